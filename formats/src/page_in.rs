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
//!
//! How the pages are mapped matters as much. A file's page cache written by `write` (a
//! download, a converter) is held in small folios, so every 4 KiB of weights takes its own
//! page-table entry: populating a cached 1 GB file took ~45 ms, and a two-thread read of the
//! mapping ran 10-15 % slower than of a huge-page mapping of the same bytes. Read back from
//! disk into a mapping marked `MADV_HUGEPAGE`, the kernel (Linux 6.x, on file systems with
//! large folios) caches it in 2 MiB folios, mapped one page-table entry each. So the loaders
//! mark their mappings, and when a large file turns out to be mapped mostly in small pages,
//! [`Pager::settle`] drops its page cache and reads it back once, 16 MiB at a time (pages not
//! yet written back are written first, or they could not be dropped), leaving a mark so a
//! system that cannot do better re-reads no file twice; a chunk slower than
//! `REREAD_MIN_BYTES_PER_SEC` (a spinning disk) ends it, so the cost stays near one chunk.
//! Measured on a 2-core EPYC (Zen 5, Linux 6.18, ext4), fresh copies of the Qwen2.5-0.5B
//! shape, 16-token prompt, process start to first token (medians of 7): 0.117 -> 0.090 s from
//! the bf16 folder, 0.143 -> 0.093 s from its GGUF (llama.cpp, reading the same page cache,
//! 0.327 -> 0.262 s); the one re-read cost the first start 0.6-0.7 s (GGUF) and 0.8-1.1 s
//! (folder), copies just written included.

use kiln_core::budget::physical_memory;
pub use kiln_core::pages::page_in;
use std::fs::File;
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};

/// One mapped weight file: the whole mapping and the open file it was made from.
#[derive(Clone, Copy)]
pub struct Mapped<'a> {
    pub bytes: &'a [u8],
    pub file: &'a File,
}

/// Pages in a set of mapped files in chunks that any number of threads claim in turn: each
/// [`Pager::work`] call returns when no chunk is left unclaimed.
pub struct Pager<'a> {
    files: Vec<Mapped<'a>>,
    /// Bytes of all the files.
    total: u64,
    chunks: Vec<&'a [u8]>,
    next: AtomicUsize,
}

/// Files smaller than this in all are left as they are mapped: a re-read would cost more than
/// their page-table entries.
const SETTLE_MIN_BYTES: u64 = 64 << 20;

/// Bytes per claim: small enough that two threads end together, large enough that claiming
/// costs nothing next to mapping (16 MiB is ~1 ms of `MADV_POPULATE_READ`).
const CHUNK: usize = 16 << 20;

impl<'a> Pager<'a> {
    /// A pager for `files` (each mapping marked for huge pages); nothing to page in when they
    /// are more than half the machine's memory, where mapping them all would only push other
    /// pages out.
    pub fn new(files: impl IntoIterator<Item = Mapped<'a>>) -> Pager<'a> {
        let files: Vec<Mapped> = files.into_iter().collect();
        for f in &files {
            advise_huge(f.bytes);
        }
        let total: u64 = files.iter().map(|f| f.bytes.len() as u64).sum();
        let chunks = if !kiln_core::pages::paged_in_ahead(total, physical_memory()) {
            Vec::new()
        } else {
            files.iter().flat_map(|f| f.bytes.chunks(CHUNK)).collect()
        };
        Pager {
            files,
            total,
            chunks,
            next: AtomicUsize::new(0),
        }
    }

    /// After [`Pager::work`]: where the files are large and mostly mapped in small pages, reads
    /// each back once for huge pages (see the module documentation), remembering it in
    /// `marks` (a folder; without one nothing is re-read, since nothing would stop it from
    /// happening at every start). Returns how many files were re-read. Best effort: any
    /// failure leaves the pages as they are.
    pub fn settle(&self, marks: Option<&Path>) -> usize {
        let Some(marks) = marks else { return 0 };
        if self.chunks.is_empty() || self.total < SETTLE_MIN_BYTES || !huge_pages_possible() {
            return 0;
        }
        // Reading smaps walks every page table of the process (10-20 ms of a 0.14 s cached
        // start of the 0.5B shape, measured with `perf`), so files settled at an earlier
        // start, re-read or found in huge pages already, are not judged again.
        let unsettled: Vec<&Mapped> = self.files.iter().filter(|f| !marked(f, marks)).collect();
        if unsettled.is_empty() {
            return 0;
        }
        if file_pmd_mapped().is_some_and(|huge| mostly_small(self.total, huge)) {
            reread_once(&self.files, marks)
        } else {
            mark_settled(&unsettled, marks);
            0
        }
    }

    /// Pages in chunks until none is left.
    pub fn work(&self) {
        while let Some(chunk) = self.chunks.get(self.next.fetch_add(1, Ordering::Relaxed)) {
            page_in(chunk);
        }
    }
}

/// Whether `huge` bytes of file pages mapped with huge pages, of `total` mapped, leave most of
/// them in small pages.
fn mostly_small(total: u64, huge: u64) -> bool {
    huge < total / 2
}

/// Drops the page cache of each file without a mark in `marks` and maps it back in, for huge
/// pages; marks each first (a file whose mark cannot be written is left alone). Returns how
/// many files were re-read.
fn reread_once(files: &[Mapped], marks: &Path) -> usize {
    if std::fs::create_dir_all(marks).is_err() {
        return 0;
    }
    let mut reread = 0;
    for f in files {
        let Some(mark) = mark_name(f.file).map(|m| marks.join(m)) else {
            continue;
        };
        let fresh = std::fs::OpenOptions::new().write(true).create_new(true).open(&mark);
        if fresh.is_err() {
            continue;
        }
        reread += 1;
        if !reread_file(f) {
            break;
        }
    }
    reread
}

/// Whether `f` has its mark in `marks`: it was settled at an earlier start.
fn marked(f: &Mapped, marks: &Path) -> bool {
    mark_name(f.file).is_some_and(|m| marks.join(m).exists())
}

/// Marks `files` settled without re-reading them: they are mapped in huge pages already.
/// Best effort: a mark that cannot be written only means the check is made again next time.
fn mark_settled(files: &[&Mapped], marks: &Path) {
    if std::fs::create_dir_all(marks).is_err() {
        return;
    }
    for name in files.iter().filter_map(|f| mark_name(f.file)) {
        let _ = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(marks.join(name));
    }
}

/// The slowest re-read worth finishing: a chunk that comes back slower than this (a spinning
/// disk, a network file system) ends the re-read and leaves the rest of the page cache as it
/// is, so the one-time cost stays near one chunk's read at such a disk's rate.
const REREAD_MIN_BYTES_PER_SEC: f64 = 400e6;

/// Drops `f`'s pages and reads them back a chunk at a time; false when a chunk came back
/// slower than [`REREAD_MIN_BYTES_PER_SEC`] (the rest stays as it was).
fn reread_file(f: &Mapped) -> bool {
    for chunk in f.bytes.chunks(CHUNK) {
        let started = std::time::Instant::now();
        drop_pages(f, chunk);
        page_in(chunk);
        if chunk.len() as f64 / started.elapsed().as_secs_f64().max(1e-9) < REREAD_MIN_BYTES_PER_SEC {
            return false;
        }
    }
    true
}

/// A file's mark: its device, inode, size and modification time, so a rewritten file (a new
/// download under the same name) is a new file.
fn mark_name(file: &File) -> Option<String> {
    use std::os::unix::fs::MetadataExt as _;
    let m = file.metadata().ok()?;
    Some(format!(
        "{:x}-{:x}-{:x}-{:x}.{:x}",
        m.dev(),
        m.ino(),
        m.size(),
        m.mtime(),
        m.mtime_nsec()
    ))
}

/// Unmaps this process's pages of `range` (a chunk of `f.bytes` starting on a page) and drops
/// the file's page cache there (the pages no other process maps), so the next touch reads it
/// back from the file.
fn drop_pages(f: &Mapped, range: &[u8]) {
    use std::os::fd::AsRawFd as _;
    let offset = range.as_ptr() as usize - f.bytes.as_ptr() as usize;
    // SAFETY: `range` lies within the mapping `f.bytes` borrows, which stays mapped for the
    // call, and starts on a page (mappings start page aligned, chunks are whole pages). It is a
    // read-only file mapping that nothing wrote, so dropping its page-table entries loses
    // nothing: the next read maps the same bytes of the unchanged file again.
    unsafe { libc::madvise(range.as_ptr() as *mut libc::c_void, range.len(), libc::MADV_DONTNEED) };
    let (fd, at, len) = (f.file.as_raw_fd(), offset as libc::off_t, range.len() as libc::off_t);
    // Pages not yet written back (a file just downloaded) cannot be dropped: write them first.
    let write = libc::SYNC_FILE_RANGE_WAIT_BEFORE | libc::SYNC_FILE_RANGE_WRITE | libc::SYNC_FILE_RANGE_WAIT_AFTER;
    // SAFETY: both act on the open file's cached pages in the range; no memory is passed.
    unsafe {
        libc::sync_file_range(fd, at, len, write);
        libc::posix_fadvise(fd, at, len, libc::POSIX_FADV_DONTNEED);
    }
}

/// Marks a mapping for huge pages (best effort): pages read from the file into it are cached
/// in huge folios where the kernel and file system can.
fn advise_huge(bytes: &[u8]) {
    if bytes.is_empty() {
        return;
    }
    // SAFETY: `bytes` is a whole mapping (page aligned) that stays mapped for the call;
    // MADV_HUGEPAGE changes only how its pages are mapped, never their contents.
    unsafe { libc::madvise(bytes.as_ptr() as *mut libc::c_void, bytes.len(), libc::MADV_HUGEPAGE) };
}

/// Whether transparent huge pages are on (`always` or `madvise`).
fn huge_pages_possible() -> bool {
    std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled").is_ok_and(|s| !s.contains("[never]"))
}

/// Bytes of file pages this process maps with huge pages (`FilePmdMapped` of
/// `/proc/self/smaps_rollup`).
fn file_pmd_mapped() -> Option<u64> {
    let rollup = std::fs::read_to_string("/proc/self/smaps_rollup").ok()?;
    parse_pmd_mapped(&rollup)
}

fn parse_pmd_mapped(rollup: &str) -> Option<u64> {
    let line = rollup.lines().find(|l| l.starts_with("FilePmdMapped:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write as _;

    /// A private temporary file of `len` patterned bytes, mapped, and the bytes.
    fn mapped_temp(len: usize) -> (File, memmap2::Mmap, Vec<u8>) {
        let mut f = tempfile::tempfile().unwrap();
        let data: Vec<u8> = (0..len).map(|i| (i * 7 % 251) as u8).collect();
        f.write_all(&data).unwrap();
        // SAFETY: a private temporary file no one else writes while it is mapped.
        let map = unsafe { memmap2::Mmap::map(&f) }.unwrap();
        (f, map, data)
    }

    /// Re-reading a file for huge pages leaves its bytes as they are, happens once per file
    /// (its mark), and not at all without a folder for marks.
    #[test]
    fn a_file_is_read_back_once_and_unchanged() {
        let (f, map, data) = mapped_temp(5 * 4096 + 3);
        let marks = tempfile::tempdir().unwrap();
        let files = [Mapped { bytes: &map, file: &f }];
        advise_huge(&map);
        assert_eq!(reread_once(&files, marks.path()), 1);
        assert_eq!(&map[..], &data[..]);
        assert_eq!(reread_once(&files, marks.path()), 0, "a marked file is not read again");
        assert_eq!(std::fs::read_dir(marks.path()).unwrap().count(), 1);
        let pager = Pager::new(files);
        pager.work();
        assert_eq!(pager.settle(None), 0);
        assert_eq!(&map[..], &data[..]);
    }

    /// A file found in huge pages is marked settled like a re-read one: it is not judged (nor
    /// read back) at a later start.
    #[test]
    fn a_file_settled_in_huge_pages_is_not_read_back_later() {
        let (f, map, data) = mapped_temp(3 * 4096);
        let marks = tempfile::tempdir().unwrap();
        let file = Mapped { bytes: &map, file: &f };
        assert!(!marked(&file, marks.path()));
        mark_settled(&[&file], &marks.path().join("sub"));
        assert!(marked(&file, &marks.path().join("sub")));
        assert_eq!(reread_once(&[file], &marks.path().join("sub")), 0);
        assert_eq!(&map[..], &data[..]);
    }

    /// Only files mapped mostly in small pages are read back, and `FilePmdMapped` is read in
    /// bytes from the kernel's KiB.
    #[test]
    fn small_pages_are_judged_from_smaps_rollup() {
        assert!(mostly_small(1 << 30, 100 << 20));
        assert!(!mostly_small(1 << 30, 900 << 20));
        let rollup = "Rss: 10 kB\nFilePmdMapped:    2048 kB\nShared_Hugetlb: 0 kB\n";
        assert_eq!(parse_pmd_mapped(rollup), Some(2 << 20));
        assert_eq!(parse_pmd_mapped("Rss: 1 kB\n"), None);
    }

    /// Paging in a file mapping leaves its bytes as they are (any sub-range, aligned or not),
    /// and an empty slice is a no-op.
    #[test]
    fn paging_in_changes_no_byte() {
        let (_f, map, data) = mapped_temp(3 * 4096 + 17);
        page_in(&map);
        page_in(&map[4097..9000]);
        page_in(&map[..0]);
        assert_eq!(&map[..], &data[..]);
    }
}
