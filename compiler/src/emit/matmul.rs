//! `y[r, n] (+)= sum_k x[r, k] * w[n, k] (+ bias[n])` with weights read as stored.
//!
//! Both operands are contiguous along `k`, so the kernel computes dot products: a micro-kernel
//! keeps an `mr x nb` block of vector accumulators in registers and walks `k` once, loading each
//! activation vector once for `nb` weight rows and each weight vector once for `mr` activation
//! rows; at the end the accumulators of one row are summed together by a shuffle tree.
//! Threads split the output columns `n` in whole blocks of `nb`, so every thread streams a
//! disjoint slice of the weight matrix and only the last one meets the `n % nb` remainder,
//! whose size is therefore a constant.
//!
//! * Decode (at most `DECODE_ROWS` rows) is a pure weight stream, in [`decode`]: every weight
//!   vector read once and folded into each activation row, with the same FMA chain per output
//!   as prefill, so every output is bitwise identical between decode and prefill.
//! * Prefill is compute-bound: each block of `nb` weight rows is widened to f32 once into a
//!   stack scratch (a chunk of `k` at a time, sized for L1) and reused by every row tile, so
//!   the inner loop is only loads and FMAs.
//! * Quantised weights (GGML blocks, see `quant.rs`) are dequantised in registers with the
//!   reference's arithmetic. Decode folds each block's values into the row's accumulator in k
//!   order, a few rows at a time so that their FMA chains overlap; prefill dequantises into the
//!   scratch (in chunks of `k` with the accumulators parked in a stack buffer when a row is too
//!   long), so decode and prefill still perform the same FMAs in the same order.

mod bf16_rows;
mod decode;
mod decode_shape;
mod q8;
mod q8_blocks;
mod q8_stage;
mod quad;

pub(super) use bf16_rows::bf16_rows;
pub(super) use decode::{decode_split, normalised_rows};
pub(super) use decode_shape::{decode_float_rows, with_decode_cols};

use super::{Dyn, elementwise, quant, quant8, split_work};
use crate::ir::{Kb, lanes_for};
use kiln_core::{Act, DType, F32Bits, Kernel, Precision};
use melior::ir::Value;

/// Largest prefill weight scratch (`nb * chunk * 4` bytes): a block's weight rows are widened
/// (or dequantised) into it a chunk of `k` at a time, the accumulators parked between chunks.
/// Small enough to stay in L1 next to the activation rows the micro-kernel streams with it:
/// 16 KiB made prefill 15-20 % faster than whole rows on the 0.5B and 1.1B shapes (k = 896 ..
/// 5632), where a whole row block (up to 132 KiB) spilled to L2.
const PREFILL_CHUNK_BYTES: usize = 16 << 10;

/// Tuning overrides for the compiler's own sweep tests (`tests::quant::decode_sweep`); libraries
/// built outside tests never read the environment, so cache keys stay complete.
pub(crate) fn exp_var(name: &str) -> Option<usize> {
    if cfg!(test) {
        std::env::var(name).ok().and_then(|v| v.parse().ok())
    } else {
        None
    }
}

/// Register tile `(mr, nb)` for prefill: `mr * nb` accumulators plus `mr` activation vectors
/// and one weight vector must fit in the vector register file (32 with AVX-512, 16 with AVX2).
fn prefill_tile(max_lanes: usize) -> (usize, usize) {
    if max_lanes >= 16 { (4, 6) } else { (2, 6) }
}

/// Where a micro-kernel reads its weights: the stored matrix (widened on load) or the f32
/// scratch holding the current block's rows.
#[derive(Clone, Copy)]
enum WeightSrc<'c, 'a> {
    Stored { w: Value<'c, 'a>, dtype: DType },
    Scratch(Value<'c, 'a>),
}

pub(super) struct MatMul<'c, 'a> {
    pub(super) k: usize,
    pub(super) lanes: usize,
    pub(super) x: Value<'c, 'a>,
    pub(super) y: Value<'c, 'a>,
    pub(super) bias: Option<(Value<'c, 'a>, DType)>,
    pub(super) accumulate: bool,
    pub(super) act: Option<Act>,
    pub(super) softcap: Option<F32Bits>,
    /// `--precision bf16`: bf16 weights multiply bf16-rounded activations in pairs
    /// ([`MatMul::pairs`]).
    pub(super) bf16_pairs: bool,
    /// The rows of `x` rounded to bf16 once per call ([`bf16_rows`]), from which the pairs
    /// broadcast their activation pieces; `None` where the pairs do not apply.
    pub(super) x_bf16: Option<Value<'c, 'a>>,
    /// `--precision q8` over weights it covers: the rows rounded to 8 bits, multiplied in
    /// integers ([`MatMul::q8_rows`]), in decode and prefill alike.
    pub(super) q8: Option<quant8::Acts<'c, 'a>>,
    /// The weights are stored in row groups (`kiln_core::grouped`): read in quad order only,
    /// at the grouped addresses, without software prefetch in decode.
    pub(super) grouped: bool,
    /// Groups' lengths from one group's start to the next: 2 for a pair of matrices whose
    /// groups alternate (`kiln_core::grouped::GroupPair`), else 1.
    pub(super) group_pitch: usize,
}

/// The rows of `x` rounded for `--precision q8` when the mode covers weights of `dtype`.
pub(super) fn q8_acts<'c, 'a>(
    b: Kb<'c, 'a>,
    d: Dyn<'c, '_>,
    x: Value<'c, '_>,
    dtype: DType,
    k: usize,
    max_rows: usize,
    opts: &kiln_core::CompileOptions,
) -> Option<quant8::Acts<'c, 'a>> {
    (opts.precision == kiln_core::Precision::Q8 && quant8::supports(dtype)).then(|| {
        let mut acts = quant8::Acts::quantise(b, d, x, k, max_rows, quant8::vnni(opts), quant8::span(dtype));
        acts.vnni512 = quant8::vnni512(opts);
        with_layouts(b, d, acts, dtype, k, max_rows)
    })
}

/// `acts` with its rows in the layouts matmuls over `dtype` read ([`super::q8_layouts`]):
/// octets where the call may have a full one (and sixteens for [`q8_blocks::in_sixteens`] with
/// AVX512-VNNI), pairs of blocks for [`q8_blocks::in_pairs`],
/// and for calls of several rows over a k-quant a [`quant8::Stage`] and the rows in word pairs
/// ([`q8_stage::staged`]).
pub(super) fn with_layouts<'c, 'a>(
    b: Kb<'c, 'a>,
    d: Dyn<'c, '_>,
    mut acts: quant8::Acts<'c, 'a>,
    dtype: DType,
    k: usize,
    max_rows: usize,
) -> quant8::Acts<'c, 'a> {
    if acts.octets.is_none() && q8_blocks::exact_blocks(dtype) && max_rows >= super::q8_layouts::ROWS {
        acts.octets = Some(super::q8_layouts::RowGroups::octets(b, d, &acts, k, max_rows));
    }
    let sixteen = super::q8_layouts::SIXTEEN;
    if acts.sixteens.is_none() && acts.vnni512 && q8_blocks::in_sixteens(dtype) && max_rows >= sixteen {
        acts.sixteens = Some(super::q8_layouts::RowGroups::sixteens(b, d, &acts, k, max_rows));
    }
    if acts.pairs.is_none() && q8_blocks::in_pairs(dtype) && k.is_multiple_of(2 * quant8::GROUP) {
        acts.pairs = Some(super::q8_layouts::pairs(b, d, &acts, k, max_rows));
    }
    if max_rows > 1 && q8_stage::staged(dtype) {
        acts.stage.get_or_insert_with(|| quant8::Stage::alloca(b, dtype, k));
        if acts.word_pairs.is_none() {
            acts.word_pairs = Some(super::q8_layouts::word_pairs(b, d, &acts, k, max_rows));
        }
    }
    acts
}

/// Elements one `vdpbf16ps` takes from each operand: 16 f32 lanes, each the sum of a pair.
use kiln_core::grouped::PAIR_STEP;

pub fn emit_matmul<'c, 'a>(
    b: Kb<'c, 'a>,
    kernel: &Kernel,
    p: &[Value<'c, 'a>],
    d: Dyn<'c, 'a>,
    max_lanes: usize,
    opts: &kiln_core::CompileOptions,
) {
    let precision = opts.precision;
    let Kernel::MatMul {
        n,
        k,
        wdtype,
        bias,
        accumulate,
        norm,
        act,
        softcap,
        max_rows,
        grouped,
        paired,
    } = kernel
    else {
        unreachable!()
    };
    let decode = kiln_core::kernel::is_decode(*max_rows);
    let x = match norm {
        Some(nm) => {
            assert!(decode, "norms are folded into decode matmuls only");
            normalised_rows(
                b,
                d,
                p[0],
                &p[3 + bias.is_some() as usize..],
                nm,
                *k,
                *max_rows,
                max_lanes,
            )
        }
        None => p[0],
    };
    let rounded = bf16_rows(b, d, x, &[*wdtype], *k, *max_rows, lanes_for(*k, max_lanes), opts);
    let m = MatMul {
        k: *k,
        lanes: lanes_for(*k, max_lanes),
        x,
        y: p[2],
        bias: bias.map(|dt| (p[3], dt)),
        accumulate: *accumulate,
        act: *act,
        softcap: *softcap,
        bf16_pairs: precision == kiln_core::Precision::Bf16,
        x_bf16: rounded.map(|r| r.buf),
        q8: q8_acts(b, d, x, *wdtype, *k, *max_rows, opts),
        grouped: *grouped,
        group_pitch: if *paired { 2 } else { 1 },
    };
    assert!(
        !m.grouped || m.quad(*wdtype),
        "row-grouped weights are read in quad order only"
    );
    let w = p[1];
    // `--precision q8` prefills with decode's code: row tiles over each weight row's blocks,
    // the same integer sums per output, so prefill and decode agree bit for bit.
    if decode || m.q8.is_some() {
        m.decode(b, w, *wdtype, *n, d, *max_rows);
    } else if m.quad(*wdtype) {
        m.prefill_quad(b, w, *wdtype, *n, d, *max_rows, max_lanes);
    } else {
        m.prefill_dot(b, w, *wdtype, *n, d, *max_rows, max_lanes);
    }
    if let Some(r) = rounded {
        r.release(b);
    }
    if let Some(acts) = m.q8 {
        acts.release(b);
    }
}

impl<'c, 'a> MatMul<'c, 'a> {
    /// Prefill in the dot-product form (f32 and quantised weights, and float weights at 4
    /// lanes): threads split the outputs in blocks of `nb` rows, each block widened or
    /// dequantised into the scratch a chunk of `k` at a time, every row tile run over it.
    #[allow(clippy::too_many_arguments)]
    fn prefill_dot(
        &self,
        b: Kb<'c, '_>,
        w: Value<'c, '_>,
        wdtype: DType,
        n: usize,
        d: Dyn<'c, '_>,
        max_rows: usize,
        max_lanes: usize,
    ) {
        let (k, lanes) = (self.k, self.lanes);
        let stored = WeightSrc::Stored { w, dtype: wdtype };
        let (mr, nb) = prefill_tile(max_lanes);
        let nb = nb.min(n);
        // Quantised and half-precision rows are widened into the scratch a chunk of `k` at a
        // time (whole blocks for quantised ones); the accumulators wait between chunks in
        // `acc`, so each output is still one chain of FMAs in `k` order, as in decode. f32
        // rows are read as stored.
        let use_scratch = wdtype != DType::F32;
        let chunk_bytes = exp_var("KILN_EXP_KCHUNK").unwrap_or(PREFILL_CHUNK_BYTES);
        let chunk = if wdtype.is_quantized() {
            let be = wdtype.block_elems();
            (chunk_bytes / (nb * 4) / be * be).clamp(be, k)
        } else if use_scratch {
            (chunk_bytes / (nb * 4) / lanes * lanes).clamp(lanes, k)
        } else {
            k
        };
        let scratch = use_scratch.then(|| b.alloca(&format!("memref<{nb}x{chunk}xf32>")));
        let acc = (chunk < k).then(|| b.alloca(&format!("memref<{max_rows}x{}xf32>", nb * lanes)));
        let parts = Part::split(k, chunk);

        // One block of `cols` weight rows starting at `n0`, over every row tile.
        let block = |b: Kb<'c, '_>, n0: Value<'c, '_>, cols: usize| {
            for part in &parts {
                // One chunk of `k` from `k0`.
                let chunk_at = |b: Kb<'c, '_>, k0: Value<'c, '_>| {
                    let src = match scratch {
                        Some(s) => {
                            widen_rows(b, w, wdtype, s, n0, cols, *part, k0, lanes);
                            WeightSrc::Scratch(s)
                        }
                        None => stored,
                    };
                    let mr_c = b.idx(mr);
                    let rows_full = b.muli(b.divui(d.rows, mr_c), mr_c);
                    let zero = b.idx(0);
                    b.for_each(zero, rows_full, mr_c, |b, r0| {
                        self.micro(b, src, r0, n0, mr, cols, *part, k0, acc)
                    });
                    if mr > 1 {
                        let one = b.idx(1);
                        b.for_each(rows_full, d.rows, one, |b, r0| {
                            self.micro(b, src, r0, n0, 1, cols, *part, k0, acc)
                        });
                    }
                };
                part.each(b, chunk_at);
            }
        };
        split_blocks(b, d, n, nb, block);
    }
}

/// Splits the `n` output rows between threads ([`split_work`]) in blocks of `nb` and runs
/// `block(b, n0, rows)` on each: shares are whole blocks, so only the share ending at `n` meets
/// the remainder, whose size `n % nb` is a constant.
fn split_blocks<'c, F>(b: Kb<'c, '_>, d: Dyn<'c, '_>, n: usize, nb: usize, block: F)
where
    F: for<'x> Fn(Kb<'c, 'x>, Value<'c, 'x>, usize),
{
    let rem = n % nb;
    split_work(b, d, n, nb, nb, |b, n_start, n_end| {
        let nb_c = b.idx(nb);
        let full_blocks = b.divui(b.subi(n_end, n_start), nb_c);
        let n_full_end = b.addi(n_start, b.muli(full_blocks, nb_c));
        b.for_each(n_start, n_full_end, nb_c, |b, n0| block(b, n0, nb));
        if rem > 0 {
            let has_rem = b.cmpi(crate::ir::Cmp::Ult, n_full_end, n_end);
            b.if_then(has_rem, |b| block(b, n_full_end, rem));
        }
    });
}

/// `count` consecutive chunks `k0 + i * len .. k0 + (i + 1) * len` of the reduction dimension
/// that passes of the micro-kernel cover: all of `k` at once, or chunks that fit the scratch.
/// Accumulators start at zero in the first chunk, are parked in the `acc` buffer between
/// chunks, and are summed and stored after the last.
#[derive(Clone, Copy, Debug, PartialEq)]
struct Part {
    k0: usize,
    count: usize,
    len: usize,
    first: bool,
    last: bool,
}

impl Part {
    /// Runs `chunk_at(b, k0)` for each of this part's chunks: once, or (the middle chunks are
    /// all alike) as one loop rather than one copy of the code each.
    fn each<'c, F>(&self, b: Kb<'c, '_>, chunk_at: F)
    where
        F: for<'x> Fn(Kb<'c, 'x>, Value<'c, 'x>),
    {
        if self.count == 1 {
            chunk_at(b, b.idx(self.k0));
        } else {
            let (lo, hi, step) = (b.idx(self.k0), b.idx(self.k0 + self.count * self.len), b.idx(self.len));
            b.for_each(lo, hi, step, chunk_at);
        }
    }

    /// `k` in chunks of `chunk`: the first chunk, the middle ones (emitted as a loop), and the
    /// last (possibly shorter) one, so the code has at most three copies of the micro-kernel.
    fn split(k: usize, chunk: usize) -> Vec<Part> {
        let part = |k0: usize, count: usize, len: usize| Part {
            k0,
            count,
            len,
            first: k0 == 0,
            last: k0 + count * len >= k,
        };
        if chunk >= k {
            return vec![part(0, 1, k)];
        }
        let full = k / chunk;
        let tail = k - full * chunk;
        // Chunks 1.. before the last one (the last is the tail, or the last full chunk).
        let middle = if tail > 0 { full - 1 } else { full - 2 };
        let mut parts = vec![part(0, 1, chunk)];
        if middle > 0 {
            parts.push(part(chunk, middle, chunk));
        }
        let last_k0 = (1 + middle) * chunk;
        parts.push(part(last_k0, 1, k - last_k0));
        parts
    }
}

/// A micro-kernel's `rows x slots` accumulators for a chunk of `k`: zeros in the first chunk,
/// else those the previous chunk parked in `acc[row][slot * lanes..]` ([`park_accs`]).
fn resume_accs<'c, 'b>(
    b: Kb<'c, 'b>,
    acc: Option<Value<'c, '_>>,
    part: Part,
    rows: &[Value<'c, 'b>],
    slots: usize,
    lanes: usize,
) -> Vec<Value<'c, 'b>> {
    (0..rows.len() * slots)
        .map(|ij| match acc {
            Some(a) if !part.first => b.load_f32(a, &[rows[ij / slots], b.idx(ij % slots * lanes)], lanes),
            _ => b.zero_like(lanes),
        })
        .collect()
}

/// Parks the accumulators `out` (`rows x slots`, row-major) in `acc` for the next chunk of
/// `k` unless `part` is the last; returns whether it did (then there is nothing to finish).
fn park_accs<'c>(
    b: Kb<'c, '_>,
    acc: Option<Value<'c, '_>>,
    part: Part,
    out: &[Value<'c, '_>],
    rows: &[Value<'c, '_>],
    lanes: usize,
) -> bool {
    if part.last {
        return false;
    }
    let a = acc.expect("an accumulator buffer when k is split");
    let slots = out.len() / rows.len();
    for (ij, &v) in out.iter().enumerate() {
        b.store(v, a, &[rows[ij / slots], b.idx(ij % slots * lanes)]);
    }
    true
}

/// Widens (or dequantises) columns `k0..k0 + part.len` of rows `n0..n0+cols` of `w` into the
/// f32 scratch (row `j` of the block → scratch row `j`, column `kk - k0`).
#[allow(clippy::too_many_arguments)]
fn widen_rows<'c>(
    b: Kb<'c, '_>,
    w: Value<'c, '_>,
    dtype: DType,
    scratch: Value<'c, '_>,
    n0: Value<'c, '_>,
    cols: usize,
    part: Part,
    k0: Value<'c, '_>,
    lanes: usize,
) {
    if dtype.is_quantized() {
        let be = dtype.block_elems();
        let (lo, hi, one) = (b.idx(0), b.idx(part.len / be), b.idx(1));
        let first = b.divui(k0, b.idx(be));
        b.for_each(lo, hi, one, |b, i| {
            let blk = b.addi(first, i);
            let col0 = b.muli(i, b.idx(be));
            for j in 0..cols {
                let vals = quant::dequant_block(b, w, dtype, b.addi(n0, b.idx(j)), blk, lanes, quant::Zeros::Either);
                for (v, &val) in vals.iter().enumerate() {
                    b.store(val, scratch, &[b.idx(j), b.addi(col0, b.idx(v * lanes))]);
                }
            }
        });
        return;
    }
    let (lo, hi, step) = (b.idx(0), b.idx(part.len), b.idx(lanes));
    b.for_each(lo, hi, step, |b, kk| {
        for j in 0..cols {
            let v = b.load_weight(w, &[b.addi(n0, b.idx(j)), b.addi(k0, kk)], lanes, dtype);
            b.store(v, scratch, &[b.idx(j), kk]);
        }
    });
}

impl<'c, 'a> MatMul<'c, 'a> {
    /// The epilogue of one output, or of a vector of consecutive outputs from `col`: `+ bias`,
    /// the activation, the soft cap (`cap * tanh(v / cap)`), `+= y` when accumulating, store.
    /// Lane by lane the same operations either way, so an output's value does not depend on
    /// whether it was finished alone or in a vector.
    fn finish<'b>(&self, b: Kb<'c, 'b>, mut s: Value<'c, 'b>, row: Value<'c, '_>, col: Value<'c, '_>) {
        let lanes = crate::ir::lanes_of(s);
        if let Some((bias, bdtype)) = self.bias {
            s = b.addf(s, b.load_weight(bias, &[col], lanes, bdtype));
        }
        if let Some(act) = self.act {
            s = elementwise::activate(b, act, s);
        }
        if let Some(cap) = self.softcap {
            let c = b.f32_like(s, cap.get());
            s = b.mulf(b.tanh(b.divf(s, c)), c);
        }
        if self.accumulate {
            s = b.addf(b.load_f32(self.y, &[row, col], lanes), s);
        }
        b.store(s, self.y, &[row, col]);
    }

    /// Computes the `mr x nb` outputs at rows `r0..r0+mr`, columns `n0..n0+nb`, over the chunk
    /// `k0..k0 + part.len` of `k` (accumulators parked in `acc` between chunks).
    #[allow(clippy::too_many_arguments)]
    fn micro(
        &self,
        b: Kb<'c, '_>,
        src: WeightSrc<'c, '_>,
        r0: Value<'c, '_>,
        n0: Value<'c, '_>,
        mr: usize,
        nb: usize,
        part: Part,
        k0: Value<'c, '_>,
        acc: Option<Value<'c, '_>>,
    ) {
        let lanes = self.lanes;
        let rows: Vec<Value> = (0..mr).map(|i| b.addi(r0, b.idx(i))).collect();
        let cols: Vec<Value> = (0..nb).map(|j| b.addi(n0, b.idx(j))).collect();
        let slots: Vec<Value> = (0..nb).map(|j| b.idx(j)).collect();
        let inits = resume_accs(b, acc, part, &rows, nb, lanes);
        let (zero, kc, step) = (b.idx(0), b.idx(part.len), b.idx(lanes));
        let acc_out = b.for_range(zero, kc, step, &inits, |b, kk, acc| {
            let kx = b.addi(k0, kk);
            let xs: Vec<Value> = rows.iter().map(|&r| b.load_f32(self.x, &[r, kx], lanes)).collect();
            let mut next = acc.clone();
            for j in 0..nb {
                let wv = match src {
                    WeightSrc::Stored { w, dtype } => b.load_weight(w, &[cols[j], kx], lanes, dtype),
                    WeightSrc::Scratch(s) => b.load_f32(s, &[slots[j], kk], lanes),
                };
                for (i, &xv) in xs.iter().enumerate() {
                    next[i * nb + j] = b.fma(wv, xv, acc[i * nb + j]);
                }
            }
            next
        });
        if park_accs(b, acc, part, &acc_out, &rows, lanes) {
            return;
        }
        // After the last chunk: each output's lanes summed by the tree decode uses too.
        for (i, &row) in rows.iter().enumerate() {
            let sums = b.reduce_many(&acc_out[i * nb..(i + 1) * nb]);
            for (j, &col) in cols.iter().enumerate() {
                self.finish(b, sums[j], row, col);
            }
        }
    }

    /// Whether weights of `dtype` are multiplied in bf16 pairs: `--precision bf16`, bf16
    /// weights, 16-lane vectors (AVX-512) and `k` a whole number of pair steps.
    pub(super) fn pairs(&self, dtype: DType) -> bool {
        let precision = if self.bf16_pairs {
            Precision::Bf16
        } else {
            Precision::Exact
        };
        kiln_core::grouped::multiplies_in_pairs(dtype, self.k, self.lanes, precision)
    }
}

#[cfg(test)]
mod tests {
    use super::Part;

    #[test]
    fn parts_cover_k_in_order_with_at_most_three_groups() {
        for (k, chunk) in [
            (64, 64),
            (64, 128),
            (128, 64),
            (192, 64),
            (200, 64),
            (896, 672),
            (5632, 672),
            (4864, 96),
        ] {
            let parts = Part::split(k, chunk);
            assert!(parts.len() <= 3, "k {k} chunk {chunk}: {parts:?}");
            let mut at = 0;
            for (i, p) in parts.iter().enumerate() {
                assert_eq!(p.k0, at, "k {k} chunk {chunk}: contiguous");
                assert!(p.len <= chunk && p.len > 0 && p.count > 0);
                assert_eq!(p.first, i == 0);
                assert_eq!(p.last, i == parts.len() - 1);
                at += p.count * p.len;
            }
            assert_eq!(at, k, "k {k} chunk {chunk}: covers k");
        }
    }
}
