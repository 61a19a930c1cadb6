//! How quad order reads weight rows, for prefill's panel packing and decode's loop alike: from
//! a row-major matrix, `O` rows' pieces loaded side by side and transposed in registers into
//! the quad layout; from a row-grouped one (`kiln_core::grouped`), `O` rows' pieces of an octet
//! in one load, already in that layout.

use super::{Form, QUAD, outputs_per_vector};
use crate::ir::Kb;
use kiln_core::DType;
use kiln_core::grouped::{GROUP_ROWS, OCTET, PieceOrder};
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
/// matrix whose groups lie `pitch` groups' length apart where `grouped` is `Some(pitch)`
/// ([`grouped_quads`]).
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
    grouped: Option<usize>,
) -> Vec<Value<'c, 'b>> {
    let o_n = outputs_per_vector(lanes);
    if let Some(pitch) = grouped {
        debug_assert_eq!(present, o_n, "row groups hold whole groups");
        return grouped_quads(b, w, dtype, row0, k, lanes, span, form, pitch);
    }
    let at = |o: usize| [b.addi(row0, b.idx(o)), k];
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

/// [`weight_quads`] from a row-grouped matrix: `O` rows from `row0` (a multiple of `O`, so
/// the rows' pieces of an octet lie side by side) at `k..k + span` (whole octets). Per octet,
/// one load of `O` pieces gives the quads of `k..k + 4` and `k + 4..k + 8` after a shift and a
/// mask ([`PieceOrder::Widen`]), or two conversions ([`PieceOrder::Quads`]), or is the pairs'
/// operand as loaded ([`PieceOrder::Pairs`]).
#[allow(clippy::too_many_arguments)]
fn grouped_quads<'c, 'b>(
    b: Kb<'c, 'b>,
    w: Value<'c, '_>,
    dtype: DType,
    row0: Value<'c, '_>,
    k: Value<'c, '_>,
    lanes: usize,
    span: usize,
    form: Form,
    pitch: usize,
) -> Vec<Value<'c, 'b>> {
    let order = PieceOrder::for_weights(dtype, form == Form::Pairs).expect("row groups hold bf16 or f16");
    debug_assert!(span.is_multiple_of(OCTET));
    let mut out = Vec::new();
    for c in 0..span / OCTET {
        let at = grouped_at(b, order, row0, b.addi(k, b.idx(c * OCTET)), pitch);
        match order {
            PieceOrder::Pairs => out.push(b.load_bf16s(w, &at, 2 * lanes)),
            PieceOrder::Widen => {
                let words = b.vbitcast(b.load_bf16s(w, &at, 2 * lanes), &format!("vector<{lanes}xi32>"));
                let low = b.shli(words, b.int_splat(16, lanes, "i32"));
                let high = b.andi(words, b.int_splat(-0x10000, lanes, "i32"));
                out.extend([low, high].map(|v| b.bitcast(v, "f32")));
            }
            PieceOrder::Quads => {
                let second = [at[0], b.addi(at[1], b.idx(order.within(0, QUAD)))];
                out.extend([at, second].map(|a| b.load_weight(w, &a, lanes, dtype)));
            }
        }
    }
    out
}

/// The indices of element `k` (a multiple of [`OCTET`]) of weight row `row` (a multiple of
/// the pieces loaded together) in a row-grouped matrix whose groups lie `pitch` groups'
/// length apart (`kiln_core::grouped::offset`): `[first row of the group times the pitch,
/// offset from the group's start]`, indices that run past the row and, for a pair, past the
/// matrix's own rows into its partner's (the memref's address arithmetic is all that reads
/// them: the kernels never index a weight memref otherwise).
fn grouped_at<'c, 'b>(
    b: Kb<'c, 'b>,
    order: PieceOrder,
    row: Value<'c, 'b>,
    k: Value<'c, 'b>,
    pitch: usize,
) -> [Value<'c, 'b>; 2] {
    let g = b.idx(GROUP_ROWS);
    let r = b.remui(row, g);
    let first = b.muli(b.subi(row, r), b.idx(pitch));
    let octets = b.muli(b.divui(k, b.idx(OCTET)), b.idx(GROUP_ROWS * OCTET));
    // `order.within(r, 0)`: `8 r`, or `32 (r / 4) + 4 (r % 4)` for quads.
    let within = match order {
        PieceOrder::Widen | PieceOrder::Pairs => b.muli(r, b.idx(OCTET)),
        PieceOrder::Quads => {
            let four = b.idx(QUAD);
            b.addi(b.muli(b.divui(r, four), b.idx(32)), b.muli(b.remui(r, four), four))
        }
    };
    [first, b.addi(octets, within)]
}

/// Elements of `dtype` per 64-byte cache line.
pub(super) fn elems_per_line(dtype: DType) -> usize {
    (64 / dtype.size()).max(1)
}
