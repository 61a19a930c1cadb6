//! One entry point for every model format: a Hugging Face folder (config.json + safetensors) or
//! a GGUF file both become a [`Model`] — a spec, weights the engine can bind, a tokenizer and
//! the ids that end generation.

use crate::gguf::{self, GgufError, GgufWeights};
use crate::model::{self, ModelError, Weights};
use crate::page_in::{PageIn, Pager};
use crate::pread::{self, Stored};
use crate::reorder::Reordered;
use kiln_core::files::{self, FileKind};
use kiln_core::spec::Layout;
use kiln_core::{DType, ModelSpec, WeightId};
use kiln_engine::buffers::AlignedBuf;
use kiln_engine::engine::WeightSource;
use kiln_text::sampler::SamplingChoice;
use kiln_text::tokenizer::{TableCache, Tokenizer, TokenizerError};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

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
    /// Parts of the checkpoint Kiln does not run (a multimodal model's vision tower, a
    /// multi-token-prediction head), one line each for the user: see [`unread_parts`].
    pub notes: Vec<String>,
}

/// How to load a model.
#[derive(Clone, Debug, Default)]
pub struct LoadOptions {
    /// Convert every quantised tensor to this float type at load (`--dequantize bf16|f32`).
    pub dequantize: Option<DType>,
    /// Map the weights' pages in while the tokenizer is built (see [`crate::page_in`]): for a
    /// model about to run; `compile` and `info`, which read only headers, leave it off.
    pub page_in: bool,
    /// Where marks of weight files read back once for huge pages are kept
    /// ([`Pager::settle`]); `None` never reads a file back.
    pub page_cache_marks: Option<std::path::PathBuf>,
    /// The f32 lanes of the code that will run the model, whose row-grouped tensors are then
    /// not paged in ([`PageIn::grouping_lanes`]); `None` pages every weight in.
    pub grouping_lanes: Option<usize>,
    /// Where built tokenizer tables are kept between runs (see `TableCache`); `None` builds
    /// them every time.
    pub tokenizer_cache: Option<TableCache>,
}

impl LoadOptions {
    /// How the loaders page the weights in; `None` without `page_in`.
    fn paging(&self) -> Option<PageIn<'_>> {
        self.page_in.then_some(PageIn {
            marks: self.page_cache_marks.as_deref(),
            grouping_lanes: self.grouping_lanes,
        })
    }
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
        _ => load_safetensors(path, opts),
    }
}

fn load_safetensors(path: &Path, opts: &LoadOptions) -> Result<Model, LoadError> {
    let loaded = model::load(path)?;
    // The weights' pages are mapped in beside the tokenizer's build (see `page_in`).
    let copied = opts.paging().unwrap_or_default().copied(&loaded.spec, |name| {
        let t = loaded.weights.lookup(name).ok()?;
        Some((t.data.as_ptr() as usize, t.data.len()))
    });
    let pager = Pager::new(loaded.weights.mapped().filter(|_| opts.page_in), copied);
    let tokenizer = std::thread::scope(|s| {
        if opts.page_in {
            s.spawn(|| pager.work());
        }
        let tokenizer = Tokenizer::from_dir_cached(&loaded.dir, opts.tokenizer_cache.as_ref());
        pager.work();
        tokenizer
    })?;
    let reread = pager.settle(opts.page_cache_marks.as_deref());
    let eos_token_ids = merge_ids(&loaded.config.eos_token_ids, tokenizer.eos_token_ids());
    let mut notes = unread_parts(&loaded.dir, loaded.weights.names());
    notes.extend(reread_note(reread));
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
        notes,
    })
}

fn load_gguf(path: &Path, opts: &LoadOptions) -> Result<Model, LoadError> {
    let g = gguf::load_with(path, opts.paging(), opts.tokenizer_cache.as_ref())?;
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
                    bufs.insert(id, (owned_copy(&bytes), bytes.len()));
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
        // llama.cpp's converter writes neither part into the model file (a vision tower goes
        // to a separate `mmproj` file, the MTP blocks are left out of the layers Kiln reads).
        notes: reread_note(g.reread).into_iter().collect(),
    })
}

/// Why this start was slower, when the loader read weight files back for huge pages.
fn reread_note(files: usize) -> Option<String> {
    let what = match files {
        0 => return None,
        1 => "the weight file back once so the kernel maps it".to_string(),
        n => format!("the {n} weight files back once so the kernel maps them"),
    };
    Some(format!(
        "read {what} with huge pages (faster starts and decode from now on)"
    ))
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

/// A 64-byte-aligned buffer of `len` bytes, zeroed, then written by `fill`.
fn filled(len: usize, fill: impl FnOnce(&mut [u8])) -> AlignedBuf {
    let mut buf = AlignedBuf::zeroed(len);
    // SAFETY: `buf` holds at least `len` initialised (zeroed) bytes, borrowed exclusively
    // through `&mut buf` for as long as the slice lives (this call).
    fill(unsafe { std::slice::from_raw_parts_mut(buf.as_mut_ptr(), len) });
    buf
}

/// `[rows, cols]` elements of `elem` bytes each, transposed into `[cols, rows]`.
fn transposed(bytes: &[u8], rows: usize, cols: usize, elem: usize) -> AlignedBuf {
    filled(bytes.len(), |out| {
        for r in 0..rows {
            for c in 0..cols {
                let (src, dst) = ((r * cols + c) * elem, (c * rows + r) * elem);
                out[dst..dst + elem].copy_from_slice(&bytes[src..src + elem]);
            }
        }
    })
}

/// How the bytes the kernels read are made from a tensor's stored bytes, when they differ.
#[derive(Clone, Copy, Debug)]
enum Rearranged {
    /// `[rows, cols, element bytes]` as the kernels read it; the file holds `[cols, rows]`
    /// (GPT-2's `Conv1D` weights).
    Transposed([usize; 3]),
    /// Whole rows (elements, for a vector) reordered: Qwen3.5's `q_proj` (and its bias), each
    /// head's query rows then its gate rows in the file, all queries then all gates read.
    Rows(Reordered),
}

impl Rearranged {
    /// The tensor the kernels read, made from its stored bytes.
    fn make(self, stored: &[u8]) -> AlignedBuf {
        match self {
            Rearranged::Transposed([rows, cols, elem]) => transposed(stored, cols, rows, elem),
            Rearranged::Rows(r) => filled(stored.len(), |out| r.copy_into(stored, out)),
        }
    }
}

/// Safetensors weights as the engine sees them: each tensor of the spec in place in its
/// mapping, except those stored transposed (GPT-2's `Conv1D` weights) or with rows in another
/// order (Qwen3.5's `q_proj`, see [`Layout::HeadParts`]), copied into the layout the kernels
/// read on their first `weight_ptr` (never for a tensor only streamed through `read_range`,
/// which rearranges as it reads).
struct SafetensorsWeights {
    weights: Weights,
    /// Per tensor of the spec, in its order.
    slots: Vec<Slot>,
}

/// One tensor of the spec.
struct Slot {
    /// The spec's name (resolved again by [`Weights::lookup`] to make the copy).
    name: String,
    /// Index of its file ([`Weights::file_at`]), absolute offset and size there.
    file: usize,
    start: u64,
    len: usize,
    /// Its address in the mapping (or the aligned copy [`Weights`] made of a misaligned one).
    ptr: usize,
    /// How a tensor stored otherwise than the kernels read it is rearranged, and its copy
    /// once made.
    copy: Option<(Rearranged, OnceLock<AlignedBuf>)>,
}

impl SafetensorsWeights {
    fn bind(weights: Weights, spec: &ModelSpec) -> Result<SafetensorsWeights, ModelError> {
        let mut slots = Vec::with_capacity(spec.weights.len());
        for w in &spec.weights {
            let t = weights.lookup(&w.name)?;
            let (file, start) = weights.locate(&w.name)?;
            let rearranged = match (w.layout, t.shape) {
                // Stored `[cols, rows]`.
                (Layout::Transposed, &[cols, rows]) => Some(Rearranged::Transposed([rows, cols, w.dtype.size()])),
                // Rows reordered (checked now, copied on first access); else as stored.
                _ => Reordered::of(w.layout, t.shape, t.len_bytes())
                    .map_err(|problem| ModelError::BadTensor {
                        path: t.path.to_path_buf(),
                        tensor: w.name.clone(),
                        problem,
                    })?
                    .map(Rearranged::Rows),
            };
            slots.push(Slot {
                name: w.name.clone(),
                file,
                start,
                len: t.len_bytes(),
                ptr: t.ptr() as usize,
                copy: rearranged.map(|how| (how, OnceLock::new())),
            });
        }
        Ok(SafetensorsWeights { weights, slots })
    }

    fn slot(&self, id: WeightId) -> Result<&Slot, String> {
        self.slots
            .get(id.0 as usize)
            .ok_or_else(|| format!("no weight {} in the spec", id.0))
    }

    /// How many transposed or reordered copies have been made so far.
    #[cfg(test)]
    fn copies_made(&self) -> usize {
        let made = |s: &Slot| s.copy.as_ref().is_some_and(|(_, c)| c.get().is_some());
        self.slots.iter().filter(|s| made(s)).count()
    }
}

impl WeightSource for SafetensorsWeights {
    fn weight_ptr(&self, id: WeightId) -> Result<*const u8, String> {
        let slot = self.slot(id)?;
        let Some((how, copy)) = &slot.copy else {
            // The mapping (or `Weights`' copy) the pointer points into lives as long as `self`.
            return Ok(slot.ptr as *const u8);
        };
        if let Some(made) = copy.get() {
            return Ok(made.as_ptr() as *const u8);
        }
        let t = self.weights.lookup(&slot.name).map_err(|e| e.to_string())?;
        // Two threads may both make it; one copy is kept, the same bytes either way.
        let _ = copy.set(how.make(t.data));
        let made = copy
            .get()
            .ok_or_else(|| format!("tensor {}: no rearranged copy", slot.name))?;
        Ok(made.as_ptr() as *const u8)
    }

    /// Reads with `pread` from the tensor's file (transposing a `Conv1D` weight or reordering
    /// rows as it goes), never through the map and without making the copy; from the copy if
    /// it already exists.
    fn read_range(&self, id: WeightId, offset: usize, dst: &mut [u8]) -> Result<(), String> {
        let slot = self.slot(id)?;
        let (file, path) = self
            .weights
            .file_at(slot.file)
            .ok_or_else(|| format!("tensor {}: no file {}", slot.name, slot.file))?;
        let stored = Stored {
            file,
            path,
            name: &slot.name,
            start: slot.start,
            len: slot.len,
        };
        let Some((how, copy)) = &slot.copy else {
            return pread::plain(&stored, offset, dst);
        };
        if let Some(made) = copy.get() {
            return copy_from(&stored, made, offset, dst);
        }
        match how {
            Rearranged::Transposed([rows, cols, elem]) => pread::transposed(&stored, *rows, *cols, *elem, offset, dst),
            Rearranged::Rows(r) => r.read(&stored, offset, dst),
        }
    }

    fn stored_at(&self, id: WeightId) -> Option<(usize, u64)> {
        self.slot(id).ok().map(|s| (s.file, s.start))
    }

    fn origin(&self) -> Option<(String, String)> {
        kiln_engine::origin::of_files((0..).map_while(|i| self.weights.file_at(i)).map(|(f, p)| (p, f)))
    }

    /// Drops the mapped pages of those of `ids` read in place from a file's map (not the
    /// transposed, reordered or realigned copies, which are this source's own memory).
    fn release(&self, ids: &[WeightId]) -> usize {
        let maps: Vec<(usize, usize)> = self
            .weights
            .mapped()
            .map(|m| (m.bytes.as_ptr() as usize, m.bytes.len()))
            .collect();
        let in_map =
            |&(at, len): &(usize, usize)| maps.iter().any(|&(base, size)| at >= base && at + len <= base + size);
        let ranges = ids
            .iter()
            .filter_map(|&id| self.slot(id).ok())
            .filter(|s| s.copy.is_none())
            .map(|s| (s.ptr, s.len))
            .filter(in_map)
            .collect();
        // SAFETY: each range lies inside one of the weight files' read-only shared mappings
        // (checked above), which live as long as `self`.
        unsafe { kiln_core::pages::release(ranges) }
    }
}

/// `dst.len()` bytes at `offset` of `buf`, a copy of the tensor `stored` describes.
fn copy_from(stored: &Stored, buf: &AlignedBuf, offset: usize, dst: &mut [u8]) -> Result<(), String> {
    stored.check(offset, dst.len())?;
    // SAFETY: `buf` holds the tensor's `stored.len` bytes (it is a copy of them, see
    // `owned_copy`), `offset..offset + dst.len()` lies within them (checked above), and `dst`
    // is a distinct, writable slice.
    unsafe { std::ptr::copy_nonoverlapping(buf.as_ptr().add(offset), dst.as_mut_ptr(), dst.len()) };
    Ok(())
}

/// GGUF weights with the quantised tensors replaced by float copies.
struct Dequantized {
    inner: GgufWeights,
    /// The converted tensors and their sizes in bytes.
    bufs: HashMap<WeightId, (AlignedBuf, usize)>,
}

impl WeightSource for Dequantized {
    fn weight_ptr(&self, id: WeightId) -> Result<*const u8, String> {
        match self.bufs.get(&id) {
            Some((b, _)) => Ok(b.as_ptr() as *const u8),
            None => self.inner.weight_ptr(id),
        }
    }

    fn stored_at(&self, id: WeightId) -> Option<(usize, u64)> {
        if self.bufs.contains_key(&id) {
            return None;
        }
        self.inner.stored_at(id)
    }

    /// A converted tensor from its buffer; any other as [`GgufWeights`] reads it (`pread`).
    fn read_range(&self, id: WeightId, offset: usize, dst: &mut [u8]) -> Result<(), String> {
        let Some((buf, len)) = self.bufs.get(&id) else {
            return self.inner.read_range(id, offset, dst);
        };
        let name = self
            .inner
            .spec()
            .weights
            .get(id.0 as usize)
            .map_or("?", |w| w.name.as_str());
        let path = self.inner.path();
        match offset.checked_add(dst.len()) {
            Some(end) if end <= *len => {}
            _ => {
                return Err(format!(
                    "{}: tensor {name} (converted): cannot read {} bytes at byte {offset}: it has {len} bytes",
                    path.display(),
                    dst.len()
                ));
            }
        }
        // SAFETY: `buf` holds the converted tensor's `len` bytes (`owned_copy`), the range lies
        // within them (checked above), and `dst` is a distinct, writable slice.
        unsafe { std::ptr::copy_nonoverlapping(buf.as_ptr().add(offset), dst.as_mut_ptr(), dst.len()) };
        Ok(())
    }
}

#[cfg(test)]
mod tests_head_parts;

#[cfg(test)]
pub(crate) mod tests_release;

#[cfg(test)]
mod tests;

/// Checkpoint parts that are read by no architecture of Kiln, by tensor-name prefix: a
/// multimodal checkpoint's vision tower (Qwen3.5's `Qwen3_5ForConditionalGeneration`) and the
/// multi-token-prediction head released Qwen3.5 checkpoints carry.
const UNREAD_PARTS: [(&str, &str); 3] = [
    ("model.visual.", "vision tower: Kiln runs the text model only"),
    ("visual.", "vision tower: Kiln runs the text model only"),
    ("mtp.", "multi-token-prediction head: Kiln decodes one token per step"),
];

/// One note per [`UNREAD_PARTS`] entry some of `names` fall under, naming the folder, the
/// part, how many tensors it has and why it is not read.
fn unread_parts<'a>(dir: &Path, names: impl Iterator<Item = &'a str>) -> Vec<String> {
    let mut counts = [0usize; UNREAD_PARTS.len()];
    for name in names {
        if let Some(i) = UNREAD_PARTS.iter().position(|(prefix, _)| name.starts_with(prefix)) {
            counts[i] += 1;
        }
    }
    UNREAD_PARTS
        .iter()
        .zip(counts)
        .filter(|(_, n)| *n > 0)
        .map(|((prefix, what), n)| {
            let tensors = if n == 1 { "tensor" } else { "tensors" };
            format!("{}: {n} {tensors} `{prefix}*` not read ({what})", dir.display())
        })
        .collect()
}

#[cfg(test)]
mod unread_tests {
    use super::*;

    /// Invariant: a multimodal Qwen3.5 checkpoint's vision tower and MTP head are each named
    /// once with their tensor counts, and the text model's own tensors give no note.
    #[test]
    fn vision_tower_and_mtp_head_are_noted_once_each() {
        let names = [
            "model.language_model.layers.0.mlp.up_proj.weight",
            "model.visual.blocks.0.attn.qkv.weight",
            "model.visual.merger.mlp.0.weight",
            "mtp.layers.0.mlp.up_proj.weight",
            "lm_head.weight",
        ];
        let notes = unread_parts(Path::new("/m"), names.into_iter());
        assert_eq!(
            notes,
            [
                "/m: 2 tensors `model.visual.*` not read (vision tower: Kiln runs the text model only)",
                "/m: 1 tensor `mtp.*` not read (multi-token-prediction head: Kiln decodes one token per step)",
            ]
        );
        assert!(unread_parts(Path::new("/m"), names[..1].iter().copied()).is_empty());
    }

    /// Invariant: a start that read weight files back for huge pages says so once, in number;
    /// one that did not says nothing.
    #[test]
    fn a_read_back_is_noted_with_its_file_count() {
        assert_eq!(reread_note(0), None);
        let one = reread_note(1).unwrap();
        assert!(
            one.starts_with("read the weight file back once") && one.contains("maps it"),
            "{one}"
        );
        assert!(reread_note(3).unwrap().starts_with("read the 3 weight files back once"));
    }
}
