//! Where `kiln chat` reads its lines: a line editor with history on a terminal, plain lines
//! from a pipe.

use crate::interrupt;
use anyhow::{Context as _, Result, anyhow};
use std::io::BufRead as _;

/// One read: a line, a line that is not UTF-8 (skipped), Ctrl-C at the prompt, or the end.
pub(super) enum Read {
    Line(String),
    NotUtf8,
    Interrupted,
    Eof,
}

/// Where lines come from: a line editor on a terminal, plain lines otherwise.
pub(super) enum Input {
    Editor(Box<rustyline::DefaultEditor>),
    Plain(std::io::StdinLock<'static>),
}

impl Input {
    pub(super) fn new(interactive: bool) -> Result<Input> {
        Ok(if interactive {
            let editor = interrupt::keeping_handler(rustyline::DefaultEditor::new)?;
            Input::Editor(Box::new(editor.context("starting the line editor")?))
        } else {
            Input::Plain(std::io::stdin().lock())
        })
    }

    pub(super) fn read(&mut self) -> Result<Read> {
        match self {
            Input::Editor(editor) => match editor.readline(">>> ") {
                Ok(line) => {
                    if !line.trim().is_empty() {
                        let _ = editor.add_history_entry(line.as_str());
                    }
                    Ok(Read::Line(line))
                }
                Err(rustyline::error::ReadlineError::Interrupted) => Ok(Read::Interrupted),
                Err(rustyline::error::ReadlineError::Eof) => Ok(Read::Eof),
                Err(e) => Err(anyhow!(e).context("reading the input")),
            },
            Input::Plain(stdin) => {
                let mut buf = Vec::new();
                if stdin.read_until(b'\n', &mut buf).context("reading the input")? == 0 {
                    return Ok(Read::Eof);
                }
                while buf.last().is_some_and(|&b| b == b'\n' || b == b'\r') {
                    buf.pop();
                }
                Ok(String::from_utf8(buf).map_or(Read::NotUtf8, Read::Line))
            }
        }
    }
}
