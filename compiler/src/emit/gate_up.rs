//! Decode's MLP input side as one kernel: the norm of the row, the gate and up projections
//! and `act(gate) * up`, with no barrier in between.
//!
//! Separately these are four steps and three barriers per layer, each barrier costing the
//! threads' finishing-time spread on a step that is mostly waiting for memory. Here every
//! thread normalises the row itself (it is a few KiB, already in cache), then walks its share
//! of output rows `j`, reading row `j` of the gate matrix and row `j` of the up matrix in
//! alternation (two weight streams, each prefetched as the decode matmul prefetches its
//! one), and once a share is complete applies the activation to it from L1. Each projection
//! output is the decode matmul's FMA chain and the activation is [`gated_at`], so the
//! values are bitwise those of the unfused prefill steps.
//!
//! Half-precision gate and up matrices are stored in row groups (`kiln_core::grouped`): the
//! two streams are then sequential, read 16 rows a step with no software prefetch, at about
//! the read probe where the row-major four rows read 69-92 % of it.

use super::Dyn;
use super::elementwise::gated_at;
use super::matmul::{
    MatMul, bf16_rows, decode_float_rows, decode_split, normalised_rows, q8_acts, with_decode_cols, with_layouts,
};
use crate::ir::{Kb, lanes_for};
use kiln_core::Kernel;
use melior::ir::Value;

pub fn emit_gate_up<'c, 'a>(
    b: Kb<'c, 'a>,
    kernel: &Kernel,
    p: &[Value<'c, 'a>],
    d: Dyn<'c, 'a>,
    max_lanes: usize,
    opts: &kiln_core::CompileOptions,
) {
    let precision = opts.precision;
    let Kernel::GateUp {
        n,
        k,
        gate_dtype,
        up_dtype,
        norm,
        act,
        max_rows,
        grouped,
        paired,
    } = kernel
    else {
        unreachable!()
    };
    let max_rows = *max_rows;
    assert!(kiln_core::kernel::is_decode(max_rows), "gate_up is a decode kernel");
    let (n, k) = (*n, *k);
    let x = match norm {
        Some(nm) => normalised_rows(b, d, p[0], &p[5..], nm, k, max_rows, max_lanes),
        None => p[0],
    };
    let (w_gate, gate, w_up, up) = (p[1], p[2], p[3], p[4]);
    let lanes = lanes_for(k, max_lanes);
    // One rounding of the rows serves both projections when the mode covers both with the
    // same span of shared scales (a k-quant beside a 32-element format needs two).
    let gate_q8 = q8_acts(b, d, x, *gate_dtype, k, max_rows, opts);
    let same_span = super::quant8::span(*gate_dtype) == super::quant8::span(*up_dtype);
    let up_q8 = match gate_q8 {
        Some(acts) if same_span && super::quant8::supports(*up_dtype) => {
            Some(with_layouts(b, d, acts, *up_dtype, k, max_rows))
        }
        _ => q8_acts(b, d, x, *up_dtype, k, max_rows, opts),
    };
    let rounded = bf16_rows(b, d, x, &[*gate_dtype, *up_dtype], k, max_rows, lanes, opts);
    let x_bf16 = rounded.map(|r| r.buf);
    let projection = |y, q8| MatMul {
        k,
        lanes,
        x,
        y,
        bias: None,
        accumulate: false,
        act: None,
        softcap: None,
        bf16_pairs: precision == kiln_core::Precision::Bf16,
        x_bf16,
        q8,
        grouped: *grouped,
        group_pitch: if *paired { 2 } else { 1 },
    };
    let (gate_mm, up_mm) = (projection(gate, gate_q8), projection(up, up_q8));
    assert!(
        !grouped || (gate_mm.quad(*gate_dtype) && up_mm.quad(*up_dtype)),
        "row-grouped weights are read in quad order only"
    );
    // Rows of each matrix per step. Float weights are memory-bound: in the dot-product order
    // the decode matmul's FMA chains split over the two matrices (one row of each with
    // AVX-512) keep as many bytes in flight; in quad order each matrix walks the decode
    // matmul's four rows (two chains each): with two rows of each (one chain) the fused
    // kernel streamed 32.6-33.1 GB/s against 34.5 with four, on the Qwen3.5-0.8B shape (2-core
    // Zen 5 EPYC, 2 threads, read probe ~35 GB/s, `KILN_PROFILE`). Quantised ones are bound by
    // the dequantisation work, whose latency the decode matmul hides with its full group of
    // chains per matrix (halving it cost 7 % on Q4_1); with several activation rows, fewer
    // (see `with_decode_cols`).
    // Shares start on whole activation vectors, so the activation runs on full vectors only.
    let act_lanes = lanes_for(n, max_lanes);
    let row_bytes = gate_dtype.bytes_for(k) + up_dtype.bytes_for(k);
    let quad = gate_mm.quad(*gate_dtype);
    let float_group = (decode_float_rows(lanes, quad, gate_mm.grouped) / if quad { 1 } else { 2 })
        .max(1)
        .min(n);
    with_decode_cols(
        b,
        d,
        *gate_dtype,
        lanes,
        n,
        max_rows,
        gate_mm.act_form(*gate_dtype),
        |b, quant_group| {
            let group = if gate_dtype.is_quantized() {
                quant_group
            } else {
                float_group
            };
            let align = lcm(group, act_lanes);
            decode_split(
                b,
                d,
                n,
                align,
                group,
                row_bytes,
                |b, col, cols, end| {
                    gate_mm.decode_rows(b, w_gate, *gate_dtype, col, cols, end, d, max_rows);
                    up_mm.decode_rows(b, w_up, *up_dtype, col, cols, end, d, max_rows);
                },
                |b, start, end| {
                    b.for_each(b.idx(0), d.rows, b.idx(1), |b, r| {
                        b.for_each(start, end, b.idx(act_lanes), |b, i| {
                            gated_at(b, *act, gate, up, &[r, i], act_lanes)
                        });
                    });
                },
            );
        },
    );
    if let Some(r) = rounded {
        r.release(b);
    }
    // The up projection's rows are the gate's plus layouts of their own where they share one
    // rounding, so releasing them frees everything once.
    match (gate_q8, up_q8) {
        (Some(gate), Some(up)) if gate.q == up.q => up.release(b),
        (gate, up) => {
            for acts in gate.into_iter().chain(up) {
                acts.release(b);
            }
        }
    }
}

fn lcm(a: usize, b: usize) -> usize {
    fn gcd(a: usize, b: usize) -> usize {
        if b == 0 { a } else { gcd(b, a % b) }
    }
    a / gcd(a, b) * b
}
