//! Text generation: prefill the prompt, then sample and decode one token at a time, streaming
//! the text as it completes.

use crate::engine::{Engine, EngineError};
use crate::sampler::{Sampler, SamplingParams};
use crate::tokenizer::{Tokenizer, TokenizerError};
use std::time::Instant;

/// What to generate.
#[derive(Clone, Debug)]
pub struct GenerateOptions {
    /// Upper bound on generated tokens.
    pub max_tokens: usize,
    pub sampling: SamplingParams,
    /// Token ids that end generation (the EOS token is kept in `token_ids` but not printed).
    pub eos_token_ids: Vec<u32>,
    /// Print special tokens (other than the final EOS) in the streamed text.
    pub show_special: bool,
}

/// Why generation stopped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StopReason {
    Eos,
    MaxTokens,
    /// The KV cache is full.
    ContextFull,
}

impl StopReason {
    pub fn as_str(self) -> &'static str {
        match self {
            StopReason::Eos => "eos",
            StopReason::MaxTokens => "max_tokens",
            StopReason::ContextFull => "context_full",
        }
    }
}

/// The result of one generation.
#[derive(Clone, Debug)]
pub struct Generation {
    pub prompt_token_ids: Vec<u32>,
    /// Generated ids, including a final EOS if one was produced.
    pub token_ids: Vec<u32>,
    /// The streamed text (EOS and, unless asked, special tokens left out).
    pub text: String,
    pub stop: StopReason,
    pub prefill_seconds: f64,
    /// Time spent in decode steps (one per generated token after the first).
    pub decode_seconds: f64,
    pub decode_steps: usize,
    /// The sampler's seed, to reproduce the run.
    pub seed: u64,
}

impl Generation {
    pub fn prefill_tok_s(&self) -> f64 {
        rate(self.prompt_token_ids.len(), self.prefill_seconds)
    }
    pub fn decode_tok_s(&self) -> f64 {
        rate(self.decode_steps, self.decode_seconds)
    }
}

fn rate(n: usize, seconds: f64) -> f64 {
    if seconds > 0.0 { n as f64 / seconds } else { 0.0 }
}

#[derive(Debug, thiserror::Error)]
pub enum GenerateError {
    #[error(transparent)]
    Engine(#[from] EngineError),
    #[error(transparent)]
    Tokenizer(#[from] TokenizerError),
}

/// Generates from `prompt_ids`, starting at the engine's current position, calling `on_text`
/// with each completed piece of text.
pub fn generate(
    engine: &mut Engine,
    tokenizer: &Tokenizer,
    prompt_ids: &[u32],
    options: &GenerateOptions,
    on_text: &mut dyn FnMut(&str),
) -> Result<Generation, GenerateError> {
    let mut sampler = Sampler::new(options.sampling);
    let mut streamer = tokenizer.streamer(!options.show_special);
    let mut history: Vec<u32> = prompt_ids.to_vec();
    let mut generated = Vec::new();
    let mut text = String::new();

    let t0 = Instant::now();
    let mut logits = engine.prefill(prompt_ids)?;
    let prefill_seconds = t0.elapsed().as_secs_f64();

    let mut decode_seconds = 0.0;
    let mut decode_steps = 0;
    let mut stop = StopReason::MaxTokens;
    while generated.len() < options.max_tokens {
        let next = sampler.sample(logits, &history);
        generated.push(next);
        history.push(next);
        if options.eos_token_ids.contains(&next) {
            stop = StopReason::Eos;
            break;
        }
        if let Some(piece) = streamer.step(next)? {
            on_text(&piece);
            text.push_str(&piece);
        }
        if generated.len() == options.max_tokens {
            break;
        }
        if engine.position() >= engine.ctx() {
            stop = StopReason::ContextFull;
            break;
        }
        let t = Instant::now();
        logits = engine.decode(next)?;
        decode_seconds += t.elapsed().as_secs_f64();
        decode_steps += 1;
    }
    if let Some(piece) = streamer.finish()? {
        on_text(&piece);
        text.push_str(&piece);
    }
    Ok(Generation {
        prompt_token_ids: prompt_ids.to_vec(),
        token_ids: generated,
        text,
        stop,
        prefill_seconds,
        decode_seconds,
        decode_steps,
        seed: sampler.seed(),
    })
}
