//! A faster reader for BPE `tokenizer.json` files.
//!
//! `tokenizers::Tokenizer::from_bytes` reads the `model` section through an untagged enum and a
//! flattened `serde_json::Value`: the whole vocabulary and merge list are first buffered as
//! generic JSON (a B-tree of strings) and only then turned into the BPE model. For a 150k-token
//! vocabulary (Qwen, Llama 3) that is ~0.3 s of a warm start that otherwise takes ~0.05 s.
//!
//! This reader parses the file once, straight into the flat tables of
//! [`super::bpe_table`] (no string is allocated per token, the merges are resolved to ids
//! once), and reads everything else (normalizer, pre-tokenizer, post-processor, decoder,
//! added tokens: a few kilobytes) with the crate's own types; then it assembles the
//! tokenizer exactly as the crate's deserializer does (same builder calls, added tokens added
//! after the model in file order). Anything it does not recognise — another model type, a malformed field —
//! makes it return `None`, and the caller falls back to the crate's reader, which also gives
//! the canonical error message. `tests::fast_reader_builds_the_same_tokenizer` checks that both
//! readers serialise to the same JSON and encode alike.

use serde::Deserialize;
use serde::de::{self, DeserializeSeed, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde_json::Value;
use std::borrow::Cow;
use std::fmt;
use tokenizers::{
    AddedToken, DecoderWrapper, NormalizerWrapper, PostProcessorWrapper, PreTokenizerWrapper, TokenizerBuilder,
};

use super::bpe_table::{BpeOptions, BpeTable, TableBuilder};
use super::engine::{Engine, KilnModel};
use super::table_cache::Rest;

/// Reads a `tokenizer.json` whose model is BPE; `None` when the fast path does not apply.
#[cfg(test)]
pub fn from_bytes(json: &[u8]) -> Option<Engine> {
    read(json).map(|(engine, _)| engine)
}

/// [`from_bytes`], and the file's sections other than `model` (what a table file keeps
/// beside the table, see [`super::table_cache`]).
pub fn read(json: &[u8]) -> Option<(Engine, Rest)> {
    let file: File = serde_json::from_slice(json).ok()?;
    let FastModel::Bpe(bpe) = file.model? else {
        return None;
    };
    let engine = assemble(bpe.build()?, &file.rest)?;
    Some((engine, file.rest))
}

/// The tokenizer a BPE `tokenizer.json` with these parts describes, built without the JSON
/// text: what [`from_bytes`] builds from that text. `None` where it would decline.
pub fn from_parts(parts: BpeParts) -> Option<(Engine, Rest)> {
    let mut options = parts.options;
    options.insert("type".into(), Value::String("BPE".into()));
    let FastModel::Bpe(mut bpe) = serde_json::from_value(Value::Object(options)).ok()? else {
        return None;
    };
    bpe.table = parts.table;
    let rest: Rest = parts.rest.into_iter().collect();
    let engine = assemble(bpe.build()?, &rest)?;
    Some((engine, rest))
}

/// A BPE `tokenizer.json` in parts: every top-level key but `model`, the model's keys but
/// `vocab` and `merges`, and those two. A front end that has the vocabulary as lists (a GGUF
/// file) builds the tokenizer from them directly: written out as JSON and parsed back, a
/// 151k-token vocabulary and its merges cost more than building the model itself.
pub struct BpeParts {
    rest: serde_json::Map<String, Value>,
    options: serde_json::Map<String, Value>,
    table: TableBuilder,
}

impl BpeParts {
    /// The parts; a text repeated in `vocab` keeps its last id, as in a JSON object.
    pub fn new<'a>(
        rest: serde_json::Map<String, Value>,
        options: serde_json::Map<String, Value>,
        vocab: impl ExactSizeIterator<Item = (&'a str, u32)>,
        merges: impl ExactSizeIterator<Item = (&'a str, &'a str)>,
    ) -> Self {
        let mut table = TableBuilder::with_capacity(vocab.len(), merges.len());
        for (text, id) in vocab {
            table.add_token(text, id);
        }
        for (a, b) in merges {
            table.add_merge(a, b);
        }
        table.has_vocab = true;
        table.has_merges = true;
        BpeParts { rest, options, table }
    }
}

/// The tokenizer of a BPE `model` and the other top-level sections of its file, assembled as
/// the crate's deserializer does.
pub fn assemble(model: BpeTable, rest: &[(String, Value)]) -> Option<Engine> {
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
        KilnModel,
        NormalizerWrapper,
        PreTokenizerWrapper,
        PostProcessorWrapper,
        DecoderWrapper,
    >::new()
    .with_model(KilnModel::Table(model))
    .with_normalizer(normalizer)
    .with_pre_tokenizer(pre_tokenizer)
    .with_post_processor(post_processor)
    .with_decoder(decoder)
    .with_truncation(None)
    .with_padding(None)
    .build()
    .ok()?;
    tok.add_tokens(added).ok()?;
    Some(tok)
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
    Bpe(Box<BpeFields>),
    /// Another model type: left to the crate's reader.
    Other,
}

/// The fields of a BPE model section, as the crate's BPE reader takes them.
#[derive(Default)]
struct BpeFields {
    table: TableBuilder,
    options: BpeOptions,
}

impl BpeFields {
    /// The table; `None` without a vocabulary or merges, or where the table declines.
    fn build(self) -> Option<BpeTable> {
        if !(self.table.has_vocab && self.table.has_merges) {
            return None;
        }
        self.table.finish(self.options)
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
                        "vocab" => {
                            map.next_value_seed(VocabSeed(&mut f.table))?;
                            f.table.has_vocab = true;
                        }
                        "merges" => {
                            map.next_value_seed(MergesSeed(&mut f.table))?;
                            f.table.has_merges = true;
                        }
                        "dropout" => f.options.dropout = map.next_value()?,
                        "unk_token" => f.options.unk_token = map.next_value()?,
                        "continuing_subword_prefix" => f.options.continuing_subword_prefix = map.next_value()?,
                        "end_of_word_suffix" => f.options.end_of_word_suffix = map.next_value()?,
                        "fuse_unk" => f.options.fuse_unk = map.next_value()?,
                        "byte_fallback" => f.options.byte_fallback = map.next_value()?,
                        "ignore_merges" => f.options.ignore_merges = map.next_value()?,
                        _ => {
                            map.next_value::<IgnoredAny>()?;
                        }
                    }
                }
                // A section without "type" is a legacy file: the crate guesses its model.
                Ok(if bpe {
                    FastModel::Bpe(Box::new(f))
                } else {
                    FastModel::Other
                })
            }
        }
        d.deserialize_map(V)
    }
}

/// A string, borrowed from the input where it has no escapes.
struct Text<'de>(Cow<'de, str>);

impl<'de> Deserialize<'de> for Text<'de> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Text<'de>;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a string")
            }
            fn visit_borrowed_str<E: de::Error>(self, s: &'de str) -> Result<Text<'de>, E> {
                Ok(Text(Cow::Borrowed(s)))
            }
            fn visit_str<E: de::Error>(self, s: &str) -> Result<Text<'de>, E> {
                Ok(Text(Cow::Owned(s.to_string())))
            }
            fn visit_string<E: de::Error>(self, s: String) -> Result<Text<'de>, E> {
                Ok(Text(Cow::Owned(s)))
            }
        }
        d.deserialize_str(V)
    }
}

/// The vocabulary object, read into the table builder.
struct VocabSeed<'a>(&'a mut TableBuilder);

impl<'de> DeserializeSeed<'de> for VocabSeed<'_> {
    type Value = ();
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for VocabSeed<'_> {
    type Value = ();
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a vocabulary object")
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        while let Some((text, id)) = map.next_entry::<Text, u32>()? {
            self.0.add_token(&text.0, id);
        }
        Ok(())
    }
}

/// Merges as `[["a", "b"], ...]` or the legacy `["a b", ...]` (lines starting `#version`
/// skipped, exactly two space-separated parts each), as the crate reads them, read into the
/// table builder.
struct MergesSeed<'a>(&'a mut TableBuilder);

impl<'de> DeserializeSeed<'de> for MergesSeed<'_> {
    type Value = ();
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_seq(self)
    }
}

impl<'de> Visitor<'de> for MergesSeed<'_> {
    type Value = ();
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a list of merges")
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        while seq.next_element_seed(MergeSeed(&mut *self.0))?.is_some() {}
        Ok(())
    }
}

/// One merge; a `#version` line of the legacy form is skipped.
struct MergeSeed<'a>(&'a mut TableBuilder);

impl<'de> DeserializeSeed<'de> for MergeSeed<'_> {
    type Value = ();
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for MergeSeed<'_> {
    type Value = ();
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("a merge: \"a b\" or [\"a\", \"b\"]")
    }
    fn visit_str<E: de::Error>(self, line: &str) -> Result<(), E> {
        if line.starts_with("#version") {
            return Ok(());
        }
        let mut parts = line.split(' ');
        match (parts.next(), parts.next(), parts.next()) {
            (Some(a), Some(b), None) => {
                self.0.add_merge(a, b);
                Ok(())
            }
            _ => Err(E::custom("a legacy merge is two space-separated tokens")),
        }
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        let a: Text = seq.next_element()?.ok_or_else(|| de::Error::invalid_length(0, &self))?;
        let b: Text = seq.next_element()?.ok_or_else(|| de::Error::invalid_length(1, &self))?;
        if seq.next_element::<IgnoredAny>()?.is_some() {
            return Err(de::Error::invalid_length(3, &self));
        }
        self.0.add_merge(&a.0, &b.0);
        Ok(())
    }
}
