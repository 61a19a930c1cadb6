//! `--ram-budget`: which weights stay resident and which are streamed from disk, per token.
//!
//! A model's weights fall into units: one per decoder layer, the output head, the token
//! table, and the small rest (final norm, learned positions) that always stays. The planner
//! ([`plan`]) is a pure function of those sizes, the KV cache's and the budget: it keeps as
//! many units resident as fit beside the stream buffers and the KV cache, and streams the
//! others through a pool of one or two buffers of the largest streamed unit (two let the next
//! unit be read while this one computes). The output head streams in chunks of rows no larger
//! than a layer ([`head_chunk_rows`]), so a budget below the head's size still works; a token
//! table that is not kept is gathered a row per token. The budget covers the weights the
//! process holds and the KV cache; activations and the process's own code are outside it.

use crate::graph;
use crate::spec::{ModelSpec, Rows, WeightId};
use std::collections::BTreeSet;

/// Page size the planner rounds to (what the kernel maps and the embedding gather touches).
pub const PAGE: u64 = 4096;

/// The sizes the planner decides on, in bytes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Footprint {
    /// Weights of each decoder layer.
    pub layers: Vec<u64>,
    /// The output head's matrix.
    pub head: u64,
    /// One chunk of the head, as streamed (see [`head_chunk_rows`]).
    pub head_chunk: u64,
    /// The token table, when it is not the head's matrix (else 0).
    pub embed: u64,
    /// One row of the token table.
    pub embed_row: u64,
    /// Whether the token table is the head's matrix (tied embeddings).
    pub tied: bool,
    /// Weights that always stay resident (the head's norm, learned positions, ...).
    pub fixed: u64,
    /// The KV cache the engine will touch (all slots, `ctx` positions).
    pub kv: u64,
    /// Rows one call can embed: a gathered table touches at most this many rows' pages.
    pub block_rows: u64,
    /// Activation buffers of one prefill block (outside the budget, reported beside it).
    pub activations: u64,
}

/// Where a unit's weights come from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Placement {
    /// In place: the file mapping (or the source's own copy).
    Resident,
    /// Read from disk into a stream buffer each time it is used.
    Streamed,
}

/// What [`plan`] decided.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BudgetPlan {
    pub layers: Vec<Placement>,
    pub head: Placement,
    /// `Streamed` means gathered: the rows of the tokens in a call are read, then released.
    pub embed: Placement,
    /// Stream buffers (0 when nothing streams, 2 to read ahead while computing).
    pub buffers: usize,
    /// Bytes of each stream buffer: the largest streamed unit, page-rounded.
    pub buffer_bytes: u64,
    /// Pages a gathered token table may hold during one call.
    pub gather_bytes: u64,
    /// Weight bytes kept resident (units and the fixed rest).
    pub resident_bytes: u64,
    /// Bytes read from disk per decoded token (streamed units and one table row).
    pub streamed_per_token: u64,
    /// Peak memory the plan holds: resident weights, buffers, gathered rows and the KV cache.
    pub peak_bytes: u64,
}

impl BudgetPlan {
    /// Whether anything is streamed (with nothing streamed, the engine runs as without a budget).
    pub fn streams(&self) -> bool {
        self.buffers > 0 || self.embed == Placement::Streamed
    }
}

/// A budget no plan fits in.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error(
    "--ram-budget {} is too small for this model and context: the smallest that works is {} \
     (the KV cache of {} plus one stream buffer of {} and {} of weights that stay resident)",
    human(*budget), human(*min), human(*kv), human(*buffer), human(*fixed)
)]
pub struct TooSmall {
    pub budget: u64,
    pub min: u64,
    pub kv: u64,
    pub buffer: u64,
    pub fixed: u64,
}

fn round_up(bytes: u64) -> u64 {
    bytes.div_ceil(PAGE) * PAGE
}

/// Decides placements for `budget` bytes. Everything resident when it fits; else the token
/// table is gathered, and layers (then the head) stay resident, largest first, as far as the
/// budget allows beside two stream buffers (one, if two do not fit).
pub fn plan(f: &Footprint, budget: u64) -> Result<BudgetPlan, TooSmall> {
    let layer_sum: u64 = f.layers.iter().sum();
    let all = layer_sum + f.head + f.embed + f.fixed + f.kv;
    let everything = BudgetPlan {
        layers: vec![Placement::Resident; f.layers.len()],
        head: Placement::Resident,
        embed: Placement::Resident,
        buffers: 0,
        buffer_bytes: 0,
        gather_bytes: 0,
        resident_bytes: layer_sum + f.head + f.embed + f.fixed,
        streamed_per_token: 0,
        peak_bytes: all,
    };
    if all <= budget {
        return Ok(everything);
    }
    let gather = f.block_rows * (round_up(f.embed_row) + PAGE);
    // Without the table (when it is separate), the rest may fit with no stream buffer.
    if !f.tied && all - f.embed + gather <= budget {
        return Ok(BudgetPlan {
            embed: Placement::Streamed,
            gather_bytes: gather,
            resident_bytes: everything.resident_bytes - f.embed,
            streamed_per_token: f.embed_row,
            peak_bytes: all - f.embed + gather,
            ..everything
        });
    }
    let unit = round_up(f.layers.iter().copied().max().unwrap_or(0).max(f.head_chunk));
    let base = f.kv + f.fixed + gather;
    let too_small = TooSmall {
        budget,
        min: base + unit,
        kv: f.kv,
        buffer: unit,
        fixed: f.fixed + gather,
    };
    let buffers = if base + 2 * unit <= budget {
        2
    } else if base + unit <= budget {
        1
    } else {
        return Err(too_small);
    };
    let room = budget - base - buffers as u64 * unit;
    let kept = keep_most(&f.layers, f.head, room);
    let place = |i| {
        if kept.contains(&i) {
            Placement::Resident
        } else {
            Placement::Streamed
        }
    };
    let layers: Vec<Placement> = (0..f.layers.len()).map(place).collect();
    let head = place(usize::MAX);
    let kept_bytes: u64 = kept
        .iter()
        .map(|&i| if i == usize::MAX { f.head } else { f.layers[i] })
        .sum();
    let streamed: u64 = layer_sum + f.head - kept_bytes;
    // A table tied to a resident head is read in place; otherwise it is gathered.
    let embed = if f.tied && head == Placement::Resident {
        Placement::Resident
    } else {
        Placement::Streamed
    };
    let gather_bytes = if embed == Placement::Streamed { gather } else { 0 };
    Ok(BudgetPlan {
        layers,
        head,
        embed,
        buffers: if streamed > 0 { buffers } else { 0 },
        buffer_bytes: if streamed > 0 { unit } else { 0 },
        gather_bytes,
        resident_bytes: kept_bytes + f.fixed,
        streamed_per_token: streamed + if embed == Placement::Streamed { f.embed_row } else { 0 },
        peak_bytes: kept_bytes + f.fixed + f.kv + gather_bytes + if streamed > 0 { buffers as u64 * unit } else { 0 },
    })
}

/// The units (layer indices, `usize::MAX` for the head) that keep the most bytes resident
/// within `room`: layers largest first, once with the head kept and once without, whichever
/// keeps more (fewer bytes streamed per token). Keeping the head only when it pays makes the
/// resident bytes grow with the budget; largest-first alone would drop several layers for
/// the head the moment it fits.
fn keep_most(layers: &[u64], head: u64, room: u64) -> BTreeSet<usize> {
    let fill = |mut room: u64, mut kept: BTreeSet<usize>| {
        let mut order: Vec<usize> = (0..layers.len()).collect();
        order.sort_by(|&a, &b| layers[b].cmp(&layers[a]).then(a.cmp(&b)));
        let mut bytes = 0;
        for i in order {
            if layers[i] <= room {
                room -= layers[i];
                bytes += layers[i];
                kept.insert(i);
            }
        }
        (bytes, kept)
    };
    let (without, layers_only) = fill(room, BTreeSet::new());
    if head > room {
        return layers_only;
    }
    let (with, with_head) = fill(room - head, BTreeSet::from([usize::MAX]));
    if with + head > without { with_head } else { layers_only }
}

/// Rows of one streamed head chunk: as many as fit in the model's largest layer (at least 64,
/// a multiple of 64, at most the vocabulary), so streaming the head needs no larger buffer
/// than streaming a layer. A function of the spec alone: it is compiled into the head's chunk
/// kernels, so one library serves every budget.
pub fn head_chunk_rows(spec: &ModelSpec) -> Option<usize> {
    chunk_rows(spec, &units(spec))
}

fn chunk_rows(spec: &ModelSpec, u: &Units) -> Option<usize> {
    let t = spec.weight(u.head?);
    let row = t.row_bytes().max(1) as u64;
    let largest = u.layers.iter().copied().max().unwrap_or(0);
    let rows = ((largest / row) as usize / 64 * 64).max(64);
    Some(rows.min(t.shape[0]))
}

/// The output head's matrix: the weight of the head step that writes the logits.
pub fn head_weight(spec: &ModelSpec) -> Option<WeightId> {
    let logits = spec.buffer_named(graph::LOGITS)?;
    graph::head_graph(spec).steps.iter().find_map(|s| {
        let writes_logits = s.args.iter().any(|a| matches!(a, graph::Arg::Buf(b) if *b == logits));
        writes_logits
            .then(|| {
                s.args.iter().find_map(|a| match a {
                    graph::Arg::Weight(w) if spec.weight(w.id).shape.len() == 2 => Some(w.id),
                    _ => None,
                })
            })
            .flatten()
    })
}

/// The weights of each unit of `spec`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Units {
    /// Bytes per decoder layer.
    pub layers: Vec<u64>,
    /// Weights of each decoder layer.
    pub layer_weights: Vec<Vec<WeightId>>,
    /// The token table (the embedding step's first weight).
    pub table: Option<WeightId>,
    /// The head's matrix.
    pub head: Option<WeightId>,
    /// Weights in no unit: always resident.
    pub fixed: Vec<WeightId>,
}

/// Splits `spec`'s weights into units: a weight belongs to the layer its tensor names; of the
/// rest, the head's matrix and the token table are units of their own, and everything else is
/// fixed.
pub fn units(spec: &ModelSpec) -> Units {
    let mut u = Units {
        layers: vec![0; spec.num_layers()],
        layer_weights: vec![Vec::new(); spec.num_layers()],
        head: head_weight(spec),
        ..Units::default()
    };
    u.table = graph::block_graph(spec, 1).steps.iter().find_map(|s| match s.kernel {
        crate::Kernel::Embed { .. } => s.args.iter().find_map(|a| match a {
            graph::Arg::Weight(w) => Some(w.id),
            _ => None,
        }),
        _ => None,
    });
    for (id, t) in spec.weight_ids() {
        match t.layer {
            Some(l) if l < u.layers.len() && Some(id) != u.head && Some(id) != u.table => {
                u.layers[l] += t.bytes() as u64;
                u.layer_weights[l].push(id);
            }
            _ if Some(id) == u.head || Some(id) == u.table => {}
            _ => u.fixed.push(id),
        }
    }
    u
}

impl Footprint {
    /// The footprint of `spec` run with prefill blocks of `block_rows` rows, `slots` sequences
    /// of `ctx` positions.
    pub fn of(spec: &ModelSpec, block_rows: usize, ctx: usize, slots: usize) -> Footprint {
        let u = units(spec);
        let bytes = |id: Option<WeightId>| id.map_or(0, |w| spec.weight(w).bytes() as u64);
        let tied = u.table.is_some() && u.table == u.head;
        let head_chunk = match (u.head, chunk_rows(spec, &u)) {
            (Some(h), Some(rows)) => (rows * spec.weight(h).row_bytes()) as u64,
            _ => 0,
        };
        // Bytes of the buffers of kind `rows` (the caches for `ctx` positions: what the engine
        // touches of them).
        let sum = |rows: Rows| -> u64 {
            let n = rows.count(block_rows, ctx, slots);
            spec.buffers
                .iter()
                .filter(|b| b.rows == rows)
                .map(|b| (b.row_bytes() * n) as u64)
                .sum()
        };
        // Recurrent state is held like the KV cache, but its size does not grow with `ctx`.
        let kv = sum(Rows::Cache) + sum(Rows::State);
        Footprint {
            head: bytes(u.head),
            head_chunk,
            embed: if tied { 0 } else { bytes(u.table) },
            embed_row: u.table.map_or(0, |t| spec.weight(t).row_bytes() as u64),
            tied,
            fixed: u.fixed.iter().map(|&w| spec.weight(w).bytes() as u64).sum(),
            kv,
            block_rows: block_rows as u64,
            activations: sum(Rows::Block) + sum(Rows::Head),
            layers: u.layers,
        }
    }
}

/// Parses a size: bytes, or a number with `K`, `M`, `G` or `T` (powers of 1024; `KiB`, `MB`
/// and the like are read the same way), e.g. `512M`, `1.5G`, `2000000`.
pub fn parse_size(text: &str) -> Result<u64, String> {
    let bad =
        || format!("--ram-budget {text:?} is not a size: expected bytes or a number with K, M, G or T (e.g. 512M, 2G)");
    let t = text.trim();
    let split = t.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(t.len());
    let (number, unit) = t.split_at(split);
    let shift = match unit
        .trim()
        .to_ascii_uppercase()
        .trim_end_matches("IB")
        .trim_end_matches('B')
    {
        "" => 0,
        "K" => 10,
        "M" => 20,
        "G" => 30,
        "T" => 40,
        _ => return Err(bad()),
    };
    if number.is_empty() {
        return Err(bad());
    }
    let value: f64 = number.parse().map_err(|_| bad())?;
    let bytes = value * (1u64 << shift) as f64;
    if !bytes.is_finite() || bytes < 1.0 || bytes >= u64::MAX as f64 {
        return Err(bad());
    }
    Ok(bytes as u64)
}

/// Bytes of physical memory of this machine (0 where the system does not say).
pub fn physical_memory() -> u64 {
    // SAFETY: sysconf reads constants of the system; no memory is passed.
    let (pages, size) = unsafe { (libc::sysconf(libc::_SC_PHYS_PAGES), libc::sysconf(libc::_SC_PAGESIZE)) };
    if pages > 0 && size > 0 {
        pages as u64 * size as u64
    } else {
        0
    }
}

/// A byte count for people: `1.5 GiB`, `300.0 MiB`, `12 KiB`.
pub fn human(bytes: u64) -> String {
    const UNITS: [(&str, u64); 3] = [("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)];
    for (name, size) in UNITS {
        if bytes >= size {
            return format!("{:.1} {name}", bytes as f64 / size as f64);
        }
    }
    format!("{bytes} B")
}

#[cfg(test)]
#[path = "budget_tests.rs"]
mod tests;
