//! Turns an OpenAI request body into a [`GenRequest`].
//!
//! The body is parsed as a `serde_json::Value` and read field by field rather than derived, so a
//! known field with the wrong type is a 400 that names the field (`param`), while unknown fields
//! (`tools`, `user`, `logit_bias`, ...) are ignored the way OpenAI-compatible servers usually do.
//! `null` counts as absent everywhere, as the official clients send it for unset options.

use serde_json::{Map, Value};

use crate::backend::{ChatMessage, GenRequest, Prompt, SamplingRequest};
use crate::errors::ApiError;

/// Most stop strings OpenAI accepts.
const MAX_STOP: usize = 4;

/// Everything a completion request asks for besides the prompt.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Parsed {
    /// The `model` field if given; it must name the loaded model.
    pub model: Option<String>,
    pub request: GenRequest,
    pub stream: bool,
    /// `stream_options.include_usage`: send a usage chunk before `[DONE]`.
    pub include_usage: bool,
}

/// Reads `/v1/chat/completions`.
pub(crate) fn parse_chat(body: &Value) -> Result<Parsed, ApiError> {
    let fields = Fields::of(body)?;
    let messages = match fields.get("messages") {
        Some(Value::Array(items)) if !items.is_empty() => items
            .iter()
            .enumerate()
            .map(|(i, m)| message(i, m))
            .collect::<Result<Vec<_>, _>>()?,
        Some(Value::Array(_)) => return Err(ApiError::invalid("messages", "`messages` must not be empty")),
        Some(_) => return Err(ApiError::invalid("messages", "`messages` must be an array")),
        None => return Err(ApiError::invalid("messages", "`messages` is required")),
    };
    // `max_completion_tokens` is the newer name; it wins when both are present.
    let max_tokens = match fields.u32("max_completion_tokens")? {
        Some(n) => Some(n),
        None => fields.u32("max_tokens")?,
    };
    common(&fields, Prompt::Chat(messages), max_tokens)
}

/// Reads `/v1/completions`: `prompt` is a string, or an array of exactly one string.
pub(crate) fn parse_completion(body: &Value) -> Result<Parsed, ApiError> {
    let fields = Fields::of(body)?;
    let prompt = match fields.get("prompt") {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(items)) => match items.as_slice() {
            [Value::String(s)] => s.clone(),
            _ => {
                return Err(ApiError::invalid(
                    "prompt",
                    "`prompt` must be a string or an array of exactly one string",
                ));
            }
        },
        Some(_) => return Err(ApiError::invalid("prompt", "`prompt` must be a string")),
        None => return Err(ApiError::invalid("prompt", "`prompt` is required")),
    };
    let max_tokens = fields.u32("max_tokens")?;
    common(&fields, Prompt::Text(prompt), max_tokens)
}

/// The options both endpoints share.
fn common(fields: &Fields<'_>, prompt: Prompt, max_tokens: Option<u32>) -> Result<Parsed, ApiError> {
    let model = fields.string("model")?;
    if fields.get("n").is_some_and(|n| n.as_u64() != Some(1)) {
        return Err(ApiError::invalid("n", "Only `n` = 1 is supported"));
    }
    let sampling = SamplingRequest {
        temperature: fields.f32("temperature", |t| t >= 0.0, "a number >= 0")?,
        top_p: fields.f32("top_p", |p| p > 0.0 && p <= 1.0, "a number in (0, 1]")?,
        // vLLM and llama.cpp take 0 or -1 as "no top-k".
        top_k: match fields.get("top_k") {
            None => None,
            Some(v) => match v.as_i64() {
                Some(k) if k <= 0 => None,
                Some(k) => Some(u32::try_from(k).unwrap_or(u32::MAX)),
                None => return Err(ApiError::invalid("top_k", "`top_k` must be an integer")),
            },
        },
        min_p: fields.f32("min_p", |p| (0.0..=1.0).contains(&p), "a number in [0, 1]")?,
        // OpenAI's seed is any integer; a negative one is used by its bit pattern.
        seed: match fields.get("seed") {
            None => None,
            Some(v) => match (v.as_u64(), v.as_i64()) {
                (Some(s), _) => Some(s),
                (None, Some(s)) => Some(s as u64),
                _ => return Err(ApiError::invalid("seed", "`seed` must be an integer")),
            },
        },
        presence_penalty: fields.f32("presence_penalty", |p| (-2.0..=2.0).contains(&p), "a number in [-2, 2]")?,
        frequency_penalty: fields.f32(
            "frequency_penalty",
            |p| (-2.0..=2.0).contains(&p),
            "a number in [-2, 2]",
        )?,
    };
    let stop = match fields.get("stop") {
        None => Vec::new(),
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(items)) => {
            if items.len() > MAX_STOP {
                return Err(ApiError::invalid(
                    "stop",
                    format!("`stop` takes at most {MAX_STOP} strings"),
                ));
            }
            items
                .iter()
                .map(|s| s.as_str().map(str::to_owned))
                .collect::<Option<Vec<_>>>()
                .ok_or_else(|| ApiError::invalid("stop", "`stop` must be a string or an array of strings"))?
        }
        Some(_) => {
            return Err(ApiError::invalid(
                "stop",
                "`stop` must be a string or an array of strings",
            ));
        }
    };
    // An empty stop string would end every generation at once; clients mean "none".
    let stop = stop.into_iter().filter(|s| !s.is_empty()).collect();
    let stream = fields.bool("stream")?.unwrap_or(false);
    // llama-server's and vLLM's extension: generate `max_tokens` whatever the model samples
    // (benchmarks need requests of a fixed length).
    let ignore_eos = fields.bool("ignore_eos")?.unwrap_or(false);
    // `null` kwargs mean none; a `null` stream_options is a wrong type, as before.
    let kwargs = fields.get("chat_template_kwargs").filter(|v| !v.is_null());
    let enable_thinking = nested_bool(kwargs, "chat_template_kwargs", "enable_thinking")?;
    let include_usage = nested_bool(fields.get("stream_options"), "stream_options", "include_usage")?.unwrap_or(false);
    Ok(Parsed {
        model,
        request: GenRequest {
            prompt,
            max_tokens,
            sampling,
            stop,
            ignore_eos,
            enable_thinking,
        },
        stream,
        include_usage,
    })
}

/// The boolean `outer.inner` of a request: absent or `null` is `None`; `outer` must be an
/// object and `inner` a boolean, else a 400 naming the field.
fn nested_bool(outer_value: Option<&Value>, outer: &str, inner: &str) -> Result<Option<bool>, ApiError> {
    match outer_value {
        None => Ok(None),
        Some(Value::Object(o)) => match o.get(inner) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(_) => Err(ApiError::invalid(
                format!("{outer}.{inner}"),
                format!("`{outer}.{inner}` must be a boolean"),
            )),
        },
        Some(_) => Err(ApiError::invalid(outer, format!("`{outer}` must be an object"))),
    }
}

/// Reads `messages[i]`, normalising the role and flattening the content.
fn message(i: usize, m: &Value) -> Result<ChatMessage, ApiError> {
    let Value::Object(m) = m else {
        return Err(ApiError::invalid(
            format!("messages[{i}]"),
            format!("`messages[{i}]` must be an object"),
        ));
    };
    let role = match m.get("role").and_then(Value::as_str) {
        Some("developer") => "system",
        Some(r @ ("system" | "user" | "assistant" | "tool")) => r,
        Some(other) => {
            return Err(ApiError::invalid(
                format!("messages[{i}].role"),
                format!(
                    "Invalid role `{other}` in `messages[{i}].role`; expected system, developer, user, assistant or tool"
                ),
            ));
        }
        None => {
            return Err(ApiError::invalid(
                format!("messages[{i}].role"),
                format!("`messages[{i}].role` must be a string"),
            ));
        }
    };
    let content = match m.get("content") {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(parts)) => text_parts(i, parts)?,
        // An assistant turn that only called tools has no content.
        None | Some(Value::Null) if role == "assistant" => String::new(),
        _ => {
            return Err(ApiError::invalid(
                format!("messages[{i}].content"),
                format!("`messages[{i}].content` must be a string or an array of text parts"),
            ));
        }
    };
    Ok(ChatMessage {
        role: role.to_owned(),
        content,
    })
}

/// Joins an OpenAI content-part array; only `{"type":"text","text":…}` parts are understood.
fn text_parts(i: usize, parts: &[Value]) -> Result<String, ApiError> {
    let mut texts = Vec::with_capacity(parts.len());
    for (j, part) in parts.iter().enumerate() {
        let param = format!("messages[{i}].content[{j}]");
        match part.get("type").and_then(Value::as_str) {
            Some("text") => match part.get("text").and_then(Value::as_str) {
                Some(t) => texts.push(t),
                None => {
                    return Err(ApiError::invalid(
                        param.clone(),
                        format!("`{param}.text` must be a string"),
                    ));
                }
            },
            Some(other) => {
                return Err(ApiError::invalid(
                    format!("{param}.type"),
                    format!("Content parts of type `{other}` are not supported; only `text`"),
                ));
            }
            None => {
                return Err(ApiError::invalid(
                    param.clone(),
                    format!("`{param}` needs a string `type`"),
                ));
            }
        }
    }
    Ok(texts.join("\n"))
}

/// The top-level object, with typed readers that name the field in their error.
struct Fields<'a>(&'a Map<String, Value>);

impl<'a> Fields<'a> {
    fn of(body: &'a Value) -> Result<Self, ApiError> {
        match body {
            Value::Object(map) => Ok(Fields(map)),
            _ => Err(ApiError::bad_request("The request body must be a JSON object")),
        }
    }

    /// The field's value; `null` reads as absent.
    fn get(&self, name: &str) -> Option<&'a Value> {
        self.0.get(name).filter(|v| !v.is_null())
    }

    fn string(&self, name: &str) -> Result<Option<String>, ApiError> {
        match self.get(name) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s.clone())),
            Some(_) => Err(ApiError::invalid(name, format!("`{name}` must be a string"))),
        }
    }

    fn bool(&self, name: &str) -> Result<Option<bool>, ApiError> {
        match self.get(name) {
            None => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(_) => Err(ApiError::invalid(name, format!("`{name}` must be a boolean"))),
        }
    }

    /// A non-negative integer; values past `u32::MAX` mean "as many as possible" and saturate.
    fn u32(&self, name: &str) -> Result<Option<u32>, ApiError> {
        match self.get(name) {
            None => Ok(None),
            Some(v) => match v.as_u64() {
                Some(n) => Ok(Some(u32::try_from(n).unwrap_or(u32::MAX))),
                None => Err(ApiError::invalid(
                    name,
                    format!("`{name}` must be a non-negative integer"),
                )),
            },
        }
    }

    /// A finite number for which `valid` holds; `expected` describes it in the error.
    fn f32(&self, name: &str, valid: impl Fn(f32) -> bool, expected: &str) -> Result<Option<f32>, ApiError> {
        match self.get(name) {
            None => Ok(None),
            Some(v) => match v.as_f64().map(|x| x as f32) {
                Some(x) if x.is_finite() && valid(x) => Ok(Some(x)),
                _ => Err(ApiError::invalid(name, format!("`{name}` must be {expected}"))),
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn chat(extra: Value) -> Result<Parsed, ApiError> {
        let mut body = json!({"messages":[{"role":"user","content":"hi"}]});
        if let (Value::Object(b), Value::Object(e)) = (&mut body, extra) {
            b.extend(e);
        }
        parse_chat(&body)
    }

    fn param_of(r: Result<Parsed, ApiError>) -> Option<String> {
        r.expect_err("should be rejected").param
    }

    // Proves every option reaches the GenRequest with the right value and nulls read as absent.
    #[test]
    fn reads_all_options() {
        let p = chat(json!({
            "model":"m","max_tokens":5,"temperature":0.5,"top_p":0.9,"top_k":40,"min_p":0.05,"seed":-1,
            "stop":"\n","presence_penalty":0.1,"frequency_penalty":null,"n":1,"stream":true,
            "stream_options":{"include_usage":true},"tools":[],"user":"x"
        }))
        .unwrap();
        assert_eq!(p.model.as_deref(), Some("m"));
        assert_eq!(p.request.max_tokens, Some(5));
        let s = &p.request.sampling;
        assert_eq!(
            (s.temperature, s.top_p, s.top_k, s.min_p),
            (Some(0.5), Some(0.9), Some(40), Some(0.05))
        );
        assert_eq!(
            (s.seed, s.presence_penalty, s.frequency_penalty),
            (Some(u64::MAX), Some(0.1), None)
        );
        assert_eq!(p.request.stop, vec!["\n".to_string()]);
        assert!(p.stream && p.include_usage);
    }

    // Proves max_completion_tokens wins over max_tokens and both must be non-negative integers.
    #[test]
    fn max_tokens_names() {
        assert_eq!(
            chat(json!({"max_tokens":3,"max_completion_tokens":7}))
                .unwrap()
                .request
                .max_tokens,
            Some(7)
        );
        assert_eq!(param_of(chat(json!({"max_tokens":-1}))).as_deref(), Some("max_tokens"));
        assert_eq!(
            param_of(chat(json!({"max_completion_tokens":"9"}))).as_deref(),
            Some("max_completion_tokens")
        );
        assert_eq!(param_of(chat(json!({"max_tokens":1.5}))).as_deref(), Some("max_tokens"));
    }

    // Proves wrong types and out-of-range values are rejected naming the field.
    #[test]
    fn wrong_types_name_the_field() {
        assert_eq!(
            param_of(chat(json!({"temperature":"hot"}))).as_deref(),
            Some("temperature")
        );
        assert_eq!(
            param_of(chat(json!({"temperature":-0.1}))).as_deref(),
            Some("temperature")
        );
        assert_eq!(param_of(chat(json!({"top_p":0}))).as_deref(), Some("top_p"));
        assert_eq!(param_of(chat(json!({"stream":"yes"}))).as_deref(), Some("stream"));
        assert_eq!(param_of(chat(json!({"stop":[1]}))).as_deref(), Some("stop"));
        assert_eq!(
            param_of(chat(json!({"stop":["a","b","c","d","e"]}))).as_deref(),
            Some("stop")
        );
        assert_eq!(param_of(chat(json!({"n":2}))).as_deref(), Some("n"));
        assert_eq!(param_of(chat(json!({"model":3}))).as_deref(), Some("model"));
        assert_eq!(
            param_of(chat(json!({"stream_options":{"include_usage":1}}))).as_deref(),
            Some("stream_options.include_usage")
        );
    }

    // Proves roles are normalised (developer -> system), unknown roles name messages[i].role,
    // and text parts are joined while other part types are refused.
    #[test]
    fn messages_are_normalised() {
        let p = parse_chat(&json!({"messages":[
            {"role":"developer","content":"be brief"},
            {"role":"user","content":[{"type":"text","text":"a"},{"type":"text","text":"b"}]},
            {"role":"assistant","content":null}
        ]}))
        .unwrap();
        let Prompt::Chat(m) = p.request.prompt else {
            panic!("not chat")
        };
        assert_eq!(
            m[0],
            ChatMessage {
                role: "system".into(),
                content: "be brief".into()
            }
        );
        assert_eq!(m[1].content, "a\nb");
        assert_eq!(m[2].content, "");
        let bad = parse_chat(&json!({"messages":[{"role":"user","content":"x"},{"role":"robot","content":"x"}]}));
        assert_eq!(param_of(bad).as_deref(), Some("messages[1].role"));
        let image = parse_chat(&json!({"messages":[{"role":"user","content":[{"type":"image_url"}]}]}));
        assert_eq!(param_of(image).as_deref(), Some("messages[0].content[0].type"));
        assert_eq!(
            param_of(parse_chat(&json!({"messages":[]}))).as_deref(),
            Some("messages")
        );
        assert!(parse_chat(&json!([1])).is_err());
    }

    // Proves /v1/completions takes a string or a one-string array and nothing else.
    #[test]
    fn completion_prompt_forms() {
        let p = parse_completion(&json!({"prompt":["once"]})).unwrap();
        assert_eq!(p.request.prompt, Prompt::Text("once".into()));
        assert_eq!(
            param_of(parse_completion(&json!({"prompt":["a","b"]}))).as_deref(),
            Some("prompt")
        );
        assert_eq!(
            param_of(parse_completion(&json!({"prompt":[1,2]}))).as_deref(),
            Some("prompt")
        );
        assert_eq!(param_of(parse_completion(&json!({}))).as_deref(), Some("prompt"));
    }
}
