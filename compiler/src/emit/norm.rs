//! RMSNorm: `y = w * (x / sqrt(mean(x^2) + eps))`, one row per work item.
//!
//! The order of operations follows the Hugging Face reference (normalise, then scale by the
//! weight) and the reciprocal square root is a correctly rounded `1 / sqrt`, as torch computes
//! it, so results agree to the last bits apart from the summation order.

use super::{Dyn, thread_range};
use crate::ir::{Kb, lanes_for};
use kiln_core::{DType, Kernel};
use melior::ir::Value;

pub fn emit_rmsnorm<'c>(b: Kb<'c, '_>, kernel: &Kernel, p: &[Value<'c, '_>], d: Dyn<'c, '_>, max_lanes: usize) {
    let Kernel::RmsNorm { dim, eps, wdtype, .. } = kernel else {
        unreachable!()
    };
    let (x, w, y) = (p[0], p[1], p[2]);
    let (r_start, r_end) = thread_range(b, d.rows, d, 1);
    let one = b.idx(1);
    b.for_each(r_start, r_end, one, |b, r| {
        let inv = inv_rms(b, x, r, b.idx(0), *dim, eps.get(), max_lanes);
        scale_row(b, x, r, b.idx(0), w, *wdtype, inv, y, r, b.idx(0), *dim, max_lanes);
    });
}

/// `1 / sqrt(mean(x[r, c0..c0+dim]^2) + eps)` as an f32 scalar.
pub fn inv_rms<'c, 'a>(
    b: Kb<'c, 'a>,
    x: Value<'c, '_>,
    r: Value<'c, '_>,
    c0: Value<'c, '_>,
    dim: usize,
    eps: f32,
    max_lanes: usize,
) -> Value<'c, 'a> {
    let lanes = lanes_for(dim, max_lanes);
    let zero = b.zero_like(lanes);
    let (lo, hi, step) = (b.idx(0), b.idx(dim), b.idx(lanes));
    let acc = b.for_range(lo, hi, step, &[zero], |b, i, acc| {
        let v = b.load_f32(x, &[r, b.addi(c0, i)], lanes);
        vec![b.fma(v, v, acc[0])]
    });
    let sum = b.reduce_add(acc[0]);
    let mean = b.divf(sum, b.f32c(dim as f32));
    let denom = b.sqrt(b.addf(mean, b.f32c(eps)));
    b.divf(b.f32c(1.0), denom)
}

/// `out[ro, oc0 + i] = w[i] * (x[r, c0 + i] * inv)` for `i < dim`.
#[allow(clippy::too_many_arguments)]
pub fn scale_row<'c>(
    b: Kb<'c, '_>,
    x: Value<'c, '_>,
    r: Value<'c, '_>,
    c0: Value<'c, '_>,
    w: Value<'c, '_>,
    wdtype: DType,
    inv: Value<'c, '_>,
    out: Value<'c, '_>,
    ro: Value<'c, '_>,
    oc0: Value<'c, '_>,
    dim: usize,
    max_lanes: usize,
) {
    let lanes = lanes_for(dim, max_lanes);
    let inv_v = if lanes == 1 { inv } else { b.broadcast(inv, lanes) };
    let (lo, hi, step) = (b.idx(0), b.idx(dim), b.idx(lanes));
    b.for_each(lo, hi, step, |b, i| {
        let v = b.load_f32(x, &[r, b.addi(c0, i)], lanes);
        let wv = b.load_weight(w, &[i], lanes, wdtype);
        let normed = b.mulf(v, inv_v);
        b.store(b.mulf(wv, normed), out, &[ro, b.addi(oc0, i)]);
    });
}
