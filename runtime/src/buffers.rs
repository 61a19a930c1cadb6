//! Activation buffers and the KV cache: zeroed, 64-byte aligned allocations made once when an
//! engine is created, never on the token path.

use kiln_spec::ModelSpec;
use kiln_spec::graph::Buf;
use std::alloc::{Layout, alloc_zeroed, dealloc};
use std::collections::HashMap;
use std::ptr::NonNull;

/// Alignment of every buffer: a cache line, and the widest vector load.
const ALIGN: usize = 64;

/// A zeroed, aligned heap allocation.
pub struct AlignedBuf {
    ptr: NonNull<u8>,
    layout: Layout,
}

// SAFETY: the buffer is plain memory owned by this value; concurrent access is coordinated by
// the pool's barriers (kernels write disjoint parts between barriers).
unsafe impl Send for AlignedBuf {}
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    pub fn zeroed(bytes: usize) -> AlignedBuf {
        let layout = Layout::from_size_align(bytes.max(ALIGN), ALIGN).expect("buffer size fits in isize");
        // SAFETY: the layout has non-zero size.
        let raw = unsafe { alloc_zeroed(layout) };
        let ptr = NonNull::new(raw).unwrap_or_else(|| std::alloc::handle_alloc_error(layout));
        AlignedBuf { ptr, layout }
    }
    /// Like [`AlignedBuf::zeroed`], 2 MiB aligned and advised to use transparent huge pages
    /// (fewer TLB misses when a large buffer is streamed).
    pub fn zeroed_huge(bytes: usize) -> AlignedBuf {
        const HUGE: usize = 2 << 20;
        if bytes < HUGE {
            return AlignedBuf::zeroed(bytes);
        }
        let layout = Layout::from_size_align(bytes.next_multiple_of(HUGE), HUGE).expect("buffer size fits in isize");
        // SAFETY: the layout has non-zero size.
        let raw = unsafe { alloc_zeroed(layout) };
        let ptr = NonNull::new(raw).unwrap_or_else(|| std::alloc::handle_alloc_error(layout));
        #[cfg(target_os = "linux")]
        // SAFETY: advising a range we own; failure only means no huge pages.
        unsafe {
            libc::madvise(raw as *mut libc::c_void, layout.size(), libc::MADV_HUGEPAGE);
        }
        AlignedBuf { ptr, layout }
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
    pub fn i32s_mut(&mut self, len: usize) -> &mut [i32] {
        assert!(len * 4 <= self.layout.size());
        // SAFETY: as above, and `&mut self` guarantees exclusive access.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr() as *mut i32, len) }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        // SAFETY: allocated in `zeroed` with this exact layout.
        unsafe { dealloc(self.ptr.as_ptr(), self.layout) }
    }
}

/// Every buffer a plan can name: activations sized for `block_rows` rows, one logits row, and
/// K and V caches of `ctx` rows per layer.
pub struct Buffers {
    bufs: HashMap<Buf, AlignedBuf>,
    row_bytes: HashMap<Buf, usize>,
    pub block_rows: usize,
    pub ctx: usize,
}

impl Buffers {
    pub fn new(spec: &ModelSpec, block_rows: usize, ctx: usize) -> Buffers {
        let mut bufs = HashMap::new();
        let mut row_bytes = HashMap::new();
        let mut add = |b: Buf, rows: usize| {
            let row = b.row_len(spec) * 4;
            row_bytes.insert(b, row);
            bufs.insert(b, AlignedBuf::zeroed(row * rows));
        };
        for b in [
            Buf::Tokens,
            Buf::X,
            Buf::Xn,
            Buf::Q,
            Buf::K,
            Buf::V,
            Buf::Attn,
            Buf::Gate,
            Buf::Up,
        ] {
            add(b, block_rows);
        }
        add(Buf::Logits, 1);
        for l in 0..spec.num_layers() {
            add(Buf::KCache(l), ctx);
            add(Buf::VCache(l), ctx);
        }
        Buffers {
            bufs,
            row_bytes,
            block_rows,
            ctx,
        }
    }

    pub fn get(&self, b: Buf) -> &AlignedBuf {
        &self.bufs[&b]
    }
    pub fn get_mut(&mut self, b: Buf) -> &mut AlignedBuf {
        self.bufs.get_mut(&b).expect("every buffer is allocated")
    }
    pub fn row_bytes(&self, b: Buf) -> usize {
        self.row_bytes[&b]
    }
    /// Bytes held by the KV cache.
    pub fn kv_bytes(&self) -> usize {
        self.bufs
            .iter()
            .filter(|(b, _)| matches!(b, Buf::KCache(_) | Buf::VCache(_)))
            .map(|(_, v)| v.bytes())
            .sum()
    }
}
