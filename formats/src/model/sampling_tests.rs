//! The sampling defaults read from `generation_config.json` ([`ModelConfig::sampling`]): the
//! values a run uses when the user gives no flag for them.

use super::ModelConfig;
use kiln_text::sampler::SamplingChoice;
use std::path::Path;

const GEN: &str = "/m/generation_config.json";

fn config() -> ModelConfig {
    let text = r#"{"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "vocab_size": 256, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
        "hidden_act": "silu"}"#;
    ModelConfig::from_json(text, Path::new("/m/config.json")).unwrap()
}

fn sampling(generation_config: &str) -> Result<SamplingChoice, String> {
    let mut c = config();
    c.apply_generation_config(generation_config, Path::new(GEN))
        .map(|()| c.sampling)
        .map_err(|e| e.to_string())
}

#[test]
fn the_files_sampling_keys_are_read() {
    // Qwen2.5-0.5B-Instruct's file.
    let s = sampling(
        r#"{"bos_token_id": 151643, "do_sample": true, "eos_token_id": [151645, 151643],
            "pad_token_id": 151643, "repetition_penalty": 1.05, "temperature": 0.7,
            "top_p": 0.8, "top_k": 20, "transformers_version": "4.37.0"}"#,
    )
    .unwrap();
    assert_eq!(
        s,
        SamplingChoice {
            temperature: Some(0.7),
            top_k: Some(20),
            top_p: Some(0.8),
            min_p: None,
            repetition_penalty: Some(1.05),
        }
    );
    assert_eq!(sampling(r#"{"min_p": 0.1, "top_k": null}"#).unwrap().min_p, Some(0.1));
}

#[test]
fn a_file_with_only_token_ids_or_no_file_states_no_sampling() {
    assert!(
        sampling(r#"{"bos_token_id": 1, "eos_token_id": 2}"#)
            .unwrap()
            .is_empty()
    );
    assert!(config().sampling.is_empty());
}

#[test]
fn do_sample_false_means_greedy() {
    // transformers' generate decodes greedily then, whatever the temperature says.
    let s = sampling(r#"{"do_sample": false, "temperature": 0.6, "top_p": 0.9}"#).unwrap();
    assert_eq!(s.temperature, Some(0.0));
    assert_eq!(s.top_p, Some(0.9));
    assert_eq!(sampling(r#"{"do_sample": false}"#).unwrap().temperature, Some(0.0));
    // Only an explicit false: true, or no do_sample, leaves the temperature to the file.
    assert_eq!(sampling(r#"{"do_sample": true}"#).unwrap().temperature, None);
    assert_eq!(sampling(r#"{"temperature": 0.6}"#).unwrap().temperature, Some(0.6));
}

#[test]
fn malformed_values_are_one_line_naming_the_file_and_key() {
    for (text, expected) in [
        (
            r#"{"temperature": "hot"}"#,
            r#"field "temperature" must be a number, got "hot""#,
        ),
        (
            r#"{"top_p": 1.5}"#,
            r#"field "top_p" must be a number in (0, 1], got 1.5"#,
        ),
        (r#"{"top_p": 0}"#, r#"field "top_p" must be a number in (0, 1], got 0"#),
        (
            r#"{"temperature": -0.5}"#,
            r#"field "temperature" must be a finite number >= 0 (0 = greedy), got -0.5"#,
        ),
        (
            r#"{"top_k": -1}"#,
            r#"field "top_k" must be an integer >= 0 (0 = off), got -1"#,
        ),
        (
            r#"{"top_k": 2.5}"#,
            r#"field "top_k" must be an integer >= 0 (0 = off), got 2.5"#,
        ),
        (r#"{"min_p": [0.1]}"#, r#"field "min_p" must be a number, got a list"#),
        (
            r#"{"repetition_penalty": 0}"#,
            r#"field "repetition_penalty" must be a finite number > 0 (1 = off), got 0"#,
        ),
        (
            r#"{"do_sample": "no"}"#,
            r#"field "do_sample" must be true or false, got "no""#,
        ),
        // A malformed temperature is reported even when do_sample turns it off.
        (
            r#"{"do_sample": false, "temperature": "x"}"#,
            r#"field "temperature" must be a number, got "x""#,
        ),
    ] {
        let e = sampling(text).unwrap_err();
        assert_eq!(e, format!("{GEN}: {expected}"), "for {text}");
        assert_eq!(e.lines().count(), 1);
    }
}
