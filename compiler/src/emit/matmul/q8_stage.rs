//! `--precision q8` over the k-quants with 4 activation rows or more (prefill, batched decode):
//! each thread's weight rows unpacked once per call into a [`Stage`], then every row tile
//! reads the stage.
//!
//! Why (measured with `quant_speed`, one thread, x86-64-v3 code, 2-core Zen 4, n = k = 2048,
//! 64 rows, GFLOP/s): a tile that unpacks each block itself for its 8 rows holds 16 vectors of
//! codes and scales, AVX2's registers spill, and LLVM orders the work row by row, reloading
//! codes and scales for every row; with q2_k the unpacking alone rivals the multiplies. Staged,
//! a tile walks each block's slots in a loop whose bound LLVM cannot see (so it stays a loop
//! with one slot and the rows' sums in registers), and two groups take one slot pair: their
//! activations interleaved by 16-bit words (`q8_layouts::word_pairs`), two `vpmaddubsw`
//! results add in i16 and one `vpmaddwd` applies both groups' scales, three multiplies per 64
//! products and row instead of four ([`staged`]).
//!
//! Every block's sum is the same exact integer as the one-row code's, and the float steps
//! after it are the same operations in the same order, so outputs are bitwise those of decode.

use super::MatMul;
use super::decode::{Tile, prefetch_group};
use super::q8::{LANES, finish_block};
use crate::emit::quant8::{self, Acts, CodeBlock, GROUP, STAGE_COLS, Stage};
use crate::ir::Kb;
use kiln_core::DType;
use melior::ir::Value;

/// Fewest activation rows a call (and a tile) must have to stage its weight rows: staging
/// costs a pass over the weights and a store per slot, which two rows do not repay (Zen 4,
/// AVX2 code, TinyLlama Q4_K_M, batched decode tok/s, direct → staged: 2 rows 71.5 → 59.3,
/// 4 rows 84.4 → 87.4).
pub(super) const STAGE_MIN_ROWS: usize = 4;

/// Activation rows per staged tile with AVX-512's 512-bit steps: 4, where the register file
/// would allow 8 (`quant_speed`, one thread, 2-core Zen 5, n = k = 2048, 64 rows, GFLOP/s, 8
/// → 4 rows: q4_k 330 → 341, q6_k 292 → 320, q3_k 295 → 324, q2_k 303 → 313). AVX2's
/// 256-bit steps take 4 rows too, with two weight rows per tile in prefill
/// (`q8::q8_tile_cols`; 8 rows by one weight row: q4_k 213 against 254).
pub(super) const WIDE_STAGED_TILE: usize = 4;

/// Whether calls of several rows over `dtype` stage their weight rows: the k-quants.
///
/// Every staged slot pair holds two groups' codes interleaved by words. The two `vpmaddubsw`
/// results add in i16 without overflow: unsigned codes below 64 (q6_k's `c + 32`, the largest)
/// times activations of at most 128 in magnitude give pair sums up to `2 · 63 · 128`, two of
/// them 32256. Each i32 lane of the `vpmaddwd` then holds the same four products of each group,
/// times the same sub-block scales, as two one-group steps would (the four products of lane `d`
/// lie in one sub-block of 16: [`CodeBlock::pair_scale`]), so every block's sum is the same
/// integer.
pub(in crate::emit) fn staged(dtype: DType) -> bool {
    quant8::supports(dtype) && quant8::span(dtype) > GROUP
}

impl<'c, 'a> MatMul<'c, 'a> {
    /// Unpacks weight rows `col0 .. col0 + cols` of `w` (of the share ending at row `end`)
    /// into the call's stage: every block's code slots and slot scales, offset factors and
    /// super-block scale, the weights prefetched as decode prefetches them.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn q8_stage_fill(
        &self,
        b: Kb<'c, '_>,
        w: Value<'c, '_>,
        dtype: DType,
        col0: Value<'c, '_>,
        cols: usize,
        end: Value<'c, '_>,
    ) {
        let acts = self.q8.expect("a q8 matmul");
        let stage = acts.stage.expect("a staged call");
        assert!(cols <= STAGE_COLS, "{cols} weight rows, the stage holds {STAGE_COLS}");
        let groups = dtype.block_elems() / GROUP;
        let blocks = self.k / dtype.block_elems();
        let zero = b.idx(0);
        for c in 0..cols {
            let (col, at) = (b.addi(col0, b.idx(c)), b.idx(c));
            b.for_each(zero, b.idx(blocks), b.idx(1), |b, blk| {
                let off = b.muli(blk, b.idx(dtype.block_bytes()));
                prefetch_group(b, w, col, 1, off, dtype.block_bytes(), dtype.bytes_for(self.k), end);
                let mut block = CodeBlock::new(b, w, dtype, col, blk);
                let first = b.muli(blk, b.idx(groups));
                let slot = |i: usize| b.addi(first, b.idx(i));
                for p in 0..groups / 2 {
                    let (low, high) = quant8::word_pair_codes(b, &mut block, p);
                    b.store(low, stage.codes, &[at, slot(2 * p), zero]);
                    b.store(high, stage.codes, &[at, slot(2 * p + 1), zero]);
                    b.store(block.pair_scale(p), stage.scales, &[at, slot(p), zero]);
                }
                if quant8::has_min_terms(dtype) {
                    b.store(block.offset_factors(), stage.offsets, &[at, blk, zero]);
                } else {
                    b.store(block.sub_scales(), stage.sub_scales, &[at, blk, zero]);
                }
                b.store(block.super_scale(), stage.big_d, &[at, blk, zero]);
            });
        }
    }

    /// The tile's outputs from the stage [`Self::q8_stage_fill`] filled for its weight rows:
    /// per block and weight row, the offset terms, the block's integer sums
    /// ([`staged_sums`]), then one `fma(Σ, D·d, acc)` per activation row, as `q8.rs` does.
    pub(super) fn q8_staged_rows(&self, b: Kb<'c, '_>, dtype: DType, t: Tile<'c, '_>, acts: &Acts<'c, '_>) {
        let stage = acts.stage.expect("a staged call");
        let groups = dtype.block_elems() / GROUP;
        let blocks = self.k / dtype.block_elems();
        let (rows, cols, inits) = t.start(b, LANES, t.ncols);
        let ncols = t.ncols;
        let acc = b.for_range(b.idx(0), b.idx(blocks), b.idx(1), &inits, |b, blk, acc| {
            let mut acc = acc;
            let zero = b.idx(0);
            let first = b.muli(blk, b.idx(groups));
            for c in 0..ncols {
                let at = b.idx(c);
                let mut col_acc: Vec<Value> = (0..rows.len()).map(|i| acc[i * ncols + c]).collect();
                if quant8::has_min_terms(dtype) {
                    let lanes = if dtype == DType::Q2K { 16 } else { 8 };
                    let factors = b.load_f32(stage.offsets, &[at, blk, zero], lanes);
                    for (i, &r) in rows.iter().enumerate() {
                        col_acc[i] = quant8::offset_terms(b, dtype, factors, col_acc[i], acts, r, blk);
                    }
                }
                let sums = staged_sums(b, dtype, stage, acts, &rows, at, first, self.lanes >= 16);
                let sub_scales =
                    (!quant8::has_min_terms(dtype)).then(|| b.load_vec(stage.sub_scales, &[at, blk, zero], 16, "i16"));
                let big_d = b.load_f32(stage.big_d, &[at, blk, zero], LANES);
                finish_block(b, dtype, acts, &rows, blk, &sums, sub_scales, big_d, &mut col_acc);
                for (i, a) in col_acc.into_iter().enumerate() {
                    acc[i * ncols + c] = a;
                }
            }
            acc
        });
        self.finish_tile(b, &acc, &rows, &cols);
    }
}

/// A block's `Σ sc·c·q` (8 i32 lanes) for each of `rows`, from weight row `at` of the stage,
/// whose slots start at `first`: a loop over the block's slot pairs. Its bound is opaque, so
/// LLVM keeps it a loop: the rows' sums, the pair's codes and scales are all it holds in
/// registers.
///
/// With AVX-512 (`wide`) a slot pair's 64 codes take one 512-bit `vpmaddubsw` and the pair
/// scales, in both halves, one `vpmaddwd` (16 i32 lanes), where 256-bit steps add the two
/// slots' pair sums in i16 first: two multiplies per 64 codes and row instead of three and an
/// add. The halves are added per block, leaving each i32 lane the same integer.
#[allow(clippy::too_many_arguments)]
fn staged_sums<'c, 'a>(
    b: Kb<'c, 'a>,
    dtype: DType,
    stage: Stage<'c, '_>,
    acts: &Acts<'c, '_>,
    rows: &[Value<'c, 'a>],
    at: Value<'c, 'a>,
    first: Value<'c, 'a>,
    wide: bool,
) -> Vec<Value<'c, 'a>> {
    let pairs = dtype.block_elems() / GROUP / 2;
    let word_pairs = acts.word_pairs.expect("a staged call's rows in word pairs");
    let lanes = if wide { 2 * LANES } else { LANES };
    let inits: Vec<Value> = rows.iter().map(|_| b.int_splat(0, lanes, "i32")).collect();
    let bound = b.opaque_index(b.idx(pairs));
    let sums = b.for_range(b.idx(0), bound, b.idx(1), &inits, |b, s, sums| {
        let zero = b.idx(0);
        let slot = b.addi(first, b.muli(s, b.idx(2)));
        let next = b.addi(slot, b.idx(1));
        let low = b.load_bytes(stage.codes, &[at, slot, zero], GROUP);
        let high = b.load_bytes(stage.codes, &[at, next, zero], GROUP);
        let scale = b.load_vec(stage.scales, &[at, b.addi(first, s), zero], 16, "i16");
        let (k0, k1) = (b.muli(slot, b.idx(GROUP)), b.muli(next, b.idx(GROUP)));
        if wide {
            let codes = b.shuffle_any(low, high, &(0..2 * GROUP).collect::<Vec<_>>());
            let scales = b.shuffle_any(scale, scale, &(0..16).chain(0..16).collect::<Vec<_>>());
            return rows
                .iter()
                .zip(sums)
                .map(|(&r, sum)| {
                    let q = b.load_bytes(word_pairs, &[r, k0], 2 * GROUP);
                    b.addi(sum, b.madd_i16(b.madd_u8_i8(codes, q), scales))
                })
                .collect();
        }
        rows.iter()
            .zip(sums)
            .map(|(&r, sum)| {
                let p = b.addi(
                    b.madd_u8_i8(low, b.load_bytes(word_pairs, &[r, k0], GROUP)),
                    b.madd_u8_i8(high, b.load_bytes(word_pairs, &[r, k1], GROUP)),
                );
                b.addi(sum, b.madd_i16(p, scale))
            })
            .collect()
    });
    if !wide {
        return sums;
    }
    sums.into_iter().map(|s| super::q8::fold_halves(b, s)).collect()
}
