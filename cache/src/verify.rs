//! Checks a built library before it is published: a builder's success is not proof.
//!
//! A linker can exit 0 having written a truncated file when the disk filled up (GNU ld 2.40
//! does, see [`crate::elf`]), and a file system can report a write error only when the data is
//! synced. So every library is synced first; its size after the sync is the size that is read,
//! checked, hashed and recorded; and a shared object must be structurally complete and pass the
//! caller's load check before its entry appears.

use std::fs::File;
use std::io::Read;
use std::path::Path;

use sha2::{Digest, Sha256};

use crate::error::CacheError;
use crate::fsutil::sha256_of;
use crate::key::to_hex;

/// Called with the path of a built shared object, in the staging folder, before it is
/// published; an `Err` is a reason, phrased to follow "the library ...".
pub type LoadCheck = Box<dyn FnOnce(&Path) -> Result<(), String>>;

/// What kind of file a builder produced, which says how it is checked before publication.
pub enum LibraryKind {
    /// Any file: only synced, measured and hashed.
    Opaque,
    /// An ELF shared object. Its headers must describe nothing past the end of the file
    /// (section and program header tables, sections, loadable segments), and only then is
    /// `load_check` called, since loading a truncated object can fault.
    SharedObject {
        /// The caller's check that the library loads and is the right one.
        load_check: LoadCheck,
    },
}

impl std::fmt::Debug for LibraryKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            LibraryKind::Opaque => "Opaque",
            LibraryKind::SharedObject { .. } => "SharedObject",
        })
    }
}

/// Syncs the built library at `path`, checks it as `kind` says, and returns its SHA-256
/// (lowercase hex) and size in bytes, as they are on disk.
pub(crate) fn built_library(path: &Path, kind: LibraryKind) -> Result<(String, u64), CacheError> {
    let mut file = File::open(path).map_err(CacheError::io("cannot open built library", path))?;
    let inspect = |file: &File| {
        file.metadata()
            .map_err(CacheError::io("cannot inspect built library", path))
    };
    if !inspect(&file)?.is_file() {
        return Err(CacheError::LibraryNotAFile { path: path.into() });
    }
    // Before anything is measured: a write error the builder never saw surfaces here.
    file.sync_all()
        .map_err(CacheError::io("cannot sync built library", path))?;
    let size = inspect(&file)?.len();
    let incomplete = |reason: String| CacheError::IncompleteLibrary {
        path: path.into(),
        reason,
    };
    let changed = |read: u64| incomplete(format!("changed size while being checked ({size} bytes, then {read})"));
    match kind {
        LibraryKind::Opaque => {
            let (sha256, read) = sha256_of(&mut file).map_err(CacheError::io("cannot read built library", path))?;
            if read != size {
                return Err(changed(read));
            }
            Ok((sha256, size))
        }
        LibraryKind::SharedObject { load_check } => {
            // Read once: what is checked is exactly what is hashed.
            let mut bytes = Vec::with_capacity(usize::try_from(size).unwrap_or(0));
            file.read_to_end(&mut bytes)
                .map_err(CacheError::io("cannot read built library", path))?;
            drop(file);
            if bytes.len() as u64 != size {
                return Err(changed(bytes.len() as u64));
            }
            crate::elf::check_shared_object(&bytes).map_err(incomplete)?;
            load_check(path).map_err(|reason| CacheError::UnloadableLibrary {
                path: path.into(),
                reason,
            })?;
            Ok((to_hex(&Sha256::digest(&bytes)), size))
        }
    }
}
