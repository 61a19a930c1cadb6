//! Each architecture file on its published configurations: the dimensions, tensors and
//! operations it builds, and the one-line refusals of what it does not implement.

use crate::graph::tests::spec_of;
use crate::graph::{OpKind, block_graph};
use serde_json::{Value, json};

/// Published `config.json` files (the fields that matter), by model.
pub(crate) fn published_configs() -> Vec<(&'static str, Value)> {
    vec![
        (
            "Llama-3.2-1B",
            json!({
                "architectures": ["LlamaForCausalLM"], "attention_bias": false, "head_dim": 64,
                "hidden_act": "silu", "hidden_size": 2048, "intermediate_size": 8192,
                "max_position_embeddings": 131072, "mlp_bias": false, "num_attention_heads": 32,
                "num_hidden_layers": 16, "num_key_value_heads": 8, "rms_norm_eps": 1e-05,
                "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                                  "original_max_position_embeddings": 8192, "rope_type": "llama3"},
                "rope_theta": 500000.0, "tie_word_embeddings": true, "vocab_size": 128256
            }),
        ),
        (
            "Mistral-7B-v0.1",
            json!({
                "architectures": ["MistralForCausalLM"], "hidden_act": "silu", "hidden_size": 4096,
                "intermediate_size": 14336, "max_position_embeddings": 32768, "num_attention_heads": 32,
                "num_hidden_layers": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-05,
                "rope_theta": 10000.0, "sliding_window": 4096, "tie_word_embeddings": false,
                "vocab_size": 32000
            }),
        ),
        (
            "Qwen3-0.6B",
            json!({
                "architectures": ["Qwen3ForCausalLM"], "attention_bias": false, "head_dim": 128,
                "hidden_act": "silu", "hidden_size": 1024, "intermediate_size": 3072,
                "max_position_embeddings": 40960, "max_window_layers": 28, "num_attention_heads": 16,
                "num_hidden_layers": 28, "num_key_value_heads": 8, "rms_norm_eps": 1e-06,
                "rope_scaling": null, "rope_theta": 1000000, "sliding_window": null,
                "tie_word_embeddings": true, "use_sliding_window": false, "vocab_size": 151936
            }),
        ),
    ]
}

fn config(name: &str) -> Value {
    published_configs()
        .into_iter()
        .find(|(n, _)| *n == name)
        .map(|(_, c)| c)
        .unwrap()
}

#[test]
fn llama_3_2_1b() {
    let s = spec_of(config("Llama-3.2-1B"));
    assert_eq!(
        (s.dims.hidden_size, s.dims.head_dim, s.dims.num_kv_heads),
        (2048, 64, 8)
    );
    assert!(s.tied_embeddings());
    assert_eq!(s.rope.as_ref().unwrap().scaling.name(), "llama3");
    // 9 tensors per layer plus the embedding and the final norm (the head is the embedding).
    assert_eq!(s.weights.len(), 16 * 9 + 2);
    assert_eq!(s.param_count(), 1_235_814_400);
}

#[test]
fn mistral_7b_slides_every_layer() {
    let s = spec_of(config("Mistral-7B-v0.1"));
    assert!(s.attention_windows().iter().all(|&w| w == Some(4096)));
    assert!(!s.tied_embeddings());
    assert_eq!(s.param_count(), 7_241_732_096);
}

#[test]
fn qwen3_normalises_q_and_k_per_head() {
    let s = spec_of(config("Qwen3-0.6B"));
    let rope = block_graph(&s, 1)
        .steps
        .into_iter()
        .find(|st| st.kernel.family() == "rope_kv")
        .unwrap();
    assert!(matches!(
        rope.kernel,
        crate::Kernel::RopeKv {
            qk_norm: Some(_),
            head_dim: 128,
            ..
        }
    ));
    assert!(
        s.ops
            .iter()
            .all(|o| !matches!(o.kind, OpKind::Attention { window: Some(_), .. }))
    );
}
