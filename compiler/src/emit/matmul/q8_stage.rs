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
        // AVX-512's staged tiles are WIDE_STAGED_TILE (4) rows: whole pairs.
        if self.lanes >= 16 {
            assert!(t.m.is_multiple_of(2), "a wide staged tile of {} rows", t.m);
            return self.q8_staged_pairs(b, dtype, t, acts);
        }
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
                let sums = staged_sums(b, dtype, stage, acts, &rows, at, first, false);
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
/// add. Those 16 lanes are returned as they are; the caller adds the halves per block
/// ([`fold_pair`]), leaving each i32 lane the integer [`super::q8::fold_halves`] would.
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
    b.for_range(b.idx(0), bound, b.idx(1), &inits, |b, s, sums| {
        let zero = b.idx(0);
        let slot = b.addi(first, b.muli(s, b.idx(2)));
        let next = b.addi(slot, b.idx(1));
        let low = b.load_bytes(stage.codes, &[at, slot, zero], GROUP);
        let high = b.load_bytes(stage.codes, &[at, next, zero], GROUP);
        let scale = b.load_vec(stage.scales, &[at, b.addi(first, s), zero], 16, "i16");
        let (k0, k1) = (b.muli(slot, b.idx(GROUP)), b.muli(next, b.idx(GROUP)));
        if wide {
            let (codes, scales) = (b.concat(low, high), b.concat(scale, scale));
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
    })
}

/// A weight row's vector for both rows of a pair: `[x | x]`.
fn twice<'c, 'a>(b: Kb<'c, 'a>, x: Value<'c, 'a>) -> Value<'c, 'a> {
    b.concat(x, x)
}

/// Two rows' 16-lane block sums (512-bit slot-pair steps) folded into one vector:
/// `[lo(x) + hi(x) | lo(y) + hi(y)]`, each lane the integer [`super::q8::fold_halves`] leaves
/// in it for its own row.
fn fold_pair<'c, 'a>(b: Kb<'c, 'a>, x: Value<'c, 'a>, y: Value<'c, 'a>) -> Value<'c, 'a> {
    let lo: Vec<usize> = (0..LANES).chain(2 * LANES..3 * LANES).collect();
    let hi: Vec<usize> = (LANES..2 * LANES).chain(3 * LANES..4 * LANES).collect();
    b.addi(b.shuffle_any(x, y, &lo), b.shuffle_any(x, y, &hi))
}

/// What a pair of activation rows `(a, b)` brings to every weight row's float step of block
/// `blk`, each as `[row a | row b]`: their scales `d` (8 lanes each) and their offset terms'
/// activation sums (`s32` for q4_k and q5_k; `s16`'s halves for q2_k; `bsums16` for q3_k and
/// q6_k, 16 i16 each).
struct RowPair<'c, 'a> {
    d: Value<'c, 'a>,
    terms: Vec<Value<'c, 'a>>,
}

impl<'c, 'a> RowPair<'c, 'a> {
    fn load(b: Kb<'c, 'a>, dtype: DType, acts: &Acts<'c, '_>, rows: [Value<'c, 'a>; 2], blk: Value<'c, 'a>) -> Self {
        let first = b.muli(blk, b.idx(dtype.block_elems() / GROUP));
        let per_row = |r: Value<'c, 'a>| b.broadcast(b.load_f32(acts.d, &[r, first], 1), LANES);
        let d = b.concat(per_row(rows[0]), per_row(rows[1]));
        let both = |f: &dyn Fn(Value<'c, 'a>) -> Value<'c, 'a>| b.concat(f(rows[0]), f(rows[1]));
        let terms = match dtype {
            DType::Q4K | DType::Q5K => vec![both(&|r| b.load_f32(acts.s32, &[r, b.muli(blk, b.idx(8))], 8))],
            DType::Q2K => {
                let at = b.muli(blk, b.idx(16));
                vec![
                    both(&|r| b.load_f32(acts.s16, &[r, at], 8)),
                    both(&|r| b.load_f32(acts.s16, &[r, b.addi(at, b.idx(8))], 8)),
                ]
            }
            _ => vec![both(&|r| {
                b.load_vec(acts.bsums16, &[r, b.muli(blk, b.idx(16))], 16, "i16")
            })],
        };
        RowPair { d, terms }
    }
}

impl<'c, 'a> MatMul<'c, 'a> {
    /// [`Self::q8_staged_rows`] with AVX-512 and an even number of rows: each pair of rows'
    /// float steps in one 16-lane vector per weight row (`[row a | row b]`), where each row
    /// took 8-lane steps of its own; every lane takes the same operations in the same order
    /// (the min terms, the halves of the block sums added, q3_k's and q6_k's integer offsets,
    /// `D·d`, the FMA), so the same bits. Those steps were half of the tile's vector
    /// instructions: per block, 4 slot-pair steps of 2 per row and weight row against 8 after
    /// them (q6_k, 2-core Zen 5).
    fn q8_staged_pairs(&self, b: Kb<'c, '_>, dtype: DType, t: Tile<'c, '_>, acts: &Acts<'c, '_>) {
        let stage = acts.stage.expect("a staged call");
        let groups = dtype.block_elems() / GROUP;
        let blocks = self.k / dtype.block_elems();
        let (rows, cols, _) = t.start(b, LANES, 0);
        let (ncols, pairs) = (t.ncols, rows.len() / 2);
        let inits: Vec<Value> = (0..pairs * ncols).map(|_| b.f32_splat(0.0, 2 * LANES)).collect();
        let acc = b.for_range(b.idx(0), b.idx(blocks), b.idx(1), &inits, |b, blk, acc| {
            let mut acc = acc;
            let zero = b.idx(0);
            let first = b.muli(blk, b.idx(groups));
            let row_pairs: Vec<RowPair> = (0..pairs)
                .map(|p| RowPair::load(b, dtype, acts, [rows[2 * p], rows[2 * p + 1]], blk))
                .collect();
            for c in 0..ncols {
                let at = b.idx(c);
                if quant8::has_min_terms(dtype) {
                    let lanes = if dtype == DType::Q2K { 16 } else { 8 };
                    let factors = b.load_f32(stage.offsets, &[at, blk, zero], lanes);
                    for (p, rp) in row_pairs.iter().enumerate() {
                        let a = &mut acc[p * ncols + c];
                        for (h, &s) in rp.terms.iter().enumerate() {
                            *a = b.fma(twice(b, b.slice(factors, h * LANES, LANES)), s, *a);
                        }
                    }
                }
                let sums = staged_sums(b, dtype, stage, acts, &rows, at, first, true);
                let sub_scales = (!quant8::has_min_terms(dtype))
                    .then(|| twice(b, b.load_vec(stage.sub_scales, &[at, blk, zero], 16, "i16")));
                let big_d = twice(b, b.load_f32(stage.big_d, &[at, blk, zero], LANES));
                for (p, rp) in row_pairs.iter().enumerate() {
                    let mut sum = fold_pair(b, sums[2 * p], sums[2 * p + 1]);
                    if let Some(scales) = sub_scales {
                        sum = quant8::int_offsets_of(b, dtype, scales, sum, rp.terms[0]);
                    }
                    let dd = b.mulf(big_d, rp.d);
                    let a = &mut acc[p * ncols + c];
                    *a = b.fma(b.sitofp(sum), dd, *a);
                }
            }
            acc
        });
        let per_row: Vec<Value> = (0..rows.len())
            .flat_map(|i| (0..ncols).map(move |c| (i, c)))
            .map(|(i, c)| b.slice(acc[(i / 2) * ncols + c], (i % 2) * LANES, LANES))
            .collect();
        self.finish_tile(b, &per_row, &rows, &cols);
    }
}
