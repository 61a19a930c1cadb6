//! The Gated DeltaNet recurrence of a prefill call in chunks: the WY (UT-transform) form
//! `transformers` runs for a prompt (`torch_chunk_gated_delta_rule`), so a long prompt is a
//! sequence of small matrix products instead of a token-by-token loop.
//!
//! Per value head, a chunk is up to [`CHUNK`] consecutive rows of one sequence (chunks start
//! at positions that are multiples of [`CHUNK`], where a call starts, and where the sequence
//! changes). With `G` the running sum of the log-decays `g` over the chunk, `Γ[i][j] =
//! exp(G_i - G_j)` and `S` the state before the chunk:
//! - `T = (I + strict_lower(diag(beta) K K^T ⊙ Γ))^-1` by forward substitution; with `beta`
//!   folded into its columns it gives `U = T diag(beta) V` and
//!   `W = T diag(beta exp(G)) K`, the chunk's values and keys with the delta rule's
//!   corrections inside the chunk applied;
//! - `V' = U - W S` (what each row writes into the state),
//! - `out = (Q ⊙ exp(G)) S + lower(Q K^T ⊙ Γ) V'`,
//! - `S ← exp(G_last) S + (K ⊙ exp(G_last - G))^T V'`.
//!
//! Everything that does not depend on the state's columns (`T`, `W`, `Q exp(G)`, `Q K^T Γ`,
//! the decayed keys) is prepared once per (head, chunk) in per-thread scratch; then each
//! block of `lanes` state columns runs the three products above as tiles of [`TILE`]
//! accumulators, each loaded state vector or `V'` row shared by the tile's FMAs. Decode keeps
//! the one-token form (`delta_net.rs`): the two agree to rounding, not bitwise.

use super::delta_net::key_head;
use super::{Dyn, row_place, thread_range};
use crate::ir::{Cmp, Kb, lanes_for};
use kiln_core::{Kernel, graph::row_info};
use melior::ir::Value;

/// Rows per chunk: the intra-chunk products cost `CHUNK` FMAs per row and state column on
/// top of the `3 k_dim` every form pays, and the scratch (about 74 KiB at `k_dim` 128) stays
/// in L2.
pub const CHUNK: usize = 32;

/// Accumulators per tile: with one loaded vector and one broadcast they fit AVX2's 16
/// registers.
const TILE: usize = 8;

/// Per-thread scratch for one (head, chunk), reused by every chunk the thread runs.
struct Scratch<'c, 'a> {
    /// `G_i`, the running sum of the chunk's log-decays, and `exp(G_i)`.
    g: Value<'c, 'a>,
    eg: Value<'c, 'a>,
    /// `T diag(beta)`, lower triangular with zeros above the diagonal.
    tb: Value<'c, 'a>,
    /// `Q K^T ⊙ Γ`, lower triangular (diagonal included).
    qk: Value<'c, 'a>,
    /// `W = T diag(beta exp(G)) K` and `Q ⊙ exp(G)`, `[CHUNK, k_dim]`.
    w: Value<'c, 'a>,
    qg: Value<'c, 'a>,
    /// `beta` of each row.
    bv: Value<'c, 'a>,
    /// `K^T` and `(K ⊙ exp(G_last - G))^T`, `[k_dim, CHUNK]`.
    kt: Value<'c, 'a>,
    kdt: Value<'c, 'a>,
    /// `V'` of the current block of columns, `[CHUNK, lanes]`.
    vn: Value<'c, 'a>,
}

/// A value head, where its key head's q and k start in a `qkv` row, and their width.
#[derive(Clone, Copy)]
struct Head<'c, 'a> {
    h: Value<'c, 'a>,
    q0: Value<'c, 'a>,
    k0: Value<'c, 'a>,
    k_dim: usize,
}

pub fn emit_delta_chunked<'c>(b: Kb<'c, '_>, kernel: &Kernel, p: &[Value<'c, '_>], d: Dyn<'c, '_>, max_lanes: usize) {
    let Kernel::DeltaNet {
        k_heads,
        v_heads,
        k_dim,
        v_dim,
        order,
        ..
    } = *kernel
    else {
        unreachable!()
    };
    let lanes = lanes_for(v_dim, max_lanes);
    let blocks = v_dim / lanes;
    let s = Scratch {
        g: b.alloca(&format!("memref<{CHUNK}xf32>")),
        eg: b.alloca(&format!("memref<{CHUNK}xf32>")),
        tb: b.alloca(&format!("memref<{CHUNK}x{CHUNK}xf32>")),
        qk: b.alloca(&format!("memref<{CHUNK}x{CHUNK}xf32>")),
        w: b.alloca(&format!("memref<{CHUNK}x{k_dim}xf32>")),
        qg: b.alloca(&format!("memref<{CHUNK}x{k_dim}xf32>")),
        bv: b.alloca(&format!("memref<{CHUNK}xf32>")),
        kt: b.alloca(&format!("memref<{k_dim}x{CHUNK}xf32>")),
        kdt: b.alloca(&format!("memref<{k_dim}x{CHUNK}xf32>")),
        vn: b.alloca(&format!("memref<{CHUNK}x{lanes}xf32>")),
    };
    let (start, end) = thread_range(b, b.idx(v_heads), d, 1);
    b.for_each(start, end, b.idx(1), |b, h| {
        let q0 = b.muli(key_head(b, h, order, k_heads, v_heads), b.idx(k_dim));
        let head = Head {
            h,
            q0,
            k0: b.addi(b.idx(k_heads * k_dim), q0),
            k_dim,
        };
        b.for_each(b.idx(0), d.rows, b.idx(1), |b, r0| {
            b.if_then(starts_chunk(b, p[5], r0), |b| {
                let n = chunk_len(b, p[5], r0, d.rows);
                prepare(b, &s, p, head, r0, n, max_lanes);
                let place = row_place(b, p[5], r0);
                let fresh = b.cmpi(Cmp::Eq, place.position, b.idx(0));
                b.for_each(b.idx(0), b.idx(blocks), b.idx(1), |b, blk| {
                    // This block's slice of the slot's state: `k_dim` vectors of `lanes`.
                    let sh = b.addi(b.muli(place.slot, b.idx(v_heads)), h);
                    let base = b.muli(b.addi(b.muli(sh, b.idx(blocks)), blk), b.idx(k_dim * lanes));
                    let col = b.muli(blk, b.idx(lanes));
                    let v0 = b.addi(b.idx(2 * k_heads * k_dim), b.addi(b.muli(h, b.idx(v_dim)), col));
                    let o0 = b.addi(b.muli(h, b.idx(v_dim)), col);
                    let block = Block {
                        state: p[4],
                        base,
                        lanes,
                    };
                    b.if_then(fresh, |b| block.zero(b, k_dim));
                    columns(b, &s, p, block, r0, n, (v0, o0), k_dim);
                });
            });
        });
    });
}

/// Row `r` starts a chunk: the call's first row, a new sequence or a jump in position, or a
/// position that is a multiple of [`CHUNK`] (so a prompt is chunked the same way whatever
/// the prefill block size, as long as blocks start on such positions).
fn starts_chunk<'c, 'a>(b: Kb<'c, 'a>, info: Value<'c, '_>, r: Value<'c, '_>) -> Value<'c, 'a> {
    let first = b.cmpi(Cmp::Eq, r, b.idx(0));
    let prev = b.subi(b.maxui(r, b.idx(1)), b.idx(1));
    let get = |row: Value<'c, '_>, field: usize| b.load_i32_index(info, &[row, b.idx(field)]);
    let pos = get(r, row_info::POSITION);
    let other_slot = b.cmpi(Cmp::Ne, get(r, row_info::SLOT), get(prev, row_info::SLOT));
    let jump = b.cmpi(Cmp::Ne, pos, b.addi(get(prev, row_info::POSITION), b.idx(1)));
    let aligned = b.cmpi(Cmp::Eq, b.remui(pos, b.idx(CHUNK)), b.idx(0));
    b.ori(b.ori(first, other_slot), b.ori(jump, aligned))
}

/// Rows in the chunk starting at `r0`: up to the next row that starts one, the call's end or
/// [`CHUNK`].
fn chunk_len<'c, 'a>(b: Kb<'c, 'a>, info: Value<'c, '_>, r0: Value<'c, '_>, rows: Value<'c, '_>) -> Value<'c, 'a> {
    let last = b.subi(rows, b.idx(1));
    b.for_range(b.idx(1), b.idx(CHUNK), b.idx(1), &[b.idx(1)], |b, i, n| {
        let r = b.addi(r0, i);
        let inside = b.cmpi(Cmp::Ult, r, rows);
        let next = starts_chunk(b, info, b.minui(r, last));
        let going = b.andi(b.cmpi(Cmp::Eq, n[0], i), inside);
        let grown = b.select(next, n[0], b.addi(i, b.idx(1)));
        vec![b.select(going, grown, n[0])]
    })[0]
}

/// The chunk's column-independent matrices, into `s`. Rows of the `CHUNK x CHUNK` matrices
/// are `cl`-lane vectors; lanes past the chunk's `n` rows hold what an earlier chunk left and
/// are kept out by selects (never by multiplying by zero, which a stale NaN would survive).
fn prepare<'c>(
    b: Kb<'c, '_>,
    s: &Scratch<'c, '_>,
    p: &[Value<'c, '_>],
    hd: Head<'c, '_>,
    r0: Value<'c, '_>,
    n: Value<'c, '_>,
    max_lanes: usize,
) {
    let (qkv, h, k_dim) = (p[0], hd.h, hd.k_dim);
    let cl = lanes_for(CHUNK, max_lanes);
    let vecs = CHUNK / cl;
    // Per row: G (the running sum of the log-decays), exp(G), beta, and k into K^T.
    b.for_range(b.idx(0), n, b.idx(1), &[b.f32c(0.0)], |b, i, acc| {
        let r = b.addi(r0, i);
        let g = b.addf(acc[0], b.load_f32(p[1], &[r, h], 1));
        b.store(g, s.g, &[i]);
        b.store(b.exp(g), s.eg, &[i]);
        b.store(b.load_f32(p[2], &[r, h], 1), s.bv, &[i]);
        b.for_each(b.idx(0), b.idx(k_dim), b.idx(1), |b, m| {
            b.store(b.load_f32(qkv, &[r, b.addi(hd.k0, m)], 1), s.kt, &[m, i]);
        });
        vec![g]
    });
    // Row i of Q K^T Γ (diagonal included) and of A = -diag(beta) K K^T Γ (strictly lower),
    // both from one pass over K^T.
    b.for_each(b.idx(0), n, b.idx(1), |b, i| {
        let r = b.addi(r0, i);
        let zeros: Vec<Value> = (0..2 * vecs).map(|_| b.zero_like(cl)).collect();
        let sums = b.for_range(b.idx(0), b.idx(k_dim), b.idx(1), &zeros, |b, m, acc| {
            let q = splat(b, b.load_f32(qkv, &[r, b.addi(hd.q0, m)], 1), cl);
            let k = splat(b, b.load_f32(qkv, &[r, b.addi(hd.k0, m)], 1), cl);
            (0..vecs)
                .flat_map(|v| {
                    let kt = b.load_f32(s.kt, &[m, b.idx(v * cl)], cl);
                    [b.fma(q, kt, acc[2 * v]), b.fma(k, kt, acc[2 * v + 1])]
                })
                .collect()
        });
        let gi = splat(b, b.load_f32(s.g, &[i], 1), cl);
        let neg_beta = splat(b, b.negf(b.load_f32(s.bv, &[i], 1)), cl);
        let at = splat(b, b.index_to_f32(i), cl);
        for v in 0..vecs {
            let c = b.idx(v * cl);
            let gamma = b.exp(b.subf(gi, b.load_f32(s.g, &[c], cl)));
            let j = lane_indices(b, v, cl);
            let qk = b.mulf(sums[2 * v], gamma);
            b.store(b.select(b.cmpf("ole", j, at), qk, b.zero_like(cl)), s.qk, &[i, c]);
            let a = b.mulf(b.mulf(sums[2 * v + 1], gamma), neg_beta);
            b.store(b.select(b.cmpf("olt", j, at), a, b.zero_like(cl)), s.tb, &[i, c]);
        }
    });
    // T - I by forward substitution, a whole row at a time: row i is A[i] + sum_{m<i} A[i][m]
    // (T - I)[m] (rows of T - I are zero from their diagonal on). The row is stored only once
    // complete: its own first entries are the coefficients.
    b.for_each(b.idx(1), n, b.idx(1), |b, i| {
        let row: Vec<Value> = (0..vecs).map(|v| b.load_f32(s.tb, &[i, b.idx(v * cl)], cl)).collect();
        let row = b.for_range(b.idx(0), i, b.idx(1), &row, |b, m, acc| {
            let a = splat(b, b.load_f32(s.tb, &[i, m], 1), cl);
            (0..vecs)
                .map(|v| b.fma(a, b.load_f32(s.tb, &[m, b.idx(v * cl)], cl), acc[v]))
                .collect()
        });
        for (v, x) in row.into_iter().enumerate() {
            b.store(x, s.tb, &[i, b.idx(v * cl)]);
        }
    });
    // T diag(beta): the unit diagonal, beta folded into the columns.
    b.for_each(b.idx(0), n, b.idx(1), |b, i| {
        let at = splat(b, b.index_to_f32(i), cl);
        for v in 0..vecs {
            let c = b.idx(v * cl);
            let j = lane_indices(b, v, cl);
            let t = b.select(
                b.cmpf("oeq", j, at),
                b.f32_splat(1.0, cl),
                b.load_f32(s.tb, &[i, c], cl),
            );
            let tb = b.mulf(t, b.load_f32(s.bv, &[c], cl));
            b.store(b.select(b.cmpf("ole", j, at), tb, b.zero_like(cl)), s.tb, &[i, c]);
        }
    });
    // W = T diag(beta exp(G)) K, up to 8 vectors of a row at a time, and Q exp(G).
    let kl = lanes_for(k_dim, max_lanes);
    let pieces: Vec<usize> = (0..k_dim / kl).collect();
    b.for_each(b.idx(0), n, b.idx(1), |b, i| {
        for group in pieces.chunks(8) {
            let zeros: Vec<Value> = group.iter().map(|_| b.zero_like(kl)).collect();
            let w = b.for_range(b.idx(0), b.addi(i, b.idx(1)), b.idx(1), &zeros, |b, j, acc| {
                let coef = b.mulf(b.load_f32(s.tb, &[i, j], 1), b.load_f32(s.eg, &[j], 1));
                let coef = splat(b, coef, kl);
                let rj = b.addi(r0, j);
                group
                    .iter()
                    .zip(acc)
                    .map(|(&v, acc)| b.fma(coef, b.load_f32(qkv, &[rj, b.addi(hd.k0, b.idx(v * kl))], kl), acc))
                    .collect()
            });
            for (&v, w) in group.iter().zip(w) {
                b.store(w, s.w, &[i, b.idx(v * kl)]);
            }
        }
        let (r, eg) = (b.addi(r0, i), splat(b, b.load_f32(s.eg, &[i], 1), kl));
        b.for_each(b.idx(0), b.idx(k_dim), b.idx(kl), |b, c| {
            let q = b.load_f32(qkv, &[r, b.addi(hd.q0, c)], kl);
            b.store(b.mulf(q, eg), s.qg, &[i, c]);
        });
    });
    // The keys decayed to the chunk's end, (K exp(G_last - G))^T.
    let g_last = splat(b, b.load_f32(s.g, &[b.subi(n, b.idx(1))], 1), cl);
    let to_end: Vec<Value> = (0..vecs)
        .map(|v| b.exp(b.subf(g_last, b.load_f32(s.g, &[b.idx(v * cl)], cl))))
        .collect();
    b.for_each(b.idx(0), b.idx(k_dim), b.idx(1), |b, m| {
        for (v, e) in to_end.iter().enumerate() {
            let c = b.idx(v * cl);
            b.store(b.mulf(b.load_f32(s.kt, &[m, c], cl), *e), s.kdt, &[m, c]);
        }
    });
}

/// The lane numbers `v cl .. (v + 1) cl` as floats (column indices of a row's vector `v`).
fn lane_indices<'c, 'a>(b: Kb<'c, 'a>, v: usize, cl: usize) -> Value<'c, 'a> {
    let idx: Vec<f32> = (v * cl..(v + 1) * cl).map(|j| j as f32).collect();
    if cl == 1 { b.f32c(idx[0]) } else { b.f32_vec(&idx) }
}

/// One block of `lanes` state columns of one head, `k_dim` vectors from `base`.
#[derive(Clone, Copy)]
struct Block<'c, 'a> {
    state: Value<'c, 'a>,
    base: Value<'c, 'a>,
    lanes: usize,
}

impl<'c> Block<'c, '_> {
    fn at<'a>(&self, b: Kb<'c, 'a>, m: Value<'c, '_>) -> Value<'c, 'a> {
        b.addi(self.base, b.muli(m, b.idx(self.lanes)))
    }
    fn load<'a>(&self, b: Kb<'c, 'a>, m: Value<'c, '_>) -> Value<'c, 'a> {
        b.load_f32(self.state, &[self.at(b, m)], self.lanes)
    }
    fn zero(&self, b: Kb<'c, '_>, k_dim: usize) {
        let zero = b.zero_like(self.lanes);
        b.for_each(b.idx(0), b.idx(k_dim), b.idx(1), |b, m| {
            b.store(zero, self.state, &[self.at(b, m)]);
        });
    }
}

/// The chunk's three products over one block of columns: `V' = U - W S`, the outputs
/// `(Q exp(G)) S + (Q K^T Γ) V'`, then the state.
#[allow(clippy::too_many_arguments)]
fn columns<'c>(
    b: Kb<'c, '_>,
    s: &Scratch<'c, '_>,
    p: &[Value<'c, '_>],
    blk: Block<'c, '_>,
    r0: Value<'c, '_>,
    n: Value<'c, '_>,
    (v0, o0): (Value<'c, '_>, Value<'c, '_>),
    k_dim: usize,
) {
    let (qkv, out, lanes) = (p[0], p[3], blk.lanes);
    let kd = b.idx(k_dim);
    tiles(b, n, |b, i0, t| {
        // Row i's coefficient of row j is zero above the diagonal, so the tile runs over
        // every row up to its last.
        let rows_in = b.addi(i0, b.idx(t));
        let zeros: Vec<Value> = (0..t).map(|_| b.zero_like(lanes)).collect();
        let u = fold(
            b,
            rows_in,
            &zeros,
            lanes,
            |b, j| b.load_f32(qkv, &[b.addi(r0, j), v0], lanes),
            |b, k, j| b.load_f32(s.tb, &[b.addi(i0, b.idx(k)), j], 1),
        );
        let ws = fold(
            b,
            kd,
            &zeros,
            lanes,
            |b, m| blk.load(b, m),
            |b, k, m| b.load_f32(s.w, &[b.addi(i0, b.idx(k)), m], 1),
        );
        for k in 0..t {
            b.store(b.subf(u[k], ws[k]), s.vn, &[b.addi(i0, b.idx(k)), b.idx(0)]);
        }
    });
    tiles(b, n, |b, i0, t| {
        let rows_in = b.addi(i0, b.idx(t));
        let zeros: Vec<Value> = (0..t).map(|_| b.zero_like(lanes)).collect();
        let inter = fold(
            b,
            kd,
            &zeros,
            lanes,
            |b, m| blk.load(b, m),
            |b, k, m| b.load_f32(s.qg, &[b.addi(i0, b.idx(k)), m], 1),
        );
        let o = fold(
            b,
            rows_in,
            &inter,
            lanes,
            |b, j| b.load_f32(s.vn, &[j, b.idx(0)], lanes),
            |b, k, j| b.load_f32(s.qk, &[b.addi(i0, b.idx(k)), j], 1),
        );
        for (k, o) in o.into_iter().enumerate() {
            b.store(o, out, &[b.addi(r0, b.addi(i0, b.idx(k))), o0]);
        }
    });
    let e_last = splat(b, b.load_f32(s.eg, &[b.subi(n, b.idx(1))], 1), lanes);
    tiles(b, kd, |b, m0, t| {
        let decayed: Vec<Value> = (0..t)
            .map(|k| b.mulf(blk.load(b, b.addi(m0, b.idx(k))), e_last))
            .collect();
        let new = fold(
            b,
            n,
            &decayed,
            lanes,
            |b, i| b.load_f32(s.vn, &[i, b.idx(0)], lanes),
            |b, k, i| b.load_f32(s.kdt, &[b.addi(m0, b.idx(k)), i], 1),
        );
        for (k, v) in new.into_iter().enumerate() {
            b.store(v, blk.state, &[blk.at(b, b.addi(m0, b.idx(k)))]);
        }
    });
}

/// `0..n` in tiles of [`TILE`], then one by one: `body(b, first, count)`.
fn tiles<'c, F>(b: Kb<'c, '_>, n: Value<'c, '_>, body: F)
where
    F: for<'x> Fn(Kb<'c, 'x>, Value<'c, 'x>, usize),
{
    let full = b.muli(b.divui(n, b.idx(TILE)), b.idx(TILE));
    b.for_each(b.idx(0), full, b.idx(TILE), |b, i0| body(b, i0, TILE));
    b.for_each(full, n, b.idx(1), |b, i| body(b, i, 1));
}

/// `accs[k] + sum_{j < len} coef(k, j) * vector(j)` for each accumulator of a tile: each
/// vector is loaded once for all of them.
fn fold<'c, 'a, V, C>(
    b: Kb<'c, 'a>,
    len: Value<'c, '_>,
    accs: &[Value<'c, 'a>],
    lanes: usize,
    vector: V,
    coef: C,
) -> Vec<Value<'c, 'a>>
where
    V: for<'x> Fn(Kb<'c, 'x>, Value<'c, 'x>) -> Value<'c, 'x>,
    C: for<'x> Fn(Kb<'c, 'x>, usize, Value<'c, 'x>) -> Value<'c, 'x>,
{
    b.for_range(b.idx(0), len, b.idx(1), accs, |b, j, accs| {
        let v = vector(b, j);
        accs.iter()
            .enumerate()
            .map(|(k, acc)| b.fma(splat(b, coef(b, k, j), lanes), v, *acc))
            .collect()
    })
}

/// A scalar in every lane (itself at one lane).
fn splat<'c, 'a>(b: Kb<'c, 'a>, x: Value<'c, 'a>, lanes: usize) -> Value<'c, 'a> {
    if lanes == 1 { x } else { b.broadcast(x, lanes) }
}
