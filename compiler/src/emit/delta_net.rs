//! The Gated DeltaNet recurrence ([`Kernel::DeltaNet`]) one token at a time, as decode runs
//! it (prefill kernels run the chunked form of [`super::delta_chunk`]), and its per-token
//! inputs ([`Kernel::DeltaGates`]).
//!
//! Each value head's state is a `[k_dim, v_dim]` matrix, and its columns are independent: a
//! token updates column `j` from `v[j]`, `k`, `q` and column `j` alone. So the work is split
//! into (value head, block of `lanes` columns) items, and an item walks every row of the call
//! in order over its `k_dim x lanes` slice of the state (8 KiB for 128 x 16), which stays in L1
//! from one token to the next. Per token, two passes over the slice with enough accumulator
//! chains to hide the FMA latency: `S^T k` (the decay `exp(g)` applied to the sum, one FMA per
//! state vector), then `S = S exp(g) + k delta^T` and `S^T q` (three operations). The
//! normalised q and k and the two gates, the same for all of a head's items, are computed once
//! per row beforehand by `delta_gates`.

use super::elementwise::activate;
use super::{Dyn, row_place, thread_range};
use crate::ir::{Cmp, Kb, lanes_for};
use kiln_core::kernel::is_decode;
use kiln_core::{Act, DType, DecayForm, HeadOrder, Kernel};
use melior::ir::Value;

/// The recurrence's inputs, prepared once per row ([`Kernel::DeltaGates`]): every work item
/// of [`emit_delta_net`] (8 per value head at 16 lanes and `v_dim` 128) reads the same
/// normalised q and k and the same two gates, which used to be recomputed by each (an L2 norm
/// is a serial reduction, the gates a `log` call and three `exp`s: about half of each item's
/// time per row). Rows are independent here, so they are split between the threads.
pub fn emit_delta_gates<'c>(b: Kb<'c, '_>, kernel: &Kernel, p: &[Value<'c, '_>], d: Dyn<'c, '_>, max_lanes: usize) {
    let Kernel::DeltaGates {
        k_heads,
        v_heads,
        k_dim,
        a_dtype,
        dt_dtype,
        decay,
        max_rows,
        ..
    } = *kernel
    else {
        unreachable!()
    };
    // The chunked prefill form sums log-decays; decode multiplies by the decay itself.
    let log_decay = !is_decode(max_rows);
    let (qkv, a, beta_in) = (p[0], p[1], p[2]);
    let (start, end) = thread_range(b, d.rows, d, 1);
    b.for_each(start, end, b.idx(1), |b, r| {
        // `transformers`: `l2norm(q) * k_dim^-0.5`, `l2norm(k)`.
        let scale = (1.0f64 / (k_dim as f64).sqrt()) as f32;
        for kh in 0..k_heads {
            normalise(b, qkv, r, kh * k_dim, k_dim, max_lanes, Some(scale));
            normalise(b, qkv, r, (k_heads + kh) * k_dim, k_dim, max_lanes, None);
        }
        b.for_each(b.idx(0), b.idx(v_heads), b.idx(1), |b, h| {
            let (g, beta) = gates(b, a_dtype, dt_dtype, decay, p, r, h);
            b.store(if log_decay { g } else { b.exp(g) }, a, &[r, h]);
            b.store(beta, beta_in, &[r, h]);
        });
    });
}

/// The recurrence over the inputs [`emit_delta_gates`] prepared: `qkv` holds normalised q and
/// k, `p[1]` the decay `exp(g)` (prefill: `g`) and `p[2]` beta of each row and value head.
/// Prefill kernels run the chunked form ([`super::delta_chunk`]).
pub fn emit_delta_net<'c>(b: Kb<'c, '_>, kernel: &Kernel, p: &[Value<'c, '_>], d: Dyn<'c, '_>, max_lanes: usize) {
    let Kernel::DeltaNet {
        k_heads,
        v_heads,
        k_dim,
        v_dim,
        order,
        max_rows,
    } = *kernel
    else {
        unreachable!()
    };
    if !is_decode(max_rows) {
        return super::delta_chunk::emit_delta_chunked(b, kernel, p, d, max_lanes);
    }
    let lanes = lanes_for(v_dim, max_lanes);
    let blocks = v_dim / lanes;
    let (qkv, state) = (p[0], p[4]);
    let (start, end) = thread_range(b, b.idx(v_heads * blocks), d, 1);
    b.for_each(start, end, b.idx(1), |b, item| {
        let h = b.divui(item, b.idx(blocks));
        let blk = b.remui(item, b.idx(blocks));
        let col = b.muli(blk, b.idx(lanes));
        let q0 = b.muli(key_head(b, h, order, k_heads, v_heads), b.idx(k_dim));
        let k0 = b.addi(b.idx(k_heads * k_dim), q0);
        let v0 = b.addi(b.idx(2 * k_heads * k_dim), b.addi(b.muli(h, b.idx(v_dim)), col));
        b.for_each(b.idx(0), d.rows, b.idx(1), |b, r| {
            let place = row_place(b, p[5], r);
            // This item's slice of the slot's state: `k_dim` vectors of `lanes`, contiguous.
            let head = b.addi(b.muli(place.slot, b.idx(v_heads)), h);
            let base = b.muli(b.addi(b.muli(head, b.idx(blocks)), blk), b.idx(k_dim * lanes));
            b.if_then(b.cmpi(Cmp::Eq, place.position, b.idx(0)), |b| {
                let zero = b.zero_like(lanes);
                b.for_each(b.idx(0), b.idx(k_dim), b.idx(1), |b, i| {
                    b.store(zero, state, &[vector_at(b, base, i, lanes)]);
                });
            });
            let dec_v = b.broadcast(b.load_f32(p[1], &[r, h], 1), lanes);
            let beta = b.load_f32(p[2], &[r, h], 1);
            // kv = (exp(g) S)^T k, the decay applied once to the sum. Eight chains: one FMA
            // per state vector, so two FMA ports at latency 4 need eight sums in flight.
            let kv = accumulate(b, k_dim, lanes, 8, |b, i, acc| {
                let s = b.load_f32(state, &[vector_at(b, base, i, lanes)], lanes);
                b.fma(s, splat_at(b, qkv, r, b.addi(k0, i), lanes), acc)
            });
            let kv = b.mulf(kv, dec_v);
            let v = b.load_f32(qkv, &[r, v0], lanes);
            let delta = b.mulf(b.subf(v, kv), b.broadcast(beta, lanes));
            // S = S * exp(g) + k delta^T, and out = S^T q: three operations per vector, so
            // four chains keep up.
            let out = accumulate(b, k_dim, lanes, 4, |b, i, acc| {
                let at = [vector_at(b, base, i, lanes)];
                let s_dec = b.mulf(b.load_f32(state, &at, lanes), dec_v);
                let s_new = b.fma(splat_at(b, qkv, r, b.addi(k0, i), lanes), delta, s_dec);
                b.store(s_new, state, &at);
                b.fma(s_new, splat_at(b, qkv, r, b.addi(q0, i), lanes), acc)
            });
            let o0 = b.addi(b.muli(h, b.idx(v_dim)), col);
            b.store(out, p[3], &[r, o0]);
        });
    });
}

/// The key head value head `h` reads: heads in groups of `v_heads / k_heads` (`transformers`),
/// or tiled (llama.cpp's converter).
pub(super) fn key_head<'c, 'a>(
    b: Kb<'c, 'a>,
    h: Value<'c, '_>,
    order: HeadOrder,
    k_heads: usize,
    v_heads: usize,
) -> Value<'c, 'a> {
    match order {
        HeadOrder::Grouped => b.divui(h, b.idx(v_heads / k_heads)),
        HeadOrder::Tiled => b.remui(h, b.idx(k_heads)),
    }
}

/// Index of vector `i` of a state slice starting at `base`.
fn vector_at<'c, 'a>(b: Kb<'c, 'a>, base: Value<'c, '_>, i: Value<'c, '_>, lanes: usize) -> Value<'c, 'a> {
    b.addi(base, b.muli(i, b.idx(lanes)))
}

/// `x[r, c]` in every lane.
fn splat_at<'c, 'a>(
    b: Kb<'c, 'a>,
    x: Value<'c, '_>,
    r: Value<'c, '_>,
    c: Value<'c, '_>,
    lanes: usize,
) -> Value<'c, 'a> {
    b.broadcast(b.load_f32(x, &[r, c], 1), lanes)
}

/// `sum_i term(i)` over `0..k_dim` in up to `max_chains` interleaved accumulator chains
/// (summed pairwise at the end), so consecutive FMAs do not wait on each other.
fn accumulate<'c, 'a, F>(b: Kb<'c, 'a>, k_dim: usize, lanes: usize, max_chains: usize, term: F) -> Value<'c, 'a>
where
    F: for<'x> Fn(Kb<'c, 'x>, Value<'c, 'x>, Value<'c, 'x>) -> Value<'c, 'x>,
{
    let chains = [8, 4, 2, 1]
        .into_iter()
        .find(|c| *c <= max_chains && k_dim.is_multiple_of(*c))
        .unwrap_or(1);
    let zeros: Vec<Value> = (0..chains).map(|_| b.zero_like(lanes)).collect();
    let accs = b.for_range(b.idx(0), b.idx(k_dim), b.idx(chains), &zeros, |b, i, accs| {
        accs.iter()
            .enumerate()
            .map(|(c, acc)| term(b, b.addi(i, b.idx(c)), *acc))
            .collect()
    });
    pairwise_sum(b, &accs)
}

/// `((a0 + a1) + (a2 + a3)) + ...`: the chains summed as a balanced tree.
fn pairwise_sum<'c, 'a>(b: Kb<'c, 'a>, values: &[Value<'c, 'a>]) -> Value<'c, 'a> {
    match values {
        [a] => *a,
        _ => {
            let (lo, hi) = values.split_at(values.len() / 2);
            b.addf(pairwise_sum(b, lo), pairwise_sum(b, hi))
        }
    }
}

/// `x[r, c0 + i] /= sqrt(sum x^2 + 1e-6) (* scale)` over `k_dim` values, in place.
fn normalise<'c>(
    b: Kb<'c, '_>,
    x: Value<'c, '_>,
    r: Value<'c, '_>,
    c0: usize,
    k_dim: usize,
    max_lanes: usize,
    scale: Option<f32>,
) {
    let lanes = lanes_for(k_dim, max_lanes);
    let zero = b.zero_like(lanes);
    let c0 = b.idx(c0);
    let sum = b.for_range(b.idx(0), b.idx(k_dim), b.idx(lanes), &[zero], |b, i, acc| {
        let v = b.load_f32(x, &[r, b.addi(c0, i)], lanes);
        vec![b.fma(v, v, acc[0])]
    });
    let total = b.reduce_add(sum[0]);
    let inv = b.divf(b.f32c(1.0), b.sqrt(b.addf(total, b.f32c(1e-6))));
    let inv_v = if lanes == 1 { inv } else { b.broadcast(inv, lanes) };
    b.for_each(b.idx(0), b.idx(k_dim), b.idx(lanes), |b, i| {
        let at = [r, b.addi(c0, i)];
        let mut v = b.mulf(b.load_f32(x, &at, lanes), inv_v);
        if let Some(s) = scale {
            v = b.mulf(v, b.f32_splat_or_scalar(s, lanes));
        }
        b.store(v, x, &at);
    });
}

/// Row `r`'s log-decay `g` and `beta` of value head `h`, as scalars: `beta = sigmoid(b)`,
/// `g = A * softplus(a + dt_bias)` with `A = -exp(A_log)` (or the stored `A`), and torch's
/// softplus (`x` above 20, else `log(1 + exp(x))`).
fn gates<'c, 'a>(
    b: Kb<'c, 'a>,
    a_dtype: DType,
    dt_dtype: DType,
    decay: DecayForm,
    p: &[Value<'c, '_>],
    r: Value<'c, '_>,
    h: Value<'c, '_>,
) -> (Value<'c, 'a>, Value<'c, 'a>) {
    let a_in = b.load_f32(p[1], &[r, h], 1);
    let b_in = b.load_f32(p[2], &[r, h], 1);
    let a_param = b.load_weight(p[3], &[h], 1, a_dtype);
    let dt = b.load_weight(p[4], &[h], 1, dt_dtype);
    let x = b.addf(a_in, dt);
    let soft = b.log(b.addf(b.f32c(1.0), b.exp(x)));
    let softplus = b.select(b.cmpf("ogt", x, b.f32c(20.0)), x, soft);
    let a = match decay {
        DecayForm::Log => b.negf(b.exp(a_param)),
        DecayForm::Negated => a_param,
    };
    (b.mulf(a, softplus), activate(b, Act::Sigmoid, b_in))
}
