//! Checked writes to stdout and stderr, for every command.
//!
//! `println!` panics when a write fails (`kiln info M > /dev/full` ended with exit 101 and a
//! backtrace) and `let _ = write!(...)` loses output without a word, so the CLI writes only
//! through here (`clippy.toml` bans the print macros): a failed write is a [`WriteError`] naming
//! the stream, which `main` turns into one line on stderr (when stderr itself still works) and a
//! non-zero exit, or into a quiet exit when the reader closed the pipe.

use std::fmt;
use std::io::{self, Write};

/// The standard stream a write went to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stream {
    Stdout,
    Stderr,
}

impl Stream {
    fn name(self) -> &'static str {
        match self {
            Stream::Stdout => "stdout",
            Stream::Stderr => "stderr",
        }
    }
}

/// A write to stdout or stderr failed.
#[derive(Debug)]
pub struct WriteError {
    pub stream: Stream,
    pub source: io::Error,
}

impl WriteError {
    pub fn stdout(source: io::Error) -> WriteError {
        WriteError {
            stream: Stream::Stdout,
            source,
        }
    }

    pub fn stderr(source: io::Error) -> WriteError {
        WriteError {
            stream: Stream::Stderr,
            source,
        }
    }

    /// The reader went away (`kiln ... | head`): not an error worth a message.
    pub fn is_broken_pipe(&self) -> bool {
        self.source.kind() == io::ErrorKind::BrokenPipe
    }
}

impl fmt::Display for WriteError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "cannot write to {}: {}", self.stream.name(), self.source)
    }
}

impl std::error::Error for WriteError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.source)
    }
}

/// Writes `args` to stdout and flushes, so a failure shows here and not at exit.
pub fn write_stdout(args: fmt::Arguments<'_>) -> Result<(), WriteError> {
    let mut out = io::stdout().lock();
    out.write_fmt(args)
        .and_then(|()| out.flush())
        .map_err(WriteError::stdout)
}

/// Writes `args` to stderr (unbuffered).
pub fn write_stderr(args: fmt::Arguments<'_>) -> Result<(), WriteError> {
    let mut err = io::stderr().lock();
    err.write_fmt(args)
        .and_then(|()| err.flush())
        .map_err(WriteError::stderr)
}

/// The [`WriteError`] in `err`'s chain, if a write to stdout or stderr is what failed.
pub fn write_error(err: &anyhow::Error) -> Option<&WriteError> {
    err.chain().find_map(|cause| cause.downcast_ref::<WriteError>())
}

/// `println!` that returns `Result<(), WriteError>` instead of panicking.
macro_rules! outln {
    () => {
        $crate::output::write_stdout(format_args!("\n"))
    };
    ($($arg:tt)*) => {
        $crate::output::write_stdout(format_args!("{}\n", format_args!($($arg)*)))
    };
}

/// `eprintln!` that returns `Result<(), WriteError>` instead of panicking.
macro_rules! errln {
    ($($arg:tt)*) => {
        $crate::output::write_stderr(format_args!("{}\n", format_args!($($arg)*)))
    };
}

pub(crate) use {errln, outln};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_message_names_the_stream_and_the_cause() {
        let e = WriteError::stdout(io::Error::from_raw_os_error(libc::ENOSPC));
        assert!(
            e.to_string()
                .starts_with("cannot write to stdout: No space left on device")
        );
        assert!(!e.is_broken_pipe());
        assert!(WriteError::stderr(io::Error::from(io::ErrorKind::BrokenPipe)).is_broken_pipe());
    }

    #[test]
    fn a_write_error_is_found_under_context() {
        let e = anyhow::Error::new(WriteError::stderr(io::Error::from(io::ErrorKind::Other))).context("reporting");
        assert_eq!(write_error(&e).map(|w| w.stream), Some(Stream::Stderr));
        assert!(write_error(&anyhow::anyhow!("other")).is_none());
    }
}
