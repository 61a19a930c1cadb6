//! Undoing llama.cpp's Q/K row permutation.
//!
//! `convert_hf_to_gguf.py` rewrites the query and key projections of `llama`-architecture
//! models (weights and biases) so that llama.cpp's "normal" RoPE, which rotates adjacent pairs
//! `(2i, 2i + 1)`, computes what Hugging Face's rotate-half RoPE computes on pairs
//! `(i, i + d/2)`:
//!
//! ```python
//! w.reshape(n_head, 2, head_dim // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
//! ```
//!
//! Within each head, HF row `j * d/2 + i` (`j` in {0, 1}, `i` < `d/2`) becomes GGUF row
//! `2i + j`. Qwen2 and Qwen3 use NeoX (rotate-half) RoPE in llama.cpp and are written
//! unpermuted.
//!
//! Kiln's kernels use HF's layout, so the loader undoes the permutation. It only moves whole
//! rows (a quantised row is a whole number of blocks; no block is split), so it works for every
//! storage type: see [`unpermute_rows`] and [`reorder_rows`]. The same holds for every layout
//! that reorders rows ([`Layout::row_order`], Qwen3.5's [`Layout::HeadParts`] among them).
//! This is a one-time copy, made on the first access, of the tensors of such a layout only (a
//! weight the engine streams is reordered as it is read instead, see `crate::pread`); every
//! other tensor is read in place from the memory map.

use kiln_core::spec::Layout;

/// For a projection of `n_heads` heads (`n_rows = n_heads * head_dim`, `head_dim` even) stored
/// in llama.cpp's permuted order: `mapping[hf_row]` is the GGUF row that holds HF row `hf_row`.
/// Building the HF-order tensor is `out.row(r) = gguf.row(mapping[r])`.
///
/// Returns `None` unless `n_heads > 0` and `n_rows` is a multiple of `2 * n_heads`. This is
/// [`Layout::row_order`] of [`Layout::RopePermuted`], which the loaders use for every layout
/// that reorders rows: within a head of `d` rows, HF row `j * d/2 + i` is GGUF row `2i + j`.
pub fn unpermute_rows(n_rows: usize, n_heads: usize) -> Option<Vec<usize>> {
    Layout::RopePermuted { heads: n_heads }.row_order(n_rows)
}

/// The converter's direction: `mapping[gguf_row]` is the HF row stored at GGUF row `gguf_row`
/// (the inverse of [`unpermute_rows`]). Used by tests and writers.
pub fn permute_rows(n_rows: usize, n_heads: usize) -> Option<Vec<usize>> {
    let unpermute = unpermute_rows(n_rows, n_heads)?;
    let mut mapping = vec![0; n_rows];
    for (hf, &gguf) in unpermute.iter().enumerate() {
        mapping[gguf] = hf;
    }
    Some(mapping)
}

/// Copies the rows of `src` (`mapping.len()` rows of `row_bytes` bytes each) into `dst` in the
/// order `mapping` gives: `dst.row(r) = src.row(mapping[r])`.
///
/// # Panics
/// If `src` or `dst` is not `mapping.len() * row_bytes` bytes long, or a mapping entry is out of
/// range (callers build both from validated tensor sizes).
pub fn reorder_rows(src: &[u8], dst: &mut [u8], row_bytes: usize, mapping: &[usize]) {
    assert_eq!(src.len(), mapping.len() * row_bytes, "source size");
    assert_eq!(dst.len(), mapping.len() * row_bytes, "destination size");
    if row_bytes == 0 {
        return;
    }
    for (out, &from) in dst.chunks_exact_mut(row_bytes).zip(mapping) {
        out.copy_from_slice(&src[from * row_bytes..(from + 1) * row_bytes]);
    }
}
