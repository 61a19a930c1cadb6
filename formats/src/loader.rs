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
    /// Tensors converted at load (`dequantize`), with their original storage type.
    pub converted: Vec<(WeightId, DType)>,
}

/// How to load a model.
#[derive(Clone, Copy, Debug, Default)]
pub struct LoadOptions {
    /// Convert every quantised tensor to this float type at load (`--dequantize bf16|f32`).
    pub dequantize: Option<DType>,
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
        _ => load_safetensors(path),
    }
}

fn load_safetensors(path: &Path) -> Result<Model, LoadError> {
    let loaded = model::load(path)?;
    let tokenizer = Tokenizer::from_dir(&loaded.dir)?;
    let eos_token_ids = merge_ids(&loaded.config.eos_token_ids, tokenizer.eos_token_ids());
    let weights = SafetensorsWeights::bind(loaded.weights, &loaded.spec)?;
    Ok(Model {
        source: loaded.dir,
        format: ModelFormat::Safetensors,
        architecture: loaded.config.architecture.clone(),
        bos_token_id: loaded.config.bos_token_id,
        spec: loaded.spec,
        weights: Arc::new(weights),
        tokenizer,
        eos_token_ids,
        converted: Vec::new(),
    })
}

fn load_gguf(path: &Path, opts: &LoadOptions) -> Result<Model, LoadError> {
    let g = gguf::load(path)?;
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
