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
    /// Where each grouped tensor lies in the copy.
    grouped: HashMap<WeightId, Placed>,
}

/// A grouped tensor's place in the copy: the offset of its first group, its length, and the
/// distance between its groups' starts (one group's bytes, or two for a pair).
#[derive(Clone, Copy)]
struct Placed {
    at: usize,
    len: usize,
    group_bytes: usize,
    stride: usize,
}

impl Placed {
    /// Where byte `offset` of the tensor (as the kernels address it, group by group) lies in
    /// the copy, and how many bytes follow it in the same group.
    fn locate(&self, offset: usize) -> (usize, usize) {
        let (group, within) = (offset / self.group_bytes, offset % self.group_bytes);
        (self.at + group * self.stride + within, self.group_bytes - within)
    }
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

/// A run of whole groups of one tensor, or of the same groups of both tensors of a pair: their
/// source bytes (`len` of each) and where they go (`len` times the sources' count).
struct Piece {
    srcs: Vec<*const u8>,
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
    /// The packed copy being kept in the cache, to wait for before the process ends.
    pub writing: Option<PendingWrite>,
    /// Dropping the sources' pages of the grouped tensors, for the caller to run once the
    /// first token is out (it costs ~7 ms of a 0.14 s start: see [`SourceRelease`]).
    pub release: Option<SourceRelease>,
}

/// The grouped tensors' pages in the source, to drop from the process once the start is over:
/// the kernels read the copy from now on, and the source's pages would only double the model's
/// memory (`WeightSource::release`). Run after the first token rather than at open, since
/// `MADV_DONTNEED` over ~0.9 GB of mappings took ~7 ms (37 calls, `strace -T`) of the 0.5B
/// shape's 0.14 s to its first token on the 2-core Zen 4, with both cores busy until then.
pub struct SourceRelease(Arc<dyn WeightSource>, Vec<WeightId>);

impl SourceRelease {
    /// Drops the pages; the bytes released.
    pub fn run(self) -> usize {
        self.0.release(&self.1)
    }
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
                writing: None,
                release: None,
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
        let grouped = layout
            .tensors
            .iter()
            .map(|&(id, _, at, len)| {
                let t = spec.weight(id);
                let group_bytes = GROUP_ROWS * t.row_bytes();
                let stride = group_bytes * t.group_pitch();
                (
                    id,
                    Placed {
                        at,
                        len,
                        group_bytes,
                        stride,
                    },
                )
            })
            .collect();
        let store = store_folder.and_then(|f| Store::locate(f, spec, &layout, source.as_ref()));
        let mut notes = Vec::new();
        let mut writer = None;
        let backing = match store.as_ref().and_then(|s| s.open(layout.len, threads)) {
            Some(mapped) => Backing::Stored(mapped),
            None => {
                let buf = pack_all(spec, &layout, source.as_ref(), threads)?;
                match store.as_ref().map(|s| s.begin(layout.len)) {
                    Some(Ok(w)) => writer = w,
                    Some(Err(e)) => notes.push(not_kept(&e)),
                    None => {}
                }
                Backing::Packed(buf)
            }
        };
        let ids: Vec<WeightId> = layout.tensors.iter().map(|&(id, ..)| id).collect();
        let release = Some(SourceRelease(Arc::clone(&source), ids));
        let weights = Arc::new(GroupedWeights {
            inner: source,
            backing,
            grouped,
        });
        // The copy's data are written while the model runs: writing and syncing them took
        // ~2 s of a 2.6 s first start of the 0.5B shape (0.9 GB) on the way to its first
        // token. The thread keeps the weights (and so the packed buffer) alive until done.
        let writing = writer.map(|w| {
            let keep = Arc::clone(&weights);
            PendingWrite::spawn(move || w.finish(keep.packed(layout.len)))
        });
        Ok(Wrapped {
            from_cache: matches!(weights.backing, Backing::Stored(_)),
            weights,
            notes,
            writing,
            release,
        })
    }

    /// The first `len` bytes of the packed copy (empty for a mapped one, which is never
    /// written back).
    fn packed(&self, len: usize) -> &[u8] {
        match &self.backing {
            // SAFETY: the buffer holds the layout's `len` bytes (`zeroed_huge` rounds up to
            // whole huge pages, and the layout's length is whole huge pages), alive as long
            // as `self`.
            Backing::Packed(buf) => unsafe { std::slice::from_raw_parts(buf.as_ptr() as *const u8, len) },
            Backing::Stored(_) => &[],
        }
    }
}

/// The note for a copy that could not be kept.
fn not_kept(error: &str) -> String {
    format!("the row-grouped weights were not kept in the cache ({error})")
}

/// The grouped copy being written to the cache on a thread of its own.
pub struct PendingWrite(Option<std::thread::JoinHandle<Result<(), String>>>);

impl PendingWrite {
    fn spawn(write: impl FnOnce() -> Result<(), String> + Send + 'static) -> PendingWrite {
        PendingWrite(Some(std::thread::spawn(write)))
    }

    /// Waits for the write to end; the note to tell the user when the copy was not kept.
    pub fn wait(mut self) -> Option<String> {
        match self.0.take()?.join() {
            Ok(Ok(())) => None,
            Ok(Err(e)) => Some(not_kept(&e)),
            Err(_) => Some(not_kept("the writing thread panicked")),
        }
    }
}

impl Drop for PendingWrite {
    /// Waits for the write nobody waited for: an engine that failed after its copy began (a
    /// plan it could not build) drops it, and a detached thread would die with the process
    /// mid-write, leaving a temporary file instead of the copy.
    fn drop(&mut self) {
        if let Some(write) = self.0.take() {
            let _ = write.join();
        }
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
        let t = spec.weight(id);
        // A pair is packed from its first tensor's entry, both tensors' groups in turn.
        let ids = match t.group_pair {
            None => vec![id],
            Some(pair) if pair.second => continue,
            Some(pair) => vec![id, pair.partner],
        };
        let srcs = ids
            .iter()
            .map(|&i| source.weight_ptr(i))
            .collect::<Result<Vec<_>, _>>()?;
        let dst = buf.as_mut_ptr().wrapping_add(at);
        let group_bytes = GROUP_ROWS * t.row_bytes();
        let per = (PIECE_BYTES / group_bytes).max(1) * group_bytes;
        for from in (0..bytes).step_by(per) {
            pieces.push(Piece {
                // `wrapping_add` keeps the arithmetic defined; `from < bytes`, inside each
                // source, and `from * srcs.len()` inside the pair's region.
                srcs: srcs.iter().map(|s| s.wrapping_add(from)).collect(),
                dst: dst.wrapping_add(from * srcs.len()),
                len: per.min(bytes - from),
                row_elems: t.row_bytes() / 2,
                order,
            });
        }
    }
    let next = AtomicUsize::new(0);
    std::thread::scope(|s| {
        for _ in 0..threads.max(1) {
            s.spawn(|| {
                while let Some(p) = pieces.get(next.fetch_add(1, Ordering::Relaxed)) {
                    // SAFETY: each of `p.srcs` holds `p.len` bytes of its tensor (the source
                    // checked the tensor's size against the spec) and `p.dst` that times the
                    // sources' count of `buf` (a pair's groups of the piece are one range),
                    // alive until the scope ends; no two pieces share destination bytes, and
                    // sources are only read.
                    let (srcs, dst) = unsafe {
                        (
                            p.srcs
                                .iter()
                                .map(|&s| std::slice::from_raw_parts(s, p.len))
                                .collect::<Vec<_>>(),
                            std::slice::from_raw_parts_mut(p.dst, p.len * p.srcs.len()),
                        )
                    };
                    pack(p.order, &srcs, dst, p.row_elems);
                }
            });
        }
    });
    Ok(buf)
}

impl WeightSource for GroupedWeights {
    fn weight_ptr(&self, id: WeightId) -> Result<*const u8, String> {
        match self.grouped.get(&id) {
            Some(p) => Ok(self.backing.base().wrapping_add(p.at)),
            None => self.inner.weight_ptr(id),
        }
    }

    fn read_range(&self, id: WeightId, offset: usize, dst: &mut [u8]) -> Result<(), String> {
        let Some(placed) = self.grouped.get(&id) else {
            return self.inner.read_range(id, offset, dst);
        };
        let end = offset.checked_add(dst.len()).filter(|e| *e <= placed.len);
        if end.is_none() {
            return Err(format!("weight {}: range past its end", id.0));
        }
        // Group by group: a pair's groups alternate with its partner's.
        let mut done = 0;
        while done < dst.len() {
            let (from, room) = placed.locate(offset + done);
            let n = room.min(dst.len() - done);
            // SAFETY: `from..from + n` lies within one group of the tensor inside the copy
            // (the range was checked above against the tensor's length, which the layout
            // places inside it); `dst[done..done + n]` is a distinct, writable slice.
            unsafe { std::ptr::copy_nonoverlapping(self.backing.base().add(from), dst.as_mut_ptr().add(done), n) };
            done += n;
        }
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

    /// Weights in memory, read through pointers or ranges; records what it is asked to
    /// release.
    pub(crate) struct InMemory(pub(crate) Vec<Vec<u8>>, std::sync::Mutex<Vec<WeightId>>);

    impl WeightSource for InMemory {
        fn weight_ptr(&self, id: WeightId) -> Result<*const u8, String> {
            Ok(self.0[id.0 as usize].as_ptr())
        }

        fn release(&self, ids: &[WeightId]) -> usize {
            self.1.lock().unwrap().extend_from_slice(ids);
            0
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
        assert_eq!(
            spec.weights.iter().filter(|t| t.group_pair.is_some()).count(),
            4,
            "as two pairs"
        );
        spec
    }

    /// The bytes of tensor `t` as the kernels read them from `ptr`: its groups one after the
    /// other, each `t.group_pitch()` groups' length after the one before (a pair's alternate).
    pub(crate) fn own_groups(ptr: *const u8, t: &kiln_core::spec::Tensor) -> Vec<u8> {
        let group = GROUP_ROWS * t.row_bytes();
        (0..t.bytes() / group)
            .flat_map(|g| {
                // SAFETY: the wrapper's pointer for a grouped tensor holds its groups at this
                // pitch, each `group` bytes long, inside the copy.
                unsafe { std::slice::from_raw_parts(ptr.add(g * group * t.group_pitch()), group) }.to_vec()
            })
            .collect()
    }

    /// Invariant: a pending write dropped without `wait` (an engine that failed after its
    /// copy began) still ends before the drop returns, so the process cannot end mid-write.
    #[test]
    fn dropping_a_pending_write_waits_for_it() {
        let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let flag = Arc::clone(&done);
        let write = PendingWrite::spawn(move || {
            std::thread::sleep(std::time::Duration::from_millis(200));
            flag.store(true, Ordering::SeqCst);
            Ok(())
        });
        drop(write);
        assert!(done.load(Ordering::SeqCst), "the write was left running");
    }

    /// Grouped tensors come back packed (by pointer and by range), every other one as the
    /// source holds it, and the source is told to release exactly the grouped ones; a spec
    /// that groups nothing gets the source itself. Gate and up are paired, their groups
    /// alternating.
    #[test]
    fn grouped_tensors_are_packed_and_the_rest_passed_through() {
        let spec = grouped_spec();
        let bytes: Vec<Vec<u8>> = spec
            .weights
            .iter()
            .enumerate()
            .map(|(w, t)| (0..t.bytes()).map(|i| (i * 13 + w * 7) as u8).collect())
            .collect();
        let source = Arc::new(InMemory(bytes.clone(), Default::default()));
        let wrapped = GroupedWeights::wrap(&spec, source.clone(), 3, None).expect("packed");
        assert!(source.1.lock().unwrap().is_empty(), "released before the caller asks");
        wrapped.release.expect("a release").run();
        let wrapped = wrapped.weights;
        let mut released = source.1.lock().unwrap().clone();
        released.sort();
        let grouped: Vec<WeightId> = spec
            .weight_ids()
            .filter(|(_, t)| t.row_groups.is_some())
            .map(|(id, _)| id)
            .collect();
        assert!(!grouped.is_empty());
        assert_eq!(released, grouped);
        for (id, t) in spec.weight_ids() {
            let original = &bytes[id.0 as usize];
            let mut want = original.clone();
            if let Some(order) = t.row_groups {
                pack(order, &[original], &mut want, t.row_bytes() / 2);
                assert_ne!(&want, original, "{}: packing moves bytes", t.name);
            }
            let ptr = wrapped.weight_ptr(id).expect("a pointer");
            let got = match t.row_groups {
                Some(_) => own_groups(ptr, t),
                // SAFETY: the wrapper's pointer for `id` holds the tensor's `t.bytes()` bytes.
                None => unsafe { std::slice::from_raw_parts(ptr, t.bytes()) }.to_vec(),
            };
            assert_eq!(got, want, "{}", t.name);
            let mut part = vec![0u8; 64];
            wrapped.read_range(id, 64, &mut part).expect("a range");
            assert_eq!(&part[..], &want[64..128], "{}: read_range", t.name);
            if t.row_groups.is_some() {
                // A range across two groups (of a pair: with the partner's group between).
                let second = GROUP_ROWS * t.row_bytes();
                wrapped.read_range(id, second - 32, &mut part).expect("a range");
                assert_eq!(&part[..], &want[second - 32..second + 32], "{}: across groups", t.name);
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
