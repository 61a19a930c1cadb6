//! What the engine shows of its own work: the residual stream after every layer (for numerical
//! comparisons against a reference, `kiln debug`) and the per-kernel times of each plan
//! (`KILN_PROFILE`).

use super::{Engine, EngineError, build_plan};
use crate::plan::Plan;
use kiln_core::graph;

impl Engine {
    /// Prefills `tokens` like [`Engine::prefill`] but one layer at a time, returning the
    /// residual stream of every token after the embedding and after each layer
    /// (`[1 + layers][tokens][hidden]`), for numerical comparisons against a reference. Slower
    /// than `prefill` (a plan per layer, and a copy of the residual after each).
    pub fn prefill_layer_by_layer(&mut self, tokens: &[u32]) -> Result<Vec<Vec<Vec<f32>>>, EngineError> {
        self.check(0, tokens)?;
        let block = self.bufs.block_rows;
        let full = graph::block_graph(&self.spec, block);
        // Split the block graph into the embedding and one graph per layer.
        let mut parts: Vec<graph::Graph> = vec![graph::Graph::default(); self.spec.num_layers() + 1];
        for step in full.steps {
            let i = step.layer.map_or(0, |l| l + 1);
            parts[i].steps.push(step);
        }
        let mut plans = parts
            .iter()
            .map(|g| {
                let streaming = self.streaming.as_ref();
                build_plan(
                    &self.spec,
                    g,
                    &self.library,
                    &self.bufs,
                    self.weights.as_ref(),
                    streaming,
                    false,
                )
            })
            .collect::<Result<Vec<_>, _>>()?;
        let hidden = self.spec.dims.hidden_size;
        let mut out: Vec<Vec<Vec<f32>>> = vec![Vec::with_capacity(tokens.len()); plans.len()];
        let seq_end = self.positions[0] + tokens.len();
        for chunk in tokens.chunks(block) {
            let pos = self.positions[0];
            self.load_tokens(chunk);
            self.load_rows(0, pos, chunk.len(), seq_end);
            self.gather_rows(chunk)?;
            for (plan, residuals) in plans.iter_mut().zip(out.iter_mut()) {
                plan.run(&self.pool, chunk.len(), pos, chunk.len());
                let x = self.bufs.get(self.std.residual).f32s(chunk.len() * hidden);
                residuals.extend(x.chunks(hidden).map(|r| r.to_vec()));
            }
            self.release_rows();
            self.stream_error()?;
            self.positions[0] += chunk.len();
        }
        let last_rows = (tokens.len() - 1) % block + 1;
        self.run_head(false, self.positions[0] - 1, last_rows)?;
        Ok(out)
    }

    /// The profile of each plan that ran, when the engine was created with `profile`.
    pub fn profile(&self) -> Vec<PlanProfile> {
        let block = self.bufs.block_rows;
        let head = graph::head_graph(&self.spec);
        let plans: [(&str, Option<&Plan>, graph::Graph); 5] = [
            (
                "prefill",
                Some(&self.prefill.block),
                graph::block_graph(&self.spec, block),
            ),
            ("prefill_head", Some(&self.prefill.head), head.clone()),
            ("decode", Some(&self.decode.block), graph::decode_graph(&self.spec)),
            ("decode_head", Some(&self.decode.head), head),
            (
                "batch_head",
                self.batch_head.as_ref(),
                graph::batch_head_graph(&self.spec),
            ),
        ];
        plans
            .into_iter()
            .filter_map(|(name, plan, graph)| {
                let plan = plan?;
                let t = plan.times()?;
                Some(PlanProfile {
                    name,
                    runs: t.runs(),
                    rows: t.rows(),
                    nodes: graph.steps.into_iter().zip(t.nodes()).collect(),
                    barriers_per_run: t.barriers_per_run(),
                    barrier_wait_nanos: t.barrier_wait(self.pool.threads()),
                })
            })
            .collect()
    }
}

/// Accumulated per-node times of one plan.
pub struct PlanProfile {
    pub name: &'static str,
    pub runs: u64,
    pub rows: u64,
    pub nodes: Vec<(graph::Step, crate::plan::NodeProfile)>,
    /// Barriers one run passes (the final one included).
    pub barriers_per_run: u64,
    /// Per thread: nanoseconds waited at barriers over all runs (load imbalance plus the
    /// barrier's own cost).
    pub barrier_wait_nanos: Vec<u64>,
}
