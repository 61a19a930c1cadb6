//! A compiled kernel library opened with `dlopen` and its symbols bound once.

use kiln_core::Kernel;
use kiln_core::abi::{ABI_VERSION, ABI_VERSION_SYMBOL, AbiVersionFn, KernelFn};
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// Why a library could not be used. A cache entry that fails here is corrupt and is rebuilt.
#[derive(Debug, thiserror::Error)]
pub enum LibraryError {
    #[error("cannot load kernel library {}: {message}", path.display())]
    Open { path: PathBuf, message: String },
    #[error("kernel library {} lacks symbol {symbol} (stale or corrupt library)", path.display())]
    MissingSymbol { path: PathBuf, symbol: String },
    #[error("kernel library {} has ABI version {found}, this runtime expects {ABI_VERSION}", path.display())]
    AbiMismatch { path: PathBuf, found: u32 },
}

/// An open library with every kernel the plans need bound to a function pointer.
pub struct KernelLibrary {
    path: PathBuf,
    symbols: HashMap<Kernel, KernelFn>,
    // Declared last so it is dropped after the function pointers above can no longer be used.
    _lib: libloading::Library,
}

impl KernelLibrary {
    /// Opens `path`, checks its ABI version and binds each kernel of `kernels`.
    pub fn open(path: &Path, kernels: &[Kernel]) -> Result<KernelLibrary, LibraryError> {
        // SAFETY: loading a library runs its initialisers; Kiln's libraries are produced by its
        // own compiler and contain no initialisers beyond the C runtime's.
        let lib = unsafe { libloading::Library::new(path) }.map_err(|e| LibraryError::Open {
            path: path.to_path_buf(),
            message: e.to_string(),
        })?;
        let missing = |symbol: &str| LibraryError::MissingSymbol {
            path: path.to_path_buf(),
            symbol: symbol.to_string(),
        };
        // SAFETY: the symbol is declared by the ABI with this exact signature.
        let version = unsafe {
            let f: libloading::Symbol<AbiVersionFn> = lib
                .get(ABI_VERSION_SYMBOL.as_bytes())
                .map_err(|_| missing(ABI_VERSION_SYMBOL))?;
            f()
        };
        if version != ABI_VERSION {
            return Err(LibraryError::AbiMismatch {
                path: path.to_path_buf(),
                found: version,
            });
        }
        let mut symbols = HashMap::new();
        for kernel in kernels {
            let name = kernel.symbol();
            // SAFETY: every kernel symbol has the `KernelFn` signature (see `kiln_core::abi`);
            // the pointer stays valid while `_lib` is alive, which outlives `symbols`.
            let f = unsafe {
                let s: libloading::Symbol<KernelFn> = lib.get(name.as_bytes()).map_err(|_| missing(&name))?;
                *s
            };
            symbols.insert(kernel.clone(), f);
        }
        Ok(KernelLibrary {
            path: path.to_path_buf(),
            symbols,
            _lib: lib,
        })
    }

    /// The function for `kernel`, which must be one of those bound at open.
    pub fn get(&self, kernel: &Kernel) -> Option<KernelFn> {
        self.symbols.get(kernel).copied()
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
}
