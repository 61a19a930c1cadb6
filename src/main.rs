//! The `kiln` command line: parses arguments and calls the library. No engine logic lives here.

use anyhow::{Result, bail};
use clap::{Args, Parser, Subcommand};
use kiln::commands;
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(Parser)]
#[command(name = "kiln", version, about = "Compile a language model for this machine and run it")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Compile a model into the cache (a no-op when it is already compiled).
    Compile {
        /// Hugging Face model folder (config.json, *.safetensors, tokenizer.json).
        model: PathBuf,
        /// Write each kernel's MLIR (as emitted, dimensions baked in) into this folder.
        #[arg(long, value_name = "DIR")]
        emit_mlir: Option<PathBuf>,
        /// Write each kernel's assembly into this folder.
        #[arg(long, value_name = "DIR")]
        emit_asm: Option<PathBuf>,
        #[command(flatten)]
        build: BuildArgs,
        /// Print a JSON report on stdout.
        #[arg(long)]
        json: bool,
    },
    /// Generate text from a raw prompt.
    Run {
        model: PathBuf,
        /// The prompt, as raw text (no chat template).
        #[arg(long, short)]
        prompt: String,
        /// Maximum number of tokens to generate.
        #[arg(long, default_value_t = 256)]
        max_tokens: usize,
        #[command(flatten)]
        sampling: SamplingArgs,
        #[command(flatten)]
        build: BuildArgs,
        /// KV-cache capacity in tokens (default: the model's limit, at most 4096).
        #[arg(long)]
        ctx: Option<usize>,
        /// Print special tokens in the output.
        #[arg(long)]
        show_special: bool,
        /// Print one JSON object at the end instead of streaming text.
        #[arg(long)]
        json: bool,
    },
    /// Describe a model: architecture, dimensions, size, cache state.
    Info {
        model: PathBuf,
        #[command(flatten)]
        build: BuildArgs,
        #[arg(long)]
        json: bool,
    },
    /// Measure prefill and decode speed on a synthetic prompt (greedy, medians over reps).
    Bench {
        model: PathBuf,
        #[arg(long, default_value_t = 148)]
        prompt_tokens: usize,
        #[arg(long, default_value_t = 64)]
        gen_tokens: usize,
        #[arg(long, default_value_t = 5)]
        reps: usize,
        #[command(flatten)]
        build: BuildArgs,
        #[arg(long)]
        json: bool,
        /// Print the synthetic prompt's token ids as JSON and exit (for peer benchmarks).
        #[arg(long, hide = true)]
        print_prompt: bool,
    },
    /// Measure this machine's read bandwidth and FMA throughput with Kiln-compiled kernels.
    Probe {
        /// Passes per measurement (the best is kept).
        #[arg(long, default_value_t = 10)]
        passes: usize,
        #[arg(long)]
        json: bool,
    },
    /// Inspect or clean the compiled-library cache.
    Cache {
        #[command(subcommand)]
        action: CacheAction,
    },
    /// Remove cache entries (same as `kiln cache clean`).
    CleanCache(CleanArgs),
}

#[derive(Subcommand)]
enum CacheAction {
    /// List compiled libraries.
    List {
        #[arg(long)]
        json: bool,
    },
    /// Remove one entry (by key or unique key prefix) or, with --all, everything.
    Clean(CleanArgs),
}

#[derive(Args)]
struct CleanArgs {
    /// Key (or unique prefix) of the entry to remove.
    key: Option<String>,
    /// Remove every entry.
    #[arg(long)]
    all: bool,
}

/// Options that shape the compiled library or the engine.
#[derive(Args, Clone)]
struct BuildArgs {
    /// Compute threads (default: one per physical core).
    #[arg(long)]
    threads: Option<usize>,
    /// Rows per prefill block (compiled into the prefill kernels).
    #[arg(long, value_name = "ROWS")]
    prefill_block: Option<usize>,
}

#[derive(Args, Clone)]
struct SamplingArgs {
    /// Softmax temperature; 0 = greedy.
    #[arg(long, default_value_t = 0.8)]
    temperature: f32,
    /// Keep the K most likely tokens (0 = off).
    #[arg(long, default_value_t = 40)]
    top_k: usize,
    /// Nucleus sampling mass (1 = off).
    #[arg(long, default_value_t = 0.95)]
    top_p: f32,
    /// Drop tokens below this fraction of the top probability (0 = off).
    #[arg(long, default_value_t = 0.05)]
    min_p: f32,
    /// Seed for sampling (default: random; printed with --json).
    #[arg(long)]
    seed: Option<u64>,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match dispatch(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {}", kiln::session::one_line(&e));
            ExitCode::FAILURE
        }
    }
}

fn dispatch(cli: Cli) -> Result<()> {
    match cli.command {
        Command::Compile { model, emit_mlir, emit_asm, build, json } => commands::compile(&commands::CompileArgs {
            model,
            emit_mlir,
            emit_asm,
            threads: build.threads,
            prefill_block: build.prefill_block,
            json,
        }),
        Command::Run { model, prompt, max_tokens, sampling, build, ctx, show_special, json } => commands::run(&commands::RunArgs {
            model,
            prompt,
            max_tokens,
            sampling: kiln_runtime::sampler::SamplingParams {
                temperature: sampling.temperature,
                top_k: sampling.top_k,
                top_p: sampling.top_p,
                min_p: sampling.min_p,
                seed: sampling.seed,
                ..kiln_runtime::sampler::SamplingParams::greedy()
            },
            threads: build.threads,
            prefill_block: build.prefill_block,
            ctx,
            show_special,
            json,
        }),
        Command::Info { model, build, json } => commands::info(&model, build.prefill_block, json),
        Command::Probe { passes, json } => commands::probe(passes, json),
        Command::Bench { model, prompt_tokens, gen_tokens, reps, build, json, print_prompt } => kiln::bench::bench(&kiln::bench::BenchArgs {
            model,
            prompt_tokens,
            gen_tokens,
            reps,
            threads: build.threads,
            prefill_block: build.prefill_block,
            json,
            print_prompt,
        }),
        Command::Cache { action: CacheAction::List { json } } => commands::cache_list(json),
        Command::Cache { action: CacheAction::Clean(c) } | Command::CleanCache(c) => match (c.key, c.all) {
            (Some(_), true) => bail!("give either a KEY or --all, not both"),
            (None, false) => bail!("give the KEY of the entry to remove (see `kiln cache list`) or --all"),
            (key, _) => commands::cache_clean(key.as_deref()),
        },
    }
}
