//! End-to-end tests: the server on 127.0.0.1:0 with `FakeBackend`, driven by a real HTTP client.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::{assert_error, sse_events, start, start_with};
use futures_util::StreamExt;
use kiln_server::testing::{FakeBackend, Script};
use kiln_server::{ChatMessage, GenRequest, Prompt, SamplingRequest, ServerConfig};
use serde_json::{Value, json};

fn chat_body() -> Value {
    json!({"model": "tiny", "messages": [{"role": "user", "content": "say hello"}]})
}

// Proves a plain chat completion carries every OpenAI field with the right values.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_plain_has_every_field() {
    let s = start().await;
    let r = s.post("/v1/chat/completions", &chat_body()).await;
    assert_eq!(r.status(), 200);
    assert!(
        r.headers()["content-type"]
            .to_str()
            .unwrap()
            .starts_with("application/json")
    );
    let v: Value = r.json().await.unwrap();
    assert!(v["id"].as_str().unwrap().starts_with("chatcmpl-"));
    assert_eq!(v["object"], "chat.completion");
    assert!(v["created"].as_u64().unwrap() > 1_600_000_000);
    assert_eq!(v["model"], "tiny");
    assert_eq!(
        v["choices"],
        json!([{"index":0,"message":{"role":"assistant","content":"Hello world"},"finish_reason":"stop","logprobs":null}])
    );
    assert_eq!(
        v["usage"],
        json!({"prompt_tokens":2,"completion_tokens":2,"total_tokens":4,"prompt_tokens_details":{"cached_tokens":0}})
    );
}

// Proves every option reaches the backend as a GenRequest, with developer -> system.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn options_reach_the_backend() {
    let s = start().await;
    let body = json!({
        "messages": [{"role":"developer","content":"terse"},{"role":"user","content":"hi"}],
        "max_completion_tokens": 9, "temperature": 0.25, "top_p": 0.5, "top_k": 3, "min_p": 0.125,
        "seed": 42, "stop": ["\n\n", "END"], "presence_penalty": 0.5, "frequency_penalty": -0.5, "n": 1,
        "ignore_eos": true, "chat_template_kwargs": {"enable_thinking": false}
    });
    assert_eq!(s.post("/v1/chat/completions", &body).await.status(), 200);
    let expected = GenRequest {
        prompt: Prompt::Chat(vec![
            ChatMessage {
                role: "system".into(),
                content: "terse".into(),
            },
            ChatMessage {
                role: "user".into(),
                content: "hi".into(),
            },
        ]),
        max_tokens: Some(9),
        sampling: SamplingRequest {
            temperature: Some(0.25),
            top_p: Some(0.5),
            top_k: Some(3),
            min_p: Some(0.125),
            seed: Some(42),
            presence_penalty: Some(0.5),
            frequency_penalty: Some(-0.5),
        },
        ignore_eos: true,
        enable_thinking: Some(false),
        stop: vec!["\n\n".into(), "END".into()],
    };
    assert_eq!(s.backend.last_request(), Some(expected));
}

// Proves a stream is role chunk, deltas, finish chunk, usage chunk (include_usage), [DONE].
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_stream_sequence() {
    let s = start().await;
    let mut body = chat_body();
    body["stream"] = json!(true);
    body["stream_options"] = json!({"include_usage": true});
    let r = s.post("/v1/chat/completions", &body).await;
    assert_eq!(r.status(), 200);
    assert!(
        r.headers()["content-type"]
            .to_str()
            .unwrap()
            .starts_with("text/event-stream")
    );
    let events = sse_events(&r.text().await.unwrap());
    assert_eq!(events.len(), 6, "{events:?}");
    let chunks: Vec<Value> = events[..5].iter().map(|e| serde_json::from_str(e).unwrap()).collect();
    for c in &chunks {
        assert_eq!(c["object"], "chat.completion.chunk");
        assert_eq!(c["id"], chunks[0]["id"]);
        assert_eq!(c["model"], "tiny");
    }
    assert_eq!(
        chunks[0]["choices"][0]["delta"],
        json!({"role":"assistant","content":""})
    );
    assert_eq!(chunks[1]["choices"][0]["delta"], json!({"content":"Hello"}));
    assert_eq!(chunks[2]["choices"][0]["delta"], json!({"content":" world"}));
    assert!(chunks[2]["choices"][0]["finish_reason"].is_null());
    assert_eq!(chunks[3]["choices"][0]["delta"], json!({}));
    assert_eq!(chunks[3]["choices"][0]["finish_reason"], "stop");
    assert_eq!(chunks[4]["choices"], json!([]));
    assert_eq!(chunks[4]["usage"]["completion_tokens"], 2);
    assert_eq!(chunks[4]["usage"]["total_tokens"], 4);
    assert_eq!(events[5], "[DONE]");
}

// Proves reasoning text arrives as reasoning_content, streamed and plain, and that without
// include_usage no usage chunk is sent; max_tokens cutting the script gives finish "length".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reasoning_and_length() {
    let s = start().await;
    let mut script = Script::text(&["", "Answer"]);
    script.deltas[0].1 = "thinking".into();
    s.backend.set_script(script);
    let v: Value = s.post("/v1/chat/completions", &chat_body()).await.json().await.unwrap();
    assert_eq!(v["choices"][0]["message"]["reasoning_content"], "thinking");
    assert_eq!(v["choices"][0]["message"]["content"], "Answer");
    let mut body = chat_body();
    body["stream"] = json!(true);
    let events = sse_events(&s.post("/v1/chat/completions", &body).await.text().await.unwrap());
    assert_eq!(events.len(), 5, "{events:?}");
    let delta: Value = serde_json::from_str(&events[1]).unwrap();
    assert_eq!(delta["choices"][0]["delta"], json!({"reasoning_content":"thinking"}));
    body["max_tokens"] = json!(1);
    body["stream"] = json!(false);
    let v: Value = s.post("/v1/chat/completions", &body).await.json().await.unwrap();
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    assert_eq!(v["usage"]["completion_tokens"], 1);
}

// Proves /v1/completions answers plain and streamed with `text` choices, and takes [prompt].
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completions_plain_and_streamed() {
    let s = start().await;
    let r = s
        .post(
            "/v1/completions",
            &json!({"model":"tiny","prompt":"Once upon","max_tokens":5}),
        )
        .await;
    assert_eq!(r.status(), 200);
    let v: Value = r.json().await.unwrap();
    assert!(v["id"].as_str().unwrap().starts_with("cmpl-"));
    assert_eq!(v["object"], "text_completion");
    assert_eq!(
        v["choices"],
        json!([{"index":0,"text":"Hello world","finish_reason":"stop","logprobs":null}])
    );
    assert_eq!(v["usage"]["prompt_tokens"], 2);
    assert_eq!(
        s.backend.last_request().unwrap().prompt,
        Prompt::Text("Once upon".into())
    );
    let body = json!({"prompt":["Once"],"stream":true,"stream_options":{"include_usage":true}});
    let events = sse_events(&s.post("/v1/completions", &body).await.text().await.unwrap());
    assert_eq!(events.len(), 5, "{events:?}");
    let chunks: Vec<Value> = events[..4].iter().map(|e| serde_json::from_str(e).unwrap()).collect();
    assert!(chunks.iter().all(|c| c["object"] == "text_completion"));
    assert_eq!(chunks[0]["choices"][0]["text"], "Hello");
    assert_eq!(chunks[1]["choices"][0]["text"], " world");
    assert_eq!(chunks[2]["choices"][0]["finish_reason"], "stop");
    assert_eq!(chunks[3]["usage"]["prompt_tokens"], 1);
    assert_eq!(events[4], "[DONE]");
}

// Proves /v1/models lists the model, /v1/models/{id} returns its card (ids may contain a slash),
// and any other id is a 404 model_not_found.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn models_endpoints() {
    let s = start_with(ServerConfig::default(), FakeBackend::new("org/tiny"), true).await;
    let v: Value = s.get("/v1/models").await.json().await.unwrap();
    assert_eq!(v["object"], "list");
    let card = &v["data"][0];
    assert_eq!(
        (card["id"].as_str(), card["object"].as_str()),
        (Some("org/tiny"), Some("model"))
    );
    assert_eq!(card["owned_by"], "kiln");
    assert!(card["created"].as_u64().is_some());
    let r = s.get("/v1/models/org/tiny").await;
    assert_eq!(r.status(), 200);
    assert_eq!(r.json::<Value>().await.unwrap()["id"], "org/tiny");
    assert_error(
        s.get("/v1/models/gpt-4").await,
        404,
        "invalid_request_error",
        Some("model"),
        Some("model_not_found"),
    )
    .await;
}

// Proves /health and /v1/* answer 503 while the model loads and work once it is set.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_while_loading_then_ok() {
    let s = start_with(ServerConfig::default(), FakeBackend::new("tiny"), false).await;
    let r = s.get("/health").await;
    assert_eq!(r.status(), 503);
    assert_eq!(r.json::<Value>().await.unwrap(), json!({"status":"loading"}));
    let r = s.post("/v1/chat/completions", &chat_body()).await;
    assert!(r.headers().contains_key("retry-after"));
    let e = assert_error(r, 503, "server_error", None, Some("model_loading")).await;
    assert_eq!(e["message"], "the model is still loading");
    assert_eq!(s.get("/v1/models").await.status(), 503);
    assert!(s.state.set_backend(s.backend.clone()));
    let r = s.get("/health").await;
    assert_eq!(r.status(), 200);
    assert_eq!(r.json::<Value>().await.unwrap(), json!({"status":"ok"}));
    assert_eq!(s.post("/v1/chat/completions", &chat_body()).await.status(), 200);
}

// Proves /metrics serves Prometheus text with request counts and the backend's stats.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_contents() {
    let s = start().await;
    s.backend.set_stats(kiln_server::BackendStats {
        queue_depth: 3,
        active_sequences: 2,
        slots: 4,
        prompt_tokens_total: 100,
        generated_tokens_total: 50,
        prefill_tok_s: 250.5,
        decode_tok_s: 20.0,
    });
    assert_eq!(s.post("/v1/chat/completions", &chat_body()).await.status(), 200);
    assert_eq!(s.get("/nope").await.status(), 404);
    let r = s.get("/metrics").await;
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["content-type"], "text/plain; version=0.0.4; charset=utf-8");
    let text = r.text().await.unwrap();
    for line in [
        "kiln_requests_total{endpoint=\"/v1/chat/completions\",status=\"200\"} 1",
        "kiln_requests_total{endpoint=\"other\",status=\"404\"} 1",
        "kiln_prompt_tokens_total 100",
        "kiln_generated_tokens_total 50",
        "kiln_queue_depth 3",
        "kiln_active_sequences 2",
        "kiln_slots 4",
        "kiln_prefill_tokens_per_second 250.5",
        "kiln_decode_tokens_per_second 20",
        "kiln_requests_in_flight 0",
        "# TYPE kiln_requests_total counter",
        "# HELP kiln_queue_depth ",
    ] {
        assert!(text.lines().any(|l| l.starts_with(line)), "missing {line:?} in\n{text}");
    }
}

// Proves 8 concurrent requests (half streamed) are all answered completely.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eight_concurrent_requests() {
    let s = Arc::new(start().await);
    s.backend.set_script(Script::long(10, Duration::from_millis(10)));
    let tasks: Vec<_> = (0..8)
        .map(|i| {
            let s = Arc::clone(&s);
            tokio::spawn(async move {
                let mut body = chat_body();
                body["stream"] = json!(i % 2 == 0);
                let r = s.post("/v1/chat/completions", &body).await;
                assert_eq!(r.status(), 200);
                let text = r.text().await.unwrap();
                if i % 2 == 0 {
                    assert_eq!(sse_events(&text).last().map(String::as_str), Some("[DONE]"));
                } else {
                    let v: Value = serde_json::from_str(&text).unwrap();
                    assert_eq!(v["choices"][0]["message"]["content"], "tok ".repeat(10));
                }
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap();
    }
    assert_eq!(s.backend.submissions(), 8);
    assert_eq!(s.backend.finished(), 8);
}

// Proves a client hanging up mid-stream cancels the request in the backend within 2 s, and the
// server still answers the next request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hang_up_mid_stream_cancels() {
    let s = start().await;
    s.backend.set_script(Script::long(2000, Duration::from_millis(10)));
    let mut body = chat_body();
    body["stream"] = json!(true);
    let r = s.post("/v1/chat/completions", &body).await;
    let mut stream = r.bytes_stream();
    let mut seen = String::new();
    while !seen.contains("tok") {
        seen.push_str(&String::from_utf8_lossy(&stream.next().await.unwrap().unwrap()));
    }
    drop(stream);
    common::wait_for(Duration::from_secs(2), || s.backend.cancellations() == 1).await;
    s.backend.set_script(Script::text(&["ok"]));
    assert_eq!(s.post("/v1/chat/completions", &chat_body()).await.status(), 200);
}

// Proves a non-streaming client that gives up (timeout) also cancels its request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hang_up_plain_request_cancels() {
    let s = start().await;
    s.backend.set_script(Script::long(2000, Duration::from_millis(10)));
    let client = reqwest::Client::builder()
        .timeout(Duration::from_millis(300))
        .build()
        .unwrap();
    let result = client
        .post(s.url("/v1/chat/completions"))
        .json(&chat_body())
        .send()
        .await;
    assert!(result.is_err(), "the request should time out");
    common::wait_for(Duration::from_secs(2), || s.backend.cancellations() == 1).await;
}

// Proves an engine failure mid-stream sends an error event and ends the stream without [DONE],
// and a failure in a plain request is a 500 JSON error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failed_generation() {
    let s = start().await;
    let mut script = Script::text(&["partial"]);
    script.fail_with = Some("the engine broke".into());
    s.backend.set_script(script);
    let mut body = chat_body();
    body["stream"] = json!(true);
    let events = sse_events(&s.post("/v1/chat/completions", &body).await.text().await.unwrap());
    assert_eq!(events.len(), 3, "{events:?}");
    let err: Value = serde_json::from_str(&events[2]).unwrap();
    assert_eq!(err["error"]["message"], "the engine broke");
    assert_eq!(err["error"]["type"], "server_error");
    let e = assert_error(
        s.post("/v1/chat/completions", &chat_body()).await,
        500,
        "server_error",
        None,
        None,
    )
    .await;
    assert_eq!(e["message"], "the engine broke");
}

// Proves graceful shutdown lets an in-flight stream finish within the grace period and `serve`
// returns Ok; new connections are refused afterwards.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_waits_for_stream() {
    let mut s = start().await;
    s.backend.set_script(Script::long(30, Duration::from_millis(20)));
    let mut body = chat_body();
    body["stream"] = json!(true);
    let r = s.post("/v1/chat/completions", &body).await;
    assert_eq!(r.status(), 200);
    let served = s.shut_down();
    let events = sse_events(&r.text().await.unwrap());
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    assert_eq!(events.len(), 1 + 30 + 1 + 1);
    tokio::time::timeout(Duration::from_secs(5), served)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert_eq!(s.backend.cancellations(), 0);
    assert!(reqwest::get(s.url("/health")).await.is_err());
}

// Proves that past a tiny grace period the in-flight stream is cancelled in the backend (it
// gets an error event) and `serve` still returns Ok.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_after_grace_cancels() {
    let config = ServerConfig {
        shutdown_grace: Duration::from_millis(100),
        ..ServerConfig::default()
    };
    let mut s = start_with(config, FakeBackend::new("tiny"), true).await;
    s.backend.set_script(Script::long(2000, Duration::from_millis(10)));
    let mut body = chat_body();
    body["stream"] = json!(true);
    let r = s.post("/v1/chat/completions", &body).await;
    let served = s.shut_down();
    tokio::time::timeout(Duration::from_secs(5), served)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    let events = sse_events(&r.text().await.unwrap());
    assert!(events.len() < 100, "the stream should have been cut short");
    let last: Value = serde_json::from_str(events.last().unwrap()).unwrap();
    assert_eq!(last["error"]["code"], "shutting_down");
    common::wait_for(Duration::from_secs(2), || s.backend.cancellations() == 1).await;
}
