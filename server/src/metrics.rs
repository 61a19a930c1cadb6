//! The server's own counters and the Prometheus text that `/metrics` serves.
//!
//! Token totals and throughput come from the backend (the engine counts what it actually
//! prefilled and decoded); the server counts requests by endpoint and status, and requests in
//! flight. No metrics crate: the text format is a few lines, and this keeps the dependency tree
//! small.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use crate::backend::BackendStats;

/// Counters shared by every request.
#[derive(Debug, Default)]
pub(crate) struct Metrics {
    /// Answers by (endpoint, status). The endpoint is the route pattern (`/v1/models/{id}`), or
    /// `other` for unknown paths, so clients cannot grow the map without bound.
    requests: Mutex<BTreeMap<(String, u16), u64>>,
    in_flight: Arc<AtomicI64>,
}

/// Counts one completion request as in flight until dropped. A streamed response moves it into
/// its stream, so the request counts until its last byte, not just until the headers.
#[derive(Debug)]
pub(crate) struct InFlight(Arc<AtomicI64>);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

impl Metrics {
    /// Counts one answered request.
    pub fn record(&self, endpoint: &str, status: u16) {
        // A poisoned lock only means another request panicked mid-increment; counts stay usable.
        let mut map = self.requests.lock().unwrap_or_else(PoisonError::into_inner);
        *map.entry((endpoint.to_owned(), status)).or_insert(0) += 1;
    }

    pub fn in_flight(&self) -> InFlight {
        self.in_flight.fetch_add(1, Ordering::Relaxed);
        InFlight(Arc::clone(&self.in_flight))
    }

    /// The Prometheus text exposition (format 0.0.4). Backend gauges read 0 while the model loads.
    pub fn render(&self, stats: Option<&BackendStats>) -> String {
        let s = stats.cloned().unwrap_or_default();
        let mut out = String::new();
        header(
            &mut out,
            "kiln_requests_total",
            "counter",
            "HTTP requests answered, by endpoint and status.",
        );
        {
            let map = self.requests.lock().unwrap_or_else(PoisonError::into_inner);
            for ((endpoint, status), n) in map.iter() {
                let _ = writeln!(
                    out,
                    "kiln_requests_total{{endpoint=\"{}\",status=\"{status}\"}} {n}",
                    escape_label(endpoint)
                );
            }
        }
        let in_flight = self.in_flight.load(Ordering::Relaxed).max(0);
        let rows: [(&str, &str, &str, f64); 8] = [
            (
                "kiln_prompt_tokens_total",
                "counter",
                "Prompt tokens processed.",
                s.prompt_tokens_total as f64,
            ),
            (
                "kiln_generated_tokens_total",
                "counter",
                "Tokens generated.",
                s.generated_tokens_total as f64,
            ),
            (
                "kiln_queue_depth",
                "gauge",
                "Requests waiting for a slot.",
                s.queue_depth as f64,
            ),
            (
                "kiln_active_sequences",
                "gauge",
                "Sequences in the running batch.",
                s.active_sequences as f64,
            ),
            (
                "kiln_slots",
                "gauge",
                "Most sequences the engine runs at once.",
                s.slots as f64,
            ),
            (
                "kiln_prefill_tokens_per_second",
                "gauge",
                "Recent prefill throughput.",
                s.prefill_tok_s,
            ),
            (
                "kiln_decode_tokens_per_second",
                "gauge",
                "Recent decode throughput, all sequences.",
                s.decode_tok_s,
            ),
            (
                "kiln_requests_in_flight",
                "gauge",
                "Completion requests being answered.",
                in_flight as f64,
            ),
        ];
        for (name, kind, help, value) in rows {
            header(&mut out, name, kind, help);
            let _ = writeln!(out, "{name} {value}");
        }
        out
    }
}

fn header(out: &mut String, name: &str, kind: &str, help: &str) {
    let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
}

/// Escapes a label value as the text format requires.
fn escape_label(v: &str) -> String {
    v.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    // Proves request counts, the in-flight gauge and backend stats all appear, each with HELP/TYPE.
    #[test]
    fn renders_every_series() {
        let m = Metrics::default();
        m.record("/v1/chat/completions", 200);
        m.record("/v1/chat/completions", 200);
        m.record("other", 404);
        let guard = m.in_flight();
        let stats = BackendStats {
            queue_depth: 2,
            slots: 8,
            decode_tok_s: 12.5,
            ..Default::default()
        };
        let text = m.render(Some(&stats));
        assert!(text.contains("kiln_requests_total{endpoint=\"/v1/chat/completions\",status=\"200\"} 2"));
        assert!(text.contains("kiln_requests_total{endpoint=\"other\",status=\"404\"} 1"));
        assert!(text.contains("kiln_requests_in_flight 1\n"));
        assert!(text.contains("kiln_queue_depth 2\n") && text.contains("kiln_slots 8\n"));
        assert!(text.contains("kiln_decode_tokens_per_second 12.5\n"));
        assert_eq!(text.matches("# HELP").count(), 9);
        assert_eq!(text.matches("# TYPE").count(), 9);
        drop(guard);
        assert!(m.render(None).contains("kiln_requests_in_flight 0\n"));
    }

    // Proves label values cannot break the exposition format.
    #[test]
    fn escapes_labels() {
        assert_eq!(escape_label("a\"b\\c\nd"), "a\\\"b\\\\c\\nd");
    }
}
