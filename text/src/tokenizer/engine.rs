//! The tokenizer pipeline Kiln runs: the `tokenizers` crate's `TokenizerImpl` (normalizer,
//! pre-tokenizer, added tokens, post-processor, decoder) around either model: the flat-table
//! BPE of [`super::bpe_table`], which most files get, or any model of the crate (WordPiece,
//! Unigram, the BPE configurations the table declines, rebuilt Llama files).

use serde::{Serialize, Serializer};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use tokenizers::models::TrainerWrapper;
use tokenizers::{
    DecoderWrapper, Model, ModelWrapper, NormalizerWrapper, PostProcessorWrapper, PreTokenizerWrapper, Token,
    TokenizerBuilder, TokenizerImpl,
};

use super::bpe_table::BpeTable;

/// The tokenizer type of [`super::Tokenizer`].
pub type Engine =
    TokenizerImpl<KilnModel, NormalizerWrapper, PreTokenizerWrapper, PostProcessorWrapper, DecoderWrapper>;

/// The model of an [`Engine`].
#[derive(Clone)]
pub enum KilnModel {
    /// A BPE model in flat tables.
    Table(BpeTable),
    /// A model of the `tokenizers` crate.
    Crate(ModelWrapper),
}

/// The same pipeline as the crate's `tok`, with its model as [`KilnModel::Crate`]. The model
/// is cloned (the crate does not hand it out): the routes that get here are the rare ones.
pub fn from_crate(tok: tokenizers::Tokenizer) -> tokenizers::Result<Engine> {
    let mut engine = TokenizerBuilder::new()
        .with_model(KilnModel::Crate(tok.get_model().clone()))
        .with_normalizer(tok.get_normalizer().cloned())
        .with_pre_tokenizer(tok.get_pre_tokenizer().cloned())
        .with_post_processor(tok.get_post_processor().cloned())
        .with_decoder(tok.get_decoder().cloned())
        .with_truncation(tok.get_truncation().cloned())
        .with_padding(tok.get_padding().cloned())
        .with_added_vocabulary(tok.get_added_vocabulary().clone())
        .build()?;
    engine.set_encode_special_tokens(tok.get_encode_special_tokens());
    Ok(engine)
}

/// Calls `$body` with `$m` bound to the model inside either variant.
macro_rules! with_model {
    ($self:expr, $m:ident => $body:expr) => {
        match $self {
            KilnModel::Table($m) => $body,
            KilnModel::Crate($m) => $body,
        }
    };
}

impl Model for KilnModel {
    type Trainer = TrainerWrapper;

    fn tokenize(&self, sequence: &str) -> tokenizers::Result<Vec<Token>> {
        with_model!(self, m => m.tokenize(sequence))
    }

    fn token_to_id(&self, token: &str) -> Option<u32> {
        with_model!(self, m => m.token_to_id(token))
    }

    fn id_to_token(&self, id: u32) -> Option<String> {
        with_model!(self, m => m.id_to_token(id))
    }

    fn get_vocab(&self) -> HashMap<String, u32> {
        with_model!(self, m => m.get_vocab())
    }

    fn get_vocab_size(&self) -> usize {
        with_model!(self, m => m.get_vocab_size())
    }

    fn save(&self, folder: &Path, prefix: Option<&str>) -> tokenizers::Result<Vec<PathBuf>> {
        with_model!(self, m => m.save(folder, prefix))
    }

    fn get_trainer(&self) -> TrainerWrapper {
        with_model!(self, m => m.get_trainer())
    }
}

impl Serialize for KilnModel {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        with_model!(self, m => m.serialize(s))
    }
}
