//! `run_blocking` end to end: its own test binary, because it sends SIGTERM to this process.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kiln_server::testing::FakeBackend;
use kiln_server::{ServerConfig, ServerState, run_blocking};

/// `GET path` over a plain socket; `None` until the server accepts.
fn get(port: u16, path: &str) -> Option<String> {
    let mut stream = TcpStream::connect(("127.0.0.1", port)).ok()?;
    stream.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
    write!(stream, "GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").ok()?;
    let mut answer = String::new();
    stream.read_to_string(&mut answer).ok()?;
    Some(answer)
}

// Proves run_blocking serves on the configured port and returns Ok after SIGTERM.
#[cfg(unix)]
#[test]
fn sigterm_stops_run_blocking() {
    let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let config = ServerConfig {
        port,
        ..ServerConfig::default()
    };
    let state = ServerState::new(&config);
    state.set_backend(Arc::new(FakeBackend::new("tiny")));
    let server = std::thread::spawn(move || run_blocking(config, state));
    let start = Instant::now();
    let answer = loop {
        if let Some(answer) = get(port, "/health") {
            break answer;
        }
        assert!(start.elapsed() < Duration::from_secs(10), "the server never answered");
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    let status = std::process::Command::new("kill")
        .args(["-TERM", &std::process::id().to_string()])
        .status();
    assert!(status.unwrap().success());
    let start = Instant::now();
    while !server.is_finished() {
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "run_blocking did not return after SIGTERM"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    server.join().unwrap().unwrap();
}
