//! The weights as kernels that read row groups see them: each tensor the spec marks with
//! `row_groups` in one copy of them all (`kiln_core::grouped` says why and what the layout
//! is), every other tensor as the source holds it.
//!
//! The copy is mapped from the cache where an earlier start kept it (`crate::grouped_store`);
//! otherwise it is packed here, once, into anonymous memory on huge pages (one pass over those
//! weights, threads sharing it) and then kept. Either way the source's pages of the grouped
//! tensors are not read again, so the page cache may reclaim them. `--ram-budget` streams
//! weights as stored and never groups (the session marks no tensor then).

use crate::buffers::AlignedBuf;
use crate::engine::WeightSource;
use crate::grouped_store::{Layout, MappedCopy, Store};
use kiln_core::grouped::{GROUP_ROWS, PieceOrder, pack};
use kiln_core::{ModelSpec, WeightId};
use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

/// Bytes per piece of the repacking that a thread claims: small enough that the threads end
/// together, large enough that claiming costs nothing.
const PIECE_BYTES: usize = 4 << 20;

pub struct GroupedWeights {
    inner: Arc<dyn WeightSource>,
    /// Every grouped tensor, at the offsets of its [`Layout`].
    backing: Backing,
    /// Each grouped tensor's offset in the copy and its length.
    grouped: HashMap<WeightId, (usize, usize)>,
}

/// Where the grouped tensors are: packed by this process, or mapped from the cache.
enum Backing {
    Packed(AlignedBuf),
    Stored(MappedCopy),
}

impl Backing {
    fn base(&self) -> *const u8 {
        match self {
            Backing::Packed(b) => b.as_ptr() as *const u8,
            Backing::Stored(m) => m.data(),
        }
    }
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

/// The weights as the kernels read them, and what the caller should hear about (a copy that
/// could not be kept in the cache).
pub struct Wrapped {
    pub weights: Arc<dyn WeightSource>,
    /// Whether the grouped tensors were mapped from the cache rather than packed.
    pub from_cache: bool,
    pub notes: Vec<String>,
}

impl GroupedWeights {
    /// `source` with the tensors `spec` marks with `row_groups` in row groups: mapped from the
    /// copy kept in `store_folder` (`crate::grouped_store`) where it holds this source's copy,
    /// else repacked by `threads` threads and then kept there for the next start. `source`
    /// itself when `spec` marks none.
    pub fn wrap(
        spec: &ModelSpec,
        source: Arc<dyn WeightSource>,
        threads: usize,
        store_folder: Option<&Path>,
    ) -> Result<Wrapped, String> {
        let layout = Layout::of(spec);
        if layout.tensors.is_empty() {
            return Ok(Wrapped {
                weights: source,
                from_cache: false,
                notes: Vec::new(),
            });
        }
        for &(id, _, _, bytes) in &layout.tensors {
            let t = spec.weight(id);
            if t.dtype.size() != 2 || !bytes.is_multiple_of(GROUP_ROWS * t.row_bytes()) {
                return Err(format!(
                    "tensor {} is marked for row groups but is not 2-byte elements in whole groups",
                    t.name
                ));
            }
        }
        let grouped = layout.tensors.iter().map(|&(id, _, at, len)| (id, (at, len))).collect();
        let store = store_folder.and_then(|f| Store::locate(f, spec, &layout, source.as_ref()));
        let mut notes = Vec::new();
        let backing = match store.as_ref().and_then(|s| s.open(layout.len, threads)) {
            Some(mapped) => Backing::Stored(mapped),
            None => {
                let buf = pack_all(spec, &layout, source.as_ref(), threads)?;
                if let Some(store) = &store {
                    // SAFETY: the buffer holds `layout.len` bytes (`zeroed_huge` rounds up to
                    // whole huge pages, and the layout's length is whole huge pages).
                    let bytes = unsafe { std::slice::from_raw_parts(buf.as_ptr() as *const u8, layout.len) };
                    if let Err(e) = store.save(bytes) {
                        notes.push(format!("the row-grouped weights were not kept in the cache ({e})"));
                    }
                }
                Backing::Packed(buf)
            }
        };
        Ok(Wrapped {
            from_cache: matches!(backing, Backing::Stored(_)),
            weights: Arc::new(GroupedWeights {
                inner: source,
                backing,
                grouped,
            }),
            notes,
        })
    }
}

/// Packs every tensor of `layout` from `source` into a new buffer, `threads` threads sharing
/// the pieces.
fn pack_all(
    spec: &ModelSpec,
    layout: &Layout,
    source: &dyn WeightSource,
    threads: usize,
) -> Result<AlignedBuf, String> {
    let mut buf = AlignedBuf::zeroed_huge(layout.len);
    let mut pieces = Vec::new();
    for &(id, order, at, bytes) in &layout.tensors {
        let row_bytes = spec.weight(id).row_bytes();
        let src = source.weight_ptr(id)?;
        let dst = buf.as_mut_ptr().wrapping_add(at);
        let group_bytes = GROUP_ROWS * row_bytes;
        let per = (PIECE_BYTES / group_bytes).max(1) * group_bytes;
        for from in (0..bytes).step_by(per) {
            pieces.push(Piece {
                // `wrapping_add` keeps the arithmetic defined; `from < bytes`, inside both.
                src: src.wrapping_add(from),
                dst: dst.wrapping_add(from),
                len: per.min(bytes - from),
                row_elems: row_bytes / 2,
                order,
            });
        }
    }
    let next = AtomicUsize::new(0);
    std::thread::scope(|s| {
        for _ in 0..threads.max(1) {
            s.spawn(|| {
                while let Some(p) = pieces.get(next.fetch_add(1, Ordering::Relaxed)) {
                    // SAFETY: `p.src` holds `p.len` bytes of its tensor (the source checked
                    // the tensor's size against the spec) and `p.dst` the same number of
                    // `buf`, alive until the scope ends; no two pieces share destination
                    // bytes, and sources are only read.
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
    Ok(buf)
}

impl WeightSource for GroupedWeights {
    fn weight_ptr(&self, id: WeightId) -> Result<*const u8, String> {
        match self.grouped.get(&id) {
            Some(&(at, _)) => Ok(self.backing.base().wrapping_add(at)),
            None => self.inner.weight_ptr(id),
        }
    }

    fn read_range(&self, id: WeightId, offset: usize, dst: &mut [u8]) -> Result<(), String> {
        let Some(&(at, len)) = self.grouped.get(&id) else {
            return self.inner.read_range(id, offset, dst);
        };
        let end = offset.checked_add(dst.len()).filter(|e| *e <= len);
        if end.is_none() {
            return Err(format!("weight {}: range past its end", id.0));
        }
        // SAFETY: `at + offset + dst.len()` lies within the copy (checked above against the
        // tensor's length, which the layout places inside it); `dst` is a distinct, writable
        // slice.
        unsafe { std::ptr::copy_nonoverlapping(self.backing.base().add(at + offset), dst.as_mut_ptr(), dst.len()) };
        Ok(())
    }

    fn stored_at(&self, id: WeightId) -> Option<(usize, u64)> {
        if self.grouped.contains_key(&id) {
            return None;
        }
        self.inner.stored_at(id)
    }

    fn origin(&self) -> Option<(String, String)> {
        self.inner.origin()
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use kiln_core::DType;
    use kiln_core::grouped::pack;
    use kiln_core::spec::Role;

    /// Weights in memory, read through pointers or ranges.
    pub(crate) struct InMemory(pub(crate) Vec<Vec<u8>>);

    impl WeightSource for InMemory {
        fn weight_ptr(&self, id: WeightId) -> Result<*const u8, String> {
            Ok(self.0[id.0 as usize].as_ptr())
        }
    }

    /// A Llama-shaped spec (SwiGLU MLP) with every matrix in bf16, grouped for 16 lanes.
    pub(crate) fn grouped_spec() -> ModelSpec {
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
        let wrapped = GroupedWeights::wrap(&spec, source.clone(), 3, None)
            .expect("packed")
            .weights;
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
        let same = GroupedWeights::wrap(&plain, source.clone(), 2, None)
            .expect("unchanged")
            .weights;
        let id = spec
            .weight_ids()
            .find(|(_, t)| t.row_groups.is_some())
            .expect("a grouped tensor")
            .0;
        assert_eq!(same.weight_ptr(id).unwrap(), source.weight_ptr(id).unwrap());
    }
}
