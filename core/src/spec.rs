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
    /// Rows stored as `heads` runs of `parts` equal parts each (Qwen3.5's `q_proj`: each head's
    /// query rows, then its gate rows), read part-major: every head's first part, then every
    /// head's second part, ... so each part of all heads is one contiguous row view.
    HeadParts { heads: usize, parts: usize },
}

impl Layout {
    /// Whether the layout only moves whole rows (elements, for a vector): the kernels' tensor
    /// is the stored rows in the order [`Layout::row_order`] gives. A quantised row is whole
    /// blocks, so this is a byte-row permutation whatever the storage type. `Plain` moves
    /// nothing and `Transposed` moves elements, not rows.
    pub fn reorders_rows(&self) -> bool {
        matches!(self, Layout::RopePermuted { .. } | Layout::HeadParts { .. })
    }

    /// For a layout that reorders rows, on a tensor of `rows` rows (elements, for a vector):
    /// `order[kernel_row]` is the stored row that holds `kernel_row`, so the tensor the kernels
    /// read is `out.row(r) = stored.row(order[r])`.
    ///
    /// `None` for a layout that does not reorder rows ([`Layout::reorders_rows`]), and when
    /// `rows` cannot be split as the layout says: `RopePermuted { heads }` needs a multiple of
    /// `2 * heads`, `HeadParts { heads, parts }` a multiple of `heads * parts` (`heads` and
    /// `parts` not 0).
    pub fn row_order(&self, rows: usize) -> Option<Vec<usize>> {
        match *self {
            Layout::Plain | Layout::Transposed => None,
            Layout::RopePermuted { heads } => {
                // llama.cpp's converter ran `w.reshape(heads, 2, d / 2, ...).swapaxes(1, 2)`:
                // within a head of `d` rows, kernel (Hugging Face) row `j * d/2 + i` is stored
                // row `2i + j`.
                if heads == 0 || !rows.is_multiple_of(heads.checked_mul(2)?) {
                    return None;
                }
                let d = rows / heads;
                let half = d / 2;
                let stored = |r: usize| r - r % d + 2 * (r % d % half) + r % d / half;
                Some((0..rows).map(stored).collect())
            }
            Layout::HeadParts { heads, parts } => {
                let runs = heads.checked_mul(parts)?;
                if runs == 0 || !rows.is_multiple_of(runs) {
                    return None;
                }
                // Kernel row `(part * heads + head) * d + i` is stored row
                // `(head * parts + part) * d + i`.
                let d = rows / runs;
                let stored = |r: usize| {
                    let (part, head, i) = (r / (heads * d), r / d % heads, r % d);
                    (head * parts + part) * d + i
                };
                Some((0..rows).map(stored).collect())
            }
        }
    }
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
    /// Read by the kernels in row groups ([`crate::grouped`]), pieces in this order: the engine
    /// repacks it at load so that each group of [`crate::grouped::GROUP_ROWS`] rows is one run
    /// of octet blocks. Set by [`ModelSpec::group_rows`]; absent from the serialised spec (and
    /// so from the cache key) when not set.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub row_groups: Option<crate::grouped::PieceOrder>,
    /// Its row groups alternate with another tensor's ([`crate::grouped::GroupPair`]: the gate
    /// and up projections of a gated activation), so decode's `gate_up` reads one stream. Set
    /// by [`ModelSpec::group_rows`] beside `row_groups`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub group_pair: Option<crate::grouped::GroupPair>,
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
    /// How many groups' length lies between the starts of two of its consecutive row groups:
    /// 2 when they alternate with a partner's ([`Tensor::group_pair`]), else 1.
    pub fn group_pitch(&self) -> usize {
        if self.group_pair.is_some() { 2 } else { 1 }
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
    /// One per row the output head computes in one call: at most [`crate::kernel::DECODE_ROWS`]
    /// (the logits). The head runs on a prefill's last row, or a batched step's rows that ask
    /// for logits a few at a time, never on a whole block: a row per block row had kept 155 MB
    /// of logits for 256 rows of a 152k vocabulary that nothing wrote.
    Head,
    /// A head-major KV cache: `max_position_embeddings` positions per head; `row_len` is
    /// `kv_heads * head_dim`.
    Cache,
    /// A recurrent layer's state (Gated DeltaNet: the convolution's last inputs, the delta
    /// rule's matrices): one row of `row_len` values per sequence slot, kept across calls
    /// like a KV cache, but of a fixed size whatever the sequence's length.
    State,
}

impl Rows {
    /// Rows a buffer of this kind has with prefill blocks of `block_rows` rows and `slots`
    /// sequences of `capacity` positions each (the KV caches).
    pub fn count(self, block_rows: usize, capacity: usize, slots: usize) -> usize {
        match self {
            Rows::Block => block_rows,
            Rows::Head => block_rows.min(crate::kernel::DECODE_ROWS),
            Rows::Cache => capacity.saturating_mul(slots),
            Rows::State => slots,
        }
    }
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
    /// Bytes of recurrent state (all layers) one sequence holds, whatever its length.
    pub fn state_bytes_per_sequence(&self) -> usize {
        self.buffers
            .iter()
            .filter(|b| b.rows == Rows::State)
            .map(Buffer::row_bytes)
            .sum()
    }
    /// Whether the model carries recurrent state across calls: then a sequence cannot be cut
    /// back to an arbitrary position (its state holds every earlier token), only restarted.
    pub fn is_recurrent(&self) -> bool {
        self.buffers.iter().any(|b| b.rows == Rows::State)
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

#[cfg(test)]
mod layout_tests {
    use super::Layout;

    /// Invariant: `HeadParts` reads stored `[heads][parts][d]` rows part-major, as
    /// `[parts][heads][d]`: part `p` of all heads is kernel rows `p * heads * d ..`, head by
    /// head, each head's part in stored order.
    #[test]
    fn head_parts_row_order_is_part_major() {
        let order = Layout::HeadParts { heads: 3, parts: 2 }.row_order(24).unwrap();
        // Stored: head 0 query 0..4, head 0 gate 4..8, head 1 query 8..12, gate 12..16, ...
        let expected = [
            [0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19],
            [4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23],
        ];
        assert_eq!(order, expected.concat());
        // A permutation for any shape; one part or one head leaves the rows alone.
        for (heads, parts, d) in [(1, 3, 2), (4, 3, 1), (2, 2, 5), (5, 1, 3), (1, 1, 7)] {
            let order = Layout::HeadParts { heads, parts }.row_order(heads * parts * d).unwrap();
            let mut seen = order.clone();
            seen.sort_unstable();
            assert_eq!(seen, (0..heads * parts * d).collect::<Vec<_>>(), "{heads} {parts} {d}");
            let identity = (0..order.len()).eq(order.iter().copied());
            assert_eq!(identity, parts == 1 || heads == 1, "{heads} {parts} {d}");
        }
    }

    /// Invariant: `row_order` is `None` exactly for layouts that move no rows and for row counts
    /// the layout cannot split, and `reorders_rows` says which layouts move rows.
    #[test]
    fn row_order_rejects_rows_that_do_not_divide() {
        let hp = |heads, parts| Layout::HeadParts { heads, parts };
        assert!(hp(3, 2).row_order(25).is_none());
        assert!(hp(3, 2).row_order(9).is_none());
        assert!(hp(0, 2).row_order(8).is_none());
        assert!(hp(2, 0).row_order(8).is_none());
        assert!(hp(usize::MAX, 2).row_order(8).is_none());
        assert_eq!(hp(3, 2).row_order(6).unwrap(), [0, 2, 4, 1, 3, 5]);
        assert!(Layout::RopePermuted { heads: 3 }.row_order(10).is_none());
        assert!(Layout::RopePermuted { heads: 0 }.row_order(8).is_none());
        // One head of 4 rows: HF rows 0, 1 (first half) are stored rows 0, 2.
        assert_eq!(Layout::RopePermuted { heads: 1 }.row_order(4).unwrap(), [0, 2, 1, 3]);
        for layout in [Layout::Plain, Layout::Transposed] {
            assert!(!layout.reorders_rows() && layout.row_order(8).is_none());
        }
        assert!(hp(3, 2).reorders_rows() && Layout::RopePermuted { heads: 1 }.reorders_rows());
    }
}
