//! `--precision q8`: matmuls over GGML block weights as 8-bit integer dot products.
//!
//! The exact mode turns every weight into its f32 value and multiplies it by the f32
//! activation: with AVX2's 16 registers that is four or five vector instructions per 8 weights,
//! more than the memory stream costs on the k-quants (measured: TinyLlama Q4_K_M decode at
//! half of llama.cpp's AVX2 build). This mode does what llama.cpp does instead: each activation
//! row is rounded once per call to 8-bit integers in groups of [`GROUP`] elements with one f32
//! scale per group ([`Acts`]), and a weight block's codes (its quantised values as unsigned
//! bytes, q8_0's as signed ones) meet those integers in `vpmaddubsw`/`vpmaddwd`: 32 products
//! in two instructions, summed exactly in i32.
//!
//! What it computes, for weight values `w = D·c + M` (`D` the block's or sub-block's scale,
//! `c` the code, `M` its offset `-off·D` or its min) and activations `â = d·q` (`d` the group's
//! scale `max|x| / 127`, `q = round(x / d)` to nearest even): `Σ w·â` with each group's
//! `Σ c·q` an exact integer, scaled by `D·d`, plus `M · (d·Σ q)` per scale group (`d·Σq` made
//! once per activation group, [`Acts::s32`] and [`Acts::s16`]); the sums in f32. Products never
//! saturate `vpmaddubsw`'s i16 pairs: unsigned codes are below 64, and q8_0's signed codes
//! multiply as `|c| · (sign(c)·q)`, at most `2 · 128 · 127` per pair.
//!
//! The k-quants (q2_k to q6_k) go further, as llama.cpp's `Q8_K` does: their activations share
//! one scale per 256-element super-block ([`span`]), so a whole block's code sums stay
//! integers. Each 32-element group's `vpmaddubsw` pairs meet their 4-, 6- or 8-bit sub-block
//! scale in `vpmaddwd`, the groups add up in i32, and the block costs one conversion and one
//! `fma(Σ, D·d, acc)` per activation row instead of one per group (with its scale lanes picked
//! by a float shuffle). No sum overflows: a pair is at most `2 · 63 · 127`, a scaled pair sum
//! `2 · 16002 · 128`, a block's sum below `2^29`. q3_k's codes are read unsigned as `c + 4`
//! (its offset term then `-4·D·sc`), and its signed 6-bit scales `sc - 32` enter `vpmaddwd`
//! as they are.
//!
//! The 32-element formats (q4_0, q4_1, q5_0, q5_1, q8_0) also sum each block exactly in
//! integers (q4_0's and q5_0's offsets of 8 and 16 included), then take one float step per
//! block and output, with the outputs in the lanes (`matmul/q8_blocks.rs`; prefill tiles read
//! the rows eight at a time, `q8_layouts.rs`).
//!
//! Decode and prefill run the same operations for every output, so within the mode they agree
//! bit for bit.

use super::Dyn;
use super::quant::BlockReader;
use crate::ir::Kb;
use kiln_core::DType;
use melior::ir::Value;
use std::collections::HashMap;

/// Activation elements sharing one scale: one `vpmaddubsw` operand of 32 bytes.
pub const GROUP: usize = 32;

/// The weight formats this mode multiplies in integers: every GGML block format Kiln reads;
/// matmuls over float weights keep exact arithmetic.
pub fn supports(dtype: DType) -> bool {
    matches!(
        dtype,
        DType::Q8_0
            | DType::Q4_0
            | DType::Q4_1
            | DType::Q5_0
            | DType::Q5_1
            | DType::Q2K
            | DType::Q3K
            | DType::Q4K
            | DType::Q5K
            | DType::Q6K
    )
}

/// Activation elements sharing one scale in matmuls over `dtype`: a k-quant's super-block (its
/// sub-block scales then apply in integers, see the module's note), else one [`GROUP`].
pub fn span(dtype: DType) -> usize {
    match dtype {
        DType::Q2K | DType::Q3K | DType::Q4K | DType::Q5K | DType::Q6K => dtype.block_elems(),
        _ => GROUP,
    }
}

/// A call's activation rows rounded to 8 bits, in stack buffers of the thread's (every thread
/// rounds every row itself: `rows · k` values against the `rows · k · n / threads` products it
/// then computes, and no barrier).
#[derive(Clone, Copy)]
pub struct Acts<'c, 'a> {
    /// `memref<R x k x i8>`: the codes `q`.
    pub q: Value<'c, 'a>,
    /// `memref<R x k/32 x f32>`: each group's scale `d` (the same for the groups of a span).
    pub d: Value<'c, 'a>,
    /// `memref<R x k/32 x f32>`: `d · Σ q` over each group of 32.
    pub s32: Value<'c, 'a>,
    /// `memref<R x k/16 x f32>`: `d · Σ q` over each half group (the k-quants with scales per
    /// 16 elements).
    pub s16: Value<'c, 'a>,
    /// `memref<R x k/32 x f32>`: `Σ q` over each group of 32 (an exact integer).
    pub sums: Value<'c, 'a>,
    /// The rows again, eight at a time for the exact block sums of prefill tiles
    /// ([`super::q8_layouts`]); `None` where no matmul of the call needs them.
    pub octets: Option<super::q8_layouts::Octets<'c, 'a>>,
    /// The rows again with each two blocks' halves side by side ([`super::q8_layouts::pairs`],
    /// `memref<R x k x i8>`) for the nibble formats' one-row steps; `None` where unused.
    pub pairs: Option<Value<'c, 'a>>,
    /// Whether dot products use `vpdpbusd` ([`vnni`]).
    pub vnni: bool,
    /// Elements sharing one scale ([`span`]): 32, or 256 for the k-quants.
    pub span: usize,
}

/// Whether this library may use `vpdpbusd` on 256-bit vectors: the host's own code (no
/// `--target-cpu`) on a CPU with AVX-VNNI or AVX512-VNNI with AVX512-VL. One instruction for
/// `vpmaddubsw` + `vpmaddwd`, with the same sums (the pairs never saturate, see the module's
/// note), so the same bits either way.
pub fn vnni(opts: &kiln_core::CompileOptions) -> bool {
    static HOST: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let host = *HOST.get_or_init(|| {
        let cpu = kiln_core::HostCpu::detect();
        cpu.has("avx_vnni") || (cpu.has("avx512_vnni") && cpu.has("avx512vl"))
    });
    opts.target_cpu.is_none() && host && cfg!(target_arch = "x86_64")
}

impl<'c, 'a> Acts<'c, 'a> {
    /// Rounds the call's rows (`d.rows` of at most `max_rows`) of `x` (`[rows, k]` f32), one
    /// scale per `span` elements.
    #[allow(clippy::too_many_arguments)]
    pub fn quantise(
        b: Kb<'c, 'a>,
        d: Dyn<'c, '_>,
        x: Value<'c, '_>,
        k: usize,
        max_rows: usize,
        vnni: bool,
        span: usize,
    ) -> Self {
        assert!(
            span.is_multiple_of(GROUP) && k.is_multiple_of(span),
            "k = {k} is not a multiple of the span {span}"
        );
        let groups = k / GROUP;
        let acts = Acts {
            q: b.alloca(&format!("memref<{max_rows}x{k}xi8>")),
            d: b.alloca(&format!("memref<{max_rows}x{groups}xf32>")),
            s32: b.alloca(&format!("memref<{max_rows}x{groups}xf32>")),
            s16: b.alloca(&format!("memref<{max_rows}x{}xf32>", 2 * groups)),
            sums: b.alloca(&format!("memref<{max_rows}x{groups}xf32>")),
            octets: None,
            pairs: None,
            vnni,
            span,
        };
        let per_span = span / GROUP;
        b.for_each(b.idx(0), d.rows, b.idx(1), |b, r| {
            b.for_each(b.idx(0), b.idx(k / span), b.idx(1), |b, s| {
                let k0 = b.muli(s, b.idx(span));
                let amax = b.reduce_max(
                    (0..span / 8)
                        .map(|i| b.abs_f32(b.load_f32(x, &[r, b.addi(k0, b.idx(8 * i))], 8)))
                        .reduce(|a, c| b.maxf(a, c))
                        .expect("a span has vectors"),
                );
                let scale = b.divf(amax, b.f32c(127.0));
                let nonzero = b.cmpf("ogt", amax, b.f32c(0.0));
                let inv = b.broadcast(b.select(nonzero, b.divf(b.f32c(127.0), amax), b.f32c(0.0)), 8);
                for g in 0..per_span {
                    let j = b.addi(b.muli(s, b.idx(per_span)), b.idx(g));
                    acts.round_group(b, x, r, j, scale, inv);
                }
            });
        });
        acts
    }

    /// Group `j` of row `r` with its span's scale `d = max|x| / 127` and `inv = 127 / max|x|`
    /// (0 for an all-zero span): `q = round(x · inv)`, and the sums.
    fn round_group(
        &self,
        b: Kb<'c, '_>,
        x: Value<'c, '_>,
        r: Value<'c, '_>,
        j: Value<'c, '_>,
        scale: Value<'c, '_>,
        inv: Value<'c, '_>,
    ) {
        let k0 = b.muli(j, b.idx(GROUP));
        let q: Vec<Value> = (0..GROUP / 8)
            .map(|i| b.round_to_i32(b.mulf(b.load_f32(x, &[r, b.addi(k0, b.idx(8 * i))], 8), inv)))
            .collect();
        let bytes: Vec<Value> = q.iter().map(|&qi| b.trunci(qi, "i8")).collect();
        let lo = b.shuffle_any(bytes[0], bytes[1], &(0..16).collect::<Vec<_>>());
        let hi = b.shuffle_any(bytes[2], bytes[3], &(0..16).collect::<Vec<_>>());
        b.store(b.shuffle_any(lo, hi, &(0..32).collect::<Vec<_>>()), self.q, &[r, k0]);
        let first = b.reduce_add_int(b.addi(q[0], q[1]));
        let second = b.reduce_add_int(b.addi(q[2], q[3]));
        let j2 = b.muli(j, b.idx(2));
        b.store(b.mulf(scale, b.sitofp(first)), self.s16, &[r, j2]);
        b.store(b.mulf(scale, b.sitofp(second)), self.s16, &[r, b.addi(j2, b.idx(1))]);
        let sum = b.sitofp(b.addi(first, second));
        b.store(b.mulf(scale, sum), self.s32, &[r, j]);
        b.store(sum, self.sums, &[r, j]);
        b.store(scale, self.d, &[r, j]);
    }
}

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
    scale: Option<Value<'c, 'a>>,
    /// The k-quants' sub-block scales as i16 lanes ([`Self::int_scale`]).
    int_scales: Option<Value<'c, 'a>>,
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
            reader: BlockReader::new(b, w, dtype, row, blk, 16, super::quant::Zeros::Either),
            bytes: HashMap::new(),
            scale: None,
            int_scales: None,
            high: None,
        }
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
                let (qh, qs) = super::quant::nibble_layout(self.dtype);
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

    /// Two nibble-format blocks' codes in the order of [`super::q8_layouts::pairs`]:
    /// `([self's 0..16 | next's 0..16], [self's 16..32 | next's 16..32])`.
    pub fn pair_codes(&mut self, next: &mut Self) -> (Value<'c, 'a>, Value<'c, 'a>) {
        let b = self.b;
        let (qh, qs) = super::quant::nibble_layout(self.dtype);
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

    /// A k-quant's scale vector (16 lanes, see `BlockReader::scale_vector`), which its offset
    /// terms use.
    fn scale(&mut self) -> Value<'c, 'a> {
        if let Some(s) = self.scale {
            return s;
        }
        let s = self.reader.scale_vector();
        self.scale = Some(s);
        s
    }

    /// A k-quant's sub-block scales for group `g`'s 16 i16 pair sums (pair `j` holds elements
    /// `2j, 2j + 1`): q4_k/q5_k the group's one scale; q2_k, q3_k and q6_k (sub-blocks of 16)
    /// sub-block `2g`'s for pairs 0..8 and `2g + 1`'s for pairs 8..16.
    pub fn int_scale(&mut self, g: usize) -> Value<'c, 'a> {
        let b = self.b;
        let all = match self.int_scales {
            Some(v) => v,
            None => {
                let v = b.trunci(self.reader.int_scales(), "i16");
                self.int_scales = Some(v);
                v
            }
        };
        let mask: Vec<usize> = match self.dtype {
            DType::Q4K | DType::Q5K => vec![g; 16],
            _ => (0..16).map(|j| 2 * g + j / 8).collect(),
        };
        b.shuffle_any(all, all, &mask)
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

    /// `acc` plus the block's offset or min terms for activation row `r` (`M · d·Σq` per scale
    /// group); `blk` is the block's index in the row.
    pub fn offset_terms(
        &mut self,
        acc: Value<'c, 'a>,
        acts: &Acts<'c, '_>,
        r: Value<'c, '_>,
        blk: Value<'c, '_>,
    ) -> Value<'c, 'a> {
        let b = self.b;
        match self.dtype {
            DType::Q4K | DType::Q5K => {
                // Lanes 8..16 of the scale vector are the sub-blocks' `-dmin · m`.
                let mins = b.slice(self.scale(), 8, 8);
                let s = b.load_f32(acts.s32, &[r, b.muli(blk, b.idx(8))], 8);
                b.fma(mins, s, acc)
            }
            DType::Q2K | DType::Q3K | DType::Q6K => {
                // Per sub-block of 16: q2_k's `-dmin · m` (lanes 16..32 of its scale vector),
                // q3_k's and q6_k's `-4·D·sc` and `-32·D·sc` for their unsigned codes.
                let m = match self.dtype {
                    DType::Q2K => b.slice(self.scale(), 16, 16),
                    DType::Q3K => b.mulf(self.scale(), b.f32_splat(-4.0, 16)),
                    _ => b.mulf(self.scale(), b.f32_splat(-32.0, 16)),
                };
                let at = b.muli(blk, b.idx(16));
                let lo = b.load_f32(acts.s16, &[r, at], 8);
                let hi = b.load_f32(acts.s16, &[r, b.addi(at, b.idx(8))], 8);
                b.fma(b.slice(m, 8, 8), hi, b.fma(b.slice(m, 0, 8), lo, acc))
            }
            other => unreachable!("{other}'s offsets are in its exact block sums (matmul/q8_blocks.rs)"),
        }
    }
}
