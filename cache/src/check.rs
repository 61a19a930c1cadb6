//! Verifying an entry folder before its library is used: `meta.json` names the key, and the
//! library has the recorded size and SHA-256.

use std::fs::{self, File};
use std::io;
use std::path::PathBuf;

use crate::META_FILE;
use crate::entry::Meta;
use crate::error::CacheError;
use crate::fsutil::{is_plain_file_name, sha256_of};
use crate::key::Key;

/// Outcome of verifying an entry folder.
pub(crate) enum Check {
    Valid(Meta),
    Missing,
    Corrupt { reason: String, meta: Option<Meta> },
}

impl Check {
    pub(crate) fn corrupt(reason: String, meta: Option<Meta>) -> Check {
        Check::Corrupt { reason, meta }
    }
}

/// Verifies the entry for `key` in `dir`: meta.json parses and names this key, and the
/// library has the recorded size and SHA-256. Reads the library exactly once.
///
/// Damage is a [`Check::Corrupt`] with a reason naming the file; only failures that a
/// rebuild could not fix either (permission denied, an unreadable folder) are errors.
pub(crate) fn check(dir: PathBuf, key: &Key) -> Result<Check, CacheError> {
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
