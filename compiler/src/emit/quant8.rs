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
//! and q6_k's as `c + 32`; those offsets come off the block's sum in integers
//! ([`int_offsets`]), and q3_k's signed 6-bit scales `sc - 32` enter `vpmaddwd` as they are.
//! With several activation rows a call unpacks its weight rows once ([`Stage`],
//! `matmul/q8_stage.rs`).
//!
//! The 32-element formats (q4_0, q4_1, q5_0, q5_1, q8_0) also sum each block exactly in
//! integers (q4_0's and q5_0's offsets of 8 and 16 included), then take one float step per
//! block and output, with the outputs in the lanes (`matmul/q8_blocks.rs`; prefill tiles read
//! the rows eight at a time, `q8_layouts.rs`).
//!
//! Decode and prefill run the same operations for every output, so within the mode they agree
//! bit for bit.

mod code_block;
mod kquant;

pub use code_block::CodeBlock;
pub use kquant::{
    STAGE_COLS, Stage, has_min_terms, int_offsets, int_offsets_of, offset_terms, word_pair_codes, word_pair_masks,
};

use super::Dyn;
use crate::ir::Kb;
use kiln_core::DType;
use melior::ir::Value;

/// Activation elements sharing one scale: one `vpmaddubsw` operand of 32 bytes.
pub const GROUP: usize = 32;

/// Most bytes of rounded rows (`max_rows · k`, each of the up to four copies: the codes and
/// their rearrangements) a kernel keeps on its stack; larger calls (long prefill blocks over
/// wide rows) put the rows on the heap. A kernel may run on the process's main thread, whose
/// stack is 8 MiB: `--prefill-block 512` over TinyLlama's 5632-wide rows needs ~12 MB.
const STACK_ROW_BYTES: usize = 1 << 20;

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
    /// `memref<R x k/16 x i16>`: `Σ q` over each half group, as integers (q3_k's and q6_k's
    /// offsets, [`int_offsets`]).
    pub bsums16: Value<'c, 'a>,
    /// The rows again, eight at a time for the exact block sums of prefill tiles
    /// ([`super::q8_layouts`]); `None` where no matmul of the call needs them.
    pub octets: Option<super::q8_layouts::Octets<'c, 'a>>,
    /// The rows again, sixteen at a time, for the exact block sums of prefill tiles with
    /// 512-bit `vpdpbusd` ([`super::q8_layouts::Sixteens`]); `None` where unused.
    pub sixteens: Option<super::q8_layouts::Sixteens<'c, 'a>>,
    /// The rows again with each 64 elements' two halves interleaved by 16-bit words
    /// ([`super::q8_layouts::word_pairs`]) for staged k-quant tiles; `None` where unused.
    pub word_pairs: Option<Value<'c, 'a>>,
    /// The rows again with each two blocks' halves side by side ([`super::q8_layouts::pairs`],
    /// `memref<R x k x i8>`) for the nibble formats' one-row steps; `None` where unused.
    pub pairs: Option<Value<'c, 'a>>,
    /// Weight rows unpacked for tiles of several activation rows ([`Stage`]); `None` where
    /// the call has one row or no matmul over a k-quant.
    pub stage: Option<Stage<'c, 'a>>,
    /// Whether the rows' buffers are on the heap ([`Acts::release`] frees them).
    pub heap: bool,
    /// Whether dot products use `vpdpbusd` ([`vnni`]).
    pub vnni: bool,
    /// Whether they may use it on 512-bit vectors ([`vnni512`]).
    pub vnni512: bool,
    /// Elements sharing one scale ([`span`]): 32, or 256 for the k-quants.
    pub span: usize,
}

/// Whether this library may use `vpdpbusd` on 512-bit vectors: the host's own code with
/// 512-bit vectors on a CPU with AVX512-VNNI (its 256-bit form is [`vnni`]'s).
pub fn vnni512(opts: &kiln_core::CompileOptions) -> bool {
    if opts.f32_lanes < 16 {
        return false;
    }
    static HOST: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let host = *HOST.get_or_init(|| {
        let cpu = kiln_core::HostCpu::detect();
        cpu.has("avx512_vnni") && cpu.has("avx512bw")
    });
    opts.target_cpu.is_none() && host && cfg!(target_arch = "x86_64")
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
        let heap = max_rows * k > STACK_ROW_BYTES;
        let buf = |ty: String| if heap { b.alloc(&ty) } else { b.alloca(&ty) };
        let acts = Acts {
            q: buf(format!("memref<{max_rows}x{k}xi8>")),
            d: buf(format!("memref<{max_rows}x{groups}xf32>")),
            s32: buf(format!("memref<{max_rows}x{groups}xf32>")),
            s16: buf(format!("memref<{max_rows}x{}xf32>", 2 * groups)),
            sums: buf(format!("memref<{max_rows}x{groups}xf32>")),
            bsums16: buf(format!("memref<{max_rows}x{}xi16>", 2 * groups)),
            octets: None,
            sixteens: None,
            pairs: None,
            word_pairs: None,
            stage: None,
            heap,
            vnni,
            vnni512: false,
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

    /// A buffer of `ty` where this call's rows live: the stack, or the heap for a large call.
    pub fn buffer<'x>(&self, b: Kb<'c, 'x>, ty: &str) -> Value<'c, 'x> {
        if self.heap { b.alloc(ty) } else { b.alloca(ty) }
    }

    /// Frees the rows' buffers if they are on the heap: emitted after the kernel's last use.
    pub fn release(&self, b: Kb<'c, '_>) {
        if !self.heap {
            return;
        }
        for v in [self.q, self.d, self.s32, self.s16, self.sums, self.bsums16] {
            b.dealloc(v);
        }
        for v in self.pairs.into_iter().chain(self.word_pairs) {
            b.dealloc(v);
        }
        if let Some(o) = self.octets {
            for v in [o.q, o.d, o.s, o.sums] {
                b.dealloc(v);
            }
        }
        if let Some(o) = self.sixteens {
            for v in [o.q, o.d, o.s, o.sums] {
                b.dealloc(v);
            }
        }
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
        b.store(b.trunci(first, "i16"), self.bsums16, &[r, j2]);
        b.store(b.trunci(second, "i16"), self.bsums16, &[r, b.addi(j2, b.idx(1))]);
        let sum = b.sitofp(b.addi(first, second));
        b.store(b.mulf(scale, sum), self.s32, &[r, j]);
        b.store(sum, self.sums, &[r, j]);
        b.store(scale, self.d, &[r, j]);
    }
}
