//! Where the engine's weights come from: the one trait every weight provider implements (mapped
//! files, in-memory copies, the row-grouped copy), defined apart from the engine that uses it.

use kiln_core::WeightId;

/// Gives the engine a pointer to each weight tensor. The pointers must stay valid, unchanged,
/// as long as the source lives; the engine keeps the source alive.
pub trait WeightSource: Send + Sync {
    fn weight_ptr(&self, id: WeightId) -> Result<*const u8, String>;

    /// Copies `dst.len()` bytes of weight `id`, from byte `offset` of the bytes the kernels
    /// read (those [`WeightSource::weight_ptr`] points at), into `dst`: how `--ram-budget`
    /// streams a weight it does not keep resident. A source backed by files reads them with
    /// `pread`, never through a mapping (so no mapped page of the weight becomes resident),
    /// and drops what it read from the page cache, so streamed weights hold no memory once
    /// used; it must not call `weight_ptr`'s lazy copies into being either. The default copies
    /// from `weight_ptr`, for sources that hold their weights in memory anyway.
    fn read_range(&self, id: WeightId, offset: usize, dst: &mut [u8]) -> Result<(), String> {
        let src = self.weight_ptr(id)?;
        // SAFETY: the caller asks for a range inside the tensor (the engine derives it from
        // the spec's shape, which the source checked its tensor against), so `src + offset`
        // holds `dst.len()` readable bytes; `dst` is a distinct, writable slice.
        unsafe { std::ptr::copy_nonoverlapping(src.add(offset), dst.as_mut_ptr(), dst.len()) };
        Ok(())
    }

    /// Where weight `id` is stored: (which file, byte offset in it), for sources read from
    /// files. The streamer reads a unit's weights in this order: a disk reads a layer's
    /// tensors about twice as fast in file order as in the model's order (measured 3.0 against
    /// 1.5 GB/s), since the kernel's readahead follows sequential reads only. `None` (the
    /// default) for weights held in memory.
    fn stored_at(&self, id: WeightId) -> Option<(usize, u64)> {
        let _ = id;
        None
    }

    /// Where the bytes come from, for copies derived from them that outlive the process (the
    /// row-grouped copy kept in the cache, `crate::grouped_store`): the files' paths, then
    /// their state (sizes, modification times, inodes), which changes when a file does.
    /// `None` (the default) for weights that exist only in this process.
    fn origin(&self) -> Option<(String, String)> {
        None
    }

    /// The engine will not read weights `ids` through this source again (their row-grouped
    /// copies took their place): a source that reads them in place from file mappings drops
    /// their pages from the process (`kiln_core::pages::release`; the page cache keeps the
    /// data), so a model's memory is its copies plus the rest, not both. Returns the bytes
    /// released. The default, for weights in the source's own memory, releases nothing.
    fn release(&self, ids: &[WeightId]) -> usize {
        let _ = ids;
        0
    }
}
