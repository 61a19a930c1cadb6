//! End-to-end runs of the `kiln` binary at the edges of its use: stdout or stderr that cannot be
//! written (a full disk, a closed pipe), thread counts of 0 or above the machine's CPUs, Ctrl-C
//! during generation and during a compile, and prompts too long for the command line.

#![cfg(target_os = "linux")]

use serde_json::Value;
use std::fs::File;
use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::OnceLock;

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
    let dir = tempfile::tempdir().unwrap();
    for e in std::fs::read_dir(fixture("qwen2")).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), dir.path().join(e.file_name())).unwrap();
    }
    let template = Path::new(env!("CARGO_MANIFEST_DIR")).join("runtime/tests/data/chat_templates/qwen2_5.jinja");
    std::fs::copy(template, dir.path().join("chat_template.jinja")).unwrap();
    dir
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

#[test]
fn more_threads_than_cpus_are_capped_unless_asked_for() {
    let cpus = kiln_runtime::pool::available_cpus();
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
