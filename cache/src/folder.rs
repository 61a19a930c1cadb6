//! The names, locks and staging folders inside the cache folder: what each name there is, the
//! per-key lock files, and the guard that deletes a staging folder a build did not commit.

use std::fs::{self, File};
use std::io;
use std::path::{Path, PathBuf};

use crate::cache::{LOCK_SUFFIX, PROBE_PREFIX, STAGING_PREFIX, TRASH_PREFIX};
use crate::fsutil::remove_path;
use crate::key::{KEY_HEX_LEN, Key};

/// What a name in the cache folder is.
pub(crate) enum Item {
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

pub(crate) fn classify(name: &str) -> Item {
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
pub(crate) struct Stale {
    pub(crate) removed: usize,
    pub(crate) bytes: u64,
    pub(crate) in_progress: Vec<PathBuf>,
}

/// An exclusive hold on a key's lock file, released when dropped (closing the file releases
/// the lock, also when the process dies).
pub(crate) struct KeyLock {
    pub(crate) file: File,
    pub(crate) path: PathBuf,
}

impl KeyLock {
    /// Deletes the lock file while still holding it, then releases it; returns whether it was
    /// deleted. Waiters notice the deletion and retry on a new file (see
    /// [`Cache::lock_exclusive`]). Only done where that check is possible (Unix).
    pub(crate) fn unlink(self) -> bool {
        let deleted = cfg!(unix) && fs::remove_file(&self.path).is_ok();
        drop(self.file);
        deleted
    }
}

pub(crate) enum TryLock {
    Acquired(KeyLock),
    Held,
    Absent,
}

/// Whether `file` (which we hold locked) is still the file at `path`.
#[cfg(unix)]
pub(crate) fn lock_file_is_current(file: &File, path: &Path) -> io::Result<bool> {
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
pub(crate) fn lock_file_is_current(_file: &File, _path: &Path) -> io::Result<bool> {
    Ok(true)
}

/// A staging folder, deleted when dropped unless it was committed: covers builder errors,
/// builder panics (during unwinding) and cache errors alike. While it lives it is registered for
/// [`crate::remove_active_staging`] (a signal ending the process).
pub(crate) struct Staging {
    pub(crate) path: PathBuf,
    pub(crate) keep: bool,
}

impl Drop for Staging {
    fn drop(&mut self) {
        crate::active::unregister(&self.path);
        if !self.keep {
            let _ = remove_path(&self.path);
        }
    }
}
