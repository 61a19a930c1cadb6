//! The one error type of the GGUF front end.
//!
//! Every variant's `Display` is a single line that starts with the file's path and says what is
//! wrong (and, for a tensor or metadata key, names it), so the CLI can print it as is.

use kiln_core::files::FileError;
use std::path::PathBuf;

/// Why a GGUF file could not be read or used. See the module documentation of [`super`].
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum GgufError {
    /// The path is missing, a symlink loop, or not a regular file (a FIFO, a device, a
    /// directory); such a path is never read.
    #[error(transparent)]
    File(#[from] FileError),

    /// The file could not be opened, its size read, or mapped.
    #[error("{}: cannot read: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    /// The first four bytes are not `GGUF`.
    #[error("{}: bad magic (expected \"GGUF\", found {found})", path.display())]
    BadMagic { path: PathBuf, found: String },

    /// A GGUF version other than 2 or 3 (version 1 used 32-bit lengths and is obsolete).
    #[error("{}: unsupported GGUF version {version} (supported: 2, 3)", path.display())]
    UnsupportedVersion { path: PathBuf, version: u32 },

    /// A version field that only makes sense byte-swapped: a big-endian file.
    #[error(
        "{}: big-endian GGUF file (version {version} byte-swapped); only little-endian files are supported",
        path.display()
    )]
    BigEndian { path: PathBuf, version: u32 },

    /// The header (counts, metadata, tensor table) runs past the end of the file.
    #[error(
        "{}: truncated: {what} at byte {offset} needs {needed} bytes, but the file ends at byte {file_len}",
        path.display()
    )]
    Truncated {
        path: PathBuf,
        what: String,
        offset: u64,
        needed: u64,
        file_len: u64,
    },

    /// The header is structurally invalid (an impossible count, an unknown metadata value type,
    /// a duplicate key, a string that is not UTF-8, ...).
    #[error("{}: malformed header: {problem}", path.display())]
    Malformed { path: PathBuf, problem: String },

    /// A tensor whose GGML type id Kiln does not know or does not read.
    #[error("{}: tensor {tensor} has {description}", path.display())]
    UnknownType {
        path: PathBuf,
        tensor: String,
        type_id: u32,
        /// "unknown ggml type 99" or "ggml type 23 (iq4_xs), which Kiln does not read (...)".
        description: String,
    },

    /// A tensor's data lies (partly) beyond the end of the file.
    #[error(
        "{}: tensor {tensor} (offset {offset}, {size} bytes) extends past the end of the file ({file_len} bytes)",
        path.display()
    )]
    TensorPastEnd {
        path: PathBuf,
        tensor: String,
        /// Absolute offset of the tensor's first byte in the file.
        offset: u64,
        size: u64,
        file_len: u64,
    },

    /// Two tensors whose data share bytes (see [`crate::overlap`]); offsets are absolute.
    #[error(
        "{}: tensors {first} (offset {first_offset}, {first_size} bytes) and {second} (offset {second_offset}, {second_size} bytes) overlap",
        path.display()
    )]
    OverlappingTensors {
        path: PathBuf,
        first: String,
        first_offset: u64,
        first_size: u64,
        second: String,
        second_offset: u64,
        second_size: u64,
    },

    /// A tensor-table entry that is inconsistent in itself (dimensions, alignment, name).
    #[error("{}: tensor {tensor} {problem}", path.display())]
    BadTensor {
        path: PathBuf,
        tensor: String,
        problem: String,
    },

    /// A metadata key the model needs is absent.
    #[error("{}: missing metadata key \"{key}\"", path.display())]
    MissingKey { path: PathBuf, key: String },

    /// A metadata key with the wrong type or an impossible value.
    #[error("{}: metadata key \"{key}\" {problem}", path.display())]
    BadKey {
        path: PathBuf,
        key: String,
        problem: String,
    },

    /// `general.architecture` names a family Kiln does not know.
    #[error(
        "{}: unknown architecture \"{name}\" (supported: {})",
        path.display(),
        kiln_core::arch::gguf_names().join(", ")
    )]
    UnknownArchitecture { path: PathBuf, name: String },

    /// Something the file asks for that Kiln does not implement; `what` reads like
    /// "rope scaling type \"yarn\" (supported: none, linear)".
    #[error("{}: unsupported {what}", path.display())]
    Unsupported { path: PathBuf, what: String },

    /// The metadata parse but describe an impossible model (`ModelSpec::validate` and relations
    /// between keys and tensors).
    #[error("{}: {message}", path.display())]
    InvalidModel { path: PathBuf, message: String },

    /// A tensor the model needs is not in the file. `weight` is Kiln's (Hugging Face) name.
    #[error("{}: tensor {tensor} not found (needed for {weight})", path.display())]
    MissingTensor {
        path: PathBuf,
        tensor: String,
        weight: String,
    },

    /// A tensor whose shape differs from what the metadata imply. Shapes are outermost
    /// dimension first (the reverse of GGUF's `ne` order).
    #[error(
        "{}: tensor {tensor} has shape {found:?}, expected {expected:?} (outermost dimension first)",
        path.display()
    )]
    ShapeMismatch {
        path: PathBuf,
        tensor: String,
        found: Vec<usize>,
        expected: Vec<usize>,
    },

    /// A tensor stored in a type other than the one a given spec records.
    #[error("{}: tensor {tensor} is stored as {found}, but the spec expects {expected}", path.display())]
    DTypeMismatch {
        path: PathBuf,
        tensor: String,
        found: String,
        expected: String,
    },

    /// The tokenizer described by the `tokenizer.*` keys cannot be built.
    #[error("{}: tokenizer: {message}", path.display())]
    Tokenizer { path: PathBuf, message: String },

    /// The parts of a split model do not fit together (a missing part, a wrong part number,
    /// a first part whose name does not say where the others are).
    #[error("{}: split model: {message}", path.display())]
    Split { path: PathBuf, message: String },

    /// A request the loaded file cannot satisfy (e.g. dequantising to a quantised type).
    #[error("{}: {message}", path.display())]
    InvalidRequest { path: PathBuf, message: String },
}
