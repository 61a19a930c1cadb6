//! The lowering's invariants on real architectures' graphs: barriers wherever a step touches
//! what an unfinished step wrote (and nowhere else), the fusions decode and the head get, and
//! the barrier counts the documentation states.

use super::*;
use crate::arch::{self, HfConfig};
use crate::spec::ModelSpec;
use serde_json::{Value, json};
use std::collections::BTreeSet;

/// The spec a Hugging Face config describes.
pub(crate) fn spec_of(config: Value) -> ModelSpec {
    let map = config.as_object().expect("a config object");
    let name = map["architectures"][0].as_str().expect("an architecture");
    let arch = arch::by_hf_name(name).expect("a known architecture");
    arch::build(arch, &HfConfig::new(map)).unwrap_or_else(|e| panic!("{name}: {e:?}"))
}

/// Qwen2.5-0.5B's published configuration.
fn qwen25_05b() -> Value {
    json!({
        "architectures": ["Qwen2ForCausalLM"], "hidden_size": 896, "intermediate_size": 4864,
        "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
        "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
        "tie_word_embeddings": true, "vocab_size": 151936, "use_sliding_window": false,
        "sliding_window": 32768, "max_window_layers": 21
    })
}

/// Checks that between two barriers no step reads or writes a buffer another step of the same
/// phase writes (the threads of one phase run its steps without waiting for each other), and
/// that every barrier is needed (removing it would break that).
pub(crate) fn assert_barriers_exact(g: &Graph, what: &str) {
    let buffers = |s: &Step| -> (BTreeSet<BufId>, BTreeSet<BufId>) {
        let writes = s
            .kernel
            .written_args()
            .iter()
            .filter_map(|&i| s.args[i].buf())
            .collect();
        let reads = s.args.iter().filter_map(|a| a.buf()).collect();
        (reads, writes)
    };
    let mut written = BTreeSet::new();
    let mut touched = BTreeSet::new();
    for (i, s) in g.steps.iter().enumerate() {
        let (reads, writes) = buffers(s);
        let hazard = reads.iter().any(|b| written.contains(b)) || writes.iter().any(|b| touched.contains(b));
        assert_eq!(
            s.barrier_before,
            hazard,
            "{what}: step {i} ({}) {} a barrier",
            s.kernel.family(),
            if hazard { "needs" } else { "does not need" }
        );
        if s.barrier_before {
            written.clear();
            touched.clear();
        }
        written.extend(writes.iter().copied());
        touched.extend(reads);
        touched.extend(writes);
    }
}

/// The kernel families of the steps of layer `l`.
pub(crate) fn layer_families(g: &Graph, l: usize) -> Vec<&'static str> {
    g.steps
        .iter()
        .filter(|s| s.layer == Some(l))
        .map(|s| s.kernel.family())
        .collect()
}

#[test]
fn llama_family_steps_in_each_regime() {
    let spec = spec_of(qwen25_05b());
    let prefill = block_graph(&spec, 64);
    assert_eq!(
        layer_families(&prefill, 3),
        [
            "norm",
            "matmul",
            "matmul",
            "matmul",
            "rope_kv",
            "attention",
            "matmul",
            "norm",
            "matmul",
            "matmul",
            "gated_act",
            "matmul"
        ]
    );
    // Decode folds both norms into the matmuls reading them and fuses the gated MLP input.
    let decode = block_graph(&spec, 1);
    assert_eq!(
        layer_families(&decode, 3),
        [
            "matmul",
            "matmul",
            "matmul",
            "rope_kv",
            "attention",
            "matmul",
            "gate_up",
            "matmul"
        ]
    );
    let folded: Vec<bool> = decode
        .steps
        .iter()
        .filter(|s| s.layer == Some(3))
        .filter_map(|s| match &s.kernel {
            Kernel::MatMul { norm, .. } | Kernel::GateUp { norm, .. } => Some(norm.is_some()),
            _ => None,
        })
        .collect();
    // q, k, v and gate_up read the normalised row; o and down the attention and MLP outputs.
    assert_eq!(folded, [true, true, true, false, true, false]);
    // The head: the final norm folded into the output matmul, reading the block's last row.
    let head = head_graph(&spec);
    assert_eq!(head.steps.len(), 1);
    assert!(matches!(
        head.steps[0].kernel,
        Kernel::MatMul {
            norm: Some(_),
            n: 151936,
            ..
        }
    ));
    assert!(matches!(head.steps[0].args[0], Arg::LastRow(_)));
    assert!(head.steps[0].barrier_before);
}

/// The counts `docs/ARCHITECTURE.md` states: 9 barriers per layer in prefill, 6 in decode, and
/// 147 per decoded token on the Qwen2.5-0.5B shape (220 unfused).
#[test]
fn barrier_counts_match_the_documentation() {
    let spec = spec_of(qwen25_05b());
    let per_layer = |g: &Graph| {
        g.steps
            .iter()
            .filter(|s| s.layer == Some(5) && s.barrier_before)
            .count()
    };
    assert_eq!(per_layer(&block_graph(&spec, 64)), 9);
    assert_eq!(per_layer(&block_graph(&spec, 1)), 6);
    let decode = block_graph(&spec, 1).barrier_count() + head_graph(&spec).barrier_count();
    assert_eq!(decode, 147);
}

#[test]
fn barriers_are_exactly_the_hazards() {
    let mut configs = vec![qwen25_05b()];
    configs.extend(crate::arch::tests::published_configs().into_iter().map(|(_, c)| c));
    for config in configs {
        let spec = spec_of(config);
        for (what, g) in [
            ("prefill", block_graph(&spec, 64)),
            ("decode", block_graph(&spec, 1)),
            ("head", head_graph(&spec)),
        ] {
            let mut g = g;
            if what == "head" {
                // The head's first barrier is forced (the block's last step wrote its input
                // from other threads); the rest follow the hazards.
                g.steps[0].barrier_before = false;
            }
            assert_barriers_exact(&g, &format!("{} {what}", spec.arch));
        }
    }
}

/// A norm whose output something other than a linear op reads stays a step, and a norm whose
/// input changes before its last reader is not folded.
#[test]
fn norms_are_folded_only_into_linear_readers_of_an_unchanged_input() {
    let spec = spec_of(qwen25_05b());
    let mut ops = spec.ops.clone();
    // Make the first layer's gated activation read the normalised input directly: its norm
    // now has a non-linear reader.
    let (x, xn) = (spec.buffer_named("x").unwrap(), spec.buffer_named("xn").unwrap());
    let act = ops
        .iter()
        .position(|o| matches!(o.kind, OpKind::GatedAct { .. }))
        .unwrap();
    if let OpKind::GatedAct { up, .. } = &mut ops[act].kind {
        *up = xn;
    }
    let s = ModelSpec { ops, ..spec.clone() };
    let decode = block_graph(&s, 1);
    let l0 = layer_families(&decode, 0);
    assert_eq!(l0.iter().filter(|f| **f == "norm").count(), 1, "{l0:?}");
    assert!(!l0.contains(&"gate_up"), "{l0:?}");
    // The attention norm's input changes (x += ...) before a reader: not folded either.
    let mut ops = spec.ops.clone();
    let o_proj = ops
        .iter()
        .position(|o| matches!(o.kind, OpKind::Linear { accumulate: true, .. }))
        .unwrap();
    let moved = ops.remove(o_proj);
    let first_q = ops
        .iter()
        .position(|o| matches!(o.kind, OpKind::Linear { .. }))
        .unwrap();
    ops.insert(first_q + 1, moved);
    let s = ModelSpec { ops, ..spec };
    let l0 = layer_families(&block_graph(&s, 1), 0);
    assert_eq!(l0[0], "norm", "{l0:?}");
    assert!(s.ops.iter().any(|o| o.kind.writes().contains(&x)));
}

/// The chunked head covers the head's rows exactly once, in order: each chunk reads its rows
/// of the matrix (and of a bias), writes its part of the logits row, keeps the folded norm,
/// and the last chunk takes the remainder; a chunk as large as the vocabulary is the whole head.
#[test]
fn chunked_head_covers_every_row_once() {
    let mut config = qwen25_05b();
    config["vocab_size"] = json!(1000);
    let spec = spec_of(config);
    let whole = head_graph(&spec);
    let chunked = chunked_head_graph(&spec, 384);
    assert_eq!(chunked.steps.len(), 3);
    let mut next = 0;
    for step in &chunked.steps {
        let Kernel::MatMul { n, norm, .. } = step.kernel else {
            panic!("a chunk is a matmul")
        };
        assert!(norm.is_some(), "the final norm stays folded into every chunk");
        let Arg::Weight(w) = step.args[1] else {
            panic!("the matrix")
        };
        assert_eq!((w.row0, w.rows), (next, n));
        assert_eq!(step.args[2], Arg::BufAt(spec.buffer_named(LOGITS).unwrap(), next));
        assert_eq!(step.args[0], whole.steps[0].args[0]);
        assert!(step.barrier_before);
        next += n;
    }
    assert_eq!(next, 1000);
    assert_eq!(chunked_head_graph(&spec, 1000), whole);
}
