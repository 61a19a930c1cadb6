//! A GGUF path that is not a regular file (a FIFO, a device, a directory, a symlink loop).
//!
//! Invariants: each case is one error naming the path and what it is, and nothing blocks on a
//! FIFO (each load runs under [`within`]).

use super::*;
use crate::loader::{self, LoadOptions};
use kiln_testkit::special_files::{mkfifo, symlink_loop, within};
use std::path::Path;
use std::time::Duration;

/// The error of `f(path)`, which must come within 10 s.
fn err_within<T: Send + 'static, E: ToString + Send + 'static>(path: &Path, f: fn(&Path) -> Result<T, E>) -> String {
    let p = path.to_path_buf();
    let (r, _) = within(
        Duration::from_secs(10),
        &format!("reading {}", path.display()),
        move || f(&p).map(|_| ()).map_err(|e| e.to_string()),
    );
    let e = r.expect_err("should fail");
    assert_eq!(e.lines().count(), 1, "one line: {e}");
    e
}

fn gguf_load(path: &Path) -> Result<LoadedGguf, GgufError> {
    load(path)
}

fn any_load(path: &Path) -> Result<loader::Model, loader::LoadError> {
    loader::load(path, &LoadOptions::default())
}

#[test]
fn gguf_path_that_is_a_fifo_device_directory_or_loop() {
    let base = tempfile::tempdir().unwrap();
    let fifo = base.path().join("m.gguf");
    mkfifo(&fifo);
    let e = err_within(&fifo, gguf_load);
    assert_eq!(
        e,
        format!("{} is a FIFO (named pipe), not a regular file", fifo.display())
    );
    assert!(!is_gguf(&fifo));
    assert!(err_within(&fifo, any_load).contains("is a FIFO (named pipe), not a regular file or folder"));
    assert_eq!(
        err_within(Path::new("/dev/zero"), gguf_load),
        "/dev/zero is a character device, not a regular file"
    );

    let dir = base.path().join("d.gguf");
    std::fs::create_dir(&dir).unwrap();
    assert_eq!(
        err_within(&dir, gguf_load),
        format!("{} is a directory, not a regular file", dir.display())
    );
    assert_eq!(
        err_within(&dir, any_load),
        format!(
            "{} is a directory, not a GGUF file (and it holds no config.json to read it as a Hugging Face model folder)",
            dir.display()
        )
    );

    let looped = base.path().join("l.gguf");
    symlink_loop(&looped);
    let want = format!(
        "{} is a symlink loop (too many levels of symbolic links)",
        looped.display()
    );
    assert_eq!(err_within(&looped, gguf_load), want);
    assert_eq!(err_within(&looped, any_load), want);
}
