//! Element types of weights as they are stored on disk.

use serde::{Deserialize, Serialize};
use std::fmt;

/// The storage type of one weight tensor. Activations, accumulators and the KV cache are always
/// f32; only weights keep the type they were stored in, so the kernels read them in place.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DType {
    F32,
    F16,
    BF16,
}

impl DType {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::F16 | DType::BF16 => 2,
        }
    }

    /// The name used in kernel symbols and MLIR element types.
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
        }
    }

    /// Parses the safetensors spelling (`F32`, `F16`, `BF16`).
    pub fn from_safetensors(name: &str) -> Option<DType> {
        match name {
            "F32" => Some(DType::F32),
            "F16" => Some(DType::F16),
            "BF16" => Some(DType::BF16),
            _ => None,
        }
    }

    /// Bytes taken by a tensor of this type with `elems` elements.
    pub fn bytes_for(self, elems: usize) -> usize {
        self.size() * elems
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}
