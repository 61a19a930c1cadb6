//! What the Hugging Face cache holds, for `kiln list` and `kiln rm`: the models Kiln can load
//! from each snapshot (a safetensors model, and each GGUF model, by the id that names it), and
//! removing one with the blobs no other snapshot uses. Never touches the network.

use super::gguf::{self, GgufModel, Select};
use super::{HubError, HubSpec, cached_snapshot, is_commit_hash, missing_in_snapshot};
use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::{Path, PathBuf};

/// One model in the cache.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CachedModel {
    /// The id that names it, for `kiln run` and `kiln rm`: `org/name`, `org/name:QUANT` or
    /// `org/name/FILE.gguf`, with `@revision` unless `main` points at its commit (`@commit`
    /// when no ref does).
    pub id: String,
    pub repo_id: String,
    /// The refs (branches, tags) that point at `commit`.
    pub refs: Vec<String>,
    pub commit: String,
    /// `"safetensors"` or `"gguf"`.
    pub format: &'static str,
    /// The quant a GGUF model's name carries, upper case.
    pub quant: Option<String>,
    /// What Kiln loads: the snapshot folder, or the GGUF file (first part).
    pub path: PathBuf,
    /// Bytes on disk of the distinct blobs its files point to.
    pub bytes: u64,
    /// Whether every file it needs is there (a download may have been cut).
    pub complete: bool,
}

/// What [`remove`] removed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Removed {
    /// Snapshot entries (links) removed.
    pub files: usize,
    /// Blobs removed (those no remaining snapshot uses).
    pub blobs: usize,
    /// Bytes freed.
    pub bytes: u64,
    /// Whether the whole `models--org--name` folder went (no snapshot left).
    pub repo_removed: bool,
}

/// Every model in the cache at `cache` (a `.../hub` folder), sorted by id. A missing cache
/// folder is an empty list.
pub fn list(cache: &Path) -> Result<Vec<CachedModel>, HubError> {
    let Ok(entries) = fs::read_dir(cache) else {
        return Ok(Vec::new());
    };
    let mut out = Vec::new();
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let Some(repo_id) = name.strip_prefix("models--").map(|n| n.replacen("--", "/", 1)) else {
            continue;
        };
        let repo_dir = e.path();
        let refs = refs_by_commit(&repo_dir);
        let Ok(snapshots) = fs::read_dir(repo_dir.join("snapshots")) else {
            continue;
        };
        for snap in snapshots.flatten() {
            let commit = snap.file_name().to_string_lossy().into_owned();
            if snap.path().is_dir() && is_commit_hash(&commit) {
                let refs = refs.get(&commit).cloned().unwrap_or_default();
                out.extend(snapshot_models(&repo_id, &commit, refs, &snap.path()));
            }
        }
    }
    out.sort_by(|a, b| a.id.cmp(&b.id));
    Ok(out)
}

/// The models in one snapshot folder.
fn snapshot_models(repo_id: &str, commit: &str, refs: Vec<String>, snap: &Path) -> Vec<CachedModel> {
    let revision = if refs.iter().any(|r| r == super::DEFAULT_REVISION) {
        String::new()
    } else {
        format!("@{}", refs.first().map(String::as_str).unwrap_or(commit))
    };
    let files = gguf::snapshot_files(snap);
    let models = gguf::models(files.iter().map(String::as_str));
    let spec = HubSpec {
        repo_id: repo_id.to_string(),
        revision: commit.to_string(),
        select: Select::Default,
    };
    let row = |id: String, format, quant, path, own: Vec<String>, complete| CachedModel {
        id,
        repo_id: repo_id.to_string(),
        refs: refs.clone(),
        commit: commit.to_string(),
        format,
        quant,
        path,
        bytes: blob_bytes(snap, &own),
        complete,
    };
    let mut out = Vec::new();
    let others: Vec<String> = files.iter().filter(|f| !is_gguf(f)).cloned().collect();
    if others.iter().any(|f| f == "config.json" || f.ends_with(".safetensors")) {
        let complete = missing_in_snapshot(snap).is_none();
        out.push(row(
            format!("{repo_id}{revision}"),
            "safetensors",
            None,
            snap.to_path_buf(),
            others,
            complete,
        ));
    }
    for m in &models {
        let quant = m.quant();
        let unique = quant.as_ref().is_some_and(|q| {
            gguf::pick(&Select::Quant(q.clone()), &models, &spec)
                .ok()
                .flatten()
                .as_ref()
                == Some(m)
        });
        let id = match (&quant, unique) {
            (Some(q), true) => format!("{repo_id}:{q}{revision}"),
            _ => format!("{repo_id}/{}{revision}", m.first),
        };
        let complete = gguf::missing_part(snap, m).is_none();
        out.push(row(id, "gguf", quant, snap.join(&m.first), m.files(), complete));
    }
    out
}

fn is_gguf(f: &str) -> bool {
    f.to_ascii_lowercase().ends_with(".gguf")
}

/// Bytes of the distinct files (blobs) that `files` of `snap` resolve to.
fn blob_bytes(snap: &Path, files: &[String]) -> u64 {
    let mut seen = BTreeSet::new();
    let mut bytes = 0;
    for f in files {
        let path = snap.join(f);
        if let (Ok(meta), Ok(real)) = (fs::metadata(&path), fs::canonicalize(&path))
            && seen.insert(real)
        {
            bytes += meta.len();
        }
    }
    bytes
}

/// Commit -> the refs (relative paths under `refs/`) that hold it.
fn refs_by_commit(repo_dir: &Path) -> BTreeMap<String, Vec<String>> {
    let mut out: BTreeMap<String, Vec<String>> = BTreeMap::new();
    let refs = repo_dir.join("refs");
    for r in gguf::snapshot_files(&refs) {
        if let Ok(c) = fs::read_to_string(refs.join(&r))
            && is_commit_hash(c.trim())
        {
            out.entry(c.trim().to_string()).or_default().push(r);
        }
    }
    out
}

/// Removes from the cache at `cache` what `spec` names: for a plain id the whole snapshot its
/// revision points at, for a quant or file that GGUF model's files. Then refs pointing at a
/// snapshot that is gone, the blobs no remaining snapshot links to and, when no snapshot is
/// left, the repository's folder and lock folder. Links go first, blobs last, so an
/// interruption leaves unused blobs, never a snapshot pointing at nothing.
pub fn remove(cache: &Path, spec: &HubSpec) -> Result<Removed, HubError> {
    let not_cached = || HubError::NotCached {
        model: spec.to_string(),
        cache: cache.to_path_buf(),
    };
    let repo_dir = cache.join(spec.folder_name());
    let snapshot = cached_snapshot(cache, spec).ok_or_else(not_cached)?;
    let files = gguf::snapshot_files(&snapshot);
    let doomed: Vec<String> = match &spec.select {
        Select::Default => files,
        select => {
            let models = gguf::models(files.iter().map(String::as_str));
            let model: GgufModel = gguf::pick(select, &models, spec)
                .ok()
                .flatten()
                .ok_or_else(not_cached)?;
            model.files().into_iter().filter(|f| files.contains(f)).collect()
        }
    };
    let blobs_dir = repo_dir.join("blobs");
    let mut candidates = BTreeSet::new();
    for f in &doomed {
        let link = snapshot.join(f);
        if let Some(blob) = blob_of(&link, &blobs_dir) {
            candidates.insert(blob);
        }
        fs::remove_file(&link).map_err(HubError::io("cannot remove", &link))?;
    }
    prune_empty_dirs(&snapshot);
    let snapshot_gone = !snapshot.exists();
    if snapshot_gone {
        let commit = snapshot.file_name().unwrap_or_default().to_string_lossy().into_owned();
        let refs = repo_dir.join("refs");
        for r in refs_by_commit(&repo_dir).remove(&commit).unwrap_or_default() {
            let path = refs.join(r);
            fs::remove_file(&path).map_err(HubError::io("cannot remove", &path))?;
        }
        prune_empty_dirs(&refs);
    }
    let still_used = used_blobs(&repo_dir, &blobs_dir);
    let mut removed = Removed {
        files: doomed.len(),
        blobs: 0,
        bytes: 0,
        repo_removed: false,
    };
    for blob in candidates.difference(&still_used) {
        let path = blobs_dir.join(blob);
        let len = fs::metadata(&path).map(|m| m.len()).unwrap_or(0);
        match fs::remove_file(&path) {
            Ok(()) => {
                removed.blobs += 1;
                removed.bytes += len;
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(HubError::io("cannot remove", &path)(e)),
        }
    }
    let snapshots_left = fs::read_dir(repo_dir.join("snapshots")).is_ok_and(|mut d| d.next().is_some());
    if !snapshots_left {
        // Whatever is left (refs to commits never downloaded, partial downloads) goes too.
        fs::remove_dir_all(&repo_dir).map_err(HubError::io("cannot remove", &repo_dir))?;
        let _ = fs::remove_dir_all(cache.join(".locks").join(spec.folder_name()));
        removed.repo_removed = true;
    }
    Ok(removed)
}

/// The blob name a snapshot link points at, if it points into `blobs_dir`.
fn blob_of(link: &Path, blobs_dir: &Path) -> Option<String> {
    let target = fs::read_link(link).ok()?;
    let name = target.file_name()?.to_str()?.to_string();
    blobs_dir.join(&name).exists().then_some(name)
}

/// Blobs some link of some snapshot of the repository points at.
fn used_blobs(repo_dir: &Path, blobs_dir: &Path) -> BTreeSet<String> {
    let mut used = BTreeSet::new();
    let snapshots = repo_dir.join("snapshots");
    let Ok(dirs) = fs::read_dir(&snapshots) else {
        return used;
    };
    for d in dirs.flatten() {
        for f in gguf::snapshot_files(&d.path()) {
            if let Some(blob) = blob_of(&d.path().join(f), blobs_dir) {
                used.insert(blob);
            }
        }
    }
    used
}

/// Removes the empty folders under `dir`, and `dir` itself when it ends up empty.
fn prune_empty_dirs(dir: &Path) {
    if let Ok(entries) = fs::read_dir(dir) {
        for e in entries.flatten() {
            if e.file_type().is_ok_and(|t| t.is_dir()) {
                prune_empty_dirs(&e.path());
            }
        }
    }
    let _ = fs::remove_dir(dir);
}
