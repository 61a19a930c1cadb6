//! `ModelSpec`: everything about a model that the generated code depends on.
//!
//! The spec is built by the runtime's front end (from `config.json` and the safetensors headers)
//! and consumed by the compiler. It is serialised into the cache key, so it holds exactly what
//! changes the emitted code — dimensions, constants and storage types — and nothing that does not
//! (tokenizer, EOS ids, file names, weight values).

use crate::dtype::DType;
use serde::{Deserialize, Serialize};

/// Model families whose graph Kiln knows. They share the Llama block structure and differ in
/// biases, norms and RoPE details, all of which are explicit fields of [`ModelSpec`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Arch {
    Llama,
    Mistral,
    Qwen2,
    Qwen3,
}

impl Arch {
    /// Maps a Hugging Face `architectures[0]` entry to a family.
    pub fn from_hf_architecture(name: &str) -> Option<Arch> {
        match name {
            "LlamaForCausalLM" => Some(Arch::Llama),
            "MistralForCausalLM" => Some(Arch::Mistral),
            "Qwen2ForCausalLM" => Some(Arch::Qwen2),
            "Qwen3ForCausalLM" => Some(Arch::Qwen3),
            _ => None,
        }
    }

    /// All Hugging Face architecture names accepted, for error messages.
    pub const HF_NAMES: &'static [&'static str] = &[
        "LlamaForCausalLM",
        "MistralForCausalLM",
        "Qwen2ForCausalLM",
        "Qwen3ForCausalLM",
    ];

    pub fn name(self) -> &'static str {
        match self {
            Arch::Llama => "llama",
            Arch::Mistral => "mistral",
            Arch::Qwen2 => "qwen2",
            Arch::Qwen3 => "qwen3",
        }
    }
}

/// How rotary frequencies are derived from `theta` (Hugging Face's `rope_type`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "lowercase")]
pub enum RopeScaling {
    /// `rope_type = "default"`.
    None,
    /// `rope_type = "linear"`: every frequency divided by `factor`.
    Linear { factor: f64 },
    /// `rope_type = "llama3"` (Llama 3.1 and later): low frequencies divided by `factor`,
    /// high ones kept, the band between smoothly interpolated.
    Llama3 {
        factor: f64,
        low_freq_factor: f64,
        high_freq_factor: f64,
        original_max_position_embeddings: f64,
    },
}

/// Rotary position embedding, rotate-half convention (pairs `i` and `i + d/2`), as Hugging Face
/// applies it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Rope {
    pub theta: f64,
    pub scaling: RopeScaling,
}

impl Rope {
    /// The `head_dim / 2` inverse frequencies, computed step by step in f32 exactly as
    /// `transformers` does, so the angles the kernel forms (`pos * inv_freq`, in f32) match the
    /// reference bit for bit wherever `powf` agrees.
    pub fn inv_freq(&self, head_dim: usize) -> Vec<f32> {
        let dim = head_dim as f32;
        let base = self.theta as f32;
        let mut inv: Vec<f32> = (0..head_dim / 2)
            .map(|i| 1.0f32 / base.powf((2 * i) as f32 / dim))
            .collect();
        match &self.scaling {
            RopeScaling::None => {}
            RopeScaling::Linear { factor } => {
                let f = *factor as f32;
                inv.iter_mut().for_each(|v| *v /= f);
            }
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings,
            } => {
                let factor = *factor as f32;
                let (lo, hi) = (*low_freq_factor as f32, *high_freq_factor as f32);
                let old = *original_max_position_embeddings as f32;
                let low_wavelen = old / lo;
                let high_wavelen = old / hi;
                for v in inv.iter_mut() {
                    let wavelen = 2.0 * std::f32::consts::PI / *v;
                    let scaled = if wavelen > low_wavelen { *v / factor } else { *v };
                    // HF: `~(wavelen < high) * ~(wavelen > low)`; wavelengths are finite and positive.
                    let medium = wavelen >= high_wavelen && wavelen <= low_wavelen;
                    *v = if medium {
                        let smooth = (old / wavelen - lo) / (hi - lo);
                        (1.0 - smooth) * scaled / factor + smooth * scaled
                    } else {
                        scaled
                    };
                }
            }
        }
        inv
    }
}

/// Storage types of one decoder layer's tensors. Optional entries are absent in architectures
/// without that tensor.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct LayerDTypes {
    pub attn_norm: DType,
    pub q: DType,
    pub k: DType,
    pub v: DType,
    pub o: DType,
    pub q_bias: Option<DType>,
    pub k_bias: Option<DType>,
    pub v_bias: Option<DType>,
    pub o_bias: Option<DType>,
    pub q_norm: Option<DType>,
    pub k_norm: Option<DType>,
    pub mlp_norm: DType,
    pub gate: DType,
    pub up: DType,
    pub down: DType,
}

impl LayerDTypes {
    /// The same type for every tensor present in this layer shape; used before the real
    /// types are read from the weight files.
    pub fn uniform(dtype: DType, attention_bias: bool, o_bias: bool, qk_norm: bool) -> Self {
        let opt = |b: bool| b.then_some(dtype);
        LayerDTypes {
            attn_norm: dtype,
            q: dtype,
            k: dtype,
            v: dtype,
            o: dtype,
            q_bias: opt(attention_bias),
            k_bias: opt(attention_bias),
            v_bias: opt(attention_bias),
            o_bias: opt(o_bias),
            q_norm: opt(qk_norm),
            k_norm: opt(qk_norm),
            mlp_norm: dtype,
            gate: dtype,
            up: dtype,
            down: dtype,
        }
    }
}

impl LayerDTypes {
    /// The storage type of one layer tensor, if the layer has it.
    pub fn get(&self, w: crate::weights::LayerWeight) -> Option<DType> {
        use crate::weights::LayerWeight as L;
        match w {
            L::AttnNorm => Some(self.attn_norm),
            L::Q => Some(self.q),
            L::K => Some(self.k),
            L::V => Some(self.v),
            L::O => Some(self.o),
            L::QBias => self.q_bias,
            L::KBias => self.k_bias,
            L::VBias => self.v_bias,
            L::OBias => self.o_bias,
            L::QNorm => self.q_norm,
            L::KNorm => self.k_norm,
            L::MlpNorm => Some(self.mlp_norm),
            L::Gate => Some(self.gate),
            L::Up => Some(self.up),
            L::Down => Some(self.down),
        }
    }

    /// Changes the storage type of one layer tensor (no effect if the layer lacks it).
    pub fn set(&mut self, w: crate::weights::LayerWeight, dtype: DType) {
        use crate::weights::LayerWeight as L;
        let slot = match w {
            L::AttnNorm => &mut self.attn_norm,
            L::Q => &mut self.q,
            L::K => &mut self.k,
            L::V => &mut self.v,
            L::O => &mut self.o,
            L::MlpNorm => &mut self.mlp_norm,
            L::Gate => &mut self.gate,
            L::Up => &mut self.up,
            L::Down => &mut self.down,
            L::QBias | L::KBias | L::VBias | L::OBias | L::QNorm | L::KNorm => {
                let opt = match w {
                    L::QBias => &mut self.q_bias,
                    L::KBias => &mut self.k_bias,
                    L::VBias => &mut self.v_bias,
                    L::OBias => &mut self.o_bias,
                    L::QNorm => &mut self.q_norm,
                    _ => &mut self.k_norm,
                };
                if let Some(d) = opt.as_mut() {
                    *d = dtype;
                }
                return;
            }
        };
        *slot = dtype;
    }
}

/// One decoder layer.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct LayerSpec {
    /// Sliding-window attention span in tokens (Mistral, some Qwen2 layers); `None` = full.
    pub sliding_window: Option<usize>,
    pub dtypes: LayerDTypes,
}

/// A whole decoder-only model of the Llama lineage.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ModelSpec {
    pub arch: Arch,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub vocab_size: usize,
    pub max_position_embeddings: usize,
    /// Kept as f32 because the reference adds it to an f32 variance.
    pub rms_norm_eps: f32,
    pub rope: Rope,
    pub tie_word_embeddings: bool,
    /// q/k/v projections carry biases (Qwen2; Llama with `attention_bias`).
    pub attention_bias: bool,
    /// The output projection carries a bias (Llama with `attention_bias`).
    pub o_bias: bool,
    /// Per-head RMSNorm of q and k before RoPE (Qwen3).
    pub qk_norm: bool,
    pub embed_dtype: DType,
    pub final_norm_dtype: DType,
    /// Storage type of the output head; equal to `embed_dtype` when embeddings are tied.
    pub lm_head_dtype: DType,
    pub layers: Vec<LayerSpec>,
}

impl ModelSpec {
    pub fn num_layers(&self) -> usize {
        self.layers.len()
    }
    /// Width of all query heads together.
    pub fn q_dim(&self) -> usize {
        self.num_heads * self.head_dim
    }
    /// Width of all key (or value) heads together: one row of the KV cache.
    pub fn kv_dim(&self) -> usize {
        self.num_kv_heads * self.head_dim
    }

    /// Checks the relations the kernels rely on, so a malformed config fails here with a
    /// message instead of producing wrong code.
    pub fn validate(&self) -> Result<(), String> {
        let pos = |v: usize, what: &str| {
            if v == 0 {
                Err(format!("{what} must be greater than 0"))
            } else {
                Ok(())
            }
        };
        pos(self.hidden_size, "hidden_size")?;
        pos(self.intermediate_size, "intermediate_size")?;
        pos(self.num_heads, "num_attention_heads")?;
        pos(self.num_kv_heads, "num_key_value_heads")?;
        pos(self.head_dim, "head_dim")?;
        pos(self.vocab_size, "vocab_size")?;
        pos(self.max_position_embeddings, "max_position_embeddings")?;
        pos(self.layers.len(), "num_hidden_layers")?;
        if !self.num_heads.is_multiple_of(self.num_kv_heads) {
            return Err(format!(
                "num_attention_heads ({}) must be a multiple of num_key_value_heads ({})",
                self.num_heads, self.num_kv_heads
            ));
        }
        if !self.head_dim.is_multiple_of(2) {
            return Err(format!("head_dim ({}) must be even for RoPE", self.head_dim));
        }
        if !(self.rope.theta.is_finite() && self.rope.theta > 0.0) {
            return Err(format!("rope_theta ({}) must be a positive number", self.rope.theta));
        }
        if !(self.rms_norm_eps.is_finite() && self.rms_norm_eps >= 0.0) {
            return Err(format!(
                "rms_norm_eps ({}) must be a non-negative number",
                self.rms_norm_eps
            ));
        }
        Ok(())
    }

    /// The storage type of a weight tensor of this model.
    pub fn dtype_of(&self, id: crate::weights::WeightId) -> Option<DType> {
        use crate::weights::WeightId as W;
        match id {
            W::Embed => Some(self.embed_dtype),
            W::FinalNorm => Some(self.final_norm_dtype),
            W::LmHead => (!self.tie_word_embeddings).then_some(self.lm_head_dtype),
            W::Layer(i, w) => self.layers.get(i)?.dtypes.get(w),
        }
    }

    /// Changes the storage type of a weight tensor (used when weights are converted at load).
    pub fn set_dtype(&mut self, id: crate::weights::WeightId, dtype: DType) {
        use crate::weights::WeightId as W;
        match id {
            W::Embed => {
                self.embed_dtype = dtype;
                if self.tie_word_embeddings {
                    self.lm_head_dtype = dtype;
                }
            }
            W::FinalNorm => self.final_norm_dtype = dtype,
            W::LmHead => self.lm_head_dtype = dtype,
            W::Layer(i, w) => {
                if let Some(l) = self.layers.get_mut(i) {
                    l.dtypes.set(w, dtype);
                }
            }
        }
    }

    /// Number of parameters (elements of all weight tensors, the tied head counted once).
    pub fn param_count(&self) -> u64 {
        crate::weights::weight_list(self).iter().map(|w| w.elems() as u64).sum()
    }

    /// Bytes of weights read to decode one token: every layer tensor, the final norm and the
    /// output head once, plus one embedding row.
    pub fn weight_bytes_per_token(&self) -> u64 {
        use crate::weights::WeightId;
        crate::weights::weight_list(self)
            .iter()
            .map(|w| match w.id {
                WeightId::Embed if !self.tie_word_embeddings => w.dtype.bytes_for(self.hidden_size) as u64,
                _ => w.bytes() as u64,
            })
            .sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_inv_freq_matches_closed_form() {
        let rope = Rope {
            theta: 10000.0,
            scaling: RopeScaling::None,
        };
        let inv = rope.inv_freq(64);
        assert_eq!(inv.len(), 32);
        assert_eq!(inv[0], 1.0);
        let expect = 1.0 / 10000f64.powf(62.0 / 64.0);
        assert!(((inv[31] as f64) - expect).abs() / expect < 1e-6);
    }

    #[test]
    fn llama3_scaling_keeps_high_and_divides_low_frequencies() {
        let base = Rope {
            theta: 500000.0,
            scaling: RopeScaling::None,
        }
        .inv_freq(128);
        let scaled = Rope {
            theta: 500000.0,
            scaling: RopeScaling::Llama3 {
                factor: 8.0,
                low_freq_factor: 1.0,
                high_freq_factor: 4.0,
                original_max_position_embeddings: 8192.0,
            },
        }
        .inv_freq(128);
        assert_eq!(scaled[0], base[0]);
        assert!((scaled[63] - base[63] / 8.0).abs() <= f32::EPSILON * base[63]);
    }
}
