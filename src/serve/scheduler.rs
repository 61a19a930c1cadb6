//! The engine thread of `kiln serve`: continuous batching over the engine's KV slots.
//!
//! Each loop turn takes new requests off the channel, frees the slots of requests whose client
//! went away, gives queued requests free slots, prefills one chunk of one waiting prompt, and
//! runs one decode step for every sequence that has a token to feed, as one batched call (one
//! read of the weights for all of them). A long prompt is prefilled a chunk per turn, so the
//! sequences already decoding wait at most one chunk for their next token.
//!
//! A slot keeps the ids its KV cache holds after its request ends. A new request takes the free
//! slot whose cache shares the longest prefix with its prompt and prefills only the rest (the
//! multi-turn case: the next turn's prompt starts with the previous one and its reply).
//!
//! With temperature 0 a request's tokens do not depend on what else runs: a row's logits in a
//! batched step are bitwise those of a step of its sequence alone (see
//! `Engine::decode_batch`), and each request has its own sampler and seed.

use crate::chat::common_prefix;
use kiln_engine::engine::{Engine, StepPart};
use kiln_server::{FinishReason, GenEvent, Usage};
use kiln_text::generate::{Part, StopStrings, ThinkFilter};
use kiln_text::sampler::{Sampler, SamplingParams};
use kiln_text::tokenizer::{TextStreamer, Tokenizer};
use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{Receiver, TryRecvError};
use std::time::{Duration, Instant};
use tokio::sync::mpsc::UnboundedSender;

/// One request, tokenised and checked, waiting for a slot.
pub struct Job {
    pub prompt: Vec<u32>,
    pub max_tokens: usize,
    pub sampling: SamplingParams,
    pub stop: Vec<String>,
    /// The rendered prompt leaves the reply inside a `<think>` block.
    pub starts_thinking: bool,
    /// Generate `max_tokens` whatever is sampled (EOS included), for benchmarks.
    pub ignore_eos: bool,
    /// Where a recurrent model's state is saved while the prompt is prefilled
    /// (`Engine::checkpoint_in`): a later request sharing the prompt up to there resumes from
    /// it, where a state that cannot be cut back would otherwise run its whole prompt again.
    pub checkpoint_at: Option<usize>,
    pub events: UnboundedSender<GenEvent>,
}

/// Counters the HTTP side reads for `/metrics` (updated by the engine thread).
#[derive(Default)]
pub struct Counters {
    pub queue_depth: AtomicUsize,
    pub active: AtomicUsize,
    pub prompt_tokens: AtomicU64,
    pub generated_tokens: AtomicU64,
    /// f64 bits: tokens per second of the last prefill chunk and of the last decode step
    /// (all rows of the step counted).
    pub prefill_tok_s: AtomicU64,
    pub decode_tok_s: AtomicU64,
}

/// What does not change between requests.
pub struct SchedulerConfig {
    /// Ids that end a reply.
    pub eos: Vec<u32>,
    /// Prompt tokens prefilled per loop turn.
    pub prefill_chunk: usize,
    /// Test hook: sleep this long before each decode step.
    pub decode_delay: Duration,
}

/// A request being served in a slot.
struct Active {
    job: Job,
    /// Admission order: prompts are prefilled oldest first.
    order: u64,
    /// Prompt tokens in the slot's cache (reused ones included).
    prefilled: usize,
    cached_tokens: usize,
    sampler: Sampler,
    streamer: TextStreamer,
    stops: StopStrings,
    think: ThinkFilter,
    /// Prompt and generated ids: what the penalties see.
    history: Vec<u32>,
    generated: usize,
    /// The last sampled token, to feed at the next decode step.
    next: Option<u32>,
}

#[derive(Default)]
struct Slot {
    /// Ids whose keys and values the slot's cache holds, in order.
    cached: Vec<u32>,
    active: Option<Active>,
}

/// Runs until the job channel closes (the server is gone) and every admitted request ended.
pub fn run(
    engine: &mut Engine,
    tokenizer: &Tokenizer,
    jobs: Receiver<Job>,
    counters: &Counters,
    cfg: &SchedulerConfig,
) {
    let mut slots: Vec<Slot> = (0..engine.slots()).map(|_| Slot::default()).collect();
    let mut queue: VecDeque<Job> = VecDeque::new();
    let mut open = true;
    let mut admitted = 0u64;
    loop {
        let idle = queue.is_empty() && slots.iter().all(|s| s.active.is_none());
        if idle {
            if !open {
                return;
            }
            match jobs.recv() {
                Ok(job) => queue.push_back(job),
                Err(_) => return,
            }
        }
        while open {
            match jobs.try_recv() {
                Ok(job) => queue.push_back(job),
                Err(TryRecvError::Empty) => break,
                Err(TryRecvError::Disconnected) => open = false,
            }
        }
        queue.retain(|j| !j.events.is_closed());
        for slot in &mut slots {
            if slot.active.as_ref().is_some_and(|a| a.job.events.is_closed()) {
                slot.active = None;
            }
        }
        admit(engine, tokenizer, &mut slots, &mut queue, &mut admitted);
        publish(counters, &queue, &slots);
        step(engine, &mut slots, counters, cfg);
        publish(counters, &queue, &slots);
    }
}

/// The queue depth and the batch size, for `/metrics` and the queue limit.
fn publish(counters: &Counters, queue: &VecDeque<Job>, slots: &[Slot]) {
    counters.queue_depth.store(queue.len(), Ordering::Relaxed);
    let active = slots.iter().filter(|s| s.active.is_some()).count();
    counters.active.store(active, Ordering::Relaxed);
}

/// Gives each queued job (oldest first) a free slot: the one whose cache shares the longest
/// prefix with its prompt; among equals, the one holding least (the others keep their
/// conversations for later turns).
fn admit(
    engine: &mut Engine,
    tokenizer: &Tokenizer,
    slots: &mut [Slot],
    queue: &mut VecDeque<Job>,
    admitted: &mut u64,
) {
    while !queue.is_empty() {
        let best = slots
            .iter()
            .enumerate()
            .filter(|(_, s)| s.active.is_none())
            .map(|(i, s)| (i, common_prefix(&s.cached, &queue[0].prompt), s.cached.len()))
            .max_by(|a, b| a.1.cmp(&b.1).then(b.2.cmp(&a.2)));
        let Some((i, shared, _)) = best else {
            return;
        };
        let job = queue.pop_front().expect("queue is not empty");
        // At least one prompt token is run, for the logits of the first reply token.
        // A recurrent model may keep less (its state cannot be cut back to a shorter prefix).
        let reuse = engine.truncate_in(i, shared.min(job.prompt.len() - 1));
        slots[i].cached.truncate(reuse);
        *admitted += 1;
        slots[i].active = Some(Active {
            order: *admitted,
            prefilled: reuse,
            cached_tokens: reuse,
            sampler: Sampler::new(job.sampling),
            streamer: tokenizer.streamer(true),
            stops: StopStrings::new(&job.stop),
            think: ThinkFilter::new(job.starts_thinking),
            history: job.prompt.clone(),
            generated: 0,
            next: None,
            job,
        });
    }
}

/// What one slot contributes to a step.
enum Work {
    /// Its last sampled token.
    Decode(u32),
    /// Prompt tokens `start..end`.
    Prefill { start: usize, end: usize },
}

/// One forward step over every active sequence: the last sampled token of each one decoding,
/// then prompt chunks, oldest request first, up to `cfg.prefill_chunk` rows in all (several
/// short prompts at once, or a block of a long one). Decoding sequences ride in the same
/// forward pass as the prompts, so a prompt never costs them a step of its own.
fn step(engine: &mut Engine, slots: &mut [Slot], counters: &Counters, cfg: &SchedulerConfig) {
    let mut plan: Vec<(usize, Work)> = slots
        .iter()
        .enumerate()
        .filter_map(|(i, s)| Some((i, Work::Decode(s.active.as_ref()?.next?))))
        .collect();
    let decoding = plan.len();
    let mut budget = cfg.prefill_chunk.saturating_sub(decoding);
    let mut waiting: Vec<(u64, usize)> = slots
        .iter()
        .enumerate()
        .filter_map(|(i, s)| {
            let a = s.active.as_ref()?;
            (a.prefilled < a.job.prompt.len()).then_some((a.order, i))
        })
        .collect();
    waiting.sort_unstable();
    for (_, i) in waiting {
        if budget == 0 {
            break;
        }
        let a = slots[i].active.as_ref().expect("an active slot");
        let mut end = (a.prefilled + budget).min(a.job.prompt.len());
        // A chunk stops where the state is to be saved (moving the delta rule's chunk
        // boundaries there changes the logits only to rounding).
        if let Some(c) = a.job.checkpoint_at.filter(|&c| a.prefilled < c && c < end) {
            end = c;
        }
        budget -= end - a.prefilled;
        plan.push((
            i,
            Work::Prefill {
                start: a.prefilled,
                end,
            },
        ));
    }
    if plan.is_empty() {
        return;
    }
    if decoding > 0 && !cfg.decode_delay.is_zero() {
        std::thread::sleep(cfg.decode_delay);
    }
    let ctx = engine.ctx();
    // Whether each sequence's cache can take the token sampled after this step.
    let room: Vec<bool> = plan
        .iter()
        .map(|(i, w)| match w {
            Work::Decode(_) => engine.position_in(*i) + 1 < ctx,
            Work::Prefill { end, .. } => *end < ctx,
        })
        .collect();
    let singles: Vec<[u32; 1]> = plan
        .iter()
        .map(|(_, w)| match w {
            Work::Decode(t) => [*t],
            Work::Prefill { .. } => [0],
        })
        .collect();
    let parts: Vec<StepPart> = plan
        .iter()
        .zip(&singles)
        .map(|((i, w), single)| {
            let a = slots[*i].active.as_ref().expect("an active slot");
            match *w {
                Work::Decode(_) => StepPart {
                    slot: *i,
                    tokens: single,
                    seq_end: engine.position_in(*i) + 1,
                    logits: true,
                },
                Work::Prefill { start, end } => StepPart {
                    slot: *i,
                    tokens: &a.job.prompt[start..end],
                    seq_end: a.job.prompt.len(),
                    logits: end == a.job.prompt.len(),
                },
            }
        })
        .collect();
    let vocab = engine.spec().dims.vocab_size;
    let t = Instant::now();
    let logits = match engine.step(&parts) {
        Ok(l) => l,
        Err(e) => {
            for (i, _) in &plan {
                fail(&mut slots[*i], &e.to_string());
            }
            return;
        }
    };
    let took = t.elapsed();
    let prompt_rows: usize = parts.iter().skip(decoding).map(|p| p.tokens.len()).sum();
    if prompt_rows > 0 {
        store_rate(&counters.prefill_tok_s, prompt_rows, took);
        counters.prompt_tokens.fetch_add(prompt_rows as u64, Ordering::Relaxed);
    } else {
        store_rate(&counters.decode_tok_s, decoding, took);
    }
    let mut rows = logits.chunks(vocab);
    // Slots whose prompt reached its checkpoint (saved once the logits are read).
    let mut saves = Vec::new();
    for ((i, work), room) in plan.into_iter().zip(room) {
        let slot = &mut slots[i];
        match work {
            Work::Decode(token) => slot.cached.push(token),
            Work::Prefill { start, end } => {
                let a = slot.active.as_mut().expect("an active slot");
                slot.cached.extend_from_slice(&a.job.prompt[start..end]);
                a.prefilled = end;
                if a.job.checkpoint_at == Some(end) {
                    saves.push(i);
                }
                if end < a.job.prompt.len() {
                    continue;
                }
            }
        }
        let row = rows.next().expect("a row of logits per part that asked");
        let a = slot.active.as_mut().expect("an active slot");
        let next = a.sampler.sample(row, &a.history);
        let eos: &[u32] = if a.job.ignore_eos { &[] } else { &cfg.eos };
        accept(slot, next, room, counters, eos);
    }
    for i in saves {
        engine.checkpoint_in(i);
    }
}

/// Takes a sampled token: streams its text, and ends the request at EOS, a stop string, its
/// token limit or a full cache (`room`: whether the cache can take the token); otherwise it is
/// fed at the next decode step.
fn accept(slot: &mut Slot, token: u32, room: bool, counters: &Counters, eos: &[u32]) {
    let a = slot.active.as_mut().expect("an active slot");
    a.generated += 1;
    a.history.push(token);
    counters.generated_tokens.fetch_add(1, Ordering::Relaxed);
    let mut text = Text::default();
    let mut finish = None;
    if eos.contains(&token) {
        finish = Some(FinishReason::Stop);
    } else {
        match a.streamer.step(token) {
            Ok(Some(piece)) => {
                let think = &mut a.think;
                if a.stops.push(&piece, &mut |s| think.push(s, &mut |p| text.add(p))) {
                    finish = Some(FinishReason::Stop);
                }
            }
            Ok(None) => {}
            Err(e) => return fail(slot, &e.to_string()),
        }
        if finish.is_none() && (a.generated >= a.job.max_tokens || !room) {
            finish = Some(FinishReason::Length);
        }
    }
    let Some(reason) = finish else {
        a.next = Some(token);
        text.send(&a.job.events);
        return;
    };
    // The rest of the text: what the streamer and the stop and think filters held back.
    if a.stops.matched().is_none()
        && let Ok(Some(piece)) = a.streamer.finish()
    {
        let think = &mut a.think;
        a.stops.push(&piece, &mut |s| think.push(s, &mut |p| text.add(p)));
    }
    let think = &mut a.think;
    a.stops.finish(&mut |s| think.push(s, &mut |p| text.add(p)));
    a.think.finish(&mut |p| text.add(p));
    text.send(&a.job.events);
    let usage = Usage {
        prompt_tokens: a.job.prompt.len() as u32,
        completion_tokens: a.generated as u32,
        cached_tokens: a.cached_tokens as u32,
    };
    let _ = a.job.events.send(GenEvent::Finished {
        finish_reason: reason,
        usage,
    });
    slot.active = None;
}

/// Ends a slot's request with an error; its cache contents are no longer trusted.
fn fail(slot: &mut Slot, message: &str) {
    if let Some(a) = slot.active.take() {
        let _ = a.job.events.send(GenEvent::Failed {
            message: message.to_string(),
        });
    }
    slot.cached.clear();
}

/// Answer and reasoning text gathered for one event.
#[derive(Default)]
struct Text {
    content: String,
    reasoning: String,
}

impl Text {
    fn add(&mut self, part: Part<'_>) {
        match part {
            Part::Answer(s) => self.content.push_str(s),
            Part::Thinking(s) => self.reasoning.push_str(s),
            Part::Open | Part::Close => {}
        }
    }
    fn send(self, events: &UnboundedSender<GenEvent>) {
        if !self.content.is_empty() || !self.reasoning.is_empty() {
            let _ = events.send(GenEvent::Delta {
                content: self.content,
                reasoning: self.reasoning,
            });
        }
    }
}

fn store_rate(slot: &AtomicU64, tokens: usize, took: Duration) {
    let secs = took.as_secs_f64();
    if secs > 0.0 {
        slot.store((tokens as f64 / secs).to_bits(), Ordering::Relaxed);
    }
}
