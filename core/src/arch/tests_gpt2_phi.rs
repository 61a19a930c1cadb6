//! GPT-2 and Phi on their published configurations (dimensions, tensors, parameter counts equal
//! to `transformers`' own count of the published models), the graphs their blocks lower to, and
//! the one-line refusals of what they do not implement.

use super::ArchError;
use crate::Kernel;
use crate::graph::tests::{assert_barriers_exact, layer_families, spec_of};
use crate::graph::{Graph, OpKind, block_graph, head_graph};
use crate::spec::{Layout, ModelSpec};
use serde_json::{Value, json};

/// `openai-community/gpt2`'s `config.json` (the fields that matter).
fn gpt2_124m() -> Value {
    json!({
        "activation_function": "gelu_new", "architectures": ["GPT2LMHeadModel"],
        "bos_token_id": 50256, "eos_token_id": 50256, "layer_norm_epsilon": 1e-05,
        "model_type": "gpt2", "n_ctx": 1024, "n_embd": 768, "n_head": 12, "n_layer": 12,
        "n_positions": 1024, "vocab_size": 50257
    })
}

/// `microsoft/phi-2`'s `config.json` (the fields that matter).
fn phi_2() -> Value {
    json!({
        "architectures": ["PhiForCausalLM"], "hidden_act": "gelu_new", "hidden_size": 2560,
        "intermediate_size": 10240, "layer_norm_eps": 1e-05, "max_position_embeddings": 2048,
        "model_type": "phi", "num_attention_heads": 32, "num_hidden_layers": 32,
        "num_key_value_heads": 32, "partial_rotary_factor": 0.4, "qk_layernorm": false,
        "rope_scaling": null, "rope_theta": 10000.0, "tie_word_embeddings": false,
        "vocab_size": 51200
    })
}

fn with(mut config: Value, key: &str, value: Value) -> Value {
    config[key] = value;
    config
}

/// The error building `config` gives.
fn refusal(config: Value) -> ArchError {
    let map = config.as_object().unwrap();
    let arch = super::by_hf_name(map["architectures"][0].as_str().unwrap()).unwrap();
    super::build(arch, &super::HfConfig::new(map)).expect_err("refused")
}

fn attention_scales(s: &ModelSpec) -> Vec<f32> {
    s.ops
        .iter()
        .filter_map(|o| match &o.kind {
            OpKind::Attention { scale, .. } => Some(scale.get()),
            _ => None,
        })
        .collect()
}

#[test]
fn gpt2_124m_has_the_published_shape() {
    let s = spec_of(gpt2_124m());
    let d = &s.dims;
    assert_eq!(
        (
            d.hidden_size,
            d.num_heads,
            d.head_dim,
            d.intermediate_size,
            d.max_position_embeddings,
            d.vocab_size
        ),
        (768, 12, 64, 3072, 1024, 50257)
    );
    assert!(s.tied_embeddings());
    // wte, wpe, 12 per block (2 LayerNorms, 4 Conv1D, each with a bias), ln_f weight and bias.
    assert_eq!(s.weights.len(), 2 + 12 * 12 + 2);
    // transformers: `GPT2LMHeadModel(GPT2Config())` on the meta device counts 124,439,808.
    assert_eq!(s.param_count(), 124_439_808);
    assert!(s.rope.is_none());
    assert_eq!(attention_scales(&s), vec![0.125; 12]);
    // c_attn is a Conv1D: stored [in, out], read [out, in]; q, k, v are its row thirds.
    let c_attn = s.weight_named("transformer.h.3.attn.c_attn.weight").unwrap();
    let t = s.weight(c_attn);
    assert_eq!(
        (t.layout, t.shape.clone(), t.stored_shape()),
        (Layout::Transposed, vec![2304, 768], vec![768, 2304])
    );
    let views: Vec<(usize, usize)> = s
        .ops
        .iter()
        .filter_map(|o| match &o.kind {
            OpKind::Linear { w, bias: Some(b), .. } if w.id == c_attn => Some((w.row0, b.row0)),
            _ => None,
        })
        .collect();
    assert_eq!(views, [(0, 0), (768, 768), (1536, 1536)]);
    // The learned positions are added by the embedding.
    assert!(matches!(s.ops[0].kind, OpKind::Embed { positions: Some(_), .. }));
}

#[test]
fn gpt2_attention_scale_options() {
    // scale_attn_weights false: no 1/sqrt(head_dim); by inverse layer index: 1/(layer + 1).
    let unscaled = spec_of(with(gpt2_124m(), "scale_attn_weights", json!(false)));
    assert_eq!(attention_scales(&unscaled), vec![1.0; 12]);
    let inverse = spec_of(with(gpt2_124m(), "scale_attn_by_inverse_layer_idx", json!(true)));
    let expected: Vec<f32> = (0..12).map(|l| (0.125f64 / (l + 1) as f64) as f32).collect();
    assert_eq!(attention_scales(&inverse), expected);
    // reorder_and_upcast_attn changes nothing in f32; n_inner sets the MLP width.
    let reordered = spec_of(with(gpt2_124m(), "reorder_and_upcast_attn", json!(true)));
    assert_eq!(reordered, spec_of(gpt2_124m()));
    assert_eq!(
        spec_of(with(gpt2_124m(), "n_inner", json!(1000)))
            .dims
            .intermediate_size,
        1000
    );
}

#[test]
fn gpt2_refusals_name_the_field() {
    let e = refusal(with(gpt2_124m(), "activation_function", json!("relu")));
    assert!(
        matches!(&e, ArchError::Unsupported { what } if what.contains("activation_function 'relu'")),
        "{e:?}"
    );
    let e = refusal(with(gpt2_124m(), "n_head", json!(7)));
    assert!(
        matches!(&e, ArchError::Config { message } if message.contains("n_head")),
        "{e:?}"
    );
    let e = refusal(with(gpt2_124m(), "scale_attn_weights", json!("yes")));
    assert!(
        matches!(&e, ArchError::Invalid { field, .. } if field == "scale_attn_weights"),
        "{e:?}"
    );
}

#[test]
fn phi_2_has_the_published_shape() {
    let s = spec_of(phi_2());
    let d = &s.dims;
    assert_eq!(
        (
            d.hidden_size,
            d.num_heads,
            d.num_kv_heads,
            d.head_dim,
            d.intermediate_size
        ),
        (2560, 32, 32, 80, 10240)
    );
    assert_eq!((d.max_position_embeddings, d.vocab_size), (2048, 51200));
    assert!(!s.tied_embeddings());
    // embedding, 14 per block (LayerNorm, q, k, v, dense, fc1, fc2, each with a bias), final
    // LayerNorm weight and bias, lm_head weight and bias.
    assert_eq!(s.weights.len(), 1 + 32 * 14 + 2 + 2);
    // transformers: `PhiForCausalLM` of this config on the meta device counts 2,779,683,840.
    assert_eq!(s.param_count(), 2_779_683_840);
    // 0.4 of 80: 32 rotated dimensions (16 frequencies), the other 48 passed through.
    let rotary = s.ops.iter().find_map(|o| match &o.kind {
        OpKind::RopeKv { rotary, .. } => rotary.clone(),
        _ => None,
    });
    let rotary = rotary.expect("a rotary embedding");
    assert_eq!((rotary.dims, rotary.inv_freq.len()), (32, 16));
    assert_eq!(rotary.pairing, crate::ops::Pairing::Half);
    // The frequencies are those of a 32-dimensional rotary embedding: 10000^(-2i/32).
    assert_eq!(
        f32::from_bits(rotary.inv_freq[1]),
        (1.0 / 10000f64.powf(2.0 / 32.0)) as f32
    );
}

#[test]
fn phi_rotary_factor_comes_from_the_rope_dict_then_the_top_level_then_half() {
    let dims = |c: Value| {
        spec_of(c).ops.iter().find_map(|o| match &o.kind {
            OpKind::RopeKv { rotary, .. } => rotary.as_ref().map(|r| r.dims),
            _ => None,
        })
    };
    let mut absent = phi_2();
    absent.as_object_mut().unwrap().remove("partial_rotary_factor");
    assert_eq!(dims(absent.clone()), Some(40));
    let dict = with(
        phi_2(),
        "rope_parameters",
        json!({"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.2}),
    );
    assert_eq!(dims(dict), Some(16));
}

#[test]
fn phi_refusals_name_the_field() {
    let e = refusal(with(phi_2(), "qk_layernorm", json!(true)));
    assert!(
        matches!(&e, ArchError::Unsupported { what } if what.starts_with("qk_layernorm true")),
        "{e:?}"
    );
    // 0.3125 of 80 is 25: an odd number of dimensions cannot be rotated in pairs.
    let e = refusal(with(phi_2(), "partial_rotary_factor", json!(0.3125)));
    assert!(
        matches!(&e, ArchError::Unsupported { what } if what.contains("partial_rotary_factor 0.3125")),
        "{e:?}"
    );
    let e = refusal(with(phi_2(), "partial_rotary_factor", json!(1.5)));
    assert!(
        matches!(&e, ArchError::Unsupported { what } if what.contains("partial_rotary_factor 1.5")),
        "{e:?}"
    );
    let e = refusal(with(phi_2(), "rope_scaling", json!({"type": "dynamic", "factor": 2.0})));
    assert!(
        matches!(&e, ArchError::Unsupported { what } if what.contains("rope_type 'dynamic'")),
        "{e:?}"
    );
    let e = refusal(with(phi_2(), "hidden_act", json!("gelu_10")));
    assert!(
        matches!(&e, ArchError::Unsupported { what } if what.contains("hidden_act 'gelu_10'")),
        "{e:?}"
    );
}

/// Whether each matmul of layer `l` reads its input through a folded norm.
fn folded(g: &Graph, l: usize) -> Vec<bool> {
    g.steps
        .iter()
        .filter(|s| s.layer == Some(l))
        .filter_map(|s| match &s.kernel {
            Kernel::MatMul { norm, .. } => Some(norm.is_some()),
            _ => None,
        })
        .collect()
}

fn barriers(g: &Graph, l: usize) -> usize {
    g.steps
        .iter()
        .filter(|s| s.layer == Some(l) && s.barrier_before)
        .count()
}

#[test]
fn phi_parallel_block_folds_its_norm_into_all_four_readers() {
    let spec = spec_of(phi_2());
    let prefill = block_graph(&spec, 64);
    let m = "matmul";
    assert_eq!(
        layer_families(&prefill, 2),
        ["norm", m, m, m, m, m, "rope_kv", "attention", m]
    );
    // Decode: q, k, v and fc1 normalise x themselves (nothing writes x before fc1 reads the
    // norm); fc2 (+= x) runs beside the rotary embedding; dense (+= x) last.
    let decode = block_graph(&spec, 1);
    assert_eq!(layer_families(&decode, 2), [m, m, m, m, m, "rope_kv", "attention", m]);
    assert_eq!(folded(&decode, 2), [true, true, true, true, false, false]);
    // Barriers: [q k v fc1] | [fc2 rope_kv] | [attention] | [dense]; prefill adds the norm's.
    assert_eq!(barriers(&decode, 2), 4);
    assert_eq!(barriers(&prefill, 2), 5);
    for (what, g) in [("prefill", prefill), ("decode", decode)] {
        assert_barriers_exact(&g, &format!("phi {what}"));
    }
    // The head: the final LayerNorm folded into the biased output matmul.
    let head = head_graph(&spec);
    assert_eq!(head.steps.len(), 1);
    assert!(matches!(
        head.steps[0].kernel,
        Kernel::MatMul {
            norm: Some(_),
            bias: Some(_),
            n: 51200,
            ..
        }
    ));
}

#[test]
fn phi_norm_is_not_folded_when_the_residual_changes_before_a_reader() {
    // The block written in the reference's order (attention's dense += x before fc1 reads the
    // norm's output) must keep the norm as a step: fc1 would otherwise normalise a changed x.
    let spec = spec_of(phi_2());
    let mut ops = spec.ops.clone();
    let layer0: Vec<usize> = (0..ops.len()).filter(|&i| ops[i].layer == Some(0)).collect();
    let linears: Vec<usize> = layer0
        .iter()
        .copied()
        .filter(|&i| matches!(ops[i].kind, OpKind::Linear { .. }))
        .collect();
    // q, k, v, fc1, fc2, dense: move fc1 and fc2 after dense.
    let (fc1, fc2) = (ops[linears[3]].clone(), ops[linears[4]].clone());
    ops.remove(linears[4]);
    ops.remove(linears[3]);
    let dense = *layer0.last().unwrap() - 2;
    ops.insert(dense + 1, fc1);
    ops.insert(dense + 2, fc2);
    let s = ModelSpec { ops, ..spec };
    s.validate().unwrap();
    let decode = block_graph(&s, 1);
    let l0 = layer_families(&decode, 0);
    assert_eq!(l0[0], "norm", "{l0:?}");
    assert_eq!(folded(&decode, 0), [false; 6]);
    assert_barriers_exact(&decode, "phi reordered decode");
}
