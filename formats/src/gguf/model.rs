//! From GGUF metadata and tensor table to a [`ModelSpec`].
//!
//! | spec field | GGUF source (`{a}` = `general.architecture`) | absent |
//! |---|---|---|
//! | `arch` | `general.architecture`: `llama`, `qwen2`, `qwen3` | error |
//! | layers | `{a}.block_count` | error |
//! | `hidden_size` | `{a}.embedding_length` | error |
//! | `intermediate_size` | `{a}.feed_forward_length` | error |
//! | `num_heads` | `{a}.attention.head_count` | error |
//! | `num_kv_heads` | `{a}.attention.head_count_kv` | `num_heads` |
//! | `head_dim` | `{a}.attention.key_length` | `hidden_size / num_heads` |
//! | `max_position_embeddings` | `{a}.context_length` | error |
//! | `rope.theta` | `{a}.rope.freq_base` | 10000 (llama.cpp's default) |
//! | `rope.scaling` | `{a}.rope.scaling.type` + `.factor` (or the older `{a}.rope.scale_linear`); a `rope_freqs.weight` tensor is recognised as Llama 3 scaling | none |
//! | `rms_norm_eps` | `{a}.attention.layer_norm_rms_epsilon` | error |
//! | `vocab_size` | rows of `token_embd.weight` (`{a}.vocab_size`, when present, must agree) | |
//! | `tie_word_embeddings` | `output.weight` absent | |
//! | `attention_bias` | Qwen2, or `blk.0.attn_q.bias` present | |
//! | `o_bias` | `blk.0.attn_output.bias` present | |
//! | `qk_norm` | Qwen3, or `blk.0.attn_q_norm.weight` present | |
//! | storage types | each tensor's GGML type | |
//!
//! Integer keys may be stored in any integer type (converters differ); a key stored as a
//! per-layer array is accepted when all its entries are equal. `{a}.attention.value_length`
//! must equal the key length and `{a}.rope.dimension_count` the head size (partial rotary
//! embeddings are not supported). Sliding-window keys are ignored, as llama.cpp ignores them
//! for these architectures.
//!
//! GGUF lists dimensions innermost first; shapes here are outermost first (see
//! [`super::parse::TensorInfo::shape`]), and every tensor of
//! [`weight_list`]`(spec)` is checked for presence and shape before the spec is returned.

use super::error::GgufError;
use super::parse::{Array, GgufHeader, TensorInfo, Value};
use kiln_core::weights::weight_list;
use kiln_core::{Arch, DType, LayerDTypes, LayerSpec, LayerWeight, ModelSpec, Rope, RopeScaling, WeightId};
use std::collections::BTreeMap;
use std::path::Path;

/// `general.architecture` values Kiln reads.
pub const SUPPORTED_ARCHITECTURES: &[&str] = &["llama", "qwen2", "qwen3"];

/// Largest accepted single dimension (as the safetensors front end).
const MAX_DIM: u64 = 1 << 24;
/// Largest accepted layer count.
const MAX_LAYERS: u64 = 1 << 16;
/// Largest accepted context length.
const MAX_POSITIONS: u64 = 1 << 30;

/// The architecture of a `general.architecture` value.
pub fn arch_from_gguf(name: &str) -> Option<Arch> {
    match name {
        "llama" => Some(Arch::Llama),
        "qwen2" => Some(Arch::Qwen2),
        "qwen3" => Some(Arch::Qwen3),
        _ => None,
    }
}

/// Whether llama.cpp's converter permuted the q/k rows of this architecture (see
/// [`super::permute`]): true for `llama` (normal RoPE), false for Qwen (NeoX RoPE).
pub fn qk_permuted(arch: Arch) -> bool {
    matches!(arch, Arch::Llama | Arch::Mistral)
}

/// The GGUF tensor name of a model weight (`token_embd.weight`, `blk.3.attn_q.weight`, ...).
pub fn gguf_tensor_name(id: WeightId) -> String {
    match id {
        WeightId::Embed => "token_embd.weight".into(),
        WeightId::FinalNorm => "output_norm.weight".into(),
        WeightId::LmHead => "output.weight".into(),
        WeightId::Layer(i, w) => {
            let suffix = match w {
                LayerWeight::AttnNorm => "attn_norm.weight",
                LayerWeight::Q => "attn_q.weight",
                LayerWeight::K => "attn_k.weight",
                LayerWeight::V => "attn_v.weight",
                LayerWeight::O => "attn_output.weight",
                LayerWeight::QBias => "attn_q.bias",
                LayerWeight::KBias => "attn_k.bias",
                LayerWeight::VBias => "attn_v.bias",
                LayerWeight::OBias => "attn_output.bias",
                LayerWeight::QNorm => "attn_q_norm.weight",
                LayerWeight::KNorm => "attn_k_norm.weight",
                LayerWeight::MlpNorm => "ffn_norm.weight",
                LayerWeight::Gate => "ffn_gate.weight",
                LayerWeight::Up => "ffn_up.weight",
                LayerWeight::Down => "ffn_down.weight",
            };
            format!("blk.{i}.{suffix}")
        }
    }
}

/// Typed access to the metadata, with errors naming the file and key.
pub(crate) struct Meta<'a> {
    pub header: &'a GgufHeader,
    pub path: &'a Path,
}

impl<'a> Meta<'a> {
    pub fn bad(&self, key: &str, problem: String) -> GgufError {
        GgufError::BadKey {
            path: self.path.to_path_buf(),
            key: key.to_string(),
            problem,
        }
    }

    pub fn missing(&self, key: &str) -> GgufError {
        GgufError::MissingKey {
            path: self.path.to_path_buf(),
            key: key.to_string(),
        }
    }

    pub fn get(&self, key: &str) -> Option<&'a Value> {
        self.header.get(key)
    }

    pub fn string(&self, key: &str) -> Result<Option<&'a str>, GgufError> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s)),
            Some(v) => Err(self.bad(key, format!("is {}, expected a string", v.describe()))),
        }
    }

    pub fn bool(&self, key: &str) -> Result<Option<bool>, GgufError> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(v) => Err(self.bad(key, format!("is {}, expected a bool", v.describe()))),
        }
    }

    /// A non-negative integer of any width, at most `max`. A per-layer array of equal values
    /// is accepted as that value.
    pub fn uint(&self, key: &str, max: u64) -> Result<Option<u64>, GgufError> {
        let v = match self.get(key) {
            None => return Ok(None),
            Some(Value::Array(a)) => {
                let values = a
                    .to_f64s()
                    .filter(|v| !v.is_empty())
                    .ok_or_else(|| self.bad(key, format!("is {}, expected an integer", describe_array(a))))?;
                if values.iter().any(|&v| v != values[0]) {
                    return Err(GgufError::Unsupported {
                        path: self.path.to_path_buf(),
                        what: format!(
                            "per-layer values of \"{key}\" that differ between layers ({})",
                            short_list(&values)
                        ),
                    });
                }
                let v = values[0];
                if v < 0.0 || v.fract() != 0.0 {
                    return Err(self.bad(key, format!("holds {v}, expected a non-negative integer")));
                }
                v as u64
            }
            Some(v) => v
                .as_u64()
                .ok_or_else(|| self.bad(key, format!("is {}, expected a non-negative integer", v.describe())))?,
        };
        if v > max {
            return Err(self.bad(key, format!("is {v}, larger than the supported maximum {max}")));
        }
        Ok(Some(v))
    }

    pub fn req_uint(&self, key: &str, max: u64) -> Result<u64, GgufError> {
        self.uint(key, max)?.ok_or_else(|| self.missing(key))
    }

    /// A finite number of any numeric type.
    pub fn float(&self, key: &str) -> Result<Option<f64>, GgufError> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => match v.as_f64() {
                Some(f) if f.is_finite() => Ok(Some(f)),
                Some(f) => Err(self.bad(key, format!("is {f}, expected a finite number"))),
                None => Err(self.bad(key, format!("is {}, expected a number", v.describe()))),
            },
        }
    }
}

fn describe_array(a: &Array) -> String {
    format!("an array of {} {}", a.len(), a.elem_type())
}

fn short_list(values: &[f64]) -> String {
    let mut s: Vec<String> = values.iter().take(8).map(|v| v.to_string()).collect();
    if values.len() > 8 {
        s.push("...".into());
    }
    s.join(", ")
}

/// The architecture named by `general.architecture`.
pub(crate) fn architecture(meta: &Meta) -> Result<(Arch, &'static str), GgufError> {
    let key = "general.architecture";
    let name = meta.string(key)?.ok_or_else(|| meta.missing(key))?;
    let arch = arch_from_gguf(name).ok_or_else(|| GgufError::UnknownArchitecture {
        path: meta.path.to_path_buf(),
        name: name.to_string(),
    })?;
    let prefix = SUPPORTED_ARCHITECTURES
        .iter()
        .find(|&&a| a == name)
        .copied()
        .unwrap_or("llama");
    Ok((arch, prefix))
}

/// Builds and validates the spec of the model in `header`; `bytes` is the whole file (read for
/// the `rope_freqs.weight` tensor only). Every tensor the spec needs is checked for presence
/// and shape.
pub fn spec_from_header(header: &GgufHeader, bytes: &[u8], path: &Path) -> Result<ModelSpec, GgufError> {
    spec_from_parts(header, &[bytes], path)
}

/// [`spec_from_header`] for a split model: `parts[i]` is the whole of part `i` (see
/// [`super::split`]).
pub fn spec_from_parts(header: &GgufHeader, parts: &[&[u8]], path: &Path) -> Result<ModelSpec, GgufError> {
    let meta = Meta { header, path };
    let (arch, a) = architecture(&meta)?;
    let key = |k: &str| format!("{a}.{k}");
    let invalid = |message: String| GgufError::InvalidModel {
        path: path.to_path_buf(),
        message,
    };
    let dim = |k: &str| -> Result<usize, GgufError> {
        let k = key(k);
        let v = meta.req_uint(&k, MAX_DIM)?;
        if v == 0 {
            return Err(meta.bad(&k, "is 0, expected a positive number".into()));
        }
        Ok(v as usize)
    };

    let num_layers = meta.req_uint(&key("block_count"), MAX_LAYERS)? as usize;
    let hidden_size = dim("embedding_length")?;
    let intermediate_size = dim("feed_forward_length")?;
    let num_heads = dim("attention.head_count")?;
    let num_kv_heads = match meta.uint(&key("attention.head_count_kv"), MAX_DIM)? {
        Some(0) => {
            return Err(meta.bad(
                &key("attention.head_count_kv"),
                "is 0, expected a positive number".into(),
            ));
        }
        Some(v) => v as usize,
        None => num_heads,
    };
    let head_dim = match meta.uint(&key("attention.key_length"), MAX_DIM)? {
        Some(v) => v as usize,
        None => {
            if !hidden_size.is_multiple_of(num_heads) {
                return Err(invalid(format!(
                    "{} ({hidden_size}) is not a multiple of {} ({num_heads}) and {} is absent",
                    key("embedding_length"),
                    key("attention.head_count"),
                    key("attention.key_length")
                )));
            }
            hidden_size / num_heads
        }
    };
    if let Some(v) = meta.uint(&key("attention.value_length"), MAX_DIM)?
        && v as usize != head_dim
    {
        return Err(GgufError::Unsupported {
            path: path.to_path_buf(),
            what: format!(
                "{} = {v} different from the key length {head_dim}",
                key("attention.value_length")
            ),
        });
    }
    if let Some(v) = meta.uint(&key("rope.dimension_count"), MAX_DIM)?
        && v as usize != head_dim
    {
        return Err(GgufError::Unsupported {
            path: path.to_path_buf(),
            what: format!(
                "partial rotary embedding ({} = {v}, head size {head_dim})",
                key("rope.dimension_count")
            ),
        });
    }
    let max_position_embeddings = meta.req_uint(&key("context_length"), MAX_POSITIONS)? as usize;
    let eps_key = key("attention.layer_norm_rms_epsilon");
    let rms_norm_eps = meta.float(&eps_key)?.ok_or_else(|| meta.missing(&eps_key))? as f32;
    let theta = meta.float(&key("rope.freq_base"))?.unwrap_or(10000.0);
    let scaling = rope_scaling(&meta, a, header, parts, theta, head_dim)?;

    // Vocabulary: the embedding's rows.
    let embed_name = gguf_tensor_name(WeightId::Embed);
    let embed = header.tensor(&embed_name).ok_or_else(|| GgufError::MissingTensor {
        path: path.to_path_buf(),
        tensor: embed_name.clone(),
        weight: WeightId::Embed.hf_name(),
    })?;
    if embed.ne.len() != 2 || embed.ne[0] != hidden_size as u64 {
        let rows = embed.ne.last().copied().unwrap_or(0) as usize;
        return Err(GgufError::ShapeMismatch {
            path: path.to_path_buf(),
            tensor: embed_name,
            found: embed.shape(),
            expected: vec![rows, hidden_size],
        });
    }
    let vocab_size = embed.ne[1] as usize;
    if vocab_size == 0 || vocab_size as u64 > MAX_DIM {
        return Err(invalid(format!(
            "{embed_name} has {vocab_size} rows (expected 1 to {MAX_DIM})"
        )));
    }
    if let Some(v) = meta.uint(&key("vocab_size"), u64::MAX)?
        && v as usize != vocab_size
    {
        return Err(invalid(format!(
            "{} is {v}, but {embed_name} has {vocab_size} rows",
            key("vocab_size")
        )));
    }

    let has = |name: &str| header.tensor(name).is_some();
    let tie_word_embeddings = !has(&gguf_tensor_name(WeightId::LmHead));
    let first = |lw| gguf_tensor_name(WeightId::Layer(0, lw));
    let attention_bias = arch == Arch::Qwen2 || has(&first(LayerWeight::QBias));
    let o_bias = has(&first(LayerWeight::OBias));
    let qk_norm = arch == Arch::Qwen3 || has(&first(LayerWeight::QNorm));

    let build = |dtype_of: &dyn Fn(WeightId) -> DType| -> ModelSpec {
        let embed_dtype = dtype_of(WeightId::Embed);
        let layers = (0..num_layers)
            .map(|i| {
                let get = |lw| dtype_of(WeightId::Layer(i, lw));
                let opt = |present: bool, lw| present.then(|| get(lw));
                LayerSpec {
                    sliding_window: None,
                    dtypes: LayerDTypes {
                        attn_norm: get(LayerWeight::AttnNorm),
                        q: get(LayerWeight::Q),
                        k: get(LayerWeight::K),
                        v: get(LayerWeight::V),
                        o: get(LayerWeight::O),
                        q_bias: opt(attention_bias, LayerWeight::QBias),
                        k_bias: opt(attention_bias, LayerWeight::KBias),
                        v_bias: opt(attention_bias, LayerWeight::VBias),
                        o_bias: opt(o_bias, LayerWeight::OBias),
                        q_norm: opt(qk_norm, LayerWeight::QNorm),
                        k_norm: opt(qk_norm, LayerWeight::KNorm),
                        mlp_norm: get(LayerWeight::MlpNorm),
                        gate: get(LayerWeight::Gate),
                        up: get(LayerWeight::Up),
                        down: get(LayerWeight::Down),
                    },
                }
            })
            .collect();
        ModelSpec {
            arch,
            hidden_size,
            intermediate_size,
            num_heads,
            num_kv_heads,
            head_dim,
            vocab_size,
            max_position_embeddings,
            rms_norm_eps,
            rope: Rope {
                theta,
                scaling: scaling.clone(),
            },
            tie_word_embeddings,
            attention_bias,
            o_bias,
            qk_norm,
            embed_dtype,
            final_norm_dtype: dtype_of(WeightId::FinalNorm),
            lm_head_dtype: if tie_word_embeddings {
                embed_dtype
            } else {
                dtype_of(WeightId::LmHead)
            },
            layers,
        }
    };

    // The layout first, validated, so impossible dimensions are reported as such; then every
    // tensor it needs, in checkpoint order; then the spec with the types found.
    let layout = build(&|_| DType::F32);
    layout
        .validate()
        .map_err(|message| invalid(gguf_field_names(&message, a)))?;
    let dtypes = check_tensors(header, &layout, path, false)?;
    let spec = build(&|id| dtypes.get(&id).copied().unwrap_or(DType::F32));
    Ok(spec)
}

/// `ModelSpec::validate`'s message with the Hugging Face field names replaced by the GGUF keys
/// they come from.
fn gguf_field_names(message: &str, a: &str) -> String {
    let mut m = message.to_string();
    for (hf, gguf) in [
        ("num_hidden_layers", "block_count"),
        ("hidden_size", "embedding_length"),
        ("intermediate_size", "feed_forward_length"),
        ("num_attention_heads", "attention.head_count"),
        ("num_key_value_heads", "attention.head_count_kv"),
        ("max_position_embeddings", "context_length"),
        ("rope_theta", "rope.freq_base"),
        ("rms_norm_eps", "attention.layer_norm_rms_epsilon"),
    ] {
        m = m.replace(hf, &format!("{a}.{gguf}"));
    }
    m
}

/// Checks every tensor of `weight_list(spec)`: present, of the expected shape and, when
/// `check_dtypes`, of the type the spec records. Returns each tensor's type.
pub fn check_tensors(
    header: &GgufHeader,
    spec: &ModelSpec,
    path: &Path,
    check_dtypes: bool,
) -> Result<BTreeMap<WeightId, DType>, GgufError> {
    let mut out = BTreeMap::new();
    for req in weight_list(spec) {
        let name = gguf_tensor_name(req.id);
        let t: &TensorInfo = header.tensor(&name).ok_or_else(|| GgufError::MissingTensor {
            path: path.to_path_buf(),
            tensor: name.clone(),
            weight: req.id.hf_name(),
        })?;
        let shape = t.shape();
        if shape != req.shape {
            return Err(GgufError::ShapeMismatch {
                path: path.to_path_buf(),
                tensor: name,
                found: shape,
                expected: req.shape,
            });
        }
        if check_dtypes && t.dtype != req.dtype {
            return Err(GgufError::DTypeMismatch {
                path: path.to_path_buf(),
                tensor: name,
                found: t.dtype.name().into(),
                expected: req.dtype.name().into(),
            });
        }
        out.insert(req.id, t.dtype);
    }
    Ok(out)
}

/// RoPE scaling from `{a}.rope.scaling.*` / `{a}.rope.scale_linear` and a `rope_freqs.weight`
/// tensor.
fn rope_scaling(
    meta: &Meta,
    a: &str,
    header: &GgufHeader,
    parts: &[&[u8]],
    theta: f64,
    head_dim: usize,
) -> Result<RopeScaling, GgufError> {
    let unsupported = |what: String| GgufError::Unsupported {
        path: meta.path.to_path_buf(),
        what,
    };
    let type_key = format!("{a}.rope.scaling.type");
    let factor_key = format!("{a}.rope.scaling.factor");
    let linear_key = format!("{a}.rope.scale_linear");
    let mut scaling = match meta.string(&type_key)? {
        None | Some("none") => match meta.float(&linear_key)? {
            Some(f) if f != 1.0 => linear(meta, &linear_key, f)?,
            _ => RopeScaling::None,
        },
        Some("linear") => {
            let f = meta
                .float(&factor_key)?
                .or(meta.float(&linear_key)?)
                .ok_or_else(|| meta.missing(&factor_key))?;
            linear(meta, &factor_key, f)?
        }
        Some(other) => {
            return Err(unsupported(format!(
                "rope scaling type \"{other}\" in {type_key} (supported: none, linear)"
            )));
        }
    };
    if let Some(t) = header.tensor("rope_freqs.weight") {
        let half = head_dim / 2;
        let what = || {
            format!(
                "rope_freqs.weight tensor (per-frequency RoPE factors, ne {:?}, {}) that does not \
                 match Llama 3 scaling",
                t.ne, t.dtype
            )
        };
        if t.dtype != DType::F32 || t.elems() != half as u64 {
            return Err(unsupported(what()));
        }
        let bytes = parts.get(t.part).ok_or_else(|| unsupported(what()))?;
        let data = &bytes[t.start as usize..(t.start + t.size) as usize];
        let factors: Vec<f32> = data
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        if factors.iter().any(|&f| f != 1.0) {
            if scaling != RopeScaling::None {
                return Err(unsupported(
                    "rope_freqs.weight together with linear rope scaling".into(),
                ));
            }
            let original = meta
                .float(&format!("{a}.rope.scaling.original_context_length"))?
                .unwrap_or(8192.0);
            scaling = fit_llama3(&factors, theta, head_dim, original).ok_or_else(|| unsupported(what()))?;
        }
    }
    Ok(scaling)
}

fn linear(meta: &Meta, key: &str, factor: f64) -> Result<RopeScaling, GgufError> {
    if factor <= 0.0 {
        return Err(meta.bad(key, format!("is {factor}, expected a positive factor")));
    }
    Ok(RopeScaling::Linear { factor })
}

/// The Llama 3 parameters that reproduce `factors` (what `convert_hf_to_gguf.py` writes as
/// `rope_freqs.weight`: the divisor of each inverse frequency), trying the published
/// low/high frequency factors (1, 4) and the file's original context length.
pub(crate) fn fit_llama3(factors: &[f32], theta: f64, head_dim: usize, original: f64) -> Option<RopeScaling> {
    let factor = factors.iter().fold(0f32, |m, &f| m.max(f)) as f64;
    let (low, high) = (1.0f64, 4.0f64);
    let low_wavelen = original / low;
    let high_wavelen = original / high;
    for (i, &got) in factors.iter().enumerate() {
        let freq = 1.0 / theta.powf((2 * i) as f64 / head_dim as f64);
        let wavelen = 2.0 * std::f64::consts::PI / freq;
        let expect = if wavelen < high_wavelen {
            1.0
        } else if wavelen > low_wavelen {
            factor
        } else {
            let smooth = (original / wavelen - low) / (high - low);
            1.0 / ((1.0 - smooth) / factor + smooth)
        };
        if ((got as f64) - expect).abs() > 1e-4 * expect {
            return None;
        }
    }
    Some(RopeScaling::Llama3 {
        factor,
        low_freq_factor: low,
        high_freq_factor: high,
        original_max_position_embeddings: original,
    })
}
