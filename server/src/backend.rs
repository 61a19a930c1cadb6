//! The seam between the HTTP layer and the model: everything the server needs from an engine.
//!
//! The server never sees tokens, templates or the scheduler. It hands a validated [`GenRequest`]
//! to [`Backend::submit`] and forwards the [`GenEvent`]s it gets back, so this crate builds and is
//! tested without the compiler or LLVM, and the engine stays on its own threads.

use tokio::sync::mpsc::UnboundedReceiver;

/// One message of a chat conversation, after the server has normalised it.
///
/// `role` is one of `system`, `user`, `assistant` or `tool` (`developer` arrives as `system`);
/// `content` is plain text (an OpenAI content-part array of text parts is joined with `\n`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
}

/// What the model is asked to continue.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Prompt {
    /// `/v1/chat/completions`: the backend renders the model's chat template.
    Chat(Vec<ChatMessage>),
    /// `/v1/completions`: raw text, tokenised as is.
    Text(String),
}

/// Sampling options exactly as the client gave them; `None` means "the backend's default".
///
/// The server checks ranges (temperature not negative, `top_p` in (0, 1], ...) so the backend
/// can trust them.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SamplingRequest {
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<u32>,
    pub min_p: Option<f32>,
    pub seed: Option<u64>,
    pub presence_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
}

/// One generation request.
#[derive(Debug, Clone, PartialEq)]
pub struct GenRequest {
    pub prompt: Prompt,
    /// Most tokens to generate; `None` means up to the context.
    pub max_tokens: Option<u32>,
    pub sampling: SamplingRequest,
    /// Stop strings (at most 4, none empty); the text up to the first match is returned.
    pub stop: Vec<String>,
    /// Do not stop at end-of-sequence tokens (`ignore_eos`, as llama-server and vLLM take it).
    pub ignore_eos: bool,
    /// `chat_template_kwargs.enable_thinking` (vLLM's and llama-server's extension): asks a
    /// template that reads `enable_thinking` (Qwen3) to think or not; `None` leaves its default.
    pub enable_thinking: Option<bool>,
}

/// Why a generation ended, as OpenAI names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// End of sequence token or a stop string.
    Stop,
    /// `max_tokens` or the context ran out.
    Length,
}

impl FinishReason {
    /// The wire name: `"stop"` or `"length"`.
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
        }
    }
}

/// Token counts of one request.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Usage {
    pub prompt_tokens: u32,
    pub completion_tokens: u32,
    /// Prompt tokens whose KV entries came from the prefix cache.
    pub cached_tokens: u32,
}

/// What a running request reports, in order.
#[derive(Debug, Clone, PartialEq)]
pub enum GenEvent {
    /// Text produced since the last event: answer text and, for thinking models, reasoning text
    /// (either may be empty). For a [`Prompt::Text`] request the server sends `reasoning` before
    /// `content` as plain text, so nothing is lost.
    Delta { content: String, reasoning: String },
    /// The last event of a successful request.
    Finished { finish_reason: FinishReason, usage: Usage },
    /// An engine error mid-generation: a stream ends with an error event, a plain request gets 500.
    Failed { message: String },
}

/// Why a request was refused; returned before any byte of the response is sent, so each maps to
/// a proper HTTP status.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SubmitError {
    /// 400 `invalid_request_error` (for example the chat template rejected the messages).
    #[error("{message}")]
    BadRequest { message: String, param: Option<String> },
    /// 400 with code `context_length_exceeded`.
    #[error("the prompt has {prompt_tokens} tokens but the context holds {ctx}")]
    ContextExceeded { prompt_tokens: usize, ctx: usize },
    /// 503 with a `Retry-After` header: the queue is full.
    #[error("the server is busy; retry in {retry_after_s} s")]
    QueueFull { retry_after_s: u64 },
    /// 503: the engine is stopping.
    #[error("the server is shutting down")]
    ShuttingDown,
}

/// A snapshot of the engine for `/metrics`.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct BackendStats {
    /// Requests waiting for a slot.
    pub queue_depth: usize,
    /// Sequences in the running batch.
    pub active_sequences: usize,
    /// Most sequences the engine runs at once.
    pub slots: usize,
    pub prompt_tokens_total: u64,
    pub generated_tokens_total: u64,
    /// Recent prefill throughput, tokens per second.
    pub prefill_tok_s: f64,
    /// Recent decode throughput (all sequences together), tokens per second.
    pub decode_tok_s: f64,
}

/// A loaded model that generates text. Implemented over the real engine by `kiln serve`, and by
/// `testing::FakeBackend` in tests.
pub trait Backend: Send + Sync + 'static {
    /// The name clients pass as `model` and `/v1/models` lists.
    fn model_id(&self) -> String;
    /// The context length in tokens.
    fn ctx(&self) -> usize;
    /// Validates, renders/tokenises and enqueues. Events arrive on the returned receiver, ending
    /// with `Finished` or `Failed`.
    ///
    /// Dropping the receiver cancels the request: the backend checks
    /// `UnboundedSender::is_closed()` every step and frees the slot. The server calls this on the
    /// blocking pool, so it may take a few milliseconds.
    fn submit(&self, req: GenRequest) -> Result<UnboundedReceiver<GenEvent>, SubmitError>;
    /// Counters and gauges for `/metrics`; must be cheap.
    fn stats(&self) -> BackendStats;
}
