//! Text generation: prefill the prompt, then sample and decode one token at a time, streaming
//! the text as it completes.
//!
//! [`generate`] is the one-shot form (`kiln run`): a fresh sampler, nothing in the KV cache
//! before the prompt. [`generate_with`] is the form a conversation uses: the caller keeps one
//! [`Sampler`] for the whole session (so a seed reproduces the whole transcript) and passes the
//! tokens already in the KV cache as `context`, which the penalties see as history.
//!
//! Besides EOS and `max_tokens`, generation stops at a stop string ([`GenerateOptions::stop`]:
//! text that could be the start of one is held back, the stop string itself is never passed to
//! `on_text` nor kept in [`Generation::text`]), when [`GenerateOptions::cancel`] is set (checked
//! before every token, e.g. by a Ctrl-C handler), or when the KV cache is full.
//!
//! The last sampled token is *not* fed through the model: after a generation the KV cache holds
//! the prompt and every generated token but the last one (`model.position()` tells exactly).
//! [`ThinkFilter`] splits streamed text into reasoning (`<think>...</think>`) and answer.

use crate::sampler::{Sampler, SamplingParams};
use crate::tokenizer::{Tokenizer, TokenizerError};
use kiln_engine::engine::{Engine, EngineError};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

mod stop;
#[cfg(test)]
mod tests;
pub mod think;

pub use stop::StopStrings;
pub use think::{Part, ThinkFilter, prompt_opens_thinking, split_thinking};

/// What [`generate`] drives: a model with a KV cache that continues at its current position.
/// [`Engine`] is the real one; tests use scripted ones.
pub trait Model {
    /// Runs `tokens` at the current position and returns the logits after the last one.
    fn prefill(&mut self, tokens: &[u32]) -> Result<&[f32], EngineError>;
    /// Feeds one token and returns the logits for the next.
    fn decode(&mut self, token: u32) -> Result<&[f32], EngineError>;
    /// Tokens in the KV cache.
    fn position(&self) -> usize;
    /// Capacity of the KV cache in tokens.
    fn ctx(&self) -> usize;
}

impl Model for Engine {
    fn prefill(&mut self, tokens: &[u32]) -> Result<&[f32], EngineError> {
        Engine::prefill(self, tokens)
    }
    fn decode(&mut self, token: u32) -> Result<&[f32], EngineError> {
        Engine::decode(self, token)
    }
    fn position(&self) -> usize {
        Engine::position(self)
    }
    fn ctx(&self) -> usize {
        Engine::ctx(self)
    }
}

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
    /// Generation ends where one of these strings appears in the text; the stop string is not
    /// printed. Empty strings are ignored.
    pub stop: Vec<String>,
    /// Generation ends (with [`StopReason::Cancelled`]) once this is set; checked before each
    /// token is sampled.
    pub cancel: Option<Arc<AtomicBool>>,
}

impl Default for GenerateOptions {
    fn default() -> Self {
        GenerateOptions {
            max_tokens: 256,
            sampling: SamplingParams::default(),
            eos_token_ids: Vec::new(),
            show_special: false,
            stop: Vec::new(),
            cancel: None,
        }
    }
}

/// Why generation stopped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StopReason {
    Eos,
    MaxTokens,
    /// The KV cache is full.
    ContextFull,
    /// A stop string appeared in the text.
    StopString,
    /// [`GenerateOptions::cancel`] was set.
    Cancelled,
}

impl StopReason {
    pub fn as_str(self) -> &'static str {
        match self {
            StopReason::Eos => "eos",
            StopReason::MaxTokens => "max_tokens",
            StopReason::ContextFull => "context_full",
            StopReason::StopString => "stop",
            StopReason::Cancelled => "cancelled",
        }
    }
}

/// The result of one generation.
#[derive(Clone, Debug)]
pub struct Generation {
    /// The ids prefilled (the prompt, or the part of it that was not in the KV cache).
    pub prompt_token_ids: Vec<u32>,
    /// Generated ids, including a final EOS if one was produced, and the tokens of a stop
    /// string.
    pub token_ids: Vec<u32>,
    /// The streamed text (EOS and, unless asked, special tokens left out), cut before a stop
    /// string.
    pub text: String,
    pub stop: StopReason,
    /// The stop string that ended generation, when `stop` is [`StopReason::StopString`].
    pub stop_string: Option<String>,
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

/// Generates from `prompt_ids`, starting at the model's current position, with a sampler made
/// from `options.sampling`, calling `on_text` with each completed piece of text.
pub fn generate<M: Model + ?Sized>(
    model: &mut M,
    tokenizer: &Tokenizer,
    prompt_ids: &[u32],
    options: &GenerateOptions,
    on_text: &mut dyn FnMut(&str),
) -> Result<Generation, GenerateError> {
    let mut sampler = Sampler::new(options.sampling);
    generate_with(model, tokenizer, &mut sampler, &[], prompt_ids, options, on_text)
}

/// Like [`generate`], with the caller's `sampler` (its parameters are used, not
/// `options.sampling`) and `context`: the ids already in the KV cache before `prompt_ids`,
/// which the penalties count as history. Only `prompt_ids` is prefilled.
pub fn generate_with<M: Model + ?Sized>(
    model: &mut M,
    tokenizer: &Tokenizer,
    sampler: &mut Sampler,
    context: &[u32],
    prompt_ids: &[u32],
    options: &GenerateOptions,
    on_text: &mut dyn FnMut(&str),
) -> Result<Generation, GenerateError> {
    let mut streamer = tokenizer.streamer(!options.show_special);
    let mut stops = StopStrings::new(&options.stop);
    let mut history: Vec<u32> = Vec::with_capacity(context.len() + prompt_ids.len() + options.max_tokens.min(4096));
    history.extend_from_slice(context);
    history.extend_from_slice(prompt_ids);
    let mut generated = Vec::new();
    let cancelled = || options.cancel.as_ref().is_some_and(|c| c.load(Ordering::Relaxed));

    let t0 = Instant::now();
    let mut logits = model.prefill(prompt_ids)?;
    let prefill_seconds = t0.elapsed().as_secs_f64();

    let mut decode_seconds = 0.0;
    let mut decode_steps = 0;
    let mut stop = StopReason::MaxTokens;
    while generated.len() < options.max_tokens {
        if cancelled() {
            stop = StopReason::Cancelled;
            break;
        }
        let next = sampler.sample(logits, &history);
        generated.push(next);
        history.push(next);
        if options.eos_token_ids.contains(&next) {
            stop = StopReason::Eos;
            break;
        }
        if let Some(piece) = streamer.step(next)?
            && stops.push(&piece, on_text)
        {
            stop = StopReason::StopString;
            break;
        }
        if generated.len() == options.max_tokens {
            break;
        }
        if model.position() >= model.ctx() {
            stop = StopReason::ContextFull;
            break;
        }
        if cancelled() {
            stop = StopReason::Cancelled;
            break;
        }
        let t = Instant::now();
        logits = model.decode(next)?;
        decode_seconds += t.elapsed().as_secs_f64();
        decode_steps += 1;
    }
    if stop != StopReason::StopString
        && let Some(piece) = streamer.finish()?
        && stops.push(&piece, on_text)
    {
        stop = StopReason::StopString;
    }
    stops.finish(on_text);
    let stop_string = stops.matched().map(str::to_owned);
    Ok(Generation {
        prompt_token_ids: prompt_ids.to_vec(),
        token_ids: generated,
        text: stops.into_text(),
        stop,
        stop_string,
        prefill_seconds,
        decode_seconds,
        decode_steps,
        seed: sampler.seed(),
    })
}
