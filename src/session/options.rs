//! What a command asks of a model it opens (`OpenOptions`, from the command line's
//! `BuildChoices`), and what follows from it: the engine's run-time configuration, the compile
//! options for this host, and the cache key of the library.

use super::toolchain_key_parts;
use crate::output::errln;
use anyhow::{Result, anyhow};
use kiln_cache::Key;
use kiln_core::{CompileOptions, HostCpu, ModelSpec, Precision};
use kiln_engine::engine::EngineConfig;
use std::path::PathBuf;

/// How to open a model.
#[derive(Clone, Debug, Default)]
pub struct OpenOptions {
    pub threads: Option<usize>,
    pub ctx: Option<usize>,
    /// Rows per prefill block (a compile-time constant of the prefill kernels).
    pub prefill_rows: Option<usize>,
    /// Cache folder; default from the environment (see [`Cache::default_root`]).
    pub cache_dir: Option<PathBuf>,
    pub emit_mlir: Option<PathBuf>,
    pub emit_asm: Option<PathBuf>,
    /// Print compile progress on stderr.
    pub progress: bool,
    /// Convert quantised weights to this float type at load (`--dequantize`).
    pub dequantize: Option<kiln_core::DType>,
    /// Emit vectors of at most this many f32 lanes (4, 8 or 16) instead of the widest the host
    /// has: lets a machine with AVX-512 build and check the code an AVX2 machine gets.
    pub max_f32_lanes: Option<usize>,
    /// Build for this x86-64 level (`x86-64-v3` is AVX2 + FMA) instead of the host CPU: the
    /// library must still run here, so the level must be one this CPU has.
    pub target_cpu: Option<String>,
    /// Map the weights' pages in while the tokenizer is built: for commands that run the model
    /// (`run`, `chat`, `bench`, `debug`), not for those that only read its headers.
    pub page_in: bool,
    /// Sequences with their own KV cache (`kiln serve --parallel`); 0 means 1.
    pub slots: usize,
    /// `--ram-budget`: bytes the weights and the KV cache may hold (`kiln_core::budget`).
    pub ram_budget: Option<u64>,
    /// `--kv-dtype`: how the KV cache stores keys and values (f32 unless given).
    pub kv_dtype: Option<kiln_core::spec::Elem>,
    /// `--precision`: how matmuls over bf16 weights multiply (exact f32 unless given).
    pub precision: Precision,
}

/// What every command that opens a model takes from the command line (`--threads`,
/// `--prefill-block`, `--dequantize`, `--target-cpu`).
#[derive(Clone, Debug, Default)]
pub struct BuildChoices {
    pub threads: Option<usize>,
    pub prefill_block: Option<usize>,
    pub dequantize: Option<kiln_core::DType>,
    pub target_cpu: Option<String>,
    pub ram_budget: Option<u64>,
    pub kv_dtype: Option<kiln_core::spec::Elem>,
    pub precision: Precision,
}

impl BuildChoices {
    /// Checks the choices made on the command line: `--threads 0` and `--prefill-block 0` are
    /// errors, and more threads than this process has CPUs are capped at that number with a
    /// warning unless `oversubscribe` (`--threads-oversubscribe`): threads beyond the CPUs only
    /// take turns on them (1000 threads on 2 cores took over a minute for 4 tokens).
    pub fn checked(mut self, oversubscribe: bool) -> Result<BuildChoices> {
        at_least_one("--threads", self.threads)?;
        at_least_one("--prefill-block", self.prefill_block)?;
        if self.ram_budget.is_some() && self.dequantize.is_some() {
            anyhow::bail!(
                "--ram-budget cannot be combined with --dequantize: converted weights are held in memory, not streamed"
            );
        }
        let cpus = kiln_engine::pool::available_cpus();
        if let Some(n) = self.threads
            && n > cpus
            && !oversubscribe
        {
            errln!(
                "warning: --threads {n} is more than the {cpus} CPUs this process may run on; using {cpus} \
                 (--threads-oversubscribe keeps {n})"
            )?;
            self.threads = Some(cpus);
        }
        Ok(self)
    }

    /// Open options carrying these choices, everything else at its default.
    pub fn open_options(&self) -> OpenOptions {
        OpenOptions {
            threads: self.threads,
            prefill_rows: self.prefill_block,
            dequantize: self.dequantize,
            target_cpu: self.target_cpu.clone(),
            ram_budget: self.ram_budget,
            kv_dtype: self.kv_dtype,
            precision: self.precision,
            ..OpenOptions::default()
        }
    }
}

/// An error for a count option given as 0 (`--threads 0` used to become 1 without a word).
pub fn at_least_one(option: &str, value: Option<usize>) -> Result<()> {
    if value == Some(0) {
        anyhow::bail!("{option} must be at least 1, not 0");
    }
    Ok(())
}

pub(super) fn engine_config(opts: &OpenOptions) -> EngineConfig {
    EngineConfig {
        threads: opts.threads,
        ctx: opts.ctx,
        slots: opts.slots.max(1),
        ram_budget: opts.ram_budget,
        // Without a cache folder the row-grouped copies are made at every start.
        grouped_store: opts.cache_root().map(|root| root.join(kiln_cache::GROUPED_COPIES)),
        ..EngineConfig::default()
    }
}

/// Marks the tensors the kernels compiled with `options` read in row groups
/// (`kiln_core::grouped`: the gate and up projections and the other large matrices, repacked
/// by the engine at load), as every command that keys or opens a model must, or its cache key
/// would differ. Not for a `--ram-budget` run, which streams weights as stored.
pub fn group_rows(spec: &mut ModelSpec, options: &CompileOptions) {
    spec.group_rows(
        options.f32_lanes,
        options.precision,
        kiln_core::budget::physical_memory(),
    );
}

/// The compile options for `spec` on this host.
pub fn compile_options(host: &HostCpu, prefill_rows: Option<usize>) -> CompileOptions {
    let mut options = CompileOptions::for_host(host);
    if let Some(rows) = prefill_rows {
        options.prefill_rows = rows.max(1);
    }
    options
}

impl OpenOptions {
    /// The cache folder these options name, else the default one (`Cache::default_root`);
    /// `None` when there is none (no home folder): loaders and engine then keep nothing.
    pub fn cache_root(&self) -> Option<PathBuf> {
        self.cache_dir
            .clone()
            .or_else(|| kiln_cache::Cache::default_root().ok())
    }

    /// The `--ram-budget` plan for `spec` (none without a budget); an error when the budget is
    /// too small for the model and context.
    pub fn budget_plan(&self, spec: &ModelSpec) -> Result<Option<kiln_core::budget::BudgetPlan>> {
        let Some(budget) = self.ram_budget else {
            return Ok(None);
        };
        use kiln_core::budget::{Footprint, plan};
        let ctx = engine_config(self).resolved_ctx(spec)?;
        let rows = self.block_rows();
        Ok(Some(plan(&Footprint::of(spec, rows, ctx, self.slots.max(1)), budget)?))
    }

    /// Rows of a prefill block: `--prefill-block`, else the default.
    fn block_rows(&self) -> usize {
        self.prefill_rows.unwrap_or(CompileOptions::DEFAULT_PREFILL_ROWS).max(1)
    }

    /// Refuses, before anything is compiled, a prefill block whose activation buffers alone
    /// exceed this machine's memory: the engine could not allocate them, and the library built
    /// for that block size would stay in the cache unused.
    pub fn check_block_fits(&self, spec: &ModelSpec, ctx: usize) -> Result<()> {
        use kiln_core::budget::{Footprint, human, physical_memory};
        let rows = self.block_rows();
        let need = Footprint::of(spec, rows, ctx, self.slots.max(1)).activations;
        let have = physical_memory();
        if have > 0 && need > have {
            anyhow::bail!(
                "cannot allocate {} of activation buffers for --prefill-block {rows}: this machine has {} of memory (a smaller --prefill-block needs less)",
                human(need),
                human(have)
            );
        }
        Ok(())
    }

    /// The f32 lanes of the code these options compile on `host`: the host's, narrowed by
    /// the lane limit and `--target-cpu`.
    pub fn f32_lanes(&self, host: &HostCpu) -> Result<usize> {
        let mut lanes = CompileOptions::for_host(host).f32_lanes;
        if let Some(limit) = self.max_f32_lanes {
            lanes = lanes.min(limit.clamp(4, 16).next_power_of_two());
        }
        if let Some(cpu) = &self.target_cpu {
            lanes = lanes.min(host.x86_level(cpu).map_err(|e| anyhow!("--target-cpu: {e}"))?.f32_lanes);
        }
        Ok(lanes)
    }

    /// The compile options these options ask for on `host` for `spec` (a budget that streams
    /// the output head adds its chunk kernels).
    pub fn compile_options(&self, host: &HostCpu, spec: &ModelSpec) -> Result<CompileOptions> {
        let mut options = compile_options(host, self.prefill_rows);
        if self
            .budget_plan(spec)?
            .is_some_and(|p| p.head == kiln_core::budget::Placement::Streamed)
        {
            options.head_chunk_rows = kiln_core::budget::head_chunk_rows(spec);
        }
        options.f32_lanes = self.f32_lanes(host)?;
        if let Some(cpu) = &self.target_cpu {
            let level = host.x86_level(cpu).map_err(|e| anyhow!("--target-cpu: {e}"))?;
            options.target_cpu = Some(level.name.to_string());
        }
        if self.precision == Precision::Bf16 {
            if self.target_cpu.is_some() {
                anyhow::bail!("--precision bf16 needs this CPU's own code (AVX512-BF16), not --target-cpu");
            }
            if !host.features.iter().any(|f| f == "avx512_bf16") || options.f32_lanes < 16 {
                anyhow::bail!(
                    "--precision bf16 needs a CPU with AVX512-BF16 (vdpbf16ps); {} has none: use --precision exact",
                    host.model_name
                );
            }
            options.precision = Precision::Bf16;
        }
        if self.precision == Precision::Q8 {
            // vpmaddubsw/vpmaddwd on 256-bit vectors: AVX2 (x86-64-v3) and up.
            if !cfg!(target_arch = "x86_64") || options.f32_lanes < 8 {
                anyhow::bail!(
                    "--precision q8 needs AVX2 code (x86-64-v3 or later); {} gives {}-lane vectors: use --precision exact",
                    options.target_cpu.as_deref().unwrap_or(&host.model_name),
                    options.f32_lanes
                );
            }
            options.precision = Precision::Q8;
        }
        Ok(options)
    }
}

/// The cache key of the library for `spec` compiled with `options` on `host`.
pub fn cache_key(spec: &ModelSpec, options: &CompileOptions, host: &HostCpu) -> Key {
    let spec_json = serde_json::to_string(spec).expect("spec serialises");
    let options_json = serde_json::to_string(options).expect("options serialise");
    let cpu_json = serde_json::to_string(host).expect("cpu serialises");
    let toolchain = toolchain_key_parts();
    let mut parts: Vec<(&str, &str)> = vec![("spec", &spec_json), ("options", &options_json), ("cpu", &cpu_json)];
    parts.extend(toolchain.iter().map(|(k, v)| (*k, v.as_str())));
    Key::from_parts(&parts)
}
