//! The cache folder: lookups, builds, listing and removal.

use std::ffi::OsStr;
use std::fs::{self, File, OpenOptions, TryLockError};
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::error::CacheError;
use crate::fsutil::{
    disk_usage, is_plain_file_name, older_than, remove_path, sha256_of, sync_dir, unique_suffix, unix_now,
};
use crate::key::{KEY_HEX_LEN, Key};
use crate::verify::{self, LibraryKind};

/// Name of the metadata file in every entry folder.
pub const META_FILE: &str = "meta.json";

/// Prefix of the folders builds are written into before they are renamed into place.
/// The folder of built tokenizer tables (`kiln_text::tokenizer::TableCache`): files that save
/// a tokenizer's build, removed with everything else by [`Cache::clean_all`].
pub const TOKENIZER_TABLES: &str = "tokenizers";

/// The folder of marks the loaders leave for weight files whose page cache they re-read once
/// for huge pages (`kiln_formats::page_in`), removed with everything else by
/// [`Cache::clean_all`].
pub const PAGE_CACHE_MARKS: &str = "page-cache";

/// The folder of row-grouped weight copies the engine keeps between runs
/// (`kiln_engine::grouped_store`), removed with everything else by [`Cache::clean_all`].
pub const GROUPED_COPIES: &str = "grouped";

const STAGING_PREFIX: &str = ".staging-";
/// Prefix of folders being deleted: renaming first makes removal atomic for readers.
const TRASH_PREFIX: &str = ".trash-";
/// Prefix of the empty files that earlier versions of [`Cache::open`] created to test that the
/// folder is writable: still cleaned up when left behind.
const PROBE_PREFIX: &str = ".probe-";
/// Suffix of the per-key lock files.
const LOCK_SUFFIX: &str = ".lock";
/// Age after which [`Cache::get_or_build`] treats leftovers of other processes as abandoned.
/// A staging folder is only removed if, in addition, no process holds its key's lock.
const STALE_AGE: Duration = Duration::from_secs(60 * 60);

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
    fn new(dir: PathBuf, meta: Meta) -> Entry {
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

/// A cache folder holding one entry folder per key.
///
/// Layout: `<root>/<key>/` holds the library and `meta.json`; `<root>/<key>.lock` serializes
/// builds and removals of a key across threads and processes; `<root>/.staging-<key>-...`
/// folders receive builds in progress and `<root>/.trash-...` folders are entries being deleted.
/// An entry folder only ever appears by an atomic rename of a complete, synced staging folder,
/// and only disappears by an atomic rename to trash, so readers never see half an entry.
///
/// The cache stores opaque build outputs: it knows nothing about what the library contains.
#[derive(Clone, Debug)]
pub struct Cache {
    root: PathBuf,
}

impl Cache {
    /// The cache folder chosen by the environment: `$KILN_CACHE_DIR`, else
    /// `$XDG_CACHE_HOME/kiln`, else `$HOME/.cache/kiln`.
    ///
    /// Empty variables count as unset, and a relative `XDG_CACHE_HOME` is ignored as the XDG
    /// specification requires. Fails with [`CacheError::NoCacheDir`] if none applies.
    pub fn default_root() -> Result<PathBuf, CacheError> {
        root_from_env(
            std::env::var_os("KILN_CACHE_DIR").as_deref(),
            std::env::var_os("XDG_CACHE_HOME").as_deref(),
            std::env::var_os("HOME").as_deref(),
        )
    }

    /// Opens the cache folder `root`, creating it if missing.
    ///
    /// The folder need not be writable: hits are served from a read-only one (a read-only
    /// mount, another user's folder). Only a build needs to write, and it says so, naming the
    /// folder ([`CacheError::NotWritable`]).
    pub fn open(root: impl Into<PathBuf>) -> Result<Cache, CacheError> {
        let cache = Cache::at(root);
        cache.create_root()?;
        Ok(cache)
    }

    /// A handle on the cache folder `root` that touches nothing on disk.
    ///
    /// For read-only uses ([`lookup`](Cache::lookup), [`list`](Cache::list)) that must work, and
    /// create nothing, when the folder does not exist yet. Writing operations still work: they
    /// create the folder when needed.
    pub fn at(root: impl Into<PathBuf>) -> Cache {
        Cache { root: root.into() }
    }

    /// The cache folder.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Where the entry for `key` lives (whether or not it exists).
    pub fn entry_dir(&self, key: &Key) -> PathBuf {
        self.root.join(key.to_string())
    }

    /// Reports whether a valid entry exists for `key`, verifying the library's size and SHA-256.
    ///
    /// Creates, locks and repairs nothing, so it is safe for informational commands. Without the
    /// lock, a rebuild running at the same moment can make it report `Missing` or `Corrupt`
    /// transiently; it never reports a damaged entry as a hit.
    pub fn lookup(&self, key: &Key) -> Result<Lookup, CacheError> {
        Ok(match self.check(key)? {
            Check::Valid(meta) => Lookup::Hit(Box::new(Entry::new(self.entry_dir(key), meta))),
            Check::Missing => Lookup::Missing,
            Check::Corrupt { reason, .. } => Lookup::Corrupt(reason),
        })
    }

    /// Returns the valid entry for `key`, calling `build` to make it if there is none.
    ///
    /// A hit writes nothing: no folder, lock or staging folder is created, so a read-only cache
    /// serves the entries it holds. This is safe without the lock because entries only appear
    /// and disappear by atomic renames, and the library is verified as it is read.
    ///
    /// Otherwise it takes `<root>/<key>.lock` exclusively, so when several threads or processes
    /// ask for the same key at once, one builds and the others wait and then find a hit. On a
    /// miss, `build` receives an empty staging folder, writes the library there and returns its
    /// file name; the cache then syncs, checks and hashes it (see [`LibraryKind`]), writes
    /// meta.json, syncs everything and renames the folder to `<root>/<key>`. A damaged entry is
    /// moved away and rebuilt ([`Status::Rebuilt`]). A folder that cannot be written to gives
    /// [`CacheError::NotWritable`] before the builder runs.
    ///
    /// If `build` fails or panics, or its library fails the checks, the staging folder is
    /// deleted and the error (or panic) propagates; no entry appears. Errors of the cache itself
    /// are converted with `E: From<CacheError>`, so with `anyhow` the call is simply
    /// `cache.get_or_build(&key, |dir| -> anyhow::Result<BuildOutput> { ... })?`.
    ///
    /// Before a build, leftover staging and trash folders older than an hour are removed, when
    /// no process holds their key's lock.
    pub fn get_or_build<E, F>(&self, key: &Key, build: F) -> Result<Outcome, E>
    where
        F: FnOnce(&Path) -> Result<BuildOutput, E>,
        E: From<CacheError>,
    {
        let dir = self.entry_dir(key);
        if let Check::Valid(meta) = self.check(key)? {
            return Ok(Outcome {
                entry: Entry::new(dir, meta),
                status: Status::Hit,
            });
        }

        self.create_root()?;
        // Best effort: a failure to tidy up must not stop a build.
        let _ = self.remove_stale(Some(STALE_AGE));
        let lock = self.lock_exclusive(key).map_err(|err| self.not_writable(key, err))?;
        // Checked again: another process may have built the entry while this one waited.
        let status = match self.check(key)? {
            Check::Valid(meta) => {
                return Ok(Outcome {
                    entry: Entry::new(dir, meta),
                    status: Status::Hit,
                });
            }
            Check::Missing => Status::Built,
            Check::Corrupt { reason, .. } => {
                let trash = self.move_to_trash(key, &dir)?;
                // Once renamed, the damaged entry is invisible; deleting it is housekeeping.
                let _ = remove_path(&trash);
                Status::Rebuilt { reason }
            }
        };

        let staging = self.create_staging(key).map_err(|err| self.not_writable(key, err))?;
        let started = Instant::now();
        let output = build(&staging.path)?;
        let build_seconds = started.elapsed().as_secs_f64();
        let entry = self.commit(key, staging, output, build_seconds)?;
        drop(lock);
        Ok(Outcome { entry, status })
    }

    /// Every entry folder with its size and state, sorted by key, for `kiln cache list`.
    ///
    /// Verifies each library (reading it once). Builds in progress and leftovers are not
    /// entries and are not listed. A missing cache folder gives an empty list.
    pub fn list(&self) -> Result<Vec<EntryInfo>, CacheError> {
        let mut infos = Vec::new();
        for key in self.entry_keys()? {
            let dir = self.entry_dir(&key);
            let (meta, problem) = match self.check(&key) {
                Ok(Check::Valid(meta)) => (Some(meta), None),
                // Removed since the folder was read.
                Ok(Check::Missing) => continue,
                Ok(Check::Corrupt { reason, meta }) => (meta, Some(reason)),
                Err(err) => (None, Some(err.to_string())),
            };
            infos.push(EntryInfo {
                key,
                bytes_on_disk: disk_usage(&dir),
                dir,
                meta,
                problem,
            });
        }
        Ok(infos)
    }

    /// Removes the entry whose key is `key_or_prefix` or starts with it (case-insensitive).
    ///
    /// Fails without removing anything if the prefix matches no entry or several, since removing
    /// one of several would be a guess. Takes the key's lock first, so it waits for a build of
    /// the same key to finish rather than pulling the folder from under it.
    pub fn remove(&self, key_or_prefix: &str) -> Result<Removed, CacheError> {
        let prefix = key_or_prefix.to_ascii_lowercase();
        if prefix.is_empty() || prefix.len() > KEY_HEX_LEN || !prefix.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(CacheError::InvalidPrefix {
                input: key_or_prefix.to_owned(),
            });
        }
        let mut matches: Vec<Key> = self
            .entry_keys()?
            .into_iter()
            .filter(|key| key.to_string().starts_with(&prefix))
            .collect();
        let no_match = || CacheError::NoMatch {
            prefix: prefix.clone(),
            root: self.root.clone(),
        };
        let key = match matches.len() {
            0 => return Err(no_match()),
            1 => matches.remove(0),
            _ => {
                return Err(CacheError::Ambiguous {
                    prefix,
                    root: self.root.clone(),
                    matches,
                });
            }
        };

        let lock = self.lock_exclusive(&key)?;
        let dir = self.entry_dir(&key);
        match fs::symlink_metadata(&dir) {
            Err(err) if err.kind() == io::ErrorKind::NotFound => return Err(no_match()),
            Err(err) => return Err(CacheError::io("cannot inspect cache entry", &dir)(err)),
            Ok(_) => {}
        }
        let bytes_on_disk = disk_usage(&dir);
        let trash = self.move_to_trash(&key, &dir)?;
        lock.unlink();
        remove_path(&trash).map_err(CacheError::io("cannot delete", &trash))?;
        Ok(Removed { key, bytes_on_disk })
    }

    /// Empties the cache: every entry, the tokenizer tables, leftovers of interrupted processes,
    /// and the lock files no process holds.
    ///
    /// Entries are removed under their lock (waiting for a build of the same key to finish);
    /// staging folders of builds in progress are left alone and reported in
    /// [`CleanReport::in_progress`]. Files whose names the cache does not use are left alone.
    pub fn clean_all(&self) -> Result<CleanReport, CacheError> {
        let mut report = CleanReport::default();
        for key in self.entry_keys()? {
            let lock = self.lock_exclusive(&key)?;
            let dir = self.entry_dir(&key);
            if fs::symlink_metadata(&dir).is_ok() {
                let bytes = disk_usage(&dir);
                let trash = self.move_to_trash(&key, &dir)?;
                remove_path(&trash).map_err(CacheError::io("cannot delete", &trash))?;
                report.entries_removed.push(key);
                report.bytes_freed += bytes;
            }
            if lock.unlink() {
                report.locks_removed += 1;
            }
        }

        for folder in [TOKENIZER_TABLES, PAGE_CACHE_MARKS, GROUPED_COPIES] {
            let tables = self.root.join(folder);
            if fs::symlink_metadata(&tables).is_ok() {
                report.bytes_freed += disk_usage(&tables);
                remove_path(&tables).map_err(CacheError::io("cannot delete", &tables))?;
            }
        }

        let stale = self.remove_stale(None)?;
        report.stale_removed = stale.removed;
        report.bytes_freed += stale.bytes;
        report.in_progress = stale.in_progress;

        for (name, _) in self.read_root()? {
            if let Item::Lock(key) = classify(&name)
                && let TryLock::Acquired(lock) = self.try_lock_existing(&key)?
                && lock.unlink()
            {
                report.locks_removed += 1;
            }
        }
        Ok(report)
    }

    // ----- internals -----

    /// Creates the cache folder if needed (a single `stat` when it exists).
    fn create_root(&self) -> Result<(), CacheError> {
        match fs::create_dir_all(&self.root) {
            Ok(()) => Ok(()),
            Err(_) if fs::metadata(&self.root).is_ok_and(|meta| !meta.is_dir()) => Err(CacheError::RootNotAFolder {
                path: self.root.clone(),
            }),
            Err(err) => Err(CacheError::CreateRoot {
                path: self.root.clone(),
                err,
            }),
        }
    }

    /// Turns a refusal to write into the cache folder into [`CacheError::NotWritable`], which
    /// says that building `key` is what needs the write; other errors pass unchanged.
    fn not_writable(&self, key: &Key, err: CacheError) -> CacheError {
        match err {
            CacheError::Io { err, .. }
                if matches!(
                    err.kind(),
                    io::ErrorKind::PermissionDenied | io::ErrorKind::ReadOnlyFilesystem
                ) =>
            {
                CacheError::NotWritable {
                    path: self.root.clone(),
                    key: *key,
                    err,
                }
            }
            other => other,
        }
    }

    fn lock_path(&self, key: &Key) -> PathBuf {
        self.root.join(format!("{key}{LOCK_SUFFIX}"))
    }

    /// Names and paths of everything in the cache folder; empty if it does not exist.
    fn read_root(&self) -> Result<Vec<(String, PathBuf)>, CacheError> {
        let children = match fs::read_dir(&self.root) {
            Ok(children) => children,
            Err(err) if err.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(err) => return Err(CacheError::io("cannot read cache folder", &self.root)(err)),
        };
        let mut items = Vec::new();
        for child in children {
            let child = child.map_err(CacheError::io("cannot read cache folder", &self.root))?;
            // Names that are not UTF-8 are not ours.
            if let Some(name) = child.file_name().to_str() {
                items.push((name.to_owned(), child.path()));
            }
        }
        Ok(items)
    }

    /// Keys of the entry folders (anything named like a key), sorted.
    fn entry_keys(&self) -> Result<Vec<Key>, CacheError> {
        let mut keys: Vec<Key> = self
            .read_root()?
            .into_iter()
            .filter_map(|(name, _)| match classify(&name) {
                Item::Entry(key) => Some(key),
                _ => None,
            })
            .collect();
        keys.sort();
        Ok(keys)
    }

    /// Takes the key's lock, waiting as long as another thread or process holds it.
    pub(crate) fn lock_exclusive(&self, key: &Key) -> Result<KeyLock, CacheError> {
        let path = self.lock_path(key);
        loop {
            let file = OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(false)
                .open(&path)
                .map_err(CacheError::io("cannot open lock file", &path))?;
            file.lock().map_err(CacheError::io("cannot lock", &path))?;
            // The holder we waited for may have deleted the lock file; a lock on a deleted file
            // excludes nobody, so start again with the file now at the path.
            let current =
                lock_file_is_current(&file, &path).map_err(CacheError::io("cannot inspect lock file", &path))?;
            if current {
                return Ok(KeyLock { file, path });
            }
        }
    }

    /// Takes the key's lock if nobody holds it, without creating the lock file.
    fn try_lock_existing(&self, key: &Key) -> Result<TryLock, CacheError> {
        let path = self.lock_path(key);
        let file = match OpenOptions::new().read(true).write(true).open(&path) {
            Ok(file) => file,
            Err(err) if err.kind() == io::ErrorKind::NotFound => return Ok(TryLock::Absent),
            Err(err) => return Err(CacheError::io("cannot open lock file", &path)(err)),
        };
        match file.try_lock() {
            Ok(()) => {}
            Err(TryLockError::WouldBlock) => return Ok(TryLock::Held),
            Err(TryLockError::Error(err)) => return Err(CacheError::io("cannot lock", &path)(err)),
        }
        let current = lock_file_is_current(&file, &path).map_err(CacheError::io("cannot inspect lock file", &path))?;
        // If the file was replaced, someone else got there first: treat the key as busy.
        Ok(if current {
            TryLock::Acquired(KeyLock { file, path })
        } else {
            TryLock::Held
        })
    }

    /// Verifies the entry for `key`: meta.json parses and names this key, and the library has
    /// the recorded size and SHA-256. Reads the library exactly once.
    ///
    /// Damage is a [`Check::Corrupt`] with a reason naming the file; only failures that a
    /// rebuild could not fix either (permission denied, an unreadable folder) are errors.
    fn check(&self, key: &Key) -> Result<Check, CacheError> {
        let dir = self.entry_dir(key);
        match fs::symlink_metadata(&dir) {
            Err(err) if err.kind() == io::ErrorKind::NotFound => return Ok(Check::Missing),
            Err(err) => return Err(CacheError::io("cannot inspect cache entry", &dir)(err)),
            Ok(meta) if !meta.is_dir() => {
                return Ok(Check::corrupt(format!("{} is not a folder", dir.display()), None));
            }
            Ok(_) => {}
        }

        let meta_path = dir.join(META_FILE);
        let text = match fs::read(&meta_path) {
            Ok(text) => text,
            Err(err) if err.kind() == io::ErrorKind::NotFound => {
                return Ok(Check::corrupt(format!("{} is missing", meta_path.display()), None));
            }
            Err(err) if err.kind() == io::ErrorKind::PermissionDenied => {
                return Err(CacheError::io("cannot read", &meta_path)(err));
            }
            Err(err) => {
                let reason = format!("{} cannot be read: {err}", meta_path.display());
                return Ok(Check::corrupt(reason, None));
            }
        };
        let meta: Meta = match serde_json::from_slice(&text) {
            Ok(meta) => meta,
            Err(err) => {
                let reason = format!("{} cannot be parsed: {err}", meta_path.display());
                return Ok(Check::corrupt(reason, None));
            }
        };
        if meta.key != *key {
            let reason = format!("{} is for key {}, expected {key}", meta_path.display(), meta.key);
            return Ok(Check::corrupt(reason, Some(meta)));
        }
        if !is_plain_file_name(&meta.library) || meta.library == META_FILE {
            let reason = format!(
                "{} names library {:?}, which is not a plain file name",
                meta_path.display(),
                meta.library
            );
            return Ok(Check::corrupt(reason, Some(meta)));
        }

        let library = dir.join(&meta.library);
        let mut file = match File::open(&library) {
            Ok(file) => file,
            Err(err) if err.kind() == io::ErrorKind::NotFound => {
                let reason = format!("library {} is missing", library.display());
                return Ok(Check::corrupt(reason, Some(meta)));
            }
            Err(err) if err.kind() == io::ErrorKind::PermissionDenied => {
                return Err(CacheError::io("cannot read", &library)(err));
            }
            Err(err) => {
                let reason = format!("library {} cannot be read: {err}", library.display());
                return Ok(Check::corrupt(reason, Some(meta)));
            }
        };
        let file_meta = match file.metadata() {
            Ok(file_meta) => file_meta,
            Err(err) => {
                let reason = format!("library {} cannot be inspected: {err}", library.display());
                return Ok(Check::corrupt(reason, Some(meta)));
            }
        };
        if !file_meta.is_file() {
            let reason = format!("library {} is not a regular file", library.display());
            return Ok(Check::corrupt(reason, Some(meta)));
        }
        if file_meta.len() != meta.library_bytes {
            let reason = format!(
                "library {} has {} bytes, {} records {} (truncated or overwritten)",
                library.display(),
                file_meta.len(),
                META_FILE,
                meta.library_bytes
            );
            return Ok(Check::corrupt(reason, Some(meta)));
        }
        let (sha256, bytes) = match sha256_of(&mut file) {
            Ok(hashed) => hashed,
            Err(err) => {
                let reason = format!("library {} cannot be read: {err}", library.display());
                return Ok(Check::corrupt(reason, Some(meta)));
            }
        };
        if bytes != meta.library_bytes {
            let reason = format!("library {} changed size while being read", library.display());
            return Ok(Check::corrupt(reason, Some(meta)));
        }
        if sha256 != meta.library_sha256 {
            let reason = format!(
                "library {} has SHA-256 {sha256}, {} records {} (overwritten or damaged)",
                library.display(),
                META_FILE,
                meta.library_sha256
            );
            return Ok(Check::corrupt(reason, Some(meta)));
        }
        Ok(Check::Valid(meta))
    }

    /// Renames an entry folder (or whatever is at its path) to a fresh trash name, which makes it
    /// disappear atomically; returns the trash path to delete.
    fn move_to_trash(&self, key: &Key, dir: &Path) -> Result<PathBuf, CacheError> {
        let trash = self.root.join(format!("{TRASH_PREFIX}{key}-{}", unique_suffix()));
        fs::rename(dir, &trash).map_err(CacheError::io("cannot move aside cache entry", dir))?;
        Ok(trash)
    }

    /// Creates an empty staging folder for a build of `key`, deleted again unless committed.
    fn create_staging(&self, key: &Key) -> Result<Staging, CacheError> {
        let path = self.root.join(format!("{STAGING_PREFIX}{key}-{}", unique_suffix()));
        crate::active::create_registered(&path).map_err(CacheError::io("cannot create staging folder", &path))?;
        Ok(Staging { path, keep: false })
    }

    /// Turns a finished staging folder into the entry for `key`: syncs, checks and hashes the
    /// library ([`verify::built_library`]), writes meta.json, syncs files and folders, then
    /// renames it into place.
    fn commit(
        &self,
        key: &Key,
        mut staging: Staging,
        output: BuildOutput,
        build_seconds: f64,
    ) -> Result<Entry, CacheError> {
        if !is_plain_file_name(&output.library) || output.library == META_FILE {
            return Err(CacheError::BadLibraryName {
                key: *key,
                name: output.library,
            });
        }
        let library = staging.path.join(&output.library);
        let (library_sha256, library_bytes) = verify::built_library(&library, output.kind)?;

        let meta = Meta {
            key: *key,
            library: output.library,
            library_sha256,
            library_bytes,
            created_unix: unix_now(),
            build_seconds,
            kiln_version: env!("CARGO_PKG_VERSION").to_owned(),
            info: output.info,
        };
        let meta_path = staging.path.join(META_FILE);
        let mut text = serde_json::to_vec_pretty(&meta).map_err(|err| CacheError::EncodeMeta {
            path: meta_path.clone(),
            err,
        })?;
        text.push(b'\n');
        let mut meta_file = File::create(&meta_path).map_err(CacheError::io("cannot create", &meta_path))?;
        meta_file
            .write_all(&text)
            .map_err(CacheError::io("cannot write", &meta_path))?;
        meta_file
            .sync_all()
            .map_err(CacheError::io("cannot sync", &meta_path))?;
        drop(meta_file);
        sync_dir(&staging.path).map_err(CacheError::io("cannot sync folder", &staging.path))?;

        let dir = self.entry_dir(key);
        fs::rename(&staging.path, &dir)
            .map_err(CacheError::io("cannot move the finished build into place at", &dir))?;
        staging.keep = true;
        sync_dir(&self.root).map_err(CacheError::io("cannot sync folder", &self.root))?;
        Ok(Entry::new(dir, meta))
    }

    /// Removes staging, trash and probe leftovers, those older than `min_age` if given. Staging
    /// folders are only removed when no process holds their key's lock, since a build may be
    /// writing into one.
    fn remove_stale(&self, min_age: Option<Duration>) -> Result<Stale, CacheError> {
        let mut stale = Stale::default();
        for (name, path) in self.read_root()? {
            let item = classify(&name);
            if matches!(item, Item::Entry(_) | Item::Lock(_) | Item::Other) {
                continue;
            }
            if min_age.is_some_and(|age| !older_than(&path, age)) {
                continue;
            }
            // Holding the key's lock while deleting is not needed: a new build of the key
            // writes into a staging folder with a new name.
            if let Item::Staging(Some(key)) = item
                && let TryLock::Held = self.try_lock_existing(&key)?
            {
                stale.in_progress.push(path);
                continue;
            }
            let bytes = disk_usage(&path);
            remove_path(&path).map_err(CacheError::io("cannot delete", &path))?;
            stale.removed += 1;
            stale.bytes += bytes;
        }
        Ok(stale)
    }
}

/// Resolves the cache folder from the values of `KILN_CACHE_DIR`, `XDG_CACHE_HOME` and `HOME`;
/// separate from the environment so it can be tested without mutating it.
pub(crate) fn root_from_env(
    kiln_cache_dir: Option<&OsStr>,
    xdg_cache_home: Option<&OsStr>,
    home: Option<&OsStr>,
) -> Result<PathBuf, CacheError> {
    let set = |value: Option<&OsStr>| value.filter(|value| !value.is_empty()).map(PathBuf::from);
    if let Some(dir) = set(kiln_cache_dir) {
        return Ok(dir);
    }
    if let Some(xdg) = set(xdg_cache_home).filter(|path| path.is_absolute()) {
        return Ok(xdg.join("kiln"));
    }
    if let Some(home) = set(home) {
        return Ok(home.join(".cache").join("kiln"));
    }
    Err(CacheError::NoCacheDir)
}

/// Outcome of verifying an entry folder.
enum Check {
    Valid(Meta),
    Missing,
    Corrupt { reason: String, meta: Option<Meta> },
}

impl Check {
    fn corrupt(reason: String, meta: Option<Meta>) -> Check {
        Check::Corrupt { reason, meta }
    }
}

/// What a name in the cache folder is.
enum Item {
    /// `<key>`: an entry folder.
    Entry(Key),
    /// `<key>.lock`.
    Lock(Key),
    /// `.staging-<key>-...`; the key is `None` if the name is mangled.
    Staging(Option<Key>),
    /// `.trash-...` or `.probe-...`.
    Leftover,
    /// Not a name the cache uses.
    Other,
}

fn classify(name: &str) -> Item {
    if let Some(key) = Key::from_folder_name(name) {
        return Item::Entry(key);
    }
    if let Some(key) = name.strip_suffix(LOCK_SUFFIX).and_then(Key::from_folder_name) {
        return Item::Lock(key);
    }
    if let Some(rest) = name.strip_prefix(STAGING_PREFIX) {
        let key = rest
            .get(..KEY_HEX_LEN)
            .filter(|_| rest.as_bytes().get(KEY_HEX_LEN) == Some(&b'-'))
            .and_then(Key::from_folder_name);
        return Item::Staging(key);
    }
    if name.starts_with(TRASH_PREFIX) || name.starts_with(PROBE_PREFIX) {
        return Item::Leftover;
    }
    Item::Other
}

/// Leftovers found by [`Cache::remove_stale`].
#[derive(Default)]
struct Stale {
    removed: usize,
    bytes: u64,
    in_progress: Vec<PathBuf>,
}

/// An exclusive hold on a key's lock file, released when dropped (closing the file releases
/// the lock, also when the process dies).
pub(crate) struct KeyLock {
    file: File,
    path: PathBuf,
}

impl KeyLock {
    /// Deletes the lock file while still holding it, then releases it; returns whether it was
    /// deleted. Waiters notice the deletion and retry on a new file (see
    /// [`Cache::lock_exclusive`]). Only done where that check is possible (Unix).
    fn unlink(self) -> bool {
        let deleted = cfg!(unix) && fs::remove_file(&self.path).is_ok();
        drop(self.file);
        deleted
    }
}

enum TryLock {
    Acquired(KeyLock),
    Held,
    Absent,
}

/// Whether `file` (which we hold locked) is still the file at `path`.
#[cfg(unix)]
fn lock_file_is_current(file: &File, path: &Path) -> io::Result<bool> {
    use std::os::unix::fs::MetadataExt;
    let held = file.metadata()?;
    match fs::metadata(path) {
        Ok(now) => Ok(now.dev() == held.dev() && now.ino() == held.ino()),
        Err(err) if err.kind() == io::ErrorKind::NotFound => Ok(false),
        Err(err) => Err(err),
    }
}

/// Lock files are never deleted where this cannot be checked, so the held file is current.
#[cfg(not(unix))]
fn lock_file_is_current(_file: &File, _path: &Path) -> io::Result<bool> {
    Ok(true)
}

/// A staging folder, deleted when dropped unless it was committed: covers builder errors,
/// builder panics (during unwinding) and cache errors alike. While it lives it is registered for
/// [`crate::remove_active_staging`] (a signal ending the process).
struct Staging {
    path: PathBuf,
    keep: bool,
}

impl Drop for Staging {
    fn drop(&mut self) {
        crate::active::unregister(&self.path);
        if !self.keep {
            let _ = remove_path(&self.path);
        }
    }
}
