//! The `kiln` package: the glue between the compiler, the cache and the runtime, and the
//! implementation of the CLI's commands.

// Output goes through `output` (outln!/errln!), whose writes are checked; the print macros
// panic when a write fails.
#![deny(clippy::print_stdout, clippy::print_stderr)]

pub mod bench;
pub mod budget;
pub mod chat;
pub mod commands;
pub mod interrupt;
pub mod models;
pub mod output;
pub mod serve;
pub mod session;
