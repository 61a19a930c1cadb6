//! Half-precision-weight (bf16, f16) matmuls in *quad order*: an outer-product prefill
//! micro-kernel and the decode loop that computes every output with the same FMAs in the same
//! order.
//!
//! Why: the dot-product micro-kernel (vectors along `k` on both sides) needs a full activation
//! vector from L2 for every few FMAs and one accumulator per output *and lane*, so it ran at
//! 51-68 % of the FMA peak on a Zen 4 EPYC. An outer-product kernel (vectors along `n`, the
//! activation broadcast) reuses each loaded value many more times, but a pure one sums every
//! output as one chain in `k` order, which decode could only reproduce by transposing every
//! weight row it streams. Quad order is the middle way both regimes can do cheaply:
//!
//! * A vector of `lanes` holds `O = lanes / 4` outputs times 4 *phases*: lane `4 o + p`
//!   accumulates `w[n0 + o][k] * x[k]` over `k = p (mod 4)`, in increasing `k`, one FMA per
//!   quad of `k`. The activation operand is the quad `x[k..k + 4]` repeated `O` times (one
//!   `vbroadcastf32x4` load); the weight operand is the 16-byte pieces `w[n0 + o][k..k + 4]` of
//!   `O` rows side by side.
//! * Each output is then `(p0 + p2) + (p1 + p3)` ([`combine_quads`]). Nothing in the order
//!   depends on the vector width, so the two regimes need not use the same one.
//! * Prefill packs a block of weight rows into that layout once per chunk of `k` (a transpose
//!   of 16-byte pieces, [`pieces::transpose_blocks`]) and runs an `mr x nv` tile of
//!   accumulators over it: `nv` weight vectors and `mr` activation quads per `4 k`, against
//!   `mr * nv` FMAs.
//! * Decode loads `O` weight rows a vector at a time, transposes the pieces in registers (one
//!   shuffle level: decode uses 8 lanes, [`MatMul::quad_decode_lanes`]) and folds them into
//!   the same chains.
//!
//! `--precision bf16` multiplies in the same order with pairs ([`Form::Pairs`]): a lane takes
//! `vdpbf16ps`'s pair of bf16 products where the f32 form takes one product, so lane `4 o + p`
//! sums the pairs `k = 8 m + 2 p, 8 m + 2 p + 1` and a 16-byte piece is 8 bf16 of a row,
//! transposed as stored (no widening). The activation pieces come from the rows rounded to
//! bf16 once per call ([`super::bf16_rows`]).
//!
//! With 4 lanes a vector is one output's 4 phases: that is the dot-product order already, so
//! quad order applies from 8 lanes up; quantised and f32 weights keep theirs ([`MatMul::quad`]
//! says why for f32).

use super::decode::{Tile, decode_prefetches, prefetch_ahead};
use super::{MatMul, Part, exp_var, park_accs, resume_accs, split_blocks};
use crate::emit::Dyn;
use crate::ir::{Cmp, Kb};
use kiln_core::DType;
use kiln_core::grouped::{GROUP_ROWS, OCTET};
use melior::ir::Value;

mod pieces;
use pieces::{elems_per_line, row_span, weight_quads};

/// `k` elements per phase group: each lane sums every fourth product.
pub(super) const QUAD: usize = 4;

/// What a lane multiplies per step of its phase.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Form {
    /// Weights widened to f32 times the f32 activations: one FMA per element of `k`.
    Fma,
    /// bf16 weights as stored times the bf16-rounded activations: one `vdpbf16ps` pair per
    /// two elements of `k` (`--precision bf16`).
    Pairs,
}

impl Form {
    /// Elements of `k` a lane takes per instruction.
    fn per_lane(self) -> usize {
        match self {
            Form::Fma => 1,
            Form::Pairs => 2,
        }
    }

    /// Elements of `k` in one piece (a row's 16 bytes in the packed or transposed layout: the
    /// `k` that all `4` phases of an output cover per instruction).
    fn piece(self) -> usize {
        QUAD * self.per_lane()
    }

    /// The element type the packed panel holds.
    fn panel_elem(self) -> (&'static str, usize) {
        match self {
            Form::Fma => ("f32", 4),
            Form::Pairs => ("bf16", 2),
        }
    }
}

/// Outputs one vector of `lanes` holds in quad order.
pub(super) fn outputs_per_vector(lanes: usize) -> usize {
    lanes / QUAD
}

/// Largest prefill weight panel (`chunk * nv * lanes / 4 * 4` bytes). Panels this large sit
/// in L2, not L1, but split `k` into fewer chunks (each chunk re-reads and re-writes every
/// tile's accumulators). On the 0.5B shape (Zen 4 EPYC, 2 threads, 256-token prefill, medians
/// of 5 interleaved runs): 64 KiB 236 tok/s, 32 KiB 230, whole rows (no chunks) 226.
const PANEL_BYTES: usize = 64 << 10;

/// The weight rows of the block a thread packs next (`rows` rows from `row0`, the chunk of
/// `k` being computed), prefetched into L2 while the row tiles of the current block run:
/// packing reads `nb` rows side by side, too many streams for the hardware prefetchers, and
/// its misses to memory otherwise stalled the core (the kernel ran at 70-75 % of the FMA peak
/// with its weights in memory, about 85 % with them in cache). Tile `t`'s loop iteration `i`
/// prefetches its share of that region ([`prefetch_next`]).
#[derive(Clone, Copy)]
struct NextBlock<'c, 'a> {
    w: Value<'c, 'a>,
    dtype: DType,
    n: usize,
    k: usize,
    row0: Value<'c, 'a>,
    rows: usize,
    tile: Value<'c, 'a>,
    share: Share<'c, 'a>,
    /// The matrix's row groups lie this many groups' length apart (2 for a pair): the block's
    /// lines are then its own groups', not the rows' range read row-major.
    pitch: usize,
}

/// How the next block's lines are shared between the full tiles of a call.
#[derive(Clone, Copy)]
enum Share<'c, 'a> {
    /// Lines per loop iteration as if the call ran the full tiles of `max_rows` rows (this
    /// many; at least one line): calls with fewer tiles cover part of the block (at least half
    /// where `prefill_quad` picks this share), calls with more fetch further ahead.
    Fixed(usize),
    /// Split evenly between the tiles this call runs (this many, at run time), several lines
    /// per iteration: for calls whose tiles would cover less than half the block one line at
    /// a time. A 16-token prompt through a 256-row block kernel (two tiles of 6 rows) had
    /// prefetched a quarter of each next block. 0.5B shape, 2-core Zen 5, 2 threads, prefill
    /// tok/s: 16 tokens 273-293 -> 340-381; at 32 tokens (62 % covered) the run-time share
    /// was 2-3 % slower than the fixed one (its inner loop), so the fixed share stays there.
    Run(Value<'c, 'a>),
}

impl Share<'_, '_> {
    /// Lines per iteration of a `Fixed` share: at least one, the block over all the tiles.
    fn fixed_per_iter(tiles: usize, total: usize, iters: usize) -> usize {
        total.div_ceil(tiles * iters).max(1)
    }
}

/// Register tile `(mr, nv)` of the prefill micro-kernel: `mr * nv` accumulators, `nv` weight
/// vectors and an activation quad in the register file (32 with AVX-512, 16 with AVX2).
fn quad_tile(max_lanes: usize) -> (usize, usize) {
    let (mr, nv) = if max_lanes >= 16 { (6, 4) } else { (3, 3) };
    (
        exp_var("KILN_EXP_QMR").unwrap_or(mr),
        exp_var("KILN_EXP_QNV").unwrap_or(nv),
    )
}

/// The quad `x[r][k..k + 4]` repeated across `lanes` (one 128-bit broadcast load).
fn x_quad<'c, 'b>(b: Kb<'c, 'b>, x: Value<'c, '_>, r: Value<'c, '_>, k: Value<'c, '_>, lanes: usize) -> Value<'c, 'b> {
    let q = b.load_f32(x, &[r, k], QUAD);
    let mask: Vec<usize> = (0..lanes).map(|l| l % QUAD).collect();
    b.shuffle(q, q, &mask)
}

/// `acc` plus the products of a weight operand and an activation operand in `form`.
fn multiply<'c, 'b>(
    b: Kb<'c, 'b>,
    form: Form,
    w: Value<'c, 'b>,
    x: Value<'c, 'b>,
    acc: Value<'c, 'b>,
) -> Value<'c, 'b> {
    match form {
        Form::Fma => b.fma(w, x, acc),
        Form::Pairs => b.dot_bf16_pairs(acc, x, w),
    }
}

/// The sums of four quad-order accumulators (`4 O = lanes` outputs: `vs[0]`'s, then `vs[1]`'s
/// ...) as one vector, each output `(p0 + p2) + (p1 + p3)`: first each pair of vectors folds
/// its phases two apart into one vector, then the two halves' neighbouring lanes are added.
/// Missing vectors (fewer than four) read as zeros; their lanes are not outputs.
fn combine_quads<'c, 'b>(b: Kb<'c, 'b>, vs: &[Value<'c, 'b>], lanes: usize) -> Value<'c, 'b> {
    debug_assert!(!vs.is_empty() && vs.len() <= QUAD);
    let zero = b.zero_like(lanes);
    let v = |i: usize| vs.get(i).copied().unwrap_or(zero);
    // Lane `2 i + h` of a folded pair: output `i` of the pair's `2 O` (at lanes `4 i..` of the
    // two vectors side by side), phases `h` and `h + 2`.
    let fold = |phase: usize| -> Vec<usize> {
        (0..lanes / 2)
            .flat_map(|i| (0..2).map(move |h| i * QUAD + h + phase))
            .collect()
    };
    let pair = |a: Value<'c, 'b>, c: Value<'c, 'b>| b.addf(b.shuffle(a, c, &fold(0)), b.shuffle(a, c, &fold(2)));
    let (lo, hi) = (pair(v(0), v(1)), pair(v(2), v(3)));
    let pick = |h: usize| -> Vec<usize> { (0..lanes).map(|i| 2 * i + h).collect() };
    b.addf(b.shuffle(lo, hi, &pick(0)), b.shuffle(lo, hi, &pick(1)))
}

/// Cache lines of the next block's chunk of `len` elements of `rows` rows.
fn next_block_lines(dtype: DType, rows: usize, len: usize) -> usize {
    (rows * len).div_ceil(elems_per_line(dtype))
}

/// Loop iteration `i` (of `iters` per tile) of tile `nb.tile`, in the chunk `k0..k0 + len`:
/// its share of the next block's lines. The block's rows are one contiguous range of the
/// matrix, walked in address order: chunk by chunk, each chunk's share is the next `rows *
/// len` elements of that range (every line is fetched before the block is packed, though not
/// in the order packing reads them), so a line's address is a multiply-add.
fn prefetch_next<'c>(
    b: Kb<'c, '_>,
    nb: NextBlock<'c, '_>,
    i: Value<'c, '_>,
    iters: usize,
    len: usize,
    k0: Value<'c, '_>,
) {
    let per_line = elems_per_line(nb.dtype);
    let total = next_block_lines(nb.dtype, nb.rows, len);
    let start = b.addi(b.muli(nb.row0, b.idx(nb.k)), b.muli(k0, b.idx(nb.rows)));
    let slot = b.addi(b.muli(nb.tile, b.idx(iters)), i);
    let group = GROUP_ROWS * nb.k;
    let last = b.idx(nb.n * nb.k * nb.pitch - (nb.pitch - 1) * group - 1);
    // Flat element index into the row-major matrix (row 0, column past `k`: the same address
    // as its row and column), clamped to the matrix. A paired matrix's group `g` starts at
    // `g * pitch` groups (the block starts on a group, so its lines' groups are the range's).
    let fetch = |b: Kb<'c, '_>, at: Value<'c, '_>| {
        if nb.pitch == 1 {
            b.prefetch_with(nb.w, &[b.idx(0), b.minui(at, last)], 2);
        } else {
            let g = b.idx(group);
            let own = b.addi(b.muli(b.divui(at, g), b.idx(nb.pitch * group)), b.remui(at, g));
            b.prefetch_with(nb.w, &[b.idx(0), b.minui(own, last)], 2);
        }
    };
    match nb.share {
        Share::Fixed(tiles) => {
            let per_iter = Share::fixed_per_iter(tiles, total, iters);
            let first = b.addi(start, b.muli(slot, b.idx(per_iter * per_line)));
            for l in 0..per_iter {
                fetch(b, b.addi(first, b.idx(l * per_line)));
            }
        }
        Share::Run(tiles) => {
            let per_iter = b.ceildivui(b.idx(total), b.muli(tiles, b.idx(iters)));
            let first = b.addi(start, b.muli(slot, b.muli(per_iter, b.idx(per_line))));
            b.for_each(b.idx(0), per_iter, b.idx(1), |b, l| {
                fetch(b, b.addi(first, b.muli(l, b.idx(per_line))))
            });
        }
    }
}

impl<'c, 'a> MatMul<'c, 'a> {
    /// Whether weights of `dtype` are multiplied in quad order: bf16 and f16 weights, at
    /// least 8 lanes, no q8 rows; bf16 pairs always are. f32 weights keep the dot-product
    /// order of the quantised kernels: `--dequantize f32` then computes bit for bit what the
    /// quantised kernels do (`tests/gguf.rs` holds them to that), an exact check of every
    /// format's dequantisation.
    pub(in crate::emit) fn quad(&self, dtype: DType) -> bool {
        matches!(dtype, DType::BF16 | DType::F16)
            && self.lanes >= 8
            && self.q8.is_none()
            && (self.pairs(dtype) || exp_var("KILN_EXP_NOQUAD").is_none())
    }

    /// The quad-order form for weights of `dtype` (where [`MatMul::quad`] holds).
    fn form(&self, dtype: DType) -> Form {
        if self.pairs(dtype) { Form::Pairs } else { Form::Fma }
    }

    /// The activation operand for the piece of `k` from `k` of row `r`, repeated across a
    /// vector of `lanes` f32 lanes: the quad of f32 ([`x_quad`]), or 8 rounded bf16.
    fn x_piece<'b>(
        &self,
        b: Kb<'c, 'b>,
        form: Form,
        r: Value<'c, '_>,
        k: Value<'c, '_>,
        lanes: usize,
    ) -> Value<'c, 'b> {
        match form {
            Form::Fma => x_quad(b, self.x, r, k, lanes),
            Form::Pairs => {
                let xr = self.x_bf16.expect("pairs in quad order read the rounded rows");
                let piece = b.load_bf16s(xr, &[r, k], form.piece());
                let mask: Vec<usize> = (0..2 * lanes).map(|l| l % form.piece()).collect();
                b.shuffle_any(piece, piece, &mask)
            }
        }
    }

    /// Vector width of decode in quad order (the order does not depend on it: see the module
    /// doc): at most 8 lanes. With 16, each transposition of four rows takes two levels of
    /// 512-bit cross-lane shuffles; with 8, one level of `vperm2i128` per pair of rows (2
    /// threads, weights in L3, Zen 4 EPYC: 43 -> 44 GB/s median, 55 -> 58 best).
    /// Row-grouped weights need no transposition: they take the full width.
    /// The pitch of the row groups where the weights are grouped ([`weight_quads`]).
    fn groups(&self) -> Option<usize> {
        self.grouped.then_some(self.group_pitch)
    }

    pub(super) fn quad_decode_lanes(&self) -> usize {
        if self.grouped {
            return self.lanes;
        }
        exp_var("KILN_EXP_QDLANES").unwrap_or(8).min(self.lanes)
    }

    /// Prefill in quad order: threads split the output rows in blocks of `nv * O`; each block
    /// is packed a chunk of `k` at a time and every row tile runs over the packed chunk.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn prefill_quad(
        &self,
        b: Kb<'c, '_>,
        w: Value<'c, '_>,
        dtype: DType,
        n: usize,
        d: Dyn<'c, '_>,
        max_rows: usize,
        max_lanes: usize,
    ) {
        let lanes = self.lanes;
        let form = self.form(dtype);
        let o_n = outputs_per_vector(lanes);
        let (mr, nv) = quad_tile(max_lanes);
        let nv = nv.min(n.div_ceil(o_n));
        let nb = nv * o_n;
        let panel_bytes = exp_var("KILN_EXP_QPANEL").unwrap_or(PANEL_BYTES);
        let span = row_span(dtype, lanes, self.k, form);
        let (elem, elem_bytes) = form.panel_elem();
        let chunk = (panel_bytes / (nb * elem_bytes) / span * span).clamp(span, self.k);
        let width = nv * lanes * form.per_lane();
        let panel = b.alloca(&format!("memref<{}x{width}x{elem}>", chunk / form.piece()));
        let acc = (chunk < self.k).then(|| b.alloca(&format!("memref<{max_rows}x{}xf32>", nv * lanes)));
        let parts = Part::split(self.k, chunk);
        let block = |b: Kb<'c, '_>, n0: Value<'c, '_>, cols: usize| {
            let vecs = cols.div_ceil(o_n);
            for part in &parts {
                let chunk_at = |b: Kb<'c, '_>, k0: Value<'c, '_>| {
                    self.pack_panel(b, w, dtype, panel, n0, cols, part.len, k0);
                    // Full tiles, then one tile of each smaller power of two the rest needs.
                    let mr_c = b.idx(mr);
                    let mut done = b.muli(b.divui(d.rows, mr_c), mr_c);
                    let full_tiles = |b: Kb<'c, '_>, share: Share<'c, '_>| {
                        b.for_each(b.idx(0), done, mr_c, |b, r0| {
                            let next = NextBlock {
                                w,
                                dtype,
                                n,
                                k: self.k,
                                row0: b.addi(n0, b.idx(nb)),
                                rows: nb,
                                tile: b.divui(r0, b.idx(mr)),
                                share,
                                pitch: self.group_pitch,
                            };
                            let next = exp_var("KILN_EXP_QNOPF").is_none().then_some(next);
                            self.quad_micro(b, form, panel, r0, n0, mr, cols, vecs, *part, k0, acc, next)
                        })
                    };
                    // The fixed share where this call's tiles cover at least half the next
                    // block with it ([`Share`]).
                    let fixed = (max_rows / mr).max(1);
                    let lines = next_block_lines(dtype, nb, part.len);
                    let iters = part.len / (lanes * form.per_lane());
                    let covered = iters * Share::fixed_per_iter(fixed, lines, iters);
                    let tiles = b.divui(d.rows, mr_c);
                    let half = b.muli(tiles, b.idx(2 * covered));
                    b.if_then(b.cmpi(Cmp::Uge, half, b.idx(lines)), |b| {
                        full_tiles(b, Share::Fixed(fixed))
                    });
                    b.if_then(b.cmpi(Cmp::Ult, half, b.idx(lines)), |b| {
                        full_tiles(b, Share::Run(b.maxui(tiles, b.idx(1))))
                    });
                    let mut m = (mr - 1).checked_ilog2().map_or(0, |l| 1usize << l);
                    while m >= 1 {
                        let fits = b.cmpi(crate::ir::Cmp::Uge, b.subi(d.rows, done), b.idx(m));
                        let r0 = done;
                        b.if_then(fits, |b| {
                            self.quad_micro(b, form, panel, r0, n0, m, cols, vecs, *part, k0, acc, None)
                        });
                        done = b.select(fits, b.addi(done, b.idx(m)), done);
                        m /= 2;
                    }
                };
                part.each(b, chunk_at);
            }
        };
        split_blocks(b, d, n, nb, block);
    }

    /// Packs rows `n0..n0 + cols` at `k0..k0 + len` into `panel[k / 4][j * lanes + 4 o + p]`
    /// (row `n0 + j O + o`, element `k0 + k + p`), rows past `cols` as zeros; in pairs,
    /// `panel[k / 8][2 (j * lanes + 4 o + p) + e]` holds element `k0 + k + 2 p + e`.
    #[allow(clippy::too_many_arguments)]
    fn pack_panel(
        &self,
        b: Kb<'c, '_>,
        w: Value<'c, '_>,
        dtype: DType,
        panel: Value<'c, '_>,
        n0: Value<'c, '_>,
        cols: usize,
        len: usize,
        k0: Value<'c, '_>,
    ) {
        let lanes = self.lanes;
        let form = self.form(dtype);
        let o_n = outputs_per_vector(lanes);
        let span = row_span(dtype, lanes, self.k, form);
        b.for_each(b.idx(0), b.idx(len), b.idx(span), |b, kk| {
            let k = b.addi(k0, kk);
            let s0 = b.divui(kk, b.idx(form.piece()));
            for j in 0..cols.div_ceil(o_n) {
                let present = (cols - j * o_n).min(o_n);
                let row0 = b.addi(n0, b.idx(j * o_n));
                for (c, t) in weight_quads(b, w, dtype, row0, present, k, lanes, span, form, self.groups())
                    .into_iter()
                    .enumerate()
                {
                    b.store(t, panel, &[b.addi(s0, b.idx(c)), b.idx(j * lanes * form.per_lane())]);
                }
            }
        });
    }

    /// The `mr x vecs` accumulators of rows `r0..r0 + mr` over the packed chunk `k0..k0 +
    /// part.len` (parked in `acc` between chunks); after the last chunk, the outputs
    /// `n0..n0 + cols` finished.
    #[allow(clippy::too_many_arguments)]
    fn quad_micro(
        &self,
        b: Kb<'c, '_>,
        form: Form,
        panel: Value<'c, '_>,
        r0: Value<'c, '_>,
        n0: Value<'c, '_>,
        mr: usize,
        cols: usize,
        vecs: usize,
        part: Part,
        k0: Value<'c, '_>,
        acc: Option<Value<'c, '_>>,
        next: Option<NextBlock<'c, '_>>,
    ) {
        let lanes = self.lanes;
        let rows: Vec<Value> = (0..mr).map(|i| b.addi(r0, b.idx(i))).collect();
        let inits = resume_accs(b, acc, part, &rows, vecs, lanes);
        // One step: every lane's instruction once per phase, `lanes / 4` pieces of `k`.
        let (per, piece) = (form.per_lane(), form.piece());
        let step = lanes * per;
        let out = b.for_range(b.idx(0), b.idx(part.len), b.idx(step), &inits, |b, kk, acc| {
            if let Some(nb) = next {
                prefetch_next(b, nb, b.divui(kk, b.idx(step)), part.len / step, part.len, k0);
            }
            let mut next = acc.clone();
            let s0 = b.divui(kk, b.idx(piece));
            for c in 0..lanes / QUAD {
                let s = b.addi(s0, b.idx(c));
                let ws: Vec<Value> = (0..vecs)
                    .map(|j| match form {
                        Form::Fma => b.load_f32(panel, &[s, b.idx(j * lanes)], lanes),
                        Form::Pairs => b.load_bf16s(panel, &[s, b.idx(j * step)], step),
                    })
                    .collect();
                let k = b.addi(b.addi(k0, kk), b.idx(c * piece));
                for (i, &r) in rows.iter().enumerate() {
                    let xq = self.x_piece(b, form, r, k, lanes);
                    for (j, &wv) in ws.iter().enumerate() {
                        next[i * vecs + j] = multiply(b, form, wv, xq, next[i * vecs + j]);
                    }
                }
            }
            next
        });
        if park_accs(b, acc, part, &out, &rows, lanes) {
            return;
        }
        let cols: Vec<Value> = (0..cols).map(|c| b.addi(n0, b.idx(c))).collect();
        self.finish_quads(b, &out, &rows, &cols);
    }

    /// The epilogue of a quad-order tile: `acc[i * vecs + j]` holds outputs `cols[j * O..]` of
    /// row `rows[i]` (`vecs = ceil(cols / O)`). Four accumulators at a time are summed into one
    /// vector ([`combine_quads`]), finished as a vector when all its outputs exist and output
    /// by output otherwise (the sums are the same either way).
    pub(super) fn finish_quads(
        &self,
        b: Kb<'c, '_>,
        acc: &[Value<'c, '_>],
        rows: &[Value<'c, '_>],
        cols: &[Value<'c, '_>],
    ) {
        let lanes = crate::ir::lanes_of(acc[0]);
        let o_n = outputs_per_vector(lanes);
        let vecs = cols.len().div_ceil(o_n);
        for (i, &row) in rows.iter().enumerate() {
            for j0 in (0..vecs).step_by(QUAD) {
                let group = &acc[i * vecs + j0..i * vecs + vecs.min(j0 + QUAD)];
                let sums = combine_quads(b, group, lanes);
                let first = j0 * o_n;
                if cols.len() >= first + lanes {
                    self.finish(b, sums, row, cols[first]);
                    continue;
                }
                for (l, &col) in cols[first..].iter().enumerate() {
                    self.finish(b, b.extract(sums, l), row, col);
                }
            }
        }
    }

    /// Decode in quad order: the tile's weight rows `O` at a time, a cache line of each per
    /// step (prefetched as the dot-product decode does), transposed in registers and folded
    /// into one accumulator per `O` rows and activation row.
    pub(super) fn decode_quads(&self, b: Kb<'c, '_>, w: Value<'c, '_>, dtype: DType, t: Tile<'c, '_>) {
        let lanes = self.quad_decode_lanes();
        let form = self.form(dtype);
        let o_n = outputs_per_vector(lanes);
        let vecs = t.ncols.div_ceil(o_n);
        let (rows, cols, inits) = t.start(b, lanes, vecs);
        // A row-grouped step is one octet of a whole group (`decode_float_rows`), two per
        // iteration.
        let (span, unroll) = if self.grouped {
            (OCTET, if self.k.is_multiple_of(2 * OCTET) { 2 } else { 1 })
        } else {
            let span = row_span(dtype, lanes, self.k, form);
            let per_line = 64 / dtype.size();
            let unroll = if per_line >= span && self.k.is_multiple_of(per_line) {
                per_line / span
            } else {
                1
            };
            (span, unroll)
        };
        // Only the far prefetch (into L2): with the transposes, the near one's address
        // arithmetic cost more than it saved (2 threads, weights in L3: 53 -> 57 GB/s median
        // on a Zen 4 EPYC, `decode_sweep`).
        // Row-grouped weights are one sequential stream per matrix, which the hardware
        // prefetchers follow: software prefetches only cost bandwidth there. `gate_up` over
        // the 0.5B shape (Zen 4, 2 threads, fast memory phase, 8-row groups): none 94-101 % of
        // the read probe, one per step 80-87 % (`kiln_core::grouped`); a 384 MiB matrix at k
        // 896 in 16-row groups (`decode_sweep`, medians of 30 rounds, mostly the slow phase):
        // none 103 %, a far prefetch per line 93 %, row-major rows with it 92 %.
        let prefetches: Vec<_> = decode_prefetches()
            .into_iter()
            .filter(|p| !p.near() && !self.grouped)
            .collect();
        let (zero, kc, step) = (b.idx(0), b.idx(self.k), b.idx(span * unroll));
        let acc = b.for_range(zero, kc, step, &inits, |b, kk0, acc| {
            let mut acc = acc;
            for &col in &cols {
                for p in prefetches.iter().filter(|p| p.bytes > 0) {
                    prefetch_ahead(b, w, col, kk0, *p, dtype.size(), self.k, t.end);
                }
            }
            for u in 0..unroll {
                let kk = b.addi(kk0, b.idx(u * span));
                let quads: Vec<Vec<Value>> = (0..vecs)
                    .map(|j| {
                        let present = (t.ncols - j * o_n).min(o_n);
                        weight_quads(
                            b,
                            w,
                            dtype,
                            cols[j * o_n],
                            present,
                            kk,
                            lanes,
                            span,
                            form,
                            self.groups(),
                        )
                    })
                    .collect();
                for c in 0..span / form.piece() {
                    let k = b.addi(kk, b.idx(c * form.piece()));
                    for (i, &r) in rows.iter().enumerate() {
                        let xq = self.x_piece(b, form, r, k, lanes);
                        for (j, q) in quads.iter().enumerate() {
                            acc[i * vecs + j] = multiply(b, form, q[c], xq, acc[i * vecs + j]);
                        }
                    }
                }
            }
            acc
        });
        self.finish_quads(b, &acc, &rows, &cols);
    }
}
