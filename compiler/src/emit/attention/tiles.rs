//! Prefill attention in tiles of rows: the keys and values of a KV head are read from memory
//! (or L3) once per tile of rows and chunk of keys, not once per row and query head.
//!
//! A work item is a tile of up to [`TILE_ROWS`] rows and one KV head. Its keys are walked in
//! chunks of about [`CHUNK_BYTES`] of keys and values (L1-sized); for each chunk, every (row,
//! query head) of the tile loads its softmax states from a per-thread scratch, folds the
//! chunk's whole units of key blocks into them with the same instructions as a row attended
//! alone ([`Attn::units`]), and stores them back. After the last chunk each (row, head) runs
//! the rest of its keys ([`Attn::finish`]: an odd block, the masked remainder) and writes its
//! output. A head's states see the same blocks in the same order, with the same state
//! layout, whichever way its row is attended, so prefill stays bitwise equal to decode; the
//! states only pass through memory between chunks (exactly). Before, each row's sweep over a
//! long context streamed its KV head's cache from L3 or memory once per query head (the
//! Qwen2.5-0.5B shape's 7 heads per KV head are attended one per item: four states'
//! accumulators would not fit the registers), and widened an f16 or bf16 cache each time; a
//! narrow cache's chunk is now widened once per tile into an f32 buffer, exactly as each load
//! would widen it. One-row decode tiles too (a tile of one row per KV head, when there are as
//! many KV heads as threads): its query heads then share each chunk.
//!
//! Measured on the Qwen2.5-0.5B shape (2-core Zen 4 EPYC, 2 threads, AVX-512, `KILN_PROFILE`),
//! 4000-token prompt, attention per prompt token / per decoded token: f32 cache 2.21 -> 1.72 ms
//! / 8.53 -> 6.83 ms, f16 cache 2.35 -> 1.88 ms / 5.83 -> 5.61 ms; prefill 178 -> 194 tok/s
//! (f32) and 171 -> 190 tok/s (f16); 148-token prompts unchanged.
//!
//! A visit of a chunk takes [`heads_per_visit`] query heads of the row together (their chains
//! interleave), and items are dealt to threads round-robin. Measured on a 2-core Zen 5, 2
//! threads, f16 cache, with 256-row prefill blocks: Qwen2.5-0.5B shape at 4000 tokens,
//! attention 1.31 -> 0.97 ms per prompt token, prefill 357 -> 409 tok/s; TinyLlama-1.1B at
//! 2000 tokens 1.57 -> 0.99 ms, 176 -> 197 tok/s.
//!
//! Rows of a tile need not share a sequence (a batched step): each row reads its own slot's
//! cache, and a chunk past a row's keys is skipped for it. Sliding windows keep the per-row
//! items (their blocks start at each row's own first key, so rows do not share chunks).

use super::{Attn, Layout, cache_rows};
use crate::emit::{Dyn, max_index};
use crate::ir::{Cmp, Kb};
use kiln_core::DType;
use melior::ir::Value;

/// Rows per tile: each chunk of keys is read from memory once and from L1 for the other rows
/// and heads of the tile.
pub(super) const TILE_ROWS: usize = 16;

/// Bytes of keys and values per chunk (as f32): L1-sized. Measured on a 2-core Zen 5 (48 KiB
/// L1), Qwen2.5-0.5B shape at 4000 tokens, f16 cache: attention per prompt token 1.03 ms with
/// 16 KiB, 0.97 with 32 KiB, 0.98 with 64 KiB.
const CHUNK_BYTES: usize = 32 << 10;

/// Heads of one row a visit of a chunk takes together: their chains (each head's own
/// instructions and states, so the bits do not change) interleave, where one head alone left
/// the core waiting on its running maximum, `exp` and accumulator chains. Measured on a 2-core
/// Zen 5, 2 threads, f16 cache, attention per prompt token: Qwen2.5-0.5B shape (two softmax
/// states per head) at 4000 tokens 1 head 1.31 ms, 2 1.12, 3 1.04, 4 1.19; TinyLlama-1.1B (one
/// state, two sets of accumulators) at 2000 tokens 1 1.48, 2 1.13, 3 1.06, 4 0.99, 6 1.18.
/// Since the heads of a visit share each key and value load ([`Attn::block`]), two heads with
/// two states each beat three (whose states no longer fit the registers): Qwen2.5-0.5B shape,
/// same machine, two runs each, f16 cache at 4000 tokens 0.95 -> 0.88-0.90 ms per prompt
/// token, f32 cache at 2000 tokens 0.49 -> 0.45 ms per prompt token and 2.39-2.41 -> 2.20-2.25
/// ms per decoded token.
///
/// Heads whose rows span 16 vectors or more (`nvec`: 256-wide heads) go one at a time: a head
/// alone then has 16 independent value-accumulator chains, and its query and accumulators fill
/// the register file, so more heads per visit only spill. Qwen3.5-0.8B shape (8 heads of 256,
/// one state per head), 2048 tokens, f32 cache, same machine, two runs each: native code, 4 ->
/// 1 head, attention per decoded token 3.08-3.21 -> 1.45-1.56 ms and per prompt token
/// 0.262-0.265 -> 0.210-0.215 ms; AVX2 code (32 vectors per head, one run each) 1.85 -> 1.78
/// and 0.591 -> 0.508 ms. TinyLlama's 64-wide heads keep four (AVX2 code, 8 vectors, 1984
/// tokens: 1 head 1.92 ms per prompt token, 2 heads 2.05, 4 heads 1.48).
fn heads_per_visit(streams: usize, nvec: usize) -> usize {
    match (streams, nvec) {
        (_, 16..) => 1,
        (2, _) => 2,
        _ => 4,
    }
}

/// Where the states of (row `r`, head `h` of the group) live in the scratch of the tile that
/// starts at row `r0`.
fn state_at<'c, 'b>(
    b: Kb<'c, 'b>,
    r0: Value<'c, '_>,
    r: Value<'c, '_>,
    h: Value<'c, '_>,
    group: usize,
    slot: usize,
) -> Value<'c, 'b> {
    let i = b.addi(b.muli(b.subi(r, r0), b.idx(group)), h);
    b.muli(i, b.idx(slot))
}

/// What the tiled items need of the kernel besides [`Attn`].
pub(super) struct Tiled<'c, 'a> {
    pub q: Value<'c, 'a>,
    pub out: Value<'c, 'a>,
    pub row_info: Value<'c, 'a>,
    pub heads: usize,
    pub kv_heads: usize,
    pub ctx: usize,
}

impl<'c> Attn<'c, '_> {
    /// Keys per chunk: a whole number of units, about [`CHUNK_BYTES`] of keys and values as
    /// f32 (narrow caches are read widened).
    fn chunk_keys(&self, lay: Layout) -> usize {
        let unit = lay.streams * self.lanes;
        let per_key = 2 * self.nvec * self.lanes * 4;
        (CHUNK_BYTES / per_key / unit).max(1) * unit
    }

    /// Floats of scratch per (row, head): every state value gets a slot of `lanes` floats.
    fn slot_floats(&self, lay: Layout) -> usize {
        lay.streams * lay.per_state * self.lanes
    }

    fn store_states(&self, b: Kb<'c, '_>, scratch: Value<'c, '_>, at: Value<'c, '_>, st: &[Value<'c, '_>]) {
        for (i, &v) in st.iter().enumerate() {
            b.store(v, scratch, &[b.addi(at, b.idx(i * self.lanes))]);
        }
    }

    fn load_states<'b>(
        &self,
        b: Kb<'c, 'b>,
        scratch: Value<'c, '_>,
        at: Value<'c, '_>,
        lay: Layout,
    ) -> Vec<Value<'c, 'b>> {
        (0..lay.streams * lay.per_state)
            .map(|i| {
                // Each state is its maximum and sum (scalars), then its value vectors.
                let lanes = if i % lay.per_state < 2 { 1 } else { self.lanes };
                b.load_f32(scratch, &[b.addi(at, b.idx(i * self.lanes))], lanes)
            })
            .collect()
    }

    /// This kernel's attention over other key and value buffers.
    fn reading<'x>(&self, kc: Value<'c, 'x>, vc: Value<'c, 'x>, kv: DType) -> Attn<'c, 'x> {
        Attn {
            kc,
            vc,
            kv,
            lanes: self.lanes,
            nvec: self.nvec,
            scale: self.scale,
            softcap: self.softcap,
            grouped: self.grouped,
        }
    }

    /// Widens cache rows `base + from .. base + to` into rows `0..` of `w`'s buffers.
    fn widen_chunk(
        &self,
        b: Kb<'c, '_>,
        w: &Attn<'c, '_>,
        base: Value<'c, '_>,
        from: Value<'c, '_>,
        to: Value<'c, '_>,
    ) {
        let dim = self.nvec * self.lanes;
        b.for_each(from, to, b.idx(1), |b, key| {
            let row = b.muli(b.addi(base, key), b.idx(dim));
            let local = b.muli(b.subi(key, from), b.idx(dim));
            for i in 0..self.nvec {
                let (at, to) = (b.addi(row, b.idx(i * self.lanes)), b.addi(local, b.idx(i * self.lanes)));
                b.store(b.load_weight(self.kc, &[at], self.lanes, self.kv), w.kc, &[to]);
                b.store(b.load_weight(self.vc, &[at], self.lanes, self.kv), w.vc, &[to]);
            }
        });
    }

    /// This thread's tiled items of a call (see the module documentation).
    pub(super) fn tiled_items(&self, b: Kb<'c, '_>, t: &Tiled<'c, '_>, d: Dyn<'c, '_>) {
        let lay = self.layout();
        let group = t.heads / t.kv_heads;
        let chunk = self.chunk_keys(lay);
        let slot = self.slot_floats(lay);
        let scratch = b.alloca(&format!("memref<{}xf32>", TILE_ROWS * group * slot));
        // A narrow cache's chunk is widened once into f32 buffers (exactly, as each load would
        // widen it) for the rows that read the first row's cache. (Stack buffers are made here,
        // outside every loop: an alloca in a loop would grow the stack each time round.)
        let widened = (self.kv != DType::F32).then(|| {
            let ty = format!("memref<{}xf32>", chunk * self.nvec * self.lanes);
            self.reading(b.alloca(&ty), b.alloca(&ty), DType::F32)
        });
        let one = b.idx(1);
        let tiles = b.ceildivui(d.rows, b.idx(TILE_ROWS));
        let total = b.muli(tiles, b.idx(t.kv_heads));
        // Items dealt round-robin: consecutive tiles of a causal block have more and more keys,
        // so contiguous ranges gave the last thread the longest tiles.
        b.for_each(b.minui(d.tid, total), total, d.nth, |b, item| {
            let kv_head = b.remui(item, b.idx(t.kv_heads));
            let r0 = b.muli(b.divui(item, b.idx(t.kv_heads)), b.idx(TILE_ROWS));
            let r1 = b.minui(b.addi(r0, b.idx(TILE_ROWS)), d.rows);
            let zero = b.idx(0);
            let most = b.for_range(r0, r1, one, &[zero], |b, r, acc| {
                let inits = self.initial_states(b, 1, lay);
                b.for_each(b.idx(0), b.idx(group), one, |b, h| {
                    self.store_states(b, scratch, state_at(b, r0, r, h, group, slot), &inits)
                });
                let (_, last) = cache_rows(b, t.row_info, t.kv_heads, t.ctx, kv_head, r);
                vec![max_index(b, acc[0], self.units_end(b, b.idx(0), last, lay))]
            });
            // A tile of one row (one-row decode) reads the narrow cache as it is (the same
            // values: widening is exact): widening each chunk for one row's heads cost more
            // than it saved (Qwen2.5-0.5B shape, 4000 tokens, f16 cache, 2-core Zen 5, two
            // runs each: attention 3.62-3.67 -> 3.05-3.13 ms per decoded token).
            let several = b.cmpi(Cmp::Ugt, b.subi(r1, r0), one);
            let alone = b.cmpi(Cmp::Ule, b.subi(r1, r0), one);
            b.for_each(zero, most[0], b.idx(chunk), |b, c0| {
                let (base0, _) = cache_rows(b, t.row_info, t.kv_heads, t.ctx, kv_head, r0);
                if let Some(w) = &widened {
                    b.if_then(several, |b| {
                        self.widen_chunk(b, w, base0, c0, b.minui(b.addi(c0, b.idx(chunk)), b.idx(t.ctx)))
                    });
                }
                b.for_each(r0, r1, one, |b, r| {
                    let (kv_base, last) = cache_rows(b, t.row_info, t.kv_heads, t.ctx, kv_head, r);
                    let to = b.minui(b.addi(c0, b.idx(chunk)), self.units_end(b, b.idx(0), last, lay));
                    let heads = |b: Kb<'c, '_>, attn: &Attn<'c, '_>, kv_base: Value<'c, '_>| {
                        // Heads of the row visited `together` at a time: their independent
                        // chains interleave (each head's own instructions and states).
                        let together = heads_per_visit(lay.streams, self.nvec).min(group);
                        let visit = |b: Kb<'c, '_>, h0: Value<'c, '_>, n: usize| {
                            let hs: Vec<Value> = (0..n).map(|i| b.addi(h0, b.idx(i))).collect();
                            let qv: Vec<Vec<Value>> = hs
                                .iter()
                                .map(|&h| self.query(b, t.q, r, b.addi(b.muli(kv_head, b.idx(group)), h)))
                                .collect();
                            let heres: Vec<Value> = hs.iter().map(|&h| state_at(b, r0, r, h, group, slot)).collect();
                            let st: Vec<Value> = heres
                                .iter()
                                .flat_map(|&at| self.load_states(b, scratch, at, lay))
                                .collect();
                            let st = attn.units(b, &qv, kv_base, c0, to, &st, lay);
                            let per = lay.streams * lay.per_state;
                            for (i, &at) in heres.iter().enumerate() {
                                self.store_states(b, scratch, at, &st[i * per..(i + 1) * per]);
                            }
                        };
                        let whole = group / together * together;
                        b.for_each(b.idx(0), b.idx(whole), b.idx(together), |b, h| visit(b, h, together));
                        b.for_each(b.idx(whole), b.idx(group), one, |b, h| visit(b, h, 1));
                    };
                    let work = b.cmpi(Cmp::Ult, c0, to);
                    match &widened {
                        None => b.if_then(work, |b| heads(b, self, kv_base)),
                        Some(w) => {
                            // Cache row `c0 + i` is row `i` of the widened chunk.
                            let shared = b.andi(several, b.cmpi(Cmp::Eq, kv_base, base0));
                            b.if_then(b.andi(work, shared), |b| heads(b, w, b.subi(b.idx(0), c0)));
                            let own = b.ori(alone, b.cmpi(Cmp::Ne, kv_base, base0));
                            b.if_then(b.andi(work, own), |b| heads(b, self, kv_base));
                        }
                    }
                });
            });
            b.for_each(r0, r1, one, |b, r| {
                let (kv_base, last) = cache_rows(b, t.row_info, t.kv_heads, t.ctx, kv_head, r);
                let units_end = self.units_end(b, b.idx(0), last, lay);
                b.for_each(b.idx(0), b.idx(group), one, |b, h| {
                    let head = b.addi(b.muli(kv_head, b.idx(group)), h);
                    let qv = vec![self.query(b, t.q, r, head)];
                    let st = self.load_states(b, scratch, state_at(b, r0, r, h, group, slot), lay);
                    let states = self.finish(b, &qv, kv_base, units_end, last, st, lay);
                    self.write_out(b, t.out, r, head, states.into_iter().next().expect("one head"));
                });
            });
        });
    }
}
