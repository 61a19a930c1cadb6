//! The transformers goldens of `scripts/make_golden.py`, shared by the test binaries that
//! check Kiln against them (`golden.rs`, `gguf.rs`, `kv_dtype.rs`): each fixture folder's
//! `golden.json`, the fixture list, and the comparisons they all make.
// Each test binary uses part of this module.
#![allow(dead_code)]

use serde::Deserialize;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

#[derive(Deserialize)]
pub struct Golden {
    pub cases: Vec<Case>,
}

#[derive(Deserialize)]
pub struct Case {
    pub prompt: String,
    pub prompt_token_ids: Vec<u32>,
    pub greedy_token_ids: Vec<u32>,
    pub last_logits: Vec<f32>,
}

/// `tests/fixtures`.
pub fn fixtures_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

pub fn fixture(name: &str) -> PathBuf {
    fixtures_dir().join(name)
}

/// Every fixture folder with a `golden.json` (one per architecture variant), sorted: adding a
/// fixture adds it to the checks. The Llama-family four must be among them, so a moved folder
/// cannot make the checks pass on nothing.
pub fn models() -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(fixtures_dir())
        .expect("tests/fixtures")
        .map(|e| e.expect("fixture entry").path())
        .filter(|p| p.join("golden.json").is_file())
        .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
        .collect();
    names.sort();
    for known in ["llama", "mistral", "qwen2", "qwen3"] {
        assert!(
            names.iter().any(|n| n == known),
            "fixture {known} missing from {names:?}"
        );
    }
    names
}

pub fn golden(name: &str) -> Golden {
    let text = std::fs::read_to_string(fixture(name).join("golden.json")).expect("golden.json");
    serde_json::from_str(&text).expect("golden.json parses")
}

/// One cache folder for the whole test binary, so each library is compiled once.
pub fn cache_dir() -> &'static Path {
    static DIR: OnceLock<tempfile::TempDir> = OnceLock::new();
    DIR.get_or_init(|| tempfile::tempdir().expect("temp cache")).path()
}

pub fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len(), "logit vectors differ in length");
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

/// The pretraining context of a LongRoPE model, past which it takes its long factors.
pub fn longrope_original(spec: &kiln_core::ModelSpec) -> Option<usize> {
    match spec.rope.as_ref().map(|r| &r.scaling) {
        Some(kiln_core::rope::RopeScaling::LongRope {
            original_max_position_embeddings,
            ..
        }) => Some(*original_max_position_embeddings),
        _ => None,
    }
}
