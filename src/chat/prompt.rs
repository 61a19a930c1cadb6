//! The pieces of a chat turn that `kiln run --chat` shares with `kiln chat`: the model's
//! template, rendering one turn, whether to ask for reasoning, and the ids that end a turn.

use anyhow::{Result, anyhow};
use kiln_text::chat_template::{ChatTemplate, Message, RenderOptions};
use kiln_text::generate;
use kiln_text::tokenizer::Tokenizer;
use std::path::Path;

/// Special tokens that end an assistant turn in the common chat formats. Generation in chat
/// mode stops at those the tokenizer has, besides the model's EOS ids: a small model's
/// `generation_config.json` does not always list its end-of-turn token.
const END_OF_TURN_TOKENS: [&str; 6] = [
    "<|im_end|>",
    "<|eot_id|>",
    "<|end|>",
    "<end_of_turn>",
    "<|end_of_text|>",
    "<|endoftext|>",
];

/// `eos` plus the end-of-turn special tokens of [`END_OF_TURN_TOKENS`] that the tokenizer has.
pub fn chat_stop_ids(tokenizer: &Tokenizer, mut eos: Vec<u32>) -> Vec<u32> {
    for name in END_OF_TURN_TOKENS {
        if let Some(id) = tokenizer.token_to_id(name)
            && tokenizer.is_special(id)
            && !eos.contains(&id)
        {
            eos.push(id);
        }
    }
    eos
}

/// The model's chat template, or an error naming `model` and what to do instead (`hint`).
pub fn load_template(tokenizer: &Tokenizer, model: &Path, hint: &str) -> Result<ChatTemplate> {
    ChatTemplate::from_tokenizer(tokenizer)?.ok_or_else(|| {
        anyhow!(
            "model {} has no chat template (no chat_template in tokenizer_config.json, no chat_template.jinja); {hint}",
            model.display()
        )
    })
}

/// `enable_thinking` for a template: asked for when the template reads the variable (Qwen3),
/// left undefined otherwise.
pub fn thinking_option(tokenizer: &Tokenizer, think: bool) -> Option<bool> {
    tokenizer
        .chat_template()
        .is_some_and(|t| t.contains("enable_thinking"))
        .then_some(think)
}

/// A rendered prompt of one or more turns.
pub struct ChatPrompt {
    pub text: String,
    /// The prompt ends inside an open `<think>` block: the reply starts with reasoning.
    pub opens_thinking: bool,
}

/// Renders `system` (if any) and one user turn with the generation prompt (`kiln run --chat`).
pub fn render_single(
    template: &ChatTemplate,
    options: &RenderOptions,
    system: Option<&str>,
    user: &str,
) -> Result<ChatPrompt> {
    let mut messages = Vec::new();
    if let Some(s) = system {
        messages.push(Message::system(s));
    }
    messages.push(Message::user(user));
    let text = template.render(&messages, options)?;
    Ok(ChatPrompt {
        opens_thinking: generate::prompt_opens_thinking(&text),
        text,
    })
}
