//! Phi-3 GGUF files as llama.cpp's converter writes them (`tests/fixtures/gguf/phi3*-bf16.gguf`,
//! made by `scripts/make_gguf_golden.py`): fused tensors read as views, the window, partial
//! rotary and LongRoPE read from metadata and factor tensors, and refusals.

use super::model;
use super::parse::{GgufHeader, Value};
use super::tests::with_meta;
use kiln_core::graph::OpKind;
use kiln_core::{ModelSpec, RopeScaling};
use std::path::{Path, PathBuf};

fn file(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures/gguf")
        .join(name)
}

fn spec(name: &str) -> ModelSpec {
    let path = file(name);
    let bytes = std::fs::read(&path).unwrap();
    let h = GgufHeader::parse(&bytes, &path).unwrap();
    model::spec_from_header(&h, &bytes, &path).unwrap()
}

fn rotary_dims(s: &ModelSpec) -> usize {
    s.ops
        .iter()
        .find_map(|o| match &o.kind {
            OpKind::RopeKv { rotary: Some(r), .. } => Some(r.dims),
            _ => None,
        })
        .unwrap()
}

/// phi3-bf16.gguf: `attn_qkv` split into three row views, the 24-position window on every layer
/// (`phi3.attention.sliding_window`, which llama.cpp ignores but transformers applies).
#[test]
fn phi3_gguf_reads_fused_tensors_and_the_window() {
    let s = spec("phi3-bf16.gguf");
    assert_eq!(s.arch, "phi3");
    assert!(s.attention_windows().iter().all(|&w| w == Some(24)));
    let qkv: Vec<(usize, usize)> = s
        .ops
        .iter()
        .filter_map(|o| match &o.kind {
            OpKind::Linear { w, .. } if s.weight(w.id).name == "blk.0.attn_qkv.weight" => Some((w.row0, w.rows)),
            _ => None,
        })
        .collect();
    assert_eq!(qkv, vec![(0, 64), (64, 64), (128, 64)]);
    assert!(!s.tied_embeddings());
}

/// phi3-longrope-bf16.gguf: 12 rotated dimensions, the factor tensors as LongRoPE with the
/// original context 128 and the converter's attention factor, no window (0), tied head.
#[test]
fn phi3_longrope_gguf_reads_factor_tensors() {
    let s = spec("phi3-longrope-bf16.gguf");
    assert_eq!(rotary_dims(&s), 12);
    let Some(RopeScaling::LongRope {
        short_factor,
        long_factor,
        original_max_position_embeddings,
        attention_factor,
    }) = s.rope.clone().map(|r| r.scaling)
    else {
        panic!("LongRoPE expected")
    };
    assert_eq!(original_max_position_embeddings, 128);
    assert_eq!(short_factor.len(), 6);
    assert_eq!(long_factor[5] as f32, 33.6f32);
    // sqrt(1 + ln(512 / 128) / ln(128)), stored as f32 by the converter.
    assert_eq!(
        attention_factor as f32,
        (1.0f64 + 4f64.ln() / 128f64.ln()).sqrt() as f32
    );
    assert!(s.attention_windows().iter().all(|w| w.is_none()));
    assert!(s.tied_embeddings());
}

/// An odd rotary width, or one the factor tables do not fit, is one line naming it.
#[test]
fn phi3_gguf_refusals() {
    let bytes = std::fs::read(file("phi3-longrope-bf16.gguf")).unwrap();
    let e = with_meta(&bytes, "phi3.rope.dimension_count", Some(Value::U32(11)));
    assert!(e.contains("11 rotary dimensions per head"), "{e}");
    let e = with_meta(&bytes, "phi3.rope.dimension_count", Some(Value::U32(10)));
    assert!(e.contains("short_factor has 6 factors, expected 5"), "{e}");
    let e = with_meta(&bytes, "phi3.rope.scaling.original_context_length", None);
    assert!(e.contains("phi3.rope.scaling.original_context_length"), "{e}");
}
