//! The contract between a compiled library and the runtime, defined once.
//!
//! Every kernel symbol (see [`crate::kernel::Kernel::symbol`]) has the same C signature:
//!
//! ```text
//! void kernel(ptr a0, ptr a1, ..., ptr a9, i64 rows, i64 thread_id, i64 n_threads)
//! ```
//!
//! * `a0..a8` are raw pointers to the first element of each buffer (MLIR's bare-pointer memref
//!   convention: every buffer has a static shape baked into the kernel, so a pointer is enough).
//!   Each kernel documents the meaning and order of its arguments; unused slots are null.
//! * `a9` points at this call's *work counter*: [`WORK_COUNTER_BYTES`] bytes, zero when the call
//!   starts, shared by the threads of that call and by no other call. Kernels that hand out part
//!   of their work dynamically claim chunks with an atomic increment of its first `i64`; others
//!   ignore it. It is never null.
//! * `rows` is the number of valid rows in the activation buffers (`1..=max_rows`). Rows need
//!   not belong to one sequence: each row's position and KV-cache slot are in the `row_info`
//!   buffer ([`crate::graph::RowInfo`]), which the kernels that need them take as an argument.
//!   A KV cache holds [`MAX_SLOTS`] sequences' caches one after another; the runtime backs only
//!   the slots it uses.
//! * `thread_id` / `n_threads`: every thread of the pool calls the kernel with the same
//!   arguments; the kernel does its `thread_id`-th share of the work (and whatever it claims
//!   through the work counter) and returns. No kernel waits for another thread; the runtime
//!   places barriers between dependent calls.
//! * Activations, the KV cache and accumulators are f32; weights are read as stored.
//!
//! The library also exports `uint32 kiln_abi_version(void)` returning [`ABI_VERSION`], checked
//! when it is loaded. Any change to the above bumps the version, which enters the cache key.

/// Version of the calling convention and buffer layout described above (2: the work counter;
/// 3: nine buffer slots, for kernels of the general graph with more inputs; 4: per-row
/// positions and KV slots in `row_info` instead of one `pos` scalar, for batched decoding).
pub const ABI_VERSION: u32 = 4;

/// KV-cache slots (sequences decoded together) the kernels' cache layout addresses. Only the
/// address space is reserved for all of them; memory is committed for the positions written.
pub const MAX_SLOTS: usize = 64;

/// Pointer argument slots every kernel takes.
pub const PTR_ARGS: usize = 10;

/// Slots for buffers (`a0..a8`); the last slot is the work counter.
pub const BUFFER_ARGS: usize = PTR_ARGS - 1;

/// The slot holding the work counter.
pub const WORK_COUNTER_ARG: usize = PTR_ARGS - 1;

/// Size of one work counter: a cache line, so counters of different calls never share one.
pub const WORK_COUNTER_BYTES: usize = 64;

/// Name of the exported function returning [`ABI_VERSION`].
pub const ABI_VERSION_SYMBOL: &str = "kiln_abi_version";

/// The Rust type of every kernel symbol.
pub type KernelFn = unsafe extern "C" fn(
    *mut u8,
    *mut u8,
    *mut u8,
    *mut u8,
    *mut u8,
    *mut u8,
    *mut u8,
    *mut u8,
    *mut u8,
    *mut u8,
    i64,
    i64,
    i64,
);

/// The Rust type of [`ABI_VERSION_SYMBOL`].
pub type AbiVersionFn = unsafe extern "C" fn() -> u32;

/// Calls kernel `f` with the pointer slots `a` (work counter in [`WORK_COUNTER_ARG`]) and the
/// run-time scalars: the one place that spells out the signature's arity.
///
/// # Safety
/// `f` must be a kernel of a library built for this ABI version, and `a` must point at buffers
/// and weights of the shapes the kernel was compiled for, with `rows` within them and the
/// positions and slots of `row_info` within the caches.
#[inline]
pub unsafe fn invoke(f: KernelFn, a: [*mut u8; PTR_ARGS], rows: i64, thread_id: i64, n_threads: i64) {
    // SAFETY: the caller guarantees `f` has this signature and the arguments fit it.
    unsafe {
        f(
            a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7], a[8], a[9], rows, thread_id, n_threads,
        )
    }
}
