//! Tests of the model front end on tiny checkpoints written with the `safetensors` crate.

use super::*;
use kiln_core::spec::Role;
use kiln_core::{DType, RopeScaling, Tensor};
use safetensors::{Dtype as St, View};
use serde_json::{Value, json};
use std::borrow::Cow;
use std::fs;
use std::path::Path;
use tempfile::TempDir;

/// An owned tensor to serialise.
struct T {
    dtype: St,
    shape: Vec<usize>,
    data: Vec<u8>,
}

impl View for T {
    fn dtype(&self) -> St {
        self.dtype
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> Cow<'_, [u8]> {
        Cow::Borrowed(&self.data)
    }
    fn data_len(&self) -> usize {
        self.data.len()
    }
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// bf16 by truncation of the f32 bits.
fn bf16_bytes(v: &[f32]) -> Vec<u8> {
    v.iter()
        .flat_map(|x| ((x.to_bits() >> 16) as u16).to_le_bytes())
        .collect()
}

fn u16_bytes(v: &[u16]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// A tensor of `dtype` and `shape` holding a recognisable pattern.
fn tensor(dtype: St, shape: &[usize]) -> T {
    let n: usize = shape.iter().product();
    let values: Vec<f32> = (0..n).map(|i| (i % 97) as f32 * 0.125 - 3.0).collect();
    let data = match dtype {
        St::F32 => f32_bytes(&values),
        St::BF16 => bf16_bytes(&values),
        // 1.0, 2.0, ... in IEEE half.
        St::F16 => u16_bytes(&(0..n).map(|i| [0x3C00u16, 0x4000][i % 2]).collect::<Vec<_>>()),
        St::I64 => vec![0u8; n * 8],
        other => panic!("test helper does not build {other:?}"),
    };
    T {
        dtype,
        shape: shape.to_vec(),
        data,
    }
}

/// A config text for `arch` with small dimensions, `extra` fields merged over the defaults
/// (a null in `extra` removes the field).
fn config(arch: &str, extra: Value) -> String {
    let mut base = json!({
        "architectures": [arch],
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 256,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "hidden_act": "silu",
        "torch_dtype": "bfloat16",
    });
    let map = base.as_object_mut().unwrap();
    for (k, v) in extra.as_object().unwrap() {
        if v.is_null() {
            map.remove(k);
        } else {
            map.insert(k.clone(), v.clone());
        }
    }
    serde_json::to_string_pretty(&base).unwrap()
}

/// Storage type per tensor: norms f32, everything else `matrix`.
fn norms_f32(matrix: St) -> impl Fn(&Tensor) -> St {
    move |t| {
        if t.role == Role::Vector && t.name.contains("norm") {
            St::F32
        } else {
            matrix
        }
    }
}

/// Every tensor the config's layout needs, named as Hugging Face names them.
fn tensors_for(config_text: &str, dtype_of: impl Fn(&Tensor) -> St) -> Vec<(String, T)> {
    let cfg = ModelConfig::from_json(config_text, Path::new("config.json")).unwrap();
    cfg.layout
        .weights
        .iter()
        .map(|t| (t.name.clone(), tensor(dtype_of(t), &t.stored_shape())))
        .collect()
}

/// The storage type of the tensor called `name`, if the spec reads one.
fn dt(s: &ModelSpec, name: &str) -> Option<DType> {
    s.weight_named(name).map(|id| s.weight(id).dtype)
}

/// `model.layers.{l}.{suffix}`.
fn lw(l: usize, suffix: &str) -> String {
    format!("model.layers.{l}.{suffix}")
}

/// The sliding windows a config gives its layers.
fn windows(c: &ModelConfig) -> Vec<Option<usize>> {
    c.layout.attention_windows()
}

fn write_st(path: &Path, tensors: Vec<(String, T)>) {
    safetensors::serialize_to_file(tensors, None, path).unwrap();
}

/// A model folder with `config.json` and a single `model.safetensors`.
fn folder(config_text: &str, tensors: Vec<(String, T)>) -> TempDir {
    let dir = tempfile::tempdir().unwrap();
    fs::write(dir.path().join("config.json"), config_text).unwrap();
    write_st(&dir.path().join("model.safetensors"), tensors);
    dir
}

fn model(config_text: &str, dtype_of: impl Fn(&Tensor) -> St) -> TempDir {
    folder(config_text, tensors_for(config_text, dtype_of))
}

fn err(path: &Path) -> String {
    match load(path) {
        Ok(_) => panic!("loading {} should fail", path.display()),
        Err(e) => e.to_string(),
    }
}

fn st_path(dir: &TempDir) -> String {
    dir.path().join("model.safetensors").display().to_string()
}

fn cfg_path(dir: &TempDir) -> String {
    dir.path().join("config.json").display().to_string()
}

/// Raw safetensors bytes: length prefix, header text as given, data.
fn raw_st(header: &str, data: &[u8]) -> Vec<u8> {
    let mut out = (header.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(header.as_bytes());
    out.extend_from_slice(data);
    out
}

#[test]
fn llama31_untied_with_llama3_rope_and_mixed_dtypes() {
    let text = config(
        "LlamaForCausalLM",
        json!({
            "rope_theta": 500000.0,
            "rope_scaling": {
                "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192, "rope_type": "llama3"
            },
            "max_position_embeddings": 131072,
            "tie_word_embeddings": false,
            "bos_token_id": 128000,
            "eos_token_id": [128001, 128008, 128009],
            "attention_bias": false,
            "mlp_bias": false,
        }),
    );
    let dir = model(&text, norms_f32(St::BF16));
    let m = load(dir.path()).unwrap();
    let s = &m.spec;
    assert_eq!(s.arch, "llama");
    assert_eq!(m.config.architecture, "LlamaForCausalLM");
    let d = &s.dims;
    assert_eq!((d.hidden_size, d.intermediate_size, s.num_layers()), (64, 128, 2));
    assert_eq!((d.num_heads, d.num_kv_heads, d.head_dim, d.vocab_size), (4, 2, 16, 256));
    assert_eq!(d.max_position_embeddings, 131072);
    assert!(s.ops.iter().all(|o| match &o.kind {
        kiln_core::graph::OpKind::Norm { norm, .. } => norm.eps.get() == 1e-5,
        _ => true,
    }));
    let rope = s.rope.as_ref().unwrap();
    assert_eq!(rope.theta, 500000.0);
    assert_eq!(
        rope.scaling,
        RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 8192.0
        }
    );
    assert!(!s.tied_embeddings());
    for absent in [
        "self_attn.q_proj.bias",
        "self_attn.o_proj.bias",
        "self_attn.q_norm.weight",
    ] {
        assert_eq!(dt(s, &lw(1, absent)), None, "{absent}");
    }
    assert_eq!(
        (
            dt(s, "model.embed_tokens.weight"),
            dt(s, "model.norm.weight"),
            dt(s, "lm_head.weight")
        ),
        (Some(DType::BF16), Some(DType::F32), Some(DType::BF16))
    );
    assert_eq!(
        [
            "input_layernorm.weight",
            "post_attention_layernorm.weight",
            "self_attn.q_proj.weight",
            "mlp.down_proj.weight"
        ]
        .map(|n| dt(s, &lw(1, n)).unwrap()),
        [DType::F32, DType::F32, DType::BF16, DType::BF16]
    );
    assert!(s.attention_windows().iter().all(|w| w.is_none()));
    assert_eq!(m.config.bos_token_id, Some(128000));
    assert_eq!(m.config.eos_token_ids, vec![128001, 128008, 128009]);
    assert_eq!(m.config.torch_dtype.as_deref(), Some("bfloat16"));
    assert_eq!(m.dir, dir.path());
    assert_eq!(m.config.generation_config, None);
    m.weights.check(&m.spec).unwrap();

    // The views are the bytes that were written, aligned, and stay put while `Weights` moves.
    let embed = m.weights.get("model.embed_tokens.weight").unwrap();
    assert_eq!(embed.shape, &[256, 64]);
    assert_eq!(embed.dtype, DType::BF16);
    assert_eq!(embed.data, tensor(St::BF16, &[256, 64]).data.as_slice());
    assert_eq!(embed.len_bytes(), 256 * 64 * 2);
    assert_eq!(embed.path, dir.path().join("model.safetensors"));
    let ptr = embed.ptr();
    let norm = m.weights.get("model.norm.weight").unwrap();
    assert_eq!(norm.ptr() as usize % 4, 0);
    assert_eq!(&norm.data[..8], &f32_bytes(&[-3.0, -2.875])[..]);
    let weights = m.weights;
    assert_eq!(weights.get("model.embed_tokens.weight").unwrap().ptr(), ptr);
    assert_eq!(weights.files().count(), 1);
    assert!(weights.index().is_none());
}

#[test]
fn llama_attention_bias_tied_rope_parameters_and_generation_config() {
    let text = config(
        "LlamaForCausalLM",
        json!({
            "attention_bias": true,
            "tie_word_embeddings": true,
            "rope_parameters": {"rope_theta": 250000.0, "rope_type": "default"},
            "bos_token_id": 1,
            "eos_token_id": 2,
        }),
    );
    let dir = model(&text, |_| St::F32);
    fs::write(
        dir.path().join("generation_config.json"),
        r#"{"bos_token_id": 7, "eos_token_id": [3, 2], "do_sample": true, "temperature": 0.6}"#,
    )
    .unwrap();
    let m = load(dir.path()).unwrap();
    let s = &m.spec;
    assert!(s.tied_embeddings());
    assert_eq!(
        ["q", "k", "v", "o"].map(|p| dt(s, &lw(0, &format!("self_attn.{p}_proj.bias")))),
        [Some(DType::F32); 4]
    );
    let rope = s.rope.as_ref().unwrap();
    assert_eq!(rope.theta, 250000.0);
    assert_eq!(rope.scaling, RopeScaling::None);
    assert_eq!(dt(s, "lm_head.weight"), None);
    assert_eq!(m.weights.get(&lw(1, "self_attn.o_proj.bias")).unwrap().shape, &[64]);
    // generation_config first, then config.json; its BOS wins.
    assert_eq!(m.config.eos_token_ids, vec![3, 2]);
    assert_eq!(m.config.bos_token_id, Some(7));
    assert_eq!(
        m.config.generation_config,
        Some(dir.path().join("generation_config.json"))
    );
}

#[test]
fn tied_embeddings_ignore_a_present_lm_head() {
    let text = config("LlamaForCausalLM", json!({"tie_word_embeddings": true}));
    let mut tensors = tensors_for(&text, |_| St::BF16);
    // Even a head of another shape and type is ignored when the config ties it.
    tensors.push(("lm_head.weight".into(), tensor(St::F32, &[3, 3])));
    tensors.push(("model.rotary_emb.inv_freq".into(), tensor(St::F32, &[8])));
    tensors.push(("model.position_ids".into(), tensor(St::I64, &[1, 16])));
    let dir = folder(&text, tensors);
    let m = load(dir.path()).unwrap();
    assert!(m.spec.tied_embeddings());
    assert_eq!(dt(&m.spec, "lm_head.weight"), None);
    assert_eq!(dt(&m.spec, "model.embed_tokens.weight"), Some(DType::BF16));
}

#[test]
fn untied_model_without_lm_head_names_it() {
    let text = config("LlamaForCausalLM", json!({}));
    let tensors = tensors_for(&text, |_| St::BF16)
        .into_iter()
        .filter(|(n, _)| n != "lm_head.weight")
        .collect();
    let dir = folder(&text, tensors);
    assert_eq!(
        err(dir.path()),
        format!("tensor lm_head.weight not found in {}", st_path(&dir))
    );
}

/// `mlp_bias` gives the three MLP projections biases, and a folder without them names the
/// first one missing.
#[test]
fn llama_mlp_bias_reads_the_mlp_biases() {
    let text = config("LlamaForCausalLM", json!({"mlp_bias": true}));
    let dir = model(&text, |_| St::F32);
    let m = load(dir.path()).unwrap();
    for (name, len) in [("gate_proj", 128), ("up_proj", 128), ("down_proj", 64)] {
        let t = m.weights.get(&lw(1, &format!("mlp.{name}.bias"))).unwrap();
        assert_eq!(t.shape, &[len], "{name}");
    }
    let dir = model(&config("LlamaForCausalLM", json!({})), |_| St::F32);
    fs::write(dir.path().join("config.json"), &text).unwrap();
    assert_eq!(
        err(dir.path()),
        format!(
            "tensor model.layers.0.mlp.gate_proj.bias not found in {}",
            st_path(&dir)
        )
    );
}

#[test]
fn mistral_sliding_window_and_class_defaults() {
    // Mistral-7B-v0.1 style: a 4096 window on every layer, f16 weights.
    let text = config(
        "MistralForCausalLM",
        json!({"sliding_window": 4096, "max_position_embeddings": 32768}),
    );
    let dir = model(&text, |_| St::F16);
    let m = load(dir.path()).unwrap();
    assert_eq!(m.spec.arch, "mistral");
    assert!(m.spec.attention_windows().iter().all(|&w| w == Some(4096)));
    assert_eq!(
        (
            dt(&m.spec, "model.embed_tokens.weight"),
            dt(&m.spec, &lw(0, "input_layernorm.weight"))
        ),
        (Some(DType::F16), Some(DType::F16))
    );
    assert!(
        !m.spec
            .weights
            .iter()
            .any(|t| t.name.ends_with(".bias") || t.name.contains("q_norm"))
    );
    let norm = m.weights.get("model.norm.weight").unwrap();
    assert_eq!(norm.data[..4], u16_bytes(&[0x3C00, 0x4000])[..]);

    // v0.2 and later: null window (written out, as `config` drops null fields).
    let text = r#"{"architectures": ["MistralForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 8, "vocab_size": 256, "sliding_window": null,
        "max_position_embeddings": 32768}"#;
    let c = ModelConfig::from_json(text, Path::new("c")).unwrap();
    assert_eq!(windows(&c), vec![None, None]);
    // MistralConfig defaults: 8 KV heads, head_dim from hidden / heads.
    assert_eq!((c.layout.dims.num_kv_heads, c.layout.dims.head_dim), (8, 8));

    // Absent: MistralConfig's default window of 4096; a window covering the whole context is
    // the same as none.
    let text = config("MistralForCausalLM", json!({"max_position_embeddings": 8192}));
    let c = ModelConfig::from_json(&text, Path::new("c")).unwrap();
    assert_eq!(windows(&c), vec![Some(4096), Some(4096)]);
    let text = config("MistralForCausalLM", json!({"max_position_embeddings": 4096}));
    let c = ModelConfig::from_json(&text, Path::new("c")).unwrap();
    assert_eq!(windows(&c), vec![None, None]);
}

#[test]
fn qwen2_biases_tied_and_generation_eos_union() {
    // Qwen2.5 style: q/k/v biases (never o), tied head, window present but disabled.
    let text = config(
        "Qwen2ForCausalLM",
        json!({
            "tie_word_embeddings": true,
            "use_sliding_window": false,
            "sliding_window": 131072,
            "max_window_layers": 21,
            "rope_theta": 1000000.0,
            "bos_token_id": 151643,
            "eos_token_id": 151645,
            "attention_bias": false,
        }),
    );
    let dir = model(&text, |_| St::BF16);
    fs::write(
        dir.path().join("generation_config.json"),
        r#"{"bos_token_id": 151643, "pad_token_id": 151643, "eos_token_id": [151645, 151643]}"#,
    )
    .unwrap();
    let m = load(dir.path()).unwrap();
    let s = &m.spec;
    assert_eq!(s.arch, "qwen2");
    assert!(s.tied_embeddings() && dt(s, &lw(0, "self_attn.q_norm.weight")).is_none());
    assert_eq!(
        ["q", "k", "v", "o"].map(|p| dt(s, &lw(0, &format!("self_attn.{p}_proj.bias")))),
        [Some(DType::BF16), Some(DType::BF16), Some(DType::BF16), None]
    );
    assert_eq!(m.weights.get(&lw(0, "self_attn.k_proj.bias")).unwrap().shape, &[32]);
    assert!(s.attention_windows().iter().all(|w| w.is_none()));
    assert_eq!(s.rope.as_ref().unwrap().theta, 1000000.0);
    assert_eq!(m.config.eos_token_ids, vec![151645, 151643]);
    assert_eq!(m.config.bos_token_id, Some(151643));

    // Without the biases the first one is reported, with the file.
    let tensors = tensors_for(&text, |_| St::BF16)
        .into_iter()
        .filter(|(n, _)| !n.ends_with("_proj.bias"))
        .collect();
    let dir = folder(&text, tensors);
    assert_eq!(
        err(dir.path()),
        format!(
            "tensor model.layers.0.self_attn.q_proj.bias not found in {}",
            st_path(&dir)
        )
    );
}

#[test]
fn qwen2_sliding_window_layers() {
    let on = json!({"use_sliding_window": true, "sliding_window": 16, "max_window_layers": 1, "num_hidden_layers": 3});
    let c = ModelConfig::from_json(&config("Qwen2ForCausalLM", on), Path::new("c")).unwrap();
    assert_eq!(windows(&c), vec![None, Some(16), Some(16)]);

    // An explicit layer_types list wins over max_window_layers.
    let listed = json!({
        "use_sliding_window": true, "sliding_window": 16, "max_window_layers": 0,
        "layer_types": ["sliding_attention", "full_attention"]
    });
    let c = ModelConfig::from_json(&config("Qwen2ForCausalLM", listed), Path::new("c")).unwrap();
    assert_eq!(windows(&c), vec![Some(16), None]);

    // Disabled: no layer slides, whatever max_window_layers says.
    let off = json!({"use_sliding_window": false, "sliding_window": 16, "max_window_layers": 0});
    let c = ModelConfig::from_json(&config("Qwen3ForCausalLM", off), Path::new("c")).unwrap();
    assert_eq!(windows(&c), vec![None, None]);

    // A sliding layer without a window is refused, as transformers refuses it.
    let bad = json!({"use_sliding_window": false, "layer_types": ["full_attention", "sliding_attention"]});
    let e = ModelConfig::from_json(&config("Qwen2ForCausalLM", bad), Path::new("/m/config.json")).unwrap_err();
    assert!(
        e.to_string()
            .starts_with("/m/config.json: layer_types[1] is \"sliding_attention\""),
        "{e}"
    );
    let bad = json!({"layer_types": ["full_attention"]});
    let e = ModelConfig::from_json(&config("Qwen2ForCausalLM", bad), Path::new("/m/config.json")).unwrap_err();
    assert_eq!(
        e.to_string(),
        "/m/config.json: field \"layer_types\" has 1 entries, expected one per layer (num_hidden_layers = 2)"
    );
}

#[test]
fn qwen3_qk_norm_explicit_head_dim_and_rope_parameters() {
    // Qwen3 style as transformers 5 writes it: head_dim != hidden / heads, rope under
    // rope_parameters, explicit layer_types, `dtype` instead of `torch_dtype`.
    let text = config(
        "Qwen3ForCausalLM",
        json!({
            "head_dim": 32,
            "tie_word_embeddings": true,
            "rope_parameters": {"rope_theta": 1000000, "rope_type": "default"},
            "layer_types": ["full_attention", "full_attention"],
            "use_sliding_window": false,
            "sliding_window": Value::Null,
            "max_window_layers": 28,
            "attention_bias": false,
            "torch_dtype": Value::Null,
            "dtype": "bfloat16",
            "eos_token_id": 151645,
        }),
    );
    let dir = model(&text, norms_f32(St::BF16));
    let m = load(dir.path()).unwrap();
    let s = &m.spec;
    assert_eq!(s.arch, "qwen3");
    assert_eq!((s.dims.head_dim, s.dims.q_dim(), s.dims.kv_dim()), (32, 128, 64));
    assert!(s.tied_embeddings());
    assert_eq!(
        [
            "self_attn.q_norm.weight",
            "self_attn.k_norm.weight",
            "self_attn.q_proj.bias",
            "self_attn.o_proj.bias"
        ]
        .map(|n| dt(s, &lw(1, n))),
        [Some(DType::F32), Some(DType::F32), None, None]
    );
    assert_eq!(m.weights.get(&lw(1, "self_attn.q_norm.weight")).unwrap().shape, &[32]);
    assert_eq!(
        m.weights.get(&lw(0, "self_attn.q_proj.weight")).unwrap().shape,
        &[128, 64]
    );
    assert_eq!(
        m.weights.get(&lw(0, "self_attn.o_proj.weight")).unwrap().shape,
        &[64, 128]
    );
    assert_eq!(
        s.rope,
        Some(kiln_core::Rope {
            theta: 1e6,
            scaling: RopeScaling::None
        })
    );
    assert_eq!(m.config.torch_dtype.as_deref(), Some("bfloat16"));
    assert_eq!(m.config.eos_token_ids, vec![151645]);
    assert_eq!(m.config.bos_token_id, None);

    // Qwen3 with attention_bias gets all four biases; an absent head_dim is Qwen3Config's 128.
    let c = ModelConfig::from_json(
        &config("Qwen3ForCausalLM", json!({"attention_bias": true})),
        Path::new("c"),
    )
    .unwrap();
    for n in [
        "q_proj.bias",
        "k_proj.bias",
        "v_proj.bias",
        "o_proj.bias",
        "q_norm.weight",
        "k_norm.weight",
    ] {
        assert!(dt(&c.layout, &lw(0, &format!("self_attn.{n}"))).is_some(), "{n}");
    }
    assert_eq!(c.layout.dims.head_dim, 128);
    // Null head_dim: derived.
    let text = config("Qwen3ForCausalLM", json!({})).replacen("{", "{\"head_dim\": null,", 1);
    assert_eq!(
        ModelConfig::from_json(&text, Path::new("c"))
            .unwrap()
            .layout
            .dims
            .head_dim,
        16
    );
}

#[test]
fn model_type_fallback_and_linear_rope_from_legacy_type() {
    let text = config(
        "X",
        json!({
            "architectures": Value::Null,
            "model_type": "qwen2",
            "rope_scaling": {"type": "linear", "factor": 2.0},
            "rope_theta": 5000.0,
        }),
    );
    let c = ModelConfig::from_json(&text, Path::new("c")).unwrap();
    assert_eq!((c.arch.name, c.architecture.as_str()), ("qwen2", "Qwen2ForCausalLM"));
    assert_eq!(
        c.layout.rope,
        Some(kiln_core::Rope {
            theta: 5000.0,
            scaling: RopeScaling::Linear { factor: 2.0 }
        })
    );
    // rope_scaling (legacy) wins over rope_parameters, as in transformers.
    let both = json!({
        "rope_scaling": {"rope_type": "linear", "factor": 4.0},
        "rope_parameters": {"rope_type": "default", "rope_theta": 7.0},
        "rope_theta": 9.0
    });
    let c = ModelConfig::from_json(&config("LlamaForCausalLM", both), Path::new("c")).unwrap();
    assert_eq!(
        c.layout.rope,
        Some(kiln_core::Rope {
            theta: 9.0,
            scaling: RopeScaling::Linear { factor: 4.0 }
        })
    );
    // No rope fields at all: theta 10000; llama3 without original_max_position_embeddings uses
    // max_position_embeddings.
    let c = ModelConfig::from_json(&config("LlamaForCausalLM", json!({})), Path::new("c")).unwrap();
    assert_eq!(
        c.layout.rope,
        Some(kiln_core::Rope {
            theta: 10000.0,
            scaling: RopeScaling::None
        })
    );
    let l3 = json!({"rope_parameters": {"rope_type": "llama3", "factor": 8, "low_freq_factor": 1, "high_freq_factor": 4, "rope_theta": 500000}});
    let c = ModelConfig::from_json(&config("LlamaForCausalLM", l3), Path::new("c")).unwrap();
    assert_eq!(
        c.layout.rope.unwrap().scaling,
        RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 4096.0
        }
    );
}

#[test]
fn config_path_may_be_given_directly() {
    let dir = model(&config("LlamaForCausalLM", json!({})), |_| St::F32);
    let m = load(&dir.path().join("config.json")).unwrap();
    assert_eq!(m.dir, dir.path());
}

#[test]
fn sharded_checkpoint() {
    let text = config("Qwen2ForCausalLM", json!({"tie_word_embeddings": false}));
    let dir = tempfile::tempdir().unwrap();
    fs::write(dir.path().join("config.json"), &text).unwrap();
    let tensors = tensors_for(&text, |_| St::BF16);
    let (a, b): (Vec<_>, Vec<_>) = tensors.into_iter().enumerate().partition(|(i, _)| i % 2 == 0);
    let mut weight_map = serde_json::Map::new();
    let names = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"];
    for (file, part) in names.iter().zip([a, b]) {
        let part: Vec<(String, T)> = part.into_iter().map(|(_, t)| t).collect();
        for (n, _) in &part {
            weight_map.insert(n.clone(), json!(file));
        }
        write_st(&dir.path().join(file), part);
    }
    let index = json!({"metadata": {"total_size": 1234}, "weight_map": weight_map});
    let index_path = dir.path().join("model.safetensors.index.json");
    fs::write(&index_path, index.to_string()).unwrap();
    let m = load(dir.path()).unwrap();
    assert_eq!(m.weights.files().count(), 2);
    assert_eq!(m.weights.index(), Some(index_path.as_path()));
    let q = m.weights.get(&lw(0, "self_attn.q_proj.weight")).unwrap();
    let k = m.weights.get(&lw(0, "self_attn.k_proj.weight")).unwrap();
    assert_ne!(q.path, k.path);
    assert_eq!(dt(&m.spec, "lm_head.weight"), Some(DType::BF16));

    // The index is authoritative: a tensor it places in the wrong shard is missing there.
    let mut moved = index.clone();
    moved["weight_map"]["model.norm.weight"] = json!(names[0]);
    moved["weight_map"]["lm_head.weight"] = json!(names[0]);
    moved["weight_map"]["model.embed_tokens.weight"] = json!(names[1]);
    fs::write(&index_path, moved.to_string()).unwrap();
    let e = err(dir.path());
    assert!(e.starts_with("tensor model.embed_tokens.weight not found in "), "{e}");
    assert!(
        e.contains(names[1]) && e.contains("model.safetensors.index.json"),
        "{e}"
    );

    // A name absent from both the index and the files.
    let mut dropped = index.clone();
    dropped["weight_map"]
        .as_object_mut()
        .unwrap()
        .remove("model.norm.weight");
    fs::write(&index_path, dropped.to_string()).unwrap();
    fs::remove_file(dir.path().join(names[1])).unwrap();
    write_st(
        &dir.path().join(names[1]),
        tensors_for(&text, |_| St::BF16)
            .into_iter()
            .enumerate()
            .filter(|(i, _)| i % 2 == 1)
            .map(|(_, t)| t)
            .filter(|(n, _)| n != "model.norm.weight")
            .collect(),
    );
    let e = err(dir.path());
    assert_eq!(
        e,
        format!(
            "tensor model.norm.weight not found in {} or any of its 2 shard files",
            index_path.display()
        )
    );

    // A shard the index names but that does not exist.
    let mut missing = index.clone();
    missing["weight_map"]["model.norm.weight"] = json!("model-00003-of-00002.safetensors");
    fs::write(&index_path, missing.to_string()).unwrap();
    let e = err(dir.path());
    assert!(
        e.starts_with(&format!(
            "{}: names shard model-00003-of-00002.safetensors",
            index_path.display()
        )),
        "{e}"
    );

    // Escaping the folder is refused.
    let mut escape = index.clone();
    escape["weight_map"]["model.norm.weight"] = json!("../elsewhere.safetensors");
    fs::write(&index_path, escape.to_string()).unwrap();
    assert!(err(dir.path()).contains("expected a file name inside the model folder"));

    // Malformed index JSON.
    fs::write(&index_path, "{\"weight_map\": {").unwrap();
    let e = err(dir.path());
    assert!(
        e.starts_with(&format!("{}: invalid JSON: ", index_path.display())),
        "{e}"
    );
    assert!(e.contains("line 1 column"), "{e}");
}

#[test]
fn missing_config_and_missing_path() {
    let dir = tempfile::tempdir().unwrap();
    assert_eq!(
        err(dir.path()),
        format!(
            "config.json not found in {} (expected a Hugging Face model folder)",
            dir.path().display()
        )
    );
    let nowhere = dir.path().join("nowhere");
    assert_eq!(
        err(&nowhere),
        format!(
            "{} does not exist (expected a Hugging Face model folder, its config.json or a GGUF file)",
            nowhere.display()
        )
    );
    // A mistyped GGUF path is told so, not pointed at folders.
    let gguf = dir.path().join("model-Q4_K_M.GGUF");
    assert_eq!(
        err(&gguf),
        format!("{} does not exist (expected a GGUF file)", gguf.display())
    );
}

#[test]
fn no_weights() {
    let dir = tempfile::tempdir().unwrap();
    fs::write(dir.path().join("config.json"), config("LlamaForCausalLM", json!({}))).unwrap();
    fs::write(dir.path().join("pytorch_model.bin"), b"not read").unwrap();
    assert!(err(dir.path()).starts_with(&format!("no safetensors weights in {}", dir.path().display())));
}

#[test]
fn malformed_config_reports_line_and_column() {
    let dir = tempfile::tempdir().unwrap();
    fs::write(
        dir.path().join("config.json"),
        "{\n  \"hidden_size\": 64,\n  \"vocab_size\": 256\n  \"x\": 1\n}\n",
    )
    .unwrap();
    let e = err(dir.path());
    assert!(e.starts_with(&format!("{}: invalid JSON: ", cfg_path(&dir))), "{e}");
    assert!(e.contains("line 4 column 3"), "{e}");
    assert!(!e.contains('\n'));

    fs::write(dir.path().join("config.json"), "[1, 2]").unwrap();
    assert_eq!(
        err(dir.path()),
        format!("{}: expected a JSON object, found a list", cfg_path(&dir))
    );

    // A broken generation_config.json is named as such.
    let dir = model(&config("LlamaForCausalLM", json!({})), |_| St::F32);
    let gen_path = dir.path().join("generation_config.json");
    fs::write(&gen_path, "{\"eos_token_id\": [1,").unwrap();
    assert!(err(dir.path()).starts_with(&format!("{}: invalid JSON: ", gen_path.display())));
    fs::write(&gen_path, "{\"eos_token_id\": [1, -2]}").unwrap();
    assert_eq!(
        err(dir.path()),
        format!(
            "{}: field \"eos_token_id\" must hold token ids (integers from 0 to 2^32-1), got -2",
            gen_path.display()
        )
    );
}

#[test]
fn missing_and_invalid_fields() {
    let dir = model(&config("LlamaForCausalLM", json!({})), |_| St::F32);
    fs::write(
        dir.path().join("config.json"),
        config("LlamaForCausalLM", json!({"hidden_size": Value::Null})),
    )
    .unwrap();
    assert_eq!(
        err(dir.path()),
        format!("{}: missing field \"hidden_size\"", cfg_path(&dir))
    );
    fs::write(
        dir.path().join("config.json"),
        config("LlamaForCausalLM", json!({"num_hidden_layers": "two"})),
    )
    .unwrap();
    assert_eq!(
        err(dir.path()),
        format!(
            "{}: field \"num_hidden_layers\" must be a non-negative integer, got \"two\"",
            cfg_path(&dir)
        )
    );
    fs::write(
        dir.path().join("config.json"),
        config("LlamaForCausalLM", json!({"vocab_size": 1u64 << 40})),
    )
    .unwrap();
    assert!(err(dir.path()).contains("field \"vocab_size\" is 1099511627776, larger than Kiln accepts"));
    fs::write(
        dir.path().join("config.json"),
        config("LlamaForCausalLM", json!({"tie_word_embeddings": "yes"})),
    )
    .unwrap();
    assert!(err(dir.path()).ends_with("field \"tie_word_embeddings\" must be true or false, got \"yes\""));
    fs::write(
        dir.path().join("config.json"),
        config("LlamaForCausalLM", json!({"rope_scaling": {"rope_type": "linear"}})),
    )
    .unwrap();
    assert_eq!(
        err(dir.path()),
        format!("{}: missing field \"rope_scaling.factor\"", cfg_path(&dir))
    );
    // Relations checked by ModelSpec::validate.
    fs::write(
        dir.path().join("config.json"),
        config(
            "LlamaForCausalLM",
            json!({"num_attention_heads": 8, "num_key_value_heads": 3}),
        ),
    )
    .unwrap();
    assert_eq!(
        err(dir.path()),
        format!(
            "{}: num_attention_heads (8) must be a multiple of num_key_value_heads (3)",
            cfg_path(&dir)
        )
    );
    fs::write(
        dir.path().join("config.json"),
        config("LlamaForCausalLM", json!({"num_attention_heads": 0})),
    )
    .unwrap();
    assert_eq!(
        err(dir.path()),
        format!("{}: num_attention_heads must be greater than 0", cfg_path(&dir))
    );
    fs::write(
        dir.path().join("config.json"),
        config("LlamaForCausalLM", json!({"num_attention_heads": 5})),
    )
    .unwrap();
    assert!(err(dir.path()).contains("hidden_size (64) is not a multiple of num_attention_heads (5)"));
}

#[test]
fn unknown_architecture_and_unsupported_features() {
    let dir = model(&config("LlamaForCausalLM", json!({})), |_| St::F32);
    let path = dir.path().join("config.json");
    fs::write(&path, config("MambaForCausalLM", json!({}))).unwrap();
    assert_eq!(
        err(dir.path()),
        format!(
            "{}: unknown architecture \"MambaForCausalLM\" (supported: {})",
            path.display(),
            kiln_core::arch::hf_names().join(", ")
        )
    );
    fs::write(
        &path,
        config(
            "LlamaForCausalLM",
            json!({"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}}),
        ),
    )
    .unwrap();
    assert_eq!(
        err(dir.path()),
        format!(
            "unsupported rope_type 'yarn' (supported: default, linear, llama3, longrope) in {}",
            path.display()
        )
    );
    fs::write(
        &path,
        config(
            "LlamaForCausalLM",
            json!({"rope_scaling": {"type": "dynamic", "factor": 2.0}}),
        ),
    )
    .unwrap();
    assert!(err(dir.path()).starts_with("unsupported rope_type 'dynamic'"));
    fs::write(&path, config("MistralForCausalLM", json!({"hidden_act": "relu2"}))).unwrap();
    assert_eq!(
        err(dir.path()),
        format!(
            "unsupported hidden_act 'relu2' (supported: {}) in {}",
            kiln_core::Act::HF_NAMES,
            path.display()
        )
    );
    fs::write(
        &path,
        config("LlamaForCausalLM", json!({"architectures": [], "model_type": "mamba"})),
    )
    .unwrap();
    assert!(err(dir.path()).contains("unknown architecture \"mamba\""));
    fs::write(&path, config("LlamaForCausalLM", json!({"architectures": []}))).unwrap();
    assert_eq!(
        err(dir.path()),
        format!("{}: missing field \"architectures\"", path.display())
    );
}

#[test]
fn wrong_shape_names_tensor_file_and_both_shapes() {
    let text = config("LlamaForCausalLM", json!({"num_key_value_heads": 4}));
    let tensors = tensors_for(&text, |_| St::F32)
        .into_iter()
        .map(|(n, t)| {
            if n == "model.layers.0.self_attn.q_proj.weight" {
                (n, tensor(St::F32, &[64, 32]))
            } else {
                (n, t)
            }
        })
        .collect();
    let dir = folder(&text, tensors);
    assert_eq!(
        err(dir.path()),
        format!(
            "model.layers.0.self_attn.q_proj.weight in {} has shape [64, 32], expected [64, 64]",
            st_path(&dir)
        )
    );
}

#[test]
fn unsupported_dtype_names_tensor_and_dtype() {
    let text = config("LlamaForCausalLM", json!({}));
    let dir = model(&text, |t| {
        if t.name == "model.norm.weight" {
            St::I64
        } else {
            St::F32
        }
    });
    assert_eq!(
        err(dir.path()),
        format!(
            "model.norm.weight in {} has dtype I64 (Kiln reads F32, F16 and BF16 weights)",
            st_path(&dir)
        )
    );
}

#[test]
fn check_reports_dtype_mismatch_against_a_given_spec() {
    let dir = model(&config("LlamaForCausalLM", json!({})), |_| St::BF16);
    let m = load(dir.path()).unwrap();
    let f32_spec = m.config.layout.clone();
    assert_eq!(
        m.weights.check(&f32_spec).unwrap_err().to_string(),
        format!(
            "model.embed_tokens.weight in {} is stored as bf16, but the spec expects f32",
            st_path(&dir)
        )
    );
}

#[test]
fn truncated_file() {
    let text = config("LlamaForCausalLM", json!({}));
    let dir = model(&text, |_| St::F32);
    let path = dir.path().join("model.safetensors");
    let bytes = fs::read(&path).unwrap();
    let cut = bytes.len() - 100;
    fs::write(&path, &bytes[..cut]).unwrap();
    let e = err(dir.path());
    assert!(
        e.starts_with(&format!("{} is truncated: tensor ", path.display())),
        "{e}"
    );
    assert!(
        e.ends_with(&format!("ends at byte {}, file has {cut}", bytes.len())),
        "{e}"
    );

    // Cut inside the header.
    fs::write(&path, &bytes[..20]).unwrap();
    let e = err(dir.path());
    assert!(
        e.starts_with(&format!(
            "{} is not a valid safetensors file: header length ",
            path.display()
        )),
        "{e}"
    );

    // Shorter than the length prefix.
    fs::write(&path, &bytes[..5]).unwrap();
    assert_eq!(
        err(dir.path()),
        format!(
            "{} is not a valid safetensors file: the file is 5 bytes long, too short for a header",
            path.display()
        )
    );
    fs::write(&path, b"").unwrap();
    assert!(err(dir.path()).contains("the file is 0 bytes long"));
}

#[test]
fn header_length_larger_than_file_and_garbage() {
    let dir = model(&config("LlamaForCausalLM", json!({})), |_| St::F32);
    let path = dir.path().join("model.safetensors");
    let mut bytes = 1_000_000u64.to_le_bytes().to_vec();
    bytes.extend_from_slice(b"{}");
    fs::write(&path, &bytes).unwrap();
    assert_eq!(
        err(dir.path()),
        format!(
            "{} is not a valid safetensors file: header length 1000000 is larger than the rest of the file (2 bytes)",
            path.display()
        )
    );

    // Pseudo-random bytes: an absurd header length.
    let mut x = 0x9E3779B97F4A7C15u64;
    let garbage: Vec<u8> = (0..4096)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect();
    fs::write(&path, &garbage).unwrap();
    assert!(err(dir.path()).starts_with(&format!("{} is not a valid safetensors file: ", path.display())));

    // A plausible length over text that is not JSON, not UTF-8, or not an object.
    fs::write(&path, raw_st("hello world", &[])).unwrap();
    assert!(err(dir.path()).contains("the header is not valid JSON"));
    fs::write(&path, raw_st("\u{0}\u{0}", &[0xff, 0xfe])).unwrap();
    assert!(err(dir.path()).contains("the header is not valid JSON"));
    let mut bad_utf8 = 2u64.to_le_bytes().to_vec();
    bad_utf8.extend_from_slice(&[0xff, 0xfe]);
    fs::write(&path, bad_utf8).unwrap();
    assert!(err(dir.path()).contains("the header is not UTF-8"));
    fs::write(&path, raw_st("[1]", &[])).unwrap();
    assert!(err(dir.path()).contains("the header is a list, expected a JSON object"));
}

#[test]
fn inconsistent_header_entries() {
    let dir = model(&config("LlamaForCausalLM", json!({})), |_| St::F32);
    let path = dir.path().join("model.safetensors");
    let p = path.display();
    // Size does not match shape x dtype.
    fs::write(
        &path,
        raw_st(r#"{"a":{"dtype":"F32","shape":[2,3],"data_offsets":[0,20]}}"#, &[0; 24]),
    )
    .unwrap();
    assert_eq!(
        err(dir.path()),
        format!("{p}: tensor a has 20 bytes of data, but shape [2, 3] of F32 needs 24")
    );
    // Reversed offsets.
    fs::write(
        &path,
        raw_st(r#"{"a":{"dtype":"F32","shape":[1],"data_offsets":[8,4]}}"#, &[0; 24]),
    )
    .unwrap();
    assert!(err(dir.path()).contains("tensor a has data_offsets [8, 4] that end before they begin"));
    // Offsets past the end: absolute byte positions.
    let header = r#"{"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}}"#;
    fs::write(&path, raw_st(header, &[0; 8])).unwrap();
    let end = 8 + header.len() + 16;
    let len = 8 + header.len() + 8;
    assert_eq!(
        err(dir.path()),
        format!("{p} is truncated: tensor a ends at byte {end}, file has {len}")
    );
    // Missing keys, negative or huge dimensions.
    fs::write(
        &path,
        raw_st(r#"{"a":{"dtype":"F32","shape":[-1],"data_offsets":[0,4]}}"#, &[0; 4]),
    )
    .unwrap();
    assert!(err(dir.path()).contains("tensor a has a malformed header entry"));
    fs::write(&path, raw_st(r#"{"a":{"shape":[1],"data_offsets":[0,4]}}"#, &[0; 4])).unwrap();
    assert!(err(dir.path()).contains("tensor a has a malformed header entry"));
    fs::write(
        &path,
        raw_st(
            r#"{"a":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,4]}}"#,
            &[0; 4],
        ),
    )
    .unwrap();
    assert!(err(dir.path()).contains("too large to address"));
    // Huge offsets do not overflow.
    fs::write(
        &path,
        raw_st(
            r#"{"a":{"dtype":"F32","shape":[1],"data_offsets":[18446744073709551611,18446744073709551615]}}"#,
            &[],
        ),
    )
    .unwrap();
    assert!(err(dir.path()).contains("is truncated: tensor a ends at byte"));
    // A dtype the safetensors format does not define is reported when needed.
    fs::write(&path, raw_st(r#"{"__metadata__":{"format":"pt"},"model.embed_tokens.weight":{"dtype":"Q4","shape":[1],"data_offsets":[0,1]}}"#, &[0])).unwrap();
    assert!(err(dir.path()).contains("model.embed_tokens.weight in"));
    assert!(err(dir.path()).contains("has dtype Q4"));
}

#[test]
fn misaligned_tensor_is_copied_aligned() {
    // A header of odd length puts the f32 data at an odd offset.
    let values = [1.5f32, -2.0, 3.25, 0.0];
    let header = r#"{"w":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]},"h":{"dtype":"BF16","shape":[1],"data_offsets":[16,18]}}"#;
    assert_eq!((8 + header.len()) % 2, 1);
    let mut data = f32_bytes(&values);
    data.extend_from_slice(&[0x80, 0x3f]);
    let dir = tempfile::tempdir().unwrap();
    fs::write(dir.path().join("model.safetensors"), raw_st(header, &data)).unwrap();
    let w = Weights::open(dir.path()).unwrap();
    let t = w.get("w").unwrap();
    assert_eq!(t.ptr() as usize % 4, 0);
    assert_eq!(t.data, f32_bytes(&values).as_slice());
    assert_eq!(t.shape, &[2, 2]);
    let h = w.get("h").unwrap();
    assert_eq!(h.ptr() as usize % 2, 0);
    assert_eq!(h.data, &[0x80, 0x3f]);
    let mut names: Vec<&str> = w.names().collect();
    names.sort();
    assert_eq!(names, ["h", "w"]);
    assert!(
        w.get("x")
            .unwrap_err()
            .to_string()
            .starts_with("tensor x not found in ")
    );
}

/// Loads a real checkpoint written by `transformers`, named by `KILN_TEST_HF_DIR`.
#[test]
#[ignore = "needs KILN_TEST_HF_DIR naming a Hugging Face model folder"]
fn real_hf_folder() {
    let dir = std::env::var_os("KILN_TEST_HF_DIR").expect("KILN_TEST_HF_DIR names a model folder");
    let m = load(Path::new(&dir)).unwrap_or_else(|e| panic!("{e}"));
    m.weights.check(&m.spec).unwrap();
    for req in &m.spec.weights {
        let t = m.weights.lookup(&req.name).unwrap();
        assert_eq!(t.shape, req.stored_shape().as_slice());
        assert_eq!(t.len_bytes(), req.bytes());
        assert_eq!(t.ptr() as usize % t.dtype.size(), 0);
    }
    eprintln!(
        "{}: {}, {} layers, hidden {}, head_dim {}, {} parameters, eos {:?}",
        m.dir.display(),
        m.spec.arch,
        m.spec.num_layers(),
        m.spec.dims.hidden_size,
        m.spec.dims.head_dim,
        m.spec.param_count(),
        m.config.eos_token_ids
    );
}

/// The repository's HF-written fixtures (`tests/fixtures/*`, see their README), when present.
#[test]
fn repository_fixtures() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures");
    let expect = [
        ("llama", 16, 2, false, None, vec![2]),
        ("mistral", 16, 1, false, Some(24), vec![2]),
        ("qwen2", 16, 2, true, None, vec![1000]),
        ("qwen3", 32, 2, false, None, vec![1002, 1000]),
    ];
    for (name, head_dim, kv_heads, tied, window, eos) in expect {
        let dir = root.join(name);
        let m = load(&dir).unwrap_or_else(|e| panic!("{name}: {e}"));
        let s = &m.spec;
        assert_eq!(
            (
                s.arch.as_str(),
                s.dims.head_dim,
                s.dims.num_kv_heads,
                s.tied_embeddings()
            ),
            (name, head_dim, kv_heads, tied),
            "{name}"
        );
        assert!(s.attention_windows().iter().all(|&w| w == window), "{name}");
        assert_eq!(dt(s, "model.embed_tokens.weight"), Some(DType::BF16), "{name}");
        assert_eq!(
            dt(s, &lw(0, "self_attn.q_proj.bias")).is_some(),
            name == "qwen2",
            "{name}"
        );
        assert_eq!(
            dt(s, &lw(0, "self_attn.q_norm.weight")).is_some(),
            name == "qwen3",
            "{name}"
        );
        assert_eq!(m.config.eos_token_ids, eos, "{name}");
    }
}

/// xorshift64, for the mutation tests.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

/// Corrupted weight files (flipped bytes, mostly in the header, and cuts) give errors, never
/// panics; whatever still loads passes its own check.
#[test]
fn corrupted_weight_files_never_panic() {
    let text = config("Qwen3ForCausalLM", json!({"head_dim": 8, "num_hidden_layers": 1}));
    let dir = model(&text, norms_f32(St::BF16));
    let path = dir.path().join("model.safetensors");
    let good = fs::read(&path).unwrap();
    let header_end = 8 + u64::from_le_bytes(good[..8].try_into().unwrap()) as usize;
    let mut rng = Rng(0x2545F4914F6CDD1D);
    for round in 0..400 {
        let mut bytes = good.clone();
        for _ in 0..1 + rng.below(4) {
            let at = if rng.below(4) == 0 {
                rng.below(bytes.len())
            } else {
                rng.below(header_end)
            };
            bytes[at] = match rng.below(3) {
                0 => rng.next() as u8,
                1 => b"0123456789[]{},:\"-e."[rng.below(20)],
                _ => bytes[at] ^ (1 << rng.below(8)),
            };
        }
        if round % 5 == 0 {
            bytes.truncate(rng.below(bytes.len() + 1));
        }
        fs::write(&path, &bytes).unwrap();
        match load(dir.path()) {
            Ok(m) => m.weights.check(&m.spec).unwrap(),
            Err(e) => assert!(!e.to_string().contains('\n'), "{e}"),
        }
    }
}

/// Every config field replaced by values of every JSON type gives a model or an error, never
/// a panic.
#[test]
fn odd_config_values_never_panic() {
    let base: Value = serde_json::from_str(&config(
        "Qwen2ForCausalLM",
        json!({
            "head_dim": 16, "use_sliding_window": true, "sliding_window": 8, "max_window_layers": 1,
            "rope_scaling": {"rope_type": "llama3", "factor": 8, "low_freq_factor": 1, "high_freq_factor": 4},
            "layer_types": ["full_attention", "sliding_attention"], "eos_token_id": [1, 2], "bos_token_id": 0,
            "tie_word_embeddings": true, "attention_bias": true
        }),
    ))
    .unwrap();
    let odd = [
        json!(null),
        json!(0),
        json!(-1),
        json!(1.5),
        json!(1e300),
        json!(u64::MAX),
        json!("x"),
        json!(""),
        json!(true),
        json!([]),
        json!([0, "a"]),
        json!({}),
        json!({"rope_type": "linear", "factor": 0}),
    ];
    let keys: Vec<String> = base.as_object().unwrap().keys().cloned().collect();
    for key in keys {
        for v in &odd {
            for arch in [
                "Qwen2ForCausalLM",
                "Qwen3ForCausalLM",
                "LlamaForCausalLM",
                "MistralForCausalLM",
            ] {
                let mut c = base.clone();
                c["architectures"] = json!([arch]);
                c[key.as_str()] = v.clone();
                let text = c.to_string();
                if let Ok(cfg) = ModelConfig::from_json(&text, Path::new("c")) {
                    cfg.layout.validate().unwrap();
                }
            }
        }
    }
}
