//! Streams a generation as Server-Sent Events, the way OpenAI's clients read them.
//!
//! The order is: a role chunk (chat only), one chunk per non-empty delta, a chunk with an empty
//! delta and the finish reason, the usage chunk if `stream_options.include_usage` asked for it,
//! then `data: [DONE]`. An engine failure sends `data: {"error":{…}}` and ends the stream.
//!
//! The stream owns the event receiver. When the client hangs up, hyper fails its next write and
//! drops the response body, which drops this stream and the receiver, and the backend sees
//! `is_closed()` and frees the slot: no explicit cancellation plumbing is needed.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::time::Duration;

use axum::http::HeaderValue;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};
use tokio::sync::mpsc::UnboundedReceiver;
use tokio::sync::watch;

use crate::backend::GenEvent;
use crate::errors::ApiError;
use crate::metrics::InFlight;
use crate::protocol::Meta;

/// A comment line this often keeps proxies from closing a stream that is quiet during a long
/// prefill; clients ignore comments.
const KEEP_ALIVE: Duration = Duration::from_secs(15);

/// Everything the stream needs between polls.
struct Streaming {
    meta: Meta,
    events: UnboundedReceiver<GenEvent>,
    abort: watch::Receiver<bool>,
    include_usage: bool,
    /// Events ready to send, produced by the last backend event.
    pending: VecDeque<Event>,
    /// Set once the terminal event is queued; the stream ends when `pending` empties.
    done: bool,
    /// Keeps the request counted in `kiln_requests_in_flight` until the stream is dropped.
    _in_flight: InFlight,
}

/// The streamed response for `events`.
pub(crate) fn respond(
    meta: Meta,
    events: UnboundedReceiver<GenEvent>,
    abort: watch::Receiver<bool>,
    include_usage: bool,
    in_flight: InFlight,
) -> Response {
    let mut pending = VecDeque::new();
    if let Some(chunk) = meta.role_chunk() {
        pending.push_back(data(&chunk));
    }
    let state = Streaming {
        meta,
        events,
        abort,
        include_usage,
        pending,
        done: false,
        _in_flight: in_flight,
    };
    let stream = futures_util::stream::unfold(state, |mut s| async move {
        loop {
            if let Some(event) = s.pending.pop_front() {
                return Some((Ok::<_, Infallible>(event), s));
            }
            if s.done {
                return None;
            }
            let aborted = crate::routes::aborted(&mut s.abort);
            let next = tokio::select! {
                event = s.events.recv() => Some(event),
                () = aborted => None,
            };
            match next {
                Some(event) => s.push(event),
                None => s.fail(&ApiError::shutting_down()),
            }
        }
    });
    let mut response = Sse::new(stream)
        .keep_alive(KeepAlive::new().interval(KEEP_ALIVE))
        .into_response();
    // Tells nginx-style proxies not to buffer the stream.
    response
        .headers_mut()
        .insert("x-accel-buffering", HeaderValue::from_static("no"));
    response
}

impl Streaming {
    /// Queues what one backend event (or the channel's end) becomes on the wire.
    fn push(&mut self, event: Option<GenEvent>) {
        match event {
            Some(GenEvent::Delta { content, reasoning }) => {
                if let Some(chunk) = self.meta.delta_chunk(&content, &reasoning) {
                    self.pending.push_back(data(&chunk));
                }
            }
            Some(GenEvent::Finished { finish_reason, usage }) => {
                self.pending.push_back(data(&self.meta.finish_chunk(finish_reason)));
                if self.include_usage {
                    self.pending.push_back(data(&self.meta.usage_chunk(usage)));
                }
                self.pending.push_back(Event::default().data("[DONE]"));
                self.done = true;
            }
            Some(GenEvent::Failed { message }) => self.fail(&ApiError::internal(message)),
            None => self.fail(&ApiError::internal("the generation ended without a result")),
        }
    }

    /// Queues an error event and ends the stream.
    fn fail(&mut self, error: &ApiError) {
        tracing::warn!("stream {} ended with an error: {}", self.meta.id, error.message);
        self.pending.push_back(data(&json!({"error": error.detail()})));
        self.done = true;
    }
}

/// One `data: {json}` event.
fn data(value: &Value) -> Event {
    Event::default().data(value.to_string())
}
