//! Models named by their Hugging Face hub id, resolved to a local folder or GGUF file and
//! downloaded into the standard Hugging Face cache on first use:
//!
//! * `org/name[@revision]`: the safetensors model of the repository, or, in a repository
//!   without safetensors weights, its default GGUF file (see [`gguf`]; a note on stderr says
//!   which);
//! * `org/name:QUANT[@revision]` (or `org/name@revision:QUANT`): the GGUF file carrying that
//!   quant, as llama.cpp's `-hf org/name:QUANT`;
//! * `org/name/path/FILE.gguf[@revision]`: that GGUF file.
//!
//! A split GGUF model (`-00001-of-0000n.gguf`) is downloaded whole and resolved to its first
//! part, which [`crate::gguf`] reads together with the others.
//!
//! The cache is laid out exactly as Python's `huggingface_hub` lays it out, so a model
//! downloaded by one is found by the other:
//!
//! ```text
//! $HF_HUB_CACHE/                      (default $HF_HOME/hub, default ~/.cache/huggingface/hub)
//!   CACHEDIR.TAG
//!   .locks/models--org--name/<etag>.lock
//!   models--org--name/
//!     blobs/<etag>                    file contents, named by their ETag: the sha256 of an
//!                                     LFS file, the git blob sha1 of a small one
//!     blobs/<etag>.incomplete         a download in progress (resumed with `Range`)
//!     snapshots/<commit>/<filename>   relative symlink -> ../../blobs/<etag>
//!     refs/<revision>                 the commit a branch or tag pointed to (no newline)
//! ```
//!
//! Only what Kiln loads is downloaded. For a GGUF model, its file (or parts). Otherwise
//! `config.json` and `tokenizer.json` (required),
//! `generation_config.json`, `tokenizer_config.json` and `chat_template.jinja` (when the
//! repository has them), and the safetensors weights: `model.safetensors` if the repository
//! has it (as `transformers` prefers it), else `model.safetensors.index.json` and the shards
//! it lists. Other formats (`*.bin`, `*.pth`, `*.gguf`, `onnx/`, ...) are skipped, and a
//! repository with neither safetensors weights nor GGUF models is refused before anything is
//! downloaded.
//!
//! Downloads go to `blobs/<etag>.incomplete` (resumed with `Range` by a later attempt or a
//! later run), are checked against the size the hub announced and, when the ETag is a
//! sha256 (LFS files), against it, and are renamed into place; only then is the snapshot
//! link made. `refs/<revision>` is written last, once the snapshot is complete. A download
//! cut by the network is resumed in-process a few times before giving up.
//!
//! [`resolve`] answers from the cache without any network traffic when the snapshot that
//! `refs/<revision>` names holds what the id asks for (a plain id of a GGUF repository always
//! asks the hub which file is its default, unless offline); otherwise it asks the hub
//! (`GET {endpoint}/api/models/{repo}/revision/{rev}` for the commit and file list, then
//! `HEAD` + `GET {endpoint}/{repo}/resolve/{commit}/{file}` for each missing file, as
//! `huggingface_hub` does). [`fetch`] always asks the hub, so it picks up a branch that has
//! moved. With `HF_HUB_OFFLINE=1` nothing touches the network: what the cache holds is used
//! (for a plain id, a complete safetensors snapshot, else its default among the cached GGUF
//! files), and anything else is one error line. [`store`] lists and removes cached models.

pub mod gguf;
mod http;
mod spec;
pub mod store;

#[cfg(test)]
mod tests;
#[cfg(test)]
mod tests_gguf;

pub use gguf::Select;
use serde_json::Value;
pub use spec::{HubSpec, is_hub_id};
use spec::{is_commit_hash, is_sha256};
use std::collections::BTreeSet;
use std::io;
use std::path::{Path, PathBuf};

/// The public hub.
pub const DEFAULT_ENDPOINT: &str = "https://huggingface.co";
/// The revision used when a hub id names none.
pub const DEFAULT_REVISION: &str = "main";

/// Weight file of a single-file checkpoint.
const SINGLE_WEIGHTS: &str = "model.safetensors";
/// Index of a sharded checkpoint.
const WEIGHTS_INDEX: &str = "model.safetensors.index.json";
/// Files Kiln cannot do without, besides the weights.
const REQUIRED_FILES: [&str; 2] = ["config.json", "tokenizer.json"];
/// Files taken when the repository has them.
const OPTIONAL_FILES: [&str; 3] = ["generation_config.json", "tokenizer_config.json", "chat_template.jinja"];
/// What `huggingface_hub` writes into `CACHEDIR.TAG`.
const CACHEDIR_TAG: &str = "Signature: 8a477f597d28d172789f06886806bc55\n\
# This file is a cache directory tag created by huggingface_hub.\n\
# For information about cache directory tags, see:\n\
#\thttps://bford.info/cachedir/\n";

/// How to reach the hub and where the cache is. `None` fields take the built-in defaults
/// (the public hub, no token, the default cache folder); [`HubOptions::from_env`] fills them
/// from the environment the way `huggingface_hub` does.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct HubOptions {
    /// Hub address, as `HF_ENDPOINT` (default [`DEFAULT_ENDPOINT`]).
    pub endpoint: Option<String>,
    /// Access token for private and gated models, sent as `Authorization: Bearer`.
    pub token: Option<String>,
    /// The hub cache folder, as `HF_HUB_CACHE` (default: [`default_cache_dir`]).
    pub cache_dir: Option<PathBuf>,
    /// No network at all: answer from the cache or fail (`HF_HUB_OFFLINE`).
    pub offline: bool,
    /// No progress bars or notes on stderr (warnings are still printed).
    pub quiet: bool,
}

impl HubOptions {
    /// Options from the environment, as `huggingface_hub` reads it:
    /// * `endpoint`: `HF_ENDPOINT`;
    /// * `token`: `HF_TOKEN`, else `HUGGING_FACE_HUB_TOKEN`, else the token file written by
    ///   `huggingface-cli login` (`HF_TOKEN_PATH`, default `$HF_HOME/token`);
    /// * `cache_dir`: `HF_HUB_CACHE`, else `HUGGINGFACE_HUB_CACHE`, else `$HF_HOME/hub`, else
    ///   `$XDG_CACHE_HOME/huggingface/hub`, else `~/.cache/huggingface/hub`;
    /// * `offline`: `HF_HUB_OFFLINE` (or `TRANSFORMERS_OFFLINE`) set to 1/ON/YES/TRUE;
    /// * `quiet`: `HF_HUB_DISABLE_PROGRESS_BARS` set to a true value.
    pub fn from_env() -> HubOptions {
        Self::from_lookup(|k| std::env::var(k).ok())
    }

    /// [`HubOptions::from_env`] over any variable lookup (for tests).
    pub(crate) fn from_lookup(var: impl Fn(&str) -> Option<String>) -> HubOptions {
        let get = |k: &str| var(k).filter(|v| !v.is_empty());
        let home = hf_home(&var);
        let token = get("HF_TOKEN")
            .or_else(|| get("HUGGING_FACE_HUB_TOKEN"))
            .and_then(|t| clean_token(&t))
            .or_else(|| {
                let path = get("HF_TOKEN_PATH")
                    .map(|p| expand_user(&p, &var))
                    .unwrap_or_else(|| home.join("token"));
                std::fs::read_to_string(path).ok().and_then(|t| clean_token(&t))
            });
        HubOptions {
            endpoint: get("HF_ENDPOINT").map(|e| e.trim_end_matches('/').to_string()),
            token,
            cache_dir: Some(cache_dir_from(&var)),
            offline: is_true(var("HF_HUB_OFFLINE")) || is_true(var("TRANSFORMERS_OFFLINE")),
            quiet: is_true(var("HF_HUB_DISABLE_PROGRESS_BARS")),
        }
    }

    /// The hub address, without a trailing slash.
    pub fn endpoint(&self) -> &str {
        self.endpoint
            .as_deref()
            .map(|e| e.trim_end_matches('/'))
            .filter(|e| !e.is_empty())
            .unwrap_or(DEFAULT_ENDPOINT)
    }

    /// The hub cache folder (`.../hub`, the one holding `models--org--name`).
    pub fn cache_root(&self) -> PathBuf {
        self.cache_dir.clone().unwrap_or_else(default_cache_dir)
    }
}

/// The hub cache folder `huggingface_hub` uses: `HF_HUB_CACHE`, else `HUGGINGFACE_HUB_CACHE`,
/// else `$HF_HOME/hub`, else `$XDG_CACHE_HOME/huggingface/hub`, else
/// `~/.cache/huggingface/hub`.
pub fn default_cache_dir() -> PathBuf {
    cache_dir_from(&|k: &str| std::env::var(k).ok())
}

fn cache_dir_from(var: &impl Fn(&str) -> Option<String>) -> PathBuf {
    let get = |k: &str| var(k).filter(|v| !v.is_empty());
    get("HF_HUB_CACHE")
        .or_else(|| get("HUGGINGFACE_HUB_CACHE"))
        .map(|p| expand_user(&p, var))
        .unwrap_or_else(|| hf_home(var).join("hub"))
}

fn hf_home(var: &impl Fn(&str) -> Option<String>) -> PathBuf {
    let get = |k: &str| var(k).filter(|v| !v.is_empty());
    match get("HF_HOME") {
        Some(h) => expand_user(&h, var),
        None => match get("XDG_CACHE_HOME") {
            Some(x) => expand_user(&x, var).join("huggingface"),
            None => home_dir(var).join(".cache").join("huggingface"),
        },
    }
}

fn home_dir(var: &impl Fn(&str) -> Option<String>) -> PathBuf {
    var("HOME")
        .or_else(|| var("USERPROFILE"))
        .filter(|h| !h.is_empty())
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("."))
}

/// `~` and `~/...` as Python's `os.path.expanduser` reads them.
fn expand_user(p: &str, var: &impl Fn(&str) -> Option<String>) -> PathBuf {
    if p == "~" {
        home_dir(var)
    } else if let Some(rest) = p.strip_prefix("~/") {
        home_dir(var).join(rest)
    } else {
        PathBuf::from(p)
    }
}

fn is_true(v: Option<String>) -> bool {
    v.is_some_and(|v| matches!(v.to_ascii_uppercase().as_str(), "1" | "ON" | "YES" | "TRUE"))
}

fn clean_token(t: &str) -> Option<String> {
    let t = t.replace(['\r', '\n'], "");
    let t = t.trim();
    (!t.is_empty()).then(|| t.to_string())
}

/// Why a model could not be resolved. Each message is one line.
#[derive(Debug, thiserror::Error)]
pub enum HubError {
    #[error(
        "'{spec}' is not a Hugging Face model id (expected org/name, org/name:QUANT or org/name/FILE.gguf, each with an optional @revision): {reason}"
    )]
    InvalidSpec { spec: String, reason: String },
    #[error("model {model} not found on {endpoint} (check the name, or set HF_TOKEN for private/gated models)")]
    NotFound { model: String, endpoint: String },
    #[error("access to model {model} on {endpoint} was refused (HTTP {status}): {hint}")]
    Unauthorized {
        model: String,
        endpoint: String,
        status: u16,
        hint: String,
    },
    #[error("revision '{revision}' of model {model} not found on {endpoint}")]
    RevisionNotFound {
        model: String,
        revision: String,
        endpoint: String,
    },
    #[error(
        "model {model} has no safetensors weights (model.safetensors or model.safetensors.index.json) and no GGUF model files{found}; Kiln loads safetensors or GGUF"
    )]
    NoSafetensors { model: String, found: String },
    #[error("model {model} has no GGUF file for quant {quant}; {available}")]
    NoQuant {
        model: String,
        quant: String,
        available: String,
    },
    #[error("quant {quant} matches several GGUF files of model {model}: {matches}; name one as {repo}/FILE")]
    AmbiguousQuant {
        model: String,
        repo: String,
        quant: String,
        matches: String,
    },
    #[error("model {model} has no GGUF file {file}; {available}")]
    NoSuchFile {
        model: String,
        file: String,
        available: String,
    },
    #[error("model {model} has no {file}, which Kiln needs")]
    MissingFile { model: String, file: String },
    #[error(
        "model {model} is not in the Hugging Face cache ({cache}) and HF_HUB_OFFLINE is set; run once online or download it with huggingface-cli"
    )]
    Offline { model: String, cache: PathBuf },
    #[error(
        "model {model} is only partly in the Hugging Face cache ({snapshot}: {missing}) and HF_HUB_OFFLINE is set; run once online or download it with huggingface-cli"
    )]
    OfflinePartial {
        model: String,
        snapshot: PathBuf,
        missing: String,
    },
    #[error("model {model} is not in the Hugging Face cache ({cache})")]
    NotCached { model: String, cache: PathBuf },
    #[error("cannot reach {url}: {message}")]
    Network { url: String, message: String },
    #[error("{url} answered HTTP {status}{message}")]
    Http { url: String, status: u16, message: String },
    #[error("unexpected answer from {url}: {message}")]
    BadResponse { url: String, message: String },
    #[error("download of {file} is corrupt: {message}")]
    Corrupt { file: String, message: String },
    #[error("{op} {path}: {source}")]
    Io {
        op: &'static str,
        path: PathBuf,
        source: io::Error,
    },
}

impl HubError {
    fn io<'a>(op: &'static str, path: &'a Path) -> impl FnOnce(io::Error) -> HubError + 'a {
        move |source| HubError::Io {
            op,
            path: path.to_path_buf(),
            source,
        }
    }

    /// Errors after which a complete cached snapshot is still worth using: the hub could
    /// not be asked, or refused to answer.
    fn allows_cache_fallback(&self) -> bool {
        matches!(
            self,
            HubError::Network { .. }
                | HubError::Http { .. }
                | HubError::BadResponse { .. }
                | HubError::Unauthorized { .. }
                | HubError::NotFound { .. }
                | HubError::RevisionNotFound { .. }
        )
    }
}

/// The local snapshot folder (safetensors) or GGUF file (the first part of a split model) of
/// the model `spec` names (see the module docs), downloading what is missing into the cache.
/// What the cache already holds for the id is returned without contacting the hub; use
/// [`fetch`] to check the hub for a newer commit.
pub fn resolve(spec: &str, opts: &HubOptions) -> Result<PathBuf, HubError> {
    resolve_with(spec, opts, &Tuning::default())
}

/// Like [`resolve`], but always asks the hub which commit the revision names and downloads
/// it if needed (`kiln pull`). If the hub cannot be reached (or refuses) and the cache holds
/// the model, that copy is returned with a warning on stderr.
pub fn fetch(spec: &str, opts: &HubOptions) -> Result<PathBuf, HubError> {
    fetch_with(spec, opts, &Tuning::default())
}

/// What [`resolve`] would return from the cache alone, if anything; never touches the network.
pub fn cached(spec: &str, opts: &HubOptions) -> Result<Option<PathBuf>, HubError> {
    let spec = HubSpec::parse(spec)?;
    Ok(match cache_state(&opts.cache_root(), &spec, false) {
        CacheState::Complete(p) => Some(p),
        _ => None,
    })
}

/// Knobs the tests turn.
#[derive(Clone, Debug)]
pub(crate) struct Tuning {
    /// In-process retries of a download cut by the network, each resuming where it stopped.
    pub retries: u32,
    /// Wait before the first retry; doubled for each next one.
    pub backoff_ms: u64,
}

impl Default for Tuning {
    fn default() -> Self {
        Tuning {
            retries: 4,
            backoff_ms: 1000,
        }
    }
}

pub(crate) fn resolve_with(spec: &str, opts: &HubOptions, tuning: &Tuning) -> Result<PathBuf, HubError> {
    let parsed = HubSpec::parse(spec)?;
    if let CacheState::Complete(p) = cache_state(&opts.cache_root(), &parsed, false) {
        return Ok(p);
    }
    fetch_with(spec, opts, tuning)
}

pub(crate) fn fetch_with(spec: &str, opts: &HubOptions, tuning: &Tuning) -> Result<PathBuf, HubError> {
    let spec = HubSpec::parse(spec)?;
    let cache = opts.cache_root();
    let state = cache_state(&cache, &spec, true);
    if opts.offline {
        return match state {
            CacheState::Complete(p) => {
                note_cached_default(&spec, &p, opts);
                Ok(p)
            }
            CacheState::Partial { snapshot, missing } => Err(HubError::OfflinePartial {
                model: spec.to_string(),
                snapshot,
                missing,
            }),
            CacheState::Absent => Err(HubError::Offline {
                model: spec.to_string(),
                cache,
            }),
        };
    }
    match download(&spec, opts, &cache, tuning) {
        Ok(p) => Ok(p),
        Err(e) => match state {
            CacheState::Complete(p) if e.allows_cache_fallback() => {
                eprintln!("warning: {e}; using the cached copy {}", p.display());
                Ok(p)
            }
            _ => Err(e),
        },
    }
}

/// A plain id answered from the cache by a GGUF file: say which, as the download does.
fn note_cached_default(spec: &HubSpec, path: &Path, opts: &HubOptions) {
    if spec.select == Select::Default && path.is_file() && !opts.quiet {
        let name = path.file_name().unwrap_or_default().to_string_lossy();
        eprintln!(
            "note: {spec} has no safetensors weights in the cache; using its cached GGUF file {name} \
             (choose another with {}:QUANT)",
            spec.repo_id
        );
    }
}

/// What the cache holds for one model revision.
#[derive(Debug)]
enum CacheState {
    /// The snapshot folder (safetensors) or the GGUF file (first part).
    Complete(PathBuf),
    Partial {
        snapshot: PathBuf,
        missing: String,
    },
    Absent,
}

/// The snapshot folder `spec`'s revision names in the cache, if it exists.
fn cached_snapshot(cache: &Path, spec: &HubSpec) -> Option<PathBuf> {
    let repo_dir = cache.join(spec.folder_name());
    let commit = if spec.is_commit() {
        spec.revision.clone()
    } else {
        match std::fs::read_to_string(repo_dir.join("refs").join(&spec.revision)) {
            Ok(c) if is_commit_hash(c.trim()) => c.trim().to_string(),
            _ => return None,
        }
    };
    let snapshot = repo_dir.join("snapshots").join(&commit);
    snapshot.is_dir().then_some(snapshot)
}

/// What the cache holds of `spec`. A plain id is a complete safetensors snapshot; with
/// `gguf_default` (offline, or the hub out of reach) also the default among the cached GGUF
/// files, since only the hub's file list says whether the repository has safetensors.
fn cache_state(cache: &Path, spec: &HubSpec, gguf_default: bool) -> CacheState {
    let Some(snapshot) = cached_snapshot(cache, spec) else {
        return CacheState::Absent;
    };
    if spec.select != Select::Default {
        return gguf_state(&snapshot, spec).unwrap_or(CacheState::Absent);
    }
    match missing_in_snapshot(&snapshot) {
        None => CacheState::Complete(snapshot),
        Some(missing) => match gguf_state(&snapshot, spec).filter(|_| gguf_default) {
            Some(state) => state,
            None => CacheState::Partial { snapshot, missing },
        },
    }
}

/// The GGUF model `spec` picks among those in `snapshot`: complete, missing a part, or `None`
/// when none matches.
fn gguf_state(snapshot: &Path, spec: &HubSpec) -> Option<CacheState> {
    let files = gguf::snapshot_files(snapshot);
    let models = gguf::models(files.iter().map(String::as_str));
    let model = gguf::pick(&spec.select, &models, spec).ok()??;
    Some(match gguf::missing_part(snapshot, &model) {
        None => CacheState::Complete(snapshot.join(&model.first)),
        Some(f) => CacheState::Partial {
            snapshot: snapshot.to_path_buf(),
            missing: format!("{f} is missing"),
        },
    })
}

/// The first file Kiln needs that `snapshot` lacks, as a message.
fn missing_in_snapshot(snapshot: &Path) -> Option<String> {
    for f in REQUIRED_FILES {
        if !snapshot.join(f).is_file() {
            return Some(format!("{f} is missing"));
        }
    }
    if snapshot.join(SINGLE_WEIGHTS).is_file() {
        return None;
    }
    let index = snapshot.join(WEIGHTS_INDEX);
    if !index.is_file() {
        return Some(format!("{SINGLE_WEIGHTS} is missing"));
    }
    let shards = match std::fs::read(&index).ok().and_then(|b| shards_of_index(&b).ok()) {
        Some(s) => s,
        None => return Some(format!("{WEIGHTS_INDEX} is unreadable")),
    };
    shards
        .into_iter()
        .find(|s| !snapshot.join(s).is_file())
        .map(|s| format!("{s} is missing"))
}

/// The shard files a `model.safetensors.index.json` names, sorted and without repeats.
fn shards_of_index(bytes: &[u8]) -> Result<BTreeSet<String>, String> {
    let v: Value = serde_json::from_slice(bytes).map_err(|e| e.to_string())?;
    let map = v
        .get("weight_map")
        .and_then(Value::as_object)
        .ok_or("no weight_map object")?;
    let mut shards = BTreeSet::new();
    for (tensor, file) in map {
        let file = file
            .as_str()
            .ok_or_else(|| format!("weight_map[{tensor}] is not a string"))?;
        if !is_safe_repo_path(file) {
            return Err(format!("weight_map[{tensor}] names an unsafe path '{file}'"));
        }
        shards.insert(file.to_string());
    }
    if shards.is_empty() {
        return Err("weight_map is empty".into());
    }
    Ok(shards)
}

/// A file name inside a repository that stays inside the snapshot folder.
fn is_safe_repo_path(f: &str) -> bool {
    !f.is_empty()
        && !f.starts_with('/')
        && !f.contains('\\')
        && !f.contains('\0')
        && f.split('/').all(|c| !c.is_empty() && c != "." && c != "..")
}

/// Which of the repository's files Kiln takes: the small files first, then the weights
/// (`model.safetensors` or the index; the index's shards are added once it is read).
fn plan_files(spec: &HubSpec, files: &BTreeSet<String>) -> Result<Vec<String>, HubError> {
    let model = spec.to_string();
    let weights = if files.contains(SINGLE_WEIGHTS) {
        SINGLE_WEIGHTS
    } else if files.contains(WEIGHTS_INDEX) {
        WEIGHTS_INDEX
    } else {
        let others: Vec<&str> = files
            .iter()
            .map(String::as_str)
            .filter(|f| is_other_weight_format(f))
            .take(5)
            .collect();
        let found = if others.is_empty() {
            String::new()
        } else {
            format!(" (it has {})", others.join(", "))
        };
        return Err(HubError::NoSafetensors { model, found });
    };
    for f in REQUIRED_FILES {
        if !files.contains(f) {
            return Err(HubError::MissingFile {
                model,
                file: f.to_string(),
            });
        }
    }
    let mut plan: Vec<String> = REQUIRED_FILES
        .iter()
        .chain(OPTIONAL_FILES.iter())
        .filter(|f| files.contains(**f))
        .map(|f| f.to_string())
        .collect();
    plan.push(weights.to_string());
    Ok(plan)
}

/// The GGUF model `spec` asks for among the repository's `files`, or `None` for a
/// safetensors download (a plain id of a repository with safetensors weights, or with no
/// GGUF model either). Every part of a split model must be listed. A plain id that falls
/// back to a GGUF file says which on stderr (unless `quiet`).
fn plan_gguf(spec: &HubSpec, files: &BTreeSet<String>, quiet: bool) -> Result<Option<gguf::GgufModel>, HubError> {
    let models = gguf::models(files.iter().map(String::as_str));
    let has_safetensors = files.contains(SINGLE_WEIGHTS) || files.contains(WEIGHTS_INDEX);
    if spec.select == Select::Default && (has_safetensors || models.is_empty()) {
        return Ok(None);
    }
    let Some(model) = gguf::pick(&spec.select, &models, spec)? else {
        return Ok(None);
    };
    if let Some(f) = model.files().into_iter().find(|f| !files.contains(f)) {
        return Err(HubError::MissingFile {
            model: spec.to_string(),
            file: format!("{f} (a part of the split model {})", model.first),
        });
    }
    if spec.select == Select::Default && !quiet {
        eprintln!(
            "note: {spec} has no safetensors weights; using its GGUF file {} (Q4_K_M if present, \
             else Q8_0, else the first; choose with {}:QUANT; {})",
            model.describe(),
            spec.repo_id,
            gguf::available(&models)
        );
    }
    Ok(Some(model))
}

fn is_other_weight_format(f: &str) -> bool {
    const EXT: [&str; 9] = [
        ".safetensors",
        ".bin",
        ".pth",
        ".pt",
        ".gguf",
        ".onnx",
        ".h5",
        ".msgpack",
        ".ckpt",
    ];
    EXT.iter().any(|e| f.ends_with(e))
}

/// Asks the hub for `spec`'s commit and files and downloads what the snapshot lacks.
fn download(spec: &HubSpec, opts: &HubOptions, cache: &Path, tuning: &Tuning) -> Result<PathBuf, HubError> {
    let client = http::Client::new(opts, spec, tuning)?;
    let info = client.model_info()?;
    let files: BTreeSet<String> = info.files.into_iter().collect();
    let gguf_model = plan_gguf(spec, &files, opts.quiet)?;
    let mut plan = match &gguf_model {
        Some(m) => m.files(),
        None => plan_files(spec, &files)?,
    };

    let repo_dir = cache.join(spec.folder_name());
    let snapshot = repo_dir.join("snapshots").join(&info.commit);
    create_dir(cache)?;
    let tag = cache.join("CACHEDIR.TAG");
    if !tag.exists() {
        let _ = std::fs::write(&tag, CACHEDIR_TAG);
    }
    create_dir(&repo_dir.join("blobs"))?;
    create_dir(&snapshot)?;

    let todo: Vec<&String> = plan.iter().filter(|f| !snapshot.join(f.as_str()).is_file()).collect();
    if !opts.quiet && !todo.is_empty() {
        eprintln!(
            "Downloading {spec} (commit {}) from {} into {}",
            &info.commit[..12],
            opts.endpoint(),
            repo_dir.display()
        );
    }

    let mut i = 0;
    while i < plan.len() {
        let file = plan[i].clone();
        client.fetch_file(&repo_dir, &info.commit, &file)?;
        if file == WEIGHTS_INDEX {
            let path = snapshot.join(WEIGHTS_INDEX);
            let bytes = std::fs::read(&path).map_err(HubError::io("cannot read", &path))?;
            let shards = shards_of_index(&bytes).map_err(|m| HubError::BadResponse {
                url: client.file_url(&info.commit, WEIGHTS_INDEX),
                message: format!("{WEIGHTS_INDEX}: {m}"),
            })?;
            for s in shards {
                if !files.contains(&s) {
                    return Err(HubError::MissingFile {
                        model: spec.to_string(),
                        file: format!("{s} (listed in {WEIGHTS_INDEX})"),
                    });
                }
                plan.push(s);
            }
        }
        i += 1;
    }

    let missing = match &gguf_model {
        Some(m) => gguf::missing_part(&snapshot, m).map(|f| format!("{f} is missing")),
        None => missing_in_snapshot(&snapshot),
    };
    if let Some(missing) = missing {
        return Err(HubError::BadResponse {
            url: client.file_url(&info.commit, ""),
            message: format!("after the download, {missing} in {}", snapshot.display()),
        });
    }
    if !spec.is_commit() {
        write_ref(&repo_dir, &spec.revision, &info.commit)?;
    }
    Ok(match gguf_model {
        Some(m) => snapshot.join(m.first),
        None => snapshot,
    })
}

fn create_dir(p: &Path) -> Result<(), HubError> {
    std::fs::create_dir_all(p).map_err(HubError::io("cannot create", p))
}

/// `refs/<revision>` = `commit`, written atomically (tmp file + rename) and only when it
/// changes, as `huggingface_hub` does.
fn write_ref(repo_dir: &Path, revision: &str, commit: &str) -> Result<(), HubError> {
    let path = repo_dir.join("refs").join(revision);
    if std::fs::read_to_string(&path).is_ok_and(|c| c == commit) {
        return Ok(());
    }
    let parent = path.parent().expect("refs path has a parent");
    create_dir(parent)?;
    let name = path.file_name().expect("ref has a name").to_string_lossy();
    let tmp = parent.join(format!("{name}.{:08x}.tmp", std::process::id()));
    std::fs::write(&tmp, commit).map_err(HubError::io("cannot write", &tmp))?;
    std::fs::rename(&tmp, &path).map_err(|e| {
        let _ = std::fs::remove_file(&tmp);
        HubError::io("cannot write", &path)(e)
    })
}
