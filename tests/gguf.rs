//! GGUF files end to end. The fixtures in `tests/fixtures/gguf/` were made from the Hugging Face
//! golden models by llama.cpp's own converter and quantiser (`scripts/make_gguf_golden.py`), so
//! the bf16 files must reproduce the transformers goldens — which checks the llama-architecture
//! q/k permutation is undone — and the quantised files must give the same numbers whether the
//! quantised kernels read them or the weights are dequantised at load. Among them is Qwen3.5's
//! (`qwen35`), whose converter rewrites the DeltaNet tensors (value heads tiled, `ssm_a` negated,
//! norms as `1 + w`).

// Test diagnostics go to the harness's stderr; clippy.toml bans the print macros for the CLI.
#![allow(clippy::disallowed_macros)]

use kiln::session::{OpenOptions, Session};
use kiln_core::DType;
use kiln_text::sampler::argmax;
use std::path::Path;
use std::process::Command;

#[path = "common/goldens.rs"]
mod goldens;
use goldens::{Golden, cache_dir, fixtures_dir as fixtures};

fn open(file: &str, dequantize: Option<DType>) -> Session {
    let opts = OpenOptions {
        threads: Some(2),
        cache_dir: Some(cache_dir().to_path_buf()),
        dequantize,
        ..OpenOptions::default()
    };
    Session::open(&fixtures().join("gguf").join(file), &opts).unwrap_or_else(|e| panic!("opening {file}: {e:#}"))
}

fn greedy(session: &mut Session, prompt: &[u32], n: usize) -> (Vec<u32>, Vec<f32>) {
    session.engine.reset();
    let logits = session.engine.prefill(prompt).expect("prefill").to_vec();
    let mut out = vec![argmax(&logits) as u32];
    while out.len() < n {
        let l = session.engine.decode(*out.last().unwrap()).expect("decode");
        out.push(argmax(l) as u32);
    }
    (out, logits)
}

#[test]
fn llama_cpp_converted_files_reproduce_the_transformers_goldens() {
    // Every `NAME-bf16.gguf` converted from the Hugging Face fixture `NAME`. (Not mistral:
    // llama.cpp's converter drops Mistral's sliding window, so its GGUF means full attention and
    // rightly differs from transformers on prompts longer than the window.)
    for name in converted_fixtures() {
        let name = name.as_str();
        let golden: Golden =
            serde_json::from_str(&std::fs::read_to_string(fixtures().join(name).join("golden.json")).unwrap()).unwrap();
        let mut session = open(&format!("{name}-bf16.gguf"), None);
        let mut worst = 0.0f32;
        for (i, case) in golden.cases.iter().enumerate() {
            // The tokenizer rebuilt from the GGUF metadata encodes like transformers.
            let ids = session.tokenizer.encode(&case.prompt, true).unwrap();
            assert_eq!(ids, case.prompt_token_ids, "{name} case {i}: GGUF tokenizer differs");
            let (tokens, logits) = greedy(&mut session, &case.prompt_token_ids, case.greedy_token_ids.len());
            let diff = logits
                .iter()
                .zip(&case.last_logits)
                .map(|(a, b)| (a - b).abs())
                .fold(0.0, f32::max);
            worst = worst.max(diff);
            assert!(diff <= 1e-3, "{name} case {i}: logits differ by {diff}");
            assert_eq!(
                tokens, case.greedy_token_ids,
                "{name} case {i}: greedy continuation differs"
            );
        }
        eprintln!("{name}-bf16.gguf: max |logit diff| vs transformers = {worst:e}");
    }
}

#[test]
fn phi2_fused_qkv_reads_the_same_weights_through_row_views() {
    // The same phi fixture with each layer's q, k and v stored as one `attn_qkv` tensor (as
    // llama.cpp converts the original phi-2 checkpoints): q, k and v become row views of it,
    // and every number must be the same as with separate tensors.
    let golden: Golden =
        serde_json::from_str(&std::fs::read_to_string(fixtures().join("phi/golden.json")).unwrap()).unwrap();
    let mut fused = open("phi-fused-qkv.gguf", None);
    let mut separate = open("phi-bf16.gguf", None);
    assert!(fused.spec.weight_named("blk.1.attn_qkv.weight").is_some());
    assert!(fused.spec.weight_named("blk.1.attn_q.weight").is_none());
    for (i, case) in golden.cases.iter().enumerate() {
        let (a_tokens, a_logits) = greedy(&mut fused, &case.prompt_token_ids, case.greedy_token_ids.len());
        let (_, b_logits) = greedy(&mut separate, &case.prompt_token_ids, 1);
        assert_eq!(a_logits, b_logits, "phi case {i}: fused and separate q/k/v differ");
        assert_eq!(
            a_tokens, case.greedy_token_ids,
            "phi case {i}: greedy continuation differs"
        );
    }
}

/// The fixtures with a bf16 GGUF made by llama.cpp's converter (`NAME-bf16.gguf` beside the
/// folder `NAME`), sorted; llama, qwen2 and qwen3_5 must be among them.
fn converted_fixtures() -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(fixtures().join("gguf"))
        .expect("tests/fixtures/gguf")
        .filter_map(|e| {
            let file = e.expect("entry").file_name().to_string_lossy().into_owned();
            file.strip_suffix("-bf16.gguf").map(str::to_string)
        })
        .filter(|n| fixtures().join(n).join("golden.json").is_file())
        .collect();
    names.sort();
    for known in ["llama", "qwen2", "qwen3_5"] {
        assert!(
            names.iter().any(|n| n == known),
            "{known}-bf16.gguf missing from {names:?}"
        );
    }
    names
}

#[test]
fn qwen35_gguf_reads_the_converters_layer_flags_and_tiled_value_heads() {
    // What the golden comparison above exercises in qwen3_5-bf16.gguf: four value heads over two
    // key heads, so the converter's tiled value-head order matters, and the per-block recurrent
    // flags it writes from layer_types.
    use kiln_core::graph::OpKind;
    use kiln_core::ops::{DecayForm, HeadOrder};
    let path = fixtures().join("gguf/qwen3_5-bf16.gguf");
    let (bytes, header) = kiln_formats::gguf::open(&path).unwrap();
    assert!(header.get("qwen35.attention.recurrent_layers").is_some());
    let spec = kiln_formats::gguf::model::spec_from_header(&header, &bytes, &path).unwrap();
    let full: Vec<usize> = spec
        .ops
        .iter()
        .filter_map(|o| match (&o.kind, o.layer) {
            (OpKind::Attention { .. }, Some(l)) => Some(l),
            _ => None,
        })
        .collect();
    assert_eq!(full, [3, 7]);
    let nets: Vec<_> = spec
        .ops
        .iter()
        .filter_map(|o| match &o.kind {
            OpKind::DeltaNet(d) => Some((d.k_heads, d.v_heads, d.v_dim, d.decay, d.order)),
            _ => None,
        })
        .collect();
    assert_eq!(nets.len(), 6);
    assert!(
        nets.iter()
            .all(|n| *n == (2, 4, 24, DecayForm::Negated, HeadOrder::Tiled))
    );
}

fn kiln(cache: &Path, args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_kiln"))
        .args(args)
        .env("KILN_CACHE_DIR", cache)
        .output()
        .expect("kiln runs")
}

fn expect_gguf_error(bytes: &[u8], needles: &[&str]) {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("broken.gguf");
    std::fs::write(&file, bytes).unwrap();
    let o = kiln(
        dir.path(),
        &["run", file.to_str().unwrap(), "--prompt", "hi", "--max-tokens", "2"],
    );
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success());
    assert!(!err.contains("panicked"), "{err}");
    assert_eq!(err.lines().count(), 1, "one line: {err}");
    assert!(err.starts_with("error: ") && err.contains("broken.gguf"), "{err}");
    for n in needles {
        assert!(err.contains(n), "error should mention {n:?}: {err}");
    }
}

#[test]
fn broken_gguf_files_give_one_line_errors() {
    let good = std::fs::read(fixtures().join("gguf/llama-q8_0.gguf")).unwrap();
    let mut bad_magic = good.clone();
    bad_magic[..4].copy_from_slice(b"GGML");
    expect_gguf_error(&bad_magic, &["magic"]);
    let mut bad_version = good.clone();
    bad_version[4..8].copy_from_slice(&1u32.to_le_bytes());
    expect_gguf_error(&bad_version, &["version 1"]);
    expect_gguf_error(&good[..good.len() - 4096], &["past the end"]);
}

#[test]
fn quantised_kernels_match_dequantising_at_load() {
    let golden: Golden =
        serde_json::from_str(&std::fs::read_to_string(fixtures().join("llama/golden.json")).unwrap()).unwrap();
    for file in [
        "llama-q8_0.gguf",
        "llama-q4_0.gguf",
        "llama-q4_1.gguf",
        "llama-q5_0.gguf",
        "llama-q5_1.gguf",
    ] {
        let mut quantised = open(file, None);
        let mut dequantised = open(file, Some(DType::F32));
        assert!(
            quantised.spec.weights.iter().any(|w| w.dtype.is_quantized()),
            "{file}: the quantised kernels are exercised"
        );
        for case in &golden.cases {
            let (a_tokens, a_logits) = greedy(&mut quantised, &case.prompt_token_ids, 16);
            let (b_tokens, b_logits) = greedy(&mut dequantised, &case.prompt_token_ids, 16);
            let diff = a_logits
                .iter()
                .zip(&b_logits)
                .map(|(a, b)| (a - b).abs())
                .fold(0.0, f32::max);
            // Same dequantised values, same accumulation order: the kernels agree exactly.
            assert_eq!(
                diff, 0.0,
                "{file}: quantised kernels and dequantised weights differ by {diff}"
            );
            assert_eq!(a_tokens, b_tokens, "{file}: greedy continuations differ");
        }
    }
}
