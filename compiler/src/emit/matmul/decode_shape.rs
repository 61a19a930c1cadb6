//! How much of a matrix one decode step walks: the weight rows taken together (one FMA chain
//! each, or one per `O` rows in quad order), the blocks of a quantised row per step, and the
//! activation rows folded into each weight vector of a batched step. These are constants of
//! the emitted code, chosen per format, vector width and activation form ([`ActForm`]).

use super::{MatMul, exp_var};
use crate::emit::Dyn;
use crate::ir::Kb;
use kiln_core::DType;

/// Weight rows a decode thread walks together over quantised weights (one FMA chain each):
/// enough independent chains to hide the FMA latency behind the dequantisation work, few enough
/// that each row's block state (scale splats, byte vectors read twice) stays in registers.
/// Four for the 32-element formats, and for the k-quants with 8 lanes (AVX2, 16 registers)
/// but q5_k, which spills with four; two for the k-quants with AVX-512 (tuned there). With 8
/// lanes q5_0 and q5_1 read as fast with 4 rows as with 2 once a step is one block walked row
/// by row ([`decode_quant_step`]). Measured with `quant_speed` (one thread, in cache, AVX2
/// code on a 2-vCPU AMD EPYC with AVX-512; Gweights/s, best of two runs, 2 → 4 rows):
/// q8_0 15.9 → 23.4, q4_0 15.7 → 19.7, q4_k 15.6 → 17.4, q6_k 9.7 → 9.9, q5_k 11.7 → 11.0.
pub(in crate::emit) fn decode_quant_rows(dtype: DType, lanes: usize) -> usize {
    if let Some(r) = exp_var("KILN_EXP_ROWS") {
        return r;
    }
    match dtype {
        _ if dtype.block_elems() == 32 => 4,
        DType::Q5K => 2,
        _ if lanes <= 8 => 4,
        _ => 2,
    }
}

/// How a decode step over quantised weights is laid out: how many consecutive blocks of each
/// weight row it reads, and whether it folds them in weight row by weight row (each row's
/// block, then the next row's) or group by group (the first vector of every row, then the
/// second ...).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(in crate::emit) struct QuantStep {
    pub blocks: usize,
    pub row_major: bool,
}

/// The step layout for `dtype` at `lanes`. With 16 registers (8 lanes, AVX2) a step over
/// 32-element blocks reads one block per row, row by row: LLVM schedules each step's loads
/// early, and four blocks of four rows in flight spilled the scale, code and high-bit
/// vectors to the stack (q5_0 12.3 → 14.4 Gweights/s one thread in cache, q8_0 19.6 → 23.4,
/// q4_0 18.1 → 19.7, `quant_speed`, same machine as [`decode_quant_rows`]). The k-quants' blocks
/// of 256 are one per step already and measured best group by group. With AVX-512's 32
/// registers, the tuned 128 elements per step, group by group, stay.
pub(in crate::emit) fn decode_quant_step(dtype: DType, lanes: usize, blocks_in_row: usize) -> QuantStep {
    let be = dtype.block_elems();
    let narrow = lanes <= 8;
    let most = if narrow { be } else { 128 };
    let blocks = [4, 2, 1]
        .into_iter()
        .find(|&u| be * u <= most && blocks_in_row.is_multiple_of(u))
        .unwrap_or(1);
    QuantStep {
        blocks,
        row_major: narrow && be == 32,
    }
}

/// Weight rows a decode thread walks together over float weights. In the dot-product order,
/// one FMA chain each: two 512-bit chains (four 256-bit ones) keep more weight bytes in flight
/// per cycle than memory delivers to one core, whatever the FMA latency; more rows would split
/// the thread's stream into more short streams without reading any faster.
///
/// In quad order (`quad`, see `quad.rs`) one chain of the decode vector
/// ([`MatMul::quad_decode_lanes`], 8 lanes) covers `O = 2` rows: two chains, four rows. A
/// chain takes 16 weight bytes per FMA latency (4 bytes per cycle at a 4-cycle latency), so
/// four rows can consume about 8 bytes per cycle per thread; eight rows (four chains) had been
/// the choice, but their eight streams per thread read memory more slowly, even in the Zen 5's
/// fastest bandwidth phase (k = 896, read probe ~70 GB/s: 4 rows 73 GB/s, 8 rows 63).
/// Measured on a 2-core AMD EPYC Zen 5, 2 threads, a 384 MiB bf16 matrix streamed from memory
/// (`decode_sweep`, each round's rate over the read probe run just before it, medians of 30-40
/// rounds): k = 896 4 rows 104 % vs 8 rows 97 %, k = 1024 104 vs 97, k = 3584 104 vs 88, k =
/// 4864 108 vs 93; six rows in between (94-101 %).
///
/// Four rows cap the exact (f32 FMA) form: each output's four phases are four sequential
/// chains, so four rows keep 16 lanes of FMAs in flight, 4 weights per cycle at a 4-cycle
/// latency whatever the vector width (`quant_speed`, bf16 in cache, one thread: 36.8 GB/s
/// with 4 rows, 66.2 with 8; `--precision bf16` pairs 53.2 and 81.2). Two threads at that
/// cap read ~70 GB/s, under the Zen 5's ~85 GB/s fast phase, yet more rows lost in the model
/// too: Qwen2.5-0.5B, exact, 2 threads, interleaved, each repetition over the (huge-page)
/// read probe right after it: 4 rows 73-74 % fast phase and 76-77 % slow, 6 rows 74 % and
/// 72-76 %, 8 rows 71-72 % and 70-72 %. Plain loads show why: two threads reading 2 KiB rows
/// one line of each of 8 rows at a time read 36-39 GB/s where 1 or 4 rows read ~50 (slow
/// phase). Lifting the cap without more streams takes eight phases per output in the f32
/// form, or weights repacked at load so that eight rows are one stream.
///
/// Row-grouped weights (`grouped`, `kiln_core::grouped`) take a whole group per step, 16 rows
/// of one sequential stream, loaded with no transposes: four 512-bit chains without 16
/// streams (a C model of the loop read 163-170 GB/s from L3 on the 2-core Zen 4 EPYC, where
/// row-major rows read 44 with 4 rows a step and 58 with 8).
pub(in crate::emit) fn decode_float_rows(lanes: usize, quad: bool, grouped: bool) -> usize {
    if grouped {
        return kiln_core::grouped::GROUP_ROWS;
    }
    let chains = (32 / lanes).max(1);
    let rows = if quad {
        2 * super::quad::outputs_per_vector(lanes.min(8))
    } else {
        chains
    };
    exp_var("KILN_EXP_FROWS").unwrap_or(rows)
}

/// Activation rows a decode kernel folds into each weight vector it reads (a batched step's
/// rows, `kiln serve`): enough that each weight vector is loaded and widened once for several
/// rows, few enough that the `cols * rows` accumulators, the rows' activation vectors and the
/// weight vectors stay in registers: half the register file in accumulators over float
/// weights (16 with AVX-512, 8 with AVX2), a quarter over quantised ones, whose dequantisation
/// needs registers of its own. A power of two, so the rows left after the full tiles are done
/// in at most `log2(tile)` smaller tiles.
pub(in crate::emit) fn decode_row_tile(cols: usize, lanes: usize) -> usize {
    let registers = if lanes >= 16 { 32 } else { 16 };
    let tile = (registers / 2 / cols.max(1)).max(1);
    exp_var("KILN_EXP_ROWTILE").unwrap_or(1 << tile.ilog2())
}

/// The activations a decode call folds its weight rows with, which decide how many rows a step
/// walks ([`decode_cols`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(in crate::emit) enum ActForm {
    /// f32 activations (or rounded to bf16 for `--precision bf16`'s pairs); `quad`: float weights
    /// multiplied in quad order ([`MatMul::quad`]).
    Float { quad: bool, grouped: bool },
    /// Activations rounded to 8-bit integers (`--precision q8`); `vnni512`: the kernels may
    /// take 512-bit `vpdpbusd`.
    Q8 { vnni512: bool },
}

impl<'c, 'a> MatMul<'c, 'a> {
    /// This call's [`ActForm`] over weights of `dtype`.
    pub(in crate::emit) fn act_form(&self, dtype: DType) -> ActForm {
        match self.q8 {
            Some(acts) => ActForm::Q8 { vnni512: acts.vnni512 },
            None => ActForm::Float {
                quad: self.quad(dtype),
                grouped: self.grouped,
            },
        }
    }
}

/// Weight rows a decode thread walks together when the step may have several activation rows
/// (`max_rows > 1`; `several_rows` is `Some(max_rows)` where it has several): one row walks as
/// many as one-row decode does; several walk fewer quantised ones, so a tile of activation
/// rows ([`decode_row_tile`]) fits beside them (each block is dequantised once per tile: with
/// four weight rows and tiles of two activation rows, eight rows of the 135M Q4_1 demo decoded
/// only 1.6x the tokens of one).
pub(in crate::emit) fn decode_cols(dtype: DType, lanes: usize, several_rows: Option<usize>, form: ActForm) -> usize {
    match (dtype.is_quantized(), several_rows, form) {
        (false, _, ActForm::Float { quad, grouped }) => decode_float_rows(lanes, quad, grouped),
        (false, _, ActForm::Q8 { .. }) => decode_float_rows(lanes, false, false),
        (true, None, ActForm::Q8 { .. }) => super::q8::q8_cols(dtype, lanes),
        (true, None, ActForm::Float { .. }) => decode_quant_rows(dtype, lanes),
        (true, Some(max_rows), ActForm::Q8 { vnni512 }) => super::q8::q8_tile_cols(dtype, lanes, vnni512, max_rows),
        (true, Some(_), ActForm::Float { .. }) => {
            if lanes >= 16 {
                2
            } else {
                1
            }
        }
    }
}

/// Runs `body(b, cols)` with the weight rows per step [`decode_cols`] gives for this call's
/// rows: one branch per distinct count (one when they agree or the kernel takes one row).
#[allow(clippy::too_many_arguments)]
pub(in crate::emit) fn with_decode_cols<'c, F>(
    b: Kb<'c, '_>,
    d: Dyn<'c, '_>,
    dtype: DType,
    lanes: usize,
    n: usize,
    max_rows: usize,
    form: ActForm,
    body: F,
) where
    F: for<'x> Fn(Kb<'c, 'x>, usize),
{
    let one = decode_cols(dtype, lanes, None, form).min(n);
    let several = decode_cols(dtype, lanes, Some(max_rows), form).min(n);
    if max_rows == 1 || one == several {
        return body(b, one);
    }
    let single = b.cmpi(crate::ir::Cmp::Eq, d.rows, b.idx(1));
    b.if_then(single, |b| body(b, one));
    let batched = b.cmpi(crate::ir::Cmp::Ne, d.rows, b.idx(1));
    b.if_then(batched, |b| body(b, several));
}
