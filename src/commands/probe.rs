//! `kiln probe`: this machine's read bandwidth and FMA peak, measured with Kiln-compiled
//! kernels and stored next to the cache, where `kiln bench` and `kiln info` read them.

use super::human_bytes;
use crate::output::{errln, outln};
use crate::session::{self, OpenOptions, compile_options, open_cache};
use anyhow::{Context as _, Result};
use kiln_cache::Cache;
use kiln_core::HostCpu;
use kiln_engine::probe::{ProbeResult, probe_buffer_bytes, probe_kernels, run_probe};
use serde_json::json;
use std::io::Write;
use std::path::{Path, PathBuf};

/// Where the probe result for this machine is stored: next to the cache, keyed by the CPU.
fn probe_path(cache_root: &Path, host: &HostCpu) -> PathBuf {
    let cpu = serde_json::to_string(host).expect("cpu serialises");
    let key = kiln_cache::Key::from_parts(&[("cpu", &cpu)]);
    cache_root.join("probe").join(format!("{key}.json"))
}

/// The stored probe result for this machine, if `kiln probe` has run.
pub fn load_probe(host: &HostCpu) -> Option<ProbeResult> {
    let root = Cache::default_root().ok()?;
    let text = std::fs::read_to_string(probe_path(&root, host)).ok()?;
    serde_json::from_str(&text).ok()
}

/// The probe library for this machine (compiled into the cache on first use), its buffer size
/// and vector width.
pub fn probe_library(
    host: &HostCpu,
    cache: &Cache,
    progress: bool,
) -> Result<(session::CompiledLibrary, usize, usize)> {
    let options = compile_options(host, None);
    let buffer_bytes = probe_buffer_bytes();
    let (read, fma) = probe_kernels(buffer_bytes, options.f32_lanes);
    let kernels = vec![read, fma];
    let kernels_json = serde_json::to_string(&kernels).expect("kernels serialise");
    let cpu_json = serde_json::to_string(&host).expect("cpu serialises");
    let toolchain = session::toolchain_key_parts();
    let mut parts: Vec<(&str, &str)> = vec![("probe", &kernels_json), ("cpu", &cpu_json)];
    parts.extend(toolchain.iter().map(|(k, v)| (*k, v.as_str())));
    let request = session::LibraryRequest {
        key: kiln_cache::Key::from_parts(&parts),
        kernels,
        options,
        label: "probe".into(),
        info: json!({"model": "probe", "buffer_bytes": buffer_bytes}),
    };
    let lib = session::ensure_library(
        &request,
        host,
        cache,
        &OpenOptions {
            progress,
            ..OpenOptions::default()
        },
    )?;
    Ok((lib, buffer_bytes, request.options.f32_lanes))
}

pub fn probe(passes: usize, as_json: bool) -> Result<()> {
    let host = HostCpu::detect();
    let cache = open_cache(None)?;
    let (lib, buffer_bytes, lanes) = probe_library(&host, &cache, !as_json)?;
    if !as_json {
        errln!(
            "probing with a {} buffer, best of {passes} passes per thread count",
            human_bytes(buffer_bytes as u64)
        )?;
    }
    // The first failed write to stderr; the probe runs on and the error is returned after it.
    let mut progress_error = None;
    let result = run_probe(&lib.path, buffer_bytes, lanes, passes, &mut |line| {
        if !as_json && progress_error.is_none() {
            progress_error = errln!("  {line}").err();
        }
    })?;
    if let Some(e) = progress_error {
        return Err(e.into());
    }
    let path = probe_path(cache.root(), &host);
    write_atomically(&path, serde_json::to_string_pretty(&result)?.as_bytes())?;
    if as_json {
        outln!("{}", serde_json::to_string(&result)?)?;
    } else {
        outln!(
            "{} ({} f32 lanes), load average {:.2}",
            host.model_name,
            result.f32_lanes,
            result.load_average.unwrap_or(f64::NAN)
        )?;
        outln!("threads  read GB/s (best / median)  FMA GFLOP/s (best / median)")?;
        for (r, f) in result.read_gb_s.iter().zip(&result.fma_gflop_s) {
            outln!(
                "{:>7}  {:>8.1} / {:<8.1}           {:>8.1} / {:<8.1}",
                r.threads,
                r.best,
                r.median,
                f.best,
                f.median
            )?;
        }
        outln!("saved to {}", path.display())?;
    }
    Ok(())
}

/// Writes `bytes` to `path` through a temporary file and a rename, so readers never see a
/// partial file.
fn write_atomically(path: &Path, bytes: &[u8]) -> Result<()> {
    let dir = path.parent().expect("path has a folder");
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let mut tmp = tempfile::NamedTempFile::new_in(dir).with_context(|| format!("writing in {}", dir.display()))?;
    tmp.write_all(bytes)
        .with_context(|| format!("writing {}", path.display()))?;
    tmp.persist(path)
        .map_err(|e| anyhow::anyhow!("writing {}: {}", path.display(), e.error))?;
    Ok(())
}
