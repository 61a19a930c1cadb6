//! The one error type of the model front end.
//!
//! Every variant's `Display` is a single line that names the file (and the field or tensor when
//! there is one) and says what was expected, so the CLI can print it as is.

use kiln_core::files::{FileError, FileKind};
use std::path::PathBuf;

/// Why a model folder could not be read. See the module documentation.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ModelError {
    /// The path given to [`super::load`] does not exist: a mistyped GGUF path is told it names
    /// no GGUF file, not sent looking for a folder.
    #[error("{} does not exist ({})", path.display(), expected_at(path))]
    NotFound { path: PathBuf },

    /// The path given to [`super::load`] exists but is neither a folder nor a regular file.
    #[error(
        "{} is {kind}, not a regular file or folder (expected a Hugging Face model folder, its config.json or a GGUF file)",
        path.display()
    )]
    NotAModel { path: PathBuf, kind: FileKind },

    /// A file of the model (the path given, `config.json`, `generation_config.json`, the weights
    /// or the index) is a symlink loop, a FIFO, a device or a directory, or cannot be opened.
    #[error(transparent)]
    File(#[from] FileError),

    /// A folder without `config.json`.
    #[error("config.json not found in {} (expected a Hugging Face model folder)", dir.display())]
    ConfigNotFound { dir: PathBuf },

    /// A file exists but could not be read or mapped.
    #[error("cannot read {}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    /// A JSON file (config, generation config, shard index) that does not parse; serde's message
    /// carries the line and column.
    #[error("{}: invalid JSON: {source}", path.display())]
    Json {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },

    /// A required field is absent (or null).
    #[error("{}: missing field \"{field}\"", path.display())]
    MissingField { path: PathBuf, field: String },

    /// A field has the wrong type or an impossible value.
    #[error("{}: field \"{field}\" {problem}", path.display())]
    InvalidField {
        path: PathBuf,
        field: String,
        problem: String,
    },

    /// `architectures[0]` (or `model_type`) names a family Kiln does not know.
    #[error(
        "{}: unknown architecture \"{name}\" (supported: {})",
        path.display(),
        kiln_core::arch::hf_names().join(", ")
    )]
    UnknownArchitecture { path: PathBuf, name: String },

    /// A feature the config asks for that Kiln does not implement (a RoPE type, an activation,
    /// MLP biases, ...). `what` reads like "rope_type 'yarn' (supported: ...)".
    #[error("unsupported {what} in {}", path.display())]
    Unsupported { path: PathBuf, what: String },

    /// The config parses but describes an impossible model (from `ModelSpec::validate` and
    /// relations between fields).
    #[error("{}: {message}", path.display())]
    InvalidConfig { path: PathBuf, message: String },

    /// Neither `model.safetensors` nor `model.safetensors.index.json` in the folder.
    #[error(
        "no safetensors weights in {} (expected model.safetensors or model.safetensors.index.json; \
         other formats such as pytorch_model.bin are not read)",
        dir.display()
    )]
    NoWeights { dir: PathBuf },

    /// The file is not a well-formed safetensors file (header length, header JSON, entries).
    #[error("{} is not a valid safetensors file: {problem}", path.display())]
    NotSafetensors { path: PathBuf, problem: String },

    /// A tensor's data lies (partly) beyond the end of the file.
    #[error("{} is truncated: tensor {tensor} ends at byte {end}, file has {file_len}", path.display())]
    Truncated {
        path: PathBuf,
        tensor: String,
        end: u64,
        file_len: u64,
    },

    /// A header entry that is inconsistent in itself (size not matching shape × dtype, reversed
    /// offsets, unknown dtype).
    #[error("{}: tensor {tensor} {problem}", path.display())]
    BadTensor {
        path: PathBuf,
        tensor: String,
        problem: String,
    },

    /// Two tensors of one file whose `data_offsets` share bytes (see [`crate::overlap`]).
    #[error(
        "{}: tensors {first} (data_offsets [{}, {}]) and {second} (data_offsets [{}, {}]) overlap",
        path.display(),
        first_offsets[0],
        first_offsets[1],
        second_offsets[0],
        second_offsets[1]
    )]
    OverlappingTensors {
        path: PathBuf,
        first: String,
        first_offsets: [u64; 2],
        second: String,
        second_offsets: [u64; 2],
    },

    /// A sharded checkpoint's index is malformed or names a file that is unusable.
    #[error("{}: {problem}", path.display())]
    BadIndex { path: PathBuf, problem: String },

    /// A tensor the model needs is in none of the files. `searched` names them.
    #[error("tensor {tensor} not found in {searched}")]
    MissingTensor { tensor: String, searched: String },

    /// A tensor whose shape differs from what the config implies.
    #[error("{tensor} in {} has shape {found:?}, expected {expected:?}", path.display())]
    ShapeMismatch {
        tensor: String,
        path: PathBuf,
        found: Vec<usize>,
        expected: Vec<usize>,
    },

    /// A needed tensor stored in a type the kernels cannot read.
    #[error("{tensor} in {} has dtype {dtype} (Kiln reads F32, F16 and BF16 weights)", path.display())]
    UnsupportedDType {
        tensor: String,
        path: PathBuf,
        dtype: String,
    },

    /// A tensor whose storage type differs from the one recorded in a given spec.
    #[error("{tensor} in {} is stored as {found}, but the spec expects {expected}", path.display())]
    DTypeMismatch {
        tensor: String,
        path: PathBuf,
        found: String,
        expected: String,
    },
}

/// What a path that does not exist was expected to name, by its extension.
fn expected_at(path: &std::path::Path) -> &'static str {
    let gguf = path.extension().is_some_and(|e| e.eq_ignore_ascii_case("gguf"));
    if gguf {
        "expected a GGUF file"
    } else {
        "expected a Hugging Face model folder, its config.json or a GGUF file"
    }
}
