//! Sampling (being written).
