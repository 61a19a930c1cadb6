//! Reading a Hugging Face `config.json` (and `generation_config.json`) into [`ModelConfig`].
//!
//! Configs written by different `transformers` versions differ (`rope_scaling` vs
//! `rope_parameters`, `torch_dtype` vs `dtype`, absent vs null fields), so the file is read as a
//! [`serde_json::Value`] and every field is interpreted the way `transformers` 5 does for the
//! architecture at hand, defaults included:
//!
//! | field | absent | null |
//! |---|---|---|
//! | `num_key_value_heads` | Llama: `num_attention_heads`; Mistral: 8; Qwen2/Qwen3: 32 | `num_attention_heads` |
//! | `head_dim` | Qwen3: 128; others: `hidden_size / num_attention_heads` | `hidden_size / num_attention_heads` |
//! | `max_position_embeddings` | Llama: 2048; Mistral: 131072; Qwen2/Qwen3: 32768 | same |
//! | `rms_norm_eps` | 1e-6 | same |
//! | `rope_theta` | 10000 | same |
//! | `tie_word_embeddings` | false (all four) | false |
//! | `sliding_window` | Mistral, Qwen: 4096 | no window |
//!
//! The core dimensions (`hidden_size`, `intermediate_size`, `num_hidden_layers`,
//! `num_attention_heads`, `vocab_size`) are required: a real checkpoint always states them, and
//! `transformers`' class defaults (a 7B model) would only turn a broken config into a confusing
//! shape mismatch later.

use super::error::ModelError;
use kiln_core::{Arch, DType, LayerDTypes, LayerSpec, LayerWeight, ModelSpec, Rope, RopeScaling, WeightId};
use serde_json::{Map, Value};
use std::path::{Path, PathBuf};

/// Largest accepted size of a single dimension (hidden size, vocabulary, heads, ...). Far above
/// any real model; it keeps every product the spec forms (`heads * head_dim`,
/// `vocab * hidden * 4`) far from overflowing.
const MAX_DIM: usize = 1 << 24;
/// Largest accepted `num_hidden_layers`.
const MAX_LAYERS: usize = 1 << 16;
/// Largest accepted `max_position_embeddings` (and sliding window).
const MAX_POSITIONS: usize = 1 << 30;

/// What Kiln takes from a model's `config.json` and `generation_config.json`: the dimensions
/// and constants that become the [`ModelSpec`] (together with the tensor types found in the
/// weights, see [`ModelConfig::spec`]), plus what the runtime needs besides (BOS/EOS ids).
#[derive(Clone, Debug, PartialEq)]
pub struct ModelConfig {
    /// The `config.json` this was read from (used in error messages).
    pub path: PathBuf,
    /// `generation_config.json`, when one was found next to it and read.
    pub generation_config: Option<PathBuf>,
    /// The Hugging Face architecture name (`architectures[0]`, or the one implied by
    /// `model_type`), e.g. `Qwen2ForCausalLM`.
    pub architecture: String,
    pub arch: Arch,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub vocab_size: usize,
    pub max_position_embeddings: usize,
    pub rms_norm_eps: f32,
    pub rope: Rope,
    pub tie_word_embeddings: bool,
    /// q/k/v projections carry biases.
    pub attention_bias: bool,
    /// The output projection carries a bias.
    pub o_bias: bool,
    /// Per-head RMSNorm of q and k (Qwen3).
    pub qk_norm: bool,
    /// Sliding window of each layer (`None` = full attention). A window at least as long as
    /// `max_position_embeddings` never excludes anything and is recorded as `None`.
    pub sliding_windows: Vec<Option<usize>>,
    /// `dtype` (transformers 5) or `torch_dtype` (older): the type the checkpoint was saved
    /// in. Informational only; the spec takes each tensor's type from the weight files.
    pub torch_dtype: Option<String>,
    /// `bos_token_id` from `generation_config.json`, else from `config.json`.
    pub bos_token_id: Option<u32>,
    /// Every end-of-sequence id: those of `generation_config.json` first, then those of
    /// `config.json`, without duplicates. Empty when neither file names one.
    pub eos_token_ids: Vec<u32>,
}

impl ModelConfig {
    /// Reads `config_path` and, when present, `generation_config.json` in the same folder.
    pub fn from_file(config_path: &Path) -> Result<ModelConfig, ModelError> {
        let text = read_text(config_path)?;
        let mut config = ModelConfig::from_json(&text, config_path)?;
        let dir = config_path.parent().unwrap_or(Path::new(""));
        let gen_path = dir.join("generation_config.json");
        match kiln_core::files::read_to_string(&gen_path) {
            Ok(text) => config.apply_generation_config(&text, &gen_path)?,
            Err(e) if e.is_not_found() => {}
            Err(e) => return Err(e.into()),
        }
        Ok(config)
    }

    /// Parses the text of a `config.json`; `path` is only used in error messages.
    /// `generation_config.json` is not consulted (see [`Self::apply_generation_config`]).
    pub fn from_json(text: &str, path: &Path) -> Result<ModelConfig, ModelError> {
        let value: Value = serde_json::from_str(text).map_err(|source| ModelError::Json {
            path: path.to_path_buf(),
            source,
        })?;
        let Value::Object(map) = &value else {
            return Err(ModelError::InvalidConfig {
                path: path.to_path_buf(),
                message: format!("expected a JSON object, found {}", describe(&value)),
            });
        };
        parse_config(&Obj {
            map,
            path,
            prefix: String::new(),
        })
    }

    /// Merges the BOS/EOS ids of a `generation_config.json` text: its EOS ids go first, then
    /// those already known from `config.json`; its BOS id, when set, replaces the config's.
    pub fn apply_generation_config(&mut self, text: &str, path: &Path) -> Result<(), ModelError> {
        let value: Value = serde_json::from_str(text).map_err(|source| ModelError::Json {
            path: path.to_path_buf(),
            source,
        })?;
        let Value::Object(map) = &value else {
            return Err(ModelError::InvalidConfig {
                path: path.to_path_buf(),
                message: format!("expected a JSON object, found {}", describe(&value)),
            });
        };
        let g = Obj {
            map,
            path,
            prefix: String::new(),
        };
        let mut eos = g.token_ids("eos_token_id")?;
        for id in std::mem::take(&mut self.eos_token_ids) {
            if !eos.contains(&id) {
                eos.push(id);
            }
        }
        self.eos_token_ids = eos;
        if let Some(bos) = g.token_id("bos_token_id")? {
            self.bos_token_id = Some(bos);
        }
        self.generation_config = Some(path.to_path_buf());
        Ok(())
    }

    /// Builds the spec, asking `dtype_of` for the storage type of every tensor the model reads
    /// (in checkpoint order), and validates it. When embeddings are tied the output head is not
    /// asked for: it is the embedding table. The config's own consistency is checked first (as
    /// by [`Self::uniform_spec`]), so `dtype_of` is only called for a well-formed model.
    pub fn spec(
        &self,
        mut dtype_of: impl FnMut(WeightId) -> Result<DType, ModelError>,
    ) -> Result<ModelSpec, ModelError> {
        self.uniform_spec(DType::F32)?;
        self.build_spec(&mut dtype_of)
    }

    /// The spec with every tensor of type `dtype`, validated: the layout (which tensors, which
    /// shapes) before the real types are known.
    pub fn uniform_spec(&self, dtype: DType) -> Result<ModelSpec, ModelError> {
        self.build_spec(&mut |_| Ok(dtype))
    }

    fn build_spec(
        &self,
        dtype_of: &mut dyn FnMut(WeightId) -> Result<DType, ModelError>,
    ) -> Result<ModelSpec, ModelError> {
        let embed_dtype = dtype_of(WeightId::Embed)?;
        let mut layers = Vec::with_capacity(self.num_layers);
        for (i, &sliding_window) in self.sliding_windows.iter().enumerate() {
            let mut get = |lw| dtype_of(WeightId::Layer(i, lw));
            // Checkpoint order, as in `weight_list`, so the first problem reported is the first
            // one in the file.
            let attn_norm = get(LayerWeight::AttnNorm)?;
            let q = get(LayerWeight::Q)?;
            let k = get(LayerWeight::K)?;
            let v = get(LayerWeight::V)?;
            let o = get(LayerWeight::O)?;
            let mut opt = |present: bool, lw| if present { get(lw).map(Some) } else { Ok(None) };
            let q_bias = opt(self.attention_bias, LayerWeight::QBias)?;
            let k_bias = opt(self.attention_bias, LayerWeight::KBias)?;
            let v_bias = opt(self.attention_bias, LayerWeight::VBias)?;
            let o_bias = opt(self.o_bias, LayerWeight::OBias)?;
            let q_norm = opt(self.qk_norm, LayerWeight::QNorm)?;
            let k_norm = opt(self.qk_norm, LayerWeight::KNorm)?;
            let dtypes = LayerDTypes {
                attn_norm,
                q,
                k,
                v,
                o,
                q_bias,
                k_bias,
                v_bias,
                o_bias,
                q_norm,
                k_norm,
                mlp_norm: get(LayerWeight::MlpNorm)?,
                gate: get(LayerWeight::Gate)?,
                up: get(LayerWeight::Up)?,
                down: get(LayerWeight::Down)?,
            };
            layers.push(LayerSpec { sliding_window, dtypes });
        }
        let final_norm_dtype = dtype_of(WeightId::FinalNorm)?;
        let lm_head_dtype = if self.tie_word_embeddings {
            embed_dtype
        } else {
            dtype_of(WeightId::LmHead)?
        };
        let spec = ModelSpec {
            arch: self.arch,
            hidden_size: self.hidden_size,
            intermediate_size: self.intermediate_size,
            num_heads: self.num_heads,
            num_kv_heads: self.num_kv_heads,
            head_dim: self.head_dim,
            vocab_size: self.vocab_size,
            max_position_embeddings: self.max_position_embeddings,
            rms_norm_eps: self.rms_norm_eps,
            rope: self.rope.clone(),
            tie_word_embeddings: self.tie_word_embeddings,
            attention_bias: self.attention_bias,
            o_bias: self.o_bias,
            qk_norm: self.qk_norm,
            embed_dtype,
            final_norm_dtype,
            lm_head_dtype,
            layers,
        };
        spec.validate().map_err(|message| ModelError::InvalidConfig {
            path: self.path.clone(),
            message,
        })?;
        Ok(spec)
    }
}

/// Reads a whole text file, refusing anything but a regular file ([`ModelError::File`]).
pub(crate) fn read_text(path: &Path) -> Result<String, ModelError> {
    Ok(kiln_core::files::read_to_string(path)?)
}

/// A short rendering of a JSON value for error messages.
pub(crate) fn describe(v: &Value) -> String {
    let s = match v {
        Value::Null => return "null".into(),
        Value::Object(_) => return "an object".into(),
        Value::Array(_) => return "a list".into(),
        other => other.to_string(),
    };
    if s.chars().count() > 40 {
        let cut: String = s.chars().take(40).collect();
        format!("{cut}...")
    } else {
        s
    }
}

/// A JSON object being read, with the file it came from and the dotted prefix of its fields.
struct Obj<'a> {
    map: &'a Map<String, Value>,
    path: &'a Path,
    prefix: String,
}

impl<'a> Obj<'a> {
    fn name(&self, key: &str) -> String {
        format!("{}{key}", self.prefix)
    }

    fn invalid(&self, key: &str, problem: String) -> ModelError {
        ModelError::InvalidField {
            path: self.path.to_path_buf(),
            field: self.name(key),
            problem,
        }
    }

    fn missing(&self, key: &str) -> ModelError {
        ModelError::MissingField {
            path: self.path.to_path_buf(),
            field: self.name(key),
        }
    }

    fn config_error(&self, message: String) -> ModelError {
        ModelError::InvalidConfig {
            path: self.path.to_path_buf(),
            message,
        }
    }

    fn unsupported(&self, what: String) -> ModelError {
        ModelError::Unsupported {
            path: self.path.to_path_buf(),
            what,
        }
    }

    /// The value, `None` when absent or null.
    fn get(&self, key: &str) -> Option<&'a Value> {
        self.map.get(key).filter(|v| !v.is_null())
    }

    fn has_key(&self, key: &str) -> bool {
        self.map.contains_key(key)
    }

    fn usize(&self, key: &str) -> Result<Option<usize>, ModelError> {
        let Some(v) = self.get(key) else {
            return Ok(None);
        };
        v.as_u64()
            .and_then(|u| usize::try_from(u).ok())
            .map(Some)
            .ok_or_else(|| self.invalid(key, format!("must be a non-negative integer, got {}", describe(v))))
    }

    fn usize_req(&self, key: &str) -> Result<usize, ModelError> {
        self.usize(key)?.ok_or_else(|| self.missing(key))
    }

    /// Checks an upper bound that keeps all later arithmetic far from overflow.
    fn at_most(&self, key: &str, v: usize, max: usize) -> Result<usize, ModelError> {
        if v > max {
            Err(self.invalid(key, format!("is {v}, larger than Kiln accepts ({max})")))
        } else {
            Ok(v)
        }
    }

    fn f64(&self, key: &str) -> Result<Option<f64>, ModelError> {
        let Some(v) = self.get(key) else {
            return Ok(None);
        };
        v.as_f64()
            .map(Some)
            .ok_or_else(|| self.invalid(key, format!("must be a number, got {}", describe(v))))
    }

    /// A number that must be finite and greater than zero.
    fn positive(&self, key: &str) -> Result<Option<f64>, ModelError> {
        match self.f64(key)? {
            Some(x) if !(x.is_finite() && x > 0.0) => {
                Err(self.invalid(key, format!("must be a positive number, got {x}")))
            }
            other => Ok(other),
        }
    }

    fn positive_req(&self, key: &str) -> Result<f64, ModelError> {
        self.positive(key)?.ok_or_else(|| self.missing(key))
    }

    fn bool(&self, key: &str) -> Result<Option<bool>, ModelError> {
        let Some(v) = self.get(key) else {
            return Ok(None);
        };
        v.as_bool()
            .map(Some)
            .ok_or_else(|| self.invalid(key, format!("must be true or false, got {}", describe(v))))
    }

    fn str(&self, key: &str) -> Result<Option<&'a str>, ModelError> {
        let Some(v) = self.get(key) else {
            return Ok(None);
        };
        v.as_str()
            .map(Some)
            .ok_or_else(|| self.invalid(key, format!("must be a string, got {}", describe(v))))
    }

    /// A nested object, `None` when absent, null or empty (an empty dict is "not set" in
    /// `transformers`).
    fn object(&self, key: &str) -> Result<Option<Obj<'a>>, ModelError> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Object(map)) if map.is_empty() => Ok(None),
            Some(Value::Object(map)) => Ok(Some(Obj {
                map,
                path: self.path,
                prefix: format!("{}.", self.name(key)),
            })),
            Some(v) => Err(self.invalid(key, format!("must be an object, got {}", describe(v)))),
        }
    }

    fn token_id_value(&self, key: &str, v: &Value) -> Result<u32, ModelError> {
        v.as_u64().and_then(|u| u32::try_from(u).ok()).ok_or_else(|| {
            self.invalid(
                key,
                format!("must hold token ids (integers from 0 to 2^32-1), got {}", describe(v)),
            )
        })
    }

    /// A token id: an integer or null.
    fn token_id(&self, key: &str) -> Result<Option<u32>, ModelError> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => self.token_id_value(key, v).map(Some),
        }
    }

    /// Token ids given as an integer, a list of integers, or null.
    fn token_ids(&self, key: &str) -> Result<Vec<u32>, ModelError> {
        let mut out = Vec::new();
        match self.get(key) {
            None => {}
            Some(Value::Array(items)) => {
                for item in items {
                    let id = self.token_id_value(key, item)?;
                    if !out.contains(&id) {
                        out.push(id);
                    }
                }
            }
            Some(v) => out.push(self.token_id_value(key, v)?),
        }
        Ok(out)
    }
}

/// The Hugging Face name of each family, for configs that only give `model_type`.
fn hf_name(arch: Arch) -> &'static str {
    match arch {
        Arch::Llama => "LlamaForCausalLM",
        Arch::Mistral => "MistralForCausalLM",
        Arch::Qwen2 => "Qwen2ForCausalLM",
        Arch::Qwen3 => "Qwen3ForCausalLM",
    }
}

fn parse_arch(c: &Obj) -> Result<(Arch, String), ModelError> {
    let unknown = |name: &str| ModelError::UnknownArchitecture {
        path: c.path.to_path_buf(),
        name: name.to_string(),
    };
    match c.get("architectures") {
        Some(Value::Array(items)) if !items.is_empty() => {
            let name = items[0].as_str().ok_or_else(|| {
                c.invalid(
                    "architectures",
                    format!("must be a list of names, got {} first", describe(&items[0])),
                )
            })?;
            let arch = Arch::from_hf_architecture(name).ok_or_else(|| unknown(name))?;
            return Ok((arch, name.to_string()));
        }
        Some(Value::Array(_)) | None => {}
        Some(v) => {
            return Err(c.invalid("architectures", format!("must be a list of names, got {}", describe(v))));
        }
    }
    let Some(model_type) = c.str("model_type")? else {
        return Err(c.missing("architectures"));
    };
    let arch = match model_type {
        "llama" => Arch::Llama,
        "mistral" => Arch::Mistral,
        "qwen2" => Arch::Qwen2,
        "qwen3" => Arch::Qwen3,
        other => return Err(unknown(other)),
    };
    Ok((arch, hf_name(arch).to_string()))
}

fn parse_config(c: &Obj) -> Result<ModelConfig, ModelError> {
    let (arch, architecture) = parse_arch(c)?;

    let dim = |key: &str| -> Result<usize, ModelError> { c.at_most(key, c.usize_req(key)?, MAX_DIM) };
    let hidden_size = dim("hidden_size")?;
    let intermediate_size = dim("intermediate_size")?;
    let num_layers = c.at_most("num_hidden_layers", c.usize_req("num_hidden_layers")?, MAX_LAYERS)?;
    let num_heads = dim("num_attention_heads")?;
    let vocab_size = dim("vocab_size")?;

    // Absent and null differ: the class default applies to an absent field, `__post_init__`
    // replaces None by the number of attention heads.
    let num_kv_heads = match c.usize("num_key_value_heads")? {
        Some(n) => c.at_most("num_key_value_heads", n, MAX_DIM)?,
        None if c.has_key("num_key_value_heads") => num_heads,
        None => match arch {
            Arch::Llama => num_heads,
            Arch::Mistral => 8,
            Arch::Qwen2 | Arch::Qwen3 => 32,
        },
    };

    let derived_head_dim = || -> Result<usize, ModelError> {
        if num_heads == 0 {
            return Ok(0); // reported by `ModelSpec::validate`
        }
        if hidden_size % num_heads != 0 {
            return Err(c.config_error(format!(
                "hidden_size ({hidden_size}) is not a multiple of num_attention_heads ({num_heads}) \
                 and head_dim is not given"
            )));
        }
        Ok(hidden_size / num_heads)
    };
    let head_dim = match c.usize("head_dim")? {
        Some(d) => c.at_most("head_dim", d, MAX_DIM)?,
        None if !c.has_key("head_dim") && arch == Arch::Qwen3 => 128,
        None => derived_head_dim()?,
    };

    let max_position_embeddings = match c.usize("max_position_embeddings")? {
        Some(n) => c.at_most("max_position_embeddings", n, MAX_POSITIONS)?,
        None => match arch {
            Arch::Llama => 2048,
            Arch::Mistral => 131072,
            Arch::Qwen2 | Arch::Qwen3 => 32768,
        },
    };

    let rms_norm_eps = c.f64("rms_norm_eps")?.unwrap_or(1e-6) as f32;

    let hidden_act = c.str("hidden_act")?.unwrap_or("silu");
    if hidden_act != "silu" && hidden_act != "swish" {
        return Err(c.unsupported(format!("hidden_act '{hidden_act}' (Kiln implements silu)")));
    }

    let tie_word_embeddings = c.bool("tie_word_embeddings")?.unwrap_or(false);

    let attention_bias = c.bool("attention_bias")?.unwrap_or(false);
    let (attention_bias, o_bias, qk_norm) = match arch {
        Arch::Llama => {
            if c.bool("mlp_bias")?.unwrap_or(false) {
                return Err(c.unsupported("mlp_bias true (biases on the MLP projections are not supported yet)".into()));
            }
            (attention_bias, attention_bias, false)
        }
        Arch::Mistral => (false, false, false),
        Arch::Qwen2 => (true, false, false),
        Arch::Qwen3 => (attention_bias, attention_bias, true),
    };

    let rope = parse_rope(c, max_position_embeddings)?;
    let sliding_windows = parse_sliding_windows(c, arch, num_layers, max_position_embeddings)?;

    let torch_dtype = match c.str("dtype")? {
        Some(s) => Some(s.to_string()),
        None => c.str("torch_dtype")?.map(str::to_string),
    };

    Ok(ModelConfig {
        path: c.path.to_path_buf(),
        generation_config: None,
        architecture,
        arch,
        hidden_size,
        intermediate_size,
        num_layers,
        num_heads,
        num_kv_heads,
        head_dim,
        vocab_size,
        max_position_embeddings,
        rms_norm_eps,
        rope,
        tie_word_embeddings,
        attention_bias,
        o_bias,
        qk_norm,
        sliding_windows,
        torch_dtype,
        bos_token_id: c.token_id("bos_token_id")?,
        eos_token_ids: c.token_ids("eos_token_id")?,
    })
}

/// RoPE as `transformers` 5 standardises it: a non-empty legacy `rope_scaling` wins over
/// `rope_parameters`; `rope_theta` comes from that dict, else the top level, else 10000; the
/// type from `rope_type`, else `type`, else "default"; llama3's
/// `original_max_position_embeddings` from the top level, else the dict, else
/// `max_position_embeddings`.
fn parse_rope(c: &Obj, max_position_embeddings: usize) -> Result<Rope, ModelError> {
    let params = match c.object("rope_scaling")? {
        Some(p) => Some(p),
        None => c.object("rope_parameters")?,
    };
    let top_theta = c.positive("rope_theta")?;
    let Some(p) = params else {
        return Ok(Rope {
            theta: top_theta.unwrap_or(10000.0),
            scaling: RopeScaling::None,
        });
    };
    if p.has_key("full_attention") || p.has_key("sliding_attention") {
        return Err(c.unsupported(format!(
            "{} given per layer type (one RoPE for all layers is supported)",
            p.prefix.trim_end_matches('.')
        )));
    }
    let theta = p.positive("rope_theta")?.or(top_theta).unwrap_or(10000.0);
    let rope_type = match p.str("rope_type")? {
        Some(t) => t,
        None => p.str("type")?.unwrap_or("default"),
    };
    let scaling = match rope_type {
        "default" => RopeScaling::None,
        "linear" => RopeScaling::Linear {
            factor: p.positive_req("factor")?,
        },
        "llama3" => {
            let original = match c.positive("original_max_position_embeddings")? {
                Some(v) => v,
                None => p
                    .positive("original_max_position_embeddings")?
                    .unwrap_or(max_position_embeddings as f64),
            };
            RopeScaling::Llama3 {
                factor: p.positive_req("factor")?,
                low_freq_factor: p.positive_req("low_freq_factor")?,
                high_freq_factor: p.positive_req("high_freq_factor")?,
                original_max_position_embeddings: original,
            }
        }
        other => {
            return Err(c.unsupported(format!("rope_type '{other}' (supported: default, linear, llama3)")));
        }
    };
    Ok(Rope { theta, scaling })
}

/// `sliding_window`, with the class default (4096) when absent and no window when null.
fn window_field(c: &Obj) -> Result<Option<usize>, ModelError> {
    if !c.has_key("sliding_window") {
        return Ok(Some(4096));
    }
    match c.usize("sliding_window")? {
        Some(0) => Err(c.invalid("sliding_window", "must be greater than 0, got 0".into())),
        Some(w) => Ok(Some(c.at_most("sliding_window", w, MAX_POSITIONS)?)),
        None => Ok(None),
    }
}

/// Per-layer sliding windows, as `transformers` 5 decides them:
/// * Llama: none.
/// * Mistral: `sliding_window` on every layer (`layer_types` is ignored by `MistralModel`).
/// * Qwen2/Qwen3: the window is `sliding_window` only when `use_sliding_window` is true. An
///   explicit `layer_types` list says which layers use it; without one, layers with index
///   `>= max_window_layers` (default 28) do. A layer marked "sliding_attention" without a
///   window is an error (`transformers` refuses to build its mask too).
fn parse_sliding_windows(
    c: &Obj,
    arch: Arch,
    num_layers: usize,
    max_position_embeddings: usize,
) -> Result<Vec<Option<usize>>, ModelError> {
    let windows = match arch {
        Arch::Llama => vec![None; num_layers],
        Arch::Mistral => vec![window_field(c)?; num_layers],
        Arch::Qwen2 | Arch::Qwen3 => {
            let window = if c.bool("use_sliding_window")?.unwrap_or(false) {
                window_field(c)?
            } else {
                None
            };
            match c.get("layer_types") {
                Some(Value::Array(types)) => {
                    if types.len() != num_layers {
                        return Err(c.invalid(
                            "layer_types",
                            format!(
                                "has {} entries, expected one per layer (num_hidden_layers = {num_layers})",
                                types.len()
                            ),
                        ));
                    }
                    let mut out = Vec::with_capacity(num_layers);
                    for (i, t) in types.iter().enumerate() {
                        match t.as_str() {
                            Some("full_attention") => out.push(None),
                            Some("sliding_attention") if window.is_some() => out.push(window),
                            Some("sliding_attention") => {
                                return Err(c.config_error(format!(
                                    "layer_types[{i}] is \"sliding_attention\" but no sliding window is set \
                                     (use_sliding_window is false or sliding_window is null)"
                                )));
                            }
                            Some(other) => {
                                return Err(c.unsupported(format!(
                                    "layer type \"{other}\" (layer_types[{i}]; supported: full_attention, sliding_attention)"
                                )));
                            }
                            None => {
                                return Err(c.invalid(
                                    "layer_types",
                                    format!("must be a list of strings, got {} at index {i}", describe(t)),
                                ));
                            }
                        }
                    }
                    out
                }
                Some(v) => {
                    return Err(c.invalid("layer_types", format!("must be a list, got {}", describe(v))));
                }
                None => {
                    let first = c.usize("max_window_layers")?.unwrap_or(28);
                    (0..num_layers)
                        .map(|i| if i >= first { window } else { None })
                        .collect()
                }
            }
        }
    };
    Ok(windows
        .into_iter()
        .map(|w| w.filter(|&w| w < max_position_embeddings))
        .collect())
}
