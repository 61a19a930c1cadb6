//! Configuration and the state every handler shares.

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use crate::backend::Backend;
use crate::metrics::Metrics;

/// How `kiln serve` listens and what it accepts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServerConfig {
    /// Address to bind; `127.0.0.1` keeps the server private to this machine.
    pub host: String,
    /// Port to bind; 0 lets the system pick one (the bound address is printed).
    pub port: u16,
    /// When set, every `/v1/*` request needs `Authorization: Bearer <key>`.
    pub api_key: Option<String>,
    /// Larger request bodies are refused with 413 before they are read.
    pub max_body_bytes: usize,
    /// On SIGTERM/SIGINT, how long in-flight requests may run before they are cancelled.
    pub shutdown_grace: Duration,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            host: "127.0.0.1".into(),
            port: 8080,
            api_key: None,
            max_body_bytes: 8 * 1024 * 1024,
            shutdown_grace: Duration::from_secs(30),
        }
    }
}

/// What the handlers share: the backend once loaded, the API key, limits and counters.
///
/// Cheap to clone. The server starts before the model has loaded, so health checks and load
/// balancers see it come up; `/v1/*` answers 503 until [`ServerState::set_backend`] is called.
#[derive(Clone)]
pub struct ServerState {
    inner: Arc<Inner>,
}

struct Inner {
    backend: Arc<OnceLock<Arc<dyn Backend>>>,
    api_key: Option<String>,
    max_body_bytes: usize,
    shutdown_grace: Duration,
    metrics: Metrics,
}

impl ServerState {
    /// State for a server with `config`'s API key, body limit and grace period; no backend yet.
    pub fn new(config: &ServerConfig) -> Self {
        ServerState {
            inner: Arc::new(Inner {
                backend: Arc::new(OnceLock::new()),
                api_key: config.api_key.clone().filter(|k| !k.is_empty()),
                max_body_bytes: config.max_body_bytes,
                shutdown_grace: config.shutdown_grace,
                metrics: Metrics::default(),
            }),
        }
    }

    /// Makes the model available. Returns false (and keeps the first) if one was already set.
    pub fn set_backend(&self, backend: Arc<dyn Backend>) -> bool {
        self.inner.backend.set(backend).is_ok()
    }

    /// The slot itself, for a loader thread that should not hold the whole state.
    pub fn backend_slot(&self) -> Arc<OnceLock<Arc<dyn Backend>>> {
        Arc::clone(&self.inner.backend)
    }

    /// The backend, or `None` while the model loads.
    pub fn backend(&self) -> Option<Arc<dyn Backend>> {
        self.inner.backend.get().cloned()
    }

    pub(crate) fn api_key(&self) -> Option<&str> {
        self.inner.api_key.as_deref()
    }

    pub(crate) fn max_body_bytes(&self) -> usize {
        self.inner.max_body_bytes
    }

    pub(crate) fn shutdown_grace(&self) -> Duration {
        self.inner.shutdown_grace
    }

    pub(crate) fn metrics(&self) -> &Metrics {
        &self.inner.metrics
    }
}
