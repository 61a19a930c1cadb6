//! Architectures: one file each, and one table.
//!
//! An architecture file reads a model's hyperparameters (from `config.json` or GGUF metadata,
//! through [`Params`]) and builds its [`ModelSpec`]: the tensors with their names in that
//! format, the buffers, and the forward pass as operations. [`ARCHITECTURES`] maps the names
//! both formats use to those files, so the safetensors and GGUF front ends build every spec
//! the same way, in one place. Adding an architecture is adding a file and a row here.

mod builder;
mod common;
mod gemma;
mod gpt2;
mod llama;
pub mod params;
mod phi;
mod phi3;
mod qwen35;
pub mod rope_cfg;

#[cfg(test)]
pub(crate) mod tests;
#[cfg(test)]
mod tests_gemma;
#[cfg(test)]
mod tests_gguf;
#[cfg(test)]
mod tests_gpt2_phi;
#[cfg(test)]
mod tests_phi3;
#[cfg(test)]
mod tests_qwen35;

pub use builder::{Attend, Builder};
pub use params::{ArchError, Cfg, Format, HfConfig, Key, Params};

use crate::spec::ModelSpec;

/// Class defaults of a Hugging Face config, used when a field is absent.
#[derive(Clone, Copy, Debug)]
pub struct Defaults {
    /// `max_position_embeddings`.
    pub max_positions: usize,
    /// `num_key_value_heads` when absent (`None`: `num_attention_heads`).
    pub kv_heads: Option<usize>,
    /// `head_dim` when absent (`None`: `hidden_size / num_attention_heads`).
    pub head_dim: Option<usize>,
    /// `rope_theta` (and llama.cpp's default for GGUF).
    pub rope_theta: f64,
    /// `tie_word_embeddings`.
    pub tie: bool,
}

/// One row of the table.
pub struct Architecture {
    /// Kiln's name, [`ModelSpec::arch`].
    pub name: &'static str,
    /// Hugging Face `architectures` entries.
    pub hf: &'static [&'static str],
    /// Hugging Face `model_type` values, for configs without `architectures`.
    pub model_types: &'static [&'static str],
    /// GGUF `general.architecture` values.
    pub gguf: &'static [&'static str],
    pub defaults: Defaults,
    /// Builds the spec (storage types still placeholders) from the hyperparameters.
    pub build: fn(&dyn Params, &Architecture) -> Result<ModelSpec, ArchError>,
}

impl PartialEq for Architecture {
    fn eq(&self, other: &Self) -> bool {
        self.name == other.name
    }
}

impl std::fmt::Debug for Architecture {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name)
    }
}

const fn defaults(max_positions: usize, kv_heads: Option<usize>, head_dim: Option<usize>, tie: bool) -> Defaults {
    Defaults {
        max_positions,
        kv_heads,
        head_dim,
        rope_theta: 10000.0,
        tie,
    }
}

/// Every architecture Kiln builds.
pub static ARCHITECTURES: &[Architecture] = &[
    Architecture {
        name: "llama",
        hf: &["LlamaForCausalLM"],
        model_types: &["llama"],
        gguf: &["llama"],
        defaults: defaults(2048, None, None, false),
        build: llama::build,
    },
    Architecture {
        name: "mistral",
        hf: &["MistralForCausalLM"],
        model_types: &["mistral"],
        gguf: &[],
        defaults: defaults(131072, Some(8), None, false),
        build: llama::build,
    },
    Architecture {
        name: "qwen2",
        hf: &["Qwen2ForCausalLM"],
        model_types: &["qwen2"],
        gguf: &["qwen2"],
        defaults: defaults(32768, Some(32), None, false),
        build: llama::build,
    },
    Architecture {
        name: "qwen3",
        hf: &["Qwen3ForCausalLM"],
        model_types: &["qwen3"],
        gguf: &["qwen3"],
        defaults: defaults(32768, Some(32), Some(128), false),
        build: llama::build,
    },
    Architecture {
        name: "phi3",
        hf: &["Phi3ForCausalLM"],
        model_types: &["phi3"],
        gguf: &["phi3"],
        defaults: defaults(4096, None, None, false),
        build: phi3::build,
    },
    Architecture {
        name: "gpt2",
        hf: &["GPT2LMHeadModel"],
        model_types: &["gpt2"],
        gguf: &["gpt2"],
        defaults: defaults(1024, None, None, true),
        build: gpt2::build,
    },
    Architecture {
        name: "phi",
        hf: &["PhiForCausalLM"],
        model_types: &["phi"],
        gguf: &["phi2"],
        defaults: defaults(2048, None, None, false),
        build: phi::build,
    },
    Architecture {
        name: "gemma2",
        hf: &["Gemma2ForCausalLM"],
        model_types: &["gemma2"],
        gguf: &["gemma2"],
        defaults: defaults(8192, Some(4), Some(256), true),
        build: gemma::build,
    },
    Architecture {
        name: "gemma3",
        hf: &["Gemma3ForCausalLM"],
        model_types: &["gemma3_text"],
        gguf: &["gemma3"],
        defaults: Defaults {
            rope_theta: 1_000_000.0,
            ..defaults(131072, Some(4), Some(256), true)
        },
        build: gemma::build,
    },
    Architecture {
        name: "qwen35",
        hf: &["Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration"],
        model_types: &["qwen3_5_text", "qwen3_5"],
        gguf: &["qwen35"],
        defaults: Defaults {
            rope_theta: 10_000_000.0,
            ..defaults(32768, Some(4), Some(256), false)
        },
        build: qwen35::build,
    },
];

/// The architecture of a Hugging Face `architectures[0]` entry.
pub fn by_hf_name(name: &str) -> Option<&'static Architecture> {
    ARCHITECTURES.iter().find(|a| a.hf.contains(&name))
}

/// The architecture of a Hugging Face `model_type`.
pub fn by_model_type(name: &str) -> Option<&'static Architecture> {
    ARCHITECTURES.iter().find(|a| a.model_types.contains(&name))
}

/// The architecture of a GGUF `general.architecture` value.
pub fn by_gguf_name(name: &str) -> Option<&'static Architecture> {
    ARCHITECTURES.iter().find(|a| a.gguf.contains(&name))
}

/// Every Hugging Face architecture name accepted, for messages.
pub fn hf_names() -> Vec<&'static str> {
    ARCHITECTURES.iter().flat_map(|a| a.hf.iter().copied()).collect()
}

/// Every GGUF architecture name accepted, for messages.
pub fn gguf_names() -> Vec<&'static str> {
    ARCHITECTURES.iter().flat_map(|a| a.gguf.iter().copied()).collect()
}

/// The model's spec from `params`, built by `arch`'s file.
pub fn build(arch: &Architecture, params: &dyn Params) -> Result<ModelSpec, ArchError> {
    (arch.build)(params, arch)
}
