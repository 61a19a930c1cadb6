//! `--precision q8` over the 32-element formats (q4_0, q4_1, q5_0, q5_1, q8_0): each block's
//! `Σ c·q` summed exactly in integers for one weight row and activation row, then one float
//! step per block: `acc = fma(Σ', D·d, acc)` (with `Σ' = Σ c·q - off·Σq`, q4_0's and q5_0's
//! offsets of 8 and 16 taken out in exact arithmetic) and, for q4_1 and q5_1,
//! `acc = fma(m, d·Σq, acc)`.
//!
//! Where a block's float work once ran on each of the 8 lanes of a partial sum, it now runs
//! on one lane per output, and those lanes share vectors: a one-row step puts its weight rows
//! in the lanes (the sums of 4 rows reduced together by horizontal adds), a tile of 8
//! activation rows puts the rows in the lanes ([`crate::emit::q8_layouts`]: the codes meet 8
//! rows in 8 `vpmaddubsw` and come out as one vector of 8 row sums). Every output takes the
//! same operations in the same order either way, so decode = prefill bit for bit.
//!
//! Measured (`quant_speed`, one thread, x86-64-v3 code, 2-core Zen 4, n 4864, k 896), decode
//! Gweights/s / prefill GFLOP/s, per-lane float work → exact block sums: q4_0 23.9 → 34.0 /
//! 80 → 153, q4_1 22.2 → 28.7 / 79 → 146, q5_0 17.6 → 22.3 / 73 → 127, q5_1 16.9 → 20.2 /
//! 72 → 125, q8_0 31.9 → 31.7 / 78 → 105 (decode with [`super::decode::prefetch_group`] on
//! both sides).

use super::MatMul;
use super::decode::{Tile, prefetch_group};
use crate::emit::q8_layouts::{self, Octets, Sixteens};
use crate::emit::quant8::{Acts, CodeBlock, GROUP};
use crate::ir::Kb;
use kiln_core::DType;
use melior::ir::Value;

/// Whether `dtype`'s q8 matmuls take this module's exact block sums: the 32-element formats.
pub(super) fn exact_blocks(dtype: DType) -> bool {
    matches!(
        dtype,
        DType::Q4_0 | DType::Q4_1 | DType::Q5_0 | DType::Q5_1 | DType::Q8_0
    )
}

/// Whether one-row steps over `dtype` take two blocks at a time
/// ([`crate::emit::q8_layouts::pairs`]): q4_0, q4_1 and q5_0, not q5_1 (`quant_speed`, one
/// thread, x86-64-v3 code, 2-core Zen 4, n 4864, k 896, decode Gweights/s one block → two:
/// q4_0 34.0 → 43.1, q4_1 28.7 → 32.7, q5_0 22.3 → 23.6, q5_1 20.2 → 19.0).
pub(super) fn in_pairs(dtype: DType) -> bool {
    matches!(dtype, DType::Q4_0 | DType::Q4_1 | DType::Q5_0)
}

/// Whether full sixteens of rows over `dtype` take 512-bit `vpdpbusd` steps
/// ([`q8_layouts::Sixteens`], with AVX512-VNNI): every 32-element format.
pub(in crate::emit) fn in_sixteens(dtype: DType) -> bool {
    exact_blocks(dtype)
}

/// A block's offset: q4_0's and q5_0's codes are `c - off`, q4_1's and q5_1's values have a
/// stored min `m` (an f16 after the scale), q8_0's codes are signed and have none.
#[derive(Clone, Copy)]
enum Offset {
    Codes(f32),
    Min,
    None,
}

fn offset(dtype: DType) -> Offset {
    match dtype {
        DType::Q8_0 => Offset::None,
        DType::Q4_0 => Offset::Codes(8.0),
        DType::Q5_0 => Offset::Codes(16.0),
        DType::Q4_1 | DType::Q5_1 => Offset::Min,
        other => unreachable!("{other} has no exact block sums"),
    }
}

/// The f16 at byte `at` of block `blk` of weight row `col`, as `vector<1xf16>`.
fn half<'c, 'a>(
    b: Kb<'c, 'a>,
    w: Value<'c, '_>,
    dtype: DType,
    col: Value<'c, '_>,
    blk: Value<'c, '_>,
    at: usize,
) -> Value<'c, 'a> {
    let byte = b.addi(b.muli(blk, b.idx(dtype.block_bytes())), b.idx(at));
    b.vbitcast(b.load_bytes(w, &[col, byte], 2), "vector<1xf16>")
}

/// The f16s at byte `at` of block `blk` of weight rows `cols` (at most 4), widened: packed
/// into one 64-bit word by scalar loads, shifts and ors, on the integer ports the loop leaves
/// idle, then one `vmovq` and one `vcvtph2ps`, where inserting each half into a vector took
/// a `vpinsrw` (two vector operations) and a tree of unpacks, about a third of a one-row q4_0
/// step's vector instructions (`quant_speed`, one thread, 2-core Zen 5, n = k = 2048, decode
/// Gweights/s, x86-64-v3 code: q4_0 58.6 → 67.4, q4_1 40.6 → 53.4, q5_1 26.6 → 33.3).
fn gather_halves<'c, 'a>(
    b: Kb<'c, 'a>,
    w: Value<'c, '_>,
    dtype: DType,
    cols: &[Value<'c, '_>],
    blk: Value<'c, '_>,
    at: usize,
) -> Value<'c, 'a> {
    assert!(cols.len() <= 4, "{} weight rows' halves in one word", cols.len());
    let word = cols
        .iter()
        .enumerate()
        .map(|(i, &c)| {
            let h = b.vbitcast(half(b, w, dtype, c, blk, at), "vector<1xi16>");
            let wide = b.extui(b.extract_lane(h, 0), "i64");
            if i == 0 {
                wide
            } else {
                b.shli(wide, b.i64c(16 * i as i64))
            }
        })
        .reduce(|x, y| b.ori(x, y))
        .expect("a weight row");
    let halves = b.vbitcast(b.splat_scalar(word, 1), "vector<4xf16>");
    let halves = b.extf(halves);
    match cols.len() {
        4 => halves,
        n => b.shuffle_any(halves, halves, &(0..n).collect::<Vec<_>>()),
    }
}

/// Pairwise sums of two vectors within each 128-bit half (`vphaddd`, `vphaddw`): `[x pairs,
/// y pairs]` per half.
fn hadd<'c, 'a>(b: Kb<'c, 'a>, x: Value<'c, 'a>, y: Value<'c, 'a>) -> Value<'c, 'a> {
    let n = crate::ir::lanes_of(x);
    let (half, quarter) = (n / 2, n / 4);
    let pick = |odd: usize| -> Vec<usize> {
        (0..2)
            .flat_map(|h| {
                let firsts = (0..quarter).map(move |j| h * half + 2 * j + odd);
                firsts.clone().chain(firsts.map(move |i| i + n))
            })
            .collect()
    };
    b.addi(b.shuffle_any(x, y, &pick(0)), b.shuffle_any(x, y, &pick(1)))
}

/// The block sums of weight rows from their `vpmaddubsw` pair sums (`vector<16xi16>`, each at
/// most `2 · 31 · 127`): two rounds of `vphaddw` leave each row's sum in 4 i16 lanes (at most
/// `8 · 31 · 127`, no overflow), one `vpmaddwd` and a fold of the halves finish it. Fewer
/// instructions than a `vpmaddwd` per row and `vphaddd` rounds.
fn totals16<'c, 'a>(b: Kb<'c, 'a>, pairs: &[Value<'c, 'a>]) -> Value<'c, 'a> {
    let ones = b.int_splat(1, 16, "i16");
    each_four(b, pairs, |s| {
        b.madd_i16(hadd(b, hadd(b, s[0], s[1]), hadd(b, s[2], s[3])), ones)
    })
}

/// The lane sums of `vector<8xi32>` values (`vpdpbusd`'s) as one `vector<n x i32>`, in order.
fn totals<'c, 'a>(b: Kb<'c, 'a>, sums: &[Value<'c, 'a>]) -> Value<'c, 'a> {
    each_four(b, sums, |s| hadd(b, hadd(b, s[0], s[1]), hadd(b, s[2], s[3])))
}

/// `fold` maps four rows' vectors to `[r0 r1 r2 r3 | r0 r1 r2 r3]` partial sums; the halves
/// add up to one `vector<n x i32>` of the rows' sums (rows padded to a multiple of 4).
fn each_four<'c, 'a>(
    b: Kb<'c, 'a>,
    sums: &[Value<'c, 'a>],
    fold: impl Fn(&[Value<'c, 'a>]) -> Value<'c, 'a>,
) -> Value<'c, 'a> {
    let mut padded = sums.to_vec();
    while !padded.len().is_multiple_of(4) {
        padded.push(sums[0]);
    }
    let fours: Vec<Value> = padded
        .chunks(4)
        .map(|s| {
            let t = fold(s);
            b.addi(b.slice(t, 0, 4), b.slice(t, 4, 4))
        })
        .collect();
    let all = join_ints(b, &fours);
    if sums.len() == padded.len() {
        all
    } else {
        b.shuffle_any(all, all, &(0..sums.len()).collect::<Vec<_>>())
    }
}

fn join_ints<'c, 'a>(b: Kb<'c, 'a>, parts: &[Value<'c, 'a>]) -> Value<'c, 'a> {
    match parts {
        [one] => *one,
        [x, y] => b.concat(*x, *y),
        _ => unreachable!("at most 8 weight rows per step"),
    }
}

/// The float step of one block for the outputs in the lanes of `acc`: `f` their exact sums
/// `Σ c·q`, `qsum` their activations' `Σq`, `scale` their `D·d`, `min` their `(m, d·Σq)`.
fn block_step<'c, 'a>(
    b: Kb<'c, 'a>,
    off: Offset,
    f: Value<'c, 'a>,
    qsum: Value<'c, 'a>,
    scale: Value<'c, 'a>,
    min: impl FnOnce() -> (Value<'c, 'a>, Value<'c, 'a>),
    acc: Value<'c, 'a>,
) -> Value<'c, 'a> {
    let lanes = crate::ir::lanes_of(f);
    match off {
        // Exact: integers below 2^24 in magnitude.
        Offset::Codes(o) => b.fma(b.fma(qsum, b.f32_splat(-o, lanes), f), scale, acc),
        Offset::Min => {
            let acc = b.fma(f, scale, acc);
            let (m, s) = min();
            b.fma(m, s, acc)
        }
        Offset::None => b.fma(f, scale, acc),
    }
}

/// One weight block's exact sums `Σ c·q` with the 16 rows of a sixteen (`vector<16xi32>`):
/// for each chunk `k`, the block's 4 codes repeated in every lane meet the rows' `chunks[k]`
/// in a 512-bit `vpdpbusd`. q8_0's codes are signed, so they are its signed operand and
/// `chunks` hold the rows' `q + 128`; `128 · Σc` then comes off exactly, each sum starting at
/// `-128 · Σc` (the rows' codes are at most 127 in magnitude, so `q + 128` fits a byte; any
/// weight code, -128 included, multiplies exactly, and the sums stay far inside i32).
fn sixteen_sums<'c, 'a>(b: Kb<'c, 'a>, dtype: DType, codes: Value<'c, 'a>, chunks: &[Value<'c, 'a>]) -> Value<'c, 'a> {
    let n = q8_layouts::SIXTEEN;
    let signed = dtype == DType::Q8_0;
    let start = if signed {
        let ones = b.int_splat(1, GROUP, "i8");
        let total = b.reduce_add_int(b.dot_u8_i8(b.int_splat(0, 8, "i32"), ones, codes));
        b.splat_scalar(b.muli(total, b.i32c(-128)), n)
    } else {
        b.int_splat(0, n, "i32")
    };
    let words = b.vbitcast(codes, "vector<8xi32>");
    chunks.iter().enumerate().fold(start, |sum, (k, &q)| {
        let spread = b.vbitcast(b.shuffle_any(words, words, &[k; 16]), "vector<64xi8>");
        if signed {
            b.dot_u8_i8(sum, q, spread)
        } else {
            b.dot_u8_i8(sum, spread, q)
        }
    })
}

/// Up to 4 weight rows' sums over a pair of blocks (`codes`: each row's
/// [`CodeBlock::pair_codes`]) with one activation row's pair (`lo`, `hi`: the blocks' halves in
/// the same order) as `[block 1: rows 0..4 | block 2: rows 0..4]` (rows padded by repeating the
/// first). In i16 as far as the codes allow: a row's two `vpmaddubsw` add to at most
/// `2 · 2 · 15 · 127` over 4-bit codes, and two `vphaddw` rounds keep 4-bit sums below `2^15`;
/// 5-bit codes widen after one round.
fn pair_totals<'c, 'a>(
    b: Kb<'c, 'a>,
    dtype: DType,
    codes: &[(Value<'c, 'a>, Value<'c, 'a>)],
    lo: Value<'c, 'a>,
    hi: Value<'c, 'a>,
    vnni: bool,
) -> Value<'c, 'a> {
    let mut codes = codes.to_vec();
    assert!(codes.len() <= 4, "pairs of blocks take at most 4 weight rows");
    while codes.len() < 4 {
        codes.push(codes[0]);
    }
    let ones = b.int_splat(1, 16, "i16");
    if vnni {
        let dots: Vec<Value> = codes
            .iter()
            .map(|&(l, h)| b.dot_u8_i8(b.dot_u8_i8(b.int_splat(0, 8, "i32"), l, lo), h, hi))
            .collect();
        return hadd(b, hadd(b, dots[0], dots[1]), hadd(b, dots[2], dots[3]));
    }
    let p: Vec<Value> = codes
        .iter()
        .map(|&(l, h)| b.addi(b.madd_u8_i8(l, lo), b.madd_u8_i8(h, hi)))
        .collect();
    match dtype {
        DType::Q4_0 | DType::Q4_1 => b.madd_i16(hadd(b, hadd(b, p[0], p[1]), hadd(b, p[2], p[3])), ones),
        _ => hadd(
            b,
            b.madd_i16(hadd(b, p[0], p[1]), ones),
            b.madd_i16(hadd(b, p[2], p[3]), ones),
        ),
    }
}

/// Block `blk` of one-row code: weight rows `cols` of `w` against activation row `r`.
struct LaneBlock<'c, 'y, 'z> {
    w: Value<'c, 'z>,
    dtype: DType,
    cols: &'z [Value<'c, 'z>],
    acts: &'z Acts<'c, 'z>,
    blk: Value<'c, 'y>,
    r: Value<'c, 'y>,
}

/// The float step of block `at.blk` for the weight rows in the lanes, their exact sums `f`
/// (`vector<n x f32>`): their `D` gathered, times the row's `d`.
fn lane_step<'c, 'y>(b: Kb<'c, 'y>, at: LaneBlock<'c, 'y, '_>, f: Value<'c, 'y>, acc: Value<'c, 'y>) -> Value<'c, 'y> {
    let LaneBlock {
        w,
        dtype,
        cols,
        acts,
        blk,
        r,
    } = at;
    let n = cols.len();
    let scales = gather_halves(b, w, dtype, cols, blk, 0);
    let splat = |mem| b.broadcast(b.load_f32(mem, &[r, blk], 1), n);
    let scale = b.mulf(scales, splat(acts.d));
    let min = || (gather_halves(b, w, dtype, cols, blk, 2), splat(acts.s32));
    block_step(b, offset(dtype), f, splat(acts.sums), scale, min, acc)
}

/// A quad's `[rows' Σ over chunks 0..4 | rows' Σ over chunks 4..8]` (i32) from the spread
/// weight chunks and the quad's chunk vectors: one `vpdpbusd` per chunk, or `vpmaddubsw`
/// pairs added in i16 (at most `4 · 2 · 31 · 127`) and one `vpmaddwd`; q8_0's signed codes
/// multiply as `|c| · (sign(c)·q)`, whose pairs (up to `2 · 128 · 127`) widen before adding.
fn quad_sums<'c, 'a>(
    b: Kb<'c, 'a>,
    dtype: DType,
    spread: &[Value<'c, 'a>],
    chunks: &[Value<'c, 'a>],
    vnni: bool,
) -> Value<'c, 'a> {
    let ones = b.int_splat(1, 16, "i16");
    let operands: Vec<(Value, Value)> = spread
        .iter()
        .zip(chunks)
        .map(|(&w, &q)| match dtype {
            DType::Q8_0 => (b.sign_bytes(w, w), b.sign_bytes(q, w)),
            _ => (w, q),
        })
        .collect();
    if vnni {
        return operands
            .iter()
            .fold(b.int_splat(0, 8, "i32"), |s, &(u, q)| b.dot_u8_i8(s, u, q));
    }
    let pairs = operands.iter().map(|&(u, q)| b.madd_u8_i8(u, q));
    if dtype == DType::Q8_0 {
        return pairs
            .map(|p| b.madd_i16(p, ones))
            .reduce(|x, y| b.addi(x, y))
            .expect("four chunks");
    }
    b.madd_i16(pairs.reduce(|x, y| b.addi(x, y)).expect("four chunks"), ones)
}

impl<'c, 'a> MatMul<'c, 'a> {
    /// The tile's outputs: by sixteens or octets where it is a full one of rows, else one
    /// activation row at a time with the weight rows in the lanes.
    pub(super) fn q8_block_rows(
        &self,
        b: Kb<'c, '_>,
        w: Value<'c, '_>,
        dtype: DType,
        t: Tile<'c, '_>,
        acts: &Acts<'c, '_>,
    ) {
        match (acts.sixteens, acts.octets) {
            (Some(six), _) if t.m == q8_layouts::SIXTEEN => self.q8_sixteen(b, w, dtype, t, &six),
            (_, Some(oct)) if t.m == q8_layouts::ROWS => self.q8_quads(b, w, dtype, t, acts, &oct, 0..2, None),
            _ => self.q8_lanes(b, w, dtype, t, acts),
        }
    }

    /// Walks the blocks of the tile's weight rows in steps of `unroll`, prefetching as
    /// [`MatMul::q8_rows`] does; `body(b, blk, acc)` folds blocks `blk .. blk + per` into
    /// `acc`.
    #[allow(clippy::too_many_arguments)]
    fn q8_block_loop<'x, F>(
        &self,
        b: Kb<'c, 'x>,
        w: Value<'c, '_>,
        dtype: DType,
        cols: &[Value<'c, 'x>],
        end: Value<'c, '_>,
        inits: &[Value<'c, 'x>],
        per: usize,
        body: F,
    ) -> Vec<Value<'c, 'x>>
    where
        F: for<'y> Fn(Kb<'c, 'y>, Value<'c, 'y>, &mut [Value<'c, 'y>]),
    {
        let blocks = self.k / dtype.block_elems();
        let unroll = super::q8::blocks_per_step(dtype, blocks);
        assert!(unroll.is_multiple_of(per), "steps of {unroll} blocks, calls of {per}");
        let row_bytes = dtype.bytes_for(self.k);
        let span = unroll * dtype.block_bytes();
        let (zero, hi, step) = (b.idx(0), b.idx(blocks), b.idx(unroll));
        b.for_range(zero, hi, step, inits, |b, kb, acc| {
            let mut acc = acc;
            let off = b.muli(kb, b.idx(dtype.block_bytes()));
            prefetch_group(b, w, cols[0], cols.len(), off, span, row_bytes, end);
            for u in (0..unroll).step_by(per) {
                body(b, b.addi(kb, b.idx(u)), &mut acc);
            }
            acc
        })
    }

    /// Any tile, one activation row at a time: the weight rows' block sums reduced into one
    /// vector (lane = weight row), then one float step for all of them. The formats
    /// [`in_pairs`] names take two blocks per call where the rows come in pairs of blocks too
    /// and the tile has at most 4 weight rows.
    fn q8_lanes(&self, b: Kb<'c, '_>, w: Value<'c, '_>, dtype: DType, t: Tile<'c, '_>, acts: &Acts<'c, '_>) {
        let (rows, cols, _) = t.start(b, 1, 0);
        let n = cols.len();
        let inits: Vec<Value> = rows.iter().map(|_| b.f32_splat(0.0, n)).collect();
        let paired = acts.pairs.filter(|_| n <= 4 && in_pairs(dtype));
        let acc = match paired {
            Some(pairs) => self.q8_block_loop(b, w, dtype, &cols, t.end, &inits, 2, |b, blk, acc| {
                let next = b.addi(blk, b.idx(1));
                let codes: Vec<(Value, Value)> = cols
                    .iter()
                    .map(|&c| CodeBlock::new(b, w, dtype, c, blk).pair_codes(&mut CodeBlock::new(b, w, dtype, c, next)))
                    .collect();
                let k0 = b.muli(blk, b.idx(GROUP));
                for (i, &r) in rows.iter().enumerate() {
                    let lo = b.load_bytes(pairs, &[r, k0], GROUP);
                    let hi = b.load_bytes(pairs, &[r, b.addi(k0, b.idx(GROUP))], GROUP);
                    let sums = b.sitofp(pair_totals(b, dtype, &codes, lo, hi, acts.vnni));
                    for (h, k) in [(0, blk), (1, next)] {
                        let f = b.shuffle_any(sums, sums, &(4 * h..4 * h + n).collect::<Vec<_>>());
                        let at = LaneBlock {
                            w,
                            dtype,
                            cols: &cols,
                            acts,
                            blk: k,
                            r,
                        };
                        acc[i] = lane_step(b, at, f, acc[i]);
                    }
                }
            }),
            None => self.q8_block_loop(b, w, dtype, &cols, t.end, &inits, 1, |b, blk, acc| {
                let mut blocks: Vec<CodeBlock> = cols.iter().map(|&c| CodeBlock::new(b, w, dtype, c, blk)).collect();
                let codes: Vec<Value> = blocks.iter_mut().map(|blk| blk.codes(0)).collect();
                let k0 = b.muli(blk, b.idx(GROUP));
                for (i, &r) in rows.iter().enumerate() {
                    let q = b.load_bytes(acts.q, &[r, k0], GROUP);
                    // q8_0's signed pairs (up to 2 · 128 · 127) leave no room to add them in i16.
                    let sums = if acts.vnni || dtype == DType::Q8_0 {
                        let dots: Vec<Value> = blocks
                            .iter()
                            .zip(&codes)
                            .map(|(blk, &c)| blk.dot(c, q, acts.vnni))
                            .collect();
                        totals(b, &dots)
                    } else {
                        let pairs: Vec<Value> = codes.iter().map(|&c| b.madd_u8_i8(c, q)).collect();
                        totals16(b, &pairs)
                    };
                    let at = LaneBlock {
                        w,
                        dtype,
                        cols: &cols,
                        acts,
                        blk,
                        r,
                    };
                    acc[i] = lane_step(b, at, b.sitofp(sums), acc[i]);
                }
            }),
        };
        for (i, &row) in rows.iter().enumerate() {
            for (c, &col) in cols.iter().enumerate() {
                self.finish(b, b.extract(acc[i], c), row, col);
            }
        }
    }

    /// The rows left after a call's full octets (2 to 7, from `t.r0`, a multiple of 8,
    /// up to the call's `rows`), from its partial octet ([`Octets::octets`]): a quad tile for
    /// rows `r0 .. r0 + 4` and, where rows remain, one for `r0 + 4 .. r0 + 8`, each storing
    /// only the outputs of the call's rows. Each row takes the octet's operations (so the
    /// one-row code's bits) at about the cost per row of a full octet, where the rows one at
    /// a time with a single weight row in the lanes took three times it: a 148-token prompt
    /// over q8_0, AVX2 code, ran 5 % slower per token than 144 or 152 tokens.
    pub(super) fn q8_octet_rest(
        &self,
        b: Kb<'c, '_>,
        w: Value<'c, '_>,
        dtype: DType,
        t: Tile<'c, '_>,
        acts: &Acts<'c, '_>,
        rows: Value<'c, '_>,
    ) {
        let oct = acts.octets.expect("octets for the rows after the full ones");
        let left = b.subi(rows, t.r0);
        self.q8_quads(b, w, dtype, t, acts, &oct, 0..1, Some(rows));
        let second = b.cmpi(crate::ir::Cmp::Ugt, left, b.idx(4));
        b.if_then(second, |b| self.q8_quads(b, w, dtype, t, acts, &oct, 1..2, Some(rows)));
    }

    /// Quads `quads` of the octet at `t.r0` (a multiple of 8; both quads: a full octet): per
    /// weight row and block, its codes with each chunk spread over a vector's lanes meet the
    /// quads' chunk vectors (the sums of each quad stay in i16: at most `4 · 2 · 31 · 127`),
    /// and the quads' sums come out as one vector of their rows' block sums, one lane per
    /// row; outputs stored for rows below `limit` where given.
    #[allow(clippy::too_many_arguments)]
    fn q8_quads(
        &self,
        b: Kb<'c, '_>,
        w: Value<'c, '_>,
        dtype: DType,
        t: Tile<'c, '_>,
        acts: &Acts<'c, '_>,
        oct: &Octets<'c, '_>,
        quads: std::ops::Range<usize>,
        limit: Option<Value<'c, '_>>,
    ) {
        let off = offset(dtype);
        let lanes = 4 * quads.len();
        let first_row = 4 * quads.start;
        let (_, cols, _) = t.start(b, 1, 0);
        let oc = b.divui(t.r0, b.idx(q8_layouts::ROWS));
        let inits: Vec<Value> = cols.iter().map(|_| b.f32_splat(0.0, lanes)).collect();
        let acc = self.q8_block_loop(b, w, dtype, &cols, t.end, &inits, 1, |b, blk, acc| {
            let zero = b.idx(0);
            let per_row = |mem| b.load_f32(mem, &[oc, blk, b.idx(first_row)], lanes);
            for (c, &col) in cols.iter().enumerate() {
                let mut block = CodeBlock::new(b, w, dtype, col, blk);
                let codes = b.vbitcast(block.codes(0), "vector<8xi32>");
                let spread: Vec<Value> = (0..4)
                    .map(|k| {
                        b.vbitcast(
                            b.shuffle_any(codes, codes, &[k, k, k, k, k + 4, k + 4, k + 4, k + 4]),
                            "vector<32xi8>",
                        )
                    })
                    .collect();
                let quad_sums: Vec<Value> = quads
                    .clone()
                    .map(|h| {
                        let chunks: Vec<Value> = (0..4)
                            .map(|k| b.load_bytes(oct.q, &[oc, blk, b.idx(4 * h + k), zero], GROUP))
                            .collect();
                        quad_sums(b, dtype, &spread, &chunks, acts.vnni)
                    })
                    .collect();
                let sums = match quad_sums[..] {
                    [q] => b.addi(b.slice(q, 0, 4), b.slice(q, 4, 4)),
                    [q0, q1] => {
                        let halves = |first: usize| {
                            let lanes: Vec<usize> = (first..first + 4).chain(first + 8..first + 12).collect();
                            b.shuffle_any(q0, q1, &lanes)
                        };
                        b.addi(halves(0), halves(4))
                    }
                    _ => unreachable!("an octet has two quads"),
                };
                let scale = b.mulf(
                    b.load_f16_splat(w, &[col, b.muli(blk, b.idx(dtype.block_bytes()))], lanes),
                    per_row(oct.d),
                );
                let min = || {
                    let m = half(b, w, dtype, col, blk, 2);
                    (b.extf(b.shuffle_any(m, m, &vec![0; lanes])), per_row(oct.s))
                };
                acc[c] = block_step(b, off, b.sitofp(sums), per_row(oct.sums), scale, min, acc[c]);
            }
        });
        let rows: Vec<Value> = (0..lanes).map(|i| b.addi(t.r0, b.idx(first_row + i))).collect();
        self.finish_lanes(b, &acc, &rows, &cols, limit);
    }

    /// Stores each weight row's accumulator (`acc[c]`, one lane per activation row of `rows`),
    /// for rows below `limit` where given.
    fn finish_lanes(
        &self,
        b: Kb<'c, '_>,
        acc: &[Value<'c, '_>],
        rows: &[Value<'c, '_>],
        cols: &[Value<'c, '_>],
        limit: Option<Value<'c, '_>>,
    ) {
        for (c, &col) in cols.iter().enumerate() {
            for (i, &row) in rows.iter().enumerate() {
                let store = |b: Kb<'c, '_>| self.finish(b, b.extract(acc[c], i), row, col);
                match limit {
                    Some(n) => b.if_then(b.cmpi(crate::ir::Cmp::Ult, row, n), store),
                    None => store(b),
                }
            }
        }
    }

    /// A full sixteen of activation rows (`t.r0` a multiple of 16, AVX512-VNNI): per weight
    /// row and block, each 4-code chunk of its codes repeated in 16 lanes (`vpermd`) meets the
    /// sixteen's chunk vector in one 512-bit `vpdpbusd`, and eight of them leave the 16 rows'
    /// exact block sums in the lanes; then the float step of [`block_step`] for all 16, as the
    /// octets and the one-row code take it per output (so the same bits).
    fn q8_sixteen(&self, b: Kb<'c, '_>, w: Value<'c, '_>, dtype: DType, t: Tile<'c, '_>, six: &Sixteens<'c, '_>) {
        let off = offset(dtype);
        let n = q8_layouts::SIXTEEN;
        let (rows, cols, _) = t.start(b, 1, 0);
        let o = b.divui(t.r0, b.idx(n));
        let inits: Vec<Value> = cols.iter().map(|_| b.f32_splat(0.0, n)).collect();
        let acc = self.q8_block_loop(b, w, dtype, &cols, t.end, &inits, 1, |b, blk, acc| {
            let zero = b.idx(0);
            let per_row = |mem| b.load_f32(mem, &[o, blk, zero], n);
            // q8_0's rows go in as `vpdpbusd`'s unsigned operand, `q + 128` ([`sixteen_sums`]).
            let flip = (dtype == DType::Q8_0).then(|| b.int_splat(-128, 64, "i8"));
            let chunks: Vec<Value> = (0..GROUP / 4)
                .map(|k| {
                    let q = b.vbitcast(b.load_vec(six.q, &[o, blk, b.idx(k), zero], n, "i32"), "vector<64xi8>");
                    flip.map_or(q, |f| b.xori(q, f))
                })
                .collect();
            for (c, &col) in cols.iter().enumerate() {
                let codes = CodeBlock::new(b, w, dtype, col, blk).codes(0);
                let sums = sixteen_sums(b, dtype, codes, &chunks);
                let scale = b.mulf(
                    b.load_f16_splat(w, &[col, b.muli(blk, b.idx(dtype.block_bytes()))], n),
                    per_row(six.d),
                );
                let min = || {
                    let h = half(b, w, dtype, col, blk, 2);
                    (b.extf(b.shuffle_any(h, h, &[0; 16])), per_row(six.s))
                };
                acc[c] = block_step(b, off, b.sitofp(sums), per_row(six.sums), scale, min, acc[c]);
            }
        });
        self.finish_lanes(b, &acc, &rows, &cols, None);
    }
}
