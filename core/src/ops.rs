//! The attributes operations share between the model graph ([`crate::graph`]) and the kernels
//! that compute them ([`crate::Kernel`]): how a row is normalised, which activation is applied,
//! how rotary embeddings pair and scale their dimensions. Each is plain data, compared and
//! hashed by value, so two layers with equal attributes share one compiled kernel.

use crate::dtype::DType;
use serde::{Deserialize, Serialize};

/// An f32 stored by its bits, so kernels holding constants can be compared and hashed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct F32Bits(pub u32);

impl F32Bits {
    pub fn new(v: f32) -> Self {
        F32Bits(v.to_bits())
    }
    pub fn get(self) -> f32 {
        f32::from_bits(self.0)
    }
}

/// How a row is normalised. Each follows its reference implementation's order of operations.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum NormKind {
    /// RMSNorm: `y = w * (x / sqrt(mean(x^2) + eps))` (Llama, Mistral, Qwen, Phi-3).
    Rms,
    /// Gemma's RMSNorm: `y = (x / sqrt(mean(x^2) + eps)) * (1 + w)`, `1 + w` formed in f32.
    RmsPlusOne,
    /// LayerNorm: `y = (x - mean) / sqrt(var + eps) * w + b` (GPT-2, Phi-2); the bias is the
    /// norm's second weight when [`NormShape::bias`] is set.
    Layer,
}

impl NormKind {
    pub fn name(self) -> &'static str {
        match self {
            NormKind::Rms => "rms",
            NormKind::RmsPlusOne => "rms1p",
            NormKind::Layer => "ln",
        }
    }
}

/// One normalisation as a kernel computes it: the kind, its epsilon and the storage types of
/// its weight (and bias). The same value describes a norm step and a norm folded into the
/// matmul that consumes it (decode), which run the same instructions.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct NormShape {
    pub kind: NormKind,
    pub eps: F32Bits,
    pub wdtype: DType,
    /// Storage type of the bias (LayerNorm with bias).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bias: Option<DType>,
}

/// An elementwise activation, each as `transformers` computes it in f32.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Act {
    /// `x / (1 + exp(-x))` (`silu`, `swish`).
    Silu,
    /// `0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))` (`gelu_new`, `gelu_pytorch_tanh`).
    GeluTanh,
    /// `0.5 x (1 + erf(x / sqrt(2)))` (`gelu`).
    GeluErf,
    /// `1 / (1 + exp(-x))`: Qwen3.5's output gate on the attention (`attn * sigmoid(gate)`).
    Sigmoid,
}

impl Act {
    /// The activation a Hugging Face `hidden_act` / `activation_function` name denotes.
    pub fn from_hf(name: &str) -> Option<Act> {
        Some(match name {
            "silu" | "swish" => Act::Silu,
            "gelu_new" | "gelu_pytorch_tanh" | "gelu_fast" => Act::GeluTanh,
            "gelu" => Act::GeluErf,
            _ => return None,
        })
    }

    /// Names [`Act::from_hf`] accepts, for error messages.
    pub const HF_NAMES: &'static str = "silu, swish, gelu, gelu_new, gelu_pytorch_tanh, gelu_fast";

    pub fn name(self) -> &'static str {
        match self {
            Act::Silu => "silu",
            Act::GeluTanh => "gelu_tanh",
            Act::GeluErf => "gelu_erf",
            Act::Sigmoid => "sigmoid",
        }
    }
}

/// Where a Gated DeltaNet layer's gate parameter `A` comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DecayForm {
    /// `A_log` (Hugging Face): the decay rate is `-exp(A_log)`.
    Log,
    /// `-exp(A_log)` itself (llama.cpp's `ssm_a`).
    Negated,
}

/// Which key head serves value head `h` when there are more value heads than key heads.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum HeadOrder {
    /// `h / (v_heads / k_heads)`: consecutive value heads share a key head (Hugging Face).
    Grouped,
    /// `h % k_heads` (llama.cpp's `qwen35` files reorder the value heads this way).
    Tiled,
}

/// Which dimensions of a head a rotary embedding rotates together.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Pairing {
    /// NeoX / Hugging Face `rotate_half`: dimension `i` with `i + dims/2`.
    Half,
    /// GPT-J: dimension `2i` with `2i + 1`.
    Adjacent,
}

/// A rotary position embedding as a kernel applies it: the first `dims` dimensions of every
/// query and key head are rotated by the angles `pos * inv_freq[i]`.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Rotary {
    /// Rotated dimensions per head (even, at most the head size; the rest pass through).
    pub dims: usize,
    pub pairing: Pairing,
    /// `dims / 2` inverse frequencies, f32 bits.
    pub inv_freq: Vec<u32>,
    /// LongRoPE: a second set of inverse frequencies used once the sequence is longer than
    /// `original` positions (as `transformers` switches per forward call; see
    /// [`crate::graph::RowInfo::seq_end`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub long: Option<LongFreqs>,
    /// Factor applied to cos and sin (LongRoPE's and YaRN's attention scaling); `None` = 1.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mscale: Option<F32Bits>,
}

/// The long-context inverse frequencies of a LongRoPE rotary embedding.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct LongFreqs {
    pub inv_freq: Vec<u32>,
    /// The pretraining context: sequences of at most this many positions use the short
    /// frequencies.
    pub original: usize,
}

impl Rotary {
    /// A rotary embedding from f32 inverse frequencies.
    pub fn new(dims: usize, pairing: Pairing, inv_freq: &[f32]) -> Rotary {
        Rotary {
            dims,
            pairing,
            inv_freq: inv_freq.iter().map(|f| f.to_bits()).collect(),
            long: None,
            mscale: None,
        }
    }
}
