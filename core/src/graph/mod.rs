//! The model graph: a model's forward pass as operations over named buffers ([`Op`], listed
//! by an architecture file in the spec), and its lowering to an ordered list of kernel calls
//! ([`Graph`]) for each regime.
//!
//! Both sides read one description: the compiler emits the distinct kernels the graphs name,
//! the engine binds their symbols and resolves each argument to a pointer. Barriers are derived
//! here from the buffers each step reads and writes, never placed by hand.

mod lower;
mod op;

#[cfg(test)]
pub(crate) mod tests;

pub use crate::ops::{DecayForm, HeadOrder};
pub use op::{DeltaNet, Norm, Op, OpKind, QkNormOp};

pub use crate::kernel::DECODE_ROWS;
use crate::kernel::Kernel;
use crate::spec::{BufId, ModelSpec, WeightRef};
use std::collections::BTreeSet;

/// The buffer of token ids (i32) the engine fills before each call.
pub const TOKENS: &str = "tokens";
/// The residual stream; layer-by-layer debugging reads it after each layer.
pub const RESIDUAL: &str = "x";
/// Logits, one row per row that asked for them: row 0 after a prefill or a one-row decode
/// (the head runs on the block's last row), rows `0..n` after a batched step.
pub const LOGITS: &str = "logits";
/// Per row of a block, [`ROW_INFO_LEN`] i32 values the engine writes before each call (see
/// [`RowInfo`]): which sequence the row belongs to and where in it the row sits. Rows of one
/// call may belong to different sequences (a batched decode step), so every kernel that needs a
/// position reads it here, never from a per-call scalar.
pub const ROW_INFO: &str = "row_info";
/// i32 values per row of [`ROW_INFO`] (16 bytes: one aligned load).
pub const ROW_INFO_LEN: usize = 4;

/// The meaning of the i32 values of one row of [`ROW_INFO`], in order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RowInfo {
    /// Absolute position of the row's token in its sequence (what the KV write and the rotary
    /// angle use, and the last key attention sees).
    pub position: u32,
    /// KV-cache slot of the row's sequence: its keys and values live in that slot's part of
    /// every cache (`abi::MAX_SLOTS` at most).
    pub slot: u32,
    /// The position after the last one of this sequence's current forward call (prefill: the
    /// end of the prompt; decode: `position + 1`). A LongRoPE rotary embedding chooses its
    /// frequencies by it, as `transformers` does per forward call.
    pub seq_end: u32,
}

impl RowInfo {
    /// The row as the kernels read it.
    pub fn encode(self) -> [i32; ROW_INFO_LEN] {
        [self.position as i32, self.slot as i32, self.seq_end as i32, 0]
    }
}

/// Field indices within a row of [`ROW_INFO`].
pub mod row_info {
    pub const POSITION: usize = 0;
    pub const SLOT: usize = 1;
    pub const SEQ_END: usize = 2;
}

/// Where a kernel's pointer argument comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Arg {
    /// Row 0 of a buffer.
    Buf(BufId),
    /// Row `rows - 1` of a buffer (the output head reads only the last position of a block).
    LastRow(BufId),
    /// A weight, or rows of one.
    Weight(WeightRef),
    /// Row 0 of a buffer from its element `elem` on: where a chunk of the output head writes
    /// its part of a logits row (one row only: the kernel's own row length is the chunk's).
    BufAt(BufId, usize),
}

impl Arg {
    fn buf(self) -> Option<BufId> {
        match self {
            Arg::Buf(b) | Arg::LastRow(b) | Arg::BufAt(b, _) => Some(b),
            Arg::Weight(_) => None,
        }
    }
}

/// One kernel call. `barrier_before` is true when this step touches data that a step since the
/// last barrier wrote (or writes data such a step read), so all threads must finish first.
#[derive(Clone, Debug, PartialEq)]
pub struct Step {
    pub kernel: Kernel,
    pub args: Vec<Arg>,
    pub barrier_before: bool,
    /// Layer index, or `None` for embedding and head; used by profiles.
    pub layer: Option<usize>,
}

/// An ordered list of steps.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Graph {
    pub steps: Vec<Step>,
}

impl Graph {
    fn push(&mut self, kernel: Kernel, args: Vec<Arg>, layer: Option<usize>) {
        assert_eq!(
            kernel.arg_count(),
            args.len(),
            "{} takes {} pointer arguments",
            kernel.family(),
            kernel.arg_count()
        );
        self.steps.push(Step {
            kernel,
            args,
            barrier_before: false,
            layer,
        });
    }

    /// Marks the barriers from each step's read and write sets (RAW, WAR and WAW hazards on
    /// buffers). Weights are never written, so they never force a barrier.
    fn place_barriers(&mut self) {
        let mut written: BTreeSet<BufId> = BTreeSet::new();
        let mut read: BTreeSet<BufId> = BTreeSet::new();
        for step in &mut self.steps {
            let writes: BTreeSet<BufId> = step
                .kernel
                .written_args()
                .iter()
                .filter_map(|&i| step.args[i].buf())
                .collect();
            let reads: BTreeSet<BufId> = step.args.iter().filter_map(|a| a.buf()).collect();
            let hazard = reads.iter().any(|b| written.contains(b))
                || writes.iter().any(|b| read.contains(b) || written.contains(b));
            if hazard {
                step.barrier_before = true;
                written.clear();
                read.clear();
            }
            written.extend(writes);
            read.extend(reads);
        }
    }

    /// Number of barriers a run of this graph executes (the implicit one at the end included).
    pub fn barrier_count(&self) -> usize {
        self.steps.iter().filter(|s| s.barrier_before).count() + 1
    }
}

/// The embedding and every layer (the ops not marked `head`) for a block of up to `max_rows`
/// tokens. With at most [`DECODE_ROWS`] rows (decode) norms are folded into the matmuls that
/// read them and a gated MLP's two projections and activation become one step (see [`lower`]).
pub fn block_graph(spec: &ModelSpec, max_rows: usize) -> Graph {
    lower::lower(spec, false, max_rows)
}

/// The decode graph: [`block_graph`] for up to [`DECODE_ROWS`] rows, one per sequence.
pub fn decode_graph(spec: &ModelSpec) -> Graph {
    block_graph(spec, DECODE_ROWS)
}

/// The ops marked `head` (final norm, output head) on the last row of the block just computed.
/// Its kernels are decode kernels; it always starts with a barrier, since the block's last step
/// wrote the residual from other threads.
pub fn head_graph(spec: &ModelSpec) -> Graph {
    let mut g = lower::lower(spec, true, DECODE_ROWS);
    if let Some(first) = g.steps.first_mut() {
        first.barrier_before = true;
    }
    g
}

/// The head on every row of a decode step (a batched step, each row another sequence), writing
/// row `r` of the logits for row `r`: the kernels of [`head_graph`], reading every row from
/// row 0. Each row is computed with the same instructions whatever the rows beside it.
pub fn batch_head_graph(spec: &ModelSpec) -> Graph {
    let mut g = lower::lower_rows(spec, true, DECODE_ROWS);
    if let Some(first) = g.steps.first_mut() {
        first.barrier_before = true;
    }
    g
}

/// The one-row head of [`head_graph`] with the matmul that writes the logits split into
/// chunks of `chunk_rows` output rows (the last one shorter), each reading its rows of the
/// head's matrix (and bias) and writing its part of the logits row: how `--ram-budget`
/// streams a head larger than a stream buffer. Each logit is computed by the same
/// instructions as in the whole head (a matmul's outputs are independent of one another), so
/// the logits are bitwise the same.
pub fn chunked_head_graph(spec: &ModelSpec, chunk_rows: usize) -> Graph {
    let logits = spec.buffer_named(LOGITS);
    let mut g = Graph::default();
    for step in head_graph(spec).steps {
        let Kernel::MatMul { n, bias, .. } = step.kernel else {
            g.push(step.kernel, step.args, step.layer);
            continue;
        };
        if step.args.get(2).and_then(|a| a.buf()) != logits || chunk_rows == 0 || chunk_rows >= n {
            g.push(step.kernel, step.args, step.layer);
            continue;
        }
        let logits = logits.expect("checked above");
        for c0 in (0..n).step_by(chunk_rows) {
            let rows = chunk_rows.min(n - c0);
            let mut kernel = step.kernel.clone();
            if let Kernel::MatMul { n, .. } = &mut kernel {
                *n = rows;
            }
            let mut args = step.args.clone();
            let slice = |a: &Arg| match *a {
                Arg::Weight(w) => Arg::Weight(WeightRef {
                    id: w.id,
                    row0: w.row0 + c0,
                    rows,
                }),
                other => other,
            };
            args[1] = slice(&args[1]);
            args[2] = Arg::BufAt(logits, c0);
            if bias.is_some() {
                args[3] = slice(&args[3]);
            }
            g.push(kernel, args, step.layer);
        }
    }
    g.place_barriers();
    if let Some(first) = g.steps.first_mut() {
        first.barrier_before = true;
    }
    g
}

/// Every distinct kernel a library for this spec compiled with `options` must export, in
/// first-use order.
pub fn kernel_set(spec: &ModelSpec, options: &crate::CompileOptions) -> Vec<Kernel> {
    let mut seen = std::collections::HashSet::new();
    let mut out = Vec::new();
    let mut graphs = vec![
        block_graph(spec, options.prefill_rows),
        decode_graph(spec),
        head_graph(spec),
        batch_head_graph(spec),
    ];
    if let Some(rows) = options.head_chunk_rows {
        graphs.push(chunked_head_graph(spec, rows));
    }
    for step in graphs.iter().flat_map(|g| g.steps.iter()) {
        if seen.insert(step.kernel.clone()) {
            out.push(step.kernel.clone());
        }
    }
    out
}
