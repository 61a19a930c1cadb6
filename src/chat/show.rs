//! What the chat shows the user beside the reply itself: JSON events (`--json`), notes and
//! errors, the ready line, the statistics after a turn (`--stats`), and the offer when the
//! conversation outgrows the context.

use super::{Chat, Shown};
use crate::output::{errln, outln};
use kiln_text::chat_template::Message;
use kiln_text::generate::{Generation, StopReason};
use serde_json::{Value, json};
use std::path::Path;

impl Chat {
    /// A JSON event on stdout (only with `--json`).
    pub(super) fn event(&self, value: Value) -> Shown {
        if self.json { outln!("{value}") } else { Ok(()) }
    }

    /// A note for the user: stderr, or a `note` event with `--json`.
    pub(super) fn note(&self, text: &str) -> Shown {
        if self.json {
            self.event(json!({"event": "note", "message": text}))
        } else {
            errln!("{text}")
        }
    }

    pub(super) fn error(&self, text: &str) -> Shown {
        if self.json {
            self.event(json!({"event": "error", "message": text}))
        } else {
            errln!("error: {text}")
        }
    }

    pub(super) fn ready(&self, model: &Path) -> Shown {
        let engine = &self.session.engine;
        self.event(json!({
            "event": "ready",
            "model": self.session.dir.display().to_string(),
            "ctx": engine.ctx(),
            "seed": self.sampler.seed(),
            "sampling": crate::commands::sampling_report(&self.sampling, self.sampler.seed()),
            "enable_thinking": self.render.enable_thinking,
            "cache_hit": self.session.library.cache_hit(),
            "compile_s": self.session.library.compile_seconds,
        }))?;
        if !self.json && !self.quiet {
            errln!(
                "kiln chat: {} ({} tokens of context). /help for commands, Ctrl-C stops a reply, Ctrl-D quits.",
                model.display(),
                engine.ctx()
            )?;
        }
        Ok(())
    }

    pub(super) fn report(&self, g: &Generation, reused: usize) -> Shown {
        let engine = &self.session.engine;
        let prompt_tokens = reused + g.prompt_token_ids.len();
        self.event(json!({
            "event": "turn",
            "turn": self.turns,
            "text": g.text,
            "token_ids": g.token_ids,
            "stop_reason": g.stop.as_str(),
            "stop_string": g.stop_string,
            "prompt_tokens": prompt_tokens,
            "reused_tokens": reused,
            "prefilled_tokens": g.prompt_token_ids.len(),
            "generated_tokens": g.token_ids.len(),
            "position": engine.position(),
            "ctx": engine.ctx(),
            "prefill_tok_s": g.prefill_tok_s(),
            "decode_tok_s": g.decode_tok_s(),
        }))?;
        if self.json {
            return Ok(());
        }
        match g.stop {
            StopReason::Cancelled => errln!("[stopped]")?,
            StopReason::ContextFull => errln!(
                "[the context is full ({} tokens): the reply was cut. /drop forgets the oldest exchange, /reset starts over]",
                engine.ctx()
            )?,
            _ => {}
        }
        if self.stats && !self.quiet {
            errln!(
                "[turn {}: {prompt_tokens}-token prompt, {reused} reused from the KV cache, {} prefilled; {} generated ({}); \
                 {:.1} tok/s prefill, {:.1} tok/s decode; context {}/{}]",
                self.turns,
                g.prompt_token_ids.len(),
                g.token_ids.len(),
                g.stop.as_str(),
                g.prefill_tok_s(),
                g.decode_tok_s(),
                engine.position(),
                engine.ctx(),
            )?;
        }
        Ok(())
    }

    /// The conversation plus `text` needs `tokens` positions, more than the context has.
    pub(super) fn context_full(&mut self, text: &str, tokens: usize) -> Shown {
        let ctx = self.session.engine.ctx();
        let limit = self.session.spec.dims.max_position_embeddings;
        let larger = if ctx < limit {
            format!(" or restart with a larger --ctx (this model allows up to {limit})")
        } else {
            String::new()
        };
        // Whether the message would fit in a new conversation (with the system prompt).
        let alone: Vec<Message> = self
            .system
            .iter()
            .map(Message::system)
            .chain([Message::user(text)])
            .collect();
        let fits_alone = self
            .template
            .render(&alone, &self.render)
            .ok()
            .and_then(|r| self.session.tokenizer.encode(&r, false).ok())
            .is_some_and(|ids| ids.len() < ctx);
        let (message, can_retry) = if !fits_alone {
            (
                format!(
                    "your message needs {tokens} tokens with the chat template, more than the context of {ctx}; shorten it{larger}"
                ),
                false,
            )
        } else {
            (
                format!(
                    "the conversation is full: with your message it needs {tokens} tokens and the context holds {ctx}. \
                     /drop forgets the oldest exchange and /reset starts over (either resends your message){}",
                    if larger.is_empty() {
                        String::new()
                    } else {
                        format!(";{larger}")
                    }
                ),
                true,
            )
        };
        self.pending = can_retry.then(|| text.to_string());
        self.event(json!({"event": "context_full", "tokens": tokens, "ctx": ctx, "message": message}))?;
        if !self.json {
            errln!("[{message}]")?;
        }
        Ok(())
    }
}
