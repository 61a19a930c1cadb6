//! The tokenizer: Hugging Face `tokenizer.json` files, encoded and decoded exactly as
//! `transformers` 5's `AutoTokenizer` does, through the `tokenizers` crate.
//!
//! What `transformers` 5 does on top of `tokenizer.json`, and so what [`Tokenizer`] does:
//!
//! * **BOS/EOS insertion** is decided by the post-processor of `tokenizer.json` alone. The
//!   `add_bos_token` / `add_eos_token` keys of `tokenizer_config.json` are *ignored* when a
//!   `tokenizer.json` exists (`PreTrainedTokenizerBase._from_pretrained` drops them), and a
//!   null post-processor adds nothing.
//! * **Llama (SentencePiece) tokenizers are rebuilt**: when `tokenizer_class` is
//!   `LlamaTokenizer`/`LlamaTokenizerFast` and `tokenizer.json` is not byte-level,
//!   `LlamaTokenizer.__init__` replaces the normalizer, pre-tokenizer, decoder and BPE options
//!   of the file: no normalizer, a `Metaspace` pre-tokenizer (prepend scheme `first`, or
//!   `always` with `"legacy": true`, or `never` with `"add_prefix_space": false`), and a
//!   Replace/ByteFallback/Fuse(/Strip) decoder. This differs from the old files' `Prepend` +
//!   `Replace` normalizer: no `▁` is prepended after a special token, nor before text that
//!   already starts with a space. [`Tokenizer`] applies the same rebuild. Other classes use
//!   `tokenizer.json` as it is: exact for `PreTrainedTokenizerFast`/`TokenizersBackend`
//!   (Llama 3) and `Qwen2Tokenizer` (whose rebuild equals Qwen's shipped pipeline). Not
//!   emulated: the rebuilds of other classes, e.g. `GPT2Tokenizer` (SmolLM), which
//!   `transformers` 5 gives a plain `ByteLevel` pre-tokenizer, dropping a `Digits` split.
//! * Tokens that `tokenizer_config.json` names (`added_tokens_decoder`, `bos_token`,
//!   `eos_token`, `unk_token`, `pad_token`, `sep/cls/mask_token`,
//!   `additional_special_tokens`/`extra_special_tokens`) and that are not yet added tokens of
//!   `tokenizer.json` are added (named ones as special), keeping their vocabulary id if they
//!   have one. Truncation and padding settings of `tokenizer.json` are turned off (HF's
//!   `tokenizer(text)` does not truncate or pad by default). `split_special_tokens: true` is
//!   honoured.
//! * Decoding is the `tokenizers` decoder's output; `clean_up_tokenization_spaces` is not
//!   applied, as `transformers` 5 ignores it for BPE models (all Llama/Qwen tokenizers).
//!
//! End-of-sequence ids ([`Tokenizer::eos_token_ids`]): the id of `tokenizer_config.json`'s
//! `eos_token`, then those of `generation_config.json`'s `eos_token_id` (a number or a list)
//! when [`Tokenizer::from_dir`] finds that file; generation should stop at any of them.
//!
//! Chat templates: the raw Jinja source is kept ([`Tokenizer::chat_template`]); rendering is
//! up to the caller. A rendered prompt already holds its special tokens (often `bos_token`
//! too), so encode it with `add_special_tokens = false`, as `apply_chat_template` does.

use std::collections::HashSet;
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use serde_json::{Value, json};
use tokenizers::AddedToken;

mod bpe_table;
mod config;
mod engine;
#[cfg(test)]
mod expected;
mod fast;
mod stream;
mod table_cache;
#[cfg(test)]
mod tests;

pub use fast::BpeParts;
pub use stream::TextStreamer;
pub use table_cache::TableCache;

use config::{TokenSpec, TokenizerConfig, generation_eos_ids};
use engine::{Engine, KilnModel};

/// Why a tokenizer could not be loaded or used. The message is one line naming the file and
/// the problem.
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    /// A required file is absent.
    #[error("{}: not found (a model directory needs a tokenizer.json)", path.display())]
    Missing {
        /// The path looked for.
        path: PathBuf,
    },
    /// A file is there but is not a regular file (a FIFO, a device, a directory), is a symlink
    /// loop, or could not be read.
    #[error(transparent)]
    File(#[from] kiln_core::files::FileError),
    /// A file is not valid JSON.
    #[error("{file}: malformed JSON: {message}")]
    Json {
        /// The file (its path, or its usual name for in-memory data).
        file: String,
        /// The parser's message.
        message: String,
    },
    /// A file is JSON but not what a tokenizer file should contain.
    #[error("{file}: invalid: {message}")]
    Invalid {
        /// The file.
        file: String,
        /// What is wrong.
        message: String,
    },
    /// `tokenizer.json` describes something the `tokenizers` crate does not implement.
    #[error("{file}: unsupported tokenizer: {message}")]
    Unsupported {
        /// The file.
        file: String,
        /// What is not supported.
        message: String,
    },
    /// Encoding failed.
    #[error("tokenizer: cannot encode text: {0}")]
    Encode(String),
    /// Decoding failed (e.g. an id outside the vocabulary with some decoders).
    #[error("tokenizer: cannot decode ids: {0}")]
    Decode(String),
}

/// A loaded tokenizer. Cheap to clone (the data is shared); `Send` and `Sync`.
#[derive(Clone)]
pub struct Tokenizer {
    inner: Arc<Inner>,
}

struct Inner {
    tok: Engine,
    bos_token: Option<String>,
    bos_token_id: Option<u32>,
    eos_token: Option<String>,
    eos_token_ids: Vec<u32>,
    pad_token_id: Option<u32>,
    special_ids: HashSet<u32>,
    vocab_size: usize,
    chat_template: Option<String>,
    named_chat_templates: Vec<(String, String)>,
    tokenizer_class: Option<String>,
    /// Tables built by this load, and the table file they go to ([`Tokenizer::save_table`]).
    unsaved_table: Mutex<Option<(PathBuf, table_cache::Rest)>>,
}

impl fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let i = &self.inner;
        f.debug_struct("Tokenizer")
            .field("class", &i.tokenizer_class)
            .field("vocab_size", &i.vocab_size)
            .field("bos_token_id", &i.bos_token_id)
            .field("eos_token_ids", &i.eos_token_ids)
            .field("chat_template", &i.chat_template.is_some())
            .finish()
    }
}

/// Joins a multi-line library message into one line.
/// The config's `tokenizer_class` without its `Fast` suffix.
fn tokenizer_class(config: &TokenizerConfig) -> Option<&str> {
    config
        .tokenizer_class
        .as_deref()
        .map(|c| c.strip_suffix("Fast").unwrap_or(c))
}

fn one_line(message: impl fmt::Display) -> String {
    message.to_string().split_whitespace().collect::<Vec<_>>().join(" ")
}

/// The bytes of `path`, `None` if it does not exist. A FIFO, a device, a directory or a
/// symlink loop is an error naming it ([`TokenizerError::File`]), and is never read from, so a
/// FIFO cannot block the load.
fn read_optional(path: &Path) -> Result<Option<Vec<u8>>, TokenizerError> {
    Ok(kiln_core::files::read_optional(path)?)
}

impl Tokenizer {
    /// Loads the tokenizer of a model directory: `tokenizer.json` (required),
    /// `tokenizer_config.json`, `chat_template.jinja` (which wins over the config's
    /// `chat_template`) and the `eos_token_id` of `generation_config.json`, each if present.
    pub fn from_dir(dir: &Path) -> Result<Tokenizer, TokenizerError> {
        Tokenizer::from_dir_cached(dir, None)
    }

    /// [`Self::from_dir`], reading a BPE model's tables from `cache` (see [`TableCache`]) when
    /// it holds them; tables built instead are written there by [`Self::save_table`].
    pub fn from_dir_cached(dir: &Path, cache: Option<&TableCache>) -> Result<Tokenizer, TokenizerError> {
        let json_path = dir.join("tokenizer.json");
        let config_path = dir.join("tokenizer_config.json");
        let config = match read_optional(&config_path)? {
            Some(bytes) => Some(TokenizerConfig::parse(&config_path.display().to_string(), &bytes)?),
            None => None,
        };

        let template_path = dir.join("chat_template.jinja");
        let template = match read_optional(&template_path)? {
            Some(bytes) => Some(String::from_utf8(bytes).map_err(|_| TokenizerError::Invalid {
                file: template_path.display().to_string(),
                message: "not UTF-8 text".to_string(),
            })?),
            None => None,
        };

        let generation_path = dir.join("generation_config.json");
        let generation_eos = match read_optional(&generation_path)? {
            Some(bytes) => generation_eos_ids(&generation_path.display().to_string(), &bytes)?,
            None => Vec::new(),
        };

        let file = json_path.display().to_string();
        // A LlamaTokenizer's file may be rewritten by the reader: never from the cache.
        let llama = config.as_ref().and_then(tokenizer_class) == Some("LlamaTokenizer");
        let entry = cache.filter(|_| !llama).and_then(|c| c.entry(&json_path, ""));
        if let Some(tok) = entry.as_deref().and_then(from_table_file) {
            return Tokenizer::finish(&file, tok, config.unwrap_or_default(), template, &generation_eos);
        }
        let json = read_optional(&json_path)?.ok_or_else(|| TokenizerError::Missing {
            path: json_path.clone(),
        })?;
        Tokenizer::build(&file, &json, config, template, &generation_eos, entry.as_deref())
    }

    /// Loads a tokenizer from the bytes of a `tokenizer.json` and, optionally, of a
    /// `tokenizer_config.json`. Errors name the files `tokenizer.json` and
    /// `tokenizer_config.json`.
    pub fn from_json_bytes(
        tokenizer_json: &[u8],
        tokenizer_config_json: Option<&[u8]>,
    ) -> Result<Tokenizer, TokenizerError> {
        let config = tokenizer_config_json
            .map(|bytes| TokenizerConfig::parse("tokenizer_config.json", bytes))
            .transpose()?;
        Tokenizer::build("tokenizer.json", tokenizer_json, config, None, &[], None)
    }

    /// The tokenizer of a BPE `tokenizer.json` given in parts (see [`BpeParts`]) and,
    /// optionally, the bytes of a `tokenizer_config.json`: what [`Self::from_json_bytes`] gives
    /// for the JSON text of those parts, built without that text. `Ok(None)` where the direct
    /// route does not apply (a `LlamaTokenizer` class, whose file the reader rewrites, or parts
    /// the fast reader declines); the caller then goes through the JSON text.
    pub fn from_bpe_parts(
        parts: BpeParts,
        tokenizer_config_json: Option<&[u8]>,
    ) -> Result<Option<Tokenizer>, TokenizerError> {
        Tokenizer::from_bpe_parts_cached(parts, tokenizer_config_json, None)
    }

    /// [`Self::from_bpe_parts`], its built tables to be written to the table file `entry` (see
    /// [`TableCache::entry`]) by [`Self::save_table`], for [`Self::from_table_file`] to read
    /// on a later load.
    pub fn from_bpe_parts_cached(
        parts: BpeParts,
        tokenizer_config_json: Option<&[u8]>,
        entry: Option<&Path>,
    ) -> Result<Option<Tokenizer>, TokenizerError> {
        let config = parse_config(tokenizer_config_json)?;
        if tokenizer_class(&config) == Some("LlamaTokenizer") {
            return Ok(None);
        }
        let Some((tok, rest)) = fast::from_parts(parts) else {
            return Ok(None);
        };
        let mut built = Tokenizer::finish("tokenizer.json", tok, config, None, &[])?;
        built.keep_unsaved_table(entry, rest);
        Ok(Some(built))
    }

    /// The tokenizer [`Self::from_bpe_parts_cached`] built with the same `entry` and config:
    /// `Ok(None)` when the table file is absent or not valid (then build from the parts).
    pub fn from_table_file(
        entry: &Path,
        tokenizer_config_json: Option<&[u8]>,
    ) -> Result<Option<Tokenizer>, TokenizerError> {
        let config = parse_config(tokenizer_config_json)?;
        if tokenizer_class(&config) == Some("LlamaTokenizer") {
            return Ok(None);
        }
        match from_table_file(entry) {
            Some(tok) => Tokenizer::finish("tokenizer.json", tok, config, None, &[]).map(Some),
            None => Ok(None),
        }
    }

    /// The tokenizer of `json`; tables built for a BPE model are kept for the table file
    /// `entry` ([`Self::save_table`]).
    fn build(
        file: &str,
        json: &[u8],
        config: Option<TokenizerConfig>,
        template_file: Option<String>,
        generation_eos: &[u32],
        entry: Option<&Path>,
    ) -> Result<Tokenizer, TokenizerError> {
        let config = config.unwrap_or_default();
        // As AutoTokenizer: a "LlamaTokenizer" whose file is byte-level loads as is.
        let llama_rebuild =
            tokenizer_class(&config) == Some("LlamaTokenizer") && !json.windows(11).any(|w| w == b"\"ByteLevel\"");

        let tok = if llama_rebuild {
            let mut value: Value = serde_json::from_slice(json).map_err(|e| TokenizerError::Json {
                file: file.to_string(),
                message: e.to_string(),
            })?;
            if value.pointer("/model/type").and_then(Value::as_str) == Some("BPE") {
                rebuild_llama(&mut value, &config);
            }
            let tok = serde_json::from_value::<tokenizers::Tokenizer>(value.clone())
                .map_err(|e| load_error(file, &value, e))?;
            from_crate(file, tok)?
        } else if let Some((tok, rest)) = fast::read(json) {
            let mut built = Tokenizer::finish(file, tok, config, template_file, generation_eos)?;
            built.keep_unsaved_table(entry, rest);
            return Ok(built);
        } else {
            let tok =
                tokenizers::Tokenizer::from_bytes(json).map_err(|e| match serde_json::from_slice::<Value>(json) {
                    Err(json_error) => TokenizerError::Json {
                        file: file.to_string(),
                        message: json_error.to_string(),
                    },
                    Ok(value) => load_error(file, &value, e),
                })?;
            from_crate(file, tok)?
        };
        Tokenizer::finish(file, tok, config, template_file, generation_eos)
    }

    /// Remembers that this tokenizer's tables were built and belong in the table file `entry`:
    /// [`Self::save_table`] writes them there.
    fn keep_unsaved_table(&mut self, entry: Option<&Path>, rest: table_cache::Rest) {
        if let (Some(entry), Some(inner)) = (entry, Arc::get_mut(&mut self.inner)) {
            inner.unsaved_table = Mutex::new(Some((entry.to_path_buf(), rest)));
        }
    }

    /// Writes the tables this tokenizer built to the table file it was loaded for (see
    /// [`Self::from_dir_cached`], [`Self::from_bpe_parts_cached`]), once; nothing when they
    /// were read from it or there is none. Callers save once the model has proved usable, so
    /// a command refused after loading leaves nothing in the cache. Best effort, like the
    /// cache itself: a failure to write only means the next load builds again.
    pub fn save_table(&self) {
        let pending = self.inner.unsaved_table.lock().map(|mut p| p.take()).unwrap_or(None);
        if let (Some((entry, rest)), KilnModel::Table(table)) = (pending, self.inner.tok.get_model()) {
            table_cache::store(&entry, table, &rest);
        }
    }

    /// The Kiln tokenizer around the crate's `tok`, read from `file`: truncation and padding
    /// off, the config's tokens added, its special ids and chat templates recorded.
    fn finish(
        file: &str,
        mut tok: Engine,
        config: TokenizerConfig,
        template_file: Option<String>,
        generation_eos: &[u32],
    ) -> Result<Tokenizer, TokenizerError> {
        tok.with_truncation(None).map_err(|e| TokenizerError::Invalid {
            file: file.to_string(),
            message: one_line(e),
        })?;
        tok.with_padding(None);
        if config.split_special_tokens {
            tok.set_encode_special_tokens(true);
        }

        add_config_tokens(&mut tok, &config).map_err(|e| TokenizerError::Invalid {
            file: file.to_string(),
            message: format!("cannot add the tokens named in tokenizer_config.json: {}", one_line(e)),
        })?;

        let added = tok.get_added_tokens_decoder();
        let special_ids: HashSet<u32> = added.iter().filter(|(_, t)| t.special).map(|(id, _)| *id).collect();
        let max_added = added.keys().max().map_or(0, |id| *id as usize + 1);
        let vocab_size = tok.get_vocab_size(false).max(max_added);

        let id_of = |spec: &Option<TokenSpec>| spec.as_ref().and_then(|t| tok.token_to_id(&t.content));
        let bos_token_id = id_of(&config.bos_token);
        let pad_token_id = id_of(&config.pad_token);
        let mut eos_token_ids = Vec::new();
        for id in id_of(&config.eos_token)
            .into_iter()
            .chain(generation_eos.iter().copied())
        {
            if !eos_token_ids.contains(&id) {
                eos_token_ids.push(id);
            }
        }

        Ok(Tokenizer {
            inner: Arc::new(Inner {
                bos_token: config.bos_token.as_ref().map(|t| t.content.clone()),
                bos_token_id,
                eos_token: config.eos_token.as_ref().map(|t| t.content.clone()),
                eos_token_ids,
                pad_token_id,
                special_ids,
                vocab_size,
                chat_template: template_file.or(config.chat_template),
                named_chat_templates: config.named_chat_templates,
                tokenizer_class: config.tokenizer_class,
                tok,
                unsaved_table: Mutex::new(None),
            }),
        })
    }

    /// The ids of `text`, exactly as `transformers`' `tokenizer(text)["input_ids"]`
    /// (`add_special_tokens = true`) or `tokenizer(text, add_special_tokens=False)`.
    /// Special tokens written in the text (`<|im_start|>`) are recognised either way.
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, TokenizerError> {
        let encoding = self
            .inner
            .tok
            .encode_fast(text, add_special_tokens)
            .map_err(|e| TokenizerError::Encode(one_line(e)))?;
        Ok(encoding.get_ids().to_vec())
    }

    /// The text of `ids`, as `transformers`' `tokenizer.decode(ids, skip_special_tokens=...)`.
    /// Ids unknown to the vocabulary are skipped.
    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String, TokenizerError> {
        self.inner
            .tok
            .decode(ids, skip_special_tokens)
            .map_err(|e| TokenizerError::Decode(one_line(e)))
    }

    /// A streaming decoder; see [`TextStreamer`].
    pub fn streamer(&self, skip_special_tokens: bool) -> TextStreamer {
        TextStreamer::new(self, skip_special_tokens)
    }

    /// The id of a token (vocabulary or added), by its text as stored (`"Ġthe"`, `"▁the"`).
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.tok.token_to_id(token)
    }

    /// The text of a token as stored in the vocabulary (`"Ġthe"`, `"<0x0A>"`).
    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.tok.id_to_token(id)
    }

    /// One more than the largest token id (vocabulary and added tokens), the `len(tokenizer)`
    /// of `transformers`. A model's logits may be wider (padded); the extra ids have no text.
    pub fn vocab_size(&self) -> usize {
        self.inner.vocab_size
    }

    /// The id of `tokenizer_config.json`'s `bos_token`, if it names one. Whether `encode`
    /// inserts it is up to `tokenizer.json`'s post-processor (see the module documentation).
    pub fn bos_token_id(&self) -> Option<u32> {
        self.inner.bos_token_id
    }

    /// The text of `tokenizer_config.json`'s `bos_token` (for chat templates).
    pub fn bos_token(&self) -> Option<&str> {
        self.inner.bos_token.as_deref()
    }

    /// The ids that end generation: `tokenizer_config.json`'s `eos_token`, then
    /// `generation_config.json`'s `eos_token_id`(s), without duplicates. Empty if neither names
    /// one (e.g. [`Tokenizer::from_json_bytes`] without a config).
    pub fn eos_token_ids(&self) -> &[u32] {
        &self.inner.eos_token_ids
    }

    /// The text of `tokenizer_config.json`'s `eos_token` (for chat templates).
    pub fn eos_token(&self) -> Option<&str> {
        self.inner.eos_token.as_deref()
    }

    /// Whether `id` is one of [`Tokenizer::eos_token_ids`].
    pub fn is_eos(&self, id: u32) -> bool {
        self.inner.eos_token_ids.contains(&id)
    }

    /// The id of `tokenizer_config.json`'s `pad_token`, if any.
    pub fn pad_token_id(&self) -> Option<u32> {
        self.inner.pad_token_id
    }

    /// Whether `id` is a special added token: one that `decode(.., true)` skips.
    pub fn is_special(&self, id: u32) -> bool {
        self.inner.special_ids.contains(&id)
    }

    /// The chat template's Jinja source: `chat_template.jinja` if the directory has one, else
    /// `tokenizer_config.json`'s `chat_template` (the one named `"default"` when it is a list).
    pub fn chat_template(&self) -> Option<&str> {
        self.inner.chat_template.as_deref()
    }

    /// A named template of a list-form `chat_template` (e.g. `"tool_use"`).
    pub fn named_chat_template(&self, name: &str) -> Option<&str> {
        self.inner
            .named_chat_templates
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, t)| t.as_str())
    }

    /// The underlying tokenizer written out as `tokenizer.json` text (vocabulary by id, merges
    /// by rank, added tokens, every section), with the ids this wrapper derived: two ways of
    /// building a tokenizer give the same one exactly when these agree.
    pub fn fingerprint(&self) -> String {
        let i = &self.inner;
        let mut special: Vec<u32> = i.special_ids.iter().copied().collect();
        special.sort_unstable();
        format!(
            "{}\nbos {:?} eos {:?} pad {:?} vocab {} special {special:?} template {:?}",
            i.tok.to_string(false).unwrap_or_default(),
            i.bos_token_id,
            i.eos_token_ids,
            i.pad_token_id,
            i.vocab_size,
            i.chat_template
        )
    }

    /// `tokenizer_config.json`'s `tokenizer_class`, as written.
    pub fn tokenizer_class(&self) -> Option<&str> {
        self.inner.tokenizer_class.as_deref()
    }
}

/// The `tokenizer_config.json` of these bytes (named so in errors); the default without.
fn parse_config(bytes: Option<&[u8]>) -> Result<TokenizerConfig, TokenizerError> {
    Ok(bytes
        .map(|bytes| TokenizerConfig::parse("tokenizer_config.json", bytes))
        .transpose()?
        .unwrap_or_default())
}

/// The tokenizer of the table file at `entry`, if it holds a valid one.
fn from_table_file(entry: &Path) -> Option<Engine> {
    let (table, rest) = table_cache::load(entry)?;
    fast::assemble(table, &rest)
}

/// The crate's tokenizer `tok`, read from `file`, as an [`Engine`].
fn from_crate(file: &str, tok: tokenizers::Tokenizer) -> Result<Engine, TokenizerError> {
    engine::from_crate(tok).map_err(|e| TokenizerError::Invalid {
        file: file.to_string(),
        message: one_line(e),
    })
}

/// The error for a `tokenizer.json` that is valid JSON but that the library refused.
fn load_error(file: &str, value: &Value, e: impl fmt::Display) -> TokenizerError {
    const MODELS: [&str; 4] = ["BPE", "WordPiece", "WordLevel", "Unigram"];
    let model_type = value.pointer("/model/type").and_then(Value::as_str);
    match model_type {
        Some(t) if !MODELS.contains(&t) => TokenizerError::Unsupported {
            file: file.to_string(),
            message: format!("model type \"{t}\" (supported: {})", MODELS.join(", ")),
        },
        _ if value.get("model").is_none() => TokenizerError::Invalid {
            file: file.to_string(),
            message: "no \"model\" key".to_string(),
        },
        _ => {
            let message = one_line(e);
            if message.contains("unknown variant") || message.contains("did not match any variant") {
                TokenizerError::Unsupported {
                    file: file.to_string(),
                    message,
                }
            } else {
                TokenizerError::Invalid {
                    file: file.to_string(),
                    message,
                }
            }
        }
    }
}

/// What `transformers` 5's `LlamaTokenizer.__init__` does to a SentencePiece-style BPE
/// `tokenizer.json`: keeps vocabulary, merges, added tokens and post-processor, replaces the
/// rest.
fn rebuild_llama(value: &mut Value, config: &TokenizerConfig) {
    let add_prefix_space = config.add_prefix_space.unwrap_or(true);
    let scheme = match (add_prefix_space, config.legacy.unwrap_or(false)) {
        (false, _) => "never",
        (true, true) => "always",
        (true, false) => "first",
    };
    value["normalizer"] = Value::Null;
    value["pre_tokenizer"] = json!({
        "type": "Metaspace", "replacement": "▁", "prepend_scheme": scheme, "split": false
    });
    let mut decoders = vec![
        json!({"type": "Replace", "pattern": {"String": "▁"}, "content": " "}),
        json!({"type": "ByteFallback"}),
        json!({"type": "Fuse"}),
    ];
    if add_prefix_space {
        decoders.push(json!({"type": "Strip", "content": " ", "start": 1, "stop": 0}));
    }
    value["decoder"] = json!({"type": "Sequence", "decoders": decoders});
    if let Some(model) = value.get_mut("model").and_then(Value::as_object_mut) {
        for (key, v) in [
            ("dropout", Value::Null),
            ("unk_token", Value::Null),
            ("continuing_subword_prefix", Value::Null),
            ("end_of_word_suffix", Value::Null),
            ("fuse_unk", Value::Bool(true)),
            ("byte_fallback", Value::Bool(true)),
            ("ignore_merges", Value::Bool(false)),
        ] {
            model.insert(key.to_string(), v);
        }
    }
}

/// Adds the tokens `tokenizer_config.json` names that `tokenizer.json` does not have among its
/// added tokens, in `transformers`' order: `added_tokens_decoder` by id, the named special
/// tokens, then the extra special tokens.
fn add_config_tokens(tok: &mut Engine, config: &TokenizerConfig) -> tokenizers::Result<()> {
    let mut present: HashSet<String> = tok
        .get_added_tokens_decoder()
        .into_values()
        .map(|t| t.content)
        .collect();
    let decoder_entries = config.added_tokens.iter().map(|(_, t)| (t, false));
    let named = [
        &config.bos_token,
        &config.eos_token,
        &config.unk_token,
        &config.pad_token,
    ]
    .into_iter()
    .flatten()
    .chain(&config.other_named_tokens)
    .chain(&config.extra_special_tokens)
    .map(|t| (t, true));
    for (spec, is_named) in decoder_entries.chain(named) {
        if present.contains(&spec.content) {
            continue;
        }
        // Python's AddedToken defaults: not special, normalized = not special; a named
        // special token is always special.
        let special = is_named || spec.special.unwrap_or(false);
        let token = AddedToken {
            content: spec.content.clone(),
            single_word: spec.single_word,
            lstrip: spec.lstrip,
            rstrip: spec.rstrip,
            normalized: spec.normalized.unwrap_or(!special),
            special,
        };
        if special {
            tok.add_special_tokens([token])?;
        } else {
            tok.add_tokens([token])?;
        }
        present.insert(spec.content.clone());
    }
    Ok(())
}
