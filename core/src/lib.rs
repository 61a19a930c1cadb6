//! Shared vocabulary of Kiln's compiler and runtime: what a model is ([`ModelSpec`]: tensors,
//! buffers and the forward pass as operations), how each architecture builds one ([`arch`]),
//! which kernels a library for it exports ([`Kernel`]), in what order they run ([`graph`]), how
//! they are called ([`abi`]), what the host offers ([`target`]) and how the files a user names
//! are opened ([`files`]). It has no dependency on
//! MLIR, so the runtime can use it without the compiler.

pub mod abi;
pub mod arch;
pub mod budget;
pub mod dequant;
pub mod dtype;
pub mod files;
pub mod graph;
pub mod grouped;
pub mod kernel;
pub mod ops;
pub mod pages;
pub mod rope;
pub mod spec;
pub mod target;

pub use dtype::DType;
pub use kernel::Kernel;
pub use ops::{Act, DecayForm, F32Bits, HeadOrder, NormKind, NormShape, Pairing, Rotary};
pub use rope::{Rope, RopeScaling};
pub use spec::{BufId, Dims, ModelSpec, Tensor, WeightId, WeightRef};
pub use target::HostCpu;

use serde::{Deserialize, Serialize};

/// Choices made at compile time that are not part of the model: they change the generated
/// code, so they enter the cache key alongside the spec.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CompileOptions {
    /// Rows per prefill block: the static row capacity of the prefill kernels.
    pub prefill_rows: usize,
    /// f32 lanes of the vectors the kernels are written with (from [`HostCpu::f32_lanes`]).
    pub f32_lanes: usize,
    /// Generate code for this x86-64 level ([`target::X86_LEVELS`]) instead of the host CPU.
    /// Absent from the serialised options (and so from the cache key) when not set.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target_cpu: Option<String>,
    /// Also compile the output head in chunks of this many rows ([`graph::chunked_head_graph`]),
    /// for a `--ram-budget` that streams the head. Absent (and out of the cache key) otherwise.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub head_chunk_rows: Option<usize>,
    /// How matmuls over bf16 or quantised weights multiply (`--precision`). Absent (and out
    /// of the cache key) for the default, exact f32.
    #[serde(default, skip_serializing_if = "Precision::is_exact")]
    pub precision: Precision,
}

/// The arithmetic of matmuls: exact, or a faster mode for one kind of weights (the others
/// keep exact arithmetic).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Precision {
    /// Every product an f32 FMA of the weight's value and the f32 activation: the reference's
    /// float32 arithmetic (the default).
    #[default]
    Exact,
    /// Activations rounded to bf16 (to nearest even) at each matmul input, products of bf16
    /// pairs summed into f32 by `vdpbf16ps` (AVX512-BF16): twice the products per instruction.
    Bf16,
    /// Matmuls over GGML block weights (q4_0, q4_1, q5_0, q5_1, q8_0, q4_k, q5_k, q6_k):
    /// activations rounded to 8-bit integers per group of 32 with an f32 scale, llama.cpp's
    /// numerics, and each group's products summed exactly in integers (`vpmaddubsw`): far less
    /// work per weight than dequantising to f32.
    Q8,
}

impl Precision {
    pub fn is_exact(&self) -> bool {
        *self == Precision::Exact
    }

    /// Parses a `--precision` value: `exact` (or `f32`), `bf16` or `q8`.
    pub fn parse(text: &str) -> Result<Precision, String> {
        match text.to_ascii_lowercase().as_str() {
            "exact" | "f32" => Ok(Precision::Exact),
            "bf16" => Ok(Precision::Bf16),
            "q8" | "int8" => Ok(Precision::Q8),
            _ => Err(format!("--precision {text:?}: expected exact, bf16 or q8")),
        }
    }
}

impl CompileOptions {
    /// Default prefill block size: large enough that each weight panel is packed, and each
    /// weight read from memory, once for many rows (a 148-token prompt is one block, not
    /// 64 + 64 + 20 with a thin last one), small enough that a block's activations stay in the
    /// last-level cache. Measured on a 2-core Zen 5 EPYC, 2 threads, the Qwen2.5-0.5B shape
    /// (tok/s, 64 -> 256 rows): 148-token prompt exact 526 -> 626, `--precision bf16`
    /// 937 -> 1148; 1024-token prompt exact 501 -> 555, bf16 846 -> 952 (512 rows: 544, 899,
    /// the activations outgrow the L3); TinyLlama-1.1B exact 209 -> 228, bf16 363 -> 441;
    /// its Q4_K_M with `--precision q8` unchanged (242 -> 247).
    pub const DEFAULT_PREFILL_ROWS: usize = 256;

    pub fn for_host(cpu: &HostCpu) -> CompileOptions {
        CompileOptions::new(Self::DEFAULT_PREFILL_ROWS, cpu.f32_lanes())
    }

    /// Prefill blocks of `prefill_rows` rows, vectors of `f32_lanes`, everything else at its
    /// default (the host CPU, no head chunks, exact arithmetic).
    pub fn new(prefill_rows: usize, f32_lanes: usize) -> CompileOptions {
        CompileOptions {
            prefill_rows,
            f32_lanes,
            target_cpu: None,
            head_chunk_rows: None,
            precision: Precision::Exact,
        }
    }
}
