//! Incremental detokenisation: text as the tokens come, one id at a time.

use super::{Tokenizer, TokenizerError};

/// Turns a stream of token ids into text chunks.
///
/// [`TextStreamer::step`] returns the text that the new id completes, or `None` while it
/// completes nothing. Joining every chunk, then the one [`TextStreamer::finish`] returns,
/// gives exactly `tokenizer.decode(all_ids, skip_special_tokens)`, including the decoders'
/// rules that depend on context (a SentencePiece decoder drops the space at the very start of
/// the text only).
///
/// One exception, where no stream can be exact: the `ByteFallback` decoder of SentencePiece
/// tokenizers turns a run of `<0xNN>` pieces that is not valid UTF-8 into one U+FFFD *per
/// byte*, including bytes that formed complete characters. So if a model writes, say, the
/// four pieces of "🦀" and then a stray `<0xBF>`, `decode` gives five U+FFFD where the stream
/// has already sent "🦀"; the stream then sends the decoding of the new pieces alone ("�").
/// Byte-level BPE decoding (Qwen, Llama 3) has no such case.
///
/// A character whose bytes are spread over several tokens (byte-level BPE pieces, or
/// `<0xE2>`-style byte-fallback pieces) is held back until its last byte arrives: no chunk
/// ever ends in the U+FFFD that an incomplete UTF-8 sequence decodes to. The cost is that a
/// genuine trailing U+FFFD (an invalid byte sequence, or the model writing U+FFFD itself) is
/// only emitted with the next chunk, or by `finish`.
///
/// It works like the prefix-offset method of `tokenizers`' `DecodeStream` and vLLM: each
/// step decodes the ids from the start of the previous chunk and emits what extends the
/// previous chunk's text, so a step costs the decoding of a few tokens whatever the length of
/// the output. It owns a handle to the tokenizer (a cheap clone), so it can live next to it.
#[derive(Debug, Clone)]
pub struct TextStreamer {
    tokenizer: Tokenizer,
    skip_special_tokens: bool,
    /// The ids from the start of the previous chunk on.
    ids: Vec<u32>,
    /// `ids[..read]` have been emitted; `ids[..read]` decodes to `prefix_text`.
    read: usize,
    prefix_text: String,
}

impl TextStreamer {
    /// A streamer with nothing decoded yet.
    pub fn new(tokenizer: &Tokenizer, skip_special_tokens: bool) -> TextStreamer {
        TextStreamer {
            tokenizer: tokenizer.clone(),
            skip_special_tokens,
            ids: Vec::new(),
            read: 0,
            prefix_text: String::new(),
        }
    }

    /// Feeds one id; returns the text it completes, if any.
    pub fn step(&mut self, id: u32) -> Result<Option<String>, TokenizerError> {
        self.ids.push(id);
        let text = self.tokenizer.decode(&self.ids, self.skip_special_tokens)?;
        if text.ends_with('\u{FFFD}') {
            return Ok(None);
        }
        let chunk = self.new_part(text)?;
        if chunk.is_empty() {
            return Ok(None);
        }
        // The chunk just emitted becomes the context of the next step.
        self.ids.drain(..self.read);
        self.read = self.ids.len();
        self.prefix_text = self.tokenizer.decode(&self.ids, self.skip_special_tokens)?;
        Ok(Some(chunk))
    }

    /// Ends the stream: returns the text still held back (an incomplete character decodes to
    /// U+FFFD here, as in `decode`), and empties the streamer for a new sequence.
    pub fn finish(&mut self) -> Result<Option<String>, TokenizerError> {
        let chunk = if self.read < self.ids.len() {
            let text = self.tokenizer.decode(&self.ids, self.skip_special_tokens)?;
            Some(self.new_part(text)?).filter(|c| !c.is_empty())
        } else {
            None
        };
        self.reset();
        Ok(chunk)
    }

    /// Forgets everything fed so far.
    pub fn reset(&mut self) {
        self.ids.clear();
        self.read = 0;
        self.prefix_text.clear();
    }

    /// The part of `text` (the decoding of `ids`) past the previous chunk's text.
    fn new_part(&self, mut text: String) -> Result<String, TokenizerError> {
        if text.starts_with(self.prefix_text.as_str()) {
            text.drain(..self.prefix_text.len());
            return Ok(text);
        }
        // The new ids changed the text already sent (an invalid byte-fallback run, see
        // above): send what the new ids decode to on their own.
        self.tokenizer.decode(&self.ids[self.read..], self.skip_special_tokens)
    }
}
