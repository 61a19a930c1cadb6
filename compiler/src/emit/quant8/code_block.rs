//! One weight block read as 8-bit codes for `--precision q8`, with the integer scales and
//! factors that turn its code sums into its share of a dot product.

use super::{Acts, GROUP, supports};
use crate::emit::quant::{self, BlockReader};
use crate::ir::Kb;
use kiln_core::DType;
use melior::ir::Value;
use std::collections::HashMap;

/// One block of a quantised weight row read as 8-bit codes, 32 at a time, with the factors
/// that turn `Σ c·q` into the block's share of a dot product.
pub struct CodeBlock<'c, 'a, 'w> {
    b: Kb<'c, 'a>,
    w: Value<'c, 'w>,
    row: Value<'c, 'w>,
    base: Value<'c, 'a>,
    dtype: DType,
    /// The exact mode's reader, for the k-quants' scale vectors.
    reader: BlockReader<'c, 'a, 'w>,
    bytes: HashMap<(usize, usize), Value<'c, 'a>>,
    /// The k-quants' sub-block scales as i16 lanes ([`Self::int_scale`]).
    int_scales: Option<Value<'c, 'a>>,
    /// [`Self::scale_parts`] by its parts, each made once per block.
    scale_parts: Vec<(usize, Value<'c, 'a>)>,
    /// q4_k/q5_k: [`Self::k4_words`], made once per block.
    k4_words: Option<(Value<'c, 'a>, Value<'c, 'a>)>,
    high: Option<Value<'c, 'a>>,
}

impl<'c, 'a, 'w> CodeBlock<'c, 'a, 'w> {
    /// Block `blk` of row `row` of `w` (`memref<N x ROWBYTES x i8>`); emits nothing until asked.
    pub fn new(b: Kb<'c, 'a>, w: Value<'c, 'w>, dtype: DType, row: Value<'c, 'w>, blk: Value<'c, 'w>) -> Self {
        assert!(supports(dtype), "{dtype} has no 8-bit dot product");
        let base = b.muli(blk, b.idx(dtype.block_bytes()));
        CodeBlock {
            b,
            w,
            row,
            base,
            dtype,
            reader: BlockReader::new(b, w, dtype, row, blk, 16, quant::Zeros::Either),
            bytes: HashMap::new(),
            int_scales: None,
            scale_parts: Vec::new(),
            k4_words: None,
            high: None,
        }
    }

    /// The block's format.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Groups of [`GROUP`] elements in the block.
    pub fn groups(&self) -> usize {
        self.dtype.block_elems() / GROUP
    }

    /// `n` bytes at `off` within the block, loaded once.
    fn load(&mut self, off: usize, n: usize) -> Value<'c, 'a> {
        let (b, w, row, base) = (self.b, self.w, self.row, self.base);
        *self
            .bytes
            .entry((off, n))
            .or_insert_with(|| b.load_bytes(w, &[row, b.addi(base, b.idx(off))], n))
    }

    fn splat8(&self, v: i64, n: usize) -> Value<'c, 'a> {
        self.b.int_splat(v, n, "i8")
    }

    /// Bits `bit..bit + width` of each byte, moved to bit `to`.
    fn field(&self, v: Value<'c, 'a>, bit: i64, width: i64, to: i64) -> Value<'c, 'a> {
        let b = self.b;
        let moved = match bit - to {
            0 => v,
            s if s > 0 => b.shrui(v, self.splat8(s, 32)),
            s => b.shli(v, self.splat8(-s, 32)),
        };
        b.andi(moved, self.splat8(((1 << width) - 1) << to, 32))
    }

    /// The 32 codes of group `g` (elements `32 g ..`) as a `vector<32xi8>` in element order:
    /// unsigned, but q8_0's signed.
    pub fn codes(&mut self, g: usize) -> Value<'c, 'a> {
        let b = self.b;
        match self.dtype {
            DType::Q8_0 => self.load(2, 32),
            DType::Q4_0 | DType::Q4_1 | DType::Q5_0 | DType::Q5_1 => {
                // Element j < 16 is the low nibble of qs[j], element j + 16 its high nibble; the
                // 5-bit formats add bit j of the little-endian u32 qh as bit 4.
                let (qh, qs) = quant::nibble_layout(self.dtype);
                let raw = self.load(qs, 16);
                let lo = b.andi(raw, self.splat8(15, 16));
                let hi = b.shrui(raw, self.splat8(4, 16));
                let codes = b.shuffle_any(lo, hi, &(0..32).collect::<Vec<_>>());
                match qh {
                    Some(off) => b.ori(codes, self.high_bits(off)),
                    None => codes,
                }
            }
            _ => {
                let fields = kquant_fields(self.dtype, g);
                let parts: Vec<Value> = fields
                    .iter()
                    .map(|f| {
                        let raw = self.load(f.off, 32);
                        self.field(raw, f.bit, f.width, f.to)
                    })
                    .collect();
                parts
                    .into_iter()
                    .reduce(|a, p| b.ori(a, p))
                    .expect("a code has a field")
            }
        }
    }

    /// Groups `2c` and `2c + 1`'s codes side by side as a `vector<64xi8>` (one 512-bit
    /// register): the bytes of [`Self::codes`] for both groups, each 32-byte source loaded once
    /// for the two halves, and each half's field moved into place by rotating its 64-bit lanes
    /// (`vprolvq`; a field never crosses a byte, so the bits a rotation carries across bytes
    /// are the ones the mask drops). Two or three instructions per field for 64 codes where
    /// two 256-bit groups take two to four each.
    pub fn pair_codes_wide(&mut self, c: usize) -> Value<'c, 'a> {
        let b = self.b;
        let (first, second) = (kquant_fields(self.dtype, 2 * c), kquant_fields(self.dtype, 2 * c + 1));
        let parts: Vec<Value> = first
            .iter()
            .zip(&second)
            .map(|(f0, f1)| {
                assert_eq!(
                    (f0.width, f0.to),
                    (f1.width, f1.to),
                    "{} pairs unlike fields",
                    self.dtype
                );
                let both = if f0.off == f1.off {
                    let raw = self.load(f0.off, 32);
                    b.shuffle_any(raw, raw, &(0..32).chain(0..32).collect::<Vec<_>>())
                } else if f1.off == f0.off + 32 {
                    self.load(f0.off, 64)
                } else {
                    let (lo, hi) = (self.load(f0.off, 32), self.load(f1.off, 32));
                    b.shuffle_any(lo, hi, &(0..64).collect::<Vec<_>>())
                };
                let turn = |f: &Field| (f.to - f.bit).rem_euclid(64);
                let moved = if (turn(f0), turn(f1)) == (0, 0) {
                    both
                } else {
                    let words = b.vbitcast(both, "vector<8xi64>");
                    let by: Vec<i64> = (0..8).map(|l| if l < 4 { turn(f0) } else { turn(f1) }).collect();
                    let by = b.int_vec(&by, "i64");
                    let turned = b.intrinsic("llvm.fshl.v8i64", &[words, words, by], b.vec_ty(8, "i64"));
                    b.vbitcast(turned, "vector<64xi8>")
                };
                b.andi(moved, b.int_splat(((1 << f0.width) - 1) << f0.to, 64, "i8"))
            })
            .collect();
        parts
            .into_iter()
            .reduce(|a, p| b.ori(a, p))
            .expect("a code has a field")
    }

    /// Two nibble-format blocks' codes in the order of [`crate::emit::q8_layouts::pairs`]:
    /// `([self's 0..16 | next's 0..16], [self's 16..32 | next's 16..32])`.
    pub fn pair_codes(&mut self, next: &mut Self) -> (Value<'c, 'a>, Value<'c, 'a>) {
        let b = self.b;
        let (qh, qs) = quant::nibble_layout(self.dtype);
        let raw = b.shuffle_any(self.load(qs, 16), next.load(qs, 16), &(0..32).collect::<Vec<_>>());
        let (lo, hi) = (b.andi(raw, self.splat8(15, 32)), b.shrui(raw, self.splat8(4, 32)));
        match qh {
            Some(off) => {
                let (mine, theirs) = (self.high_bits(off), next.high_bits(off));
                let low: Vec<usize> = (0..16).chain(32..48).collect();
                let high: Vec<usize> = (16..32).chain(48..64).collect();
                (
                    b.ori(lo, b.shuffle_any(mine, theirs, &low)),
                    b.ori(hi, b.shuffle_any(mine, theirs, &high)),
                )
            }
            None => (lo, hi),
        }
    }

    /// q5_0/q5_1: bit j of the u32 at `off` as 16 in byte j, else 0 (each byte picks the byte of
    /// the word holding its bit, then tests its bit).
    fn high_bits(&mut self, off: usize) -> Value<'c, 'a> {
        if let Some(h) = self.high {
            return h;
        }
        let b = self.b;
        let word = self.load(off, 4);
        let spread = b.shuffle_any(word, word, &(0..32).map(|j| j / 8).collect::<Vec<_>>());
        let bit: Vec<i64> = (0..32).map(|j| 1 << (j % 8)).collect();
        let bit = b.int_vec(&bit, "i8");
        // All ones where the bit is set (`vpcmpeqb`), masked to 16.
        let set = b.extsi(b.cmpi(crate::ir::Cmp::Eq, b.andi(spread, bit), bit), "i8");
        let h = b.andi(set, self.splat8(16, 32));
        self.high = Some(h);
        h
    }

    /// A k-quant's sub-block scales as 16 i16 lanes, made on first use: q4_k/q5_k its 6-bit
    /// scales (lanes 0..8; its mins in 8..16, [`Self::k4_words`]), q6_k its signed bytes,
    /// q2_k its low nibbles, q3_k its signed 6-bit scales. Unpacked in i16 lanes (one 256-bit
    /// vector) rather than the exact mode's i32 lanes (two).
    fn int_scales(&mut self) -> Value<'c, 'a> {
        if let Some(v) = self.int_scales {
            return v;
        }
        let b = self.b;
        let v = match self.dtype {
            DType::Q4K | DType::Q5K => {
                let (scales, mins) = self.k4_words();
                let both = b.vbitcast(b.shuffle_any(scales, mins, &[0, 1]), "vector<16xi8>");
                b.extui(both, "i16")
            }
            DType::Q6K => b.extsi(self.load(192, 16), "i16"),
            DType::Q2K => b.andi(b.extui(self.load(0, 16), "i16"), b.int_splat(15, 16, "i16")),
            _ => b.trunci(self.reader.int_scales(), "i16"),
        };
        self.int_scales = Some(v);
        v
    }

    /// q4_k/q5_k: [`quant::k4_words`] of the block, made once.
    fn k4_words(&mut self) -> (Value<'c, 'a>, Value<'c, 'a>) {
        if let Some(w) = self.k4_words {
            return w;
        }
        let w = quant::k4_words(self.b, self.w, self.row, self.base);
        self.k4_words = Some(w);
        w
    }

    /// A k-quant's sub-block scales for group `g`'s 16 i16 pair sums (pair `j` holds elements
    /// `2j, 2j + 1`): q4_k/q5_k the group's one scale; q2_k, q3_k and q6_k (sub-blocks of 16)
    /// sub-block `2g`'s for pairs 0..8 and `2g + 1`'s for pairs 8..16.
    pub fn int_scale(&mut self, g: usize) -> Value<'c, 'a> {
        self.pick_scales(2, |_| g)
    }

    /// The scales of [`Self::pair_codes_wide`]'s 32 i16 pair sums: quarter `q` (lanes
    /// `8q .. 8q + 8`, elements `16q ..` of the pair) takes q4_k's/q5_k's group `2c + q / 2`
    /// scale, the others' sub-block `4c + q`.
    pub fn pair_scale_wide(&mut self, c: usize) -> Value<'c, 'a> {
        let whole_groups = matches!(self.dtype, DType::Q4K | DType::Q5K);
        self.pick_scales(4, |q| if whole_groups { 2 * c + q / 2 } else { c })
    }

    /// `8 · parts` i16 scales, each 128-bit part `p` all the scale at `pick(p)` in that part of
    /// [`Self::scale_parts`]: one in-lane `vpshufb` (q4_k/q5_k: of the scale bytes, zero-extended
    /// by the same shuffle).
    fn pick_scales(&mut self, parts: usize, pick: impl Fn(usize) -> usize) -> Value<'c, 'a> {
        let b = self.b;
        let source = self.scale_parts(parts);
        if matches!(self.dtype, DType::Q4K | DType::Q5K) {
            let zeros = b.int_splat(0, 16 * parts, "i8");
            let mask: Vec<usize> = (0..16 * parts)
                .map(|m| {
                    if m % 2 == 0 {
                        16 * (m / 16) + pick(m / 16)
                    } else {
                        16 * parts
                    }
                })
                .collect();
            return b.vbitcast(
                b.shuffle_any(source, zeros, &mask),
                &format!("vector<{}xi16>", 8 * parts),
            );
        }
        let mask: Vec<usize> = (0..8 * parts).map(|j| 8 * (j / 8) + pick(j / 8)).collect();
        b.shuffle_any(source, source, &mask)
    }

    /// The block's scales laid out for [`Self::pick_scales`] in a vector of `parts` 128-bit
    /// parts (two for 256-bit group steps, four for 512-bit pair steps), made once per block:
    /// q4_k/q5_k the 8 scale bytes ([`Self::k4_words`]) in every part; else i16 sub-block
    /// scales, part `p` holding sub-blocks `p, p + parts, p + 2 · parts, ..`. Each group's
    /// scales are then one in-lane `vpshufb`, not a cross-lane broadcast of two instructions
    /// (the 8 broadcasts per block were the decode loop's busiest port). Opaque, or LLVM folds
    /// the shuffles back into one cross-lane broadcast per group.
    fn scale_parts(&mut self, parts: usize) -> Value<'c, 'a> {
        if let Some(&(_, v)) = self.scale_parts.iter().find(|(p, _)| *p == parts) {
            return v;
        }
        let b = self.b;
        let v = if matches!(self.dtype, DType::Q4K | DType::Q5K) {
            let scales = b.extract_lane(self.k4_words().0, 0);
            b.vbitcast(b.splat_scalar(scales, 2 * parts), &format!("vector<{}xi8>", 16 * parts))
        } else {
            let all = self.int_scales();
            let mask: Vec<usize> = (0..8 * parts).map(|j| (j / 8 + parts * (j % 8)) % 16).collect();
            b.shuffle_any(all, all, &mask)
        };
        let v = b.opaque(v);
        self.scale_parts.push((parts, v));
        v
    }

    /// Groups `2c` and `2c + 1`'s scales alternating, for pair sums whose lanes alternate
    /// between the two groups ([`super::word_pair_codes`]).
    pub fn pair_scale(&mut self, c: usize) -> Value<'c, 'a> {
        let all = self.int_scales();
        let mask: Vec<usize> = match self.dtype {
            // One scale per group of 32: lane `2d + h` takes group `2c + h`'s.
            DType::Q4K | DType::Q5K => (0..16).map(|j| 2 * c + j % 2).collect(),
            // Scales per 16: lane `2d + h` sums elements `4d .. 4d + 4` of group `2c + h`, in
            // its sub-block `d / 4` (of two), whose scale is sub-block `2 (2c + h) + d / 4`.
            _ => (0..16).map(|j| 4 * c + 2 * (j % 2) + j / 8).collect(),
        };
        self.b.shuffle_any(all, all, &mask)
    }

    /// A k-quant block's super-block scale `D` (its `d`), 8 lanes.
    pub fn super_scale(&mut self) -> Value<'c, 'a> {
        self.reader.super_scale(8)
    }

    /// `Σ c·q` of group `g`'s codes and 32 activation codes, as 8 i32 lanes.
    pub fn dot(&self, codes: Value<'c, 'a>, q: Value<'c, '_>, vnni: bool) -> Value<'c, 'a> {
        let b = self.b;
        if self.dtype == DType::Q8_0 {
            return self.pair_dot(b.sign_bytes(codes, codes), b.sign_bytes(q, codes), vnni);
        }
        self.pair_dot(codes, q, vnni)
    }

    /// `Σ u·s` per 4 bytes (unsigned `u`, signed `s`) as 8 i32 lanes.
    fn pair_dot(&self, u: Value<'c, '_>, s: Value<'c, '_>, vnni: bool) -> Value<'c, 'a> {
        let b = self.b;
        if vnni {
            return b.dot_u8_i8(b.int_splat(0, 8, "i32"), u, s);
        }
        b.madd_i16(b.madd_u8_i8(u, s), b.int_splat(1, 16, "i16"))
    }

    /// The factors of the block's min terms, for the formats whose offsets have a float scale
    /// of their own ([`super::has_min_terms`]): q4_k/q5_k 8 lanes, each sub-block's `-dmin · m`;
    /// q2_k 16 lanes of `-dmin · m`.
    pub fn offset_factors(&mut self) -> Value<'c, 'a> {
        let b = self.b;
        match self.dtype {
            DType::Q4K | DType::Q5K => {
                // `-dmin · m`, as the exact mode's scale vector holds it (same product).
                let m = b.extui(b.vbitcast(self.k4_words().1, "vector<8xi8>"), "i32");
                let dmin = b.negf(b.load_f16_splat(self.w, &[self.row, b.addi(self.base, b.idx(2))], 8));
                b.mulf(b.sitofp(m), dmin)
            }
            DType::Q2K => {
                // `-dmin · m` for the high nibbles `m` of its 16 scale bytes (the exact mode's
                // lanes 16..32, the same products).
                let m = b.shrui(b.extui(self.load(0, 16), "i32"), b.int_splat(4, 16, "i32"));
                let dmin = b.negf(b.load_f16_splat(self.w, &[self.row, b.addi(self.base, b.idx(82))], 16));
                b.mulf(b.sitofp(m), dmin)
            }
            other => unreachable!("{other} has no min terms"),
        }
    }

    /// `acc` plus the block's min terms for activation row `r` (see [`super::offset_terms`]).
    pub fn offset_terms(
        &mut self,
        acc: Value<'c, 'a>,
        acts: &Acts<'c, '_>,
        r: Value<'c, '_>,
        blk: Value<'c, '_>,
    ) -> Value<'c, 'a> {
        let factors = self.offset_factors();
        super::offset_terms(self.b, self.dtype, factors, acc, acts, r, blk)
    }

    /// q3_k/q6_k: the sub-block scales in sub-block order (16 i16 lanes), for [`super::int_offsets`].
    pub fn sub_scales(&mut self) -> Value<'c, 'a> {
        assert!(!super::has_min_terms(self.dtype), "{} has min terms", self.dtype);
        self.int_scales()
    }
}

/// One bit field of a k-quant's codes: bits `bit .. bit + width` of each of the 32 bytes at
/// `off` in the block, as bits `to ..` of the code of the same element.
#[derive(Clone, Copy, Debug)]
struct Field {
    off: usize,
    bit: i64,
    width: i64,
    to: i64,
}

/// Where group `g`'s 32 codes (elements `32 g ..`) lie in a k-quant block, ORed together:
/// - q4_k/q5_k: chunk `c` of 64 holds the low nibbles of `qs[32c + l]` (group `2c`), then
///   the high ones; q5_k adds bit `g` of `qh[l]` as bit 4;
/// - q2_k/q3_k: element `128n + 32j + l` is bits `2j .. 2j + 2` of `qs[32n + l]` (`qs` after
///   q2_k's 16 scale bytes, q3_k's 32 hmask bytes); q3_k adds bit `4n + j` of `hmask[l]` as 2;
/// - q6_k: element `128n + 32k + l` is nibble `k / 2` of `ql[64n + 32 (k & 1) + l]`, with bits
///   `2k .. 2k + 2` of `qh[32n + l]` as bits 4..6.
fn kquant_fields(dtype: DType, g: usize) -> Vec<Field> {
    let field = |off: usize, bit: usize, width: i64, to: i64| Field {
        off,
        bit: bit as i64,
        width,
        to,
    };
    match dtype {
        DType::Q4K => vec![field(16 + 32 * (g / 2), 4 * (g % 2), 4, 0)],
        DType::Q5K => vec![field(48 + 32 * (g / 2), 4 * (g % 2), 4, 0), field(16, g, 1, 4)],
        DType::Q2K => vec![field(16 + 32 * (g / 4), 2 * (g % 4), 2, 0)],
        DType::Q3K => vec![field(32 + 32 * (g / 4), 2 * (g % 4), 2, 0), field(0, g, 1, 2)],
        DType::Q6K => {
            let (n, k) = (g / 4, g % 4);
            vec![
                field(64 * n + 32 * (k & 1), 4 * (k / 2), 4, 0),
                field(128 + 32 * n, 2 * k, 2, 4),
            ]
        }
        other => unreachable!("{other} is not a k-quant"),
    }
}
