//! How `kiln info --ram-budget` shows a budget's plan (see `kiln_core::budget`).

use crate::commands::human_bytes;
use kiln_core::ModelSpec;
use kiln_core::budget::{BudgetPlan, Footprint, Placement, head_chunk_rows};
use serde_json::{Value, json};

/// The plan in lines of text, each starting with a column label.
pub fn describe(plan: &BudgetPlan, spec: &ModelSpec, budget: u64, f: &Footprint, ctx: usize) -> Vec<String> {
    let resident = plan.layers.iter().filter(|&&l| l == Placement::Resident).count();
    let head = match (plan.head, head_chunk_rows(spec)) {
        (Placement::Resident, _) => "resident".to_string(),
        (Placement::Streamed, Some(rows)) => format!(
            "streamed in {} chunks of {rows} rows",
            spec.dims.vocab_size.div_ceil(rows)
        ),
        (Placement::Streamed, None) => "streamed".to_string(),
    };
    let table = match plan.embed {
        Placement::Resident => "read in place",
        Placement::Streamed => "gathered, one row per token",
    };
    let mut lines = vec![
        format!(
            "budget       {} for weights and the KV cache ({} for {ctx} positions)",
            human_bytes(budget),
            human_bytes(f.kv)
        ),
        format!(
            "resident     {resident} of {} layers, {} of weights",
            plan.layers.len(),
            human_bytes(plan.resident_bytes)
        ),
        format!("head         {head}; token table {table}"),
    ];
    if plan.buffers > 0 {
        lines.push(format!(
            "buffers      {} stream buffer{} of {}",
            plan.buffers,
            if plan.buffers == 1 { "" } else { "s" },
            human_bytes(plan.buffer_bytes)
        ));
    }
    lines.push(format!("peak         {} planned", human_bytes(plan.peak_bytes)));
    lines.push(format!(
        "outside      {} of activations for a prefill block of {} rows, plus the code, tokenizer and heap",
        human_bytes(f.activations),
        f.block_rows
    ));
    lines.push(format!(
        "disk/token   {} read from disk per decoded token",
        human_bytes(plan.streamed_per_token)
    ));
    lines
}

/// The plan as JSON (`kiln info --json`).
pub fn to_json(plan: &BudgetPlan, budget: u64, f: &Footprint) -> Value {
    json!({
        "ram_budget_bytes": budget,
        "kv_bytes": f.kv,
        "activation_bytes": f.activations,
        "resident_layers": plan.layers.iter().filter(|&&l| l == Placement::Resident).count(),
        "layers": plan.layers.len(),
        "head_streamed": plan.head == Placement::Streamed,
        "embedding_gathered": plan.embed == Placement::Streamed,
        "stream_buffers": plan.buffers,
        "stream_buffer_bytes": plan.buffer_bytes,
        "resident_weight_bytes": plan.resident_bytes,
        "planned_peak_bytes": plan.peak_bytes,
        "streamed_bytes_per_token": plan.streamed_per_token,
    })
}
