//! End-to-end tests of every error answer: status, OpenAI error fields, headers.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::{assert_error, start, start_with};
use kiln_server::testing::FakeBackend;
use kiln_server::{Backend, BackendStats, GenEvent, GenRequest, ServerConfig, ServerState, SubmitError, serve};
use serde_json::{Value, json};
use tokio::sync::mpsc::UnboundedReceiver;

const INVALID: &str = "invalid_request_error";

fn chat_body() -> Value {
    json!({"messages": [{"role": "user", "content": "hi"}]})
}

fn with(field: &str, value: Value) -> Value {
    let mut body = chat_body();
    body[field] = value;
    body
}

// Proves malformed JSON and a missing/wrong Content-Type are 400 JSON errors, not axum's
// plain-text 400/415.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_json_and_content_type() {
    let s = start().await;
    let url = s.url("/v1/chat/completions");
    let r = s
        .client
        .post(&url)
        .header("content-type", "application/json")
        .body("{\"messages\": [")
        .send()
        .await;
    assert_error(r.unwrap(), 400, INVALID, None, None).await;
    let r = s
        .client
        .post(&url)
        .header("content-type", "text/plain")
        .body(chat_body().to_string())
        .send()
        .await;
    let e = assert_error(r.unwrap(), 400, INVALID, None, None).await;
    assert!(e["message"].as_str().unwrap().contains("Content-Type"));
    let r = s.client.post(&url).json(&json!([1, 2])).send().await;
    assert_error(r.unwrap(), 400, INVALID, None, None).await;
    assert_eq!(s.backend.submissions(), 0);
}

// Proves a known field with the wrong type, negative max_tokens, n=2 and an unknown role are
// 400s naming the field, and none reaches the backend.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invalid_fields_name_the_param() {
    let s = start().await;
    let cases = [
        (with("temperature", json!("hot")), "temperature"),
        (with("max_tokens", json!(-1)), "max_tokens"),
        (with("max_completion_tokens", json!(-5)), "max_completion_tokens"),
        (with("n", json!(2)), "n"),
        (with("stream", json!("yes")), "stream"),
        (with("stop", json!(["a", "b", "c", "d", "e"])), "stop"),
        (with("seed", json!("x")), "seed"),
        (
            json!({"messages": [{"role": "user", "content": "a"}, {"role": "wizard", "content": "b"}]}),
            "messages[1].role",
        ),
        (json!({"messages": "hi"}), "messages"),
    ];
    for (body, param) in cases {
        let e = assert_error(
            s.post("/v1/chat/completions", &body).await,
            400,
            INVALID,
            Some(param),
            None,
        )
        .await;
        assert!(
            e["message"]
                .as_str()
                .unwrap()
                .contains(param.split('[').next().unwrap()),
            "{e}"
        );
    }
    let r = s.post("/v1/completions", &json!({"prompt": 5})).await;
    assert_error(r, 400, INVALID, Some("prompt"), None).await;
    assert_eq!(s.backend.submissions(), 0);
}

// Proves a `model` other than the loaded one is 404 model_not_found on both endpoints.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_model_is_404() {
    let s = start().await;
    let r = s.post("/v1/chat/completions", &with("model", json!("gpt-4o"))).await;
    let e = assert_error(r, 404, INVALID, Some("model"), Some("model_not_found")).await;
    assert!(e["message"].as_str().unwrap().contains("gpt-4o"));
    let r = s
        .post("/v1/completions", &json!({"model": "other", "prompt": "x"}))
        .await;
    assert_error(r, 404, INVALID, Some("model"), Some("model_not_found")).await;
}

// Proves an unknown path is a JSON 404 and a wrong method a JSON 405 keeping the Allow header.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_path_and_wrong_method() {
    let s = start().await;
    let e = assert_error(s.get("/v1/embeddings").await, 404, INVALID, None, None).await;
    assert!(e["message"].as_str().unwrap().contains("/v1/embeddings"));
    let r = s.get("/v1/chat/completions").await;
    assert!(
        r.headers()
            .get("allow")
            .is_some_and(|v| v.to_str().unwrap().contains("POST"))
    );
    assert_error(r, 405, INVALID, None, None).await;
    let r = s.client.delete(s.url("/health")).send().await.unwrap();
    assert_error(r, 405, INVALID, None, None).await;
}

// Proves a body over max_body_bytes is a JSON 413, with or without a Content-Length.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_body_is_413() {
    let config = ServerConfig {
        max_body_bytes: 1024,
        ..ServerConfig::default()
    };
    let s = start_with(config, FakeBackend::new("tiny"), true).await;
    let big = with("padding", json!("x".repeat(4096)));
    let code = Some("request_too_large");
    assert_error(s.post("/v1/chat/completions", &big).await, 413, INVALID, None, code).await;
    let chunks: Vec<Result<Vec<u8>, std::io::Error>> = vec![Ok(big.to_string().into_bytes())];
    let r = s
        .client
        .post(s.url("/v1/chat/completions"))
        .header("content-type", "application/json")
        .body(reqwest::Body::wrap_stream(futures_util::stream::iter(chunks)))
        .send()
        .await
        .unwrap();
    assert_error(r, 413, INVALID, None, code).await;
    assert_eq!(s.post("/v1/chat/completions", &chat_body()).await.status(), 200);
}

// Proves a configured API key is required on /v1/* (401 invalid_api_key when missing or wrong)
// while /health and /metrics stay open.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn api_key_required() {
    let config = ServerConfig {
        api_key: Some("sekret".into()),
        ..ServerConfig::default()
    };
    let s = start_with(config, FakeBackend::new("tiny"), true).await;
    let code = Some("invalid_api_key");
    assert_error(
        s.post("/v1/chat/completions", &chat_body()).await,
        401,
        INVALID,
        None,
        code,
    )
    .await;
    let r = s
        .client
        .get(s.url("/v1/models"))
        .bearer_auth("wrong")
        .send()
        .await
        .unwrap();
    assert_error(r, 401, INVALID, None, code).await;
    let r = s
        .client
        .get(s.url("/v1/models"))
        .header("authorization", "Basic sekret")
        .send()
        .await
        .unwrap();
    assert_error(r, 401, INVALID, None, code).await;
    let r = s
        .client
        .post(s.url("/v1/chat/completions"))
        .bearer_auth("sekret")
        .json(&chat_body())
        .send()
        .await;
    assert_eq!(r.unwrap().status(), 200);
    assert_eq!(s.get("/health").await.status(), 200);
    assert_eq!(s.get("/metrics").await.status(), 200);
    assert_eq!(s.backend.submissions(), 1);
}

// Proves each SubmitError maps to its status, error fields and headers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn submit_errors_map_to_statuses() {
    let s = start().await;
    s.backend.fail_next(SubmitError::QueueFull { retry_after_s: 3 });
    let r = s.post("/v1/chat/completions", &chat_body()).await;
    assert_eq!(r.headers()["retry-after"], "3");
    assert_error(r, 503, "server_error", None, Some("server_overloaded")).await;

    s.backend.fail_next(SubmitError::ContextExceeded {
        prompt_tokens: 5000,
        ctx: 4096,
    });
    let r = s
        .post("/v1/completions", &json!({"prompt": "long", "stream": true}))
        .await;
    let e = assert_error(r, 400, INVALID, None, Some("context_length_exceeded")).await;
    let message = e["message"].as_str().unwrap();
    assert!(message.contains("5000") && message.contains("4096"), "{message}");

    s.backend.fail_next(SubmitError::BadRequest {
        message: "template failed".into(),
        param: Some("messages".into()),
    });
    let r = s.post("/v1/chat/completions", &chat_body()).await;
    let e = assert_error(r, 400, INVALID, Some("messages"), None).await;
    assert_eq!(e["message"], "template failed");

    s.backend.fail_next(SubmitError::ShuttingDown);
    let r = s.post("/v1/chat/completions", &chat_body()).await;
    assert_error(r, 503, "server_error", None, Some("shutting_down")).await;
    assert_eq!(s.backend.submissions(), 4);
}

/// A backend that panics, to prove panics become 500s rather than dropped connections.
struct Panicky;

impl Backend for Panicky {
    fn model_id(&self) -> String {
        panic!("model_id exploded")
    }
    fn ctx(&self) -> usize {
        0
    }
    fn submit(&self, _: GenRequest) -> Result<UnboundedReceiver<GenEvent>, SubmitError> {
        panic!("submit exploded")
    }
    fn stats(&self) -> BackendStats {
        BackendStats::default()
    }
}

// Proves a panic in a handler is a 500 JSON error and the server keeps serving.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn handler_panic_is_500() {
    let state = ServerState::new(&ServerConfig::default());
    state.set_backend(Arc::new(Panicky));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let server = tokio::spawn(serve(listener, state, std::future::pending()));
    let client = reqwest::Client::new();
    let url = format!("http://{addr}/v1/chat/completions");
    let r = client.post(&url).json(&chat_body()).send().await.unwrap();
    assert_error(r, 500, "server_error", None, None).await;
    let r = client.get(format!("http://{addr}/health")).send().await.unwrap();
    assert_eq!(r.status(), 200);
    server.abort();
    let _ = tokio::time::timeout(Duration::from_secs(1), server).await;
}
