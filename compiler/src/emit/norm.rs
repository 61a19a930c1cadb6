//! Row normalisation, one row per work item: RMSNorm (plain or Gemma's `1 + w` form) and
//! LayerNorm, optionally added to the output (Gemma's post-attention and post-MLP norms).
//!
//! The order of operations follows each reference: RMSNorm normalises, then scales by the
//! weight (`w * (x * inv)`, or `(x * inv) * (1 + w)`); LayerNorm is torch's
//! `(x * rstd + (-rstd * mean)) * w + b`. Reciprocal square roots are a correctly rounded
//! `1 / sqrt`, as torch computes them, so results agree to the last bits apart from the
//! summation order. [`normalize_row`] is shared with the kernels that fold a norm in (decode
//! matmuls, per-head q/k norms), which therefore compute the same bits.

use super::{Dyn, thread_range};
use crate::ir::{Kb, lanes_for};
use kiln_core::{DType, Kernel, NormKind, NormShape};
use melior::ir::Value;

pub fn emit_norm<'c>(b: Kb<'c, '_>, kernel: &Kernel, p: &[Value<'c, '_>], d: Dyn<'c, '_>, max_lanes: usize) {
    let Kernel::Norm {
        dim, norm, accumulate, ..
    } = kernel
    else {
        unreachable!()
    };
    let (x, y) = (p[0], p[2]);
    let weights = NormWeights {
        w: p[1],
        bias: norm.bias.map(|_| p[3]),
    };
    let (r_start, r_end) = thread_range(b, d.rows, d, 1);
    let one = b.idx(1);
    b.for_each(r_start, r_end, one, |b, r| {
        let zero = b.idx(0);
        let row = Row { mem: x, r, c0: zero };
        let out = Row { mem: y, r, c0: zero };
        normalize_row(b, norm, weights, row, out, *dim, max_lanes, *accumulate);
    });
}

/// The weight (and LayerNorm bias) of a norm.
#[derive(Clone, Copy)]
pub struct NormWeights<'c, 'a> {
    pub w: Value<'c, 'a>,
    pub bias: Option<Value<'c, 'a>>,
}

/// `dim` values of row `r` of a `[rows, cols]` buffer starting at column `c0`.
#[derive(Clone, Copy)]
pub struct Row<'c, 'a> {
    pub mem: Value<'c, 'a>,
    pub r: Value<'c, 'a>,
    pub c0: Value<'c, 'a>,
}

impl<'c> Row<'c, '_> {
    fn load<'a>(&self, b: Kb<'c, 'a>, i: Value<'c, '_>, lanes: usize) -> Value<'c, 'a> {
        b.load_f32(self.mem, &[self.r, b.addi(self.c0, i)], lanes)
    }
    fn store(&self, b: Kb<'c, '_>, v: Value<'c, '_>, i: Value<'c, '_>) {
        b.store(v, self.mem, &[self.r, b.addi(self.c0, i)]);
    }
}

/// `out = norm(x)` (or `out += norm(x)` with `accumulate`) over `dim` values; `out` may be
/// `x` itself (each value is read before it is written).
#[allow(clippy::too_many_arguments)]
pub fn normalize_row<'c>(
    b: Kb<'c, '_>,
    norm: &NormShape,
    wts: NormWeights<'c, '_>,
    x: Row<'c, '_>,
    out: Row<'c, '_>,
    dim: usize,
    max_lanes: usize,
    accumulate: bool,
) {
    let lanes = lanes_for(dim, max_lanes);
    let splat = |v| if lanes == 1 { v } else { b.broadcast(v, lanes) };
    match norm.kind {
        NormKind::Rms | NormKind::RmsPlusOne => {
            let inv = inv_rms(b, x, dim, norm.eps.get(), max_lanes);
            let inv_v = splat(inv);
            let one = b.f32_splat_or_scalar(1.0, lanes);
            each(b, dim, lanes, |b, i| {
                let normed = b.mulf(x.load(b, i, lanes), inv_v);
                let wv = b.load_weight(wts.w, &[i], lanes, norm.wdtype);
                let v = match norm.kind {
                    NormKind::Rms => b.mulf(wv, normed),
                    _ => b.mulf(normed, b.addf(one, wv)),
                };
                finish(b, out, i, v, lanes, accumulate);
            });
        }
        NormKind::Layer => {
            let (mean, inv) = moments(b, x, dim, norm.eps.get(), max_lanes);
            let scale = splat(inv);
            let shift = splat(b.negf(b.mulf(inv, mean)));
            let bdtype = norm.bias.unwrap_or(DType::F32);
            each(b, dim, lanes, |b, i| {
                let v = b.addf(b.mulf(x.load(b, i, lanes), scale), shift);
                let mut v = b.mulf(v, b.load_weight(wts.w, &[i], lanes, norm.wdtype));
                if let Some(bias) = wts.bias {
                    v = b.addf(v, b.load_weight(bias, &[i], lanes, bdtype));
                }
                finish(b, out, i, v, lanes, accumulate);
            });
        }
    }
}

/// Stores `v` at `out[i]`, or `out[i] + v` with `accumulate`.
fn finish<'c>(b: Kb<'c, '_>, out: Row<'c, '_>, i: Value<'c, '_>, v: Value<'c, '_>, lanes: usize, accumulate: bool) {
    let v = if accumulate {
        b.addf(out.load(b, i, lanes), v)
    } else {
        v
    };
    out.store(b, v, i);
}

/// `body(b, i)` for `i` in `0..dim` by `lanes`.
fn each<'c, F>(b: Kb<'c, '_>, dim: usize, lanes: usize, body: F)
where
    F: for<'x> Fn(Kb<'c, 'x>, Value<'c, 'x>),
{
    let (lo, hi, step) = (b.idx(0), b.idx(dim), b.idx(lanes));
    b.for_each(lo, hi, step, body);
}

/// `1 / sqrt(mean(x^2) + eps)` of `dim` values, as an f32 scalar.
fn inv_rms<'c, 'a>(b: Kb<'c, 'a>, x: Row<'c, '_>, dim: usize, eps: f32, max_lanes: usize) -> Value<'c, 'a> {
    let lanes = lanes_for(dim, max_lanes);
    let zero = b.zero_like(lanes);
    let (lo, hi, step) = (b.idx(0), b.idx(dim), b.idx(lanes));
    let acc = b.for_range(lo, hi, step, &[zero], |b, i, acc| {
        let v = x.load(b, i, lanes);
        vec![b.fma(v, v, acc[0])]
    });
    let sum = b.reduce_add(acc[0]);
    let mean = b.divf(sum, b.f32c(dim as f32));
    let denom = b.sqrt(b.addf(mean, b.f32c(eps)));
    b.divf(b.f32c(1.0), denom)
}

/// The mean of `dim` values and `1 / sqrt(var + eps)` (biased variance, two passes), as f32
/// scalars.
fn moments<'c, 'a>(
    b: Kb<'c, 'a>,
    x: Row<'c, '_>,
    dim: usize,
    eps: f32,
    max_lanes: usize,
) -> (Value<'c, 'a>, Value<'c, 'a>) {
    let lanes = lanes_for(dim, max_lanes);
    let n = b.f32c(dim as f32);
    let (lo, hi, step) = (b.idx(0), b.idx(dim), b.idx(lanes));
    let sum = b.for_range(lo, hi, step, &[b.zero_like(lanes)], |b, i, acc| {
        vec![b.addf(acc[0], x.load(b, i, lanes))]
    });
    let mean = b.divf(b.reduce_add(sum[0]), n);
    let mean_v = if lanes == 1 { mean } else { b.broadcast(mean, lanes) };
    let sq = b.for_range(lo, hi, step, &[b.zero_like(lanes)], |b, i, acc| {
        let c = b.subf(x.load(b, i, lanes), mean_v);
        vec![b.fma(c, c, acc[0])]
    });
    let var = b.divf(b.reduce_add(sq[0]), n);
    let inv = b.divf(b.f32c(1.0), b.sqrt(b.addf(var, b.f32c(eps))));
    (mean, inv)
}
