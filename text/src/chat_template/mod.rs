//! Chat templates: renders a conversation into the prompt text a chat model was trained on,
//! the way `transformers`' `apply_chat_template(messages, tokenize=False, ...)` does.
//!
//! The template is the model's own Jinja source ([`Tokenizer::chat_template`]), run by
//! MiniJinja set up like `transformers` sets up Jinja2 (`_compile_jinja_template`):
//!
//! * `trim_blocks` and `lstrip_blocks` on, a single trailing newline of the template dropped
//!   (`keep_trailing_newline` off), no autoescaping: `<`, `&` and quotes pass through as they are.
//! * Undefined values are Jinja2's default ones: they print as nothing, iterate as empty and
//!   are false, and looking anything up on them is an error.
//! * `raise_exception(msg)` stops the render with [`ChatTemplateError::Raised`] carrying `msg`;
//!   `strftime_now(fmt)` formats the local time (or [`RenderOptions::now`]) like Python's
//!   `datetime.now().strftime(fmt)`; `namespace()`, `dict()`, `range()` and loop controls
//!   (`break`, `continue`) are there.
//! * `tojson` is `json.dumps(x, ensure_ascii=False, indent=None, separators=None,
//!   sort_keys=False)`, Python's float formatting and key order included.
//! * Python's string, dict and list methods that templates call (`.strip()`, `.startswith()`,
//!   `.split()`, `.items()`, `.get()`...), with Python's whitespace for the strip family and the
//!   `trim` filter; `{{ x }}` prints `None`, `True`, `1.0`, `['a']` as Python's `str()` does.
//! * `{% generation %}...{% endgeneration %}` (the assistant-mask tag of `transformers`) renders
//!   its body.
//!
//! The variables a template sees are those `apply_chat_template` passes: `messages` (each a map
//! with `role` and `content`, plus `reasoning_content` and its alias `thinking` when given),
//! `add_generation_prompt`, `tools` and `documents` (`None` unless given: `transformers` passes
//! them explicitly, so `tools is defined` holds and `tools is none` tells), `bos_token` and
//! `eos_token` when the tokenizer has them, `enable_thinking` only when set, and anything in
//! [`RenderOptions::extra`].
//!
//! A rendered prompt holds its special tokens as text (often the BOS too): encode it with
//! `add_special_tokens = false`, as `apply_chat_template` does.
//!
//! # Multi-turn chat
//!
//! There is no incremental rendering: render the whole conversation each turn, encode it, and
//! compare the token ids with those already in the KV cache; prefill from the first id that
//! differs. The new rendering is *not* always an extension of the previous one, so the
//! comparison is needed:
//!
//! * the model's reply ends at its end-of-turn token, while the template writes more after it
//!   (ChatML adds `"\n"` after `<|im_end|>`);
//! * templates rewrite history: Qwen3 drops the `<think>...</think>` block of assistant turns
//!   before the last user message, and the empty think block that `enable_thinking = false`
//!   puts into the generation prompt is not in the re-rendered turn;
//! * Llama 3.2 writes today's date into the system header (`strftime_now`), which changes at
//!   midnight: pin [`RenderOptions::now`] for a session to keep it stable.
//!
//! [`Tokenizer::chat_template`]: crate::tokenizer::Tokenizer::chat_template

mod python;
#[cfg(test)]
mod tests;

use minijinja::syntax::SyntaxConfig;
use minijinja::value::{Rest, ValueKind, ValueOrKwargs};
use minijinja::{AutoEscape, Environment, Error, ErrorKind, UndefinedBehavior, Value};

use crate::tokenizer::Tokenizer;

pub use python::DateTime;

const TEMPLATE_NAME: &str = "chat_template";

/// Why a chat template could not be loaded or rendered. Every message is one line.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ChatTemplateError {
    /// The model ships no chat template.
    #[error("model {model} has no chat template; run without --chat")]
    Missing { model: String },
    /// The template does not parse.
    #[error("chat template syntax error{}: {message}", at_line(*.line))]
    Syntax { line: Option<usize>, message: String },
    /// The template called `raise_exception(message)`: it rejects the conversation.
    #[error("the chat template rejected the conversation: {0}")]
    Raised(String),
    /// Rendering failed otherwise (an undefined value looked into, a bad filter argument...).
    #[error("chat template render error{}: {message}", at_line(*.line))]
    Render { line: Option<usize>, message: String },
    /// `apply_chat_template` refuses an empty conversation, and so does this.
    #[error("cannot apply a chat template to an empty conversation")]
    EmptyConversation,
    /// [`RenderOptions::tools`] or [`RenderOptions::extra`] is not the JSON it should be.
    #[error("invalid chat template option {option}: {message}")]
    Options { option: &'static str, message: String },
}

fn at_line(line: Option<usize>) -> String {
    line.map(|l| format!(" at line {l}")).unwrap_or_default()
}

fn one_line(s: &str) -> String {
    s.split(['\n', '\r'])
        .filter(|p| !p.is_empty())
        .collect::<Vec<_>>()
        .join(" ")
}

/// One message of a conversation (serialized as `{"role", "content", "reasoning_content"?}`,
/// the OpenAI-style shape `apply_chat_template` takes).
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Message {
    /// `system`, `user`, `assistant` (or whatever else the template knows, e.g. `tool`).
    pub role: String,
    pub content: String,
    /// An assistant turn's reasoning, for templates that read `reasoning_content` (Qwen3).
    /// Without it, Qwen3's template takes the reasoning from a `<think>...</think>` prefix of
    /// `content`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
}

impl Message {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Message {
        Message {
            role: role.into(),
            content: content.into(),
            reasoning_content: None,
        }
    }

    pub fn system(content: impl Into<String>) -> Message {
        Message::new("system", content)
    }

    pub fn user(content: impl Into<String>) -> Message {
        Message::new("user", content)
    }

    pub fn assistant(content: impl Into<String>) -> Message {
        Message::new("assistant", content)
    }

    /// The map the template sees. Like `transformers`, a reasoning text is also given as
    /// `thinking` (the name gpt-oss templates read).
    fn to_value(&self) -> Value {
        let mut pairs: Vec<(&str, Value)> = Vec::with_capacity(4);
        if let Some(r) = &self.reasoning_content {
            pairs.push(("thinking", Value::from(r.as_str())));
        }
        pairs.push(("role", Value::from(self.role.as_str())));
        pairs.push(("content", Value::from(self.content.as_str())));
        if let Some(r) = &self.reasoning_content {
            pairs.push(("reasoning_content", Value::from(r.as_str())));
        }
        Value::from_pairs(pairs)
    }
}

/// How to render, beyond the messages.
#[derive(Clone, Debug, Default)]
pub struct RenderOptions {
    /// End with the header of an assistant turn, for the model to write the reply.
    pub add_generation_prompt: bool,
    /// Passed as `enable_thinking` only when set (Qwen3: `Some(false)` asks for no reasoning).
    pub enable_thinking: Option<bool>,
    /// The JSON text of a list of tool schemas, passed as `tools` (`None` passes `None`). Kept
    /// as text so that key order survives as written, as in Python's dicts.
    pub tools: Option<String>,
    /// The JSON text of an object whose entries become more template variables, like extra
    /// keyword arguments of `apply_chat_template` (e.g. `{"date_string": "26 Jul 2024"}`).
    /// They override `bos_token`/`eos_token`, but not `messages`, `tools`, `documents`,
    /// `add_generation_prompt` or `enable_thinking`.
    pub extra: Option<String>,
    /// The time `strftime_now` formats; `None` is the local time at the call.
    pub now: Option<DateTime>,
}

/// A compiled chat template, with the special tokens it may print.
pub struct ChatTemplate {
    env: Environment<'static>,
    bos_token: Option<String>,
    eos_token: Option<String>,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("bos_token", &self.bos_token)
            .field("eos_token", &self.eos_token)
            .finish_non_exhaustive()
    }
}

/// What `raise_exception` raises, found again in the error's source chain.
#[derive(Debug)]
struct Raised(String);

impl std::fmt::Display for Raised {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Raised {}

/// Rewrites `{% generation %}` / `{% endgeneration %}` (a `transformers` extension tag) to
/// `{% if true %}` / `{% endif %}`: the same output and the same whitespace control, lines kept.
fn rewrite_generation_tags(source: &str) -> String {
    let mut out = String::with_capacity(source.len());
    let mut rest = source;
    while let Some(pos) = rest.find("{%") {
        out.push_str(&rest[..pos]);
        let tag = &rest[pos..];
        let inner_start = 2 + usize::from(tag[2..].starts_with(['-', '+']));
        let after_ws = tag[inner_start..].trim_start_matches([' ', '\t', '\n', '\r']);
        let word_start = tag.len() - after_ws.len();
        let (word, replacement) = if after_ws.starts_with("endgeneration") {
            ("endgeneration", "endif")
        } else if after_ws.starts_with("generation") {
            ("generation", "if true")
        } else {
            ("", "")
        };
        let tail = &after_ws[word.len()..];
        let closes = tail
            .trim_start_matches([' ', '\t', '\n', '\r'])
            .trim_start_matches(['-', '+'])
            .starts_with("%}");
        if word.is_empty() || !closes {
            out.push_str("{%");
            rest = &tag[2..];
            continue;
        }
        out.push_str(&tag[..word_start]);
        out.push_str(replacement);
        rest = tail;
    }
    out.push_str(rest);
    out
}

fn error_message(err: &Error) -> String {
    let mut message = match err.detail() {
        Some(detail) => format!("{}: {detail}", err.kind()),
        None => err.kind().to_string(),
    };
    let mut source = std::error::Error::source(err);
    while let Some(s) = source {
        message.push_str(": ");
        message.push_str(&s.to_string());
        source = s.source();
    }
    one_line(&message)
}

fn raised_message(err: &Error) -> Option<String> {
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(err);
    while let Some(s) = source {
        if let Some(Raised(msg)) = s.downcast_ref::<Raised>() {
            return Some(msg.clone());
        }
        source = s.source();
    }
    None
}

fn new_environment() -> Environment<'static> {
    let mut env = Environment::new();
    let syntax = SyntaxConfig::builder()
        .trim_blocks(true)
        .lstrip_blocks(true)
        .keep_trailing_newline(false)
        .build()
        .expect("the default delimiters are valid");
    env.set_syntax(syntax);
    env.set_auto_escape_callback(|_| AutoEscape::None);
    env.set_undefined_behavior(UndefinedBehavior::Lenient);
    env.set_unknown_method_callback(python::unknown_method);
    env.set_formatter(|out, _state, value| {
        let text = match value.as_str() {
            Some(s) => std::borrow::Cow::Borrowed(s),
            None => std::borrow::Cow::Owned(python::py_str(value)),
        };
        out.write_str(&text).map_err(Error::from)
    });
    env.add_filter("tojson", |value: &Value, args: Rest<ValueOrKwargs>| {
        python::tojson_filter(value, args)
    });
    env.add_filter("trim", python::trim_filter);
    env.add_filter("string", python::string_filter);
    // Jinja2's tests where Python's types differ from MiniJinja's defaults: a bool is a
    // number, strings and dicts are sequences, and `None` is not iterable (Qwen3-Coder's
    // template asks `tools is iterable` of a `None`).
    env.add_test("number", |v: &Value| {
        matches!(v.kind(), ValueKind::Number | ValueKind::Bool)
    });
    env.add_test("sequence", |v: &Value| {
        matches!(
            v.kind(),
            ValueKind::Undefined | ValueKind::Seq | ValueKind::Map | ValueKind::String
        )
    });
    env.add_test("iterable", |v: &Value| {
        matches!(
            v.kind(),
            ValueKind::Undefined
                | ValueKind::String
                | ValueKind::Bytes
                | ValueKind::Seq
                | ValueKind::Map
                | ValueKind::Iterable
        )
    });
    env.add_function("raise_exception", |message: Value| -> Result<Value, Error> {
        let message = python::py_str(&message);
        Err(Error::new(ErrorKind::InvalidOperation, message.clone()).with_source(Raised(message)))
    });
    env
}

fn parse_json(option: &'static str, text: &str) -> Result<Value, ChatTemplateError> {
    serde_json::from_str::<Value>(text).map_err(|e| ChatTemplateError::Options {
        option,
        message: one_line(&e.to_string()),
    })
}

impl ChatTemplate {
    /// Compiles `source`. A syntax error is reported with its line in the template.
    pub fn new(
        source: &str,
        bos_token: Option<&str>,
        eos_token: Option<&str>,
    ) -> Result<ChatTemplate, ChatTemplateError> {
        let mut env = new_environment();
        env.add_template_owned(TEMPLATE_NAME, rewrite_generation_tags(source))
            .map_err(|e| ChatTemplateError::Syntax {
                line: e.line(),
                message: one_line(e.detail().unwrap_or(&e.kind().to_string())),
            })?;
        Ok(ChatTemplate {
            env,
            bos_token: bos_token.map(str::to_owned),
            eos_token: eos_token.map(str::to_owned),
        })
    }

    /// The tokenizer's chat template with its BOS and EOS tokens; `None` when it has none.
    pub fn from_tokenizer(tokenizer: &Tokenizer) -> Result<Option<ChatTemplate>, ChatTemplateError> {
        tokenizer
            .chat_template()
            .map(|source| ChatTemplate::new(source, tokenizer.bos_token(), tokenizer.eos_token()))
            .transpose()
    }

    /// Like [`ChatTemplate::from_tokenizer`], but a missing template is an error naming `model`
    /// ("model X has no chat template; run without --chat").
    pub fn require(tokenizer: &Tokenizer, model: &str) -> Result<ChatTemplate, ChatTemplateError> {
        ChatTemplate::from_tokenizer(tokenizer)?.ok_or_else(|| ChatTemplateError::Missing {
            model: model.to_owned(),
        })
    }

    pub fn bos_token(&self) -> Option<&str> {
        self.bos_token.as_deref()
    }

    pub fn eos_token(&self) -> Option<&str> {
        self.eos_token.as_deref()
    }

    /// Renders `messages` as `apply_chat_template(messages, tokenize=False, ...)` would.
    pub fn render(&self, messages: &[Message], opts: &RenderOptions) -> Result<String, ChatTemplateError> {
        if messages.is_empty() {
            return Err(ChatTemplateError::EmptyConversation);
        }
        let mut ctx: Vec<(String, Value)> = Vec::new();
        fn set(ctx: &mut Vec<(String, Value)>, key: &str, value: Value) {
            match ctx.iter_mut().find(|(k, _)| k == key) {
                Some(entry) => entry.1 = value,
                None => ctx.push((key.to_owned(), value)),
            }
        }
        if let Some(bos) = &self.bos_token {
            set(&mut ctx, "bos_token", Value::from(bos.as_str()));
        }
        if let Some(eos) = &self.eos_token {
            set(&mut ctx, "eos_token", Value::from(eos.as_str()));
        }
        if let Some(extra) = &opts.extra {
            let extra = parse_json("extra", extra)?;
            if extra.kind() != ValueKind::Map {
                return Err(ChatTemplateError::Options {
                    option: "extra",
                    message: "expected a JSON object".into(),
                });
            }
            for key in extra.try_iter().map_err(|e| ChatTemplateError::Options {
                option: "extra",
                message: error_message(&e),
            })? {
                let value = extra.get_item(&key).unwrap_or_default();
                set(&mut ctx, &python::py_str(&key), value);
            }
        }
        if let Some(thinking) = opts.enable_thinking {
            set(&mut ctx, "enable_thinking", Value::from(thinking));
        }
        let tools = match &opts.tools {
            Some(text) => {
                let tools = parse_json("tools", text)?;
                if tools.kind() != ValueKind::Seq {
                    return Err(ChatTemplateError::Options {
                        option: "tools",
                        message: "expected a JSON array".into(),
                    });
                }
                tools
            }
            None => Value::from(()),
        };
        let now = opts.now;
        let strftime_now = Value::from_function(move |format: String| -> Result<String, Error> {
            now.unwrap_or_else(DateTime::now)
                .strftime(&format)
                .map_err(|e| Error::new(ErrorKind::InvalidOperation, e))
        });
        set(&mut ctx, "strftime_now", strftime_now);
        let messages: Vec<Value> = messages.iter().map(Message::to_value).collect();
        set(&mut ctx, "messages", Value::from(messages));
        set(&mut ctx, "tools", tools);
        set(&mut ctx, "documents", Value::from(()));
        set(
            &mut ctx,
            "add_generation_prompt",
            Value::from(opts.add_generation_prompt),
        );

        let template = self
            .env
            .get_template(TEMPLATE_NAME)
            .expect("the template was added in `new`");
        template
            .render(Value::from_pairs(ctx))
            .map_err(|e| match raised_message(&e) {
                Some(msg) => ChatTemplateError::Raised(one_line(&msg)),
                None => ChatTemplateError::Render {
                    line: e.line(),
                    message: error_message(&e),
                },
            })
    }
}

// A compiled template can be shared between threads.
const _: fn() = || {
    fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<ChatTemplate>();
};
