//! Hyperparameters most architectures read the same way, with each format's semantics: a
//! Hugging Face config falls back to the class defaults of the architecture's table row, a GGUF
//! file to llama.cpp's defaults (or has the key required).

use super::Defaults;
use super::params::{ArchError, Cfg, MAX_DIM, MAX_LAYERS, MAX_POSITIONS, keys};
use crate::ops::Act;
use crate::spec::Dims;

/// The attention shape: query heads, key/value heads, head size.
#[derive(Clone, Copy, Debug)]
pub struct Heads {
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
}

/// The shape hyperparameters decoders of the Llama lineage read under the standard keys.
pub struct Shape {
    pub hidden: usize,
    pub intermediate: usize,
    pub layers: usize,
    pub vocab: usize,
    pub heads: Heads,
    pub max_positions: usize,
}

/// [`Shape`] from `hidden_size`, `intermediate_size`, `num_hidden_layers`, the vocabulary, the
/// heads and `max_position_embeddings` (GGUF: their llama.cpp names), checked in that order.
pub fn shape(c: Cfg, d: &Defaults) -> Result<Shape, ArchError> {
    let hidden = hidden(c, keys::HIDDEN)?;
    let intermediate = self::hidden(c, keys::INTERMEDIATE)?;
    let layers = layers(c, keys::LAYERS)?;
    let vocab = vocab(c, "token_embd.weight", hidden)?;
    let heads = heads(c, d, hidden, keys::HEADS)?;
    let max_positions = max_positions(c, d, keys::MAX_POSITIONS)?;
    Ok(Shape {
        hidden,
        intermediate,
        layers,
        vocab,
        heads,
        max_positions,
    })
}

/// The dimensions a decoder's spec records, from the hyperparameters read and checked above.
pub fn dims(hidden: usize, intermediate: usize, layers: usize, h: &Heads, vocab: usize, max_positions: usize) -> Dims {
    Dims {
        hidden_size: hidden,
        intermediate_size: intermediate,
        num_layers: layers,
        num_heads: h.heads,
        num_kv_heads: h.kv_heads,
        head_dim: h.head_dim,
        vocab_size: vocab,
        max_position_embeddings: max_positions,
    }
}

/// `hidden_size` (or the arch's own key), checked positive.
pub fn hidden(c: Cfg, key: super::Key) -> Result<usize, ArchError> {
    let v = c.dim(key)?;
    c.positive_dim(key, v)
}

/// `num_hidden_layers` (GGUF `block_count`).
pub fn layers(c: Cfg, key: super::Key) -> Result<usize, ArchError> {
    let v = c.req_usize(key, MAX_LAYERS)?;
    c.positive_dim(key, v)
}

/// Heads, key/value heads and head size. Hugging Face: an absent `num_key_value_heads` takes
/// the class default, a null one `num_attention_heads`; `head_dim` absent takes the class
/// default or `hidden / heads`. GGUF: `head_count_kv` absent = `head_count`; `key_length`
/// absent = `hidden / heads`; `value_length` must equal the key length.
pub fn heads(c: Cfg, d: &Defaults, hidden: usize, heads_key: super::Key) -> Result<Heads, ArchError> {
    let heads = c.dim(heads_key)?;
    let kv_heads = match c.usize(keys::KV_HEADS, MAX_DIM)? {
        Some(n) => n,
        None if c.is_gguf() || c.present(keys::KV_HEADS) => heads,
        None => d.kv_heads.unwrap_or(heads),
    };
    let derived = || -> Result<usize, ArchError> {
        if heads == 0 {
            return Ok(0); // reported below
        }
        if !hidden.is_multiple_of(heads) {
            return Err(c.config_error(format!(
                "{} ({hidden}) is not a multiple of {} ({heads}) and {} is not given",
                c.name(keys::HIDDEN),
                c.name(heads_key),
                c.name(keys::HEAD_DIM)
            )));
        }
        Ok(hidden / heads)
    };
    let head_dim = match c.usize(keys::HEAD_DIM, MAX_DIM)? {
        Some(v) => v,
        None if !c.is_gguf() && !c.present(keys::HEAD_DIM) => match d.head_dim {
            Some(v) => v,
            None => derived()?,
        },
        None => derived()?,
    };
    c.positive_dim(heads_key, heads)?;
    c.positive_dim(keys::KV_HEADS, kv_heads)?;
    c.positive_dim(keys::HEAD_DIM, head_dim)?;
    if !heads.is_multiple_of(kv_heads) {
        return Err(c.config_error(format!(
            "{} ({heads}) must be a multiple of {} ({kv_heads})",
            c.name(heads_key),
            c.name(keys::KV_HEADS)
        )));
    }
    if let Some(v) = c.usize(keys::VALUE_DIM, MAX_DIM)?
        && v != head_dim
    {
        return Err(c.unsupported(format!(
            "{} = {v} different from the key length {head_dim}",
            c.name(keys::VALUE_DIM)
        )));
    }
    Ok(Heads {
        heads,
        kv_heads,
        head_dim,
    })
}

/// The context limit: Hugging Face falls back to the class default, GGUF requires it.
pub fn max_positions(c: Cfg, d: &Defaults, key: super::Key) -> Result<usize, ArchError> {
    let v = match c.usize(key, MAX_POSITIONS)? {
        Some(v) => v,
        None if c.is_gguf() => return Err(c.missing(key)),
        None => d.max_positions,
    };
    c.positive_dim(key, v)
}

/// A norm epsilon: Hugging Face falls back to `default`, GGUF requires it.
pub fn eps(c: Cfg, key: super::Key, default: f64) -> Result<f32, ArchError> {
    match c.non_negative(key)? {
        Some(v) => Ok(v as f32),
        None if c.is_gguf() => Err(c.missing(key)),
        None => Ok(default as f32),
    }
}

/// The vocabulary: `vocab_size` of a Hugging Face config; in GGUF the rows of the embedding
/// table `embed` (whose columns must be `hidden`), which `{a}.vocab_size`, if present, must
/// equal.
pub fn vocab(c: Cfg, embed: &str, hidden: usize) -> Result<usize, ArchError> {
    if !c.is_gguf() {
        let v = c.dim(keys::VOCAB)?;
        return c.positive_dim(keys::VOCAB, v);
    }
    let shape =
        c.p.tensor_shape(embed)
            .ok_or_else(|| ArchError::MissingTensor { name: embed.into() })?;
    let vocab = match shape[..] {
        [rows, cols] if cols == hidden => rows,
        _ => {
            return Err(ArchError::TensorShape {
                name: embed.into(),
                expected: vec![shape.first().copied().unwrap_or(0), hidden],
                found: shape,
            });
        }
    };
    if vocab == 0 || vocab > MAX_DIM {
        return Err(c.config_error(format!("{embed} has {vocab} rows (expected 1 to {MAX_DIM})")));
    }
    if let Some(v) = c.usize(keys::VOCAB, usize::MAX)?
        && v != vocab
    {
        return Err(c.config_error(format!("{} is {v}, but {embed} has {vocab} rows", c.name(keys::VOCAB))));
    }
    Ok(vocab)
}

/// Whether the output head is the embedding: a Hugging Face config's flag (else the class
/// default); in GGUF, the absence of the head tensor `head`.
pub fn tied(c: Cfg, d: &Defaults, head: &str) -> Result<bool, ArchError> {
    if c.is_gguf() {
        return Ok(c.p.tensor_shape(head).is_none());
    }
    Ok(c.bool(keys::TIE)?.unwrap_or(d.tie))
}

/// The activation a config names in `key` (else `default`), refusing names Kiln does not
/// implement.
pub fn activation(c: Cfg, key: super::Key, default: &str) -> Result<Act, ArchError> {
    let name = c.str(key)?.unwrap_or_else(|| default.to_string());
    Act::from_hf(&name).ok_or_else(|| c.unsupported(format!("{} '{name}' (supported: {})", c.name(key), Act::HF_NAMES)))
}

/// Whether a GGUF file has a tensor (always false for a Hugging Face folder, whose presence
/// of optional tensors the config states).
pub fn has_tensor(c: Cfg, name: &str) -> bool {
    c.is_gguf() && c.p.tensor_shape(name).is_some()
}

/// A window at least as long as the context never excludes anything: recorded as none.
pub fn effective_window(w: Option<usize>, max_positions: usize) -> Option<usize> {
    w.filter(|&w| w < max_positions)
}

/// Hugging Face's per-layer kinds (`layer_types`), e.g. `full_attention` / `sliding_attention`.
const LAYER_TYPES: super::Key = super::Key::hf("layer_types");

/// `layer_types` read as one flag per layer, each name mapped by `kinds` (`(name, flag)`);
/// `None` without the key. A wrong count, or a name `kinds` lacks, is an error naming it.
pub fn layer_types(c: Cfg, layers: usize, kinds: &[(&str, bool)]) -> Result<Option<Vec<bool>>, ArchError> {
    let Some(types) = c.strings(LAYER_TYPES)? else {
        return Ok(None);
    };
    if types.len() != layers {
        return Err(c.invalid(
            LAYER_TYPES,
            format!(
                "has {} entries, expected one per layer (num_hidden_layers = {layers})",
                types.len()
            ),
        ));
    }
    let names: Vec<&str> = kinds.iter().map(|(name, _)| *name).collect();
    types
        .iter()
        .enumerate()
        .map(|(i, t)| match kinds.iter().find(|(name, _)| name == t) {
            Some((_, flag)) => Ok(*flag),
            None => Err(c.unsupported(format!(
                "layer type \"{t}\" (layer_types[{i}]; supported: {})",
                names.join(", ")
            ))),
        })
        .collect::<Result<Vec<bool>, ArchError>>()
        .map(Some)
}
