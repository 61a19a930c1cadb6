//! Reading a tensor's bytes from its file with `pread`, for
//! [`kiln_engine::engine::WeightSource::read_range`]: how `--ram-budget` streams weights it
//! does not keep resident.
//!
//! Every read goes to the file descriptor, never through the file's memory map, so no mapped
//! page becomes resident, and what was read is then dropped from the page cache
//! (`POSIX_FADV_DONTNEED`, best effort), so a streamed weight holds no memory once used.
//!
//! The bytes produced are the bytes the kernels read, whatever the tensor's layout in the
//! file: as stored ([`plain`]), with rows reordered ([`reordered`]: llama.cpp's q/k
//! permutation undone, Qwen3.5's query and gate rows split), or transposed ([`transposed`],
//! GPT-2's `Conv1D` weights). Any byte range of the tensor may be asked for; the scratch
//! buffers stay small (at most [`SCRATCH`] bytes of stored rows, or one row), and nothing the
//! size of the tensor's data is allocated.

use std::fs::File;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::path::Path;

/// Largest scratch buffer [`transposed`] and [`reordered`] read stored rows into.
const SCRATCH: usize = 4 << 20;

/// One tensor's bytes in a file: `len` bytes from byte `start` of `file` (opened from `path`).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Stored<'a> {
    pub file: &'a File,
    pub path: &'a Path,
    /// The tensor's name, for messages.
    pub name: &'a str,
    pub start: u64,
    pub len: usize,
}

impl Stored<'_> {
    fn err(&self, problem: impl std::fmt::Display) -> String {
        format!("{}: tensor {}: {problem}", self.path.display(), self.name)
    }

    /// `offset..offset + len` as a range of the tensor's bytes, or an error if it reaches past
    /// them.
    pub fn check(&self, offset: usize, len: usize) -> Result<(), String> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len => Ok(()),
            _ => Err(self.err(format_args!(
                "cannot read {len} bytes at byte {offset}: the tensor has {} bytes",
                self.len
            ))),
        }
    }

    /// Reads `dst.len()` bytes at byte `at` of the tensor (in the file's layout) into `dst`,
    /// then drops them from the page cache.
    fn read(&self, at: usize, dst: &mut [u8]) -> Result<(), String> {
        let pos = self.start + at as u64;
        self.file.read_exact_at(dst, pos).map_err(|e| {
            let end = pos + dst.len() as u64;
            match e.kind() {
                std::io::ErrorKind::UnexpectedEof => {
                    self.err(format_args!("short read: the file ends before byte {end}"))
                }
                _ => self.err(format_args!("reading bytes {pos}..{end} of the file: {e}")),
            }
        })?;
        drop_cached(self.file, pos, dst.len());
        Ok(())
    }
}

/// Asks the kernel to drop `len` bytes at `pos` of `file` from the page cache. Best effort:
/// pages still mapped or dirty stay, and an error changes nothing but memory use.
fn drop_cached(file: &File, pos: u64, len: usize) {
    let (Ok(pos), Ok(len)) = (libc::off_t::try_from(pos), libc::off_t::try_from(len)) else {
        return;
    };
    // SAFETY: posix_fadvise only advises the kernel about a range of the open descriptor
    // `file` owns (alive for the call); no memory is passed.
    unsafe { libc::posix_fadvise(file.as_raw_fd(), pos, len, libc::POSIX_FADV_DONTNEED) };
}

/// Copies the part of `src` (bytes `at..at + src.len()` of the tensor) that falls within
/// `dst` (bytes `offset..offset + dst.len()` of the tensor).
fn put(dst: &mut [u8], offset: usize, at: usize, src: &[u8]) {
    let lo = at.max(offset);
    let hi = (at + src.len()).min(offset + dst.len());
    if lo < hi {
        dst[lo - offset..hi - offset].copy_from_slice(&src[lo - at..hi - at]);
    }
}

/// `dst.len()` bytes from byte `offset` of a tensor read as stored.
pub(crate) fn plain(t: &Stored, offset: usize, dst: &mut [u8]) -> Result<(), String> {
    t.check(offset, dst.len())?;
    if dst.is_empty() {
        return Ok(());
    }
    t.read(offset, dst)
}

/// `dst.len()` bytes from byte `offset` of a tensor whose rows are stored in another order (see
/// [`kiln_core::spec::Layout::row_order`]): row `r` of the result is the file's row
/// `order[r]`, `order.len()` rows in all. The file rows that the rows asked for need are read
/// in runs of adjacent rows (a gap of one row is read through: llama's q/k take every other
/// row of a head), each read at most [`SCRATCH`] bytes (or one row), then scattered.
pub(crate) fn reordered(t: &Stored, order: &[usize], offset: usize, dst: &mut [u8]) -> Result<(), String> {
    reordered_with(t, order, offset, dst, SCRATCH)
}

/// [`reordered`] with reads of at most `scratch_bytes` (or one row).
fn reordered_with(
    t: &Stored,
    order: &[usize],
    offset: usize,
    dst: &mut [u8],
    scratch_bytes: usize,
) -> Result<(), String> {
    t.check(offset, dst.len())?;
    if dst.is_empty() {
        return Ok(());
    }
    let rows = order.len();
    if rows == 0 || !t.len.is_multiple_of(rows) {
        return Err(t.err(format_args!("{} bytes cannot be split into {rows} rows", t.len)));
    }
    let row_bytes = t.len / rows;
    let end = offset + dst.len();
    let (first_row, end_row) = (offset / row_bytes, end.div_ceil(row_bytes));
    // The file rows wanted, each with the row of the result it becomes, in file order.
    let mut wanted: Vec<(usize, usize)> = (first_row..end_row).map(|r| (order[r], r)).collect();
    wanted.sort_unstable();
    if let Some(&(last, _)) = wanted.last()
        && last >= rows
    {
        return Err(t.err(format_args!("row {last} of a row order lies past the {rows} rows")));
    }
    let most = (scratch_bytes / row_bytes).max(1);
    let mut scratch = Vec::new();
    let mut i = 0;
    while i < wanted.len() {
        let lo = wanted[i].0;
        let mut j = i + 1;
        while j < wanted.len() && wanted[j].0 <= wanted[j - 1].0 + 2 && wanted[j].0 < lo + most {
            j += 1;
        }
        let hi = wanted[j - 1].0 + 1;
        scratch.resize((hi - lo) * row_bytes, 0);
        t.read(lo * row_bytes, &mut scratch)?;
        for &(file_row, r) in &wanted[i..j] {
            let from = (file_row - lo) * row_bytes;
            put(dst, offset, r * row_bytes, &scratch[from..from + row_bytes]);
        }
        i = j;
    }
    Ok(())
}

/// `dst.len()` bytes from byte `offset` of a `[rows, cols]` tensor of `elem`-byte elements
/// stored transposed (`[cols, rows]`): element `(r, c)` of the result is stored element
/// `(c, r)`. The stored rows are read in strips of at most [`SCRATCH`] bytes, each only the
/// columns (of the stored rows) that the rows asked for need.
pub(crate) fn transposed(
    t: &Stored,
    rows: usize,
    cols: usize,
    elem: usize,
    offset: usize,
    dst: &mut [u8],
) -> Result<(), String> {
    transposed_with(t, [rows, cols, elem], offset, dst, SCRATCH)
}

/// [`transposed`] with a scratch of at most `scratch_bytes` (at least one element).
fn transposed_with(
    t: &Stored,
    [rows, cols, elem]: [usize; 3],
    offset: usize,
    dst: &mut [u8],
    scratch_bytes: usize,
) -> Result<(), String> {
    t.check(offset, dst.len())?;
    if dst.is_empty() {
        return Ok(());
    }
    if elem == 0 || rows.checked_mul(cols).and_then(|n| n.checked_mul(elem)) != Some(t.len) {
        return Err(t.err(format_args!(
            "{} bytes are not {rows} x {cols} elements of {elem} bytes",
            t.len
        )));
    }
    let end = offset + dst.len();
    let row_bytes = cols * elem;
    let (first_row, end_row) = (offset / row_bytes, end.div_ceil(row_bytes));
    // Output rows in chunks whose segment of one stored row fits the scratch.
    let room = (scratch_bytes / elem).max(1);
    let chunk_rows = room.min(rows);
    let mut scratch = Vec::new();
    let mut ra = first_row;
    while ra < end_row {
        let rb = (ra + chunk_rows).min(end_row);
        let width = rb - ra;
        // Stored rows `c0..c1` hold the chunk in one contiguous span from element
        // `(c0, ra)` to `(c1 - 1, rb)`: `(c1 - c0 - 1) * rows + width` elements.
        let strip = (room.saturating_sub(width) / rows + 1).min(cols);
        let mut c0 = 0;
        while c0 < cols {
            let c1 = (c0 + strip).min(cols);
            let span = (c1 - c0 - 1) * rows + width;
            scratch.resize(span * elem, 0);
            t.read((c0 * rows + ra) * elem, &mut scratch)?;
            for c in c0..c1 {
                for r in ra..rb {
                    let from = ((c - c0) * rows + (r - ra)) * elem;
                    put(dst, offset, (r * cols + c) * elem, &scratch[from..from + elem]);
                }
            }
            c0 = c1;
        }
        ra = rb;
    }
    Ok(())
}

/// Checks shared by the tests of every [`kiln_engine::engine::WeightSource`] of this crate.
#[cfg(test)]
pub(crate) mod check {
    use kiln_core::WeightId;
    use kiln_engine::engine::WeightSource;

    /// Byte ranges of a tensor of `len` bytes in `rows` rows: the whole tensor, whole rows
    /// from the second up to the last, the last row, and a range cutting rows at both ends.
    pub fn ranges(len: usize, rows: usize) -> Vec<(usize, usize)> {
        let row = len / rows.max(1);
        let mut out = vec![(0, len), (len - row, row)];
        if rows >= 3 {
            out.push((row, (rows - 2) * row));
        }
        if len > row + 8 {
            out.push((3, row + 2));
        }
        out
    }

    /// What `read_range` gives for each of [`ranges`] of weight `id`.
    pub fn read(src: &dyn WeightSource, id: WeightId, len: usize, rows: usize) -> Vec<((usize, usize), Vec<u8>)> {
        ranges(len, rows)
            .into_iter()
            .map(|(off, n)| {
                let mut got = vec![0xA5; n];
                src.read_range(id, off, &mut got)
                    .unwrap_or_else(|e| panic!("weight {}: {off}+{n}: {e}", id.0));
                ((off, n), got)
            })
            .collect()
    }

    /// The `len` bytes `weight_ptr` exposes for weight `id`.
    pub fn exposed(src: &dyn WeightSource, id: WeightId, len: usize) -> Vec<u8> {
        let p = src.weight_ptr(id).unwrap();
        // SAFETY: the source holds `len` bytes at `p` (the spec's size of the weight) as long
        // as it lives, which is longer than this copy.
        unsafe { std::slice::from_raw_parts(p, len) }.to_vec()
    }

    /// Asserts each read of [`read`] is its range of `exposed`.
    pub fn same(reads: &[((usize, usize), Vec<u8>)], exposed: &[u8], what: &str) {
        for ((off, n), got) in reads {
            assert!(got[..] == exposed[*off..off + n], "{what}: bytes {off}+{n} differ");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gguf::permute::{reorder_rows, unpermute_rows};
    use kiln_core::spec::Layout;
    use std::io::Write as _;

    fn file_of(bytes: &[u8], pad: usize) -> File {
        let mut f = tempfile::tempfile().unwrap();
        f.write_all(&vec![0xEE; pad]).unwrap();
        f.write_all(bytes).unwrap();
        f
    }

    fn stored<'a>(file: &'a File, pad: usize, len: usize) -> Stored<'a> {
        Stored {
            file,
            path: Path::new("/m/w.bin"),
            name: "t",
            start: pad as u64,
            len,
        }
    }

    /// Byte ranges to try on a tensor of `len` bytes in rows of `row` bytes: whole, empty,
    /// whole rows, and ranges cutting rows (and elements) anywhere.
    fn ranges(len: usize, row: usize) -> Vec<(usize, usize)> {
        let mut out = vec![(0, len), (0, 0), (len, 0), (row, len - row), (row, row), (1, len - 2)];
        out.extend([
            (3, row + 5),
            (len.saturating_sub(row + 3), row + 3),
            (row / 2, 2 * row + 1),
        ]);
        out.retain(|&(off, n)| off + n <= len);
        out
    }

    /// Invariant: a reordered read of any byte range is that range of the rows reordered in
    /// memory by `reorder_rows` (what the lazy copy holds), with the file read at its offset,
    /// for llama's q/k permutation and Qwen3.5's head parts alike, whatever the read size.
    #[test]
    fn reordered_reads_equal_the_reordered_copy() {
        let rope = |heads| Layout::RopePermuted { heads };
        let parts = |heads, parts| Layout::HeadParts { heads, parts };
        let cases = [
            (16, rope(2), 6),
            (8, rope(4), 3),
            (24, rope(3), 10),
            (4, rope(1), 1),
            (24, parts(3, 2), 4),
            (12, parts(2, 3), 5),
            (6, parts(3, 2), 1),
            (8, parts(1, 2), 3),
        ];
        for (rows, layout, row) in cases {
            let order = layout.row_order(rows).unwrap();
            let src: Vec<u8> = (0..rows * row).map(|i| (i * 7 % 251) as u8).collect();
            let mut copy = vec![0; src.len()];
            reorder_rows(&src, &mut copy, row, &order);
            let f = file_of(&src, 13);
            let t = stored(&f, 13, src.len());
            for (off, n) in ranges(src.len(), row) {
                let mut got = vec![0; n];
                reordered(&t, &order, off, &mut got).unwrap();
                assert_eq!(got, copy[off..off + n], "{rows}x{row} {layout:?}, {off}+{n}");
                // Reads of one row, two, a few.
                for scratch in [1, 2 * row, 5 * row + 1] {
                    let mut got = vec![0; n];
                    reordered_with(&t, &order, off, &mut got, scratch).unwrap();
                    assert_eq!(got, copy[off..off + n], "{rows}x{row} {layout:?}, {off}+{n}, {scratch}");
                }
            }
        }
    }

    /// Invariant: a transposed read of any byte range is that range of the tensor transposed
    /// in memory, also when the scratch holds only part of a strip.
    #[test]
    fn transposed_reads_equal_the_transposed_copy() {
        for (rows, cols, elem) in [(6, 4, 4), (5, 7, 2), (1, 3, 4), (9, 1, 2)] {
            let src: Vec<u8> = (0..rows * cols * elem).map(|i| (i * 13 % 253) as u8).collect();
            let mut copy = vec![0; src.len()];
            for r in 0..rows {
                for c in 0..cols {
                    let (s, d) = ((c * rows + r) * elem, (r * cols + c) * elem);
                    copy[d..d + elem].copy_from_slice(&src[s..s + elem]);
                }
            }
            let f = file_of(&src, 5);
            let t = stored(&f, 5, src.len());
            for (off, n) in ranges(src.len(), cols * elem) {
                let mut got = vec![0; n];
                transposed(&t, rows, cols, elem, off, &mut got).unwrap();
                assert_eq!(got, copy[off..off + n], "{rows}x{cols}x{elem}, {off}+{n}");
                // Scratch of one element, a few, part of a stored row, a few stored rows.
                for scratch in [1, 3 * elem, rows * elem / 2, 2 * rows * elem + elem] {
                    let mut got = vec![0; n];
                    transposed_with(&t, [rows, cols, elem], off, &mut got, scratch).unwrap();
                    assert_eq!(got, copy[off..off + n], "{rows}x{cols}x{elem}, {off}+{n}, {scratch}");
                }
            }
        }
    }

    /// Ranges past the tensor, a file cut short and impossible shapes are errors naming the
    /// file and the tensor, never panics.
    #[test]
    fn bad_reads_are_errors_naming_the_tensor() {
        let f = file_of(&[1u8; 32], 0);
        let t = stored(&f, 0, 32);
        let mut buf = [0u8; 8];
        let e = plain(&t, 28, &mut buf).unwrap_err();
        assert_eq!(
            e,
            "/m/w.bin: tensor t: cannot read 8 bytes at byte 28: the tensor has 32 bytes"
        );
        assert!(plain(&t, usize::MAX, &mut buf).is_err());
        let long = stored(&f, 16, 32);
        let e = plain(&long, 9, &mut buf).unwrap_err();
        assert_eq!(e, "/m/w.bin: tensor t: short read: the file ends before byte 33");
        let e = reordered(&t, &[0, 1, 2, 3, 4, 5], 0, &mut buf).unwrap_err();
        assert_eq!(e, "/m/w.bin: tensor t: 32 bytes cannot be split into 6 rows");
        assert!(reordered(&t, &[0, 9], 16, &mut buf).unwrap_err().contains("row 9"));
        assert!(transposed(&t, 3, 3, 4, 0, &mut buf).unwrap_err().contains("3 x 3"));
        let order = unpermute_rows(4, 2).unwrap();
        assert!(
            reordered(&long, &order, 24, &mut buf)
                .unwrap_err()
                .contains("short read")
        );
        assert!(
            transposed(&long, 4, 2, 4, 0, &mut buf)
                .unwrap_err()
                .contains("short read")
        );
        plain(&t, 24, &mut buf).unwrap();
        assert_eq!(buf, [1; 8]);
    }
}
