//! GGUF front end: a llama.cpp model file into the same [`ModelSpec`] the safetensors front end
//! ([`crate::model`]) produces, memory-mapped weights with Hugging Face row order, and the
//! file's tokenizer as a [`Tokenizer`].
//!
//! ```no_run
//! let model = kiln_formats::gguf::load(std::path::Path::new("/models/SmolLM2-135M.Q4_1.gguf"))?;
//! println!("{} layers, eos {:?}", model.spec.num_layers(), model.eos_token_ids);
//! let q = model.weights.named("blk.0.attn_q.weight").expect("a llama-family file");
//! println!("{} {:?} at {:p}", q.dtype, q.shape, q.ptr());
//! let ids = model.tokenizer.encode("<|im_start|>user\nHi<|im_end|>", false)?;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! The pieces, each usable on its own:
//!
//! * [`split`]: models split into several files by llama.cpp's `gguf-split`, read in place.
//! * [`parse`]: the container (GGUF v2/v3 header, metadata, tensor table), every length and
//!   offset checked against the file; never panics (fuzzed, see `fuzz/`).
//! * [`model`]: metadata and tensor table to a validated [`ModelSpec`], built by the
//!   architecture's file in [`kiln_core::arch`]; each tensor checked against the spec.
//! * [`permute`]: undoing llama.cpp's q/k row permutation of `llama` files.
//! * [`weights`]: [`GgufWeights`], the tensors by [`kiln_core::WeightId`] (pointer, type,
//!   shape), also an [`kiln_engine::engine::WeightSource`]; `dequantize_to` for `--dequantize`.
//! * [`dequant`]: reference dequantisers of every storage type, bit-exact with ggml.
//! * [`tokenizer`]: `tokenizer.*` metadata to a `tokenizer.json` and a Kiln [`Tokenizer`],
//!   matching llama.cpp's tokenisation.
//!
//! Every failure is one [`GgufError`] whose message is one line starting with the file's path.
//! [`crate::model::load`] does not depend on this module; choosing between the two is up to
//! the caller ([`is_gguf`] tells them apart by the magic).

pub use kiln_core::dequant;
pub mod error;
pub mod model;
pub mod parse;
pub mod permute;
mod reader;
pub mod split;
pub mod strings;
pub mod tokenizer;
pub mod tokenizer_doc;
mod value;
pub mod weights;

#[cfg(test)]
mod special_files_tests;
#[cfg(test)]
mod tests;
#[cfg(test)]
mod tests_head_parts;
#[cfg(test)]
mod tests_phi3;
#[cfg(test)]
mod tests_read_range;
#[cfg(test)]
mod tests_release;

pub use error::GgufError;
pub use parse::{GgufHeader, TensorInfo, Value};
pub use tokenizer::GgufVocab;
pub use weights::{GgufTensor, GgufWeights};

use crate::page_in::{Mapped, PageIn, Pager};
use kiln_core::ModelSpec;
use kiln_core::files;
use kiln_text::tokenizer::{TableCache, Tokenizer};
use memmap2::Mmap;
use std::fs::File;
use std::io::Read;
use std::path::{Path, PathBuf};

/// A GGUF model file, read and checked.
#[derive(Debug)]
pub struct LoadedGguf {
    /// The file (the first part of a split model).
    pub path: PathBuf,
    /// Every file of the model: `path` alone, or all parts of a split model in order.
    pub parts: Vec<PathBuf>,
    /// The validated spec, with each tensor's storage type as found in the file.
    pub spec: ModelSpec,
    /// The mapped weights, checked against `spec`, q/k rows in Hugging Face order. The parsed
    /// header (all metadata) is [`GgufWeights::header`].
    pub weights: GgufWeights,
    /// The tokenizer metadata as read (token texts, types, scores, merges, special ids).
    pub vocab: GgufVocab,
    /// The tokenizer built from it; `encode(text, true)` adds BOS/EOS as the file asks.
    pub tokenizer: Tokenizer,
    /// `tokenizer.ggml.bos_token_id` (or the tokenizer family's default).
    pub bos_token_id: Option<u32>,
    /// Every id that ends generation: EOS, EOT, EOM and the end-of-turn tokens llama.cpp
    /// recognises by their text (`<|im_end|>`, `<|eot_id|>`, ...).
    pub eos_token_ids: Vec<u32>,
    /// Whether prompts start with BOS (`tokenizer.ggml.add_bos_token`).
    pub add_bos: bool,
    /// `tokenizer.chat_template`, the raw Jinja source.
    pub chat_template: Option<String>,
    /// Files read back once for huge pages while loading ([`crate::page_in::Pager::settle`]).
    pub reread: usize,
}

/// Whether `path` is a regular file starting with the GGUF magic (never blocks on a FIFO).
pub fn is_gguf(path: &Path) -> bool {
    let mut magic = [0u8; 4];
    files::open(path).is_ok_and(|mut f| f.read_exact(&mut magic).is_ok() && magic == parse::MAGIC)
}

/// Maps `path` read-only and parses its header. Only a regular file is opened: a FIFO, a
/// device or a directory is refused by name ([`GgufError::File`]) without blocking.
pub fn open(path: &Path) -> Result<(Mmap, GgufHeader), GgufError> {
    open_file(path).map(|(_, map, header)| (map, header))
}

/// [`open`], also returning the open file the map was made from.
pub fn open_file(path: &Path) -> Result<(File, Mmap, GgufHeader), GgufError> {
    let io = |source| GgufError::Io {
        path: path.to_path_buf(),
        source,
    };
    let mut file = files::open(path)?;
    let len = file.metadata().map_err(io)?.len();
    if len < 4 {
        // Too short to map usefully; parse the bytes for the proper message.
        let mut bytes = Vec::new();
        file.read_to_end(&mut bytes).map_err(io)?;
        GgufHeader::parse(&bytes, path)?;
    }
    // SAFETY: the mapping is read-only. The file is treated as immutable while the model is
    // loaded (changing it meanwhile is not supported, as with any memory-mapped loader); every
    // access is bounds-checked against the map's length by the parser.
    let map = unsafe { Mmap::map(&file) }.map_err(io)?;
    let header = GgufHeader::parse(&map, path)?;
    Ok((file, map, header))
}

/// Reads the GGUF model at `path`: header, spec (every needed tensor checked), weights (llama
/// q/k rows reordered) and tokenizer. `path` may be the first part of a split model (see
/// [`split`]).
pub fn load(path: &Path) -> Result<LoadedGguf, GgufError> {
    load_with(path, None, None)
}

/// [`load`], with the weights' pages mapped in beside the tokenizer's build when `page_in` is
/// given (see [`crate::page_in`]), and the tokenizer's tables kept in `tokenizer_cache`.
pub fn load_with(
    path: &Path,
    page_in: Option<PageIn>,
    tokenizer_cache: Option<&TableCache>,
) -> Result<LoadedGguf, GgufError> {
    let files = split::open_model(path)?;
    let bytes: Vec<&[u8]> = files.maps.iter().map(|m| &m[..]).collect();
    let spec = model::spec_from_parts(&files.header, &bytes, path)?;
    let vocab = tokenizer::vocab_from_header(&files.header, path)?;
    if vocab.tokens.len() > spec.dims.vocab_size {
        return Err(GgufError::InvalidModel {
            path: path.to_path_buf(),
            message: format!(
                "tokenizer.ggml.tokens has {} tokens, but token_embd.weight has only {} rows",
                vocab.tokens.len(),
                spec.dims.vocab_size
            ),
        });
    }
    // The weights' pages are mapped in beside the tokenizer's build (see `page_in`).
    let mapped = files
        .maps
        .iter()
        .zip(&files.files)
        .map(|(m, file)| Mapped { bytes: m, file });
    let copied = page_in.unwrap_or_default().copied(&spec, |name| {
        let t = files.header.tensors.iter().find(|t| t.name == name)?;
        let start = files.maps.get(t.part)?.as_ptr() as usize + t.start as usize;
        Some((start, t.size as usize))
    });
    let pager = Pager::new(mapped.filter(|_| page_in.is_some()), copied);
    let tokenizer = std::thread::scope(|s| {
        if page_in.is_some() {
            s.spawn(|| pager.work());
        }
        let tokenizer = tokenizer::build_tokenizer_cached(&vocab, path, tokenizer_cache);
        pager.work();
        tokenizer
    })?;
    let reread = pager.settle(page_in.and_then(|p| p.marks));
    let parts = files.paths.clone();
    let weights = GgufWeights::from_files(files, &spec)?;
    Ok(LoadedGguf {
        path: path.to_path_buf(),
        parts,
        bos_token_id: vocab.bos_token_id,
        eos_token_ids: vocab.eog_token_ids.clone(),
        add_bos: vocab.add_bos,
        chat_template: vocab.chat_template.clone(),
        reread,
        spec,
        weights,
        vocab,
        tokenizer,
    })
}
