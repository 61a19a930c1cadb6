//! OpenAI response bodies: whole completions and stream chunks, for both endpoints.
//!
//! The shapes follow what OpenAI's API returns and its official Python client parses; fields it
//! fills that Kiln has nothing for (`logprobs`) are `null` rather than missing, because some
//! clients index them unconditionally.

use std::collections::hash_map::RandomState;
use std::hash::{BuildHasher, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use serde_json::{Value, json};

use crate::backend::{FinishReason, Usage};

/// Which endpoint a response belongs to; they differ in object names and where text goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    /// `/v1/chat/completions`: text in `message` / `delta`, reasoning in `reasoning_content`.
    Chat,
    /// `/v1/completions`: text in `choices[0].text`.
    Text,
}

/// What every body and chunk of one response repeats.
#[derive(Debug, Clone)]
pub(crate) struct Meta {
    pub kind: Kind,
    pub id: String,
    pub created: u64,
    pub model: String,
}

impl Meta {
    pub fn new(kind: Kind, model: String) -> Self {
        let prefix = match kind {
            Kind::Chat => "chatcmpl",
            Kind::Text => "cmpl",
        };
        Meta {
            kind,
            id: format!("{prefix}-{}", unique_hex()),
            created: unix_now(),
            model,
        }
    }

    fn object(&self, chunk: bool) -> &'static str {
        match (self.kind, chunk) {
            (Kind::Chat, false) => "chat.completion",
            (Kind::Chat, true) => "chat.completion.chunk",
            (Kind::Text, _) => "text_completion",
        }
    }

    fn envelope(&self, chunk: bool, choices: Value) -> Value {
        json!({
            "id": self.id,
            "object": self.object(chunk),
            "created": self.created,
            "model": self.model,
            "choices": choices,
        })
    }

    /// A complete, non-streamed response.
    pub fn full(&self, content: &str, reasoning: &str, finish: FinishReason, usage: Usage) -> Value {
        let choice = match self.kind {
            Kind::Chat => {
                let mut message = json!({"role": "assistant", "content": content});
                if !reasoning.is_empty() {
                    message["reasoning_content"] = json!(reasoning);
                }
                json!({"index": 0, "message": message, "finish_reason": finish.as_str(), "logprobs": null})
            }
            Kind::Text => json!({
                "index": 0,
                "text": format!("{reasoning}{content}"),
                "finish_reason": finish.as_str(),
                "logprobs": null,
            }),
        };
        let mut body = self.envelope(false, json!([choice]));
        body["usage"] = usage_json(usage);
        body
    }

    /// The chunk that opens a chat stream, announcing the role; text streams have none.
    pub fn role_chunk(&self) -> Option<Value> {
        match self.kind {
            Kind::Chat => Some(self.chunk(json!({"role": "assistant", "content": ""}), None)),
            Kind::Text => None,
        }
    }

    /// A chunk carrying new text; `None` when the delta is empty (nothing to send).
    pub fn delta_chunk(&self, content: &str, reasoning: &str) -> Option<Value> {
        if content.is_empty() && reasoning.is_empty() {
            return None;
        }
        match self.kind {
            Kind::Chat => {
                let mut delta = json!({});
                if !content.is_empty() {
                    delta["content"] = json!(content);
                }
                if !reasoning.is_empty() {
                    delta["reasoning_content"] = json!(reasoning);
                }
                Some(self.chunk(delta, None))
            }
            Kind::Text => Some(self.chunk(json!(format!("{reasoning}{content}")), None)),
        }
    }

    /// The last chunk with a choice: an empty delta and the finish reason.
    pub fn finish_chunk(&self, finish: FinishReason) -> Value {
        let empty = match self.kind {
            Kind::Chat => json!({}),
            Kind::Text => json!(""),
        };
        self.chunk(empty, Some(finish))
    }

    /// The `stream_options.include_usage` chunk: no choices, only usage.
    pub fn usage_chunk(&self, usage: Usage) -> Value {
        let mut body = self.envelope(true, json!([]));
        body["usage"] = usage_json(usage);
        body
    }

    /// `payload` is the chat `delta` object or the completion `text`.
    fn chunk(&self, payload: Value, finish: Option<FinishReason>) -> Value {
        let key = match self.kind {
            Kind::Chat => "delta",
            Kind::Text => "text",
        };
        let choice = json!({
            "index": 0,
            key: payload,
            "finish_reason": finish.map(FinishReason::as_str),
            "logprobs": null,
        });
        self.envelope(true, json!([choice]))
    }
}

fn usage_json(u: Usage) -> Value {
    json!({
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens.saturating_add(u.completion_tokens),
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
    })
}

/// Seconds since the Unix epoch, for `created`.
pub(crate) fn unix_now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

/// 24 hex digits unlikely to repeat across requests and restarts: a per-process random key
/// (std's `RandomState`) hashed with a counter and the clock. No `rand` dependency for an id.
fn unique_hex() -> String {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let nanos = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_nanos());
    let mut h = RandomState::new().build_hasher();
    h.write_u64(n);
    h.write_u128(nanos);
    format!("{:016x}{:08x}", h.finish(), n as u32)
}

#[cfg(test)]
mod tests {
    use super::*;

    // Proves a chat body carries every OpenAI field, and reasoning only when there is some.
    #[test]
    fn chat_full_body() {
        let m = Meta::new(Kind::Chat, "tiny".into());
        let usage = Usage {
            prompt_tokens: 3,
            completion_tokens: 2,
            cached_tokens: 1,
        };
        let v = m.full("hi", "", FinishReason::Stop, usage);
        assert!(v["id"].as_str().unwrap().starts_with("chatcmpl-"));
        assert_eq!(v["object"], "chat.completion");
        assert_eq!(v["choices"][0]["message"], json!({"role":"assistant","content":"hi"}));
        assert_eq!(v["usage"]["total_tokens"], 5);
        assert_eq!(v["usage"]["prompt_tokens_details"]["cached_tokens"], 1);
        let v = m.full("hi", "hmm", FinishReason::Length, usage);
        assert_eq!(v["choices"][0]["message"]["reasoning_content"], "hmm");
        assert_eq!(v["choices"][0]["finish_reason"], "length");
    }

    // Proves text chunks put text in `text` and chat chunks in `delta`, with null finish_reason
    // until the end, and that empty deltas produce no chunk.
    #[test]
    fn chunks() {
        let t = Meta::new(Kind::Text, "tiny".into());
        assert!(t.role_chunk().is_none());
        assert_eq!(t.delta_chunk("b", "a").unwrap()["choices"][0]["text"], "ab");
        assert_eq!(
            t.finish_chunk(FinishReason::Stop)["choices"][0]["finish_reason"],
            "stop"
        );
        let c = Meta::new(Kind::Chat, "tiny".into());
        let d = c.delta_chunk("", "think").unwrap();
        assert_eq!(d["choices"][0]["delta"], json!({"reasoning_content":"think"}));
        assert!(d["choices"][0]["finish_reason"].is_null());
        assert!(c.delta_chunk("", "").is_none());
        assert_eq!(c.usage_chunk(Usage::default())["choices"], json!([]));
        assert_ne!(Meta::new(Kind::Chat, "x".into()).id, c.id);
    }
}
