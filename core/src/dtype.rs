//! Element types of weights as they are stored on disk.

use serde::{Deserialize, Serialize};
use std::fmt;

/// The storage type of one weight tensor. Activations, accumulators and the KV cache are always
/// f32; only weights keep the type they were stored in, so the kernels read them in place.
///
/// The quantised types are GGML's block formats: each stores a fixed number of consecutive
/// elements of one row (a *block*) in a fixed number of bytes, with its own scale(s).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DType {
    F32,
    F16,
    BF16,
    Q8_0,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q2K,
    Q3K,
    Q4K,
    Q5K,
    Q6K,
}

impl DType {
    /// Elements per block (1 for plain float types).
    pub fn block_elems(self) -> usize {
        match self {
            DType::F32 | DType::F16 | DType::BF16 => 1,
            DType::Q8_0 | DType::Q4_0 | DType::Q4_1 | DType::Q5_0 | DType::Q5_1 => 32,
            DType::Q2K | DType::Q3K | DType::Q4K | DType::Q5K | DType::Q6K => 256,
        }
    }

    /// Bytes per block (per element for plain float types), as laid out by GGML.
    pub fn block_bytes(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::F16 | DType::BF16 => 2,
            DType::Q8_0 => 34, // f16 scale + 32 x i8
            DType::Q4_0 => 18, // f16 scale + 16 bytes of nibbles
            DType::Q4_1 => 20, // f16 scale + f16 min + 16 bytes of nibbles
            DType::Q5_0 => 22, // f16 scale + 4 bytes of high bits + 16 bytes of nibbles
            DType::Q5_1 => 24, // f16 scale + f16 min + 4 + 16
            DType::Q2K => 84,  // 16 scales/mins + 64 quants + f16 d + f16 dmin
            DType::Q3K => 110, // 32 hmask + 64 quants + 12 scales + f16 d
            DType::Q4K => 144, // f16 d + f16 dmin + 12 scales + 128 quants
            DType::Q5K => 176, // f16 d + f16 dmin + 12 scales + 32 high bits + 128 quants
            DType::Q6K => 210, // 128 low bits + 64 high bits + 16 scales + f16 d
        }
    }

    /// Whether this is a quantised block format.
    pub fn is_quantized(self) -> bool {
        self.block_elems() > 1
    }

    /// Bytes per element of a plain float type.
    ///
    /// # Panics
    /// For quantised types, which have no per-element size; use [`DType::bytes_for`].
    pub fn size(self) -> usize {
        assert!(!self.is_quantized(), "{self} has no per-element size");
        self.block_bytes()
    }

    /// The name used in kernel symbols and, for float types, as the MLIR element type.
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
            DType::Q8_0 => "q8_0",
            DType::Q4_0 => "q4_0",
            DType::Q4_1 => "q4_1",
            DType::Q5_0 => "q5_0",
            DType::Q5_1 => "q5_1",
            DType::Q2K => "q2_k",
            DType::Q3K => "q3_k",
            DType::Q4K => "q4_k",
            DType::Q5K => "q5_k",
            DType::Q6K => "q6_k",
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

    /// Maps a GGML type id (`ggml_type` in the GGUF tensor table) to a storage type.
    pub fn from_ggml(id: u32) -> Option<DType> {
        Some(match id {
            0 => DType::F32,
            1 => DType::F16,
            2 => DType::Q4_0,
            3 => DType::Q4_1,
            6 => DType::Q5_0,
            7 => DType::Q5_1,
            8 => DType::Q8_0,
            10 => DType::Q2K,
            11 => DType::Q3K,
            12 => DType::Q4K,
            13 => DType::Q5K,
            14 => DType::Q6K,
            30 => DType::BF16,
            _ => return None,
        })
    }

    /// Bytes taken by `elems` consecutive elements (a whole number of blocks for quantised
    /// types; callers check divisibility first, see [`DType::fits`]).
    pub fn bytes_for(self, elems: usize) -> usize {
        elems / self.block_elems() * self.block_bytes()
    }

    /// Whether a row of `elems` elements is a whole number of blocks.
    pub fn fits(self, elems: usize) -> bool {
        elems.is_multiple_of(self.block_elems())
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn block_sizes_match_ggml() {
        // Bits per weight as GGML documents them.
        let bpw = |d: DType| d.block_bytes() as f64 * 8.0 / d.block_elems() as f64;
        assert_eq!(bpw(DType::Q8_0), 8.5);
        assert_eq!(bpw(DType::Q4_0), 4.5);
        assert_eq!(bpw(DType::Q4K), 4.5);
        assert_eq!(bpw(DType::Q6K), 6.5625);
        assert_eq!(bpw(DType::Q2K), 2.625);
        assert_eq!(DType::Q4K.bytes_for(512), 288);
        assert_eq!(DType::BF16.bytes_for(3), 6);
    }
}
