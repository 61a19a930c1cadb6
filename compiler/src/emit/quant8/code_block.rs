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
    /// [`Self::int_scale`]'s source vector, made once per block.
    halves: Option<Value<'c, 'a>>,
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
            halves: None,
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
            DType::Q4K | DType::Q5K => {
                // Chunk c of 64: the low nibbles of qs[32c + l] (group 2c), then the high ones;
                // q5_k adds bit g of qh[l] as bit 4.
                let qs = if self.dtype == DType::Q4K { 16 } else { 48 };
                let raw = self.load(qs + 32 * (g / 2), 32);
                let code = if g.is_multiple_of(2) {
                    b.andi(raw, self.splat8(15, 32))
                } else {
                    b.shrui(raw, self.splat8(4, 32))
                };
                if self.dtype == DType::Q5K {
                    let qh = self.load(16, 32);
                    b.ori(code, self.field(qh, g as i64, 1, 4))
                } else {
                    code
                }
            }
            DType::Q2K | DType::Q3K => {
                // Element 128n + 32j + l: bits 2j..2j+2 of qs[32n + l] (qs after q2_k's 16
                // scale bytes, q3_k's 32 hmask bytes); q3_k adds bit 4n + j of hmask[l] as 4.
                let (n, j) = (g / 4, g % 4);
                let qs = if self.dtype == DType::Q2K { 16 } else { 32 };
                let raw = self.load(qs + 32 * n, 32);
                let low = self.field(raw, 2 * j as i64, 2, 0);
                if self.dtype == DType::Q3K {
                    let hmask = self.load(0, 32);
                    b.ori(low, self.field(hmask, g as i64, 1, 2))
                } else {
                    low
                }
            }
            DType::Q6K => {
                // Element 128n + 32k + l: nibble k / 2 of ql[64n + 32 (k & 1) + l], bits 2k..2k+2
                // of qh[32n + l] as bits 4..6.
                let (n, k) = (g / 4, g % 4);
                let ql = self.load(64 * n + 32 * (k & 1), 32);
                let low = if k < 2 {
                    b.andi(ql, self.splat8(15, 32))
                } else {
                    b.shrui(ql, self.splat8(4, 32))
                };
                let qh = self.load(128 + 32 * n, 32);
                b.ori(low, self.field(qh, 2 * k as i64, 2, 4))
            }
            other => unreachable!("{other} has no 8-bit codes"),
        }
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
    /// scales (lanes 0..8; its mins in 8..16, [`Self::k4_six_bits`]), q6_k its signed bytes,
    /// q2_k its low nibbles, q3_k its signed 6-bit scales. Unpacked in i16 lanes (one 256-bit
    /// vector) rather than the exact mode's i32 lanes (two).
    fn int_scales(&mut self) -> Value<'c, 'a> {
        if let Some(v) = self.int_scales {
            return v;
        }
        let b = self.b;
        let v = match self.dtype {
            DType::Q4K | DType::Q5K => self.k4_six_bits(),
            DType::Q6K => b.extsi(self.load(192, 16), "i16"),
            DType::Q2K => b.andi(b.extui(self.load(0, 16), "i16"), b.int_splat(15, 16, "i16")),
            _ => b.trunci(self.reader.int_scales(), "i16"),
        };
        self.int_scales = Some(v);
        v
    }

    /// q4_k/q5_k: the 6-bit `sc_j` (lanes 0..8) and `m_j` (lanes 8..16) as i16 lanes, unpacked
    /// as ggml's `get_scale_min_k4` (the layout of `quant.rs`'s `k4_six_bits`): for `j < 4`
    /// the low 6 bits of bytes `j` and `j + 4` of the 12 scale bytes; for `j >= 4` the low
    /// (high) nibble of byte `j + 4` plus the top 2 bits of byte `j - 4` (`j`) as bits 4..6.
    fn k4_six_bits(&mut self) -> Value<'c, 'a> {
        let b = self.b;
        let raw = self.load(4, 16);
        let lane = |s: usize| (s % 8, s >= 8);
        let p_src: Vec<usize> = (0..16)
            .map(|s| match lane(s) {
                (j, false) if j < 4 => j,
                (j, _) => j + 4,
            })
            .collect();
        let q_src: Vec<usize> = (0..16)
            .map(|s| match lane(s) {
                (j, _) if j < 4 => 0,
                (j, true) => j,
                (j, false) => j - 4,
            })
            .collect();
        let p_shift: Vec<i64> = (0..16)
            .map(|s| match lane(s) {
                (j, true) if j >= 4 => 4,
                _ => 0,
            })
            .collect();
        let p_mask: Vec<i64> = (0..16).map(|s| if s % 8 < 4 { 63 } else { 15 }).collect();
        let q_mask: Vec<i64> = (0..16).map(|s| if s % 8 < 4 { 0 } else { 0x30 }).collect();
        let p = b.extui(b.shuffle_any(raw, raw, &p_src), "i16");
        let q = b.extui(b.shuffle_any(raw, raw, &q_src), "i16");
        let p = b.andi(b.shrui(p, b.int_vec(&p_shift, "i16")), b.int_vec(&p_mask, "i16"));
        let q = b.andi(b.shrui(q, b.int_splat(2, 16, "i16")), b.int_vec(&q_mask, "i16"));
        b.ori(p, q)
    }

    /// A k-quant's sub-block scales for group `g`'s 16 i16 pair sums (pair `j` holds elements
    /// `2j, 2j + 1`): q4_k/q5_k the group's one scale; q2_k, q3_k and q6_k (sub-blocks of 16)
    /// sub-block `2g`'s for pairs 0..8 and `2g + 1`'s for pairs 8..16.
    pub fn int_scale(&mut self, g: usize) -> Value<'c, 'a> {
        let b = self.b;
        let halves = self.scale_halves();
        let mask: Vec<usize> = (0..16).map(|j| 8 * (j / 8) + g).collect();
        b.shuffle_any(halves, halves, &mask)
    }

    /// The block's scales with each 128-bit half holding the 8 that [`Self::int_scale`]
    /// broadcasts from (q4_k/q5_k: the group scales in both halves; else the even sub-blocks'
    /// in the low half, the odd ones' in the high half), made once per block: each group's
    /// vector is then one in-lane `vpshufb`, not a cross-lane broadcast of two instructions
    /// (the 8 broadcasts per block were the decode loop's busiest port). Opaque, or LLVM
    /// folds the two shuffles back into one cross-lane broadcast per group.
    fn scale_halves(&mut self) -> Value<'c, 'a> {
        if let Some(h) = self.halves {
            return h;
        }
        let b = self.b;
        let all = self.int_scales();
        let mask: Vec<usize> = match self.dtype {
            DType::Q4K | DType::Q5K => (0..16).map(|j| j % 8).collect(),
            _ => (0..16).map(|j| 2 * (j % 8) + j / 8).collect(),
        };
        let h = b.opaque(b.shuffle_any(all, all, &mask));
        self.halves = Some(h);
        h
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

    /// A k-quant group's `Σ sc·c·q` as 8 i32 lanes: `vpmaddubsw` pairs (unsigned codes below
    /// 64, so no saturation) times their sub-block scale in `vpmaddwd` (q3_k's signed).
    pub fn scaled_dot(&self, codes: Value<'c, 'a>, q: Value<'c, '_>, scale: Value<'c, 'a>) -> Value<'c, 'a> {
        let b = self.b;
        b.madd_i16(b.madd_u8_i8(codes, q), scale)
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
                let m = b.extui(b.slice(self.int_scales(), 8, 8), "i32");
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
