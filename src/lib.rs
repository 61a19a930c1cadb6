//! The `kiln` package: the glue between the compiler, the cache and the runtime, and the
//! implementation of the CLI's commands.

pub mod bench;
pub mod chat;
pub mod commands;
pub mod interrupt;
pub mod output;
pub mod session;
