//! Kiln's runtime: loads a model's files and a compiled library, and generates text with them.
//! It never needs MLIR: a cached library is opened with `dlopen` and driven from here.

pub mod model;
pub mod sampler;
pub mod tokenizer;
