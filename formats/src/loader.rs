//! One entry point for every model format: a Hugging Face folder (config.json + safetensors) or
//! a GGUF file both become a [`Model`] — a spec, weights the engine can bind, a tokenizer and
//! the ids that end generation.

use crate::gguf::{self, GgufError, GgufWeights};
use crate::model::{self, ModelError, Weights};
use kiln_core::files::{self, FileKind};
use kiln_core::spec::Layout;
use kiln_core::{DType, ModelSpec, WeightId};
use kiln_engine::buffers::AlignedBuf;
use kiln_engine::engine::WeightSource;
use kiln_text::sampler::SamplingChoice;
use kiln_text::tokenizer::{Tokenizer, TokenizerError};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Which front end read the model.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ModelFormat {
    Safetensors,
    Gguf,
}

impl ModelFormat {
    pub fn name(self) -> &'static str {
        match self {
            ModelFormat::Safetensors => "safetensors",
            ModelFormat::Gguf => "gguf",
        }
    }
}

/// A model read, checked and ready to compile and bind.
pub struct Model {
    /// The folder (safetensors) or file (GGUF) the model was read from.
    pub source: PathBuf,
    pub format: ModelFormat,
    /// `architectures[0]` of config.json, or `general.architecture` of a GGUF file.
    pub architecture: String,
    pub spec: ModelSpec,
    pub weights: Arc<dyn WeightSource>,
    pub tokenizer: Tokenizer,
    /// Ids that end generation: the model's own and the tokenizer's, without duplicates.
    pub eos_token_ids: Vec<u32>,
    pub bos_token_id: Option<u32>,
    /// The sampling the model's `generation_config.json` states: the defaults of a run whose
    /// user gives no flag for a key. Empty for a GGUF file, which has no such file, so
    /// llama.cpp's defaults apply there as in llama.cpp.
    pub sampling: SamplingChoice,
    /// Tensors converted at load (`dequantize`), with their original storage type.
    pub converted: Vec<(WeightId, DType)>,
}

/// How to load a model.
#[derive(Clone, Copy, Debug, Default)]
pub struct LoadOptions {
    /// Convert every quantised tensor to this float type at load (`--dequantize bf16|f32`).
    pub dequantize: Option<DType>,
    /// Map the weights' pages in while the tokenizer is built (see [`crate::page_in`]): for a
    /// model about to run; `compile` and `info`, which read only headers, leave it off.
    pub page_in: bool,
}

#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error(transparent)]
    Model(#[from] ModelError),
    #[error(transparent)]
    Gguf(#[from] GgufError),
    #[error(transparent)]
    Tokenizer(#[from] TokenizerError),
    #[error("--dequantize takes bf16 or f32, not {0}")]
    BadTarget(DType),
    /// A folder named like a GGUF file that is not a Hugging Face model folder either.
    #[error(
        "{} is a directory, not a GGUF file (and it holds no config.json to read it as a Hugging Face model folder)",
        path.display()
    )]
    GgufDirectory { path: PathBuf },
}

/// Reads the model at `path`: a GGUF file (recognised by its magic or its `.gguf` extension,
/// so a damaged one is reported by the GGUF parser), a folder, or a folder's `config.json`.
/// A path that is missing, a symlink loop, or neither a folder nor a regular file (a FIFO, a
/// device) is reported as such by [`model::load`], without being opened.
pub fn load(path: &Path, opts: &LoadOptions) -> Result<Model, LoadError> {
    if let Some(t) = opts.dequantize
        && !matches!(t, DType::F32 | DType::BF16)
    {
        return Err(LoadError::BadTarget(t));
    }
    let gguf_name = path.extension().is_some_and(|e| e.eq_ignore_ascii_case("gguf"));
    let kind = files::stat(path).map(|meta| FileKind::of(&meta));
    match kind {
        Ok(None) if gguf_name || gguf::is_gguf(path) => load_gguf(path, opts),
        Ok(Some(FileKind::Directory))
            if gguf_name && files::stat(&path.join("config.json")).is_err_and(|e| e.is_not_found()) =>
        {
            Err(LoadError::GgufDirectory {
                path: path.to_path_buf(),
            })
        }
        _ => load_safetensors(path, opts.page_in),
    }
}

fn load_safetensors(path: &Path, page_in: bool) -> Result<Model, LoadError> {
    let loaded = model::load(path)?;
    // The weights' pages are mapped in beside the tokenizer's build (see `page_in`).
    let tokenizer = std::thread::scope(|s| {
        if page_in {
            s.spawn(|| loaded.weights.page_in());
        }
        Tokenizer::from_dir(&loaded.dir)
    })?;
    let eos_token_ids = merge_ids(&loaded.config.eos_token_ids, tokenizer.eos_token_ids());
    let weights = SafetensorsWeights::bind(loaded.weights, &loaded.spec)?;
    Ok(Model {
        source: loaded.dir,
        format: ModelFormat::Safetensors,
        architecture: loaded.config.architecture.clone(),
        bos_token_id: loaded.config.bos_token_id,
        sampling: loaded.config.sampling,
        spec: loaded.spec,
        weights: Arc::new(weights),
        tokenizer,
        eos_token_ids,
        converted: Vec::new(),
    })
}

fn load_gguf(path: &Path, opts: &LoadOptions) -> Result<Model, LoadError> {
    let g = gguf::load_with(path, opts.page_in)?;
    let architecture = g.spec.arch.clone();
    let eos_token_ids = merge_ids(&g.eos_token_ids, g.tokenizer.eos_token_ids());
    let mut spec = g.spec;
    let mut converted = Vec::new();
    let weights: Arc<dyn WeightSource> = match opts.dequantize {
        Some(target) => {
            let mut bufs = HashMap::new();
            for (id, w) in spec.weight_ids() {
                if w.dtype.is_quantized() {
                    let bytes = g.weights.dequantize_to(id, target)?;
                    bufs.insert(id, owned_copy(&bytes));
                    converted.push((id, w.dtype));
                }
            }
            for (id, _) in &converted {
                spec.weights[id.0 as usize].dtype = target;
            }
            Arc::new(Dequantized { inner: g.weights, bufs })
        }
        None => Arc::new(g.weights),
    };
    Ok(Model {
        source: path.to_path_buf(),
        format: ModelFormat::Gguf,
        architecture,
        bos_token_id: g.bos_token_id,
        sampling: SamplingChoice::default(),
        spec,
        weights,
        tokenizer: g.tokenizer,
        eos_token_ids,
        converted,
    })
}

fn merge_ids(first: &[u32], second: &[u32]) -> Vec<u32> {
    let mut ids = first.to_vec();
    for &id in second {
        if !ids.contains(&id) {
            ids.push(id);
        }
    }
    ids
}

/// A 64-byte-aligned copy of `bytes`.
fn owned_copy(bytes: &[u8]) -> AlignedBuf {
    let mut buf = AlignedBuf::zeroed(bytes.len());
    // SAFETY: `buf` holds at least `bytes.len()` bytes and does not overlap `bytes`.
    unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), buf.as_mut_ptr(), bytes.len()) };
    buf
}

/// `[rows, cols]` elements of `elem` bytes each, transposed into `[cols, rows]`.
fn transposed(bytes: &[u8], rows: usize, cols: usize, elem: usize) -> AlignedBuf {
    let mut out = vec![0u8; bytes.len()];
    for r in 0..rows {
        for c in 0..cols {
            let (src, dst) = ((r * cols + c) * elem, (c * rows + r) * elem);
            out[dst..dst + elem].copy_from_slice(&bytes[src..src + elem]);
        }
    }
    owned_copy(&out)
}

/// Safetensors weights as the engine sees them: each tensor of the spec in place in its
/// mapping, except those stored transposed (GPT-2's `Conv1D` weights), copied once, at load,
/// into the layout the kernels read.
struct SafetensorsWeights {
    weights: Weights,
    /// Per tensor of the spec: its address.
    ptrs: Vec<usize>,
    _copies: Vec<AlignedBuf>,
}

impl SafetensorsWeights {
    fn bind(weights: Weights, spec: &ModelSpec) -> Result<SafetensorsWeights, ModelError> {
        let mut ptrs = Vec::with_capacity(spec.weights.len());
        let mut copies = Vec::new();
        for w in &spec.weights {
            let t = weights.lookup(&w.name)?;
            let ptr = match (w.layout, t.shape) {
                (Layout::Transposed, &[rows, cols]) => {
                    let copy = transposed(t.data, rows, cols, w.dtype.size());
                    let p = copy.as_ptr() as usize;
                    copies.push(copy);
                    p
                }
                _ => t.ptr() as usize,
            };
            ptrs.push(ptr);
        }
        Ok(SafetensorsWeights {
            weights,
            ptrs,
            _copies: copies,
        })
    }
}

impl WeightSource for SafetensorsWeights {
    fn weight_ptr(&self, id: WeightId) -> Result<*const u8, String> {
        let _ = &self.weights; // the mapping the pointers point into lives as long as `self`
        self.ptrs
            .get(id.0 as usize)
            .map(|&p| p as *const u8)
            .ok_or_else(|| format!("no weight {} in the spec", id.0))
    }
}

/// GGUF weights with the quantised tensors replaced by float copies.
struct Dequantized {
    inner: GgufWeights,
    bufs: HashMap<WeightId, AlignedBuf>,
}

impl WeightSource for Dequantized {
    fn weight_ptr(&self, id: WeightId) -> Result<*const u8, String> {
        match self.bufs.get(&id) {
            Some(b) => Ok(b.as_ptr() as *const u8),
            None => self.inner.weight_ptr(id),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kiln_core::spec::Role;
    use safetensors::tensor::TensorView as StView;

    /// A GPT-2 checkpoint named as the published `gpt2` names it (no `transformer.` prefix),
    /// every tensor f32 holding its element indices: the spec's `transformer.*` names must find
    /// them, and each `Conv1D` weight must reach the kernels transposed into `[out, in]`.
    #[test]
    fn gpt2_conv1d_weights_are_found_unprefixed_and_transposed_at_load() {
        let config = serde_json::json!({
            "architectures": ["GPT2LMHeadModel"], "n_embd": 16, "n_layer": 1, "n_head": 2,
            "n_positions": 8, "vocab_size": 32, "n_inner": 24
        });
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("config.json"), config.to_string()).unwrap();
        let layout = model::ModelConfig::from_file(&dir.path().join("config.json"))
            .unwrap()
            .layout;
        let data: Vec<(String, Vec<usize>, Vec<u8>)> = layout
            .weights
            .iter()
            .map(|t| {
                let shape = t.stored_shape();
                let n: usize = shape.iter().product();
                let bytes = (0..n).flat_map(|i| (i as f32).to_le_bytes()).collect();
                let name = t.name.strip_prefix("transformer.").unwrap_or(&t.name).to_string();
                (name, shape, bytes)
            })
            .collect();
        let views: Vec<(&str, StView)> = data
            .iter()
            .map(|(n, s, b)| (n.as_str(), StView::new(safetensors::Dtype::F32, s.clone(), b).unwrap()))
            .collect();
        safetensors::serialize_to_file(views, None, &dir.path().join("model.safetensors")).unwrap();

        let loaded = model::load(dir.path()).unwrap();
        let spec = loaded.spec.clone();
        let weights = SafetensorsWeights::bind(loaded.weights, &spec).unwrap();
        let mut transposed_seen = 0;
        for (id, t) in spec.weight_ids().filter(|(_, t)| t.role == Role::Matrix) {
            let (rows, cols) = (t.shape[0], t.shape[1]);
            let ptr = weights.weight_ptr(id).unwrap() as *const f32;
            // SAFETY: the pointer is to `rows * cols` f32 values owned by `weights`, alive here.
            let got = unsafe { std::slice::from_raw_parts(ptr, rows * cols) };
            for (r, c) in [(0, 1), (1, 0), (rows - 1, cols - 1), (rows / 2, cols / 3)] {
                let stored = match t.layout {
                    Layout::Transposed => c * rows + r, // stored [cols, rows]
                    _ => r * cols + c,
                };
                assert_eq!(got[r * cols + c], stored as f32, "{} [{r}, {c}]", t.name);
            }
            transposed_seen += (t.layout == Layout::Transposed) as usize;
        }
        // c_attn, attn.c_proj, mlp.c_fc, mlp.c_proj.
        assert_eq!(transposed_seen, 4);
        assert_eq!(
            spec.weight(spec.weight_named("transformer.h.0.mlp.c_fc.weight").unwrap())
                .shape,
            [24, 16]
        );
    }
}
