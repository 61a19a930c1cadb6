//! The gate and up projections of a gated MLP read in *row groups*: each group of
//! [`GROUP_ROWS`] rows is stored as one run of interleaved cache lines (line 0 of each row of
//! the group, then line 1 of each, ...), so the rows a decode step walks together are one
//! sequential stream and decode's fused `gate_up` kernel reads two such streams per thread,
//! with no software prefetch.
//!
//! Why: decode in quad order (`compiler/src/emit/matmul/quad.rs`) walks a few weight rows side
//! by side, a cache line of each per step. Stored row-major, those are as many streams a row
//! apart, which the hardware prefetchers do not follow (two threads reading a line of each of
//! 4 rows at a time with plain loads: 23 GB/s where one sequential stream read 54), so decode
//! prefetches every line in software, and the prefetches cost bandwidth themselves (a
//! sequential stream with one per line: 43 GB/s; four interleaved rows with them: 41). (2-core
//! AMD EPYC Zen 4, 2 pinned threads, AVX-512 loads from a 512 MiB huge-page buffer, 1792-byte
//! rows as the 0.5B shape's; 4 KiB and 9.5 KiB rows alike.) Four rows also cap the exact
//! form's FMA chains (in L3, 2 threads: 44 GB/s median with 4 rows, 58 with 8), so a group
//! holds 8 rows: one step, one stream, twice the chains.
//!
//! Measured in the model (Qwen2.5-0.5B shape, bf16, 2 threads, same machine, interleaved
//! runs, each over the read probe right after it): the `gate_up` kernel read 96-103 % of the
//! probe against 69-80 % row-major in the fast memory phase (~56-62 GB/s), 94-101 % against
//! 80-92 % in the slow one (~33-36 GB/s); decode 48.9-51.2 against 44.4-47.5 tok/s and
//! 30.1-31.1 against 29.2 tok/s. The single-matrix decode matmuls did not gain: grouped
//! (8 rows, with or without a prefetch per step, or walking two halves of a share side by
//! side) their rows read 63-71 % of the fast probe against 73-78 % row-major, so they stay
//! row-major.
//!
//! The kernels compute the same products in the same order either way (only addresses
//! change), so results are bitwise those of the row-major layout. The engine repacks the
//! tensors [`ModelSpec::group_rows`] marks once, at load ([`pack`]).

use crate::dtype::DType;
use crate::graph::OpKind;
use crate::spec::{BufId, ModelSpec, Role, WeightId};

/// Rows per group: the rows one decode step walks together in quad order (two 8-lane
/// vectors of two rows each).
pub const GROUP_ROWS: usize = 8;

/// Bytes of a row per step of the interleave: one cache line.
pub const LINE_BYTES: usize = 64;

/// Where byte `byte` of row `row` (of rows `row_bytes` long) lies in the grouped layout.
pub fn offset(row: usize, byte: usize, row_bytes: usize) -> usize {
    let (group, o) = (row / GROUP_ROWS, row % GROUP_ROWS);
    group * GROUP_ROWS * row_bytes + byte / LINE_BYTES * GROUP_ROWS * LINE_BYTES + o * LINE_BYTES + byte % LINE_BYTES
}

/// Writes the whole groups of row-major `src` into `dst` in the grouped layout. Both hold the
/// same number of bytes, a multiple of `GROUP_ROWS * row_bytes`; `row_bytes` is a multiple of
/// [`LINE_BYTES`].
pub fn pack(src: &[u8], dst: &mut [u8], row_bytes: usize) {
    let group_bytes = GROUP_ROWS * row_bytes;
    assert!(row_bytes.is_multiple_of(LINE_BYTES) && src.len().is_multiple_of(group_bytes));
    assert_eq!(src.len(), dst.len());
    for (s, d) in src.chunks_exact(group_bytes).zip(dst.chunks_exact_mut(group_bytes)) {
        for (line, out) in d.chunks_exact_mut(GROUP_ROWS * LINE_BYTES).enumerate() {
            for (o, piece) in out.chunks_exact_mut(LINE_BYTES).enumerate() {
                let at = o * row_bytes + line * LINE_BYTES;
                piece.copy_from_slice(&s[at..at + LINE_BYTES]);
            }
        }
    }
}

impl ModelSpec {
    /// Marks every tensor that kernels with `f32_lanes`-wide vectors can read in row groups
    /// ([`ModelSpec::groupable`]); returns how many. The copies are made in memory beside the
    /// mapped weights, so none is marked unless the weights and the copies fit in three
    /// quarters of `memory` bytes (0: unknown), where the page cache would not have to evict
    /// weights to hold them. The caller decides whether the weights stay in memory at all
    /// (`--ram-budget` streams them as stored, so it groups none).
    pub fn group_rows(&mut self, f32_lanes: usize, memory: u64) -> usize {
        let ids: Vec<WeightId> = self
            .weight_ids()
            .map(|(id, _)| id)
            .filter(|&id| self.groupable(id, f32_lanes))
            .collect();
        let weights: usize = self.weights.iter().map(|t| t.bytes()).sum();
        let copies: usize = ids.iter().map(|&id| self.weight(id).bytes()).sum();
        if memory > 0 && (weights + copies) as u64 > memory / 4 * 3 {
            return 0;
        }
        for &id in &ids {
            self.weights[id.0 as usize].grouped_rows = true;
        }
        ids.len()
    }

    /// Whether tensor `id` is read in row groups: a bf16 or f16 matrix of whole groups of
    /// whole lines, read in quad order (vectors of 8 lanes or more), only as the weight of
    /// linear operations whose views start and end on a group and whose outputs are the gate
    /// or the up input of a gated activation (what decode fuses into `gate_up`).
    pub fn groupable(&self, id: WeightId, f32_lanes: usize) -> bool {
        let t = self.weight(id);
        let shaped = t.role == Role::Matrix
            && matches!(t.dtype, DType::BF16 | DType::F16)
            && t.shape.len() == 2
            && t.shape[0].is_multiple_of(GROUP_ROWS)
            && t.row_bytes().is_multiple_of(LINE_BYTES);
        if !shaped || f32_lanes < 8 {
            return false;
        }
        let mut linear = false;
        for op in &self.ops {
            match &op.kind {
                OpKind::Linear { w, bias, out, .. } if w.id == id => {
                    if !w.row0.is_multiple_of(GROUP_ROWS) || !w.rows.is_multiple_of(GROUP_ROWS) {
                        return false;
                    }
                    if !self.gates(*out) {
                        return false;
                    }
                    if bias.is_some_and(|b| b.id == id) {
                        return false;
                    }
                    linear = true;
                }
                kind => {
                    let (whole, gathered) = kind.weights_read();
                    if whole.contains(&id) || gathered.contains(&id) {
                        return false;
                    }
                }
            }
        }
        linear
    }

    /// Whether buffer `b` is the gate or the up input of a gated activation.
    fn gates(&self, b: BufId) -> bool {
        self.ops
            .iter()
            .any(|op| matches!(op.kind, OpKind::GatedAct { gate, up, .. } if gate == b || up == b))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::arch::{self, HfConfig};
    use crate::graph::{block_graph, decode_graph};
    use crate::kernel::Kernel;
    use serde_json::json;

    /// Qwen2.5-0.5B's published shape (tied embeddings), every matrix stored as `dtype`.
    fn qwen25(dtype: DType, intermediate: usize) -> ModelSpec {
        let config = json!({
            "architectures": ["Qwen2ForCausalLM"], "hidden_size": 896, "intermediate_size": intermediate,
            "num_hidden_layers": 2, "num_attention_heads": 14, "num_key_value_heads": 2,
            "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
            "tie_word_embeddings": true, "vocab_size": 151936
        });
        let map = config.as_object().expect("an object");
        let mut spec = arch::build(
            arch::by_hf_name("Qwen2ForCausalLM").expect("qwen2"),
            &HfConfig::new(map),
        )
        .expect("a valid config");
        for t in spec.weights.iter_mut().filter(|t| t.role == Role::Matrix) {
            t.dtype = dtype;
        }
        spec
    }

    fn grouped_names(spec: &ModelSpec) -> Vec<String> {
        spec.weights
            .iter()
            .filter(|t| t.grouped_rows)
            .map(|t| t.name.clone())
            .collect()
    }

    /// Exactly the gate and up projections are grouped: not the attention projections, the
    /// down projection, nor the tied token table the embedding gathers from.
    #[test]
    fn only_gate_and_up_projections_are_grouped() {
        let mut spec = qwen25(DType::BF16, 4864);
        assert_eq!(spec.group_rows(16, 0), 4);
        let names = grouped_names(&spec);
        assert!(
            names
                .iter()
                .all(|n| n.ends_with("mlp.gate_proj.weight") || n.ends_with("mlp.up_proj.weight")),
            "{names:?}"
        );
        // The kernels that read them say so: decode's fused gate_up and prefill's matmuls.
        let gate_up = decode_graph(&spec)
            .steps
            .iter()
            .filter(|s| matches!(s.kernel, Kernel::GateUp { grouped: true, .. }))
            .count();
        assert_eq!(gate_up, 2, "one fused gate_up per layer");
        let prefill = block_graph(&spec, 64)
            .steps
            .iter()
            .filter(|s| matches!(s.kernel, Kernel::MatMul { grouped: true, .. }))
            .count();
        assert_eq!(prefill, 4, "gate and up of each layer");
    }

    /// Nothing is grouped where the kernels would not read quad order (4-lane vectors), for
    /// f32 or quantised weights, or for rows that do not fill whole groups.
    #[test]
    fn groups_need_half_precision_quad_order_and_whole_groups() {
        assert_eq!(qwen25(DType::BF16, 4864).group_rows(4, 0), 0);
        assert_eq!(qwen25(DType::F32, 4864).group_rows(16, 0), 0);
        assert_eq!(qwen25(DType::Q8_0, 4864).group_rows(16, 0), 0);
        assert_eq!(qwen25(DType::BF16, 4868).group_rows(16, 0), 0);
        assert_eq!(qwen25(DType::F16, 4864).group_rows(8, 0), 4);
        // Two layers of the 0.5B shape and its token table hold ~0.33 GB, their gate and up
        // projections ~0.035 GB.
        assert_eq!(qwen25(DType::BF16, 4864).group_rows(16, 512 << 20), 4);
        assert_eq!(
            qwen25(DType::BF16, 4864).group_rows(16, 256 << 20),
            0,
            "no room for the copies"
        );
    }

    /// `pack` puts every byte where `offset` says, and nowhere else (a permutation).
    #[test]
    fn pack_places_each_byte_at_its_offset() {
        let (rows, row_bytes) = (8, 192);
        let src: Vec<u8> = (0..rows * row_bytes).map(|i| (i * 7 % 251) as u8).collect();
        let mut dst = vec![0u8; src.len()];
        pack(&src, &mut dst, row_bytes);
        let mut seen = vec![false; src.len()];
        for r in 0..rows {
            for c in 0..row_bytes {
                let at = offset(r, c, row_bytes);
                assert_eq!(dst[at], src[r * row_bytes + c], "row {r} byte {c}");
                assert!(!seen[at], "two bytes at {at}");
                seen[at] = true;
            }
        }
        // A group's first line holds line 0 of each of its rows, in row order.
        assert_eq!(&dst[64..128], &src[row_bytes..row_bytes + 64]);
    }

    /// A group of rows occupies the same bytes in both layouts, so a view that starts on a
    /// group starts at the same byte.
    #[test]
    fn groups_keep_their_byte_range() {
        let row_bytes = 128;
        for r in 0..12 {
            for c in 0..row_bytes {
                let group = r / GROUP_ROWS * GROUP_ROWS * row_bytes;
                let at = offset(r, c, row_bytes);
                assert!((group..group + GROUP_ROWS * row_bytes).contains(&at));
            }
        }
    }
}
