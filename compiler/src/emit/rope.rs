//! Per-row position work between the projections and attention: optional per-head norm of
//! q and k (Qwen3, Gemma 3), the rotary embedding of q and k in place, and the write of k and v
//! into the KV cache at the row's absolute position.
//!
//! The rotation follows the reference's convention: rotate-half pairs element `i` with
//! `i + dims/2` (Hugging Face, NeoX), GPT-J pairs `2i` with `2i + 1`; only the first `dims`
//! elements of a head rotate (partial rotary), the rest pass through. The angle
//! `pos * inv_freq[i]` is formed in f32 like the reference, cos and sin are scaled by the
//! attention factor when there is one, and `out = x * cos + rotate(x) * sin` is evaluated with
//! the same operations (no fused multiply-add), so positions match the reference to rounding
//! of `cos`/`sin`. A LongRoPE embedding reads the current call's sequence end and takes the long
//! frequencies when it passes the pretraining context, as `transformers` does per forward call.

use super::norm::{NormWeights, Row, normalize_row};
use super::{Dyn, thread_range};
use crate::ir::{Cmp, Kb, lanes_for};
use kiln_core::kernel::QkNorm;
use kiln_core::{Kernel, NormShape, Pairing, Rotary};
use melior::ir::Value;

/// Name of the module-private table of inverse frequencies.
pub const INV_FREQ: &str = "kiln_inv_freq";
/// Name of the module-private table of LongRoPE's long-context inverse frequencies.
pub const INV_FREQ_LONG: &str = "kiln_inv_freq_long";

pub fn emit_rope_kv<'c>(b: Kb<'c, '_>, kernel: &Kernel, p: &[Value<'c, '_>], d: Dyn<'c, '_>, max_lanes: usize) {
    let Kernel::RopeKv {
        heads,
        kv_heads,
        head_dim,
        qk_norm,
        rotary,
        ctx,
        kv,
        ..
    } = kernel
    else {
        unreachable!()
    };
    let (q, k, v, kc, vc) = (p[0], p[1], p[2], p[3], p[4]);
    let norms = qk_norm.as_ref().map(|n| (n, p[5], p[6]));
    let row_info = p[5 + 2 * qk_norm.is_some() as usize];
    let angles = rotary.as_ref().map(|r| Angles::new(b, r));

    let per_row = heads + kv_heads;
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
            let place = super::row_place(b, row_info, r);
            let position = place.position;
            // cos and sin of this row's angles, computed once per row and thread rather than
            // once per head (scalar `cos`/`sin` calls were most of this kernel's time).
            let trig = angles.as_ref().map(|a| a.trig(b, position, place.seq_end));
            let row0 = b.muli(r, per_row_c);
            let h_lo = b.subi(super::max_index(b, start, row0), row0);
            let h_hi = b.subi(b.minui(end, b.addi(row0, per_row_c)), row0);
            b.for_each(h_lo, h_hi, one, |b, h| {
                let is_q = b.cmpi(Cmp::Ult, h, b.idx(*heads));
                // A query head.
                b.if_then(is_q, |b| {
                    let c0 = b.muli(h, b.idx(*head_dim));
                    if let Some((n, qn, _)) = norms {
                        head_norm(b, q, r, c0, n, qn, n.q_dtype, *head_dim, max_lanes);
                    }
                    if let Some(t) = trig {
                        rotate(b, q, r, c0, t, max_lanes);
                    }
                });
                // A key/value head: norm and rotate k, then store k and v rows into the caches.
                let is_kv = b.cmpi(Cmp::Uge, h, b.idx(*heads));
                b.if_then(is_kv, |b| {
                    let c0 = b.muli(b.subi(h, b.idx(*heads)), b.idx(*head_dim));
                    if let Some((n, _, kn)) = norms {
                        head_norm(b, k, r, c0, n, kn, n.k_dtype, *head_dim, max_lanes);
                    }
                    if let Some(t) = trig {
                        rotate(b, k, r, c0, t, max_lanes);
                    }
                    let lanes = lanes_for(*head_dim, max_lanes);
                    let (lo, hi, step) = (b.idx(0), b.idx(*head_dim), b.idx(lanes));
                    // Cache row of this slot, head and position (slot-major, head-major caches).
                    let kvh = b.subi(h, b.idx(*heads));
                    let slot_head = b.addi(b.muli(place.slot, b.idx(*kv_heads)), kvh);
                    let cache_row = b.addi(b.muli(slot_head, b.idx(*ctx)), position);
                    b.for_each(lo, hi, step, |b, i| {
                        let c = b.addi(c0, i);
                        b.store_as(b.load_f32(k, &[r, c], lanes), lanes, *kv, kc, &[cache_row, i]);
                        b.store_as(b.load_f32(v, &[r, c], lanes), lanes, *kv, vc, &[cache_row, i]);
                    });
                });
            });
        });
    });
}

/// The frequency tables of a rotary embedding and this thread's cos/sin buffers.
struct Angles<'c, 'a> {
    rotary: &'a Rotary,
    table: Value<'c, 'a>,
    /// LongRoPE: the long table.
    long: Option<Value<'c, 'a>>,
    cos: Value<'c, 'a>,
    sin: Value<'c, 'a>,
}

impl<'c, 'a> Angles<'c, 'a> {
    fn new(b: Kb<'c, 'a>, rotary: &'a Rotary) -> Angles<'c, 'a> {
        let half = rotary.dims / 2;
        let get = |name: &str| {
            let ty = b.ty(&format!("memref<{half}xf32>"));
            b.op(
                "memref.get_global",
                &[],
                &[ty],
                &[("name", b.attr(&format!("@{name}")))],
            )[0]
        };
        let long = rotary.long.as_ref().map(|_| get(INV_FREQ_LONG));
        let trig_ty = format!("memref<{half}xf32>");
        Angles {
            rotary,
            table: get(INV_FREQ),
            long,
            cos: b.alloca(&trig_ty),
            sin: b.alloca(&trig_ty),
        }
    }

    /// Fills the cos/sin buffers for `position` (in a sequence whose current forward call
    /// ends at `seq_end`, which picks LongRoPE's table) and returns them.
    fn trig<'x>(&self, b: Kb<'c, 'x>, position: Value<'c, '_>, seq_end: Value<'c, '_>) -> Trig<'c, 'a> {
        let half = self.rotary.dims / 2;
        let pos_f = b.index_to_f32(position);
        let long = self.long.map(|table| {
            let original = self.rotary.long.as_ref().map_or(0, |l| l.original);
            (table, b.cmpi(Cmp::Ugt, seq_end, b.idx(original)))
        });
        let (lo, hi, one) = (b.idx(0), b.idx(half), b.idx(1));
        b.for_each(lo, hi, one, |b, i| {
            let mut inv = b.load_f32(self.table, &[i], 1);
            if let Some((long, use_long)) = long {
                inv = b.select(use_long, b.load_f32(long, &[i], 1), inv);
            }
            let angle = b.mulf(pos_f, inv);
            let (mut cos, mut sin) = (b.cos(angle), b.sin(angle));
            if let Some(m) = self.rotary.mscale {
                cos = b.mulf(cos, b.f32c(m.get()));
                sin = b.mulf(sin, b.f32c(m.get()));
            }
            b.store(cos, self.cos, &[i]);
            b.store(sin, self.sin, &[i]);
        });
        Trig {
            cos: self.cos,
            sin: self.sin,
            half,
            pairing: self.rotary.pairing,
        }
    }
}

/// The cos and sin of one row's angles, `half` of each.
#[derive(Clone, Copy)]
struct Trig<'c, 'a> {
    cos: Value<'c, 'a>,
    sin: Value<'c, 'a>,
    half: usize,
    pairing: Pairing,
}

/// The q/k norm of one head, in place.
#[allow(clippy::too_many_arguments)]
fn head_norm<'c>(
    b: Kb<'c, '_>,
    x: Value<'c, '_>,
    r: Value<'c, '_>,
    c0: Value<'c, '_>,
    n: &QkNorm,
    w: Value<'c, '_>,
    wdtype: kiln_core::DType,
    dim: usize,
    max_lanes: usize,
) {
    let shape = NormShape {
        kind: n.kind,
        eps: n.eps,
        wdtype,
        bias: None,
    };
    let row = Row { mem: x, r, c0 };
    normalize_row(
        b,
        &shape,
        NormWeights { w, bias: None },
        row,
        row,
        dim,
        max_lanes,
        false,
    );
}

/// Rotates the pairs of the head at column `c0` of row `r` by the row's angles: for
/// rotate-half pairs `(c0 + i, c0 + i + half)` a vector of pairs at a time (the same
/// multiplies and adds, lane by lane, as one pair at a time), for GPT-J pairs
/// `(c0 + 2i, c0 + 2i + 1)` one pair at a time.
fn rotate<'c>(b: Kb<'c, '_>, x: Value<'c, '_>, r: Value<'c, '_>, c0: Value<'c, '_>, t: Trig<'c, '_>, max_lanes: usize) {
    if t.pairing == Pairing::Adjacent {
        let (lo, hi, one) = (b.idx(0), b.idx(t.half), b.idx(1));
        b.for_each(lo, hi, one, |b, i| {
            let cos = b.load_f32(t.cos, &[i], 1);
            let sin = b.load_f32(t.sin, &[i], 1);
            let c1 = b.addi(c0, b.muli(i, b.idx(2)));
            let c2 = b.addi(c1, b.idx(1));
            let x1 = b.load_f32(x, &[r, c1], 1);
            let x2 = b.load_f32(x, &[r, c2], 1);
            b.store(b.subf(b.mulf(x1, cos), b.mulf(x2, sin)), x, &[r, c1]);
            b.store(b.addf(b.mulf(x2, cos), b.mulf(x1, sin)), x, &[r, c2]);
        });
        return;
    }
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
