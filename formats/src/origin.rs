//! What a model's weight bytes come from, for copies derived from them that outlive the process
//! (`kiln_engine::engine::WeightSource::origin`).

use std::fs::File;
use std::os::unix::fs::MetadataExt;
use std::path::Path;

/// The files' absolute paths (one per line), and their state: size, modification time in
/// nanoseconds, device and inode, which change when a file is rewritten or replaced. `None`
/// when a file's metadata cannot be read.
pub fn of_files<'a>(files: impl IntoIterator<Item = (&'a Path, &'a File)>) -> Option<(String, String)> {
    let (mut place, mut state) = (String::new(), String::new());
    for (path, file) in files {
        let m = file.metadata().ok()?;
        let absolute = std::path::absolute(path).ok()?;
        place.push_str(&format!("{}\n", absolute.display()));
        state.push_str(&format!(
            "{} {} {} {} {}\n",
            m.len(),
            m.mtime(),
            m.mtime_nsec(),
            m.dev(),
            m.ino()
        ));
    }
    Some((place, state))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Rewriting a file changes its state and keeps its place.
    #[test]
    fn a_rewritten_file_changes_the_state_not_the_place() {
        let dir = std::env::temp_dir().join(format!("kiln-origin-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("w.bin");
        std::fs::write(&path, b"one").unwrap();
        let read = || of_files([(path.as_path(), &File::open(&path).unwrap())]).unwrap();
        let before = read();
        std::fs::write(&path, b"other").unwrap();
        let after = read();
        assert_eq!(before.0, after.0);
        assert_ne!(before.1, after.1);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
