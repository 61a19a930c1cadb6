//! A GGUF path that is not a regular file (a FIFO, a device, a directory, a symlink loop), and
//! GGUF files whose tensors' data overlap.
//!
//! Invariants: each case is one error naming the path and what it is, nothing blocks on a FIFO
//! (each load runs under [`within`]), and a tensor pointing into another's bytes (of any type)
//! is refused naming both.

use super::parse::GgufHeader;
use super::tests::Writer;
use super::*;
use crate::loader::{self, LoadOptions};
use kiln_core::DType;
use kiln_testkit::special_files::{mkfifo, symlink_loop, within};
use std::path::{Path, PathBuf};
use std::time::Duration;

fn tiny_llama() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/data/gguf/tiny-llama.gguf")
}

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

/// `bytes` (a whole GGUF file) with the tensor `name` moved to `offset` in the data section.
fn with_offset(bytes: &[u8], name: &str, offset: u64) -> Vec<u8> {
    let h = GgufHeader::parse(bytes, Path::new("m")).unwrap();
    let mut w = Writer::new(h.version).kvs(&h.metadata);
    for t in &h.tensors {
        let at = if t.name == name { offset } else { t.offset };
        w = w.tensor(&t.name, &t.ne, t.type_id, at);
    }
    let mut out = w.finish();
    out.extend(&bytes[h.data_start as usize..]);
    out
}

#[test]
fn a_tensor_pointing_into_another_of_another_type_is_refused() {
    let bytes = std::fs::read(tiny_llama()).unwrap();
    let h = GgufHeader::parse(&bytes, Path::new("m")).unwrap();
    // A float tensor made to read the bytes of the largest quantised one.
    let small = h.tensors.iter().find(|t| t.dtype == DType::F32).unwrap();
    let big = h
        .tensors
        .iter()
        .filter(|t| t.dtype.is_quantized())
        .max_by_key(|t| t.size)
        .unwrap();
    assert!(small.size < big.size);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("overlap.gguf");
    std::fs::write(&path, with_offset(&bytes, &small.name, big.offset)).unwrap();
    let at = GgufHeader::parse(&std::fs::read(&path).unwrap(), &path)
        .map(|_| ())
        .unwrap_err();
    let start = h.data_start + big.offset;
    let want = format!(
        "{}: tensors {} (offset {start}, {} bytes) and {} (offset {start}, {} bytes) overlap",
        path.display(),
        small.name,
        small.size,
        big.name,
        big.size
    );
    assert_eq!(at.to_string(), want);
    assert_eq!(err_within(&path, any_load), want);

    // The unmodified rewrite loads, so the offset is what was refused.
    std::fs::write(&path, with_offset(&bytes, &small.name, small.offset)).unwrap();
    assert!(load(&path).is_ok());
}

#[test]
fn overlaps_in_a_bare_tensor_table() {
    let parse = |w: Writer, data: usize| {
        let mut f = w.finish();
        f.extend(vec![0u8; data]);
        GgufHeader::parse(&f, Path::new("/x/m.gguf")).map(|h| h.data_start)
    };
    // 64 f32 (256 bytes at 0) and 32 f16 (64 bytes at 128): contained, another type.
    let w = Writer::new(3).tensor("a", &[64], 0, 0).tensor("b", &[32], 1, 128);
    let e = parse(w, 512).unwrap_err().to_string();
    assert!(
        e.starts_with("/x/m.gguf: tensors a (offset ")
            && e.contains(", 256 bytes) and b (offset ")
            && e.ends_with(", 64 bytes) overlap"),
        "{e}"
    );
    // Listed in the other order, the same pair in the same order.
    let w = Writer::new(3).tensor("b", &[32], 1, 128).tensor("a", &[64], 0, 0);
    assert_eq!(parse(w, 512).unwrap_err().to_string(), e);
    // Adjacent tensors and a zero-size one share nothing.
    let w = Writer::new(3)
        .tensor("a", &[64], 0, 0)
        .tensor("b", &[32], 1, 256)
        .tensor("z", &[0], 0, 128);
    assert!(parse(w, 512).is_ok());
}
