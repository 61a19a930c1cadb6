//! Reading a model's hyperparameters the same way from either format.
//!
//! An architecture file asks for a [`Key`] (its Hugging Face `config.json` name and its GGUF
//! metadata name); a [`Params`] implementation answers from `config.json` ([`HfConfig`]) or from
//! GGUF metadata (the GGUF front end's), reporting a wrong type in its format's own words.
//! [`Cfg`] adds the checks every architecture shares (bounds, positivity, required fields), so
//! each error is one line naming the field as the file spells it.

use serde_json::{Map, Value};

/// Which kind of file the parameters come from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    /// A Hugging Face folder: `config.json` and safetensors.
    HuggingFace,
    /// A GGUF file: metadata and tensor table.
    Gguf,
}

/// A hyperparameter: its `config.json` name and its GGUF metadata name without the
/// `{architecture}.` prefix (`None` where GGUF has no such key).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Key {
    pub hf: &'static str,
    pub gguf: Option<&'static str>,
}

impl Key {
    pub const fn new(hf: &'static str, gguf: &'static str) -> Key {
        Key { hf, gguf: Some(gguf) }
    }
    pub const fn hf(hf: &'static str) -> Key {
        Key { hf, gguf: None }
    }
    /// A key only GGUF metadata has.
    pub const fn gguf(gguf: &'static str) -> Key {
        Key {
            hf: "",
            gguf: Some(gguf),
        }
    }
}

/// The keys most architectures share (llama.cpp's names on the GGUF side).
pub mod keys {
    use super::Key;
    pub const HIDDEN: Key = Key::new("hidden_size", "embedding_length");
    pub const INTERMEDIATE: Key = Key::new("intermediate_size", "feed_forward_length");
    pub const LAYERS: Key = Key::new("num_hidden_layers", "block_count");
    pub const HEADS: Key = Key::new("num_attention_heads", "attention.head_count");
    pub const KV_HEADS: Key = Key::new("num_key_value_heads", "attention.head_count_kv");
    pub const HEAD_DIM: Key = Key::new("head_dim", "attention.key_length");
    pub const VALUE_DIM: Key = Key::gguf("attention.value_length");
    pub const VOCAB: Key = Key::new("vocab_size", "vocab_size");
    pub const MAX_POSITIONS: Key = Key::new("max_position_embeddings", "context_length");
    pub const RMS_EPS: Key = Key::new("rms_norm_eps", "attention.layer_norm_rms_epsilon");
    pub const LN_EPS: Key = Key::new("layer_norm_eps", "attention.layer_norm_epsilon");
    pub const ROPE_THETA: Key = Key::new("rope_theta", "rope.freq_base");
    pub const PARTIAL_ROTARY: Key = Key::hf("partial_rotary_factor");
    pub const ROPE_DIMS: Key = Key::gguf("rope.dimension_count");
    pub const SLIDING_WINDOW: Key = Key::new("sliding_window", "attention.sliding_window");
    pub const TIE: Key = Key::hf("tie_word_embeddings");
    pub const ACT: Key = Key::hf("hidden_act");
}

/// Why a config cannot be turned into a spec. Front ends add the file's path.
#[derive(Clone, Debug, PartialEq)]
pub enum ArchError {
    /// A required field is absent (or null).
    Missing { field: String },
    /// A field has the wrong type or an impossible value; `problem` completes
    /// "field X ...".
    Invalid { field: String, problem: String },
    /// A feature Kiln does not implement; `what` reads like "rope_type 'yarn' (supported: ...)".
    Unsupported { what: String },
    /// The fields parse but describe an impossible model.
    Config { message: String },
    /// A tensor the hyperparameters are read from (GGUF: the embedding, for the vocabulary)
    /// is absent.
    MissingTensor { name: String },
    /// Such a tensor has an impossible shape (outermost dimension first).
    TensorShape {
        name: String,
        found: Vec<usize>,
        expected: Vec<usize>,
    },
}

/// Typed access to one format's hyperparameters. Getters return `Ok(None)` for an absent (or,
/// in `config.json`, null) key and an [`ArchError::Invalid`] for a value of the wrong type.
pub trait Params {
    fn format(&self) -> Format;
    /// The full name of `key` in this format, or `None` when the format has no such key.
    fn key(&self, key: Key) -> Option<String>;
    /// Whether the key is present at all (in `config.json`: even when null).
    fn present(&self, name: &str) -> bool;
    fn uint(&self, name: &str) -> Result<Option<u64>, ArchError>;
    fn float(&self, name: &str) -> Result<Option<f64>, ArchError>;
    fn boolean(&self, name: &str) -> Result<Option<bool>, ArchError>;
    fn string(&self, name: &str) -> Result<Option<String>, ArchError>;
    fn strings(&self, name: &str) -> Result<Option<Vec<String>>, ArchError>;
    fn floats(&self, name: &str) -> Result<Option<Vec<f64>>, ArchError>;
    /// A nested object (`config.json` only; an empty object counts as absent, as in
    /// `transformers`).
    fn object<'s>(&'s self, name: &str) -> Result<Option<Box<dyn Params + 's>>, ArchError>;
    /// The shape (outermost first) of a tensor of the model file, where the parameters come with
    /// a tensor table (GGUF).
    fn tensor_shape(&self, name: &str) -> Option<Vec<usize>>;
    /// The values of a small f32 tensor (GGUF's RoPE factor tables).
    fn tensor_f32s(&self, name: &str) -> Result<Option<Vec<f32>>, ArchError>;
}

/// Largest accepted size of a single dimension (hidden size, vocabulary, heads, ...). Far above
/// any real model; it keeps every product the spec forms (`heads * head_dim`,
/// `vocab * hidden * 4`) far from overflowing.
pub const MAX_DIM: usize = 1 << 24;
/// Largest accepted `num_hidden_layers`.
pub const MAX_LAYERS: usize = 1 << 16;
/// Largest accepted `max_position_embeddings` (and sliding window).
pub const MAX_POSITIONS: usize = 1 << 30;

/// The checks architectures share, over any [`Params`].
#[derive(Clone, Copy)]
pub struct Cfg<'a> {
    pub p: &'a dyn Params,
}

impl<'a> Cfg<'a> {
    pub fn new(p: &'a dyn Params) -> Cfg<'a> {
        Cfg { p }
    }
    pub fn format(&self) -> Format {
        self.p.format()
    }
    pub fn is_gguf(&self) -> bool {
        self.p.format() == Format::Gguf
    }
    /// The field's name as this format spells it (the Hugging Face name if the format lacks it).
    pub fn name(&self, key: Key) -> String {
        self.p.key(key).unwrap_or_else(|| key.hf.to_string())
    }
    pub fn invalid(&self, key: Key, problem: String) -> ArchError {
        ArchError::Invalid {
            field: self.name(key),
            problem,
        }
    }
    pub fn missing(&self, key: Key) -> ArchError {
        ArchError::Missing { field: self.name(key) }
    }
    pub fn present(&self, key: Key) -> bool {
        self.p.key(key).is_some_and(|k| self.p.present(&k))
    }
    pub fn usize(&self, key: Key, max: usize) -> Result<Option<usize>, ArchError> {
        let Some(k) = self.p.key(key) else {
            return Ok(None);
        };
        match self.p.uint(&k)? {
            None => Ok(None),
            Some(v) if v > max as u64 => Err(self.invalid(key, format!("is {v}, larger than Kiln accepts ({max})"))),
            Some(v) => Ok(Some(v as usize)),
        }
    }
    pub fn req_usize(&self, key: Key, max: usize) -> Result<usize, ArchError> {
        self.usize(key, max)?.ok_or_else(|| self.missing(key))
    }
    /// A required dimension, at most [`MAX_DIM`] (zero is reported by [`Cfg::positive_dim`]).
    pub fn dim(&self, key: Key) -> Result<usize, ArchError> {
        self.req_usize(key, MAX_DIM)
    }
    /// Fails with "X must be greater than 0" for a zero dimension.
    pub fn positive_dim(&self, key: Key, v: usize) -> Result<usize, ArchError> {
        if v == 0 {
            return Err(ArchError::Config {
                message: format!("{} must be greater than 0", self.name(key)),
            });
        }
        Ok(v)
    }
    pub fn f64(&self, key: Key) -> Result<Option<f64>, ArchError> {
        match self.p.key(key) {
            Some(k) => self.p.float(&k),
            None => Ok(None),
        }
    }
    /// A number that must be finite and greater than zero.
    pub fn positive(&self, key: Key) -> Result<Option<f64>, ArchError> {
        match self.f64(key)? {
            Some(x) if !(x.is_finite() && x > 0.0) => {
                Err(self.invalid(key, format!("must be a positive number, got {x}")))
            }
            other => Ok(other),
        }
    }
    pub fn req_positive(&self, key: Key) -> Result<f64, ArchError> {
        self.positive(key)?.ok_or_else(|| self.missing(key))
    }
    /// A finite number that must not be negative (epsilons).
    pub fn non_negative(&self, key: Key) -> Result<Option<f64>, ArchError> {
        match self.f64(key)? {
            Some(x) if !(x.is_finite() && x >= 0.0) => {
                Err(self.invalid(key, format!("must be a non-negative number, got {x}")))
            }
            other => Ok(other),
        }
    }
    pub fn bool(&self, key: Key) -> Result<Option<bool>, ArchError> {
        match self.p.key(key) {
            Some(k) => self.p.boolean(&k),
            None => Ok(None),
        }
    }
    pub fn str(&self, key: Key) -> Result<Option<String>, ArchError> {
        match self.p.key(key) {
            Some(k) => self.p.string(&k),
            None => Ok(None),
        }
    }
    pub fn strings(&self, key: Key) -> Result<Option<Vec<String>>, ArchError> {
        match self.p.key(key) {
            Some(k) => self.p.strings(&k),
            None => Ok(None),
        }
    }
    pub fn floats(&self, key: Key) -> Result<Option<Vec<f64>>, ArchError> {
        match self.p.key(key) {
            Some(k) => self.p.floats(&k),
            None => Ok(None),
        }
    }
    pub fn unsupported(&self, what: String) -> ArchError {
        ArchError::Unsupported { what }
    }
    pub fn config_error(&self, message: String) -> ArchError {
        ArchError::Config { message }
    }
}

/// A short rendering of a JSON value for error messages.
pub fn describe(v: &Value) -> String {
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

/// A `config.json` object (or one nested in it), with the dotted prefix of its fields.
pub struct HfConfig<'a> {
    pub map: &'a Map<String, Value>,
    pub prefix: String,
}

impl<'a> HfConfig<'a> {
    pub fn new(map: &'a Map<String, Value>) -> HfConfig<'a> {
        HfConfig {
            map,
            prefix: String::new(),
        }
    }

    /// The value, `None` when absent or null.
    fn get(&self, key: &str) -> Option<&'a Value> {
        self.map.get(self.local(key)).filter(|v| !v.is_null())
    }

    /// `key` without this object's prefix (keys handed out by [`Params::key`] carry it).
    fn local<'k>(&self, key: &'k str) -> &'k str {
        key.strip_prefix(self.prefix.as_str()).unwrap_or(key)
    }

    fn full(&self, key: &str) -> String {
        format!("{}{}", self.prefix, self.local(key))
    }

    fn invalid(&self, key: &str, problem: String) -> ArchError {
        ArchError::Invalid {
            field: self.full(key),
            problem,
        }
    }
}

impl Params for HfConfig<'_> {
    fn format(&self) -> Format {
        Format::HuggingFace
    }
    fn key(&self, key: Key) -> Option<String> {
        (!key.hf.is_empty()).then(|| format!("{}{}", self.prefix, key.hf))
    }
    fn present(&self, name: &str) -> bool {
        self.map.contains_key(self.local(name))
    }
    fn uint(&self, name: &str) -> Result<Option<u64>, ArchError> {
        let Some(v) = self.get(name) else {
            return Ok(None);
        };
        v.as_u64()
            .map(Some)
            .ok_or_else(|| self.invalid(name, format!("must be a non-negative integer, got {}", describe(v))))
    }
    fn float(&self, name: &str) -> Result<Option<f64>, ArchError> {
        let Some(v) = self.get(name) else {
            return Ok(None);
        };
        v.as_f64()
            .map(Some)
            .ok_or_else(|| self.invalid(name, format!("must be a number, got {}", describe(v))))
    }
    fn boolean(&self, name: &str) -> Result<Option<bool>, ArchError> {
        let Some(v) = self.get(name) else {
            return Ok(None);
        };
        v.as_bool()
            .map(Some)
            .ok_or_else(|| self.invalid(name, format!("must be true or false, got {}", describe(v))))
    }
    fn string(&self, name: &str) -> Result<Option<String>, ArchError> {
        let Some(v) = self.get(name) else {
            return Ok(None);
        };
        v.as_str()
            .map(|s| Some(s.to_string()))
            .ok_or_else(|| self.invalid(name, format!("must be a string, got {}", describe(v))))
    }
    fn strings(&self, name: &str) -> Result<Option<Vec<String>>, ArchError> {
        let Some(v) = self.get(name) else {
            return Ok(None);
        };
        let Value::Array(items) = v else {
            return Err(self.invalid(name, format!("must be a list, got {}", describe(v))));
        };
        items
            .iter()
            .enumerate()
            .map(|(i, t)| {
                t.as_str().map(str::to_string).ok_or_else(|| {
                    self.invalid(
                        name,
                        format!("must be a list of strings, got {} at index {i}", describe(t)),
                    )
                })
            })
            .collect::<Result<Vec<_>, _>>()
            .map(Some)
    }
    fn floats(&self, name: &str) -> Result<Option<Vec<f64>>, ArchError> {
        let Some(v) = self.get(name) else {
            return Ok(None);
        };
        let Value::Array(items) = v else {
            return Err(self.invalid(name, format!("must be a list, got {}", describe(v))));
        };
        items
            .iter()
            .enumerate()
            .map(|(i, t)| {
                t.as_f64().filter(|x| x.is_finite()).ok_or_else(|| {
                    self.invalid(
                        name,
                        format!("must be a list of numbers, got {} at index {i}", describe(t)),
                    )
                })
            })
            .collect::<Result<Vec<_>, _>>()
            .map(Some)
    }
    fn object<'s>(&'s self, name: &str) -> Result<Option<Box<dyn Params + 's>>, ArchError> {
        match self.get(name) {
            None => Ok(None),
            Some(Value::Object(map)) if map.is_empty() => Ok(None),
            Some(Value::Object(map)) => Ok(Some(Box::new(HfConfig {
                map,
                prefix: format!("{}.", self.full(name)),
            }))),
            Some(v) => Err(self.invalid(name, format!("must be an object, got {}", describe(v)))),
        }
    }
    fn tensor_shape(&self, _name: &str) -> Option<Vec<usize>> {
        None
    }
    fn tensor_f32s(&self, _name: &str) -> Result<Option<Vec<f32>>, ArchError> {
        Ok(None)
    }
}
