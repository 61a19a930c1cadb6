//! Half-precision weight matrices (the gate and up projections of a gated MLP, and the other
//! matrices of at least [`MIN_GROUPED_BYTES`]) read in *row groups*: each group of
//! [`GROUP_ROWS`] rows is stored as one run of *octet blocks* (the 8 elements `k..k + 8` of
//! each of the group's rows, 256 bytes), each row's octet a 16-byte *piece* whose elements sit
//! in the order the kernels consume them ([`PieceOrder`]). One aligned load of `O` consecutive
//! pieces is then a quad-order operand of `O` outputs (`compiler/src/emit/matmul/quad.rs`)
//! after at most a shift and a mask, and a decode step over a group is one sequential stream.
//!
//! Why: decode in quad order sums each output's four phases as four sequential FMA chains, so
//! a step that walks few rows is bound by the FMA latency, and reading rows row-major needs
//! transposes (two 16-byte-block shuffles and four widening shuffles per 64 bytes) and a
//! software prefetch per line of each row (rows a row apart are streams the hardware
//! prefetchers do not follow). Row-major, the exact form read 44 GB/s (4 rows a step) and 58
//! (8 rows) from L3 on 2 threads of a 2-core AMD EPYC Zen 4, below its ~55-65 GB/s memory in
//! the fast phase. In this layout a step of 16 rows (four 512-bit chains) takes per octet four
//! loads, four shifts, four masks and eight FMAs: 163-170 GB/s median from L3 and L2 in a C
//! model of the loop (256-bit vectors, eight chains: 95-99). In the model `gate_up` read the
//! same in these groups as in the 8-row line groups before them (Qwen2.5-0.5B shape, 47-57
//! GB/s in the fast phase either way), while large single matrices gained on row-major rows
//! ([`MIN_GROUPED_BYTES`] has the figures).
//!
//! The gate and up projections of a gated activation are stored as a *pair* ([`GroupPair`]):
//! their groups alternate (the gate's group `g`, then the up's group `g`), so decode's fused
//! `gate_up`, which reads a group of each in turn, reads one sequential stream where two
//! separate matrices made it two. Two streams per thread read slower than one: on a 2-core
//! Zen 4 EPYC, 2 threads, a C loop reading two arrays in lockstep read 44 GB/s against 60 for
//! one array (same bytes, fast memory phase), and `gate_up` read 3-7 % below the single
//! matrices of the same `k` in every profiled decode of the Qwen3.5-0.8B shape (11 % in the
//! fast phase). Each kernel reading a paired matrix addresses group `g` at `2 g`.
//!
//! The kernels compute the same products in the same order as from row-major rows (only
//! addresses and shuffles change), so results are bitwise those of the row-major layout. The
//! engine repacks the tensors [`ModelSpec::group_rows`] marks once, at load ([`pack`]).

use crate::Precision;
use crate::dtype::DType;
use crate::graph::OpKind;
use crate::spec::{BufId, ModelSpec, Role, WeightId, WeightRef};
use serde::{Deserialize, Serialize};

/// Rows per group: the rows one decode step walks (four 512-bit vectors of four outputs).
pub const GROUP_ROWS: usize = 16;

/// Elements of a row per piece: two quads of `k`.
pub const OCTET: usize = 8;

/// Smallest matrix other than a gate or up projection stored in row groups. Shorter streams
/// stay row-major, where decode's software prefetches run ahead from the first row: grouped,
/// the 0.5B shape's 896 x 896 projections (1.6 MB) read 27-28 GB/s in the model against 36-39
/// row-major (2-core Zen 4, 2 threads, fast memory phase). At 4 MiB and up grouping gains:
/// interleaved runs of both builds, each kernel's rate over the grouped `gate_up`'s rate in
/// the same run (the machine's bandwidth phases move both alike), 6 runs each: Qwen3.5-0.8B
/// shape with `--precision bf16`, its DeltaNet and attention projections and down 0.73-1.04
/// row-major against 1.03-1.11 grouped, decode in the fast phase 27.0-28.7 against 30.8-32.1
/// tok/s (68-75 % against 79-84 % of the read probe), in the slow one 87 % against 88-90 %;
/// Qwen2.5-0.5B exact, down 0.80-0.98 against 0.93-1.05. The copy costs start: a one-token
/// answer on the Qwen3.5 shape 0.24-0.29 s against 0.31-0.36 s (6 alternating runs).
pub const MIN_GROUPED_BYTES: usize = 4 << 20;

/// How a piece holds a row's octet `w[k..k + 8]`, chosen by what the kernels do with it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PieceOrder {
    /// bf16 widened to f32: 32-bit word `p` holds `(w[k + p], w[k + 4 + p])`, so a left shift
    /// by 16 gives the quad `k..k + 4` and a mask of the high half the quad `k + 4..k + 8`.
    Widen,
    /// bf16 multiplied in `vdpbf16ps` pairs (`--precision bf16`): the octet as stored.
    Pairs,
    /// f16 widened by `vcvtph2ps`: groups of 4 rows hold their first quads side by side, then
    /// their second quads, so each conversion reads 4 (or 2) rows' quads in a row.
    Quads,
}

/// `k` elements a `--precision bf16` kernel rounds and multiplies per step: rows must hold whole
/// steps for the pairs to apply.
pub const PAIR_STEP: usize = 32;

/// Whether a matmul over `k`-long rows of `dtype`, compiled with `f32_lanes`-wide vectors at
/// `precision`, multiplies in `vdpbf16ps` pairs (bf16 weights, 512-bit vectors, whole
/// [`PAIR_STEP`]s) rather than widening its weights: the compiler's choice, which the layout
/// of a row-grouped matrix must follow.
pub fn multiplies_in_pairs(dtype: DType, k: usize, f32_lanes: usize, precision: Precision) -> bool {
    precision == Precision::Bf16 && dtype == DType::BF16 && f32_lanes >= 16 && k.is_multiple_of(PAIR_STEP)
}

impl PieceOrder {
    /// The order for weights of `dtype` multiplied in pairs (`pairs`, [`multiplies_in_pairs`])
    /// or widened; `None` where row groups do not apply.
    pub fn for_weights(dtype: DType, pairs: bool) -> Option<PieceOrder> {
        match dtype {
            DType::BF16 if pairs => Some(PieceOrder::Pairs),
            DType::BF16 => Some(PieceOrder::Widen),
            DType::F16 if !pairs => Some(PieceOrder::Quads),
            _ => None,
        }
    }

    /// Where element `e` of row `r`'s octet lies in its group's octet block.
    pub fn within(self, r: usize, e: usize) -> usize {
        match self {
            PieceOrder::Widen => r * OCTET + if e < 4 { 2 * e } else { 2 * (e - 4) + 1 },
            PieceOrder::Pairs => r * OCTET + e,
            PieceOrder::Quads => r / 4 * 32 + e / 4 * 16 + r % 4 * 4 + e % 4,
        }
    }
}

/// Two matrices whose row groups alternate in storage: `partner` is the other one, and
/// `second` says whether this one's group `g` is the second of pair `g` (the up projection)
/// rather than the first (the gate).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct GroupPair {
    pub partner: WeightId,
    pub second: bool,
}

/// Where element `k` of row `row` (of rows `row_elems` long) lies in the grouped layout, in
/// elements from the start of the matrix, its groups `pitch` groups' length apart (2 for a
/// [`GroupPair`]).
pub fn offset(order: PieceOrder, row: usize, k: usize, row_elems: usize, pitch: usize) -> usize {
    let (group, r) = (row / GROUP_ROWS, row % GROUP_ROWS);
    group * pitch * GROUP_ROWS * row_elems + k / OCTET * GROUP_ROWS * OCTET + order.within(r, k % OCTET)
}

/// Writes the whole groups of the row-major matrices `srcs` (2-byte elements, rows
/// `row_elems` long, a multiple of [`OCTET`], each the same number of whole groups) into `dst`
/// in the grouped layout, their groups alternating: group `g` of `srcs[s]` at group
/// `g * srcs.len() + s` of `dst` (one matrix, or a [`GroupPair`]). `dst` holds the bytes of
/// them all. Each row is read once in order and its pieces placed whole (the engine packs at
/// start, so this runs over hundreds of megabytes on the way to the first token: placing
/// element by element cost ~0.02 s more per start on the 0.5B shape).
pub fn pack(order: PieceOrder, srcs: &[&[u8]], dst: &mut [u8], row_elems: usize) {
    const PIECE: usize = OCTET * 2;
    let group_bytes = GROUP_ROWS * row_elems * 2;
    let len = srcs.first().map_or(0, |s| s.len());
    assert!(row_elems.is_multiple_of(OCTET) && len.is_multiple_of(group_bytes));
    assert!(srcs.iter().all(|s| s.len() == len));
    assert_eq!(len * srcs.len(), dst.len());
    let block_bytes = GROUP_ROWS * PIECE;
    let groups = (0..len / group_bytes).flat_map(|g| srcs.iter().map(move |s| &s[g * group_bytes..][..group_bytes]));
    for (s, d) in groups.zip(dst.chunks_exact_mut(group_bytes)) {
        for (r, row) in s.chunks_exact(row_elems * 2).enumerate() {
            let at = order.within(r, 0) * 2;
            for (piece, block) in row.chunks_exact(PIECE).zip(d.chunks_exact_mut(block_bytes)) {
                place(order, piece, &mut block[at..]);
            }
        }
    }
}

/// Writes one row's piece (its octet as stored) from the start of `out`, the row's place in
/// its octet block: as stored, or in the order `order` keeps ([`PieceOrder::within`]).
fn place(order: PieceOrder, piece: &[u8], out: &mut [u8]) {
    match order {
        PieceOrder::Pairs => out[..OCTET * 2].copy_from_slice(piece),
        PieceOrder::Widen => {
            for p in 0..4 {
                out[4 * p..4 * p + 2].copy_from_slice(&piece[2 * p..2 * p + 2]);
                out[4 * p + 2..4 * p + 4].copy_from_slice(&piece[8 + 2 * p..8 + 2 * p + 2]);
            }
        }
        PieceOrder::Quads => {
            // The second quad lies a half block (4 rows' first quads) after the first.
            let second = order.within(0, 4) * 2;
            out[..8].copy_from_slice(&piece[..8]);
            out[second..second + 8].copy_from_slice(&piece[8..]);
        }
    }
}

impl ModelSpec {
    /// Marks every tensor that kernels with `f32_lanes`-wide vectors can read in row groups
    /// ([`ModelSpec::groupable`]) with the [`PieceOrder`] kernels compiled at `precision`
    /// read; returns how many. None is marked unless what stays in memory, the weights, fits
    /// in three quarters of `memory` bytes (0: unknown), where the page cache would not have
    /// to evict weights to hold it: a grouped tensor's copy takes its source's place, since
    /// the source is read only to pack it (on a first start) and the engine then drops its
    /// pages from the process (`WeightSource::release`; before that, a model the loaders
    /// page in ahead held both, ~2x its size). The caller decides whether the weights stay in
    /// memory at all (`--ram-budget` streams them as stored, so it groups none).
    pub fn group_rows(&mut self, f32_lanes: usize, precision: Precision, memory: u64) -> usize {
        let ids: Vec<WeightId> = self
            .weight_ids()
            .map(|(id, _)| id)
            .filter(|&id| self.groupable(id, f32_lanes))
            .collect();
        let weights = self.weights.iter().map(|t| t.bytes() as u64).sum::<u64>();
        if memory > 0 && weights > memory / 4 * 3 {
            return 0;
        }
        for &id in &ids {
            let t = &mut self.weights[id.0 as usize];
            let pairs = multiplies_in_pairs(t.dtype, t.shape[1], f32_lanes, precision);
            t.row_groups = PieceOrder::for_weights(t.dtype, pairs);
        }
        for (gate, up) in self.gate_up_pairs() {
            self.weights[gate.0 as usize].group_pair = Some(GroupPair {
                partner: up,
                second: false,
            });
            self.weights[up.0 as usize].group_pair = Some(GroupPair {
                partner: gate,
                second: true,
            });
        }
        ids.len()
    }

    /// The (gate, up) weights of each gated activation that can be stored as a [`GroupPair`]:
    /// two distinct matrices of one shape, type and piece order, each read whole (not row
    /// views of one fused tensor) by the linear operation that produces its input.
    fn gate_up_pairs(&self) -> Vec<(WeightId, WeightId)> {
        // The linear operation that last wrote buffer `b` before operation `a` (buffers are
        // reused from layer to layer).
        let producer = |a: usize, b: BufId| {
            self.ops[..a].iter().rev().find_map(|op| match op.kind {
                OpKind::Linear { w, out, .. } if out == b => Some(w),
                _ => None,
            })
        };
        let mut pairs: Vec<(WeightId, WeightId)> = Vec::new();
        for (a, op) in self.ops.iter().enumerate() {
            let OpKind::GatedAct { gate, up, .. } = op.kind else {
                continue;
            };
            let (Some(g), Some(u)) = (producer(a, gate), producer(a, up)) else {
                continue;
            };
            let (tg, tu) = (self.weight(g.id), self.weight(u.id));
            let whole = |w: WeightRef, t: &crate::spec::Tensor| w.row0 == 0 && w.rows == t.shape[0];
            let fits = g.id != u.id
                && tg.row_groups.is_some()
                && (tg.row_groups, &tg.shape, tg.dtype) == (tu.row_groups, &tu.shape, tu.dtype)
                && whole(g, tg)
                && whole(u, tu);
            let taken = |id: WeightId| pairs.iter().any(|&(a, b)| a == id || b == id);
            if fits && !taken(g.id) && !taken(u.id) {
                pairs.push((g.id, u.id));
            }
        }
        pairs
    }

    /// Whether tensor `id` is read in row groups: a bf16 or f16 matrix of whole groups of
    /// whole octets, read in quad order (vectors of 8 lanes or more), only as the weight of
    /// linear operations whose views start and end on a group, and either the gate or the up
    /// input of a gated activation (what decode fuses into `gate_up`) or at least
    /// [`MIN_GROUPED_BYTES`]. A tied token table qualifies as its output head (the embedding
    /// gathers its rows in the grouped layout too): at 0.25-0.5 GB it is the largest matrix
    /// decode reads, a third of the Qwen3.5-0.8B's bytes per token.
    pub fn groupable(&self, id: WeightId, f32_lanes: usize) -> bool {
        let t = self.weight(id);
        let shaped = t.role == Role::Matrix
            && matches!(t.dtype, DType::BF16 | DType::F16)
            && t.shape.len() == 2
            && t.shape[0].is_multiple_of(GROUP_ROWS)
            && t.shape[1].is_multiple_of(OCTET);
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
                    if !self.gates(*out) && t.bytes() < MIN_GROUPED_BYTES {
                        return false;
                    }
                    if bias.is_some_and(|b| b.id == id) {
                        return false;
                    }
                    linear = true;
                }
                // The embedding gathers rows of a tied table in its layout (`Kernel::Embed`).
                OpKind::Embed { table, positions, .. } if *table == id && *positions != Some(id) => {}
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
    use crate::graph::{block_graph, decode_graph, head_graph};
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
            .filter(|t| t.row_groups.is_some())
            .map(|t| t.name.clone())
            .collect()
    }

    /// Exactly the gate and up projections and the other matrices of at least 4 MiB are
    /// grouped: the down projection (8.7 MB) and the tied token table (272 MB, the output
    /// head), not the attention projections (1.6 MB and less).
    #[test]
    fn gate_up_and_large_projections_are_grouped() {
        let mut spec = qwen25(DType::BF16, 4864);
        assert_eq!(spec.group_rows(16, Precision::Exact, 0), 7);
        let names = grouped_names(&spec);
        assert!(
            names.iter().all(|n| n == "model.embed_tokens.weight"
                || ["gate_proj", "up_proj", "down_proj"]
                    .iter()
                    .any(|m| n.ends_with(&format!("mlp.{m}.weight")))),
            "{names:?}"
        );
        assert!(names.iter().any(|n| n == "model.embed_tokens.weight"), "{names:?}");
        assert!(spec.weights.iter().all(|t| t.row_groups != Some(PieceOrder::Pairs)));
        // The kernels that read them say so: decode's fused gate_up and down matmuls, the
        // head's matmul and the embedding in its order, and prefill's matmuls.
        let count = |steps: &[crate::graph::Step], gate_up: bool| {
            steps
                .iter()
                .filter(|s| match s.kernel {
                    Kernel::GateUp { grouped, .. } => gate_up && grouped,
                    Kernel::MatMul { grouped, .. } => !gate_up && grouped,
                    _ => false,
                })
                .count()
        };
        let embeds_grouped = |steps: &[crate::graph::Step]| {
            steps
                .iter()
                .filter_map(|s| match s.kernel {
                    Kernel::Embed { grouped, .. } => Some(grouped),
                    _ => None,
                })
                .collect::<Vec<_>>()
        };
        // Each layer's gate and up are a pair (the gate first), and nothing else is.
        for (id, t) in spec.weight_ids() {
            let pair = t.group_pair;
            if t.name.ends_with("mlp.gate_proj.weight") {
                let p = pair.expect("the gate is paired");
                let up = spec.weight(p.partner);
                assert_eq!(up.name, t.name.replace("gate_proj", "up_proj"));
                assert_eq!(
                    up.group_pair,
                    Some(GroupPair {
                        partner: id,
                        second: true
                    })
                );
                assert!(!p.second);
            } else if !t.name.ends_with("mlp.up_proj.weight") {
                assert_eq!(pair, None, "{}", t.name);
            }
        }
        let paired = |steps: &[crate::graph::Step]| {
            steps
                .iter()
                .filter(|s| {
                    matches!(
                        s.kernel,
                        Kernel::GateUp { paired: true, .. } | Kernel::MatMul { paired: true, .. }
                    )
                })
                .count()
        };
        let decode = decode_graph(&spec);
        assert_eq!(count(&decode.steps, true), 2, "one fused gate_up per layer");
        assert_eq!(paired(&decode.steps), 2, "reading its pair");
        assert_eq!(
            paired(&block_graph(&spec, 64).steps),
            4,
            "prefill's gate and up matmuls"
        );
        assert_eq!(count(&decode.steps, false), 2, "one down projection per layer");
        assert_eq!(embeds_grouped(&decode.steps), [Some(PieceOrder::Widen)]);
        assert_eq!(count(&head_graph(&spec).steps, false), 1, "the tied head");
        let prefill = block_graph(&spec, 64);
        assert_eq!(count(&prefill.steps, false), 6, "gate, up and down of each layer");
        assert_eq!(embeds_grouped(&prefill.steps), [Some(PieceOrder::Widen)]);
        // A narrower MLP's down projection (896 x 1024, 1.8 MB) stays row-major.
        assert_eq!(qwen25(DType::BF16, 1024).group_rows(16, Precision::Exact, 0), 5);
    }

    /// Nothing is grouped where the kernels would not read quad order (4-lane vectors), for
    /// f32 or quantised weights, or for rows that do not fill whole groups and octets; f16
    /// rows are converted by quads, and `--precision bf16` pairs take the pieces as stored.
    #[test]
    fn groups_need_half_precision_quad_order_and_whole_groups() {
        let groups = |dtype, intermediate, lanes, precision, memory| {
            qwen25(dtype, intermediate).group_rows(lanes, precision, memory)
        };
        assert_eq!(groups(DType::BF16, 4864, 4, Precision::Exact, 0), 0);
        assert_eq!(groups(DType::F32, 4864, 16, Precision::Exact, 0), 0);
        assert_eq!(groups(DType::Q8_0, 4864, 16, Precision::Exact, 0), 0);
        // An MLP of 4868 rows fills no whole groups: only the token table is grouped.
        assert_eq!(groups(DType::BF16, 4868, 16, Precision::Exact, 0), 1);
        assert_eq!(groups(DType::F16, 4864, 8, Precision::Exact, 0), 7);
        let mut f16 = qwen25(DType::F16, 4864);
        f16.group_rows(16, Precision::Bf16, 0);
        let mut bf16 = qwen25(DType::BF16, 4864);
        bf16.group_rows(16, Precision::Bf16, 0);
        let orders = |s: &ModelSpec| s.weights.iter().filter_map(|t| t.row_groups).collect::<Vec<_>>();
        assert!(orders(&f16).iter().all(|&o| o == PieceOrder::Quads));
        assert!(orders(&bf16).iter().all(|&o| o == PieceOrder::Pairs));
        // Two layers of the 0.5B shape and its token table hold ~0.33 GB, their gate, up and
        // down projections and the table ~0.32 GB.
        // The copies replace their sources in memory (paged in ahead or not), so the weights
        // alone must fit in three quarters of it.
        for memory in [1 << 30, 768 << 20, 512 << 20] {
            assert_eq!(groups(DType::BF16, 4864, 16, Precision::Exact, memory), 7, "{memory}");
        }
        assert_eq!(groups(DType::BF16, 4864, 16, Precision::Exact, 400 << 20), 0);
    }

    /// The pairs apply exactly where the compiler multiplies in pairs: bf16 weights, 512-bit
    /// vectors, whole steps of 32.
    #[test]
    fn pairs_need_bf16_wide_vectors_and_whole_steps() {
        assert!(multiplies_in_pairs(DType::BF16, 896, 16, Precision::Bf16));
        assert!(!multiplies_in_pairs(DType::BF16, 896, 16, Precision::Exact));
        assert!(!multiplies_in_pairs(DType::BF16, 896, 8, Precision::Bf16));
        assert!(!multiplies_in_pairs(DType::BF16, 904, 16, Precision::Bf16));
        assert!(!multiplies_in_pairs(DType::F16, 896, 16, Precision::Bf16));
    }

    const ORDERS: [PieceOrder; 3] = [PieceOrder::Widen, PieceOrder::Pairs, PieceOrder::Quads];

    /// `pack` puts every element where `offset` says, and nowhere else (a permutation), and a
    /// group of rows keeps the elements it held row-major, so a view that starts on a group
    /// starts at the same element.
    #[test]
    fn pack_places_each_element_at_its_offset() {
        let (rows, k) = (2 * GROUP_ROWS, 24);
        let src: Vec<u16> = (0..rows * k).map(|i| i as u16).collect();
        let bytes: Vec<u8> = src.iter().flat_map(|v| v.to_le_bytes()).collect();
        for order in ORDERS {
            let mut dst = vec![0u8; bytes.len()];
            pack(order, &[&bytes], &mut dst, k);
            let got: Vec<u16> = dst.chunks_exact(2).map(|c| u16::from_le_bytes([c[0], c[1]])).collect();
            let mut seen = vec![false; got.len()];
            for r in 0..rows {
                for c in 0..k {
                    let at = offset(order, r, c, k, 1);
                    assert_eq!(got[at], src[r * k + c], "{order:?}: row {r} element {c}");
                    assert!(!seen[at], "{order:?}: two elements at {at}");
                    seen[at] = true;
                    let group = r / GROUP_ROWS * GROUP_ROWS * k;
                    assert!((group..group + GROUP_ROWS * k).contains(&at));
                }
            }
        }
    }

    /// Two matrices packed as a pair: every element of each lies at its `offset` with pitch 2
    /// from the matrix's first group (the second's one group into the pair), so the kernels'
    /// pitch-2 addresses read each matrix's own elements.
    #[test]
    fn a_pair_places_each_matrix_at_its_pitch_2_offsets() {
        let (rows, k) = (3 * GROUP_ROWS, 24);
        let matrix = |base: usize| -> Vec<u16> { (0..rows * k).map(|i| (base + i) as u16).collect() };
        let (gate, up) = (matrix(0), matrix(rows * k));
        let bytes = |m: &[u16]| -> Vec<u8> { m.iter().flat_map(|v| v.to_le_bytes()).collect() };
        for order in ORDERS {
            let mut dst = vec![0u8; 2 * rows * k * 2];
            pack(order, &[&bytes(&gate), &bytes(&up)], &mut dst, k);
            let got: Vec<u16> = dst.chunks_exact(2).map(|c| u16::from_le_bytes([c[0], c[1]])).collect();
            for (m, first) in [(&gate, 0), (&up, GROUP_ROWS * k)] {
                for r in 0..rows {
                    for c in 0..k {
                        let at = first + offset(order, r, c, k, 2);
                        assert_eq!(got[at], m[r * k + c], "{order:?}: row {r} element {c}");
                    }
                }
            }
        }
    }

    /// What the kernels load: an octet's pieces of `O` rows from a multiple of `O` (2 or 4)
    /// lie side by side, and in each order one load of them is the quad-order operand (words
    /// `(k + p, k + 4 + p)` per row for the shift and the mask; the octet as stored for the
    /// pairs; for quads, the rows' first quads, then their second quads).
    #[test]
    fn an_octet_of_aligned_rows_is_one_quad_order_operand() {
        let k = 16;
        for order in ORDERS {
            for (o_n, row0) in [(4, 4), (2, 6), (4, 12)] {
                let base = offset(order, row0, 8, k, 1);
                let want: Vec<(usize, usize)> = match order {
                    PieceOrder::Widen => (0..o_n)
                        .flat_map(|o| (0..4).flat_map(move |p| [(o, p), (o, p + 4)]))
                        .collect(),
                    PieceOrder::Pairs => (0..o_n).flat_map(|o| (0..8).map(move |e| (o, e))).collect(),
                    PieceOrder::Quads => (0..2)
                        .flat_map(|h| (0..o_n).flat_map(move |o| (0..4).map(move |p| (o, 4 * h + p))))
                        .collect(),
                };
                for (i, (o, e)) in want.into_iter().enumerate() {
                    // Quads leave the other pair of rows' quads between the halves when O = 2.
                    let i = if order == PieceOrder::Quads && i >= 4 * o_n {
                        i - 4 * o_n + 16
                    } else {
                        i
                    };
                    assert_eq!(
                        offset(order, row0 + o, 8 + e, k, 1),
                        base + i,
                        "{order:?} O {o_n} row {o} element {e}"
                    );
                }
            }
        }
    }
}
