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
//!   of rows one row at a time, so the matrix is read in address order as one long stream (the
//!   pattern hardware prefetchers follow best; interleaving several short rows restarts their
//!   streams every row). One vector accumulator per row and the same lane-summing tree as
//!   prefill make every output bitwise identical between decode and prefill: the single FMA
//!   chain still allows ~8 bytes of bf16 weights per cycle per core, above what memory delivers.
//! * Prefill is compute-bound: each block of `nb` weight rows is widened to f32 once into a
//!   stack scratch and reused by every row tile, so the inner loop is only loads and FMAs.

use super::{Dyn, thread_range};
use crate::ir::{Kb, lanes_for};
use kiln_spec::{DType, Kernel};
use melior::ir::Value;


/// Largest prefill weight scratch (`nb * k * 4` bytes) placed on the stack; beyond it the
/// weights are widened in registers as in decode.
const MAX_SCRATCH_BYTES: usize = 256 << 10;

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

struct MatMul<'c, 'a> {
    k: usize,
    lanes: usize,
    x: Value<'c, 'a>,
    y: Value<'c, 'a>,
    bias: Option<(Value<'c, 'a>, DType)>,
    accumulate: bool,
}

pub fn emit_matmul<'c, 'a>(b: Kb<'c, 'a>, kernel: &Kernel, p: &[Value<'c, 'a>], d: Dyn<'c, 'a>, max_lanes: usize) {
    let Kernel::MatMul { n, k, wdtype, bias, accumulate, max_rows } = kernel else { unreachable!() };
    let m = MatMul {
        k: *k,
        lanes: lanes_for(*k, max_lanes),
        x: p[0],
        y: p[2],
        bias: bias.map(|dt| (p[3], dt)),
        accumulate: *accumulate,
    };
    let w = p[1];
    if *max_rows == 1 {
        return m.decode(b, w, *wdtype, *n, d);
    }
    let stored = WeightSrc::Stored { w, dtype: *wdtype };
    let (mr, nb) = prefill_tile(max_lanes);
    let nb = nb.min(*n);
    let scratch = (*max_rows > 1 && *wdtype != DType::F32 && nb * k * 4 <= MAX_SCRATCH_BYTES).then(|| {
        let ty = b.ty(&format!("memref<{nb}x{k}xf32>"));
        b.op("memref.alloca", &[], &[ty], &[("alignment", b.attr("64 : i64")), ("operandSegmentSizes", b.attr("array<i32: 0, 0>"))])[0]
    });

    let total = b.idx(*n);
    let (n_start, n_end) = thread_range(b, total, d, nb);
    let nb_c = b.idx(nb);
    let full_blocks = b.divui(b.subi(n_end, n_start), nb_c);
    let n_full_end = b.addi(n_start, b.muli(full_blocks, nb_c));

    // One block of `cols` weight rows starting at `n0`, over every row tile.
    let block = |b: Kb<'c, '_>, n0: Value<'c, '_>, cols: usize| {
        let src = match scratch {
            Some(s) => {
                widen_rows(b, w, *wdtype, s, n0, cols, *k, m.lanes);
                WeightSrc::Scratch(s)
            }
            None => stored,
        };
        let mr_c = b.idx(mr);
        let rows_full = b.muli(b.divui(d.rows, mr_c), mr_c);
        let zero = b.idx(0);
        b.for_each(zero, rows_full, mr_c, |b, r0| m.micro(b, src, r0, n0, mr, cols));
        if mr > 1 {
            let one = b.idx(1);
            b.for_each(rows_full, d.rows, one, |b, r0| m.micro(b, src, r0, n0, 1, cols));
        }
    };
    b.for_each(n_start, n_full_end, nb_c, |b, n0| block(b, n0, nb));
    // Chunks are whole blocks, so only the thread ending at `n` has a remainder: `n % nb`.
    let rem = n % nb;
    if rem > 0 {
        let has_rem = b.cmpi(crate::ir::Cmp::Ult, n_full_end, n_end);
        b.if_then(has_rem, |b| block(b, n_full_end, rem));
    }
}

/// Widens rows `n0..n0+cols` of `w` into the f32 scratch (row `j` of the block → scratch row
/// `j`).
#[allow(clippy::too_many_arguments)]
fn widen_rows<'c>(b: Kb<'c, '_>, w: Value<'c, '_>, dtype: DType, scratch: Value<'c, '_>, n0: Value<'c, '_>, cols: usize, k: usize, lanes: usize) {
    let (lo, hi, step) = (b.idx(0), b.idx(k), b.idx(lanes));
    b.for_each(lo, hi, step, |b, kk| {
        for j in 0..cols {
            let v = b.load_weight(w, &[b.addi(n0, b.idx(j)), kk], lanes, dtype);
            b.store(v, scratch, &[b.idx(j), kk]);
        }
    });
}

impl<'c, 'a> MatMul<'c, 'a> {
    /// Decode: rows of the weight matrix in address order, one accumulator per row.
    fn decode(&self, b: Kb<'c, '_>, w: Value<'c, '_>, dtype: DType, n: usize, d: Dyn<'c, '_>) {
        let lanes = self.lanes;
        let total = b.idx(n);
        let (start, end) = thread_range(b, total, d, 1);
        let (zero, one) = (b.idx(0), b.idx(1));
        let row = b.idx(0);
        b.for_each(start, end, one, |b, col| {
            let init = b.zero_like(lanes);
            let (kc, step) = (b.idx(self.k), b.idx(lanes));
            let acc = b.for_range(zero, kc, step, &[init], |b, kk, acc| {
                let wv = b.load_weight(w, &[col, kk], lanes, dtype);
                let xv = b.load_f32(self.x, &[row, kk], lanes);
                vec![b.fma(wv, xv, acc[0])]
            });
            let mut s = b.reduce_many(&acc)[0];
            if let Some((bias, bdtype)) = self.bias {
                s = b.addf(s, b.load_weight(bias, &[col], 1, bdtype));
            }
            if self.accumulate {
                s = b.addf(b.load_f32(self.y, &[row, col], 1), s);
            }
            b.store(s, self.y, &[row, col]);
        });
    }

    /// Computes the `mr x nb` outputs at rows `r0..r0+mr`, columns `n0..n0+nb`.
    fn micro(&self, b: Kb<'c, '_>, src: WeightSrc<'c, '_>, r0: Value<'c, '_>, n0: Value<'c, '_>, mr: usize, nb: usize) {
        let lanes = self.lanes;
        let rows: Vec<Value> = (0..mr).map(|i| b.addi(r0, b.idx(i))).collect();
        let cols: Vec<Value> = (0..nb).map(|j| b.addi(n0, b.idx(j))).collect();
        let slots: Vec<Value> = (0..nb).map(|j| b.idx(j)).collect();
        let inits: Vec<Value> = (0..mr * nb).map(|_| b.zero_like(lanes)).collect();
        let (zero, kc, step) = (b.idx(0), b.idx(self.k), b.idx(lanes));
        let acc = b.for_range(zero, kc, step, &inits, |b, kk, acc| {
            let xs: Vec<Value> = rows.iter().map(|&r| b.load_f32(self.x, &[r, kk], lanes)).collect();
            let mut next = acc.clone();
            for j in 0..nb {
                let wv = match src {
                    WeightSrc::Stored { w, dtype } => b.load_weight(w, &[cols[j], kk], lanes, dtype),
                    WeightSrc::Scratch(s) => b.load_f32(s, &[slots[j], kk], lanes),
                };
                for (i, &xv) in xs.iter().enumerate() {
                    next[i * nb + j] = b.fma(wv, xv, acc[i * nb + j]);
                }
            }
            next
        });
        for (i, &row) in rows.iter().enumerate() {
            let sums = b.reduce_many(&acc[i * nb..(i + 1) * nb]);
            for (j, &col) in cols.iter().enumerate() {
                let mut s = sums[j];
                if let Some((bias, bdtype)) = self.bias {
                    s = b.addf(s, b.load_weight(bias, &[col], 1, bdtype));
                }
                if self.accumulate {
                    s = b.addf(b.load_f32(self.y, &[row, col], 1), s);
                }
                b.store(s, self.y, &[row, col]);
            }
        }
    }
}
