//! Asking the kernel to map a file mapping's pages before their first read, shared by the
//! loaders (the weight files, `kiln_formats::page_in`) and the engine (the row-grouped copy
//! kept in the cache), and to drop the pages of weights no kernel will read through that
//! mapping again (the sources of row-grouped copies).

use crate::budget::physical_memory;

/// Whether `bytes` of mappings are paged in ahead of use on a machine of `memory` bytes (0:
/// unknown): not more than half of it, where mapping them all would only push other pages out
/// (pages the kernels never read, such as the source of a row-grouped copy, are mapped too
/// until [`release`] drops them).
pub fn paged_in_ahead(bytes: u64, memory: u64) -> bool {
    memory == 0 || bytes <= memory / 2
}

/// Asks the kernel to map every page of `bytes` (part of a file mapping) now, as reads would:
/// `MADV_POPULATE_READ` (Linux 5.14), else `MADV_WILLNEED` (read-ahead only). Best effort: an
/// error changes nothing but the speed of the first touch. Skipped where [`paged_in_ahead`]
/// says no.
pub fn page_in(bytes: &[u8]) {
    if bytes.is_empty() || !paged_in_ahead(bytes.len() as u64, physical_memory()) {
        return;
    }
    let page = page_size();
    let start = bytes.as_ptr() as usize;
    let aligned = start - start % page;
    let len = bytes.len() + (start - aligned);
    // SAFETY: madvise only reads the range's pages in on the kernel side; the range lies
    // within (or rounds down to the page holding the start of) a mapping `bytes` borrows, so it
    // stays mapped for the whole call.
    let populated = unsafe { libc::madvise(aligned as *mut libc::c_void, len, libc::MADV_POPULATE_READ) } == 0;
    if !populated {
        // SAFETY: as above; MADV_WILLNEED only starts read-ahead of the same range.
        unsafe { libc::madvise(aligned as *mut libc::c_void, len, libc::MADV_WILLNEED) };
    }
}

/// Huge-page span the released ranges are rounded to: a file mapping of the weights is mapped in
/// 2 MiB pages where it can be, and dropping part of one would split the mapping of what
/// stays (small tensors beside the released ones) into 4 KiB entries.
const RELEASE_ALIGN: usize = 2 << 20;

/// The whole aligned spans inside `ranges` (start address, length): touching or overlapping
/// ranges merged into runs, each run's interior aligned to [`RELEASE_ALIGN`] (so no page
/// holding bytes outside the ranges is included), empty ones left out. What [`release`] drops,
/// and what the loaders leave out of paging in ahead (the bytes of tensors read from a copy).
pub fn aligned_spans(mut ranges: Vec<(usize, usize)>) -> Vec<(usize, usize)> {
    ranges.retain(|&(_, len)| len > 0);
    ranges.sort_unstable();
    let mut runs: Vec<(usize, usize)> = Vec::new();
    for (start, len) in ranges {
        let end = start + len;
        match runs.last_mut() {
            Some(run) if start <= run.1 => run.1 = run.1.max(end),
            _ => runs.push((start, end)),
        }
    }
    runs.into_iter()
        .filter_map(|(start, end)| {
            let (from, to) = (start.next_multiple_of(RELEASE_ALIGN), end - end % RELEASE_ALIGN);
            (to > from).then(|| (from, to - from))
        })
        .collect()
}

/// Drops this process's pages of the given ranges of **file mappings** the weights will not be
/// read through again (the sources of row-grouped copies): `MADV_DONTNEED` unmaps them, so
/// they stop counting in the process's memory; the page cache keeps the data, and a later read
/// maps it back from there or from the file. Only whole aligned spans inside the merged ranges
/// are dropped ([`aligned_spans`]). Returns the bytes released. Best effort.
///
/// # Safety
/// Every range must lie inside a shared or read-only file mapping that stays mapped for the
/// call: on a private anonymous mapping `MADV_DONTNEED` would discard the data itself.
pub unsafe fn release(ranges: Vec<(usize, usize)>) -> usize {
    let mut released = 0;
    for (start, len) in aligned_spans(ranges) {
        // SAFETY: the caller guarantees file-mapped ranges (their pages are read back from
        // the file if touched again); the span lies inside them (`aligned_spans`).
        if unsafe { libc::madvise(start as *mut libc::c_void, len, libc::MADV_DONTNEED) } == 0 {
            released += len;
        }
    }
    released
}

/// The system's page size (4 KiB where it cannot be read).
fn page_size() -> usize {
    // SAFETY: sysconf reads a constant of the system; no memory is passed.
    let size = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if size > 0 { size as usize } else { 4096 }
}

#[cfg(test)]
mod tests {
    use super::{RELEASE_ALIGN, aligned_spans};

    const M: usize = RELEASE_ALIGN;

    /// Invariant: a released span covers only bytes of the given ranges (touching ranges count
    /// as one run), on whole aligned pages; a run shorter than one aligned page releases
    /// nothing.
    #[test]
    fn aligned_spans_merge_touching_ranges_and_keep_to_their_aligned_interior() {
        // Two touching tensors from 1.5 to 6.75 aligned pages, one more from 9, one tiny one.
        let ranges = vec![
            (9 * M, 3 * M + 1),
            (M + M / 2, 2 * M),
            (M + M / 2 + 2 * M, 3 * M + M / 4),
            (20 * M + 5, 100),
        ];
        assert_eq!(aligned_spans(ranges), vec![(2 * M, 4 * M), (9 * M, 3 * M)]);
        assert_eq!(aligned_spans(vec![(M / 2, M)]), vec![]);
        assert_eq!(aligned_spans(vec![(3 * M, M), (3 * M, 2 * M)]), vec![(3 * M, 2 * M)]);
    }
}
