//! The staging folders of this process's builds in progress, so that a process ended by a signal
//! (Ctrl-C during a compile) can delete them on its way out instead of leaving them to the
//! stale-folder cleanup of a later build.
//!
//! A staging folder is registered as it is created and unregistered when its `Staging`
//! guard is dropped (committed or not); [`remove_active_staging`] deletes whatever is
//! registered. It is meant for the last moments of a process: a build whose folder it deleted
//! fails (its files are gone), and a build that commits at that very moment may publish an
//! entry missing files, which every lookup's verification then rebuilds.

use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use crate::fsutil::remove_path;

/// Every staging folder of a build in progress in this process.
static ACTIVE: Registry = Registry::new();

/// Attempts at deleting a folder that a compile may still be writing into (a file created
/// during the deletion makes it fail with "directory not empty").
const REMOVE_ATTEMPTS: usize = 20;

/// A list of folders to delete on the way out.
struct Registry(Mutex<Vec<PathBuf>>);

impl Registry {
    const fn new() -> Registry {
        Registry(Mutex::new(Vec::new()))
    }

    fn list(&self) -> MutexGuard<'_, Vec<PathBuf>> {
        // A panic while the list was held leaves it consistent (pushes and removals are single
        // operations), so a poisoned lock is still usable.
        self.0.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Creates the folder `path` and registers it under one hold of the list, so that
    /// [`Registry::remove_all`] sees either neither or both: a folder created just before a
    /// signal but registered after it would be left behind.
    fn create(&self, path: &Path) -> std::io::Result<()> {
        let mut list = self.list();
        std::fs::create_dir(path)?;
        list.push(path.to_path_buf());
        Ok(())
    }

    fn unregister(&self, path: &Path) {
        self.list().retain(|p| p != path);
    }

    /// Deletes every registered folder (and forgets it); returns how many were deleted.
    fn remove_all(&self) -> usize {
        let paths = std::mem::take(&mut *self.list());
        paths.iter().filter(|path| remove_with_retries(path)).count()
    }
}

fn remove_with_retries(path: &Path) -> bool {
    for attempt in 1..=REMOVE_ATTEMPTS {
        if remove_path(path).is_ok() {
            return true;
        }
        if attempt < REMOVE_ATTEMPTS {
            std::thread::sleep(Duration::from_millis(5));
        }
    }
    false
}

/// Creates the staging folder `path` and registers it, atomically with respect to
/// [`remove_active_staging`].
pub(crate) fn create_registered(path: &Path) -> std::io::Result<()> {
    ACTIVE.create(path)
}

pub(crate) fn unregister(path: &Path) {
    ACTIVE.unregister(path);
}

/// Deletes the staging folders of every build in progress in this process and returns how many
/// it deleted. For a signal handler about to end the process (it can be called from any
/// thread); the builds themselves fail afterwards.
pub fn remove_active_staging() -> usize {
    ACTIVE.remove_all()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn registered_folders_are_removed_and_unregistered_ones_kept() {
        // Proves that only folders still registered are deleted, and each only once.
        let root = tempfile::tempdir().unwrap();
        let (building, done) = (root.path().join(".staging-a"), root.path().join(".staging-b"));
        // A registry of its own: the global one holds the folders of concurrent tests' builds.
        let registry = Registry::new();
        for dir in [&building, &done] {
            registry.create(dir).unwrap();
            std::fs::write(dir.join("k.o"), b"x").unwrap();
        }
        registry.unregister(&done);
        assert_eq!(registry.remove_all(), 1);
        assert!(!building.exists());
        assert!(done.exists());
        assert_eq!(registry.remove_all(), 0, "the list is emptied");
    }
}
