//! The cache folder: lookups, builds, listing and removal.

use std::ffi::OsStr;
use std::fs::{self, File, OpenOptions, TryLockError};
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::check::{Check, check};
use crate::entry::{BuildOutput, CleanReport, Entry, EntryInfo, Lookup, Meta, Outcome, Removed, Status};
use crate::error::CacheError;
use crate::folder::{Item, KeyLock, Staging, Stale, TryLock, classify, lock_file_is_current};
use crate::fsutil::{disk_usage, is_plain_file_name, older_than, remove_path, sync_dir, unique_suffix, unix_now};
use crate::key::{KEY_HEX_LEN, Key};
use crate::verify;

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

pub(crate) const STAGING_PREFIX: &str = ".staging-";
/// Prefix of folders being deleted: renaming first makes removal atomic for readers.
pub(crate) const TRASH_PREFIX: &str = ".trash-";
/// Prefix of the empty files that earlier versions of [`Cache::open`] created to test that the
/// folder is writable: still cleaned up when left behind.
pub(crate) const PROBE_PREFIX: &str = ".probe-";
/// Suffix of the per-key lock files.
pub(crate) const LOCK_SUFFIX: &str = ".lock";
/// Age after which [`Cache::get_or_build`] treats leftovers of other processes as abandoned.
/// A staging folder is only removed if, in addition, no process holds its key's lock.
const STALE_AGE: Duration = Duration::from_secs(60 * 60);

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
        Ok(match check(self.entry_dir(key), key)? {
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
        if let Check::Valid(meta) = check(self.entry_dir(key), key)? {
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
        let status = match check(self.entry_dir(key), key)? {
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
            let (meta, problem) = match check(self.entry_dir(&key), &key) {
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
