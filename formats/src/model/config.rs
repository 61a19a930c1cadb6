//! Reading a Hugging Face `config.json` (and `generation_config.json`) into [`ModelConfig`].
//!
//! `architectures[0]` (or, without it, `model_type`) picks the architecture's row in
//! [`kiln_core::arch::ARCHITECTURES`], whose file reads every hyperparameter the way
//! `transformers` 5 does for that architecture, class defaults included (see each file in
//! `core/src/arch/`). Configs written by different `transformers` versions differ
//! (`rope_scaling` vs `rope_parameters`, `torch_dtype` vs `dtype`, absent vs null fields);
//! the file is read as a [`serde_json::Value`] and every field interpreted by the reader
//! [`HfConfig`]. What is not about the computation (BOS/EOS ids, the saved dtype) is read here.
//!
//! The core dimensions are required: a real checkpoint always states them, and
//! `transformers`' class defaults (a 7B model) would only turn a broken config into a confusing
//! shape mismatch later.

use super::error::ModelError;
use kiln_core::arch::params::describe;
use kiln_core::arch::{self, ArchError, Architecture, HfConfig};
use kiln_core::{DType, ModelSpec};
use kiln_text::sampler::SamplingChoice;
use serde_json::{Map, Value};
use std::path::{Path, PathBuf};

/// What Kiln takes from a model's `config.json` and `generation_config.json`: the layout of the
/// model (a [`ModelSpec`] whose storage types are placeholders until the weights are read, see
/// [`super::load`]) plus what the runtime needs besides (BOS/EOS ids).
#[derive(Clone, Debug, PartialEq)]
pub struct ModelConfig {
    /// The `config.json` this was read from (used in error messages).
    pub path: PathBuf,
    /// `generation_config.json`, when one was found next to it and read.
    pub generation_config: Option<PathBuf>,
    /// The Hugging Face architecture name (`architectures[0]`, or the one implied by
    /// `model_type`), e.g. `Qwen2ForCausalLM`.
    pub architecture: String,
    /// The architecture's row in the table.
    pub arch: &'static Architecture,
    /// The model as the config describes it: tensors (named as in the safetensors files, every
    /// storage type f32 until the files say otherwise), buffers and operations.
    pub layout: ModelSpec,
    /// `dtype` (transformers 5) or `torch_dtype` (older): the type the checkpoint was saved
    /// in. Informational only; the spec takes each tensor's type from the weight files.
    pub torch_dtype: Option<String>,
    /// `bos_token_id` from `generation_config.json`, else from `config.json`.
    pub bos_token_id: Option<u32>,
    /// Every end-of-sequence id: those of `generation_config.json` first, then those of
    /// `config.json`, without duplicates. Empty when neither file names one.
    pub eos_token_ids: Vec<u32>,
    /// The sampling `generation_config.json` states (temperature, top_k, top_p, min_p,
    /// repetition_penalty; `do_sample: false` as temperature 0), the defaults of a run whose
    /// user gives none. Empty without the file.
    pub sampling: SamplingChoice,
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
        let map = json_object(text, path)?;
        parse_config(&Obj { map: &map, path })
    }

    /// Merges the BOS/EOS ids of a `generation_config.json` text: its EOS ids go first, then
    /// those already known from `config.json`; its BOS id, when set, replaces the config's.
    /// Reads its sampling values ([`parse_sampling`]).
    pub fn apply_generation_config(&mut self, text: &str, path: &Path) -> Result<(), ModelError> {
        let map = json_object(text, path)?;
        let g = Obj { map: &map, path };
        self.sampling = parse_sampling(&g)?;
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

    /// The spec with each tensor's storage type from `dtype_of` (asked in checkpoint order),
    /// validated.
    pub fn spec(
        &self,
        mut dtype_of: impl FnMut(usize, &kiln_core::Tensor) -> Result<DType, ModelError>,
    ) -> Result<ModelSpec, ModelError> {
        let mut spec = self.layout.clone();
        for i in 0..spec.weights.len() {
            let dtype = dtype_of(i, &self.layout.weights[i])?;
            spec.weights[i].dtype = dtype;
        }
        Ok(spec)
    }
}

/// Reads a whole text file, refusing anything but a regular file ([`ModelError::File`]).
pub(crate) fn read_text(path: &Path) -> Result<String, ModelError> {
    Ok(kiln_core::files::read_to_string(path)?)
}

/// The top-level object of a JSON file's text.
fn json_object(text: &str, path: &Path) -> Result<Map<String, Value>, ModelError> {
    let value: Value = serde_json::from_str(text).map_err(|source| ModelError::Json {
        path: path.to_path_buf(),
        source,
    })?;
    match value {
        Value::Object(map) => Ok(map),
        other => Err(ModelError::InvalidConfig {
            path: path.to_path_buf(),
            message: format!("expected a JSON object, found {}", describe(&other)),
        }),
    }
}

/// An architecture file's error, with the config's path, as this front end reports it.
pub(crate) fn from_arch_error(path: &Path, e: ArchError) -> ModelError {
    let path = path.to_path_buf();
    match e {
        ArchError::Missing { field } => ModelError::MissingField { path, field },
        ArchError::Invalid { field, problem } => ModelError::InvalidField { path, field, problem },
        ArchError::Unsupported { what } => ModelError::Unsupported { path, what },
        ArchError::Config { message } => ModelError::InvalidConfig { path, message },
        ArchError::MissingTensor { name } => ModelError::InvalidConfig {
            path,
            message: format!("tensor {name} is needed to read the model's dimensions"),
        },
        ArchError::TensorShape { name, found, expected } => ModelError::InvalidConfig {
            path,
            message: format!("tensor {name} has shape {found:?}, expected {expected:?}"),
        },
    }
}

/// The top-level JSON object of a config file being read.
struct Obj<'a> {
    map: &'a Map<String, Value>,
    path: &'a Path,
}

impl<'a> Obj<'a> {
    fn invalid(&self, key: &str, problem: String) -> ModelError {
        ModelError::InvalidField {
            path: self.path.to_path_buf(),
            field: key.to_string(),
            problem,
        }
    }

    /// The value, `None` when absent or null.
    fn get(&self, key: &str) -> Option<&'a Value> {
        self.map.get(key).filter(|v| !v.is_null())
    }

    fn str(&self, key: &str) -> Result<Option<&'a str>, ModelError> {
        let Some(v) = self.get(key) else {
            return Ok(None);
        };
        v.as_str()
            .map(Some)
            .ok_or_else(|| self.invalid(key, format!("must be a string, got {}", describe(v))))
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

/// The architecture `architectures[0]` names, else the one of `model_type`, with the Hugging
/// Face architecture name.
fn parse_arch(c: &Obj) -> Result<(&'static Architecture, String), ModelError> {
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
            let arch = arch::by_hf_name(name).ok_or_else(|| unknown(name))?;
            return Ok((arch, name.to_string()));
        }
        Some(Value::Array(_)) | None => {}
        Some(v) => {
            return Err(c.invalid("architectures", format!("must be a list of names, got {}", describe(v))));
        }
    }
    let Some(model_type) = c.str("model_type")? else {
        return Err(ModelError::MissingField {
            path: c.path.to_path_buf(),
            field: "architectures".into(),
        });
    };
    let arch = arch::by_model_type(model_type).ok_or_else(|| unknown(model_type))?;
    Ok((arch, arch.hf[0].to_string()))
}

fn parse_config(c: &Obj) -> Result<ModelConfig, ModelError> {
    let (arch, architecture) = parse_arch(c)?;
    let layout = arch::build(arch, &HfConfig::new(c.map)).map_err(|e| from_arch_error(c.path, e))?;
    let torch_dtype = match c.str("dtype")? {
        Some(s) => Some(s.to_string()),
        None => c.str("torch_dtype")?.map(str::to_string),
    };
    Ok(ModelConfig {
        path: c.path.to_path_buf(),
        generation_config: None,
        architecture,
        arch,
        layout,
        torch_dtype,
        bos_token_id: c.token_id("bos_token_id")?,
        eos_token_ids: c.token_ids("eos_token_id")?,
        sampling: SamplingChoice::default(),
    })
}

/// The sampling values of a `generation_config.json`, each range-checked. `do_sample: false`
/// means greedy decoding in transformers' `generate`, so it reads as temperature 0 whatever
/// temperature the file also gives; only an explicit `false` does (an absent `do_sample` says
/// nothing, as vLLM reads it). A null key is absent.
fn parse_sampling(g: &Obj) -> Result<SamplingChoice, ModelError> {
    let number = |key: &str| -> Result<Option<f32>, ModelError> {
        match g.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_f64()
                .map(|x| Some(x as f32))
                .ok_or_else(|| g.invalid(key, format!("must be a number, got {}", describe(v)))),
        }
    };
    let top_k = match g.get("top_k") {
        None => None,
        Some(v) => Some(v.as_u64().and_then(|k| usize::try_from(k).ok()).ok_or_else(|| {
            g.invalid(
                "top_k",
                format!("must be an integer >= 0 (0 = off), got {}", describe(v)),
            )
        })?),
    };
    let greedy = match g.get("do_sample") {
        None => false,
        Some(Value::Bool(b)) => !b,
        Some(v) => return Err(g.invalid("do_sample", format!("must be true or false, got {}", describe(v)))),
    };
    let mut choice = SamplingChoice {
        temperature: number("temperature")?,
        top_k,
        top_p: number("top_p")?,
        min_p: number("min_p")?,
        repetition_penalty: number("repetition_penalty")?,
    };
    choice
        .validate()
        .map_err(|e| g.invalid(e.name, format!("must be {}, got {}", e.expected, e.value)))?;
    if greedy {
        choice.temperature = Some(0.0);
    }
    Ok(choice)
}
