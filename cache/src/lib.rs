//! On-disk cache (being written).
