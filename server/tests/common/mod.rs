//! Helpers shared by the end-to-end tests: a server on a free port with a `FakeBackend`, a
//! client, SSE parsing and OpenAI error checks.

#![allow(dead_code)] // Each test file uses a different subset.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kiln_server::testing::FakeBackend;
use kiln_server::{ServerConfig, ServerState, serve};
use serde_json::Value;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

/// A running server.
pub struct Server {
    pub addr: SocketAddr,
    pub backend: Arc<FakeBackend>,
    pub state: ServerState,
    pub client: reqwest::Client,
    shutdown: Option<oneshot::Sender<()>>,
    handle: Option<JoinHandle<anyhow::Result<()>>>,
}

/// A server with the model `tiny` loaded and default settings.
pub async fn start() -> Server {
    start_with(ServerConfig::default(), FakeBackend::new("tiny"), true).await
}

/// A server with `config`; `loaded` says whether the backend is set before it starts.
pub async fn start_with(config: ServerConfig, backend: FakeBackend, loaded: bool) -> Server {
    let backend = Arc::new(backend);
    let state = ServerState::new(&config);
    if loaded {
        assert!(state.set_backend(backend.clone()));
    }
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (tx, rx) = oneshot::channel::<()>();
    let handle = tokio::spawn(serve(listener, state.clone(), async move {
        let _ = rx.await;
    }));
    Server {
        addr,
        backend,
        state,
        client: reqwest::Client::new(),
        shutdown: Some(tx),
        handle: Some(handle),
    }
}

impl Server {
    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    pub async fn post(&self, path: &str, body: &Value) -> reqwest::Response {
        self.client.post(self.url(path)).json(body).send().await.unwrap()
    }

    pub async fn get(&self, path: &str) -> reqwest::Response {
        self.client.get(self.url(path)).send().await.unwrap()
    }

    /// Triggers the shutdown future; the handle resolves when `serve` returns.
    pub fn shut_down(&mut self) -> JoinHandle<anyhow::Result<()>> {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        self.handle.take().expect("shut down twice")
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
    }
}

/// The `data:` payloads of an SSE body, in order (comments and blank lines skipped).
pub fn sse_events(body: &str) -> Vec<String> {
    body.split("\n\n")
        .filter_map(|event| {
            let data: Vec<&str> = event
                .lines()
                .filter_map(|l| l.strip_prefix("data:"))
                .map(str::trim_start)
                .collect();
            (!data.is_empty()).then(|| data.join("\n"))
        })
        .collect()
}

/// Checks the status and the OpenAI error fields, and returns the `error` object.
pub async fn assert_error(
    r: reqwest::Response,
    status: u16,
    kind: &str,
    param: Option<&str>,
    code: Option<&str>,
) -> Value {
    assert_eq!(r.status(), status);
    let ct = r.headers().get("content-type").map(|v| v.to_str().unwrap().to_owned());
    assert!(
        ct.as_deref().is_some_and(|c| c.starts_with("application/json")),
        "content-type {ct:?}"
    );
    let v: Value = r.json().await.unwrap();
    let e = v["error"].clone();
    assert!(e["message"].as_str().is_some_and(|m| !m.is_empty()), "{v}");
    assert_eq!(e["type"], kind, "{v}");
    assert_eq!(e["param"].as_str(), param, "{v}");
    assert_eq!(e["code"].as_str(), code, "{v}");
    e
}

/// Polls `cond` until it holds, failing after `limit`.
pub async fn wait_for(limit: Duration, cond: impl Fn() -> bool) {
    let start = Instant::now();
    while !cond() {
        assert!(start.elapsed() < limit, "condition not met within {limit:?}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}
