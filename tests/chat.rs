//! End-to-end tests of the everyday commands: `kiln chat` driven through a pipe (multi-turn KV
//! reuse counted in prefilled tokens, /reset, /system, /drop, a full context, Ctrl-C,
//! reasoning), `kiln run --chat`, sampling flags and stop strings, the sampler checked
//! statistically against the engine's softmax, and models named by hub id, downloaded from a
//! local fake hub.
//!
//! The fixture models ship no chat template, so each test writes a copy of the fixture with a
//! real template from `tests/data/chat_templates/` into a temp folder.

use kiln_text::chat_template::{ChatTemplate, Message, RenderOptions};
use kiln_text::generate::{GenerateOptions, generate};
use kiln_text::sampler::SamplingParams;
use kiln_text::tokenizer::Tokenizer;
use serde_json::Value;
use std::io::{BufRead, BufReader, Write};
use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Output, Stdio};
use std::sync::OnceLock;
use std::sync::mpsc::{Receiver, RecvTimeoutError, channel};
use std::time::{Duration, Instant};

use kiln_testkit::fake_hub;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(name)
}

fn template_source(name: &str) -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data/chat_templates")
        .join(format!("{name}.jinja"));
    std::fs::read_to_string(path).unwrap()
}

/// One compile cache for the whole test binary, so each fixture is compiled once.
fn cache_dir() -> &'static Path {
    static DIR: OnceLock<tempfile::TempDir> = OnceLock::new();
    DIR.get_or_init(|| tempfile::tempdir().expect("temp cache")).path()
}

/// How a test copy of a fixture gets its chat template.
enum Template<'a> {
    /// None (as the fixtures are).
    None,
    /// `chat_template` in `tokenizer_config.json`.
    InConfig(&'a str),
    /// A `chat_template.jinja` file.
    File(&'a str),
}

/// A copy of the fixture `name` with `template`.
fn model_with(name: &str, template: Template) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    for e in std::fs::read_dir(fixture(name)).unwrap() {
        let e = e.unwrap();
        if e.file_name() != "golden.json" {
            std::fs::copy(e.path(), dir.path().join(e.file_name())).unwrap();
        }
    }
    match template {
        Template::None => {}
        Template::InConfig(source) => {
            let path = dir.path().join("tokenizer_config.json");
            let mut config: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
            config["chat_template"] = Value::String(source.to_string());
            std::fs::write(&path, serde_json::to_string_pretty(&config).unwrap()).unwrap();
        }
        Template::File(source) => std::fs::write(dir.path().join("chat_template.jinja"), source).unwrap(),
    }
    dir
}

/// qwen2 with the Qwen2.5 Instruct template (ChatML).
fn qwen2_chat() -> tempfile::TempDir {
    model_with("qwen2", Template::InConfig(&template_source("qwen2_5")))
}

fn kiln(cache: &Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kiln"))
        .args(args)
        .env("KILN_CACHE_DIR", cache)
        .env_remove("KILN_PROFILE")
        .stdin(Stdio::null())
        .output()
        .expect("kiln runs")
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn json_of(o: &Output) -> Value {
    assert!(o.status.success(), "kiln failed: {}", stderr(o));
    serde_json::from_slice(&o.stdout).unwrap_or_else(|e| {
        panic!(
            "stdout is one JSON object ({e}): {}",
            String::from_utf8_lossy(&o.stdout)
        )
    })
}

/// `kiln run MODEL --json` with `extra` flags (by default greedy, 8 tokens).
fn run_json(model: &Path, prompt: &str, extra: &[&str]) -> Value {
    let mut args = vec![
        "run",
        model.to_str().unwrap(),
        "--prompt",
        prompt,
        "--json",
        "--threads",
        "2",
    ];
    for (flag, default) in [("--temperature", "0"), ("--max-tokens", "8")] {
        if !extra.contains(&flag) {
            args.extend([flag, default]);
        }
    }
    args.extend_from_slice(extra);
    json_of(&kiln(cache_dir(), &args))
}

/// Checks the error contract: non-zero exit, one `error:` line on stderr naming every needle,
/// no panic.
fn expect_error(o: &Output, needles: &[&str]) -> String {
    let err = stderr(o);
    assert!(
        !o.status.success(),
        "expected a failure; stdout: {}",
        String::from_utf8_lossy(&o.stdout)
    );
    assert!(!err.contains("panicked"), "panic: {err}");
    let lines: Vec<&str> = err.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(lines.len(), 1, "one line of error: {err}");
    assert!(lines[0].starts_with("error: "), "{err}");
    for n in needles {
        assert!(err.contains(n), "the error should mention {n:?}: {err}");
    }
    err
}

/// Runs `kiln chat MODEL --json` on `input` (piped, all at once); returns the events and stderr.
fn chat_transcript(cache: &Path, model: &Path, extra: &[&str], input: &[u8]) -> (Vec<Value>, String) {
    let mut args = vec![
        "chat",
        model.to_str().unwrap(),
        "--json",
        "--temperature",
        "0",
        "--threads",
        "2",
    ];
    args.extend_from_slice(extra);
    let mut child = Command::new(env!("CARGO_BIN_EXE_kiln"))
        .args(&args)
        .env("KILN_CACHE_DIR", cache)
        .env_remove("KILN_PROFILE")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(input).unwrap();
    let o = child.wait_with_output().unwrap();
    let err = stderr(&o);
    assert!(o.status.success(), "kiln chat failed: {err}");
    assert!(!err.contains("panicked"), "{err}");
    let events = String::from_utf8(o.stdout)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}")))
        .collect();
    (events, err)
}

fn of_kind<'a>(events: &'a [Value], kind: &str) -> Vec<&'a Value> {
    events.iter().filter(|e| e["event"] == kind).collect()
}

fn n(v: &Value, field: &str) -> usize {
    v[field].as_u64().unwrap_or_else(|| panic!("{field} missing in {v}")) as usize
}

/// The conversation as the model's template renders it, with the generation prompt.
fn render_chat(model: &Path, messages: &[Message], opts: &RenderOptions) -> String {
    let tok = Tokenizer::from_dir(model).unwrap();
    let template = ChatTemplate::from_tokenizer(&tok).unwrap().unwrap();
    template
        .render(
            messages,
            &RenderOptions {
                add_generation_prompt: true,
                ..opts.clone()
            },
        )
        .unwrap()
}

/// The ids `kiln chat` should prefill for the conversation.
fn encode_chat(model: &Path, messages: &[Message], opts: &RenderOptions) -> Vec<u32> {
    let tok = Tokenizer::from_dir(model).unwrap();
    tok.encode(&render_chat(model, messages, opts), false).unwrap()
}

#[test]
fn chat_prefills_only_the_new_tokens_of_each_turn() {
    let model = qwen2_chat();
    let input = "Hello there\nTell me more\nAnd once again, please\n/exit\n";
    let (events, _) = chat_transcript(cache_dir(), model.path(), &["--max-tokens", "12"], input.as_bytes());
    assert_eq!(events[0]["event"], "ready");
    assert_eq!(events.last().unwrap()["event"], "exit");
    let turns = of_kind(&events, "turn");
    assert_eq!(turns.len(), 3, "{events:?}");

    assert_eq!(n(turns[0], "reused_tokens"), 0);
    assert_eq!(n(turns[0], "prefilled_tokens"), n(turns[0], "prompt_tokens"));
    for t in &turns {
        assert_eq!(n(t, "reused_tokens") + n(t, "prefilled_tokens"), n(t, "prompt_tokens"));
        // Everything but the last generated token went through the engine.
        assert_eq!(n(t, "position"), n(t, "prompt_tokens") + n(t, "generated_tokens") - 1);
    }
    for pair in turns.windows(2) {
        let (prev, next) = (pair[0], pair[1]);
        // The whole previous prompt (but perhaps its last token, which a reply starting with a
        // newline merges with) comes from the KV cache: only the reply and the new message are
        // prefilled, never the conversation again.
        assert!(
            n(next, "reused_tokens") + 1 >= n(prev, "prompt_tokens"),
            "{prev}\n{next}"
        );
        assert!(
            n(next, "prefilled_tokens") < n(next, "prompt_tokens") - n(prev, "prompt_tokens") + 2,
            "{next}"
        );
    }

    // The reply of the second turn, generated over a reused KV cache, is the greedy
    // continuation of the whole conversation prefilled from scratch.
    let messages = [
        Message::user("Hello there"),
        Message::assistant(turns[0]["text"].as_str().unwrap()),
        Message::user("Tell me more"),
    ];
    let text = render_chat(model.path(), &messages, &RenderOptions::default());
    let ids = encode_chat(model.path(), &messages, &RenderOptions::default());
    assert_eq!(ids.len(), n(turns[1], "prompt_tokens"));
    let fresh = run_json(model.path(), &text, &["--max-tokens", "12"]);
    let fresh_ids: Vec<u64> = fresh["prompt_token_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap())
        .collect();
    assert_eq!(
        fresh_ids,
        ids.iter().map(|&i| i as u64).collect::<Vec<_>>(),
        "the raw prompt encodes to the same ids"
    );
    let reply: Vec<&Value> = turns[1]["token_ids"].as_array().unwrap().iter().collect();
    let fresh_reply: Vec<&Value> = fresh["token_ids"].as_array().unwrap().iter().collect();
    let k = reply.len().min(fresh_reply.len());
    assert_eq!(reply[..k], fresh_reply[..k]);
}

#[test]
fn chat_commands_reset_system_help_and_bad_input() {
    let model = qwen2_chat();
    let mut input =
        b"Hello there\n/reset\nHello there\n/system You answer in one word.\nHello there\n/help\n/nope\n\n".to_vec();
    input.extend_from_slice(b"\xff\xfe not utf-8\n//slash at the start\n/exit\nnever read\n");
    let (events, _) = chat_transcript(cache_dir(), model.path(), &["--max-tokens", "6"], &input);
    let kinds: Vec<&str> = events.iter().map(|e| e["event"].as_str().unwrap()).collect();
    assert_eq!(
        kinds,
        [
            "ready", "start", "turn", "reset", "start", "turn", "system", "start", "turn", "help", "error", "error",
            "start", "turn", "exit"
        ]
    );
    let turns = of_kind(&events, "turn");
    // After /reset nothing is reused, and the same message gives the same (greedy) reply.
    assert_eq!(n(turns[1], "reused_tokens"), 0);
    assert_eq!(turns[1]["token_ids"], turns[0]["token_ids"]);
    assert_eq!(turns[1]["prompt_tokens"], turns[0]["prompt_tokens"]);
    // A new system prompt changes the start of the rendering: the cache is reused only up to
    // the first token that differs, and the earlier exchange is still in the conversation.
    let before = encode_chat(model.path(), &[Message::user("Hello there")], &RenderOptions::default());
    let with_history = encode_chat(
        model.path(),
        &[
            Message::system("You answer in one word."),
            Message::user("Hello there"),
            Message::assistant(turns[1]["text"].as_str().unwrap()),
            Message::user("Hello there"),
        ],
        &RenderOptions::default(),
    );
    assert_eq!(n(turns[2], "prompt_tokens"), with_history.len());
    let common = before.iter().zip(&with_history).take_while(|(a, b)| a == b).count();
    assert!(common < 12, "the system prompt comes first");
    assert_eq!(n(turns[2], "reused_tokens"), common, "{}", turns[2]);
    let errors = of_kind(&events, "error");
    assert!(
        errors[0]["message"].as_str().unwrap().contains("/nope"),
        "{}",
        errors[0]
    );
    assert!(
        errors[1]["message"].as_str().unwrap().contains("UTF-8"),
        "{}",
        errors[1]
    );
    assert!(of_kind(&events, "help")[0]["text"].as_str().unwrap().contains("/reset"));
}

#[test]
fn chat_says_when_the_context_is_full_and_recovers() {
    let model = qwen2_chat();
    let second = "A second message that is long enough not to fit";
    let alone = encode_chat(model.path(), &[Message::user(second)], &RenderOptions::default()).len();
    // The second message fits alone, with room for a few tokens of reply, but not after the
    // first exchange.
    let ctx = alone + 4;
    let long = "many words ".repeat(40);
    let input = format!("Hi\n{second}\n/drop\n{long}\n/reset\nHi\n/exit\n");
    let (events, _) = chat_transcript(
        cache_dir(),
        model.path(),
        &["--ctx", &ctx.to_string(), "--max-tokens", "10"],
        input.as_bytes(),
    );
    let kinds: Vec<&str> = events.iter().map(|e| e["event"].as_str().unwrap()).collect();
    assert_eq!(
        kinds,
        [
            "ready",
            "start",
            "turn",
            "context_full",
            "dropped",
            "start",
            "turn",
            "context_full",
            "reset",
            "start",
            "turn",
            "exit"
        ],
        "{events:#?}"
    );
    let full = of_kind(&events, "context_full");
    let message = full[0]["message"].as_str().unwrap();
    assert!(message.contains("/drop") && message.contains("/reset"), "{message}");
    assert_eq!(n(full[0], "ctx"), ctx);
    assert!(n(full[0], "tokens") >= ctx);
    // The message that did not fit was resent after /drop, in a conversation without the
    // first exchange.
    let turns = of_kind(&events, "turn");
    assert_eq!(n(turns[1], "prompt_tokens"), alone);
    // A message that cannot fit even alone: say so; it is not resent after /reset.
    assert!(full[1]["message"].as_str().unwrap().contains("shorten"), "{}", full[1]);
    assert_eq!(n(turns[2], "reused_tokens"), 0);

    // A reply that runs into the end of the context stops there; the next message does not
    // fit, and /reset resends it.
    let base = encode_chat(model.path(), &[Message::user("Hi")], &RenderOptions::default()).len();
    let (events, _) = chat_transcript(
        cache_dir(),
        model.path(),
        &["--ctx", &(base + 3).to_string()],
        b"Hi\nHi\n/reset\n",
    );
    let kinds: Vec<&str> = events.iter().map(|e| e["event"].as_str().unwrap()).collect();
    assert_eq!(
        kinds,
        [
            "ready",
            "start",
            "turn",
            "context_full",
            "reset",
            "start",
            "turn",
            "exit"
        ],
        "{events:#?}"
    );
    let turns = of_kind(&events, "turn");
    if turns[0]["stop_reason"] != "eos" {
        assert_eq!(turns[0]["stop_reason"], "context_full");
        assert_eq!(n(turns[0], "position"), base + 3);
    }
    assert_eq!(n(turns[1], "reused_tokens"), 0);
}

/// A `kiln chat --json` process driven line by line.
struct Driven {
    child: Child,
    stdin: ChildStdin,
    events: Receiver<Value>,
}

impl Driven {
    fn spawn(model: &Path, extra: &[&str]) -> Driven {
        let mut command = Command::new(env!("CARGO_BIN_EXE_kiln"));
        // SAFETY: between fork and exec the child only calls the async-signal-safe `signal`:
        // SIGINT at its default disposition, as a test of Ctrl-C needs (a background job of a
        // non-interactive shell starts with it ignored).
        unsafe {
            command.pre_exec(|| {
                libc::signal(libc::SIGINT, libc::SIG_DFL);
                Ok(())
            });
        }
        let mut child = command
            .args(["chat", model.to_str().unwrap(), "--json", "--threads", "1"])
            .args(extra)
            .env("KILN_CACHE_DIR", cache_dir())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let stdin = child.stdin.take().unwrap();
        let stdout = child.stdout.take().unwrap();
        let (tx, events) = channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { return };
                if tx.send(serde_json::from_str(&line).unwrap()).is_err() {
                    return;
                }
            }
        });
        Driven { child, stdin, events }
    }

    fn send(&mut self, line: &str) {
        writeln!(self.stdin, "{line}").unwrap();
        self.stdin.flush().unwrap();
    }

    fn next(&self, kind: &str) -> Value {
        let deadline = Instant::now() + Duration::from_secs(300);
        loop {
            match self
                .events
                .recv_timeout(deadline.saturating_duration_since(Instant::now()))
            {
                Ok(e) if e["event"] == kind => return e,
                Ok(_) => {}
                Err(RecvTimeoutError::Timeout) => panic!("no {kind} event in time"),
                Err(RecvTimeoutError::Disconnected) => panic!("kiln chat ended before a {kind} event"),
            }
        }
    }

    fn interrupt(&self) {
        let ok = Command::new("kill")
            .args(["-INT", &self.child.id().to_string()])
            .status()
            .unwrap();
        assert!(ok.success());
    }
}

#[test]
fn ctrl_c_stops_the_reply_not_the_session() {
    let model = qwen2_chat();
    // Each decode step sleeps 20 ms, so a reply to the end of the 512-token context would take
    // about 10 s: long enough to be interrupted in the middle.
    let mut chat = Driven::spawn(model.path(), &["--debug-decode-delay-ms", "20", "--temperature", "0"]);
    chat.next("ready");
    for message in ["Hello there", "Tell me more"] {
        chat.send(message);
        chat.next("start");
        std::thread::sleep(Duration::from_millis(150));
        let t0 = Instant::now();
        chat.interrupt();
        let turn = chat.next("turn");
        assert_eq!(turn["stop_reason"], "cancelled", "{turn}");
        assert!(t0.elapsed() < Duration::from_secs(3), "the reply stopped promptly");
        assert!(n(&turn, "generated_tokens") < 200, "{turn}");
    }
    // The session goes on and answers the next line normally.
    chat.send("/system Be brief.");
    chat.next("system");
    chat.send("/exit");
    chat.next("exit");
    let status = chat.child.wait().unwrap();
    assert!(status.success(), "{status}");
}

#[test]
fn thinking_is_turned_off_in_the_template_unless_asked_for() {
    let model = model_with("qwen3", Template::File(&template_source("qwen3")));
    let prompt = |think: bool| {
        let (events, _) = chat_transcript(
            cache_dir(),
            model.path(),
            &["--max-tokens", "4"]
                .into_iter()
                .chain(think.then_some("--think"))
                .collect::<Vec<_>>(),
            b"Why is the sky blue?\n",
        );
        assert_eq!(events[0]["enable_thinking"], think, "{}", events[0]);
        n(of_kind(&events, "turn")[0], "prompt_tokens")
    };
    let expected = |think: bool| {
        let opts = RenderOptions {
            enable_thinking: Some(think),
            ..RenderOptions::default()
        };
        encode_chat(model.path(), &[Message::user("Why is the sky blue?")], &opts).len()
    };
    // Without --think the generation prompt holds an empty <think></think> block.
    assert_eq!(prompt(false), expected(false));
    assert_eq!(prompt(true), expected(true));
    assert!(expected(false) > expected(true));

    // A template that knows nothing of enable_thinking is not given the variable.
    let llama = model_with("llama", Template::InConfig(&template_source("llama3")));
    let (events, _) = chat_transcript(cache_dir(), llama.path(), &["--max-tokens", "4"], b"Hi\n");
    assert_eq!(events[0]["enable_thinking"], Value::Null);
    assert_eq!(of_kind(&events, "turn").len(), 1);
}

#[test]
fn run_chat_sends_the_prompt_through_the_template() {
    let model = qwen2_chat();
    let out = run_json(model.path(), "What is Kiln?", &["--chat", "--system", "You are terse."]);
    let expected = encode_chat(
        model.path(),
        &[Message::system("You are terse."), Message::user("What is Kiln?")],
        &RenderOptions::default(),
    );
    let got: Vec<u32> = out["prompt_token_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap() as u32)
        .collect();
    assert_eq!(got, expected);
    // Without --chat the prompt stays raw text.
    let raw = run_json(model.path(), "What is Kiln?", &[]);
    let tok = Tokenizer::from_dir(model.path()).unwrap();
    let raw_ids: Vec<u64> = tok
        .encode("What is Kiln?", true)
        .unwrap()
        .into_iter()
        .map(u64::from)
        .collect();
    assert_eq!(raw["prompt_token_ids"], serde_json::json!(raw_ids));
    // --system and --think only make sense with --chat.
    let o = kiln(
        cache_dir(),
        &["run", model.path().to_str().unwrap(), "--prompt", "x", "--system", "s"],
    );
    assert!(!o.status.success() && stderr(&o).contains("--chat"), "{}", stderr(&o));
}

#[test]
fn chat_templates_that_are_missing_or_fail() {
    let cache = tempfile::tempdir().unwrap();
    // No template.
    let plain = model_with("qwen2", Template::None);
    let o = kiln(
        cache.path(),
        &["run", plain.path().to_str().unwrap(), "--prompt", "hi", "--chat"],
    );
    expect_error(&o, &["no chat template", "without --chat"]);
    let o = kiln(cache.path(), &["chat", plain.path().to_str().unwrap()]);
    expect_error(&o, &["no chat template", "kiln run"]);
    // A syntax error.
    let broken = model_with("qwen2", Template::InConfig("{% for m in messages %}{{ m.content }"));
    let o = kiln(
        cache.path(),
        &["run", broken.path().to_str().unwrap(), "--prompt", "hi", "--chat"],
    );
    expect_error(&o, &["chat template syntax error"]);
    // Nothing was compiled for these: no cache entry, nothing half-written.
    let left: Vec<_> = std::fs::read_dir(cache.path())
        .map(|d| d.filter_map(|e| e.ok()).collect())
        .unwrap_or_default();
    assert!(left.iter().all(|e| !e.path().is_dir()), "{left:?}");

    // A template that rejects a conversation: an error for that message, and the session
    // goes on.
    let strict = format!(
        "{{%- if messages[0].role == 'system' and messages[0].content == 'forbidden' %}}{{{{ raise_exception('this template refuses that system prompt') }}}}{{%- endif %}}{}",
        template_source("qwen2_5")
    );
    let strict = model_with("qwen2", Template::InConfig(&strict));
    let o = kiln(
        cache_dir(),
        &[
            "run",
            strict.path().to_str().unwrap(),
            "--prompt",
            "hi",
            "--chat",
            "--system",
            "forbidden",
        ],
    );
    expect_error(&o, &["refuses that system prompt"]);
    let (events, _) = chat_transcript(
        cache_dir(),
        strict.path(),
        &["--max-tokens", "3"],
        b"/system forbidden\nHello\n/system fine\nHello\n",
    );
    let kinds: Vec<&str> = events.iter().map(|e| e["event"].as_str().unwrap()).collect();
    assert_eq!(kinds, ["ready", "system", "error", "system", "start", "turn", "exit"]);
    assert!(
        of_kind(&events, "error")[0]["message"]
            .as_str()
            .unwrap()
            .contains("refuses that system prompt")
    );
    assert_eq!(n(of_kind(&events, "turn")[0], "reused_tokens"), 0);
}

/// Index of the first char boundary at or after `i` (at most the length).
fn boundary(s: &str, mut i: usize) -> usize {
    i = i.min(s.len());
    while !s.is_char_boundary(i) {
        i += 1;
    }
    i
}

#[test]
fn stop_strings_end_the_output_and_are_not_printed() {
    let model = fixture("qwen2");
    let prompt = "The weather today";
    let full = run_json(&model, prompt, &["--max-tokens", "24"]);
    let text = full["text"].as_str().unwrap().to_string();
    assert!(text.len() >= 8, "{text:?}");
    // A stop string from the middle of the output, at its first occurrence.
    let start = boundary(&text, text.len() / 2);
    let stop = &text[start..boundary(&text, start + 3)];
    let cut = text.find(stop).unwrap();
    let stopped = run_json(
        &model,
        prompt,
        &["--max-tokens", "24", "--stop", "never appears", "--stop", stop],
    );
    assert_eq!(stopped["text"].as_str().unwrap(), &text[..cut]);
    assert_eq!(stopped["stop_reason"], "stop");
    assert_eq!(stopped["stop_string"], stop);
    // Streamed to stdout: the same text, without the stop string.
    let o = kiln(
        cache_dir(),
        &[
            "run",
            model.to_str().unwrap(),
            "--prompt",
            prompt,
            "--temperature",
            "0",
            "--max-tokens",
            "24",
            "--stop",
            stop,
            "--quiet",
        ],
    );
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(String::from_utf8_lossy(&o.stdout), format!("{}\n", &text[..cut]));
    assert_eq!(stderr(&o), "", "--quiet prints nothing on stderr");
    // A stop string longer than the whole output: everything is printed, generation ends at
    // --max-tokens.
    let longer = format!("{text} and then some");
    let o = kiln(
        cache_dir(),
        &[
            "run",
            model.to_str().unwrap(),
            "--prompt",
            prompt,
            "--temperature",
            "0",
            "--max-tokens",
            "24",
            "--stop",
            &longer,
            "-q",
        ],
    );
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(String::from_utf8_lossy(&o.stdout), format!("{text}\n"));
    let json = run_json(&model, prompt, &["--max-tokens", "24", "--stop", &longer]);
    assert_eq!(json["text"], full["text"]);
    assert_eq!(json["stop_reason"], full["stop_reason"]);
}

#[test]
fn sampling_flags_and_seeds() {
    let model = fixture("qwen2");
    let sampled = |seed: &str, extra: &[&str]| {
        let mut args = vec![
            "--temperature",
            "1",
            "--top-k",
            "0",
            "--top-p",
            "1",
            "--min-p",
            "0",
            "--max-tokens",
            "16",
            "--seed",
            seed,
        ];
        args.extend_from_slice(extra);
        run_json(&model, "Once upon a time", &args)
    };
    let a = sampled("7", &[]);
    let b = sampled("7", &[]);
    assert_eq!(a["token_ids"], b["token_ids"], "same seed, same output");
    assert_eq!(a["seed"], 7);
    let others: Vec<Value> = ["1", "2", "3"]
        .iter()
        .map(|s| sampled(s, &[])["token_ids"].clone())
        .collect();
    assert!(
        others.iter().any(|o| *o != a["token_ids"]),
        "different seeds should differ"
    );
    // Penalties are accepted (negative ones too).
    sampled(
        "7",
        &[
            "--repetition-penalty",
            "1.3",
            "--frequency-penalty",
            "0.5",
            "--presence-penalty",
            "-0.5",
        ],
    );
    // Out-of-range values are refused with the parameter's name.
    let o = kiln(
        cache_dir(),
        &["run", model.to_str().unwrap(), "--prompt", "x", "--top-p", "0"],
    );
    expect_error(&o, &["top_p"]);
    let o = kiln(
        cache_dir(),
        &[
            "run",
            model.to_str().unwrap(),
            "--prompt",
            "x",
            "--repetition-penalty",
            "0",
        ],
    );
    expect_error(&o, &["repetition_penalty"]);
    let o = kiln(cache_dir(), &["chat", model.to_str().unwrap(), "--min-p", "2"]);
    expect_error(&o, &["min_p"]);
}

/// The upper `1 - 1e-6` quantile of the chi-square distribution with `df` degrees of freedom
/// (Wilson-Hilferty; within a few percent for df >= 3).
fn chi_square_critical(df: usize) -> f64 {
    let z = 4.753; // upper 1e-6 quantile of the standard normal
    let k = df as f64;
    let a = 2.0 / (9.0 * k);
    k * (1.0 - a + z * a.sqrt()).powi(3)
}

/// Pearson's statistic of `counts` against `probs`, over bins with an expected count of at
/// least 5 (the rest pooled into one bin); returns (statistic, degrees of freedom).
fn chi_square(counts: &[u64], probs: &[f64], total: u64) -> (f64, usize) {
    let (mut stat, mut bins) = (0.0, 0);
    let (mut pooled_obs, mut pooled_exp) = (0.0, 0.0);
    for (&c, &p) in counts.iter().zip(probs) {
        let e = p * total as f64;
        if e >= 5.0 {
            stat += (c as f64 - e).powi(2) / e;
            bins += 1;
        } else {
            pooled_obs += c as f64;
            pooled_exp += e;
        }
    }
    if pooled_exp > 0.0 {
        let e = pooled_exp.max(1e-9);
        stat += (pooled_obs - e).powi(2) / e;
        bins += 1;
    }
    (stat, bins - 1)
}

#[test]
fn sampled_first_tokens_follow_the_models_distribution() {
    let opts = kiln::session::OpenOptions {
        threads: Some(2),
        cache_dir: Some(cache_dir().to_path_buf()),
        ..Default::default()
    };
    let mut session = kiln::session::Session::open(&fixture("qwen2"), &opts).unwrap();
    let tokenizer = session.tokenizer.clone();
    let prompt = tokenizer.encode("Once upon a time", true).unwrap();
    let logits = session.engine.prefill(&prompt).unwrap().to_vec();
    let vocab = logits.len();

    // Plain sampling (temperature 1, no filter): softmax of the logits. Then a filtered one,
    // temperature 0.7 and top-k 5: the softmax of the five largest logits divided by 0.7.
    let plain = SamplingParams {
        temperature: 1.0,
        top_k: 0,
        top_p: 1.0,
        min_p: 0.0,
        ..SamplingParams::greedy()
    };
    let filtered = SamplingParams {
        temperature: 0.7,
        top_k: 5,
        ..plain
    };
    let softmax_over = |ids: &[usize], t: f64| {
        let max = ids.iter().map(|&i| logits[i] as f64).fold(f64::NEG_INFINITY, f64::max);
        let w: Vec<f64> = ids.iter().map(|&i| ((logits[i] as f64 - max) / t).exp()).collect();
        let sum: f64 = w.iter().sum();
        let mut p = vec![0.0f64; vocab];
        for (k, &i) in ids.iter().enumerate() {
            p[i] = w[k] / sum;
        }
        p
    };
    let expected_plain = softmax_over(&(0..vocab).collect::<Vec<_>>(), 1.0);
    let mut order: Vec<usize> = (0..vocab).collect();
    order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]));
    let expected_filtered = softmax_over(&order[..5], 0.7);

    let draws = 20_000u64;
    for (params, expected) in [(plain, &expected_plain), (filtered, &expected_filtered)] {
        let t0 = Instant::now();
        let mut counts = vec![0u64; vocab];
        for seed in 0..draws {
            session.engine.reset();
            let options = GenerateOptions {
                max_tokens: 1,
                sampling: SamplingParams {
                    seed: Some(seed),
                    ..params
                },
                ..GenerateOptions::default()
            };
            let g = generate(&mut session.engine, &tokenizer, &prompt, &options, &mut |_| {}).unwrap();
            counts[g.token_ids[0] as usize] += 1;
        }
        let (stat, df) = chi_square(&counts, expected, draws);
        let critical = chi_square_critical(df);
        eprintln!(
            "{params:?}: chi-square {stat:.1} with {df} degrees of freedom (critical {critical:.1}), {:?}",
            t0.elapsed()
        );
        assert!(df >= 3, "the distribution should not be degenerate");
        assert!(
            stat < critical,
            "chi-square {stat} >= {critical} ({df} df): sampling does not follow the model's distribution"
        );
        // Tokens the filters removed are never drawn.
        for (i, &c) in counts.iter().enumerate() {
            assert!(
                expected[i] > 0.0 || c == 0,
                "token {i} drawn {c} times but filtered out"
            );
        }
    }

    // The CLI draws the same first token for the same seed as this in-process path.
    let in_process: Vec<(u64, u32)> = [3u64, 11]
        .into_iter()
        .map(|seed| {
            session.engine.reset();
            let options = GenerateOptions {
                max_tokens: 1,
                sampling: SamplingParams {
                    seed: Some(seed),
                    ..plain
                },
                ..GenerateOptions::default()
            };
            (
                seed,
                generate(&mut session.engine, &tokenizer, &prompt, &options, &mut |_| {})
                    .unwrap()
                    .token_ids[0],
            )
        })
        .collect();
    // The engine pins this thread while it lives, and a child process would inherit that.
    drop(session);
    for (seed, token) in in_process {
        let s = seed.to_string();
        let cli = run_json(
            &fixture("qwen2"),
            "Once upon a time",
            &[
                "--temperature",
                "1",
                "--top-k",
                "0",
                "--top-p",
                "1",
                "--min-p",
                "0",
                "--max-tokens",
                "1",
                "--seed",
                &s,
            ],
        );
        assert_eq!(cli["token_ids"][0].as_u64().unwrap(), token as u64, "seed {seed}");
    }
}

const COMMIT: &str = "0123456789abcdef0123456789abcdef01234567";

/// A fake hub serving the qwen2 fixture (with a chat template) as `kiln-test/<name>`,
/// `model.safetensors` through LFS as on the real hub.
fn hub_with_qwen2(names: &[&str]) -> (fake_hub::FakeHub, Vec<fake_hub::FakeFile>) {
    let hub = fake_hub::FakeHub::start();
    let mut files = Vec::new();
    for f in [
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "model.safetensors",
    ] {
        let data = std::fs::read(fixture("qwen2").join(f)).unwrap();
        files.push(fake_hub::FakeFile::new(f, data, f.ends_with(".safetensors")));
    }
    files.push(fake_hub::FakeFile::new("README.md", "# tiny", false));
    files.push(fake_hub::FakeFile::new("pytorch_model.bin", "not downloaded", true));
    for name in names {
        hub.add_repo(
            &format!("kiln-test/{name}"),
            fake_hub::FakeRepo::default().commit(&["main", "v1"], COMMIT, files.clone()),
        );
    }
    (hub, files)
}

/// `kiln run` against the fake hub, with the Hugging Face cache in `hf_home`.
fn kiln_hub(hub: &fake_hub::FakeHub, hf_home: &Path, cache: &Path, args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_kiln"));
    cmd.args(args)
        .env("KILN_CACHE_DIR", cache)
        .env("HF_ENDPOINT", &hub.url)
        .env("HF_HOME", hf_home)
        .stdin(Stdio::null());
    for var in [
        "HF_TOKEN",
        "HUGGING_FACE_HUB_TOKEN",
        "HF_HUB_OFFLINE",
        "TRANSFORMERS_OFFLINE",
        "HF_HUB_CACHE",
        "HUGGINGFACE_HUB_CACHE",
        "KILN_PROFILE",
    ] {
        cmd.env_remove(var);
    }
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.output().unwrap()
}

fn run_args(model: &str) -> Vec<&str> {
    vec![
        "run",
        model,
        "--prompt",
        "Hello there",
        "--temperature",
        "0",
        "--max-tokens",
        "8",
        "--json",
        "--threads",
        "2",
    ]
}

#[test]
fn run_a_model_by_hub_id_from_a_local_fake_hub() {
    let (hub, _) = hub_with_qwen2(&["qwen2-tiny"]);
    let hf = tempfile::tempdir().unwrap();
    let reference = run_json(&fixture("qwen2"), "Hello there", &[]);

    let o = kiln_hub(&hub, hf.path(), cache_dir(), &run_args("kiln-test/qwen2-tiny"), &[]);
    let first = json_of(&o);
    assert_eq!(first["token_ids"], reference["token_ids"]);
    let snapshot = hf
        .path()
        .join("hub/models--kiln-test--qwen2-tiny/snapshots")
        .join(COMMIT);
    assert_eq!(first["model_dir"], snapshot.display().to_string());
    assert!(snapshot.join("model.safetensors").is_file());
    assert!(!snapshot.join("pytorch_model.bin").exists() && !snapshot.join("README.md").exists());
    assert_eq!(
        std::fs::read_to_string(hf.path().join("hub/models--kiln-test--qwen2-tiny/refs/main")).unwrap(),
        COMMIT
    );

    // Cached: works offline, without a single request.
    let before = hub.request_count();
    let o = kiln_hub(
        &hub,
        hf.path(),
        cache_dir(),
        &run_args("kiln-test/qwen2-tiny"),
        &[("HF_HUB_OFFLINE", "1")],
    );
    assert_eq!(json_of(&o)["token_ids"], reference["token_ids"]);
    assert_eq!(hub.request_count(), before);

    // A revision, and kiln chat by hub id.
    let o = kiln_hub(&hub, hf.path(), cache_dir(), &run_args("kiln-test/qwen2-tiny@v1"), &[]);
    assert_eq!(json_of(&o)["token_ids"], reference["token_ids"]);
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_kiln"));
    let o = cmd
        .args([
            "chat",
            "kiln-test/qwen2-tiny",
            "--json",
            "--max-tokens",
            "2",
            "--threads",
            "2",
        ])
        .env("KILN_CACHE_DIR", cache_dir())
        .env("HF_HOME", hf.path())
        .env("HF_HUB_OFFLINE", "1")
        .env_remove("HF_HUB_CACHE")
        .stdin(Stdio::null())
        .output()
        .unwrap();
    // The fixture has no chat template: the hub path worked and the chat said so clearly.
    expect_error(&o, &["no chat template"]);
}

#[test]
fn hub_errors_are_clear_and_leave_no_half_written_files() {
    let (hub, files) = hub_with_qwen2(&["qwen2-tiny", "qwen2-cut"]);
    hub.add_repo(
        "kiln-test/gated",
        fake_hub::FakeRepo::default()
            .commit(&["main"], COMMIT, files.clone())
            .gated("hf_secret"),
    );
    let hf = tempfile::tempdir().unwrap();
    let cache = tempfile::tempdir().unwrap();
    let no_entries = |cache: &Path| {
        let left: Vec<_> = std::fs::read_dir(cache)
            .map(|d| d.filter_map(|e| e.ok()).map(|e| e.file_name()).collect())
            .unwrap_or_default();
        assert!(
            left.iter().all(|n| n.to_string_lossy().ends_with(".lock")),
            "kiln cache: {left:?}"
        );
    };

    // Unknown id.
    let o = kiln_hub(&hub, hf.path(), cache.path(), &run_args("kiln-test/nope"), &[]);
    expect_error(&o, &["kiln-test/nope", "not found", "Hugging Face"]);
    assert!(!hf.path().join("hub/models--kiln-test--nope/snapshots").exists());
    // Offline and not cached.
    let o = kiln_hub(
        &hub,
        hf.path(),
        cache.path(),
        &run_args("kiln-test/qwen2-tiny"),
        &[("HF_HUB_OFFLINE", "1")],
    );
    expect_error(
        &o,
        &[
            "kiln-test/qwen2-tiny",
            "HF_HUB_OFFLINE",
            "not in the Hugging Face cache",
        ],
    );
    // Gated: refused without HF_TOKEN, downloaded with it.
    let o = kiln_hub(&hub, hf.path(), cache.path(), &run_args("kiln-test/gated"), &[]);
    expect_error(&o, &["HF_TOKEN"]);
    let o = kiln_hub(
        &hub,
        hf.path(),
        cache_dir(),
        &run_args("kiln-test/gated"),
        &[("HF_TOKEN", "hf_secret")],
    );
    json_of(&o);
    assert!(
        hub.requests()
            .iter()
            .any(|r| r.header("authorization") == Some("Bearer hf_secret"))
    );
    no_entries(cache.path());

    // A download cut in the middle, more often than it is retried: a clear error, no
    // snapshot entry for the weights, no ref, no compile. The next run resumes it.
    let weights = files.iter().find(|f| f.name == "model.safetensors").unwrap();
    hub.cut(&weights.etag(), 5000, 5);
    let o = kiln_hub(&hub, hf.path(), cache.path(), &run_args("kiln-test/qwen2-cut"), &[]);
    expect_error(&o, &["kiln-test/qwen2-cut"]);
    let repo = hf.path().join("hub/models--kiln-test--qwen2-cut");
    assert!(!repo.join("snapshots").join(COMMIT).join("model.safetensors").exists());
    assert!(!repo.join("refs/main").exists());
    let partial = repo.join("blobs").join(format!("{}.incomplete", weights.etag()));
    assert!(partial.is_file(), "the partial download is kept to resume");
    no_entries(cache.path());
    let o = kiln_hub(&hub, hf.path(), cache.path(), &run_args("kiln-test/qwen2-cut"), &[]);
    json_of(&o);
    assert!(!partial.exists());
    assert!(
        hub.requests().iter().any(|r| r
            .header("range")
            .is_some_and(|v| v.starts_with("bytes=") && v != "bytes=0-")),
        "resumed with Range"
    );
}

/// `kiln chat --json` reports in its `ready` event the sampling it will use and where each value
/// came from, as `kiln run --json` does: a flag, the model's generation_config.json, or
/// llama.cpp's default.
#[test]
fn the_ready_event_reports_the_sampling_and_where_each_value_came_from() {
    let model = qwen2_chat();
    std::fs::write(
        model.path().join("generation_config.json"),
        r#"{"bos_token_id": 1000, "eos_token_id": 1000, "do_sample": true, "top_p": 0.8}"#,
    )
    .unwrap();
    let extra = ["--top-k", "5", "--seed", "7"];
    let (events, _) = chat_transcript(cache_dir(), model.path(), &extra, b"/exit\n");
    assert_eq!(events[0]["event"], "ready");
    let s = &events[0]["sampling"];
    let float = |key: &str| s[key].as_f64().unwrap_or_else(|| panic!("{key}: {s}"));
    // chat_transcript passes --temperature 0.
    assert_eq!(float("temperature"), 0.0, "{s}");
    assert_eq!(s["from"]["temperature"], "flag", "{s}");
    assert_eq!(s["top_k"], 5, "{s}");
    assert_eq!(s["from"]["top_k"], "flag", "{s}");
    assert!((float("top_p") - 0.8).abs() < 1e-6, "{s}");
    assert_eq!(s["from"]["top_p"], "generation_config.json", "{s}");
    assert!((float("min_p") - 0.05).abs() < 1e-6, "{s}");
    assert_eq!(s["from"]["min_p"], "default", "{s}");
    assert_eq!(s["greedy"], true, "{s}");
    assert_eq!(s["seed"], 7, "{s}");
    assert_eq!(events[0]["seed"], 7);
}
