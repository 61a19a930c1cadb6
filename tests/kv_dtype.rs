//! `--kv-dtype f16|bf16`: KV caches stored narrow. Against transformers float32 on every
//! fixture (the goldens of `scripts/make_golden.py`): last-position logits within a bound
//! stated per type, and every greedy continuation that departs from the reference's does so
//! at a near-tie of the float32 logits (the margin is printed). Within a narrow mode, prefill
//! and decode still agree bit for bit. The option changes the cache key, shows in `kiln info`,
//! and a value that is not a type is one clear error line.

// Test diagnostics go to the harness's stderr; clippy.toml bans the print macros for the CLI.
#![allow(clippy::disallowed_macros)]

use kiln::session::{OpenOptions, Session};
use kiln_core::spec::Elem;
use std::process::{Command, Output};

#[path = "common/goldens.rs"]
mod goldens;
use goldens::{cache_dir, check_near_ties, check_prefill_equals_decode, fixture, golden, max_abs_diff, models, steps};

/// Largest |logit difference| from float32 allowed at the last prompt position: keys and
/// values rounded to 11 (f16) or 8 (bf16) significant bits. Measured on the fixtures (Zen 5,
/// 2026-12-03): at most 3.0e-2 with f16 and 1.5e-1 with bf16. It also bounds the float32
/// margin at which a greedy step may pick another token (a flip needs the rounding to move the
/// two logits apart by the margin): f16 picked every token float32 picks; bf16 departed in 8
/// greedy cases of the 12 fixtures, at margins from 3.1e-3 to 1.3e-1.
fn logit_bound(elem: Elem) -> f32 {
    match elem {
        Elem::F16 => 5e-2,
        _ => 2e-1,
    }
}

fn open(name: &str, kv: Option<Elem>) -> Session {
    open_for(name, kv, None)
}

fn open_for(name: &str, kv: Option<Elem>, target_cpu: Option<&str>) -> Session {
    let opts = OpenOptions {
        threads: Some(2),
        cache_dir: Some(cache_dir().to_path_buf()),
        kv_dtype: kv,
        target_cpu: target_cpu.map(str::to_string),
        ..OpenOptions::default()
    };
    Session::open(&fixture(name), &opts).unwrap_or_else(|e| panic!("opening {name}: {e:#}"))
}

#[test]
fn narrow_caches_stay_close_to_transformers() {
    for name in models() {
        let mut exact = open(&name, None);
        for elem in [Elem::F16, Elem::Bf16] {
            let mut narrow = open(&name, Some(elem));
            assert_eq!(narrow.spec.kv_elem(), elem);
            check_near_ties(
                &name,
                &format!("kv {elem:?}"),
                &mut exact,
                &mut narrow,
                logit_bound(elem),
            );
        }
    }
}

/// The AVX2 + FMA code (no AVX-512 conversions: f16 through F16C, bf16 rounded in integer
/// arithmetic) stays within the same bounds, where this CPU can run it.
#[test]
fn narrow_caches_in_avx2_code_stay_close_to_transformers() {
    if let Err(why) = kiln_core::HostCpu::detect().x86_level("x86-64-v3") {
        eprintln!("skipped: {why}");
        return;
    }
    for name in ["llama", "qwen2"] {
        for elem in [Elem::F16, Elem::Bf16] {
            let mut s = open_for(name, Some(elem), Some("x86-64-v3"));
            for (i, case) in golden(name).cases.iter().enumerate() {
                let got = steps(&mut s, &case.prompt_token_ids, &case.greedy_token_ids[..1]);
                let diff = max_abs_diff(&got[0], &case.last_logits);
                assert!(
                    diff <= logit_bound(elem),
                    "{name} {elem:?} x86-64-v3 case {i}: logits differ from transformers by {diff}"
                );
            }
        }
    }
}

#[test]
fn narrow_caches_prefill_and_decode_agree() {
    for name in models() {
        for elem in [Elem::F16, Elem::Bf16] {
            check_prefill_equals_decode(&name, &format!("kv {elem:?}"), &mut open(&name, Some(elem)));
        }
    }
}

fn kiln(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kiln"))
        .args(args)
        .env("KILN_CACHE_DIR", cache_dir())
        .output()
        .expect("kiln runs")
}

#[test]
fn kv_dtype_changes_the_key_shows_in_info_and_rejects_bad_values() {
    let model = fixture("llama");
    let model = model.to_str().unwrap();
    let info = |extra: &[&str]| -> serde_json::Value {
        let mut args = vec!["info", model, "--json"];
        args.extend_from_slice(extra);
        let o = kiln(&args);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        serde_json::from_slice(&o.stdout).expect("info JSON")
    };
    let (f32, f16, bf16) = (info(&[]), info(&["--kv-dtype", "f16"]), info(&["--kv-dtype", "bf16"]));
    assert_eq!(f32["kv_dtype"], "f32");
    assert_eq!(f16["kv_dtype"], "f16");
    assert_eq!(bf16["kv_dtype"], "bf16");
    assert_eq!(info(&["--kv-dtype", "f32"])["cache_key"], f32["cache_key"]);
    assert_ne!(f16["cache_key"], f32["cache_key"]);
    assert_ne!(bf16["cache_key"], f16["cache_key"]);

    let o = kiln(&["run", model, "-p", "hi", "--kv-dtype", "f8"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success());
    assert!(err.contains("expected f32, f16 or bf16"), "{err}");
    let lines = err
        .lines()
        .filter(|l| !l.trim().is_empty() && !l.starts_with("Usage") && !l.starts_with("For more"))
        .count();
    assert_eq!(lines, 1, "one line expected: {err}");
}
