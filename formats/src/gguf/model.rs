//! From GGUF metadata and tensor table to a [`ModelSpec`].
//!
//! `general.architecture` picks the architecture's row in [`kiln_core::arch::ARCHITECTURES`];
//! its file builds the spec from the metadata through [`GgufParams`], which answers for keys
//! `{a}.<name>` (`{a}` the architecture) the way llama.cpp's loader reads them. Integer keys may
//! be stored in any integer type (converters differ); a key stored as a per-layer array is
//! accepted when all its entries are equal. Tensor names are the architecture file's GGUF
//! names, and every tensor the spec reads is checked for presence and shape before the spec is
//! returned with each tensor's storage type.
//!
//! GGUF lists dimensions innermost first; shapes here are outermost first (see
//! [`super::parse::TensorInfo::shape`]).

use super::error::GgufError;
use super::parse::{Array, GgufHeader, TensorInfo, Value};
use kiln_core::arch::{self, ArchError, Architecture, Format, Key, Params};
use kiln_core::{DType, ModelSpec};
use std::path::Path;

/// Typed access to the metadata, with errors naming the file and key.
pub struct Meta<'a> {
    pub header: &'a GgufHeader,
    pub path: &'a Path,
}

impl<'a> Meta<'a> {
    pub fn bad(&self, key: &str, problem: String) -> GgufError {
        GgufError::BadKey {
            path: self.path.to_path_buf(),
            key: key.to_string(),
            problem,
        }
    }

    pub fn missing(&self, key: &str) -> GgufError {
        GgufError::MissingKey {
            path: self.path.to_path_buf(),
            key: key.to_string(),
        }
    }

    pub fn get(&self, key: &str) -> Option<&'a Value> {
        self.header.get(key)
    }

    pub fn string(&self, key: &str) -> Result<Option<&'a str>, GgufError> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s)),
            Some(v) => Err(self.bad(key, format!("is {}, expected a string", v.describe()))),
        }
    }

    pub fn bool(&self, key: &str) -> Result<Option<bool>, GgufError> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(v) => Err(self.bad(key, format!("is {}, expected a bool", v.describe()))),
        }
    }

    /// A non-negative integer of any width, at most `max`. A per-layer array of equal values
    /// is accepted as that value.
    pub fn uint(&self, key: &str, max: u64) -> Result<Option<u64>, GgufError> {
        let v = match self.get(key) {
            None => return Ok(None),
            Some(Value::Array(a)) => {
                let values = a
                    .to_f64s()
                    .filter(|v| !v.is_empty())
                    .ok_or_else(|| self.bad(key, format!("is {}, expected an integer", describe_array(a))))?;
                if values.iter().any(|&v| v != values[0]) {
                    return Err(GgufError::Unsupported {
                        path: self.path.to_path_buf(),
                        what: format!(
                            "per-layer values of \"{key}\" that differ between layers ({})",
                            short_list(&values)
                        ),
                    });
                }
                let v = values[0];
                if v < 0.0 || v.fract() != 0.0 {
                    return Err(self.bad(key, format!("holds {v}, expected a non-negative integer")));
                }
                v as u64
            }
            Some(v) => v
                .as_u64()
                .ok_or_else(|| self.bad(key, format!("is {}, expected a non-negative integer", v.describe())))?,
        };
        if v > max {
            return Err(self.bad(key, format!("is {v}, larger than the supported maximum {max}")));
        }
        Ok(Some(v))
    }

    /// A finite number of any numeric type.
    pub fn float(&self, key: &str) -> Result<Option<f64>, GgufError> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => match v.as_f64() {
                Some(f) if f.is_finite() => Ok(Some(f)),
                Some(f) => Err(self.bad(key, format!("is {f}, expected a finite number"))),
                None => Err(self.bad(key, format!("is {}, expected a number", v.describe()))),
            },
        }
    }
}

fn describe_array(a: &Array) -> String {
    format!("an array of {} {}", a.len(), a.elem_type())
}

fn short_list(values: &[f64]) -> String {
    let mut s: Vec<String> = values.iter().take(8).map(|v| v.to_string()).collect();
    if values.len() > 8 {
        s.push("...".into());
    }
    s.join(", ")
}

/// The architecture named by `general.architecture`.
pub(crate) fn architecture(meta: &Meta) -> Result<(&'static Architecture, String), GgufError> {
    let key = "general.architecture";
    let name = meta.string(key)?.ok_or_else(|| meta.missing(key))?;
    let arch = arch::by_gguf_name(name).ok_or_else(|| GgufError::UnknownArchitecture {
        path: meta.path.to_path_buf(),
        name: name.to_string(),
    })?;
    Ok((arch, name.to_string()))
}

/// The metadata and tensor table of one file as an architecture file reads them: key
/// `{a}.<name>` for the architecture `{a}`, errors in the GGUF front end's words.
pub struct GgufParams<'a> {
    pub meta: Meta<'a>,
    /// The whole of each part of the file (for the small tensors RoPE factors are read from).
    pub parts: &'a [&'a [u8]],
    /// `general.architecture`.
    pub prefix: String,
}

/// A metadata problem as an [`ArchError`].
fn arch_err(e: GgufError) -> ArchError {
    match e {
        GgufError::MissingKey { key, .. } => ArchError::Missing { field: key },
        GgufError::BadKey { key, problem, .. } => ArchError::Invalid { field: key, problem },
        GgufError::Unsupported { what, .. } => ArchError::Unsupported { what },
        other => ArchError::Config {
            message: other.to_string(),
        },
    }
}

impl Params for GgufParams<'_> {
    fn format(&self) -> Format {
        Format::Gguf
    }
    fn key(&self, key: Key) -> Option<String> {
        key.gguf.map(|k| format!("{}.{k}", self.prefix))
    }
    fn present(&self, name: &str) -> bool {
        self.meta.get(name).is_some()
    }
    fn uint(&self, name: &str) -> Result<Option<u64>, ArchError> {
        self.meta.uint(name, u64::MAX).map_err(arch_err)
    }
    fn float(&self, name: &str) -> Result<Option<f64>, ArchError> {
        self.meta.float(name).map_err(arch_err)
    }
    fn boolean(&self, name: &str) -> Result<Option<bool>, ArchError> {
        self.meta.bool(name).map_err(arch_err)
    }
    fn string(&self, name: &str) -> Result<Option<String>, ArchError> {
        Ok(self.meta.string(name).map_err(arch_err)?.map(str::to_string))
    }
    fn strings(&self, name: &str) -> Result<Option<Vec<String>>, ArchError> {
        match self.meta.get(name) {
            None => Ok(None),
            Some(Value::Array(a)) => a.to_strings().map(Some).ok_or_else(|| {
                arch_err(
                    self.meta
                        .bad(name, format!("is {}, expected strings", describe_array(a))),
                )
            }),
            Some(v) => Err(arch_err(
                self.meta.bad(name, format!("is {}, expected an array", v.describe())),
            )),
        }
    }
    /// A numeric array, or a bool array as 1 (true) and 0 (false): llama.cpp's per-layer flags
    /// such as `{a}.attention.recurrent_layers`.
    fn floats(&self, name: &str) -> Result<Option<Vec<f64>>, ArchError> {
        match self.meta.get(name) {
            None => Ok(None),
            Some(Value::Array(Array::Bool(flags))) => {
                Ok(Some(flags.iter().map(|&f| if f { 1.0 } else { 0.0 }).collect()))
            }
            Some(Value::Array(a)) => a.to_f64s().map(Some).ok_or_else(|| {
                arch_err(
                    self.meta
                        .bad(name, format!("is {}, expected numbers", describe_array(a))),
                )
            }),
            Some(v) => Err(arch_err(
                self.meta.bad(name, format!("is {}, expected an array", v.describe())),
            )),
        }
    }
    fn object<'s>(&'s self, _name: &str) -> Result<Option<Box<dyn Params + 's>>, ArchError> {
        Ok(None)
    }
    fn tensor_shape(&self, name: &str) -> Option<Vec<usize>> {
        self.meta.header.tensor(name).map(TensorInfo::shape)
    }
    fn tensor_f32s(&self, name: &str) -> Result<Option<Vec<f32>>, ArchError> {
        let Some(t) = self.meta.header.tensor(name) else {
            return Ok(None);
        };
        if t.dtype != DType::F32 {
            return Err(ArchError::Unsupported {
                what: format!("{name} stored as {} (RoPE factor tables are read as f32)", t.dtype),
            });
        }
        let bytes = self.parts.get(t.part).ok_or_else(|| ArchError::Config {
            message: format!("{name} lies in split part {}, which was not given", t.part),
        })?;
        let data = &bytes[t.start as usize..(t.start + t.size) as usize];
        Ok(Some(
            data.chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
        ))
    }
}

/// An architecture file's error, with the file's path, as the GGUF front end reports it.
pub fn from_arch_error(path: &Path, e: ArchError) -> GgufError {
    let path = path.to_path_buf();
    match e {
        ArchError::Missing { field } => GgufError::MissingKey { path, key: field },
        ArchError::Invalid { field, problem } => GgufError::BadKey {
            path,
            key: field,
            problem,
        },
        ArchError::Unsupported { what } => GgufError::Unsupported { path, what },
        ArchError::Config { message } => GgufError::InvalidModel { path, message },
        ArchError::MissingTensor { name } => GgufError::MissingTensor {
            path,
            tensor: name,
            weight: "the model's dimensions".into(),
        },
        ArchError::TensorShape { name, found, expected } => GgufError::ShapeMismatch {
            path,
            tensor: name,
            found,
            expected,
        },
    }
}

/// Builds and validates the spec of the model in `header`; `bytes` is the whole file (read for
/// RoPE factor tensors only). Every tensor the spec needs is checked for presence and shape,
/// and its storage type recorded.
pub fn spec_from_header(header: &GgufHeader, bytes: &[u8], path: &Path) -> Result<ModelSpec, GgufError> {
    spec_from_parts(header, &[bytes], path)
}

/// [`spec_from_header`] for a split model: `parts[i]` is the whole of part `i` (see
/// [`super::split`]).
pub fn spec_from_parts(header: &GgufHeader, parts: &[&[u8]], path: &Path) -> Result<ModelSpec, GgufError> {
    let meta = Meta { header, path };
    let (arch, prefix) = architecture(&meta)?;
    let params = GgufParams { meta, parts, prefix };
    let mut spec = arch::build(arch, &params).map_err(|e| from_arch_error(path, e))?;
    let dtypes = check_tensors(header, &spec, path, false)?;
    for (t, dtype) in spec.weights.iter_mut().zip(dtypes) {
        t.dtype = dtype;
    }
    Ok(spec)
}

/// Checks every tensor of `spec`: present, of the expected shape and, when `check_dtypes`, of
/// the type the spec records. Returns each tensor's type, in the spec's order.
pub fn check_tensors(
    header: &GgufHeader,
    spec: &ModelSpec,
    path: &Path,
    check_dtypes: bool,
) -> Result<Vec<DType>, GgufError> {
    let mut out = Vec::with_capacity(spec.weights.len());
    for req in &spec.weights {
        let t: &TensorInfo = header.tensor(&req.name).ok_or_else(|| GgufError::MissingTensor {
            path: path.to_path_buf(),
            tensor: req.name.clone(),
            weight: format!("the {} model", spec.arch),
        })?;
        let shape = t.shape();
        let expected = req.stored_shape();
        if shape != expected {
            return Err(GgufError::ShapeMismatch {
                path: path.to_path_buf(),
                tensor: req.name.clone(),
                found: shape,
                expected,
            });
        }
        if check_dtypes && t.dtype != req.dtype {
            return Err(GgufError::DTypeMismatch {
                path: path.to_path_buf(),
                tensor: req.name.clone(),
                found: t.dtype.name().into(),
                expected: req.dtype.name().into(),
            });
        }
        out.push(t.dtype);
    }
    Ok(out)
}
