//! `POST /v1/chat/completions` and `POST /v1/completions`.
//!
//! Both endpoints run the same steps and differ only in how the body is read and how the answer
//! is shaped ([`Kind`]): parse, check the model name, submit on the blocking pool, then either
//! collect the events into one body or stream them as Server-Sent Events.

use std::sync::Arc;

use axum::Json;
use axum::extract::State;
use axum::extract::rejection::JsonRejection;
use axum::response::{IntoResponse, Response};
use serde_json::Value;
use tokio::sync::mpsc::UnboundedReceiver;
use tokio::sync::watch;

use crate::backend::{Backend, FinishReason, GenEvent, GenRequest, Usage};
use crate::errors::ApiError;
use crate::protocol::{Kind, Meta};
use crate::request::{parse_chat, parse_completion};
use crate::routes::App;
use crate::sse;

/// `POST /v1/chat/completions`.
pub(crate) async fn chat(State(app): State<App>, body: Result<Json<Value>, JsonRejection>) -> Response {
    generate(app, body, Kind::Chat)
        .await
        .unwrap_or_else(IntoResponse::into_response)
}

/// `POST /v1/completions`.
pub(crate) async fn text(State(app): State<App>, body: Result<Json<Value>, JsonRejection>) -> Response {
    generate(app, body, Kind::Text)
        .await
        .unwrap_or_else(IntoResponse::into_response)
}

async fn generate(app: App, body: Result<Json<Value>, JsonRejection>, kind: Kind) -> Result<Response, ApiError> {
    let backend = app.state.backend().ok_or_else(ApiError::loading)?;
    let Json(body) = body?;
    let parsed = match kind {
        Kind::Chat => parse_chat(&body)?,
        Kind::Text => parse_completion(&body)?,
    };
    let model_id = backend.model_id();
    if let Some(model) = parsed.model.as_deref().filter(|m| *m != model_id) {
        return Err(ApiError::model_not_found(model));
    }
    if app.aborting() {
        return Err(ApiError::shutting_down());
    }
    let in_flight = app.state.metrics().in_flight();
    let events = submit(backend, parsed.request).await?;
    let meta = Meta::new(kind, model_id);
    if parsed.stream {
        return Ok(sse::respond(
            meta,
            events,
            app.abort.clone(),
            parsed.include_usage,
            in_flight,
        ));
    }
    // If the client hangs up, axum drops this future, and with it `events`: the backend sees
    // the channel closed and cancels.
    let done = collect(events, app.abort.clone()).await?;
    drop(in_flight);
    Ok(Json(meta.full(&done.content, &done.reasoning, done.finish_reason, done.usage)).into_response())
}

/// Hands the request to the backend on the blocking pool: `submit` tokenises and may take a few
/// milliseconds, which must not stall the runtime's worker threads.
async fn submit(backend: Arc<dyn Backend>, request: GenRequest) -> Result<UnboundedReceiver<GenEvent>, ApiError> {
    match tokio::task::spawn_blocking(move || backend.submit(request)).await {
        Ok(result) => result.map_err(ApiError::from),
        Err(e) => {
            tracing::error!("the backend's submit failed: {e}");
            Err(ApiError::internal("the backend failed to accept the request"))
        }
    }
}

/// A finished, non-streamed generation.
#[derive(Debug)]
struct Collected {
    content: String,
    reasoning: String,
    finish_reason: FinishReason,
    usage: Usage,
}

/// Gathers the events of one request; a `Failed` event (or a backend that drops its sender
/// without finishing) is a 500, the end of the shutdown grace period a 503.
async fn collect(
    mut events: UnboundedReceiver<GenEvent>,
    mut abort: watch::Receiver<bool>,
) -> Result<Collected, ApiError> {
    let (mut content, mut reasoning) = (String::new(), String::new());
    loop {
        let event = tokio::select! {
            event = events.recv() => event,
            () = crate::routes::aborted(&mut abort) => return Err(ApiError::shutting_down()),
        };
        match event {
            Some(GenEvent::Delta {
                content: c,
                reasoning: r,
            }) => {
                content.push_str(&c);
                reasoning.push_str(&r);
            }
            Some(GenEvent::Finished { finish_reason, usage }) => {
                return Ok(Collected {
                    content,
                    reasoning,
                    finish_reason,
                    usage,
                });
            }
            Some(GenEvent::Failed { message }) => return Err(ApiError::internal(message)),
            None => return Err(ApiError::internal("the generation ended without a result")),
        }
    }
}
