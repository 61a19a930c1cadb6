//! Kiln's compiler: [`ModelSpec`] → kernel list → MLIR (one module per kernel, every dimension a
//! constant) → LLVM for this CPU → objects compiled in parallel → one shared library.
//!
//! It holds no run-time state and knows nothing of tokens; the runtime loads what it produces.

pub mod emit;
mod ir;
mod link;
mod llvm;
mod lower;

pub use llvm::HostTarget;
pub use lower::{PIPELINE, PIPELINE_VERSION};

use kiln_core::{CompileOptions, Kernel, ModelSpec, graph};
use melior::{
    Context,
    dialect::DialectRegistry,
    ir::{Module, operation::OperationLike},
    utility::{register_all_dialects, register_all_llvm_translations, register_all_passes},
};
use rayon::prelude::*;
use std::cell::RefCell;
use std::path::{Path, PathBuf};
use std::sync::Once;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

/// Version of LLVM linked into this build (from `llvm-config` at build time).
pub const LLVM_VERSION: &str = env!("KILN_LLVM_VERSION");
/// Hash of the emitter, lowering and spec sources this compiler was built from (see build.rs);
/// part of every cache key.
pub const CODEGEN_SOURCE_HASH: &str = env!("KILN_CODEGEN_SOURCE_HASH");

/// MLIR contexts created by this process. A cache hit must leave it at zero; tests and
/// `kiln run --json` read it to prove that no compilation happened.
static MLIR_CONTEXTS: AtomicUsize = AtomicUsize::new(0);

/// Number of MLIR contexts this process has created so far.
pub fn mlir_contexts_created() -> usize {
    MLIR_CONTEXTS.load(Ordering::Relaxed)
}

/// Compiler threads need deep stacks: MLIR passes recurse.
const COMPILER_STACK_BYTES: usize = 16 << 20;

/// What to compile and where.
pub struct CompileRequest<'a> {
    /// The kernels to compile (see [`model_kernels`]).
    pub kernels: &'a [Kernel],
    pub options: &'a CompileOptions,
    /// Folder receiving the library (a cache staging folder).
    pub out_dir: &'a Path,
    /// File name of the library inside `out_dir`.
    pub library_name: &'a str,
    /// Write each kernel's MLIR (as emitted, before lowering) into this folder.
    pub emit_mlir: Option<&'a Path>,
    /// Write each kernel's assembly into this folder.
    pub emit_asm: Option<&'a Path>,
    /// Compiler threads (default: all cores).
    pub threads: Option<usize>,
    /// Called after each kernel with (done, total).
    pub progress: Option<&'a (dyn Fn(usize, usize) + Sync)>,
}

/// One compiled kernel.
#[derive(Clone, Debug)]
pub struct KernelReport {
    pub symbol: String,
    pub family: &'static str,
    pub seconds: f64,
    pub object_bytes: usize,
}

/// What a compilation produced.
#[derive(Clone, Debug)]
pub struct CompileReport {
    pub library: PathBuf,
    pub kernels: Vec<KernelReport>,
    pub llvm_cpu: String,
    pub llvm_features: String,
    pub seconds: f64,
}

/// A compilation failure, naming the kernel or file involved.
#[derive(Debug, thiserror::Error)]
pub enum CompileError {
    #[error("kernel {symbol}: {message}")]
    Kernel { symbol: String, message: String },
    #[error("{0}")]
    Link(String),
    #[error("{}: {source}", path.display())]
    Io { path: PathBuf, source: std::io::Error },
    #[error("{0}")]
    Setup(String),
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> CompileError + '_ {
    move |source| CompileError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// The kernels a library for `spec` exports, in emission order.
pub fn kernel_list(spec: &ModelSpec, options: &CompileOptions) -> Vec<Kernel> {
    graph::kernel_set(spec, options)
}

/// The kernels for `spec`, or an error naming a weight whose storage type has no kernel.
///
/// Weight matrices (embedding, projections, output head) may be stored in any GGML block format
/// whose block divides their rows; norms and biases must be f32, f16 or bf16 (see
/// [`ModelSpec::validate`]).
pub fn model_kernels(spec: &ModelSpec, options: &CompileOptions) -> Result<Vec<Kernel>, CompileError> {
    spec.validate().map_err(CompileError::Setup)?;
    Ok(kernel_list(spec, options))
}

/// Compiles `req.kernels` (plus the ABI-version function) and links them into
/// `req.out_dir/req.library_name`.
pub fn compile(req: &CompileRequest) -> Result<CompileReport, CompileError> {
    let start = Instant::now();
    let kernels = req.kernels;
    let host = HostTarget::for_options(req.options);
    let objects_dir = req.out_dir.join(".objects");
    // Not create_dir_all: `out_dir` is the cache's staging folder, and if Ctrl-C has just
    // deleted it (the process is exiting) it must not be created again here.
    std::fs::create_dir(&objects_dir).map_err(io_err(&objects_dir))?;
    for dir in [req.emit_mlir, req.emit_asm].into_iter().flatten() {
        std::fs::create_dir_all(dir).map_err(io_err(dir))?;
    }
    let threads = req
        .threads
        .unwrap_or_else(|| std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1));
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .stack_size(COMPILER_STACK_BYTES)
        .thread_name(|i| format!("kiln-compile-{i}"))
        .build()
        .map_err(|e| CompileError::Setup(format!("cannot start compiler threads: {e}")))?;

    // `None` stands for the ABI-version module.
    let jobs: Vec<Option<&Kernel>> = std::iter::once(None).chain(kernels.iter().map(Some)).collect();
    let done = AtomicUsize::new(0);
    let total = jobs.len();
    let results: Vec<Result<(KernelReport, PathBuf), CompileError>> = pool.install(|| {
        jobs.par_iter()
            .map(|job| {
                let r = compile_one(*job, req, &host, &objects_dir);
                let n = done.fetch_add(1, Ordering::Relaxed) + 1;
                if let Some(progress) = req.progress {
                    progress(n, total);
                }
                r
            })
            .collect()
    });
    let mut reports = Vec::new();
    let mut objects = Vec::new();
    for r in results {
        let (report, object) = r?;
        reports.push(report);
        objects.push(object);
    }
    let library = req.out_dir.join(req.library_name);
    link::link_shared(&objects, &library).map_err(CompileError::Link)?;
    std::fs::remove_dir_all(&objects_dir).map_err(io_err(&objects_dir))?;
    Ok(CompileReport {
        library,
        kernels: reports,
        llvm_cpu: host.cpu,
        llvm_features: host.features,
        seconds: start.elapsed().as_secs_f64(),
    })
}

/// Emits, lowers and generates code for one kernel (or the ABI module), writing its object.
fn compile_one(
    kernel: Option<&Kernel>,
    req: &CompileRequest,
    host: &HostTarget,
    objects_dir: &Path,
) -> Result<(KernelReport, PathBuf), CompileError> {
    let t0 = Instant::now();
    let symbol = kernel
        .map(|k| k.symbol())
        .unwrap_or_else(|| kiln_core::abi::ABI_VERSION_SYMBOL.to_string());
    let family = kernel.map(|k| k.family()).unwrap_or("abi");
    let fail = |message: String| CompileError::Kernel {
        symbol: symbol.clone(),
        message,
    };
    let ctx = new_context();
    let diagnostics = RefCell::new(Vec::<String>::new());
    let handler = ctx.attach_diagnostic_handler(|d| {
        diagnostics.borrow_mut().push(d.to_string());
        true
    });
    let mut module: Module = match kernel {
        Some(k) => emit::emit_kernel(&ctx, k, req.options),
        None => emit::emit_abi_module(&ctx),
    };
    if let Some(dir) = req.emit_mlir {
        let path = dir.join(format!("{symbol}.mlir"));
        std::fs::write(&path, module.as_operation().to_string()).map_err(io_err(&path))?;
    }
    if !module.as_operation().verify() {
        return Err(fail(format!(
            "emitted MLIR does not verify: {}",
            diagnostics.borrow().join("; ")
        )));
    }
    lower::lower_to_llvm(&ctx, &mut module).map_err(|e| fail(format!("{e}: {}", diagnostics.borrow().join("; "))))?;
    let tm = llvm::TargetMachine::new(host, req.options.f32_lanes * 32).map_err(&fail)?;
    let out = tm.compile(&module, req.emit_asm.is_some()).map_err(&fail)?;
    ctx.detach_diagnostic_handler(handler);
    if let (Some(dir), Some(asm)) = (req.emit_asm, &out.assembly) {
        let path = dir.join(format!("{symbol}.s"));
        std::fs::write(&path, asm).map_err(io_err(&path))?;
    }
    let object = objects_dir.join(format!("{symbol}.o"));
    std::fs::write(&object, &out.object).map_err(io_err(&object))?;
    Ok((
        KernelReport {
            symbol,
            family,
            seconds: t0.elapsed().as_secs_f64(),
            object_bytes: out.object.len(),
        },
        object,
    ))
}

static REGISTER_PASSES: Once = Once::new();

/// A fresh single-threaded MLIR context with every dialect and translation registered.
/// Compilation is parallel across kernels, so each context stays on its own thread.
fn new_context() -> Context {
    REGISTER_PASSES.call_once(register_all_passes);
    MLIR_CONTEXTS.fetch_add(1, Ordering::Relaxed);
    let registry = DialectRegistry::new();
    register_all_dialects(&registry);
    let ctx = Context::new_with_threading(false);
    ctx.append_dialect_registry(&registry);
    ctx.load_all_available_dialects();
    register_all_llvm_translations(&ctx);
    ctx
}

#[cfg(test)]
mod tests;
