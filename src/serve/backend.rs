//! The model side of `kiln serve`, as the HTTP layer sees it ([`kiln_server::Backend`]): a
//! request is rendered through the chat template, tokenised and checked on the caller's thread,
//! then queued for the engine thread ([`super::scheduler`]).

use super::scheduler::{Counters, Job};
use crate::chat::common_prefix;
use kiln_server::{Backend, BackendStats, GenEvent, GenRequest, Prompt, SamplingRequest, SubmitError};
use kiln_text::chat_template::{ChatTemplate, Message, RenderOptions};
use kiln_text::generate::prompt_opens_thinking;
use kiln_text::sampler::{SamplingChoice, SamplingParams};
use kiln_text::tokenizer::Tokenizer;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::Sender;
use std::sync::{Arc, Mutex};
use tokio::sync::mpsc::unbounded_channel;

/// What a request is checked and prepared with.
pub struct KilnBackend {
    pub model_id: String,
    pub ctx: usize,
    pub slots: usize,
    pub tokenizer: Tokenizer,
    pub template: Option<ChatTemplate>,
    /// The model's sampling defaults (generation_config.json over llama.cpp's), which request
    /// fields override key by key.
    pub sampling: SamplingParams,
    /// Requests waiting for a slot beyond which new ones are refused with 503.
    pub max_queue: usize,
    pub jobs: Mutex<Sender<Job>>,
    pub counters: Arc<Counters>,
    pub shutting_down: AtomicBool,
    /// The model has recurrent state (a chat prompt then saves it where the history ends).
    pub recurrent: bool,
}

impl KilnBackend {
    /// The model's defaults under the request's fields.
    fn sampling(&self, r: &SamplingRequest) -> Result<SamplingParams, SubmitError> {
        let choice = SamplingChoice {
            temperature: r.temperature,
            top_k: r.top_k.map(|k| k as usize),
            top_p: r.top_p,
            min_p: r.min_p,
            repetition_penalty: None,
        };
        let mut params = SamplingChoice::resolve(&choice, &SamplingChoice::default(), self.sampling).params;
        params.presence_penalty = r.presence_penalty.unwrap_or(0.0);
        params.frequency_penalty = r.frequency_penalty.unwrap_or(0.0);
        params.seed = r.seed;
        params.validate().map_err(|e| bad(e.to_string(), None))?;
        Ok(params)
    }

    /// The prompt's ids, whether it leaves the reply inside a `<think>` block, and, for a chat
    /// prompt to a recurrent model, where the conversation ends before the reply's assistant
    /// header: the next turn renders the same tokens up to there but not always after (Qwen3's
    /// template drops earlier replies' reasoning), so the state saved there is the one it can
    /// resume from.
    fn encode(&self, prompt: &Prompt, enable_thinking: Option<bool>) -> Result<Encoded, SubmitError> {
        let encode = |text: &str, special: bool| {
            self.tokenizer
                .encode(text, special)
                .map_err(|e| bad(format!("cannot tokenise the prompt: {e}"), None))
        };
        match prompt {
            Prompt::Text(text) => Ok((encode(text, true)?, false, None)),
            Prompt::Chat(messages) => {
                let template = self.template.as_ref().ok_or_else(|| {
                    bad(
                        "this model has no chat template: send a raw prompt to /v1/completions".into(),
                        Some("messages"),
                    )
                })?;
                let messages: Vec<Message> = messages.iter().map(|m| Message::new(&m.role, &m.content)).collect();
                let options = RenderOptions {
                    add_generation_prompt: true,
                    enable_thinking,
                    ..RenderOptions::default()
                };
                let text = template
                    .render(&messages, &options)
                    .map_err(|e| bad(format!("the chat template failed: {e}"), Some("messages")))?;
                let ids = encode(&text, false)?;
                let history_end = self.recurrent.then(|| {
                    let options = RenderOptions {
                        add_generation_prompt: false,
                        ..options
                    };
                    let history = template.render(&messages, &options).ok()?;
                    let history = self.tokenizer.encode(&history, false).ok()?;
                    Some(common_prefix(&history, &ids))
                });
                Ok((ids, prompt_opens_thinking(&text), history_end.flatten()))
            }
        }
    }
}

/// A prompt's ids, whether it opens a `<think>` block, where a recurrent state is saved.
type Encoded = (Vec<u32>, bool, Option<usize>);

fn bad(message: String, param: Option<&str>) -> SubmitError {
    SubmitError::BadRequest {
        message,
        param: param.map(str::to_owned),
    }
}

impl Backend for KilnBackend {
    fn model_id(&self) -> String {
        self.model_id.clone()
    }

    fn ctx(&self) -> usize {
        self.ctx
    }

    fn submit(&self, req: GenRequest) -> Result<tokio::sync::mpsc::UnboundedReceiver<GenEvent>, SubmitError> {
        if self.shutting_down.load(Ordering::Relaxed) {
            return Err(SubmitError::ShuttingDown);
        }
        let sampling = self.sampling(&req.sampling)?;
        let (prompt, starts_thinking, checkpoint_at) = self.encode(&req.prompt, req.enable_thinking)?;
        let checkpoint_at = checkpoint_at.filter(|&c| c > 0 && c < prompt.len());
        if prompt.is_empty() {
            return Err(bad("the prompt encodes to no tokens".into(), Some("prompt")));
        }
        // The prompt and at least one generated token must fit.
        if prompt.len() >= self.ctx {
            return Err(SubmitError::ContextExceeded {
                prompt_tokens: prompt.len(),
                ctx: self.ctx,
            });
        }
        let room = self.ctx - prompt.len();
        let max_tokens = req.max_tokens.map_or(room, |m| (m as usize).min(room));
        if self.counters.queue_depth.load(Ordering::Relaxed) >= self.max_queue {
            return Err(SubmitError::QueueFull { retry_after_s: 1 });
        }
        let (events, receiver) = unbounded_channel();
        if max_tokens == 0 {
            let _ = events.send(GenEvent::Finished {
                finish_reason: kiln_server::FinishReason::Length,
                usage: kiln_server::Usage {
                    prompt_tokens: prompt.len() as u32,
                    completion_tokens: 0,
                    cached_tokens: 0,
                },
            });
            return Ok(receiver);
        }
        self.counters.queue_depth.fetch_add(1, Ordering::Relaxed);
        let job = Job {
            prompt,
            max_tokens,
            sampling,
            stop: req.stop,
            starts_thinking,
            ignore_eos: req.ignore_eos,
            checkpoint_at,
            events,
        };
        let sent = self.jobs.lock().map(|jobs| jobs.send(job).is_ok()).unwrap_or(false);
        if !sent {
            return Err(SubmitError::ShuttingDown);
        }
        Ok(receiver)
    }

    fn stats(&self) -> BackendStats {
        let c = &self.counters;
        let rate = |a: &std::sync::atomic::AtomicU64| f64::from_bits(a.load(Ordering::Relaxed));
        BackendStats {
            queue_depth: c.queue_depth.load(Ordering::Relaxed),
            active_sequences: c.active.load(Ordering::Relaxed),
            slots: self.slots,
            prompt_tokens_total: c.prompt_tokens.load(Ordering::Relaxed),
            generated_tokens_total: c.generated_tokens.load(Ordering::Relaxed),
            prefill_tok_s: rate(&c.prefill_tok_s),
            decode_tok_s: rate(&c.decode_tok_s),
        }
    }
}
