//! The GGUF container: header, metadata and tensor table, parsed from the bytes of a file.
//!
//! Layout (GGUF v2 and v3, little-endian; v1 used 32-bit counts and is rejected):
//!
//! ```text
//! magic "GGUF" | version u32 | tensor_count u64 | kv_count u64
//! kv_count × (key: string, value_type: u32, value)
//! tensor_count × (name: string, n_dims: u32, ne: n_dims × u64, ggml_type: u32, offset: u64)
//! padding to `general.alignment` (default 32)
//! tensor data (each tensor at data_start + offset)
//! ```
//!
//! where a string is `len: u64` followed by `len` bytes of UTF-8, and an array value is
//! `elem_type: u32, count: u64` followed by `count` values of that type (arrays nest).
//!
//! Nothing read from the file is trusted: every length and count is checked against the bytes
//! that remain before anything is allocated (a count of `n` elements of at least `m` bytes each
//! needs `n × m` bytes), array nesting is capped at [`MAX_ARRAY_DEPTH`], every dimension product
//! and byte size is computed with overflow checks, and every tensor's `offset + size` is checked
//! against the file size and its offset against the alignment; no two tensors may share bytes
//! ([`crate::overlap`]). No input makes [`GgufHeader::parse`] panic or read outside the given
//! slice.

use super::error::GgufError;
use super::reader::Reader;
pub use super::value::{Array, Value, ValueType};
use crate::overlap::{Span, first_overlap};
use kiln_core::DType;
use std::collections::HashMap;
use std::path::Path;

/// The four bytes every GGUF file starts with.
pub const MAGIC: [u8; 4] = *b"GGUF";
/// Alignment of tensor data when `general.alignment` is absent.
pub const DEFAULT_ALIGNMENT: u64 = 32;
/// Deepest nesting of array values accepted (real files use 1; 2 for arrays of arrays).
pub const MAX_ARRAY_DEPTH: usize = 8;
/// Longest tensor name accepted, in bytes (ggml's `GGML_MAX_NAME` minus the terminator).
pub const MAX_TENSOR_NAME: usize = 63;
/// Most dimensions a tensor may have (ggml's `GGML_MAX_DIMS`).
pub const MAX_DIMS: usize = 4;
/// Longest metadata key accepted, in bytes (the GGUF specification's limit).
pub const MAX_KEY_LEN: usize = 65535;

/// GGML type names by id, for messages about types Kiln does not read. Ids missing here were
/// never assigned or were removed from ggml.
pub fn ggml_type_name(id: u32) -> Option<&'static str> {
    Some(match id {
        0 => "f32",
        1 => "f16",
        2 => "q4_0",
        3 => "q4_1",
        6 => "q5_0",
        7 => "q5_1",
        8 => "q8_0",
        9 => "q8_1",
        10 => "q2_k",
        11 => "q3_k",
        12 => "q4_k",
        13 => "q5_k",
        14 => "q6_k",
        15 => "q8_k",
        16 => "iq2_xxs",
        17 => "iq2_xs",
        18 => "iq3_xxs",
        19 => "iq1_s",
        20 => "iq4_nl",
        21 => "iq3_s",
        22 => "iq2_s",
        23 => "iq4_xs",
        24 => "i8",
        25 => "i16",
        26 => "i32",
        27 => "i64",
        28 => "f64",
        29 => "iq1_m",
        30 => "bf16",
        34 => "tq1_0",
        35 => "tq2_0",
        39 => "mxfp4",
        40 => "nvfp4",
        41 => "q1_0",
        42 => "q2_0",
        _ => return None,
    })
}

/// The GGML type names Kiln reads, for messages.
pub const SUPPORTED_TYPES: &str = "f32, f16, bf16, q8_0, q4_0, q4_1, q5_0, q5_1, q2_k, q3_k, q4_k, q5_k, q6_k";

/// One entry of the tensor table, validated (see the module documentation).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorInfo {
    pub name: String,
    /// Dimensions as GGUF lists them: innermost (row length, ggml's `ne[0]`) first.
    pub ne: Vec<u64>,
    /// The GGML type id as stored.
    pub type_id: u32,
    pub dtype: DType,
    /// Offset of the data from the start of the data section, as stored.
    pub offset: u64,
    /// Absolute offset of the data in the file (`data_start + offset`).
    pub start: u64,
    /// Bytes of data.
    pub size: u64,
    /// Which file of a split model holds the data (0 for a single file; see
    /// [`super::split`]). `start` is an offset in that file.
    pub part: usize,
}

impl TensorInfo {
    /// The shape outermost dimension first (the reverse of [`Self::ne`]), as `weight_list` and
    /// safetensors write it: a `[vocab, hidden]` embedding is `ne = [hidden, vocab]`.
    pub fn shape(&self) -> Vec<usize> {
        // Every dimension was checked to fit in an i64 (and the product too), so the casts are
        // exact on 64-bit targets.
        self.ne.iter().rev().map(|&d| d as usize).collect()
    }

    /// Number of elements.
    pub fn elems(&self) -> u64 {
        self.ne.iter().product()
    }

    /// Elements per row (`ne[0]`; 1 for a 0-dimensional tensor).
    pub fn row_len(&self) -> u64 {
        self.ne.first().copied().unwrap_or(1)
    }

    /// Number of rows (every dimension but the first).
    pub fn rows(&self) -> u64 {
        self.ne.iter().skip(1).product()
    }
}

/// A parsed GGUF header: metadata and tensor table, all checked against the file size.
#[derive(Clone, Debug)]
pub struct GgufHeader {
    pub version: u32,
    /// `general.alignment`, or [`DEFAULT_ALIGNMENT`].
    pub alignment: u64,
    /// Absolute offset of the data section.
    pub data_start: u64,
    /// Size of the parsed bytes (the file).
    pub file_len: u64,
    /// Metadata in file order.
    pub metadata: Vec<(String, Value)>,
    /// Tensor table in file order.
    pub tensors: Vec<TensorInfo>,
    key_index: HashMap<String, usize>,
    tensor_index: HashMap<String, usize>,
}

impl GgufHeader {
    /// The value of a metadata key.
    pub fn get(&self, key: &str) -> Option<&Value> {
        self.key_index.get(key).map(|&i| &self.metadata[i].1)
    }

    /// A tensor-table entry by name.
    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensor_index.get(name).map(|&i| &self.tensors[i])
    }

    /// Parses `bytes`, the whole file. `path` is only used in error messages.
    pub fn parse(bytes: &[u8], path: &Path) -> Result<GgufHeader, GgufError> {
        let mut r = Reader {
            buf: bytes,
            pos: 0,
            path,
        };
        let file_len = bytes.len() as u64;
        // Magic: a file too short to hold it is reported as a bad magic too.
        let magic = bytes.get(..4).unwrap_or(bytes);
        if magic != MAGIC {
            return Err(GgufError::BadMagic {
                path: path.to_path_buf(),
                found: describe_magic(magic),
            });
        }
        r.pos = 4;
        let version = r.u32(&|| "the version".into())?;
        if version != 2 && version != 3 {
            let swapped = version.swap_bytes();
            if version > 0xFFFF && (1..=3).contains(&swapped) {
                return Err(GgufError::BigEndian {
                    path: path.to_path_buf(),
                    version: swapped,
                });
            }
            return Err(GgufError::UnsupportedVersion {
                path: path.to_path_buf(),
                version,
            });
        }
        let n_tensors = r.u64(&|| "the tensor count".into())?;
        let n_kv = r.u64(&|| "the metadata count".into())?;
        // Minimal on-disk sizes: a key-value pair is a key length, a type and at least one byte
        // of value; a tensor entry is a name length, n_dims, a type and an offset.
        r.check_count(n_kv, 8 + 4 + 1, "metadata entries")?;

        let mut metadata = Vec::with_capacity(reserve(n_kv));
        let mut key_index = HashMap::with_capacity(reserve(n_kv));
        for i in 0..n_kv {
            let key = r.string(&|| format!("the key of metadata entry {i}"))?;
            if key.is_empty() {
                return Err(r.malformed(format!("metadata entry {i} has an empty key")));
            }
            if key.len() > MAX_KEY_LEN {
                return Err(r.malformed(format!(
                    "metadata entry {i} has a key of {} bytes (at most {MAX_KEY_LEN})",
                    key.len()
                )));
            }
            let type_id = r.u32(&|| format!("the value type of metadata key \"{key}\""))?;
            let Some(vt) = ValueType::from_id(type_id) else {
                return Err(r.malformed(format!("metadata key \"{key}\" has unknown value type {type_id}")));
            };
            let value = r.value(vt, &key, 0)?;
            if key_index.insert(key.clone(), metadata.len()).is_some() {
                return Err(r.malformed(format!("duplicate metadata key \"{key}\"")));
            }
            metadata.push((key, value));
        }

        let alignment = match key_index.get("general.alignment").map(|&i| &metadata[i].1) {
            None => DEFAULT_ALIGNMENT,
            Some(Value::U32(a)) if *a != 0 && a.is_power_of_two() => u64::from(*a),
            Some(Value::U32(a)) => {
                return Err(GgufError::BadKey {
                    path: path.to_path_buf(),
                    key: "general.alignment".into(),
                    problem: format!("is {a}, expected a power of two"),
                });
            }
            Some(v) => {
                return Err(GgufError::BadKey {
                    path: path.to_path_buf(),
                    key: "general.alignment".into(),
                    problem: format!("is {}, expected a u32", v.describe()),
                });
            }
        };

        r.check_count(n_tensors, 8 + 4 + 4 + 8, "tensor entries")?;
        struct Raw {
            name: String,
            ne: Vec<u64>,
            type_id: u32,
            offset: u64,
        }
        let mut raws = Vec::with_capacity(reserve(n_tensors));
        let mut tensor_index = HashMap::with_capacity(reserve(n_tensors));
        for i in 0..n_tensors {
            let name = r.string(&|| format!("the name of tensor {i}"))?;
            let n_dims = r.u32(&|| format!("the dimension count of tensor {name}"))?;
            if n_dims as usize > MAX_DIMS {
                return Err(r.bad_tensor(&name, format!("has {n_dims} dimensions (at most {MAX_DIMS})")));
            }
            let mut ne = Vec::with_capacity(n_dims as usize);
            for d in 0..n_dims {
                ne.push(r.u64(&|| format!("dimension {d} of tensor {name}"))?);
            }
            let type_id = r.u32(&|| format!("the type of tensor {name}"))?;
            let offset = r.u64(&|| format!("the offset of tensor {name}"))?;
            if name.len() > MAX_TENSOR_NAME {
                return Err(r.bad_tensor(
                    &name,
                    format!("has a name of {} bytes (at most {MAX_TENSOR_NAME})", name.len()),
                ));
            }
            if tensor_index.insert(name.clone(), raws.len()).is_some() {
                return Err(r.bad_tensor(&name, "appears twice in the tensor table".into()));
            }
            raws.push(Raw {
                name,
                ne,
                type_id,
                offset,
            });
        }

        // The data section starts at the next multiple of the alignment.
        let header_end = r.pos as u64;
        let data_start = header_end
            .checked_next_multiple_of(alignment)
            .filter(|&s| n_tensors == 0 || s <= file_len)
            .ok_or_else(|| GgufError::Truncated {
                path: path.to_path_buf(),
                what: "the tensor data section".into(),
                offset: header_end,
                needed: alignment,
                file_len,
            })?;

        let mut tensors = Vec::with_capacity(raws.len());
        for raw in raws {
            let bad = |problem: String| GgufError::BadTensor {
                path: path.to_path_buf(),
                tensor: raw.name.clone(),
                problem,
            };
            // Dimensions: each must fit ggml's int64, and so must their product.
            let mut elems: u64 = 1;
            for &d in &raw.ne {
                elems = elems
                    .checked_mul(d)
                    .filter(|&e| e <= i64::MAX as u64)
                    .ok_or_else(|| bad(format!("has dimensions {:?} whose product overflows", raw.ne)))?;
            }
            let dtype = DType::from_ggml(raw.type_id).ok_or_else(|| {
                let description = match ggml_type_name(raw.type_id) {
                    Some(n) => format!(
                        "ggml type {} ({n}), which Kiln does not read (supported: {SUPPORTED_TYPES})",
                        raw.type_id
                    ),
                    None => format!("unknown ggml type {}", raw.type_id),
                };
                GgufError::UnknownType {
                    path: path.to_path_buf(),
                    tensor: raw.name.clone(),
                    type_id: raw.type_id,
                    description,
                }
            })?;
            let row = raw.ne.first().copied().unwrap_or(1);
            let block = dtype.block_elems() as u64;
            if row % block != 0 {
                return Err(bad(format!(
                    "has rows of {row} elements, not a multiple of the {dtype} block size {block}"
                )));
            }
            let size = (elems / block)
                .checked_mul(dtype.block_bytes() as u64)
                .ok_or_else(|| bad(format!("has dimensions {:?} too large to address", raw.ne)))?;
            if raw.offset % alignment != 0 {
                return Err(bad(format!(
                    "has offset {}, not a multiple of the alignment {alignment}",
                    raw.offset
                )));
            }
            let start = data_start.checked_add(raw.offset);
            let end = start.and_then(|s| s.checked_add(size));
            match (start, end) {
                (Some(start), Some(end)) if end <= file_len => tensors.push(TensorInfo {
                    name: raw.name,
                    ne: raw.ne,
                    type_id: raw.type_id,
                    dtype,
                    offset: raw.offset,
                    start,
                    size,
                    part: 0,
                }),
                _ => {
                    return Err(GgufError::TensorPastEnd {
                        path: path.to_path_buf(),
                        tensor: raw.name,
                        offset: data_start.saturating_add(raw.offset),
                        size,
                        file_len,
                    });
                }
            }
        }
        let spans = tensors.iter().map(|t| Span {
            name: &t.name,
            start: t.start,
            end: t.start + t.size,
        });
        if let Some((a, b)) = first_overlap(spans) {
            return Err(GgufError::OverlappingTensors {
                path: path.to_path_buf(),
                first: a.name.to_string(),
                first_offset: a.start,
                first_size: a.end - a.start,
                second: b.name.to_string(),
                second_offset: b.start,
                second_size: b.end - b.start,
            });
        }

        Ok(GgufHeader {
            version,
            alignment,
            data_start,
            file_len,
            metadata,
            tensors,
            key_index,
            tensor_index,
        })
    }
}

impl GgufHeader {
    /// One header for the parts of a split model (see [`super::split`]): the first part's
    /// metadata and every part's tensors, each tagged with the index of its part. `paths` name
    /// the parts in messages. A tensor name in two parts is an error.
    pub fn join_parts(parts: Vec<GgufHeader>, paths: &[&Path]) -> Result<GgufHeader, GgufError> {
        let mut parts = parts.into_iter();
        let mut joined = parts.next().expect("a split model has a first part");
        for (i, header) in parts.enumerate() {
            let part = i + 1;
            for mut t in header.tensors {
                if joined.tensor_index.contains_key(&t.name) {
                    return Err(GgufError::BadTensor {
                        path: paths[part].to_path_buf(),
                        tensor: t.name,
                        problem: "is also in an earlier part of the split model".into(),
                    });
                }
                t.part = part;
                joined.tensor_index.insert(t.name.clone(), joined.tensors.len());
                joined.tensors.push(t);
            }
        }
        Ok(joined)
    }
}

/// Capacity reserved up front for `count` entries read one by one: a checked count still only
/// bounds the entries by the file size, and an entry in memory (a `String`, a key-value pair) is
/// larger than its smallest encoding, so larger vectors grow as entries are actually read.
pub(super) fn reserve(count: u64) -> usize {
    count.min(4096) as usize
}

/// How a wrong magic reads in a message: printable ASCII quoted, anything else as hex bytes.
fn describe_magic(found: &[u8]) -> String {
    if found.is_empty() {
        "an empty file".into()
    } else if found.len() < 4 {
        format!("a file of {} bytes", found.len())
    } else if found.iter().all(|b| b.is_ascii_graphic() || *b == b' ') {
        format!("\"{}\"", String::from_utf8_lossy(found))
    } else {
        found.iter().map(|b| format!("{b:02x}")).collect::<Vec<_>>().join(" ")
    }
}
