//! A test double of the GGUF front end's metadata answers, shared by the architectures' tests.

use super::{ArchError, Format, Key, Params};
use serde_json::Value;

/// GGUF metadata of architecture `arch` (full key names, `{arch}.` prefix included) and tensor
/// shapes, answering as the GGUF front end does (bool arrays as numbers 1 and 0).
pub(super) struct Gguf {
    pub arch: &'static str,
    pub meta: serde_json::Map<String, Value>,
    pub tensors: Vec<(&'static str, Vec<usize>)>,
}

impl Params for Gguf {
    fn format(&self) -> Format {
        Format::Gguf
    }
    fn key(&self, key: Key) -> Option<String> {
        key.gguf.map(|k| format!("{}.{k}", self.arch))
    }
    fn present(&self, name: &str) -> bool {
        self.meta.contains_key(name)
    }
    fn uint(&self, name: &str) -> Result<Option<u64>, ArchError> {
        Ok(self.meta.get(name).and_then(Value::as_u64))
    }
    fn float(&self, name: &str) -> Result<Option<f64>, ArchError> {
        Ok(self.meta.get(name).and_then(Value::as_f64))
    }
    fn boolean(&self, name: &str) -> Result<Option<bool>, ArchError> {
        Ok(self.meta.get(name).and_then(Value::as_bool))
    }
    fn string(&self, name: &str) -> Result<Option<String>, ArchError> {
        Ok(self.meta.get(name).and_then(Value::as_str).map(str::to_string))
    }
    fn strings(&self, _name: &str) -> Result<Option<Vec<String>>, ArchError> {
        Ok(None)
    }
    fn floats(&self, name: &str) -> Result<Option<Vec<f64>>, ArchError> {
        Ok(self.meta.get(name).and_then(Value::as_array).map(|a| {
            a.iter()
                .map(|v| match v {
                    Value::Bool(b) => f64::from(u8::from(*b)),
                    other => other.as_f64().unwrap(),
                })
                .collect()
        }))
    }
    fn object<'s>(&'s self, _name: &str) -> Result<Option<Box<dyn Params + 's>>, ArchError> {
        Ok(None)
    }
    fn tensor_shape(&self, name: &str) -> Option<Vec<usize>> {
        self.tensors.iter().find(|(n, _)| *n == name).map(|(_, s)| s.clone())
    }
    fn tensor_f32s(&self, _name: &str) -> Result<Option<Vec<f32>>, ArchError> {
        Ok(None)
    }
}
