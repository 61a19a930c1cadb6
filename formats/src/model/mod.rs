//! Model front end: a Hugging Face model folder (`config.json`, optional
//! `generation_config.json`, safetensors weights) into a validated [`ModelSpec`] and
//! memory-mapped [`Weights`].
//!
//! ```no_run
//! let model = kiln_formats::model::load(std::path::Path::new("/models/Qwen3-0.6B"))?;
//! println!("{} layers, eos {:?}", model.spec.num_layers(), model.config.eos_token_ids);
//! let embed = model.weights.get("model.embed_tokens.weight")?;
//! # Ok::<(), kiln_formats::model::ModelError>(())
//! ```
//!
//! The spec's layout comes from `config.json` (see [`config`] and the architecture files of
//! [`kiln_core::arch`] for how each field and its default is read); the storage type of each of
//! its tensors comes from the files, after each has been checked for presence and shape. Every failure is one [`ModelError`] whose
//! message names the file and the field or tensor concerned. No input makes this code panic.

pub mod config;
pub mod error;
pub mod weights;

#[cfg(test)]
mod sampling_tests;
#[cfg(test)]
mod special_files_tests;
#[cfg(test)]
mod tests;

pub use config::ModelConfig;
pub use error::ModelError;
pub use weights::{TensorView, Weights};

use kiln_core::ModelSpec;
use kiln_core::files::{self, FileError, FileKind};
use std::path::{Path, PathBuf};

/// A model folder, read and checked.
#[derive(Debug)]
pub struct LoadedModel {
    /// The folder holding `config.json` and the weights.
    pub dir: PathBuf,
    /// Everything read from `config.json` / `generation_config.json`, BOS/EOS ids included.
    pub config: ModelConfig,
    /// The validated spec, with the storage type of each tensor as found in the files.
    pub spec: ModelSpec,
    /// The mapped weights, checked against `spec` ([`Weights::check`] passes).
    pub weights: Weights,
}

/// Reads the model at `path`: a folder containing `config.json`, or the path of that
/// `config.json` itself (the weights are then looked for next to it).
pub fn load(path: &Path) -> Result<LoadedModel, ModelError> {
    let (dir, config_path) = locate(path)?;
    // The layout (which tensors, which shapes) is known from the config alone and checked
    // first, so config mistakes are reported as such rather than as weight mismatches.
    let config = ModelConfig::from_file(&config_path)?;
    let weights = Weights::open(&dir)?;
    let dtypes = weights.check_layout(&config.layout)?;
    let spec = config.spec(|i, _| Ok(dtypes[i]))?;
    weights.check(&spec)?;
    Ok(LoadedModel {
        dir,
        config,
        spec,
        weights,
    })
}

/// Splits `path` into (model folder, config file). A path that is there but is neither a
/// folder nor a regular file (a FIFO, a device) is named as such rather than as missing, and
/// is never opened.
fn locate(path: &Path) -> Result<(PathBuf, PathBuf), ModelError> {
    let meta = files::stat(path).map_err(|e| match e {
        FileError::NotFound { path } => ModelError::NotFound { path },
        e => e.into(),
    })?;
    match FileKind::of(&meta) {
        Some(FileKind::Directory) => {
            let config = path.join("config.json");
            match files::stat(&config) {
                // Whatever is there is opened (and refused unless a regular file) by the reader.
                Ok(_) => Ok((path.to_path_buf(), config)),
                Err(e) if e.is_not_found() => Err(ModelError::ConfigNotFound {
                    dir: path.to_path_buf(),
                }),
                Err(e) => Err(e.into()),
            }
        }
        Some(kind) => Err(ModelError::NotAModel {
            path: path.to_path_buf(),
            kind,
        }),
        None => {
            let dir = match path.parent() {
                Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
                _ => PathBuf::from("."),
            };
            Ok((dir, path.to_path_buf()))
        }
    }
}
