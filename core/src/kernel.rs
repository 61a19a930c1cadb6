//! The kernel catalogue: every distinct function a compiled library exports.
//!
//! A [`Kernel`] names one computation for one exact shape. The compiler emits one function per
//! distinct value (layers with equal shapes share it; weights are arguments), and the runtime
//! binds the same values by [`Kernel::symbol`]. Argument order is part of the ABI and is listed
//! on each variant; see [`crate::abi`] for the calling convention.

use crate::dtype::DType;
pub use crate::ops::F32Bits;
use crate::ops::{Act, DecayForm, HeadOrder, NormKind, NormShape, Rotary};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

/// Per-head normalisation of q and k before the rotary embedding (Qwen3, Gemma 3).
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct QkNorm {
    pub kind: NormKind,
    pub q_dtype: DType,
    pub k_dtype: DType,
    pub eps: F32Bits,
}

/// Learned absolute position embeddings added by the embedding kernel (GPT-2).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct PositionTable {
    /// Rows of the table: the positions it covers.
    pub rows: usize,
    pub dtype: DType,
}

/// Rows a decode step carries at most: one per sequence decoded together (`kiln serve`'s
/// batch); one sequence alone is one row. Kernels for at most this many rows are decode
/// kernels ([`is_decode`]).
pub const DECODE_ROWS: usize = 8;

/// Whether kernels for blocks of at most `max_rows` rows are decode kernels: norms folded into
/// the matmuls that read them, gate and up fused, and every weight vector read once and folded
/// into each row as it is read (instead of prefill's widened scratch and register tiles).
pub fn is_decode(max_rows: usize) -> bool {
    max_rows <= DECODE_ROWS
}

/// One kernel instance. `max_rows` is the static row capacity of the activation buffers it
/// touches: the prefill block size, or 1 for the decode specialisation. The actual row count
/// (`rows <= max_rows`) is a run-time argument; each row's position and KV slot are read from
/// the `row_info` buffer by the kernels that need them.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(tag = "family", rename_all = "snake_case")]
pub enum Kernel {
    /// `x[r, :] = float(table[tokens[r], :]) (* scale) (+ float(pos_table[position(r), :]))`.
    /// Args: `tokens: i32[max_rows]`, `table: dtype[vocab, hidden]`, `x: f32[max_rows, hidden]`,
    /// then `pos_table: [rows, hidden]` and `row_info: i32[max_rows, 4]` with `positions`.
    Embed {
        vocab: usize,
        hidden: usize,
        dtype: DType,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        scale: Option<F32Bits>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        positions: Option<PositionTable>,
        max_rows: usize,
        /// The table is stored in row groups in this order (a tied output head's table, which
        /// the head's matmul reads grouped; `crate::grouped`), not row-major.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        grouped: Option<crate::grouped::PieceOrder>,
    },
    /// `y[r, :] = norm(x[r, :])`, or `y += norm(x)` when `accumulate` (Gemma's norms after the
    /// attention and the MLP, added to the residual).
    /// Args: `x: f32[max_rows, dim]`, `w: [dim]`, `y: f32[max_rows, dim]`, then `b: [dim]` if
    /// the norm has a bias.
    Norm {
        dim: usize,
        norm: NormShape,
        accumulate: bool,
        max_rows: usize,
    },
    /// `y[r, n] = epilogue(sum_k x[r, k] * w[n, k])` where the epilogue adds `bias[n]`, applies
    /// `act`, then soft-caps (`cap * tanh(v / cap)`), and finally adds the old `y` when
    /// `accumulate` (the residual add). With `norm` (decode only), `x` is first replaced by its
    /// normalisation with weight `norm_w` (and `norm_b`).
    /// Args: `x: f32[max_rows, k]`, `w: wdtype[n, k]`, `y: f32[max_rows, n]`, then
    /// `bias: bdtype[n]` if `bias`, then `norm_w: [k]` (and `norm_b: [k]`) if `norm`.
    MatMul {
        n: usize,
        k: usize,
        wdtype: DType,
        bias: Option<DType>,
        accumulate: bool,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        norm: Option<NormShape>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        act: Option<Act>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        softcap: Option<F32Bits>,
        max_rows: usize,
        /// `w` is stored in row groups ([`crate::grouped`]).
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        grouped: bool,
        /// Those groups alternate with a partner's ([`crate::grouped::GroupPair`]): group `g`
        /// starts `2 g` groups' length after `w`.
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        paired: bool,
    },
    /// Decode's whole gated-MLP input side in one step: `g = x @ w_gate^T`, `u = x @ w_up^T`,
    /// then `g = act(g) * u`, each thread finishing the outputs it computed (no barrier between
    /// the projections and the activation), with `norm` as in [`Kernel::MatMul`].
    /// Args: `x: f32[1, k]`, `w_gate: gate_dtype[n, k]`, `g: f32[1, n]`, `w_up: up_dtype[n, k]`,
    /// `u: f32[1, n]`, then `norm_w: [k]` (and `norm_b`) if `norm`.
    GateUp {
        n: usize,
        k: usize,
        gate_dtype: DType,
        up_dtype: DType,
        norm: Option<NormShape>,
        act: Act,
        max_rows: usize,
        /// `w_gate` and `w_up` are stored in row groups ([`crate::grouped`]).
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        grouped: bool,
        /// ... as a pair ([`crate::grouped::GroupPair`]): `w_up` is `w_gate` plus one group,
        /// each matrix's group `g` at `2 g` groups' length from its pointer, so the two are
        /// one stream.
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        paired: bool,
    },
    /// For each row `r` at the position and slot `row_info[r]` gives: optional per-head norm of
    /// q and k, the rotary embedding of q and k in place (when `rotary`), then k and v written
    /// into the slot's caches at that position.
    /// Args: `q: f32[max_rows, heads*head_dim]`, `k, v: f32[max_rows, kv_heads*head_dim]`,
    /// `k_cache, v_cache: f32[MAX_SLOTS, kv_heads, ctx, head_dim]` (slot-major, then
    /// head-major: each head's keys are one contiguous stream for attention), then
    /// `q_norm, k_norm: [head_dim]` with `qk_norm`, then `row_info: i32[max_rows, 4]`
    /// ([`crate::graph::RowInfo`]; a LongRoPE `rotary` chooses its table by the row's
    /// `seq_end`).
    RopeKv {
        heads: usize,
        kv_heads: usize,
        head_dim: usize,
        rotary: Option<Rotary>,
        qk_norm: Option<QkNorm>,
        ctx: usize,
        max_rows: usize,
        /// How the caches store keys and values (`--kv-dtype`): f32, f16 or bf16, rounded to
        /// nearest even as they are written.
        #[serde(default = "f32_kv", skip_serializing_if = "is_f32")]
        kv: DType,
    },
    /// Causal grouped-query attention of each row over its slot's cache rows `[start, p]`,
    /// where `p` is the row's position and `start = max(0, p + 1 - window)` with a sliding
    /// window and 0 otherwise. Scores are `q . k * scale`, soft-capped (`cap * tanh(s / cap)`)
    /// with `softcap`; softmax in f32.
    /// Args: `q: f32[max_rows, heads*head_dim]`,
    /// `k_cache, v_cache: f32[MAX_SLOTS, kv_heads, ctx, head_dim]`,
    /// `out: f32[max_rows, heads*head_dim]`, `row_info: i32[max_rows, 4]`.
    Attention {
        heads: usize,
        kv_heads: usize,
        head_dim: usize,
        window: Option<usize>,
        scale: F32Bits,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        softcap: Option<F32Bits>,
        ctx: usize,
        max_rows: usize,
        /// How the caches store keys and values, widened to f32 as they are read.
        #[serde(default = "f32_kv", skip_serializing_if = "is_f32")]
        kv: DType,
    },
    /// `g[r, i] = act(g[r, i]) * u[r, i]`, in place.
    /// Args: `g: f32[max_rows, dim]`, `u: f32[max_rows, dim]`.
    GatedAct { act: Act, dim: usize, max_rows: usize },
    /// `x[r, i] += y[r, i]`.
    /// Args: `x: f32[max_rows, dim]`, `y: f32[max_rows, dim]`.
    Add { dim: usize, max_rows: usize },
    /// Causal depthwise convolution over time, then SiLU (Gated DeltaNet's short convolution):
    /// `out[r, c] = silu(sum_j w[c, j] * in(position(r) - (taps - 1) + j, c))`, where an input
    /// is the row of this call at that position of the same sequence, else the slot's state
    /// (its last `taps - 1` inputs, oldest first), or zero before the sequence's start. Each
    /// sequence's last row then writes its new state.
    /// Args: `x: f32[max_rows, channels]`, `w: wdtype[channels * taps]`,
    /// `out: f32[max_rows, channels]`, `state: f32[MAX_SLOTS, (taps - 1) * channels]`,
    /// `row_info`.
    CausalConv {
        channels: usize,
        taps: usize,
        wdtype: DType,
        max_rows: usize,
    },
    /// The Gated DeltaNet's per-token inputs, in place, once per row and head so the
    /// recurrence's work items do not each redo them: q and k of every key head L2-normalised
    /// (q also scaled by `k_dim^-0.5`), `a` replaced by the decay `exp(g)` (prefill kernels:
    /// by `g` itself, which the chunked form sums) with `g = A softplus(a + dt_bias)`, `b` by
    /// `beta = sigmoid(b)`.
    /// Args: `qkv: f32[max_rows, 2 * k_heads * k_dim + v_heads * v_dim]`,
    /// `a, b: f32[max_rows, v_heads]`, `a_param: a_dtype[v_heads]`, `dt_bias: dt_dtype[v_heads]`.
    DeltaGates {
        k_heads: usize,
        v_heads: usize,
        k_dim: usize,
        v_dim: usize,
        a_dtype: DType,
        dt_dtype: DType,
        decay: DecayForm,
        max_rows: usize,
    },
    /// The Gated DeltaNet recurrence ([`crate::graph::DeltaNet`]) over the inputs
    /// [`Kernel::DeltaGates`] prepared, each row on its slot's state (zero at position 0):
    /// decode kernels row by row, prefill kernels in chunks of rows (the WY form).
    /// Args: `qkv: f32[max_rows, 2 * k_heads * k_dim + v_heads * v_dim]` (q, k normalised),
    /// `decay, beta: f32[max_rows, v_heads]`, `out: f32[max_rows, v_heads * v_dim]`,
    /// `state: f32[MAX_SLOTS * v_heads * k_dim * v_dim]`, `row_info`. The state is laid out
    /// for the kernel alone, `[slot, value head, block of lanes columns, k_dim, lanes]`: each
    /// work item's slice is contiguous, where rows of `v_dim` would put its `k_dim` vectors
    /// `4 v_dim` bytes apart, into few L1 sets (128 lines over 8 sets of 12 ways at 512 B).
    DeltaNet {
        k_heads: usize,
        v_heads: usize,
        k_dim: usize,
        v_dim: usize,
        order: HeadOrder,
        max_rows: usize,
    },
    /// `x = rmsnorm(x) * w * silu(gate)` over each head of `dim` values of rows of `width`.
    /// Args: `x: f32[max_rows, width]`, `gate: f32[max_rows, width]`, `w: wdtype[dim]`.
    GatedNorm {
        width: usize,
        dim: usize,
        wdtype: DType,
        eps: F32Bits,
        max_rows: usize,
    },
    /// Machine probe: each thread reads its share of `buf` once, sequentially, with vector
    /// loads (the way decode streams weights) and writes a checksum to `sums[thread_id]`.
    /// Args: `buf: f32[elems]`, `sums: f32[64, 16]`. `rows` and `pos` are unused.
    ProbeRead { elems: usize },
    /// Machine probe: `rows` iterations of `chains` independent vector FMA chains held in
    /// registers, then a checksum to `sums[thread_id]`.
    /// Args: `sums: f32[64, 16]`.
    ProbeFma { chains: usize },
}

impl Kernel {
    /// The family name, used in symbols and in profiles.
    pub fn family(&self) -> &'static str {
        match self {
            Kernel::Embed { .. } => "embed",
            Kernel::Norm { .. } => "norm",
            Kernel::MatMul { .. } => "matmul",
            Kernel::GateUp { .. } => "gate_up",
            Kernel::RopeKv { .. } => "rope_kv",
            Kernel::Attention { .. } => "attention",
            Kernel::GatedAct { .. } => "gated_act",
            Kernel::Add { .. } => "add",
            Kernel::CausalConv { .. } => "causal_conv",
            Kernel::DeltaGates { .. } => "delta_gates",
            Kernel::DeltaNet { .. } => "delta_net",
            Kernel::GatedNorm { .. } => "gated_norm",
            Kernel::ProbeRead { .. } => "probe_read",
            Kernel::ProbeFma { .. } => "probe_fma",
        }
    }

    pub fn max_rows(&self) -> usize {
        match self {
            Kernel::Embed { max_rows, .. }
            | Kernel::Norm { max_rows, .. }
            | Kernel::MatMul { max_rows, .. }
            | Kernel::GateUp { max_rows, .. }
            | Kernel::RopeKv { max_rows, .. }
            | Kernel::Attention { max_rows, .. }
            | Kernel::GatedAct { max_rows, .. }
            | Kernel::Add { max_rows, .. }
            | Kernel::CausalConv { max_rows, .. }
            | Kernel::DeltaGates { max_rows, .. }
            | Kernel::DeltaNet { max_rows, .. }
            | Kernel::GatedNorm { max_rows, .. } => *max_rows,
            Kernel::ProbeRead { .. } | Kernel::ProbeFma { .. } => 1,
        }
    }

    /// Number of pointer arguments the kernel reads; the rest of the ABI's slots are unused.
    pub fn arg_count(&self) -> usize {
        let norm_args = |n: &Option<NormShape>| n.map_or(0, |n| 1 + n.bias.is_some() as usize);
        match self {
            Kernel::Embed { positions, .. } => 3 + 2 * positions.is_some() as usize,
            Kernel::Norm { norm, .. } => 3 + norm.bias.is_some() as usize,
            Kernel::MatMul { bias, norm, .. } => 3 + bias.is_some() as usize + norm_args(norm),
            Kernel::GateUp { norm, .. } => 5 + norm_args(norm),
            Kernel::RopeKv { qk_norm, .. } => 6 + 2 * qk_norm.is_some() as usize,
            Kernel::Attention { .. } => 5,
            Kernel::GatedAct { .. } | Kernel::Add { .. } | Kernel::ProbeRead { .. } => 2,
            Kernel::ProbeFma { .. } => 1,
            Kernel::CausalConv { .. } => 5,
            Kernel::DeltaGates { .. } => 5,
            Kernel::DeltaNet { .. } => 6,
            Kernel::GatedNorm { .. } => 3,
        }
    }

    /// Indices of the pointer arguments the kernel writes (the others are only read).
    /// `accumulate` matmuls and in-place kernels also read what they write.
    pub fn written_args(&self) -> &'static [usize] {
        match self {
            Kernel::Embed { .. } | Kernel::Norm { .. } | Kernel::MatMul { .. } => &[2],
            Kernel::GateUp { .. } => &[2, 4],
            Kernel::RopeKv { .. } => &[0, 1, 3, 4],
            Kernel::Attention { .. } => &[3],
            Kernel::GatedAct { .. } | Kernel::Add { .. } | Kernel::ProbeFma { .. } => &[0],
            Kernel::ProbeRead { .. } => &[1],
            Kernel::CausalConv { .. } => &[2, 3],
            Kernel::DeltaGates { .. } => &[0, 1, 2],
            Kernel::DeltaNet { .. } => &[3, 4],
            Kernel::GatedNorm { .. } => &[0],
        }
    }

    /// Bytes the kernel reads and writes for one call on `rows` rows starting at position
    /// `pos`: weights once, activations per row, and for attention the cached keys and values
    /// each row attends to. An estimate for profiles (it ignores cache reuse between rows).
    pub fn bytes_moved(&self, rows: usize, pos: usize) -> u64 {
        let f = 4usize;
        let norm_bytes = |n: &Option<NormShape>, k: usize| {
            n.map_or(0, |n| n.wdtype.bytes_for(k) + n.bias.map_or(0, |b| b.bytes_for(k)))
        };
        let b = match self {
            Kernel::Embed {
                hidden,
                dtype,
                positions,
                ..
            } => {
                let pos_row = positions.map_or(0, |p| p.dtype.bytes_for(*hidden));
                rows * (dtype.bytes_for(*hidden) + pos_row + hidden * f + 4)
            }
            Kernel::Norm {
                dim, norm, accumulate, ..
            } => norm_bytes(&Some(*norm), *dim) + rows * (2 + *accumulate as usize) * dim * f,
            Kernel::MatMul {
                n,
                k,
                wdtype,
                bias,
                accumulate,
                norm,
                ..
            } => {
                let out = if *accumulate { 2 } else { 1 };
                n * wdtype.bytes_for(*k)
                    + bias.map_or(0, |d| d.bytes_for(*n))
                    + norm_bytes(norm, *k)
                    + rows * (k + out * n) * f
            }
            Kernel::GateUp {
                n,
                k,
                gate_dtype,
                up_dtype,
                norm,
                ..
            } => {
                n * (gate_dtype.bytes_for(*k) + up_dtype.bytes_for(*k)) + norm_bytes(norm, *k) + rows * (k + 3 * n) * f
            }
            Kernel::RopeKv {
                heads,
                kv_heads,
                head_dim,
                kv,
                ..
            } => rows * ((2 * heads + 4 * kv_heads) * head_dim * f + 2 * kv.bytes_for(kv_heads * head_dim)),
            Kernel::Attention {
                heads,
                kv_heads,
                head_dim,
                window,
                kv,
                ..
            } => {
                let keys = attended_keys(rows, pos, *window);
                rows * 2 * heads * head_dim * f + keys * 2 * kv.bytes_for(kv_heads * head_dim)
            }
            Kernel::GatedAct { dim, .. } | Kernel::Add { dim, .. } => rows * 3 * dim * f,
            Kernel::ProbeRead { elems } => elems * f,
            Kernel::ProbeFma { .. } => 0,
            Kernel::CausalConv { channels, taps, .. } => (rows * 2 + 2 * (taps - 1) + taps) * channels * f,
            Kernel::DeltaGates {
                k_heads,
                v_heads,
                k_dim,
                ..
            } => rows * 2 * (2 * k_heads * k_dim + 2 * v_heads) * f,
            Kernel::DeltaNet {
                k_heads,
                v_heads,
                k_dim,
                v_dim,
                ..
            } => {
                // Each row reads its inputs and writes its output; the state is read and
                // written once per call (it stays in cache between the rows).
                let row = (2 * k_heads * k_dim + 2 * v_heads * v_dim + 2 * v_heads) * f;
                rows * row + 2 * v_heads * k_dim * v_dim * f
            }
            Kernel::GatedNorm { width, .. } => rows * 3 * width * f,
        };
        b as u64
    }

    /// Floating-point operations of one call (a multiply-add counts 2), for profiles.
    pub fn flops(&self, rows: usize, pos: usize) -> u64 {
        let b = match self {
            Kernel::MatMul { n, k, .. } => 2 * rows * n * k,
            Kernel::GateUp { n, k, .. } => 4 * rows * n * k,
            // Per row and value head: decay, S^T k, the rank-1 update and S^T q over the state.
            Kernel::DeltaNet {
                v_heads, k_dim, v_dim, ..
            } => 8 * rows * v_heads * k_dim * v_dim,
            Kernel::Attention {
                heads,
                head_dim,
                window,
                ..
            } => 4 * attended_keys(rows, pos, *window) * heads * head_dim,
            _ => 0,
        };
        b as u64
    }

    /// Exported symbol: readable shape fields plus a hash of the whole descriptor, so two
    /// kernels share a symbol exactly when they are equal.
    pub fn symbol(&self) -> String {
        let json = serde_json::to_string(self).expect("kernel descriptors serialise");
        let hash = Sha256::digest(json.as_bytes());
        let short: String = hash[..4].iter().map(|b| format!("{b:02x}")).collect();
        let flag = |on: bool, s: &str| if on { s.to_string() } else { String::new() };
        let norm_tag = |n: &Option<NormShape>| n.map(|n| format!("_{}", n.kind.name())).unwrap_or_default();
        let shape = match self {
            Kernel::Embed {
                vocab,
                hidden,
                dtype,
                positions,
                ..
            } => format!("v{vocab}_h{hidden}_{dtype}{}", flag(positions.is_some(), "_pos")),
            Kernel::Norm {
                dim, norm, accumulate, ..
            } => format!(
                "{}_d{dim}_{}{}",
                norm.kind.name(),
                norm.wdtype,
                flag(*accumulate, "_acc")
            ),
            Kernel::MatMul {
                n,
                k,
                wdtype,
                bias,
                accumulate,
                norm,
                act,
                softcap,
                ..
            } => format!(
                "n{n}_k{k}_{wdtype}{}{}{}{}{}",
                flag(bias.is_some(), "_bias"),
                flag(*accumulate, "_acc"),
                norm_tag(norm),
                act.map(|a| format!("_{}", a.name())).unwrap_or_default(),
                flag(softcap.is_some(), "_cap"),
            ),
            Kernel::GateUp {
                n,
                k,
                gate_dtype,
                up_dtype,
                norm,
                act,
                ..
            } => format!("n{n}_k{k}_{gate_dtype}_{up_dtype}{}_{}", norm_tag(norm), act.name()),
            Kernel::RopeKv {
                heads,
                kv_heads,
                head_dim,
                qk_norm,
                rotary,
                kv,
                ..
            } => format!(
                "h{heads}_kv{kv_heads}_d{head_dim}{}{}{}",
                rotary.as_ref().map(|r| format!("_r{}", r.dims)).unwrap_or_default(),
                flag(qk_norm.is_some(), "_qknorm"),
                kv_tag(*kv)
            ),
            Kernel::Attention {
                heads,
                kv_heads,
                head_dim,
                window,
                softcap,
                kv,
                ..
            } => format!(
                "h{heads}_kv{kv_heads}_d{head_dim}{}{}{}",
                window.map(|w| format!("_w{w}")).unwrap_or_default(),
                flag(softcap.is_some(), "_cap"),
                kv_tag(*kv)
            ),
            Kernel::GatedAct { act, dim, .. } => format!("{}_d{dim}", act.name()),
            Kernel::Add { dim, .. } => format!("d{dim}"),
            Kernel::ProbeRead { elems } => format!("e{elems}"),
            Kernel::ProbeFma { chains } => format!("c{chains}"),
            Kernel::CausalConv {
                channels, taps, wdtype, ..
            } => format!("c{channels}_t{taps}_{wdtype}"),
            Kernel::DeltaGates {
                k_heads,
                v_heads,
                k_dim,
                a_dtype,
                dt_dtype,
                decay,
                ..
            } => format!("k{k_heads}x{k_dim}_v{v_heads}_{a_dtype}_{dt_dtype}_{decay:?}"),
            Kernel::DeltaNet {
                k_heads,
                v_heads,
                k_dim,
                v_dim,
                order,
                ..
            } => format!("k{k_heads}x{k_dim}_v{v_heads}x{v_dim}_{order:?}"),
            Kernel::GatedNorm { width, dim, wdtype, .. } => format!("w{width}_d{dim}_{wdtype}"),
        };
        // `decode8`: a decode kernel for up to 8 rows; `r64`: a prefill kernel for blocks of 64.
        let regime = if is_decode(self.max_rows()) {
            format!("decode{}", self.max_rows())
        } else {
            format!("r{}", self.max_rows())
        };
        format!("kiln_{}_{shape}_{regime}_{short}", self.family())
    }
}

/// Serde default of a kernel's KV storage type: f32 (left out of the descriptor, so kernels
/// of the default cache keep their names and keys).
fn f32_kv() -> DType {
    DType::F32
}

fn is_f32(d: &DType) -> bool {
    *d == DType::F32
}

/// The symbol suffix of a KV storage type other than f32.
fn kv_tag(kv: DType) -> String {
    if is_f32(&kv) { String::new() } else { format!("_kv{kv}") }
}

/// Cache rows the attention of `rows` rows starting at `pos` reads, summed over the rows (each
/// row `r` attends to positions up to `pos + r`, within the sliding window if there is one).
fn attended_keys(rows: usize, pos: usize, window: Option<usize>) -> usize {
    (0..rows)
        .map(|r| window.map_or(pos + r + 1, |w| (pos + r + 1).min(w)))
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn symbols_differ_exactly_when_kernels_differ() {
        let act = |act, max_rows| Kernel::GatedAct {
            act,
            dim: 128,
            max_rows,
        };
        let (a, b, c) = (act(Act::Silu, 64), act(Act::Silu, 1), act(Act::Silu, 64));
        assert_ne!(a.symbol(), b.symbol());
        assert_eq!(a.symbol(), c.symbol());
        assert_ne!(a.symbol(), act(Act::GeluTanh, 64).symbol());
        assert!(b.symbol().starts_with("kiln_gated_act_silu_d128_decode1_"));
    }
}
