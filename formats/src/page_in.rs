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

/// How a loader pages a model's weights in while it builds the tokenizer.
#[derive(Clone, Copy, Debug, Default)]
pub struct PageIn<'a> {
    /// Where marks of files settled for huge pages are kept ([`Pager::settle`]); `None` reads
    /// no file back.
    pub marks: Option<&'a Path>,
    /// The f32 lanes of the code that will run the model. The tensors
    /// `ModelSpec::group_rows` marks at that width are read from their row-grouped copy
    /// (kept in the cache, or packed from them as the start reads them), so their bytes are
    /// not paged in: on a cached start of the 0.5B shape that was ~0.9 GB of the 1.1 GB file
    /// and ~18 ms of its ~0.13 s to the first token (2-core Zen 4). `None` pages all in.
    pub grouping_lanes: Option<usize>,
}

impl PageIn<'_> {
    /// The address ranges of `spec`'s tensors that will be read from a row-grouped copy, where
    /// `range` finds a tensor's bytes by name.
    pub fn copied(
        &self,
        spec: &kiln_core::ModelSpec,
        range: impl Fn(&str) -> Option<(usize, usize)>,
    ) -> Vec<(usize, usize)> {
        let Some(lanes) = self.grouping_lanes else {
            return Vec::new();
        };
        let mut marked = spec.clone();
        marked.group_rows(lanes, kiln_core::Precision::Exact, physical_memory());
        marked
            .weights
            .iter()
            .filter(|t| t.row_groups.is_some())
            .filter_map(|t| range(&t.name))
            .collect()
    }
}

/// Pages in a set of mapped files in chunks that any number of threads claim in turn: each
/// [`Pager::work`] call returns when no chunk is left unclaimed.
pub struct Pager<'a> {
    files: Vec<Mapped<'a>>,
    /// Bytes paged in.
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
    /// A pager for `files` (each mapping marked for huge pages) but the whole huge pages
    /// inside `skipped` (address ranges: tensors read from a copy, [`PageIn::copied`]);
    /// nothing to page in when that is more than half the machine's memory, where mapping it
    /// all would only push other pages out.
    pub fn new(files: impl IntoIterator<Item = Mapped<'a>>, skipped: Vec<(usize, usize)>) -> Pager<'a> {
        let files: Vec<Mapped> = files.into_iter().collect();
        for f in &files {
            advise_huge(f.bytes);
        }
        let spans = kiln_core::pages::aligned_spans(skipped);
        let parts: Vec<&[u8]> = files.iter().flat_map(|f| outside(f.bytes, &spans)).collect();
        let total: u64 = parts.iter().map(|p| p.len() as u64).sum();
        let chunks = if !kiln_core::pages::paged_in_ahead(total, physical_memory()) {
            Vec::new()
        } else {
            parts.iter().flat_map(|p| p.chunks(CHUNK)).collect()
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

/// The parts of `bytes` outside `spans` (sorted, disjoint address ranges), in order.
fn outside<'a>(bytes: &'a [u8], spans: &[(usize, usize)]) -> Vec<&'a [u8]> {
    let base = bytes.as_ptr() as usize;
    let (mut parts, mut at) = (Vec::new(), 0);
    for &(start, len) in spans {
        let (from, to) = (start.saturating_sub(base), (start + len).saturating_sub(base));
        if to == 0 || from >= bytes.len() {
            continue;
        }
        if from > at {
            parts.push(&bytes[at..from]);
        }
        at = at.max(to.min(bytes.len()));
    }
    if at < bytes.len() {
        parts.push(&bytes[at..]);
    }
    parts
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
        let pager = Pager::new(files, Vec::new());
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

    /// Invariant: the pager leaves out exactly the spans given (inside the file or across
    /// its ends) and pages everything else in order.
    #[test]
    fn the_parts_outside_the_skipped_spans_are_paged() {
        let bytes = vec![0u8; 100];
        let base = bytes.as_ptr() as usize;
        let lens = |parts: Vec<&[u8]>| {
            parts
                .iter()
                .map(|p| (p.as_ptr() as usize - base, p.len()))
                .collect::<Vec<_>>()
        };
        assert_eq!(lens(outside(&bytes, &[])), [(0, 100)]);
        assert_eq!(
            lens(outside(&bytes, &[(base + 10, 20), (base + 50, 10)])),
            [(0, 10), (30, 20), (60, 40)]
        );
        assert_eq!(lens(outside(&bytes, &[(base - 5, 10), (base + 90, 50)])), [(5, 85)]);
        assert_eq!(lens(outside(&bytes, &[(base - 5, 200)])), []);
        assert_eq!(lens(outside(&bytes, &[(base + 200, 10)])), [(0, 100)]);
    }

    /// Invariant: the tensors left out of paging in are exactly those `group_rows` marks at
    /// the lanes given (here every bf16 matrix of the small Llama, its gate and up among them),
    /// and none without lanes.
    #[test]
    fn copied_tensors_are_the_ones_group_rows_marks() {
        let config = serde_json::json!({
            "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 144,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "vocab_size": 96
        });
        let arch = kiln_core::arch::by_hf_name("LlamaForCausalLM").unwrap();
        let map = config.as_object().unwrap();
        let mut spec = kiln_core::arch::build(arch, &kiln_core::arch::HfConfig::new(map)).unwrap();
        for t in spec.weights.iter_mut() {
            t.dtype = kiln_core::DType::BF16;
        }
        let index = |name: &str| spec.weights.iter().position(|t| t.name == name);
        let lanes = PageIn {
            marks: None,
            grouping_lanes: Some(16),
        };
        let copied: Vec<usize> = lanes
            .copied(&spec, |n| index(n).map(|i| (i, 1)))
            .into_iter()
            .map(|r| r.0)
            .collect();
        let mut marked = spec.clone();
        marked.group_rows(16, kiln_core::Precision::Exact, 0);
        let want: Vec<usize> = (0..spec.weights.len())
            .filter(|&i| marked.weights[i].row_groups.is_some())
            .collect();
        assert!(
            want.iter().any(|&i| spec.weights[i].name.contains("gate_proj")),
            "{want:?}"
        );
        assert_eq!(copied, want);
        assert!(PageIn::default().copied(&spec, |n| index(n).map(|i| (i, 1))).is_empty());
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
