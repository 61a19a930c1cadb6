//! What each CLI command does, in terms of the session and the crates. Output formatting lives
//! here; engine logic does not.

mod cache;
mod probe;

pub use cache::{CleanWhat, cache_clean, cache_list};
pub use probe::{load_probe, probe, probe_library};

use crate::chat;
use crate::interrupt::{self, OnInterrupt};
use crate::output::{WriteError, errln, outln};
use crate::session::{self, BuildChoices, OpenOptions, PreparedModel, cache_key, ensure_compiled, open_cache};
use anyhow::{Context as _, Result};
use kiln_cache::{Cache, Lookup};
use kiln_core::HostCpu;
use kiln_text::chat_template::RenderOptions;
use kiln_text::generate::{GenerateOptions, Generation, StopReason, generate};
use kiln_text::sampler::{ResolvedSampling, SamplingChoice, SamplingParams};
use serde_json::json;
use std::io::{Read as _, Write};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

pub struct CompileArgs {
    /// Threads, prefill block, dequantisation and target CPU.
    pub build: BuildChoices,
    pub model: PathBuf,
    pub emit_mlir: Option<PathBuf>,
    pub emit_asm: Option<PathBuf>,
    pub json: bool,
}

pub fn compile(args: &CompileArgs) -> Result<()> {
    let t0 = Instant::now();
    let opts = OpenOptions {
        emit_mlir: args.emit_mlir.clone(),
        emit_asm: args.emit_asm.clone(),
        progress: !args.json,
        ..args.build.open_options()
    };
    let loaded = PreparedModel::open(&args.model, &opts)?;
    let host = HostCpu::detect();
    let cache = open_cache(None)?;
    let lib = ensure_compiled(&loaded.spec, &loaded.dir, &host, &cache, &opts)?;
    let report = json!({
        "model": loaded.dir.display().to_string(),
        "cache_key": lib.key.to_string(),
        "library": lib.path.display().to_string(),
        "library_bytes": lib.library_bytes,
        "kernels": lib.kernels,
        "cache_hit": lib.cache_hit(),
        "compile_s": lib.compile_seconds,
        "total_s": t0.elapsed().as_secs_f64(),
        "mlir_contexts": kiln_compiler::mlir_contexts_created(),
    });
    if args.json {
        outln!("{report}")?;
    } else {
        let state = if lib.cache_hit() {
            "already compiled".to_string()
        } else {
            format!("compiled in {:.2} s", lib.compile_seconds)
        };
        outln!("{}: {state}", loaded.dir.display())?;
        outln!("  key      {}", lib.key)?;
        outln!(
            "  library  {} ({} kernels, {} bytes)",
            lib.path.display(),
            lib.kernels,
            lib.library_bytes
        )?;
        for (what, dir) in [("MLIR", &args.emit_mlir), ("assembly", &args.emit_asm)] {
            if let Some(d) = dir {
                outln!("  {what} written to {}", d.display())?;
            }
        }
    }
    Ok(())
}

pub struct RunArgs {
    /// Threads, prefill block, dequantisation and target CPU.
    pub build: BuildChoices,
    pub model: PathBuf,
    pub prompt: String,
    /// Send the prompt as one user turn through the chat template.
    pub chat: bool,
    /// System prompt (with `chat`).
    pub system: Option<String>,
    /// Show reasoning blocks; otherwise the template is asked not to think and they are hidden
    /// (with `chat`).
    pub think: bool,
    pub max_tokens: usize,
    /// The flags over Kiln's defaults (checked before the model is opened).
    pub sampling: SamplingParams,
    /// Which of the keys a model can set the user gave: the others come from the model's
    /// generation_config.json when it states them.
    pub sampling_flags: SamplingChoice,
    /// Stop strings (not printed).
    pub stop: Vec<String>,
    pub ctx: Option<usize>,
    pub show_special: bool,
    pub ignore_eos: bool,
    pub json: bool,
    /// No progress bars or statistics on stderr.
    pub quiet: bool,
    /// Test hook: sleep this long before each decode step (to interrupt generation reliably).
    pub decode_delay_ms: u64,
}

/// `kiln run`. Ctrl-C during generation stops it and the text or JSON so far is printed; the
/// exit status is then [`interrupt::EXIT_STATUS`].
pub fn run(args: &RunArgs) -> Result<ExitCode> {
    args.sampling.validate()?;
    let opts = OpenOptions {
        ctx: args.ctx,
        progress: !args.json && !args.quiet,
        page_in: true,
        ..args.build.open_options()
    };
    let prepared = PreparedModel::open(&args.model, &opts)?;
    // With --chat: the rendered prompt, and whether it leaves the reply inside a <think> block.
    let (prompt_ids, starts_thinking) = if args.chat {
        let template = chat::load_template(
            &prepared.tokenizer,
            &args.model,
            "run without --chat to send the prompt as raw text",
        )?;
        let options = RenderOptions {
            add_generation_prompt: true,
            enable_thinking: chat::thinking_option(&prepared.tokenizer, args.think),
            ..RenderOptions::default()
        };
        let prompt = chat::render_single(&template, &options, args.system.as_deref(), &args.prompt)?;
        (prepared.tokenizer.encode(&prompt.text, false)?, prompt.opens_thinking)
    } else {
        (prepared.tokenizer.encode(&args.prompt, true)?, false)
    };
    if prompt_ids.is_empty() {
        anyhow::bail!("the prompt encodes to no tokens");
    }
    let ctx = prepared.ctx(&opts)?;
    if prompt_ids.len() > ctx {
        anyhow::bail!(
            "the prompt has {} tokens but the context holds {ctx} (model limit {}); shorten the prompt or raise --ctx",
            prompt_ids.len(),
            prepared.spec.dims.max_position_embeddings
        );
    }
    let sampling = SamplingChoice::resolve(&args.sampling_flags, &prepared.sampling, args.sampling);
    let mut session = prepared.into_session(&opts)?;
    // From here the first Ctrl-C stops generation and the second ends the process.
    interrupt::set(OnInterrupt::CancelThenExit);
    let cancel = interrupt::cancel_flag();
    let eos_token_ids = if args.ignore_eos {
        Vec::new()
    } else if args.chat {
        chat::chat_stop_ids(&session.tokenizer, session.eos_token_ids())
    } else {
        session.eos_token_ids()
    };
    let options = GenerateOptions {
        max_tokens: args.max_tokens,
        sampling: sampling.params,
        eos_token_ids,
        show_special: args.show_special,
        stop: args.stop.clone(),
        cancel: Some(cancel.clone()),
    };
    let mut sink = TextSink::new(args, starts_thinking, cancel.clone());
    let tokenizer = session.tokenizer.clone();
    let mut model = chat::Paced {
        engine: &mut session.engine,
        delay: Duration::from_millis(args.decode_delay_ms),
        checkpoint_at: None,
    };
    let generation = generate(&mut model, &tokenizer, &prompt_ids, &options, &mut |piece| {
        sink.push(piece)
    })?;
    sink.finish()?;
    crate::bench::write_profile(&session)?;
    if args.json {
        outln!("{}", run_report(&session, &generation, &sampling))?;
    } else if !args.quiet {
        errln!(
            "[{} prompt tokens, {:.1} tok/s prefill; {} generated, {:.1} tok/s decode; {}{}]",
            generation.prompt_token_ids.len(),
            generation.prefill_tok_s(),
            generation.token_ids.len(),
            generation.decode_tok_s(),
            if session.library.cache_hit() {
                "cached library".to_string()
            } else {
                format!("compiled in {:.2} s", session.library.compile_seconds)
            },
            if generation.stop == StopReason::Cancelled {
                "; stopped by Ctrl-C"
            } else {
                ""
            },
        )?;
    }
    // The process ends after this: freeing a large vocabulary's maps one string at a time
    // would only delay the exit (~0.1 s for Qwen's 151k tokens on a 2-core EPYC). The
    // session's background work is waited for first, as dropping it would.
    for note in session.engine.finish_writes() {
        errln!("warning: {note}")?;
    }
    std::mem::forget(tokenizer);
    std::mem::forget(session);
    // Cancelled by Ctrl-C: a failed write, the other way to cancel, returned above.
    Ok(if generation.stop == StopReason::Cancelled {
        ExitCode::from(interrupt::EXIT_STATUS)
    } else {
        ExitCode::SUCCESS
    })
}

/// The prompt in `path` (`-`: standard input), as UTF-8 text exactly as it is (`--prompt-file`).
pub fn read_prompt_file(path: &Path) -> Result<String> {
    let (name, bytes) = if path == Path::new("-") {
        let mut bytes = Vec::new();
        std::io::stdin()
            .lock()
            .read_to_end(&mut bytes)
            .context("cannot read the prompt from standard input")?;
        ("from standard input".to_string(), bytes)
    } else {
        let bytes = std::fs::read(path).with_context(|| format!("cannot read the prompt file {}", path.display()))?;
        (format!("file {}", path.display()), bytes)
    };
    String::from_utf8(bytes).map_err(|e| {
        anyhow::anyhow!(
            "the prompt {name} is not UTF-8 text (invalid byte at offset {})",
            e.utf8_error().valid_up_to()
        )
    })
}

/// The sampling values used and where each came from (`sampling` in `kiln run --json` and in
/// the `ready` event of `kiln chat --json`).
pub fn sampling_report(s: &ResolvedSampling, seed: u64) -> serde_json::Value {
    let p = &s.params;
    let from: serde_json::Map<String, serde_json::Value> = s
        .origins
        .iter()
        .map(|(key, origin)| (key.to_string(), origin.as_str().into()))
        .collect();
    json!({
        "temperature": p.temperature,
        "top_k": p.top_k,
        "top_p": p.top_p,
        "min_p": p.min_p,
        "repetition_penalty": p.repetition_penalty,
        "frequency_penalty": p.frequency_penalty,
        "presence_penalty": p.presence_penalty,
        "seed": seed,
        "greedy": p.is_greedy(),
        "from": from,
    })
}

/// `kiln run --json`'s object.
fn run_report(session: &session::Session, generation: &Generation, sampling: &ResolvedSampling) -> serde_json::Value {
    json!({
        "prompt_token_ids": generation.prompt_token_ids,
        "token_ids": generation.token_ids,
        "text": generation.text,
        "stop_reason": generation.stop.as_str(),
        "stop_string": generation.stop_string,
        "prefill_tok_s": generation.prefill_tok_s(),
        "decode_tok_s": generation.decode_tok_s(),
        "prefill_s": generation.prefill_seconds,
        "decode_s": generation.decode_seconds,
        "compile_s": session.library.compile_seconds,
        "cache_hit": session.library.cache_hit(),
        "open_s": session.open_seconds,
        "cache_key": session.library.key.to_string(),
        "model_dir": session.dir.display().to_string(),
        "threads": session.engine.threads(),
        "prefill_block": session.engine.prefill_block(),
        "seed": generation.seed,
        "sampling": sampling_report(sampling, generation.seed),
        "mlir_contexts": kiln_compiler::mlir_contexts_created(),
    })
}

/// Where `kiln run` streams its text: stdout as it is, or through the reasoning filter with
/// `--chat`; nothing with `--json`. The first failed write stops generation (through the cancel
/// flag) and is returned by [`TextSink::finish`], so no token is generated for nobody.
struct TextSink {
    json: bool,
    printer: Option<chat::ReplyPrinter>,
    cancel: Arc<AtomicBool>,
    error: Option<WriteError>,
}

impl TextSink {
    fn new(args: &RunArgs, starts_thinking: bool, cancel: Arc<AtomicBool>) -> TextSink {
        TextSink {
            json: args.json,
            printer: args
                .chat
                .then(|| chat::ReplyPrinter::new(args.think, starts_thinking, chat::stdout_styled())),
            cancel,
            error: None,
        }
    }

    fn push(&mut self, piece: &str) {
        if self.json || self.error.is_some() {
            return;
        }
        let mut out = std::io::stdout().lock();
        let written = match &mut self.printer {
            Some(p) => p.push(piece, &mut out),
            None => out.write_all(piece.as_bytes()).and_then(|()| out.flush()),
        };
        if let Err(e) = written {
            self.error = Some(WriteError::stdout(e));
            self.cancel.store(true, Ordering::SeqCst);
        }
    }

    /// Ends the text (held-back text, the final newline) or returns the first failed write.
    fn finish(mut self) -> Result<(), WriteError> {
        if let Some(e) = self.error {
            return Err(e);
        }
        if self.json {
            return Ok(());
        }
        let mut out = std::io::stdout().lock();
        if let Some(p) = &mut self.printer {
            p.finish(&mut out).map_err(WriteError::stdout)?;
        }
        writeln!(out).and_then(|()| out.flush()).map_err(WriteError::stdout)
    }
}

pub fn info(path: &Path, build: &BuildChoices, ctx: Option<usize>, as_json: bool) -> Result<()> {
    let opts = OpenOptions {
        progress: !as_json,
        ctx,
        ..build.open_options()
    };
    let loaded = PreparedModel::open(path, &opts)?;
    let spec = &loaded.spec;
    let host = HostCpu::detect();
    let options = opts.compile_options(&host, spec)?;
    let key = cache_key(spec, &options, &host);
    let cache = Cache::at(Cache::default_root()?);
    let state = match cache.lookup(&key)? {
        Lookup::Hit(entry) => format!("compiled ({})", entry.library_path.display()),
        Lookup::Missing => "not compiled".to_string(),
        Lookup::Corrupt(reason) => format!("corrupt entry, will be rebuilt ({reason})"),
    };
    let kernels = kiln_compiler::kernel_list(spec, &options).len();
    let dtypes: std::collections::BTreeSet<String> = spec.weights.iter().map(|w| w.dtype.to_string()).collect();
    let budget = match (opts.budget_plan(spec)?, opts.ram_budget) {
        (Some(plan), Some(bytes)) => {
            let ctx = loaded.ctx(&opts)?;
            let footprint = kiln_core::budget::Footprint::of(spec, options.prefill_rows, ctx, 1);
            Some((plan, bytes, footprint, ctx))
        }
        _ => None,
    };
    if as_json {
        outln!(
            "{}",
            json!({
                "model": loaded.dir.display().to_string(),
                "architecture": loaded.architecture,
                "format": loaded.format.name(),
                "spec": spec,
                "parameters": spec.param_count(),
                "weight_bytes_per_token": spec.weight_bytes_per_token(),
                "eos_token_ids": loaded.eos_token_ids,
                "bos_token_id": loaded.bos_token_id,
                "kernels": kernels,
                "kv_dtype": spec.kv_elem().name(),
                "recurrent_state_bytes_per_sequence": spec.state_bytes_per_sequence(),
                "precision": opts.precision,
                "cache_key": key.to_string(),
                "cache_state": state,
                "budget_plan": budget.as_ref().map(|(p, b, f, _)| crate::budget::to_json(p, *b, f)),
            })
        )?;
        return Ok(());
    }
    outln!("model        {}", loaded.dir.display())?;
    outln!(
        "architecture {} ({}, {})",
        loaded.architecture,
        spec.arch,
        loaded.format.name()
    )?;
    outln!("layers       {}", spec.num_layers())?;
    outln!(
        "hidden       {} (intermediate {})",
        spec.dims.hidden_size,
        spec.dims.intermediate_size
    )?;
    outln!(
        "attention    {} heads, {} kv heads, head_dim {}",
        spec.dims.num_heads,
        spec.dims.num_kv_heads,
        spec.dims.head_dim
    )?;
    outln!("vocabulary   {}", spec.dims.vocab_size)?;
    let rope = spec
        .rope
        .as_ref()
        .map(|r| format!(", rope theta {} ({})", r.theta, r.scaling.name()))
        .unwrap_or_else(|| ", learned positions".into());
    outln!("context      {} positions{rope}", spec.dims.max_position_embeddings)?;
    outln!(
        "kv cache     {}, {} per position",
        spec.kv_elem().name(),
        human_bytes(spec.kv_bytes_per_position() as u64)
    )?;
    if spec.is_recurrent() {
        let layers = spec
            .ops
            .iter()
            .filter(|o| matches!(o.kind, kiln_core::graph::OpKind::DeltaNet(_)))
            .count();
        outln!(
            "recurrent    {} of state per sequence ({layers} Gated DeltaNet layers)",
            human_bytes(spec.state_bytes_per_sequence() as u64)
        )?;
    }
    outln!(
        "embeddings   {}",
        if spec.tied_embeddings() { "tied" } else { "untied" }
    )?;
    outln!(
        "weights      {} ({})",
        dtypes.into_iter().collect::<Vec<_>>().join(", "),
        human_bytes(spec.weight_bytes())
    )?;
    outln!(
        "parameters   {} ({:.1} M)",
        spec.param_count(),
        spec.param_count() as f64 / 1e6
    )?;
    outln!(
        "read/token   {} of weights per decoded token",
        human_bytes(spec.weight_bytes_per_token())
    )?;
    outln!(
        "kernels      {kernels} distinct (prefill block {} rows, {} f32 lanes)",
        options.prefill_rows,
        options.f32_lanes
    )?;
    outln!("cache key    {key}")?;
    outln!("cache        {state}")?;
    if let Some((plan, bytes, footprint, ctx)) = &budget {
        for line in crate::budget::describe(plan, spec, *bytes, footprint, *ctx) {
            outln!("{line}")?;
        }
    }
    Ok(())
}

pub fn human_bytes(b: u64) -> String {
    let units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = b as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < units.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{b} B")
    } else {
        format!("{v:.1} {}", units[u])
    }
}

pub struct DebugArgs {
    pub model: PathBuf,
    pub prompt: Option<String>,
    pub ids: Option<Vec<u32>>,
    pub chat: bool,
    pub all_tokens: bool,
    /// Threads, prefill block, dequantisation and target CPU.
    pub build: BuildChoices,
}

/// `kiln debug`: one JSON object with the prompt's token ids, the residual stream after the
/// embedding and after each layer (last token, or every token), and the last logits.
pub fn debug_layers(args: &DebugArgs) -> Result<()> {
    let opts = OpenOptions {
        page_in: true,
        ..args.build.open_options()
    };
    let prepared = PreparedModel::open(&args.model, &opts)?;
    let prompt = args.prompt.as_deref().unwrap_or_default();
    let ids = if let Some(ids) = &args.ids {
        ids.clone()
    } else if args.chat {
        let template =
            crate::chat::load_template(&prepared.tokenizer, &args.model, "use --chat only with chat models")?;
        let options = RenderOptions {
            add_generation_prompt: true,
            enable_thinking: crate::chat::thinking_option(&prepared.tokenizer, false),
            ..RenderOptions::default()
        };
        let rendered = crate::chat::render_single(&template, &options, None, prompt)?;
        prepared.tokenizer.encode(&rendered.text, false)?
    } else {
        prepared.tokenizer.encode(prompt, true)?
    };
    if ids.is_empty() {
        anyhow::bail!("the prompt encodes to no tokens");
    }
    let mut session = prepared.into_session(&opts)?;
    let layers = session.engine.prefill_layer_by_layer(&ids)?;
    let residuals: Vec<serde_json::Value> = layers
        .iter()
        .map(|rows| {
            if args.all_tokens {
                json!(rows)
            } else {
                json!(rows.last().expect("at least one token"))
            }
        })
        .collect();
    outln!(
        "{}",
        json!({
            "model": session.dir.display().to_string(),
            "prompt_token_ids": ids,
            "hidden_size": session.spec.dims.hidden_size,
            "all_tokens": args.all_tokens,
            "residuals": residuals,
            "logits": session.engine.logits(),
        })
    )?;
    Ok(())
}
