//! Kiln's runtime: loads a model's files and a compiled library, and generates text with them.
//! It never needs MLIR: a cached library is opened with `dlopen` and driven from here.

pub mod buffers;
pub mod chat_template;
pub mod engine;
pub mod generate;
pub mod gguf;
pub mod hub;
pub mod library;
pub mod loader;
pub mod model;
pub mod plan;
pub mod pool;
pub mod probe;
pub mod resident;
pub mod sampler;
pub mod tokenizer;

pub use engine::{Engine, EngineConfig, EngineError, WeightSource};
