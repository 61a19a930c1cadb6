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

/// How far the logits of the same tokens may move when the calls split them differently
/// (prefill against decode, a prompt in one call against two, rows batched with others):
/// nothing, since every output is the same chain of operations in every regime, except in a
/// recurrent model, whose prefill runs the delta rule in chunks of rows (the WY form) and
/// decode one token at a time, equal to rounding (qwen3_5: measured up to 1.13e-4, where
/// `transformers`' own prefill and decode differ by up to 5.6e-4;
/// `scripts/recurrent_split_reference.py`).
pub fn split_bound(spec: &kiln_core::ModelSpec) -> f32 {
    if spec.is_recurrent() { 2e-4 } else { 0.0 }
}

/// Asserts `got` and `want` are within [`split_bound`] of each other.
pub fn assert_split_agree(what: &str, spec: &kiln_core::ModelSpec, got: &[f32], want: &[f32]) {
    assert_within(what, got, want, split_bound(spec));
}

/// Asserts `got` and `want` have the same length and differ by at most `bound` anywhere.
pub fn assert_within(what: &str, got: &[f32], want: &[f32], bound: f32) {
    let diff = max_abs_diff(got, want);
    assert!(
        diff <= bound && got.len() == want.len(),
        "{what}: logits differ by {diff} (bound {bound:e})"
    );
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

/// Logits after prefilling `prompt` and decoding each of `forced` but the last in turn: the
/// distribution each greedy step chose from, teacher-forced on `forced`.
pub fn steps(session: &mut kiln::session::Session, prompt: &[u32], forced: &[u32]) -> Vec<Vec<f32>> {
    session.engine.reset();
    let mut out = vec![session.engine.prefill(prompt).expect("prefill").to_vec()];
    for &t in &forced[..forced.len() - 1] {
        out.push(session.engine.decode(t).expect("decode").to_vec());
    }
    out
}

/// Checks `approx`, a session of fixture `name` in a less exact mode (`what`), against its
/// goldens: last-prompt logits within `bound` of transformers float32, and the first greedy step
/// whose choice differs from the reference's a near-tie of the float32 logits (`exact`'s, at
/// most `bound` apart; each departure is printed with its margin). Returns the largest logit
/// difference.
pub fn check_near_ties(
    name: &str,
    what: &str,
    exact: &mut kiln::session::Session,
    approx: &mut kiln::session::Session,
    bound: f32,
) -> f32 {
    use kiln_text::sampler::argmax;
    let mut worst = 0.0f32;
    for (i, case) in golden(name).cases.iter().enumerate() {
        let (ids, want) = (&case.prompt_token_ids, &case.greedy_token_ids);
        let got = steps(approx, ids, want);
        let diff = max_abs_diff(&got[0], &case.last_logits);
        worst = worst.max(diff);
        assert!(
            diff <= bound,
            "{name} {what} case {i}: logits differ from transformers by {diff}"
        );
        if let Some(t) = got.iter().zip(want).position(|(l, &w)| argmax(l) as u32 != w) {
            let f32_logits = &steps(exact, ids, want)[t];
            let chosen = argmax(&got[t]);
            let margin = f32_logits[want[t] as usize] - f32_logits[chosen];
            eprintln!(
                "{name} {what} case {i}: step {t} picks {chosen} instead of {}: float32 margin {margin:e}",
                want[t]
            );
            assert!(
                margin <= bound,
                "{name} {what} case {i}: step {t} departs from transformers at a float32 margin of {margin}"
            );
        }
    }
    eprintln!("{name} {what}: max |logit diff| from transformers = {worst:e}");
    worst
}

/// Prefill and decode give bitwise the same logits (a recurrent model's within
/// [`split_bound`]): `session` (of fixture `name`, in mode `what`) prefills the longest golden
/// prompt up to several positions and decodes it token by token. LongRoPE switches tables once
/// a call passes its original context, and cached keys keep the rotation they were given, so
/// only positions before that switch are compared (the golden tests cover the crossing).
pub fn check_prefill_equals_decode(name: &str, what: &str, session: &mut kiln::session::Session) {
    let bound = split_bound(&session.spec);
    check_prefill_equals_decode_within(name, what, session, bound);
}

/// [`check_prefill_equals_decode`] with the difference allowed given.
pub fn check_prefill_equals_decode_within(name: &str, what: &str, session: &mut kiln::session::Session, bound: f32) {
    let case = golden(name)
        .cases
        .into_iter()
        .max_by_key(|c| c.prompt_token_ids.len())
        .expect("a golden case");
    let ids = &case.prompt_token_ids;
    let ids = &ids[..longrope_original(&session.spec).map_or(ids.len(), |o| o.min(ids.len()))];
    let positions = [1, 7, ids.len() / 2, ids.len() - 1];
    check_prefill_equals_decode_at_within(&format!("{name} {what}"), session, ids, &positions, bound);
}

/// Prefill of `ids[..=t]` gives the logits of prefilling `ids[0]` and decoding the rest one
/// token at a time, at each position `t` of `positions`: bitwise, or within [`split_bound`].
pub fn check_prefill_equals_decode_at(
    what: &str,
    session: &mut kiln::session::Session,
    ids: &[u32],
    positions: &[usize],
) {
    let bound = split_bound(&session.spec);
    check_prefill_equals_decode_at_within(what, session, ids, positions, bound);
}

/// [`check_prefill_equals_decode_at`] with the difference allowed given.
pub fn check_prefill_equals_decode_at_within(
    what: &str,
    session: &mut kiln::session::Session,
    ids: &[u32],
    positions: &[usize],
    bound: f32,
) {
    session.engine.reset();
    let mut decoded = vec![session.engine.prefill(&ids[..1]).expect("prefill").to_vec()];
    for &t in &ids[1..] {
        decoded.push(session.engine.decode(t).expect("decode").to_vec());
    }
    for &t in positions {
        session.engine.reset();
        let prefilled = session.engine.prefill(&ids[..=t]).expect("prefill").to_vec();
        assert_within(
            &format!("{what}: position {t}: prefill and decode"),
            &prefilled,
            &decoded[t],
            bound,
        );
    }
}
