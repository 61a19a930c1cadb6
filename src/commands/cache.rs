//! `kiln cache list` and `kiln cache clean`: the compiled libraries and the row-grouped weight
//! copies kept in the cache, listed and removed.

use super::human_bytes;
use crate::output::outln;
use anyhow::{Context as _, Result};
use kiln_cache::Cache;
use serde_json::json;

/// `kiln cache list [--json]`. The JSON form is one array: each compiled library
/// (`"kind": "library"`), then each row-grouped weight copy (`"kind": "grouped_copy"`, its path,
/// size and whether it is stale), so a script summing `bytes` counts all the cache holds.
pub fn cache_list(as_json: bool) -> Result<()> {
    let cache = Cache::at(Cache::default_root()?);
    let entries = cache.list()?;
    let grouped = cache.root().join(kiln_cache::GROUPED_COPIES);
    let copies: Vec<(std::path::PathBuf, u64)> = std::fs::read_dir(&grouped)
        .map(|d| {
            d.flatten()
                .filter_map(|f| Some((f.path(), f.metadata().ok()?.len())))
                .collect()
        })
        .unwrap_or_default();
    let stale = kiln_engine::grouped_store::stale_copies(&grouped);
    if as_json {
        let libraries = entries.iter().map(|e| {
            json!({
                "kind": "library",
                "key": e.key.to_string(),
                "dir": e.dir.display().to_string(),
                "bytes": e.bytes_on_disk,
                "valid": e.is_valid(),
                "problem": e.problem,
                "model": e.info().and_then(|i| i.get("model")).cloned(),
            })
        });
        let copies = copies.iter().map(|(path, bytes)| {
            json!({
                "kind": "grouped_copy",
                "path": path.display().to_string(),
                "bytes": bytes,
                "stale": stale.iter().any(|(p, _)| p == path),
            })
        });
        outln!("{}", serde_json::Value::Array(libraries.chain(copies).collect()))?;
        return Ok(());
    }
    if entries.is_empty() && copies.is_empty() {
        outln!("cache {} is empty", cache.root().display())?;
        return Ok(());
    }
    outln!("cache {}", cache.root().display())?;
    if !copies.is_empty() {
        let bytes = human_bytes(copies.iter().map(|c| c.1).sum());
        outln!(
            "{bytes} in {} row-grouped weight copies ({})",
            copies.len(),
            grouped.display()
        )?;
        if !stale.is_empty() {
            outln!(
                "{} of them ({}) stale: their model files are gone or changed (`kiln cache clean --stale`)",
                stale.len(),
                human_bytes(stale.iter().map(|s| s.1).sum())
            )?;
        }
    }
    for e in &entries {
        let model = e
            .info()
            .and_then(|i| i.get("model"))
            .and_then(|m| m.as_str())
            .unwrap_or("?")
            .to_string();
        let status = e.problem.clone().unwrap_or_else(|| "ok".into());
        outln!("{}  {:>10}  {model}  [{status}]", e.key, human_bytes(e.bytes_on_disk))?;
    }
    Ok(())
}

/// What `kiln cache clean` removes.
pub enum CleanWhat {
    /// One compiled library, by key or unique key prefix.
    Entry(String),
    /// The row-grouped weight copies that serve no model any more.
    Stale,
    /// Everything.
    All,
}

pub fn cache_clean(what: CleanWhat) -> Result<()> {
    let root = Cache::default_root()?;
    if !root.exists() {
        outln!("cache {} is empty", root.display())?;
        return Ok(());
    }
    let cache = Cache::open(root).context("opening the cache")?;
    match what {
        CleanWhat::Entry(k) => {
            let removed = cache.remove(&k)?;
            outln!("removed {} ({})", removed.key, human_bytes(removed.bytes_on_disk))?;
        }
        CleanWhat::Stale => {
            let grouped = cache.root().join(kiln_cache::GROUPED_COPIES);
            let (mut count, mut bytes) = (0, 0);
            for (path, len) in kiln_engine::grouped_store::stale_copies(&grouped) {
                std::fs::remove_file(&path).with_context(|| format!("removing {}", path.display()))?;
                (count, bytes) = (count + 1, bytes + len);
            }
            outln!(
                "removed {count} stale row-grouped weight copies, freed {}",
                human_bytes(bytes)
            )?;
        }
        CleanWhat::All => {
            let report = cache.clean_all()?;
            outln!(
                "removed {} entries, freed {}",
                report.entries_removed.len(),
                human_bytes(report.bytes_freed)
            )?;
        }
    }
    Ok(())
}
