//! A bounds-checked little-endian cursor over a GGUF file's bytes: every length and count is
//! checked against what remains before anything is allocated.

use super::error::GgufError;
use super::parse::{MAX_ARRAY_DEPTH, reserve};
use super::strings::StringArray;
use super::value::{Array, Value, ValueType};
use std::path::Path;

/// A bounds-checked little-endian cursor over the file.
pub(super) struct Reader<'a> {
    pub(super) buf: &'a [u8],
    pub(super) pos: usize,
    pub(super) path: &'a Path,
}

impl<'a> Reader<'a> {
    pub(super) fn remaining(&self) -> u64 {
        (self.buf.len() - self.pos) as u64
    }

    pub(super) fn truncated(&self, what: String, needed: u64) -> GgufError {
        GgufError::Truncated {
            path: self.path.to_path_buf(),
            what,
            offset: self.pos as u64,
            needed,
            file_len: self.buf.len() as u64,
        }
    }

    pub(super) fn malformed(&self, problem: String) -> GgufError {
        GgufError::Malformed {
            path: self.path.to_path_buf(),
            problem,
        }
    }

    pub(super) fn bad_tensor(&self, name: &str, problem: String) -> GgufError {
        GgufError::BadTensor {
            path: self.path.to_path_buf(),
            tensor: name.to_string(),
            problem,
        }
    }

    /// Fails unless `count` items of at least `min_size` bytes each fit in what remains.
    pub(super) fn check_count(&self, count: u64, min_size: u64, what: &str) -> Result<(), GgufError> {
        let needed = count.saturating_mul(min_size);
        if needed > self.remaining() {
            return Err(self.truncated(format!("{count} {what}"), needed));
        }
        Ok(())
    }

    pub(super) fn take(&mut self, n: u64, what: &dyn Fn() -> String) -> Result<&'a [u8], GgufError> {
        if n > self.remaining() {
            return Err(self.truncated(what(), n));
        }
        let start = self.pos;
        self.pos += n as usize;
        Ok(&self.buf[start..self.pos])
    }

    pub(super) fn array<const N: usize>(&mut self, what: &dyn Fn() -> String) -> Result<[u8; N], GgufError> {
        let bytes = self.take(N as u64, what)?;
        let mut out = [0u8; N];
        out.copy_from_slice(bytes);
        Ok(out)
    }

    pub(super) fn u32(&mut self, what: &dyn Fn() -> String) -> Result<u32, GgufError> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    pub(super) fn u64(&mut self, what: &dyn Fn() -> String) -> Result<u64, GgufError> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    pub(super) fn string(&mut self, what: &dyn Fn() -> String) -> Result<String, GgufError> {
        self.str(what).map(str::to_string)
    }

    /// A string, borrowed from the file.
    pub(super) fn str(&mut self, what: &dyn Fn() -> String) -> Result<&'a str, GgufError> {
        let len = self.u64(what)?;
        let bytes = self.take(len, what)?;
        match std::str::from_utf8(bytes) {
            Ok(s) => Ok(s),
            Err(e) => Err(self.malformed(format!("{} is not valid UTF-8 ({e})", what()))),
        }
    }

    /// `n` strings read as bytes and checked as UTF-8 once, all together: a vocabulary is
    /// ~150k short strings, and validating each on its own was most of a cached GGUF's
    /// metadata parse. `None` (position left anywhere) when an element is cut short or not
    /// UTF-8; the caller reads them again one by one to say which.
    pub(super) fn string_array_checked_once(&mut self, n: usize, count: u64) -> Option<StringArray> {
        let what = || String::new();
        let mut bytes = Vec::new();
        let mut ends = Vec::with_capacity(reserve(count));
        for _ in 0..n {
            let len = self.u64(&what).ok()?;
            bytes.extend_from_slice(self.take(len, &what).ok()?);
            ends.push(bytes.len());
        }
        StringArray::from_utf8_parts(bytes, ends)
    }

    /// One value of type `vt` (an element of an array when `depth > 0`).
    pub(super) fn value(&mut self, vt: ValueType, key: &str, depth: usize) -> Result<Value, GgufError> {
        let what = || format!("the value of metadata key \"{key}\"");
        Ok(match vt {
            ValueType::U8 => Value::U8(u8::from_le_bytes(self.array(&what)?)),
            ValueType::I8 => Value::I8(i8::from_le_bytes(self.array(&what)?)),
            ValueType::U16 => Value::U16(u16::from_le_bytes(self.array(&what)?)),
            ValueType::I16 => Value::I16(i16::from_le_bytes(self.array(&what)?)),
            ValueType::U32 => Value::U32(u32::from_le_bytes(self.array(&what)?)),
            ValueType::I32 => Value::I32(i32::from_le_bytes(self.array(&what)?)),
            ValueType::F32 => Value::F32(f32::from_le_bytes(self.array(&what)?)),
            ValueType::U64 => Value::U64(u64::from_le_bytes(self.array(&what)?)),
            ValueType::I64 => Value::I64(i64::from_le_bytes(self.array(&what)?)),
            ValueType::F64 => Value::F64(f64::from_le_bytes(self.array(&what)?)),
            ValueType::Bool => Value::Bool(self.bool(key)?),
            ValueType::String => Value::String(self.string(&what)?),
            ValueType::Array => Value::Array(self.array_value(key, depth + 1)?),
        })
    }

    pub(super) fn bool(&mut self, key: &str) -> Result<bool, GgufError> {
        let [b] = self.array(&|| format!("the value of metadata key \"{key}\""))?;
        match b {
            0 => Ok(false),
            1 => Ok(true),
            b => Err(self.malformed(format!(
                "metadata key \"{key}\" has a bool of value {b} (expected 0 or 1)"
            ))),
        }
    }

    pub(super) fn array_value(&mut self, key: &str, depth: usize) -> Result<Array, GgufError> {
        if depth > MAX_ARRAY_DEPTH {
            return Err(self.malformed(format!(
                "metadata key \"{key}\" nests arrays deeper than {MAX_ARRAY_DEPTH} levels"
            )));
        }
        let what = || format!("the array header of metadata key \"{key}\"");
        let type_id = self.u32(&what)?;
        let Some(et) = ValueType::from_id(type_id) else {
            return Err(self.malformed(format!(
                "metadata key \"{key}\" is an array of unknown value type {type_id}"
            )));
        };
        let count = self.u64(&what)?;
        self.check_count(
            count,
            et.min_size(),
            &format!("{et} elements of metadata key \"{key}\""),
        )?;
        let n = count as usize;
        // `count` elements of `min_size` bytes fit in the file, so each vector below is at most
        // as long as the file (and a fixed-size one is filled from exactly that many bytes).
        macro_rules! fixed {
            ($variant:ident, $t:ty) => {{
                let size = std::mem::size_of::<$t>();
                let bytes = self.take((n * size) as u64, &what)?;
                Array::$variant(
                    bytes
                        .chunks_exact(size)
                        .map(|c| <$t>::from_le_bytes(c.try_into().expect("chunk of the type's size")))
                        .collect(),
                )
            }};
        }
        Ok(match et {
            ValueType::U8 => Array::U8(self.take(count, &what)?.to_vec()),
            ValueType::I8 => fixed!(I8, i8),
            ValueType::U16 => fixed!(U16, u16),
            ValueType::I16 => fixed!(I16, i16),
            ValueType::U32 => fixed!(U32, u32),
            ValueType::I32 => fixed!(I32, i32),
            ValueType::F32 => fixed!(F32, f32),
            ValueType::U64 => fixed!(U64, u64),
            ValueType::I64 => fixed!(I64, i64),
            ValueType::F64 => fixed!(F64, f64),
            ValueType::Bool => {
                let mut v = Vec::with_capacity(reserve(count));
                for _ in 0..n {
                    v.push(self.bool(key)?);
                }
                Array::Bool(v)
            }
            ValueType::String => {
                let start = self.pos;
                if let Some(v) = self.string_array_checked_once(n, count) {
                    return Ok(Array::String(v));
                }
                // Something is wrong with an element: read them one by one again, for the
                // error that names it.
                self.pos = start;
                let mut v = StringArray::with_capacity(reserve(count), 0);
                for i in 0..n {
                    v.push(self.str(&|| format!("element {i} of metadata key \"{key}\""))?);
                }
                Array::String(v)
            }
            ValueType::Array => {
                let mut v = Vec::with_capacity(reserve(count));
                for _ in 0..n {
                    v.push(self.array_value(key, depth + 1)?);
                }
                Array::Array(v)
            }
        })
    }
}
