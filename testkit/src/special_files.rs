//! Special files to give a loader instead of the regular files it expects, and a guard that a
//! call does not block on them.

use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// Creates a FIFO (named pipe) at `path`. Nobody ever writes to it, so opening it for reading
/// without `O_NONBLOCK` blocks forever.
pub fn mkfifo(path: &Path) {
    let c = CString::new(path.as_os_str().as_bytes()).expect("path without NUL");
    // SAFETY: `c` is a NUL-terminated path that outlives the call; mkfifo only reads it.
    let rc = unsafe { libc::mkfifo(c.as_ptr(), 0o644) };
    assert_eq!(rc, 0, "mkfifo {}: {}", path.display(), std::io::Error::last_os_error());
}

/// Makes `path` a symlink to itself: resolving it fails with `ELOOP`.
pub fn symlink_loop(path: &Path) {
    // The target is resolved from the link's own folder, so its bare name points back at it.
    let name = path.file_name().expect("a path ending in a name");
    std::os::unix::fs::symlink(name, path).expect("create a self-referencing symlink");
}

/// Runs `f` on another thread and returns its result, panicking if it has not returned within
/// `limit` (the thread is then left blocked; the test fails instead of hanging). The result
/// comes with the time taken.
pub fn within<T: Send + 'static>(limit: Duration, what: &str, f: impl FnOnce() -> T + Send + 'static) -> (T, Duration) {
    let (tx, rx) = mpsc::channel();
    let start = Instant::now();
    std::thread::spawn(move || {
        // The receiver is gone only after a timeout, which already failed the test.
        let _ = tx.send(f());
    });
    match rx.recv_timeout(limit) {
        Ok(v) => (v, start.elapsed()),
        Err(_) => panic!("{what} did not finish within {limit:?} (blocked?)"),
    }
}
