//! Gemma 2 and Gemma 3 on their published configurations (google/gemma-2-2b, gemma-3-270m,
//! gemma-3-1b; parameter counts from `transformers` 5.24 `from_config` on the meta device), the
//! per-layer windows and RoPE bases they imply, and the one-line refusals of what Kiln does not
//! implement.

use super::tests_gguf::Gguf;
use super::{ArchError, HfConfig};
use crate::graph::OpKind;
use crate::ops::{F32Bits, NormKind, Rotary};
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

fn gemma_2_2b() -> Value {
    json!({
        "architectures": ["Gemma2ForCausalLM"], "attention_bias": false, "attention_dropout": 0.0,
        "attn_logit_softcapping": 50.0, "bos_token_id": 2, "cache_implementation": "hybrid",
        "eos_token_id": [1, 107], "final_logit_softcapping": 30.0, "head_dim": 256,
        "hidden_act": "gelu_pytorch_tanh", "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 2304,
        "initializer_range": 0.02, "intermediate_size": 9216, "max_position_embeddings": 8192,
        "model_type": "gemma2", "num_attention_heads": 8, "num_hidden_layers": 26,
        "num_key_value_heads": 4, "pad_token_id": 0, "query_pre_attn_scalar": 256,
        "rms_norm_eps": 1e-06, "rope_theta": 10000.0, "sliding_window": 4096,
        "torch_dtype": "float32", "use_cache": true, "vocab_size": 256000
    })
}

fn gemma_3_1b() -> Value {
    json!({
        "architectures": ["Gemma3ForCausalLM"], "attention_bias": false, "attention_dropout": 0.0,
        "attn_logit_softcapping": null, "bos_token_id": 2, "cache_implementation": "hybrid",
        "eos_token_id": [1, 106], "final_logit_softcapping": null, "head_dim": 256,
        "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 1152, "initializer_range": 0.02,
        "intermediate_size": 6912, "max_position_embeddings": 32768, "model_type": "gemma3_text",
        "num_attention_heads": 4, "num_hidden_layers": 26, "num_key_value_heads": 1, "pad_token_id": 0,
        "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06, "rope_local_base_freq": 10000,
        "rope_scaling": null, "rope_theta": 1000000, "sliding_window": 512, "sliding_window_pattern": 6,
        "torch_dtype": "bfloat16", "use_cache": true, "vocab_size": 262144
    })
}

fn gemma_3_270m() -> Value {
    let types: Vec<&str> = (0..18)
        .map(|i| {
            if (i + 1) % 6 == 0 {
                "full_attention"
            } else {
                "sliding_attention"
            }
        })
        .collect();
    json!({
        "_sliding_window_pattern": 6, "architectures": ["Gemma3ForCausalLM"], "attention_bias": false,
        "attn_logit_softcapping": null, "final_logit_softcapping": null, "head_dim": 256,
        "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 640, "intermediate_size": 2048,
        "layer_types": types, "max_position_embeddings": 32768, "model_type": "gemma3_text",
        "num_attention_heads": 4, "num_hidden_layers": 18, "num_key_value_heads": 1,
        "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06, "rope_local_base_freq": 10000.0,
        "rope_scaling": null, "rope_theta": 1000000.0, "sliding_window": 512,
        "use_bidirectional_attention": false, "vocab_size": 262144
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

/// Each layer's attention: (window, score scale, soft cap).
fn attention(s: &ModelSpec) -> Vec<(Option<usize>, f32, Option<f32>)> {
    s.ops
        .iter()
        .filter_map(|o| match &o.kind {
            OpKind::Attention {
                window, scale, softcap, ..
            } => Some((*window, scale.get(), softcap.map(F32Bits::get))),
            _ => None,
        })
        .collect()
}

/// Each layer's rotary embedding and q/k norm kind.
fn ropes(s: &ModelSpec) -> Vec<(Rotary, Option<NormKind>)> {
    s.ops
        .iter()
        .filter_map(|o| match &o.kind {
            OpKind::RopeKv { rotary, qk_norm, .. } => Some((rotary.clone().unwrap(), qk_norm.map(|n| n.kind))),
            _ => None,
        })
        .collect()
}

/// The i-th inverse frequency of a rotary table (`1 / base^(2i / d)` in f32, as transformers).
fn freq(r: &Rotary, i: usize) -> f32 {
    f32::from_bits(r.inv_freq[i])
}

fn head_softcap(s: &ModelSpec) -> Option<f32> {
    s.ops
        .iter()
        .filter(|o| o.head)
        .find_map(|o| match &o.kind {
            OpKind::Linear { softcap, .. } => Some(softcap.map(F32Bits::get)),
            _ => None,
        })
        .unwrap()
}

fn embed_scale(s: &ModelSpec) -> Option<f32> {
    s.ops.iter().find_map(|o| match &o.kind {
        OpKind::Embed { scale, .. } => Some(scale.map(F32Bits::get)),
        _ => None,
    })?
}

#[test]
fn gemma_2_2b_alternates_windows_and_caps_scores_and_logits() {
    let s = spec(&gemma_2_2b());
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
        (2304, 26, 8, 4, 256, 9216)
    );
    assert_eq!(d.vocab_size, 256000);
    assert!(s.tied_embeddings());
    // Sliding from layer 0, every other layer; scores scaled by 256^-0.5 and capped at 50.
    let attn = attention(&s);
    assert_eq!(attn.len(), 26);
    for (l, &(window, scale, cap)) in attn.iter().enumerate() {
        assert_eq!(window, (l % 2 == 0).then_some(4096), "layer {l}");
        assert_eq!((scale, cap), (0.0625, Some(50.0)), "layer {l}");
    }
    assert_eq!(head_softcap(&s), Some(30.0));
    assert_eq!(embed_scale(&s), Some((2304f64).sqrt() as f32));
    // Every layer rotates with base 10000, no q/k norm; every norm is the (1 + w) form.
    assert!(
        ropes(&s)
            .iter()
            .all(|(r, qk)| freq(r, 1) == 1.0 / 10000f32.powf(2.0 / 256.0) && qk.is_none())
    );
    assert!(s.ops.iter().all(|o| match &o.kind {
        OpKind::Norm { norm, .. } => norm.kind == NormKind::RmsPlusOne,
        _ => true,
    }));
    // 11 tensors per layer (4 norms, 7 projections) plus the embedding and the final norm.
    assert_eq!(s.weights.len(), 26 * 11 + 2);
    assert_eq!(s.param_count(), 2_614_341_888);
}

#[test]
fn gemma_3_1b_has_five_local_layers_per_global_one_with_their_own_rope() {
    let s = spec(&gemma_3_1b());
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
        (1152, 26, 4, 1, 256, 6912)
    );
    assert_eq!((d.vocab_size, d.max_position_embeddings), (262144, 32768));
    let attn = attention(&s);
    let ropes = ropes(&s);
    let (local, global) = (1.0 / 10000f32.powf(2.0 / 256.0), 1.0 / 1_000_000f32.powf(2.0 / 256.0));
    for l in 0..26 {
        let sliding = (l + 1) % 6 != 0;
        assert_eq!(attn[l], (sliding.then_some(512), 0.0625, None), "layer {l}");
        let want = if sliding { local } else { global };
        assert_eq!(freq(&ropes[l].0, 1), want, "layer {l}");
        assert_eq!(ropes[l].1, Some(NormKind::RmsPlusOne), "layer {l}: (1 + w) q/k norm");
    }
    assert_eq!(head_softcap(&s), None);
    assert!(s.tied_embeddings());
    // 13 tensors per layer (with q_norm, k_norm).
    assert_eq!(s.weights.len(), 26 * 13 + 2);
    assert_eq!(s.param_count(), 999_885_952);
}

#[test]
fn gemma_3_270m_reads_layer_types() {
    let s = spec(&gemma_3_270m());
    assert_eq!(
        (s.dims.hidden_size, s.dims.num_layers, s.dims.intermediate_size),
        (640, 18, 2048)
    );
    let windows = s.attention_windows();
    assert_eq!(windows.iter().filter(|w| w.is_none()).count(), 3);
    assert_eq!((windows[4], windows[5], windows[17]), (Some(512), None, None));
    assert_eq!(s.param_count(), 268_098_176);
}

#[test]
fn gemma_3_rope_parameters_by_layer_type_equal_the_older_fields() {
    // transformers 5 writes the two RoPEs as `rope_parameters` keyed by layer type.
    let v5 = with(
        gemma_3_1b(),
        json!({"rope_theta": null, "rope_local_base_freq": null, "rope_scaling": null,
               "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
                                   "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}}),
    );
    assert_eq!(spec(&v5).ops, spec(&gemma_3_1b()).ops);
    // Gemma 3 4B and larger: linear scaling (factor 8) on the global layers only.
    let scaled = with(
        gemma_3_1b(),
        json!({"rope_scaling": {"factor": 8.0, "rope_type": "linear"}}),
    );
    let (a, b) = (ropes(&spec(&scaled)), ropes(&spec(&gemma_3_1b())));
    assert_eq!(
        freq(&a[5].0, 1),
        freq(&b[5].0, 1) / 8.0,
        "full layer divided by the factor"
    );
    assert_eq!(a[0].0, b[0].0, "sliding layer unscaled");
}

#[test]
fn query_pre_attn_scalar_sets_the_score_scale() {
    // Gemma 2 27B: query_pre_attn_scalar 144 (hidden / heads), not head_dim 128.
    let s = spec(&with(
        gemma_2_2b(),
        json!({"query_pre_attn_scalar": 144, "head_dim": 128, "num_hidden_layers": 2}),
    ));
    assert_eq!(attention(&s)[0].1, (144f64).powf(-0.5) as f32);
}

#[test]
fn gemma_2_soft_caps_null_means_none_and_absent_the_defaults() {
    // `with` removes the keys given as null: absent caps are transformers' defaults, 50 and 30.
    let absent = spec(&with(
        gemma_2_2b(),
        json!({"attn_logit_softcapping": null, "final_logit_softcapping": null}),
    ));
    assert_eq!(
        (attention(&absent)[0].2, head_softcap(&absent)),
        (Some(50.0), Some(30.0))
    );
    let mut nulls = gemma_2_2b();
    nulls["attn_logit_softcapping"] = Value::Null;
    nulls["final_logit_softcapping"] = Value::Null;
    let none = spec(&nulls);
    assert_eq!((attention(&none)[0].2, head_softcap(&none)), (None, None));
}

/// The one-line message of a refused config.
fn refusal(config: Value) -> String {
    match build(&config) {
        Ok(_) => panic!("accepted {config}"),
        Err(e) => {
            let text = format!("{e:?}");
            assert!(!text.contains('\n'), "{text}");
            text
        }
    }
}

#[test]
fn unsupported_options_are_refused_in_one_line() {
    let cases = [
        (with(gemma_2_2b(), json!({"attention_bias": true})), "attention_bias"),
        (
            with(gemma_3_1b(), json!({"use_bidirectional_attention": true})),
            "use_bidirectional_attention",
        ),
        (
            with(gemma_3_1b(), json!({"attn_logit_softcapping": 50.0})),
            "attn_logit_softcapping",
        ),
        (
            with(gemma_2_2b(), json!({"hidden_activation": "relu"})),
            "hidden_activation",
        ),
        (
            {
                let mut c = gemma_2_2b();
                c["sliding_window"] = Value::Null;
                c
            },
            "sliding_window",
        ),
        (with(gemma_2_2b(), json!({"sliding_window": 0})), "sliding_window"),
        (
            with(gemma_3_270m(), json!({"layer_types": ["chunked_attention"]})),
            "layer_types",
        ),
        (
            with(
                gemma_3_270m(),
                json!({"num_hidden_layers": 2, "layer_types": ["sliding_attention", "chunked_attention"]}),
            ),
            "chunked_attention",
        ),
        (
            with(
                gemma_3_1b(),
                json!({"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}),
            ),
            "rope_parameters",
        ),
        (
            with(
                gemma_3_1b(),
                json!({"rope_scaling": {"rope_type": "yarn", "factor": 8.0}}),
            ),
            "yarn",
        ),
        (
            with(gemma_2_2b(), json!({"partial_rotary_factor": 0.5})),
            "partial_rotary_factor",
        ),
    ];
    for (config, needle) in cases {
        let msg = refusal(config);
        assert!(msg.contains(needle), "{needle}: {msg}");
    }
}

// ---------------------------------------------------------------- GGUF metadata, as llama.cpp reads it

/// A small GGUF model of `arch` with `layers` layers (hidden 64, 2 heads of 16, so hidden /
/// heads = 32 differs from head_dim) and the extra keys `extra`.
fn gguf(arch: &'static str, layers: u64, extra: Value) -> ModelSpec {
    let mut meta = serde_json::Map::new();
    let base = json!({
        "embedding_length": 64, "feed_forward_length": 136, "block_count": layers,
        "attention.head_count": 2, "attention.head_count_kv": 1, "attention.key_length": 16,
        "attention.value_length": 16, "context_length": 8192,
        "attention.layer_norm_rms_epsilon": 1e-6,
    });
    for (k, v) in base.as_object().unwrap().iter().chain(extra.as_object().unwrap()) {
        meta.insert(format!("{arch}.{k}"), v.clone());
    }
    let p = Gguf {
        arch,
        meta,
        tensors: vec![("token_embd.weight", vec![1000, 64])],
    };
    let a = super::by_gguf_name(arch).unwrap();
    super::build(a, &p).unwrap_or_else(|e| panic!("{e:?}"))
}

#[test]
fn gguf_gemma2_follows_llama_cpp_defaults() {
    // No window or cap keys: llama.cpp's Gemma 2 defaults (window 4096 on every other layer from
    // layer 0, caps 50 and 30); norms hold 1 + w already; the head is always the embedding.
    let s = gguf("gemma2", 2, json!({}));
    let scale = 0.25; // head_dim 16
    assert_eq!(
        attention(&s),
        [(Some(4096), scale, Some(50.0)), (None, scale, Some(50.0))]
    );
    assert_eq!(head_softcap(&s), Some(30.0));
    assert!(s.tied_embeddings());
    assert!(s.ops.iter().all(|o| match &o.kind {
        OpKind::Norm { norm, .. } => norm.kind == NormKind::Rms,
        _ => true,
    }));
    // The 27B shape (46 layers) scales by (hidden / heads)^-0.5 = 32^-0.5, as llama.cpp does.
    let big = gguf(
        "gemma2",
        46,
        json!({"attn_logit_softcapping": 5.0, "final_logit_softcapping": 10.0}),
    );
    assert_eq!(attention(&big)[0].1, 1.0 / 32f32.sqrt());
    assert_eq!((attention(&big)[0].2, head_softcap(&big)), (Some(5.0), Some(10.0)));
}

#[test]
fn gguf_gemma3_windows_and_ropes_per_layer() {
    // Without a sliding window llama.cpp builds no SWA graph: every layer is full and rotates
    // with the full layers' base.
    let none = gguf("gemma3", 6, json!({"rope.freq_base": 1e6}));
    assert!(none.attention_windows().iter().all(Option::is_none));
    let r = ropes(&none);
    assert!(r.iter().all(|(rot, qk)| rot == &r[0].0 && *qk == Some(NormKind::Rms)));
    assert_eq!(freq(&r[0].0, 1), 1.0 / 1e6f32.powf(2.0 / 16.0));
    assert_eq!(head_softcap(&none), None);
    // With one: five sliding layers per full one; the sliding layers use freq_base_swa unscaled,
    // the full ones freq_base with the linear scaling; no attention cap; a final cap of 0 is none.
    let s = gguf(
        "gemma3",
        6,
        json!({"attention.sliding_window": 24, "rope.freq_base": 1e6, "rope.freq_base_swa": 1e4,
               "rope.scaling.type": "linear", "rope.scaling.factor": 8.0, "final_logit_softcapping": 0.0}),
    );
    let windows = s.attention_windows();
    assert_eq!(windows, [Some(24), Some(24), Some(24), Some(24), Some(24), None]);
    let r = ropes(&s);
    assert_eq!(freq(&r[0].0, 1), 1.0 / 1e4f32.powf(2.0 / 16.0));
    assert_eq!(freq(&r[5].0, 1), freq(&ropes(&none)[0].0, 1) / 8.0);
    assert!(attention(&s).iter().all(|a| a.2.is_none()));
    assert_eq!(head_softcap(&s), None);
}
