//! End-to-end tests of `kiln serve`: the real binary on the qwen2 fixture (with the Qwen2.5
//! chat template), driven over HTTP on a loopback port. The HTTP layer's own cases (every
//! error status and body, SSE framing, the loading state) are tested against a scripted backend
//! in `server/tests/http.rs`; these prove what needs the engine: batching, prefix reuse,
//! cancellation, draining, and the official `openai` client.

use reqwest::blocking::{Client, Response};
use serde_json::{Value, json};
use std::io::{BufRead as _, BufReader, Read as _};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(name)
}

/// One compile cache for the whole test binary, so the fixture is compiled once.
fn cache_dir() -> &'static Path {
    static DIR: OnceLock<tempfile::TempDir> = OnceLock::new();
    DIR.get_or_init(|| tempfile::tempdir().expect("temp cache")).path()
}

/// The qwen2 fixture with the Qwen2.5 chat template, shared by the tests.
fn chat_model() -> &'static Path {
    static DIR: OnceLock<tempfile::TempDir> = OnceLock::new();
    DIR.get_or_init(|| {
        let template = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/chat_templates/qwen2_5.jinja");
        let template = std::fs::read_to_string(template).unwrap();
        kiln_testkit::fixtures::with_chat_template(&fixture("qwen2"), &template)
    })
    .path()
}

/// A running `kiln serve` on an ephemeral port; killed when dropped.
struct Server {
    child: Child,
    base: String,
    log: Arc<Mutex<String>>,
}

impl Server {
    fn start(extra: &[&str]) -> Server {
        Server::start_model(chat_model(), extra)
    }

    fn start_model(model: &Path, extra: &[&str]) -> Server {
        let mut child = Command::new(env!("CARGO_BIN_EXE_kiln"))
            .arg("serve")
            .arg(model)
            .args(["--port", "0", "--threads", "2", "--alias", "tiny"])
            .args(extra)
            .env("KILN_CACHE_DIR", cache_dir())
            .env_remove("KILN_PROFILE")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("kiln serve starts");
        let log = Arc::new(Mutex::new(String::new()));
        let (addr_tx, addr_rx) = mpsc::channel();
        let stderr = child.stderr.take().unwrap();
        let sink = log.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                if let Some(addr) = line.strip_prefix("listening on ") {
                    let _ = addr_tx.send(addr.to_string());
                }
                sink.lock().unwrap().push_str(&format!("{line}\n"));
            }
        });
        let base = addr_rx
            .recv_timeout(Duration::from_secs(60))
            .unwrap_or_else(|_| panic!("the server printed no address: {}", log.lock().unwrap()));
        let server = Server { child, base, log };
        server.wait_ready();
        server
    }

    /// Waits until `/health` says the model is loaded (it is 503 while compiling).
    fn wait_ready(&self) {
        let t = Instant::now();
        loop {
            if let Ok(r) = client().get(self.url("/health")).send()
                && r.status() == 200
            {
                return;
            }
            assert!(t.elapsed() < Duration::from_secs(300), "not ready: {}", self.log());
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    fn log(&self) -> String {
        self.log.lock().unwrap().clone()
    }

    fn post(&self, path: &str, body: &Value) -> Response {
        client().post(self.url(path)).json(body).send().expect("request sent")
    }

    /// A completion's JSON body, checked to be a 200.
    fn complete(&self, body: &Value) -> Value {
        let r = self.post("/v1/completions", body);
        assert_eq!(r.status(), 200, "{}", self.log());
        r.json().unwrap()
    }

    /// A metric's current value.
    fn metric(&self, name: &str) -> f64 {
        let text = client().get(self.url("/metrics")).send().unwrap().text().unwrap();
        text.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
            .unwrap_or_else(|| panic!("no {name} in {text}"))
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn client() -> Client {
    Client::builder().timeout(Duration::from_secs(120)).build().unwrap()
}

fn text_of(v: &Value) -> String {
    v["choices"][0]["text"].as_str().expect("a text choice").to_string()
}

/// Server-sent events of a streamed response, as JSON values, up to `[DONE]` (which must come).
fn events(r: Response) -> Vec<Value> {
    let mut out = Vec::new();
    for line in BufReader::new(r).lines() {
        let line = line.unwrap();
        let Some(data) = line.strip_prefix("data: ") else {
            continue;
        };
        if data == "[DONE]" {
            return out;
        }
        out.push(serde_json::from_str(data).unwrap());
    }
    panic!("the stream ended without [DONE]: {out:?}");
}

// A chat completion has OpenAI's shape, and its stream carries the same text, then the finish
// reason, the usage and [DONE].
#[test]
fn chat_completion_plain_and_streamed_agree() {
    let s = Server::start(&[]);
    let body = json!({
        "model": "tiny",
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}],
        "max_tokens": 12,
        "temperature": 0,
    });
    let r = s.post("/v1/chat/completions", &body);
    assert_eq!(r.status(), 200);
    let v: Value = r.json().unwrap();
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(v["model"], "tiny");
    assert_eq!(v["choices"][0]["message"]["role"], "assistant");
    let content = v["choices"][0]["message"]["content"].as_str().unwrap().to_string();
    let usage = &v["usage"];
    let (prompt, completion) = (
        usage["prompt_tokens"].as_u64().unwrap(),
        usage["completion_tokens"].as_u64().unwrap(),
    );
    assert!(prompt > 10, "the template's tokens are counted: {usage}");
    assert!((1..=12).contains(&completion), "{usage}");
    assert_eq!(usage["total_tokens"].as_u64().unwrap(), prompt + completion);
    let finish = v["choices"][0]["finish_reason"].as_str().unwrap();
    assert_eq!(finish == "length", completion == 12, "{v}");

    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    streamed["stream_options"] = json!({"include_usage": true});
    let ev = events(s.post("/v1/chat/completions", &streamed));
    assert_eq!(ev[0]["choices"][0]["delta"]["role"], "assistant");
    let text: String = ev
        .iter()
        .filter_map(|e| e["choices"].get(0)?["delta"]["content"].as_str())
        .collect();
    assert_eq!(
        text, content,
        "streamed and plain answers of a greedy request are the same"
    );
    let finish_chunk = ev.iter().rev().find(|e| e["choices"].get(0).is_some()).unwrap();
    assert_eq!(finish_chunk["choices"][0]["finish_reason"], finish);
    let last = ev.last().unwrap();
    assert_eq!(last["choices"], json!([]));
    assert_eq!(last["usage"]["completion_tokens"].as_u64(), Some(completion));
}

// Continuous batching does not change answers: eight greedy requests give the same text
// whether each runs alone or all eight decode together (and they did run together).
#[test]
fn greedy_answers_are_the_same_alone_and_alongside_seven_others() {
    let s = Server::start(&["--parallel", "8", "--debug-decode-delay-ms", "3"]);
    let prompts: Vec<String> = (0..8)
        .map(|i| {
            format!(
                "Request number {i} asks about {}",
                ["cats", "rust", "tea", "the sea"][i % 4]
            )
        })
        .collect();
    let body = |p: &str| json!({"prompt": p, "max_tokens": 20 + 3 * p.len() % 7, "temperature": 0});
    let alone: Vec<String> = prompts.iter().map(|p| text_of(&s.complete(&body(p)))).collect();
    let most_active = Arc::new(Mutex::new(0f64));
    let together: Vec<String> = std::thread::scope(|scope| {
        let watcher = {
            let most = most_active.clone();
            let s = &s;
            scope.spawn(move || {
                for _ in 0..200 {
                    let a = s.metric("kiln_active_sequences");
                    let mut m = most.lock().unwrap();
                    *m = m.max(a);
                    if *m >= 8.0 {
                        break;
                    }
                    drop(m);
                    std::thread::sleep(Duration::from_millis(5));
                }
            })
        };
        let handles: Vec<_> = prompts
            .iter()
            .map(|p| {
                let s = &s;
                let b = body(p);
                scope.spawn(move || text_of(&s.complete(&b)))
            })
            .collect();
        let out = handles.into_iter().map(|h| h.join().unwrap()).collect();
        watcher.join().unwrap();
        out
    });
    assert!(
        *most_active.lock().unwrap() >= 2.0,
        "requests decoded together (most active at once: {})",
        most_active.lock().unwrap()
    );
    for (i, (a, t)) in alone.iter().zip(&together).enumerate() {
        assert_eq!(a, t, "request {i}: batched answer differs from the answer alone");
    }
}

// Sampling with a seed is reproducible per request, also while other requests run.
#[test]
fn seeded_sampling_is_reproducible_per_request() {
    let s = Server::start(&["--parallel", "3"]);
    let body = json!({"prompt": "Once upon a time", "max_tokens": 16, "temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0, "seed": 1234});
    let first = text_of(&s.complete(&body));
    let other = json!({"prompt": "Another story", "max_tokens": 16, "temperature": 1.0, "seed": 99});
    let again = std::thread::scope(|scope| {
        let h = scope.spawn(|| s.complete(&other));
        let again = text_of(&s.complete(&body));
        h.join().unwrap();
        again
    });
    assert_eq!(first, again, "the same seed gives the same text");
    let mut reseeded = body.clone();
    reseeded["seed"] = json!(4321);
    let texts: Vec<String> = (0..3).map(|_| text_of(&s.complete(&reseeded))).collect();
    assert!(texts.iter().all(|t| *t == texts[0]));
}

// A request that continues an earlier one reuses the slot's KV cache for the shared prefix
// (reported as cached tokens), and its answer is the one it gets without reuse.
#[test]
fn a_shared_prefix_is_reused_and_gives_the_same_answer() {
    let s = Server::start(&["--parallel", "1"]);
    let first = s.complete(&json!({"prompt": "The history of tea begins", "max_tokens": 10, "temperature": 0}));
    assert_eq!(first["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    let follow = format!("The history of tea begins{} and then", text_of(&first));
    let req = json!({"prompt": follow, "max_tokens": 10, "temperature": 0});
    let reused = s.complete(&req);
    let cached = reused["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    assert!(
        cached >= 5,
        "the earlier prompt's tokens were reused: {}",
        reused["usage"]
    );
    // Push the cache out with an unrelated prompt, then ask again without reuse.
    s.complete(&json!({"prompt": "Zebras", "max_tokens": 3, "temperature": 0}));
    let fresh = s.complete(&req);
    assert_eq!(fresh["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    assert_eq!(text_of(&reused), text_of(&fresh), "reuse does not change the answer");
}

// A recurrent model's state cannot be cut back to a shared prefix, so a chat request saves it
// where its conversation ends (before the assistant header, Qwen3's real template): the next
// turn resumes from there, reports those tokens as cached, and answers as a fresh server does.
#[test]
fn a_recurrent_model_resumes_the_next_chat_turn_from_its_checkpoint() {
    let template = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/chat_templates/qwen3.jinja");
    let template = std::fs::read_to_string(template).unwrap();
    let dir = kiln_testkit::fixtures::with_chat_template(&fixture("qwen3_5"), &template);
    let s = Server::start_model(dir.path(), &["--parallel", "1"]);
    let mut messages = vec![
        json!({"role": "system", "content": "Be brief."}),
        json!({"role": "user", "content": "Hello there"}),
    ];
    let ask = |messages: &[Value]| -> Value {
        let body = json!({"messages": messages, "max_tokens": 8, "temperature": 0,
                          "chat_template_kwargs": {"enable_thinking": false}});
        s.post("/v1/chat/completions", &body).json().unwrap()
    };
    let first = ask(&messages);
    let first_prompt = first["usage"]["prompt_tokens"].as_u64().unwrap();
    let reply = first["choices"][0]["message"]["content"].as_str().unwrap().to_string();
    messages.push(json!({"role": "assistant", "content": reply}));
    messages.push(json!({"role": "user", "content": "And then?"}));
    let second = ask(&messages);
    let cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    // Without the checkpoint nothing could be reused; the saved state ends before the first
    // request's assistant header (24 of its 42 tokens with this fixture's tokenizer).
    assert!(
        cached > 0 && cached < first_prompt,
        "the first conversation up to its reply is reused: {} (first prompt {first_prompt})",
        second["usage"]
    );
    let fresh = Server::start_model(dir.path(), &["--parallel", "1"]);
    let body = json!({"messages": messages, "max_tokens": 8, "temperature": 0,
                      "chat_template_kwargs": {"enable_thinking": false}});
    let alone: Value = fresh.post("/v1/chat/completions", &body).json().unwrap();
    assert_eq!(alone["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    assert_eq!(
        second["choices"][0]["message"], alone["choices"][0]["message"],
        "resuming from the checkpoint does not change the answer"
    );
}

// A client that hangs up mid-stream frees its slot at once; the server keeps serving.
#[test]
fn a_client_hang_up_cancels_its_request_and_frees_the_slot() {
    let s = Server::start(&["--parallel", "1", "--debug-decode-delay-ms", "20"]);
    let mut r = s.post(
        "/v1/completions",
        &json!({"prompt": "Tell a long story", "max_tokens": 400, "temperature": 0, "stream": true}),
    );
    assert_eq!(r.status(), 200);
    let mut first = [0u8; 64];
    r.read_exact(&mut first).unwrap();
    assert_eq!(s.metric("kiln_active_sequences"), 1.0);
    drop(r);
    let t = Instant::now();
    while s.metric("kiln_active_sequences") != 0.0 {
        assert!(
            t.elapsed() < Duration::from_secs(5),
            "the slot was not freed: {}",
            s.log()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    // The only slot serves the next request (400 tokens at 20 ms would take 8 s).
    let v = s.complete(&json!({"prompt": "Hi", "max_tokens": 2, "temperature": 0}));
    assert_eq!(v["usage"]["completion_tokens"], 2);
    assert!(t.elapsed() < Duration::from_secs(5));
}

// Requests the engine cannot take get OpenAI-style errors: a prompt longer than the context
// (never truncated), an unknown model, a wrong API key, malformed JSON.
#[test]
fn requests_the_engine_cannot_take_are_clear_errors() {
    let s = Server::start(&["--ctx", "32", "--api-key", "sekrit"]);
    let with_key = |path: &str, body: &Value| {
        client()
            .post(s.url(path))
            .bearer_auth("sekrit")
            .json(body)
            .send()
            .unwrap()
    };
    let long = "word ".repeat(100);
    let r = with_key("/v1/completions", &json!({"prompt": long, "max_tokens": 4}));
    assert_eq!(r.status(), 400);
    let e: Value = r.json().unwrap();
    assert_eq!(e["error"]["code"], "context_length_exceeded", "{e}");
    assert!(e["error"]["message"].as_str().unwrap().contains("32"), "{e}");
    let r = with_key("/v1/completions", &json!({"model": "other", "prompt": "x"}));
    assert_eq!(r.status(), 404);
    let r = s.post("/v1/completions", &json!({"prompt": "x"}));
    assert_eq!(r.status(), 401, "no key");
    let r = client()
        .post(s.url("/v1/completions"))
        .bearer_auth("sekrit")
        .header("content-type", "application/json")
        .body("{\"prompt\": ")
        .send()
        .unwrap();
    assert_eq!(r.status(), 400);
    let e: Value = r.json().unwrap();
    assert_eq!(e["error"]["type"], "invalid_request_error", "{e}");
    let r = with_key("/v1/completions", &json!({"prompt": "x", "max_tokens": -1}));
    assert_eq!(r.status(), 400);
    // The server still answers a good request.
    let r = with_key("/v1/completions", &json!({"prompt": "Hi", "max_tokens": 2}));
    assert_eq!(r.status(), 200);
}

// SIGTERM drains: the request in flight completes, then the process exits with status 0.
#[test]
fn sigterm_finishes_the_requests_in_flight_and_exits_zero() {
    let mut s = Server::start(&["--debug-decode-delay-ms", "20"]);
    let base = s.base.clone();
    let stream = std::thread::spawn(move || {
        let r = client()
            .post(format!("{base}/v1/completions"))
            .json(&json!({"prompt": "Count", "max_tokens": 40, "temperature": 0, "stream": true}))
            .send()
            .unwrap();
        events(r)
    });
    let t = Instant::now();
    while s.metric("kiln_active_sequences") == 0.0 {
        assert!(t.elapsed() < Duration::from_secs(10));
        std::thread::sleep(Duration::from_millis(10));
    }
    // SAFETY: sending a signal to our own child process.
    unsafe { libc::kill(s.child.id() as i32, libc::SIGTERM) };
    let ev = stream.join().expect("the stream completed with [DONE]");
    let finish = ev
        .iter()
        .rev()
        .find_map(|e| e["choices"].get(0)?["finish_reason"].as_str());
    assert_eq!(finish, Some("length"), "all 40 tokens were generated");
    let t = Instant::now();
    let status = loop {
        if let Some(st) = s.child.try_wait().unwrap() {
            break st;
        }
        assert!(t.elapsed() < Duration::from_secs(10), "still running: {}", s.log());
        std::thread::sleep(Duration::from_millis(20));
    };
    assert_eq!(status.code(), Some(0), "{}", s.log());
}

// The official `openai` Python client talks to the server: plain and streamed chat, and a
// text completion (scripts/openai_check.py; installs `openai` from PyPI when it is missing).
#[test]
fn the_official_openai_python_client_works() {
    if Command::new("python3").arg("--version").output().is_err() {
        eprintln!("the_official_openai_python_client_works: not run, python3 is not installed");
        return;
    }
    let s = Server::start(&[]);
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("scripts/openai_check.py");
    let out = Command::new("python3")
        .arg(script)
        .args(["--base-url", &format!("{}/v1", s.base), "--model", "tiny", "--install"])
        .output()
        .unwrap();
    let (o, e) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(
        out.status.success(),
        "openai_check.py failed:\n{o}\n{e}\nserver:\n{}",
        s.log()
    );
    assert!(o.contains("openai client: ok"), "{o}");
}

// A thinking model's reasoning stays out of `content`: with a template that opens a `<think>`
// block for the reply (as DeepSeek-R1's and Qwen3's do), what the model writes before
// `</think>` comes back as `reasoning_content`, plain and streamed; asked not to think, the
// reply is `content`.
#[test]
fn reasoning_is_returned_apart_from_the_answer() {
    // Thinks unless `enable_thinking` is false, as Qwen3's template.
    let template = "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endfor %}\
                    {%- if add_generation_prompt %}<|im_start|>assistant\n\
                    {%- if enable_thinking is not defined or enable_thinking %}<think>\n{%- endif %}{%- endif %}";
    let dir = kiln_testkit::fixtures::with_chat_template(&fixture("qwen2"), template);
    let s = Server::start_model(dir.path(), &[]);
    let body = json!({"messages": [{"role": "user", "content": "Why?"}], "max_tokens": 16, "temperature": 0});
    let v: Value = s.post("/v1/chat/completions", &body).json().unwrap();
    let message = &v["choices"][0]["message"];
    let reasoning = message["reasoning_content"].as_str().unwrap_or_default().to_string();
    assert!(!reasoning.is_empty(), "the reply is reasoning: {v}");
    assert_eq!(message["content"].as_str().unwrap_or_default(), "", "{v}");
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let ev = events(s.post("/v1/chat/completions", &streamed));
    let text: String = ev
        .iter()
        .filter_map(|e| e["choices"].get(0)?["delta"]["reasoning_content"].as_str())
        .collect();
    assert_eq!(text, reasoning, "the stream carries the same reasoning");
    // `chat_template_kwargs.enable_thinking: false` (vLLM's and llama-server's extension) asks
    // the template not to open the block: the reply is the answer.
    let mut plain = body.clone();
    plain["chat_template_kwargs"] = json!({"enable_thinking": false});
    let v: Value = s.post("/v1/chat/completions", &plain).json().unwrap();
    let message = &v["choices"][0]["message"];
    assert!(
        message["reasoning_content"].as_str().unwrap_or_default().is_empty(),
        "{v}"
    );
    assert!(!message["content"].as_str().unwrap_or_default().is_empty(), "{v}");
    let mut wrong = body.clone();
    wrong["chat_template_kwargs"] = json!({"enable_thinking": "no"});
    assert_eq!(s.post("/v1/chat/completions", &wrong).status(), 400);
}

// Requests beyond the free slots wait in the queue; beyond `--max-queue` they get 503 with
// Retry-After (and are not run), and the server keeps serving the others.
#[test]
fn a_full_queue_answers_503_with_retry_after() {
    let s = Server::start(&["--parallel", "1", "--max-queue", "1", "--debug-decode-delay-ms", "20"]);
    let long = json!({"prompt": "Go on", "max_tokens": 60, "temperature": 0});
    std::thread::scope(|scope| {
        // One request runs, one waits in the queue.
        let running = scope.spawn(|| s.complete(&long));
        let t = Instant::now();
        while s.metric("kiln_active_sequences") < 1.0 {
            assert!(t.elapsed() < Duration::from_secs(10));
            std::thread::sleep(Duration::from_millis(10));
        }
        let queued = scope.spawn(|| s.complete(&long));
        while s.metric("kiln_queue_depth") < 1.0 {
            assert!(t.elapsed() < Duration::from_secs(10), "{}", s.log());
            std::thread::sleep(Duration::from_millis(10));
        }
        let r = s.post("/v1/completions", &long);
        assert_eq!(r.status(), 503);
        assert!(r.headers().get("retry-after").is_some(), "Retry-After is set");
        let e: Value = r.json().unwrap();
        assert!(e["error"]["message"].is_string(), "{e}");
        for h in [running, queued] {
            assert_eq!(h.join().unwrap()["usage"]["completion_tokens"], 60);
        }
    });
}

// Bad input is one error line and exit status 1, before anything listens: a model that does
// not exist, a context beyond the model's, a port already taken, a --parallel out of range or
// beyond the prefill block (a step holds one token of every sequence).
#[test]
fn bad_arguments_are_one_line_and_exit_1() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = taken.local_addr().unwrap().port().to_string();
    let model = chat_model().to_str().unwrap().to_string();
    let cases: [(Vec<&str>, &str); 6] = [
        (vec!["/nonexistent/model"], "/nonexistent/model"),
        (vec![&model, "--ctx", "100000"], "--ctx 100000"),
        (vec![&model, "--port", &port], "cannot listen on 127.0.0.1:"),
        (vec![&model, "--parallel", "0"], "--parallel"),
        (vec![&model, "--parallel", "65"], "--parallel 65"),
        (
            vec![&model, "--parallel", "8", "--prefill-block", "4"],
            "--prefill-block 4",
        ),
    ];
    for (args, needle) in cases {
        let out = Command::new(env!("CARGO_BIN_EXE_kiln"))
            .arg("serve")
            .args(&args)
            .env("KILN_CACHE_DIR", cache_dir())
            .stdin(Stdio::null())
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {err}");
        assert_eq!(err.lines().count(), 1, "{args:?}: one line: {err}");
        assert!(err.starts_with("error: ") && err.contains(needle), "{args:?}: {err}");
    }
}
