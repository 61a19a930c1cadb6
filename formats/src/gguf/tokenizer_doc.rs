//! The `tokenizer.json` text a GGUF vocabulary is rebuilt as (see `tokenizer.rs`), written
//! without building the large parts as a `serde_json` value.

use kiln_text::tokenizer::BpeParts;
use serde_json::{Map, Value as Json};

/// A `tokenizer.json` whose BPE `vocab` and `merges` (150k entries each for Qwen) are written
/// straight from borrowed lists: held as a `serde_json` map, they were sorted into a B-tree of
/// owned strings and then copied out again: over half of the samples `perf` took of a
/// one-token run of a Qwen2.5-0.5B GGUF (151k tokens) went there.
pub struct TokenizerDoc<'v> {
    /// Every top-level key but `model`.
    rest: Map<String, Json>,
    /// The BPE model's keys other than `vocab` and `merges`.
    model: Map<String, Json>,
    /// `vocab`: token text and id, in id order.
    vocab: Vec<(&'v str, u32)>,
    /// `merges`, by rank.
    merges: Vec<(&'v str, &'v str)>,
}

impl serde::Serialize for TokenizerDoc<'_> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap as _;
        let mut top = s.serialize_map(Some(self.rest.len() + 1))?;
        for (k, v) in &self.rest {
            top.serialize_entry(k, v)?;
        }
        top.serialize_entry("model", &BpeModel(self))?;
        top.end()
    }
}

/// The `model` object of a [`TokenizerDoc`].
struct BpeModel<'d, 'v>(&'d TokenizerDoc<'v>);

impl serde::Serialize for BpeModel<'_, '_> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap as _;
        let doc = self.0;
        let mut m = s.serialize_map(Some(doc.model.len() + 2))?;
        for (k, v) in &doc.model {
            m.serialize_entry(k, v)?;
        }
        m.serialize_entry("vocab", &VocabObject(&doc.vocab))?;
        m.serialize_entry("merges", &doc.merges)?;
        m.end()
    }
}

/// `{"text": id, ...}` in the list's order.
struct VocabObject<'d, 'v>(&'d [(&'v str, u32)]);

impl serde::Serialize for VocabObject<'_, '_> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_map(self.0.iter().map(|(t, id)| (t, id)))
    }
}

impl<'v> TokenizerDoc<'v> {
    /// The document as the parts the tokenizer is built from directly (see
    /// `kiln_text::tokenizer::BpeParts`), the document itself kept for the JSON route.
    pub fn bpe_parts(&self) -> BpeParts {
        BpeParts::new(
            self.rest.clone(),
            self.model.clone(),
            self.vocab.iter().copied(),
            self.merges.iter().copied(),
        )
    }

    /// `rest` (every top-level key but `model`), the BPE `model`'s keys other than `vocab` and
    /// `merges`, and those two as lists.
    pub fn new(
        rest: Map<String, Json>,
        model: Map<String, Json>,
        vocab: Vec<(&'v str, u32)>,
        merges: Vec<(&'v str, &'v str)>,
    ) -> Self {
        TokenizerDoc {
            rest,
            model,
            vocab,
            merges,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// The document serialises to the JSON the same parts give as one `serde_json` value, with
    /// `vocab` and `merges` inside `model` in the lists' order.
    #[test]
    fn serialises_as_the_equivalent_json_value() {
        let rest = json!({"version": "1.0", "added_tokens": [{"id": 2, "content": "<s>"}]});
        let model = json!({"type": "BPE", "dropout": null});
        let (Json::Object(rest), Json::Object(model)) = (rest, model) else {
            unreachable!()
        };
        let doc = TokenizerDoc::new(rest, model, vec![("b", 1), ("a", 0), ("ab", 2)], vec![("a", "b")]);
        let text = serde_json::to_string(&doc).unwrap();
        let want = json!({
            "version": "1.0",
            "added_tokens": [{"id": 2, "content": "<s>"}],
            "model": {"type": "BPE", "dropout": null, "vocab": {"a": 0, "b": 1, "ab": 2}, "merges": [["a", "b"]]},
        });
        assert_eq!(serde_json::from_str::<Json>(&text).unwrap(), want);
        assert!(text.contains(r#""vocab":{"b":1,"a":0,"ab":2}"#), "{text}");
    }
}
