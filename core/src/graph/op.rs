//! The operations of a model's forward pass, over named buffers and weight tensors.
//!
//! An architecture file lists them once; [`super::lower`] turns them into kernel calls for each
//! regime (prefill blocks, one decode row, the output head on the last row), fusing where a
//! regime gains from it.

use crate::ops::{Act, DecayForm, F32Bits, HeadOrder, NormKind, Rotary};
use crate::spec::{BufId, Elem, ModelSpec, Role, Rows, WeightId, WeightRef};
use serde::{Deserialize, Serialize};

/// One operation. `layer` tags it for profiles and layer-by-layer debugging; `head` marks the
/// operations after the last layer that run on the last row of a block only (final norm,
/// output head).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Op {
    pub kind: OpKind,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub layer: Option<usize>,
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub head: bool,
}

/// A normalisation with its weights.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Norm {
    pub kind: NormKind,
    pub eps: F32Bits,
    pub weight: WeightId,
    /// LayerNorm's bias.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bias: Option<WeightId>,
}

/// Per-head normalisation of q and k before the rotary embedding.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct QkNormOp {
    pub kind: NormKind,
    pub eps: F32Bits,
    pub q: WeightId,
    pub k: WeightId,
}

/// What an operation computes. Widths come from the buffers and tensors it names.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum OpKind {
    /// `out[r] = table[tokens[r]] (* scale) (+ positions[pos + r])`.
    Embed {
        tokens: BufId,
        table: WeightId,
        out: BufId,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        scale: Option<F32Bits>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        positions: Option<WeightId>,
    },
    /// `out = norm(x)`, or `out += norm(x)` when `accumulate`.
    Norm {
        x: BufId,
        out: BufId,
        norm: Norm,
        accumulate: bool,
    },
    /// `out = softcap(act(x @ w^T + bias))`, or `out += ...` when `accumulate`.
    Linear {
        x: BufId,
        w: WeightRef,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        bias: Option<WeightRef>,
        out: BufId,
        accumulate: bool,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        act: Option<Act>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        softcap: Option<F32Bits>,
    },
    /// Per-head q/k norm, rotary embedding of q and k, and the write of k and v into the caches
    /// at each row's position.
    RopeKv {
        q: BufId,
        k: BufId,
        v: BufId,
        k_cache: BufId,
        v_cache: BufId,
        heads: usize,
        kv_heads: usize,
        head_dim: usize,
        rotary: Option<Rotary>,
        qk_norm: Option<QkNormOp>,
    },
    /// Causal grouped-query attention over the caches.
    Attention {
        q: BufId,
        k_cache: BufId,
        v_cache: BufId,
        out: BufId,
        heads: usize,
        kv_heads: usize,
        head_dim: usize,
        window: Option<usize>,
        scale: F32Bits,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        softcap: Option<F32Bits>,
    },
    /// `gate = act(gate) * up`.
    GatedAct { gate: BufId, up: BufId, act: Act },
    /// Causal depthwise convolution over time, then SiLU: `out[t, c] = silu(sum_j w[c, j] *
    /// x[t - (kernel - 1) + j, c])`, inputs before the sequence's start being zero. The last
    /// `kernel - 1` inputs of each sequence are kept in `state` across calls.
    CausalConv {
        x: BufId,
        out: BufId,
        /// `[channels, kernel]` values (Hugging Face stores `[channels, 1, kernel]`).
        weight: WeightId,
        state: BufId,
        kernel: usize,
    },
    /// The Gated DeltaNet's recurrence ([`DeltaNet`]): reads the convolved q/k/v and the
    /// gate inputs, updates each head's state matrix, writes each value head's output.
    DeltaNet(DeltaNet),
    /// `x = rmsnorm(x) * w * silu(gate)` per head of `dim` values (the DeltaNet's gated norm,
    /// plain `w`).
    GatedNorm {
        x: BufId,
        gate: BufId,
        weight: WeightId,
        eps: F32Bits,
        dim: usize,
    },
    /// `x += y`.
    Add { x: BufId, y: BufId },
}

/// One Gated DeltaNet recurrence step over a block of rows, as `transformers`' Qwen3.5 computes
/// it: `q`, `k` L2-normalised (eps 1e-6) and `q` scaled by `k_dim^-0.5`; `beta = sigmoid(b)`;
/// `g = -exp(A_log) * softplus(a + dt_bias)`; then per value head, with state `S [k_dim, v_dim]`:
/// `S *= exp(g)`, `delta = (v - S^T k) * beta`, `S += k delta^T`, `out = S^T q`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DeltaNet {
    /// The convolved projection: `k_heads * k_dim` query values, as many key values, then
    /// `v_heads * v_dim` values.
    pub qkv: BufId,
    /// `in_proj_a` and `in_proj_b` outputs, one value per value head.
    pub a: BufId,
    pub b: BufId,
    pub out: BufId,
    pub a_param: WeightId,
    pub dt_bias: WeightId,
    pub state: BufId,
    pub k_heads: usize,
    pub v_heads: usize,
    pub k_dim: usize,
    pub v_dim: usize,
    pub decay: DecayForm,
    pub order: HeadOrder,
}

impl DeltaNet {
    /// Width of the `qkv` buffer.
    pub fn qkv_width(&self) -> usize {
        2 * self.k_heads * self.k_dim + self.v_heads * self.v_dim
    }
    /// Values of one sequence's state: a `[k_dim, v_dim]` matrix per value head.
    pub fn state_len(&self) -> usize {
        self.v_heads * self.k_dim * self.v_dim
    }
}

impl OpKind {
    pub fn name(&self) -> &'static str {
        match self {
            OpKind::Embed { .. } => "embed",
            OpKind::Norm { .. } => "norm",
            OpKind::Linear { .. } => "linear",
            OpKind::RopeKv { .. } => "rope_kv",
            OpKind::Attention { .. } => "attention",
            OpKind::GatedAct { .. } => "gated_act",
            OpKind::Add { .. } => "add",
            OpKind::CausalConv { .. } => "causal_conv",
            OpKind::DeltaNet(_) => "delta_net",
            OpKind::GatedNorm { .. } => "gated_norm",
        }
    }

    /// Buffers the operation reads (in-place and accumulating outputs included).
    pub fn reads(&self) -> Vec<BufId> {
        match *self {
            OpKind::Embed { tokens, .. } => vec![tokens],
            OpKind::Norm { x, out, accumulate, .. } => {
                [Some(x), accumulate.then_some(out)].into_iter().flatten().collect()
            }
            OpKind::Linear { x, out, accumulate, .. } => {
                [Some(x), accumulate.then_some(out)].into_iter().flatten().collect()
            }
            OpKind::RopeKv { q, k, v, .. } => vec![q, k, v],
            OpKind::Attention {
                q, k_cache, v_cache, ..
            } => vec![q, k_cache, v_cache],
            OpKind::GatedAct { gate, up, .. } => vec![gate, up],
            OpKind::Add { x, y } => vec![x, y],
            OpKind::CausalConv { x, state, .. } => vec![x, state],
            OpKind::DeltaNet(ref d) => vec![d.qkv, d.a, d.b, d.state],
            OpKind::GatedNorm { x, gate, .. } => vec![x, gate],
        }
    }

    /// Buffers the operation writes.
    pub fn writes(&self) -> Vec<BufId> {
        match *self {
            OpKind::Embed { out, .. }
            | OpKind::Norm { out, .. }
            | OpKind::Linear { out, .. }
            | OpKind::Attention { out, .. } => vec![out],
            OpKind::RopeKv {
                q, k, k_cache, v_cache, ..
            } => vec![q, k, k_cache, v_cache],
            OpKind::GatedAct { gate, .. } => vec![gate],
            OpKind::Add { x, .. } => vec![x],
            OpKind::CausalConv { out, state, .. } => vec![out, state],
            OpKind::DeltaNet(ref d) => vec![d.out, d.state],
            OpKind::GatedNorm { x, .. } => vec![x],
        }
    }

    /// Weights read whole (directly or through views), and tables only gathered from, a row
    /// at a time.
    pub fn weights_read(&self) -> (Vec<WeightId>, Vec<WeightId>) {
        match self {
            OpKind::Embed { table, positions, .. } => {
                (Vec::new(), [Some(*table), *positions].into_iter().flatten().collect())
            }
            OpKind::Norm { norm, .. } => (norm_weights(norm).collect(), Vec::new()),
            OpKind::Linear { w, bias, .. } => (
                [Some(w.id), bias.map(|b| b.id)].into_iter().flatten().collect(),
                Vec::new(),
            ),
            OpKind::RopeKv { qk_norm, .. } => (qk_norm.iter().flat_map(|n| [n.q, n.k]).collect(), Vec::new()),
            OpKind::Attention { .. } | OpKind::GatedAct { .. } | OpKind::Add { .. } => (Vec::new(), Vec::new()),
            OpKind::CausalConv { weight, .. } | OpKind::GatedNorm { weight, .. } => (vec![*weight], Vec::new()),
            OpKind::DeltaNet(d) => (vec![d.a_param, d.dt_bias], Vec::new()),
        }
    }

    /// Checks widths and views against `spec`; see [`ModelSpec::validate`].
    pub fn check(&self, spec: &ModelSpec) -> Result<(), String> {
        let ck = Checker { spec };
        match self {
            OpKind::Embed {
                tokens,
                table,
                out,
                positions,
                ..
            } => {
                ck.buf(*tokens, None, Elem::I32)?;
                let hidden = ck.matrix(*table)?.1;
                ck.buf(*out, Some(hidden), Elem::F32)?;
                if let Some(p) = positions {
                    ck.cols(*p, hidden)?;
                }
                Ok(())
            }
            OpKind::Norm { x, out, norm, .. } => {
                let dim = ck.width(*x)?;
                ck.buf(*out, Some(dim), Elem::F32)?;
                ck.norm(norm, dim)
            }
            OpKind::Linear { x, w, bias, out, .. } => {
                let (rows, cols) = ck.view(w)?;
                ck.buf(*x, Some(cols), Elem::F32)?;
                ck.buf(*out, Some(rows), Elem::F32)?;
                if let Some(b) = bias {
                    ck.vector_view(b, rows)?;
                }
                Ok(())
            }
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
                ck.heads(*heads, *kv_heads, *head_dim)?;
                ck.buf(*q, Some(heads * head_dim), Elem::F32)?;
                for b in [k, v] {
                    ck.buf(*b, Some(kv_heads * head_dim), Elem::F32)?;
                }
                ck.caches(*k_cache, *v_cache, kv_heads * head_dim)?;
                if let Some(r) = rotary {
                    let pairs = r.dims / 2;
                    if r.dims == 0 || r.dims % 2 != 0 || r.dims > *head_dim {
                        return Err(format!(
                            "rotary dims {} must be even and at most head_dim {head_dim}",
                            r.dims
                        ));
                    }
                    let long = r.long.as_ref().map_or(pairs, |l| l.inv_freq.len());
                    if r.inv_freq.len() != pairs || long != pairs {
                        return Err(format!("rotary tables must hold {pairs} frequencies"));
                    }
                }
                if let Some(n) = qk_norm {
                    ck.vector(n.q, *head_dim)?;
                    ck.vector(n.k, *head_dim)?;
                }
                Ok(())
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
                ..
            } => {
                ck.heads(*heads, *kv_heads, *head_dim)?;
                ck.buf(*q, Some(heads * head_dim), Elem::F32)?;
                ck.buf(*out, Some(heads * head_dim), Elem::F32)?;
                ck.caches(*k_cache, *v_cache, kv_heads * head_dim)?;
                if *window == Some(0) {
                    return Err("a sliding window must hold at least one position".into());
                }
                Ok(())
            }
            OpKind::GatedAct { gate, up, .. } | OpKind::Add { x: gate, y: up } => {
                let dim = ck.width(*gate)?;
                ck.buf(*up, Some(dim), Elem::F32)
            }
            OpKind::CausalConv {
                x,
                out,
                weight,
                state,
                kernel,
            } => {
                let channels = ck.width(*x)?;
                ck.buf(*out, Some(channels), Elem::F32)?;
                if *kernel < 2 {
                    return Err(format!("a causal convolution of {kernel} taps keeps no state"));
                }
                ck.float_values(*weight, channels * kernel)?;
                ck.state(*state, channels * (kernel - 1))
            }
            OpKind::DeltaNet(d) => {
                if d.k_heads == 0 || d.k_dim == 0 || d.v_dim == 0 || !d.v_heads.is_multiple_of(d.k_heads) {
                    return Err(format!(
                        "{} value heads, {} key heads of {}: the value heads must be a positive multiple of \
                         the key heads",
                        d.v_heads, d.k_heads, d.k_dim
                    ));
                }
                ck.buf(d.qkv, Some(d.qkv_width()), Elem::F32)?;
                ck.buf(d.a, Some(d.v_heads), Elem::F32)?;
                ck.buf(d.b, Some(d.v_heads), Elem::F32)?;
                ck.buf(d.out, Some(d.v_heads * d.v_dim), Elem::F32)?;
                ck.vector(d.a_param, d.v_heads)?;
                ck.vector(d.dt_bias, d.v_heads)?;
                ck.state(d.state, d.state_len())
            }
            OpKind::GatedNorm {
                x, gate, weight, dim, ..
            } => {
                let width = ck.width(*x)?;
                if *dim == 0 || !width.is_multiple_of(*dim) {
                    return Err(format!("rows of {width} are not whole heads of {dim}"));
                }
                ck.buf(*gate, Some(width), Elem::F32)?;
                ck.vector(*weight, *dim)
            }
        }
    }
}

/// The weights of a norm: its weight, then its bias if it has one.
pub(crate) fn norm_weights(n: &Norm) -> impl Iterator<Item = WeightId> {
    [Some(n.weight), n.bias].into_iter().flatten()
}

/// Width and view checks against one spec, with messages naming what is wrong.
struct Checker<'a> {
    spec: &'a ModelSpec,
}

impl Checker<'_> {
    fn buffer(&self, id: BufId) -> Result<&crate::spec::Buffer, String> {
        self.spec
            .buffers
            .get(id.0 as usize)
            .ok_or_else(|| format!("no buffer {}", id.0))
    }
    fn tensor(&self, id: WeightId) -> Result<&crate::spec::Tensor, String> {
        self.spec
            .weights
            .get(id.0 as usize)
            .ok_or_else(|| format!("no weight {}", id.0))
    }
    fn width(&self, id: BufId) -> Result<usize, String> {
        Ok(self.buffer(id)?.row_len)
    }
    /// An activation buffer (`Block` rows) of the given element type and width.
    fn buf(&self, id: BufId, width: Option<usize>, elem: Elem) -> Result<(), String> {
        let b = self.buffer(id)?;
        if b.elem != elem {
            return Err(format!("buffer {} holds {:?}, expected {elem:?}", b.name, b.elem));
        }
        match width {
            Some(w) if b.row_len != w => Err(format!("buffer {} has rows of {}, expected {w}", b.name, b.row_len)),
            _ => Ok(()),
        }
    }
    /// A key and a value cache of rows of `width`, stored as the same float type.
    fn caches(&self, k: BufId, v: BufId, width: usize) -> Result<(), String> {
        self.cache(k, width)?;
        self.cache(v, width)?;
        let (kb, vb) = (self.buffer(k)?, self.buffer(v)?);
        if kb.elem != vb.elem {
            return Err(format!("KV caches {} and {} hold different types", kb.name, vb.name));
        }
        Ok(())
    }
    fn cache(&self, id: BufId, width: usize) -> Result<(), String> {
        let b = self.buffer(id)?;
        if b.rows != Rows::Cache || b.row_len != width || b.elem.kv_dtype().is_none() {
            return Err(format!("buffer {} is not a KV cache of rows of {width} floats", b.name));
        }
        Ok(())
    }
    /// A recurrent state buffer of `len` f32 values per sequence.
    fn state(&self, id: BufId, len: usize) -> Result<(), String> {
        let b = self.buffer(id)?;
        if b.rows != Rows::State || b.row_len != len || b.elem != Elem::F32 {
            return Err(format!("buffer {} is not a state of {len} floats per sequence", b.name));
        }
        Ok(())
    }
    /// A float tensor of `len` values in any shape (a convolution's `[channels, 1, taps]`).
    fn float_values(&self, id: WeightId, len: usize) -> Result<(), String> {
        let t = self.tensor(id)?;
        if t.elems() != len || t.dtype.is_quantized() {
            return Err(format!(
                "{} must hold {len} float values, has shape {:?} of {}",
                t.name, t.shape, t.dtype
            ));
        }
        Ok(())
    }
    fn matrix(&self, id: WeightId) -> Result<(usize, usize), String> {
        let t = self.tensor(id)?;
        match t.shape[..] {
            [rows, cols] if t.role == Role::Matrix => Ok((rows, cols)),
            _ => Err(format!("{} is not a matrix", t.name)),
        }
    }
    fn cols(&self, id: WeightId, cols: usize) -> Result<(), String> {
        let (_, c) = self.matrix(id)?;
        if c != cols {
            return Err(format!("{} has {c} columns, expected {cols}", self.tensor(id)?.name));
        }
        Ok(())
    }
    /// `(rows, cols)` of a matrix view inside its tensor.
    fn view(&self, w: &WeightRef) -> Result<(usize, usize), String> {
        let (rows, cols) = self.matrix(w.id)?;
        if w.rows == 0 || w.row0 + w.rows > rows {
            return Err(format!(
                "rows {}..{} are not inside {} ({rows} rows)",
                w.row0,
                w.row0 + w.rows,
                self.tensor(w.id)?.name
            ));
        }
        Ok((w.rows, cols))
    }
    fn vector(&self, id: WeightId, len: usize) -> Result<(), String> {
        let t = self.tensor(id)?;
        if t.shape != [len] {
            return Err(format!("{} has shape {:?}, expected [{len}]", t.name, t.shape));
        }
        Ok(())
    }
    fn vector_view(&self, v: &WeightRef, len: usize) -> Result<(), String> {
        let t = self.tensor(v.id)?;
        match t.shape[..] {
            [n] if v.rows == len && v.row0 + v.rows <= n => Ok(()),
            _ => Err(format!("{} does not hold {len} values from {}", t.name, v.row0)),
        }
    }
    fn norm(&self, n: &Norm, dim: usize) -> Result<(), String> {
        norm_weights(n).try_for_each(|w| self.vector(w, dim))?;
        if n.kind != NormKind::Layer && n.bias.is_some() {
            return Err("only a LayerNorm has a bias".into());
        }
        Ok(())
    }
    fn heads(&self, heads: usize, kv_heads: usize, head_dim: usize) -> Result<(), String> {
        if heads == 0 || kv_heads == 0 || head_dim == 0 || !heads.is_multiple_of(kv_heads) {
            return Err(format!(
                "{heads} query heads, {kv_heads} key/value heads of {head_dim}: the query heads must be a \
                 positive multiple of the key/value heads"
            ));
        }
        Ok(())
    }
}
