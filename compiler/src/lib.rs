//! MLIR compiler (being written).
