//! `kiln chat` in a real pseudo-terminal, where input goes through the line editor and not
//! through the piped path that tests/chat.rs drives.
//!
//! A terminal hands a program whatever has arrived since its last read: a pasted line, or keys
//! sent by tmux `send-keys`, come in ONE read. The line editor must handle all of those bytes;
//! with rustyline's `signal-hook` feature it waited in `select` on the terminal while the rest
//! of the line sat in its own buffer, so `hello` + Enter showed `>>> h` and nothing happened
//! until another key arrived. These tests write each line in one `write` to the PTY's master
//! side, as a paste does.

#![cfg(target_os = "linux")]

use std::fs::File;
use std::io::{Read as _, Write as _};
use std::os::fd::{FromRawFd as _, OwnedFd};
use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::OnceLock;
use std::sync::mpsc::{Receiver, channel};
use std::time::{Duration, Instant};

fn repo(path: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(path)
}

/// A copy of the qwen2 fixture with the Qwen2.5 chat template (the fixtures have none).
fn qwen2_chat() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    for e in std::fs::read_dir(repo("tests/fixtures/qwen2")).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), dir.path().join(e.file_name())).unwrap();
    }
    std::fs::copy(
        repo("tests/data/chat_templates/qwen2_5.jinja"),
        dir.path().join("chat_template.jinja"),
    )
    .unwrap();
    dir
}

/// One compile cache for the whole test binary, so the fixture is compiled once.
fn cache_dir() -> &'static Path {
    static DIR: OnceLock<tempfile::TempDir> = OnceLock::new();
    DIR.get_or_init(|| tempfile::tempdir().expect("temp cache")).path()
}

/// A pseudo-terminal of 100 x 30 characters: (master, slave).
fn open_pty() -> (OwnedFd, OwnedFd) {
    let (mut master, mut slave) = (-1, -1);
    let size = libc::winsize {
        ws_row: 30,
        ws_col: 100,
        ws_xpixel: 0,
        ws_ypixel: 0,
    };
    // SAFETY: `openpty` writes two file descriptors into the two ints; the name pointer is null
    // (not wanted), and the termios and winsize pointers are null or point to a live value.
    let rc = unsafe { libc::openpty(&mut master, &mut slave, std::ptr::null_mut(), std::ptr::null(), &size) };
    assert_eq!(rc, 0, "openpty: {}", std::io::Error::last_os_error());
    // SAFETY: both descriptors were just opened by `openpty` and are owned by nobody else.
    unsafe { (OwnedFd::from_raw_fd(master), OwnedFd::from_raw_fd(slave)) }
}

/// `kiln chat` running on the slave side of a PTY, with what it prints collected from the
/// master side by a thread.
struct Terminal {
    child: Child,
    master: File,
    /// Chunks of output, in order, until the child closes the terminal.
    output: Receiver<Vec<u8>>,
    /// Everything printed so far.
    screen: String,
}

impl Terminal {
    fn spawn(model: &Path, args: &[&str]) -> Terminal {
        let (master, slave) = open_pty();
        let mut command = Command::new(env!("CARGO_BIN_EXE_kiln"));
        command
            .arg("chat")
            .arg(model)
            .args(args)
            .env("KILN_CACHE_DIR", cache_dir())
            .env("TERM", "xterm")
            .env("NO_COLOR", "1")
            .env_remove("KILN_PROFILE")
            .stdin(Stdio::from(slave.try_clone().unwrap()))
            .stdout(Stdio::from(slave.try_clone().unwrap()))
            .stderr(Stdio::from(slave));
        // SAFETY: between fork and exec the child only calls async-signal-safe functions: it
        // starts a session whose controlling terminal is the PTY (as a shell in a terminal
        // would have) and takes SIGINT at its default disposition (a background job of a
        // non-interactive shell starts with it ignored).
        unsafe {
            command.pre_exec(|| {
                if libc::setsid() < 0 || libc::ioctl(0, libc::TIOCSCTTY, 0) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                libc::signal(libc::SIGINT, libc::SIG_DFL);
                Ok(())
            });
        }
        let child = command.spawn().expect("kiln starts");
        // The command held the last copies of the slave side here: once it is gone the master
        // reads EIO when the child has exited.
        drop(command);
        let master = File::from(master);
        let mut reader = master.try_clone().unwrap();
        let (tx, output) = channel();
        std::thread::spawn(move || {
            let mut buf = [0u8; 4096];
            while let Ok(n) = reader.read(&mut buf) {
                if n == 0 || tx.send(buf[..n].to_vec()).is_err() {
                    break;
                }
            }
        });
        Terminal {
            child,
            master,
            output,
            screen: String::new(),
        }
    }

    /// Waits until the output since byte `from` contains `needle`; returns where it ends.
    fn expect(&mut self, from: usize, needle: &str, timeout: Duration, what: &str) -> usize {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(i) = self.screen[from..].find(needle) {
                return from + i + needle.len();
            }
            let left = deadline.saturating_duration_since(Instant::now());
            match self.output.recv_timeout(left) {
                Ok(chunk) => self.screen.push_str(&String::from_utf8_lossy(&chunk)),
                Err(_) => panic!(
                    "{what}: no {needle:?} within {timeout:?}; the terminal shows:\n{}",
                    self.screen
                ),
            }
        }
    }

    /// Types `text` as ONE write to the terminal, as a paste or tmux send-keys does.
    fn paste(&mut self, text: &str) {
        let n = self.master.write(text.as_bytes()).unwrap();
        assert_eq!(n, text.len(), "one write");
    }

    fn wait(&mut self, timeout: Duration) -> ExitStatus {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                return status;
            }
            assert!(
                Instant::now() < deadline,
                "kiln chat did not exit within {timeout:?}; the terminal shows:\n{}",
                self.screen
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Terminal {
    /// A failed test leaves no process behind.
    fn drop(&mut self) {
        if self.child.try_wait().ok().flatten().is_none() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// Proves that a line arriving in one read is handled whole: `hello` + Enter, written at once,
/// gets a reply (the turn's statistics line follows it), and `/exit` + Enter, written at once,
/// ends the chat with status 0. Before the fix the first write left `>>> h` on the screen and
/// the test timed out waiting for the reply.
#[test]
fn a_line_typed_in_one_burst_is_answered_and_exit_works() {
    let model = qwen2_chat();
    let mut term = Terminal::spawn(
        model.path(),
        &["--temperature", "0", "--max-tokens", "4", "--threads", "2", "--stats"],
    );
    // The first prompt comes after the compile.
    let at = term.expect(0, ">>> ", Duration::from_secs(300), "the first prompt");
    assert!(term.screen.contains("kiln chat:"), "{}", term.screen);
    term.paste("hello\r");
    let at = term.expect(at, "[turn 1:", Duration::from_secs(60), "the reply to hello");
    assert!(term.screen.contains("hello"), "the line is echoed: {}", term.screen);
    term.expect(at, ">>> ", Duration::from_secs(30), "the second prompt");
    term.paste("/exit\r");
    let status = term.wait(Duration::from_secs(30));
    assert_eq!(status.code(), Some(0), "{status}; the terminal shows:\n{}", term.screen);
}

/// Two lines in one write (a paste of two lines): both are answered, in order.
#[test]
fn two_lines_pasted_at_once_are_both_answered() {
    let model = qwen2_chat();
    let mut term = Terminal::spawn(
        model.path(),
        &["--temperature", "0", "--max-tokens", "2", "--threads", "2", "--stats"],
    );
    let at = term.expect(0, ">>> ", Duration::from_secs(300), "the first prompt");
    term.paste("hi\rthere\r");
    let at = term.expect(at, "[turn 1:", Duration::from_secs(60), "the reply to the first line");
    term.expect(at, "[turn 2:", Duration::from_secs(60), "the reply to the second line");
    term.paste("/exit\r");
    assert_eq!(term.wait(Duration::from_secs(30)).code(), Some(0), "{}", term.screen);
}

/// Proves that Ctrl-C typed in the terminal during a reply still stops it (the line editor
/// must not keep SIGINT for itself) and that the chat goes on: the terminal's line discipline
/// turns the byte 0x03 into SIGINT for the chat, whose reply then ends with `[stopped]`, and the
/// next line is answered.
#[test]
fn ctrl_c_in_the_terminal_stops_a_reply() {
    let model = qwen2_chat();
    // 20 ms before each decode step: a reply to the end of the 512-token context would take
    // about 10 s.
    let mut term = Terminal::spawn(
        model.path(),
        &["--temperature", "0", "--threads", "2", "--debug-decode-delay-ms", "20"],
    );
    let at = term.expect(0, ">>> ", Duration::from_secs(300), "the first prompt");
    term.paste("tell me a story\r");
    // The reply has started when its first characters are on the screen after the echo.
    let at = term.expect(at, "tell me a story", Duration::from_secs(30), "the echo");
    std::thread::sleep(Duration::from_millis(500));
    let t0 = Instant::now();
    term.paste("\x03");
    let at = term.expect(at, "[stopped]", Duration::from_secs(5), "the reply stopped by Ctrl-C");
    assert!(
        t0.elapsed() < Duration::from_secs(3),
        "stopped promptly: {:?}",
        t0.elapsed()
    );
    term.expect(
        at,
        ">>> ",
        Duration::from_secs(10),
        "the prompt after the stopped reply",
    );
    term.paste("/exit\r");
    assert_eq!(term.wait(Duration::from_secs(30)).code(), Some(0), "{}", term.screen);
}
