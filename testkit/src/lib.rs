//! Test helpers shared by several Kiln crates (dev-dependency only): a fake Hugging Face hub
//! and a GGUF splitter that writes parts as llama.cpp's `gguf-split` does.

pub mod fake_hub;
pub mod gguf_split;
pub mod special_files;
