//! Paging mapped weights in while the tokenizer is being built, instead of at their first use.
//!
//! Weights are memory-mapped, so the first forward pass took the page faults itself (with the
//! kernel's fault-around, ~5k of them for a cached 384 MB Q4_K_M GGUF) and, when the file is
//! not in the page cache, waited for its reads. The loaders page the weights in ([`Pager`])
//! on a second thread while the first gets the tokenizer, and the first joins in when it is
//! done: measured on a 2-core EPYC, the first prefill of a one-token run went from
//! 0.106–0.139 s to 0.083–0.105 s with the file cached. Mapping a cached 1 GB file takes one
//! thread 35–70 ms, so once the tokenizer came from its table file in a few milliseconds, the
//! second thread's half of the work became what the first waits for. Only commands that are
//! about to run the model ask for it (`LoadOptions::page_in`): for `compile` or `info`, which
//! read headers, it would read the whole file for nothing.

use std::sync::atomic::{AtomicUsize, Ordering};

/// Pages in a set of mapped regions in chunks that any number of threads claim in turn: each
/// [`Pager::work`] call returns when no chunk is left unclaimed.
pub struct Pager<'a> {
    chunks: Vec<&'a [u8]>,
    next: AtomicUsize,
}

/// Bytes per claim: small enough that two threads end together, large enough that claiming
/// costs nothing next to mapping (16 MiB is ~1 ms of `MADV_POPULATE_READ`).
const CHUNK: usize = 16 << 20;

impl<'a> Pager<'a> {
    /// A pager for `regions` (parts of file mappings); none at all when they are more than
    /// half the machine's memory, where mapping them all would only push other pages out.
    pub fn new(regions: impl IntoIterator<Item = &'a [u8]>) -> Pager<'a> {
        let regions: Vec<&[u8]> = regions.into_iter().collect();
        let total: u64 = regions.iter().map(|r| r.len() as u64).sum();
        let chunks = if total > physical_memory() / 2 {
            Vec::new()
        } else {
            regions.iter().flat_map(|r| r.chunks(CHUNK)).collect()
        };
        Pager {
            chunks,
            next: AtomicUsize::new(0),
        }
    }

    /// Pages in chunks until none is left.
    pub fn work(&self) {
        while let Some(chunk) = self.chunks.get(self.next.fetch_add(1, Ordering::Relaxed)) {
            page_in(chunk);
        }
    }
}

/// Asks the kernel to map every page of `bytes` (part of a file mapping) now, as reads would:
/// `MADV_POPULATE_READ` (Linux 5.14), else `MADV_WILLNEED` (read-ahead only). Best effort: an
/// error changes nothing but the speed of the first touch. Skipped when `bytes` is more than
/// half the machine's memory, where mapping it all would only push other pages out.
pub fn page_in(bytes: &[u8]) {
    if bytes.is_empty() || bytes.len() as u64 > physical_memory() / 2 {
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

fn page_size() -> usize {
    // SAFETY: sysconf reads a constant of the system; no memory is passed.
    let size = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if size > 0 { size as usize } else { 4096 }
}

fn physical_memory() -> u64 {
    // SAFETY: sysconf reads constants of the system; no memory is passed.
    let pages = unsafe { libc::sysconf(libc::_SC_PHYS_PAGES) };
    if pages > 0 {
        pages as u64 * page_size() as u64
    } else {
        0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write as _;

    /// Paging in a file mapping leaves its bytes as they are (any sub-range, aligned or not),
    /// and an empty slice is a no-op.
    #[test]
    fn paging_in_changes_no_byte() {
        let mut f = tempfile::tempfile().unwrap();
        let data: Vec<u8> = (0..3 * 4096 + 17).map(|i| (i * 7 % 251) as u8).collect();
        f.write_all(&data).unwrap();
        // SAFETY: a private temporary file no one else writes while it is mapped.
        let map = unsafe { memmap2::Mmap::map(&f) }.unwrap();
        page_in(&map);
        page_in(&map[4097..9000]);
        page_in(&map[..0]);
        assert_eq!(&map[..], &data[..]);
    }
}
