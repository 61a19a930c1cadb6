//! The HTTP layer of `kiln serve`: an OpenAI-compatible API (`/v1/chat/completions`,
//! `/v1/completions`, `/v1/models`) plus `/health` and `/metrics`.
//!
//! The model sits behind the [`Backend`] trait, so this crate depends on no other Kiln crate and
//! builds and tests without LLVM. The engine runs on its own threads; the async runtime here only
//! moves bytes, and calls [`Backend::submit`] on its blocking pool.

mod backend;
mod completions;
mod errors;
mod metrics;
mod protocol;
mod request;
mod routes;
mod sse;
mod state;
#[cfg(any(test, feature = "testing"))]
pub mod testing;

use std::future::Future;
use std::time::Duration;

use anyhow::Context as _;
use tokio::net::TcpListener;
use tokio::sync::{oneshot, watch};

pub use backend::{
    Backend, BackendStats, ChatMessage, FinishReason, GenEvent, GenRequest, Prompt, SamplingRequest, SubmitError, Usage,
};
pub use state::{ServerConfig, ServerState};

/// After the grace period, how long aborted requests get to send their last bytes before
/// `serve` stops waiting for their connections.
const ABORT_DRAIN: Duration = Duration::from_secs(2);

/// Serves on `listener` until `shutdown` resolves, then shuts down gracefully.
///
/// On shutdown the server stops accepting connections and lets in-flight requests finish for up
/// to the state's `shutdown_grace`. Requests still running then are ended (a stream gets an
/// error event, a plain request a 503), which drops their receivers and so cancels them in the
/// backend; `serve` returns `Ok` at the latest [`ABORT_DRAIN`] after that.
pub async fn serve(
    listener: TcpListener,
    state: ServerState,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    let grace = state.shutdown_grace();
    let (abort_tx, abort_rx) = watch::channel(false);
    let (began_tx, began_rx) = oneshot::channel::<()>();
    let app = routes::router(routes::App::new(state, abort_rx));
    let server = axum::serve(listener, app).with_graceful_shutdown(async move {
        shutdown.await;
        tracing::info!(
            "shutting down: no new connections, {} s for requests in flight",
            grace.as_secs_f64()
        );
        let _ = began_tx.send(());
    });
    let server = std::future::IntoFuture::into_future(server);
    tokio::pin!(server);
    tokio::select! {
        result = &mut server => return result.context("the HTTP server failed"),
        Ok(()) = began_rx => {}
    }
    tokio::select! {
        result = &mut server => return result.context("the HTTP server failed"),
        () = tokio::time::sleep(grace) => {}
    }
    tracing::warn!("shutdown grace period over: cancelling the requests still in flight");
    let _ = abort_tx.send(true);
    match tokio::time::timeout(ABORT_DRAIN, &mut server).await {
        Ok(result) => result.context("the HTTP server failed"),
        Err(_) => {
            tracing::warn!("some connections did not close; leaving them");
            Ok(())
        }
    }
}

/// Runs the server on its own runtime until SIGTERM or SIGINT: binds `config.host:config.port`,
/// prints `listening on http://ADDR` to stderr (ADDR with the real port, so port 0 works), and
/// returns `Ok` after a graceful shutdown.
pub fn run_blocking(config: ServerConfig, state: ServerState) -> anyhow::Result<()> {
    run_on(bind(&config)?, state)
}

/// Binds `config.host:config.port` (an error names the address), for callers that must know
/// the port is theirs before starting anything else; then [`run_on`].
pub fn bind(config: &ServerConfig) -> anyhow::Result<std::net::TcpListener> {
    let addr = display_addr(&config.host, config.port);
    let listener = std::net::TcpListener::bind((config.host.as_str(), config.port))
        .with_context(|| format!("cannot listen on {addr}"))?;
    listener
        .set_nonblocking(true)
        .with_context(|| format!("cannot listen on {addr}"))?;
    Ok(listener)
}

/// [`run_blocking`] on a listener already bound: prints `listening on http://ADDR` and serves
/// until SIGTERM or SIGINT.
pub fn run_on(listener: std::net::TcpListener, state: ServerState) -> anyhow::Result<()> {
    // Two workers are plenty: handlers only move bytes; the engine has its own threads.
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("kiln-http")
        .enable_all()
        .build()
        .context("cannot start the HTTP runtime")?;
    let result = runtime.block_on(async {
        // The handlers are in place before the address is announced.
        let signal = shutdown_signal()?;
        let local = listener.local_addr().context("the listening socket has no address")?;
        let listener = TcpListener::from_std(listener).context("cannot use the listening socket")?;
        eprintln!("listening on http://{local}");
        serve(listener, state, signal).await
    });
    // Connection tasks left after `serve` returned are dropped here, without waiting on them.
    runtime.shutdown_timeout(Duration::from_secs(1));
    result
}

/// `host:port`, with brackets around an IPv6 host.
fn display_addr(host: &str, port: u16) -> String {
    if host.contains(':') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    }
}

/// A future that resolves on the first SIGINT (Ctrl-C) or SIGTERM. The handlers are installed
/// now, before the port is bound, so a signal sent once the server answers is never missed (and
/// never kills the process with the default action).
fn shutdown_signal() -> anyhow::Result<impl Future<Output = ()> + Send + 'static> {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        let mut int = signal(SignalKind::interrupt()).context("cannot listen for SIGINT")?;
        let mut term = signal(SignalKind::terminate()).context("cannot listen for SIGTERM")?;
        Ok(async move {
            tokio::select! {
                _ = int.recv() => {}
                _ = term.recv() => {}
            }
        })
    }
    #[cfg(not(unix))]
    {
        Ok(async {
            if tokio::signal::ctrl_c().await.is_err() {
                std::future::pending::<()>().await;
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // Proves bind errors and the banner name IPv6 hosts unambiguously.
    #[test]
    fn addresses() {
        assert_eq!(display_addr("127.0.0.1", 80), "127.0.0.1:80");
        assert_eq!(display_addr("::1", 80), "[::1]:80");
    }

    // Proves a port already taken is one clear error naming the address.
    #[test]
    fn bind_error_names_address() {
        let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = taken.local_addr().unwrap().port();
        let config = ServerConfig {
            port,
            ..ServerConfig::default()
        };
        let state = ServerState::new(&config);
        let err = run_blocking(config, state).unwrap_err();
        assert!(
            format!("{err:#}").starts_with(&format!("cannot listen on 127.0.0.1:{port}")),
            "{err:#}"
        );
    }
}
