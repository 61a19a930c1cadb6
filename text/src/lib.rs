//! Text around the engine: tokenizers (Hugging Face `tokenizer.json` and GGUF vocabularies), chat
//! templates rendered as `transformers` renders them, sampling, and the generation loop that
//! streams text while the engine produces logits.

pub mod chat_template;
pub mod generate;
pub mod sampler;
pub mod tokenizer;
