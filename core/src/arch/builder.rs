//! Building a [`ModelSpec`]: tensors, buffers and operations declared in order, with the
//! pieces most decoder blocks share.

use super::params::{ArchError, Format};
use crate::dtype::DType;
use crate::graph::{Norm, Op, OpKind, QkNormOp, RESIDUAL, ROW_INFO, ROW_INFO_LEN, TOKENS};
use crate::ops::{Act, F32Bits, NormKind, Rotary};
use crate::spec::{BufId, Buffer, Dims, Elem, Layout, ModelSpec, Role, Rows, Tensor, WeightId, WeightRef};

/// Accumulates a spec. Tensors get the placeholder storage type f32 until the front end reads
/// the real one from the file.
pub struct Builder {
    spec: ModelSpec,
    format: Format,
    layer: Option<usize>,
    head: bool,
}

impl Builder {
    /// A spec with the standard buffers: token ids, the residual stream, the logits and the
    /// rows' positions and slots.
    pub fn new(arch: &str, dims: Dims, format: Format) -> Builder {
        let mut b = Builder {
            spec: ModelSpec {
                arch: arch.to_string(),
                dims,
                weights: Vec::new(),
                buffers: Vec::new(),
                ops: Vec::new(),
                rope: None,
            },
            format,
            layer: None,
            head: false,
        };
        b.declare(TOKENS, 1, Elem::I32, Rows::Block);
        let hidden = b.spec.dims.hidden_size;
        b.declare(RESIDUAL, hidden, Elem::F32, Rows::Block);
        let vocab = b.spec.dims.vocab_size;
        b.declare(crate::graph::LOGITS, vocab, Elem::F32, Rows::Head);
        b.declare(ROW_INFO, ROW_INFO_LEN, Elem::I32, Rows::Block);
        b
    }

    pub fn dims(&self) -> &Dims {
        &self.spec.dims
    }
    pub fn format(&self) -> Format {
        self.format
    }

    /// `hf` in a Hugging Face folder, `gguf` in a GGUF file.
    pub fn name(&self, hf: impl Into<String>, gguf: impl Into<String>) -> String {
        match self.format {
            Format::HuggingFace => hf.into(),
            Format::Gguf => gguf.into(),
        }
    }

    /// Operations and tensors declared from now on belong to layer `l`.
    pub fn layer(&mut self, l: usize) {
        self.layer = Some(l);
    }

    /// The layer being declared, if any.
    pub fn current_layer(&self) -> Option<usize> {
        self.layer
    }

    /// Operations declared from now on are the output head (final norm, logits), which run on
    /// the last row of a block only.
    pub fn head(&mut self) {
        self.layer = None;
        self.head = true;
    }

    fn declare(&mut self, name: &str, row_len: usize, elem: Elem, rows: Rows) -> BufId {
        if let Some(id) = self.spec.buffer_named(name) {
            return id;
        }
        self.spec.buffers.push(Buffer {
            name: name.to_string(),
            row_len,
            elem,
            rows,
        });
        BufId(self.spec.buffers.len() as u32 - 1)
    }

    /// The activation buffer `name` (declared on first use; later uses get the same buffer,
    /// so every layer reuses it).
    pub fn buffer(&mut self, name: &str, row_len: usize) -> BufId {
        self.declare(name, row_len, Elem::F32, Rows::Block)
    }

    /// A KV cache of rows of `row_len` (`kv_heads * head_dim`).
    pub fn cache(&mut self, name: &str, row_len: usize) -> BufId {
        self.declare(name, row_len, Elem::F32, Rows::Cache)
    }

    /// A recurrent layer's state of `len` f32 values per sequence, kept across calls.
    pub fn state(&mut self, name: &str, len: usize) -> BufId {
        self.declare(name, len, Elem::F32, Rows::State)
    }

    pub fn tokens(&self) -> BufId {
        self.spec.buffer_named(TOKENS).expect("standard buffer")
    }
    pub fn residual(&self) -> BufId {
        self.spec.buffer_named(RESIDUAL).expect("standard buffer")
    }
    pub fn logits(&self) -> BufId {
        self.spec.buffer_named(crate::graph::LOGITS).expect("standard buffer")
    }

    /// A tensor of the model file, stored as the kernels read it.
    pub fn tensor(&mut self, name: String, shape: &[usize], role: Role) -> WeightId {
        self.tensor_with(name, shape, role, Layout::Plain)
    }

    /// A tensor stored in `layout` (transposed, or with permuted rows).
    pub fn tensor_with(&mut self, name: String, shape: &[usize], role: Role, layout: Layout) -> WeightId {
        self.spec.weights.push(Tensor {
            name,
            shape: shape.to_vec(),
            dtype: DType::F32,
            layout,
            role,
            layer: self.layer,
            row_groups: None,
            group_pair: None,
        });
        WeightId(self.spec.weights.len() as u32 - 1)
    }

    /// A matrix `[rows, cols]`.
    pub fn matrix(&mut self, name: String, rows: usize, cols: usize) -> WeightId {
        self.tensor(name, &[rows, cols], Role::Matrix)
    }

    /// A vector `[len]`.
    pub fn vector(&mut self, name: String, len: usize) -> WeightId {
        self.tensor(name, &[len], Role::Vector)
    }

    /// The whole of a tensor, as a view.
    pub fn whole(&self, id: WeightId) -> WeightRef {
        WeightRef {
            id,
            row0: 0,
            rows: self.spec.weight(id).shape[0],
        }
    }

    /// Rows `row0 .. row0 + rows` of a tensor.
    pub fn rows(&self, id: WeightId, row0: usize, rows: usize) -> WeightRef {
        WeightRef { id, row0, rows }
    }

    pub fn op(&mut self, kind: OpKind) {
        self.spec.ops.push(Op {
            kind,
            layer: self.layer,
            head: self.head,
        });
    }

    /// `out = norm(x)` (or `out += norm(x)`).
    pub fn norm(&mut self, x: BufId, out: BufId, norm: Norm, accumulate: bool) {
        self.op(OpKind::Norm {
            x,
            out,
            norm,
            accumulate,
        });
    }

    /// `out (+)= x @ w^T + bias`, no activation.
    pub fn linear(&mut self, x: BufId, w: WeightRef, bias: Option<WeightRef>, out: BufId, accumulate: bool) {
        self.op(OpKind::Linear {
            x,
            w,
            bias,
            out,
            accumulate,
            act: None,
            softcap: None,
        });
    }

    /// `out = act(x @ w^T + bias)`.
    pub fn linear_act(&mut self, x: BufId, w: WeightRef, bias: Option<WeightRef>, out: BufId, act: Act) {
        self.op(OpKind::Linear {
            x,
            w,
            bias,
            out,
            accumulate: false,
            act: Some(act),
            softcap: None,
        });
    }

    /// The token embedding table `[vocab, hidden]` (named `hf` or `gguf`, as the format names it)
    /// and the operation that fills the residual stream from it (`* scale` where given); returns
    /// the table, which a tied head reads.
    pub fn embed_tokens(&mut self, hf: &str, gguf: &str, scale: Option<F32Bits>) -> WeightId {
        let (vocab, hidden) = (self.spec.dims.vocab_size, self.spec.dims.hidden_size);
        let name = self.name(hf, gguf);
        let table = self.matrix(name, vocab, hidden);
        let (tokens, out) = (self.tokens(), self.residual());
        self.op(OpKind::Embed {
            tokens,
            table,
            out,
            scale,
            positions: None,
        });
        table
    }

    /// The output head as the Llama-style families name it: after the last layer, the final
    /// norm (`model.norm` / `output_norm`, of `kind`) of the residual stream, then `logits =
    /// softcap(head @ norm(x))` with the head `lm_head` / `output`, or the embedding `embed`
    /// when `tied`.
    pub fn norm_and_head(&mut self, kind: NormKind, eps: f32, embed: WeightId, tied: bool, softcap: Option<F32Bits>) {
        let (hidden, vocab) = (self.spec.dims.hidden_size, self.spec.dims.vocab_size);
        self.head();
        let norm_name = self.name("model.norm.weight", "output_norm.weight");
        let final_norm = self.vector(norm_name, hidden);
        let head = if tied {
            embed
        } else {
            let name = self.name("lm_head.weight", "output.weight");
            self.matrix(name, vocab, hidden)
        };
        let (x, xn, logits) = (self.residual(), self.buffer("xn", hidden), self.logits());
        self.norm(x, xn, norm(kind, eps, final_norm, None), false);
        let w = self.whole(head);
        self.op(OpKind::Linear {
            x: xn,
            w,
            bias: None,
            out: logits,
            accumulate: false,
            act: None,
            softcap,
        });
    }

    /// Self-attention from projected `q`, `k`, `v` into `out`: per-head norms, rotary
    /// embedding and the cache write, then attention over this layer's caches.
    pub fn attend(&mut self, a: &Attend, q: BufId, k: BufId, v: BufId, out: BufId) {
        let l = self.layer.expect("attention belongs to a layer");
        let kv = a.kv_heads * a.head_dim;
        let k_cache = self.cache(&format!("layers.{l}.k_cache"), kv);
        let v_cache = self.cache(&format!("layers.{l}.v_cache"), kv);
        self.op(OpKind::RopeKv {
            q,
            k,
            v,
            k_cache,
            v_cache,
            heads: a.heads,
            kv_heads: a.kv_heads,
            head_dim: a.head_dim,
            rotary: a.rotary.clone(),
            qk_norm: a.qk_norm,
        });
        self.op(OpKind::Attention {
            q,
            k_cache,
            v_cache,
            out,
            heads: a.heads,
            kv_heads: a.kv_heads,
            head_dim: a.head_dim,
            window: a.window,
            scale: a.scale,
            softcap: a.softcap,
        });
    }

    /// Records the configured RoPE of the full-attention layers (for reports).
    pub fn set_rope(&mut self, rope: crate::rope::Rope) {
        self.spec.rope = Some(rope);
    }

    /// The checked spec.
    pub fn finish(self) -> Result<ModelSpec, ArchError> {
        self.spec.validate().map_err(|message| ArchError::Config { message })?;
        Ok(self.spec)
    }
}

/// One layer's attention: heads, rotary embedding, window and score treatment.
#[derive(Clone, Debug)]
pub struct Attend {
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub rotary: Option<Rotary>,
    pub qk_norm: Option<QkNormOp>,
    pub window: Option<usize>,
    pub scale: F32Bits,
    pub softcap: Option<F32Bits>,
}

impl Attend {
    /// The reference's default score scale, `head_dim^-0.5` rounded to f32.
    pub fn default_scale(head_dim: usize) -> F32Bits {
        F32Bits::new((1.0f64 / (head_dim as f64).sqrt()) as f32)
    }
}

/// A norm of `kind` with weight `w` (and LayerNorm bias `b`).
pub fn norm(kind: NormKind, eps: f32, w: WeightId, b: Option<WeightId>) -> Norm {
    Norm {
        kind,
        eps: F32Bits::new(eps),
        weight: w,
        bias: b,
    }
}
