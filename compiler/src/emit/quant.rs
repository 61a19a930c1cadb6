//! GGML block formats dequantised in registers.
//!
//! A quantised `[n, k]` weight is passed as `memref<n x ROWBYTES x i8>`: row `r` is
//! `k / block_elems` consecutive blocks, laid out exactly as GGML stores them (see
//! `core/src/dequant.rs`, the reference these emitters reproduce). Nothing is assumed
//! about alignment: every load is an unaligned vector load of bytes.
//!
//! [`BlockReader`] turns one block into f32 vectors of `lanes` lanes in k order, one vector
//! where it is asked for ([`dequant_block`]: all of them at once). Each format
//! is described the same way: per group of `lanes` elements an integer *code* vector (the
//! quantised value as an unsigned or signed integer, extracted with vector shifts and masks), and
//! per *scale group* (the elements sharing a scale, and a min where the format has one) an
//! [`Affine`] map from code to value. The reference writes these maps as `(c - off) * d`,
//! `c * d + m` or `d * c - m`, each operation rounding separately. For a matmul ([`Zeros::Either`])
//! each is one fused multiply-add `c * d + a` (`a` = `-off * d`, `m` or `-m`), which gives the
//! reference's value: `off` is a power of two, so `-off * d` is exact and `(c - off) * d` is
//! rounded once on both sides; and where the reference rounds `c * d` before adding, that
//! product is exact (a code of at most 5 bits times an f16 scale, or times an f16 scale
//! multiplied by a 6-bit sub-block scale: at most 22 significant bits), so its rounding was a
//! no-op. The one difference: where `c == off`, `c * d - off * d` is `+0` while the reference's
//! `0 * d` is `-0` for a negative `d`. No matmul output can tell: its accumulators start at
//! `+0`, and adding a zero of either sign to them leaves them as they are. The embedding,
//! whose output *is* the values, asks for [`Zeros::Signed`] and gets `(c - off) * d` written
//! the reference's way. One conversion and one FMA per vector instead of a conversion, a
//! multiply and an add.
//!
//! With AVX-512 (16 lanes) the formats whose codes have at most 5 bits and whose scale groups
//! span 32 elements or more (q4_0, q4_1, q5_0, q5_1, q4_k, q5_k) evaluate the affine map once per
//! scale group on all 16 or 32 possible codes (a *table*, computed with the same operation on
//! the same operands, hence the same values), and look each code up with one `vpermps`
//! (16 entries) or `vpermi2ps` (32 entries): a conversion and an FMA per vector become one
//! permute. The other formats, and every format on narrower machines, convert the codes and
//! apply the map per vector.

use crate::ir::Kb;
use kiln_core::DType;
use melior::ir::Value;
use std::collections::HashMap;

/// `vpermps` with a 512-bit table: `out[i] = table[idx[i] & 15]`.
const PERMPS_512: &str = "llvm.x86.avx512.permvar.sf.512";
/// `vpermi2ps` with two 512-bit tables: `out[i] = (idx[i] & 16 ? hi : lo)[idx[i] & 15]`.
const PERMI2PS_512: &str = "llvm.x86.avx512.vpermi2var.ps.512";

/// Whether a value that is zero must carry the reference's sign (see the module's note).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Zeros {
    /// Every value bitwise the reference's, the sign of a zero included: values that are
    /// stored as they are (the embedding).
    Signed,
    /// A zero may have the other sign: values only multiplied into sums that start at `+0`
    /// (matmuls), which then come out bitwise the same.
    Either,
}

/// How the codes of one scale group become values; `d` and `a` are `lanes`-wide splats.
#[derive(Clone, Copy)]
enum Affine<'c, 'a> {
    /// `c as f32 * d` (signed codes: q8_0).
    Scale { d: Value<'c, 'a> },
    /// The reference's `(c - off) * d` (`off` a power of two); `neg` is `-off * d`.
    Offset {
        d: Value<'c, 'a>,
        off: i64,
        neg: Value<'c, 'a>,
    },
    /// `c as f32 * d + a`, rounded once: the reference's `c * d + m` (`a = m`) or `d * c - m`
    /// (`a = -m`), whose product `c * d` is exact.
    Fma { d: Value<'c, 'a>, a: Value<'c, 'a> },
}

impl<'c, 'a> Affine<'c, 'a> {
    fn offset(b: Kb<'c, 'a>, d: Value<'c, 'a>, off: i64, lanes: usize) -> Self {
        debug_assert!((off as u64).is_power_of_two());
        Affine::Offset {
            d,
            off,
            neg: b.mulf(d, b.f32_splat(-(off as f32), lanes)),
        }
    }
}

/// 2^23, whose f32 encoding has an all-zero mantissa: `bits(2^23) | c` encodes `2^23 + c` for
/// any `c < 2^23`.
const MAGIC: f32 = 8_388_608.0;
const MAGIC_BITS: i64 = 0x4B00_0000;

/// Whether `dequant_block` looks codes up in per-scale-group tables for this format and width.
fn uses_tables(dtype: DType, lanes: usize) -> bool {
    lanes == 16
        && cfg!(target_arch = "x86_64")
        && matches!(
            dtype,
            DType::Q4_0 | DType::Q4_1 | DType::Q5_0 | DType::Q5_1 | DType::Q4K | DType::Q5K
        )
}

/// The values of block `blk` of row `row` of the quantised weight `w` (`memref<N x ROWBYTES x
/// i8>`), as `dtype.block_elems() / lanes` vectors of `lanes` f32 in k order.
pub fn dequant_block<'c, 'a>(
    b: Kb<'c, 'a>,
    w: Value<'c, '_>,
    dtype: DType,
    row: Value<'c, '_>,
    blk: Value<'c, '_>,
    lanes: usize,
    zeros: Zeros,
) -> Vec<Value<'c, 'a>> {
    let mut block = BlockReader::new(b, w, dtype, row, blk, lanes, zeros);
    (0..block.groups()).map(|g| block.value(g)).collect()
}

/// One block of a quantised row, read one group of `lanes` values at a time: [`Self::value`]
/// emits the loads and arithmetic of group `g` where it is asked for, and a scale group's
/// factors (splats, or its lookup table) when its first group is.
///
/// Why lazily: a decode step folds each group into an FMA as soon as it exists. Emitting a
/// whole block's values (or all 8–16 scale splats) up front kept them all live at once; with
/// 16 registers (AVX2) a 256-element block of two rows spilled to the stack. In k order the
/// groups of a scale group are consecutive, so each factor lives only while it is used.
pub struct BlockReader<'c, 'a, 'w> {
    blk: Blk<'c, 'a, 'w>,
    dtype: DType,
    zeros: Zeros,
    /// The format's per-block vector of scales (k-quants: one lane per scale group), made once.
    scales: Option<Value<'c, 'a>>,
    /// q5_0/q5_1: the 32 high bits as a splat u32 word.
    high_word: Option<Value<'c, 'a>>,
    affines: HashMap<usize, Affine<'c, 'a>>,
    tables: HashMap<usize, Vec<Value<'c, 'a>>>,
}

impl<'c, 'a, 'w> BlockReader<'c, 'a, 'w> {
    /// A reader of block `blk` of row `row` of `w`; emits nothing until asked.
    pub fn new(
        b: Kb<'c, 'a>,
        w: Value<'c, 'w>,
        dtype: DType,
        row: Value<'c, 'w>,
        blk: Value<'c, 'w>,
        lanes: usize,
        zeros: Zeros,
    ) -> Self {
        assert!(dtype.is_quantized(), "{dtype} is not a block format");
        assert!(
            lanes.is_power_of_two() && lanes <= 16,
            "quantised blocks are read in groups of at most 16 lanes"
        );
        let base = b.muli(blk, b.idx(dtype.block_bytes()));
        let blk = Blk {
            b,
            w,
            row,
            base,
            lanes,
            cache: HashMap::new(),
            six_bits: None,
        };
        BlockReader {
            blk,
            dtype,
            zeros,
            scales: None,
            high_word: None,
            affines: HashMap::new(),
            tables: HashMap::new(),
        }
    }

    /// The number of groups (vectors) in the block.
    pub fn groups(&self) -> usize {
        self.dtype.block_elems() / self.blk.lanes
    }

    /// The values of group `g` (elements `g * lanes ..`), bitwise the reference's (up to the
    /// sign of a zero with [`Zeros::Either`]).
    pub fn value(&mut self, g: usize) -> Value<'c, 'a> {
        let b = self.blk.b;
        let tables = uses_tables(self.dtype, self.blk.lanes);
        if self.dtype == DType::Q5_0 && self.zeros == Zeros::Either && !tables {
            return self.q5_0_value(g);
        }
        let (code, sg) = self.code(g);
        if tables {
            let bits = if matches!(self.dtype, DType::Q5_0 | DType::Q5_1 | DType::Q5K) {
                5
            } else {
                4
            };
            if !self.tables.contains_key(&sg) {
                let t = table(b, self.affine(sg), bits, self.zeros);
                self.tables.insert(sg, t);
            }
            lookup(b, &self.tables[&sg], code)
        } else {
            let a = self.affine(sg);
            apply(b, a, code, self.blk.lanes, self.zeros)
        }
    }

    /// A q5_0 group without assembling its 5-bit codes: `(c - 16) * d` is `nib * d + a` with
    /// `a = -16 * d` where the high bit is clear and `0` where it is set (then `nib * d` is
    /// exact). The high bit of each lane is shifted to the lane's sign bit (`vpsllvd`), which a
    /// blend reads directly (`vblendvps`): two instructions where masking the bit, moving it to
    /// bit 4 and merging it into the code took three, and with fewer constants live.
    fn q5_0_value(&mut self, g: usize) -> Value<'c, 'a> {
        let lanes = self.blk.lanes;
        let e = g * lanes;
        let b = self.blk.b;
        let raw = self.blk.bytes(6 + e % 16, lanes, false);
        let nib = if e < 16 {
            b.andi(raw, self.blk.c(15))
        } else {
            b.shrui(raw, self.blk.c(4))
        };
        let word = self.high_word(2);
        let shifts: Vec<i64> = (0..lanes as i64).map(|j| 31 - (e as i64 + j)).collect();
        let top = b.shli(word, b.int_vec(&shifts, "i32"));
        let set = b.cmpi(crate::ir::Cmp::Slt, top, self.blk.c(0));
        let Affine::Offset { d, neg, .. } = self.affine(0) else {
            unreachable!("q5_0 is an offset format")
        };
        // -0, not +0: `x + -0` is `x` for every `x`, so `nib * d` keeps its sign when zero, and
        // two non-zero operands make the select the one blend (+0 would be an and-not after a
        // compare).
        let add = b.select(set, b.f32_splat(-0.0, lanes), neg);
        b.fma(b.sitofp(nib), d, add)
    }

    /// The sub-block scales of a k-quant block as integers, 16 i32 lanes: q2_k its 4-bit
    /// scales (not the mins), q3_k its 6-bit scales less 32, q4_k/q5_k the 6-bit `sc_j` in
    /// lanes 0..8 and `m_j` in lanes 8..16, q6_k its 16 signed 8-bit scales. `--precision q8`
    /// multiplies the k-quants' code sums by them in integers (`quant8.rs`).
    pub fn int_scales(&mut self) -> Value<'c, 'a> {
        let b = self.blk.b;
        match self.dtype {
            DType::Q2K => b.andi(self.blk.bytes(0, 16, false), b.int_splat(15, 16, "i32")),
            DType::Q3K => b.subi(self.blk.q3k_scales(), b.int_splat(32, 16, "i32")),
            DType::Q4K | DType::Q5K => self.blk.k4_six_bits(),
            DType::Q6K => self.blk.bytes(192, 16, true),
            other => unreachable!("{other} has no integer sub-block scales"),
        }
    }

    /// A k-quant block's super-block scale `d` (the f16 at its place in each format's layout)
    /// as an f32 splat of `lanes` lanes.
    pub fn super_scale(&mut self, lanes: usize) -> Value<'c, 'a> {
        let at = match self.dtype {
            DType::Q2K => 80,
            DType::Q3K => 108,
            DType::Q4K | DType::Q5K => 0,
            DType::Q6K => 208,
            other => unreachable!("{other} has no super-block scale"),
        };
        self.blk.f16(at, lanes)
    }

    /// The map of scale group `sg`, made on first use.
    fn affine(&mut self, sg: usize) -> Affine<'c, 'a> {
        if let Some(a) = self.affines.get(&sg) {
            return *a;
        }
        let a = self.make_affine(sg);
        self.affines.insert(sg, a);
        a
    }

    /// The format's per-block scale vector, made on first use.
    fn scales(&mut self) -> Value<'c, 'a> {
        if let Some(s) = self.scales {
            return s;
        }
        let b = self.blk.b;
        let s = match self.dtype {
            // Lanes 0..16: `d * (sc & 15)`, lanes 16..32: `-dmin * (sc >> 4)` (exact products).
            DType::Q2K => {
                let d = b.mulf(b.sitofp(self.int_scales()), self.super_scale(16));
                let sc = self.blk.bytes(0, 16, false);
                let m = b.mulf(
                    b.sitofp(b.shrui(sc, b.int_splat(4, 16, "i32"))),
                    b.negf(self.blk.f16(82, 16)),
                );
                b.shuffle_any(d, m, &(0..32).collect::<Vec<_>>())
            }
            // `d * sc` for each sub-block of 16.
            DType::Q3K | DType::Q6K => b.mulf(self.super_scale(16), b.sitofp(self.int_scales())),
            DType::Q4K | DType::Q5K => self.blk.k4_scales_mins(),
            other => unreachable!("{other} has one scale per block"),
        };
        self.scales = Some(s);
        s
    }

    fn make_affine(&mut self, sg: usize) -> Affine<'c, 'a> {
        let lanes = self.blk.lanes;
        let b = self.blk.b;
        match self.dtype {
            DType::Q8_0 => Affine::Scale {
                d: self.blk.f16(0, lanes),
            },
            DType::Q4_0 => Affine::offset(b, self.blk.f16(0, lanes), 8, lanes),
            DType::Q5_0 => Affine::offset(b, self.blk.f16(0, lanes), 16, lanes),
            DType::Q4_1 | DType::Q5_1 => Affine::Fma {
                d: self.blk.f16(0, lanes),
                a: self.blk.f16(2, lanes),
            },
            DType::Q2K | DType::Q4K | DType::Q5K => {
                // The scale vector holds the scale groups' factors, then their negated mins.
                let groups = if self.dtype == DType::Q2K { 16 } else { 8 };
                let s = self.scales();
                Affine::Fma {
                    d: splat(b, s, sg, lanes),
                    a: splat(b, s, groups + sg, lanes),
                }
            }
            DType::Q3K => Affine::offset(b, splat(b, self.scales(), sg, lanes), 4, lanes),
            DType::Q6K => Affine::offset(b, splat(b, self.scales(), sg, lanes), 32, lanes),
            DType::F32 | DType::F16 | DType::BF16 => unreachable!("float weights are not blocks"),
        }
    }

    /// The integer codes of group `g` (i32 lanes) and the scale group they belong to.
    fn code(&mut self, g: usize) -> (Value<'c, 'a>, usize) {
        let lanes = self.blk.lanes;
        let e = g * lanes;
        let b = self.blk.b;
        match self.dtype {
            DType::Q8_0 => (self.blk.bytes(2 + e, lanes, true), 0),
            DType::Q4_0 | DType::Q4_1 | DType::Q5_0 | DType::Q5_1 => {
                // Element j < 16 is the low nibble of qs[j], element j + 16 its high nibble; the
                // 5-bit types add bit j of the little-endian u32 qh as bit 4. qh is splat to
                // every lane and each lane shifts its own bit down (`vpsrlvd`): reading the bits
                // as a `vector<32xi1>` instead is one mask move with AVX-512 but, without mask
                // registers (AVX2), LLVM extracts and inserts every bit in scalar code (about
                // 100 scalar instructions per 32-element block, measured in the x86-64-v3
                // assembly).
                let (qh, qs) = nibble_layout(self.dtype);
                let raw = self.blk.bytes(qs + e % 16, lanes, false);
                let mut code = if e < 16 {
                    b.andi(raw, self.blk.c(15))
                } else {
                    b.shrui(raw, self.blk.c(4))
                };
                if let Some(off) = qh {
                    // Bit j of qh lands on bit 4 of lane j with one variable shift and a mask.
                    // Lanes whose bit is below 4 shift a copy of the word moved up by 4 (the
                    // first group only: bits below 16, so the copy loses none it needs).
                    let word = self.high_word(off);
                    let (src, first) = if e >= 4 {
                        (word, e as i64 - 4)
                    } else {
                        (b.shli(word, self.blk.c(4)), e as i64)
                    };
                    let shifts: Vec<i64> = (0..lanes as i64).map(|j| first + j).collect();
                    let hb = b.andi(b.shrui(src, b.int_vec(&shifts, "i32")), self.blk.c(16));
                    code = b.ori(code, hb);
                }
                (code, 0)
            }
            DType::Q2K => {
                // scales[16] @0, qs[64] @16, d @80, dmin @82. Sub-block `is = 8n + 2s + h` holds
                // 2-bit field `s` of qs[32n + 16h + l], l = 0..16.
                let (n, s, h, l) = (e / 128, (e % 128) / 32, (e % 32) / 16, e % 16);
                let raw = self.blk.bytes(16 + 32 * n + 16 * h + l, lanes, false);
                (self.blk.field(raw, 2 * s as i64, 2, 0), 8 * n + 2 * s + h)
            }
            DType::Q3K => {
                // hmask[32] @0, qs[64] @32, scales[12] @96, d @108. Sub-block `is = 8n + 2s + h`:
                // 2-bit field `s` of qs[32n + 16h + l] plus bit `4n + s` of hmask[16h + l] as
                // bit 2; value `(code - 4) * d * (scale - 32)`.
                let (n, s, h, l) = (e / 128, (e % 128) / 32, (e % 32) / 16, e % 16);
                let qs = self.blk.bytes(32 + 32 * n + 16 * h + l, lanes, false);
                let hm = self.blk.bytes(16 * h + l, lanes, false);
                let low = self.blk.field(qs, 2 * s as i64, 2, 0);
                let high = self.blk.field(hm, (4 * n + s) as i64, 1, 2);
                (b.ori(low, high), 8 * n + 2 * s + h)
            }
            DType::Q4K | DType::Q5K => {
                // d @0, dmin @2, scales[12] @4, (q5_k: qh[32] @16), qs[128] @16 or @48. Chunk c of
                // 64: the low nibbles of qs[32c + l] (sub-block 2c), then the high nibbles
                // (2c + 1); q5_k adds bit 2c (2c + 1) of qh[l] as bit 4.
                let qs = if self.dtype == DType::Q4K { 16 } else { 48 };
                let (c, h, l) = (e / 64, (e % 64) / 32, e % 32);
                let raw = self.blk.bytes(qs + 32 * c + l, lanes, false);
                let mut code = if h == 0 {
                    b.andi(raw, self.blk.c(15))
                } else {
                    b.shrui(raw, self.blk.c(4))
                };
                if self.dtype == DType::Q5K {
                    let qh = self.blk.bytes(16 + l, lanes, false);
                    code = b.ori(code, self.blk.field(qh, (2 * c + h) as i64, 1, 4));
                }
                (code, 2 * c + h)
            }
            DType::Q6K => {
                // ql[128] @0, qh[64] @128, scales[16] (i8) @192, d @208. Element 128n + 32k + l:
                // nibble k / 2 of ql[64n + 32 (k & 1) + l], bits 2k..2k+2 of qh[32n + l] as bits
                // 4..6; value `d * scale[8n + 2k + l / 16] * (code - 32)`.
                let (n, k, l) = (e / 128, (e % 128) / 32, e % 32);
                let ql = self.blk.bytes(64 * n + 32 * (k & 1) + l, lanes, false);
                let low = if k < 2 {
                    b.andi(ql, self.blk.c(15))
                } else {
                    b.shrui(ql, self.blk.c(4))
                };
                let qh = self.blk.bytes(128 + 32 * n + l, lanes, false);
                (
                    b.ori(low, self.blk.field(qh, 2 * k as i64, 2, 4)),
                    8 * n + 2 * k + l / 16,
                )
            }
            DType::F32 | DType::F16 | DType::BF16 => unreachable!("float weights are not blocks"),
        }
    }

    /// q5_0/q5_1's high-bit word at byte `off`, splat to every lane, loaded once.
    fn high_word(&mut self, off: usize) -> Value<'c, 'a> {
        if let Some(w) = self.high_word {
            return w;
        }
        let q = &self.blk;
        let b = q.b;
        let raw = b.load_bytes(q.w, &[q.row, b.addi(q.base, b.idx(off))], 4);
        let word = b.vbitcast(raw, "vector<1xi32>");
        let w = b.shuffle_any(word, word, &vec![0; q.lanes]);
        self.high_word = Some(w);
        w
    }
}

/// One block being read: the byte offset of the block within its row, and the byte vectors
/// already loaded (a group of bytes often feeds several code vectors).
struct Blk<'c, 'a, 'w> {
    b: Kb<'c, 'a>,
    w: Value<'c, 'w>,
    row: Value<'c, 'w>,
    base: Value<'c, 'a>,
    lanes: usize,
    cache: HashMap<(usize, usize, bool), Value<'c, 'a>>,
    /// q4_k/q5_k: the unpacked 6-bit scales and mins ([`Blk::k4_six_bits`]).
    six_bits: Option<Value<'c, 'a>>,
}

impl<'c, 'a, 'w> Blk<'c, 'a, 'w> {
    /// `n` bytes at `off` within the block, widened to i32 lanes (zero- or sign-extended).
    fn bytes(&mut self, off: usize, n: usize, signed: bool) -> Value<'c, 'a> {
        let b = self.b;
        let (w, row, base) = (self.w, self.row, self.base);
        *self.cache.entry((off, n, signed)).or_insert_with(|| {
            let raw = b.load_bytes(w, &[row, b.addi(base, b.idx(off))], n);
            if signed {
                b.extsi(raw, "i32")
            } else {
                b.extui(raw, "i32")
            }
        })
    }
    /// The f16 at `off` as an f32 splat of `lanes` lanes.
    fn f16(&self, off: usize, lanes: usize) -> Value<'c, 'a> {
        let b = self.b;
        b.load_f16_splat(self.w, &[self.row, b.addi(self.base, b.idx(off))], lanes)
    }
    fn c(&self, v: i64) -> Value<'c, 'a> {
        self.b.int_splat(v, self.lanes, "i32")
    }
    /// `v >> s` for `s > 0`, `v << -s` for `s < 0` (i32 lanes).
    fn shift(&self, v: Value<'c, 'a>, s: i64, lanes: usize) -> Value<'c, 'a> {
        let b = self.b;
        match s {
            0 => v,
            s if s > 0 => b.shrui(v, b.int_splat(s, lanes, "i32")),
            s => b.shli(v, b.int_splat(-s, lanes, "i32")),
        }
    }
    /// Bits `bit..bit + width` of each lane, moved to bit `to`.
    fn field(&self, v: Value<'c, 'a>, bit: i64, width: i64, to: i64) -> Value<'c, 'a> {
        let lanes = self.lanes;
        let moved = self.shift(v, bit - to, lanes);
        let mask = ((1i64 << width) - 1) << to;
        self.b.andi(moved, self.b.int_splat(mask, lanes, "i32"))
    }

    /// The 16 unsigned 6-bit scales of a q3_k block (ggml's `kmask` unpacking), as i32 lanes:
    /// scale `s` takes its low 4 bits from nibble `s / 8` of byte `s % 8` and its high 2 bits from
    /// bits `2 (s / 4)..` of byte `8 + s % 4` (bytes of the 12 at offset 96).
    fn q3k_scales(&mut self) -> Value<'c, 'a> {
        let b = self.b;
        // Bytes 94..110: the 12 scale bytes are lanes 2..14 (the block ends at 110).
        let raw = b.load_bytes(self.w, &[self.row, b.addi(self.base, b.idx(94))], 16);
        let lo_src: Vec<usize> = (0..16).map(|s| 2 + s % 8).collect();
        let hi_src: Vec<usize> = (0..16).map(|s| 2 + 8 + s % 4).collect();
        let lo = b.extui(b.shuffle_any(raw, raw, &lo_src), "i32");
        let hi = b.extui(b.shuffle_any(raw, raw, &hi_src), "i32");
        let lo_shift: Vec<i64> = (0..16).map(|s| 4 * (s / 8) as i64).collect();
        let hi_shift: Vec<i64> = (0..16).map(|s| 2 * (s / 4) as i64).collect();
        let lo = b.andi(b.shrui(lo, b.int_vec(&lo_shift, "i32")), b.int_splat(15, 16, "i32"));
        let hi = b.andi(b.shrui(hi, b.int_vec(&hi_shift, "i32")), b.int_splat(3, 16, "i32"));
        b.ori(lo, b.shli(hi, b.int_splat(4, 16, "i32")))
    }

    /// `d * sc_j` (lanes 0..8) and `-dmin * m_j` (lanes 8..16) of a q4_k/q5_k block, with the
    /// 6-bit `sc_j`, `m_j` unpacked as ggml's `get_scale_min_k4`: for `j < 4` the low 6 bits of
    /// bytes `j` and `j + 4`; for `j >= 4` the low (high) nibble of byte `j + 4` plus the top 2
    /// bits of byte `j - 4` (`j`) as bits 4..6.
    fn k4_scales_mins(&mut self) -> Value<'c, 'a> {
        let b = self.b;
        let six = b.sitofp(self.k4_six_bits());
        let d = self.f16(0, 16);
        let dmin = b.negf(self.f16(2, 16));
        let dm = b.shuffle_any(
            d,
            dmin,
            &(0..16).map(|s| if s < 8 { s } else { 16 + s }).collect::<Vec<_>>(),
        );
        b.mulf(six, dm)
    }

    /// The 6-bit `sc_j` (lanes 0..8) and `m_j` (lanes 8..16) of a q4_k/q5_k block as i32 lanes
    /// (see [`Self::k4_scales_mins`]), unpacked once per block in vector lanes: [`k4_words`]'
    /// scalar form made AVX2's exact decode slower (`quant_speed`, q4_k, 18.2 → 16.9
    /// Gweights/s), its general-purpose registers being spent on the loop already.
    fn k4_six_bits(&mut self) -> Value<'c, 'a> {
        if let Some(v) = self.six_bits {
            return v;
        }
        let b = self.b;
        // Bytes 4..20: the 12 scale bytes are lanes 0..12.
        let raw = b.load_bytes(self.w, &[self.row, b.addi(self.base, b.idx(4))], 16);
        // Lane s: scale j = s for s < 8, min j = s - 8 for s >= 8.
        let mut p_src = Vec::new();
        let mut p_shift = Vec::new();
        let mut p_mask = Vec::new();
        let mut q_src = Vec::new();
        let mut q_mask = Vec::new();
        for s in 0..16 {
            let (j, min) = (s % 8, s >= 8);
            p_src.push(if j < 4 && !min { j } else { j + 4 });
            p_shift.push(if j >= 4 && min { 4 } else { 0 });
            p_mask.push(if j < 4 { 63 } else { 15 });
            q_src.push(if j < 4 {
                0
            } else if min {
                j
            } else {
                j - 4
            });
            q_mask.push(if j < 4 { 0 } else { 0x30 });
        }
        let p = b.extui(b.shuffle_any(raw, raw, &p_src), "i32");
        let q = b.extui(b.shuffle_any(raw, raw, &q_src), "i32");
        let p = b.andi(b.shrui(p, b.int_vec(&p_shift, "i32")), b.int_vec(&p_mask, "i32"));
        let q = b.andi(b.shrui(q, b.int_splat(2, 16, "i32")), b.int_vec(&q_mask, "i32"));
        let six = b.ori(p, q);
        self.six_bits = Some(six);
        six
    }
}

/// A q4_k/q5_k block's 6-bit scales `sc_j` and mins `m_j`, one byte each, as two
/// `vector<1xi64>`: ggml's `get_scale_min_k4` over the 12 scale bytes `s` at byte 4 of the block
/// at `base` (for `j < 4`, `sc_j = s[j] & 63` and `m_j = s[j + 4] & 63`; for `j >= 4` the low
/// (high) nibble of `s[j + 4]` with the top two bits of `s[j - 4]` (`s[j]`) as bits 4..6), done
/// on the bytes of two words at once. Scalar instructions, on the integer ports a vector loop
/// leaves idle: unpacked in vectors, the scales took about a third of the vector instructions
/// of a one-row q4_k block in `--precision q8` (`quant_speed`, native, one thread, n = k =
/// 2048: 68 Gweights/s with them, 111 without any).
pub fn k4_words<'c, 'a>(
    b: Kb<'c, 'a>,
    w: Value<'c, '_>,
    row: Value<'c, '_>,
    base: Value<'c, '_>,
) -> (Value<'c, 'a>, Value<'c, 'a>) {
    let load = |off: usize, ty: &str| {
        let bytes = b.load_bytes(
            w,
            &[row, b.addi(base, b.idx(off))],
            if ty.contains("i64") { 8 } else { 4 },
        );
        b.extract_lane(b.vbitcast(bytes, ty), 0)
    };
    // `x`: bytes 0..8 (`sc_0..4`, `m_0..4` in their low 6 bits); `y`: bytes 8..12.
    let x = load(4, "vector<1xi64>");
    let y = b.extui(load(12, "vector<1xi32>"), "i64");
    let k = |v: u64| b.i64c(v as i64);
    let low = b.andi(x, k(0x3f3f_3f3f_3f3f_3f3f));
    // Bytes 0..4: `sc_4..8`, the low nibbles of `y`; bytes 4..8: `m_4..8`, its high nibbles
    // (`y << 28` is `y >> 4` in the high word); both with bits 6..8 of `x`'s bytes as 4..6.
    let nibbles = b.andi(b.ori(y, b.shli(y, b.i64c(28))), k(0x0f0f_0f0f_0f0f_0f0f));
    let high = b.ori(nibbles, b.andi(b.shrui(x, b.i64c(2)), k(0x3030_3030_3030_3030)));
    let scales = b.ori(b.andi(low, k(0xffff_ffff)), b.shli(high, b.i64c(32)));
    let mins = b.ori(b.shrui(low, b.i64c(32)), b.andi(high, k(0xffff_ffff_0000_0000)));
    (b.splat_scalar(scales, 1), b.splat_scalar(mins, 1))
}

/// Byte offsets within a q4_0, q4_1, q5_0 or q5_1 block of the 5-bit formats' high-bit word
/// `qh` (none for the 4-bit ones) and of the 16 nibble bytes `qs` (after the f16 scale, and the
/// f16 min of q4_1/q5_1).
pub fn nibble_layout(dtype: DType) -> (Option<usize>, usize) {
    match dtype {
        DType::Q4_0 => (None, 2),
        DType::Q4_1 => (None, 4),
        DType::Q5_0 => (Some(2), 6),
        DType::Q5_1 => (Some(4), 8),
        other => unreachable!("{other} is not a 32-element nibble format"),
    }
}

/// Lane `i` of `v` repeated `lanes` times.
fn splat<'c, 'a>(b: Kb<'c, 'a>, v: Value<'c, 'a>, i: usize, lanes: usize) -> Value<'c, 'a> {
    b.shuffle_any(v, v, &vec![i; lanes])
}

/// The values of a code vector (i32 lanes, small enough for a signed conversion) under `a`.
fn apply<'c, 'a>(b: Kb<'c, 'a>, a: Affine<'c, 'a>, code: Value<'c, 'a>, lanes: usize, zeros: Zeros) -> Value<'c, 'a> {
    match (a, zeros) {
        // `c - off` exactly, by placing the (non-negative, small) code in the mantissa of 2^23
        // and subtracting `2^23 + off`: the `or` usually merges into the code's last logic op.
        (Affine::Offset { d, off, .. }, Zeros::Signed) => {
            let biased = b.bitcast(b.ori(code, b.int_splat(MAGIC_BITS, lanes, "i32")), "f32");
            b.mulf(b.subf(biased, b.f32_splat(MAGIC + off as f32, lanes)), d)
        }
        _ => of_codes(b, a, b.sitofp(code), lanes, zeros),
    }
}

/// `a` applied to codes already converted to f32.
fn of_codes<'c, 'a>(b: Kb<'c, 'a>, a: Affine<'c, 'a>, c: Value<'c, 'a>, lanes: usize, zeros: Zeros) -> Value<'c, 'a> {
    match (a, zeros) {
        (Affine::Scale { d }, _) => b.mulf(c, d),
        (Affine::Offset { d, off, .. }, Zeros::Signed) => b.mulf(b.subf(c, b.f32_splat(off as f32, lanes)), d),
        (Affine::Offset { d, neg, .. }, Zeros::Either) => b.fma(c, d, neg),
        (Affine::Fma { d, a }, _) => b.fma(c, d, a),
    }
}

/// `a` evaluated on every code `0..2^bits` (16-lane vectors), with the same operations as
/// [`apply`].
fn table<'c, 'a>(b: Kb<'c, 'a>, a: Affine<'c, 'a>, bits: u32, zeros: Zeros) -> Vec<Value<'c, 'a>> {
    (0..1usize << (bits - 4))
        .map(|t| {
            let codes: Vec<f32> = (0..16).map(|i| (16 * t + i) as f32).collect();
            of_codes(b, a, b.f32_vec(&codes), 16, zeros)
        })
        .collect()
}

/// `table[code]` per lane (16 lanes; one table of 16 entries or two of 16 for 32 codes).
fn lookup<'c, 'a>(b: Kb<'c, 'a>, table: &[Value<'c, 'a>], code: Value<'c, 'a>) -> Value<'c, 'a> {
    let ty = b.vec_ty(16, "f32");
    match table {
        [t] => b.intrinsic(PERMPS_512, &[*t, code], ty),
        [lo, hi] => b.intrinsic(PERMI2PS_512, &[*lo, code, *hi], ty),
        _ => unreachable!("tables hold 16 or 32 entries"),
    }
}
