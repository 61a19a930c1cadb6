//! Reading `tokenizer_config.json` (and the `eos_token_id` of `generation_config.json`).
//!
//! Only the keys that change what the tokenizer does, or that a caller needs, are read; every
//! other key is ignored. A key with an unexpected JSON type is an error naming the file and
//! the key.

use serde_json::{Map, Value};

use super::TokenizerError;

/// One token as `tokenizer_config.json` describes it: a plain string, or the object form
/// `{"content": ..., "special": ..., "lstrip": ..., ...}` (with or without `"__type"`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct TokenSpec {
    pub content: String,
    /// `None` where the file does not say (a plain string).
    pub special: Option<bool>,
    pub lstrip: bool,
    pub rstrip: bool,
    pub single_word: bool,
    /// `None` where the file does not say.
    pub normalized: Option<bool>,
}

/// What Kiln takes from `tokenizer_config.json`.
#[derive(Debug, Clone, Default)]
pub(crate) struct TokenizerConfig {
    pub tokenizer_class: Option<String>,
    pub bos_token: Option<TokenSpec>,
    pub eos_token: Option<TokenSpec>,
    pub unk_token: Option<TokenSpec>,
    pub pad_token: Option<TokenSpec>,
    /// `sep_token`, `cls_token`, `mask_token`: named special tokens Kiln does not otherwise use.
    pub other_named_tokens: Vec<TokenSpec>,
    /// `additional_special_tokens` / `extra_special_tokens`.
    pub extra_special_tokens: Vec<TokenSpec>,
    /// `added_tokens_decoder`, by increasing id.
    pub added_tokens: Vec<(u32, TokenSpec)>,
    pub add_bos_token: Option<bool>,
    pub add_eos_token: Option<bool>,
    pub legacy: Option<bool>,
    pub add_prefix_space: Option<bool>,
    pub split_special_tokens: bool,
    /// The default chat template, if any.
    pub chat_template: Option<String>,
    /// Every named template of a list-form `chat_template`, in file order.
    pub named_chat_templates: Vec<(String, String)>,
}

fn invalid(file: &str, key: &str, expected: &str) -> TokenizerError {
    TokenizerError::Invalid {
        file: file.to_string(),
        message: format!("key \"{key}\" should be {expected}"),
    }
}

fn token_spec(file: &str, key: &str, v: &Value) -> Result<Option<TokenSpec>, TokenizerError> {
    match v {
        Value::Null => Ok(None),
        Value::String(s) => Ok(Some(TokenSpec {
            content: s.clone(),
            special: None,
            lstrip: false,
            rstrip: false,
            single_word: false,
            normalized: None,
        })),
        Value::Object(o) => {
            let content = o
                .get("content")
                .and_then(Value::as_str)
                .ok_or_else(|| invalid(file, key, "a string or an object with a \"content\" string"))?;
            let flag = |name: &str| -> Result<Option<bool>, TokenizerError> {
                match o.get(name) {
                    None | Some(Value::Null) => Ok(None),
                    Some(Value::Bool(b)) => Ok(Some(*b)),
                    Some(_) => Err(invalid(file, &format!("{key}.{name}"), "a boolean")),
                }
            };
            Ok(Some(TokenSpec {
                content: content.to_string(),
                special: flag("special")?,
                lstrip: flag("lstrip")?.unwrap_or(false),
                rstrip: flag("rstrip")?.unwrap_or(false),
                single_word: flag("single_word")?.unwrap_or(false),
                normalized: flag("normalized")?,
            }))
        }
        _ => Err(invalid(
            file,
            key,
            "null, a string or an object with a \"content\" string",
        )),
    }
}

fn opt_bool(file: &str, o: &Map<String, Value>, key: &str) -> Result<Option<bool>, TokenizerError> {
    match o.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Bool(b)) => Ok(Some(*b)),
        Some(_) => Err(invalid(file, key, "a boolean")),
    }
}

impl TokenizerConfig {
    /// Parses the bytes of a `tokenizer_config.json`; `file` names it in errors.
    pub fn parse(file: &str, bytes: &[u8]) -> Result<TokenizerConfig, TokenizerError> {
        let value: Value = serde_json::from_slice(bytes).map_err(|e| TokenizerError::Json {
            file: file.to_string(),
            message: e.to_string(),
        })?;
        let Value::Object(o) = value else {
            return Err(TokenizerError::Invalid {
                file: file.to_string(),
                message: "the top level should be a JSON object".to_string(),
            });
        };
        let mut c = TokenizerConfig {
            tokenizer_class: match o.get("tokenizer_class") {
                None | Some(Value::Null) => None,
                Some(Value::String(s)) => Some(s.clone()),
                Some(_) => return Err(invalid(file, "tokenizer_class", "a string")),
            },
            ..TokenizerConfig::default()
        };
        let named = |key: &str| -> Result<Option<TokenSpec>, TokenizerError> {
            o.get(key).map_or(Ok(None), |v| token_spec(file, key, v))
        };
        c.bos_token = named("bos_token")?;
        c.eos_token = named("eos_token")?;
        c.unk_token = named("unk_token")?;
        c.pad_token = named("pad_token")?;
        for key in ["sep_token", "cls_token", "mask_token"] {
            if let Some(t) = named(key)? {
                c.other_named_tokens.push(t);
            }
        }
        for key in ["additional_special_tokens", "extra_special_tokens"] {
            match o.get(key) {
                None | Some(Value::Null) => {}
                Some(Value::Array(items)) => {
                    for item in items {
                        if let Some(t) = token_spec(file, key, item)? {
                            c.extra_special_tokens.push(t);
                        }
                    }
                }
                // transformers 5 also accepts a mapping of names to tokens (multimodal models).
                Some(Value::Object(items)) => {
                    for item in items.values() {
                        if let Some(t) = token_spec(file, key, item)? {
                            c.extra_special_tokens.push(t);
                        }
                    }
                }
                Some(_) => return Err(invalid(file, key, "a list of tokens")),
            }
        }
        match o.get("added_tokens_decoder") {
            None | Some(Value::Null) => {}
            Some(Value::Object(items)) => {
                for (id, item) in items {
                    let key = format!("added_tokens_decoder.{id}");
                    let id: u32 = id.parse().map_err(|_| invalid(file, &key, "keyed by a token id"))?;
                    if let Some(t) = token_spec(file, &key, item)? {
                        c.added_tokens.push((id, t));
                    }
                }
                c.added_tokens.sort_by_key(|(id, _)| *id);
            }
            Some(_) => return Err(invalid(file, "added_tokens_decoder", "an object")),
        }
        c.add_bos_token = opt_bool(file, &o, "add_bos_token")?;
        c.add_eos_token = opt_bool(file, &o, "add_eos_token")?;
        c.legacy = opt_bool(file, &o, "legacy")?;
        c.add_prefix_space = opt_bool(file, &o, "add_prefix_space")?;
        c.split_special_tokens = opt_bool(file, &o, "split_special_tokens")?.unwrap_or(false);

        match o.get("chat_template") {
            None | Some(Value::Null) => {}
            Some(Value::String(s)) => c.chat_template = Some(s.clone()),
            Some(Value::Array(items)) => {
                for item in items {
                    let name = item.get("name").and_then(Value::as_str);
                    let template = item.get("template").and_then(Value::as_str);
                    let (Some(name), Some(template)) = (name, template) else {
                        return Err(invalid(
                            file,
                            "chat_template",
                            "a string or a list of {\"name\", \"template\"} objects",
                        ));
                    };
                    c.named_chat_templates.push((name.to_string(), template.to_string()));
                }
                c.chat_template = c
                    .named_chat_templates
                    .iter()
                    .find(|(name, _)| name == "default")
                    .map(|(_, t)| t.clone());
            }
            Some(_) => {
                return Err(invalid(
                    file,
                    "chat_template",
                    "a string or a list of {\"name\", \"template\"} objects",
                ));
            }
        }
        Ok(c)
    }
}

/// The `eos_token_id` of a `generation_config.json` (a number or a list of numbers; absent or
/// null gives an empty list).
pub(crate) fn generation_eos_ids(file: &str, bytes: &[u8]) -> Result<Vec<u32>, TokenizerError> {
    let value: Value = serde_json::from_slice(bytes).map_err(|e| TokenizerError::Json {
        file: file.to_string(),
        message: e.to_string(),
    })?;
    let id = |v: &Value| -> Result<u32, TokenizerError> {
        v.as_u64()
            .and_then(|n| u32::try_from(n).ok())
            .ok_or_else(|| invalid(file, "eos_token_id", "a token id or a list of token ids"))
    };
    match value.get("eos_token_id") {
        None | Some(Value::Null) => Ok(Vec::new()),
        Some(Value::Array(items)) => items.iter().map(id).collect(),
        Some(v) => Ok(vec![id(v)?]),
    }
}
