//! A faster reader for BPE `tokenizer.json` files.
//!
//! `tokenizers::Tokenizer::from_bytes` reads the `model` section through an untagged enum and a
//! flattened `serde_json::Value`: the whole vocabulary and merge list are first buffered as
//! generic JSON (a B-tree of strings) and only then turned into the BPE model. For a 150k-token
//! vocabulary (Qwen, Llama 3) that is ~0.3 s of a warm start that otherwise takes ~0.05 s.
//!
//! This reader parses the file once, straight into the BPE builder's vocabulary map and merge
//! list, and reads everything else (normalizer, pre-tokenizer, post-processor, decoder, added
//! tokens: a few kilobytes) with the crate's own types; then it assembles the tokenizer exactly
//! as the crate's deserializer does (same builder calls, added tokens added after the model in
//! file order). Anything it does not recognise — another model type, a malformed field —
//! makes it return `None`, and the caller falls back to the crate's reader, which also gives
//! the canonical error message. `tests::fast_reader_builds_the_same_tokenizer` checks that both
//! readers serialise to the same JSON and encode alike.

use serde::Deserialize;
use serde::de::{self, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde_json::Value;
use std::fmt;
use tokenizers::models::bpe::{BPE, Merges, Vocab};
use tokenizers::{
    AddedToken, DecoderWrapper, ModelWrapper, NormalizerWrapper, PostProcessorWrapper, PreTokenizerWrapper,
    TokenizerBuilder,
};

/// Reads a `tokenizer.json` whose model is BPE; `None` when the fast path does not apply.
pub fn from_bytes(json: &[u8]) -> Option<tokenizers::Tokenizer> {
    let file: File = serde_json::from_slice(json).ok()?;
    let FastModel::Bpe(bpe) = file.model? else {
        return None;
    };
    assemble(bpe.build()?, &file.rest)
}

/// The tokenizer a BPE `tokenizer.json` with these parts describes, built without the JSON
/// text: what [`from_bytes`] builds from that text. `None` where it would decline.
pub fn from_parts(parts: BpeParts) -> Option<tokenizers::Tokenizer> {
    let mut options = parts.options;
    options.insert("type".into(), Value::String("BPE".into()));
    let FastModel::Bpe(mut bpe) = serde_json::from_value(Value::Object(options)).ok()? else {
        return None;
    };
    bpe.vocab = Some(parts.vocab);
    bpe.merges = Some(parts.merges);
    let rest: Vec<(String, Value)> = parts.rest.into_iter().collect();
    assemble(bpe.build()?, &rest)
}

/// A BPE `tokenizer.json` in parts: every top-level key but `model`, the model's keys but
/// `vocab` and `merges`, and those two. A front end that has the vocabulary as lists (a GGUF
/// file) builds the tokenizer from them directly: written out as JSON and parsed back, a
/// 151k-token vocabulary and its merges cost more than building the model itself.
pub struct BpeParts {
    rest: serde_json::Map<String, Value>,
    options: serde_json::Map<String, Value>,
    vocab: Vocab,
    merges: Merges,
}

impl BpeParts {
    /// The parts; a text repeated in `vocab` keeps its last id, as in a JSON object. The map
    /// and the merge list are made on two threads (each is 150k owned strings for Qwen).
    pub fn new<'a>(
        rest: serde_json::Map<String, Value>,
        options: serde_json::Map<String, Value>,
        vocab: impl ExactSizeIterator<Item = (&'a str, u32)> + Send,
        merges: impl Iterator<Item = (&'a str, &'a str)>,
    ) -> Self {
        let (vocab, merges) = std::thread::scope(|s| {
            let map = s.spawn(|| {
                let mut map = Vocab::with_capacity(vocab.len());
                for (text, id) in vocab {
                    map.insert(text.to_string(), id);
                }
                map
            });
            let merges: Merges = merges.map(|(a, b)| (a.to_string(), b.to_string())).collect();
            (map.join().expect("building a vocabulary map does not panic"), merges)
        });
        BpeParts {
            rest,
            options,
            vocab,
            merges,
        }
    }
}

/// The tokenizer of a BPE `model` and the other top-level sections of its file, assembled as
/// the crate's deserializer does.
fn assemble(model: BPE, rest: &[(String, Value)]) -> Option<tokenizers::Tokenizer> {
    let section = |name: &str| rest.iter().find(|(k, _)| k == name).map(|(_, v)| v.clone());
    if let Some(v) = section("version")
        && v.as_str() != Some("1.0")
    {
        return None;
    }
    // `null` and absent both mean "none", as in the crate's reader.
    fn part<T: for<'de> Deserialize<'de>>(v: Option<Value>) -> Option<Option<T>> {
        match v {
            None | Some(Value::Null) => Some(None),
            Some(v) => serde_json::from_value(v).ok().map(Some),
        }
    }
    let normalizer: Option<NormalizerWrapper> = part(section("normalizer"))?;
    let pre_tokenizer: Option<PreTokenizerWrapper> = part(section("pre_tokenizer"))?;
    let post_processor: Option<PostProcessorWrapper> = part(section("post_processor"))?;
    let decoder: Option<DecoderWrapper> = part(section("decoder"))?;
    let added: Vec<AddedToken> = part(section("added_tokens"))?.unwrap_or_default();
    // Truncation and padding are turned off by the caller whatever the file says.
    let mut tok = TokenizerBuilder::<
        ModelWrapper,
        NormalizerWrapper,
        PreTokenizerWrapper,
        PostProcessorWrapper,
        DecoderWrapper,
    >::new()
    .with_model(ModelWrapper::BPE(model))
    .with_normalizer(normalizer)
    .with_pre_tokenizer(pre_tokenizer)
    .with_post_processor(post_processor)
    .with_decoder(decoder)
    .with_truncation(None)
    .with_padding(None)
    .build()
    .ok()?;
    tok.add_tokens(added).ok()?;
    Some(tok.into())
}

/// The top level: the model read by [`FastModel`], every other section kept as JSON.
struct File {
    model: Option<FastModel>,
    rest: Vec<(String, Value)>,
}

impl<'de> Deserialize<'de> for File {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = File;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a tokenizer.json object")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<File, A::Error> {
                let mut file = File {
                    model: None,
                    rest: Vec::new(),
                };
                while let Some(key) = map.next_key::<String>()? {
                    if key == "model" {
                        file.model = Some(map.next_value()?);
                    } else {
                        let value: Value = map.next_value()?;
                        file.rest.push((key, value));
                    }
                }
                Ok(file)
            }
        }
        d.deserialize_map(V)
    }
}

enum FastModel {
    Bpe(BpeFields),
    /// Another model type: left to the crate's reader.
    Other,
}

/// The fields of a BPE model section, as the crate's BPE reader takes them.
#[derive(Default)]
struct BpeFields {
    vocab: Option<Vocab>,
    merges: Option<Merges>,
    dropout: Option<f32>,
    unk_token: Option<String>,
    continuing_subword_prefix: Option<String>,
    end_of_word_suffix: Option<String>,
    fuse_unk: Option<bool>,
    byte_fallback: Option<bool>,
    ignore_merges: Option<bool>,
}

impl BpeFields {
    fn build(self) -> Option<BPE> {
        let mut b = BPE::builder().vocab_and_merges(self.vocab?, self.merges?);
        if let Some(v) = self.dropout {
            b = b.dropout(v);
        }
        if let Some(v) = self.unk_token {
            b = b.unk_token(v);
        }
        if let Some(v) = self.continuing_subword_prefix {
            b = b.continuing_subword_prefix(v);
        }
        if let Some(v) = self.end_of_word_suffix {
            b = b.end_of_word_suffix(v);
        }
        if let Some(v) = self.fuse_unk {
            b = b.fuse_unk(v);
        }
        if let Some(v) = self.byte_fallback {
            b = b.byte_fallback(v);
        }
        if let Some(v) = self.ignore_merges {
            b = b.ignore_merges(v);
        }
        b.build().ok()
    }
}

impl<'de> Deserialize<'de> for FastModel {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = FastModel;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a model object")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<FastModel, A::Error> {
                let mut f = BpeFields::default();
                let mut bpe = false;
                while let Some(key) = map.next_key::<String>()? {
                    match key.as_str() {
                        "type" => {
                            let t: String = map.next_value()?;
                            if t != "BPE" {
                                // Drain the rest; the caller falls back.
                                while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
                                return Ok(FastModel::Other);
                            }
                            bpe = true;
                        }
                        "vocab" => f.vocab = Some(map.next_value()?),
                        "merges" => f.merges = Some(map.next_value::<MergeList>()?.0),
                        "dropout" => f.dropout = map.next_value()?,
                        "unk_token" => f.unk_token = map.next_value()?,
                        "continuing_subword_prefix" => f.continuing_subword_prefix = map.next_value()?,
                        "end_of_word_suffix" => f.end_of_word_suffix = map.next_value()?,
                        "fuse_unk" => f.fuse_unk = map.next_value()?,
                        "byte_fallback" => f.byte_fallback = map.next_value()?,
                        "ignore_merges" => f.ignore_merges = map.next_value()?,
                        _ => {
                            map.next_value::<IgnoredAny>()?;
                        }
                    }
                }
                // A section without "type" is a legacy file: the crate guesses its model.
                Ok(if bpe { FastModel::Bpe(f) } else { FastModel::Other })
            }
        }
        d.deserialize_map(V)
    }
}

/// Merges as `[["a", "b"], ...]` or the legacy `["a b", ...]` (lines starting `#version`
/// skipped, exactly two space-separated parts each), as the crate reads them.
struct MergeList(Merges);

impl<'de> Deserialize<'de> for MergeList {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = MergeList;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a list of merges")
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<MergeList, A::Error> {
                let mut out = Vec::with_capacity(seq.size_hint().unwrap_or(0));
                while let Some(m) = seq.next_element::<Merge>()? {
                    if let Some(pair) = m.0 {
                        out.push(pair);
                    }
                }
                Ok(MergeList(out))
            }
        }
        d.deserialize_seq(V)
    }
}

/// One merge; `None` for a `#version` line of the legacy form.
struct Merge(Option<(String, String)>);

impl<'de> Deserialize<'de> for Merge {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Merge;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a merge: \"a b\" or [\"a\", \"b\"]")
            }
            fn visit_str<E: de::Error>(self, line: &str) -> Result<Merge, E> {
                if line.starts_with("#version") {
                    return Ok(Merge(None));
                }
                let mut parts = line.split(' ');
                match (parts.next(), parts.next(), parts.next()) {
                    (Some(a), Some(b), None) => Ok(Merge(Some((a.to_string(), b.to_string())))),
                    _ => Err(E::custom("a legacy merge is two space-separated tokens")),
                }
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Merge, A::Error> {
                let a: String = seq.next_element()?.ok_or_else(|| de::Error::invalid_length(0, &self))?;
                let b: String = seq.next_element()?.ok_or_else(|| de::Error::invalid_length(1, &self))?;
                if seq.next_element::<IgnoredAny>()?.is_some() {
                    return Err(de::Error::invalid_length(3, &self));
                }
                Ok(Merge(Some((a, b))))
            }
        }
        d.deserialize_any(V)
    }
}
