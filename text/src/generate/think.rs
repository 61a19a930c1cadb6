//! Reasoning blocks (`<think>...</think>`, as Qwen3, QwQ and DeepSeek-R1 write them) in
//! streamed text.

/// The tag that opens a reasoning block.
pub const OPEN: &str = "<think>";
/// The tag that closes it.
pub const CLOSE: &str = "</think>";

/// A piece of streamed text, as [`ThinkFilter`] classifies it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Part<'a> {
    /// Text of the answer.
    Answer(&'a str),
    /// Text inside a reasoning block.
    Thinking(&'a str),
    /// The `<think>` tag.
    Open,
    /// The `</think>` tag.
    Close,
}

/// Splits streamed text into answer and reasoning. A tail that could be the beginning of the
/// next tag is held back until the following piece shows whether it is one, so a tag split
/// over several tokens is still recognised and never half-printed.
#[derive(Clone, Debug, Default)]
pub struct ThinkFilter {
    thinking: bool,
    pending: String,
}

impl ThinkFilter {
    /// A filter that starts in the answer, or inside a reasoning block when the prompt already
    /// opened one (see [`prompt_opens_thinking`]).
    pub fn new(start_thinking: bool) -> ThinkFilter {
        ThinkFilter {
            thinking: start_thinking,
            pending: String::new(),
        }
    }

    /// Whether the text so far ends inside a reasoning block.
    pub fn is_thinking(&self) -> bool {
        self.thinking
    }

    /// Adds `text`, passing each complete part to `out`.
    pub fn push(&mut self, text: &str, out: &mut dyn FnMut(Part<'_>)) {
        self.pending.push_str(text);
        loop {
            let tag = if self.thinking { CLOSE } else { OPEN };
            if let Some(at) = self.pending.find(tag) {
                self.emit(at, out);
                out(if self.thinking { Part::Close } else { Part::Open });
                self.pending.drain(..tag.len());
                self.thinking = !self.thinking;
                continue;
            }
            let keep = (1..tag.len().min(self.pending.len() + 1))
                .rev()
                .find(|&k| {
                    self.pending.is_char_boundary(self.pending.len() - k)
                        && tag.starts_with(&self.pending[self.pending.len() - k..])
                })
                .unwrap_or(0);
            self.emit(self.pending.len() - keep, out);
            return;
        }
    }

    /// Passes on what is held back (the text ended).
    pub fn finish(&mut self, out: &mut dyn FnMut(Part<'_>)) {
        self.emit(self.pending.len(), out);
    }

    /// Sends `pending[..upto]` as the current kind of text and drops it.
    fn emit(&mut self, upto: usize, out: &mut dyn FnMut(Part<'_>)) {
        if upto > 0 {
            let text = &self.pending[..upto];
            out(if self.thinking {
                Part::Thinking(text)
            } else {
                Part::Answer(text)
            });
            self.pending.drain(..upto);
        }
    }
}

/// Whether a rendered prompt ends inside a reasoning block: its last `<think>` is not closed
/// (templates of reasoning models that always think put `<think>\n` into the generation
/// prompt, so the reply starts in the middle of the block).
pub fn prompt_opens_thinking(prompt: &str) -> bool {
    match prompt.rfind(OPEN) {
        Some(at) => !prompt[at..].contains(CLOSE),
        None => false,
    }
}

/// Splits a whole reply into (reasoning, answer): the text of its reasoning blocks, and the
/// rest with leading whitespace after a block dropped. `start_thinking` as for
/// [`ThinkFilter::new`].
pub fn split_thinking(text: &str, start_thinking: bool) -> (String, String) {
    let mut thinking = String::new();
    let mut answer = String::new();
    let mut after_block = false;
    let mut filter = ThinkFilter::new(start_thinking);
    let mut take = |part: Part<'_>| match part {
        Part::Thinking(t) => thinking.push_str(t),
        Part::Answer(t) => {
            let t = if after_block { t.trim_start() } else { t };
            after_block &= t.is_empty();
            answer.push_str(t);
        }
        Part::Open => {}
        Part::Close => after_block = true,
    };
    filter.push(text, &mut take);
    filter.finish(&mut take);
    (thinking, answer)
}
