//! On-disk cache of build outputs, one folder per key.
//!
//! Compiling a model takes long enough that it must happen once per model and machine, and a
//! warm start must take well under 0.2 s; this crate makes that safe. It stores opaque build
//! outputs (a library file plus free-form metadata) under a [`Key`] derived from everything that
//! determines them, and it does not know what a model or a kernel is.
//!
//! Guarantees:
//! - an entry is only ever visible complete: builds go to a staging folder that is synced and
//!   renamed into place, and deletions rename to trash first;
//! - a builder's success is not trusted: its library is synced, and a shared object must be a
//!   complete ELF file and pass the caller's load check, before it is published
//!   ([`LibraryKind`]);
//! - a hit writes nothing, so a read-only cache folder serves the entries it holds;
//! - every use verifies the library's size and SHA-256 against `meta.json`, so a truncated or
//!   overwritten library is rebuilt ([`Status::Rebuilt`]) instead of loaded;
//! - concurrent builds of one key, from threads or processes, run the builder once: the others
//!   wait on `<root>/<key>.lock` and then find a hit;
//! - a failing or panicking builder leaves nothing behind; leftovers of crashed processes are
//!   ignored, and removed by [`Cache::clean_all`] or after an hour by the next build; a process
//!   ended by a signal can delete its own first ([`remove_active_staging`]).
//!
//! ```no_run
//! use kiln_cache::{BuildOutput, Cache, Key};
//!
//! type Error = Box<dyn std::error::Error + Send + Sync>;
//!
//! # fn main() -> Result<(), Error> {
//! let cache = Cache::open(Cache::default_root()?)?;
//! let key = Key::from_parts(&[("spec", "{...}"), ("kiln_version", "0.1.0")]);
//! let outcome = cache.get_or_build(&key, |staging| -> Result<BuildOutput, Error> {
//!     std::fs::write(staging.join("libkiln.so"), b"...")?;
//!     Ok(BuildOutput::new("libkiln.so", serde_json::json!({ "model": "x" })))
//! })?;
//! println!("{:?}: {}", outcome.status, outcome.entry.library_path.display());
//! # Ok(())
//! # }
//! ```

mod active;
mod cache;
mod check;
mod elf;
mod entry;
mod error;
mod folder;
mod fsutil;
mod key;
mod verify;

pub use active::remove_active_staging;
pub use cache::{Cache, GROUPED_COPIES, META_FILE, PAGE_CACHE_MARKS, TOKENIZER_TABLES};
pub use entry::{BuildOutput, CleanReport, Entry, EntryInfo, Lookup, Meta, Outcome, Removed, Status};
pub use error::CacheError;
pub use key::{KEY_HEX_LEN, Key};
pub use verify::{LibraryKind, LoadCheck};

#[cfg(test)]
mod publish_tests;
#[cfg(test)]
mod tests;
