//! The row-grouped copies of a model's weights (`crate::grouped`) kept on disk between runs, in
//! the cache's `grouped/` folder, so a start maps them instead of repacking.
//!
//! Why: repacking ran on the way to the first token. On the Qwen2.5-0.5B shape (0.9 GB grouped:
//! gate, up and down of every layer and the tied token table) it took 0.14-0.22 s of a 0.25 s
//! one-token run on a 2-core Zen 4 EPYC: ~5 GB/s of packing per thread and the kernel zeroing
//! the anonymous huge pages first. A file mapped from the page cache costs page-table entries
//! only, and its pages are shared between processes and reclaimable like the weights' own.
//!
//! A file is `DATA_START` bytes of header (magic, format version, the digest of what it
//! holds, data length, the weight files' paths and state it was made from; the rest a hole),
//! then the grouped tensors at the offsets [`Layout`] gives. Its name comes from the weight
//! files' paths and the layout, so a changed model file replaces its copy rather than adding
//! one; the digest adds the files' sizes,
//! modification times, devices and inodes ([`WeightSource::origin`]), and a copy whose header
//! or length disagrees is rebuilt. (The weights' bytes are not read for it: a tensor the
//! source reorders on first access would be copied whole just to be sampled.) Copies are
//! written to a temporary name, synced, then renamed, so no reader sees half a file; a write
//! that fails (a full disk) leaves nothing behind and the run goes on with its packed copy.
//!
//! A copy is as large as the model's large matrices (14 GB for a 7B model in bf16), so copies
//! that no longer serve a model are not left to pile up: each write removes the copies whose
//! weight files are gone or changed (their headers say which files, [`stale_copies`]), and
//! `kiln cache clean --stale` does the same on demand.

use crate::engine::WeightSource;
use kiln_core::grouped::{GROUP_ROWS, PieceOrder};
use kiln_core::{ModelSpec, WeightId};
use sha2::{Digest, Sha256};
use std::fs::File;
use std::io::Write;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::ptr::NonNull;

/// Format of the files; part of every digest and name. Version 2 records the origin; 3 stores
/// the gate and up projections as pairs (`kiln_core::grouped::GroupPair`), so copies of
/// version 2 are stale.
const VERSION: u32 = 3;
const MAGIC: &[u8; 8] = b"KILNGRP\0";
/// Where the data starts: a huge page, so the data maps in 2 MiB folios.
pub const DATA_START: usize = 2 << 20;
/// Each tensor starts on a page.
const TENSOR_ALIGN: usize = 4096;
/// The header's fixed part: magic, version, origin length, digest, data length.
const FIXED_HEADER: usize = 8 + 4 + 4 + 32 + 8;

/// Where each grouped tensor lies in the copy: `(id, order, offset of its first group,
/// length)` in weight order, and the length of it all (whole huge pages). The two tensors of a
/// pair ([`kiln_core::grouped::GroupPair`]) share one region of twice the length, the second's
/// first group one group after the first's.
pub struct Layout {
    pub tensors: Vec<(WeightId, PieceOrder, usize, usize)>,
    pub len: usize,
}

impl Layout {
    /// The tensors `spec` marks with `row_groups`, each (or each pair) at the next page
    /// boundary.
    pub fn of(spec: &ModelSpec) -> Layout {
        let mut at = 0;
        let mut tensors = Vec::new();
        for (id, t) in spec.weight_ids() {
            let Some(order) = t.row_groups else { continue };
            match t.group_pair {
                None => tensors.push((id, order, at, t.bytes())),
                Some(pair) if pair.second => continue,
                Some(pair) => {
                    tensors.push((id, order, at, t.bytes()));
                    tensors.push((pair.partner, order, at + GROUP_ROWS * t.row_bytes(), t.bytes()));
                }
            }
            at = (at + t.bytes() * t.group_pitch()).next_multiple_of(TENSOR_ALIGN);
        }
        Layout {
            tensors,
            len: at.next_multiple_of(DATA_START),
        }
    }

    /// The layout's own description: each tensor as the spec has it (name, shape, type, how
    /// its stored rows are rearranged, piece order), its place, and the Kiln version whose
    /// loaders rearranged it.
    fn describe(&self, spec: &ModelSpec, hash: &mut Sha256) {
        hash.update(env!("CARGO_PKG_VERSION").as_bytes());
        for &(id, _, at, len) in &self.tensors {
            hash.update(format!("{:?}|{at}|{len}\n", spec.weight(id)).as_bytes());
        }
    }
}

/// A copy's place in the cache and what it must hold.
pub struct Store {
    path: PathBuf,
    digest: [u8; 32],
    /// The weight files' paths, a NUL, then their state (`crate::origin`).
    origin: String,
}

impl Store {
    /// The store for `layout` of `source`'s weights in `folder`, or `None` for a source that
    /// exists only in this process (no [`WeightSource::origin`]).
    pub fn locate(folder: &Path, spec: &ModelSpec, layout: &Layout, source: &dyn WeightSource) -> Option<Store> {
        let (place, state) = source.origin()?;
        let mut name = Sha256::new();
        name.update(VERSION.to_le_bytes());
        name.update(place.as_bytes());
        layout.describe(spec, &mut name);
        let mut digest = name.clone();
        digest.update(state.as_bytes());
        let hex: String = name.finalize()[..16].iter().map(|b| format!("{b:02x}")).collect();
        Some(Store {
            path: folder.join(format!("{hex}.grp")),
            digest: digest.finalize().into(),
            origin: format!("{place}\0{state}"),
        })
    }

    fn header(&self, len: usize) -> Vec<u8> {
        let mut h = Vec::with_capacity(FIXED_HEADER + self.origin.len());
        h.extend_from_slice(MAGIC);
        h.extend_from_slice(&VERSION.to_le_bytes());
        h.extend_from_slice(&(self.origin.len() as u32).to_le_bytes());
        h.extend_from_slice(&self.digest);
        h.extend_from_slice(&(len as u64).to_le_bytes());
        h.extend_from_slice(self.origin.as_bytes());
        h
    }

    /// The stored copy of `len` data bytes, mapped read-only and paged in by `threads`
    /// threads; `None` when there is none or it is not exactly the copy this store names.
    pub fn open(&self, len: usize, threads: usize) -> Option<MappedCopy> {
        let file = File::open(&self.path).ok()?;
        let want = self.header(len);
        let mut got = vec![0u8; want.len()];
        file.read_exact_at(&mut got, 0).ok()?;
        if got != want || file.metadata().ok()?.len() != (DATA_START + len) as u64 {
            return None;
        }
        let copy = MappedCopy::map(&file, DATA_START + len)?;
        copy.page_in(threads);
        Some(copy)
    }

    /// Starts this store's copy of `len` data bytes: makes the folder, removes abandoned
    /// temporary copies and stale copies, and creates the temporary file with the header, so
    /// that what can fail at once (an unwritable cache) fails here, before the model runs; the
    /// data follow with [`CopyWriter::finish`], which may run on another thread. `None` for a
    /// cache that may not be written (a read-only mount, another user's folder): not an error,
    /// it serves the copies it has, as it serves libraries.
    pub fn begin(&self, len: usize) -> Result<Option<CopyWriter>, String> {
        let folder = self.path.parent().ok_or("no folder")?;
        let header = self.header(len);
        if header.len() > DATA_START {
            return Err(format!(
                "{}: the weight files' paths do not fit its header",
                self.path.display()
            ));
        }
        std::fs::create_dir_all(folder).map_err(|e| format!("{}: {e}", folder.display()))?;
        remove_abandoned(&self.path);
        for (stale, _) in stale_copies(folder) {
            if stale != self.path {
                let _ = std::fs::remove_file(stale);
            }
        }
        let tmp = self.path.with_extension(format!("tmp-{}", std::process::id()));
        let created = File::create(&tmp).and_then(|mut f| f.write_all(&header).map(|()| f));
        match created {
            Ok(file) => Ok(Some(CopyWriter {
                file,
                tmp,
                path: self.path.clone(),
                len,
            })),
            Err(e) => {
                let _ = std::fs::remove_file(&tmp);
                match e.kind() {
                    std::io::ErrorKind::ReadOnlyFilesystem | std::io::ErrorKind::PermissionDenied => Ok(None),
                    _ => Err(format!("{}: {e}", self.path.display())),
                }
            }
        }
    }
}

/// A copy being written: its temporary file, header written ([`Store::begin`]).
pub struct CopyWriter {
    file: File,
    tmp: PathBuf,
    path: PathBuf,
    len: usize,
}

impl CopyWriter {
    /// Writes the data (`len` bytes, as begun), syncs the file, drops its pages from the page
    /// cache (the next start maps it read back in huge folios) and renames it over the copy's
    /// name, so no reader sees half a file. On failure (a full disk) the temporary file is
    /// removed and the error returned; the run goes on with its packed copy.
    pub fn finish(self, data: &[u8]) -> Result<(), String> {
        assert_eq!(data.len(), self.len, "the length the copy was begun with");
        let written = (|| {
            self.file.write_all_at(data, DATA_START as u64)?;
            self.file.sync_all()?;
            drop_page_cache(&self.file);
            std::fs::rename(&self.tmp, &self.path)
        })();
        written.map_err(|e| {
            let _ = std::fs::remove_file(&self.tmp);
            format!("{}: {e}", self.path.display())
        })
    }
}

/// The copies in `folder` that serve no model any more, with their sizes: those whose weight
/// files are gone or changed, those in an older format (no build reads them: the format is
/// part of every name), and files there that are not copies at all. A copy in a newer format is
/// left to the build that wrote it. A process that still maps a copy removed here keeps
/// reading it (the file lives on until it is unmapped).
pub fn stale_copies(folder: &Path) -> Vec<(PathBuf, u64)> {
    let Ok(entries) = std::fs::read_dir(folder) else {
        return Vec::new();
    };
    entries
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "grp") && is_stale(p))
        .map(|p| {
            let len = std::fs::metadata(&p).map(|m| m.len()).unwrap_or(0);
            (p, len)
        })
        .collect()
}

fn is_stale(path: &Path) -> bool {
    let Ok(file) = File::open(path) else {
        return false;
    };
    let mut fixed = [0u8; FIXED_HEADER];
    if file.read_exact_at(&mut fixed, 0).is_err() || &fixed[..8] != MAGIC {
        return true;
    }
    let word = |at: usize| u32::from_le_bytes(fixed[at..at + 4].try_into().expect("4 bytes"));
    match word(8).cmp(&VERSION) {
        std::cmp::Ordering::Less => return true,
        std::cmp::Ordering::Greater => return false,
        std::cmp::Ordering::Equal => {}
    }
    let mut origin = vec![0u8; (word(12) as usize).min(DATA_START)];
    if file.read_exact_at(&mut origin, FIXED_HEADER as u64).is_err() {
        return true;
    }
    let Some((place, state)) = std::str::from_utf8(&origin).ok().and_then(|o| o.split_once('\0')) else {
        return true;
    };
    crate::origin::current_state(place).as_deref() != Some(state)
}

/// Removes the temporary files of `path` (`<name>.tmp-<pid>`) that a process no longer running
/// left (killed while writing its copy, which can be as large as the model), so they do not
/// pile up in the cache. Best effort.
fn remove_abandoned(path: &Path) {
    let (Some(folder), Some(stem)) = (path.parent(), path.file_stem().and_then(|s| s.to_str())) else {
        return;
    };
    let Ok(entries) = std::fs::read_dir(folder) else {
        return;
    };
    let prefix = format!("{stem}.tmp-");
    for entry in entries.flatten() {
        let name = entry.file_name();
        let pid = name
            .to_str()
            .and_then(|n| n.strip_prefix(&prefix))
            .and_then(|p| p.parse::<u32>().ok());
        if pid.is_some_and(|pid| !Path::new(&format!("/proc/{pid}")).exists()) {
            let _ = std::fs::remove_file(entry.path());
        }
    }
}

/// Asks the kernel to drop a synced file's cached pages (best effort).
fn drop_page_cache(f: &File) {
    use std::os::fd::AsRawFd;
    // SAFETY: advice on an open descriptor; it changes no memory of this process.
    unsafe {
        libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED);
    }
}

/// A stored copy mapped read-only; the data starts [`DATA_START`] bytes in.
pub struct MappedCopy {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: a read-only shared mapping, never written through and unmapped only on drop.
unsafe impl Send for MappedCopy {}
// SAFETY: as for `Send`: every access is a read.
unsafe impl Sync for MappedCopy {}

impl MappedCopy {
    fn map(file: &File, len: usize) -> Option<MappedCopy> {
        use std::os::fd::AsRawFd;
        // SAFETY: a fresh read-only shared mapping of `len` bytes of an open file (its length
        // was checked to be `len`); the kernel picks the address.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return None;
        }
        // SAFETY: advice on the mapping just made; huge folios where the file system has them.
        unsafe { libc::madvise(ptr, len, libc::MADV_HUGEPAGE) };
        Some(MappedCopy {
            ptr: NonNull::new(ptr as *mut u8)?,
            len,
        })
    }

    /// The first data byte.
    pub fn data(&self) -> *const u8 {
        self.ptr.as_ptr().wrapping_add(DATA_START)
    }

    /// Maps every page now, in 16 MiB chunks that `threads` threads claim in turn, rather than
    /// at the kernels' first reads (as the loaders page in the weight files: not a copy of more
    /// than half the memory, which would only push other pages out).
    fn page_in(&self, threads: usize) {
        const CHUNK: usize = 16 << 20;
        if !kiln_core::pages::paged_in_ahead(self.len as u64, kiln_core::budget::physical_memory()) {
            return;
        }
        // SAFETY: the whole mapping, readable and alive as long as `self`.
        let bytes = unsafe { std::slice::from_raw_parts(self.ptr.as_ptr() as *const u8, self.len) };
        let chunks: Vec<&[u8]> = bytes.chunks(CHUNK).collect();
        let next = std::sync::atomic::AtomicUsize::new(0);
        std::thread::scope(|s| {
            for _ in 0..threads.max(1) {
                s.spawn(|| {
                    while let Some(c) = chunks.get(next.fetch_add(1, std::sync::atomic::Ordering::Relaxed)) {
                        kiln_core::pages::page_in(c);
                    }
                });
            }
        });
    }
}

impl Drop for MappedCopy {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `map`, unmapped once; no pointer into it outlives the
        // `GroupedWeights` that owns it.
        unsafe { libc::munmap(self.ptr.as_ptr() as *mut libc::c_void, self.len) };
    }
}

#[cfg(test)]
#[path = "grouped_store_tests.rs"]
mod tests;
