//! The shape and the expected row order shared by the `HeadParts` tests of both front ends
//! (`gguf/tests_head_parts.rs`, `loader/tests_head_parts.rs`): an oracle written out head by
//! head and part by part, independent of `reorder.rs`, which it checks.

pub const HEADS: usize = 3;
pub const PARTS: usize = 2;
/// Rows of one part of one head.
pub const HEAD_DIM: usize = 4;
pub const ROWS: usize = HEADS * PARTS * HEAD_DIM;

/// The bytes the kernels read for stored bytes `raw` of [`ROWS`] rows: part `p` of head `h` is
/// stored at rows `(h * PARTS + p) * HEAD_DIM ..` and read at rows `(p * HEADS + h) * HEAD_DIM ..`.
pub fn part_major(raw: &[u8]) -> Vec<u8> {
    let block = HEAD_DIM * raw.len() / ROWS;
    let mut out = Vec::with_capacity(raw.len());
    for p in 0..PARTS {
        for h in 0..HEADS {
            let at = (h * PARTS + p) * block;
            out.extend(&raw[at..at + block]);
        }
    }
    out
}
