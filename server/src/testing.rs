//! A scripted [`Backend`] for tests (feature `testing`), so the server and `kiln serve`'s wiring
//! can be exercised without a model.
//!
//! Each request gets its own thread that sends the script's deltas with a delay, checks
//! `is_closed()` before every step as the real engine does, and counts a cancellation when the
//! server dropped the receiver.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use tokio::sync::mpsc::{self, UnboundedReceiver};

use crate::backend::{Backend, BackendStats, FinishReason, GenEvent, GenRequest, Prompt, SubmitError, Usage};

/// What the fake generates for every request.
#[derive(Debug, Clone, PartialEq)]
pub struct Script {
    /// `(content, reasoning)` pairs, one `Delta` each; one delta counts as one token.
    pub deltas: Vec<(String, String)>,
    /// Pause before each delta.
    pub delay: Duration,
    /// The finish reason when all deltas were sent (`max_tokens` cutting in gives `Length`).
    pub finish: FinishReason,
    /// Send `Failed` with this message instead of `Finished`.
    pub fail_with: Option<String>,
    /// `Usage::cached_tokens` to report.
    pub cached_tokens: u32,
}

impl Script {
    /// Content-only deltas, 5 ms apart, ending with `stop`.
    pub fn text(pieces: &[&str]) -> Self {
        Script {
            deltas: pieces.iter().map(|p| ((*p).to_owned(), String::new())).collect(),
            delay: Duration::from_millis(5),
            finish: FinishReason::Stop,
            fail_with: None,
            cached_tokens: 0,
        }
    }

    /// `n` deltas `"tok "`, `delay` apart: a stream long enough to interrupt.
    pub fn long(n: usize, delay: Duration) -> Self {
        Script {
            delay,
            ..Script::text(&vec!["tok "; n])
        }
    }
}

/// The fake backend; see the module docs.
#[derive(Debug)]
pub struct FakeBackend {
    model: String,
    ctx: usize,
    script: Mutex<Script>,
    next_error: Mutex<Option<SubmitError>>,
    last_request: Mutex<Option<GenRequest>>,
    stats: Mutex<BackendStats>,
    submissions: AtomicUsize,
    cancellations: Arc<AtomicUsize>,
    finished: Arc<AtomicUsize>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl FakeBackend {
    /// A backend named `model` with a 4096-token context answering "Hello world".
    pub fn new(model: &str) -> Self {
        FakeBackend {
            model: model.to_owned(),
            ctx: 4096,
            script: Mutex::new(Script::text(&["Hello", " world"])),
            next_error: Mutex::new(None),
            last_request: Mutex::new(None),
            stats: Mutex::new(BackendStats::default()),
            submissions: AtomicUsize::new(0),
            cancellations: Default::default(),
            finished: Default::default(),
        }
    }

    /// Replaces the script for later requests.
    pub fn set_script(&self, script: Script) {
        *lock(&self.script) = script;
    }

    /// Makes the next `submit` return `error`.
    pub fn fail_next(&self, error: SubmitError) {
        *lock(&self.next_error) = Some(error);
    }

    /// What `stats()` reports.
    pub fn set_stats(&self, stats: BackendStats) {
        *lock(&self.stats) = stats;
    }

    /// Calls of `submit`, refused ones included.
    pub fn submissions(&self) -> usize {
        self.submissions.load(Ordering::SeqCst)
    }

    /// Requests whose receiver was dropped before they finished.
    pub fn cancellations(&self) -> usize {
        self.cancellations.load(Ordering::SeqCst)
    }

    /// Requests that sent their last event.
    pub fn finished(&self) -> usize {
        self.finished.load(Ordering::SeqCst)
    }

    /// The last request `submit` saw.
    pub fn last_request(&self) -> Option<GenRequest> {
        lock(&self.last_request).clone()
    }
}

impl Backend for FakeBackend {
    fn model_id(&self) -> String {
        self.model.clone()
    }

    fn ctx(&self) -> usize {
        self.ctx
    }

    fn submit(&self, req: GenRequest) -> Result<UnboundedReceiver<GenEvent>, SubmitError> {
        self.submissions.fetch_add(1, Ordering::SeqCst);
        *lock(&self.last_request) = Some(req.clone());
        if let Some(error) = lock(&self.next_error).take() {
            return Err(error);
        }
        let script = lock(&self.script).clone();
        let prompt_tokens = match &req.prompt {
            Prompt::Chat(messages) => messages.iter().map(|m| m.content.split_whitespace().count()).sum(),
            Prompt::Text(text) => text.split_whitespace().count(),
        };
        let (tx, rx) = mpsc::unbounded_channel();
        let cancellations = Arc::clone(&self.cancellations);
        let finished = Arc::clone(&self.finished);
        std::thread::spawn(move || {
            let limit = req.max_tokens.map_or(usize::MAX, |m| m as usize);
            let mut finish = script.finish;
            let mut sent = 0u32;
            for (content, reasoning) in script.deltas {
                if sent as usize >= limit {
                    finish = FinishReason::Length;
                    break;
                }
                std::thread::sleep(script.delay);
                if tx.is_closed() || tx.send(GenEvent::Delta { content, reasoning }).is_err() {
                    cancellations.fetch_add(1, Ordering::SeqCst);
                    return;
                }
                sent += 1;
            }
            let last = match script.fail_with {
                Some(message) => GenEvent::Failed { message },
                None => GenEvent::Finished {
                    finish_reason: finish,
                    usage: Usage {
                        prompt_tokens: u32::try_from(prompt_tokens).unwrap_or(u32::MAX),
                        completion_tokens: sent,
                        cached_tokens: script.cached_tokens,
                    },
                },
            };
            // Counted before the send: a client that has the last event must see it counted.
            finished.fetch_add(1, Ordering::SeqCst);
            if tx.send(last).is_err() {
                finished.fetch_sub(1, Ordering::SeqCst);
                cancellations.fetch_add(1, Ordering::SeqCst);
            }
        });
        Ok(rx)
    }

    fn stats(&self) -> BackendStats {
        lock(&self.stats).clone()
    }
}
