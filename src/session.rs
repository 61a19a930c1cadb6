//! Joins the three crates: a model folder → its spec → the cache key → a cached library (compiled
//! on a miss) → an engine bound to the model's weights.
//!
//! The cache key is computed from plain data (spec, options, versions, the host CPU as the
//! kernel reports it), so a hit never touches MLIR or LLVM.

use crate::output::errln;
use anyhow::{Context as _, Result, anyhow};
use kiln_cache::{BuildOutput, Cache, CacheError, Key, Status};
use kiln_core::{CompileOptions, HostCpu, ModelSpec, abi};
use kiln_engine::engine::{Engine, EngineError, WeightSource};
use kiln_engine::library::{KernelLibrary, LibraryError};
use kiln_formats::hub;
use kiln_formats::loader::{self, LoadOptions, ModelFormat};
use kiln_text::sampler::SamplingChoice;
use kiln_text::tokenizer::TableCache;
use kiln_text::tokenizer::Tokenizer;
use serde_json::json;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

mod options;
use options::engine_config;
pub use options::{BuildChoices, OpenOptions, at_least_one, cache_key, compile_options, group_rows};

/// File name of the library inside a cache entry.
pub const LIBRARY_NAME: &str = "libkiln.so";

/// The compiled library for a model on this machine.
#[derive(Clone, Debug)]
pub struct CompiledLibrary {
    pub key: Key,
    pub path: PathBuf,
    pub status: Status,
    /// Seconds spent compiling in this process (0 on a cache hit).
    pub compile_seconds: f64,
    pub kernels: usize,
    pub library_bytes: u64,
}

impl CompiledLibrary {
    pub fn cache_hit(&self) -> bool {
        matches!(self.status, Status::Hit)
    }
}

/// Opens the cache named by `dir` or the environment.
pub fn open_cache(dir: Option<&Path>) -> Result<Cache> {
    let root = match dir {
        Some(d) => d.to_path_buf(),
        None => Cache::default_root()?,
    };
    Ok(Cache::open(root)?)
}

/// Finds the library for `spec` in the cache, compiling and publishing it on a miss (or when the
/// entry is corrupt). With `emit_*` set, the kernels' MLIR/assembly are written even on a hit.
/// A bad `--ctx`, or a prefill block no engine here could allocate, is refused first: its
/// library would sit in the cache unused ([`OpenOptions::check_block_fits`]).
pub fn ensure_compiled(
    spec: &ModelSpec,
    model_dir: &Path,
    host: &HostCpu,
    cache: &Cache,
    opts: &OpenOptions,
) -> Result<CompiledLibrary> {
    opts.check_block_fits(spec, engine_config(opts).resolved_ctx(spec)?)?;
    let options = opts.compile_options(host, spec)?;
    let request = LibraryRequest {
        key: cache_key(spec, &options, host),
        kernels: kiln_compiler::model_kernels(spec, &options)?,
        options,
        label: spec.arch.clone(),
        info: json!({
            "model": model_dir.display().to_string(),
            "arch": spec.arch,
            "spec": spec,
        }),
    };
    ensure_library(&request, host, cache, opts)
}

/// A kernel library to find in the cache or build.
pub struct LibraryRequest {
    pub key: Key,
    pub kernels: Vec<kiln_core::Kernel>,
    pub options: CompileOptions,
    /// Shown in the progress bar.
    pub label: String,
    /// Recorded in `meta.json` (merged with the compiler's report).
    pub info: serde_json::Value,
}

/// Finds `req.key` in the cache or compiles `req.kernels` into it.
pub fn ensure_library(
    req: &LibraryRequest,
    host: &HostCpu,
    cache: &Cache,
    opts: &OpenOptions,
) -> Result<CompiledLibrary> {
    let key = req.key;
    let options = &req.options;
    let mut compile_seconds = 0.0;
    let kernels = req.kernels.len();
    // Hidden automatically when stderr is not a terminal.
    let bar = if opts.progress {
        indicatif::ProgressBar::new(kernels as u64 + 1)
    } else {
        indicatif::ProgressBar::hidden()
    };
    let bar = bar.with_style(
        indicatif::ProgressStyle::with_template("compiling {msg} [{bar:30}] {pos}/{len} kernels ({elapsed})")
            .expect("static template")
            .progress_chars("=> "),
    );
    bar.set_message(req.label.clone());
    let progress = |done: usize, _total: usize| bar.set_position(done as u64);
    let run_compiler = |out_dir: &Path| -> Result<kiln_compiler::CompileReport> {
        let report = kiln_compiler::compile(&kiln_compiler::CompileRequest {
            kernels: &req.kernels,
            options,
            out_dir,
            library_name: LIBRARY_NAME,
            emit_mlir: opts.emit_mlir.as_deref(),
            emit_asm: opts.emit_asm.as_deref(),
            threads: None,
            progress: if opts.progress { Some(&progress) } else { None },
        })?;
        Ok(report)
    };
    let outcome = cache.get_or_build(&key, |staging| -> Result<BuildOutput> {
        let t0 = Instant::now();
        let report = run_compiler(staging);
        bar.finish_and_clear();
        let report = report?;
        compile_seconds = t0.elapsed().as_secs_f64();
        let kernels: Vec<_> = report
            .kernels
            .iter()
            .map(|k| json!({"symbol": k.symbol, "family": k.family, "seconds": k.seconds, "object_bytes": k.object_bytes}))
            .collect();
        let mut info = req.info.clone();
        let extra = json!({
            "options": options,
            "cpu": host,
            "llvm_cpu": report.llvm_cpu,
            "llvm_features": report.llvm_features,
            "llvm_version": kiln_compiler::LLVM_VERSION,
            "abi_version": abi::ABI_VERSION,
            "pipeline_version": kiln_compiler::PIPELINE_VERSION,
            "compile_seconds": report.seconds,
            "kernels": kernels,
        });
        if let (Some(info), Some(extra)) = (info.as_object_mut(), extra.as_object()) {
            info.extend(extra.clone());
        }
        // Published only if it loads here and is the ABI and kernel set asked for.
        let kernels = req.kernels.clone();
        let load_check = move |path: &Path| KernelLibrary::open(path, &kernels).map(drop).map_err(load_failure);
        Ok(BuildOutput::shared_object(LIBRARY_NAME, info, load_check))
    });
    let outcome = outcome.map_err(|err| {
        if out_of_space(&err) {
            err.context(format!(
                "cache folder {} has no space left on device for the {} library (free some space or set KILN_CACHE_DIR)",
                cache.root().display(),
                req.label
            ))
        } else {
            err
        }
    })?;
    if let Status::Rebuilt { reason } = &outcome.status {
        errln!("warning: cache entry {key} was corrupt ({reason}); rebuilt it")?;
    }
    if matches!(outcome.status, Status::Hit) && (opts.emit_mlir.is_some() || opts.emit_asm.is_some()) {
        // The dumps were asked for but the library came from the cache: compile again into a
        // scratch folder for the dumps only.
        let scratch = tempfile::tempdir().context("creating a scratch folder for --emit-mlir/--emit-asm")?;
        run_compiler(scratch.path())?;
    }
    Ok(CompiledLibrary {
        key,
        path: outcome.entry.library_path.clone(),
        status: outcome.status,
        compile_seconds,
        kernels,
        library_bytes: outcome.entry.meta.library_bytes,
    })
}

/// Why a freshly built library does not load, without its path (the cache's error names it).
fn load_failure(err: LibraryError) -> String {
    match err {
        LibraryError::Open { message, .. } => format!("dlopen fails: {message}"),
        LibraryError::MissingSymbol { symbol, .. } => format!("it lacks symbol {symbol}"),
        LibraryError::AbiMismatch { found, .. } => {
            format!("it has ABI version {found}, this runtime expects {}", abi::ABI_VERSION)
        }
    }
}

/// Whether `err` comes from a full file system: ENOSPC anywhere in its chain, as an error value
/// or in a tool's message (the linker runs in the C locale, so its text is the C library's).
fn out_of_space(err: &anyhow::Error) -> bool {
    err.chain().any(|cause| {
        let io = cause
            .downcast_ref::<std::io::Error>()
            .or_else(|| cause.downcast_ref::<CacheError>().and_then(CacheError::io_error));
        io.is_some_and(|e| e.kind() == std::io::ErrorKind::StorageFull)
            || cause.to_string().contains("No space left on device")
    })
}

/// Versions that change generated code, shared by every cache key.
pub fn toolchain_key_parts() -> [(&'static str, String); 5] {
    [
        ("kiln_version", env!("CARGO_PKG_VERSION").to_string()),
        ("abi_version", abi::ABI_VERSION.to_string()),
        ("pipeline_version", kiln_compiler::PIPELINE_VERSION.to_string()),
        ("llvm_version", kiln_compiler::LLVM_VERSION.to_string()),
        ("codegen_source_hash", kiln_compiler::CODEGEN_SOURCE_HASH.to_string()),
    ]
}

/// A model ready to generate: tokenizer, compiled library and engine.
pub struct Session {
    pub dir: PathBuf,
    /// Ids that end generation (model config and tokenizer merged).
    eos_token_ids: Vec<u32>,
    pub spec: ModelSpec,
    pub tokenizer: Tokenizer,
    pub engine: Engine,
    pub library: CompiledLibrary,
    /// Seconds from the start of `open` to an engine ready for its first kernel call.
    pub open_seconds: f64,
}

impl Drop for Session {
    /// Says, as the session ends, what went wrong with the work its engine did in the
    /// background (a row-grouped copy that could not be kept in the cache: the next start
    /// packs it again). Written on stderr like the warnings at open; a failed write of the
    /// warning itself is ignored, as the process is ending.
    fn drop(&mut self) {
        for note in self.engine.finish_writes() {
            let _ = errln!("warning: {note}");
        }
    }
}

/// A model read and checked, with its tokenizer, before any library is compiled or loaded:
/// the place to reject a prompt that cannot fit before paying for a compile.
pub struct PreparedModel {
    /// The model folder, or the GGUF file.
    pub dir: PathBuf,
    pub format: ModelFormat,
    pub architecture: String,
    pub spec: ModelSpec,
    pub tokenizer: Tokenizer,
    /// Ids that end generation (model config and tokenizer merged).
    pub eos_token_ids: Vec<u32>,
    pub bos_token_id: Option<u32>,
    /// The sampling the model's `generation_config.json` states (empty for GGUF).
    pub sampling: SamplingChoice,
    weights: Arc<dyn WeightSource>,
    started: Instant,
}

impl PreparedModel {
    /// Reads the model at `path` (config and weight headers or a GGUF file, and the
    /// tokenizer); a Hugging Face hub id is downloaded first (see [`resolve_model`]), with
    /// progress on stderr unless `opts.progress` is off.
    pub fn open(path: &Path, opts: &OpenOptions) -> Result<PreparedModel> {
        let started = Instant::now();
        let path = resolve_model(path, !opts.progress)?;
        let cache_root = opts.cache_root();
        let m = loader::load(
            &path,
            &LoadOptions {
                dequantize: opts.dequantize,
                // Under a budget, weights are paged in only as the plan reads them.
                page_in: opts.page_in && opts.ram_budget.is_none(),
                // Without a cache folder the tokenizer is built each time, as it would be, and
                // no weight file is read back for huge pages.
                tokenizer_cache: cache_root
                    .as_ref()
                    .map(|root| TableCache::in_folder(root.join(kiln_cache::TOKENIZER_TABLES))),
                page_cache_marks: cache_root.as_ref().map(|root| root.join(kiln_cache::PAGE_CACHE_MARKS)),
                // The row-grouped tensors are read from their copy: not paged in. A bad
                // --target-cpu is reported below, where the compile options are made.
                grouping_lanes: opts
                    .ram_budget
                    .is_none()
                    .then(|| opts.f32_lanes(&HostCpu::detect()).ok())
                    .flatten(),
            },
        )?;
        if opts.progress {
            for note in &m.notes {
                errln!("note: {note}")?;
            }
        }
        let mut spec = m.spec;
        if let Some(elem) = opts.kv_dtype {
            spec.set_kv_elem(elem);
        }
        // The row-grouped tensors are part of the spec, hence of the cache key.
        if opts.ram_budget.is_none() {
            let options = opts.compile_options(&HostCpu::detect(), &spec)?;
            group_rows(&mut spec, &options);
        }
        let mut weights = m.weights;
        if std::env::var_os("KILN_RESIDENT").is_some_and(|v| v == "1") && opts.ram_budget.is_none() {
            let resident = kiln_engine::resident::ResidentWeights::copy_from(&spec, weights.as_ref())
                .map_err(anyhow::Error::msg)?;
            weights = Arc::new(resident);
        }
        Ok(PreparedModel {
            dir: m.source,
            format: m.format,
            architecture: m.architecture,
            bos_token_id: m.bos_token_id,
            spec,
            tokenizer: m.tokenizer,
            eos_token_ids: m.eos_token_ids,
            sampling: m.sampling,
            weights,
            started,
        })
    }

    /// The KV-cache capacity an engine opened with `opts` will have.
    pub fn ctx(&self, opts: &OpenOptions) -> Result<usize> {
        Ok(engine_config(opts).resolved_ctx(&self.spec)?)
    }

    /// Finds or compiles the library and builds the engine.
    pub fn into_session(self, opts: &OpenOptions) -> Result<Session> {
        let PreparedModel {
            dir,
            spec,
            tokenizer,
            eos_token_ids,
            weights,
            started,
            ..
        } = self;
        let host = HostCpu::detect();
        let cache = open_cache(opts.cache_dir.as_deref())?;
        let engine_config = engine_config(opts);
        let mut library = ensure_compiled(&spec, &dir, &host, &cache, opts)?;
        let options = opts.compile_options(&host, &spec)?;
        let engine = match Engine::new(&spec, &options, &library.path, weights.clone(), &engine_config) {
            Err(EngineError::Library(
                e @ (LibraryError::Open { .. } | LibraryError::MissingSymbol { .. } | LibraryError::AbiMismatch { .. }),
            )) => {
                // The entry passed its hash check but cannot be used: drop it and rebuild once.
                errln!(
                    "warning: cached library {} is unusable ({e}); rebuilding",
                    library.path.display()
                )?;
                cache.remove(&library.key.to_string())?;
                library = ensure_compiled(&spec, &dir, &host, &cache, opts)?;
                Engine::new(&spec, &options, &library.path, weights, &engine_config)?
            }
            other => other?,
        };
        for note in engine.notes() {
            errln!("warning: {note}")?;
        }
        // The model proved usable: now the tokenizer tables it built may go to the cache.
        tokenizer.save_table();
        release_freed_heap();
        Ok(Session {
            dir,
            eos_token_ids,
            spec,
            tokenizer,
            engine,
            library,
            open_seconds: started.elapsed().as_secs_f64(),
        })
    }
}

/// Hands the heap's free pages back to the system once the model is open. glibc keeps freed
/// heap memory for reuse, so the tokenizer's parsed JSON (~30 MB for a 32k vocabulary) and a
/// cold compile's work would otherwise stay resident beside the weights for the whole run:
/// memory `--ram-budget` users count.
fn release_freed_heap() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only returns free heap pages to the kernel; no live allocation is
    // touched, and it is safe to call from any thread at any time.
    unsafe {
        libc::malloc_trim(0);
    }
}

impl Session {
    /// Loads the model at `path`, finds or compiles its library, and builds the engine.
    pub fn open(path: &Path, opts: &OpenOptions) -> Result<Session> {
        PreparedModel::open(path, opts)?.into_session(opts)
    }

    /// EOS ids: the model config's and the tokenizer's, merged.
    pub fn eos_token_ids(&self) -> Vec<u32> {
        self.eos_token_ids.clone()
    }
}

/// The local folder or file of `MODEL`: `path` itself, unless it does not exist and reads as a
/// Hugging Face hub id (`org/name`, `org/name:QUANT`, `org/name/FILE.gguf`, each with an
/// optional `@revision`), which is then resolved in the Hugging Face cache (`HF_HOME`,
/// `HF_HUB_CACHE`) and downloaded there if missing, as `HF_ENDPOINT`, `HF_TOKEN` and
/// `HF_HUB_OFFLINE` say: a folder, or a GGUF file (the first part of a split model). A
/// missing path with `:` or `@` that is no valid id is reported as a bad id. `quiet` hides
/// the download progress bars and notes.
pub fn resolve_model(path: &Path, quiet: bool) -> Result<PathBuf> {
    // Anything on disk under that name is local, even a symlink loop or a dangling link that
    // `Path::exists` calls absent: the loader says what is wrong with it.
    if path.symlink_metadata().is_ok() {
        return Ok(path.to_path_buf());
    }
    let Some(id) = path.to_str() else {
        return Ok(path.to_path_buf());
    };
    match hub::HubSpec::parse(id) {
        Ok(_) => {}
        Err(e) if id.contains([':', '@']) => {
            return Err(anyhow::Error::new(e).context(format!("{id} is not a local folder or file")));
        }
        Err(_) => return Ok(path.to_path_buf()),
    }
    let mut options = hub::HubOptions::from_env();
    options.quiet |= quiet;
    hub::resolve(id, &options)
        .with_context(|| format!("{id} is not a local folder or file, so it was taken as a Hugging Face model id"))
}

/// File name of the demo model that `scripts/fetch-demo-model.sh` installs.
pub const DEMO_MODEL: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";

/// Kiln's models folder: `$KILN_MODELS_DIR`, else `$XDG_DATA_HOME/kiln/models`, else
/// `~/.local/share/kiln/models` (where `scripts/fetch-demo-model.sh` puts the demo model).
pub fn models_dir() -> Option<PathBuf> {
    let env = |k: &str| std::env::var_os(k).filter(|v| !v.is_empty()).map(PathBuf::from);
    env("KILN_MODELS_DIR")
        .or_else(|| env("XDG_DATA_HOME").map(|d| d.join("kiln").join("models")))
        .or_else(|| env("HOME").map(|h| h.join(".local").join("share").join("kiln").join("models")))
}

/// The demo model, used when no model is named; an error saying how to fetch it when absent.
pub fn demo_model() -> Result<PathBuf> {
    let dir =
        models_dir().ok_or_else(|| anyhow!("no MODEL given and no models folder (set KILN_MODELS_DIR or HOME)"))?;
    let path = dir.join(DEMO_MODEL);
    if path.is_file() {
        Ok(path)
    } else {
        Err(anyhow!(
            "no MODEL given and the demo model is not installed at {}; fetch it with scripts/fetch-demo-model.sh, or name a model",
            path.display()
        ))
    }
}

/// Turns an `anyhow` error chain into one line for the CLI.
pub fn one_line(err: &anyhow::Error) -> String {
    let mut parts: Vec<String> = Vec::new();
    for cause in err.chain() {
        let s = cause.to_string();
        if !parts.iter().any(|p| p.contains(&s)) {
            parts.push(s);
        }
    }
    parts.join(": ").replace('\n', " ")
}
