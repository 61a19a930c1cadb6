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

pub use op::{Norm, Op, OpKind, QkNormOp};

use crate::kernel::Kernel;
use crate::spec::{BufId, ModelSpec, WeightRef};
use std::collections::BTreeSet;

/// The buffer of token ids (i32) the engine fills before each call.
pub const TOKENS: &str = "tokens";
/// The residual stream; layer-by-layer debugging reads it after each layer.
pub const RESIDUAL: &str = "x";
/// The logits of the last row.
pub const LOGITS: &str = "logits";
/// One i32: the position after the last one of the current forward call (prefill: the end of
/// the prompt; decode: `pos + 1`), written by the engine before each call. A LongRoPE rotary
/// embedding chooses its frequencies by it, as `transformers` does per forward call.
pub const SEQ_END: &str = "seq_end";

/// Where a kernel's pointer argument comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Arg {
    /// Row 0 of a buffer.
    Buf(BufId),
    /// Row `rows - 1` of a buffer (the output head reads only the last position of a block).
    LastRow(BufId),
    /// A weight, or rows of one.
    Weight(WeightRef),
}

impl Arg {
    fn buf(self) -> Option<BufId> {
        match self {
            Arg::Buf(b) | Arg::LastRow(b) => Some(b),
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
/// tokens. With `max_rows = 1` (decode) norms are folded into the matmuls that read them and a
/// gated MLP's two projections and activation become one step (see [`lower`]).
pub fn block_graph(spec: &ModelSpec, max_rows: usize) -> Graph {
    lower::lower(spec, false, max_rows)
}

/// The ops marked `head` (final norm, output head) on the last row of the block just computed.
/// Its kernels are decode kernels; it always starts with a barrier, since the block's last step
/// wrote the residual from other threads.
pub fn head_graph(spec: &ModelSpec) -> Graph {
    let mut g = lower::lower(spec, true, 1);
    if let Some(first) = g.steps.first_mut() {
        first.barrier_before = true;
    }
    g
}

/// Every distinct kernel a library for this spec must export, in first-use order.
pub fn kernel_set(spec: &ModelSpec, prefill_rows: usize) -> Vec<Kernel> {
    let mut seen = std::collections::HashSet::new();
    let mut out = Vec::new();
    let graphs = [block_graph(spec, prefill_rows), block_graph(spec, 1), head_graph(spec)];
    for step in graphs.iter().flat_map(|g| g.steps.iter()) {
        if seen.insert(step.kernel.clone()) {
            out.push(step.kernel.clone());
        }
    }
    out
}
