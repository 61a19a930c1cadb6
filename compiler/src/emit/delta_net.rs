//! The Gated DeltaNet recurrence ([`Kernel::DeltaNet`]), one token at a time in both regimes.
//!
//! Each value head's state is a `[k_dim, v_dim]` matrix, and its columns are independent: a
//! token updates column `j` from `v[j]`, `k`, `q` and column `j` alone. So the work is split
//! into (value head, block of `lanes` columns) items, and an item walks every row of the call
//! in order over its `k_dim x lanes` slice of the state (8 KiB for 128 x 16), which stays in L1
//! from one token to the next: prefill is a loop of FMAs over an L1-resident block, as
//! compute-bound as the chunked (WY) form on a CPU, with the same instructions as decode, so
//! prefill and decode agree bit for bit. Per token, two passes over the slice, each with four
//! accumulator chains so the FMA latency is hidden: `S^T k` (the decay `exp(g)` applied to the
//! sum, one FMA per state vector), then `S = S exp(g) + k delta^T` and `S^T q` (three).

use super::elementwise::activate;
use super::{Dyn, row_place, thread_range};
use crate::ir::{Cmp, Kb, lanes_for};
use kiln_core::{Act, DType, DecayForm, HeadOrder, Kernel};
use melior::ir::Value;

/// How the gates' parameters are stored and which key head serves a value head.
#[derive(Clone, Copy)]
struct Shape {
    a_dtype: DType,
    dt_dtype: DType,
    decay: DecayForm,
    order: HeadOrder,
}

pub fn emit_delta_net<'c>(b: Kb<'c, '_>, kernel: &Kernel, p: &[Value<'c, '_>], d: Dyn<'c, '_>, max_lanes: usize) {
    let Kernel::DeltaNet {
        k_heads,
        v_heads,
        k_dim,
        v_dim,
        a_dtype,
        dt_dtype,
        decay,
        order,
        ..
    } = *kernel
    else {
        unreachable!()
    };
    let s = Shape {
        a_dtype,
        dt_dtype,
        decay,
        order,
    };
    let lanes = lanes_for(v_dim, max_lanes);
    let blocks = v_dim / lanes;
    // This thread's normalised q and k of the current row.
    let qn = b.alloca(&format!("memref<{k_dim}xf32>"));
    let kn = b.alloca(&format!("memref<{k_dim}xf32>"));
    let (start, end) = thread_range(b, b.idx(v_heads * blocks), d, 1);
    b.for_each(start, end, b.idx(1), |b, item| {
        let h = b.divui(item, b.idx(blocks));
        let col = b.muli(b.remui(item, b.idx(blocks)), b.idx(lanes));
        let kh = match s.order {
            HeadOrder::Grouped => b.divui(h, b.idx(v_heads / k_heads)),
            HeadOrder::Tiled => b.remui(h, b.idx(k_heads)),
        };
        b.for_each(b.idx(0), d.rows, b.idx(1), |b, r| {
            let place = row_place(b, p[7], r);
            let qkv = p[0];
            let q0 = b.muli(kh, b.idx(k_dim));
            let k0 = b.addi(b.idx(k_heads * k_dim), q0);
            // `transformers`: `l2norm(q) * k_dim^-0.5`, `l2norm(k)`.
            let scale = (1.0f64 / (k_dim as f64).sqrt()) as f32;
            normalised(b, qkv, r, q0, k_dim, max_lanes, Some(scale), qn);
            normalised(b, qkv, r, k0, k_dim, max_lanes, None, kn);
            let (dec, beta) = gates(b, &s, p, r, h);
            // State rows of this slot's head.
            let base = b.muli(b.addi(b.muli(place.slot, b.idx(v_heads)), h), b.idx(k_dim));
            let state = p[4];
            b.if_then(b.cmpi(Cmp::Eq, place.position, b.idx(0)), |b| {
                let zero = b.zero_like(lanes);
                b.for_each(b.idx(0), b.idx(k_dim), b.idx(1), |b, i| {
                    b.store(zero, state, &[b.addi(base, i), col]);
                });
            });
            let dec_v = b.broadcast(dec, lanes);
            // kv = (exp(g) S)^T k, the decay applied once to the sum.
            let kv = accumulate(b, k_dim, lanes, |b, i, acc| {
                let s = b.load_f32(state, &[b.addi(base, i), col], lanes);
                b.fma(s, b.broadcast(b.load_f32(kn, &[i], 1), lanes), acc)
            });
            let kv = b.mulf(kv, dec_v);
            let v0 = b.addi(b.idx(2 * k_heads * k_dim), b.addi(b.muli(h, b.idx(v_dim)), col));
            let v = b.load_f32(qkv, &[r, v0], lanes);
            let delta = b.mulf(b.subf(v, kv), b.broadcast(beta, lanes));
            // S = S * exp(g) + k delta^T, and out = S^T q.
            let out = accumulate(b, k_dim, lanes, |b, i, acc| {
                let at = [b.addi(base, i), col];
                let s_dec = b.mulf(b.load_f32(state, &at, lanes), dec_v);
                let s_new = b.fma(b.broadcast(b.load_f32(kn, &[i], 1), lanes), delta, s_dec);
                b.store(s_new, state, &at);
                b.fma(s_new, b.broadcast(b.load_f32(qn, &[i], 1), lanes), acc)
            });
            let o0 = b.addi(b.muli(h, b.idx(v_dim)), col);
            b.store(out, p[3], &[r, o0]);
        });
    });
}

/// `sum_i term(i)` over `0..k_dim` in four interleaved accumulator chains (summed pairwise at
/// the end), so consecutive FMAs do not wait on each other.
fn accumulate<'c, 'a, F>(b: Kb<'c, 'a>, k_dim: usize, lanes: usize, term: F) -> Value<'c, 'a>
where
    F: for<'x> Fn(Kb<'c, 'x>, Value<'c, 'x>, Value<'c, 'x>) -> Value<'c, 'x>,
{
    let chains = [4, 2, 1].into_iter().find(|c| k_dim.is_multiple_of(*c)).unwrap_or(1);
    let zeros: Vec<Value> = (0..chains).map(|_| b.zero_like(lanes)).collect();
    let accs = b.for_range(b.idx(0), b.idx(k_dim), b.idx(chains), &zeros, |b, i, accs| {
        accs.iter()
            .enumerate()
            .map(|(c, acc)| term(b, b.addi(i, b.idx(c)), *acc))
            .collect()
    });
    match accs[..] {
        [a] => a,
        [a0, a1] => b.addf(a0, a1),
        [a0, a1, a2, a3] => b.addf(b.addf(a0, a1), b.addf(a2, a3)),
        _ => unreachable!(),
    }
}

/// `dst[i] = x[r, c0 + i] / sqrt(sum x^2 + 1e-6) (* scale)` over `k_dim` values.
#[allow(clippy::too_many_arguments)]
fn normalised<'c>(
    b: Kb<'c, '_>,
    x: Value<'c, '_>,
    r: Value<'c, '_>,
    c0: Value<'c, '_>,
    k_dim: usize,
    max_lanes: usize,
    scale: Option<f32>,
    dst: Value<'c, '_>,
) {
    let lanes = lanes_for(k_dim, max_lanes);
    let zero = b.zero_like(lanes);
    let sum = b.for_range(b.idx(0), b.idx(k_dim), b.idx(lanes), &[zero], |b, i, acc| {
        let v = b.load_f32(x, &[r, b.addi(c0, i)], lanes);
        vec![b.fma(v, v, acc[0])]
    });
    let total = b.reduce_add(sum[0]);
    let inv = b.divf(b.f32c(1.0), b.sqrt(b.addf(total, b.f32c(1e-6))));
    let inv_v = if lanes == 1 { inv } else { b.broadcast(inv, lanes) };
    b.for_each(b.idx(0), b.idx(k_dim), b.idx(lanes), |b, i| {
        let mut v = b.mulf(b.load_f32(x, &[r, b.addi(c0, i)], lanes), inv_v);
        if let Some(s) = scale {
            v = b.mulf(v, b.f32_splat_or_scalar(s, lanes));
        }
        b.store(v, dst, &[i]);
    });
}

/// Row `r`'s decay `exp(g)` and `beta` of value head `h`, as scalars: `beta = sigmoid(b)`,
/// `g = A * softplus(a + dt_bias)` with `A = -exp(A_log)` (or the stored `A`), and torch's
/// softplus (`x` above 20, else `log(1 + exp(x))`).
fn gates<'c, 'a>(
    b: Kb<'c, 'a>,
    s: &Shape,
    p: &[Value<'c, '_>],
    r: Value<'c, '_>,
    h: Value<'c, '_>,
) -> (Value<'c, 'a>, Value<'c, 'a>) {
    let a_in = b.load_f32(p[1], &[r, h], 1);
    let b_in = b.load_f32(p[2], &[r, h], 1);
    let a_param = b.load_weight(p[5], &[h], 1, s.a_dtype);
    let dt = b.load_weight(p[6], &[h], 1, s.dt_dtype);
    let x = b.addf(a_in, dt);
    let soft = b.log(b.addf(b.f32c(1.0), b.exp(x)));
    let softplus = b.select(b.cmpf("ogt", x, b.f32c(20.0)), x, soft);
    let a = match s.decay {
        DecayForm::Log => b.negf(b.exp(a_param)),
        DecayForm::Negated => a_param,
    };
    let g = b.mulf(a, softplus);
    (b.exp(g), activate(b, Act::Sigmoid, b_in))
}
