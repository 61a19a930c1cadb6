//! The planner's invariants: a plan never holds more than its budget, keeps everything when
//! everything fits, names the smallest budget that works when none does, and the sizes it is
//! given are those of the model's tensors.

use super::*;
use crate::graph::tests::spec_of;
use serde_json::json;

const MIB: u64 = 1 << 20;

/// 24 layers of 10 MiB, a separate 40 MiB table and 40 MiB head (chunks of 8 MiB), 1 MiB of
/// fixed weights and a 12 MiB KV cache.
fn untied() -> Footprint {
    Footprint {
        layers: vec![10 * MIB; 24],
        head: 40 * MIB,
        head_chunk: 8 * MIB,
        embed: 40 * MIB,
        embed_row: 1792,
        tied: false,
        fixed: MIB,
        kv: 12 * MIB,
        block_rows: 64,
        activations: 3 * MIB,
    }
}

fn tied() -> Footprint {
    Footprint {
        embed: 0,
        tied: true,
        ..untied()
    }
}

/// With room for everything, nothing streams and the plan holds exactly the model plus its KV.
#[test]
fn everything_resident_when_it_fits() {
    let f = untied();
    let total = 240 * MIB + 80 * MIB + MIB + 12 * MIB;
    let p = plan(&f, total).unwrap();
    assert!(!p.streams());
    assert!(p.layers.iter().all(|&l| l == Placement::Resident));
    assert_eq!(
        (p.head, p.embed, p.buffers),
        (Placement::Resident, Placement::Resident, 0)
    );
    assert_eq!(p.peak_bytes, total);
    assert_eq!(p.streamed_per_token, 0);
}

/// A separate token table is the first thing to go: gathering costs one row per token.
#[test]
fn a_separate_table_is_gathered_first() {
    let f = untied();
    let total = 240 * MIB + 80 * MIB + MIB + 12 * MIB;
    let p = plan(&f, total - 30 * MIB).unwrap();
    assert_eq!(p.embed, Placement::Streamed);
    assert_eq!(p.buffers, 0);
    assert!(p.layers.iter().all(|&l| l == Placement::Resident));
    assert_eq!(p.streamed_per_token, 1792);
    assert!(p.peak_bytes <= total - 30 * MIB);
}

/// At every budget from the smallest that works to the whole model, the plan's peak stays
/// within the budget, what it streams plus what it keeps is the whole model, and more budget
/// never streams more.
#[test]
fn peak_never_exceeds_the_budget() {
    for f in [untied(), tied()] {
        let model: u64 = f.layers.iter().sum::<u64>() + f.head + f.embed + f.fixed;
        let min = plan(&f, 1).unwrap_err().min;
        let mut last_streamed = u64::MAX;
        let mut budget = min;
        while budget <= model + f.kv + MIB {
            let p = plan(&f, budget).unwrap();
            assert!(p.peak_bytes <= budget, "budget {budget}: peak {}", p.peak_bytes);
            let table_row = if p.embed == Placement::Streamed { f.embed_row } else { 0 };
            let table_kept = if p.embed == Placement::Resident { f.embed } else { 0 };
            assert_eq!(
                p.resident_bytes + p.streamed_per_token - table_row + f.embed - table_kept,
                model
            );
            assert!(p.streamed_per_token <= last_streamed, "budget {budget}");
            last_streamed = p.streamed_per_token;
            budget += 3 * MIB + 17;
        }
    }
}

/// With equal layers (every dense model) the plan keeps the most bytes the room allows: the
/// head only when it beats the layers it displaces. Checked against all choices for heads
/// smaller, equal and larger than a layer and rooms around every multiple of them.
#[test]
fn keeps_the_most_bytes_the_room_allows() {
    let layer = 10 * MIB;
    for head in [7 * MIB, 10 * MIB, 35 * MIB, 136 * MIB] {
        let layers = vec![layer; 24];
        for room in (0..300 * MIB).step_by(MIB as usize / 2) {
            let kept = keep_most(&layers, head, room);
            let bytes: u64 = kept.iter().map(|&i| if i == usize::MAX { head } else { layer }).sum();
            let best_without = (room / layer).min(24) * layer;
            let best_with = if head <= room {
                head + ((room - head) / layer).min(24) * layer
            } else {
                0
            };
            assert!(bytes <= room, "head {head} room {room}");
            assert_eq!(bytes, best_without.max(best_with), "head {head} room {room}");
        }
    }
}

/// One byte below the smallest budget is refused with that smallest budget; at it, the plan
/// streams everything through one buffer of the largest unit.
#[test]
fn the_smallest_budget_is_named_and_works() {
    let f = untied();
    let err = plan(&f, 20 * MIB).unwrap_err();
    let gather = 64 * (PAGE + PAGE);
    assert_eq!(err.min, 12 * MIB + MIB + gather + 10 * MIB);
    assert!(err.to_string().contains("smallest that works is"), "{err}");
    assert_eq!(
        plan(&f, err.min - 1).unwrap_err(),
        TooSmall {
            budget: err.min - 1,
            ..err.clone()
        }
    );
    let p = plan(&f, err.min).unwrap();
    assert_eq!(p.buffers, 1);
    assert!(p.layers.iter().all(|&l| l == Placement::Streamed));
    assert_eq!(p.head, Placement::Streamed);
    // Two buffers as soon as they fit, so reading overlaps computing.
    assert_eq!(plan(&f, err.min + 10 * MIB).unwrap().buffers, 2);
}

/// A tied table is read in place while the head stays, and gathered once the head streams.
#[test]
fn a_tied_table_follows_the_head() {
    let f = tied();
    let big = plan(&f, 300 * MIB).unwrap();
    assert_eq!((big.head, big.embed), (Placement::Resident, Placement::Resident));
    let small = plan(&f, 60 * MIB).unwrap();
    assert_eq!((small.head, small.embed), (Placement::Streamed, Placement::Streamed));
}

/// Qwen2.5-0.5B's published shape (tied, bf16).
fn qwen2_5_0_5b() -> crate::ModelSpec {
    spec_of(json!({
        "architectures": ["Qwen2ForCausalLM"], "hidden_size": 896, "intermediate_size": 4864,
        "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
        "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
        "tie_word_embeddings": true, "vocab_size": 151936, "torch_dtype": "bfloat16"
    }))
}

/// On Qwen2.5-0.5B's shape (tied, bf16): 24 equal layers holding every layer tensor, the
/// head chunk within a layer's size and a multiple of 64 rows, and the KV cache of `ctx`
/// positions of 2 KV heads of 64, K and V, f32.
#[test]
fn footprint_of_a_real_shape() {
    let spec = qwen2_5_0_5b();
    let f = Footprint::of(&spec, 64, 512, 1);
    assert_eq!(f.layers.len(), 24);
    assert!(f.layers.iter().all(|&l| l == f.layers[0]));
    let per_layer: u64 = spec
        .weight_ids()
        .filter(|(_, t)| t.layer == Some(0))
        .map(|(_, t)| t.bytes() as u64)
        .sum();
    assert_eq!(f.layers[0], per_layer);
    assert!(f.tied);
    assert_eq!(
        f.head,
        (151936 * 896 * spec.weight(head_weight(&spec).unwrap()).dtype.size()) as u64
    );
    let rows = head_chunk_rows(&spec).unwrap();
    assert!(rows.is_multiple_of(64) && f.head_chunk <= f.layers[0] && f.head_chunk + 64 * 896 * 4 > f.layers[0] / 2);
    assert_eq!(f.kv, 24 * 2 * 2 * 64 * 512 * 4);
}

/// The logits are sized for the rows the head computes at once, not for the block: growing
/// the block from 8 to 256 rows adds 248 rows of every block buffer and none of logits.
#[test]
fn logits_do_not_grow_with_the_block() {
    let spec = qwen2_5_0_5b();
    let logits = spec.buffer(spec.buffer_named(crate::graph::LOGITS).unwrap());
    assert_eq!(logits.rows, Rows::Head);
    let block_row: u64 = spec
        .buffers
        .iter()
        .filter(|b| b.rows == Rows::Block)
        .map(|b| b.row_bytes() as u64)
        .sum();
    let logits_bytes = (crate::kernel::DECODE_ROWS * logits.row_bytes()) as u64;
    let (small, large) = (Footprint::of(&spec, 8, 512, 1), Footprint::of(&spec, 256, 512, 1));
    assert_eq!(small.activations, 8 * block_row + logits_bytes);
    assert_eq!(large.activations, 256 * block_row + logits_bytes);
    assert_eq!(
        Footprint::of(&spec, 1, 512, 1).activations,
        block_row + logits.row_bytes() as u64
    );
}

/// Sizes parse in bytes or with binary units; anything else is an error naming the text.
#[test]
fn sizes_parse() {
    assert_eq!(parse_size("512M"), Ok(512 * MIB));
    assert_eq!(parse_size("2G"), Ok(2 << 30));
    assert_eq!(parse_size("1.5g"), Ok(3 << 29));
    assert_eq!(parse_size("2GiB"), Ok(2 << 30));
    assert_eq!(parse_size("300MB"), Ok(300 * MIB));
    assert_eq!(parse_size("123456"), Ok(123456));
    for bad in ["", "G", "12X", "-1G", "1.2.3M", "0", "abc"] {
        let e = parse_size(bad).unwrap_err();
        assert!(e.contains(&format!("{bad:?}")), "{e}");
    }
}
