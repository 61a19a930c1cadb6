//! `kiln chat`: a multi-turn conversation over one KV cache, and the pieces `kiln run --chat`
//! shares with it (rendering one turn, end-of-turn ids, printing a reply with or without its
//! reasoning).
//!
//! Each turn the whole conversation is rendered through the model's chat template and encoded;
//! the engine keeps the longest prefix of those ids that it already holds and prefills only
//! the rest. The rendering is not always an extension of the previous one (ChatML writes a
//! newline after `<|im_end|>` that the model never generated, Qwen3 drops the reasoning of old
//! turns, a stop string cut the reply), which the comparison of token ids handles.
//!
//! Input is read with line editing and history (rustyline) when stdin is a terminal, and line
//! by line otherwise, so the REPL can be driven through a pipe. With `--json` every event is
//! one JSON object on stdout (a transcript for scripts and tests); otherwise replies stream to
//! stdout and notes go to stderr.
//!
//! Beside the REPL: `prompt` (a turn's template, rendering and end-of-turn ids), `show` (what
//! it prints beside replies: events, notes, statistics), `reply`
//! (printing a reply with its reasoning shown or hidden) and `input` (where lines come from).

mod input;
mod prompt;
mod reply;
mod show;

use input::{Input, Read};
pub use prompt::{ChatPrompt, chat_stop_ids, load_template, render_single, thinking_option};
pub use reply::{ReplyPrinter, stdout_styled};

use crate::interrupt::{self, OnInterrupt};
use crate::output::{WriteError, errln};
use crate::session::{BuildChoices, OpenOptions, PreparedModel, Session};
use anyhow::Result;
use kiln_engine::engine::{Engine, EngineError};
use kiln_text::chat_template::{ChatTemplate, DateTime, Message, RenderOptions};
use kiln_text::generate::{self, GenerateOptions, Generation, Model};
use kiln_text::sampler::{ResolvedSampling, Sampler, SamplingChoice, SamplingParams};
use kiln_text::tokenizer::Tokenizer;
use serde_json::json;
use std::io::{IsTerminal as _, Write};
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::time::Duration;

/// What printing a line to the user gives: only a failed write is an error.
type Shown = Result<(), WriteError>;

/// What `kiln chat` was asked for.
pub struct ChatArgs {
    /// Threads, prefill block, dequantisation and target CPU.
    pub build: BuildChoices,
    pub model: PathBuf,
    pub system: Option<String>,
    pub think: bool,
    /// Per reply; `None`: until the end of the turn or a full context.
    pub max_tokens: Option<usize>,
    /// The flags over Kiln's defaults (checked before the model is opened).
    pub sampling: SamplingParams,
    /// Which of the keys a model can set the user gave: the others come from the model's
    /// generation_config.json when it states them.
    pub sampling_flags: SamplingChoice,
    pub stop: Vec<String>,
    pub ctx: Option<usize>,
    pub json: bool,
    pub stats: bool,
    pub quiet: bool,
    /// Test hook: sleep this long before each decode step (to interrupt a reply reliably).
    pub decode_delay_ms: u64,
}

/// Runs the REPL until `/exit`, Ctrl-D or the end of the input.
pub fn chat(args: &ChatArgs) -> Result<()> {
    args.sampling.validate()?;
    let opts = OpenOptions {
        ctx: args.ctx,
        progress: !args.json && !args.quiet,
        page_in: true,
        ..args.build.open_options()
    };
    let prepared = PreparedModel::open(&args.model, &opts)?;
    let template = load_template(
        &prepared.tokenizer,
        &args.model,
        "kiln chat needs one: use `kiln run` with a raw prompt",
    )?;
    let sampling = SamplingChoice::resolve(&args.sampling_flags, &prepared.sampling, args.sampling);
    let session = prepared.into_session(&opts)?;
    let interactive = std::io::stdin().is_terminal();
    // At the prompt a terminal's Ctrl-C is a key for the line editor; a piped session ends.
    let idle = if interactive {
        OnInterrupt::Ignore
    } else {
        OnInterrupt::Exit
    };
    interrupt::set(idle);
    let mut chat = Chat::new(session, template, args, sampling, idle);
    let mut input = Input::new(interactive)?;
    chat.ready(&args.model)?;
    loop {
        match input.read()? {
            Read::Line(line) => {
                if chat.handle(&line)? == Flow::Exit {
                    break;
                }
            }
            Read::NotUtf8 => chat.error("the line is not UTF-8 text; it was skipped")?,
            Read::Interrupted => chat.note("(Ctrl-D or /exit quits)")?,
            Read::Eof => break,
        }
    }
    chat.event(json!({"event": "exit"}))?;
    Ok(())
}

#[derive(Debug, PartialEq, Eq)]
enum Flow {
    Continue,
    Exit,
}

const HELP: &str = "\
commands:
  /help          this list
  /reset         start a new conversation (the system prompt is kept)
  /system TEXT   set the system prompt (/system alone shows it)
  /drop [N]      forget the N oldest exchanges (default 1), to make room in the context
  /exit, /quit   leave (so does Ctrl-D)
Ctrl-C stops the reply being written. Start a message with // to send a line beginning with /.";

/// The engine, slowed down for tests that interrupt generation (`--debug-decode-delay-ms` of
/// `kiln chat` and `kiln run`).
pub(crate) struct Paced<'a> {
    pub engine: &'a mut Engine,
    /// Slept before each decode step.
    pub delay: Duration,
    /// Where to save a recurrent model's state while prefilling (`Engine::checkpoint`): the
    /// end of the conversation before the assistant header of the reply. The next turn renders
    /// the same tokens up to there, but maybe not after it (templates that drop earlier replies'
    /// reasoning, or render the header differently in history), and resumes from there
    /// instead of re-running the conversation (a recurrent state cannot be cut back).
    pub checkpoint_at: Option<usize>,
}

impl Model for Paced<'_> {
    fn prefill(&mut self, tokens: &[u32]) -> Result<&[f32], EngineError> {
        let pos = self.engine.position();
        match self.checkpoint_at {
            // Prefill in two parts is bitwise the same as in one.
            Some(at) if at > pos && at < pos + tokens.len() => {
                self.engine.prefill(&tokens[..at - pos])?;
                self.engine.checkpoint();
                self.engine.prefill(&tokens[at - pos..])
            }
            _ => self.engine.prefill(tokens),
        }
    }
    fn decode(&mut self, token: u32) -> Result<&[f32], EngineError> {
        if !self.delay.is_zero() {
            std::thread::sleep(self.delay);
        }
        self.engine.decode(token)
    }
    fn position(&self) -> usize {
        self.engine.position()
    }
    fn ctx(&self) -> usize {
        self.engine.ctx()
    }
}

/// The longest common prefix of `a` and `b` (also `kiln serve`'s, for slot reuse).
pub(crate) fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

/// How much of a rendered conversation (`ids`) must be prefilled when the KV cache holds
/// `cached`: returns the number of cached ids to keep. At least one id is always prefilled, as
/// the logits of the last one are needed.
fn reusable_prefix(cached: &[u32], ids: &[u32]) -> usize {
    common_prefix(cached, ids).min(ids.len().saturating_sub(1))
}

/// Drops the `n` oldest exchanges (a user message and what follows it up to the next one)
/// from `messages`; returns how many were dropped.
fn drop_oldest(messages: &mut Vec<Message>, n: usize) -> usize {
    let mut dropped = 0;
    while dropped < n && !messages.is_empty() {
        let end = messages
            .iter()
            .skip(1)
            .position(|m| m.role == "user")
            .map_or(messages.len(), |i| i + 1);
        messages.drain(..end);
        dropped += 1;
    }
    dropped
}

struct Chat {
    session: Session,
    template: ChatTemplate,
    render: RenderOptions,
    think: bool,
    system: Option<String>,
    /// The conversation without the system prompt.
    messages: Vec<Message>,
    /// The ids whose keys and values are in the KV cache (`engine.position()` of them).
    cached: Vec<u32>,
    sampler: Sampler,
    /// The sampling values used and where they came from.
    sampling: ResolvedSampling,
    options: GenerateOptions,
    /// A message that did not fit in the context, resent after `/drop` or `/reset`.
    pending: Option<String>,
    turns: usize,
    json: bool,
    stats: bool,
    quiet: bool,
    styled: bool,
    delay: Duration,
    /// What Ctrl-C does between replies.
    idle: OnInterrupt,
}

impl Chat {
    fn new(
        session: Session,
        template: ChatTemplate,
        args: &ChatArgs,
        sampling: ResolvedSampling,
        idle: OnInterrupt,
    ) -> Chat {
        let render = RenderOptions {
            add_generation_prompt: true,
            enable_thinking: thinking_option(&session.tokenizer, args.think),
            // Pinned, so that a date in the system header does not change under the cache.
            now: Some(DateTime::now()),
            ..RenderOptions::default()
        };
        let options = GenerateOptions {
            max_tokens: args.max_tokens.unwrap_or(usize::MAX),
            sampling: sampling.params,
            eos_token_ids: chat_stop_ids(&session.tokenizer, session.eos_token_ids()),
            show_special: false,
            stop: args.stop.clone(),
            cancel: Some(interrupt::cancel_flag()),
        };
        Chat {
            sampler: Sampler::new(sampling.params),
            sampling,
            session,
            template,
            render,
            think: args.think,
            system: args.system.clone(),
            messages: Vec::new(),
            cached: Vec::new(),
            options,
            pending: None,
            turns: 0,
            json: args.json,
            stats: args.stats,
            quiet: args.quiet,
            styled: !args.json && stdout_styled(),
            delay: Duration::from_millis(args.decode_delay_ms),
            idle,
        }
    }

    fn conversation(&self) -> Vec<Message> {
        self.system
            .iter()
            .map(Message::system)
            .chain(self.messages.iter().cloned())
            .collect()
    }

    /// Acts on one line of input; only a failed write to stdout or stderr is an error.
    fn handle(&mut self, line: &str) -> Result<Flow, WriteError> {
        if line.trim().is_empty() {
            return Ok(Flow::Continue);
        }
        if let Some(command) = line.strip_prefix('/')
            && !command.starts_with('/')
        {
            return self.command(command.trim());
        }
        let text = if line.starts_with("//") { &line[1..] } else { line };
        self.pending = None;
        self.turn(text)?;
        Ok(Flow::Continue)
    }

    fn command(&mut self, command: &str) -> Result<Flow, WriteError> {
        let (name, rest) = command
            .split_once(char::is_whitespace)
            .map_or((command, ""), |(n, r)| (n, r.trim()));
        match name {
            "help" | "?" => {
                if self.json {
                    self.event(json!({"event": "help", "text": HELP}))?;
                } else {
                    errln!("{HELP}")?;
                }
            }
            "exit" | "quit" => return Ok(Flow::Exit),
            "reset" => {
                self.messages.clear();
                self.cached.clear();
                self.session.engine.reset();
                self.event(json!({"event": "reset"}))?;
                if !self.json {
                    errln!("[new conversation]")?;
                }
                self.resend_pending()?;
            }
            "system" if rest.is_empty() => match &self.system {
                Some(s) => self.note(&format!("system prompt: {s}"))?,
                None => self.note("no system prompt (the template's default applies, if it has one)")?,
            },
            "system" => {
                self.system = Some(rest.to_string());
                self.event(json!({"event": "system", "text": rest}))?;
                if !self.json {
                    errln!("[system prompt set; it applies from the next reply]")?;
                }
            }
            "drop" => {
                let n = if rest.is_empty() { Ok(1) } else { rest.parse::<usize>() };
                match n {
                    Ok(n) if n > 0 => {
                        let dropped = drop_oldest(&mut self.messages, n);
                        let left = self.messages.iter().filter(|m| m.role == "user").count();
                        self.event(json!({"event": "dropped", "exchanges": dropped, "left": left}))?;
                        if !self.json {
                            errln!("[forgot {dropped} exchange(s); {left} left]")?;
                        }
                        self.resend_pending()?;
                    }
                    _ => self.error(&format!("/drop takes a positive number of exchanges, not {rest:?}"))?,
                }
            }
            _ => self.error(&format!("unknown command /{name}; /help lists them"))?,
        }
        Ok(Flow::Continue)
    }

    fn resend_pending(&mut self) -> Shown {
        if let Some(text) = self.pending.take() {
            if !self.json {
                errln!("[resending your message]")?;
            }
            self.turn(&text)?;
        }
        Ok(())
    }

    /// One exchange: the user's `text` and the model's reply.
    fn turn(&mut self, text: &str) -> Shown {
        self.messages.push(Message::user(text));
        let rendered = match self.template.render(&self.conversation(), &self.render) {
            Ok(r) => r,
            Err(e) => {
                self.messages.pop();
                return self.error(&format!("{e}; the message was not sent"));
            }
        };
        let tokenizer = self.session.tokenizer.clone();
        let ids = match tokenizer.encode(&rendered, false) {
            Ok(ids) => ids,
            Err(e) => {
                self.messages.pop();
                return self.error(&format!("{e}; the message was not sent"));
            }
        };
        let ctx = self.session.engine.ctx();
        if ids.len() >= ctx {
            self.messages.pop();
            return self.context_full(text, ids.len());
        }
        // A recurrent model may keep less than the shared prefix (its state cannot be cut back).
        let keep = self.session.engine.truncate(reusable_prefix(&self.cached, &ids));
        self.cached.truncate(keep);
        self.turns += 1;
        // From here a Ctrl-C stops the reply (and no longer ends a piped session).
        interrupt::set(OnInterrupt::Cancel);
        let started = self
            .event(json!({"event": "start", "turn": self.turns, "prompt_tokens": ids.len(), "reused_tokens": keep}));
        let result = started.and_then(|()| self.reply(&tokenizer, &ids, keep, &rendered));
        interrupt::set(self.idle);
        match result? {
            Ok(generation) => {
                let mut cached = ids;
                cached.extend_from_slice(&generation.token_ids);
                cached.truncate(self.session.engine.position());
                self.cached = cached;
                self.messages.push(Message::assistant(generation.text.clone()));
                self.report(&generation, keep)
            }
            Err(e) => {
                // What the KV cache holds is unknown: start the next turn from scratch.
                self.session.engine.reset();
                self.cached.clear();
                self.messages.pop();
                self.turns -= 1;
                self.error(&format!("{e}; the message was not answered"))
            }
        }
    }

    /// Generates the reply to `ids` (of which the KV cache holds the first `keep`), streaming
    /// it to stdout unless `--json`. A failed write stops generation and is the outer error.
    /// Where the conversation in `ids` ends before the reply's assistant header: where a
    /// recurrent model saves its state (see [`Paced::checkpoint_at`]). `None` for a model
    /// without recurrent state, or if the history alone does not render.
    fn history_end(&self, tokenizer: &Tokenizer, ids: &[u32]) -> Option<usize> {
        if !self.session.spec.is_recurrent() {
            return None;
        }
        let opts = RenderOptions {
            add_generation_prompt: false,
            ..self.render.clone()
        };
        let history = self.template.render(&self.conversation(), &opts).ok()?;
        let history_ids = tokenizer.encode(&history, false).ok()?;
        Some(common_prefix(&history_ids, ids))
    }

    fn reply(
        &mut self,
        tokenizer: &Tokenizer,
        ids: &[u32],
        keep: usize,
        rendered: &str,
    ) -> Result<Result<Generation, generate::GenerateError>, WriteError> {
        let checkpoint_at = self.history_end(tokenizer, ids);
        let mut printer = ReplyPrinter::new(self.think, generate::prompt_opens_thinking(rendered), self.styled);
        let json = self.json;
        let cancel = interrupt::cancel_flag();
        let mut failed = None;
        let mut on_text = |piece: &str| {
            if !json && failed.is_none() {
                failed = printer.push(piece, &mut std::io::stdout().lock()).err();
                if failed.is_some() {
                    cancel.store(true, Ordering::SeqCst);
                }
            }
        };
        let result = generate::generate_with(
            &mut Paced {
                engine: &mut self.session.engine,
                delay: self.delay,
                checkpoint_at,
            },
            tokenizer,
            &mut self.sampler,
            &ids[..keep],
            &ids[keep..],
            &self.options,
            &mut on_text,
        );
        if let Some(e) = failed {
            return Err(WriteError::stdout(e));
        }
        if !json {
            let mut out = std::io::stdout().lock();
            printer
                .finish(&mut out)
                .and_then(|()| writeln!(out))
                .and_then(|()| out.flush())
                .map_err(WriteError::stdout)?;
        }
        Ok(result)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reuse_stops_at_the_first_difference_and_keeps_one_to_prefill() {
        assert_eq!(reusable_prefix(&[], &[1, 2, 3]), 0);
        assert_eq!(reusable_prefix(&[1, 2, 9, 9], &[1, 2, 3]), 2);
        assert_eq!(reusable_prefix(&[1, 2, 3, 4], &[1, 2, 3]), 2);
        assert_eq!(reusable_prefix(&[1, 2], &[1, 2, 3, 4]), 2);
    }

    #[test]
    fn dropping_exchanges() {
        let mut m = vec![
            Message::user("a"),
            Message::assistant("A"),
            Message::user("b"),
            Message::assistant("B"),
            Message::user("c"),
        ];
        assert_eq!(drop_oldest(&mut m, 1), 1);
        assert_eq!(m[0].content, "b");
        assert_eq!(drop_oldest(&mut m, 5), 2);
        assert!(m.is_empty());
        assert_eq!(drop_oldest(&mut m, 1), 0);
    }
}
