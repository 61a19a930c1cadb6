//! The engine: a compiled library, the model's weights, buffers and KV cache, and the plans that
//! drive them. Prefill runs the prompt in blocks of rows; decode runs one row per token; both end
//! with the output head on the last row. All numeric work happens in the library.

use crate::buffers::Buffers;
use crate::checkpoint::Checkpoints;
use crate::library::{KernelLibrary, LibraryError};
use crate::plan::{Plan, Resolved};
use crate::pool::{Pool, physical_cores};

mod inspect;
mod step;
mod streaming;
pub use crate::source::WeightSource;
pub use inspect::PlanProfile;
use kiln_core::budget;
use kiln_core::graph::{self, Arg, RowInfo};
use kiln_core::{BufId, CompileOptions, ModelSpec};
use std::path::Path;
use std::sync::Arc;
pub use step::StepPart;

/// Run-time choices that do not change the compiled code.
#[derive(Clone, Debug)]
pub struct EngineConfig {
    /// Compute threads; default one per physical core.
    pub threads: Option<usize>,
    /// KV-cache capacity in tokens per sequence; default `min(max_position_embeddings, 4096)`.
    pub ctx: Option<usize>,
    /// Sequences with their own KV cache (`kiln serve --parallel`); the plain API uses slot 0.
    /// At most `abi::MAX_SLOTS`.
    pub slots: usize,
    /// Pin compute threads to cores.
    pub pin: bool,
    /// Record per-node times (`KILN_PROFILE=1`).
    pub profile: bool,
    /// `--ram-budget`: bytes the weights and the KV cache may hold (see `kiln_core::budget`).
    pub ram_budget: Option<u64>,
    /// The folder where row-grouped copies of the weights are kept between runs
    /// (`crate::grouped_store`); `None` repacks them at every start.
    pub grouped_store: Option<std::path::PathBuf>,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            threads: None,
            ctx: None,
            slots: 1,
            pin: true,
            profile: std::env::var_os("KILN_PROFILE").is_some_and(|v| v == "1"),
            ram_budget: None,
            grouped_store: None,
        }
    }
}

/// Default KV-cache capacity when the model allows more.
pub const DEFAULT_CTX: usize = 4096;

impl EngineConfig {
    /// The KV-cache capacity this configuration gives an engine for `spec`: the requested one
    /// if the model allows it, else `min(max_position_embeddings, DEFAULT_CTX)`.
    pub fn resolved_ctx(&self, spec: &ModelSpec) -> Result<usize, EngineError> {
        let max = spec.dims.max_position_embeddings;
        match self.ctx {
            Some(requested) if requested > max => Err(EngineError::CtxTooLarge { requested, max }),
            Some(requested) => Ok(requested.max(1)),
            None => Ok(max.min(DEFAULT_CTX)),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error(transparent)]
    Library(#[from] LibraryError),
    #[error("{0}")]
    Plan(String),
    #[error("{tokens} tokens at position {pos} exceed the context of {ctx} tokens")]
    ContextFull { tokens: usize, pos: usize, ctx: usize },
    #[error("token id {id} is outside the vocabulary of {vocab} tokens")]
    BadToken { id: u32, vocab: usize },
    #[error("nothing to prefill: the prompt has no tokens")]
    Empty,
    #[error("--ctx {requested} exceeds the model's max_position_embeddings ({max})")]
    CtxTooLarge { requested: usize, max: usize },
    #[error("{slots} sequences in parallel is more than this engine can batch (at most {max})")]
    TooManySlots { slots: usize, max: usize },
    #[error("slot {slot} does not exist: the engine has {slots} slots")]
    BadSlot { slot: usize, slots: usize },
    #[error("slot {slot} appears twice in one batched step")]
    DuplicateSlot { slot: usize },
    #[error("a step of {rows} rows exceeds the prefill block of {max} rows")]
    StepTooLarge { rows: usize, max: usize },
    #[error(transparent)]
    Budget(#[from] budget::TooSmall),
    #[error(transparent)]
    OutOfMemory(#[from] crate::buffers::OutOfMemory),
    #[error("reading streamed weights failed: {0}")]
    Stream(String),
}

/// Plans of one regime: the layer blocks and the output head.
struct Plans {
    block: Plan,
    head: Plan,
}

/// The buffers the engine itself reads or fills.
#[derive(Clone, Copy)]
struct Standard {
    tokens: BufId,
    residual: BufId,
    logits: BufId,
    row_info: BufId,
}

impl Standard {
    fn of(spec: &ModelSpec) -> Result<Standard, EngineError> {
        let get = |name: &str| {
            spec.buffer_named(name)
                .ok_or_else(|| EngineError::Plan(format!("the spec declares no \"{name}\" buffer")))
        };
        Ok(Standard {
            tokens: get(graph::TOKENS)?,
            residual: get(graph::RESIDUAL)?,
            logits: get(graph::LOGITS)?,
            row_info: get(graph::ROW_INFO)?,
        })
    }
}

pub struct Engine {
    spec: ModelSpec,
    pool: Pool,
    std: Standard,
    prefill: Plans,
    decode: Plans,
    /// The head on every row of a decode step: the logits of a batched step (none when the
    /// head streams in chunks: rows then go through the one-row head one by one).
    batch_head: Option<Plan>,
    /// The logits of a batched step of more than `DECODE_ROWS` sequences, gathered step by step.
    batch_logits: Vec<f32>,
    /// Block buffers the head reads (rows gathered to the front for the batched head).
    head_inputs: Vec<BufId>,
    bufs: Buffers,
    /// Tokens in each slot's KV cache.
    positions: Vec<usize>,
    /// Saved recurrent states to cut back to (see [`Engine::checkpoint_in`]).
    checkpoints: Checkpoints,
    /// Under `--ram-budget`: the plan, and where streamed weights come from.
    streaming: Option<streaming::Streaming>,
    // Dropped after the plans that point into them.
    weights: Arc<dyn WeightSource>,
    library: KernelLibrary,
    notes: Vec<String>,
    /// The row-grouped copy being kept in the cache while the model runs.
    writing: Option<crate::grouped::PendingWrite>,
    /// The grouped tensors' source pages, dropped at the second forward call (the first
    /// token is out by then), and whether a forward call has run.
    release: Option<crate::grouped::SourceRelease>,
    forwarded: bool,
}

impl Engine {
    /// Opens `library` (compiled for `spec` with `options`) and binds it to `weights`.
    pub fn new(
        spec: &ModelSpec,
        options: &CompileOptions,
        library: &Path,
        weights: Arc<dyn WeightSource>,
        config: &EngineConfig,
    ) -> Result<Engine, EngineError> {
        let ctx = config.resolved_ctx(spec)?;
        let std = Standard::of(spec)?;
        let block_rows = options.prefill_rows;
        let max_slots = kiln_core::abi::MAX_SLOTS;
        if config.slots == 0 || config.slots > max_slots {
            return Err(EngineError::TooManySlots {
                slots: config.slots,
                max: max_slots,
            });
        }
        let kernels = graph::kernel_set(spec, options);
        let library = KernelLibrary::open(library, &kernels)?;
        let bufs = Buffers::new(spec, block_rows, ctx, config.slots)?;
        let cores = physical_cores();
        let threads = config.threads.unwrap_or(cores.len()).max(1);
        let pool = Pool::new(
            threads,
            (config.pin && threads <= cores.len()).then(|| &cores[..threads]),
        );

        // Weights the kernels read in row groups, repacked once (the streamer reads weights as
        // stored, so a streaming engine must have none).
        let grouped = spec.weights.iter().any(|t| t.row_groups.is_some());
        if grouped && config.ram_budget.is_some() {
            return Err(EngineError::Plan(
                "row-grouped weights cannot be streamed under a RAM budget".to_string(),
            ));
        }
        let wrapped = crate::grouped::GroupedWeights::wrap(spec, weights, threads, config.grouped_store.as_deref())
            .map_err(EngineError::Plan)?;
        let (weights, writing, release) = (wrapped.weights, wrapped.writing, wrapped.release);
        let streaming = match config.ram_budget {
            Some(b) => {
                let plan = budget::plan(&budget::Footprint::of(spec, block_rows, ctx, config.slots), b)?;
                Some(streaming::Streaming::new(spec, options, plan, &weights)?)
            }
            None => None,
        };
        let head_streamed = streaming.as_ref().is_some_and(|s| s.head_streamed());
        let build = |g: &graph::Graph| {
            build_plan(
                spec,
                g,
                &library,
                &bufs,
                weights.as_ref(),
                streaming.as_ref(),
                config.profile,
            )
        };
        // A streamed head always has chunk rows here: `Streaming::new` refuses it otherwise.
        let head = match options.head_chunk_rows {
            Some(rows) if head_streamed => graph::chunked_head_graph(spec, rows),
            _ => graph::head_graph(spec),
        };
        let prefill = Plans {
            block: build(&graph::block_graph(spec, block_rows))?,
            head: build(&head)?,
        };
        let decode = Plans {
            block: build(&graph::decode_graph(spec))?,
            head: build(&head)?,
        };
        let batch_head_graph = graph::batch_head_graph(spec);
        let batch_head = if head_streamed {
            None
        } else {
            Some(build(&batch_head_graph)?)
        };
        let head_inputs = read_before_written(spec, &batch_head_graph);
        Ok(Engine {
            spec: spec.clone(),
            pool,
            std,
            prefill,
            decode,
            batch_head,
            batch_logits: Vec::new(),
            head_inputs,
            bufs,
            positions: vec![0; config.slots],
            checkpoints: Checkpoints::new(spec, config.slots),
            streaming,
            weights,
            library,
            notes: wrapped.notes,
            writing,
            release,
            forwarded: false,
        })
    }

    /// What the caller should tell the user about opening the engine (warnings).
    pub fn notes(&self) -> &[String] {
        &self.notes
    }

    /// Waits for the work the engine left running in the background (the row-grouped copy
    /// being written to the cache) and returns what the caller should tell the user about it.
    /// Dropping the engine waits too, silently.
    pub fn finish_writes(&mut self) -> Vec<String> {
        self.writing.take().and_then(|w| w.wait()).into_iter().collect()
    }

    pub fn spec(&self) -> &ModelSpec {
        &self.spec
    }
    /// Tokens currently in the KV cache (of slot 0, the one the plain API uses).
    pub fn position(&self) -> usize {
        self.positions[0]
    }
    /// Tokens currently in `slot`'s KV cache.
    pub fn position_in(&self, slot: usize) -> usize {
        self.positions[slot]
    }
    /// Sequences with their own KV cache.
    pub fn slots(&self) -> usize {
        self.positions.len()
    }
    pub fn ctx(&self) -> usize {
        self.bufs.ctx
    }
    pub fn threads(&self) -> usize {
        self.pool.threads()
    }
    /// The engine's thread pool (a benchmark measures the machine's ceilings on it).
    pub fn pool(&self) -> &Pool {
        &self.pool
    }
    pub fn prefill_block(&self) -> usize {
        self.bufs.block_rows
    }
    /// Forgets the conversation (the cache contents are overwritten as positions are reused).
    pub fn reset(&mut self) {
        self.positions[0] = 0;
        self.checkpoints.forget(0);
    }
    /// Drops every cached position from `pos` on, so generation continues from there, and
    /// returns the position kept: `pos` (or less if fewer were cached), except for a model with
    /// recurrent state ([`ModelSpec::is_recurrent`]), whose state holds every token so far and
    /// cannot be cut back: cutting anything goes back to the slot's checkpoint if it was taken
    /// at `pos` or before ([`Engine::checkpoint_in`]), else restarts the sequence at 0 (its
    /// kernels start from a zero state at position 0); the caller runs the tokens after the
    /// position kept again.
    pub fn truncate(&mut self, pos: usize) -> usize {
        self.truncate_in(0, pos)
    }
    /// [`Engine::truncate`] for `slot`.
    pub fn truncate_in(&mut self, slot: usize, pos: usize) -> usize {
        let now = self.positions[slot];
        let kept = if pos >= now {
            now
        } else if self.spec.is_recurrent() {
            self.checkpoints.restore(&mut self.bufs, slot, pos)
        } else {
            pos
        };
        self.positions[slot] = kept;
        kept
    }
    /// Saves `slot`'s recurrent state at its current position, so that a later
    /// [`Engine::truncate_in`] to this position or beyond comes back here instead of
    /// restarting (one checkpoint per slot; a copy of the state, 19 MiB on the Qwen3.5-0.8B
    /// shape). Does nothing for a model without recurrent state.
    pub fn checkpoint_in(&mut self, slot: usize) {
        self.checkpoints.save(&self.bufs, slot, self.positions[slot]);
    }
    /// [`Engine::checkpoint_in`] for slot 0.
    pub fn checkpoint(&mut self) {
        self.checkpoint_in(0)
    }

    fn check(&self, slot: usize, tokens: &[u32]) -> Result<(), EngineError> {
        if slot >= self.positions.len() {
            return Err(EngineError::BadSlot {
                slot,
                slots: self.positions.len(),
            });
        }
        if tokens.is_empty() {
            return Err(EngineError::Empty);
        }
        let pos = self.positions[slot];
        if pos + tokens.len() > self.bufs.ctx {
            return Err(EngineError::ContextFull {
                tokens: tokens.len(),
                pos,
                ctx: self.bufs.ctx,
            });
        }
        let vocab = self.spec.dims.vocab_size;
        if let Some(&id) = tokens.iter().find(|&&t| t as usize >= vocab) {
            return Err(EngineError::BadToken { id, vocab });
        }
        Ok(())
    }

    /// Runs `tokens` through the model at the current position, in blocks of the prefill
    /// size, and returns the logits of the last token.
    pub fn prefill(&mut self, tokens: &[u32]) -> Result<&[f32], EngineError> {
        self.prefill_in(0, tokens)
    }

    /// [`Engine::prefill`] into `slot`'s KV cache.
    pub fn prefill_in(&mut self, slot: usize, tokens: &[u32]) -> Result<&[f32], EngineError> {
        self.check(slot, tokens)?;
        let seq_end = self.positions[slot] + tokens.len();
        self.prefill_part(slot, tokens, seq_end, true)?;
        Ok(self.logits())
    }

    /// Runs `tokens` into `slot`, a block at a time, in a forward call ending at `seq_end`.
    /// With `logits`, the head runs on the last token (read them with [`Engine::logits`]).
    fn prefill_part(&mut self, slot: usize, tokens: &[u32], seq_end: usize, logits: bool) -> Result<(), EngineError> {
        self.check(slot, tokens)?;
        let block = self.bufs.block_rows;
        let blocks = tokens.len().div_ceil(block);
        let mut decode = false;
        for (i, chunk) in tokens.chunks(block).enumerate() {
            let pos = self.positions[slot];
            self.load_tokens(chunk);
            self.load_rows(slot, pos, chunk.len(), seq_end.max(pos + chunk.len()));
            // A chunk of a few rows (a short prompt, or a long one's tail) runs the decode
            // kernels, which read every weight once for all of their rows, where the prefill
            // kernels' tiles are laid out for whole blocks. Their rows are bitwise the prefill
            // kernels' except in recurrent layers, whose prefill takes chunks in another
            // summation order: those keep the prefill kernels, so a prompt's result does not
            // depend on how it was split.
            decode = chunk.len() <= graph::DECODE_ROWS && !self.spec.is_recurrent();
            self.run_block(decode, chunk, pos, logits && i + 1 == blocks)?;
            self.positions[slot] += chunk.len();
        }
        if logits {
            // The head reads the last row of the last block.
            let last_rows = (tokens.len() - 1) % block + 1;
            self.run_head(decode, self.positions[slot] - 1, last_rows)?;
        }
        Ok(())
    }

    /// Feeds one token and returns the logits for the next.
    pub fn decode(&mut self, token: u32) -> Result<&[f32], EngineError> {
        self.decode_batch(&[(0, token)])
    }

    /// Logits produced by the last `prefill` or `decode` (row 0 of the logits buffer).
    pub fn logits(&self) -> &[f32] {
        self.bufs.get(self.std.logits).f32s(self.spec.dims.vocab_size)
    }

    /// Row info for `rows` consecutive tokens of `slot` from `pos`, in a forward call of that
    /// sequence ending at `seq_end`.
    fn load_rows(&mut self, slot: usize, pos: usize, rows: usize, seq_end: usize) {
        let info: Vec<RowInfo> = (0..rows)
            .map(|r| RowInfo {
                position: (pos + r) as u32,
                slot: slot as u32,
                seq_end: seq_end as u32,
            })
            .collect();
        self.write_rows(&info);
    }

    fn write_rows(&mut self, rows: &[RowInfo]) {
        let n = graph::ROW_INFO_LEN;
        let dst = self.bufs.get_mut(self.std.row_info).i32s_mut(rows.len() * n);
        for (d, r) in dst.chunks_exact_mut(n).zip(rows) {
            d.copy_from_slice(&r.encode());
        }
    }

    fn load_tokens(&mut self, tokens: &[u32]) {
        let dst = self.bufs.get_mut(self.std.tokens).i32s_mut(tokens.len());
        for (d, &t) in dst.iter_mut().zip(tokens) {
            *d = t as i32;
        }
    }
}

/// The block buffers `graph` reads before (or without) writing them: its inputs.
fn read_before_written(spec: &ModelSpec, graph: &graph::Graph) -> Vec<BufId> {
    let mut written = std::collections::BTreeSet::new();
    let mut inputs = Vec::new();
    for step in &graph.steps {
        let writes: Vec<BufId> = step
            .kernel
            .written_args()
            .iter()
            .filter_map(|&i| match step.args[i] {
                Arg::Buf(b) | Arg::LastRow(b) | Arg::BufAt(b, _) => Some(b),
                Arg::Weight(_) => None,
            })
            .collect();
        for (i, arg) in step.args.iter().enumerate() {
            if let Arg::Buf(b) | Arg::LastRow(b) = *arg
                && !written.contains(&b)
                && !step.kernel.written_args().contains(&i)
                && spec.buffer(b).rows == kiln_core::spec::Rows::Block
                && !inputs.contains(&b)
            {
                inputs.push(b);
            }
        }
        written.extend(writes);
    }
    inputs
}

/// Binds `graph` to the library's kernels, the engine's buffers and the weights.
fn build_plan(
    spec: &ModelSpec,
    graph: &graph::Graph,
    library: &KernelLibrary,
    bufs: &Buffers,
    weights: &dyn WeightSource,
    streaming: Option<&streaming::Streaming>,
    profile: bool,
) -> Result<Plan, EngineError> {
    let resolve = |kernel: &kiln_core::Kernel, arg: &Arg| -> Result<Resolved, String> {
        match *arg {
            Arg::Buf(b) | Arg::LastRow(b) => Ok(Resolved::Buffer {
                base: bufs.get(b).as_ptr(),
                row_bytes: bufs.row_bytes(b),
            }),
            // `wrapping_add` keeps the arithmetic defined; `elem` lies within the buffer's
            // first row (the chunked head's chunks cover the logits row).
            Arg::BufAt(b, elem) => Ok(Resolved::Buffer {
                base: bufs.get(b).as_ptr().wrapping_add(elem * 4),
                row_bytes: bufs.row_bytes(b),
            }),
            Arg::Weight(w) => {
                if let Some(r) = streaming.map(|s| s.resolve(spec, kernel, w)).transpose()?.flatten() {
                    return Ok(r);
                }
                let row_bytes = spec.weight(w.id).row_bytes();
                // `wrapping_add` keeps the arithmetic defined; the view lies inside the tensor
                // (checked by `ModelSpec::validate`), which the source holds in full.
                weights
                    .weight_ptr(w.id)
                    .map(|p| Resolved::Weight(p.wrapping_add(w.row0 * row_bytes)))
            }
        }
    };
    let stream = streaming.and_then(|s| s.streamer.clone());
    Plan::build(graph, library, resolve, profile, stream).map_err(EngineError::Plan)
}
