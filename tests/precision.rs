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
use std::process::Command;

#[path = "common/goldens.rs"]
mod goldens;
use goldens::{cache_dir, check_near_ties, check_prefill_equals_decode, fixture, models};

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

#[test]
fn bf16_precision_stays_close_to_transformers() {
    if !has_bf16() {
        eprintln!("skipped: this CPU has no AVX512-BF16");
        return;
    }
    for name in models() {
        let mut exact = open(&name, Precision::Exact);
        let mut fast = open(&name, Precision::Bf16);
        check_near_ties(&name, "precision bf16", &mut exact, &mut fast, LOGIT_BOUND);
    }
}

#[test]
fn bf16_precision_prefill_and_decode_agree() {
    if !has_bf16() {
        eprintln!("skipped: this CPU has no AVX512-BF16");
        return;
    }
    for name in models() {
        check_prefill_equals_decode(&name, "precision bf16", &mut open(&name, Precision::Bf16));
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
