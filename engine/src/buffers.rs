//! Activation buffers and the KV cache: zeroed, 64-byte aligned allocations made once when an
//! engine is created, never on the token path.

use kiln_core::spec::{BufId, ModelSpec, Rows};
use std::alloc::{Layout, alloc_zeroed, dealloc};
use std::ptr::NonNull;

/// Alignment of every buffer: a cache line, and the widest vector load.
const ALIGN: usize = 64;

/// Buffers at least this large are mapped straight from the kernel: their pages are zero
/// until first written and cost nothing until then. (The global allocator zeroes an
/// over-aligned allocation with memset, touching every page: for a KV cache of 4096 positions
/// that was most of a warm start.)
const MAP_THRESHOLD: usize = 1 << 20;

/// A zeroed, aligned allocation: from the heap, or for large sizes an anonymous mapping.
pub struct AlignedBuf {
    ptr: NonNull<u8>,
    layout: Layout,
    mapped: bool,
}

// SAFETY: the buffer is plain memory owned by this value; concurrent access is coordinated by
// the pool's barriers (kernels write disjoint parts between barriers).
unsafe impl Send for AlignedBuf {}
// SAFETY: as for `Send`: shared access never writes except through kernels the barriers order.
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    pub fn zeroed(bytes: usize) -> AlignedBuf {
        Self::with_align(bytes, ALIGN, false, false)
    }
    /// Like [`AlignedBuf::zeroed`], but for a large buffer of which only a part may ever be
    /// touched: the address space is reserved without committing memory for it
    /// (`MAP_NORESERVE`), and pages are backed only once written.
    pub fn reserved(bytes: usize) -> AlignedBuf {
        Self::with_align(bytes, ALIGN, false, true)
    }
    /// Like [`AlignedBuf::zeroed`], 2 MiB aligned and advised to use transparent huge pages
    /// (fewer TLB misses when a large buffer is streamed).
    pub fn zeroed_huge(bytes: usize) -> AlignedBuf {
        const HUGE: usize = 2 << 20;
        if bytes < HUGE {
            return AlignedBuf::zeroed(bytes);
        }
        Self::with_align(bytes.next_multiple_of(HUGE), HUGE, true, false)
    }

    fn with_align(bytes: usize, align: usize, huge: bool, noreserve: bool) -> AlignedBuf {
        Self::try_with_align(bytes, align, huge, noreserve).unwrap_or_else(|| {
            let layout = Layout::from_size_align(bytes.max(ALIGN), align).expect("buffer size fits in isize");
            std::alloc::handle_alloc_error(layout)
        })
    }

    /// [`AlignedBuf::zeroed`], or `None` when the memory cannot be had: for the buffers sized
    /// by command-line choices (`--prefill-block`, `--ctx`, `--parallel`), which must fail with
    /// an error that names them, not abort the process.
    pub fn try_zeroed(bytes: usize) -> Option<AlignedBuf> {
        Self::try_with_align(bytes, ALIGN, false, false)
    }
    /// [`AlignedBuf::reserved`], or `None` when the address space cannot be had.
    pub fn try_reserved(bytes: usize) -> Option<AlignedBuf> {
        Self::try_with_align(bytes, ALIGN, false, true)
    }

    fn try_with_align(bytes: usize, align: usize, huge: bool, noreserve: bool) -> Option<AlignedBuf> {
        let layout = Layout::from_size_align(bytes.max(ALIGN), align).ok()?;
        #[cfg(target_os = "linux")]
        if layout.size() >= MAP_THRESHOLD {
            // Over-allocate by the alignment so an aligned start always fits, then give the
            // slack back; the kernel's pages are 4 KiB aligned already, enough below that.
            let slack = align.saturating_sub(4096);
            let len = layout.size() + slack;
            // SAFETY: an anonymous private mapping with no address hint; checked below.
            let raw = unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    len,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | if noreserve { libc::MAP_NORESERVE } else { 0 },
                    -1,
                    0,
                )
            };
            if raw != libc::MAP_FAILED {
                let start = (raw as usize).next_multiple_of(align);
                let head = start - raw as usize;
                let tail = len - head - layout.size();
                // SAFETY: unmapping the unused ends of the mapping just made; `huge` only
                // advises the kernel about a range we own (failure means no huge pages).
                unsafe {
                    if head > 0 {
                        libc::munmap(raw, head);
                    }
                    if tail > 0 {
                        libc::munmap((start + layout.size()) as *mut libc::c_void, tail);
                    }
                    if huge {
                        libc::madvise(start as *mut libc::c_void, layout.size(), libc::MADV_HUGEPAGE);
                    }
                }
                let ptr = NonNull::new(start as *mut u8).expect("mmap does not return null");
                return Some(AlignedBuf {
                    ptr,
                    layout,
                    mapped: true,
                });
            }
        }
        let _ = (huge, noreserve);
        // SAFETY: the layout has non-zero size.
        let raw = unsafe { alloc_zeroed(layout) };
        let ptr = NonNull::new(raw)?;
        Some(AlignedBuf {
            ptr,
            layout,
            mapped: false,
        })
    }
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }
    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.ptr.as_ptr()
    }
    pub fn bytes(&self) -> usize {
        self.layout.size()
    }
    /// Whether the buffer is an anonymous mapping of its own (not part of the heap).
    pub fn is_mapped(&self) -> bool {
        self.mapped
    }
    /// The contents as f32 values (the first `len` of them).
    pub fn f32s(&self, len: usize) -> &[f32] {
        assert!(len * 4 <= self.layout.size());
        // SAFETY: in bounds (checked), aligned to 64, initialised (zeroed at allocation).
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr() as *const f32, len) }
    }
    pub fn f32s_mut(&mut self, len: usize) -> &mut [f32] {
        assert!(len * 4 <= self.layout.size());
        // SAFETY: in bounds, aligned, initialised; `&mut self` guarantees exclusive access.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr() as *mut f32, len) }
    }
    /// Copies `len` bytes at `from` to `to` within the buffer (the ranges may overlap).
    pub fn copy_within(&mut self, from: usize, to: usize, len: usize) {
        let size = self.layout.size();
        // SAFETY: the whole allocation is initialised (zeroed at allocation) and `&mut self`
        // guarantees exclusive access; `copy_within` checks both ranges against it.
        let bytes = unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), size) };
        bytes.copy_within(from..from + len, to);
    }
    pub fn i32s_mut(&mut self, len: usize) -> &mut [i32] {
        assert!(len * 4 <= self.layout.size());
        // SAFETY: as above, and `&mut self` guarantees exclusive access.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr() as *mut i32, len) }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        #[cfg(target_os = "linux")]
        if self.mapped {
            // SAFETY: `ptr..ptr + size` is exactly what `with_align` kept of its mapping.
            unsafe { libc::munmap(self.ptr.as_ptr() as *mut libc::c_void, self.layout.size()) };
            return;
        }
        // SAFETY: allocated in `with_align` with this exact layout.
        unsafe { dealloc(self.ptr.as_ptr(), self.layout) }
    }
}

/// A buffer the engine could not allocate.
#[derive(Debug, thiserror::Error)]
#[error(
    "cannot allocate the {buffer} buffer: {rows} rows, {bytes} bytes (a smaller --prefill-block, --ctx or --parallel needs less)"
)]
pub struct OutOfMemory {
    pub buffer: String,
    pub rows: usize,
    pub bytes: usize,
}

/// Every buffer the spec declares: activations sized for `block_rows` rows (the logits for the
/// few rows the head computes at once), and K and V caches of `slots` sequences of `ctx` usable
/// positions per layer.
pub struct Buffers {
    bufs: Vec<AlignedBuf>,
    row_bytes: Vec<usize>,
    pub block_rows: usize,
    pub ctx: usize,
    pub slots: usize,
}

impl Buffers {
    ///
    /// A buffer that cannot be allocated is an error naming it and its size ([`OutOfMemory`]):
    /// the sizes follow `--prefill-block`, `--ctx` and `--parallel`, so a value too large for
    /// this machine must not abort the process.
    pub fn new(spec: &ModelSpec, block_rows: usize, ctx: usize, slots: usize) -> Result<Buffers, OutOfMemory> {
        let mut bufs = Vec::with_capacity(spec.buffers.len());
        let mut row_bytes = Vec::with_capacity(spec.buffers.len());
        for b in &spec.buffers {
            let row = b.row_bytes();
            row_bytes.push(row);
            // The caches are slot-major, then head-major (`[slots, kv_heads, capacity,
            // head_dim]`) with the capacity the kernels were compiled for, the model's own
            // limit; the engine uses only the first `ctx` positions of each head of the `slots`
            // sequences it serves, so only those pages are ever backed by memory. A recurrent
            // state is one row per slot, of a fixed size.
            let count = b.rows.count(block_rows, spec.dims.max_position_embeddings, slots);
            let reserve = b.rows == Rows::Cache;
            let bytes = row.checked_mul(count);
            let buf = bytes.and_then(|n| {
                if reserve {
                    AlignedBuf::try_reserved(n)
                } else {
                    AlignedBuf::try_zeroed(n)
                }
            });
            bufs.push(buf.ok_or_else(|| OutOfMemory {
                buffer: b.name.clone(),
                rows: count,
                bytes: bytes.unwrap_or(usize::MAX),
            })?);
        }
        Ok(Buffers {
            bufs,
            row_bytes,
            block_rows,
            ctx,
            slots,
        })
    }

    pub fn get(&self, b: BufId) -> &AlignedBuf {
        &self.bufs[b.0 as usize]
    }
    pub fn get_mut(&mut self, b: BufId) -> &mut AlignedBuf {
        &mut self.bufs[b.0 as usize]
    }
    pub fn row_bytes(&self, b: BufId) -> usize {
        self.row_bytes[b.0 as usize]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_are_zeroed_aligned_and_writable_at_every_size() {
        for bytes in [
            1,
            100,
            4096,
            MAP_THRESHOLD - 64,
            MAP_THRESHOLD,
            3 * MAP_THRESHOLD + 8,
            5 << 20,
        ] {
            for huge in [false, true] {
                let mut b = if huge {
                    AlignedBuf::zeroed_huge(bytes)
                } else {
                    AlignedBuf::zeroed(bytes)
                };
                let align = if huge && bytes >= 2 << 20 { 2 << 20 } else { ALIGN };
                assert_eq!(b.as_ptr() as usize % align, 0, "{bytes} bytes, huge {huge}");
                assert!(b.bytes() >= bytes);
                let n = b.bytes() / 4;
                assert!(b.f32s(n).iter().all(|&v| v == 0.0), "{bytes} bytes start zeroed");
                let s = b.f32s_mut(n);
                s[0] = 1.0;
                s[n - 1] = 2.0;
                assert_eq!((b.f32s(n)[0], b.f32s(n)[n - 1]), (1.0, 2.0));
            }
        }
    }
}
