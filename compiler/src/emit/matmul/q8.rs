//! `--precision q8` matmul tiles: quantised weight rows against activation rows rounded to 8
//! bits (`quant8.rs`), for decode and prefill alike.

use super::MatMul;
use super::decode::{Tile, prefetch_group};
use crate::emit::quant8::{self, Acts, CodeBlock, GROUP, span};
use crate::ir::Kb;
use kiln_core::DType;
use melior::ir::Value;

/// f32 lanes of the accumulators: one per i32 sum of `vpmaddwd`.
pub(super) const LANES: usize = 8;

/// Weight rows a one-row decode walks together (one accumulator each): four over the
/// 32-element formats (`quant_speed`, one thread, x86-64-v3 code, 2-core Zen 5, Gweights/s,
/// 4 → 2 rows: q4_0 35.2 → 30.6, q8_0 37.7 → 36.6). Over the k-quants, whose blocks sum in
/// integers ([`super_block`]) and hold more live vectors, one with AVX2's 16 registers and two
/// with AVX-512's 32 (Zen 4, 2 → 1 rows, AVX2 code: q4_k 35.2 → 37.5, q5_k 28.9 → 30.6, q6_k
/// 26.5 → 28.8; native code: q4_k 35.9 → 33.8, q6_k 31.3 → 30.8).
pub(super) fn q8_cols(dtype: DType, lanes: usize) -> usize {
    if let Some(r) = super::exp_var("KILN_EXP_ROWS") {
        return r;
    }
    match (dtype.block_elems(), lanes >= 16) {
        (32, _) => 4,
        (_, true) => 2,
        (_, false) => 1,
    }
}

/// Weight rows a tile of several activation rows takes at once (each activation vector it
/// loads meets that many weight rows): with AVX-512 four, against the sixteens' 16 rows
/// (512-bit `vpdpbusd`) and the staged k-quant tiles' 4 rows; with AVX2 two against the
/// staged 4-row tiles, one against the octets' 8 rows (16 registers), and two against octets
/// with AVX-512 but no VNNI. Measured with `quant_speed` (one thread, 2-core Zen 5, n 2048, k
/// 2048 / 5632, 64 rows, GFLOP/s), native code 2 → 4 weight rows: q8_0 435 → 494 / 441 →
/// 501, q4_0 462 → 504 / 465 → 509, q5_1 322 → 363 / 322 → 361, q2_k 334 → 346 / 296 → 343,
/// q4_k 361 → 378 / 335 → 331; x86-64-v3 code, staged tiles of 8 rows × 1 → 4 rows × 2: q4_k
/// 213 → 254 / 191 → 252, q5_k 210 → 256 / 184 → 250, q6_k 207 → 253 / 187 → 240. With one
/// weight row per tile every activation row of the call came from L2 again for each weight
/// row, a byte per multiply-add. Batched decode kernels (`max_rows` up to
/// [`kiln_core::kernel::DECODE_ROWS`]) keep two and one, each activation row's vectors in L1
/// anyway and the stage of four weight rows not (TinyLlama Q4_K_M, 4 sequences, native code:
/// 187 tok/s with two, 171 with four).
pub(super) fn q8_tile_cols(dtype: DType, lanes: usize, vnni512: bool, max_rows: usize) -> usize {
    if let Some(c) = super::exp_var("KILN_EXP_TILECOLS") {
        return c;
    }
    let wide = lanes >= 16;
    if max_rows <= kiln_core::kernel::DECODE_ROWS {
        return if wide { 2 } else { 1 };
    }
    match (super::q8_blocks::exact_blocks(dtype), wide) {
        (true, true) if vnni512 => 4,
        (true, true) => 2,
        (true, false) => 1,
        (false, true) => 4,
        (false, false) => 2,
    }
}

/// Blocks per loop step: enough that a step reads a cache line of each weight row (one
/// prefetch per line instead of several per line for the 18- to 34-byte blocks).
pub(super) fn blocks_per_step(dtype: DType, blocks: usize) -> usize {
    [4, 2, 1]
        .into_iter()
        .find(|&u| (u - 1) * dtype.block_bytes() < 64 && blocks.is_multiple_of(u))
        .unwrap_or(1)
}

impl<'c, 'a> MatMul<'c, 'a> {
    /// The tile's outputs: the 32-element formats by exact block sums
    /// ([`super::q8_blocks`]); the k-quants for each block of each weight row (in address
    /// order, prefetched as one stream), its offset terms, then its codes folded into every
    /// activation row of the tile ([`super_block`]).
    pub(super) fn q8_rows(&self, b: Kb<'c, '_>, w: Value<'c, '_>, dtype: DType, t: Tile<'c, '_>, acts: &Acts<'c, '_>) {
        if super::q8_blocks::exact_blocks(dtype) {
            return self.q8_block_rows(b, w, dtype, t, acts);
        }
        assert_eq!(
            acts.span,
            span(dtype),
            "{dtype}'s activations rounded with another span"
        );
        let blocks = self.k / dtype.block_elems();
        let unroll = blocks_per_step(dtype, blocks);
        let (rows, cols, inits) = t.start(b, LANES, t.ncols);
        let ncols = t.ncols;
        let row_bytes = dtype.bytes_for(self.k);
        let span = unroll * dtype.block_bytes();
        let (zero, hi, step) = (b.idx(0), b.idx(blocks), b.idx(unroll));
        let acc = b.for_range(zero, hi, step, &inits, |b, kb, acc| {
            let mut acc = acc;
            let off = b.muli(kb, b.idx(dtype.block_bytes()));
            prefetch_group(b, w, cols[0], cols.len(), off, span, row_bytes, t.end);
            for u in 0..unroll {
                let blk = b.addi(kb, b.idx(u));
                for (c, &col) in cols.iter().enumerate() {
                    let mut block = CodeBlock::new(b, w, dtype, col, blk);
                    let mut col_acc: Vec<Value> = (0..rows.len()).map(|i| acc[i * ncols + c]).collect();
                    if quant8::has_min_terms(dtype) {
                        for (i, &r) in rows.iter().enumerate() {
                            col_acc[i] = block.offset_terms(col_acc[i], acts, r, blk);
                        }
                    }
                    super_block(b, &mut block, acts, &rows, blk, self.lanes >= 16, &mut col_acc);
                    for (i, a) in col_acc.into_iter().enumerate() {
                        acc[i * ncols + c] = a;
                    }
                }
            }
            acc
        });
        self.finish_tile(b, &acc, &rows, &cols);
    }
}

/// A k-quant's block: its groups' `Σ sc·c·q` summed in i32 for each activation row (whose
/// codes share one scale over the block, [`block_sums`]), then one `fma(Σ, D·d, acc)` per row.
fn super_block<'c, 'a>(
    b: Kb<'c, 'a>,
    block: &mut CodeBlock<'c, 'a, '_>,
    acts: &Acts<'c, '_>,
    rows: &[Value<'c, 'a>],
    blk: Value<'c, 'a>,
    wide: bool,
    acc: &mut [Value<'c, 'a>],
) {
    let first = b.muli(blk, b.idx(block.groups()));
    let sums = block_sums(b, block, acts, rows, first, wide);
    let dtype = block.dtype();
    let sub_scales = (!quant8::has_min_terms(dtype)).then(|| block.sub_scales());
    finish_block(b, dtype, acts, rows, blk, &sums, sub_scales, block.super_scale(), acc);
}

/// The block's `Σ sc·c·q` per activation row (8 i32 lanes each): for each group, its 32 codes
/// against 32 activation codes in `vpmaddubsw` and the pair sums times the group's scales in
/// `vpmaddwd`. With AVX-512 (`wide`) two groups take one 512-bit step
/// ([`CodeBlock::pair_codes_wide`], [`CodeBlock::pair_scale_wide`]: 16 i32 lanes) and the two
/// 256-bit halves are added at the end. Lane `d` of either half holds the same four products,
/// times the same scale, as lane `d` of a 256-bit group step, so the block's 8 lanes are the
/// same integers and the outputs the same bits. Half the vector instructions per code of the
/// 256-bit steps, which AVX-512 machines also ran (`quant_speed`, one thread, 2-core Zen 5,
/// n = k = 2048, Gweights/s, 256-bit → 512-bit steps: q4_k 58 → 68, q5_k 48 → 60, q6_k 57 →
/// 79, q2_k and q3_k 77 and 61 after).
fn block_sums<'c, 'a>(
    b: Kb<'c, 'a>,
    block: &mut CodeBlock<'c, 'a, '_>,
    acts: &Acts<'c, '_>,
    rows: &[Value<'c, 'a>],
    first: Value<'c, 'a>,
    wide: bool,
) -> Vec<Value<'c, 'a>> {
    let per = if wide { 2 } else { 1 };
    let mut sums: Vec<Option<Value>> = vec![None; rows.len()];
    for c in 0..block.groups() / per {
        let (codes, scale) = match wide {
            true => (block.pair_codes_wide(c), block.pair_scale_wide(c)),
            false => (block.codes(c), block.int_scale(c)),
        };
        let k0 = b.muli(b.addi(first, b.idx(per * c)), b.idx(GROUP));
        for (i, &r) in rows.iter().enumerate() {
            let q = b.load_bytes(acts.q, &[r, k0], per * GROUP);
            let dot = b.madd_i16(b.madd_u8_i8(codes, q), scale);
            sums[i] = Some(sums[i].map_or(dot, |s| b.addi(s, dot)));
        }
    }
    sums.into_iter()
        .map(|s| {
            let s = s.expect("a block has groups");
            if wide { fold_halves(b, s) } else { s }
        })
        .collect()
}

/// A 512-bit step's 16 i32 lanes as the 8 of a 256-bit one: its two halves added, lane `d` of
/// either half holding the products lane `d` of a 256-bit step holds (the one-row code's group
/// pairs, the staged tiles' slot pairs), so the block's sums are the same integers.
pub(super) fn fold_halves<'c, 'a>(b: Kb<'c, 'a>, s: Value<'c, 'a>) -> Value<'c, 'a> {
    b.addi(b.slice(s, 0, LANES), b.slice(s, LANES, LANES))
}

/// A k-quant block's float step for each activation row, shared by the one-row code and the
/// staged tiles (`q8_stage.rs`) so their outputs agree bit for bit: the integer offsets off
/// `sums` where the format has them (`sub_scales`, [`quant8::int_offsets`]), then
/// `acc + Σ · (D·d)`.
#[allow(clippy::too_many_arguments)]
pub(super) fn finish_block<'c, 'a>(
    b: Kb<'c, 'a>,
    dtype: DType,
    acts: &Acts<'c, '_>,
    rows: &[Value<'c, 'a>],
    blk: Value<'c, 'a>,
    sums: &[Value<'c, 'a>],
    sub_scales: Option<Value<'c, 'a>>,
    big_d: Value<'c, 'a>,
    acc: &mut [Value<'c, 'a>],
) {
    let first = b.muli(blk, b.idx(dtype.block_elems() / GROUP));
    for (i, &r) in rows.iter().enumerate() {
        let sum = match sub_scales {
            Some(scales) => quant8::int_offsets(b, dtype, scales, sums[i], acts, r, blk),
            None => sums[i],
        };
        let dd = b.mulf(big_d, b.broadcast(b.load_f32(acts.d, &[r, first], 1), LANES));
        acc[i] = b.fma(b.sitofp(sum), dd, acc[i]);
    }
}
