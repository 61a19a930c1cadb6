//! Opening the files a user names (a model folder's JSON files, weights, a GGUF file) without
//! being fooled by what is not a regular file.
//!
//! `std::fs::File::open` on a FIFO blocks until a writer appears, reading `/dev/zero` never
//! ends, and `Path::is_file` is false for both a FIFO and a missing file, so a loader built on
//! those either hangs or calls a FIFO "missing". Everything here opens with `O_NONBLOCK` (which
//! never blocks on a FIFO and changes nothing for regular files), checks with `fstat` on the
//! opened descriptor that it is a regular file (so a swap between a check and the open cannot
//! slip a FIFO in), and reports what the path actually is: missing, a symlink loop, a FIFO, a
//! device, a socket or a directory. Nothing is ever read from a non-regular file.

use std::fmt;
use std::fs::{File, Metadata};
use std::io::{self, Read};
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

/// What a path is when it is not a regular file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FileKind {
    Directory,
    Fifo,
    CharDevice,
    BlockDevice,
    Socket,
    /// Anything else `stat` can report.
    Other,
}

impl FileKind {
    /// The kind of `meta` (from a `stat` that follows symlinks), or `None` for a regular file.
    pub fn of(meta: &Metadata) -> Option<FileKind> {
        let t = meta.file_type();
        if t.is_file() {
            None
        } else if t.is_dir() {
            Some(FileKind::Directory)
        } else if t.is_fifo() {
            Some(FileKind::Fifo)
        } else if t.is_char_device() {
            Some(FileKind::CharDevice)
        } else if t.is_block_device() {
            Some(FileKind::BlockDevice)
        } else if t.is_socket() {
            Some(FileKind::Socket)
        } else {
            Some(FileKind::Other)
        }
    }
}

impl fmt::Display for FileKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            FileKind::Directory => "a directory",
            FileKind::Fifo => "a FIFO (named pipe)",
            FileKind::CharDevice => "a character device",
            FileKind::BlockDevice => "a block device",
            FileKind::Socket => "a socket",
            FileKind::Other => "a special file",
        })
    }
}

/// Why a path could not be opened as a regular file. Each message is one line starting with
/// the path.
#[derive(Debug, thiserror::Error)]
pub enum FileError {
    #[error("{} does not exist", path.display())]
    NotFound { path: PathBuf },

    /// `ELOOP`: the path, or a folder on the way to it, is a chain of symlinks that never ends.
    #[error("{} is a symlink loop (too many levels of symbolic links)", path.display())]
    SymlinkLoop { path: PathBuf },

    #[error("{} is {kind}, not a regular file", path.display())]
    NotRegular { path: PathBuf, kind: FileKind },

    #[error("cannot read {}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
}

impl FileError {
    /// The error for a failed `stat` or `open` of `path`.
    pub fn from_io(path: &Path, source: io::Error) -> FileError {
        let path = path.to_path_buf();
        match source.raw_os_error() {
            Some(libc::ENOENT) => FileError::NotFound { path },
            Some(libc::ELOOP) => FileError::SymlinkLoop { path },
            _ => FileError::Io { path, source },
        }
    }

    /// Whether the path does not exist (an optional file that is simply absent).
    pub fn is_not_found(&self) -> bool {
        matches!(self, FileError::NotFound { .. })
    }
}

/// `stat` of `path`, following symlinks: what the path is, without opening it.
pub fn stat(path: &Path) -> Result<Metadata, FileError> {
    std::fs::metadata(path).map_err(|e| FileError::from_io(path, e))
}

/// Opens `path` for reading if and only if it is a regular file. Never blocks, and never
/// reads anything, when the path is a FIFO or a device (see the module documentation).
pub fn open(path: &Path) -> Result<File, FileError> {
    // Refuse special files before opening them: opening a device can have side effects.
    if let Some(kind) = FileKind::of(&stat(path)?) {
        return Err(FileError::NotRegular {
            path: path.to_path_buf(),
            kind,
        });
    }
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY)
        .open(path)
        .map_err(|e| FileError::from_io(path, e))?;
    // The path may have been replaced since the `stat`: check what was actually opened.
    let meta = file.metadata().map_err(|e| FileError::from_io(path, e))?;
    match FileKind::of(&meta) {
        None => Ok(file),
        Some(kind) => Err(FileError::NotRegular {
            path: path.to_path_buf(),
            kind,
        }),
    }
}

/// The whole content of the regular file `path`.
pub fn read(path: &Path) -> Result<Vec<u8>, FileError> {
    let mut file = open(path)?;
    let mut bytes = Vec::new();
    file.read_to_end(&mut bytes).map_err(|source| FileError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    Ok(bytes)
}

/// The whole content of the regular file `path`, which must be UTF-8.
pub fn read_to_string(path: &Path) -> Result<String, FileError> {
    let mut file = open(path)?;
    let mut text = String::new();
    file.read_to_string(&mut text).map_err(|source| FileError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    Ok(text)
}

/// Like [`read`], but `None` when `path` does not exist: for the optional files of a model
/// folder. Anything else that is there but not a readable regular file is an error.
pub fn read_optional(path: &Path) -> Result<Option<Vec<u8>>, FileError> {
    match read(path) {
        Ok(bytes) => Ok(Some(bytes)),
        Err(e) if e.is_not_found() => Ok(None),
        Err(e) => Err(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::ffi::CString;
    use std::os::unix::ffi::OsStrExt;
    use std::sync::mpsc;
    use std::time::Duration;

    fn mkfifo(path: &Path) {
        let c = CString::new(path.as_os_str().as_bytes()).unwrap();
        // SAFETY: `c` is a NUL-terminated path that outlives the call.
        let rc = unsafe { libc::mkfifo(c.as_ptr(), 0o644) };
        assert_eq!(rc, 0, "mkfifo {}", path.display());
    }

    /// `read(path)` run on another thread; panics if it has not returned within 10 s (a FIFO
    /// opened without `O_NONBLOCK` would block there forever).
    fn read_within_10s(path: &Path) -> Result<Vec<u8>, FileError> {
        let (tx, rx) = mpsc::channel();
        let p = path.to_path_buf();
        std::thread::spawn(move || tx.send(read(&p)));
        rx.recv_timeout(Duration::from_secs(10))
            .unwrap_or_else(|_| panic!("reading {} blocked", path.display()))
    }

    #[test]
    fn regular_files_read_and_missing_ones_are_absent() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("a.json");
        std::fs::write(&f, "{}").unwrap();
        assert_eq!(read(&f).unwrap(), b"{}");
        assert_eq!(read_to_string(&f).unwrap(), "{}");
        let missing = dir.path().join("nope.json");
        assert_eq!(read_optional(&missing).unwrap(), None);
        let e = read(&missing).unwrap_err().to_string();
        assert_eq!(e, format!("{} does not exist", missing.display()));
    }

    /// A FIFO without a writer is refused at once, never opened for a blocking read, and is
    /// an error (not "absent") even for an optional file.
    #[test]
    fn fifo_is_refused_without_blocking() {
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("tokenizer.json");
        mkfifo(&fifo);
        let e = read_within_10s(&fifo).unwrap_err();
        assert!(
            matches!(
                e,
                FileError::NotRegular {
                    kind: FileKind::Fifo,
                    ..
                }
            ),
            "{e:?}"
        );
        assert_eq!(
            e.to_string(),
            format!("{} is a FIFO (named pipe), not a regular file", fifo.display())
        );
        assert!(read_optional(&fifo).is_err());
    }

    #[test]
    fn devices_and_directories_are_named() {
        for dev in ["/dev/null", "/dev/zero", "/dev/urandom"] {
            let e = read_within_10s(Path::new(dev)).unwrap_err().to_string();
            assert_eq!(e, format!("{dev} is a character device, not a regular file"));
        }
        let dir = tempfile::tempdir().unwrap();
        let e = read_within_10s(dir.path()).unwrap_err().to_string();
        assert_eq!(
            e,
            format!("{} is a directory, not a regular file", dir.path().display())
        );
    }

    #[test]
    fn symlink_loops_are_named() {
        let dir = tempfile::tempdir().unwrap();
        let a = dir.path().join("a");
        let b = dir.path().join("b");
        std::os::unix::fs::symlink(&b, &a).unwrap();
        std::os::unix::fs::symlink(&a, &b).unwrap();
        let own = dir.path().join("own");
        std::os::unix::fs::symlink(&own, &own).unwrap();
        for p in [&a, &own, &a.join("config.json")] {
            let e = read_optional(p).unwrap_err();
            assert!(matches!(e, FileError::SymlinkLoop { .. }), "{e:?}");
            assert!(e.to_string().contains("symlink loop"), "{e}");
        }
    }
}
