//! Row-wise and elementwise kernels: the embedding gather, activations (`act(gate) * up`) and
//! the residual add.

use super::{Dyn, quant, thread_range};
use crate::ir::{Kb, lanes_for};
use kiln_core::grouped::{GROUP_ROWS, OCTET, PieceOrder};
use kiln_core::{Act, Kernel};
use melior::ir::Value;

/// `x[r, :] = float(table[tokens[r], :]) (* scale) (+ pos_table[position(r), :])`. Token ids are
/// clamped to the table (and positions to the position table) so a bad id can never read
/// outside it (the runtime rejects such ids and positions before calling).
pub fn emit_embed<'c>(b: Kb<'c, '_>, kernel: &Kernel, p: &[Value<'c, '_>], d: Dyn<'c, '_>, max_lanes: usize) {
    let Kernel::Embed {
        vocab,
        hidden,
        dtype,
        scale,
        positions,
        grouped,
        ..
    } = kernel
    else {
        unreachable!()
    };
    let (tokens, table, x) = (p[0], p[1], p[2]);
    let lanes = lanes_for(*hidden, max_lanes);
    let (r_start, r_end) = thread_range(b, d.rows, d, 1);
    let one = b.idx(1);
    b.for_each(r_start, r_end, one, |b, r| {
        let t = b.minui(b.load_i32_index(tokens, &[r]), b.idx(vocab - 1));
        match grouped {
            Some(order) => gather_grouped_row(b, table, *dtype, *order, t, x, r, *hidden),
            None => gather_row(b, table, *dtype, t, x, r, *hidden, lanes),
        }
        // Then the row is finished in place: scaled (Gemma's `sqrt(hidden)`), then the learned
        // position added (GPT-2), each as the reference's own elementwise step.
        if scale.is_none() && positions.is_none() {
            return;
        }
        let pos_row = positions.map(|pt| {
            let position = super::row_place(b, p[4], r).position;
            (p[3], pt, b.minui(position, b.idx(pt.rows - 1)))
        });
        let (lo, hi, step) = (b.idx(0), b.idx(*hidden), b.idx(lanes));
        b.for_each(lo, hi, step, |b, c| {
            let mut v = b.load_f32(x, &[r, c], lanes);
            if let Some(s) = scale {
                v = b.mulf(v, b.f32_splat_or_scalar(s.get(), lanes));
            }
            if let Some((ptable, pt, prow)) = pos_row {
                v = b.addf(v, b.load_weight(ptable, &[prow, c], lanes, pt.dtype));
            }
            b.store(v, x, &[r, c]);
        });
    });
}

/// Row `t` of `table` (any storage type), widened into row `r` of `x`.
#[allow(clippy::too_many_arguments)]
fn gather_row<'c>(
    b: Kb<'c, '_>,
    table: Value<'c, '_>,
    dtype: kiln_core::DType,
    t: Value<'c, '_>,
    x: Value<'c, '_>,
    r: Value<'c, '_>,
    hidden: usize,
    lanes: usize,
) {
    let one = b.idx(1);
    if dtype.is_quantized() {
        // The row's blocks, each dequantised into vectors in column order.
        let be = dtype.block_elems();
        let (lo, hi) = (b.idx(0), b.idx(hidden / be));
        b.for_each(lo, hi, one, |b, blk| {
            let c0 = b.muli(blk, b.idx(be));
            for (i, v) in quant::dequant_block(b, table, dtype, t, blk, lanes, quant::Zeros::Signed)
                .into_iter()
                .enumerate()
            {
                b.store(v, x, &[r, b.addi(c0, b.idx(i * lanes))]);
            }
        });
        return;
    }
    let (lo, hi, step) = (b.idx(0), b.idx(hidden), b.idx(lanes));
    b.for_each(lo, hi, step, |b, c| {
        let v = b.load_weight(table, &[t, c], lanes, dtype);
        b.store(v, x, &[r, c]);
    });
}

/// Row `t` of a table of 2-byte elements stored in row groups (`kiln_core::grouped`), widened
/// into row `r` of `x` an octet at a time: each octet is one piece of its group's octet block
/// (two quarter pieces for f16's [`PieceOrder::Quads`]), put back in column order.
#[allow(clippy::too_many_arguments)]
fn gather_grouped_row<'c>(
    b: Kb<'c, '_>,
    table: Value<'c, '_>,
    dtype: kiln_core::DType,
    order: PieceOrder,
    t: Value<'c, '_>,
    x: Value<'c, '_>,
    r: Value<'c, '_>,
    hidden: usize,
) {
    let rows = b.idx(GROUP_ROWS);
    let (group, row) = (b.divui(t, rows), b.remui(t, rows));
    // Element offsets in the table, as `offset` defines them: the group's start, then the row's
    // place in an octet block (`within(row, e)` is linear in `row` within each quarter of four
    // rows, so it is computed from `row / 4` and `row % 4`).
    let group_at = b.muli(group, b.idx(GROUP_ROWS * hidden));
    let (quarter, in_quarter) = (b.divui(row, b.idx(4)), b.remui(row, b.idx(4)));
    let row_at = b.addi(
        b.muli(quarter, b.idx(order.within(4, 0) - order.within(0, 0))),
        b.muli(in_quarter, b.idx(order.within(1, 0) - order.within(0, 0))),
    );
    let start = b.addi(group_at, row_at);
    let (lo, hi, one) = (b.idx(0), b.idx(hidden / OCTET), b.idx(1));
    b.for_each(lo, hi, one, |b, octet| {
        let at = b.addi(start, b.muli(octet, b.idx(GROUP_ROWS * OCTET)));
        let v = match order {
            PieceOrder::Pairs => load_at(b, table, dtype, hidden, at, OCTET),
            // Word `p` holds elements `p` and `4 + p`.
            PieceOrder::Widen => {
                let w = load_at(b, table, dtype, hidden, at, OCTET);
                b.shuffle(w, w, &[0, 2, 4, 6, 1, 3, 5, 7])
            }
            PieceOrder::Quads => {
                let second = b.addi(at, b.idx(order.within(0, 4) - order.within(0, 0)));
                b.concat(
                    load_at(b, table, dtype, hidden, at, 4),
                    load_at(b, table, dtype, hidden, second, 4),
                )
            }
        };
        b.store(v, x, &[r, b.muli(octet, b.idx(OCTET))]);
    });
}

/// `lanes` elements of `table` (passed as `[vocab, hidden]`) from element `at` of its layout,
/// `[at / hidden, at % hidden]`, widened.
fn load_at<'c, 'a>(
    b: Kb<'c, 'a>,
    table: Value<'c, '_>,
    dtype: kiln_core::DType,
    hidden: usize,
    at: Value<'c, '_>,
    lanes: usize,
) -> Value<'c, 'a> {
    let hid = b.idx(hidden);
    b.load_weight(table, &[b.divui(at, hid), b.remui(at, hid)], lanes, dtype)
}

/// `g = act(g) * u` over `rows * dim` contiguous values.
pub fn emit_gated_act<'c>(b: Kb<'c, '_>, kernel: &Kernel, p: &[Value<'c, '_>], d: Dyn<'c, '_>, max_lanes: usize) {
    let Kernel::GatedAct { act, dim, .. } = kernel else {
        unreachable!()
    };
    let (g, u) = (p[0], p[1]);
    let lanes = lanes_for(*dim, max_lanes);
    let total = b.muli(d.rows, b.idx(*dim));
    let (start, end) = thread_range(b, total, d, lanes);
    let step = b.idx(lanes);
    b.for_each(start, end, step, |b, i| gated_at(b, *act, g, u, &[i], lanes));
}

/// `x += y` over `rows * dim` contiguous values (Phi-2's parallel attention and MLP outputs
/// added to the residual).
pub fn emit_add<'c>(b: Kb<'c, '_>, kernel: &Kernel, p: &[Value<'c, '_>], d: Dyn<'c, '_>, max_lanes: usize) {
    let Kernel::Add { dim, .. } = kernel else {
        unreachable!()
    };
    let (x, y) = (p[0], p[1]);
    let lanes = lanes_for(*dim, max_lanes);
    let total = b.muli(d.rows, b.idx(*dim));
    let (start, end) = thread_range(b, total, d, lanes);
    b.for_each(start, end, b.idx(lanes), |b, i| {
        let v = b.addf(b.load_f32(x, &[i], lanes), b.load_f32(y, &[i], lanes));
        b.store(v, x, &[i]);
    });
}

/// `g[idx..+lanes] = act(g) * u` for one vector: the arithmetic of [`emit_gated_act`], shared
/// with the decode `gate_up` kernel so both regimes produce the same bits.
pub fn gated_at<'c>(b: Kb<'c, '_>, act: Act, g: Value<'c, '_>, u: Value<'c, '_>, idx: &[Value<'c, '_>], lanes: usize) {
    let gv = b.load_f32(g, idx, lanes);
    let uv = b.load_f32(u, idx, lanes);
    b.store(b.mulf(activate(b, act, gv), uv), g, idx);
}

/// `act(v)` as `transformers` computes it in f32 (see [`Act`]), for a scalar or a vector.
pub fn activate<'c, 'a>(b: Kb<'c, 'a>, act: Act, v: Value<'c, '_>) -> Value<'c, 'a> {
    let c = |x: f32| b.f32_like(v, x);
    match act {
        // torch: x / (1 + exp(-x)).
        Act::Silu => b.divf(v, b.addf(c(1.0), b.exp(b.negf(v)))),
        // torch's tanh GELU: 0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * x^3))).
        Act::GeluTanh => {
            let x3 = b.mulf(b.mulf(v, v), v);
            let inner = b.mulf(c(0.797_884_6), b.addf(v, b.mulf(c(0.044_715), x3)));
            b.mulf(b.mulf(c(0.5), v), b.addf(c(1.0), b.tanh(inner)))
        }
        // torch: 1 / (1 + exp(-x)).
        Act::Sigmoid => b.divf(c(1.0), b.addf(c(1.0), b.exp(b.negf(v)))),
        // torch's exact GELU: x * 0.5 * (1 + erf(x * sqrt(1/2))).
        Act::GeluErf => {
            let e = b.erf(b.mulf(v, c(std::f32::consts::FRAC_1_SQRT_2)));
            b.mulf(b.mulf(v, c(0.5)), b.addf(c(1.0), e))
        }
    }
}
