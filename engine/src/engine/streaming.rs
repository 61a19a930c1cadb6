//! How an engine under `--ram-budget` finds each weight: in place, in a stream buffer, or in
//! the gathered token table (see `kiln_core::budget` for the plan, `crate::stream` for the
//! machinery).

use super::EngineError;
use crate::engine::WeightSource;
use crate::plan::Resolved;
use crate::stream::{Gather, Streamer, Unit};
use kiln_core::budget::{self, BudgetPlan, Placement};
use kiln_core::{CompileOptions, Kernel, ModelSpec, WeightId, WeightRef};
use std::collections::HashMap;
use std::sync::Arc;

/// Where a streamed weight's bytes are.
#[derive(Clone, Copy)]
enum Home {
    /// Whole, at byte `at` of unit `unit`'s buffer.
    Unit { unit: usize, at: usize },
    /// The head's matrix, `chunk_rows` rows per unit from unit `first` on.
    HeadChunks {
        first: usize,
        chunk_rows: usize,
        row_bytes: usize,
    },
}

/// The streaming side of an engine: its plan, streamer and gathered table.
pub(super) struct Streaming {
    pub plan: BudgetPlan,
    pub streamer: Option<Arc<Streamer>>,
    pub gather: Option<Gather>,
    homes: HashMap<WeightId, Home>,
    table: Option<WeightId>,
}

impl Streaming {
    /// Builds the units `plan` streams. The head streams in the chunks `options` compiled.
    pub fn new(
        spec: &ModelSpec,
        options: &CompileOptions,
        plan: BudgetPlan,
        source: &Arc<dyn WeightSource>,
    ) -> Result<Streaming, EngineError> {
        let u = budget::units(spec);
        let mut units = Vec::new();
        let mut homes = HashMap::new();
        for (l, weights) in u.layer_weights.iter().enumerate() {
            if plan.layers[l] != Placement::Streamed {
                continue;
            }
            let mut unit = Unit::default();
            for &w in weights {
                let piece = unit.push(w, 0, spec.weight(w).bytes());
                homes.insert(
                    w,
                    Home::Unit {
                        unit: units.len(),
                        at: piece.at,
                    },
                );
            }
            units.push(unit);
        }
        let layer_units = units.len();
        if plan.head == Placement::Streamed
            && let Some(head) = u.head
        {
            let chunk_rows = options.head_chunk_rows.ok_or_else(|| {
                EngineError::Plan("the budget streams the output head, but the library has no head chunks".into())
            })?;
            let t = spec.weight(head);
            let row_bytes = t.row_bytes();
            homes.insert(
                head,
                Home::HeadChunks {
                    first: units.len(),
                    chunk_rows,
                    row_bytes,
                },
            );
            for c0 in (0..t.shape[0]).step_by(chunk_rows) {
                let rows = chunk_rows.min(t.shape[0] - c0);
                let mut unit = Unit::default();
                unit.push(head, c0 * row_bytes, rows * row_bytes);
                units.push(unit);
            }
        }
        let gather = (plan.embed == Placement::Streamed)
            .then_some(u.table)
            .flatten()
            .map(|t| Gather::new(t, spec.weight(t).shape[0], spec.weight(t).row_bytes()));
        let streamer =
            (!units.is_empty()).then(|| Arc::new(Streamer::new(units, layer_units, plan.buffers, source.clone())));
        Ok(Streaming {
            plan,
            streamer,
            gather,
            homes,
            table: u.table,
        })
    }

    /// Whether the output head is read in chunks (so only the chunked head plan may read it).
    pub fn head_streamed(&self) -> bool {
        self.plan.head == Placement::Streamed
    }

    /// Where `kernel`'s argument `w` is, if not in place.
    pub fn resolve(&self, spec: &ModelSpec, kernel: &Kernel, w: WeightRef) -> Result<Option<Resolved>, String> {
        let row_bytes = spec.weight(w.id).row_bytes();
        if let (Some(g), Kernel::Embed { .. }) = (&self.gather, kernel)
            && Some(w.id) == self.table
        {
            return Ok(Some(Resolved::Weight(g.table_ptr().wrapping_add(w.row0 * row_bytes))));
        }
        Ok(match self.homes.get(&w.id) {
            None => None,
            Some(&Home::Unit { unit, at }) => Some(Resolved::Streamed {
                unit,
                offset: at + w.row0 * row_bytes,
            }),
            Some(&Home::HeadChunks {
                first,
                chunk_rows,
                row_bytes,
            }) => {
                let (chunk, within) = (w.row0 / chunk_rows, w.row0 % chunk_rows);
                if within + w.rows > chunk_rows {
                    return Err(format!(
                        "{} reads rows {}..{} of the output head, which streams in chunks of {chunk_rows} rows",
                        kernel.symbol(),
                        w.row0,
                        w.row0 + w.rows
                    ));
                }
                Some(Resolved::Streamed {
                    unit: first + chunk,
                    offset: within * row_bytes,
                })
            }
        })
    }

    /// Bytes read from disk so far (stream buffers and gathered rows).
    pub fn bytes_read(&self) -> u64 {
        self.streamer.as_ref().map_or(0, |s| s.bytes_read()) + self.gather.as_ref().map_or(0, |g| g.bytes_read())
    }
}

impl super::Engine {
    /// Runs the block plan of one regime on `tokens` (already loaded, with their row info) at
    /// `pos`; `head_follows` says whether the head runs next (what the streamer reads ahead).
    pub(super) fn run_block(
        &mut self,
        decode: bool,
        tokens: &[u32],
        pos: usize,
        head_follows: bool,
    ) -> Result<(), EngineError> {
        if let Some(s) = self.streaming.as_ref().and_then(|s| s.streamer.as_ref()) {
            s.set_head_follows(head_follows);
        }
        // The second forward call comes after the first token is out: the grouped tensors'
        // source pages are dropped then, not on the way to it.
        if self.forwarded
            && let Some(release) = self.release.take()
        {
            release.run();
        }
        self.forwarded = true;
        self.gather_rows(tokens)?;
        let rows = tokens.len();
        let plan = if decode {
            &mut self.decode.block
        } else {
            &mut self.prefill.block
        };
        plan.run(&self.pool, rows, pos, rows);
        self.release_rows();
        self.stream_error()
    }

    /// Runs the one-row head of one regime on row `src_rows - 1` of the block just computed.
    pub(super) fn run_head(&mut self, decode: bool, pos: usize, src_rows: usize) -> Result<(), EngineError> {
        let plan = if decode {
            &mut self.decode.head
        } else {
            &mut self.prefill.head
        };
        plan.run(&self.pool, 1, pos, src_rows);
        self.stream_error()
    }

    /// Reads the token-table rows of `tokens` when the table is gathered.
    pub(super) fn gather_rows(&mut self, tokens: &[u32]) -> Result<(), EngineError> {
        let source = self.weights.clone();
        match self.streaming.as_mut().and_then(|s| s.gather.as_mut()) {
            Some(g) => g.load(source.as_ref(), tokens).map_err(EngineError::Stream),
            None => Ok(()),
        }
    }

    /// Releases the gathered rows of the call that just ran.
    pub(super) fn release_rows(&mut self) {
        if let Some(g) = self.streaming.as_mut().and_then(|s| s.gather.as_mut()) {
            g.release();
        }
    }

    /// The first read error of a stream buffer since the last check.
    pub(super) fn stream_error(&self) -> Result<(), EngineError> {
        match self
            .streaming
            .as_ref()
            .and_then(|s| s.streamer.as_ref())
            .and_then(|s| s.take_error())
        {
            Some(e) => Err(EngineError::Stream(e)),
            None => Ok(()),
        }
    }

    /// The `--ram-budget` plan this engine runs, if it was given one.
    pub fn budget_plan(&self) -> Option<&BudgetPlan> {
        self.streaming.as_ref().map(|s| &s.plan)
    }

    /// Bytes of weights read from disk so far under `--ram-budget` (0 without streaming).
    pub fn streamed_bytes(&self) -> u64 {
        self.streaming.as_ref().map_or(0, |s| s.bytes_read())
    }

    /// Whether the head has no batched plan (it streams in chunks, one row at a time).
    pub(super) fn head_by_rows(&self) -> bool {
        self.batch_head.is_none()
    }
}
