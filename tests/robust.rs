//! End-to-end runs of the `kiln` binary at the edges of its use: stdout or stderr that cannot be
//! written (a full disk, a closed pipe), thread counts of 0 or above the machine's CPUs, Ctrl-C
//! during generation and during a compile, and prompts too long for the command line.

#![cfg(target_os = "linux")]

use serde_json::Value;
use std::fs::File;
use std::io::Read as _;
use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(name)
}

/// One compile cache for the whole test binary, so each fixture is compiled once.
fn cache_dir() -> &'static Path {
    static DIR: OnceLock<tempfile::TempDir> = OnceLock::new();
    DIR.get_or_init(|| tempfile::tempdir().expect("temp cache")).path()
}

/// `kiln args` against the shared cache, stdin empty.
fn kiln(args: &[&str]) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_kiln"));
    c.args(args)
        .env("KILN_CACHE_DIR", cache_dir())
        .env_remove("KILN_PROFILE")
        .stdin(Stdio::null());
    c
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn dev_full() -> File {
    File::options().write(true).open("/dev/full").expect("/dev/full")
}

/// A copy of the qwen2 fixture with the Qwen2.5 chat template, for `kiln chat`.
fn chat_model() -> tempfile::TempDir {
    let template = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/chat_templates/qwen2_5.jinja");
    let template = std::fs::read_to_string(template).unwrap();
    kiln_testkit::fixtures::with_chat_template(&fixture("qwen2"), &template)
}

/// The process failed with exactly one line on stderr, `error: ...` containing every needle.
fn assert_one_line_error(o: &Output, needles: &[&str]) {
    let err = stderr(o);
    assert!(!o.status.success(), "expected a failure: {err}");
    assert_eq!(o.status.code(), Some(1), "exit status 1, not a panic's 101: {err}");
    let lines: Vec<&str> = err.lines().filter(|l| !l.starts_with("compiling")).collect();
    assert_eq!(lines.len(), 1, "one line of error: {err}");
    assert!(lines[0].starts_with("error: "), "{err}");
    for n in needles {
        assert!(err.contains(n), "the error mentions {n:?}: {err}");
    }
}

#[test]
fn a_full_stdout_is_one_line_of_error_for_every_command() {
    let llama = fixture("llama");
    let model = llama.to_str().unwrap();
    let run = [
        "run",
        model,
        "--prompt",
        "Hello",
        "--temperature",
        "0",
        "--max-tokens",
        "4",
    ];
    let mut run_json = run.to_vec();
    run_json.push("--json");
    let cases: Vec<Vec<&str>> = vec![
        vec!["compile", model],
        vec!["compile", model, "--json"],
        vec!["info", model],
        vec!["info", model, "--json"],
        vec!["cache", "list"],
        vec!["cache", "list", "--json"],
        run.to_vec(),
        run_json,
        vec!["--help"],
        vec!["--version"],
    ];
    for args in cases {
        let o = kiln(&args).stdout(dev_full()).output().unwrap();
        assert_one_line_error(&o, &["cannot write to stdout", "No space left on device"]);
    }
}

#[test]
fn a_full_stdout_ends_a_chat_with_one_line_of_error() {
    let model = chat_model();
    for extra in [&[][..], &["--json"]] {
        let mut child = kiln(&["chat", model.path().to_str().unwrap(), "--max-tokens", "4"])
            .args(extra)
            .stdin(Stdio::piped())
            .stdout(dev_full())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        use std::io::Write as _;
        child.stdin.take().unwrap().write_all(b"Hello\nAgain\n").unwrap();
        let o = child.wait_with_output().unwrap();
        let err = stderr(&o);
        let errors: Vec<&str> = err.lines().filter(|l| l.starts_with("error: ")).collect();
        assert_eq!(errors.len(), 1, "{err}");
        assert!(errors[0].contains("cannot write to stdout"), "{err}");
        assert_eq!(o.status.code(), Some(1), "{err}");
    }
}

#[test]
fn a_full_stderr_is_a_failure_not_a_panic() {
    let llama = fixture("llama");
    let o = kiln(&["run", llama.to_str().unwrap(), "--prompt", "Hello", "--max-tokens", "4"])
        .stderr(dev_full())
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(1), "the statistics line could not be written");
    assert!(!o.stdout.is_empty(), "the text was written");
    // --quiet writes nothing on stderr, so nothing fails.
    let o = kiln(&[
        "run",
        llama.to_str().unwrap(),
        "--prompt",
        "Hello",
        "--max-tokens",
        "4",
        "--quiet",
    ])
    .stderr(dev_full())
    .output()
    .unwrap();
    assert!(o.status.success());
}

/// A chat whose stderr cannot be written (its banner, notes and errors go there) fails with
/// status 1 instead of answering on stdout and exiting 0 as if all was well.
#[test]
fn a_full_stderr_ends_a_chat_with_a_failure() {
    use std::io::Write as _;
    let model = chat_model();
    let mut child = kiln(&["chat", model.path().to_str().unwrap(), "--max-tokens", "4"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(dev_full())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(b"Hello\n").unwrap();
    let o = child.wait_with_output().unwrap();
    assert_eq!(
        o.status.code(),
        Some(1),
        "stdout: {}",
        String::from_utf8_lossy(&o.stdout)
    );
}

#[test]
fn a_closed_pipe_ends_quietly() {
    let llama = fixture("llama");
    for args in [&["info", llama.to_str().unwrap()][..], &["cache", "list"]] {
        let mut command = kiln(args);
        // SAFETY: between fork and exec the child only calls the async-signal-safe
        // `sigprocmask`. Blocking SIGPIPE makes a write to the closed pipe fail with EPIPE
        // instead of killing the process, so the error path is what is tested.
        unsafe {
            command.pre_exec(|| {
                let mut set: libc::sigset_t = std::mem::zeroed();
                libc::sigemptyset(&mut set);
                libc::sigaddset(&mut set, libc::SIGPIPE);
                libc::sigprocmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
                Ok(())
            });
        }
        let mut child = command.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
        drop(child.stdout.take());
        let o = child.wait_with_output().unwrap();
        assert_eq!(stderr(&o), "", "nothing said about the closed pipe");
        assert_eq!(o.status.code(), Some(141), "the status of a death by SIGPIPE");
    }
}

/// `kiln run --json` on the llama fixture with `extra` arguments.
fn run_json(extra: &[&str]) -> Value {
    let llama = fixture("llama");
    let o = kiln(&[
        "run",
        llama.to_str().unwrap(),
        "--prompt",
        "Hello",
        "--temperature",
        "0",
        "--json",
    ])
    .args(extra)
    .output()
    .unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    serde_json::from_slice(&o.stdout).unwrap()
}

#[test]
fn zero_threads_blocks_or_context_are_errors() {
    let llama = fixture("llama");
    let run = ["run", llama.to_str().unwrap(), "--prompt", "Hello", "--max-tokens", "4"];
    for (option, value) in [("--threads", "0"), ("--prefill-block", "0"), ("--ctx", "0")] {
        let o = kiln(&run).args([option, value]).output().unwrap();
        assert_one_line_error(&o, &[option, "at least 1"]);
    }
    let model = chat_model();
    let o = kiln(&["chat", model.path().to_str().unwrap(), "--ctx", "0"])
        .output()
        .unwrap();
    assert_one_line_error(&o, &["--ctx", "at least 1"]);
    let o = kiln(&["bench", llama.to_str().unwrap(), "--threads", "0"])
        .output()
        .unwrap();
    assert_one_line_error(&o, &["--threads", "at least 1"]);
}

/// A prefill block too large for any machine's memory (a terabyte-row block: over 100 TiB of
/// activations) is one line naming the buffer and the option, not an allocation abort.
#[test]
fn a_prefill_block_too_large_to_allocate_is_an_error() {
    // Refused before anything is compiled, by `run` and by `compile` alike: a library for
    // that block size would stay in the cache unused.
    let llama = fixture("llama");
    let run = ["run", llama.to_str().unwrap(), "--prompt", "Hello", "--max-tokens", "4"];
    let compile = ["compile", llama.to_str().unwrap()];
    for command in [&run[..], &compile[..]] {
        let cache = tempfile::tempdir().unwrap();
        let o = kiln(command)
            .env("KILN_CACHE_DIR", cache.path())
            .args(["--prefill-block", "1000000000000"])
            .output()
            .unwrap();
        assert_one_line_error(
            &o,
            &["cannot allocate", "activation buffers", "--prefill-block 1000000000000"],
        );
        let entries: Vec<_> = std::fs::read_dir(cache.path()).unwrap().collect();
        assert!(
            entries.is_empty(),
            "{}: nothing compiled or cached: {entries:?}",
            command[0]
        );
    }
}

/// Below the machine's memory but past what can be allocated, the engine's buffers fail as an
/// error naming the buffer, not an abort (the check before compiling cannot see every limit).
#[test]
fn buffers_that_cannot_be_allocated_are_an_error() {
    let model = kiln_formats::loader::load(&fixture("llama"), &Default::default()).unwrap();
    let err = kiln_engine::buffers::Buffers::new(&model.spec, 1 << 40, 64, 1)
        .err()
        .expect("no machine allocates 2^40 rows");
    assert!(
        err.bytes > 1 << 40 && err.to_string().contains("cannot allocate the"),
        "{err}"
    );
}

#[test]
fn more_threads_than_cpus_are_capped_unless_asked_for() {
    let cpus = kiln_engine::pool::available_cpus();
    let reference = run_json(&["--threads", "1", "--max-tokens", "6"]);

    let llama = fixture("llama");
    let o = kiln(&[
        "run",
        llama.to_str().unwrap(),
        "--prompt",
        "Hello",
        "--temperature",
        "0",
        "--json",
    ])
    .args(["--max-tokens", "6", "--threads", "1000"])
    .output()
    .unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    let err = stderr(&o);
    assert!(
        err.contains("warning: --threads 1000") && err.contains("--threads-oversubscribe"),
        "{err}"
    );
    let capped: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(capped["threads"], cpus, "capped at the CPUs");
    assert_eq!(capped["token_ids"], reference["token_ids"]);

    // Asked for: twice the CPUs, no warning, the same tokens.
    let twice = (2 * cpus).to_string();
    let o = kiln(&[
        "run",
        llama.to_str().unwrap(),
        "--prompt",
        "Hello",
        "--temperature",
        "0",
        "--json",
    ])
    .args(["--max-tokens", "6", "--threads", &twice, "--threads-oversubscribe"])
    .output()
    .unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(!stderr(&o).contains("warning"), "{}", stderr(&o));
    let over: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(over["threads"], 2 * cpus);
    assert_eq!(over["token_ids"], reference["token_ids"]);
}

/// `command` with SIGINT at its default disposition in the child: a background job of a
/// non-interactive shell starts with SIGINT ignored, and a test of Ctrl-C must not inherit that.
fn default_sigint(command: &mut Command) -> &mut Command {
    // SAFETY: between fork and exec the child only calls the async-signal-safe `signal`.
    unsafe {
        command.pre_exec(|| {
            libc::signal(libc::SIGINT, libc::SIG_DFL);
            Ok(())
        });
    }
    command
}

fn sigint(child: &Child) {
    // SAFETY: `kill` with the pid of our own child, which has not been waited for yet.
    let rc = unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGINT) };
    assert_eq!(rc, 0, "kill -INT");
}

/// A greedy `kiln run` of the llama fixture that would generate to the end of its 512-token
/// context, sleeping `delay_ms` before each token: long enough to be interrupted.
fn endless_run(delay_ms: u64, json: bool) -> Child {
    run_json(&["--max-tokens", "1"]); // compiled before, so the timings below are generation's
    let llama = fixture("llama");
    let delay = delay_ms.to_string();
    let mut command = kiln(&[
        "run",
        llama.to_str().unwrap(),
        "--prompt",
        "Hello",
        "--temperature",
        "0",
    ]);
    command.args([
        "--ignore-eos",
        "--max-tokens",
        "100000",
        "--debug-decode-delay-ms",
        &delay,
    ]);
    if json {
        command.arg("--json");
    }
    default_sigint(&mut command)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

#[test]
fn ctrl_c_stops_run_and_prints_the_json_so_far() {
    let child = endless_run(50, true);
    // Generation has started well before this (a cached library starts in a fraction of a
    // second) and takes 25 s to reach the end of the context.
    std::thread::sleep(Duration::from_secs(3));
    sigint(&child);
    let t0 = Instant::now();
    let o = child.wait_with_output().unwrap();
    assert!(t0.elapsed() < Duration::from_secs(5), "stopped promptly");
    assert_eq!(o.status.code(), Some(130), "{}", stderr(&o));
    let report: Value = serde_json::from_slice(&o.stdout).expect("one JSON object");
    assert_eq!(report["stop_reason"], "cancelled");
    let generated = report["token_ids"].as_array().unwrap().len();
    assert!(generated > 0 && generated < 400, "{generated} tokens");
}

#[test]
fn ctrl_c_stops_run_and_prints_the_statistics() {
    let mut child = endless_run(20, false);
    let mut stdout = child.stdout.take().unwrap();
    let mut first = [0u8; 1];
    stdout
        .read_exact(&mut first)
        .expect("text streams before the interrupt");
    sigint(&child);
    let mut rest = Vec::new();
    stdout.read_to_end(&mut rest).unwrap();
    let o = child.wait_with_output().unwrap();
    assert_eq!(o.status.code(), Some(130), "{}", stderr(&o));
    assert_eq!(rest.last(), Some(&b'\n'), "the text ends with its line");
    let err = stderr(&o);
    assert!(err.contains("generated") && err.contains("stopped by Ctrl-C"), "{err}");
}

#[test]
fn a_second_ctrl_c_ends_run_at_once() {
    // Each decode step sleeps 4 s first, so the first Ctrl-C takes effect only after it.
    let child = endless_run(4000, true);
    std::thread::sleep(Duration::from_secs(2));
    sigint(&child);
    std::thread::sleep(Duration::from_millis(300));
    sigint(&child);
    let t0 = Instant::now();
    let o = child.wait_with_output().unwrap();
    assert!(t0.elapsed() < Duration::from_millis(1500), "ended at once");
    assert_eq!(o.status.code(), Some(130));
    assert!(o.stdout.is_empty(), "nothing printed");
}

#[test]
fn ctrl_c_during_a_compile_leaves_no_staging_folder() {
    let cache = tempfile::tempdir().unwrap();
    let staging = || {
        std::fs::read_dir(cache.path())
            .unwrap()
            .filter_map(|e| e.ok())
            .any(|e| e.file_name().to_string_lossy().starts_with(".staging-"))
    };
    let mistral = fixture("mistral");
    let mut command = kiln(&["compile", mistral.to_str().unwrap()]);
    let mut child = default_sigint(command.env("KILN_CACHE_DIR", cache.path()))
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    while !staging() {
        assert!(
            child.try_wait().unwrap().is_none(),
            "the compile ended before it was seen"
        );
        assert!(Instant::now() < deadline, "no staging folder appeared");
        std::thread::sleep(Duration::from_millis(2));
    }
    sigint(&child);
    let o = child.wait_with_output().unwrap();
    assert_eq!(o.status.code(), Some(130), "{}", stderr(&o));
    assert!(!staging(), "the staging folder was removed");
}

#[test]
fn prompt_file_reads_long_prompts_and_stdin() {
    let dir = tempfile::tempdir().unwrap();
    let llama = fixture("llama");
    let model = llama.to_str().unwrap();
    let reference = run_json(&["--max-tokens", "6"]);

    // A file and standard input give exactly what --prompt gives.
    let file = dir.path().join("prompt.txt");
    std::fs::write(&file, "Hello").unwrap();
    let from_file = run_json_without_prompt(&["--prompt-file", file.to_str().unwrap(), "--max-tokens", "6"], b"");
    assert_eq!(from_file["token_ids"], reference["token_ids"]);
    assert_eq!(from_file["prompt_token_ids"], reference["prompt_token_ids"]);
    let from_stdin = run_json_without_prompt(&["--prompt-file", "-", "--max-tokens", "6"], b"Hello");
    assert_eq!(from_stdin["prompt_token_ids"], reference["prompt_token_ids"]);

    // 1 MB: more than an argument list may hold; read, encoded, and only then too long for
    // the fixture's 512-token context.
    let big = dir.path().join("big.txt");
    let text = "many words of text ".repeat(60_000); // 1.14 MB of ASCII
    std::fs::write(&big, &text.as_bytes()[..1 << 20]).unwrap();
    let o = kiln(&[
        "run",
        model,
        "--prompt-file",
        big.to_str().unwrap(),
        "--max-tokens",
        "4",
    ])
    .output()
    .unwrap();
    assert_one_line_error(&o, &["tokens but the context holds 512"]);
}

#[test]
fn prompt_file_errors_are_one_line() {
    let dir = tempfile::tempdir().unwrap();
    let llama = fixture("llama");
    let model = llama.to_str().unwrap();
    let missing = dir.path().join("missing.txt");
    let o = kiln(&["run", model, "--prompt-file", missing.to_str().unwrap()])
        .output()
        .unwrap();
    assert_one_line_error(&o, &["cannot read the prompt file", "missing.txt", "No such file"]);

    let o = kiln(&["run", model, "--prompt-file", dir.path().to_str().unwrap()])
        .output()
        .unwrap();
    assert_one_line_error(&o, &["cannot read the prompt file", "Is a directory"]);

    let latin1 = dir.path().join("latin1.txt");
    std::fs::write(&latin1, b"caf\xe9 au lait").unwrap();
    let o = kiln(&["run", model, "--prompt-file", latin1.to_str().unwrap()])
        .output()
        .unwrap();
    assert_one_line_error(&o, &["latin1.txt", "is not UTF-8", "offset 3"]);

    // Exclusive with --prompt (clap's usage error).
    let o = kiln(&["run", model, "--prompt", "x", "--prompt-file", latin1.to_str().unwrap()])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("cannot be used with"), "{}", stderr(&o));
}

/// `kiln run --json` on the llama fixture with `args` (which name the prompt) and `stdin`.
fn run_json_without_prompt(args: &[&str], stdin: &[u8]) -> Value {
    use std::io::Write as _;
    let llama = fixture("llama");
    let mut child = kiln(&["run", llama.to_str().unwrap(), "--temperature", "0", "--json"])
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(stdin).unwrap();
    let o = child.wait_with_output().unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    serde_json::from_slice(&o.stdout).unwrap()
}
