//! The tensors of a GGUF file, memory-mapped, with llama-architecture q/k rows put back in
//! Hugging Face order.
//!
//! Every tensor is read in place from the read-only memory map, except the query and key
//! projections (and their biases) of `llama`-architecture files: those are copied once, at
//! load, with their rows reordered (see [`super::permute`]). The copy lives as long as the
//! [`GgufWeights`] and is 64-byte aligned.
//!
//! A split model's parts are each mapped; a tensor's data is read from the part that holds it.
//!
//! Alignment: tensor data in the map starts at `data_start + offset`, both multiples of the
//! file's alignment (32 by default) and the map is page-aligned, so every tensor begins at a
//! multiple of 32 bytes. A file declaring a smaller `general.alignment` would break that; such
//! a tensor is copied into an aligned buffer at load, so every [`GgufTensor::ptr`] is 32-byte
//! aligned whatever the file.

use super::dequant;
use super::error::GgufError;
use super::parse::{GgufHeader, TensorInfo};
use super::permute::{reorder_rows, unpermute_rows};
use kiln_core::spec::Layout;
use kiln_core::{DType, ModelSpec, WeightId};
use memmap2::Mmap;
use std::path::{Path, PathBuf};

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
    /// The raw data: `dtype.bytes_for(elems)` bytes, rows in Hugging Face order, starting at a
    /// multiple of [`TENSOR_ALIGN`] bytes. Valid, at the same address, as long as the
    /// [`GgufWeights`] lives (moving it does not move the data).
    pub data: &'a [u8],
    /// Whether `data` is a reordered copy (llama q/k) rather than the file's bytes.
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

#[derive(Debug)]
enum Storage {
    /// `start..end` of the map of part `part`.
    Mapped { part: usize, start: usize, end: usize },
    /// A reordered or re-aligned copy.
    Owned { buf: AlignedBuf, reordered: bool },
}

#[derive(Debug)]
struct Entry {
    /// Index into the header's tensor table.
    info: usize,
    shape: Vec<usize>,
    storage: Storage,
}

/// The model tensors of one GGUF file (or the parts of a split one): mapped, checked against a
/// [`ModelSpec`], q/k rows in Hugging Face order. See the module documentation.
#[derive(Debug)]
pub struct GgufWeights {
    path: PathBuf,
    /// One map per part (one for a single file), indexed by [`TensorInfo::part`].
    maps: Vec<Mmap>,
    header: GgufHeader,
    spec: ModelSpec,
    /// One per tensor of the spec, in its order (indexed by [`WeightId`]).
    entries: Vec<Entry>,
    reordered_bytes: usize,
}

impl GgufWeights {
    /// Binds the tensors of `spec` in `map` (whose parsed header is `header`), checking each
    /// for presence, shape and storage type, and reorders the q/k rows llama.cpp permuted.
    pub fn new(path: &Path, map: Mmap, header: GgufHeader, spec: &ModelSpec) -> Result<GgufWeights, GgufError> {
        Self::from_parts(path, vec![map], header, spec)
    }

    /// [`GgufWeights::new`] for a split model: `maps[i]` is part `i`, `header` the joined
    /// header of [`super::split::open_model`]; `path` (the first part) names it in messages.
    pub fn from_parts(
        path: &Path,
        maps: Vec<Mmap>,
        header: GgufHeader,
        spec: &ModelSpec,
    ) -> Result<GgufWeights, GgufError> {
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
            let bytes = &maps[part][start..end];
            let storage = match req.layout {
                Layout::RopePermuted { heads } => {
                    let rows = req.shape[0];
                    let mapping = unpermute_rows(rows, heads).ok_or_else(|| GgufError::InvalidModel {
                        path: path.to_path_buf(),
                        message: format!(
                            "tensor {} has {rows} rows, not a multiple of 2 x {heads} heads",
                            req.name
                        ),
                    })?;
                    let mut buf = AlignedBuf::zeroed(bytes.len());
                    reorder_rows(bytes, buf.as_mut_slice(), bytes.len() / rows, &mapping);
                    reordered_bytes += bytes.len();
                    Storage::Owned { buf, reordered: true }
                }
                _ if !(bytes.as_ptr() as usize).is_multiple_of(TENSOR_ALIGN) => {
                    let mut buf = AlignedBuf::zeroed(bytes.len());
                    buf.as_mut_slice().copy_from_slice(bytes);
                    Storage::Owned { buf, reordered: false }
                }
                _ => Storage::Mapped { part, start, end },
            };
            entries.push(Entry {
                info: i,
                shape: req.shape.clone(),
                storage,
            });
        }
        Ok(GgufWeights {
            path: path.to_path_buf(),
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

    /// Bytes copied at load to put llama q/k rows in Hugging Face order.
    pub fn reordered_bytes(&self) -> usize {
        self.reordered_bytes
    }

    /// The tensor of a model weight: pointer, type and shape (outermost first), rows in Hugging
    /// Face order.
    pub fn tensor(&self, id: WeightId) -> Result<GgufTensor<'_>, GgufError> {
        let entry = self
            .entries
            .get(id.0 as usize)
            .ok_or_else(|| GgufError::InvalidRequest {
                path: self.path.clone(),
                message: format!("no weight {} in the spec", id.0),
            })?;
        let info = &self.header.tensors[entry.info];
        let (data, reordered) = match &entry.storage {
            Storage::Mapped { part, start, end } => (&self.maps[*part][*start..*end], false),
            Storage::Owned { buf, reordered } => (buf.as_slice(), *reordered),
        };
        Ok(GgufTensor {
            name: &info.name,
            dtype: info.dtype,
            shape: &entry.shape,
            data,
            reordered,
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
        let t = self.tensor(id)?;
        let values = dequant::dequantize(t.dtype, t.data).map_err(|e| GgufError::InvalidRequest {
            path: self.path.clone(),
            message: format!("tensor {}: {e}", t.name),
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
}
