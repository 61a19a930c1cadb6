//! Asking the kernel to map a file mapping's pages before their first read, shared by the
//! loaders (the weight files, `kiln_formats::page_in`) and the engine (the row-grouped copy
//! kept in the cache).

use crate::budget::physical_memory;

/// Whether `bytes` of mappings are paged in ahead of use on a machine of `memory` bytes (0:
/// unknown): not more than half of it, where mapping them all would only push other pages out
/// (and pages the kernels never read, such as the source of a row-grouped copy, would stay).
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

/// The system's page size (4 KiB where it cannot be read).
fn page_size() -> usize {
    // SAFETY: sysconf reads a constant of the system; no memory is passed.
    let size = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if size > 0 { size as usize } else { 4096 }
}
