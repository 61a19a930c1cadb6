//! The Gated DeltaNet's short convolution and gated norm: the parts of a recurrent layer around
//! its delta rule (`delta_net.rs`).
//!
//! A call's rows may belong to several sequences (a batched step), each a run of consecutive
//! rows at consecutive positions. The convolution reads an input `m` positions back from the
//! same run when it is in this call, else from the slot's state (the sequence's last
//! `taps - 1` inputs before this call), else zero (before the sequence's start), so every row
//! sees what a token-by-token run would, and a sequence restarted at position 0 never reads
//! what an earlier one left in its slot.

use super::elementwise::activate;
use super::norm::{NormWeights, Row, normalize_row};
use super::{Dyn, row_place, thread_range};
use crate::ir::{Cmp, Kb, lanes_for};
use kiln_core::{Act, Kernel, NormKind, NormShape};
use melior::ir::Value;

/// Causal depthwise convolution, then SiLU; see [`Kernel::CausalConv`]. Threads split the
/// channels; each walks every row of its channels in order, then writes the new state of each
/// sequence from its last row.
pub fn emit_causal_conv<'c>(b: Kb<'c, '_>, kernel: &Kernel, p: &[Value<'c, '_>], d: Dyn<'c, '_>, max_lanes: usize) {
    let Kernel::CausalConv {
        channels, taps, wdtype, ..
    } = *kernel
    else {
        unreachable!()
    };
    let conv = Conv {
        x: p[0],
        info: p[4],
        state: p[3],
        channels,
        taps,
    };
    // Deinterleaving the `[channels, taps]` weights into one vector per tap needs whole taps
    // per vector; otherwise the kernel runs on scalars.
    let lanes = match lanes_for(channels, max_lanes) {
        l if l.is_multiple_of(taps) => l,
        _ => 1,
    };
    let (start, end) = thread_range(b, b.idx(channels), d, lanes);
    b.for_each(start, end, b.idx(lanes), |b, c| {
        let w = tap_vectors(b, p[1], wdtype, c, taps, lanes);
        b.for_each(b.idx(0), d.rows, b.idx(1), |b, r| {
            let src = conv.sources(b, r);
            let mut acc = b.mulf(w[0], conv.input(b, &src, taps - 1, c, lanes));
            for (j, wj) in w.iter().enumerate().skip(1) {
                acc = b.fma(*wj, conv.input(b, &src, taps - 1 - j, c, lanes), acc);
            }
            b.store(activate(b, Act::Silu, acc), p[2], &[r, c]);
        });
        // The new state of each sequence: its last `taps - 1` inputs, read before any is
        // written (they may come from the old state).
        b.for_each(b.idx(0), d.rows, b.idx(1), |b, r| {
            let src = conv.sources(b, r);
            b.if_then(conv.ends_run(b, r, d.rows, &src), |b| {
                let kept: Vec<_> = (0..taps - 1)
                    .map(|i| conv.input(b, &src, taps - 2 - i, c, lanes))
                    .collect();
                for (i, v) in kept.into_iter().enumerate() {
                    b.store(v, conv.state, &[src.slot, b.addi(b.idx(i * channels), c)]);
                }
            });
        });
    });
}

/// The convolution's buffers and shape.
struct Conv<'c, 'a> {
    x: Value<'c, 'a>,
    info: Value<'c, 'a>,
    state: Value<'c, 'a>,
    channels: usize,
    taps: usize,
}

/// Where row `r`'s earlier inputs are: for each lag `m` (1 .. taps - 1), whether row `r - m`
/// is the same sequence's previous row(s) in this call, and how many of the lags are.
struct Sources<'c, 'a> {
    r: Value<'c, 'a>,
    position: Value<'c, 'a>,
    slot: Value<'c, 'a>,
    /// `in_call[m - 1]`: lag `m` is a row of this call.
    in_call: Vec<Value<'c, 'a>>,
    /// `in_run[m - 1]`: how many of the lags `1..=m` are rows of this call.
    in_run: Vec<Value<'c, 'a>>,
}

impl<'c, 'a> Conv<'c, 'a> {
    fn sources<'x>(&self, b: Kb<'c, 'x>, r: Value<'c, 'x>) -> Sources<'c, 'x> {
        let here = row_place(b, self.info, r);
        let (mut in_call, mut in_run) = (Vec::new(), Vec::new());
        let mut still = b.cmpi(Cmp::Eq, b.idx(0), b.idx(0));
        let mut count = b.idx(0);
        for m in 1..self.taps {
            // Row r - m (clamped; only meaningful when r >= m) at position p - m of this slot.
            let exists = b.cmpi(Cmp::Uge, r, b.idx(m));
            let prev = row_place(b, self.info, b.subi(b.maxui(r, b.idx(m)), b.idx(m)));
            let same_slot = b.cmpi(Cmp::Eq, prev.slot, here.slot);
            let step = b.cmpi(Cmp::Eq, b.addi(prev.position, b.idx(m)), here.position);
            still = b.andi(still, b.andi(exists, b.andi(same_slot, step)));
            count = b.addi(count, b.select(still, b.idx(1), b.idx(0)));
            in_call.push(still);
            in_run.push(count);
        }
        Sources {
            r,
            position: here.position,
            slot: here.slot,
            in_call,
            in_run,
        }
    }

    /// The input `m` positions before row `src.r` (`m = 0`: the row's own) at channels
    /// `c .. c + lanes`: from this call, the slot's state, or zero before the sequence.
    fn input<'x>(
        &self,
        b: Kb<'c, 'x>,
        src: &Sources<'c, '_>,
        m: usize,
        c: Value<'c, '_>,
        lanes: usize,
    ) -> Value<'c, 'x> {
        if m == 0 {
            return b.load_f32(self.x, &[src.r, c], lanes);
        }
        let row = b.subi(b.maxui(src.r, b.idx(m)), b.idx(m));
        let from_call = b.load_f32(self.x, &[row, c], lanes);
        // The state holds positions p0 - (taps - 1) .. p0 - 1 (p0 = this run's first), oldest
        // first: position p - m sits at `taps - 1 - m + (rows of the run before r)`.
        let back = b.addi(b.idx(self.taps - 1 - m), src.in_run[m - 1]);
        let at = b.minui(back, b.idx(self.taps - 2));
        let col = b.addi(b.muli(at, b.idx(self.channels)), c);
        let from_state = b.load_f32(self.state, &[src.slot, col], lanes);
        let before_start = b.cmpi(Cmp::Ult, src.position, b.idx(m));
        let earlier = b.select(before_start, b.zero_like(lanes), from_state);
        b.select(src.in_call[m - 1], from_call, earlier)
    }

    /// Whether row `r` is the last of its sequence in this call.
    fn ends_run<'x>(
        &self,
        b: Kb<'c, 'x>,
        r: Value<'c, '_>,
        rows: Value<'c, '_>,
        src: &Sources<'c, '_>,
    ) -> Value<'c, 'x> {
        let next = b.addi(r, b.idx(1));
        let last = b.cmpi(Cmp::Uge, next, rows);
        let after = row_place(b, self.info, b.minui(next, b.subi(rows, b.idx(1))));
        let continues = b.andi(
            b.cmpi(Cmp::Eq, after.slot, src.slot),
            b.cmpi(Cmp::Eq, after.position, b.addi(src.position, b.idx(1))),
        );
        let not_continued = b.cmpi(Cmp::Eq, b.select(continues, b.idx(1), b.idx(0)), b.idx(0));
        b.ori(last, not_continued)
    }
}

/// The weights of channels `c .. c + lanes`, one vector per tap: the `[channels, taps]` values
/// are loaded as `taps` contiguous vectors and deinterleaved by shuffles (tap `j` of channel
/// `i` is flat element `i * taps + j`).
fn tap_vectors<'c, 'a>(
    b: Kb<'c, 'a>,
    w: Value<'c, '_>,
    wdtype: kiln_core::DType,
    c: Value<'c, '_>,
    taps: usize,
    lanes: usize,
) -> Vec<Value<'c, 'a>> {
    let base = b.muli(c, b.idx(taps));
    let flat: Vec<Value> = (0..taps)
        .map(|m| b.load_weight(w, &[b.addi(base, b.idx(m * lanes))], lanes, wdtype))
        .collect();
    if lanes == 1 {
        return flat;
    }
    (0..taps)
        .map(|j| {
            // Each loaded vector's lanes of tap j, then the pieces joined in order.
            let mut pieces: Vec<(Value, usize)> = flat
                .iter()
                .enumerate()
                .map(|(m, v)| {
                    let mask: Vec<usize> = (0..lanes).filter(|i| (m * lanes + i) % taps == j).collect();
                    (b.shuffle(*v, *v, &mask), mask.len())
                })
                .collect();
            while pieces.len() > 1 {
                let mut next = Vec::with_capacity(pieces.len().div_ceil(2));
                for pair in pieces.chunks(2) {
                    match pair {
                        [(a, la), (c, lc)] => {
                            let mask: Vec<usize> = (0..la + lc).collect();
                            next.push((b.shuffle(*a, *c, &mask), la + lc));
                        }
                        [single] => next.push(*single),
                        _ => unreachable!(),
                    }
                }
                pieces = next;
            }
            pieces[0].0
        })
        .collect()
}

/// `x = rmsnorm(x) * w * silu(gate)` per head; see [`Kernel::GatedNorm`]. Threads split the
/// (row, head) pairs.
pub fn emit_gated_norm<'c>(b: Kb<'c, '_>, kernel: &Kernel, p: &[Value<'c, '_>], d: Dyn<'c, '_>, max_lanes: usize) {
    let Kernel::GatedNorm {
        width,
        dim,
        wdtype,
        eps,
        ..
    } = *kernel
    else {
        unreachable!()
    };
    let (x, gate) = (p[0], p[1]);
    let heads = width / dim;
    let norm = NormShape {
        kind: NormKind::Rms,
        eps,
        wdtype,
        bias: None,
    };
    let weights = NormWeights { w: p[2], bias: None };
    let lanes = lanes_for(dim, max_lanes);
    let total = b.muli(d.rows, b.idx(heads));
    let (start, end) = thread_range(b, total, d, 1);
    b.for_each(start, end, b.idx(1), |b, item| {
        let r = b.divui(item, b.idx(heads));
        let c0 = b.muli(b.remui(item, b.idx(heads)), b.idx(dim));
        let row = Row { mem: x, r, c0 };
        // `transformers`: `w * (x * rsqrt(...))`, then `* silu(gate)`.
        normalize_row(b, &norm, weights, row, row, dim, max_lanes, false);
        b.for_each(b.idx(0), b.idx(dim), b.idx(lanes), |b, i| {
            let col = b.addi(c0, i);
            let v = b.load_f32(x, &[r, col], lanes);
            let g = activate(b, Act::Silu, b.load_f32(gate, &[r, col], lanes));
            b.store(b.mulf(v, g), x, &[r, col]);
        });
    });
}
