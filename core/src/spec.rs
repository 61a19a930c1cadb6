//! `ModelSpec`: everything about a model that the generated code depends on, as data.
//!
//! A spec is built by an architecture file ([`crate::arch`]) from a model's config and holds the
//! weight tensors it reads ([`Tensor`]), the activation buffers and caches its steps pass
//! between them ([`Buffer`]), and the forward pass as a list of operations over those
//! ([`crate::graph::Op`]). The compiler emits the kernels the operations need and the engine
//! binds the same operations to pointers, so both read one description. The spec is serialised
//! into the cache key: it holds what changes the emitted code (dimensions, constants, storage
//! types, the operations) and the names that bind tensors, nothing else (no tokenizer, no EOS
//! ids, no weight values).

use crate::dtype::DType;
use crate::graph::{Op, OpKind};
use crate::rope::Rope;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// Index of a tensor in [`ModelSpec::weights`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct WeightId(pub u32);

/// Rows `row0 .. row0 + rows` of a weight (elements, for a vector): how a step reads one
/// projection out of a fused one (Phi-3's `qkv_proj`, GPT-2's `c_attn`) without a copy. Rows
/// of a matrix are whole quantisation blocks, so a view of any storage type is a pointer offset.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct WeightRef {
    pub id: WeightId,
    pub row0: usize,
    pub rows: usize,
}

/// How a file stores a tensor relative to the `[rows, cols]` layout the kernels read; the front
/// end puts it right once, at load.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Layout {
    /// Exactly as the kernels read it.
    Plain,
    /// Stored as `[cols, rows]` (GPT-2's `Conv1D` weights in Hugging Face files).
    Transposed,
    /// A q or k projection (or bias) of `heads` heads whose rows llama.cpp's converter
    /// permuted for its adjacent-pair RoPE (GGUF `llama` files).
    RopePermuted { heads: usize },
}

/// What a tensor is, which decides the storage types it may have.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    /// A matrix read a row at a time (projections, embeddings, the output head): any storage
    /// type, quantised included.
    Matrix,
    /// A vector (norm weights, biases, RoPE factors): f32, f16 or bf16.
    Vector,
}

/// One weight tensor of the model.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Tensor {
    /// The tensor's name in the model file (Hugging Face or GGUF spelling).
    pub name: String,
    /// Shape as the kernels read it, outermost first: `[rows, cols]` or `[len]`.
    pub shape: Vec<usize>,
    pub dtype: DType,
    pub layout: Layout,
    pub role: Role,
    /// The decoder layer it belongs to, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub layer: Option<usize>,
}

impl Tensor {
    pub fn elems(&self) -> usize {
        self.shape.iter().product()
    }
    pub fn bytes(&self) -> usize {
        self.dtype.bytes_for(self.elems())
    }
    /// Elements of one row (of the outermost dimension; 1 for a vector).
    pub fn row_elems(&self) -> usize {
        self.shape.iter().skip(1).product()
    }
    /// Bytes of one row.
    pub fn row_bytes(&self) -> usize {
        self.dtype.bytes_for(self.row_elems())
    }
    /// The shape as stored in the file (see [`Layout`]).
    pub fn stored_shape(&self) -> Vec<usize> {
        match self.layout {
            Layout::Transposed => self.shape.iter().rev().copied().collect(),
            _ => self.shape.clone(),
        }
    }
}

/// Index of a buffer in [`ModelSpec::buffers`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct BufId(pub u32);

/// Element type of a buffer. Activations are f32 (token ids and row info i32); a KV cache may
/// be stored narrower (`--kv-dtype`), converted to f32 as the attention reads it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Elem {
    #[default]
    F32,
    I32,
    F16,
    Bf16,
}

impl Elem {
    pub fn bytes(self) -> usize {
        match self {
            Elem::F32 | Elem::I32 => 4,
            Elem::F16 | Elem::Bf16 => 2,
        }
    }

    /// The storage type of a KV cache of this element type (`None` for i32).
    pub fn kv_dtype(self) -> Option<DType> {
        match self {
            Elem::F32 => Some(DType::F32),
            Elem::F16 => Some(DType::F16),
            Elem::Bf16 => Some(DType::BF16),
            Elem::I32 => None,
        }
    }

    /// Parses a `--kv-dtype` value: `f32`, `f16` or `bf16`.
    pub fn parse_kv(text: &str) -> Result<Elem, String> {
        match text.to_ascii_lowercase().as_str() {
            "f32" | "float32" => Ok(Elem::F32),
            "f16" | "float16" | "half" => Ok(Elem::F16),
            "bf16" | "bfloat16" => Ok(Elem::Bf16),
            _ => Err(format!("--kv-dtype {text:?}: expected f32, f16 or bf16")),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Elem::F32 => "f32",
            Elem::I32 => "i32",
            Elem::F16 => "f16",
            Elem::Bf16 => "bf16",
        }
    }
}

/// How many rows a buffer has.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Rows {
    /// One per row of a block (the prefill block size; 1 in decode).
    Block,
    /// A head-major KV cache: `max_position_embeddings` positions per head; `row_len` is
    /// `kv_heads * head_dim`.
    Cache,
}

/// An activation buffer or cache owned by the engine.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Buffer {
    pub name: String,
    /// Elements per row.
    pub row_len: usize,
    pub elem: Elem,
    pub rows: Rows,
}

impl Buffer {
    pub fn row_bytes(&self) -> usize {
        self.row_len * self.elem.bytes()
    }
}

/// The model's headline dimensions: what `kiln info` shows and what the engine sizes by.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Dims {
    pub hidden_size: usize,
    /// Width of the MLP's hidden layer.
    pub intermediate_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub vocab_size: usize,
    /// The model's context limit: the capacity of the KV caches the kernels address.
    pub max_position_embeddings: usize,
}

impl Dims {
    /// Width of all query heads together.
    pub fn q_dim(&self) -> usize {
        self.num_heads * self.head_dim
    }
    /// Width of all key (or value) heads together: one row of the KV cache.
    pub fn kv_dim(&self) -> usize {
        self.num_kv_heads * self.head_dim
    }
}

/// A whole model: tensors, buffers and the forward pass.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ModelSpec {
    /// The architecture's name in [`crate::arch::ARCHITECTURES`] (`llama`, `gpt2`, ...).
    pub arch: String,
    pub dims: Dims,
    pub weights: Vec<Tensor>,
    pub buffers: Vec<Buffer>,
    /// Embedding and layers, then the ops marked [`Op::head`] (final norm, output head).
    pub ops: Vec<Op>,
    /// The rotary embedding of the full-attention layers as configured (for reports; the
    /// operations carry the tables the kernels use).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rope: Option<Rope>,
}

impl ModelSpec {
    pub fn num_layers(&self) -> usize {
        self.dims.num_layers
    }
    /// Stores every KV cache as `elem` (f32, f16 or bf16): `--kv-dtype`. The caches' element
    /// type is part of the spec, hence of the cache key and of the kernels that touch them.
    pub fn set_kv_elem(&mut self, elem: Elem) {
        assert!(elem.kv_dtype().is_some(), "a KV cache holds floats");
        for b in self.buffers.iter_mut().filter(|b| b.rows == Rows::Cache) {
            b.elem = elem;
        }
    }
    /// Bytes the KV caches of all layers hold for one position of one sequence.
    pub fn kv_bytes_per_position(&self) -> usize {
        self.buffers
            .iter()
            .filter(|b| b.rows == Rows::Cache)
            .map(Buffer::row_bytes)
            .sum()
    }
    /// The element type of the KV caches (f32 unless [`ModelSpec::set_kv_elem`] changed it).
    pub fn kv_elem(&self) -> Elem {
        self.buffers
            .iter()
            .find(|b| b.rows == Rows::Cache)
            .map_or(Elem::F32, |b| b.elem)
    }
    pub fn weight(&self, id: WeightId) -> &Tensor {
        &self.weights[id.0 as usize]
    }
    pub fn buffer(&self, id: BufId) -> &Buffer {
        &self.buffers[id.0 as usize]
    }
    /// The buffer called `name`, if the spec has one.
    pub fn buffer_named(&self, name: &str) -> Option<BufId> {
        self.buffers
            .iter()
            .position(|b| b.name == name)
            .map(|i| BufId(i as u32))
    }
    /// Every tensor with its id.
    pub fn weight_ids(&self) -> impl Iterator<Item = (WeightId, &Tensor)> {
        self.weights.iter().enumerate().map(|(i, t)| (WeightId(i as u32), t))
    }
    /// The id of the tensor called `name`, if the spec reads one.
    pub fn weight_named(&self, name: &str) -> Option<WeightId> {
        self.weights
            .iter()
            .position(|t| t.name == name)
            .map(|i| WeightId(i as u32))
    }

    /// Number of parameters (elements of all weight tensors; a tied head is the embedding).
    pub fn param_count(&self) -> u64 {
        self.weights.iter().map(|w| w.elems() as u64).sum()
    }

    /// Bytes of weights read to decode one token: every tensor once, except tables only
    /// gathered from (a token's embedding row, a position's row), of which one row is read.
    pub fn weight_bytes_per_token(&self) -> u64 {
        let mut gathered_only: BTreeMap<WeightId, bool> = BTreeMap::new();
        for op in &self.ops {
            let (full, gathered) = op.kind.weights_read();
            for id in full {
                gathered_only.insert(id, false);
            }
            for id in gathered {
                gathered_only.entry(id).or_insert(true);
            }
        }
        gathered_only
            .iter()
            .map(|(&id, &gathered)| {
                let t = self.weight(id);
                (if gathered { t.row_bytes() } else { t.bytes() }) as u64
            })
            .sum()
    }

    /// Whether the output head reads the embedding table (tied embeddings).
    pub fn tied_embeddings(&self) -> bool {
        let gathered: Vec<WeightId> = self.ops.iter().flat_map(|o| o.kind.weights_read().1).collect();
        self.ops
            .iter()
            .filter(|o| o.head)
            .flat_map(|o| o.kind.weights_read().0)
            .any(|id| gathered.contains(&id))
    }

    /// Bytes of all weight tensors.
    pub fn weight_bytes(&self) -> u64 {
        self.weights.iter().map(|w| w.bytes() as u64).sum()
    }

    /// The sliding window of each layer's attention (`None` = full attention).
    pub fn attention_windows(&self) -> Vec<Option<usize>> {
        let mut out = vec![None; self.num_layers()];
        for op in &self.ops {
            if let (OpKind::Attention { window, .. }, Some(l)) = (&op.kind, op.layer)
                && let Some(slot) = out.get_mut(l)
            {
                *slot = *window;
            }
        }
        out
    }

    /// Checks that every operation fits its buffers and tensors (widths, views inside their
    /// tensors, storage types a kernel reads), so an architecture file's mistake fails here with
    /// a message rather than as wrong code.
    pub fn validate(&self) -> Result<(), String> {
        for t in &self.weights {
            if t.role == Role::Vector && t.dtype.is_quantized() {
                return Err(format!(
                    "{} is stored as {}: quantised storage is supported for weight matrices, not for norms or \
                     biases; load the model with dequantisation to bf16 or f32",
                    t.name, t.dtype
                ));
            }
            if t.dtype.is_quantized() && !t.dtype.fits(t.row_elems()) {
                return Err(format!(
                    "{} is stored as {} with rows of {} values, not a whole number of {}-value blocks",
                    t.name,
                    t.dtype,
                    t.row_elems(),
                    t.dtype.block_elems()
                ));
            }
        }
        for (i, op) in self.ops.iter().enumerate() {
            op.kind
                .check(self)
                .map_err(|e| format!("operation {i} ({}): {e}", op.kind.name()))?;
        }
        Ok(())
    }
}
