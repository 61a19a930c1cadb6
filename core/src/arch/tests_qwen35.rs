//! Qwen3.5 (Gated DeltaNet hybrid) configurations: which layers are full attention
//! (`layer_types`, `full_attention_interval`, GGUF's per-block recurrent flags), the
//! `Qwen3_5ForConditionalGeneration` nesting, llama.cpp's GGUF forms (value heads tiled, `ssm_a`
//! negated, multi-token-prediction blocks left out) and one-line refusals.

use super::tests_gguf::Gguf;
use super::{ArchError, HfConfig};
use crate::graph::OpKind;
use crate::ops::{DecayForm, HeadOrder, NormKind};
use crate::spec::ModelSpec;
use serde_json::{Value, json};

fn build(config: &Value) -> Result<ModelSpec, ArchError> {
    let map = config.as_object().expect("a config object");
    let name = map["architectures"][0].as_str().expect("an architecture");
    let arch = super::by_hf_name(name).expect("a known architecture");
    super::build(arch, &HfConfig::new(map))
}

fn spec(config: &Value) -> ModelSpec {
    build(config).unwrap_or_else(|e| panic!("{e:?}"))
}

/// `[linear, linear, linear, full] * (layers / 4)`.
fn every_fourth(layers: usize) -> Vec<&'static str> {
    (0..layers)
        .map(|i| {
            if (i + 1) % 4 == 0 {
                "full_attention"
            } else {
                "linear_attention"
            }
        })
        .collect()
}

/// The language model of Qwen/Qwen3.5-0.8B (its `text_config`).
fn qwen35_0_8b_text() -> Value {
    json!({
        "architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text",
        "attention_bias": false, "attention_dropout": 0.0, "eos_token_id": 248044,
        "head_dim": 256, "hidden_act": "silu", "hidden_size": 1024, "initializer_range": 0.02,
        "intermediate_size": 3584, "layer_types": every_fourth(24),
        "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_num_key_heads": 16,
        "linear_num_value_heads": 16, "linear_value_head_dim": 128,
        "max_position_embeddings": 262144, "num_attention_heads": 8, "num_hidden_layers": 24,
        "num_key_value_heads": 2, "rms_norm_eps": 1e-6, "tie_word_embeddings": true,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25,
                            "mrope_section": [11, 11, 10], "mrope_interleaved": true},
        "vocab_size": 248320
    })
}

/// A small text config: 8 layers, 4 value heads over 2 key heads of different sizes.
fn small() -> Value {
    json!({
        "architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text",
        "head_dim": 32, "hidden_act": "silu", "hidden_size": 64, "intermediate_size": 136,
        "layer_types": every_fourth(8), "linear_conv_kernel_dim": 4, "linear_key_head_dim": 16,
        "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_value_head_dim": 24,
        "max_position_embeddings": 512, "num_attention_heads": 4, "num_hidden_layers": 8,
        "num_key_value_heads": 2, "rms_norm_eps": 1e-6, "tie_word_embeddings": false,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "partial_rotary_factor": 0.25},
        "vocab_size": 1003
    })
}

/// `config` with `changes` applied (a null value removes the key).
fn with(mut config: Value, changes: Value) -> Value {
    for (k, v) in changes.as_object().unwrap() {
        if v.is_null() {
            config.as_object_mut().unwrap().remove(k);
        } else {
            config[k] = v.clone();
        }
    }
    config
}

/// The multimodal checkpoint's form: `text` under `text_config`, the vision tower beside it.
fn conditional(text: Value) -> Value {
    let mut text = text;
    text.as_object_mut().unwrap().remove("architectures");
    text["model_type"] = json!("qwen3_5_text");
    json!({
        "architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
        "text_config": text,
        "vision_config": {"depth": 12, "hidden_size": 768, "model_type": "qwen3_5"},
        "image_token_id": 248056
    })
}

/// The layers with full attention.
fn full_layers(s: &ModelSpec) -> Vec<usize> {
    s.ops
        .iter()
        .filter_map(|o| match (&o.kind, o.layer) {
            (OpKind::Attention { .. }, Some(l)) => Some(l),
            _ => None,
        })
        .collect()
}

/// Each DeltaNet layer's (key heads, value heads, key size, value size, decay form, head order).
fn delta_nets(s: &ModelSpec) -> Vec<(usize, usize, usize, usize, DecayForm, HeadOrder)> {
    s.ops
        .iter()
        .filter_map(|o| match &o.kind {
            OpKind::DeltaNet(d) => Some((d.k_heads, d.v_heads, d.k_dim, d.v_dim, d.decay, d.order)),
            _ => None,
        })
        .collect()
}

/// The one-line message of a refused config.
fn refusal(result: Result<ModelSpec, ArchError>, what: &Value) -> String {
    match result {
        Ok(_) => panic!("accepted {what}"),
        Err(e) => {
            let text = format!("{e:?}");
            assert!(!text.contains('\n'), "{text}");
            text
        }
    }
}

#[test]
fn qwen35_0_8b_has_a_full_attention_layer_after_every_three_delta_net_layers() {
    let s = spec(&qwen35_0_8b_text());
    let d = &s.dims;
    assert_eq!(
        (
            d.hidden_size,
            d.num_layers,
            d.num_heads,
            d.num_kv_heads,
            d.head_dim,
            d.intermediate_size
        ),
        (1024, 24, 8, 2, 256, 3584)
    );
    assert_eq!((d.vocab_size, d.max_position_embeddings), (248320, 262144));
    assert_eq!(full_layers(&s), [3, 7, 11, 15, 19, 23]);
    let nets = delta_nets(&s);
    assert_eq!(nets.len(), 18);
    assert!(
        nets.iter()
            .all(|n| *n == (16, 16, 128, 128, DecayForm::Log, HeadOrder::Grouped))
    );
    assert!(s.tied_embeddings());
    // Every norm but the DeltaNet layers' gated norm is the (1 + w) form.
    assert!(s.ops.iter().all(|o| match &o.kind {
        OpKind::Norm { norm, .. } => norm.kind == NormKind::RmsPlusOne,
        _ => true,
    }));
    // transformers 5.24 `AutoModelForCausalLM.from_config` on the meta device.
    assert_eq!(s.param_count(), 752_393_024);
}

#[test]
fn full_attention_interval_stands_in_for_layer_types() {
    let listed = spec(&small());
    let interval = spec(&with(
        small(),
        json!({"layer_types": null, "full_attention_interval": 4}),
    ));
    assert_eq!(interval.ops, listed.ops);
    // Absent both: transformers' default interval, 4.
    let default = spec(&with(small(), json!({"layer_types": null})));
    assert_eq!(default.ops, listed.ops);
    let every_other = spec(&with(
        small(),
        json!({"layer_types": null, "full_attention_interval": 2}),
    ));
    assert_eq!(full_layers(&every_other), [1, 3, 5, 7]);
    // layer_types wins over the interval.
    let types = [
        "full_attention",
        "linear_attention",
        "linear_attention",
        "linear_attention",
    ];
    let first = spec(&with(
        small(),
        json!({"num_hidden_layers": 4, "layer_types": types, "full_attention_interval": 2}),
    ));
    assert_eq!(full_layers(&first), [0]);
}

#[test]
fn conditional_generation_reads_the_text_config_and_language_model_tensors() {
    let s = spec(&conditional(small()));
    let flat = spec(&small());
    assert_eq!(s.dims, flat.dims);
    assert_eq!(full_layers(&s), full_layers(&flat));
    for name in [
        "model.language_model.embed_tokens.weight",
        "model.language_model.layers.0.linear_attn.in_proj_qkv.weight",
        "model.language_model.layers.0.linear_attn.A_log",
        "model.language_model.layers.3.self_attn.q_proj.weight",
        "model.language_model.norm.weight",
        "lm_head.weight",
    ] {
        assert!(s.weight_named(name).is_some(), "{name}");
    }
    assert!(s.weight_named("model.layers.0.linear_attn.A_log").is_none());
    assert!(s.weights.iter().all(|w| !w.name.contains("visual")));
    assert_eq!(s.param_count(), flat.param_count());
    // Tied embeddings said only at the top level (the published multimodal configs do).
    let mut tied = conditional(with(small(), json!({"tie_word_embeddings": null})));
    tied["tie_word_embeddings"] = json!(true);
    let tied = spec(&tied);
    assert!(tied.tied_embeddings());
    assert!(tied.weight_named("lm_head.weight").is_none());
}

#[test]
fn bad_layer_configs_are_refused_in_one_line() {
    let cases = [
        (
            with(small(), json!({"layer_types": every_fourth(4)})),
            vec!["layer_types", "4 entries", "num_hidden_layers = 8"],
        ),
        (
            with(
                small(),
                json!({"num_hidden_layers": 2, "layer_types": ["linear_attention", "sliding_attention"]}),
            ),
            vec!["sliding_attention", "layer_types[1]"],
        ),
        (
            with(small(), json!({"layer_types": null, "full_attention_interval": 0})),
            vec!["full_attention_interval", "at least 1"],
        ),
        (
            with(small(), json!({"linear_num_value_heads": 3})),
            vec!["linear_num_value_heads (3)", "multiple of linear_num_key_heads (2)"],
        ),
        (
            with(small(), json!({"linear_conv_kernel_dim": 1})),
            vec!["linear_conv_kernel_dim", "at least 2"],
        ),
        (
            with(small(), json!({"layer_types": "full_attention"})),
            vec!["layer_types"],
        ),
    ];
    for (config, needles) in cases {
        let msg = refusal(build(&config), &config);
        for n in needles {
            assert!(msg.contains(n), "{n}: {msg}");
        }
    }
    // Inside text_config the field is named with its path.
    let heads = conditional(with(small(), json!({"linear_num_value_heads": 3})));
    let msg = refusal(build(&heads), &heads);
    assert!(msg.contains("multiple of"), "{msg}");
    let types = conditional(with(small(), json!({"layer_types": every_fourth(4)})));
    let msg = refusal(build(&types), &types);
    assert!(msg.contains("text_config.layer_types"), "{msg}");
}

// ---------------------------------------------------------------- GGUF metadata, as llama.cpp reads it

/// The metadata llama.cpp's converter writes for [`small`] with `blocks` blocks, and `extra`
/// keys (a null value removes one).
fn gguf(blocks: u64, extra: Value) -> Result<ModelSpec, ArchError> {
    let base = json!({
        "block_count": blocks, "context_length": 512, "embedding_length": 64,
        "feed_forward_length": 136, "attention.head_count": 4, "attention.head_count_kv": 2,
        "rope.freq_base": 1e6, "attention.layer_norm_rms_epsilon": 1e-6,
        "attention.key_length": 32, "attention.value_length": 32,
        "ssm.conv_kernel": 4, "ssm.state_size": 16, "ssm.group_count": 2, "ssm.time_step_rank": 4,
        "ssm.inner_size": 96, "full_attention_interval": 4, "rope.dimension_count": 8,
        "rope.dimension_sections": [11, 11, 10, 0]
    });
    let mut meta = serde_json::Map::new();
    for (k, v) in with(base, extra).as_object().unwrap() {
        meta.insert(format!("qwen35.{k}"), v.clone());
    }
    let p = Gguf {
        arch: "qwen35",
        meta,
        tensors: vec![("token_embd.weight", vec![1003, 64]), ("output.weight", vec![1003, 64])],
    };
    super::build(super::by_gguf_name("qwen35").unwrap(), &p)
}

fn gguf_spec(blocks: u64, extra: Value) -> ModelSpec {
    gguf(blocks, extra).unwrap_or_else(|e| panic!("{e:?}"))
}

#[test]
fn gguf_reads_llama_cpp_forms_of_the_delta_net_tensors() {
    let s = gguf_spec(8, json!({}));
    assert_eq!(full_layers(&s), [3, 7]);
    // Value width 96 over 4 heads: 24 each; `ssm_a` holds -exp(A_log); value heads tiled.
    let nets = delta_nets(&s);
    assert_eq!(nets.len(), 6);
    assert!(
        nets.iter()
            .all(|n| *n == (2, 4, 16, 24, DecayForm::Negated, HeadOrder::Tiled))
    );
    assert!(s.ops.iter().all(|o| match &o.kind {
        OpKind::Norm { norm, .. } => norm.kind == NormKind::Rms,
        _ => true,
    }));
    for name in [
        "blk.0.attn_qkv.weight",
        "blk.0.attn_gate.weight",
        "blk.0.ssm_a",
        "blk.0.ssm_dt.bias",
        "blk.0.ssm_conv1d.weight",
        "blk.0.ssm_norm.weight",
        "blk.0.post_attention_norm.weight",
        "blk.3.attn_q.weight",
        "output.weight",
    ] {
        assert!(s.weight_named(name).is_some(), "{name}");
    }
    // The conv weight squeezed to [channels, taps].
    let conv = s.weight(s.weight_named("blk.0.ssm_conv1d.weight").unwrap());
    assert_eq!(conv.shape, [2 * 32 + 96, 4]);
    // The same numbers of parameters as the Hugging Face form.
    assert_eq!(s.param_count(), spec(&small()).param_count());
}

#[test]
fn gguf_recurrent_layer_flags_win_over_the_interval() {
    // llama.cpp writes one flag per block (true: DeltaNet) whenever layer_types is given.
    let flags = [true, false, true, true, false, true, true, true];
    let s = gguf_spec(8, json!({"attention.recurrent_layers": flags}));
    assert_eq!(full_layers(&s), [1, 4]);
    // Without them: the interval, default 4.
    let s = gguf_spec(8, json!({"full_attention_interval": 2}));
    assert_eq!(full_layers(&s), [1, 3, 5, 7]);
    let s = gguf_spec(8, json!({"full_attention_interval": null}));
    assert_eq!(full_layers(&s), [3, 7]);
}

#[test]
fn gguf_multi_token_prediction_blocks_are_left_out() {
    // Converted with the checkpoint's MTP block: block_count 9, the last block flagged
    // non-recurrent; the model itself has 8 layers.
    let mut flags = vec![true, true, true, false, true, true, true, false];
    flags.push(false);
    let s = gguf_spec(
        9,
        json!({"nextn_predict_layers": 1, "attention.recurrent_layers": flags}),
    );
    assert_eq!(s.dims.num_layers, 8);
    assert_eq!(full_layers(&s), [3, 7]);
    assert!(s.weights.iter().all(|w| !w.name.starts_with("blk.8.")));
    // Likewise with the interval.
    let s = gguf_spec(9, json!({"nextn_predict_layers": 1}));
    assert_eq!((s.dims.num_layers, full_layers(&s)), (8, vec![3, 7]));
}

#[test]
fn gguf_bad_layer_metadata_is_refused_in_one_line() {
    let cases = [
        (
            json!({"attention.recurrent_layers": [true, false]}),
            vec![
                "qwen35.attention.recurrent_layers",
                "2 entries",
                "qwen35.block_count = 8",
            ],
        ),
        (
            json!({"nextn_predict_layers": 8}),
            vec!["qwen35.nextn_predict_layers (8)", "qwen35.block_count (8)"],
        ),
        (
            json!({"full_attention_interval": 0}),
            vec!["qwen35.full_attention_interval", "at least 1"],
        ),
        (
            json!({"ssm.time_step_rank": 3, "ssm.inner_size": 72}),
            vec![
                "qwen35.ssm.time_step_rank (3)",
                "multiple of qwen35.ssm.group_count (2)",
            ],
        ),
        (
            json!({"ssm.inner_size": 98}),
            vec!["qwen35.ssm.inner_size (98)", "qwen35.ssm.time_step_rank (4)"],
        ),
        (json!({"ssm.conv_kernel": null}), vec!["qwen35.ssm.conv_kernel"]),
    ];
    for (extra, needles) in cases {
        let msg = refusal(gguf(8, extra.clone()), &extra);
        for n in needles {
            assert!(msg.contains(n), "{n}: {msg}");
        }
    }
}
