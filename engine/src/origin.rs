//! What a model's weight bytes come from, for copies derived from them that outlive the process
//! ([`crate::WeightSource::origin`], the row-grouped copies of `crate::grouped_store`), and
//! whether those files are still what they were when a copy was made.

use std::fs::{File, Metadata};
use std::os::unix::fs::MetadataExt;
use std::path::Path;

/// The files' absolute paths (one per line), and their state (one [`state_line`] per file),
/// which changes when a file is rewritten or replaced. `None` when a file's metadata cannot
/// be read.
pub fn of_files<'a>(files: impl IntoIterator<Item = (&'a Path, &'a File)>) -> Option<(String, String)> {
    let (mut place, mut state) = (String::new(), String::new());
    for (path, file) in files {
        let m = file.metadata().ok()?;
        let absolute = std::path::absolute(path).ok()?;
        place.push_str(&format!("{}\n", absolute.display()));
        state.push_str(&state_line(&m));
    }
    Some((place, state))
}

/// The state of the files a place lists (as [`of_files`] gives it) now: `None` when one of them
/// is gone or cannot be read, so a copy made from them can be told stale without opening it.
pub fn current_state(place: &str) -> Option<String> {
    place
        .lines()
        .map(|path| std::fs::metadata(path).ok().map(|m| state_line(&m)))
        .collect()
}

/// Size, modification time in nanoseconds, device and inode: what a rewrite or a replacement
/// changes (the bytes are not read; see `crate::grouped_store` for why).
fn state_line(m: &Metadata) -> String {
    format!("{} {} {} {} {}\n", m.len(), m.mtime(), m.mtime_nsec(), m.dev(), m.ino())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn temp_file(name: &str, bytes: &[u8]) -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!("kiln-origin-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("w.bin");
        std::fs::write(&path, bytes).unwrap();
        path
    }

    /// Rewriting a file changes its state and keeps its place.
    #[test]
    fn a_rewritten_file_changes_the_state_not_the_place() {
        let path = temp_file("rewrite", b"one");
        let read = || of_files([(path.as_path(), &File::open(&path).unwrap())]).unwrap();
        let before = read();
        std::fs::write(&path, b"other").unwrap();
        let after = read();
        assert_eq!(before.0, after.0);
        assert_ne!(before.1, after.1);
        std::fs::remove_dir_all(path.parent().unwrap()).unwrap();
    }

    /// The state read back from the place alone equals the state taken from the open files,
    /// until a file changes or goes.
    #[test]
    fn the_current_state_matches_until_a_file_changes_or_goes() {
        let path = temp_file("current", b"weights");
        let (place, state) = of_files([(path.as_path(), &File::open(&path).unwrap())]).unwrap();
        assert_eq!(current_state(&place).as_deref(), Some(state.as_str()));
        std::fs::write(&path, b"other weights").unwrap();
        assert_ne!(current_state(&place).as_deref(), Some(state.as_str()));
        std::fs::remove_dir_all(path.parent().unwrap()).unwrap();
        assert_eq!(current_state(&place), None);
    }
}
