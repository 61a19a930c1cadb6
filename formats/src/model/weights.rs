//! Safetensors weights, memory-mapped and checked before anything reads them.
//!
//! [`Weights::open`] maps `model.safetensors`, or every shard named by
//! `model.safetensors.index.json`, read-only, and validates each header completely: header
//! length against the file size, every entry's `data_offsets` against the file size, and every
//! entry's byte length against `shape × dtype`. After that, every [`TensorView`] handed out
//! lies inside its mapping, so no later access can fault on a malformed file. (A file truncated
//! by another process *after* it was mapped can still raise SIGBUS; that is inherent to memory
//! mapping.) No two tensors of a file may share bytes ([`crate::overlap`]), and only regular
//! files are opened ([`kiln_core::files`]): a FIFO or a device named as a weight file is refused
//! without blocking.
//!
//! Alignment: the kernels read weights in place, as arrays of their element type, so each
//! tensor must start at a multiple of its element size. Files written by the `safetensors`
//! library (Python or Rust) always are (the header is padded to 8 bytes and tensors are sorted
//! by decreasing alignment). A misaligned F32/F16/BF16 tensor from some other writer is copied
//! once, at open, into an owned 8-byte-aligned buffer, so it still works at the cost of that
//! tensor's memory (eagerly, even under `--ram-budget`: such files are rare); all other tensors
//! are never copied. Each file is kept open beside its map, so a tensor can also be read with
//! `pread`, bypassing the map (`Weights::locate`).

use super::error::ModelError;
use crate::overlap::{Span, first_overlap};
use crate::page_in::Mapped;
use kiln_core::arch::params::describe;
use kiln_core::files;
use kiln_core::{DType, ModelSpec, Tensor};
use memmap2::Mmap;
use serde_json::Value;
use std::collections::HashMap;
use std::fs::File;
use std::path::{Component, Path, PathBuf};

/// File name of a single-file checkpoint.
pub const SINGLE_FILE: &str = "model.safetensors";
/// File name of a sharded checkpoint's index.
pub const INDEX_FILE: &str = "model.safetensors.index.json";

/// Largest header accepted, as in the `safetensors` library.
const MAX_HEADER: u64 = 100_000_000;

/// One tensor of a weight file, borrowed from [`Weights`].
#[derive(Clone, Copy, Debug)]
pub struct TensorView<'a> {
    /// The tensor's name in the file.
    pub name: &'a str,
    /// The file holding it.
    pub path: &'a Path,
    pub dtype: DType,
    /// Outermost dimension first.
    pub shape: &'a [usize],
    /// The raw little-endian data: `shape.product() * dtype.size()` bytes, aligned to
    /// `dtype.size()`. It lives in the file's memory map (or, for a misaligned tensor, in an
    /// aligned copy owned by [`Weights`]) and stays valid, at the same address, as long as the
    /// [`Weights`] it came from.
    pub data: &'a [u8],
}

impl TensorView<'_> {
    /// Address of the first byte; valid for [`Self::len_bytes`] bytes as long as the
    /// [`Weights`] lives (moving the `Weights` value does not move the data).
    pub fn ptr(&self) -> *const u8 {
        self.data.as_ptr()
    }

    pub fn len_bytes(&self) -> usize {
        self.data.len()
    }

    pub fn elems(&self) -> usize {
        self.shape.iter().product()
    }
}

/// Where a tensor's bytes are.
#[derive(Debug)]
enum Storage {
    /// `start..end` of the file's mapping.
    Mapped { start: usize, end: usize },
    /// A copy made because the mapped bytes were misaligned; `len` bytes at the start of the
    /// buffer (8-byte aligned, since it is a `u64` slice). The file holds them at `start`.
    Copied { buf: Box<[u64]>, len: usize, start: usize },
}

#[derive(Debug)]
struct Entry {
    file: usize,
    /// The safetensors spelling (`BF16`, `I64`, ...).
    dtype_name: String,
    /// `None` for types the kernels cannot read.
    dtype: Option<DType>,
    shape: Vec<usize>,
    storage: Storage,
}

#[derive(Debug)]
struct WeightFile {
    path: PathBuf,
    /// The open file `map` was made from, for reads that bypass the map (`read_range`).
    file: File,
    map: Mmap,
}

/// The weight files of one model, mapped read-only and validated. Tensor data is reachable
/// through [`Weights::tensor`] / [`Weights::get`] for as long as this value lives.
#[derive(Debug)]
pub struct Weights {
    dir: PathBuf,
    /// `model.safetensors.index.json` for a sharded checkpoint.
    index: Option<PathBuf>,
    files: Vec<WeightFile>,
    tensors: HashMap<String, Entry>,
    /// For a sharded checkpoint: the file the index names for each tensor.
    weight_map: HashMap<String, usize>,
}

impl Weights {
    /// The mapped bytes of every weight file (for [`crate::page_in::Pager`]).
    pub fn mapped(&self) -> impl Iterator<Item = Mapped<'_>> {
        self.files.iter().map(|f| Mapped {
            bytes: &f.map[..],
            file: &f.file,
        })
    }

    /// Opens the weights of the model folder `dir`: `model.safetensors` if it exists (as
    /// `transformers` prefers it), else the shards listed in `model.safetensors.index.json`.
    /// Either name being something other than a regular file (a FIFO, a directory, a symlink
    /// loop) is an error naming it, not a reason to look further.
    pub fn open(dir: &Path) -> Result<Weights, ModelError> {
        let single = dir.join(SINGLE_FILE);
        match files::open(&single) {
            Ok(file) => {
                let mut w = Weights {
                    dir: dir.to_path_buf(),
                    index: None,
                    files: Vec::new(),
                    tensors: HashMap::new(),
                    weight_map: HashMap::new(),
                };
                w.add_file(single, file)?;
                return Ok(w);
            }
            Err(e) if e.is_not_found() => {}
            Err(e) => return Err(e.into()),
        }
        let index = dir.join(INDEX_FILE);
        match files::read_to_string(&index) {
            Ok(text) => Weights::open_sharded(dir, index, &text),
            Err(e) if e.is_not_found() => Err(ModelError::NoWeights { dir: dir.to_path_buf() }),
            Err(e) => Err(e.into()),
        }
    }

    fn open_sharded(dir: &Path, index: PathBuf, text: &str) -> Result<Weights, ModelError> {
        let value: Value = serde_json::from_str(text).map_err(|source| ModelError::Json {
            path: index.clone(),
            source,
        })?;
        let bad = |problem: String| ModelError::BadIndex {
            path: index.clone(),
            problem,
        };
        let Some(map) = value.get("weight_map") else {
            return Err(ModelError::MissingField {
                path: index.clone(),
                field: "weight_map".into(),
            });
        };
        let Value::Object(map) = map else {
            return Err(bad(format!(
                "field \"weight_map\" must be an object, got {}",
                describe(map)
            )));
        };
        // Shard names in order of first appearance in the map (sorted by tensor name, or file
        // order with serde_json's `preserve_order`; deterministic either way).
        let mut shard_names: Vec<&str> = Vec::new();
        let mut by_tensor: Vec<(&str, usize)> = Vec::with_capacity(map.len());
        for (tensor, file) in map {
            let Some(file) = file.as_str() else {
                return Err(bad(format!(
                    "weight_map entry for {tensor} must be a file name, got {}",
                    describe(file)
                )));
            };
            let rel = Path::new(file);
            let plain = rel.components().all(|c| matches!(c, Component::Normal(_)));
            if file.is_empty() || !plain {
                return Err(bad(format!(
                    "weight_map entry for {tensor} is \"{file}\"; expected a file name inside the model folder"
                )));
            }
            let shard = match shard_names.iter().position(|&n| n == file) {
                Some(i) => i,
                None => {
                    shard_names.push(file);
                    shard_names.len() - 1
                }
            };
            by_tensor.push((tensor, shard));
        }
        if shard_names.is_empty() {
            return Err(bad("weight_map is empty".into()));
        }
        let mut w = Weights {
            dir: dir.to_path_buf(),
            index: Some(index.clone()),
            files: Vec::new(),
            tensors: HashMap::new(),
            weight_map: HashMap::new(),
        };
        w.weight_map = by_tensor.into_iter().map(|(t, shard)| (t.to_string(), shard)).collect();
        for name in &shard_names {
            let path = dir.join(name);
            // "names shard X, but <path> does not exist / is a FIFO, not a regular file / ..."
            let file = files::open(&path).map_err(|e| bad(format!("names shard {name}, but {e}")))?;
            w.add_file(path, file)?;
        }
        Ok(w)
    }

    /// Maps one file (`file`, opened from `path` by [`files::open`], so a regular file),
    /// validates its header and registers its tensors. A tensor already registered from an
    /// earlier file is kept unless the index places it in this one.
    fn add_file(&mut self, path: PathBuf, file: File) -> Result<(), ModelError> {
        let file_idx = self.files.len();
        let io = |source| ModelError::Io {
            path: path.clone(),
            source,
        };
        let file_len = file.metadata().map_err(io)?.len();
        let not_st = |problem: String| ModelError::NotSafetensors {
            path: path.clone(),
            problem,
        };
        if file_len < 8 {
            return Err(not_st(format!(
                "the file is {file_len} bytes long, too short for a header"
            )));
        }
        // SAFETY: the mapping is read-only. The file is treated as immutable while the model is
        // loaded (changing it meanwhile is not supported, as with any memory-mapped loader);
        // every access below is bounds-checked against `map.len()`, not the size read above.
        let map = unsafe { Mmap::map(&file) }.map_err(io)?;
        let total = map.len() as u64;
        let Some(prefix) = map.get(..8) else {
            return Err(not_st(format!(
                "the file is {total} bytes long, too short for a header"
            )));
        };
        let mut len_bytes = [0u8; 8];
        len_bytes.copy_from_slice(prefix);
        let header_len = u64::from_le_bytes(len_bytes);
        if header_len > total - 8 {
            return Err(not_st(format!(
                "header length {header_len} is larger than the rest of the file ({} bytes)",
                total - 8
            )));
        }
        if header_len > MAX_HEADER {
            return Err(not_st(format!(
                "header length {header_len} exceeds the {MAX_HEADER}-byte limit"
            )));
        }
        let data_start = 8 + header_len as usize;
        let header =
            std::str::from_utf8(&map[8..data_start]).map_err(|e| not_st(format!("the header is not UTF-8 ({e})")))?;
        let header: Value =
            serde_json::from_str(header).map_err(|e| not_st(format!("the header is not valid JSON ({e})")))?;
        let Value::Object(header) = header else {
            return Err(not_st(format!(
                "the header is {}, expected a JSON object",
                describe(&header)
            )));
        };
        let data_len = map.len() - data_start;

        struct Raw {
            name: String,
            dtype_name: String,
            dtype: Option<DType>,
            shape: Vec<usize>,
            begin: usize,
            end: usize,
            bytes: Option<usize>,
        }
        let mut raws = Vec::with_capacity(header.len());
        for (name, info) in &header {
            if name == "__metadata__" {
                continue;
            }
            let bad = |problem: String| ModelError::BadTensor {
                path: path.clone(),
                tensor: name.clone(),
                problem,
            };
            let malformed = || bad(format!("has a malformed header entry: {}", compact(info)));
            let dtype_name = info.get("dtype").and_then(Value::as_str).ok_or_else(malformed)?;
            let shape = info
                .get("shape")
                .and_then(Value::as_array)
                .ok_or_else(malformed)?
                .iter()
                .map(|d| d.as_u64().and_then(|d| usize::try_from(d).ok()))
                .collect::<Option<Vec<usize>>>()
                .ok_or_else(malformed)?;
            let offsets = info
                .get("data_offsets")
                .and_then(Value::as_array)
                .filter(|a| a.len() == 2)
                .and_then(|a| Some((a[0].as_u64()?, a[1].as_u64()?)))
                .ok_or_else(malformed)?;
            let (begin, end) = offsets;
            if begin > end {
                return Err(bad(format!(
                    "has data_offsets [{begin}, {end}] that end before they begin"
                )));
            }
            // Beyond the file: report the absolute byte positions.
            if end > data_len as u64 {
                return Err(ModelError::Truncated {
                    path: path.clone(),
                    tensor: name.clone(),
                    end: (data_start as u64).saturating_add(end),
                    file_len: total,
                });
            }
            // Bits per element of every safetensors type, so sizes are checked even for
            // tensors Kiln will not read; an unknown type name is reported as such.
            let bits = serde_json::from_value::<safetensors::Dtype>(Value::String(dtype_name.to_string()))
                .ok()
                .map(|d| d.bitsize());
            let bytes = match bits {
                Some(bits) => {
                    let total_bits = shape
                        .iter()
                        .try_fold(bits, |acc, &d| acc.checked_mul(d))
                        .ok_or_else(|| bad(format!("has shape {shape:?}, too large to address")))?;
                    if total_bits % 8 != 0 {
                        return Err(bad(format!(
                            "has shape {shape:?} of {dtype_name}, which is not a whole number of bytes"
                        )));
                    }
                    Some(total_bits / 8)
                }
                None => None,
            };
            raws.push(Raw {
                name: name.clone(),
                dtype_name: dtype_name.to_string(),
                dtype: DType::from_safetensors(dtype_name),
                shape,
                begin: begin as usize,
                end: end as usize,
                bytes,
            });
        }
        // In file order, so a cut file reports its first incomplete tensor (done above for the
        // bounds) and size mismatches come in a stable order.
        raws.sort_by_key(|r| (r.begin, r.end));
        for raw in &raws {
            let bad = |problem: String| ModelError::BadTensor {
                path: path.clone(),
                tensor: raw.name.clone(),
                problem,
            };
            let len = raw.end - raw.begin;
            match raw.bytes {
                Some(bytes) if bytes != len => {
                    return Err(bad(format!(
                        "has {len} bytes of data, but shape {:?} of {} needs {bytes}",
                        raw.shape, raw.dtype_name
                    )));
                }
                Some(_) => {}
                None => {
                    // Unknown type: bounds are checked, the size cannot be. It is rejected if the
                    // model ever asks for it (its dtype is unsupported).
                }
            }
        }
        // Each entry is consistent in itself; no two may share bytes.
        let spans = raws.iter().map(|r| Span {
            name: &r.name,
            start: r.begin as u64,
            end: r.end as u64,
        });
        if let Some((a, b)) = first_overlap(spans) {
            return Err(ModelError::OverlappingTensors {
                path: path.clone(),
                first: a.name.to_string(),
                first_offsets: [a.start, a.end],
                second: b.name.to_string(),
                second_offsets: [b.start, b.end],
            });
        }
        for raw in raws {
            let len = raw.end - raw.begin;
            let start = data_start + raw.begin;
            let end = data_start + raw.end;
            let storage = match raw.dtype {
                Some(dtype) if !(map.as_ptr() as usize + start).is_multiple_of(dtype.size()) => Storage::Copied {
                    buf: aligned_copy(&map[start..end]),
                    len,
                    start,
                },
                _ => Storage::Mapped { start, end },
            };
            // A name present in several shards: the one the index names wins, else the first.
            let indexed_here = self.weight_map.get(&raw.name) == Some(&file_idx);
            if indexed_here || !self.tensors.contains_key(&raw.name) {
                self.tensors.insert(
                    raw.name,
                    Entry {
                        file: file_idx,
                        dtype_name: raw.dtype_name,
                        dtype: raw.dtype,
                        shape: raw.shape,
                        storage,
                    },
                );
            }
        }
        self.files.push(WeightFile { path, file, map });
        Ok(())
    }

    /// The model folder.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// `model.safetensors.index.json` for a sharded checkpoint.
    pub fn index(&self) -> Option<&Path> {
        self.index.as_deref()
    }

    /// Every mapped file, in the order they were opened.
    pub fn files(&self) -> impl Iterator<Item = &Path> {
        self.files.iter().map(|f| f.path.as_path())
    }

    /// Names of all tensors in the files, including ones the model does not use.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.tensors.keys().map(String::as_str)
    }

    /// Description of the files searched for `name`, for [`ModelError::MissingTensor`].
    fn searched(&self, name: &str) -> String {
        match (&self.index, self.weight_map.get(name)) {
            (Some(index), Some(&shard)) => format!(
                "{} (where {} places it)",
                self.files[shard].path.display(),
                index.display()
            ),
            (Some(index), None) => {
                format!("{} or any of its {} shard files", index.display(), self.files.len())
            }
            (None, _) => self
                .files
                .iter()
                .map(|f| f.path.display().to_string())
                .collect::<Vec<_>>()
                .join(", "),
        }
    }

    /// The entry for `name` (with the map's copy of the name), honouring the index's
    /// placement for sharded checkpoints, and its readable type.
    fn resolve(&self, name: &str) -> Result<(&str, &Entry, DType), ModelError> {
        let missing = || ModelError::MissingTensor {
            tensor: name.to_string(),
            searched: self.searched(name),
        };
        let (key, entry) = self.tensors.get_key_value(name).ok_or_else(missing)?;
        // Listed in one shard but only found in another: the index is authoritative.
        if self.weight_map.get(name).is_some_and(|&shard| shard != entry.file) {
            return Err(missing());
        }
        let dtype = entry.dtype.ok_or_else(|| ModelError::UnsupportedDType {
            tensor: name.to_string(),
            path: self.files[entry.file].path.clone(),
            dtype: entry.dtype_name.clone(),
        })?;
        Ok((key, entry, dtype))
    }

    /// The tensor named `name`, which must be stored as F32, F16 or BF16.
    pub fn get(&self, name: &str) -> Result<TensorView<'_>, ModelError> {
        let (key, entry, dtype) = self.resolve(name)?;
        let file = &self.files[entry.file];
        let data: &[u8] = match &entry.storage {
            Storage::Mapped { start, end } => &file.map[*start..*end],
            Storage::Copied { buf, len, .. } => {
                // SAFETY: `buf` holds at least `len` initialised bytes (see `aligned_copy`),
                // any byte pattern is a valid `u8`, and the borrow is tied to `self`, which
                // owns the buffer.
                unsafe { std::slice::from_raw_parts(buf.as_ptr().cast::<u8>(), *len) }
            }
        };
        Ok(TensorView {
            name: key,
            path: &file.path,
            dtype,
            shape: &entry.shape,
            data,
        })
    }

    /// The tensor a spec names: `name`, or, when a checkpoint was saved without its base
    /// model's prefix (GPT-2's `transformer.`), `name` without its first component.
    pub fn lookup(&self, name: &str) -> Result<TensorView<'_>, ModelError> {
        match self.get(name) {
            Err(ModelError::MissingTensor { .. }) if self.tensors.contains_key(unprefixed(name)) => {
                self.get(unprefixed(name))
            }
            other => other,
        }
    }

    /// Where the tensor a spec names ([`Weights::lookup`]) lies in its file: the index of the
    /// file (for [`Weights::file_at`]) and the absolute offset of its first byte.
    pub(crate) fn locate(&self, name: &str) -> Result<(usize, u64), ModelError> {
        let t = self.lookup(name)?;
        let missing = || ModelError::MissingTensor {
            tensor: name.to_string(),
            searched: self.searched(name),
        };
        let entry = self.tensors.get(t.name).ok_or_else(missing)?;
        let start = match entry.storage {
            Storage::Mapped { start, .. } | Storage::Copied { start, .. } => start,
        };
        Ok((entry.file, start as u64))
    }

    /// The open file number `idx` (see [`Weights::locate`]) and its path.
    pub(crate) fn file_at(&self, idx: usize) -> Option<(&File, &Path)> {
        self.files.get(idx).map(|f| (&f.file, f.path.as_path()))
    }

    /// Checks one required tensor's presence, shape (as stored, see
    /// [`kiln_core::spec::Layout`]) and type support; returns its type.
    fn check_req(&self, req: &Tensor) -> Result<(DType, TensorView<'_>), ModelError> {
        let t = self.lookup(&req.name)?;
        let expected = req.stored_shape();
        if t.shape != expected.as_slice() {
            return Err(ModelError::ShapeMismatch {
                tensor: req.name.clone(),
                path: t.path.to_path_buf(),
                found: t.shape.to_vec(),
                expected,
            });
        }
        Ok((t.dtype, t))
    }

    /// Checks every tensor `layout` reads (presence, shape, a readable type) without looking
    /// at the types `layout` records, and returns the type each is stored in, in the spec's
    /// order. Used with the config's layout to learn the real types.
    pub fn check_layout(&self, layout: &ModelSpec) -> Result<Vec<DType>, ModelError> {
        layout.weights.iter().map(|req| Ok(self.check_req(req)?.0)).collect()
    }

    /// Checks every tensor of `spec`: present, of the expected shape and stored in exactly the
    /// type the spec records. Extra tensors (rotary buffers, an `lm_head.weight` next to tied
    /// embeddings) are ignored.
    pub fn check(&self, spec: &ModelSpec) -> Result<(), ModelError> {
        for req in &spec.weights {
            let (dtype, t) = self.check_req(req)?;
            if dtype != req.dtype {
                return Err(ModelError::DTypeMismatch {
                    tensor: req.name.clone(),
                    path: t.path.to_path_buf(),
                    found: dtype.name().to_string(),
                    expected: req.dtype.name().to_string(),
                });
            }
        }
        Ok(())
    }
}

/// `name` without its first dotted component.
fn unprefixed(name: &str) -> &str {
    name.split_once('.').map_or(name, |(_, rest)| rest)
}

/// One-line rendering of a header entry, shortened.
fn compact(v: &Value) -> String {
    let s = v.to_string();
    if s.chars().count() > 80 {
        format!("{}...", s.chars().take(80).collect::<String>())
    } else {
        s
    }
}

/// Copies `bytes` into a fresh 8-byte-aligned buffer.
fn aligned_copy(bytes: &[u8]) -> Box<[u64]> {
    let mut buf = vec![0u64; bytes.len().div_ceil(8)].into_boxed_slice();
    for (word, chunk) in buf.iter_mut().zip(bytes.chunks(8)) {
        let mut b = [0u8; 8];
        b[..chunk.len()].copy_from_slice(chunk);
        // Native order: the bytes land in memory exactly as they were in the file.
        *word = u64::from_ne_bytes(b);
    }
    buf
}
