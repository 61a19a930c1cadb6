//! How quad order reads weight rows: `O` rows' pieces loaded side by side (from a row-major
//! matrix or a row-grouped one, `kiln_core::grouped`) and transposed in registers into the
//! quad layout, for prefill's panel packing and decode's loop alike.

use super::{Form, QUAD, outputs_per_vector};
use crate::ir::Kb;
use kiln_core::DType;
use melior::ir::Value;

/// `rows[o]` holds consecutive elements of weight row `o` (`O` rows, `O` 128-bit blocks each:
/// `block` elements per block, 4 f32 or 8 bf16); returns `O` vectors, vector `c` holding block
/// `c` of every row side by side (block `o` of the result = block `c` of row `o`).
pub(super) fn transpose_blocks<'c, 'b>(b: Kb<'c, 'b>, rows: &[Value<'c, 'b>], block: usize) -> Vec<Value<'c, 'b>> {
    let o_n = rows.len();
    let width = o_n * block;
    // Elements of block `q` of operand `v` (0 or 1) of a two-vector shuffle.
    let blk = |v: usize, q: usize| (0..block).map(move |e| v * width + q * block + e);
    if o_n == 2 {
        let t = |c: usize| -> Vec<usize> { blk(0, c).chain(blk(1, c)).collect() };
        return (0..2).map(|c| b.shuffle_any(rows[0], rows[1], &t(c))).collect();
    }
    assert_eq!(o_n, 4, "quad order is for 8 or 16 lanes");
    // u0 = [r0.0 r0.1 r1.0 r1.1], u1 = [r0.2 r0.3 r1.2 r1.3] (and u2, u3 from rows 2, 3).
    let half = |lo: usize| -> Vec<usize> {
        blk(0, lo)
            .chain(blk(0, lo + 1))
            .chain(blk(1, lo))
            .chain(blk(1, lo + 1))
            .collect()
    };
    let u = [
        b.shuffle_any(rows[0], rows[1], &half(0)),
        b.shuffle_any(rows[0], rows[1], &half(2)),
        b.shuffle_any(rows[2], rows[3], &half(0)),
        b.shuffle_any(rows[2], rows[3], &half(2)),
    ];
    // t_c = [r0.c r1.c r2.c r3.c]: blocks (c % 2) and (c % 2) + 2 of u_{c/2} and u_{c/2 + 2}.
    let pick = |odd: usize| -> Vec<usize> {
        blk(0, odd)
            .chain(blk(0, odd + 2))
            .chain(blk(1, odd))
            .chain(blk(1, odd + 2))
            .collect()
    };
    (0..4)
        .map(|c| b.shuffle_any(u[c / 2], u[c / 2 + 2], &pick(c % 2)))
        .collect()
}

/// Elements of each weight row one transposition covers: `2 lanes` for bf16 (a 128-bit block
/// holds two quads, transposed before widening: half the shuffles; in pairs, one piece),
/// else `lanes`.
pub(super) fn row_span(dtype: DType, lanes: usize, k: usize, form: Form) -> usize {
    if form == Form::Pairs || (dtype == DType::BF16 && k.is_multiple_of(2 * lanes)) {
        2 * lanes
    } else {
        lanes
    }
}

/// `O` weight rows from `row0` (only the first `present` exist; the rest read as zeros) at
/// `k..k + span` ([`row_span`]), in quad order: `span / form.piece()` vectors (f32, or bf16
/// pieces side by side for [`Form::Pairs`]), piece by piece in `k` order; from a row-grouped
/// matrix where `grouped` ([`weight_at`]).
#[allow(clippy::too_many_arguments)]
pub(super) fn weight_quads<'c, 'b>(
    b: Kb<'c, 'b>,
    w: Value<'c, '_>,
    dtype: DType,
    row0: Value<'c, '_>,
    present: usize,
    k: Value<'c, '_>,
    lanes: usize,
    span: usize,
    form: Form,
    grouped: bool,
) -> Vec<Value<'c, 'b>> {
    let o_n = outputs_per_vector(lanes);
    let at = |o: usize| weight_at(b, dtype, b.addi(row0, b.idx(o)), k, grouped);
    if span == lanes && form == Form::Fma {
        let rows: Vec<Value> = (0..o_n)
            .map(|o| {
                if o < present {
                    b.load_weight(w, &at(o), lanes, dtype)
                } else {
                    b.zero_like(lanes)
                }
            })
            .collect();
        return transpose_blocks(b, &rows, QUAD);
    }
    // bf16, two quads per 128-bit block: transpose the raw 16-bit values, then widen each
    // block's low and high quads by interleaving zeros below them (`bf16 << 16`).
    debug_assert_eq!((dtype, span), (DType::BF16, 2 * lanes));
    let zero = b.int_splat(0, span, "i16");
    let rows: Vec<Value> = (0..o_n)
        .map(|o| {
            if o < present {
                b.bitcast(b.load_bf16s(w, &at(o), span), "i16")
            } else {
                zero
            }
        })
        .collect();
    let widen = |t: Value<'c, 'b>, half: usize| -> Value<'c, 'b> {
        let mask: Vec<usize> = (0..o_n)
            .flat_map(|q| (0..QUAD).flat_map(move |j| [0, span + q * 2 * QUAD + half * QUAD + j]))
            .collect();
        b.vbitcast(b.shuffle_any(zero, t, &mask), &format!("vector<{lanes}xf32>"))
    };
    let pieces = transpose_blocks(b, &rows, 2 * QUAD);
    if form == Form::Pairs {
        return pieces.into_iter().map(|t| b.bitcast(t, "bf16")).collect();
    }
    pieces.into_iter().flat_map(|t| [widen(t, 0), widen(t, 1)]).collect()
}

/// The indices of element `k` of weight row `row`: `[row, k]`, or in the row-grouped layout
/// (`kiln_core::grouped`) `[first row of the group, offset from its start]`, an offset that
/// runs past the row (the memref's address arithmetic is all that reads it, as the prefetches
/// index `[0, flat]`). A load of a piece never crosses a line: pieces divide lines.
pub(super) fn weight_at<'c, 'b>(
    b: Kb<'c, 'b>,
    dtype: DType,
    row: Value<'c, 'b>,
    k: Value<'c, 'b>,
    grouped: bool,
) -> [Value<'c, 'b>; 2] {
    if !grouped {
        return [row, k];
    }
    use kiln_core::grouped::{GROUP_ROWS, LINE_BYTES};
    let line = LINE_BYTES / dtype.size();
    let (g, o) = (b.idx(GROUP_ROWS), b.idx(line));
    let first = b.muli(b.divui(row, g), g);
    let lines = b.muli(b.divui(k, o), b.idx(GROUP_ROWS * line));
    let within = b.addi(b.muli(b.remui(row, g), o), b.remui(k, o));
    [first, b.addi(lines, within)]
}

/// Elements of `dtype` per 64-byte cache line.
pub(super) fn elems_per_line(dtype: DType) -> usize {
    (64 / dtype.size()).max(1)
}
