//! From the spec's operations to the kernel calls of one regime.
//!
//! Prefill (`max_rows > DECODE_ROWS`) lowers every operation to its own kernel. Decode and the
//! output head (at most `DECODE_ROWS` rows: one per sequence of a batched step) fuse two
//! patterns, both bitwise neutral (the fused kernels run the unfused kernels' instructions for
//! each value):
//!
//! * **Folded norms.** A norm whose output is read only by linear operations (until it is
//!   overwritten) disappears: each of those matmuls normalises the one row itself, into a stack
//!   buffer of each thread, so the barrier between the norm and its readers goes. The norm's
//!   input must not change between the norm and its last reader.
//! * **Gated MLP input.** Two linear projections of the same input (plain: no bias, no
//!   activation, not accumulating) followed by `gate = act(gate) * up` become one `gate_up`
//!   kernel that finishes each output as soon as its two dot products are done.

use super::op::{Norm, Op, OpKind, norm_weights};
use super::{Arg, Graph, ROW_INFO};
use crate::dtype::DType;
use crate::kernel::{Kernel, PositionTable, QkNorm};
use crate::ops::{Act, NormShape};
use crate::spec::{BufId, ModelSpec, Rows, WeightId, WeightRef};
use std::collections::BTreeSet;

/// An operation after fusion.
enum Unit<'a> {
    Plain(&'a Op),
    /// A linear operation reading `x` through the folded norm `norm`.
    Folded {
        op: &'a Op,
        x: BufId,
        norm: &'a Norm,
    },
    /// A DeltaNet's per-token inputs (normalised q/k, decay, beta), prepared in place once
    /// per row before its recurrence (which lowers from the same op, as `Plain`).
    DeltaGates(&'a Op),
    /// Two projections and their gated activation as one step.
    GateUp {
        gate: &'a Op,
        up: &'a Op,
        act: Act,
        x: BufId,
        norm: Option<&'a Norm>,
    },
}

/// The kernel calls of the ops of one section (`head` or not) for `max_rows` rows. The head
/// section reads the last row of what the block computed.
pub(super) fn lower(spec: &ModelSpec, head: bool, max_rows: usize) -> Graph {
    lower_section(spec, head, max_rows, head)
}

/// Like [`lower`], every row reading its own row of every buffer (the batched head).
pub(super) fn lower_rows(spec: &ModelSpec, head: bool, max_rows: usize) -> Graph {
    lower_section(spec, head, max_rows, false)
}

fn lower_section(spec: &ModelSpec, head: bool, max_rows: usize, last_row: bool) -> Graph {
    let units = if crate::kernel::is_decode(max_rows) {
        fuse(spec, head)
    } else {
        spec.ops.iter().filter(|o| o.head == head).map(Unit::Plain).collect()
    };
    let units = units.into_iter().flat_map(|u| match u {
        Unit::Plain(
            op @ Op {
                kind: OpKind::DeltaNet(_),
                ..
            },
        ) => vec![Unit::DeltaGates(op), u],
        u => vec![u],
    });
    let mut g = Graph::default();
    let mut written_in_head: BTreeSet<BufId> = BTreeSet::new();
    for unit in units {
        let (kernel, args, layer, writes) = kernel_of(spec, &unit, max_rows);
        // The head reads the last row of what the block computed, and row 0 of what it
        // computes itself (its own outputs included).
        written_in_head.extend(writes);
        let args = args
            .into_iter()
            .map(|a| match a {
                Arg::Buf(b) if last_row && spec.buffer(b).rows == Rows::Block && !written_in_head.contains(&b) => {
                    Arg::LastRow(b)
                }
                other => other,
            })
            .collect();
        g.push(kernel, args, layer);
    }
    g.place_barriers();
    g
}

/// The standard per-row positions and slots buffer.
fn row_info(spec: &ModelSpec) -> Arg {
    Arg::Buf(
        spec.buffer_named(ROW_INFO)
            .expect("every spec declares the row_info buffer (arch::Builder::new)"),
    )
}

fn whole(id: WeightId, spec: &ModelSpec) -> Arg {
    Arg::Weight(WeightRef {
        id,
        row0: 0,
        rows: spec.weight(id).shape[0],
    })
}

fn norm_shape(spec: &ModelSpec, n: &Norm) -> NormShape {
    NormShape {
        kind: n.kind,
        eps: n.eps,
        wdtype: spec.weight(n.weight).dtype,
        bias: n.bias.map(|b| spec.weight(b).dtype),
    }
}

fn norm_args<'a>(spec: &'a ModelSpec, n: &'a Norm) -> impl Iterator<Item = Arg> + 'a {
    norm_weights(n).map(|w| whole(w, spec))
}

/// The kernel, its arguments, layer and written buffers for one unit.
fn kernel_of(spec: &ModelSpec, unit: &Unit, max_rows: usize) -> (Kernel, Vec<Arg>, Option<usize>, Vec<BufId>) {
    match *unit {
        Unit::Plain(op) => {
            let (k, a) = plain(spec, &op.kind, max_rows);
            (k, a, op.layer, op.kind.writes())
        }
        Unit::DeltaGates(op) => {
            let OpKind::DeltaNet(d) = &op.kind else {
                unreachable!("delta_gates prepares a delta_net's inputs")
            };
            let kernel = Kernel::DeltaGates {
                k_heads: d.k_heads,
                v_heads: d.v_heads,
                k_dim: d.k_dim,
                v_dim: d.v_dim,
                a_dtype: spec.weight(d.a_param).dtype,
                dt_dtype: spec.weight(d.dt_bias).dtype,
                decay: d.decay,
                max_rows,
            };
            let args = vec![
                Arg::Buf(d.qkv),
                Arg::Buf(d.a),
                Arg::Buf(d.b),
                whole(d.a_param, spec),
                whole(d.dt_bias, spec),
            ];
            (kernel, args, op.layer, vec![d.qkv, d.a, d.b])
        }
        Unit::Folded { op, x, norm } => {
            let (k, a) = linear(spec, &op.kind, Some((x, norm)), max_rows);
            (k, a, op.layer, op.kind.writes())
        }
        Unit::GateUp { gate, up, act, x, norm } => {
            let (OpKind::Linear { w: wg, out: g, .. }, OpKind::Linear { w: wu, out: u, .. }) = (&gate.kind, &up.kind)
            else {
                unreachable!("gate_up fuses two linear operations")
            };
            let kernel = Kernel::GateUp {
                n: wg.rows,
                k: spec.weight(wg.id).shape[1],
                gate_dtype: spec.weight(wg.id).dtype,
                up_dtype: spec.weight(wu.id).dtype,
                norm: norm.map(|n| norm_shape(spec, n)),
                act,
                max_rows,
                grouped: spec.weight(wg.id).row_groups.is_some(),
                // Fused only where both have the same pitch; a pair is always these two.
                paired: spec.weight(wg.id).group_pair.is_some(),
            };
            let mut args = vec![
                Arg::Buf(x),
                Arg::Weight(*wg),
                Arg::Buf(*g),
                Arg::Weight(*wu),
                Arg::Buf(*u),
            ];
            if let Some(n) = norm {
                args.extend(norm_args(spec, n));
            }
            (kernel, args, gate.layer, vec![*g, *u])
        }
    }
}

/// A linear operation's matmul, reading `x` (or, folded, the normalised `source`).
fn linear(spec: &ModelSpec, kind: &OpKind, folded: Option<(BufId, &Norm)>, max_rows: usize) -> (Kernel, Vec<Arg>) {
    let OpKind::Linear {
        x,
        w,
        bias,
        out,
        accumulate,
        act,
        softcap,
    } = kind
    else {
        unreachable!("not a linear operation")
    };
    let t = spec.weight(w.id);
    let kernel = Kernel::MatMul {
        n: w.rows,
        k: t.shape[1],
        wdtype: t.dtype,
        bias: bias.map(|b| spec.weight(b.id).dtype),
        accumulate: *accumulate,
        norm: folded.map(|(_, n)| norm_shape(spec, n)),
        act: *act,
        softcap: *softcap,
        max_rows,
        grouped: t.row_groups.is_some(),
        paired: t.group_pair.is_some(),
    };
    let input = folded.map_or(*x, |(source, _)| source);
    let mut args = vec![Arg::Buf(input), Arg::Weight(*w), Arg::Buf(*out)];
    args.extend(bias.map(Arg::Weight));
    if let Some((_, n)) = folded {
        args.extend(norm_args(spec, n));
    }
    (kernel, args)
}

fn plain(spec: &ModelSpec, kind: &OpKind, max_rows: usize) -> (Kernel, Vec<Arg>) {
    let ctx = spec.dims.max_position_embeddings;
    let width = |b: BufId| spec.buffer(b).row_len;
    match kind {
        OpKind::Embed {
            tokens,
            table,
            out,
            scale,
            positions,
        } => {
            let t = spec.weight(*table);
            let kernel = Kernel::Embed {
                vocab: t.shape[0],
                hidden: t.shape[1],
                dtype: t.dtype,
                scale: *scale,
                positions: positions.map(|p| PositionTable {
                    rows: spec.weight(p).shape[0],
                    dtype: spec.weight(p).dtype,
                }),
                max_rows,
                grouped: t.row_groups,
            };
            let mut args = vec![Arg::Buf(*tokens), whole(*table, spec), Arg::Buf(*out)];
            if let Some(p) = positions {
                args.extend([whole(*p, spec), row_info(spec)]);
            }
            (kernel, args)
        }
        OpKind::Norm {
            x,
            out,
            norm,
            accumulate,
        } => {
            let kernel = Kernel::Norm {
                dim: width(*x),
                norm: norm_shape(spec, norm),
                accumulate: *accumulate,
                max_rows,
            };
            let mut args = vec![Arg::Buf(*x), whole(norm.weight, spec), Arg::Buf(*out)];
            args.extend(norm.bias.map(|b| whole(b, spec)));
            (kernel, args)
        }
        OpKind::Linear { .. } => linear(spec, kind, None, max_rows),
        OpKind::RopeKv {
            q,
            k,
            v,
            k_cache,
            v_cache,
            heads,
            kv_heads,
            head_dim,
            rotary,
            qk_norm,
        } => {
            let kernel = Kernel::RopeKv {
                heads: *heads,
                kv_heads: *kv_heads,
                head_dim: *head_dim,
                rotary: rotary.clone(),
                qk_norm: qk_norm.map(|n| QkNorm {
                    kind: n.kind,
                    q_dtype: spec.weight(n.q).dtype,
                    k_dtype: spec.weight(n.k).dtype,
                    eps: n.eps,
                }),
                ctx,
                max_rows,
                kv: kv_dtype(spec, *k_cache),
            };
            let mut args: Vec<Arg> = [q, k, v, k_cache, v_cache].iter().map(|&&b| Arg::Buf(b)).collect();
            if let Some(n) = qk_norm {
                args.extend([whole(n.q, spec), whole(n.k, spec)]);
            }
            args.push(row_info(spec));
            (kernel, args)
        }
        OpKind::Attention {
            q,
            k_cache,
            v_cache,
            out,
            heads,
            kv_heads,
            head_dim,
            window,
            scale,
            softcap,
        } => (
            Kernel::Attention {
                heads: *heads,
                kv_heads: *kv_heads,
                head_dim: *head_dim,
                window: *window,
                scale: *scale,
                softcap: *softcap,
                ctx,
                max_rows,
                kv: kv_dtype(spec, *k_cache),
            },
            vec![
                Arg::Buf(*q),
                Arg::Buf(*k_cache),
                Arg::Buf(*v_cache),
                Arg::Buf(*out),
                row_info(spec),
            ],
        ),
        OpKind::GatedAct { gate, up, act } => (
            Kernel::GatedAct {
                act: *act,
                dim: width(*gate),
                max_rows,
            },
            vec![Arg::Buf(*gate), Arg::Buf(*up)],
        ),
        OpKind::Add { x, y } => (
            Kernel::Add {
                dim: width(*x),
                max_rows,
            },
            vec![Arg::Buf(*x), Arg::Buf(*y)],
        ),
        OpKind::CausalConv {
            x,
            out,
            weight,
            state,
            kernel,
        } => (
            Kernel::CausalConv {
                channels: width(*x),
                taps: *kernel,
                wdtype: spec.weight(*weight).dtype,
                max_rows,
            },
            vec![
                Arg::Buf(*x),
                whole(*weight, spec),
                Arg::Buf(*out),
                Arg::Buf(*state),
                row_info(spec),
            ],
        ),
        OpKind::DeltaNet(d) => (
            Kernel::DeltaNet {
                k_heads: d.k_heads,
                v_heads: d.v_heads,
                k_dim: d.k_dim,
                v_dim: d.v_dim,
                order: d.order,
                max_rows,
            },
            vec![
                Arg::Buf(d.qkv),
                Arg::Buf(d.a),
                Arg::Buf(d.b),
                Arg::Buf(d.out),
                Arg::Buf(d.state),
                row_info(spec),
            ],
        ),
        OpKind::GatedNorm {
            x,
            gate,
            weight,
            eps,
            dim,
        } => (
            Kernel::GatedNorm {
                width: width(*x),
                dim: *dim,
                wdtype: spec.weight(*weight).dtype,
                eps: *eps,
                max_rows,
            },
            vec![Arg::Buf(*x), Arg::Buf(*gate), whole(*weight, spec)],
        ),
    }
}

/// Decode fusions over the ops of one section; see the module documentation.
fn fuse(spec: &ModelSpec, head: bool) -> Vec<Unit<'_>> {
    let ops = &spec.ops[..];
    let n = ops.len();
    // For each folded norm, its readers; for each op, the norm it reads through.
    let mut folded_into: Vec<Option<usize>> = vec![None; n];
    let mut dropped = vec![false; n];
    for (i, op) in ops.iter().enumerate() {
        if op.head != head {
            continue;
        }
        if let Some(readers) = foldable_norm(ops, i) {
            dropped[i] = true;
            for r in readers {
                folded_into[r] = Some(i);
            }
        }
    }
    // The input (and folded norm) a linear op reads.
    let source = |j: usize| -> Option<(BufId, Option<&Norm>)> {
        let OpKind::Linear { x, .. } = &ops[j].kind else {
            return None;
        };
        Some(match folded_into[j] {
            Some(i) => match &ops[i].kind {
                OpKind::Norm { x, norm, .. } => (*x, Some(norm)),
                _ => unreachable!("only norms are folded"),
            },
            None => (*x, None),
        })
    };
    let mut gate_up: Vec<Option<(usize, usize, Act)>> = vec![None; n];
    for (a, op) in ops.iter().enumerate() {
        let OpKind::GatedAct { gate, up, act } = op.kind else {
            continue;
        };
        if op.head != head {
            continue;
        }
        // One kernel reads both matrices in one layout (a row-grouped matrix beside a
        // row-major one, or a paired one beside an unpaired one, stays two matmuls).
        let grouped = |j: usize| match &ops[j].kind {
            OpKind::Linear { w, .. } => {
                let t = spec.weight(w.id);
                (t.row_groups.is_some(), t.group_pitch())
            }
            _ => (false, 1),
        };
        let fused = fusable_gate_up(ops, a, gate, up, &source).filter(|&(pg, pu)| grouped(pg) == grouped(pu));
        if let Some((pg, pu)) = fused {
            let (first, last) = (pg.min(pu), pg.max(pu));
            dropped[first] = true;
            dropped[a] = true;
            gate_up[last] = Some((pg, pu, act));
        }
    }
    let mut units = Vec::new();
    for (i, op) in ops.iter().enumerate() {
        if op.head != head || dropped[i] {
            continue;
        }
        if let Some((pg, pu, act)) = gate_up[i] {
            let (x, norm) = source(pg).expect("a linear op");
            units.push(Unit::GateUp {
                gate: &ops[pg],
                up: &ops[pu],
                act,
                x,
                norm,
            });
        } else if let Some(ni) = folded_into[i] {
            let OpKind::Norm { x, norm, .. } = &ops[ni].kind else {
                unreachable!("only norms are folded")
            };
            units.push(Unit::Folded { op, x: *x, norm });
        } else {
            units.push(Unit::Plain(op));
        }
    }
    units
}

/// If op `i` is a norm that can be folded into its readers, those readers.
fn foldable_norm(ops: &[Op], i: usize) -> Option<Vec<usize>> {
    let OpKind::Norm {
        x,
        out,
        accumulate: false,
        ..
    } = ops[i].kind
    else {
        return None;
    };
    let mut readers = Vec::new();
    for (j, op) in ops.iter().enumerate().skip(i + 1) {
        let reads = op.kind.reads();
        if reads.contains(&out) {
            let plain_reader = matches!(op.kind, OpKind::Linear { x: lx, out: lo, .. } if lx == out && lo != out);
            if !plain_reader || op.head != ops[i].head {
                return None;
            }
            readers.push(j);
        }
        if op.kind.writes().contains(&out) {
            break;
        }
    }
    let last = *readers.last()?;
    // The norm's input must be the same when each reader normalises it.
    let input_changes = ops[i + 1..=last].iter().any(|op| op.kind.writes().contains(&x));
    (!input_changes).then_some(readers)
}

/// If the gated activation at `a` can fuse with the projections that produced `gate` and
/// `up`, their indices.
fn fusable_gate_up<'a>(
    ops: &'a [Op],
    a: usize,
    gate: BufId,
    up: BufId,
    source: &dyn Fn(usize) -> Option<(BufId, Option<&'a Norm>)>,
) -> Option<(usize, usize)> {
    let producer = |buf: BufId| ops[..a].iter().rposition(|op| op.kind.writes().contains(&buf));
    let (pg, pu) = (producer(gate)?, producer(up)?);
    let plain = |j: usize| {
        matches!(
            ops[j].kind,
            OpKind::Linear {
                bias: None,
                accumulate: false,
                act: None,
                softcap: None,
                ..
            }
        ) && ops[j].head == ops[a].head
    };
    if pg == pu || !plain(pg) || !plain(pu) {
        return None;
    }
    let (sg, su) = (source(pg)?, source(pu)?);
    if sg.0 != su.0 || sg.1 != su.1 {
        return None;
    }
    let (first, last) = (pg.min(pu), pg.max(pu));
    // Nothing else touches gate or up from the first projection to the activation, and the
    // shared input does not change between the two projections.
    let touches = |j: usize| {
        let (r, w) = (ops[j].kind.reads(), ops[j].kind.writes());
        [gate, up].iter().any(|b| r.contains(b) || w.contains(b))
    };
    if (first + 1..a).any(|j| j != last && touches(j)) {
        return None;
    }
    if ops[first + 1..last].iter().any(|op| op.kind.writes().contains(&sg.0)) {
        return None;
    }
    Some((pg, pu))
}

/// How a KV cache is stored (checked to be a float type by `ModelSpec::validate`).
fn kv_dtype(spec: &ModelSpec, cache: BufId) -> DType {
    spec.buffer(cache).elem.kv_dtype().unwrap_or(DType::F32)
}
