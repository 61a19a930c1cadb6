//! The tensors of a GGUF file, memory-mapped, with reordered rows (llama-architecture q/k,
//! Qwen3.5's query and gate) put in the order the kernels read.
//!
//! Every tensor is read in place from the read-only memory map, except those of a layout that
//! reorders rows ([`kiln_core::spec::Layout::reorders_rows`]): the query and key projections
//! (and their biases) of `llama`-architecture files (see [`super::permute`]) and Qwen3.5's
//! full-attention `attn_q` (each head's query rows, then its gate rows, see
//! [`kiln_core::spec::Layout::HeadParts`]). Those are copied with their rows reordered. The
//! copy is made on the tensor's first access ([`GgufWeights::tensor`], `weight_ptr`), not at
//! load, so a tensor the engine only streams (`read_range`, which reorders as it reads) is
//! never copied; the row order is checked at load all the same. A copy lives as long as the
//! [`GgufWeights`] and is 64-byte aligned.
//!
//! A split model's parts are each mapped; a tensor's data is read from the part that holds it.
//! Each part's open file is kept beside its map, for `read_range`'s `pread`s.
//!
//! Alignment: tensor data in the map starts at `data_start + offset`, both multiples of the
//! file's alignment (32 by default) and the map is page-aligned, so every tensor begins at a
//! multiple of 32 bytes. A file declaring a smaller `general.alignment` would break that; such
//! a tensor is copied into an aligned buffer on its first access, so every
//! [`GgufTensor::ptr`] is 32-byte aligned whatever the file.

use super::dequant;
use super::error::GgufError;
use super::parse::{GgufHeader, TensorInfo};
use super::split::GgufFiles;
use crate::pread::{self, Stored};
use crate::reorder::Reordered;
use kiln_core::{DType, ModelSpec, WeightId};
use memmap2::Mmap;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// The alignment every tensor's data is guaranteed to have.
pub const TENSOR_ALIGN: usize = 32;

/// One model tensor, borrowed from [`GgufWeights`].
#[derive(Clone, Copy, Debug)]
pub struct GgufTensor<'a> {
    /// The tensor's name in the file (`blk.0.attn_q.weight`).
    pub name: &'a str,
    pub dtype: DType,
    /// Outermost dimension first (the reverse of GGUF's `ne`), as in `weight_list`.
    pub shape: &'a [usize],
    /// The raw data: `dtype.bytes_for(elems)` bytes, rows in the kernels' (Hugging Face)
    /// order, starting at a multiple of [`TENSOR_ALIGN`] bytes. Valid, at the same address, as
    /// long as the [`GgufWeights`] lives (moving it does not move the data).
    pub data: &'a [u8],
    /// Whether `data` is a reordered copy (llama q/k, Qwen3.5's q) rather than the file's
    /// bytes.
    pub reordered: bool,
}

impl GgufTensor<'_> {
    /// Address of the first byte, valid for [`Self::len_bytes`] bytes while the
    /// [`GgufWeights`] lives.
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

/// 64 bytes, 64-byte aligned: the unit of owned tensor copies.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Line([u8; 64]);

/// An owned, 64-byte-aligned byte buffer.
struct AlignedBuf {
    lines: Box<[Line]>,
    len: usize,
}

impl AlignedBuf {
    fn zeroed(len: usize) -> AlignedBuf {
        AlignedBuf {
            lines: vec![Line([0; 64]); len.div_ceil(64)].into_boxed_slice(),
            len,
        }
    }

    fn as_slice(&self) -> &[u8] {
        // SAFETY: `lines` is `len.div_ceil(64) * 64 >= len` initialised bytes (`Line` is
        // `repr(C)` around a byte array, so without padding); the borrow is tied to `self`.
        unsafe { std::slice::from_raw_parts(self.lines.as_ptr().cast::<u8>(), self.len) }
    }

    fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as in `as_slice`, with exclusive access through `&mut self`.
        unsafe { std::slice::from_raw_parts_mut(self.lines.as_mut_ptr().cast::<u8>(), self.len) }
    }
}

impl std::fmt::Debug for AlignedBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "AlignedBuf({} bytes)", self.len)
    }
}

/// How the bytes the kernels read are made from the file's.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    /// Read in place from the map.
    Mapped,
    /// Rows reordered by a layout that moves rows (llama.cpp's q/k permutation, Qwen3.5's
    /// head parts), into a copy.
    Reordered(Reordered),
    /// Copied as they are into an aligned buffer (the map's bytes are misaligned).
    Realigned,
}

#[derive(Debug)]
struct Entry {
    /// Index into the header's tensor table.
    info: usize,
    shape: Vec<usize>,
    /// `start..end` of the map of part `part`: the tensor's bytes as stored.
    part: usize,
    start: usize,
    end: usize,
    kind: Kind,
    /// The copy of a `Reordered` or `Realigned` tensor, made on first access.
    copy: OnceLock<AlignedBuf>,
}

/// The model tensors of one GGUF file (or the parts of a split one): mapped, checked against a
/// [`ModelSpec`], rows in the order the kernels read. See the module documentation.
#[derive(Debug)]
pub struct GgufWeights {
    path: PathBuf,
    /// Every part's path (one for a single file), indexed by [`TensorInfo::part`].
    paths: Vec<PathBuf>,
    /// The open file of each part, the one its map was made from (for `read_range`).
    files: Vec<File>,
    /// One map per part (one for a single file), indexed by [`TensorInfo::part`].
    maps: Vec<Mmap>,
    header: GgufHeader,
    spec: ModelSpec,
    /// One per tensor of the spec, in its order (indexed by [`WeightId`]).
    entries: Vec<Entry>,
    reordered_bytes: usize,
}

impl GgufWeights {
    /// Binds the tensors of `spec` in `map` (made from `file`, opened from `path`, whose
    /// parsed header is `header`), checking each for presence, shape and storage type, and
    /// checking that the rows of a layout that reorders them (llama.cpp's q/k permutation,
    /// Qwen3.5's head parts) can be reordered (they are on first access).
    pub fn new(
        path: &Path,
        file: File,
        map: Mmap,
        header: GgufHeader,
        spec: &ModelSpec,
    ) -> Result<GgufWeights, GgufError> {
        let files = GgufFiles {
            paths: vec![path.to_path_buf()],
            files: vec![file],
            maps: vec![map],
            header,
        };
        Self::from_files(files, spec)
    }

    /// [`GgufWeights::new`] for the files [`super::split::open_model`] opened (one, or every
    /// part of a split model): part `i` is `files.paths[i]`, `header` is the joined header;
    /// the first part names the model in messages.
    pub fn from_files(files: GgufFiles, spec: &ModelSpec) -> Result<GgufWeights, GgufError> {
        let GgufFiles {
            paths,
            files,
            maps,
            header,
        } = files;
        let path = paths.first().cloned().unwrap_or_default();
        let path = path.as_path();
        if files.len() != paths.len() || maps.len() != paths.len() {
            return Err(GgufError::InvalidRequest {
                path: path.to_path_buf(),
                message: format!(
                    "{} paths, {} files and {} maps do not describe the same parts",
                    paths.len(),
                    files.len(),
                    maps.len()
                ),
            });
        }
        super::model::check_tensors(&header, spec, path, true)?;
        let mut entries = Vec::with_capacity(spec.weights.len());
        let mut reordered_bytes = 0;
        for req in &spec.weights {
            let i = header
                .tensors
                .iter()
                .position(|t| t.name == req.name)
                .expect("present: check_tensors passed");
            let t: &TensorInfo = &header.tensors[i];
            // The header was parsed from this part's map, so these are in bounds.
            let (part, start, end) = (t.part, t.start as usize, (t.start + t.size) as usize);
            let in_map = maps.get(part).and_then(|m| m.get(start..end));
            let Some(bytes) = in_map else {
                return Err(GgufError::InvalidModel {
                    path: path.to_path_buf(),
                    message: format!("tensor {} lies outside part {} of the model", req.name, part + 1),
                });
            };
            // A reordering is checked now, copied on first access.
            let reordered =
                Reordered::of(req.layout, &req.shape, bytes.len()).map_err(|problem| GgufError::InvalidModel {
                    path: path.to_path_buf(),
                    message: format!("tensor {} {problem}", req.name),
                })?;
            let kind = match reordered {
                Some(r) => {
                    reordered_bytes += bytes.len();
                    Kind::Reordered(r)
                }
                None if !(bytes.as_ptr() as usize).is_multiple_of(TENSOR_ALIGN) => Kind::Realigned,
                None => Kind::Mapped,
            };
            entries.push(Entry {
                info: i,
                shape: req.shape.clone(),
                part,
                start,
                end,
                kind,
                copy: OnceLock::new(),
            });
        }
        Ok(GgufWeights {
            path: path.to_path_buf(),
            paths,
            files,
            maps,
            header,
            spec: spec.clone(),
            entries,
            reordered_bytes,
        })
    }

    /// The file these weights were read from (the first part of a split model).
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The parsed header (metadata and the full tensor table).
    pub fn header(&self) -> &GgufHeader {
        &self.header
    }

    /// The spec these weights were checked against.
    pub fn spec(&self) -> &ModelSpec {
        &self.spec
    }

    /// Bytes of the copies that put reordered rows (llama q/k, Qwen3.5's q) in the kernels'
    /// order: the size of every reordered tensor, whether or not its copy has been made yet (it
    /// is on first access).
    pub fn reordered_bytes(&self) -> usize {
        self.reordered_bytes
    }

    /// How many reordered or re-aligned copies have been made so far.
    #[cfg(test)]
    pub(crate) fn copies_made(&self) -> usize {
        self.entries.iter().filter(|e| e.copy.get().is_some()).count()
    }

    fn entry(&self, id: WeightId) -> Result<&Entry, GgufError> {
        self.entries
            .get(id.0 as usize)
            .ok_or_else(|| GgufError::InvalidRequest {
                path: self.path.clone(),
                message: format!("no weight {} in the spec", id.0),
            })
    }

    /// The tensor's bytes as stored in the map.
    fn stored(&self, e: &Entry) -> &[u8] {
        &self.maps[e.part][e.start..e.end]
    }

    /// The bytes the kernels read made from `stored`, a copy unless the entry is `Mapped`.
    fn made(e: &Entry, stored: &[u8]) -> AlignedBuf {
        let mut buf = AlignedBuf::zeroed(stored.len());
        match e.kind {
            // Checked at load: the rows divide as the layout says, and the size into rows.
            Kind::Reordered(r) => r.copy_into(stored, buf.as_mut_slice()),
            Kind::Realigned | Kind::Mapped => buf.as_mut_slice().copy_from_slice(stored),
        }
        buf
    }

    /// Calls `f` with the bytes the kernels read of `e`, without keeping a copy it has to make
    /// (the lazy copy when it exists, else a temporary one).
    fn with_bytes<R>(&self, e: &Entry, f: impl FnOnce(&[u8]) -> R) -> R {
        match (e.kind, e.copy.get()) {
            (Kind::Mapped, _) => f(self.stored(e)),
            (_, Some(copy)) => f(copy.as_slice()),
            _ => f(Self::made(e, self.stored(e)).as_slice()),
        }
    }

    /// The tensor of a model weight: pointer, type and shape (outermost first), rows in the
    /// order the kernels read.
    ///
    /// The first access to a reordered (llama q/k, Qwen3.5's q) or misaligned tensor makes its
    /// copy.
    pub fn tensor(&self, id: WeightId) -> Result<GgufTensor<'_>, GgufError> {
        let entry = self.entry(id)?;
        let info = &self.header.tensors[entry.info];
        let data = match entry.kind {
            Kind::Mapped => self.stored(entry),
            _ => entry
                .copy
                .get_or_init(|| Self::made(entry, self.stored(entry)))
                .as_slice(),
        };
        Ok(GgufTensor {
            name: &info.name,
            dtype: info.dtype,
            shape: &entry.shape,
            data,
            reordered: matches!(entry.kind, Kind::Reordered(_)),
        })
    }

    /// The tensor called `name` in the file, if the spec reads it.
    pub fn named(&self, name: &str) -> Option<GgufTensor<'_>> {
        self.tensor(self.spec.weight_named(name)?).ok()
    }

    /// The raw bytes of any tensor of the file by its GGUF name, as stored (not reordered).
    pub fn raw(&self, name: &str) -> Option<(&TensorInfo, &[u8])> {
        let t = self.header.tensor(name)?;
        Some((t, &self.maps[t.part][t.start as usize..(t.start + t.size) as usize]))
    }

    /// The weight `id` converted to `target` (F32 or BF16): little-endian values in Hugging
    /// Face row order, outermost dimension first, as a safetensors file would hold them. For
    /// `--dequantize`.
    pub fn dequantize_to(&self, id: WeightId, target: DType) -> Result<Vec<u8>, GgufError> {
        if !matches!(target, DType::F32 | DType::BF16) {
            return Err(GgufError::InvalidRequest {
                path: self.path.clone(),
                message: format!("cannot dequantize to {target} (targets: f32, bf16)"),
            });
        }
        // Without keeping a reordered copy: the converted values replace it.
        let entry = self.entry(id)?;
        let info = &self.header.tensors[entry.info];
        let values = self
            .with_bytes(entry, |data| dequant::dequantize(info.dtype, data))
            .map_err(|e| GgufError::InvalidRequest {
                path: self.path.clone(),
                message: format!("tensor {}: {e}", info.name),
            })?;
        Ok(match target {
            DType::F32 => values.iter().flat_map(|v| v.to_le_bytes()).collect(),
            _ => values
                .iter()
                .flat_map(|&v| dequant::f32_to_bf16(v).to_le_bytes())
                .collect(),
        })
    }
}

impl kiln_engine::engine::WeightSource for GgufWeights {
    fn weight_ptr(&self, id: WeightId) -> Result<*const u8, String> {
        self.tensor(id).map(|t| t.ptr()).map_err(|e| e.to_string())
    }

    fn origin(&self) -> Option<(String, String)> {
        kiln_engine::origin::of_files(self.paths.iter().map(|p| p.as_path()).zip(&self.files))
    }

    /// Drops the mapped pages of those of `ids` read in place from the maps (not the
    /// reordered or realigned copies, which are this source's own memory).
    fn release(&self, ids: &[WeightId]) -> usize {
        let ranges = ids
            .iter()
            .filter_map(|&id| self.entry(id).ok())
            .filter(|e| matches!(e.kind, Kind::Mapped))
            .map(|e| (self.maps[e.part].as_ptr() as usize + e.start, e.end - e.start))
            .collect();
        // SAFETY: each range is a tensor's bytes inside one of `self.maps`, read-only shared
        // file mappings that live as long as `self`.
        unsafe { kiln_core::pages::release(ranges) }
    }

    /// Reads with `pread` from the part's file (reordering rows as it goes), never through the
    /// map and without making the lazy copy; from the copy if it already exists.
    fn read_range(&self, id: WeightId, offset: usize, dst: &mut [u8]) -> Result<(), String> {
        let entry = self.entry(id).map_err(|e| e.to_string())?;
        let info = &self.header.tensors[entry.info];
        let stored = Stored {
            file: &self.files[entry.part],
            path: &self.paths[entry.part],
            name: &info.name,
            start: entry.start as u64,
            len: entry.end - entry.start,
        };
        if let Some(copy) = entry.copy.get() {
            stored.check(offset, dst.len())?;
            dst.copy_from_slice(&copy.as_slice()[offset..offset + dst.len()]);
            return Ok(());
        }
        match entry.kind {
            Kind::Reordered(r) => r.read(&stored, offset, dst),
            Kind::Mapped | Kind::Realigned => pread::plain(&stored, offset, dst),
        }
    }

    fn stored_at(&self, id: WeightId) -> Option<(usize, u64)> {
        self.entry(id).ok().map(|e| (e.part, e.start as u64))
    }
}
