//! Kiln's engine: opens a compiled library with `dlopen`, binds its kernels to the model's weights
//! and buffers (plans), and runs them on a pinned thread pool: prefill in blocks of rows, decode one
//! row at a time. It never needs MLIR, tokenizers or model files: weights arrive through
//! [`WeightSource`].

pub mod buffers;
mod checkpoint;
pub mod engine;
pub mod grouped;
pub mod grouped_store;
pub mod library;
pub mod origin;
pub mod plan;
pub mod pool;
pub mod probe;
pub mod resident;
mod source;
pub mod stream;

pub use engine::{Engine, EngineConfig, EngineError, WeightSource};
