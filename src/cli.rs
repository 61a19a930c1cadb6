//! The command line's grammar: every subcommand, its flags and their help text (clap), and the
//! small conversions from flags to the library's choices. `main.rs` dispatches on it.

use anyhow::Result;
use clap::{Args, Parser, Subcommand};
use kiln_core::DType;
use kiln_text::sampler::{SamplingChoice, SamplingParams};
use std::path::PathBuf;

#[derive(Parser)]
#[command(
    name = "kiln",
    version,
    about = "Compile a language model for this machine and run it"
)]
pub(crate) struct Cli {
    #[command(subcommand)]
    pub(crate) command: Command,
}

#[derive(Subcommand)]
pub(crate) enum Command {
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
    /// Generate text from a prompt: raw text, or one user turn through the chat template (--chat).
    Run {
        /// Model folder, its config.json, a GGUF file, or a Hugging Face id (org/name,
        /// org/name:QUANT or org/name/FILE.gguf, each with an optional @revision). Default: the
        /// demo model (scripts/fetch-demo-model.sh).
        model: Option<PathBuf>,
        /// The prompt: raw text, or with --chat the user's message.
        #[arg(long, short, required_unless_present = "prompt_file")]
        prompt: Option<String>,
        /// Read the prompt from FILE instead, exactly as it is (`-`: standard input); for
        /// prompts too long for the command line.
        #[arg(long, value_name = "FILE", conflicts_with = "prompt")]
        prompt_file: Option<PathBuf>,
        /// Send the prompt as one user turn through the model's chat template.
        #[arg(long)]
        chat: bool,
        /// System prompt (with --chat).
        #[arg(long, requires = "chat")]
        system: Option<String>,
        /// Show the model's reasoning (<think> blocks); without it the template is asked not to
        /// think and reasoning is hidden (with --chat).
        #[arg(long, requires = "chat")]
        think: bool,
        /// Maximum number of tokens to generate.
        #[arg(long, default_value_t = 256)]
        max_tokens: usize,
        #[command(flatten)]
        generate: GenerateArgs,
        /// Print special tokens in the output.
        #[arg(long)]
        show_special: bool,
        /// Do not stop at end-of-sequence tokens (for comparisons of fixed-length output).
        #[arg(long)]
        ignore_eos: bool,
        /// Print one JSON object at the end instead of streaming text.
        #[arg(long)]
        json: bool,
        /// No progress bars and no statistics on stderr: only the generated text on stdout.
        #[arg(long, short)]
        quiet: bool,
        /// Sleep this long before each decode step (for tests that interrupt generation).
        #[arg(long, hide = true, default_value_t = 0)]
        debug_decode_delay_ms: u64,
    },
    /// Chat with a model: a multi-turn session whose KV cache is kept across turns.
    Chat {
        /// Model folder, its config.json, a GGUF file, or a Hugging Face id (org/name,
        /// org/name:QUANT or org/name/FILE.gguf, each with an optional @revision). Default: the
        /// demo model (scripts/fetch-demo-model.sh).
        model: Option<PathBuf>,
        /// System prompt.
        #[arg(long)]
        system: Option<String>,
        /// Show the model's reasoning (<think> blocks, dimmed on a terminal); without it the
        /// template is asked not to think and reasoning is hidden.
        #[arg(long)]
        think: bool,
        /// Maximum tokens per reply (default: until the end of the turn or a full context).
        #[arg(long)]
        max_tokens: Option<usize>,
        #[command(flatten)]
        generate: GenerateArgs,
        /// One JSON object per event on stdout (ready, start, turn, reset, context_full, ...)
        /// instead of streamed text: a transcript for scripts.
        #[arg(long)]
        json: bool,
        /// After each reply, print on stderr how many prompt tokens were reused from the KV cache
        /// and how many were prefilled, with speeds.
        #[arg(long)]
        stats: bool,
        /// No banner, progress bars or statistics.
        #[arg(long, short)]
        quiet: bool,
        /// Sleep this long before each decode step (for tests that interrupt a reply).
        #[arg(long, hide = true, default_value_t = 0)]
        debug_decode_delay_ms: u64,
    },
    /// Serve a model over an OpenAI-compatible HTTP API (chat and text completions, models,
    /// health, metrics), decoding up to --parallel requests together.
    Serve {
        /// Model folder, its config.json, a GGUF file, or a Hugging Face id. Default: the demo
        /// model (scripts/fetch-demo-model.sh).
        model: Option<PathBuf>,
        /// Address to listen on.
        #[arg(long, default_value = "127.0.0.1")]
        host: String,
        /// Port to listen on (0: any free port; the address is printed).
        #[arg(long, default_value_t = 8080)]
        port: u16,
        /// Requests decoded together, each with its own KV cache of --ctx tokens.
        #[arg(long, default_value_t = 4, value_name = "N")]
        parallel: usize,
        /// Requests that may wait for a free slot; beyond them new requests get 503 with
        /// Retry-After.
        #[arg(long, default_value_t = 64, value_name = "N")]
        max_queue: usize,
        /// KV-cache capacity in tokens per request (default: the model's limit, at most 4096).
        #[arg(long)]
        ctx: Option<usize>,
        /// Require `Authorization: Bearer KEY` on /v1/* requests.
        #[arg(long, value_name = "KEY", env = "KILN_API_KEY", hide_env_values = true)]
        api_key: Option<String>,
        /// The model id /v1/models lists and requests use (default: the model's folder or
        /// file name, or the hub id).
        #[arg(long)]
        alias: Option<String>,
        /// Seconds in-flight requests get to finish after SIGTERM or Ctrl-C.
        #[arg(long, default_value_t = 30, value_name = "SECONDS")]
        shutdown_grace: u64,
        /// Log each request on stderr (-vv: debug detail).
        #[arg(short, long, action = clap::ArgAction::Count)]
        verbose: u8,
        #[command(flatten)]
        build: BuildArgs,
        /// Sleep this long before each decode step (for tests of cancellation).
        #[arg(long, hide = true, default_value_t = 0)]
        debug_decode_delay_ms: u64,
    },
    /// Describe a model: architecture, dimensions, size, cache state.
    Info {
        model: PathBuf,
        #[command(flatten)]
        build: BuildArgs,
        /// KV-cache capacity in tokens, for the --ram-budget plan (default: as `run`).
        #[arg(long)]
        ctx: Option<usize>,
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
        /// Do not measure the read bandwidth between repetitions (judge decode against the
        /// stored `kiln probe` only).
        #[arg(long)]
        no_probe: bool,
        /// Also measure decode of N sequences batched together, as `kiln serve` steps them.
        #[arg(long, default_value_t = 1, value_name = "N")]
        batch: usize,
        /// KV-cache capacity in tokens (default: as `run`).
        #[arg(long)]
        ctx: Option<usize>,
    },
    /// Print the residual stream after every layer for a prompt (for numerical comparisons
    /// against a reference, see scripts/compare_layers.py).
    Debug {
        model: PathBuf,
        #[arg(long, short, required_unless_present = "ids")]
        prompt: Option<String>,
        /// Token ids to prefill instead of a prompt (comma-separated).
        #[arg(long, value_delimiter = ',', conflicts_with = "prompt")]
        ids: Option<Vec<u32>>,
        /// Encode the prompt as one user turn through the chat template.
        #[arg(long)]
        chat: bool,
        /// Include every token's residual, not only the last token's.
        #[arg(long)]
        all_tokens: bool,
        #[command(flatten)]
        build: BuildArgs,
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
    /// Download a model from the Hugging Face hub without running it; prints its local path.
    Pull {
        /// org/name, org/name:QUANT (a GGUF quant, e.g. Q4_K_M) or org/name/FILE.gguf,
        /// each with an optional @revision.
        model: String,
        /// No progress bars or notes on stderr.
        #[arg(long, short)]
        quiet: bool,
    },
    /// List the models in the Hugging Face cache and Kiln's models folder: size, compiled or not.
    List {
        #[arg(long)]
        json: bool,
    },
    /// Remove a model from the Hugging Face cache (with its unshared blobs) or Kiln's models folder.
    Rm {
        /// An id as `kiln list` shows it.
        model: String,
    },
}

#[derive(Subcommand)]
pub(crate) enum CacheAction {
    /// List compiled libraries and row-grouped weight copies (and which copies are stale).
    List {
        /// One JSON array: each library (`"kind": "library"`), then each copy
        /// (`"kind": "grouped_copy"`, with `path`, `bytes`, `stale`).
        #[arg(long)]
        json: bool,
    },
    /// Remove one entry (by key or unique key prefix); with --stale, the row-grouped weight
    /// copies of model files that are gone or changed; with --all, everything.
    Clean(CleanArgs),
}

#[derive(Args)]
pub(crate) struct CleanArgs {
    /// Key (or unique prefix) of the entry to remove.
    pub(crate) key: Option<String>,
    /// Remove every entry.
    #[arg(long)]
    pub(crate) all: bool,
    /// Remove only the row-grouped weight copies that serve no model any more (their model
    /// files are gone or changed).
    #[arg(long)]
    pub(crate) stale: bool,
}

/// Options that shape the compiled library or the engine.
#[derive(Args, Clone)]
pub(crate) struct BuildArgs {
    /// Compute threads (default: one per physical core; at most the CPUs this process may run
    /// on unless --threads-oversubscribe).
    #[arg(long, value_name = "N")]
    pub(crate) threads: Option<usize>,
    /// Use --threads N even when it exceeds the CPUs this process may run on (threads then
    /// take turns on the CPUs).
    #[arg(long, requires = "threads")]
    pub(crate) threads_oversubscribe: bool,
    /// Rows per prefill block (compiled into the prefill kernels).
    #[arg(long, value_name = "ROWS")]
    pub(crate) prefill_block: Option<usize>,
    /// Convert quantised GGUF weights to bf16 or f32 at load instead of reading them as stored.
    #[arg(long, value_name = "TYPE", value_parser = parse_float_dtype)]
    pub(crate) dequantize: Option<DType>,
    /// Generate code for an x86-64 level instead of this CPU: x86-64-v2 (SSE4.2), x86-64-v3
    /// (AVX2 + FMA) or x86-64-v4 (AVX-512); it must be one this CPU can run. Lets an AVX-512
    /// machine build, inspect and measure the code an AVX2 machine gets.
    #[arg(long, value_name = "LEVEL")]
    pub(crate) target_cpu: Option<String>,
    /// Keep the weights and the KV cache within SIZE bytes (512M, 2G, ...): layers that do not
    /// fit are read from disk each time they are used. Output is identical at any budget.
    #[arg(long, value_name = "SIZE", value_parser = kiln_core::budget::parse_size)]
    pub(crate) ram_budget: Option<u64>,
    /// Store the KV cache as f32 (the default: exact), f16 or bf16 (half the memory and the
    /// bytes attention reads; keys and values rounded to nearest as they are stored).
    #[arg(long, value_name = "TYPE", value_parser = kiln_core::spec::Elem::parse_kv)]
    pub(crate) kv_dtype: Option<kiln_core::spec::Elem>,
    /// Matmul arithmetic: exact (f32 products, the default); bf16 (over bf16 weights,
    /// activations rounded to bf16, pairs of products summed by AVX512-BF16's vdpbf16ps: faster
    /// prefill); q8 (over GGUF block weights, activations rounded to 8-bit integers per group
    /// of 32, as llama.cpp does: faster quantised decode).
    #[arg(long, value_name = "MODE", value_parser = kiln_core::Precision::parse, default_value = "exact")]
    pub(crate) precision: kiln_core::Precision,
}

impl BuildArgs {
    /// The checked choices (see [`kiln::session::BuildChoices::checked`]).
    pub(crate) fn choices(self) -> Result<kiln::session::BuildChoices> {
        kiln::session::BuildChoices {
            threads: self.threads,
            prefill_block: self.prefill_block,
            dequantize: self.dequantize,
            target_cpu: self.target_cpu,
            ram_budget: self.ram_budget,
            kv_dtype: self.kv_dtype,
            precision: self.precision,
        }
        .checked(self.threads_oversubscribe)
    }
}

pub(crate) fn parse_float_dtype(s: &str) -> Result<DType, String> {
    match s {
        "bf16" => Ok(DType::BF16),
        "f32" => Ok(DType::F32),
        _ => Err(format!("expected bf16 or f32, not {s:?}")),
    }
}

/// What every command that generates text takes: sampling, the build, and the context.
#[derive(Args, Clone)]
pub(crate) struct GenerateArgs {
    #[command(flatten)]
    pub(crate) sampling: SamplingArgs,
    #[command(flatten)]
    pub(crate) build: BuildArgs,
    /// KV-cache capacity in tokens (default: the model's limit, at most 4096).
    #[arg(long)]
    pub(crate) ctx: Option<usize>,
}

#[derive(Args, Clone)]
pub(crate) struct SamplingArgs {
    /// Softmax temperature; 0 = greedy. Default: the model's generation_config.json (where
    /// `do_sample: false` means 0), else 0.8.
    #[arg(long)]
    pub(crate) temperature: Option<f32>,
    /// Keep the K most likely tokens (0 = off). Default: generation_config.json, else 40.
    #[arg(long)]
    pub(crate) top_k: Option<usize>,
    /// Nucleus sampling mass (1 = off). Default: generation_config.json, else 0.95.
    #[arg(long)]
    pub(crate) top_p: Option<f32>,
    /// Drop tokens below this fraction of the top probability (0 = off). Default:
    /// generation_config.json, else 0.05.
    #[arg(long)]
    pub(crate) min_p: Option<f32>,
    /// Seed for sampling (default: random; printed with --json). The same seed gives the same
    /// output.
    #[arg(long)]
    pub(crate) seed: Option<u64>,
    /// Divide the positive logits of tokens already in the text by this, multiply the negative
    /// ones (1 = off). Default: generation_config.json, else 1.
    #[arg(long)]
    pub(crate) repetition_penalty: Option<f32>,
    /// Subtract this from a token's logit for each time it occurs in the text (0 = off).
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    pub(crate) frequency_penalty: f32,
    /// Subtract this from the logit of every token that occurs in the text (0 = off).
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    pub(crate) presence_penalty: f32,
    /// Stop when this text appears (repeatable); it is not printed.
    #[arg(long, value_name = "STRING", allow_hyphen_values = true)]
    pub(crate) stop: Vec<String>,
}

impl SamplingArgs {
    /// The flags given of those a model's generation_config.json can also set.
    pub(crate) fn given(&self) -> SamplingChoice {
        SamplingChoice {
            temperature: self.temperature,
            top_k: self.top_k,
            top_p: self.top_p,
            min_p: self.min_p,
            repetition_penalty: self.repetition_penalty,
        }
    }

    /// The flags over Kiln's defaults: the base the model's values go under, checked before
    /// the model is opened.
    pub(crate) fn params(&self) -> SamplingParams {
        let base = SamplingParams {
            seed: self.seed,
            frequency_penalty: self.frequency_penalty,
            presence_penalty: self.presence_penalty,
            ..SamplingParams::default()
        };
        SamplingChoice::resolve(&self.given(), &SamplingChoice::default(), base).params
    }
}
