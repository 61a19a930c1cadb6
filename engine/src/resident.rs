//! Weights copied out of the file mapping into anonymous memory, for `KILN_RESIDENT=1`.
//!
//! Reading weights straight from the page cache costs nothing at start-up; a resident copy costs
//! one pass over the weights at load but can live on transparent huge pages (fewer TLB misses
//! while decode streams the whole model per token) and is immune to page-cache eviction. The
//! bench measures both.

use crate::buffers::AlignedBuf;
use crate::engine::WeightSource;
use kiln_core::{ModelSpec, WeightId};
use std::collections::HashMap;

pub struct ResidentWeights {
    bufs: HashMap<WeightId, AlignedBuf>,
}

impl ResidentWeights {
    /// Copies every weight of `spec` from `source`.
    pub fn copy_from(spec: &ModelSpec, source: &dyn WeightSource) -> Result<ResidentWeights, String> {
        let mut bufs = HashMap::new();
        for (id, w) in spec.weight_ids() {
            let bytes = w.bytes();
            let mut buf = AlignedBuf::zeroed_huge(bytes);
            let src = source.weight_ptr(id)?;
            // SAFETY: `src` points at `bytes` bytes of the tensor (the source checked its size
            // against the spec); `buf` holds at least `bytes` bytes; they do not overlap.
            unsafe { std::ptr::copy_nonoverlapping(src, buf.as_mut_ptr(), bytes) };
            bufs.insert(id, buf);
        }
        Ok(ResidentWeights { bufs })
    }
}

impl WeightSource for ResidentWeights {
    fn weight_ptr(&self, id: WeightId) -> Result<*const u8, String> {
        self.bufs
            .get(&id)
            .map(|b| b.as_ptr() as *const u8)
            .ok_or_else(|| format!("no resident copy of weight {}", id.0))
    }
}
