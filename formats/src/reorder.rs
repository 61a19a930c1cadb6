//! Tensors whose layout reorders whole rows ([`Layout::reorders_rows`]): llama.cpp's q/k
//! permutation in GGUF `llama` files, and Qwen3.5's full-attention `q_proj` (each head's query
//! rows, then its gate rows: [`Layout::HeadParts`]) in both formats.
//!
//! Both front ends treat them alike: checked at load ([`Reordered::of`]), copied into the order
//! the kernels read on their first `weight_ptr` ([`Reordered::copy_into`]), and streamed in
//! that order by `read_range` without the copy ([`Reordered::read`]). A row is whole
//! quantisation blocks (one element, for a vector), so a row permutation is a permutation of
//! byte rows whatever the storage type.

use crate::gguf::permute::reorder_rows;
use crate::pread::{self, Stored};
use kiln_core::spec::Layout;

/// A tensor of a layout that reorders rows, checked: its rows divide as the layout says and
/// its bytes into whole rows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Reordered {
    layout: Layout,
    /// Rows of the outermost dimension (elements, for a vector), at least 1.
    rows: usize,
}

impl Reordered {
    /// The reordering of a tensor of `layout` and `shape` (outermost first) stored in `len`
    /// bytes: `Ok(None)` for a layout that moves no rows. The error, when the rows cannot be
    /// split as the layout says or the bytes into whole rows, completes "tensor NAME ...".
    pub fn of(layout: Layout, shape: &[usize], len: usize) -> Result<Option<Reordered>, String> {
        if !layout.reorders_rows() {
            return Ok(None);
        }
        let rows = shape.first().copied().unwrap_or(0);
        if rows == 0 || layout.row_order(rows).is_none() {
            let split = match layout {
                Layout::RopePermuted { heads } => format!("2 x {heads} heads"),
                Layout::HeadParts { heads, parts } => format!("{heads} heads x {parts} parts"),
                other => format!("{other:?}"),
            };
            return Err(format!("has {rows} rows, not a multiple of {split}"));
        }
        if !len.is_multiple_of(rows) {
            return Err(format!("has {len} bytes, which do not split into {rows} rows"));
        }
        Ok(Some(Reordered { layout, rows }))
    }

    /// `order[kernel_row]` is the stored row that holds it ([`Layout::row_order`]).
    pub fn order(&self) -> Vec<usize> {
        // Checked by `of`, so never the empty default.
        self.layout.row_order(self.rows).unwrap_or_default()
    }

    /// Writes the tensor the kernels read into `dst` from the stored bytes `src` (both the
    /// tensor's size).
    ///
    /// # Panics
    /// If `src` or `dst` is not the size of the tensor `of` checked.
    pub fn copy_into(&self, src: &[u8], dst: &mut [u8]) {
        reorder_rows(src, dst, src.len() / self.rows, &self.order());
    }

    /// `dst.len()` bytes at byte `offset` of the tensor the kernels read, read from the file
    /// `t` describes without making the copy.
    pub fn read(&self, t: &Stored, offset: usize, dst: &mut [u8]) -> Result<(), String> {
        pread::reordered(t, &self.order(), offset, dst)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Invariant: only row-reordering layouts are reordered, and one whose rows or bytes do not
    /// divide is an error saying how they should (llama's wording kept for `RopePermuted`).
    #[test]
    fn only_dividing_row_reorderings_are_accepted() {
        let hp = Layout::HeadParts { heads: 3, parts: 2 };
        assert_eq!(Reordered::of(Layout::Plain, &[6, 4], 48), Ok(None));
        assert_eq!(Reordered::of(Layout::Transposed, &[6, 4], 48), Ok(None));
        let r = Reordered::of(hp, &[6, 4], 48).unwrap().unwrap();
        assert_eq!(r.order(), [0, 2, 4, 1, 3, 5]);
        let src: Vec<u8> = (0..12).collect();
        let mut dst = vec![0; 12];
        r.copy_into(&src, &mut dst);
        assert_eq!(dst, [0, 1, 4, 5, 8, 9, 2, 3, 6, 7, 10, 11]);
        assert_eq!(
            Reordered::of(hp, &[8, 4], 64).unwrap_err(),
            "has 8 rows, not a multiple of 3 heads x 2 parts"
        );
        assert_eq!(
            Reordered::of(Layout::RopePermuted { heads: 3 }, &[9], 36).unwrap_err(),
            "has 9 rows, not a multiple of 2 x 3 heads"
        );
        assert!(Reordered::of(hp, &[], 4).unwrap_err().contains("has 0 rows"));
        assert!(Reordered::of(hp, &[6], 9).unwrap_err().contains("9 bytes"));
    }
}
