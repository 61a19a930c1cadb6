//! The cache's error type.

use std::io;
use std::path::PathBuf;

use crate::key::{KEY_HEX_LEN, Key};

/// Everything that can go wrong in the cache.
///
/// Each message is one line that names the path (or key) involved and what was expected, so a
/// command-line tool can print it as is. Operating-system errors are part of the message rather
/// than a [`source`](std::error::Error::source), so printing the error chain (e.g. anyhow's
/// `{:#}`) does not repeat them; [`CacheError::io_error`] gives access to them.
///
/// A damaged entry is not an error: it is reported as [`Lookup::Corrupt`](crate::Lookup) or
/// rebuilt. Errors are reserved for what the cache cannot repair itself.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CacheError {
    /// None of the variables that locate the cache folder is usable.
    #[error("cannot determine the cache folder: KILN_CACHE_DIR, XDG_CACHE_HOME and HOME are all unset or empty")]
    NoCacheDir,

    /// The cache folder is missing and cannot be created.
    #[error("cannot create cache folder {}: {err}", .path.display())]
    CreateRoot {
        /// The cache folder.
        path: PathBuf,
        /// Why the operating system refused.
        err: io::Error,
    },

    /// The cache folder's path is taken by something that is not a folder.
    #[error("cache folder {} exists but is not a folder", .path.display())]
    RootNotAFolder {
        /// The cache folder.
        path: PathBuf,
    },

    /// An entry must be built but the cache folder cannot be written to (a read-only mount,
    /// another user's folder). Hits never need to write, so only a build reports this.
    #[error(
        "cache folder {} is not writable ({err}), and entry {key} is not in it yet: building it needs a writable cache folder",
        .path.display()
    )]
    NotWritable {
        /// The cache folder.
        path: PathBuf,
        /// The entry that was to be built.
        key: Key,
        /// Why the operating system refused.
        err: io::Error,
    },

    /// A file-system operation failed; `what` says what was being attempted.
    #[error("{what} {}: {err}", .path.display())]
    Io {
        /// What was being attempted, phrased to precede the path ("cannot read", ...).
        what: &'static str,
        /// The file or folder involved.
        path: PathBuf,
        /// Why the operating system refused.
        err: io::Error,
    },

    /// A string given as a key is not one.
    #[error("invalid cache key {input:?}: expected {KEY_HEX_LEN} hexadecimal digits")]
    InvalidKey {
        /// The rejected text.
        input: String,
    },

    /// A string given as a key prefix is not one.
    #[error("invalid cache key prefix {input:?}: expected 1 to {KEY_HEX_LEN} hexadecimal digits")]
    InvalidPrefix {
        /// The rejected text.
        input: String,
    },

    /// No entry's key starts with the given prefix.
    #[error("no cache entry in {} has a key starting with {prefix:?}", .root.display())]
    NoMatch {
        /// The prefix, lowercased.
        prefix: String,
        /// The cache folder searched.
        root: PathBuf,
    },

    /// Several entries' keys start with the given prefix, so removing one would be a guess.
    #[error(
        "cache key prefix {prefix:?} is ambiguous in {}: it matches {} entries ({})",
        .root.display(), .matches.len(), join_keys(.matches)
    )]
    Ambiguous {
        /// The prefix, lowercased.
        prefix: String,
        /// The cache folder searched.
        root: PathBuf,
        /// Every key that starts with the prefix.
        matches: Vec<Key>,
    },

    /// The builder returned a library name that is not a plain file name in the staging folder.
    #[error(
        "the builder of cache entry {key} named its library {name:?}: expected a plain file name other than meta.json"
    )]
    BadLibraryName {
        /// The entry being built.
        key: Key,
        /// The name the builder returned.
        name: String,
    },

    /// The builder returned the name of something that is not a regular file.
    #[error("built library {} is not a regular file", .path.display())]
    LibraryNotAFile {
        /// Where the library was expected.
        path: PathBuf,
    },

    /// The built library is not what its kind promises: a shared object cut short or not an
    /// ELF shared object at all, or a file that changed size while being checked.
    #[error("built library {} {reason}", .path.display())]
    IncompleteLibrary {
        /// The library in the staging folder.
        path: PathBuf,
        /// What is wrong, phrased to follow the path ("is truncated: ...").
        reason: String,
    },

    /// The built library is complete but the builder's load check refused it.
    #[error("built library {} fails its load check: {reason}", .path.display())]
    UnloadableLibrary {
        /// The library in the staging folder.
        path: PathBuf,
        /// What the load check reported.
        reason: String,
    },

    /// meta.json could not be serialized.
    #[error("cannot encode {}: {err}", .path.display())]
    EncodeMeta {
        /// The meta.json being written.
        path: PathBuf,
        /// What serde_json reported.
        err: serde_json::Error,
    },
}

impl CacheError {
    /// The operating-system error behind this one, if any, for callers that branch on its kind.
    pub fn io_error(&self) -> Option<&io::Error> {
        match self {
            CacheError::CreateRoot { err, .. } | CacheError::NotWritable { err, .. } | CacheError::Io { err, .. } => {
                Some(err)
            }
            _ => None,
        }
    }

    /// Shorthand for [`CacheError::Io`], used with `map_err`.
    pub(crate) fn io(what: &'static str, path: impl Into<PathBuf>) -> impl FnOnce(io::Error) -> Self {
        let path = path.into();
        move |err| CacheError::Io { what, path, err }
    }
}

/// Keys separated by commas, for [`CacheError::Ambiguous`].
fn join_keys(keys: &[Key]) -> String {
    keys.iter().map(Key::to_string).collect::<Vec<_>>().join(", ")
}
