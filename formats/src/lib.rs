//! Model front ends: a Hugging Face folder (`config.json` + safetensors), a GGUF file, or a hub id
//! downloaded into the Hugging Face cache, each read into one [`loader::Model`]: a validated
//! spec, mapped weights the engine can bind, a tokenizer and the ids that end generation.

pub mod gguf;
#[cfg(test)]
mod head_parts_reference;
pub mod hub;
pub mod loader;
pub mod model;
pub mod overlap;
pub mod page_in;
mod pread;
mod reorder;
