//! `--precision bf16` (activations rounded to bf16 at each matmul over bf16 weights, pairs of
//! products summed by AVX512-BF16's `vdpbf16ps`) against transformers float32 on every fixture:
//! last-position logits within a stated bound, and every greedy continuation that departs from
//! the reference's does so at a near-tie of the float32 logits (margins printed). Prefill and
//! decode agree bit for bit within the mode. Where the CPU has no AVX512-BF16 the option is one
//! clear error line (checked on such CPUs; skipped with a message elsewhere).

// Test diagnostics go to the harness's stderr; clippy.toml bans the print macros for the CLI.
#![allow(clippy::disallowed_macros)]

use kiln::session::{OpenOptions, Session};
use kiln_core::Precision;
use kiln_text::sampler::argmax;
use std::process::Command;

#[path = "common/goldens.rs"]
mod goldens;
use goldens::{cache_dir, fixture, golden, longrope_original, max_abs_diff, models};

/// Largest |logit difference| from float32 at the last prompt position, and the float32
/// margin below which a greedy step may pick another token. Measured on the fixtures (2-core
/// Zen 5, 2026-12-03): see the printed figures.
const LOGIT_BOUND: f32 = 0.25;

fn has_bf16() -> bool {
    let host = kiln_core::HostCpu::detect();
    host.features.iter().any(|f| f == "avx512_bf16") && host.f32_lanes() >= 16
}

fn open(name: &str, precision: Precision) -> Session {
    let opts = OpenOptions {
        threads: Some(2),
        cache_dir: Some(cache_dir().to_path_buf()),
        precision,
        ..OpenOptions::default()
    };
    Session::open(&fixture(name), &opts).unwrap_or_else(|e| panic!("opening {name}: {e:#}"))
}

/// Logits after prefilling `prompt` and decoding each of `forced` but the last in turn.
fn steps(session: &mut Session, prompt: &[u32], forced: &[u32]) -> Vec<Vec<f32>> {
    session.engine.reset();
    let mut out = vec![session.engine.prefill(prompt).expect("prefill").to_vec()];
    for &t in &forced[..forced.len() - 1] {
        out.push(session.engine.decode(t).expect("decode").to_vec());
    }
    out
}

#[test]
fn bf16_precision_stays_close_to_transformers() {
    if !has_bf16() {
        eprintln!("skipped: this CPU has no AVX512-BF16");
        return;
    }
    for name in models() {
        let mut exact = open(&name, Precision::Exact);
        let mut fast = open(&name, Precision::Bf16);
        let mut worst = 0.0f32;
        for (i, case) in golden(&name).cases.iter().enumerate() {
            let (ids, want) = (&case.prompt_token_ids, &case.greedy_token_ids);
            let got = steps(&mut fast, ids, want);
            let diff = max_abs_diff(&got[0], &case.last_logits);
            worst = worst.max(diff);
            assert!(
                diff <= LOGIT_BOUND,
                "{name} case {i}: logits differ from transformers by {diff}"
            );
            if let Some(t) = got.iter().zip(want).position(|(l, &w)| argmax(l) as u32 != w) {
                let f32_logits = &steps(&mut exact, ids, want)[t];
                let chosen = argmax(&got[t]);
                let margin = f32_logits[want[t] as usize] - f32_logits[chosen];
                eprintln!(
                    "{name} case {i}: step {t} picks {chosen} instead of {}: float32 margin {margin:e}",
                    want[t]
                );
                assert!(
                    margin <= LOGIT_BOUND,
                    "{name} case {i}: step {t} departs from transformers at a float32 margin of {margin}"
                );
            }
        }
        eprintln!("{name} precision bf16: max |logit diff| from transformers = {worst:e}");
    }
}

#[test]
fn bf16_precision_prefill_and_decode_agree() {
    if !has_bf16() {
        eprintln!("skipped: this CPU has no AVX512-BF16");
        return;
    }
    for name in models() {
        let case = golden(&name)
            .cases
            .into_iter()
            .max_by_key(|c| c.prompt_token_ids.len())
            .unwrap();
        let mut s = open(&name, Precision::Bf16);
        let ids = &case.prompt_token_ids;
        let ids = &ids[..longrope_original(&s.spec).map_or(ids.len(), |o| o.min(ids.len()))];
        s.engine.reset();
        let mut decoded = vec![s.engine.prefill(&ids[..1]).unwrap().to_vec()];
        for &t in &ids[1..] {
            decoded.push(s.engine.decode(t).unwrap().to_vec());
        }
        for t in [1, 7, ids.len() / 2, ids.len() - 1] {
            s.engine.reset();
            let prefilled = s.engine.prefill(&ids[..=t]).unwrap().to_vec();
            assert!(
                prefilled == decoded[t],
                "{name}: position {t}: prefill and decode logits differ by {}",
                max_abs_diff(&prefilled, &decoded[t])
            );
        }
    }
}

#[test]
fn bad_or_unsupported_precision_is_one_line() {
    let model = fixture("llama");
    let model = model.to_str().unwrap();
    let mut cases: Vec<(Vec<&str>, &str)> = vec![
        (vec!["--precision", "fp8"], "expected exact or bf16"),
        (
            vec!["--precision", "bf16", "--target-cpu", "x86-64-v3"],
            "not --target-cpu",
        ),
    ];
    if !has_bf16() {
        cases.push((vec!["--precision", "bf16"], "needs a CPU with AVX512-BF16"));
    }
    for (extra, expected) in cases {
        let mut args = vec!["run", model, "-p", "hi", "--max-tokens", "2"];
        args.extend_from_slice(&extra);
        let o = Command::new(env!("CARGO_BIN_EXE_kiln"))
            .args(&args)
            .env("KILN_CACHE_DIR", cache_dir())
            .output()
            .expect("kiln runs");
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success(), "{extra:?} succeeded");
        assert!(err.contains(expected), "{extra:?}: {err}");
        let lines = err
            .lines()
            .filter(|l| !l.trim().is_empty() && !l.starts_with("Usage") && !l.starts_with("For more"))
            .count();
        assert_eq!(lines, 1, "{extra:?}: one line expected: {err}");
    }
}
