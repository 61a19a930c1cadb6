//! The router: endpoints, and the middleware every request passes through.
//!
//! Layers, outermost first: request log and counters, JSON error bodies for bare error statuses
//! (axum's 405, tower-http's 413), panic to 500, body limit. `/v1/*` routes also check the API
//! key and then that the model has loaded. `/health` and `/metrics` need no key, so probes and
//! scrapers work without the secret (they reveal no prompts or outputs).

use std::any::Any;
use std::time::Instant;

use axum::Json;
use axum::extract::{DefaultBodyLimit, Path, Request, State};
use axum::http::{HeaderValue, StatusCode, header};
use axum::middleware::{Next, from_fn, from_fn_with_state};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Router, body::Body};
use serde_json::{Value, json};
use tokio::sync::watch;
use tower_http::catch_panic::CatchPanicLayer;
use tower_http::limit::RequestBodyLimitLayer;

use crate::completions;
use crate::errors::ApiError;
use crate::protocol::unix_now;
use crate::state::ServerState;

/// The router's state: the shared [`ServerState`] plus what one `serve` call owns.
#[derive(Clone)]
pub(crate) struct App {
    pub state: ServerState,
    /// Becomes true when the shutdown grace period is over: in-flight requests end (dropping
    /// their receivers, which cancels them in the backend) so the connections can close.
    pub abort: watch::Receiver<bool>,
    /// `created` of the model card: when this server started.
    pub started: u64,
}

impl App {
    pub fn new(state: ServerState, abort: watch::Receiver<bool>) -> Self {
        App {
            state,
            abort,
            started: unix_now(),
        }
    }

    pub fn aborting(&self) -> bool {
        *self.abort.borrow()
    }
}

/// Resolves once `abort` turns true, or once its sender is gone (the server has stopped).
pub(crate) async fn aborted(abort: &mut watch::Receiver<bool>) {
    // The guard `wait_for` returns holds the channel's lock; drop it at once.
    let _ = abort.wait_for(|a| *a).await;
}

/// All routes with their middleware.
pub(crate) fn router(app: App) -> Router {
    let v1 = Router::new()
        .route("/v1/chat/completions", post(completions::chat))
        .route("/v1/completions", post(completions::text))
        .route("/v1/models", get(models))
        // `{*id}`: model ids such as `Qwen/Qwen3-0.6B` contain slashes.
        .route("/v1/models/{*id}", get(model))
        .route_layer(from_fn_with_state(app.clone(), require_backend))
        .route_layer(from_fn_with_state(app.clone(), authorize));
    let max_body = app.state.max_body_bytes();
    Router::new()
        .merge(v1)
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .fallback(not_found)
        .with_state(app.clone())
        // One limit, tower-http's: it refuses a too-large Content-Length before reading, and
        // axum's extractors recognise its error for chunked bodies.
        .layer(DefaultBodyLimit::disable())
        .layer(RequestBodyLimitLayer::new(max_body))
        .layer(CatchPanicLayer::custom(panic_response))
        .layer(from_fn(json_errors))
        .layer(from_fn_with_state(app, log_request))
}

/// Logs one line per request and counts it for `/metrics`. For a stream the status and time are
/// those of the response head; the stream's end is logged by the stream if it fails.
async fn log_request(State(app): State<App>, req: Request, next: Next) -> Response {
    let started = Instant::now();
    let method = req.method().clone();
    let path = req.uri().path().to_owned();
    let response = next.run(req).await;
    let status = response.status();
    app.state.metrics().record(endpoint_label(&path), status.as_u16());
    tracing::info!(
        method = %method,
        path = %path,
        status = status.as_u16(),
        duration_ms = started.elapsed().as_secs_f64() * 1000.0,
        "request"
    );
    response
}

/// The `endpoint` label: a route pattern, never the raw path (clients must not grow the series).
fn endpoint_label(path: &str) -> &'static str {
    match path {
        "/v1/chat/completions" => "/v1/chat/completions",
        "/v1/completions" => "/v1/completions",
        "/v1/models" => "/v1/models",
        "/health" => "/health",
        "/metrics" => "/metrics",
        p if p.starts_with("/v1/models/") => "/v1/models/{id}",
        _ => "other",
    }
}

/// Gives an error status produced without a body (axum's 405, tower-http's 413, ...) the OpenAI
/// JSON body, keeping `Allow` and `Retry-After`.
async fn json_errors(req: Request, next: Next) -> Response {
    let method = req.method().clone();
    let path = req.uri().path().to_owned();
    let response = next.run(req).await;
    let status = response.status();
    let is_json = response
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("application/json"));
    if !(status.is_client_error() || status.is_server_error()) || is_json {
        return response;
    }
    let mut fixed = ApiError::for_status(status, method.as_str(), &path).into_response();
    for name in [header::ALLOW, header::RETRY_AFTER] {
        if let Some(v) = response.headers().get(&name) {
            fixed.headers_mut().insert(name, v.clone());
        }
    }
    fixed
}

/// A handler panic becomes a 500 JSON error instead of a dropped connection.
fn panic_response(panic: Box<dyn Any + Send + 'static>) -> Response<Body> {
    let what = panic
        .downcast_ref::<String>()
        .map(String::as_str)
        .or_else(|| panic.downcast_ref::<&str>().copied())
        .unwrap_or("(no message)");
    tracing::error!("a request handler panicked: {what}");
    ApiError::internal("The server hit an internal error").into_response()
}

/// Requires `Authorization: Bearer <key>` when a key is configured.
async fn authorize(State(app): State<App>, req: Request, next: Next) -> Response {
    if let Some(key) = app.state.api_key() {
        let given = req
            .headers()
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.split_once(' '))
            .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
            .map(|(_, token)| token.trim());
        match given {
            None => {
                return ApiError::unauthorized(
                    "You didn't provide an API key; send it as `Authorization: Bearer <key>`",
                )
                .into_response();
            }
            Some(token) if !same_secret(token, key) => {
                return ApiError::unauthorized("Incorrect API key provided").into_response();
            }
            Some(_) => {}
        }
    }
    next.run(req).await
}

/// Compares without stopping at the first differing byte, so response time does not reveal how
/// much of a guessed key was right.
fn same_secret(a: &str, b: &str) -> bool {
    a.len() == b.len() && a.bytes().zip(b.bytes()).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Every `/v1/*` route answers 503 until the model has loaded.
async fn require_backend(State(app): State<App>, req: Request, next: Next) -> Response {
    if app.state.backend().is_none() {
        return ApiError::loading().into_response();
    }
    next.run(req).await
}

/// `GET /health`: 200 once the model is loaded, 503 while it loads.
async fn health(State(app): State<App>) -> Response {
    match app.state.backend() {
        Some(_) => Json(json!({"status": "ok"})).into_response(),
        None => (StatusCode::SERVICE_UNAVAILABLE, Json(json!({"status": "loading"}))).into_response(),
    }
}

/// `GET /metrics`: Prometheus text format.
async fn metrics(State(app): State<App>) -> Response {
    let stats = app.state.backend().map(|b| b.stats());
    let body = app.state.metrics().render(stats.as_ref());
    let mut response = body.into_response();
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"),
    );
    response
}

fn model_card(id: &str, created: u64) -> Value {
    json!({"id": id, "object": "model", "created": created, "owned_by": "kiln"})
}

/// `GET /v1/models`: the one loaded model.
async fn models(State(app): State<App>) -> Result<Json<Value>, ApiError> {
    let backend = app.state.backend().ok_or_else(ApiError::loading)?;
    Ok(Json(
        json!({"object": "list", "data": [model_card(&backend.model_id(), app.started)]}),
    ))
}

/// `GET /v1/models/{id}`: the model card, or 404 for any other id.
async fn model(State(app): State<App>, Path(id): Path<String>) -> Result<Json<Value>, ApiError> {
    let backend = app.state.backend().ok_or_else(ApiError::loading)?;
    let model_id = backend.model_id();
    if id != model_id {
        return Err(ApiError::model_not_found(&id));
    }
    Ok(Json(model_card(&model_id, app.started)))
}

/// Unknown paths: a JSON 404 rather than axum's empty one.
async fn not_found(req: Request) -> ApiError {
    ApiError::for_status(StatusCode::NOT_FOUND, req.method().as_str(), req.uri().path())
}

#[cfg(test)]
mod tests {
    use super::*;

    // Proves the key comparison accepts only the exact key.
    #[test]
    fn secret_comparison() {
        assert!(same_secret("abc", "abc"));
        assert!(!same_secret("abd", "abc"));
        assert!(!same_secret("ab", "abc"));
    }

    // Proves raw paths collapse to a fixed set of endpoint labels.
    #[test]
    fn endpoint_labels_are_bounded() {
        assert_eq!(endpoint_label("/v1/models/Qwen/Qwen3"), "/v1/models/{id}");
        assert_eq!(endpoint_label("/anything/else"), "other");
        assert_eq!(endpoint_label("/v1/completions"), "/v1/completions");
    }
}
