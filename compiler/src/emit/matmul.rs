//! `y[r, n] (+)= sum_k x[r, k] * w[n, k] (+ bias[n])` with weights read as stored.
//!
//! Both operands are contiguous along `k`, so the kernel computes dot products: a micro-kernel
//! keeps an `mr x nb` block of vector accumulators in registers and walks `k` once, loading each
//! activation vector once for `nb` weight rows and each weight vector once for `mr` activation
//! rows; at the end the accumulators of one row are summed together by a shuffle tree.
//! Threads split the output columns `n` in whole blocks of `nb`, so every thread streams a
//! disjoint slice of the weight matrix and only the last one meets the `n % nb` remainder,
//! whose size is therefore a constant.
//!
//! * Decode (`max_rows = 1`) is a pure weight stream. Each thread walks its contiguous range
//!   of rows a few adjacent rows at a time (two 512-bit or four 256-bit FMA chains, see
//!   [`decode_float_rows`]), so the matrix is read nearly in address order, with software
//!   prefetches ahead of the stream ([`decode_prefetches`]). One vector accumulator per row
//!   and the same lane-summing tree as prefill make every output bitwise identical between
//!   decode and prefill.
//! * Prefill is compute-bound: each block of `nb` weight rows is widened to f32 once into a
//!   stack scratch (a chunk of `k` at a time, sized for L1) and reused by every row tile, so
//!   the inner loop is only loads and FMAs.
//! * Quantised weights (GGML blocks, see `quant.rs`) are dequantised in registers with the
//!   reference's arithmetic. Decode folds each block's values into the row's accumulator in k
//!   order, a few rows at a time so that their FMA chains overlap; prefill dequantises into the
//!   scratch (in chunks of `k` with the accumulators parked in a stack buffer when a row is too
//!   long), so decode and prefill still perform the same FMAs in the same order.

use super::norm::{NormWeights, Row, normalize_row};
use super::{Dyn, elementwise, quant, split_work};
use crate::ir::{Kb, lanes_for};
use kiln_core::{Act, DType, F32Bits, Kernel, NormShape};
use melior::ir::Value;

/// Largest prefill weight scratch (`nb * chunk * 4` bytes): a block's weight rows are widened
/// (or dequantised) into it a chunk of `k` at a time, the accumulators parked between chunks.
/// Small enough to stay in L1 next to the activation rows the micro-kernel streams with it:
/// 16 KiB made prefill 15-20 % faster than whole rows on the 0.5B and 1.1B shapes (k = 896 ..
/// 5632), where a whole row block (up to 132 KiB) spilled to L2.
const PREFILL_CHUNK_BYTES: usize = 16 << 10;

/// Weight rows a decode thread walks together over quantised weights (one FMA chain each):
/// enough independent chains to hide the FMA latency behind the dequantisation work, few enough
/// that each row's block state (scale splats, byte vectors read twice) stays in registers.
/// q5_0/q5_1 with 8 lanes (AVX2, 16 registers) take 2: four rows' high-bit words and bytes
/// spilled to the stack, and one thread read 7.2 Gweights/s with 2 rows against 5.2–6.4 with
/// 4 (`quant_speed`, 2-vCPU AMD EPYC Zen 3); the other 32-element formats measured alike or
/// better with 4.
pub(super) fn decode_quant_rows(dtype: DType, lanes: usize) -> usize {
    if let Some(r) = exp_var("KILN_EXP_ROWS") {
        return r;
    }
    let five_bit = matches!(dtype, DType::Q5_0 | DType::Q5_1);
    match dtype.block_elems() {
        32 if five_bit && lanes <= 8 => 2,
        32 => 4,
        _ => 2,
    }
}

/// Weight rows a decode thread walks together over float weights, one FMA chain each: two
/// 512-bit chains (four 256-bit ones) keep more weight bytes in flight per cycle than memory
/// delivers to one core, whatever the FMA latency; more rows would split the thread's stream
/// into more short streams without reading any faster.
pub(super) fn decode_float_rows(lanes: usize) -> usize {
    exp_var("KILN_EXP_FROWS").unwrap_or((32 / lanes).max(1))
}

/// A software prefetch issued for every cache line of weights a decode thread streams:
/// `bytes` ahead in the thread's own stream, with MLIR's locality hint (3 = into L1, 2 = into
/// L2).
#[derive(Clone, Copy)]
struct Prefetch {
    bytes: usize,
    locality: u32,
}

/// The prefetches decode issues per cache line of weights. The hardware prefetchers alone left
/// decode at ~65 % of the read probe on the 2-core Xeon (AVX-512) these kernels were tuned on:
/// a thread's stream restarts at every matrix, every claimed chunk and every 4 KiB page, and
/// the loop body is long enough that demand misses alone keep few lines in flight. A near
/// prefetch (3 KiB ahead, into L1: the lines are in L1 when the loads get there) took it to
/// ~80 %, and a far one (32 KiB ahead, into L2: enough requests in flight to cover the memory
/// latency without holding L1 fill buffers) to ~90 %, measured with `kiln bench` against the
/// read bandwidth measured in the same run.
fn decode_prefetches() -> [Prefetch; 2] {
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

/// Tuning overrides for the compiler's own sweep tests (`tests::quant::decode_sweep`); libraries
/// built outside tests never read the environment, so cache keys stay complete.
pub(crate) fn exp_var(name: &str) -> Option<usize> {
    if cfg!(test) {
        std::env::var(name).ok().and_then(|v| v.parse().ok())
    } else {
        None
    }
}

/// Prefetches the cache line `p.bytes` past element `w[row, col]` (element size `elem`) in the
/// row-major stream of the matrix `w` (rows of `row_len` elements), clamped to the last element
/// of row `end - 1`: a thread prefetches only within the range it is working on, never the
/// rows another thread claimed (nor past the matrix).
#[allow(clippy::too_many_arguments)]
fn prefetch_ahead<'c>(
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

/// Register tile `(mr, nb)` for prefill: `mr * nb` accumulators plus `mr` activation vectors
/// and one weight vector must fit in the vector register file (32 with AVX-512, 16 with AVX2).
fn prefill_tile(max_lanes: usize) -> (usize, usize) {
    if max_lanes >= 16 { (4, 6) } else { (2, 6) }
}

/// Where a micro-kernel reads its weights: the stored matrix (widened on load) or the f32
/// scratch holding the current block's rows.
#[derive(Clone, Copy)]
enum WeightSrc<'c, 'a> {
    Stored { w: Value<'c, 'a>, dtype: DType },
    Scratch(Value<'c, 'a>),
}

pub(super) struct MatMul<'c, 'a> {
    pub(super) k: usize,
    pub(super) lanes: usize,
    pub(super) x: Value<'c, 'a>,
    pub(super) y: Value<'c, 'a>,
    pub(super) bias: Option<(Value<'c, 'a>, DType)>,
    pub(super) accumulate: bool,
    pub(super) act: Option<Act>,
    pub(super) softcap: Option<F32Bits>,
}

/// The decode rows (`d.rows` of at most `max_rows`) normalised by a folded norm into a stack
/// buffer of this thread's (`memref<max_rows x k x f32>`), with the [`Kernel::Norm`] kernel's
/// own instructions. `args` are the norm's weight and (LayerNorm) bias.
#[allow(clippy::too_many_arguments)]
pub(super) fn normalised_rows<'c, 'a>(
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

/// Activation rows a decode kernel folds into each weight vector it reads (a batched step's
/// rows, `kiln serve`): enough that each weight vector is loaded and widened once for several
/// rows, few enough that the `cols * rows` accumulators, the rows' activation vectors and the
/// weight vectors stay in registers: half the register file in accumulators over float
/// weights (16 with AVX-512, 8 with AVX2), a quarter over quantised ones, whose dequantisation
/// needs registers of its own. A power of two, so the rows left after the full tiles are done
/// in at most `log2(tile)` smaller tiles.
pub(super) fn decode_row_tile(cols: usize, lanes: usize) -> usize {
    let registers = if lanes >= 16 { 32 } else { 16 };
    let tile = (registers / 2 / cols.max(1)).max(1);
    exp_var("KILN_EXP_ROWTILE").unwrap_or(1 << tile.ilog2())
}

/// Weight rows a decode thread walks together when the step may have several activation rows
/// (`max_rows > 1`) but has `rows`: one row walks as many as one-row decode does; several
/// walk fewer quantised ones, so a tile of activation rows ([`decode_row_tile`]) fits beside
/// them (each block is dequantised once per tile: with four weight rows and tiles of two
/// activation rows, eight rows of the 135M Q4_1 demo decoded only 1.6x the tokens of one).
pub(super) fn decode_cols(dtype: DType, lanes: usize, several_rows: bool) -> usize {
    match (dtype.is_quantized(), several_rows) {
        (false, _) => decode_float_rows(lanes),
        (true, false) => decode_quant_rows(dtype, lanes),
        (true, true) => {
            if lanes >= 16 {
                2
            } else {
                1
            }
        }
    }
}

/// Runs `body(b, cols)` with the weight rows per step [`decode_cols`] gives for this call's
/// rows: one branch per distinct count (one when they agree or the kernel takes one row).
pub(super) fn with_decode_cols<'c, F>(
    b: Kb<'c, '_>,
    d: Dyn<'c, '_>,
    dtype: DType,
    lanes: usize,
    n: usize,
    max_rows: usize,
    body: F,
) where
    F: for<'x> Fn(Kb<'c, 'x>, usize),
{
    let one = decode_cols(dtype, lanes, false).min(n);
    let several = decode_cols(dtype, lanes, true).min(n);
    if max_rows == 1 || one == several {
        return body(b, one);
    }
    let single = b.cmpi(crate::ir::Cmp::Eq, d.rows, b.idx(1));
    b.if_then(single, |b| body(b, one));
    let batched = b.cmpi(crate::ir::Cmp::Ne, d.rows, b.idx(1));
    b.if_then(batched, |b| body(b, several));
}

pub fn emit_matmul<'c, 'a>(b: Kb<'c, 'a>, kernel: &Kernel, p: &[Value<'c, 'a>], d: Dyn<'c, 'a>, max_lanes: usize) {
    let Kernel::MatMul {
        n,
        k,
        wdtype,
        bias,
        accumulate,
        norm,
        act,
        softcap,
        max_rows,
    } = kernel
    else {
        unreachable!()
    };
    let decode = kiln_core::kernel::is_decode(*max_rows);
    let x = match norm {
        Some(nm) => {
            assert!(decode, "norms are folded into decode matmuls only");
            normalised_rows(
                b,
                d,
                p[0],
                &p[3 + bias.is_some() as usize..],
                nm,
                *k,
                *max_rows,
                max_lanes,
            )
        }
        None => p[0],
    };
    let m = MatMul {
        k: *k,
        lanes: lanes_for(*k, max_lanes),
        x,
        y: p[2],
        bias: bias.map(|dt| (p[3], dt)),
        accumulate: *accumulate,
        act: *act,
        softcap: *softcap,
    };
    let w = p[1];
    if decode {
        return m.decode(b, w, *wdtype, *n, d, *max_rows);
    }
    let stored = WeightSrc::Stored { w, dtype: *wdtype };
    let (mr, nb) = prefill_tile(max_lanes);
    let nb = nb.min(*n);
    // Quantised and half-precision rows are widened into the scratch a chunk of `k` at a time
    // (whole blocks for quantised ones); the accumulators wait between chunks in `acc`, so
    // each output is still one chain of FMAs in `k` order, as in decode. f32 rows are read
    // as stored.
    let chunk_bytes = exp_var("KILN_EXP_KCHUNK").unwrap_or(PREFILL_CHUNK_BYTES);
    let chunk = if wdtype.is_quantized() {
        let be = wdtype.block_elems();
        (chunk_bytes / (nb * 4) / be * be).clamp(be, *k)
    } else if *wdtype != DType::F32 {
        let step = m.lanes;
        (chunk_bytes / (nb * 4) / step * step).clamp(step, *k)
    } else {
        *k
    };
    let use_scratch = wdtype.is_quantized() || *wdtype != DType::F32;
    let scratch = use_scratch.then(|| b.alloca(&format!("memref<{nb}x{chunk}xf32>")));
    let acc = (chunk < *k).then(|| b.alloca(&format!("memref<{max_rows}x{}xf32>", nb * m.lanes)));
    let parts = Part::split(*k, chunk);

    // One block of `cols` weight rows starting at `n0`, over every row tile.
    let block = |b: Kb<'c, '_>, n0: Value<'c, '_>, cols: usize| {
        for part in &parts {
            // One chunk of `k` from `k0`.
            let chunk_at = |b: Kb<'c, '_>, k0: Value<'c, '_>| {
                let src = match scratch {
                    Some(s) => {
                        widen_rows(b, w, *wdtype, s, n0, cols, *part, k0, m.lanes);
                        WeightSrc::Scratch(s)
                    }
                    None => stored,
                };
                let mr_c = b.idx(mr);
                let rows_full = b.muli(b.divui(d.rows, mr_c), mr_c);
                let zero = b.idx(0);
                b.for_each(zero, rows_full, mr_c, |b, r0| {
                    m.micro(b, src, r0, n0, mr, cols, *part, k0, acc)
                });
                if mr > 1 {
                    let one = b.idx(1);
                    b.for_each(rows_full, d.rows, one, |b, r0| {
                        m.micro(b, src, r0, n0, 1, cols, *part, k0, acc)
                    });
                }
            };
            if part.count == 1 {
                chunk_at(b, b.idx(part.k0));
            } else {
                // The middle chunks are all alike: one loop, not one copy of the code each.
                let (lo, hi, step) = (b.idx(part.k0), b.idx(part.k0 + part.count * part.len), b.idx(part.len));
                b.for_each(lo, hi, step, chunk_at);
            }
        }
    };
    // Shares are whole blocks, so only the range ending at `n` has a remainder: `n % nb`.
    let rem = n % nb;
    split_work(b, d, *n, nb, nb, |b, n_start, n_end| {
        let nb_c = b.idx(nb);
        let full_blocks = b.divui(b.subi(n_end, n_start), nb_c);
        let n_full_end = b.addi(n_start, b.muli(full_blocks, nb_c));
        b.for_each(n_start, n_full_end, nb_c, |b, n0| block(b, n0, nb));
        if rem > 0 {
            let has_rem = b.cmpi(crate::ir::Cmp::Ult, n_full_end, n_end);
            b.if_then(has_rem, |b| block(b, n_full_end, rem));
        }
    });
}

/// `count` consecutive chunks `k0 + i * len .. k0 + (i + 1) * len` of the reduction dimension
/// that passes of the micro-kernel cover: all of `k` at once, or chunks that fit the scratch.
/// Accumulators start at zero in the first chunk, are parked in the `acc` buffer between
/// chunks, and are summed and stored after the last.
#[derive(Clone, Copy, Debug, PartialEq)]
struct Part {
    k0: usize,
    count: usize,
    len: usize,
    first: bool,
    last: bool,
}

impl Part {
    /// `k` in chunks of `chunk`: the first chunk, the middle ones (emitted as a loop), and the
    /// last (possibly shorter) one, so the code has at most three copies of the micro-kernel.
    fn split(k: usize, chunk: usize) -> Vec<Part> {
        let part = |k0: usize, count: usize, len: usize| Part {
            k0,
            count,
            len,
            first: k0 == 0,
            last: k0 + count * len >= k,
        };
        if chunk >= k {
            return vec![part(0, 1, k)];
        }
        let full = k / chunk;
        let tail = k - full * chunk;
        // Chunks 1.. before the last one (the last is the tail, or the last full chunk).
        let middle = if tail > 0 { full - 1 } else { full - 2 };
        let mut parts = vec![part(0, 1, chunk)];
        if middle > 0 {
            parts.push(part(chunk, middle, chunk));
        }
        let last_k0 = (1 + middle) * chunk;
        parts.push(part(last_k0, 1, k - last_k0));
        parts
    }
}

/// Widens (or dequantises) columns `k0..k0 + part.len` of rows `n0..n0+cols` of `w` into the
/// f32 scratch (row `j` of the block → scratch row `j`, column `kk - k0`).
#[allow(clippy::too_many_arguments)]
fn widen_rows<'c>(
    b: Kb<'c, '_>,
    w: Value<'c, '_>,
    dtype: DType,
    scratch: Value<'c, '_>,
    n0: Value<'c, '_>,
    cols: usize,
    part: Part,
    k0: Value<'c, '_>,
    lanes: usize,
) {
    if dtype.is_quantized() {
        let be = dtype.block_elems();
        let (lo, hi, one) = (b.idx(0), b.idx(part.len / be), b.idx(1));
        let first = b.divui(k0, b.idx(be));
        b.for_each(lo, hi, one, |b, i| {
            let blk = b.addi(first, i);
            let col0 = b.muli(i, b.idx(be));
            for j in 0..cols {
                let vals = quant::dequant_block(b, w, dtype, b.addi(n0, b.idx(j)), blk, lanes);
                for (v, &val) in vals.iter().enumerate() {
                    b.store(val, scratch, &[b.idx(j), b.addi(col0, b.idx(v * lanes))]);
                }
            }
        });
        return;
    }
    let (lo, hi, step) = (b.idx(0), b.idx(part.len), b.idx(lanes));
    b.for_each(lo, hi, step, |b, kk| {
        for j in 0..cols {
            let v = b.load_weight(w, &[b.addi(n0, b.idx(j)), b.addi(k0, kk)], lanes, dtype);
            b.store(v, scratch, &[b.idx(j), kk]);
        }
    });
}

/// Splits `n` decode rows between threads (see [`split_work`]) in shares of whole `align` rows
/// (a multiple of `group`), dynamic chunks at least [`DECODE_MIN_CHUNK_BYTES`] of `row_bytes`
/// rows long. `rows_at(b, col0, rows, end)` emits one group (`rows < group` only for the
/// `n % group` rows at the end) of the share ending at row `end`; `after(b, start, end)` runs
/// once a share's rows are all done.
#[allow(clippy::too_many_arguments)]
pub(super) fn decode_split<'c, F, G>(
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

impl<'c, 'a> MatMul<'c, 'a> {
    /// Decode: each thread walks its weight rows a few at a time ([`decode_float_rows`],
    /// [`decode_quant_rows`]), one accumulator per weight row and activation row and the
    /// prefill's lane-summing tree, so every output is bitwise the one prefill computes;
    /// weights are prefetched as [`decode_prefetches`] says. Quantised rows are read block by
    /// block in address order, each block dequantised into vectors in k order and folded into
    /// the accumulators (prefill dequantises the same values into its scratch); interleaving a
    /// few rows gives the core independent FMA chains to overlap with the dequantisation work.
    /// With several activation rows (a batched step), each weight vector read (and
    /// dequantised) is folded into [`decode_row_tile`] rows at once; the weights of a few
    /// weight rows are re-read from L1 for the next tile of activation rows.
    fn decode(&self, b: Kb<'c, '_>, w: Value<'c, '_>, dtype: DType, n: usize, d: Dyn<'c, '_>, max_rows: usize) {
        with_decode_cols(b, d, dtype, self.lanes, n, max_rows, |b, group| {
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
        });
    }

    /// Decode outputs `col0..col0 + cols` (of the range ending at row `end`) of every
    /// activation row (`d.rows`) from weights `w` stored as `dtype`, float or quantised: tiles
    /// of [`decode_row_tile`] rows, then the rows left in halving tiles (7 rows with a tile of
    /// 4: 4, 2, 1; one row alone is the last).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn decode_rows(
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
        let tile = decode_row_tile(cols, self.lanes).min(max_rows.next_power_of_two());
        let run = |b: Kb<'c, '_>, r0: Value<'c, '_>, m: usize| {
            if dtype.is_quantized() {
                self.quant_rows(b, w, dtype, col0, cols, end, r0, m)
            } else {
                self.float_rows(b, w, dtype, col0, cols, end, r0, m)
            }
        };
        if max_rows == 1 {
            return run(b, b.idx(0), 1);
        }
        // Full tiles, then one tile of each smaller power of two the rest needs.
        let t = b.idx(tile);
        let mut done = b.muli(b.divui(d.rows, t), t);
        b.for_each(b.idx(0), done, t, |b, r0| run(b, r0, tile));
        let mut m = tile / 2;
        while m >= 1 {
            let left = b.subi(d.rows, done);
            let fits = b.cmpi(crate::ir::Cmp::Uge, left, b.idx(m));
            let r0 = done;
            b.if_then(fits, |b| run(b, r0, m));
            done = b.select(fits, b.addi(done, b.idx(m)), done);
            m /= 2;
        }
    }

    /// Outputs `col0..col0 + ncols` of activation rows `r0..r0 + m` from float weights, one
    /// FMA chain each, walking `k` a cache line of weights per step with one prefetch per
    /// weight row and line.
    #[allow(clippy::too_many_arguments)]
    fn float_rows(
        &self,
        b: Kb<'c, '_>,
        w: Value<'c, '_>,
        dtype: DType,
        col0: Value<'c, '_>,
        ncols: usize,
        end: Value<'c, '_>,
        r0: Value<'c, '_>,
        m: usize,
    ) {
        let lanes = self.lanes;
        let rows: Vec<Value> = (0..m).map(|i| b.addi(r0, b.idx(i))).collect();
        let cols: Vec<Value> = (0..ncols).map(|r| b.addi(col0, b.idx(r))).collect();
        let inits: Vec<Value> = (0..m * ncols).map(|_| b.zero_like(lanes)).collect();
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
    fn finish_tile(&self, b: Kb<'c, '_>, acc: &[Value<'c, '_>], rows: &[Value<'c, '_>], cols: &[Value<'c, '_>]) {
        for (i, &row) in rows.iter().enumerate() {
            let sums = b.reduce_many(&acc[i * cols.len()..(i + 1) * cols.len()]);
            for (&s, &col) in sums.iter().zip(cols) {
                self.finish(b, s, row, col);
            }
        }
    }

    /// Outputs `col0..col0 + ncols` of activation rows `r0..r0 + m` from quantised weights,
    /// prefetching each weight row's stream as [`decode_prefetches`] says.
    #[allow(clippy::too_many_arguments)]
    fn quant_rows(
        &self,
        b: Kb<'c, '_>,
        w: Value<'c, '_>,
        dtype: DType,
        col0: Value<'c, '_>,
        ncols: usize,
        end: Value<'c, '_>,
        r0: Value<'c, '_>,
        m: usize,
    ) {
        let lanes = self.lanes;
        let be = dtype.block_elems();
        let blocks = self.k / be;
        // Several 32-element blocks per iteration, to amortise the loop's own instructions.
        let unroll = [4, 2, 1]
            .into_iter()
            .find(|&u| be * u <= 128 && blocks.is_multiple_of(u))
            .unwrap_or(1);
        let rows: Vec<Value> = (0..m).map(|i| b.addi(r0, b.idx(i))).collect();
        let cols: Vec<Value> = (0..ncols).map(|r| b.addi(col0, b.idx(r))).collect();
        let inits: Vec<Value> = (0..m * ncols).map(|_| b.zero_like(lanes)).collect();
        let row_bytes = dtype.bytes_for(self.k);
        let span = unroll * dtype.block_bytes();
        let prefetches = decode_prefetches();
        let (zero, hi, step) = (b.idx(0), b.idx(blocks), b.idx(unroll));
        let acc = b.for_range(zero, hi, step, &inits, |b, kb, acc| {
            let mut acc = acc;
            let off = b.muli(kb, b.idx(dtype.block_bytes()));
            for &col in &cols {
                for p in prefetches.iter().filter(|p| p.bytes > 0) {
                    // One prefetch per cache line the step reads (a step may span less than one).
                    for line in (0..span.div_ceil(64)).map(|l| l * 64) {
                        let at = Prefetch {
                            bytes: p.bytes + line,
                            ..*p
                        };
                        prefetch_ahead(b, w, col, off, at, 1, row_bytes, end);
                    }
                }
            }
            for u in 0..unroll {
                let blk = b.addi(kb, b.idx(u));
                let k0 = b.muli(blk, b.idx(be));
                // Group by group, every row's values folded in as they are made: each x vector
                // and each dequantised vector lives for a few instructions (see `BlockReader`).
                let mut blocks: Vec<_> = cols
                    .iter()
                    .map(|&col| quant::BlockReader::new(b, w, dtype, col, blk, lanes))
                    .collect();
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

    /// The epilogue of one output: `+ bias`, the activation, the soft cap
    /// (`cap * tanh(v / cap)`), `+= y` when accumulating, store.
    fn finish<'b>(&self, b: Kb<'c, 'b>, mut s: Value<'c, 'b>, row: Value<'c, '_>, col: Value<'c, '_>) {
        if let Some((bias, bdtype)) = self.bias {
            s = b.addf(s, b.load_weight(bias, &[col], 1, bdtype));
        }
        if let Some(act) = self.act {
            s = elementwise::activate(b, act, s);
        }
        if let Some(cap) = self.softcap {
            let c = b.f32c(cap.get());
            s = b.mulf(b.tanh(b.divf(s, c)), c);
        }
        if self.accumulate {
            s = b.addf(b.load_f32(self.y, &[row, col], 1), s);
        }
        b.store(s, self.y, &[row, col]);
    }

    /// Computes the `mr x nb` outputs at rows `r0..r0+mr`, columns `n0..n0+nb`, over the chunk
    /// `k0..k0 + part.len` of `k` (accumulators parked in `acc` between chunks).
    #[allow(clippy::too_many_arguments)]
    fn micro(
        &self,
        b: Kb<'c, '_>,
        src: WeightSrc<'c, '_>,
        r0: Value<'c, '_>,
        n0: Value<'c, '_>,
        mr: usize,
        nb: usize,
        part: Part,
        k0: Value<'c, '_>,
        acc: Option<Value<'c, '_>>,
    ) {
        let lanes = self.lanes;
        let rows: Vec<Value> = (0..mr).map(|i| b.addi(r0, b.idx(i))).collect();
        let cols: Vec<Value> = (0..nb).map(|j| b.addi(n0, b.idx(j))).collect();
        let slots: Vec<Value> = (0..nb).map(|j| b.idx(j)).collect();
        let parked = |i: usize, j: usize| [rows[i], b.idx(j * lanes)];
        let inits: Vec<Value> = (0..mr * nb)
            .map(|ij| match acc {
                Some(a) if !part.first => b.load_f32(a, &parked(ij / nb, ij % nb), lanes),
                _ => b.zero_like(lanes),
            })
            .collect();
        let (zero, kc, step) = (b.idx(0), b.idx(part.len), b.idx(lanes));
        let acc_out = b.for_range(zero, kc, step, &inits, |b, kk, acc| {
            let kx = b.addi(k0, kk);
            let xs: Vec<Value> = rows.iter().map(|&r| b.load_f32(self.x, &[r, kx], lanes)).collect();
            let mut next = acc.clone();
            for j in 0..nb {
                let wv = match src {
                    WeightSrc::Stored { w, dtype } => b.load_weight(w, &[cols[j], kx], lanes, dtype),
                    WeightSrc::Scratch(s) => b.load_f32(s, &[slots[j], kk], lanes),
                };
                for (i, &xv) in xs.iter().enumerate() {
                    next[i * nb + j] = b.fma(wv, xv, acc[i * nb + j]);
                }
            }
            next
        });
        if !part.last {
            let a = acc.expect("an accumulator buffer when k is split");
            for (ij, &v) in acc_out.iter().enumerate() {
                b.store(v, a, &parked(ij / nb, ij % nb));
            }
            return;
        }
        for (i, &row) in rows.iter().enumerate() {
            let sums = b.reduce_many(&acc_out[i * nb..(i + 1) * nb]);
            for (j, &col) in cols.iter().enumerate() {
                self.finish(b, sums[j], row, col);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Part;

    #[test]
    fn parts_cover_k_in_order_with_at_most_three_groups() {
        for (k, chunk) in [
            (64, 64),
            (64, 128),
            (128, 64),
            (192, 64),
            (200, 64),
            (896, 672),
            (5632, 672),
            (4864, 96),
        ] {
            let parts = Part::split(k, chunk);
            assert!(parts.len() <= 3, "k {k} chunk {chunk}: {parts:?}");
            let mut at = 0;
            for (i, p) in parts.iter().enumerate() {
                assert_eq!(p.k0, at, "k {k} chunk {chunk}: contiguous");
                assert!(p.len <= chunk && p.len > 0 && p.count > 0);
                assert_eq!(p.first, i == 0);
                assert_eq!(p.last, i == parts.len() - 1);
                at += p.count * p.len;
            }
            assert_eq!(at, k, "k {k} chunk {chunk}: covers k");
        }
    }
}
