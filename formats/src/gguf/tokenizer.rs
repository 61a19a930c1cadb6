//! The tokenizer stored in a GGUF file's `tokenizer.*` metadata, rebuilt as a Hugging Face
//! `tokenizer.json` and loaded through [`kiln_text::tokenizer::Tokenizer`], so the rest of Kiln
//! uses one tokenizer type. The target is llama.cpp's behaviour (`src/llama-vocab.cpp`) for the
//! same file, which the tests check id for id.
//!
//! **`tokenizer.ggml.model = "gpt2"`** (byte-level BPE): vocabulary `tokenizer.ggml.tokens`,
//! merges `tokenizer.ggml.merges` (`"left right"`, rank = position). The pre-tokenizer is the
//! list of regexes llama.cpp uses for `tokenizer.ggml.pre`, each applied in turn to the pieces
//! the previous one left (a `Split` with `Isolated` behaviour per regex, then a `ByteLevel`
//! pre-tokenizer without regex); see [`pre_tokenizer`]. `llama-bpe` and its aliases also skip
//! merges for words that are whole tokens (`ignore_merges`), as llama.cpp does.
//!
//! **`tokenizer.ggml.model = "llama"`** (SentencePiece BPE): tokens with `tokenizer.ggml.scores`.
//! llama.cpp merges, within each piece of text, the adjacent pair whose concatenation is the
//! highest-scoring token; that is a BPE whose merges are every split `(left, right)` of every
//! token into two tokens, ranked by the score of the merged token (ties: merged id, then the
//! ids of left and right, as `transformers`' `SentencePieceExtractor`). Characters that are not
//! tokens fall back to `<0xXX>` byte tokens. Spaces become `▁`, and with
//! `tokenizer.ggml.add_space_prefix` (default true) a `▁` is prepended to every piece of text
//! that starts the input or follows a special token (llama.cpp's `is_prev_special` rule, here a
//! `Prepend` normalizer, which the `tokenizers` crate applies to each segment between added
//! tokens).
//!
//! **Special tokens**: tokens of type CONTROL (3), UNKNOWN (2) and USER_DEFINED (4) become added
//! tokens, matched in the raw text before anything else (CONTROL/UNKNOWN as special, so
//! `decode(.., skip_special_tokens = true)` drops them). As llama.cpp, tokens whose text marks
//! an end of generation (`<|im_end|>`, `<|eot_id|>`, `</s>`, ...) are treated as CONTROL
//! whatever their stored type. `encode(text, true)` adds BOS/EOS as
//! `tokenizer.ggml.add_bos_token` / `add_eos_token` say (defaults: BOS for SentencePiece and for
//! `llama-bpe`, nothing else).
//!
//! Not reproduced: llama.cpp's length-first (rather than leftmost-longest) matching of
//! overlapping special tokens, the name-based lstrip attributes of BERT-family models (the
//! Phi-3 rstrip rule is reproduced), tie-breaking between equal SentencePiece scores of different tokens, and llama.cpp's
//! own Unicode category tables (the `tokenizers` crate uses Oniguruma's).

use super::error::GgufError;
use super::model::Meta;
use super::parse::{Array, GgufHeader, Value};
use super::strings::StringArray;
use super::tokenizer_doc::TokenizerDoc;
use kiln_text::tokenizer::{TableCache, Tokenizer, TokenizerError};
use serde_json::{Map, Value as Json, json};
use std::collections::{BTreeSet, HashMap};
use std::path::Path;

/// llama.cpp's token types (`tokenizer.ggml.token_type`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum TokenType {
    Undefined,
    Normal,
    Unknown,
    Control,
    UserDefined,
    Unused,
    Byte,
}

impl TokenType {
    pub fn from_id(id: i64) -> TokenType {
        match id {
            1 => TokenType::Normal,
            2 => TokenType::Unknown,
            3 => TokenType::Control,
            4 => TokenType::UserDefined,
            5 => TokenType::Unused,
            6 => TokenType::Byte,
            _ => TokenType::Undefined,
        }
    }

    /// Matched in the raw text before pre-tokenisation.
    pub fn is_added(self) -> bool {
        matches!(self, TokenType::Control | TokenType::Unknown | TokenType::UserDefined)
    }
}

/// The tokenizer family (`tokenizer.ggml.model`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum VocabKind {
    /// `gpt2`: byte-level BPE with merges.
    Gpt2,
    /// `llama`: SentencePiece BPE with scores and byte fallback.
    SentencePiece,
}

/// Token texts that llama.cpp treats as end-of-generation and as CONTROL, whatever their
/// stored type (`llama_vocab::impl::load`, "maintain a list of tokens that cause
/// end-of-generation").
pub const EOG_TEXTS: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<|return|>",
    "<|call|>",
    "<|flush|>",
    "<|calls|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "</s>",
    "<|eom_id|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "[EOS]",
    "<|end_of_text|>",
    "<end_of_utterance>",
    "<eos>",
    "<turn|>",
    "<|tool_response>",
    "<｜end▁of▁sentence｜>",
    "[e~[",
];

impl GgufVocab {
    /// The merges as pairs: each line split, as llama.cpp does, at the first space after its
    /// first byte; a line without one gives two empty texts (a merge no token can use).
    pub fn merges(&self) -> impl Iterator<Item = (&str, &str)> {
        self.merge_lines
            .iter()
            .map(|m| match m.as_bytes().iter().skip(1).position(|&b| b == b' ') {
                Some(p) => (&m[..p + 1], &m[p + 2..]),
                None => ("", ""),
            })
    }
}

/// The `tokenizer.*` metadata of a GGUF file, read and checked.
#[derive(Clone, Debug)]
pub struct GgufVocab {
    pub kind: VocabKind,
    /// `tokenizer.ggml.pre` (gpt2 only; `None` when absent, read as `default`).
    pub pre: Option<String>,
    /// The token texts by id (an empty text is renamed `[EMPTY_<id>]`, as llama.cpp does).
    /// One buffer, not a `String` each: 151k allocations (and their frees) were about a
    /// fifth of a cached Qwen GGUF's start.
    pub tokens: StringArray,
    /// Token types by id after llama.cpp's adjustments (EOG texts are CONTROL).
    pub token_types: Vec<TokenType>,
    /// `tokenizer.ggml.scores` (SentencePiece); empty when absent.
    pub scores: Vec<f32>,
    /// `tokenizer.ggml.merges` as written, `"left right"` (gpt2); see [`GgufVocab::merges`].
    pub merge_lines: StringArray,
    pub bos_token_id: Option<u32>,
    pub eos_token_id: Option<u32>,
    pub unknown_token_id: Option<u32>,
    pub padding_token_id: Option<u32>,
    /// Every id that ends generation: EOS first, then EOT/EOM, then the tokens named by
    /// [`EOG_TEXTS`], by id.
    pub eog_token_ids: Vec<u32>,
    /// Added tokens that swallow the whitespace after them (llama.cpp's RSTRIP attribute, set
    /// by model name for Phi-3).
    pub rstrip_ids: BTreeSet<u32>,
    pub add_bos: bool,
    pub add_eos: bool,
    pub add_space_prefix: bool,
    /// `tokenizer.chat_template`.
    pub chat_template: Option<String>,
}

/// How llama.cpp pre-tokenizes a `gpt2` vocabulary of pre-tokenizer type `pre`: the regexes
/// (applied in turn), whether whole-token words skip merges, and whether BOS is added by
/// default. `None` for pre-tokenizer types Kiln does not know.
pub fn pre_tokenizer(pre: &str) -> Option<(&'static [&'static str], bool, bool)> {
    const GPT2: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)";
    const LLAMA3: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
    const QWEN2: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
    const DEFAULT: &[&str] = &[r"[\p{P}\$\+<=>\^~\|]+", GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"];
    Some(match pre {
        "default" => (DEFAULT, false, false),
        "llama3" | "llama-v3" | "llama-bpe" | "falcon3" => (&[LLAMA3], true, true),
        "dbrx" | "smaug-bpe" => (&[LLAMA3], false, false),
        "gpt-2" | "phi-2" | "mpt" | "olmo" => (&[GPT2], false, false),
        "qwen2" | "deepseek-r1-qwen" | "megrez" | "stablelm2" => (&[QWEN2], false, false),
        "smollm" | "starcoder" | "refact" | "codeshell" => (&[r"\p{N}", GPT2], false, false),
        _ => return None,
    })
}

/// `tokenizer.ggml.pre` values Kiln reads, for messages.
pub const SUPPORTED_PRE: &str = "default, llama3, llama-v3, llama-bpe, falcon3, dbrx, smaug-bpe, \
     gpt-2, phi-2, mpt, olmo, qwen2, deepseek-r1-qwen, megrez, stablelm2, smollm, starcoder, \
     refact, codeshell";

fn tok_err(path: &Path, message: String) -> GgufError {
    GgufError::Tokenizer {
        path: path.to_path_buf(),
        message,
    }
}

/// Reads the `tokenizer.*` metadata of `header`.
pub fn vocab_from_header(header: &GgufHeader, path: &Path) -> Result<GgufVocab, GgufError> {
    let meta = Meta { header, path };
    let model_key = "tokenizer.ggml.model";
    let model = meta.string(model_key)?.ok_or_else(|| meta.missing(model_key))?;
    let kind = match model {
        "gpt2" => VocabKind::Gpt2,
        "llama" => VocabKind::SentencePiece,
        other => {
            return Err(GgufError::Unsupported {
                path: path.to_path_buf(),
                what: format!("tokenizer model \"{other}\" in {model_key} (supported: gpt2, llama)"),
            });
        }
    };

    let tokens_key = "tokenizer.ggml.tokens";
    let tokens: StringArray = match meta.get(tokens_key) {
        None => return Err(meta.missing(tokens_key)),
        Some(Value::Array(Array::String(t))) if !t.iter().any(str::is_empty) => t.clone(),
        Some(Value::Array(Array::String(t))) if !t.is_empty() => t
            .iter()
            .enumerate()
            .map(|(i, t)| {
                if t.is_empty() {
                    std::borrow::Cow::Owned(format!("[EMPTY_{i}]"))
                } else {
                    std::borrow::Cow::Borrowed(t)
                }
            })
            .collect(),
        Some(v) => {
            return Err(meta.bad(
                tokens_key,
                format!("is {}, expected a non-empty array of strings", v.describe()),
            ));
        }
    };
    let n = tokens.len();
    if n > u32::MAX as usize {
        return Err(meta.bad(tokens_key, format!("has {n} tokens, more than ids can address")));
    }

    let numeric = |key: &str| -> Result<Option<Vec<f64>>, GgufError> {
        match meta.get(key) {
            None => Ok(None),
            Some(Value::Array(a)) => match a.to_f64s() {
                Some(v) if v.len() >= n => Ok(Some(v)),
                Some(v) => Err(meta.bad(key, format!("has {} entries, fewer than the {n} tokens", v.len()))),
                None => Err(meta.bad(key, format!("is an array of {}, expected numbers", a.elem_type()))),
            },
            Some(v) => Err(meta.bad(key, format!("is {}, expected an array", v.describe()))),
        }
    };
    let mut token_types: Vec<TokenType> = match numeric("tokenizer.ggml.token_type")? {
        Some(v) => v[..n].iter().map(|&t| TokenType::from_id(t as i64)).collect(),
        None => vec![TokenType::Normal; n],
    };
    let scores: Vec<f32> = match numeric("tokenizer.ggml.scores")? {
        Some(v) => v[..n].iter().map(|&s| s as f32).collect(),
        None => Vec::new(),
    };

    let merges_key = "tokenizer.ggml.merges";
    let merges = match (kind, meta.get(merges_key)) {
        (VocabKind::Gpt2, None) => return Err(meta.missing(merges_key)),
        (_, None) => StringArray::default(),
        (_, Some(Value::Array(Array::String(m)))) => m.clone(),
        (_, Some(v)) => {
            return Err(meta.bad(merges_key, format!("is {}, expected an array of strings", v.describe())));
        }
    };

    let pre = match kind {
        VocabKind::Gpt2 => Some(meta.string("tokenizer.ggml.pre")?.unwrap_or("default").to_string()),
        VocabKind::SentencePiece => None,
    };
    let (default_add_bos, (default_bos, default_eos, default_unk)) = match kind {
        VocabKind::SentencePiece => (true, (Some(1), Some(2), Some(0))),
        VocabKind::Gpt2 => {
            let pre_name = pre.as_deref().unwrap_or("default");
            let Some((_, _, add_bos)) = pre_tokenizer(pre_name) else {
                return Err(GgufError::Unsupported {
                    path: path.to_path_buf(),
                    what: format!("pre-tokenizer \"{pre_name}\" in tokenizer.ggml.pre (supported: {SUPPORTED_PRE})"),
                });
            };
            (add_bos, (Some(11), Some(11), None))
        }
    };
    // A special-token id: the key when present and in range (llama.cpp ignores out-of-range
    // ids with a warning), else the family's default when in range.
    let id_key = |key: &str, default: Option<u32>| -> Result<Option<u32>, GgufError> {
        let in_range = |id: u32| (id as usize) < n;
        match meta.get(key) {
            // A negative id (some converters write -1 for "none") means absent.
            Some(v) if v.as_f64().is_some_and(|f| f < 0.0) => Ok(None),
            _ => match meta.uint(key, u64::MAX)? {
                Some(id) if id < n as u64 => Ok(Some(id as u32)),
                _ => Ok(default.filter(|&d| in_range(d))),
            },
        }
    };
    let bos_token_id = id_key("tokenizer.ggml.bos_token_id", default_bos)?;
    let eos_token_id = id_key("tokenizer.ggml.eos_token_id", default_eos)?;
    let unknown_token_id = id_key("tokenizer.ggml.unknown_token_id", default_unk)?;
    let padding_token_id = id_key("tokenizer.ggml.padding_token_id", None)?;
    let eot = id_key("tokenizer.ggml.eot_token_id", None)?;
    let eom = id_key("tokenizer.ggml.eom_token_id", None)?;
    let add_bos = meta.bool("tokenizer.ggml.add_bos_token")?.unwrap_or(default_add_bos);
    let add_eos = meta.bool("tokenizer.ggml.add_eos_token")?.unwrap_or(false);
    let add_space_prefix = match kind {
        VocabKind::SentencePiece => meta.bool("tokenizer.ggml.add_space_prefix")?.unwrap_or(true),
        VocabKind::Gpt2 => false,
    };
    if add_bos && bos_token_id.is_none() {
        return Err(tok_err(
            path,
            "tokenizer.ggml.add_bos_token is set but there is no BOS token id".into(),
        ));
    }
    if add_eos && eos_token_id.is_none() {
        return Err(tok_err(
            path,
            "tokenizer.ggml.add_eos_token is set but there is no EOS token id".into(),
        ));
    }

    // End-of-generation tokens by text are CONTROL in llama.cpp, whatever the file says.
    let mut eog: BTreeSet<u32> = BTreeSet::new();
    for (i, t) in tokens.iter().enumerate() {
        if EOG_TEXTS.contains(&t) {
            eog.insert(i as u32);
            if !matches!(token_types[i], TokenType::Control) {
                token_types[i] = TokenType::Control;
            }
        }
    }
    let mut eog_token_ids: Vec<u32> = Vec::new();
    for id in [eos_token_id, eot, eom].into_iter().flatten().chain(eog) {
        if !eog_token_ids.contains(&id) {
            eog_token_ids.push(id);
        }
    }

    // llama.cpp sets RSTRIP by model name for Phi-3: on every added token and `</s>`, except
    // `<unk>`, `<s>` and `<|endoftext|>`.
    let mut rstrip_ids = BTreeSet::new();
    let name = meta.string("general.name")?.unwrap_or("").to_lowercase();
    if name.contains("phi-3") || name.contains("phi3") {
        for (i, t) in tokens.iter().enumerate() {
            let keep = matches!(t, "<unk>" | "<s>" | "<|endoftext|>");
            if (token_types[i].is_added() || t == "</s>") && !keep {
                rstrip_ids.insert(i as u32);
            }
        }
    }

    let chat_template = meta.string("tokenizer.chat_template")?.map(str::to_string);
    Ok(GgufVocab {
        kind,
        pre,
        tokens,
        token_types,
        scores,
        merge_lines: merges,
        bos_token_id,
        eos_token_id,
        unknown_token_id,
        padding_token_id,
        eog_token_ids,
        rstrip_ids,
        add_bos,
        add_eos,
        add_space_prefix,
        chat_template,
    })
}

/// The Hugging Face `tokenizer.json` equivalent to `vocab` (see the module documentation), as a
/// document that serialises to it.
pub fn tokenizer_json<'v>(vocab: &'v GgufVocab, path: &Path) -> Result<TokenizerDoc<'v>, GgufError> {
    let mut ids: HashMap<&str, u32> = HashMap::with_capacity(vocab.tokens.len());
    for (i, t) in vocab.tokens.iter().enumerate() {
        // A repeated text keeps its last id, as llama.cpp's `token_to_id`.
        ids.insert(t, i as u32);
    }
    // The vocabulary list is made on a second thread while this one makes the rest (the
    // merge filter, 450k lookups for Qwen, is the other long part).
    std::thread::scope(|s| {
        let ids = &ids;
        let vocab_list = s.spawn(move || -> Vec<(&str, u32)> {
            vocab
                .tokens
                .iter()
                .enumerate()
                .filter(|(i, t)| ids.get(t) == Some(&(*i as u32)))
                .map(|(i, t)| (t, i as u32))
                .collect()
        });
        let added: Vec<Json> = vocab
            .tokens
            .iter()
            .enumerate()
            .filter(|(i, t)| vocab.token_types[*i].is_added() && ids.get(t) == Some(&(*i as u32)))
            .map(|(i, t)| {
                json!({
                    "id": i,
                    "content": t,
                    "single_word": false,
                    "lstrip": false,
                    "rstrip": vocab.rstrip_ids.contains(&(i as u32)),
                    "normalized": false,
                    "special": vocab.token_types[i] != TokenType::UserDefined,
                })
            })
            .collect();

        let (normalizer, pre_tokenizer, decoder, model, merges) = match vocab.kind {
            VocabKind::Gpt2 => {
                let pre_name = vocab.pre.as_deref().unwrap_or("default");
                let (regexes, ignore_merges, _) = pre_tokenizer(pre_name).ok_or_else(|| GgufError::Unsupported {
                    path: path.to_path_buf(),
                    what: format!("pre-tokenizer \"{pre_name}\" in tokenizer.ggml.pre (supported: {SUPPORTED_PRE})"),
                })?;
                let mut pretoks: Vec<Json> = regexes
                    .iter()
                    .map(|r| json!({"type": "Split", "pattern": {"Regex": r}, "behavior": "Isolated", "invert": false}))
                    .collect();
                pretoks.push(
                    json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false}),
                );
                // Merges whose parts or result are not tokens can never yield a token; the
                // `tokenizers` crate refuses them, so they are left out.
                let mut joined = String::new();
                let merges: Vec<(&str, &str)> = vocab
                    .merges()
                    .filter(|(a, b)| {
                        joined.clear();
                        joined.push_str(a);
                        joined.push_str(b);
                        !a.is_empty()
                            && !b.is_empty()
                            && ids.contains_key(a)
                            && ids.contains_key(b)
                            && ids.contains_key(joined.as_str())
                    })
                    .collect();
                (
                    Json::Null,
                    json!({"type": "Sequence", "pretokenizers": pretoks}),
                    json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false}),
                    json!({
                        "type": "BPE",
                        "dropout": null,
                        "unk_token": null,
                        "continuing_subword_prefix": null,
                        "end_of_word_suffix": null,
                        "fuse_unk": false,
                        "byte_fallback": false,
                        "ignore_merges": ignore_merges,
                    }),
                    merges,
                )
            }
            VocabKind::SentencePiece => {
                let mut normalizers = Vec::new();
                if vocab.add_space_prefix {
                    normalizers.push(json!({"type": "Prepend", "prepend": "▁"}));
                }
                normalizers.push(json!({"type": "Replace", "pattern": {"String": " "}, "content": "▁"}));
                let mut decoders = vec![
                    json!({"type": "Replace", "pattern": {"String": "▁"}, "content": " "}),
                    json!({"type": "ByteFallback"}),
                    json!({"type": "Fuse"}),
                ];
                if vocab.add_space_prefix {
                    decoders.push(json!({"type": "Strip", "content": " ", "start": 1, "stop": 0}));
                }
                let unk = vocab.unknown_token_id.map(|id| vocab.tokens[id as usize].to_string());
                (
                    json!({"type": "Sequence", "normalizers": normalizers}),
                    Json::Null,
                    json!({"type": "Sequence", "decoders": decoders}),
                    json!({
                        "type": "BPE",
                        "dropout": null,
                        "unk_token": unk,
                        "continuing_subword_prefix": null,
                        "end_of_word_suffix": null,
                        "fuse_unk": true,
                        "byte_fallback": true,
                        "ignore_merges": false,
                    }),
                    spm_merges(vocab, ids),
                )
            }
        };

        let post_processor = post_processor(vocab);
        let rest = json!({
            "version": "1.0",
            "truncation": null,
            "padding": null,
            "added_tokens": added,
            "normalizer": normalizer,
            "pre_tokenizer": pre_tokenizer,
            "post_processor": post_processor,
            "decoder": decoder,
        });
        let (Json::Object(rest), Json::Object(model)) = (rest, model) else {
            unreachable!("both are objects")
        };
        let vocab_list = vocab_list.join().expect("listing the vocabulary does not panic");
        Ok(TokenizerDoc::new(rest, model, vocab_list, merges))
    })
}

/// SentencePiece scores as BPE merges: every split of every token into two tokens, ranked by
/// the merged token's score (highest first), then merged id, left id, right id.
fn spm_merges<'v>(vocab: &'v GgufVocab, ids: &HashMap<&str, u32>) -> Vec<(&'v str, &'v str)> {
    let score = |id: u32| vocab.scores.get(id as usize).copied().unwrap_or(0.0);
    let mut merges: Vec<(f32, u32, u32, u32)> = Vec::new();
    for (i, t) in vocab.tokens.iter().enumerate() {
        if ids.get(t) != Some(&(i as u32)) {
            continue;
        }
        for (split, _) in t.char_indices().skip(1) {
            let (l, r) = t.split_at(split);
            if let (Some(&li), Some(&ri)) = (ids.get(l), ids.get(r)) {
                merges.push((score(i as u32), i as u32, li, ri));
            }
        }
    }
    merges.sort_by(|a, b| {
        b.0.total_cmp(&a.0)
            .then(a.1.cmp(&b.1))
            .then(a.2.cmp(&b.2))
            .then(a.3.cmp(&b.3))
    });
    merges
        .into_iter()
        .map(|(_, _, l, r)| (&vocab.tokens[l as usize], &vocab.tokens[r as usize]))
        .collect()
}

/// BOS/EOS insertion for `encode(text, true)`.
fn post_processor(vocab: &GgufVocab) -> Json {
    let bos = vocab.bos_token_id.filter(|_| vocab.add_bos);
    let eos = vocab.eos_token_id.filter(|_| vocab.add_eos);
    if bos.is_none() && eos.is_none() {
        return Json::Null;
    }
    let mut special = Map::new();
    let piece = |id: u32, special: &mut Map<String, Json>| {
        let text = vocab.tokens[id as usize].to_string();
        special.insert(text.clone(), json!({"id": text, "ids": [id], "tokens": [text]}));
        json!({"SpecialToken": {"id": &vocab.tokens[id as usize], "type_id": 0}})
    };
    let seq = |name: &str| json!({"Sequence": {"id": name, "type_id": 0}});
    let mut single = Vec::new();
    let mut pair = Vec::new();
    for name in ["A", "B"] {
        let mut part = Vec::new();
        if let Some(b) = bos {
            part.push(piece(b, &mut special));
        }
        part.push(seq(name));
        if let Some(e) = eos {
            part.push(piece(e, &mut special));
        }
        if name == "A" {
            single = part.clone();
        }
        pair.extend(part);
    }
    json!({"type": "TemplateProcessing", "single": single, "pair": pair, "special_tokens": special})
}

/// The `tokenizer_config.json` that gives the Kiln tokenizer its BOS/EOS/PAD/UNK names and the
/// chat template. Only tokens that are added tokens are named (naming another would make it
/// one, changing the tokenisation).
fn tokenizer_config(vocab: &GgufVocab) -> Json {
    let mut c = Map::new();
    let named = |id: Option<u32>| {
        id.filter(|&id| vocab.token_types[id as usize].is_added())
            .map(|id| Json::String(vocab.tokens[id as usize].to_string()))
    };
    for (key, id) in [
        ("bos_token", vocab.bos_token_id),
        ("eos_token", vocab.eos_token_id),
        ("pad_token", vocab.padding_token_id),
        ("unk_token", vocab.unknown_token_id),
    ] {
        if let Some(t) = named(id) {
            c.insert(key.into(), t);
        }
    }
    if let Some(t) = &vocab.chat_template {
        c.insert("chat_template".into(), Json::String(t.clone()));
    }
    Json::Object(c)
}

/// Builds the Kiln tokenizer of `vocab`: straight from its lists where the text crate can
/// (the `tokenizer.json` it stands for is then never written), else through that JSON text.
/// Both give the same tokenizer (`tests::direct_and_json_routes_build_the_same_tokenizer`).
pub fn build_tokenizer(vocab: &GgufVocab, path: &Path) -> Result<Tokenizer, GgufError> {
    build_tokenizer_cached(vocab, path, None)
}

/// [`build_tokenizer`], its BPE tables kept in `cache`, keyed by the GGUF file and the code
/// that turns GGUF metadata into a tokenizer (this file and `tokenizer_doc.rs`).
pub fn build_tokenizer_cached(
    vocab: &GgufVocab,
    path: &Path,
    cache: Option<&TableCache>,
) -> Result<Tokenizer, GgufError> {
    let config = serde_json::to_vec(&tokenizer_config(vocab)).map_err(|e| tok_err(path, e.to_string()))?;
    let salt = [include_str!("tokenizer.rs"), include_str!("tokenizer_doc.rs")].concat();
    let entry = cache.and_then(|c| c.entry(path, &salt));
    let err = |e: TokenizerError| tok_err(path, e.to_string());
    if let Some(entry) = &entry
        && let Some(tok) = Tokenizer::from_table_file(entry, Some(&config)).map_err(err)?
    {
        return Ok(tok);
    }
    let doc = tokenizer_json(vocab, path)?;
    if let Some(tok) =
        Tokenizer::from_bpe_parts_cached(doc.bpe_parts(), Some(&config), entry.as_deref()).map_err(err)?
    {
        return Ok(tok);
    }
    json_route(&doc, &config, path)
}

/// The tokenizer of `doc` and `config` read back from their JSON text.
fn json_route(doc: &TokenizerDoc, config: &[u8], path: &Path) -> Result<Tokenizer, GgufError> {
    let bytes = serde_json::to_vec(doc).map_err(|e| tok_err(path, e.to_string()))?;
    Tokenizer::from_json_bytes(&bytes, Some(config)).map_err(|e| tok_err(path, e.to_string()))
}

/// [`build_tokenizer`] by the JSON text only, for tests that compare the two routes.
#[cfg(test)]
pub fn build_tokenizer_via_json(vocab: &GgufVocab, path: &Path) -> Result<Tokenizer, GgufError> {
    let doc = tokenizer_json(vocab, path)?;
    let config = serde_json::to_vec(&tokenizer_config(vocab)).map_err(|e| tok_err(path, e.to_string()))?;
    json_route(&doc, &config, path)
}
