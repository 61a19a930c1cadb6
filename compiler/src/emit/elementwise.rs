//! Row-wise and elementwise kernels: embedding gather and `silu(gate) * up`.

use super::{Dyn, quant, thread_range};
use crate::ir::{Kb, lanes_for};
use kiln_core::Kernel;
use melior::ir::Value;

/// `x[r, :] = float(table[tokens[r], :])`. Token ids are clamped to the table so a bad id can
/// never read outside it (the runtime rejects such ids before calling).
pub fn emit_embed<'c>(b: Kb<'c, '_>, kernel: &Kernel, p: &[Value<'c, '_>], d: Dyn<'c, '_>, max_lanes: usize) {
    let Kernel::Embed {
        vocab, hidden, dtype, ..
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
        if dtype.is_quantized() {
            // The row's blocks, each dequantised into vectors in column order.
            let be = dtype.block_elems();
            let (lo, hi) = (b.idx(0), b.idx(hidden / be));
            b.for_each(lo, hi, one, |b, blk| {
                let c0 = b.muli(blk, b.idx(be));
                for (i, v) in quant::dequant_block(b, table, *dtype, t, blk, lanes)
                    .into_iter()
                    .enumerate()
                {
                    b.store(v, x, &[r, b.addi(c0, b.idx(i * lanes))]);
                }
            });
            return;
        }
        let (lo, hi, step) = (b.idx(0), b.idx(*hidden), b.idx(lanes));
        b.for_each(lo, hi, step, |b, c| {
            let v = b.load_weight(table, &[t, c], lanes, *dtype);
            b.store(v, x, &[r, c]);
        });
    });
}

/// `g = silu(g) * u` over `rows * dim` contiguous values, with `silu(v) = v / (1 + exp(-v))` as
/// torch computes it.
pub fn emit_silu_mul<'c>(b: Kb<'c, '_>, kernel: &Kernel, p: &[Value<'c, '_>], d: Dyn<'c, '_>, max_lanes: usize) {
    let Kernel::SiluMul { dim, .. } = kernel else {
        unreachable!()
    };
    let (g, u) = (p[0], p[1]);
    let lanes = lanes_for(*dim, max_lanes);
    let total = b.muli(d.rows, b.idx(*dim));
    let (start, end) = thread_range(b, total, d, lanes);
    let step = b.idx(lanes);
    let one_v = if lanes == 1 {
        b.f32c(1.0)
    } else {
        b.f32_splat(1.0, lanes)
    };
    b.for_each(start, end, step, |b, i| silu_mul_at(b, g, u, &[i], lanes, one_v));
}

/// `g[idx..+lanes] = silu(g) * u` for one vector: the arithmetic of [`emit_silu_mul`], shared
/// with the decode `gate_up` kernel so both regimes produce the same bits. `one` is 1.0 splat
/// to `lanes`.
pub fn silu_mul_at<'c>(
    b: Kb<'c, '_>,
    g: Value<'c, '_>,
    u: Value<'c, '_>,
    idx: &[Value<'c, '_>],
    lanes: usize,
    one: Value<'c, '_>,
) {
    let gv = b.load_f32(g, idx, lanes);
    let uv = b.load_f32(u, idx, lanes);
    let silu = b.divf(gv, b.addf(one, b.exp(b.negf(gv))));
    b.store(b.mulf(silu, uv), g, idx);
}
