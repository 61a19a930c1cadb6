//! Printing a streamed reply, its reasoning shown (styled on a terminal) or hidden.

use kiln_text::generate::{self, Part, ThinkFilter};
use std::io::{IsTerminal as _, Write};

/// ANSI: dim and italic on, then everything off.
const STYLE_THINKING: &str = "\x1b[2;3m";
const STYLE_RESET: &str = "\x1b[0m";

/// Whether replies on stdout get ANSI styles: stdout is a terminal and `NO_COLOR` is unset.
pub fn stdout_styled() -> bool {
    std::io::stdout().is_terminal() && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty())
}

/// Prints a streamed reply, showing or hiding its reasoning. Shown reasoning is dim and italic
/// (without its tags) when styled, and printed as it is, tags included, when not. Hidden
/// reasoning is replaced, on a terminal, by a dim "thinking…" that is erased when it ends; the
/// whitespace that follows a hidden block is dropped.
pub struct ReplyPrinter {
    filter: ThinkFilter,
    show_thinking: bool,
    styled: bool,
    /// After a hidden block, until the answer's first non-space character.
    skip_space: bool,
    /// The "thinking…" indicator is on screen.
    indicator: bool,
}

impl ReplyPrinter {
    pub fn new(show_thinking: bool, start_thinking: bool, styled: bool) -> ReplyPrinter {
        ReplyPrinter {
            filter: ThinkFilter::new(start_thinking),
            show_thinking,
            styled,
            skip_space: false,
            indicator: false,
        }
    }

    /// Prints the next piece of the reply; a failed write is returned (and the rest of the
    /// piece dropped).
    pub fn push(&mut self, text: &str, out: &mut dyn Write) -> std::io::Result<()> {
        let mut filter = std::mem::take(&mut self.filter);
        let mut written = Ok(());
        if filter.is_thinking()
            && !self.show_thinking
            && self.styled
            && !self.indicator
            && text.contains(|c: char| !c.is_whitespace())
        {
            // Started inside a block: the prompt opened it.
            written = self.show_indicator(out);
        }
        filter.push(text, &mut |part| {
            if written.is_ok() {
                written = self.part(part, out);
            }
        });
        self.filter = filter;
        written.and_then(|()| out.flush())
    }

    /// Ends the reply (held-back text is printed, styles are reset).
    pub fn finish(&mut self, out: &mut dyn Write) -> std::io::Result<()> {
        let mut filter = std::mem::take(&mut self.filter);
        let mut written = Ok(());
        filter.finish(&mut |part| {
            if written.is_ok() {
                written = self.part(part, out);
            }
        });
        written?;
        if self.indicator {
            self.clear_indicator(out)?;
        }
        out.flush()
    }

    fn show_indicator(&mut self, out: &mut dyn Write) -> std::io::Result<()> {
        self.indicator = true;
        write!(out, "{STYLE_THINKING}thinking…{STYLE_RESET}")
    }

    fn clear_indicator(&mut self, out: &mut dyn Write) -> std::io::Result<()> {
        self.indicator = false;
        write!(out, "\r\x1b[2K")
    }

    fn part(&mut self, part: Part<'_>, out: &mut dyn Write) -> std::io::Result<()> {
        match (part, self.show_thinking, self.styled) {
            (Part::Answer(t), ..) => {
                let t = if self.skip_space { t.trim_start() } else { t };
                self.skip_space &= t.is_empty();
                out.write_all(t.as_bytes())
            }
            (Part::Thinking(t), true, true) => write!(out, "{STYLE_THINKING}{t}{STYLE_RESET}"),
            (Part::Thinking(t), true, false) => out.write_all(t.as_bytes()),
            (Part::Open, true, false) => out.write_all(generate::think::OPEN.as_bytes()),
            (Part::Close, true, false) => out.write_all(generate::think::CLOSE.as_bytes()),
            (Part::Open, false, true) => self.show_indicator(out),
            (Part::Close, false, _) => {
                self.skip_space = true;
                if self.indicator {
                    self.clear_indicator(out)
                } else {
                    Ok(())
                }
            }
            _ => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn printed(show: bool, start: bool, styled: bool, chunks: &[&str]) -> String {
        let mut p = ReplyPrinter::new(show, start, styled);
        let mut out = Vec::new();
        for c in chunks {
            p.push(c, &mut out).unwrap();
        }
        p.finish(&mut out).unwrap();
        String::from_utf8(out).unwrap()
    }

    #[test]
    fn reasoning_is_hidden_styled_or_shown_as_is() {
        let chunks = ["<thi", "nk>\nLet me", " think.\n</th", "ink>\n\n", "The answer."];
        assert_eq!(printed(false, false, false, &chunks), "The answer.");
        assert_eq!(
            printed(true, false, false, &chunks),
            "<think>\nLet me think.\n</think>\n\nThe answer."
        );
        assert_eq!(
            printed(true, false, true, &chunks),
            "\x1b[2;3m\nLet me\x1b[0m\x1b[2;3m think.\n\x1b[0m\n\nThe answer."
        );
        // Hidden on a terminal: an indicator, erased when the block ends.
        assert_eq!(
            printed(false, false, true, &chunks),
            "\x1b[2;3mthinking…\x1b[0m\r\x1b[2KThe answer."
        );
        // The prompt opened the block.
        assert_eq!(printed(false, true, false, &["why</think>\n", "Because."]), "Because.");
        // No reasoning at all.
        assert_eq!(printed(false, false, true, &["Plain ", "text <b>"]), "Plain text <b>");
    }
}
