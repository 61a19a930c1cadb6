//! Test helpers shared by several Kiln crates (dev-dependency only): a fake Hugging Face hub,
//! a GGUF splitter that writes parts as llama.cpp's `gguf-split` does, and fixtures with a chat
//! template.

pub mod fake_hub;
pub mod fixtures;
pub mod gguf_split;
pub mod special_files;
