//! `y[r, n] (+)= sum_k x[r, k] * w[n, k] (+ bias[n])` with weights read as stored.
//!
//! Both operands are contiguous along `k`, so the kernel is a set of dot products: a micro-kernel
//! keeps an `mr x nb` block of vector accumulators in registers and walks `k` once, loading each
//! activation vector once for `nb` weight rows and each (widened) weight vector once for `mr`
//! activation rows. Threads split the output columns `n` in chunks of `nb`, so every thread streams
//! a disjoint slice of the weight matrix (decode is a pure weight stream: `mr = 1`).

use super::{Dyn, thread_range};
use crate::ir::{Kb, lanes_for};
use kiln_spec::{DType, Kernel};
use melior::ir::Value;

/// Weight rows per micro-kernel: enough independent loads in flight to cover memory latency.
const NB: usize = 4;

/// Activation rows per micro-kernel for prefill, bounded by the vector register file:
/// `mr * nb` accumulators + `mr` activation vectors + `nb` weight vectors must fit.
fn prefill_mr(max_lanes: usize) -> usize {
    if max_lanes >= 16 { 4 } else { 2 }
}

struct MatMul {
    k: usize,
    wdtype: DType,
    bias: Option<DType>,
    accumulate: bool,
    lanes: usize,
}

pub fn emit_matmul<'c>(b: Kb<'c, '_>, kernel: &Kernel, p: &[Value<'c, '_>], d: Dyn<'c, '_>, max_lanes: usize) {
    let Kernel::MatMul { n, k, wdtype, bias, accumulate, max_rows } = kernel else { unreachable!() };
    let m = MatMul { k: *k, wdtype: *wdtype, bias: *bias, accumulate: *accumulate, lanes: lanes_for(*k, max_lanes) };
    let (x, w, y) = (p[0], p[1], p[2]);
    let bias_mem = bias.map(|_| p[3]);
    let mr = if *max_rows == 1 { 1 } else { prefill_mr(max_lanes) };

    let total = b.idx(*n);
    let (n_start, n_end) = thread_range(b, total, d, NB);
    let nb_c = b.idx(NB);
    let full_blocks = b.divui(b.subi(n_end, n_start), nb_c);
    let n_full_end = b.addi(n_start, b.muli(full_blocks, nb_c));
    let one = b.idx(1);
    let zero = b.idx(0);

    // Whole blocks of NB weight rows.
    b.for_each(n_start, n_full_end, nb_c, |b, n0| {
        let mr_c = b.idx(mr);
        let rows_full = b.muli(b.divui(d.rows, mr_c), mr_c);
        b.for_each(zero, rows_full, mr_c, |b, r0| m.micro(b, x, w, y, bias_mem, r0, n0, mr, NB));
        if mr > 1 {
            b.for_each(rows_full, d.rows, one, |b, r0| m.micro(b, x, w, y, bias_mem, r0, n0, 1, NB));
        }
    });
    // The last thread's remainder columns, one at a time.
    b.for_each(n_full_end, n_end, one, |b, n0| {
        b.for_each(zero, d.rows, one, |b, r0| m.micro(b, x, w, y, bias_mem, r0, n0, 1, 1));
    });
}

impl MatMul {
    /// Computes the `mr x nb` outputs at rows `r0..r0+mr`, columns `n0..n0+nb`.
    #[allow(clippy::too_many_arguments)]
    fn micro<'c>(
        &self,
        b: Kb<'c, '_>,
        x: Value<'c, '_>,
        w: Value<'c, '_>,
        y: Value<'c, '_>,
        bias: Option<Value<'c, '_>>,
        r0: Value<'c, '_>,
        n0: Value<'c, '_>,
        mr: usize,
        nb: usize,
    ) {
        let lanes = self.lanes;
        let rows: Vec<Value> = (0..mr).map(|i| b.addi(r0, b.idx(i))).collect();
        let cols: Vec<Value> = (0..nb).map(|j| b.addi(n0, b.idx(j))).collect();
        let inits: Vec<Value> = (0..mr * nb).map(|_| b.zero_like(lanes)).collect();
        let (zero, kc, step) = (b.idx(0), b.idx(self.k), b.idx(lanes));
        let acc = b.for_range(zero, kc, step, &inits, |b, kk, acc| {
            let xs: Vec<Value> = rows.iter().map(|&r| b.load_f32(x, &[r, kk], lanes)).collect();
            let mut next = acc.clone();
            for (j, &col) in cols.iter().enumerate() {
                let wv = b.load_weight(w, &[col, kk], lanes, self.wdtype);
                for (i, &xv) in xs.iter().enumerate() {
                    next[i * nb + j] = b.fma(wv, xv, acc[i * nb + j]);
                }
            }
            next
        });
        for (i, &row) in rows.iter().enumerate() {
            for (j, &col) in cols.iter().enumerate() {
                let mut s = b.reduce_add(acc[i * nb + j]);
                if let (Some(bias), Some(bdtype)) = (bias, self.bias) {
                    s = b.addf(s, b.load_weight(bias, &[col], 1, bdtype));
                }
                if self.accumulate {
                    s = b.addf(b.load_f32(y, &[row, col], 1), s);
                }
                b.store(s, y, &[row, col]);
            }
        }
    }
}
