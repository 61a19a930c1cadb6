//! Causal grouped-query attention over the KV cache, one (row, run of query heads sharing a KV
//! head) per work item, or one (tile of rows, KV head) ([`tiles`]).
//!
//! Keys are taken a block of `lanes` positions at a time (flash-decoding style): the block's
//! dot products are computed as independent FMA chains and summed into one vector of scores by
//! a single shuffle tree, the softmax state (running maximum and sum) is updated once per
//! block with a vector exp, and the values are accumulated with the block's weights. So the
//! per-key work is a few vector operations with no serial scalar chain (one pass over the keys
//! with the running state updated per key was ~150 cycles per key and head), no scratch
//! proportional to the context is needed, and each key and value row is read once. The scale
//! (`head_dim^-0.5`, or Gemma's `query_pre_attn_scalar^-0.5`, rounded to f32) is applied to each
//! dot product as the reference does, then the soft cap when the model has one.
//! Decode and prefill run this same code per (row, head), so they agree bit for bit; heads that
//! share a KV head are attended together a block of keys at a time when there are enough rows
//! (each head keeping its own state and instructions), so the block is read from L2 once.
//! Where the registers allow, each head keeps two softmax states, one for the even and one for
//! the odd blocks, merged at the end (`blocked`): the loop-carried chain (maximum, `exp`,
//! rescaled accumulators) becomes two chains of half the length. At a 4000-token prompt on the
//! Qwen2.5-0.5B shape (2-core Zen 5, f16 cache) attention went from 2.11 to 1.80 ms per prompt
//! token in prefill and from 5.66 to 5.21 ms per decoded token (`KILN_PROFILE`).
//! Without a sliding window, calls with a tile of rows for every thread take the same per-head
//! steps in tiles ([`tiles`]), so a chunk of keys is read once per tile, not once per row
//! and query head.

mod tiles;

use super::{Dyn, max_index, thread_range};
use crate::ir::{Cmp, Kb, lanes_for};
use kiln_core::{DType, Kernel};
use melior::ir::Value;

/// Row `r`'s first cache row of KV head `kv_head` (of its own slot, in the slot-major,
/// head-major caches: `(slot * kv_heads + kv_head) * ctx`) and the end of its keys.
fn cache_rows<'c, 'b>(
    b: Kb<'c, 'b>,
    row_info: Value<'c, '_>,
    kv_heads: usize,
    ctx: usize,
    kv_head: Value<'c, '_>,
    r: Value<'c, '_>,
) -> (Value<'c, 'b>, Value<'c, 'b>) {
    let place = super::row_place(b, row_info, r);
    let kv = b.addi(b.muli(place.slot, b.idx(kv_heads)), kv_head);
    (b.muli(kv, b.idx(ctx)), b.addi(place.position, b.idx(1)))
}

pub fn emit_attention<'c>(b: Kb<'c, '_>, kernel: &Kernel, p: &[Value<'c, '_>], d: Dyn<'c, '_>, max_lanes: usize) {
    let Kernel::Attention {
        heads,
        kv_heads,
        head_dim,
        window,
        scale,
        softcap,
        ctx,
        kv,
        ..
    } = kernel
    else {
        unreachable!()
    };
    let (q, kc, vc, out, row_info) = (p[0], p[1], p[2], p[3], p[4]);
    let dim = *head_dim;
    let lanes = lanes_for(dim, max_lanes);
    let group = heads / kv_heads;
    let nvec = dim / lanes;
    let together = heads_together(group, lanes, nvec);
    let a = Attn {
        kc,
        vc,
        kv: *kv,
        lanes,
        nvec,
        scale: scale.get(),
        softcap: softcap.map(|c| c.get()),
        grouped: together,
    };

    // Work items are (row, run of `together` query heads of one KV head).
    let items = |b: Kb<'c, '_>, together: usize| {
        let runs = heads / together;
        let total = b.muli(d.rows, b.idx(runs));
        let (start, end) = thread_range(b, total, d, 1);
        let one = b.idx(1);
        b.for_each(start, end, one, |b, item| {
            let runs_c = b.idx(runs);
            let r = b.divui(item, runs_c);
            let h0 = b.muli(b.remui(item, runs_c), b.idx(together));
            let (kv_base, last) = cache_rows(b, row_info, *kv_heads, *ctx, b.divui(h0, b.idx(group)), r);
            let first = match window {
                // Keys in (position - window, position]: `window` keys including this one.
                Some(w) => {
                    let wc = b.idx(*w);
                    let lower = max_index(b, last, wc);
                    b.subi(lower, wc)
                }
                None => b.idx(0),
            };
            let qvs: Vec<Vec<Value>> = (0..together).map(|t| a.query(b, q, r, b.addi(h0, b.idx(t)))).collect();
            let states = if lanes >= 4 {
                a.blocked(b, &qvs, kv_base, first, last)
            } else {
                qvs.iter().map(|qv| a.per_key(b, qv, kv_base, first, last)).collect()
            };
            for (t, state) in states.into_iter().enumerate() {
                a.write_out(b, out, r, b.addi(h0, b.idx(t)), state);
            }
        });
    };
    let per_row = |b: Kb<'c, '_>| {
        if together == 1 {
            return items(b, 1);
        }
        // Grouped heads make fewer, longer items: with few rows (one-row decode) the threads
        // would get unequal shares, so those calls keep one head per item.
        let enough = b.cmpi(
            Cmp::Uge,
            b.muli(d.rows, b.idx(heads / together)),
            b.muli(d.nth, b.idx(4)),
        );
        b.if_then(enough, |b| items(b, together));
        let few = b.cmpi(
            Cmp::Ult,
            b.muli(d.rows, b.idx(heads / together)),
            b.muli(d.nth, b.idx(4)),
        );
        b.if_then(few, |b| items(b, 1));
    };
    if window.is_some() || lanes < 4 {
        return per_row(b);
    }
    // Calls with a tile for every thread attend in tiles of rows.
    let tiles = b.ceildivui(d.rows, b.idx(tiles::TILE_ROWS));
    let tiled = b.cmpi(Cmp::Uge, b.muli(tiles, b.idx(*kv_heads)), d.nth);
    let t = tiles::Tiled {
        q,
        out,
        row_info,
        heads: *heads,
        kv_heads: *kv_heads,
        ctx: *ctx,
    };
    b.if_then(tiled, |b| a.tiled_items(b, &t, d));
    let untiled = b.cmpi(Cmp::Ult, b.muli(tiles, b.idx(*kv_heads)), d.nth);
    b.if_then(untiled, per_row);
}

/// Query heads of one KV head that one work item attends together, a block of keys at a time:
/// the block's keys and values come from L2 (or memory) once and from L1 for the other heads
/// (the heads of a group were separate items, each streaming its KV head's cache from L2).
/// Each head keeps its own softmax state, so the largest divisor of the group (at most 4) whose
/// value accumulators fill at most half the register file: more spilled them every block of
/// keys. Measured at 2 threads on a Zen 4: the Qwen3.5-0.8B shape's 256-wide heads (4 -> 1
/// head, AVX-512) 0.92 -> 0.75 ms of attention per prompt token at 2048 tokens, TinyLlama's
/// 64-wide heads in AVX2 code (2 -> 1) 2.1 -> 1.7 ms at 1024.
fn heads_together(group: usize, lanes: usize, nvec: usize) -> usize {
    // Half the register file holds the heads' value accumulators.
    let regs = if lanes >= 16 { 32 } else { 16 };
    let most = (regs / 2 / nvec).clamp(1, 4);
    (1..=most.min(group))
        .rev()
        .find(|t| group.is_multiple_of(*t))
        .unwrap_or(1)
}

struct Attn<'c, 'a> {
    /// The key and value caches as flat views (`kv_base + position` is a row of `head_dim`).
    kc: Value<'c, 'a>,
    vc: Value<'c, 'a>,
    /// How the caches store keys and values (widened to f32 as they are loaded).
    kv: DType,
    lanes: usize,
    nvec: usize,
    scale: f32,
    softcap: Option<f32>,
    /// Heads per item where rows allow grouping: every item, grouped or not, shapes each
    /// head's softmax states as such an item does, so a head computes the same bits whatever
    /// the rows beside it (one-row decode takes one head per item, prefill groups them).
    grouped: usize,
}

/// How `blocked` lays out its loop-carried values: `streams` softmax states per head, each
/// `per_state` values (maximum, sum, `sets` interleaved sets of value accumulators).
#[derive(Clone, Copy)]
struct Layout {
    streams: usize,
    sets: usize,
    per_state: usize,
}

/// The softmax state after some keys: the running sum of the weights and the weighted values.
type State<'c, 'b> = (Value<'c, 'b>, Vec<Value<'c, 'b>>);

impl<'c, 'a> Attn<'c, 'a> {
    /// A scaled score, soft-capped (`cap * tanh(s / cap)`, Gemma 2) when the kernel says so.
    fn score<'b>(&self, b: Kb<'c, 'b>, s: Value<'c, 'b>) -> Value<'c, 'b> {
        match self.softcap {
            Some(cap) => {
                let c = b.f32_like(s, cap);
                b.mulf(b.tanh(b.divf(s, c)), c)
            }
            None => s,
        }
    }

    /// How every head's softmax states are laid out in this kernel (the same for every item,
    /// grouped or not, tiled or not).
    fn layout(&self) -> Layout {
        let streams = self.streams(self.grouped);
        // Two interleaved sets of value accumulators when the head is short and one stream
        // carries it, so the chains of FMAs into them are twice as many and half as long.
        let sets = if self.nvec < 8 && streams == 1 { 2 } else { 1 };
        Layout {
            streams,
            sets,
            per_state: 2 + sets * self.nvec,
        }
    }

    /// The states of `heads` heads before any key: maximum -inf, sum 0, values 0.
    fn initial_states<'b>(&self, b: Kb<'c, 'b>, heads: usize, lay: Layout) -> Vec<Value<'c, 'b>> {
        let mut inits = Vec::with_capacity(heads * lay.streams * lay.per_state);
        for _ in 0..heads * lay.streams {
            inits.extend([b.f32c(f32::NEG_INFINITY), b.f32c(0.0)]);
            inits.extend((0..lay.sets * self.nvec).map(|_| b.zero_like(self.lanes)));
        }
        inits
    }

    /// Where the main loop over keys `first..last` ends: after the last whole unit (a pair of
    /// blocks with two streams, one block with one).
    fn units_end<'b>(&self, b: Kb<'c, 'b>, first: Value<'c, '_>, last: Value<'c, '_>, lay: Layout) -> Value<'c, 'b> {
        let unit = b.idx(lay.streams * self.lanes);
        b.addi(first, b.muli(b.divui(b.subi(last, first), unit), unit))
    }

    /// The main loop over whole units from `from` to `to` (a multiple of the unit apart): with
    /// two streams, a unit's even block goes to the first state and its odd block to the
    /// second.
    #[allow(clippy::too_many_arguments)]
    fn units<'b>(
        &self,
        b: Kb<'c, 'b>,
        qvs: &[Vec<Value<'c, '_>>],
        kv_base: Value<'c, '_>,
        from: Value<'c, '_>,
        to: Value<'c, '_>,
        st: &[Value<'c, '_>],
        lay: Layout,
    ) -> Vec<Value<'c, 'b>> {
        let bl = b.idx(self.lanes);
        if lay.streams == 2 {
            b.for_range(from, to, b.idx(2 * self.lanes), st, |b, base, st| {
                self.step(b, qvs, kv_base, &[(0, base), (1, b.addi(base, bl))], None, st, lay)
            })
        } else {
            b.for_range(from, to, bl, st, |b, base, st| {
                self.step(b, qvs, kv_base, &[(0, base)], None, st, lay)
            })
        }
    }

    /// Keys `first..last` in blocks of `lanes` positions for each head of `qvs`; the last block
    /// is masked. Each head keeps `streams` softmax states: with two, even blocks go to one and
    /// odd blocks to the other, merged at the end, so the loop-carried chain (running maximum,
    /// its `exp`, the rescaled value accumulators) is two independent chains of half the
    /// length. Which state takes which block depends only on `first` and `last`, so decode and
    /// prefill still compute every output the same way.
    fn blocked<'b>(
        &self,
        b: Kb<'c, 'b>,
        qvs: &[Vec<Value<'c, '_>>],
        kv_base: Value<'c, '_>,
        first: Value<'c, '_>,
        last: Value<'c, '_>,
    ) -> Vec<State<'c, 'b>> {
        let lay = self.layout();
        let inits = self.initial_states(b, qvs.len(), lay);
        let units_end = self.units_end(b, first, last, lay);
        let st = self.units(b, qvs, kv_base, first, units_end, &inits, lay);
        self.finish(b, qvs, kv_base, units_end, last, st, lay)
    }

    /// The keys after the whole units (`units_end..last`): with two streams an odd full block
    /// to the first state, then the masked remainder to the last; the states merged.
    #[allow(clippy::too_many_arguments)]
    fn finish<'b>(
        &self,
        b: Kb<'c, 'b>,
        qvs: &[Vec<Value<'c, '_>>],
        kv_base: Value<'c, '_>,
        units_end: Value<'c, '_>,
        last: Value<'c, '_>,
        st: Vec<Value<'c, 'b>>,
        lay: Layout,
    ) -> Vec<State<'c, 'b>> {
        let (lanes, streams, sets, per_state) = (self.lanes, lay.streams, lay.sets, lay.per_state);
        let bl = b.idx(lanes);
        let full_end = b.addi(units_end, b.muli(b.divui(b.subi(last, units_end), bl), bl));
        let st = if streams == 2 {
            // An odd full block (runs 0 or 1 times) to the first state.
            b.for_range(units_end, full_end, bl, &st, |b, base, st| {
                self.step(b, qvs, kv_base, &[(0, base)], None, st, lay)
            })
        } else {
            st
        };
        // The remainder: one more block, masked to the keys before `last` (runs 0 or 1 times),
        // to the last state.
        let st = b.for_range(full_end, last, bl, &st, |b, base, st| {
            self.step(b, qvs, kv_base, &[(streams - 1, base)], Some(last), st, lay)
        });
        st.chunks(streams * per_state)
            .map(|head| {
                let state = |k: usize| {
                    let st = &head[k * per_state..(k + 1) * per_state];
                    let acc: Vec<Value> = (0..self.nvec)
                        .map(|i| (1..sets).fold(st[2 + i], |s, j| b.addf(s, st[2 + j * self.nvec + i])))
                        .collect();
                    (st[0], st[1], acc)
                };
                let (m0, l0, acc0) = state(0);
                if streams == 1 {
                    return (l0, acc0);
                }
                // Both states rescaled to the larger maximum (a state that saw no key has
                // maximum -inf, sum 0 and values 0, and adds nothing).
                let (m1, l1, acc1) = state(1);
                let m = b.maxf(m0, m1);
                let (c0, c1) = (b.exp(b.subf(m0, m)), b.exp(b.subf(m1, m)));
                let l = b.addf(b.mulf(l0, c0), b.mulf(l1, c1));
                let (v0, v1) = (b.broadcast(c0, lanes), b.broadcast(c1, lanes));
                let acc = acc0
                    .iter()
                    .zip(&acc1)
                    .map(|(&a0, &a1)| b.fma(a1, v1, b.mulf(a0, v0)))
                    .collect();
                (l, acc)
            })
            .collect()
    }

    /// The query vectors of row `r`, head `head`.
    fn query<'b>(&self, b: Kb<'c, 'b>, q: Value<'c, '_>, r: Value<'c, '_>, head: Value<'c, '_>) -> Vec<Value<'c, 'b>> {
        let q0 = b.muli(head, b.idx(self.nvec * self.lanes));
        (0..self.nvec)
            .map(|i| b.load_f32(q, &[r, b.addi(q0, b.idx(i * self.lanes))], self.lanes))
            .collect()
    }

    /// Writes head `head`'s output of row `r`: its weighted values over the sum of weights.
    fn write_out<'b>(
        &self,
        b: Kb<'c, 'b>,
        out: Value<'c, '_>,
        r: Value<'c, '_>,
        head: Value<'c, '_>,
        state: State<'c, 'b>,
    ) {
        let (l, acc) = state;
        let lanes = self.lanes;
        let qc0 = b.muli(head, b.idx(self.nvec * lanes));
        let inv_l = b.divf(b.f32c(1.0), l);
        let inv_v = if lanes == 1 { inv_l } else { b.broadcast(inv_l, lanes) };
        for (i, &acc) in acc.iter().enumerate() {
            b.store(b.mulf(acc, inv_v), out, &[r, b.addi(qc0, b.idx(i * lanes))]);
        }
    }

    /// One step over key blocks: each `(stream, base)` of `at` folds the block of keys at
    /// `base` into that stream's state of every head (states laid out head by head, each
    /// head's streams together); the other states pass through. The heads take each block
    /// together ([`Attn::block`]).
    #[allow(clippy::too_many_arguments)]
    fn step<'b>(
        &self,
        b: Kb<'c, 'b>,
        qvs: &[Vec<Value<'c, '_>>],
        kv_base: Value<'c, '_>,
        at: &[(usize, Value<'c, '_>)],
        limit: Option<Value<'c, '_>>,
        st: Vec<Value<'c, 'b>>,
        lay: Layout,
    ) -> Vec<Value<'c, 'b>> {
        let mut next = st.clone();
        let qs: Vec<&[Value]> = qvs.iter().map(|q| &q[..]).collect();
        for &(stream, base) in at {
            let at_head = |h: usize| (h * lay.streams + stream) * lay.per_state;
            let mine: Vec<Vec<Value>> = (0..qvs.len())
                .map(|h| st[at_head(h)..at_head(h) + lay.per_state].to_vec())
                .collect();
            let done = self.block(b, &qs, kv_base, base, limit, mine, lay.sets);
            for (h, d) in done.into_iter().enumerate() {
                next.splice(at_head(h)..at_head(h) + lay.per_state, d);
            }
        }
        next
    }

    /// Softmax states per head: two (even and odd key blocks) while the states of all heads
    /// of an item fit in the registers beside the query vectors, else one.
    fn streams(&self, heads: usize) -> usize {
        let regs = if self.lanes >= 16 { 32 } else { 16 };
        let per_head = 2 * self.nvec /* two states' accumulators */ + self.nvec /* query */;
        if heads * per_head + 6 <= regs { 2 } else { 1 }
    }

    /// One block of `lanes` keys from `base` for each head of `qvs` (`sts`: each head's
    /// state); with `limit`, keys at or after it are masked out (their rows are clamped to
    /// `limit - 1` so every load stays in the cache). The heads' instructions interleave key by
    /// key: each key and value vector is loaded once and used at once by every head, and each
    /// head's scores are folded as they come ([`Kb::fold_next`]). Emitted head after head, the
    /// loads the heads share were merged into one value live across the whole block, and the
    /// register allocator spilled them to the stack and read them back (a store and a reload
    /// per vector). Each head's own operations, and so its bits, are the same either way (the
    /// residual streams of `kiln debug` matched bit for bit before and after). On a 2-core
    /// Zen 5 EPYC, 2 threads, Qwen2.5-0.5B shape, 4000-token prompt, f16 cache
    /// (`KILN_PROFILE`, two runs each): attention 1.07-1.09 -> 0.96 ms per prompt token and
    /// 4.11-4.13 -> 3.70-3.77 ms per decoded token; prefill 370-375 -> 389 tok/s.
    #[allow(clippy::too_many_arguments)]
    fn block<'b>(
        &self,
        b: Kb<'c, 'b>,
        qvs: &[&[Value<'c, '_>]],
        kv_base: Value<'c, '_>,
        base: Value<'c, '_>,
        limit: Option<Value<'c, '_>>,
        sts: Vec<Vec<Value<'c, 'b>>>,
        sets: usize,
    ) -> Vec<Vec<Value<'c, 'b>>> {
        let lanes = self.lanes;
        let dim = self.nvec * lanes;
        // Where each key's row starts in the flat caches. Unmasked, the block's rows are one
        // run: one start and constant offsets (per-row index arithmetic had LLVM keep a
        // pointer per key, spilled, about a fifth of the loop's instructions).
        let starts: Vec<Value> = match limit {
            None => {
                let first = b.muli(b.addi(kv_base, base), b.idx(dim));
                (0..lanes).map(|j| b.addi(first, b.idx(j * dim))).collect()
            }
            Some(lim) => (0..lanes)
                .map(|j| {
                    let pos = b.minui(b.addi(base, b.idx(j)), b.subi(lim, b.idx(1)));
                    b.muli(b.addi(kv_base, pos), b.idx(dim))
                })
                .collect(),
        };
        let load = |cache: Value<'c, '_>, start: Value<'c, '_>| -> Vec<Value<'c, 'b>> {
            (0..self.nvec)
                .map(|i| b.load_weight(cache, &[b.addi(start, b.idx(i * lanes))], lanes, self.kv))
                .collect()
        };
        let mut folds: Vec<Vec<(Value, usize)>> = vec![Vec::new(); qvs.len()];
        for &start in &starts {
            let ks = load(self.kc, start);
            for (qv, fold) in qvs.iter().zip(&mut folds) {
                let mut dot = b.zero_like(lanes);
                for (&qi, &kv) in qv.iter().zip(&ks) {
                    dot = b.fma(qi, kv, dot);
                }
                b.fold_next(fold, dot);
            }
        }
        let valid = limit.map(|lim| {
            let n = b.index_to_f32(b.subi(lim, base));
            let iota: Vec<f32> = (0..lanes).map(|j| j as f32).collect();
            b.cmpf_olt(b.f32_vec(&iota), b.broadcast(n, lanes))
        });
        // Each head's softmax step: its new maximum and sum, its weights, its rescaled values.
        let mut heads: Vec<(Value, Value, Value, Vec<Value>)> = folds
            .into_iter()
            .zip(&sts)
            .map(|(fold, st)| {
                let [(sum, _)] = fold[..] else {
                    unreachable!("one vector of scores")
                };
                let mut s = self.score(b, b.mulf(sum, b.f32_splat(self.scale, lanes)));
                if let Some(valid) = valid {
                    s = b.select(valid, s, b.f32_splat(f32::NEG_INFINITY, lanes));
                }
                let (m, l) = (st[0], st[1]);
                // The running maximum without NaN tests: `arith.maximumf` put a compare and a
                // blend into each of the reduction's steps, all on the chain every block of
                // keys waits on. A maximum is one of its operands either way, so the bits do
                // not change (a NaN score still makes the head's output NaN, through its
                // weight). Qwen2.5-0.5B shape, 4000 tokens, f16 cache, 2-core Zen 5: attention
                // per prompt token 0.878-0.893 -> 0.707-0.711 ms (prefill 405-415 -> 432-436
                // tok/s), per decoded token 3.15-3.30 -> 3.02-3.03 ms.
                let m_new = b.max_no_nan(m, b.reduce_max_no_nan(s));
                let c_old = b.exp(b.subf(m, m_new));
                let mut pw = b.exp(b.subf(s, b.broadcast(m_new, lanes)));
                if let Some(valid) = valid {
                    pw = b.select(valid, pw, b.zero_like(lanes));
                }
                let l_new = b.addf(b.mulf(l, c_old), b.reduce_add(pw));
                let c_old_v = b.broadcast(c_old, lanes);
                let acc: Vec<Value> = st[2..].iter().map(|&a| b.mulf(a, c_old_v)).collect();
                (m_new, l_new, pw, acc)
            })
            .collect();
        for (j, &start) in starts.iter().enumerate() {
            let vs = load(self.vc, start);
            let set = (j % sets) * self.nvec;
            for (_, _, pw, acc) in &mut heads {
                let wj = b.splat_lane(*pw, j);
                for (i, &vv) in vs.iter().enumerate() {
                    acc[set + i] = b.fma(wj, vv, acc[set + i]);
                }
            }
        }
        heads
            .into_iter()
            .map(|(m_new, l_new, _, acc)| {
                let mut next = vec![m_new, l_new];
                next.extend(acc);
                next
            })
            .collect()
    }

    /// One key at a time with the running state (heads too short for a vector of scores).
    fn per_key<'b>(
        &self,
        b: Kb<'c, 'b>,
        qv: &[Value<'c, '_>],
        kv_base: Value<'c, '_>,
        first: Value<'c, '_>,
        last: Value<'c, '_>,
    ) -> State<'c, 'b> {
        let lanes = self.lanes;
        let scale_c = b.f32c(self.scale);
        let one = b.idx(1);
        let mut inits = vec![b.f32c(f32::NEG_INFINITY), b.f32c(0.0)];
        inits.extend((0..self.nvec).map(|_| b.zero_like(lanes)));
        let st = b.for_range(first, last, one, &inits, |b, j, st| {
            let (m, l) = (st[0], st[1]);
            let mut dot = b.zero_like(lanes);
            let start = b.muli(b.addi(kv_base, j), b.idx(self.nvec * lanes));
            for (i, &qi) in qv.iter().enumerate() {
                let kv = b.load_weight(self.kc, &[b.addi(start, b.idx(i * lanes))], lanes, self.kv);
                dot = b.fma(qi, kv, dot);
            }
            let s = self.score(b, b.mulf(b.reduce_add(dot), scale_c));
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
            for i in 0..self.nvec {
                let vv = b.load_weight(self.vc, &[b.addi(start, b.idx(i * lanes))], lanes, self.kv);
                next.push(b.fma(c_new_v, vv, b.mulf(st[2 + i], c_old_v)));
            }
            next
        });
        (st[1], st[2..].to_vec())
    }
}
