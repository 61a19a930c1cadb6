//! Per-row position work between the projections and attention: optional per-head RMSNorm of
//! q and k (Qwen3), rotary embedding of q and k in place, and the write of k and v into the KV
//! cache at the row's absolute position.
//!
//! The rotation follows Hugging Face's rotate-half convention: element `i` pairs with
//! `i + head_dim/2`, angle `pos * inv_freq[i]` formed in f32 like the reference, and
//! `out = x * cos + rotate_half(x) * sin` evaluated with the same operations (no fused multiply-
//! add), so positions match the reference to rounding of `cos`/`sin`.

use super::norm::{inv_rms, scale_row};
use super::{Dyn, thread_range};
use crate::ir::{Cmp, Kb, lanes_for};
use kiln_core::{DType, Kernel};
use melior::ir::Value;

/// Name of the module-private table of inverse frequencies.
pub const INV_FREQ: &str = "kiln_inv_freq";

pub fn emit_rope_kv<'c>(b: Kb<'c, '_>, kernel: &Kernel, p: &[Value<'c, '_>], d: Dyn<'c, '_>, max_lanes: usize) {
    let Kernel::RopeKv {
        heads,
        kv_heads,
        head_dim,
        qk_norm,
        inv_freq,
        ctx,
        ..
    } = kernel
    else {
        unreachable!()
    };
    let (q, k, v, kc, vc) = (p[0], p[1], p[2], p[3], p[4]);
    let norms = qk_norm
        .as_ref()
        .map(|n| (p[5], n.q_dtype, p[6], n.k_dtype, n.eps.get()));
    let half = head_dim / 2;
    let table_ty = b.ty(&format!("memref<{}xf32>", inv_freq.len()));
    let table = b.op(
        "memref.get_global",
        &[],
        &[table_ty],
        &[("name", b.attr(&format!("@{INV_FREQ}")))],
    )[0];

    let per_row = heads + kv_heads;
    // cos and sin of this row's angles, computed once per row and thread rather than once per
    // head (scalar `cos`/`sin` calls were most of this kernel's time).
    let trig_ty = format!("memref<{half}xf32>");
    let cos_buf = b.alloca(&trig_ty);
    let sin_buf = b.alloca(&trig_ty);
    let total = b.muli(d.rows, b.idx(per_row));
    let (start, end) = thread_range(b, total, d, 1);
    let one = b.idx(1);
    let per_row_c = b.idx(per_row);
    // The rows this thread's items touch: start / per_row ..= (end - 1) / per_row.
    let has_items = b.cmpi(Cmp::Ult, start, end);
    b.if_then(has_items, |b| {
        let r0 = b.divui(start, per_row_c);
        let r1 = b.addi(b.divui(b.subi(end, one), per_row_c), one);
        b.for_each(r0, r1, one, |b, r| {
            let position = b.addi(d.pos, r);
            let pos_f = b.index_to_f32(position);
            let (lo, hi) = (b.idx(0), b.idx(half));
            b.for_each(lo, hi, one, |b, i| {
                let angle = b.mulf(pos_f, b.load_f32(table, &[i], 1));
                b.store(b.cos(angle), cos_buf, &[i]);
                b.store(b.sin(angle), sin_buf, &[i]);
            });
            let row0 = b.muli(r, per_row_c);
            let h_lo = b.subi(super::max_index(b, start, row0), row0);
            let h_hi = b.subi(b.minui(end, b.addi(row0, per_row_c)), row0);
            b.for_each(h_lo, h_hi, one, |b, h| {
                let trig = Trig {
                    cos: cos_buf,
                    sin: sin_buf,
                    half,
                };
                let is_q = b.cmpi(Cmp::Ult, h, b.idx(*heads));
                // A query head.
                b.if_then(is_q, |b| {
                    let c0 = b.muli(h, b.idx(*head_dim));
                    if let Some((qn, qdt, _, _, eps)) = norms {
                        head_norm(b, q, r, c0, qn, qdt, eps, *head_dim, max_lanes);
                    }
                    rotate(b, q, r, c0, trig, max_lanes);
                });
                // A key/value head: rotate k, then store k and v rows into the caches.
                let is_kv = b.cmpi(Cmp::Uge, h, b.idx(*heads));
                b.if_then(is_kv, |b| {
                    let c0 = b.muli(b.subi(h, b.idx(*heads)), b.idx(*head_dim));
                    if let Some((_, _, kn, kdt, eps)) = norms {
                        head_norm(b, k, r, c0, kn, kdt, eps, *head_dim, max_lanes);
                    }
                    rotate(b, k, r, c0, trig, max_lanes);
                    let lanes = lanes_for(*head_dim, max_lanes);
                    let (lo, hi, step) = (b.idx(0), b.idx(*head_dim), b.idx(lanes));
                    // Cache row of this head and position (head-major caches).
                    let kvh = b.subi(h, b.idx(*heads));
                    let cache_row = b.addi(b.muli(kvh, b.idx(*ctx)), position);
                    b.for_each(lo, hi, step, |b, i| {
                        let c = b.addi(c0, i);
                        b.store(b.load_f32(k, &[r, c], lanes), kc, &[cache_row, i]);
                        b.store(b.load_f32(v, &[r, c], lanes), vc, &[cache_row, i]);
                    });
                });
            });
        });
    });
}

/// The cos and sin of one row's angles, `half` of each.
#[derive(Clone, Copy)]
struct Trig<'c, 'a> {
    cos: Value<'c, 'a>,
    sin: Value<'c, 'a>,
    half: usize,
}

/// RMSNorm of one head in place.
#[allow(clippy::too_many_arguments)]
fn head_norm<'c>(
    b: Kb<'c, '_>,
    x: Value<'c, '_>,
    r: Value<'c, '_>,
    c0: Value<'c, '_>,
    w: Value<'c, '_>,
    wdtype: DType,
    eps: f32,
    dim: usize,
    max_lanes: usize,
) {
    let inv = inv_rms(b, x, r, c0, dim, eps, max_lanes);
    scale_row(b, x, r, c0, w, wdtype, inv, x, r, c0, dim, max_lanes);
}

/// Rotates the pairs `(c0 + i, c0 + i + half)` of row `r` by the row's angles, a vector of
/// pairs at a time (the same multiplies and adds, lane by lane, as one pair at a time).
fn rotate<'c>(b: Kb<'c, '_>, x: Value<'c, '_>, r: Value<'c, '_>, c0: Value<'c, '_>, t: Trig<'c, '_>, max_lanes: usize) {
    let lanes = lanes_for(t.half, max_lanes);
    let (lo, hi, step) = (b.idx(0), b.idx(t.half), b.idx(lanes));
    b.for_each(lo, hi, step, |b, i| {
        let cos = b.load_f32(t.cos, &[i], lanes);
        let sin = b.load_f32(t.sin, &[i], lanes);
        let c1 = b.addi(c0, i);
        let c2 = b.addi(c1, b.idx(t.half));
        let x1 = b.load_f32(x, &[r, c1], lanes);
        let x2 = b.load_f32(x, &[r, c2], lanes);
        b.store(b.subf(b.mulf(x1, cos), b.mulf(x2, sin)), x, &[r, c1]);
        b.store(b.addf(b.mulf(x2, cos), b.mulf(x1, sin)), x, &[r, c2]);
    });
}
