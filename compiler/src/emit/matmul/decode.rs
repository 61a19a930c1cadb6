//! Decode matmuls: up to `DECODE_ROWS` activation rows against a pure weight stream.
//!
//! Each thread walks its contiguous range of weight rows a few adjacent rows at a time (how
//! many: `decode_shape.rs`), so the matrix is read nearly in address order, with software
//! prefetches ahead of the stream ([`decode_prefetches`]).
//! Every weight vector is loaded (and widened or dequantised) once and folded into a tile of
//! activation rows ([`decode_row_tile`]). One vector accumulator per weight row and activation
//! row and the same lane-summing tree as prefill make every output bitwise identical between
//! decode and prefill. Quantised blocks are dequantised in registers with the reference's
//! arithmetic and folded in k order, a few weight rows at a time so that their FMA chains
//! overlap with the dequantisation work.

use super::decode_shape::{QuantStep, decode_quant_step, decode_row_tile, with_decode_cols};
use super::{MatMul, exp_var};
use crate::emit::norm::{NormWeights, Row, normalize_row};
use crate::emit::{Dyn, quant, split_work};
use crate::ir::Kb;
use kiln_core::{DType, NormShape};
use melior::ir::Value;

/// A software prefetch issued for every cache line of weights a decode thread streams:
/// `bytes` ahead in the thread's own stream, with MLIR's locality hint (3 = into L1, 2 = into
/// L2).
#[derive(Clone, Copy)]
pub(super) struct Prefetch {
    pub(super) bytes: usize,
    locality: u32,
}

impl Prefetch {
    /// Whether this is the near prefetch (into L1).
    pub(super) fn near(&self) -> bool {
        self.locality == 3
    }
}

/// The prefetches decode issues per cache line of weights. The hardware prefetchers alone left
/// decode at ~65 % of the read probe on the 2-core Xeon (AVX-512) these kernels were tuned on:
/// a thread's stream restarts at every matrix, every claimed chunk and every 4 KiB page, and
/// the loop body is long enough that demand misses alone keep few lines in flight. A near
/// prefetch (3 KiB ahead, into L1: the lines are in L1 when the loads get there) took it to
/// ~80 %, and a far one (32 KiB ahead, into L2: enough requests in flight to cover the memory
/// latency without holding L1 fill buffers) to ~90 %, measured with `kiln bench` against the
/// read bandwidth measured in the same run.
///
/// They cost instructions (an address, a clamp and the prefetch per line and distance): in
/// cache, q8-mode q8_0 (34 bytes per 32 weights, the most lines per weight) ran at 45.6 GB/s
/// per thread with both and 60.2 without (AVX2 code 46.4 → 54.9; q4_k, q6_k, bf16 within 5 %;
/// `quant_speed`, 2-core Zen 5). From memory that headroom bought nothing: TinyLlama-1.1B Q8_0,
/// `--precision q8`, 2 threads, decode 51.4-52.0 tok/s with the near prefetch and 50.9-51.9
/// without it in the fast memory phase (interleaved, read probe 82-86 GB/s), so both stay.
pub(super) fn decode_prefetches() -> [Prefetch; 2] {
    [
        Prefetch {
            bytes: exp_var("KILN_EXP_PF").unwrap_or(3 << 10),
            locality: 3,
        },
        Prefetch {
            bytes: exp_var("KILN_EXP_PF_FAR").unwrap_or(32 << 10),
            locality: exp_var("KILN_EXP_PF_FAR_LOC").unwrap_or(2) as u32,
        },
    ]
}

/// Smallest chunk of weights a decode thread claims from the work counter (claims shrink
/// towards it, see [`split_work`]). Short chunks even out the threads' finishing times but
/// restart the thread's stream (and its far prefetch, which never crosses into rows another
/// thread may have claimed); 32, 64 and 96 KiB measured alike on the 0.5B shape and the 135M
/// Q4_1 demo, all well ahead of fixed 256 KiB chunks.
const DECODE_MIN_CHUNK_BYTES: usize = 64 << 10;

/// Prefetches the cache line `p.bytes` past element `w[row, col]` (element size `elem`) in the
/// row-major stream of the matrix `w` (rows of `row_len` elements), clamped to the last element
/// of row `end - 1`: a thread prefetches only within the range it is working on, never the
/// rows another thread claimed (nor past the matrix).
#[allow(clippy::too_many_arguments)]
pub(super) fn prefetch_ahead<'c>(
    b: Kb<'c, '_>,
    w: Value<'c, '_>,
    row: Value<'c, '_>,
    col: Value<'c, '_>,
    p: Prefetch,
    elem: usize,
    row_len: usize,
    end: Value<'c, '_>,
) {
    let len = b.idx(row_len);
    let flat = b.addi(b.addi(b.muli(row, len), col), b.idx(p.bytes / elem));
    let last = b.subi(b.muli(end, len), b.idx(1));
    let flat = b.minui(flat, last);
    b.prefetch_with(w, &[b.divui(flat, len), b.remui(flat, len)], p.locality);
}

/// The prefetches of a decode step over quantised rows `cols` reading `span` bytes of each from
/// byte `off` (rows of `row_bytes`, the share ending at row `end`): one per cache line and
/// [`decode_prefetches`] distance (a step may span less than a line).
#[allow(clippy::too_many_arguments)]
pub(super) fn prefetch_blocks<'c>(
    b: Kb<'c, '_>,
    w: Value<'c, '_>,
    cols: &[Value<'c, '_>],
    off: Value<'c, '_>,
    span: usize,
    row_bytes: usize,
    end: Value<'c, '_>,
) {
    for &col in cols {
        for p in decode_prefetches().iter().filter(|p| p.bytes > 0) {
            for line in (0..span.div_ceil(64)).map(|l| l * 64) {
                let at = Prefetch {
                    bytes: p.bytes + line,
                    ..*p
                };
                prefetch_ahead(b, w, col, off, at, 1, row_bytes, end);
            }
        }
    }
}

/// The prefetches of a step over the adjacent quantised rows `col0 .. col0 + ncols`, reading
/// `span` bytes of each from byte `off` (rows of `row_bytes`, the share ending at row `end`).
/// The rows are one contiguous region that the walk crosses `ncols · span` bytes per step, so
/// one stream over it (at `ncols · off` into the region) covers them with one prefetch per
/// line and [`decode_prefetches`] distance, clamped once per distance: [`prefetch_blocks`]
/// clamped each of `ncols` rows' lines, about twice the prefetches and four instructions
/// each, a fifth of a q8 decode loop's instructions (q4_0: 80 of 304 per step).
#[allow(clippy::too_many_arguments)]
pub(super) fn prefetch_group<'c>(
    b: Kb<'c, '_>,
    w: Value<'c, '_>,
    col0: Value<'c, '_>,
    ncols: usize,
    off: Value<'c, '_>,
    span: usize,
    row_bytes: usize,
    end: Value<'c, '_>,
) {
    let len = b.idx(row_bytes);
    let lines = (ncols * span).div_ceil(64);
    let reach = b.idx(64 * lines);
    let at = b.addi(b.muli(col0, len), b.muli(off, b.idx(ncols)));
    // The last start whose lines stay within the share (0 for a share shorter than a step).
    let last = b.subi(b.maxui(b.muli(end, len), reach), reach);
    for p in decode_prefetches().iter().filter(|p| p.bytes > 0) {
        let start = b.minui(b.addi(at, b.idx(p.bytes)), last);
        for l in 0..lines {
            let flat = b.addi(start, b.idx(64 * l));
            b.prefetch_with(w, &[b.divui(flat, len), b.remui(flat, len)], p.locality);
        }
    }
}

/// The decode rows (`d.rows` of at most `max_rows`) normalised by a folded norm into a stack
/// buffer of this thread's (`memref<max_rows x k x f32>`), with the [`Kernel::Norm`] kernel's
/// own instructions. `args` are the norm's weight and (LayerNorm) bias.
#[allow(clippy::too_many_arguments)]
pub(in crate::emit) fn normalised_rows<'c, 'a>(
    b: Kb<'c, 'a>,
    d: Dyn<'c, '_>,
    x: Value<'c, '_>,
    args: &[Value<'c, '_>],
    norm: &NormShape,
    k: usize,
    max_rows: usize,
    max_lanes: usize,
) -> Value<'c, 'a> {
    let buf = b.alloca(&format!("memref<{max_rows}x{k}xf32>"));
    let zero = b.idx(0);
    let weights = NormWeights {
        w: args[0],
        bias: norm.bias.map(|_| args[1]),
    };
    b.for_each(zero, d.rows, b.idx(1), |b, r| {
        let zero = b.idx(0);
        let src = Row { mem: x, r, c0: zero };
        let dst = Row { mem: buf, r, c0: zero };
        normalize_row(b, norm, weights, src, dst, k, max_lanes, false);
    });
    buf
}

/// Splits `n` decode rows between threads (see [`split_work`]) in shares of whole `align` rows
/// (a multiple of `group`), dynamic chunks at least [`DECODE_MIN_CHUNK_BYTES`] of `row_bytes`
/// rows long. `rows_at(b, col0, rows, end)` emits one group (`rows < group` only for the
/// `n % group` rows at the end) of the share ending at row `end`; `after(b, start, end)` runs
/// once a share's rows are all done.
#[allow(clippy::too_many_arguments)]
pub(in crate::emit) fn decode_split<'c, F, G>(
    b: Kb<'c, '_>,
    d: Dyn<'c, '_>,
    n: usize,
    align: usize,
    group: usize,
    row_bytes: usize,
    rows_at: F,
    after: G,
) where
    F: for<'x> Fn(Kb<'c, 'x>, Value<'c, 'x>, usize, Value<'c, 'x>),
    G: for<'x> Fn(Kb<'c, 'x>, Value<'c, 'x>, Value<'c, 'x>),
{
    debug_assert!(align.is_multiple_of(group));
    let min_chunk = exp_var("KILN_EXP_MINCHUNK")
        .unwrap_or(DECODE_MIN_CHUNK_BYTES)
        .div_ceil(row_bytes);
    // Shares are whole groups, so only the range ending at `n` has `n % group` rows left.
    let rem = n % group;
    split_work(b, d, n, align, min_chunk, |b, start, end| {
        let g_c = b.idx(group);
        let full_end = b.addi(start, b.muli(b.divui(b.subi(end, start), g_c), g_c));
        b.for_each(start, full_end, g_c, |b, col| rows_at(b, col, group, end));
        if rem > 0 {
            let has_rem = b.cmpi(crate::ir::Cmp::Ult, full_end, end);
            b.if_then(has_rem, |b| rows_at(b, full_end, rem, end));
        }
        after(b, start, end);
    });
}

/// Outputs `col0..col0 + ncols` (of the share ending at weight row `end`) of activation rows
/// `r0..r0 + m`: what one call of the inner loop computes.
#[derive(Clone, Copy)]
pub(super) struct Tile<'c, 'a> {
    pub col0: Value<'c, 'a>,
    pub ncols: usize,
    pub end: Value<'c, 'a>,
    pub r0: Value<'c, 'a>,
    pub m: usize,
}

impl<'c, 'a> Tile<'c, 'a> {
    /// The tile's activation rows, weight rows, and zero accumulators, `accs` per activation
    /// row (one per weight row, or in quad order one per `lanes / 4` of them), row-major.
    #[allow(clippy::type_complexity)]
    pub(super) fn start<'x>(
        &self,
        b: Kb<'c, 'x>,
        lanes: usize,
        accs: usize,
    ) -> (Vec<Value<'c, 'x>>, Vec<Value<'c, 'x>>, Vec<Value<'c, 'x>>) {
        let rows = (0..self.m).map(|i| b.addi(self.r0, b.idx(i))).collect();
        let cols = (0..self.ncols).map(|c| b.addi(self.col0, b.idx(c))).collect();
        let inits = (0..self.m * accs).map(|_| b.zero_like(lanes)).collect();
        (rows, cols, inits)
    }
}

impl<'c, 'a> MatMul<'c, 'a> {
    /// Decode: each thread walks its weight rows a few at a time (`decode_shape.rs`), one
    /// accumulator per weight row and activation row and the prefill's lane-summing tree, so
    /// every output is bitwise the one prefill computes; weights are prefetched as
    /// [`decode_prefetches`] says. Quantised rows are read block by block in address order,
    /// each block dequantised into vectors in k order and folded into the accumulators
    /// (prefill dequantises the same values into its scratch); interleaving a few rows gives
    /// the core independent FMA chains to overlap with the dequantisation work.
    /// With several activation rows (a batched step), each weight vector read (and
    /// dequantised) is folded into [`decode_row_tile`] rows at once; the weights of a few
    /// weight rows are re-read from L1 for the next tile of activation rows.
    pub(super) fn decode(
        &self,
        b: Kb<'c, '_>,
        w: Value<'c, '_>,
        dtype: DType,
        n: usize,
        d: Dyn<'c, '_>,
        max_rows: usize,
    ) {
        with_decode_cols(
            b,
            d,
            dtype,
            self.lanes,
            n,
            max_rows,
            self.act_form(dtype),
            |b, group| {
                decode_split(
                    b,
                    d,
                    n,
                    group,
                    group,
                    dtype.bytes_for(self.k),
                    |b, col, cols, end| self.decode_rows(b, w, dtype, col, cols, end, d, max_rows),
                    |_, _, _| {},
                );
            },
        );
    }

    /// Decode outputs `col0..col0 + cols` (of the range ending at row `end`) of every
    /// activation row (`d.rows`) from weights `w` stored as `dtype`, float or quantised: tiles
    /// of [`decode_row_tile`] rows, then the rows left in halving tiles (7 rows with a tile of
    /// 4: 4, 2, 1; one row alone is the last).
    #[allow(clippy::too_many_arguments)]
    pub(in crate::emit) fn decode_rows(
        &self,
        b: Kb<'c, '_>,
        w: Value<'c, '_>,
        dtype: DType,
        col0: Value<'c, '_>,
        cols: usize,
        end: Value<'c, '_>,
        d: Dyn<'c, '_>,
        max_rows: usize,
    ) {
        // In quad order one accumulator covers `lanes / 4` weight rows.
        let acc_cols = if self.quad(dtype) {
            cols.div_ceil(super::quad::outputs_per_vector(self.quad_decode_lanes()))
        } else {
            cols
        };
        // k-quants in q8 mode with several rows: the weight rows unpacked once for every tile
        // of `STAGE_MIN_ROWS` or more (`q8_stage.rs`); smaller tiles read the weights themselves.
        let staged = max_rows > 1 && self.q8.is_some_and(|a| a.stage.is_some()) && super::q8_stage::staged(dtype);
        let sixteens = self.q8.is_some_and(|a| a.sixteens.is_some()) && super::q8_blocks::in_sixteens(dtype);
        let octets = self.q8.is_some_and(|a| a.octets.is_some()) && super::q8_blocks::exact_blocks(dtype);
        let tile = if staged && self.lanes >= 16 {
            super::q8_stage::WIDE_STAGED_TILE
        } else if sixteens {
            crate::emit::q8_layouts::SIXTEEN
        } else {
            decode_row_tile(acc_cols, self.lanes)
        };
        let tile = tile.min(max_rows.next_power_of_two());
        let run = |b: Kb<'c, '_>, r0: Value<'c, '_>, m: usize| {
            let tile = Tile {
                col0,
                ncols: cols,
                end,
                r0,
                m,
            };
            if let Some(acts) = self.q8 {
                if staged && m >= super::q8_stage::STAGE_MIN_ROWS {
                    self.q8_staged_rows(b, dtype, tile, &acts)
                } else {
                    self.q8_rows(b, w, dtype, tile, &acts)
                }
            } else if dtype.is_quantized() {
                self.quant_rows(b, w, dtype, tile)
            } else {
                self.float_rows(b, w, dtype, tile)
            }
        };
        if max_rows == 1 {
            return run(b, b.idx(0), 1);
        }
        if staged {
            let several = b.cmpi(crate::ir::Cmp::Uge, d.rows, b.idx(super::q8_stage::STAGE_MIN_ROWS));
            b.if_then(several, |b| self.q8_stage_fill(b, w, dtype, col0, cols, end));
        }
        // Over the 32-element formats in q8 mode, the rows after the full octets take the
        // partial octet's quads ([`MatMul::q8_octet_rest`]), but one row alone takes the
        // one-row code: a quad does four rows' work, and with the one-row step's weight rows
        // in the lanes (a call of one row) that code is decode's.
        let octet = crate::emit::q8_layouts::ROWS;
        let octet_rest = tile >= octet && octets;
        // Full tiles, then one tile of each smaller power of two the rest needs.
        let t = b.idx(tile);
        let mut done = b.muli(b.divui(d.rows, t), t);
        b.for_each(b.idx(0), done, t, |b, r0| run(b, r0, tile));
        let mut m = tile / 2;
        let smallest = if octet_rest { octet } else { 1 };
        while m >= smallest {
            let left = b.subi(d.rows, done);
            let fits = b.cmpi(crate::ir::Cmp::Uge, left, b.idx(m));
            let r0 = done;
            b.if_then(fits, |b| run(b, r0, m));
            done = b.select(fits, b.addi(done, b.idx(m)), done);
            m /= 2;
        }
        if let (true, Some(acts)) = (octet_rest, self.q8) {
            let one = b.cmpi(crate::ir::Cmp::Eq, b.addi(done, b.idx(1)), d.rows);
            b.if_then(one, |b| run(b, done, 1));
            let several = b.cmpi(crate::ir::Cmp::Ult, b.addi(done, b.idx(1)), d.rows);
            b.if_then(several, |b| {
                let tile = Tile {
                    col0,
                    ncols: cols,
                    end,
                    r0: done,
                    m: octet,
                };
                self.q8_octet_rest(b, w, dtype, tile, &acts, d.rows)
            });
        }
    }

    /// The tile's outputs from float weights, one FMA chain each, walking `k` a cache line of
    /// weights per step with one prefetch per weight row and line.
    fn float_rows(&self, b: Kb<'c, '_>, w: Value<'c, '_>, dtype: DType, t: Tile<'c, '_>) {
        if self.quad(dtype) {
            return self.decode_quads(b, w, dtype, t);
        }
        let lanes = self.lanes;
        let (ncols, end) = (t.ncols, t.end);
        let (rows, cols, inits) = t.start(b, lanes, t.ncols);
        let per_line = 64 / dtype.size();
        let unroll = if per_line >= lanes && self.k.is_multiple_of(per_line) {
            per_line / lanes
        } else {
            1
        };
        let prefetches = decode_prefetches();
        let (zero, kc, step) = (b.idx(0), b.idx(self.k), b.idx(lanes * unroll));
        let acc = b.for_range(zero, kc, step, &inits, |b, kk0, acc| {
            let mut acc = acc;
            for &col in &cols {
                for p in prefetches.iter().filter(|p| p.bytes > 0) {
                    prefetch_ahead(b, w, col, kk0, *p, dtype.size(), self.k, end);
                }
            }
            for u in 0..unroll {
                let kk = b.addi(kk0, b.idx(u * lanes));
                let xs: Vec<Value> = rows.iter().map(|&r| b.load_f32(self.x, &[r, kk], lanes)).collect();
                for (c, &col) in cols.iter().enumerate() {
                    let wv = b.load_weight(w, &[col, kk], lanes, dtype);
                    for (i, &xv) in xs.iter().enumerate() {
                        acc[i * ncols + c] = b.fma(wv, xv, acc[i * ncols + c]);
                    }
                }
            }
            acc
        });
        self.finish_tile(b, &acc, &rows, &cols);
    }

    /// The epilogue of every output of a tile: `acc[i * cols.len() + c]` is row `rows[i]`,
    /// column `cols[c]`.
    pub(super) fn finish_tile(
        &self,
        b: Kb<'c, '_>,
        acc: &[Value<'c, '_>],
        rows: &[Value<'c, '_>],
        cols: &[Value<'c, '_>],
    ) {
        for (i, &row) in rows.iter().enumerate() {
            let sums = b.reduce_many(&acc[i * cols.len()..(i + 1) * cols.len()]);
            for (&s, &col) in sums.iter().zip(cols) {
                self.finish(b, s, row, col);
            }
        }
    }

    /// The tile's outputs from quantised weights, prefetching each weight row's stream as
    /// [`decode_prefetches`] says.
    fn quant_rows(&self, b: Kb<'c, '_>, w: Value<'c, '_>, dtype: DType, t: Tile<'c, '_>) {
        let lanes = self.lanes;
        let (ncols, end) = (t.ncols, t.end);
        let be = dtype.block_elems();
        let blocks = self.k / be;
        let QuantStep {
            blocks: unroll,
            row_major,
        } = decode_quant_step(dtype, lanes, blocks);
        let (rows, cols, inits) = t.start(b, lanes, t.ncols);
        let row_bytes = dtype.bytes_for(self.k);
        let span = unroll * dtype.block_bytes();
        let (zero, hi, step) = (b.idx(0), b.idx(blocks), b.idx(unroll));
        let acc = b.for_range(zero, hi, step, &inits, |b, kb, acc| {
            let mut acc = acc;
            let off = b.muli(kb, b.idx(dtype.block_bytes()));
            prefetch_blocks(b, w, &cols, off, span, row_bytes, end);
            for u in 0..unroll {
                let blk = b.addi(kb, b.idx(u));
                let k0 = b.muli(blk, b.idx(be));
                // Every value folded in as it is made, so each dequantised vector lives for a
                // few instructions (see `BlockReader`): row by row, or group by group (each x
                // vector loaded once for all rows).
                let mut blocks: Vec<_> = cols
                    .iter()
                    .map(|&col| quant::BlockReader::new(b, w, dtype, col, blk, lanes, quant::Zeros::Either))
                    .collect();
                if row_major {
                    for (c, block) in blocks.iter_mut().enumerate() {
                        for g in 0..be / lanes {
                            let kk = b.addi(k0, b.idx(g * lanes));
                            let wv = block.value(g);
                            for (i, &r) in rows.iter().enumerate() {
                                let xv = b.load_f32(self.x, &[r, kk], lanes);
                                acc[i * ncols + c] = b.fma(wv, xv, acc[i * ncols + c]);
                            }
                        }
                    }
                    continue;
                }
                for g in 0..be / lanes {
                    let kk = b.addi(k0, b.idx(g * lanes));
                    let xs: Vec<Value> = rows.iter().map(|&r| b.load_f32(self.x, &[r, kk], lanes)).collect();
                    for (c, block) in blocks.iter_mut().enumerate() {
                        let wv = block.value(g);
                        for (i, &xv) in xs.iter().enumerate() {
                            acc[i * ncols + c] = b.fma(wv, xv, acc[i * ncols + c]);
                        }
                    }
                }
            }
            acc
        });
        self.finish_tile(b, &acc, &rows, &cols);
    }
}
