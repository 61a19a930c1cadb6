//! Causal grouped-query attention over the KV cache, one (row, query head) pair per work item.
//!
//! Softmax is computed online in f32 (running maximum and rescaled sums, one pass over the
//! keys), so no scratch buffer proportional to the context is needed and each key and value row
//! is read once. The scale is `head_dim^-0.5` rounded to f32, applied to each dot product as the
//! reference does.

use super::{Dyn, max_index, thread_range};
use crate::ir::{Kb, lanes_for};
use kiln_spec::Kernel;
use melior::ir::Value;

pub fn emit_attention<'c>(b: Kb<'c, '_>, kernel: &Kernel, p: &[Value<'c, '_>], d: Dyn<'c, '_>, max_lanes: usize) {
    let Kernel::Attention {
        heads,
        kv_heads,
        head_dim,
        window,
        ..
    } = kernel
    else {
        unreachable!()
    };
    let (q, kc, vc, out) = (p[0], p[1], p[2], p[3]);
    let dim = *head_dim;
    let lanes = lanes_for(dim, max_lanes);
    let nvec = dim / lanes;
    let group = heads / kv_heads;
    let scale = (1.0f64 / (dim as f64).sqrt()) as f32;

    let total = b.muli(d.rows, b.idx(*heads));
    let (start, end) = thread_range(b, total, d, 1);
    let one = b.idx(1);
    b.for_each(start, end, one, |b, item| {
        let heads_c = b.idx(*heads);
        let r = b.divui(item, heads_c);
        let h = b.remui(item, heads_c);
        let qc0 = b.muli(h, b.idx(dim));
        let kc0 = b.muli(b.divui(h, b.idx(group)), b.idx(dim));
        let position = b.addi(d.pos, r);
        let last = b.addi(position, one);
        let first = match window {
            // Keys in (position - window, position]: `window` keys including this one.
            Some(w) => {
                let wc = b.idx(*w);
                let lower = max_index(b, last, wc);
                b.subi(lower, wc)
            }
            None => b.idx(0),
        };
        let qv: Vec<Value> = (0..nvec)
            .map(|i| b.load_f32(q, &[r, b.addi(qc0, b.idx(i * lanes))], lanes))
            .collect();
        let scale_c = b.f32c(scale);
        let mut inits = vec![b.f32c(f32::NEG_INFINITY), b.f32c(0.0)];
        inits.extend((0..nvec).map(|_| b.zero_like(lanes)));
        let state = b.for_range(first, last, one, &inits, |b, j, st| {
            let (m, l) = (st[0], st[1]);
            let mut dot = b.zero_like(lanes);
            for (i, &qi) in qv.iter().enumerate() {
                let kv = b.load_f32(kc, &[j, b.addi(kc0, b.idx(i * lanes))], lanes);
                dot = b.fma(qi, kv, dot);
            }
            let s = b.mulf(b.reduce_add(dot), scale_c);
            let m_new = b.maxf(m, s);
            let c_old = b.exp(b.subf(m, m_new));
            let c_new = b.exp(b.subf(s, m_new));
            let l_new = b.addf(b.mulf(l, c_old), c_new);
            let (c_old_v, c_new_v) = if lanes == 1 {
                (c_old, c_new)
            } else {
                (b.broadcast(c_old, lanes), b.broadcast(c_new, lanes))
            };
            let mut next = vec![m_new, l_new];
            for i in 0..nvec {
                let vv = b.load_f32(vc, &[j, b.addi(kc0, b.idx(i * lanes))], lanes);
                next.push(b.fma(c_new_v, vv, b.mulf(st[2 + i], c_old_v)));
            }
            next
        });
        let l = state[1];
        let inv_l = b.divf(b.f32c(1.0), l);
        let inv_v = if lanes == 1 { inv_l } else { b.broadcast(inv_l, lanes) };
        for i in 0..nvec {
            b.store(b.mulf(state[2 + i], inv_v), out, &[r, b.addi(qc0, b.idx(i * lanes))]);
        }
    });
}
