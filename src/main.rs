//! The `kiln` command line: parses arguments and calls the library. No engine logic lives here.

// Output goes through `output` (outln!/errln!), whose writes are checked; the print macros
// panic when a write fails.
#![deny(clippy::print_stdout, clippy::print_stderr)]

use anyhow::{Context as _, Result, bail};
use clap::Parser;
use kiln::{commands, output};
use std::path::PathBuf;
use std::process::ExitCode;

mod cli;
use cli::{CacheAction, Cli, Command};

/// Rust ignores SIGPIPE, which turns `kiln ... | head` into a panic on the next write to the
/// closed pipe; restore the default so the process ends quietly, as command-line tools do.
fn restore_sigpipe() {
    #[cfg(unix)]
    // SAFETY: setting a signal disposition to its default at start-up, before any thread exists.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
}

/// `--ctx`, which must be at least 1 (`--ctx 0` used to become a context of 1).
fn positive_ctx(ctx: Option<usize>) -> Result<Option<usize>> {
    kiln::session::at_least_one("--ctx", ctx)?;
    Ok(ctx)
}

/// The model named on the command line, or the installed demo model.
fn model_or_demo(model: Option<PathBuf>) -> Result<PathBuf> {
    match model {
        Some(m) => Ok(m),
        None => kiln::session::demo_model(),
    }
}

/// Logs of `kiln serve` on stderr: warnings, each request with `-v`, debug detail with `-vv`.
fn init_logging(verbose: u8) {
    let level = match verbose {
        0 => tracing_subscriber::filter::LevelFilter::WARN,
        1 => tracing_subscriber::filter::LevelFilter::INFO,
        _ => tracing_subscriber::filter::LevelFilter::DEBUG,
    };
    tracing_subscriber::fmt()
        .with_max_level(level)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_target(false)
        .init();
}

fn main() -> ExitCode {
    restore_sigpipe();
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => return usage_exit(&e),
    };
    match kiln::interrupt::install().and_then(|()| dispatch(cli)) {
        Ok(code) => code,
        Err(e) => {
            // An error caused by Ctrl-C's clean-up is not the process's to report.
            kiln::interrupt::yield_to_exit();
            fail(&e)
        }
    }
}

/// Exit status of a process whose reader closed the pipe: what a shell reports for a death by
/// SIGPIPE, the usual end of a command-line tool in `kiln ... | head`.
const BROKEN_PIPE_EXIT: u8 = 128 + 13;

/// Reports `e` as one line on stderr and gives the exit status. A failed write to stdout or
/// stderr says so where it still can: nothing for a closed pipe (the reader went away) or for a
/// broken stderr, one line on stderr for a broken stdout.
fn fail(e: &anyhow::Error) -> ExitCode {
    match output::write_error(e) {
        Some(w) if w.is_broken_pipe() => return ExitCode::from(BROKEN_PIPE_EXIT),
        Some(w) if w.stream == output::Stream::Stderr => return ExitCode::FAILURE,
        _ => {}
    }
    // Exit non-zero whether or not the message could be written: there is nowhere else to say it.
    let _ = output::write_stderr(format_args!("error: {}\n", kiln::session::one_line(e)));
    ExitCode::FAILURE
}

/// Prints clap's help, version or usage error, checking the write like every other output.
fn usage_exit(e: &clap::Error) -> ExitCode {
    match e.print() {
        Ok(()) => ExitCode::from(u8::try_from(e.exit_code()).unwrap_or(2)),
        Err(io) => {
            let w = if e.use_stderr() {
                output::WriteError::stderr(io)
            } else {
                output::WriteError::stdout(io)
            };
            fail(&w.into())
        }
    }
}

/// Runs the command and gives its exit status (`kiln run` stopped by Ctrl-C has its own).
fn dispatch(cli: Cli) -> Result<ExitCode> {
    let done = |result: Result<()>| result.map(|()| ExitCode::SUCCESS);
    match cli.command {
        Command::Run {
            model,
            prompt,
            prompt_file,
            chat,
            system,
            think,
            max_tokens,
            generate: cli::GenerateArgs { sampling, build, ctx },
            show_special,
            ignore_eos,
            json,
            quiet,
            debug_decode_delay_ms,
        } => commands::run(&commands::RunArgs {
            ctx: positive_ctx(ctx)?,
            prompt: match (prompt, prompt_file) {
                (Some(text), _) => text,
                (None, file) => commands::read_prompt_file(&file.context("give --prompt TEXT or --prompt-file FILE")?)?,
            },
            model: model_or_demo(model)?,
            chat,
            system,
            think,
            max_tokens,
            sampling: sampling.params(),
            sampling_flags: sampling.given(),
            stop: sampling.stop,
            build: build.choices()?,
            show_special,
            ignore_eos,
            json,
            quiet,
            decode_delay_ms: debug_decode_delay_ms,
        }),
        Command::Compile {
            model,
            emit_mlir,
            emit_asm,
            build,
            json,
        } => done(commands::compile(&commands::CompileArgs {
            model,
            emit_mlir,
            emit_asm,
            build: build.choices()?,
            json,
        })),
        Command::Chat {
            model,
            system,
            think,
            max_tokens,
            generate: cli::GenerateArgs { sampling, build, ctx },
            json,
            stats,
            quiet,
            debug_decode_delay_ms,
        } => done(kiln::chat::chat(&kiln::chat::ChatArgs {
            ctx: positive_ctx(ctx)?,
            model: model_or_demo(model)?,
            system,
            think,
            max_tokens,
            sampling: sampling.params(),
            sampling_flags: sampling.given(),
            stop: sampling.stop,
            build: build.choices()?,
            json,
            stats,
            quiet,
            decode_delay_ms: debug_decode_delay_ms,
        })),
        Command::Serve {
            model,
            host,
            port,
            parallel,
            max_queue,
            ctx,
            api_key,
            alias,
            shutdown_grace,
            verbose,
            build,
            debug_decode_delay_ms,
        } => {
            kiln::session::at_least_one("--parallel", Some(parallel))?;
            if parallel > kiln_core::abi::MAX_SLOTS {
                bail!(
                    "--parallel {parallel} is more than the {} sequences Kiln's KV caches hold at once",
                    kiln_core::abi::MAX_SLOTS
                );
            }
            // Every sequence's token of a step must fit one block.
            let block = build
                .prefill_block
                .unwrap_or(kiln_core::CompileOptions::DEFAULT_PREFILL_ROWS);
            if parallel > block {
                bail!(
                    "--parallel {parallel} exceeds --prefill-block {block}: a step holds one token of every sequence"
                );
            }
            init_logging(verbose);
            kiln::serve::serve(kiln::serve::ServeArgs {
                model: model_or_demo(model)?,
                alias,
                server: kiln_server::ServerConfig {
                    host,
                    port,
                    api_key,
                    shutdown_grace: std::time::Duration::from_secs(shutdown_grace),
                    ..kiln_server::ServerConfig::default()
                },
                parallel,
                max_queue,
                ctx: positive_ctx(ctx)?,
                build: build.choices()?,
                decode_delay_ms: debug_decode_delay_ms,
            })
        }
        Command::Info {
            model,
            build,
            ctx,
            json,
        } => done(commands::info(&model, &build.choices()?, positive_ctx(ctx)?, json)),
        Command::Probe { passes, json } => done(commands::probe(passes, json)),
        Command::Debug {
            model,
            prompt,
            ids,
            chat,
            all_tokens,
            build,
        } => done(commands::debug_layers(&commands::DebugArgs {
            model,
            prompt,
            ids,
            chat,
            all_tokens,
            build: build.choices()?,
        })),
        Command::Bench {
            model,
            prompt_tokens,
            gen_tokens,
            reps,
            build,
            json,
            print_prompt,
            no_probe,
            batch,
            ctx,
        } => done(kiln::bench::bench(&kiln::bench::BenchArgs {
            model,
            prompt_tokens,
            gen_tokens,
            reps,
            build: build.choices()?,
            json,
            print_prompt,
            no_probe,
            batch,
            ctx: positive_ctx(ctx)?,
        })),
        Command::Cache {
            action: CacheAction::List { json },
        } => done(commands::cache_list(json)),
        Command::Cache {
            action: CacheAction::Clean(c),
        }
        | Command::CleanCache(c) => done(commands::cache_clean(match (c.key, c.all, c.stale) {
            (Some(key), false, false) => commands::CleanWhat::Entry(key),
            (None, true, false) => commands::CleanWhat::All,
            (None, false, true) => commands::CleanWhat::Stale,
            (None, false, false) => {
                bail!("give the KEY of the entry to remove (see `kiln cache list`), --stale or --all")
            }
            _ => bail!("give one of a KEY, --stale or --all"),
        })),
        Command::Pull { model, quiet } => done(kiln::models::pull(&model, quiet)),
        Command::List { json } => done(kiln::models::list(json)),
        Command::Rm { model } => done(kiln::models::rm(&model)),
    }
}
