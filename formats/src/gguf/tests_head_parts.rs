//! [`Layout::HeadParts`] in GGUF files (llama.cpp's `qwen35` `attn_q`: each head's query rows,
//! then its gate rows): [`GgufWeights`] exposes the rows part-major, all queries then all
//! gates, through `weight_ptr` and `read_range` alike, for quantised and float tensors.

use super::tests::Writer;
use super::*;
use crate::head_parts_reference::{HEADS, PARTS, ROWS, part_major};
use crate::pread::check;
use kiln_core::spec::{Layout, Role, Tensor};
use kiln_core::{DType, ModelSpec};
use std::path::Path;

/// `(name, GGUF type id, storage type, columns)` of each test tensor: a q8_0 matrix (one block
/// per row), an f16 matrix and an f32 vector (a bias: a row is one element).
const TENSORS: [(&str, u32, DType, usize); 3] = [
    ("blk.0.attn_q.weight", 8, DType::Q8_0, 32),
    ("blk.0.attn_gate.weight", 1, DType::F16, 6),
    ("blk.0.attn_q.bias", 0, DType::F32, 1),
];

fn shape(cols: usize) -> Vec<usize> {
    if cols == 1 { vec![ROWS] } else { vec![ROWS, cols] }
}

/// A GGUF file holding [`TENSORS`] (bytes counting from a different start each) and a spec
/// (taken from `tiny-llama.gguf`, weights replaced) reading them with `layout`.
fn model(dir: &Path, layout: Layout) -> (std::path::PathBuf, ModelSpec) {
    let mut w = Writer::new(3);
    let mut data = Vec::new();
    let mut weights = Vec::new();
    for (i, (name, type_id, dtype, cols)) in TENSORS.into_iter().enumerate() {
        let shape = shape(cols);
        let ne: Vec<u64> = shape.iter().rev().map(|&n| n as u64).collect();
        w = w.tensor(name, &ne, type_id, data.len() as u64);
        let len = dtype.bytes_for(ROWS * cols);
        data.extend((0..len).map(|b| (b * 7 + 31 * i) as u8));
        data.resize(data.len().next_multiple_of(32), 0);
        let role = if cols == 1 { Role::Vector } else { Role::Matrix };
        weights.push(Tensor {
            name: name.to_string(),
            shape,
            dtype,
            layout,
            role,
            layer: Some(0),
            row_groups: None,
            group_pair: None,
        });
    }
    let mut bytes = w.finish();
    bytes.extend(data);
    let path = dir.join("head-parts.gguf");
    std::fs::write(&path, bytes).unwrap();
    let base = load(&Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/data/gguf/tiny-llama.gguf"))
        .unwrap()
        .spec;
    (path, ModelSpec { weights, ..base })
}

/// Invariant: a `HeadParts` tensor (q8_0, f16 or an f32 vector) is exposed by `weight_ptr`
/// with its rows part-major, every head's query rows then every head's gate rows, and
/// `read_range` over the whole tensor and whole-row and row-cutting ranges returns those same
/// bytes without making the lazy copy (made by `weight_ptr`, then served by later reads).
#[test]
fn head_parts_are_read_part_major_by_weight_ptr_and_read_range() {
    let dir = tempfile::tempdir().unwrap();
    let (path, spec) = model(
        dir.path(),
        Layout::HeadParts {
            heads: HEADS,
            parts: PARTS,
        },
    );
    let w = GgufWeights::from_files(split::open_model(&path).unwrap(), &spec).unwrap();
    let total: usize = spec.weights.iter().map(Tensor::bytes).sum();
    assert_eq!(w.reordered_bytes(), total);
    let reads: Vec<_> = spec
        .weight_ids()
        .map(|(id, t)| check::read(&w, id, t.bytes(), t.shape[0]))
        .collect();
    assert_eq!(w.copies_made(), 0, "read_range made a copy");
    for ((id, t), reads) in spec.weight_ids().zip(&reads) {
        let (_, raw) = w.raw(&t.name).unwrap();
        let expected = part_major(raw);
        assert_ne!(expected, raw, "{}", t.name);
        assert_eq!(check::exposed(&w, id, t.bytes()), expected, "{}", t.name);
        assert!(w.tensor(id).unwrap().reordered);
        check::same(reads, &expected, &t.name);
        // From the copy now: the same bytes.
        check::same(&check::read(&w, id, t.bytes(), t.shape[0]), &expected, &t.name);
    }
    assert_eq!(w.copies_made(), spec.weights.len());
}

/// Invariant: a `HeadParts` tensor whose rows do not split into its heads and parts is refused
/// at load, naming the tensor and the split it needed.
#[test]
fn head_parts_that_do_not_divide_are_refused_at_load() {
    let dir = tempfile::tempdir().unwrap();
    let (path, spec) = model(dir.path(), Layout::HeadParts { heads: 5, parts: 2 });
    let e = GgufWeights::from_files(split::open_model(&path).unwrap(), &spec)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("tensor blk.0.attn_q.weight has 24 rows, not a multiple of 5 heads x 2 parts"),
        "{e}"
    );
}
