//! The k-quants' parts of `--precision q8` beyond their codes: the stage of unpacked weight
//! rows for tiles of several activation rows, their offsets and min terms, and the word-pair
//! order of q4_k's and q5_k's staged slots.

use super::{Acts, CodeBlock, GROUP};
use crate::ir::Kb;
use kiln_core::DType;
use melior::ir::Value;

/// Weight rows of a k-quant unpacked once per call of several activation rows, for all of
/// their row tiles (`matmul/q8_stage.rs`): each 32-code slot ready for `vpmaddubsw`, its
/// sub-block scales as i16 lanes, and each block's offset factors and super-block scale.
///
/// Why: a tile that unpacks a block itself for its 8 rows holds 16 vectors of codes and
/// scales; AVX2's 16 registers spill, and LLVM then orders the work row by row, reloading
/// codes and scales for every row (three loads per multiply pair: the loads set the pace).
/// Unpacked once per weight row, the codes cost nothing per tile, and a tile walks each
/// block's slots in a loop that holds only the rows' sums and one slot.
#[derive(Clone, Copy)]
pub struct Stage<'c, 'a> {
    /// `memref<C x k/32 x 32 x i8>`: weight row `c`'s code slots.
    pub codes: Value<'c, 'a>,
    /// `memref<C x k/32 x 16 x i16>`: each slot's scales (`vpmaddwd`'s other operand).
    pub scales: Value<'c, 'a>,
    /// `memref<C x k/256 x 16 x f32>`: each block's min-term factors
    /// ([`CodeBlock::offset_factors`]; q2_k, q4_k, q5_k).
    pub offsets: Value<'c, 'a>,
    /// `memref<C x k/256 x 16 x i16>`: each block's sub-block scales for its integer offsets
    /// ([`int_offsets`]; q3_k, q6_k).
    pub sub_scales: Value<'c, 'a>,
    /// `memref<C x k/256 x 8 x f32>`: each block's super-block scale `D`, 8 lanes.
    pub big_d: Value<'c, 'a>,
}

/// Weight rows a [`Stage`] holds: the most a decode thread walks together with several
/// activation rows (`decode_cols`).
pub const STAGE_COLS: usize = 4;

impl<'c, 'a> Stage<'c, 'a> {
    /// Stack buffers for [`STAGE_COLS`] weight rows of `k` elements of a k-quant.
    pub fn alloca(b: Kb<'c, 'a>, dtype: DType, k: usize) -> Self {
        let (slots, blocks) = (k / GROUP, k / dtype.block_elems());
        Stage {
            codes: b.alloca(&format!("memref<{STAGE_COLS}x{slots}x{GROUP}xi8>")),
            scales: b.alloca(&format!("memref<{STAGE_COLS}x{slots}x16xi16>")),
            offsets: b.alloca(&format!("memref<{STAGE_COLS}x{blocks}x16xf32>")),
            sub_scales: b.alloca(&format!("memref<{STAGE_COLS}x{blocks}x16xi16>")),
            big_d: b.alloca(&format!("memref<{STAGE_COLS}x{blocks}x8xf32>")),
        }
    }
}

/// Whether a k-quant's offsets are min terms with a float scale of their own (`dmin`: q2_k,
/// q4_k, q5_k), added in f32 ([`offset_terms`]); q3_k's and q6_k's offsets (their codes read
/// unsigned as `c + 4` and `c + 32`) share the block's scale and are subtracted in integers
/// ([`int_offsets`]).
pub fn has_min_terms(dtype: DType) -> bool {
    matches!(dtype, DType::Q2K | DType::Q4K | DType::Q5K)
}

/// `acc` plus a k-quant block's min terms for activation row `r` from its `factors`
/// ([`CodeBlock::offset_factors`]) times `d·Σq`: per 32 elements (q4_k, q5_k) or per 16 (q2_k).
pub fn offset_terms<'c, 'a>(
    b: Kb<'c, 'a>,
    dtype: DType,
    factors: Value<'c, '_>,
    acc: Value<'c, '_>,
    acts: &Acts<'c, '_>,
    r: Value<'c, '_>,
    blk: Value<'c, '_>,
) -> Value<'c, 'a> {
    if matches!(dtype, DType::Q4K | DType::Q5K) {
        let s = b.load_f32(acts.s32, &[r, b.muli(blk, b.idx(8))], 8);
        return b.fma(factors, s, acc);
    }
    let at = b.muli(blk, b.idx(16));
    let lo = b.load_f32(acts.s16, &[r, at], 8);
    let hi = b.load_f32(acts.s16, &[r, b.addi(at, b.idx(8))], 8);
    b.fma(b.slice(factors, 8, 8), hi, b.fma(b.slice(factors, 0, 8), lo, acc))
}

/// q3_k/q6_k: a block's `Σ sc·(c + off)·q` (8 i32 lanes, `off` 4 or 32) minus
/// `off · Σ sc·Σq` per sub-block of 16 (one `vpmaddwd` of the sub-block scales and activation
/// row `r`'s sums per 16, and a shift): `Σ sc·c·q` exactly, in integers, where a float offset
/// term per sub-block would cost a conversion of the scales and two FMAs per row. No
/// overflow: the corrected sum stays below `2^26` in magnitude.
pub fn int_offsets<'c, 'a>(
    b: Kb<'c, 'a>,
    dtype: DType,
    scales: Value<'c, '_>,
    sums: Value<'c, '_>,
    acts: &Acts<'c, '_>,
    r: Value<'c, '_>,
    blk: Value<'c, '_>,
) -> Value<'c, 'a> {
    let bsums = b.load_vec(acts.bsums16, &[r, b.muli(blk, b.idx(16))], 16, "i16");
    int_offsets_of(b, dtype, scales, sums, bsums)
}

/// [`int_offsets`] from the rows' sums per 16 (`bsums`, i16), for any number of rows side by
/// side (`scales` repeated for each): `sums - (Σ sc·bsum) << shift`, lane by lane.
pub fn int_offsets_of<'c, 'a>(
    b: Kb<'c, 'a>,
    dtype: DType,
    scales: Value<'c, '_>,
    sums: Value<'c, '_>,
    bsums: Value<'c, '_>,
) -> Value<'c, 'a> {
    let shift = match dtype {
        DType::Q3K => 2,
        DType::Q6K => 5,
        other => unreachable!("{other}'s offsets are min terms"),
    };
    let lanes = crate::ir::lanes_of(sums);
    let terms = b.shli(b.madd_i16(scales, bsums), b.int_splat(shift, lanes, "i32"));
    b.subi(sums, terms)
}

/// The byte order of [`crate::emit::q8_layouts::word_pairs`] over two 32-byte vectors `x` (indices
/// 0..32) and `y` (32..64): `(low, high)` masks. In each 4-byte lane, `low` holds `x`'s first
/// two bytes then `y`'s, `high` their last two. `vpmaddubsw` pairs bytes `2j, 2j + 1`, so
/// i32 lane `i` of `vpmaddwd(low_sums + high_sums, [sc_x, sc_y, ..])` is
/// `sc_x·(x's pairs 2i and 2i+1) + sc_y·(y's)`: the same integers the one-group code leaves in
/// lane `i`, so the lanes' float steps, and the outputs, stay bitwise the decode's.
pub fn word_pair_masks() -> (Vec<usize>, Vec<usize>) {
    let half = |first: usize| -> Vec<usize> {
        (0..8)
            .flat_map(|d| {
                let at = 4 * d + first;
                [at, at + 1, 32 + at, 32 + at + 1]
            })
            .collect()
    };
    (half(0), half(2))
}

/// Groups `2c` and `2c + 1`'s codes in the order of
/// [`crate::emit::q8_layouts::word_pairs`], so that `vpmaddubsw` leaves group `2c`'s pair sums in
/// its even i16 lanes and group `2c + 1`'s in its odd ones.
pub fn word_pair_codes<'c, 'a>(
    b: Kb<'c, 'a>,
    block: &mut CodeBlock<'c, 'a, '_>,
    c: usize,
) -> (Value<'c, 'a>, Value<'c, 'a>) {
    let (x, y) = (block.codes(2 * c), block.codes(2 * c + 1));
    let (low, high) = word_pair_masks();
    (b.shuffle_any(x, y, &low), b.shuffle_any(x, y, &high))
}
