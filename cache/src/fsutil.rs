//! Small file-system helpers: hashing, durability, removal and naming.

use std::fs::{self, File};
use std::io::{self, Read};
use std::path::{Component, Path};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use sha2::{Digest, Sha256};

use crate::key::to_hex;

/// Size of the read buffer used for hashing: large enough that a library of a few MB takes a
/// handful of reads, small enough to sit in L2.
const HASH_CHUNK: usize = 256 * 1024;

/// Reads `file` to its end once and returns its SHA-256 (lowercase hex) and its length in bytes.
pub(crate) fn sha256_of(file: &mut File) -> io::Result<(String, u64)> {
    let mut hasher = Sha256::new();
    let mut buffer = vec![0u8; HASH_CHUNK];
    let mut total = 0u64;
    loop {
        let read = match file.read(&mut buffer) {
            Ok(0) => break,
            Ok(read) => read,
            Err(err) if err.kind() == io::ErrorKind::Interrupted => continue,
            Err(err) => return Err(err),
        };
        hasher.update(&buffer[..read]);
        total += read as u64;
    }
    Ok((to_hex(&hasher.finalize()), total))
}

/// Flushes a folder's entries (names created or renamed in it) to disk, so that a rename is
/// durable before it is relied on. A no-op where folders cannot be opened as files.
pub(crate) fn sync_dir(path: &Path) -> io::Result<()> {
    #[cfg(unix)]
    {
        File::open(path)?.sync_all()
    }
    #[cfg(not(unix))]
    {
        let _ = path;
        Ok(())
    }
}

/// Removes a file or a folder tree; something already gone counts as removed, because several
/// processes may clean the same stale folder at once.
pub(crate) fn remove_path(path: &Path) -> io::Result<()> {
    let result = match fs::symlink_metadata(path) {
        Ok(meta) if meta.is_dir() => fs::remove_dir_all(path),
        Ok(_) => fs::remove_file(path),
        Err(err) => Err(err),
    };
    match result {
        Err(err) if err.kind() == io::ErrorKind::NotFound => Ok(()),
        other => other,
    }
}

/// Bytes used by the files under `path` (not following symbolic links). Best effort: what cannot
/// be read counts as zero, because this only feeds reports.
pub(crate) fn disk_usage(path: &Path) -> u64 {
    let Ok(meta) = fs::symlink_metadata(path) else {
        return 0;
    };
    if !meta.is_dir() {
        return meta.len();
    }
    let Ok(children) = fs::read_dir(path) else {
        return 0;
    };
    children.flatten().map(|child| disk_usage(&child.path())).sum()
}

/// Whether `path` was last modified at least `age` ago. Unknown or future times count as recent,
/// so that nothing is deleted on a guess.
pub(crate) fn older_than(path: &Path, age: Duration) -> bool {
    fs::symlink_metadata(path)
        .and_then(|meta| meta.modified())
        .ok()
        .and_then(|modified| SystemTime::now().duration_since(modified).ok())
        .is_some_and(|elapsed| elapsed >= age)
}

/// A suffix that no other live process or thread uses: process id, time and a counter. Names
/// built from it are still created with `create_new` semantics, so a clash is an error, not a
/// shared folder.
pub(crate) fn unique_suffix() -> String {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let count = COUNTER.fetch_add(1, Ordering::Relaxed);
    let nanos = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_nanos());
    format!("{}-{nanos:x}.{count}", std::process::id())
}

/// Seconds since the Unix epoch, or 0 if the clock is before it.
pub(crate) fn unix_now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

/// Whether `name` is a single, ordinary file name: no separators, not `.` or `..`, not empty.
/// Library names come from builders and meta.json files, and must not escape the entry folder.
pub(crate) fn is_plain_file_name(name: &str) -> bool {
    let mut components = Path::new(name).components();
    matches!(
        (components.next(), components.next()),
        (Some(Component::Normal(first)), None) if first == name
    ) && !name.contains(['/', '\\'])
}
