//! `--precision q8` activation rows rearranged once per call for the exact block sums of
//! `matmul/q8_blocks.rs`: in octets, so that one weight block's codes meet eight rows in a few
//! instructions and leave each row's block sum in its own lane, and in pairs of blocks, so
//! that one-row decode takes two blocks of 4-bit codes per vector; and for the staged k-quant
//! tiles of `matmul/q8_stage.rs`, with each two groups interleaved by 16-bit words.
//!
//! Octets.
//! A group's 32 codes are eight 4-byte chunks; a row's group vector holds chunks 0..4 in its
//! low 128 bits and 4..8 in its high 128 bits. For rows `a b c d` (a quad) and chunk `k < 4`
//! the octet stores `[a_k b_k c_k d_k | a_{k+4} b_{k+4} c_{k+4} d_{k+4}]`: a weight block's
//! codes with chunk `k` repeated in each low lane and chunk `k + 4` in each high lane (one
//! `vpshufd`) multiply it in one `vpmaddubsw`, and the four products of a quad add up to each
//! row's sums over the block's two halves.
//!
//! Sixteens.
//! With AVX512-VNNI sixteen rows take one 512-bit vector per chunk: for chunk `k` of a group,
//! `[r0_k r1_k .. r15_k]`. A weight block's chunk `k` repeated in all 16 lanes (one `vpermd`)
//! meets it in one `vpdpbusd`, and eight of them leave the 16 rows' block sums in the lanes:
//! 16 rows for what an octet does for 8, without its fold of two quads (`matmul/q8_blocks.rs`).

use super::Dyn;
use super::quant8::{Acts, GROUP};
use crate::ir::Kb;
use melior::ir::Value;

/// Activation rows in an octet.
pub const ROWS: usize = 8;

/// A call's rows rearranged in full groups of `rows` (8 for octets, 16 for sixteens; the
/// module's note), built from [`Acts`] once per call, with each group's per-row scalars as
/// one vector.
#[derive(Clone, Copy)]
pub struct RowGroups<'c, 'a> {
    /// Octets: `memref<O x k/32 x 8 x 32 x i8>`, vector `4h + k` of octet `o`, group `g` is
    /// quad `h`'s chunks `k` and `k + 4`. Sixteens: `memref<O x k/32 x 8 x 16 x i32>`, vector
    /// `k` is the rows' chunk `k` (codes `4k .. 4k + 4` of the group), one row per lane.
    pub q: Value<'c, 'a>,
    /// `memref<O x k/32 x R x f32>`: the rows' group scales `d`.
    pub d: Value<'c, 'a>,
    /// `memref<O x k/32 x R x f32>`: the rows' `d · Σq` ([`Acts::s32`]).
    pub s: Value<'c, 'a>,
    /// `memref<O x k/32 x R x f32>`: the rows' `Σq` ([`Acts::sums`]).
    pub sums: Value<'c, 'a>,
}

/// Rows in octets (8 per group).
pub type Octets<'c, 'a> = RowGroups<'c, 'a>;

/// Rows in sixteens (16 per group, for 512-bit `vpdpbusd`).
pub type Sixteens<'c, 'a> = RowGroups<'c, 'a>;

/// Activation rows in a [`Sixteens`] group.
pub const SIXTEEN: usize = 16;

impl<'c, 'a> RowGroups<'c, 'a> {
    /// Buffers for the full groups of `rows` among `max_rows` over `k` elements, the codes as
    /// `q_elems` (the layout's innermost shape, e.g. `8x32xi8`); then `fill(b, o, g)` for every
    /// full group `o` of the call's `d.rows` and activation group `g`.
    fn build(
        b: Kb<'c, 'a>,
        d: Dyn<'c, '_>,
        acts: &Acts<'c, '_>,
        (k, max_rows, rows, partial): (usize, usize, usize, bool),
        q_elems: &str,
        fill: impl Fn(&Self, Kb<'c, '_>, Value<'c, '_>, Value<'c, '_>),
    ) -> Self {
        let groups = k / GROUP;
        let count = if partial {
            max_rows.div_ceil(rows)
        } else {
            max_rows / rows
        };
        assert!(max_rows >= rows, "{max_rows} rows hold no group of {rows}");
        let per_row = |elem: &str| acts.buffer(b, &format!("memref<{count}x{groups}x{rows}x{elem}>"));
        let o = RowGroups {
            q: acts.buffer(b, &format!("memref<{count}x{groups}x{q_elems}>")),
            d: per_row("f32"),
            s: per_row("f32"),
            sums: per_row("f32"),
        };
        let filled = match partial {
            true => b.divui(b.addi(d.rows, b.idx(rows - 1)), b.idx(rows)),
            false => b.divui(d.rows, b.idx(rows)),
        };
        b.for_each(b.idx(0), filled, b.idx(1), |b, oc| {
            b.for_each(b.idx(0), b.idx(groups), b.idx(1), |b, g| fill(&o, b, oc, g));
        });
        o
    }

    /// The octets of the call's rows (`d.rows` of at most `max_rows`) of `acts`, rounded over
    /// `k` elements, the last one partial where `d.rows` is no multiple of 8: its lanes past
    /// the call's last row repeat that row, so the quad tiles of the rows left after the full
    /// octets read the same layout (`matmul/q8_blocks.rs`) and never a row outside the call.
    pub fn octets(b: Kb<'c, 'a>, d: Dyn<'c, '_>, acts: &Acts<'c, '_>, k: usize, max_rows: usize) -> Self {
        let q = format!("{ROWS}x{GROUP}xi8");
        let last = b.subi(d.rows, b.idx(1));
        Self::build(b, d, acts, (k, max_rows, ROWS, true), &q, |o, b, oc, g| {
            o.fill_octet(b, acts, oc, g, last)
        })
    }

    /// The sixteens of the call's rows, as [`Self::octets`]; rows past the last full sixteen
    /// are left to octets and one-row code.
    pub fn sixteens(b: Kb<'c, 'a>, d: Dyn<'c, '_>, acts: &Acts<'c, '_>, k: usize, max_rows: usize) -> Self {
        let q = format!("{}x{SIXTEEN}xi32", GROUP / 4);
        Self::build(b, d, acts, (k, max_rows, SIXTEEN, false), &q, |o, b, six, g| {
            o.fill_sixteen(b, acts, six, g)
        })
    }

    /// Group `o` of `rows.len()` rows, activation group `g`: the rows' scalars, each kind as one
    /// vector.
    fn fill_scalars(
        &self,
        b: Kb<'c, '_>,
        acts: &Acts<'c, '_>,
        rows: &[Value<'c, '_>],
        o: Value<'c, '_>,
        g: Value<'c, '_>,
    ) {
        let zero = b.idx(0);
        for (from, to) in [(acts.d, self.d), (acts.s32, self.s), (acts.sums, self.sums)] {
            let lanes: Vec<Value> = rows
                .iter()
                .map(|&r| b.broadcast(b.load_f32(from, &[r, g], 1), 1))
                .collect();
            b.store(join(b, &lanes), to, &[o, g, zero]);
        }
    }

    /// Sixteen `o`, group `g`: each row's chunks stored to their lanes (a 16 x 8 transpose of
    /// 4-byte chunks, one store each: per call, against the `16 · k` products per weight row
    /// that read them), and the rows' scalars.
    fn fill_sixteen(&self, b: Kb<'c, '_>, acts: &Acts<'c, '_>, o: Value<'c, '_>, g: Value<'c, '_>) {
        let r0 = b.muli(o, b.idx(SIXTEEN));
        let rows: Vec<Value> = (0..SIXTEEN).map(|i| b.addi(r0, b.idx(i))).collect();
        let k0 = b.muli(g, b.idx(GROUP));
        for (lane, &r) in rows.iter().enumerate() {
            let chunks = b.vbitcast(b.load_bytes(acts.q, &[r, k0], GROUP), "vector<8xi32>");
            for c in 0..GROUP / 4 {
                b.store(b.extract_lane(chunks, c), self.q, &[o, g, b.idx(c), b.idx(lane)]);
            }
        }
        self.fill_scalars(b, acts, &rows, o, g);
    }

    /// Octet `oc`, group `g`: the quads' chunk vectors and the rows' scalars, rows past
    /// `last` (the call's last row) read as `last`.
    fn fill_octet(&self, b: Kb<'c, '_>, acts: &Acts<'c, '_>, oc: Value<'c, '_>, g: Value<'c, '_>, last: Value<'c, '_>) {
        let r0 = b.muli(oc, b.idx(ROWS));
        let rows: Vec<Value> = (0..ROWS).map(|i| b.minui(b.addi(r0, b.idx(i)), last)).collect();
        let k0 = b.muli(g, b.idx(GROUP));
        let zero = b.idx(0);
        for h in 0..2 {
            let quad: Vec<Value> = rows[4 * h..4 * h + 4]
                .iter()
                .map(|&r| b.vbitcast(b.load_bytes(acts.q, &[r, k0], GROUP), "vector<8xi32>"))
                .collect();
            // A 4 x 4 transpose of 4-byte chunks within each 128-bit half.
            let lo01 = b.shuffle_any(quad[0], quad[1], &[0, 8, 1, 9, 4, 12, 5, 13]);
            let lo23 = b.shuffle_any(quad[2], quad[3], &[0, 8, 1, 9, 4, 12, 5, 13]);
            let hi01 = b.shuffle_any(quad[0], quad[1], &[2, 10, 3, 11, 6, 14, 7, 15]);
            let hi23 = b.shuffle_any(quad[2], quad[3], &[2, 10, 3, 11, 6, 14, 7, 15]);
            let even = [0, 1, 8, 9, 4, 5, 12, 13];
            let odd = [2, 3, 10, 11, 6, 7, 14, 15];
            let chunks = [
                b.shuffle_any(lo01, lo23, &even),
                b.shuffle_any(lo01, lo23, &odd),
                b.shuffle_any(hi01, hi23, &even),
                b.shuffle_any(hi01, hi23, &odd),
            ];
            for (c, v) in chunks.into_iter().enumerate() {
                let at = b.idx(4 * h + c);
                b.store(
                    b.vbitcast(v, &format!("vector<{GROUP}xi8>")),
                    self.q,
                    &[oc, g, at, zero],
                );
            }
        }
        self.fill_scalars(b, acts, &rows, oc, g);
    }
}

/// The `vector<1xf32>` values in order, as one vector (a tree of shuffles).
pub fn join<'c, 'a>(b: Kb<'c, 'a>, parts: &[Value<'c, 'a>]) -> Value<'c, 'a> {
    if parts.len() == 1 {
        return parts[0];
    }
    let (lo, hi) = parts.split_at(parts.len() / 2);
    b.shuffle_any(join(b, lo), join(b, hi), &(0..parts.len()).collect::<Vec<_>>())
}

/// A call's rows with each two blocks' codes as the nibble formats hold them (`memref<R x k x
/// i8>`): bytes `64p .. 64p + 32` are `[block 2p's elements 0..16 | block 2p+1's 0..16]`,
/// bytes `64p + 32 .. 64p + 64` their elements `16..32`. A pair of q4_0 blocks' 16-byte code
/// arrays side by side (one load and one `vinserti128`) gives their low nibbles and high
/// nibbles in these orders with one `vpand` and one shift, where one block alone takes a shift,
/// a `vinserti128` and a `vpand`.
pub fn pairs<'c, 'a>(b: Kb<'c, 'a>, d: Dyn<'c, '_>, acts: &Acts<'c, '_>, k: usize, max_rows: usize) -> Value<'c, 'a> {
    let low: Vec<usize> = (0..16).chain(32..48).collect();
    let high: Vec<usize> = (16..32).chain(48..64).collect();
    rearranged(b, d, acts, k, max_rows, (&low, &high))
}

/// A call's rows for staged k-quant tiles (`memref<R x k x i8>`): each 64 elements'
/// halves (groups `2c` and `2c + 1`) interleaved by 16-bit words, as
/// [`super::quant8::word_pair_masks`] orders them, so that one `vpmaddubsw` yields pair sums of
/// both groups, alternating, and two such sums add in i16 before one `vpmaddwd` applies both
/// groups' scales (`matmul/q8_stage.rs`).
pub fn word_pairs<'c, 'a>(
    b: Kb<'c, 'a>,
    d: Dyn<'c, '_>,
    acts: &Acts<'c, '_>,
    k: usize,
    max_rows: usize,
) -> Value<'c, 'a> {
    let (low, high) = super::quant8::word_pair_masks();
    rearranged(b, d, acts, k, max_rows, (&low, &high))
}

/// The call's rows (`memref<R x k x i8>`) with each 64 codes' two halves `x`, `y` stored as
/// `shuffle(x, y, low)` then `shuffle(x, y, high)`.
fn rearranged<'c, 'a>(
    b: Kb<'c, 'a>,
    d: Dyn<'c, '_>,
    acts: &Acts<'c, '_>,
    k: usize,
    max_rows: usize,
    (low, high): (&[usize], &[usize]),
) -> Value<'c, 'a> {
    assert!(
        k.is_multiple_of(2 * GROUP),
        "k = {k} is no whole number of 64-code pieces"
    );
    let out = acts.buffer(b, &format!("memref<{max_rows}x{k}xi8>"));
    b.for_each(b.idx(0), d.rows, b.idx(1), |b, r| {
        b.for_each(b.idx(0), b.idx(k), b.idx(2 * GROUP), |b, k0| {
            let second = b.addi(k0, b.idx(GROUP));
            let (x, y) = (
                b.load_bytes(acts.q, &[r, k0], GROUP),
                b.load_bytes(acts.q, &[r, second], GROUP),
            );
            b.store(b.shuffle_any(x, y, low), out, &[r, k0]);
            b.store(b.shuffle_any(x, y, high), out, &[r, second]);
        });
    });
    out
}
