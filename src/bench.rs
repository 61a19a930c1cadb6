//! `kiln bench`: prefill and decode speed on a fixed synthetic prompt, judged against this
//! machine's probed ceilings; and the `KILN_PROFILE=1` per-kernel profile file.

use crate::commands::{human_bytes, load_probe, probe_library};
use crate::output::{errln, outln};
use crate::session::{BuildChoices, OpenOptions, PreparedModel, Session};
use anyhow::{Result, bail};
use kiln_core::HostCpu;
use kiln_engine::probe::{ReadProbe, load_average, peak_rss_bytes};
use kiln_text::sampler::argmax;
use serde_json::json;
use std::path::PathBuf;
use std::time::Instant;

pub struct BenchArgs {
    /// Threads, prefill block, dequantisation and target CPU.
    pub build: BuildChoices,
    pub model: PathBuf,
    pub prompt_tokens: usize,
    pub gen_tokens: usize,
    pub reps: usize,
    pub json: bool,
    /// Only print the synthetic prompt's token ids (for peers measured on the same ids).
    pub print_prompt: bool,
    /// Skip the read-bandwidth measurement between repetitions (saves ~1 GiB of memory and a
    /// second per repetition; decode is then judged against the stored `kiln probe` only).
    pub no_probe: bool,
    /// Also measure decode of this many sequences batched together (`kiln serve`'s steps).
    pub batch: usize,
    /// KV-cache capacity in tokens (default: as `kiln run`).
    pub ctx: Option<usize>,
}

/// Read-probe passes after each repetition; the best of them is that repetition's ceiling.
const PROBE_PASSES: usize = 3;

/// A deterministic prompt of `n` ordinary token ids (no special tokens at either end of the
/// vocabulary).
pub fn synthetic_prompt(n: usize, vocab: usize) -> Vec<u32> {
    let lo = 256.min(vocab / 4);
    let hi = (vocab * 9 / 10).max(lo + 1);
    let mut x: u64 = 0x2545_f491_4f6c_dd1d;
    (0..n)
        .map(|_| {
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (lo + (x >> 33) as usize % (hi - lo)) as u32
        })
        .collect()
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

pub fn bench(args: &BenchArgs) -> Result<()> {
    if args.prompt_tokens == 0 || args.gen_tokens == 0 || args.reps == 0 {
        bail!("--prompt-tokens, --gen-tokens and --reps must be at least 1");
    }
    let opts = OpenOptions {
        progress: !args.json,
        page_in: true,
        slots: args.batch.max(1),
        ctx: args.ctx,
        ..args.build.open_options()
    };
    let prepared = PreparedModel::open(&args.model, &opts)?;
    let prompt = synthetic_prompt(
        args.prompt_tokens,
        prepared
            .spec
            .dims
            .vocab_size
            .min(prepared.tokenizer.vocab_size().max(1)),
    );
    if args.print_prompt {
        outln!("{}", serde_json::to_string(&prompt)?)?;
        return Ok(());
    }
    let mut session = prepared.into_session(&opts)?;
    // A first start writes the row-grouped copy in the background: let it finish, so that it
    // does not share the memory bandwidth with the runs being measured.
    for note in session.engine.finish_writes() {
        errln!("warning: {note}")?;
    }
    let spec = session.spec.clone();
    let ctx = session.engine.ctx();
    if args.prompt_tokens + args.gen_tokens > ctx {
        bail!(
            "{} prompt + {} generated tokens exceed the context of {ctx}",
            args.prompt_tokens,
            args.gen_tokens
        );
    }
    let threads = session.engine.threads();
    let host = HostCpu::detect();
    let read_probe = if args.no_probe {
        None
    } else {
        let cache = crate::session::open_cache(None)?;
        let (lib, buffer_bytes, lanes) = probe_library(&host, &cache, !args.json)?;
        Some(ReadProbe::open(&lib.path, buffer_bytes, lanes)?)
    };
    let load_before = load_average();
    // Per repetition: the read ceiling measured right after it, and decode's share of it.
    let mut ceilings = Vec::new();
    let mut shares = Vec::new();
    let bytes_per_token = spec.weight_bytes_per_token();

    let mut prefill = Vec::new();
    let mut decode = Vec::new();
    // Bytes read from disk per decoded token, under --ram-budget (measured, per repetition).
    let mut streamed = Vec::new();
    // The first repetition warms the page cache and the CPU caches and is not counted.
    for rep in 0..=args.reps {
        let engine = &mut session.engine;
        engine.reset();
        let t = Instant::now();
        let mut next = argmax(engine.prefill(&prompt)?) as u32;
        let prefill_s = t.elapsed().as_secs_f64();
        let t = Instant::now();
        let read_before = engine.streamed_bytes();
        for _ in 0..args.gen_tokens {
            next = argmax(engine.decode(next)?) as u32;
        }
        let decode_s = t.elapsed().as_secs_f64();
        let streamed_per_token = (engine.streamed_bytes() - read_before) as f64 / args.gen_tokens as f64;
        let (p, d) = (args.prompt_tokens as f64 / prefill_s, args.gen_tokens as f64 / decode_s);
        let ceiling = read_probe
            .as_ref()
            .map(|probe| probe.best_gb_s(session.engine.pool(), PROBE_PASSES));
        let share = ceiling.map(|c| 100.0 * d * bytes_per_token as f64 / 1e9 / c);
        if rep > 0 {
            prefill.push(p);
            decode.push(d);
            ceilings.extend(ceiling);
            shares.extend(share);
            streamed.push(streamed_per_token);
        }
        if !args.json {
            let label = if rep == 0 {
                "warm-up".to_string()
            } else {
                format!("rep {rep}/{}", args.reps)
            };
            let read = match (ceiling, share) {
                (Some(c), Some(s)) => format!(" ({s:.0} % of {c:.1} GB/s read right after)"),
                _ => String::new(),
            };
            errln!("{label}: prefill {p:.1} tok/s, decode {d:.2} tok/s{read}")?;
        }
    }
    let batch = if args.batch > 1 {
        let mut rates = batched_decode(&mut session.engine, &prompt, args.batch, args.gen_tokens, args.reps)?;
        Some(median(&mut rates))
    } else {
        None
    };
    let in_run_ceiling = (!ceilings.is_empty()).then(|| median(&mut ceilings.clone()));
    let in_run_share = (!shares.is_empty()).then(|| median(&mut shares.clone()));
    let (prefill_tok_s, decode_tok_s) = (median(&mut prefill), median(&mut decode));
    let decode_gb_s = decode_tok_s * bytes_per_token as f64 / 1e9;
    // Matmul flops per prompt token (the output head runs once per prefill, on the last row).
    let head = 2 * spec.dims.vocab_size as u64 * spec.dims.hidden_size as u64;
    let layer_flops: u64 = kiln_core::graph::block_graph(&spec, 1)
        .steps
        .iter()
        .map(|s| s.kernel.flops(1, 0))
        .sum();
    let prefill_gflop_s = prefill_tok_s * (layer_flops as f64 + head as f64 / args.prompt_tokens as f64) / 1e9;
    let probe = load_probe(&host);
    let stored_read = probe.as_ref().and_then(|p| p.read_at(threads));
    let fma_ceiling = probe.as_ref().and_then(|p| p.fma_at(threads));
    let load_after = load_average();
    write_profile(&session)?;
    let budget = session.engine.budget_plan().map(|p| {
        json!({
            "ram_budget_bytes": args.build.ram_budget,
            "planned_peak_bytes": p.peak_bytes,
            "planned_streamed_bytes_per_token": p.streamed_per_token,
            "stream_buffers": p.buffers,
            "resident_layers": p.layers.iter().filter(|&&l| l == kiln_core::budget::Placement::Resident).count(),
            "head_streamed": p.head == kiln_core::budget::Placement::Streamed,
            "embedding_gathered": p.embed == kiln_core::budget::Placement::Streamed,
        })
    });
    // Without a budget nothing goes through the streamer (page faults are the kernel's): null.
    let streamed_per_token =
        (args.build.ram_budget.is_some() && !streamed.is_empty()).then(|| median(&mut streamed.clone()));
    let peak_rss = peak_rss_bytes();
    let weight_bytes: u64 = spec.weights.iter().map(|w| w.bytes() as u64).sum();
    let footprint = kiln_core::budget::Footprint::of(
        &spec,
        session.engine.prefill_block(),
        session.engine.ctx(),
        session.engine.slots(),
    );

    let report = json!({
        "model": session.dir.display().to_string(),
        "cpu": host.model_name,
        "threads": threads,
        "prompt_tokens": args.prompt_tokens,
        "gen_tokens": args.gen_tokens,
        "reps": args.reps,
        "prefill_tok_s": prefill_tok_s,
        "decode_tok_s": decode_tok_s,
        "prefill_tok_s_all": prefill,
        "decode_tok_s_all": decode,
        "weight_bytes_per_token": bytes_per_token,
        "decode_gb_s": decode_gb_s,
        // Against the read bandwidth measured between repetitions (median of the per-repetition
        // shares), else against the stored probe.
        "decode_pct_of_probe": in_run_share.or(stored_read.map(|c| 100.0 * decode_gb_s / c)),
        "probe_read_gb_s": in_run_ceiling.or(stored_read),
        "in_run_read_gb_s_all": ceilings,
        "decode_pct_of_in_run_read_all": shares,
        "stored_probe_read_gb_s": stored_read,
        "decode_pct_of_stored_probe": stored_read.map(|c| 100.0 * decode_gb_s / c),
        "prefill_gflop_s": prefill_gflop_s,
        "prefill_pct_of_fma_peak": fma_ceiling.map(|c| 100.0 * prefill_gflop_s / c),
        "probe_fma_gflop_s": fma_ceiling,
        "open_s": session.open_seconds,
        "compile_s": session.library.compile_seconds,
        "cache_hit": session.library.cache_hit(),
        "load_average": [load_before, load_after],
        "batch": args.batch.max(1),
        "batch_decode_tok_s": batch,
        "ram_budget_bytes": args.build.ram_budget,
        "budget_plan": budget,
        "streamed_bytes_per_token": streamed_per_token,
        "peak_rss_bytes": peak_rss,
        "weight_bytes": weight_bytes,
        "kv_bytes": footprint.kv,
        "kv_dtype": spec.kv_elem().name(),
        "precision": opts.precision,
        "target_cpu": opts.target_cpu,
        "activation_bytes": footprint.activations,
    });
    if args.json {
        outln!("{report}")?;
        return Ok(());
    }
    outln!(
        "{} on {} ({threads} threads, load {:.2})",
        session.dir.display(),
        host.model_name,
        load_before.unwrap_or(f64::NAN)
    )?;
    outln!(
        "prefill  {prefill_tok_s:>8.1} tok/s  ({} tokens, {prefill_gflop_s:.1} GFLOP/s{})",
        args.prompt_tokens,
        pct(fma_ceiling.map(|c| prefill_gflop_s / c), "FMA peak")
    )?;
    outln!(
        "decode   {decode_tok_s:>8.2} tok/s  ({} per token, {decode_gb_s:.1} GB/s{})",
        human_bytes(bytes_per_token),
        pct(stored_read.map(|c| decode_gb_s / c), "stored probe")
    )?;
    if let (Some(c), Some(s)) = (in_run_ceiling, in_run_share) {
        outln!(
            "         {s:.0} % of the read bandwidth measured between repetitions ({c:.1} GB/s, median; per repetition: {})",
            shares_list(&ceilings, &shares)
        )?;
    }
    if let Some(b) = batch {
        outln!(
            "decode   {b:>8.2} tok/s  with {} sequences batched ({:.2}x one sequence)",
            args.batch,
            b / decode_tok_s
        )?;
    }
    if let (Some(budget), Some(read)) = (args.build.ram_budget, streamed_per_token) {
        outln!(
            "budget   {} : {} read from disk per token ({:.2} GB/s), peak RSS {}",
            human_bytes(budget),
            human_bytes(read as u64),
            read * decode_tok_s / 1e9,
            peak_rss.map_or("?".to_string(), human_bytes)
        )?;
    }
    if q8_would_apply(&spec, &opts, &host) {
        outln!(
            "(quantised weights in exact mode, f32 products of the dequantised weights: `--precision q8` rounds the \
             activations to 8 bits per group of 32, as llama.cpp does, for faster decode and prefill)"
        )?;
    }
    if probe.is_none() {
        outln!("(run `kiln probe` to compare against this machine's bandwidth and FMA peak)")?;
    }
    Ok(())
}

/// Whether a run in the default exact mode reads GGUF block weights that `--precision q8` could
/// take instead (where the compile options accept q8 for this build: AVX2 code or wider):
/// decode of those formats is compute-bound in exact mode (TinyLlama Q4_K_M on a 2-core Zen 5
/// EPYC, 2 threads: 46 tok/s exact, 90 with q8, llama.cpp 63), and a user measuring speed
/// should hear of the mode that matches llama.cpp's arithmetic.
fn q8_would_apply(spec: &kiln_core::ModelSpec, opts: &OpenOptions, host: &HostCpu) -> bool {
    let q8 = OpenOptions {
        precision: kiln_core::Precision::Q8,
        ..opts.clone()
    };
    opts.precision == kiln_core::Precision::Exact
        && spec.weights.iter().any(|w| w.dtype.is_quantized())
        && q8.compile_options(host, spec).is_ok()
}

/// Decode of `n` sequences together, each in its own slot after the same prompt, as `kiln
/// serve` steps them: tokens per second over all rows, one value per repetition (the first,
/// a warm-up, left out).
fn batched_decode(
    engine: &mut kiln_engine::engine::Engine,
    prompt: &[u32],
    n: usize,
    steps: usize,
    reps: usize,
) -> Result<Vec<f64>> {
    let vocab = engine.spec().dims.vocab_size;
    let mut rates = Vec::new();
    for rep in 0..=reps {
        let mut next = Vec::with_capacity(n);
        for slot in 0..n {
            engine.truncate_in(slot, 0);
            next.push(argmax(engine.prefill_in(slot, prompt)?) as u32);
        }
        let t = Instant::now();
        for _ in 0..steps {
            let rows: Vec<(usize, u32)> = next.iter().copied().enumerate().collect();
            let logits = engine.decode_batch(&rows)?;
            next = logits.chunks(vocab).map(|row| argmax(row) as u32).collect();
        }
        if rep > 0 {
            rates.push((n * steps) as f64 / t.elapsed().as_secs_f64());
        }
    }
    Ok(rates)
}

fn shares_list(ceilings: &[f64], shares: &[f64]) -> String {
    ceilings
        .iter()
        .zip(shares)
        .map(|(c, s)| format!("{s:.0} % of {c:.1}"))
        .collect::<Vec<_>>()
        .join(", ")
}

fn pct(ratio: Option<f64>, what: &str) -> String {
    ratio
        .map(|r| format!(", {:.0} % of {what}", 100.0 * r))
        .unwrap_or_default()
}

/// With `KILN_PROFILE=1`, writes the engine's per-node profile to `$KILN_PROFILE_OUT` (default
/// `kiln-profile.json`) for `scripts/profile.py`.
pub fn write_profile(session: &Session) -> Result<()> {
    let plans = session.engine.profile();
    if plans.is_empty() {
        return Ok(());
    }
    let threads = session.engine.threads();
    let probe = load_probe(&HostCpu::detect());
    let plans: Vec<_> = plans
        .iter()
        .map(|p| {
            let nodes: Vec<_> = p
                .nodes
                .iter()
                .map(|(step, t)| {
                    json!({
                        "symbol": step.kernel.symbol(),
                        "family": step.kernel.family(),
                        "layer": step.layer,
                        "barrier_before": step.barrier_before,
                        "nanos": t.nanos,
                        "bytes": t.bytes,
                        "flops": t.flops,
                    })
                })
                .collect();
            json!({
                "name": p.name,
                "runs": p.runs,
                "rows": p.rows,
                "nodes": nodes,
                "barriers_per_run": p.barriers_per_run,
                "barrier_wait_nanos": p.barrier_wait_nanos,
            })
        })
        .collect();
    let out = json!({
        "model": session.dir.display().to_string(),
        "threads": threads,
        "probe_read_gb_s": probe.as_ref().and_then(|p| p.read_at(threads)),
        "probe_fma_gflop_s": probe.as_ref().and_then(|p| p.fma_at(threads)),
        "plans": plans,
    });
    let path = std::env::var_os("KILN_PROFILE_OUT")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("kiln-profile.json"));
    std::fs::write(&path, serde_json::to_string_pretty(&out)?)?;
    errln!(
        "profile written to {} (summarise with scripts/profile.py)",
        path.display()
    )?;
    Ok(())
}
