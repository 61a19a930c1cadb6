//! `kiln serve`: an OpenAI-compatible HTTP server (the `kiln-server` crate) over one engine
//! with `--parallel` KV slots, decoded together by continuous batching ([`scheduler`]).
//!
//! The server listens at once and answers `/health` with 503 while the model loads (compiled or
//! found in the cache) on the engine thread; that thread then serves requests until the
//! process ends. The engine never runs inside the async runtime: requests reach it through a
//! channel, and tokens come back through one channel per request.

mod backend;
mod scheduler;

use crate::session::{BuildChoices, OpenOptions, PreparedModel};
use anyhow::Result;
use backend::KilnBackend;
use kiln_server::{ServerConfig, ServerState};
use kiln_text::chat_template::ChatTemplate;
use kiln_text::sampler::{SamplingChoice, SamplingParams};
use scheduler::{Counters, SchedulerConfig};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex, mpsc};
use std::time::Duration;

/// `kiln serve`'s options.
pub struct ServeArgs {
    pub model: PathBuf,
    /// The id `/v1/models` lists and requests name (default: the model's folder or file name).
    pub alias: Option<String>,
    pub server: ServerConfig,
    /// Sequences decoded together (KV slots).
    pub parallel: usize,
    /// Requests waiting for a slot beyond which new ones get 503.
    pub max_queue: usize,
    pub ctx: Option<usize>,
    pub build: BuildChoices,
    /// Test hook: sleep this long before each decode step.
    pub decode_delay_ms: u64,
}

/// Runs the server until SIGTERM or SIGINT; exits 0 after draining.
pub fn serve(args: ServeArgs) -> Result<ExitCode> {
    // SIGINT drains like SIGTERM (the server's own handler); a compile interrupted that way
    // leaves its staging folder to the removal below.
    crate::interrupt::set(crate::interrupt::OnInterrupt::Ignore);
    let state = ServerState::new(&args.server);
    let slot = state.backend_slot();
    let model_id = args.alias.clone().unwrap_or_else(|| model_name(&args.model));
    let opts = OpenOptions {
        ctx: args.ctx,
        slots: args.parallel,
        progress: false,
        page_in: true,
        ..args.build.open_options()
    };
    // The model's files are read and checked before the server listens, so a wrong path or
    // a malformed model is one error line and exit 1; compiling and loading come after.
    let prepared = PreparedModel::open(&args.model, &opts)?;
    prepared.ctx(&opts)?;
    let listener = kiln_server::bind(&args.server)?;
    let loader = Loader {
        prepared,
        model_id,
        opts,
        parallel: args.parallel,
        max_queue: args.max_queue,
        decode_delay: Duration::from_millis(args.decode_delay_ms),
    };
    let engine_thread = std::thread::Builder::new()
        .name("kiln-engine".into())
        .stack_size(kiln_engine::pool::WORKER_STACK_BYTES);
    engine_thread.spawn(move || {
        if let Err(e) = loader.load_and_serve(&slot) {
            crate::output::errln!("error: {e:#}").ok();
            kiln_cache::remove_active_staging();
            std::process::exit(1);
        }
    })?;
    kiln_server::run_on(listener, state)?;
    kiln_cache::remove_active_staging();
    Ok(ExitCode::SUCCESS)
}

/// What the engine thread needs to open the model and serve it.
struct Loader {
    prepared: PreparedModel,
    model_id: String,
    opts: OpenOptions,
    parallel: usize,
    max_queue: usize,
    decode_delay: Duration,
}

type BackendSlot = Arc<std::sync::OnceLock<Arc<dyn kiln_server::Backend>>>;

impl Loader {
    /// Opens the model (compiling it if needed), publishes the backend, then runs the
    /// scheduler on this thread.
    fn load_and_serve(self, slot: &BackendSlot) -> Result<()> {
        let prepared = self.prepared;
        let sampling = SamplingChoice::resolve(
            &SamplingChoice::default(),
            &prepared.sampling,
            SamplingParams::default(),
        );
        let mut session = prepared.into_session(&self.opts)?;
        let tokenizer = session.tokenizer.clone();
        let template = ChatTemplate::from_tokenizer(&tokenizer).unwrap_or(None);
        let eos = crate::chat::chat_stop_ids(&tokenizer, session.eos_token_ids());
        let (jobs, receiver) = mpsc::channel();
        let counters = Arc::new(Counters::default());
        let backend = KilnBackend {
            model_id: self.model_id.clone(),
            ctx: session.engine.ctx(),
            slots: session.engine.slots(),
            tokenizer: tokenizer.clone(),
            template,
            sampling: sampling.params,
            max_queue: self.max_queue,
            jobs: Mutex::new(jobs),
            counters: counters.clone(),
            shutting_down: AtomicBool::new(false),
            recurrent: session.spec.is_recurrent(),
        };
        let cfg = SchedulerConfig {
            eos,
            prefill_chunk: session.engine.prefill_block(),
            decode_delay: self.decode_delay,
        };
        let _ = slot.set(Arc::new(backend));
        crate::output::errln!(
            "serving {} ({} slots, context {} tokens each, {}, {} threads)",
            self.model_id,
            self.parallel,
            session.engine.ctx(),
            if session.library.cache_hit() {
                "cached library".to_string()
            } else {
                format!("compiled in {:.1} s", session.library.compile_seconds)
            },
            session.engine.threads()
        )
        .ok();
        scheduler::run(&mut session.engine, &tokenizer, receiver, &counters, &cfg);
        Ok(())
    }
}

/// The name a model is served under by default: a hub id as given, else the folder's or
/// file's name.
fn model_name(model: &Path) -> String {
    let text = model.to_string_lossy();
    if !model.exists() && !text.starts_with('/') && !text.starts_with('.') {
        return text.into_owned();
    }
    let named = if model.file_name().is_some_and(|n| n == "config.json") {
        model.parent().unwrap_or(model)
    } else {
        model
    };
    named
        .file_name()
        .map_or_else(|| text.into_owned(), |n| n.to_string_lossy().into_owned())
}
