//! Models on disk: `kiln pull` (download without running), `kiln list` (what the Hugging Face
//! cache and Kiln's models folder hold, with size and whether Kiln's cache has a library for
//! it), `kiln rm` (remove one). `list` and `rm` never touch the network; `pull` follows
//! `HF_HUB_OFFLINE` (then it only reports what the cache holds).

use crate::commands::human_bytes;
use crate::output::{errln, outln};
use crate::session::{cache_key, compile_options, models_dir};
use anyhow::{Context as _, Result, anyhow, bail};
use kiln_cache::{Cache, Lookup};
use kiln_core::{HostCpu, ModelSpec};
use kiln_formats::gguf;
use kiln_formats::hub::{self, HubError, HubOptions, HubSpec, store};
use serde_json::json;
use std::path::{Path, PathBuf};

/// The id forms `pull` and `rm` take, for messages.
const ID_FORMS: &str = "org/name, org/name:QUANT or org/name/FILE.gguf, each with an optional @revision";

/// `kiln pull ID`: downloads what `kiln run ID` would load (always asking the hub for the
/// revision's commit, so a moved branch is followed), with progress bars, resumption and
/// sha256 checks, and prints the local path on stdout. Offline, a cached copy is reported
/// as is and anything else is an error.
pub fn pull(id: &str, quiet: bool) -> Result<()> {
    if Path::new(id).exists() {
        bail!("{id} is a local path; kiln pull downloads Hugging Face models ({ID_FORMS})");
    }
    let mut opts = HubOptions::from_env();
    opts.quiet |= quiet;
    HubSpec::parse(id)?;
    if opts.offline && !opts.quiet {
        errln!("note: HF_HUB_OFFLINE is set: the Hugging Face cache is not checked against the hub")?;
    }
    let path = hub::fetch(id, &opts)?;
    outln!("{}", path.display())?;
    Ok(())
}

/// One row of `kiln list`.
struct Row {
    /// What `kiln run` and `kiln rm` take: a hub id, or the path in Kiln's models folder.
    id: String,
    source: &'static str,
    /// Branches/tags pointing at the snapshot, else its commit; `-` for the models folder.
    revision: String,
    format: &'static str,
    quant: Option<String>,
    path: PathBuf,
    bytes: u64,
    complete: bool,
}

/// `kiln list [--json]`: the models in the Hugging Face cache and in Kiln's models folder, with
/// their size on disk and whether a library compiled with the default options for this CPU is
/// in Kiln's cache (found from the model's headers alone: nothing is compiled or loaded).
pub fn list(as_json: bool) -> Result<()> {
    let hf_cache = HubOptions::from_env().cache_root();
    let folder = models_dir();
    let mut rows: Vec<Row> = store::list(&hf_cache)?
        .into_iter()
        .map(|m| Row {
            revision: if m.refs.is_empty() {
                m.commit[..12].to_string()
            } else {
                m.refs.join(",")
            },
            id: m.id,
            source: "hf-cache",
            format: m.format,
            quant: m.quant,
            path: m.path,
            bytes: m.bytes,
            complete: m.complete,
        })
        .collect();
    if let Some(dir) = &folder {
        rows.extend(folder_models(dir));
    }
    let host = HostCpu::detect();
    let cache = Cache::at(Cache::default_root()?);
    let states: Vec<Compiled> = rows.iter().map(|r| compiled(r, &host, &cache)).collect();
    if as_json {
        let items: Vec<_> = rows
            .iter()
            .zip(&states)
            .map(|(r, c)| {
                json!({
                    "id": r.id, "source": r.source, "revision": r.revision, "format": r.format,
                    "quant": r.quant, "path": r.path.display().to_string(), "bytes": r.bytes,
                    "complete": r.complete, "compiled": c.compiled, "cache_key": c.key,
                    "problem": c.problem,
                })
            })
            .collect();
        outln!("{}", serde_json::Value::Array(items))?;
        return Ok(());
    }
    let folder_text = folder.map_or("none: set KILN_MODELS_DIR or HOME".into(), |d| d.display().to_string());
    if rows.is_empty() {
        outln!(
            "no models in the Hugging Face cache ({}) or Kiln's models folder ({folder_text}); \
             download one with `kiln pull ORG/NAME[:QUANT]`",
            hf_cache.display()
        )?;
        return Ok(());
    }
    print_table(&rows, &states)?;
    outln!(
        "{} model{}, {} (Hugging Face cache {}; Kiln models folder {folder_text})",
        rows.len(),
        if rows.len() == 1 { "" } else { "s" },
        human_bytes(rows.iter().map(|r| r.bytes).sum()),
        hf_cache.display()
    )?;
    Ok(())
}

fn print_table(rows: &[Row], states: &[Compiled]) -> Result<()> {
    let id_w = rows.iter().map(|r| r.id.len()).max().unwrap_or(0).max(2);
    let rev_w = rows.iter().map(|r| r.revision.len()).max().unwrap_or(0).max(8);
    let quant = |r: &Row| r.quant.clone().unwrap_or_else(|| "-".into());
    let q_w = rows.iter().map(|r| quant(r).len()).max().unwrap_or(0).max(5);
    outln!(
        "{:id_w$}  {:rev_w$}  {:q_w$}  {:>10}  COMPILED",
        "ID",
        "REVISION",
        "QUANT",
        "SIZE"
    )?;
    for (r, c) in rows.iter().zip(states) {
        let compiled = match (c.compiled, &c.problem) {
            (Some(true), _) => "yes".to_string(),
            (Some(false), _) => "no".to_string(),
            (None, Some(p)) => format!("- ({p})"),
            (None, None) => "-".to_string(),
        };
        outln!(
            "{:id_w$}  {:rev_w$}  {:q_w$}  {:>10}  {compiled}",
            r.id,
            r.revision,
            quant(r),
            human_bytes(r.bytes)
        )?;
    }
    Ok(())
}

/// Whether Kiln's cache has the library of a row's model.
struct Compiled {
    compiled: Option<bool>,
    key: Option<String>,
    problem: Option<String>,
}

/// Reads the row's model spec from its headers (config + safetensors headers, or the GGUF
/// header of every part) and looks its cache key up.
fn compiled(row: &Row, host: &HostCpu, cache: &Cache) -> Compiled {
    let unknown = |problem: String| Compiled {
        compiled: None,
        key: None,
        problem: Some(problem),
    };
    if !row.complete {
        return unknown("incomplete download".into());
    }
    let mut spec = match spec_of(&row.path) {
        Ok(s) => s,
        Err(e) => return unknown(crate::session::one_line(&e)),
    };
    // As a run with the default options prepares it (`PreparedModel`).
    let options = compile_options(host, None);
    crate::session::group_rows(&mut spec, &options);
    let key = cache_key(&spec, &options, host);
    let compiled = match cache.lookup(&key) {
        Ok(Lookup::Hit(_)) => Some(true),
        Ok(Lookup::Missing | Lookup::Corrupt(_)) => Some(false),
        Err(e) => return unknown(e.to_string()),
    };
    Compiled {
        compiled,
        key: Some(key.to_string()),
        problem: None,
    }
}

/// The spec of the model at `path`, from headers only.
fn spec_of(path: &Path) -> Result<ModelSpec> {
    if path.is_file() {
        let files = gguf::split::open_model(path)?;
        let parts: Vec<&[u8]> = files.maps.iter().map(|m| &m[..]).collect();
        Ok(gguf::model::spec_from_parts(&files.header, &parts, path)?)
    } else {
        Ok(kiln_formats::model::load(path)?.spec)
    }
}

/// The GGUF files (a split model once, by its first part) and model folders (with a
/// `config.json`) directly in Kiln's models folder.
fn folder_models(dir: &Path) -> Vec<Row> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut names = Vec::new();
    let mut rows = Vec::new();
    for e in entries.flatten() {
        let path = e.path();
        let name = e.file_name().to_string_lossy().into_owned();
        if path.is_dir() && path.join("config.json").is_file() {
            rows.push(folder_row(path.clone(), "safetensors", None, dir_bytes(&path), true));
        } else if path.is_file() {
            names.push(name);
        }
    }
    for m in hub::gguf::models(names.iter().map(String::as_str)) {
        let files = m.files();
        let complete = files.iter().all(|f| dir.join(f).is_file());
        let bytes = files
            .iter()
            .filter_map(|f| dir.join(f).metadata().ok())
            .map(|m| m.len())
            .sum();
        rows.push(folder_row(dir.join(&m.first), "gguf", m.quant(), bytes, complete));
    }
    rows.sort_by(|a, b| a.id.cmp(&b.id));
    rows
}

fn folder_row(path: PathBuf, format: &'static str, quant: Option<String>, bytes: u64, complete: bool) -> Row {
    Row {
        id: path.display().to_string(),
        source: "models-folder",
        revision: "-".into(),
        format,
        quant,
        path,
        bytes,
        complete,
    }
}

fn dir_bytes(dir: &Path) -> u64 {
    std::fs::read_dir(dir)
        .map(|d| d.flatten().filter_map(|e| e.metadata().ok()).map(|m| m.len()).sum())
        .unwrap_or(0)
}

/// `kiln rm ID`: removes a model from the Hugging Face cache (a plain id: the snapshot its
/// revision points at; a quant or file: that GGUF model), with the blobs no other snapshot
/// uses, or a model file or folder from Kiln's models folder (by its path or its name there).
/// Asks nothing; an id that is in neither place is an error.
pub fn rm(id: &str) -> Result<()> {
    let folder = models_dir();
    if let Some(path) = folder_entry(id, folder.as_deref())? {
        return rm_from_folder(&path);
    }
    let spec = HubSpec::parse(id).map_err(|e| match e {
        HubError::InvalidSpec { .. } => anyhow!(
            "{id} is neither a model in Kiln's models folder nor a Hugging Face id ({ID_FORMS}); \
             `kiln list` shows the models on disk"
        ),
        e => e.into(),
    })?;
    let hf_cache = HubOptions::from_env().cache_root();
    let removed = match store::remove(&hf_cache, &spec) {
        Err(HubError::NotCached { model, cache }) => bail!(
            "{model} is not in the Hugging Face cache ({}) or Kiln's models folder; `kiln list` shows what is",
            cache.display()
        ),
        other => other?,
    };
    let rest = if removed.repo_removed {
        format!(" (its last snapshot: {} is gone)", spec.folder_name())
    } else {
        String::new()
    };
    outln!(
        "removed {spec}: {} files, {} blobs, {} freed{rest}",
        removed.files,
        removed.blobs,
        human_bytes(removed.bytes)
    )?;
    Ok(())
}

/// The path in Kiln's models folder that `id` names (its path, or its name there), if any. A
/// path that exists elsewhere is refused: `rm` deletes nothing outside its two folders.
fn folder_entry(id: &str, folder: Option<&Path>) -> Result<Option<PathBuf>> {
    let by_name = folder.map(|f| f.join(id)).filter(|p| !id.contains('/') && p.exists());
    let path = match by_name {
        Some(p) => p,
        None if Path::new(id).exists() => PathBuf::from(id),
        None => return Ok(None),
    };
    let canon = |p: &Path| p.canonicalize().with_context(|| format!("cannot read {}", p.display()));
    let inside = match folder.filter(|f| f.is_dir()) {
        Some(f) => canon(&path)?.parent() == Some(canon(f)?.as_path()),
        None => false,
    };
    if !inside {
        bail!(
            "kiln rm removes models from the Hugging Face cache and Kiln's models folder ({}); {id} is in neither",
            folder.map_or("not set".into(), |f| f.display().to_string())
        );
    }
    Ok(Some(path))
}

/// Removes a model folder, or a GGUF file with every part of its split model.
fn rm_from_folder(path: &Path) -> Result<()> {
    if path.is_dir() {
        let bytes = dir_bytes(path);
        std::fs::remove_dir_all(path).with_context(|| format!("cannot remove {}", path.display()))?;
        outln!("removed {} ({} freed)", path.display(), human_bytes(bytes))?;
        return Ok(());
    }
    let dir = path.parent().unwrap_or(Path::new("."));
    let name = path.file_name().unwrap_or_default().to_string_lossy();
    let files = match gguf::split::split_name(&name) {
        Some((prefix, _, count)) if count > 1 => (1..=count)
            .map(|i| dir.join(gguf::split::part_name(prefix, i, count)))
            .filter(|p| p.exists())
            .collect(),
        _ => vec![path.to_path_buf()],
    };
    let mut bytes = 0;
    for f in &files {
        bytes += f.metadata().map(|m| m.len()).unwrap_or(0);
        std::fs::remove_file(f).with_context(|| format!("cannot remove {}", f.display()))?;
    }
    outln!(
        "removed {} ({} files, {} freed)",
        path.display(),
        files.len(),
        human_bytes(bytes)
    )?;
    Ok(())
}
