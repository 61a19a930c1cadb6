//! What the cache stores beside each library and what its operations report: the entry's
//! metadata (`meta.json`), a build's output, lookups, listings and removals.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::key::Key;
use crate::verify::LibraryKind;

/// What is recorded next to each library, as pretty JSON in `meta.json`.
///
/// The size and SHA-256 let every use detect a truncated or overwritten library before it is
/// loaded; the rest is for people (`kiln cache list`) and for callers (`info`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Meta {
    /// The entry's key, repeated so that a folder copied or renamed by hand is not trusted.
    pub key: Key,
    /// File name of the library inside the entry folder.
    pub library: String,
    /// SHA-256 of the library, lowercase hex.
    pub library_sha256: String,
    /// Size of the library in bytes: checked before hashing, so truncation is cheap to detect.
    pub library_bytes: u64,
    /// When the entry was built, in seconds since the Unix epoch.
    pub created_unix: u64,
    /// How long the builder ran, in seconds: tells users what a cache miss costs.
    pub build_seconds: f64,
    /// Version of Kiln that wrote the entry (the workspace shares one version).
    pub kiln_version: String,
    /// Whatever the builder chose to record (model, spec, CPU, kernels, LLVM version, ...). The
    /// cache never interprets it.
    #[serde(default)]
    pub info: Value,
}

/// A valid cache entry: a library whose size and SHA-256 matched its meta.json when checked.
#[derive(Clone, Debug, PartialEq)]
pub struct Entry {
    /// The entry's key.
    pub key: Key,
    /// The entry folder, `<root>/<key>`.
    pub dir: PathBuf,
    /// The library to load, `<root>/<key>/<meta.library>`.
    pub library_path: PathBuf,
    /// The entry's meta.json.
    pub meta: Meta,
}

impl Entry {
    pub(crate) fn new(dir: PathBuf, meta: Meta) -> Entry {
        Entry {
            key: meta.key,
            library_path: dir.join(&meta.library),
            dir,
            meta,
        }
    }
}

/// What a builder reports after writing its library into the staging folder.
#[derive(Debug)]
pub struct BuildOutput {
    /// File name of the library the builder wrote in the staging folder (e.g. `libkiln.so`). The
    /// cache hashes it; other files the builder leaves there are kept in the entry unchecked.
    pub library: String,
    /// Stored as [`Meta::info`].
    pub info: Value,
    /// How the library is checked before it is published.
    pub kind: LibraryKind,
}

impl BuildOutput {
    /// A library of any format, recorded by size and SHA-256 without further checks.
    pub fn new(library: impl Into<String>, info: Value) -> BuildOutput {
        BuildOutput {
            library: library.into(),
            info,
            kind: LibraryKind::Opaque,
        }
    }

    /// An ELF shared object: published only if it is structurally complete and `load_check`
    /// (typically `dlopen` and an ABI-version check) accepts it; see [`LibraryKind`].
    pub fn shared_object(
        library: impl Into<String>,
        info: Value,
        load_check: impl FnOnce(&Path) -> Result<(), String> + 'static,
    ) -> BuildOutput {
        BuildOutput {
            library: library.into(),
            info,
            kind: LibraryKind::SharedObject {
                load_check: Box::new(load_check),
            },
        }
    }
}

/// How [`Cache::get_or_build`] obtained its entry.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Status {
    /// A valid entry was already there; the builder was not called.
    Hit,
    /// There was no entry; the builder made one.
    Built,
    /// There was an entry but it was damaged, so it was deleted and built again. The caller
    /// should tell the user, since it may point at a disk or a process that writes where it
    /// should not.
    Rebuilt {
        /// What was wrong, naming the file (e.g. "library /c/k/libkiln.so has 10 bytes, ...").
        reason: String,
    },
}

/// The result of [`Cache::get_or_build`]: a valid entry and how it was obtained.
#[derive(Clone, Debug, PartialEq)]
pub struct Outcome {
    /// The valid entry.
    pub entry: Entry,
    /// Whether it was found, built or rebuilt.
    pub status: Status,
}

/// The result of [`Cache::lookup`].
#[derive(Clone, Debug, PartialEq)]
pub enum Lookup {
    /// A valid entry.
    Hit(Box<Entry>),
    /// No entry for this key.
    Missing,
    /// An entry exists but is damaged; the reason names the file. The next
    /// [`Cache::get_or_build`] for this key rebuilds it.
    Corrupt(String),
}

/// One entry as reported by [`Cache::list`], valid or not.
#[derive(Clone, Debug, PartialEq)]
pub struct EntryInfo {
    /// The entry's key (its folder name).
    pub key: Key,
    /// The entry folder.
    pub dir: PathBuf,
    /// Bytes used by all files in the entry folder.
    pub bytes_on_disk: u64,
    /// The parsed meta.json, when it could be read (even if the library is damaged).
    pub meta: Option<Meta>,
    /// What is wrong with the entry, or `None` if it is valid.
    pub problem: Option<String>,
}

impl EntryInfo {
    /// Whether the library matches its meta.json.
    pub fn is_valid(&self) -> bool {
        self.problem.is_none()
    }

    /// When the entry was built (seconds since the Unix epoch), if meta.json could be read.
    pub fn created_unix(&self) -> Option<u64> {
        self.meta.as_ref().map(|meta| meta.created_unix)
    }

    /// The builder's [`Meta::info`], if meta.json could be read.
    pub fn info(&self) -> Option<&Value> {
        self.meta.as_ref().map(|meta| &meta.info)
    }
}

/// What [`Cache::remove`] removed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Removed {
    /// The full key of the removed entry.
    pub key: Key,
    /// Bytes the entry used.
    pub bytes_on_disk: u64,
}

/// What [`Cache::clean_all`] removed.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CleanReport {
    /// Keys of the entries removed, valid or not.
    pub entries_removed: Vec<Key>,
    /// Staging, trash and probe folders or files left behind by interrupted processes.
    pub stale_removed: usize,
    /// Lock files removed (only those no process held).
    pub locks_removed: usize,
    /// Bytes used by everything removed.
    pub bytes_freed: u64,
    /// Staging folders left alone because a process is building into them right now.
    pub in_progress: Vec<PathBuf>,
}
