//! The weights as kernels that read row groups see them: each tensor the spec marks with
//! `row_groups` repacked once, at load, into anonymous memory on huge pages
//! (`kiln_core::grouped` says why and what the layout is); every other tensor as the source
//! holds it.
//!
//! The copy costs one pass over those weights at start (threads share it) and their size in
//! anonymous memory; the source's pages of them are not read again, so the page cache may
//! reclaim them. `--ram-budget` streams weights as stored and never groups (the session
//! marks no tensor then), which [`GroupedWeights::wrap`] checks.

use crate::buffers::AlignedBuf;
use crate::engine::WeightSource;
use kiln_core::grouped::{GROUP_ROWS, PieceOrder, pack};
use kiln_core::{ModelSpec, WeightId};
use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

/// Bytes per piece of the repacking that a thread claims: small enough that the threads end
/// together, large enough that claiming costs nothing.
const PIECE_BYTES: usize = 4 << 20;

pub struct GroupedWeights {
    inner: Arc<dyn WeightSource>,
    /// Each grouped tensor's copy and its length (the buffer is rounded up to whole huge
    /// pages).
    grouped: HashMap<WeightId, (AlignedBuf, usize)>,
}

/// A run of whole groups of one tensor: its source bytes and where they go.
struct Piece {
    src: *const u8,
    dst: *mut u8,
    len: usize,
    row_elems: usize,
    order: PieceOrder,
}

// SAFETY: a piece names bytes of a source tensor (read only, alive while the source lives)
// and a range of a destination buffer no other piece covers; `wrap` keeps both alive until
// every thread has finished.
unsafe impl Send for Piece {}
// SAFETY: as for `Send`: threads share the list of pieces, each piece claimed by one thread.
unsafe impl Sync for Piece {}

impl GroupedWeights {
    /// `source` with the tensors `spec` marks with `row_groups` repacked by `threads` threads;
    /// `source` itself when it marks none.
    pub fn wrap(
        spec: &ModelSpec,
        source: Arc<dyn WeightSource>,
        threads: usize,
    ) -> Result<Arc<dyn WeightSource>, String> {
        let marked: Vec<(WeightId, PieceOrder)> = spec
            .weight_ids()
            .filter_map(|(id, t)| Some((id, t.row_groups?)))
            .collect();
        if marked.is_empty() {
            return Ok(source);
        }
        let mut grouped = HashMap::new();
        let mut pieces = Vec::new();
        for (id, order) in marked {
            let t = spec.weight(id);
            let (bytes, row_bytes) = (t.bytes(), t.row_bytes());
            let group_bytes = GROUP_ROWS * row_bytes;
            if t.dtype.size() != 2 || !bytes.is_multiple_of(group_bytes) {
                return Err(format!(
                    "tensor {} is marked for row groups but is not 2-byte elements in whole groups",
                    t.name
                ));
            }
            let src = source.weight_ptr(id)?;
            let mut buf = AlignedBuf::zeroed_huge(bytes);
            let per = (PIECE_BYTES / group_bytes).max(1) * group_bytes;
            for at in (0..bytes).step_by(per) {
                pieces.push(Piece {
                    // `wrapping_add` keeps the arithmetic defined; `at < bytes`, inside both.
                    src: src.wrapping_add(at),
                    dst: buf.as_mut_ptr().wrapping_add(at),
                    len: per.min(bytes - at),
                    row_elems: row_bytes / 2,
                    order,
                });
            }
            grouped.insert(id, (buf, bytes));
        }
        let next = AtomicUsize::new(0);
        std::thread::scope(|s| {
            for _ in 0..threads.max(1) {
                s.spawn(|| {
                    while let Some(p) = pieces.get(next.fetch_add(1, Ordering::Relaxed)) {
                        // SAFETY: `p.src` holds `p.len` bytes of its tensor (the source checked
                        // the tensor's size against the spec) and `p.dst` the same number of a
                        // buffer in `grouped`, alive until the scope ends; no two pieces share
                        // destination bytes, and sources are only read.
                        let (src, dst) = unsafe {
                            (
                                std::slice::from_raw_parts(p.src, p.len),
                                std::slice::from_raw_parts_mut(p.dst, p.len),
                            )
                        };
                        pack(p.order, src, dst, p.row_elems);
                    }
                });
            }
        });
        Ok(Arc::new(GroupedWeights { inner: source, grouped }))
    }
}

impl WeightSource for GroupedWeights {
    fn weight_ptr(&self, id: WeightId) -> Result<*const u8, String> {
        match self.grouped.get(&id) {
            Some((b, _)) => Ok(b.as_ptr() as *const u8),
            None => self.inner.weight_ptr(id),
        }
    }

    fn read_range(&self, id: WeightId, offset: usize, dst: &mut [u8]) -> Result<(), String> {
        let Some((b, len)) = self.grouped.get(&id) else {
            return self.inner.read_range(id, offset, dst);
        };
        let end = offset.checked_add(dst.len()).filter(|e| e <= len);
        if end.is_none() {
            return Err(format!("weight {}: range past its end", id.0));
        }
        // SAFETY: `offset + dst.len()` lies within the buffer (checked above); `dst` is a
        // distinct, writable slice.
        unsafe { std::ptr::copy_nonoverlapping(b.as_ptr().add(offset), dst.as_mut_ptr(), dst.len()) };
        Ok(())
    }

    fn stored_at(&self, id: WeightId) -> Option<(usize, u64)> {
        if self.grouped.contains_key(&id) {
            return None;
        }
        self.inner.stored_at(id)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kiln_core::DType;
    use kiln_core::grouped::pack;
    use kiln_core::spec::Role;

    /// Weights in memory, read through pointers or ranges.
    struct InMemory(Vec<Vec<u8>>);

    impl WeightSource for InMemory {
        fn weight_ptr(&self, id: WeightId) -> Result<*const u8, String> {
            Ok(self.0[id.0 as usize].as_ptr())
        }
    }

    /// A Llama-shaped spec (SwiGLU MLP) with every matrix in bf16, grouped for 16 lanes.
    fn grouped_spec() -> ModelSpec {
        let config = serde_json::json!({
            "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 144,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "vocab_size": 96
        });
        let map = config.as_object().expect("an object");
        let arch = kiln_core::arch::by_hf_name("LlamaForCausalLM").expect("llama");
        let mut spec = kiln_core::arch::build(arch, &kiln_core::arch::HfConfig::new(map)).expect("a valid config");
        for t in spec.weights.iter_mut().filter(|t| t.role == Role::Matrix) {
            t.dtype = DType::BF16;
        }
        assert_eq!(
            spec.group_rows(16, kiln_core::Precision::Exact, 0),
            4,
            "gate and up of two layers"
        );
        spec
    }

    /// Grouped tensors come back packed (by pointer and by range), every other one as the
    /// source holds it; a spec that groups nothing gets the source itself.
    #[test]
    fn grouped_tensors_are_packed_and_the_rest_passed_through() {
        let spec = grouped_spec();
        let bytes: Vec<Vec<u8>> = spec
            .weights
            .iter()
            .enumerate()
            .map(|(w, t)| (0..t.bytes()).map(|i| (i * 13 + w * 7) as u8).collect())
            .collect();
        let source = Arc::new(InMemory(bytes.clone()));
        let wrapped = GroupedWeights::wrap(&spec, source.clone(), 3).expect("packed");
        for (id, t) in spec.weight_ids() {
            let original = &bytes[id.0 as usize];
            let mut want = original.clone();
            if let Some(order) = t.row_groups {
                pack(order, original, &mut want, t.row_bytes() / 2);
                assert_ne!(&want, original, "{}: packing moves bytes", t.name);
            }
            let ptr = wrapped.weight_ptr(id).expect("a pointer");
            // SAFETY: the wrapper's pointer for `id` holds the tensor's `t.bytes()` bytes.
            let got = unsafe { std::slice::from_raw_parts(ptr, t.bytes()) };
            assert_eq!(got, &want[..], "{}", t.name);
            let mut part = vec![0u8; 64];
            wrapped.read_range(id, 64, &mut part).expect("a range");
            assert_eq!(&part[..], &want[64..128], "{}: read_range", t.name);
            if t.row_groups.is_some() {
                // The copy's buffer runs on to a whole huge page; the tensor ends before.
                let past = wrapped.read_range(id, t.bytes() - 32, &mut part);
                assert!(past.is_err(), "{}: a range past its end", t.name);
            }
        }
        let mut plain = spec.clone();
        plain.weights.iter_mut().for_each(|t| t.row_groups = None);
        let same = GroupedWeights::wrap(&plain, source.clone(), 2).expect("unchanged");
        let id = spec
            .weight_ids()
            .find(|(_, t)| t.row_groups.is_some())
            .expect("a grouped tensor")
            .0;
        assert_eq!(same.weight_ptr(id).unwrap(), source.weight_ptr(id).unwrap());
    }
}
