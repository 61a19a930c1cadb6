//! `WeightSource::read_range` of [`GgufWeights`]: the bytes it reads from the files are the
//! bytes `weight_ptr` exposes, for every kind of tensor, and reading makes no lazy copy.

use super::parse::{GgufHeader, Value};
use super::tests::Writer;
use super::*;
use crate::pread::check;
use kiln_engine::engine::WeightSource;
use std::path::{Path, PathBuf};

fn data(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/data/gguf")
        .join(name)
}

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures/gguf")
        .join(name)
}

/// `read_range` of every weight of `w` over each of `check::ranges`, all done before any
/// `weight_ptr`; then asserts that no lazy copy was made by them and that each read equals
/// the bytes `weight_ptr` exposes. Returns the number of weights.
fn reads_match_weight_ptr(w: &GgufWeights, what: &str) -> usize {
    let spec = w.spec().clone();
    let reads: Vec<_> = spec
        .weight_ids()
        .map(|(id, t)| check::read(w, id, t.bytes(), t.shape[0]))
        .collect();
    assert_eq!(w.copies_made(), 0, "{what}: read_range made a copy");
    for ((id, t), reads) in spec.weight_ids().zip(&reads) {
        let exposed = check::exposed(w, id, t.bytes());
        assert_eq!(exposed, w.tensor(id).unwrap().data, "{what}: {}", t.name);
        check::same(reads, &exposed, &format!("{what}: {}", t.name));
    }
    spec.weights.len()
}

/// Invariant: for plain tensors (mapped in place) and llama's row-permuted q/k (weights and,
/// in llama-q8_0, every quantised type of the K-quant fixture), `read_range` over the whole
/// tensor and over whole-row and row-cutting sub-ranges returns exactly the bytes `weight_ptr`
/// exposes (Hugging Face row order), without making the lazy copies.
#[test]
fn read_range_equals_weight_ptr_for_plain_and_permuted_tensors() {
    for path in [
        data("tiny-llama.gguf"),
        data("tiny-qwen2.gguf"),
        fixture("llama-q8_0.gguf"),
    ] {
        let m = load(&path).unwrap();
        let what = path.display().to_string();
        let permuted = m
            .spec
            .weights
            .iter()
            .filter(|t| t.layout != kiln_core::spec::Layout::Plain);
        assert_eq!(permuted.count() > 0, m.weights.reordered_bytes() > 0, "{what}");
        reads_match_weight_ptr(&m.weights, &what);
    }
}

/// Invariant: reading a llama q/k tensor with `read_range` never makes its reordered copy
/// (the memory `--ram-budget` cannot control), while `weight_ptr` still makes it on demand
/// with the right bytes, and later reads (now served from the copy) agree.
#[test]
fn read_range_of_a_permuted_tensor_makes_no_copy() {
    let m = load(&data("tiny-llama.gguf")).unwrap();
    let w = &m.weights;
    let q = m.spec.weight_named("blk.0.attn_q.weight").unwrap();
    let t = m.spec.weight(q);
    assert!(matches!(t.layout, kiln_core::spec::Layout::RopePermuted { .. }));
    let len = t.bytes();
    let mut streamed = vec![0; len];
    w.read_range(q, 0, &mut streamed).unwrap();
    assert_eq!(w.copies_made(), 0);
    assert!(w.reordered_bytes() >= len);
    // The file's rows are the permuted ones: the read reordered them.
    let (_, raw) = w.raw(&t.name).unwrap();
    assert_ne!(streamed, raw);

    let exposed = check::exposed(w, q, len);
    assert_eq!(w.copies_made(), 1);
    assert_eq!(streamed, exposed);
    let row = len / t.shape[0];
    let mut again = vec![0; 2 * row];
    w.read_range(q, row, &mut again).unwrap();
    assert_eq!(again, exposed[row..3 * row]);
    assert_eq!(w.copies_made(), 1);
}

/// Invariant: ranges outside a tensor and unknown weights are errors naming the file and the
/// tensor, not panics.
#[test]
fn read_range_outside_a_tensor_is_an_error() {
    let path = data("tiny-llama.gguf");
    let m = load(&path).unwrap();
    let q = m.spec.weight_named("blk.0.attn_q.weight").unwrap();
    let len = m.spec.weight(q).bytes();
    let mut buf = vec![0; 16];
    let e = m.weights.read_range(q, len - 8, &mut buf).unwrap_err();
    assert!(
        e.starts_with(&format!("{}: tensor blk.0.attn_q.weight: ", path.display())),
        "{e}"
    );
    let none = kiln_core::WeightId(m.spec.weights.len() as u32);
    assert!(m.weights.read_range(none, 0, &mut buf).is_err());
    assert_eq!(m.weights.copies_made(), 0);
}

/// Invariant: in a split model, tensors held by parts after the first are read from their
/// own part's file, at their offset there: `read_range` equals `weight_ptr` for every weight.
#[test]
fn read_range_reads_split_parts_from_their_own_files() {
    use kiln_testkit::gguf_split::{part_names, split_gguf};
    let dir = tempfile::tempdir().unwrap();
    let parts = split_gguf(&std::fs::read(fixture("llama-q8_0.gguf")).unwrap(), 7, false);
    let names = part_names("model", parts.len());
    for (name, bytes) in names.iter().zip(&parts) {
        std::fs::write(dir.path().join(name), bytes).unwrap();
    }
    let m = load(&dir.path().join(&names[0])).unwrap();
    let header = m.weights.header();
    let later = m
        .spec
        .weights
        .iter()
        .filter(|t| header.tensor(&t.name).unwrap().part >= 1);
    assert!(later.count() > 3);
    assert_eq!(reads_match_weight_ptr(&m.weights, "split"), m.spec.weights.len());
}

/// `bytes` (a GGUF file aligned to 32) rewritten with `general.alignment` 8 and every tensor
/// moved 8 or 16 bytes on, so that no tensor starts at a multiple of 32 in the file.
fn misaligned(bytes: &[u8]) -> Vec<u8> {
    let h = GgufHeader::parse(bytes, Path::new("m")).unwrap();
    assert_eq!(h.alignment, 32);
    let mut kvs = h.metadata.clone();
    kvs.retain(|(k, _)| k != "general.alignment");
    kvs.push(("general.alignment".into(), Value::U32(8)));
    let header = |shift: u64| {
        let mut w = Writer::new(h.version).kvs(&kvs);
        for t in &h.tensors {
            w = w.tensor(&t.name, &t.ne, t.type_id, t.offset + shift);
        }
        w.finish_to(8)
    };
    let len = header(0).len();
    let shift = if (len + 8).is_multiple_of(32) { 16 } else { 8 };
    let mut out = header(shift as u64);
    out.resize(out.len() + shift, 0);
    out.extend(&bytes[h.data_start as usize..]);
    out
}

/// Invariant: a file whose tensors are misaligned (a small `general.alignment`) is streamed
/// from the file as stored, equal to the aligned copies `weight_ptr` makes on demand, and
/// those copies are not made by reading.
#[test]
fn read_range_equals_weight_ptr_for_misaligned_tensors() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("misaligned.gguf");
    std::fs::write(&path, misaligned(&std::fs::read(data("tiny-llama.gguf")).unwrap())).unwrap();
    let m = load(&path).unwrap();
    assert!(m.weights.header().tensors.iter().all(|t| !t.start.is_multiple_of(32)));
    let n = reads_match_weight_ptr(&m.weights, "misaligned");
    // Every tensor is a copy (reordered or re-aligned), each aligned.
    assert_eq!(m.weights.copies_made(), n);
    for (id, _) in m.spec.weight_ids() {
        assert!((m.weights.weight_ptr(id).unwrap() as usize).is_multiple_of(weights::TENSOR_ALIGN));
    }
}
