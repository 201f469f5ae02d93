//! Chat: what an OpenAI-style server (or `generate --chat`) needs around the engine.
//!
//! - [`ChatTemplate`]: a checkpoint's Jinja chat template rendered as transformers'
//!   `apply_chat_template` renders it (messages, tools, `add_generation_prompt`,
//!   `chat_template_kwargs` such as `enable_thinking`).
//! - [`generation_eos_ids`]: the token ids that end a turn.
//! - [`StopMatcher`]: `stop` strings over streamed text.
//! - [`OutputParser`]: streamed output split into reasoning (`<think>`), content and tool
//!   calls (the qwen3_coder XML format Nemotron-3 Nano writes).
//!
//! - [`Detok`]: generated ids to text a token at a time (UTF-8 safe: a character split over
//!   tokens comes out once whole), special tokens skipped but the tags the parser reads
//!   (`<think>`, `<tool_call>` and their ends), special or not; [`TokenBytes`]: each token's
//!   own bytes; [`turn_start`]: the token that starts a turn.
//!
//! A server's order (and [`crate::text::Llm`]'s): tokens through a [`Detok`]; that text
//! through a [`StopMatcher`]; what it lets through into an [`OutputParser`]. The eos ids
//! ([`generation_eos_ids`]) go to the engine as stop tokens.

mod detok;
mod parse;
mod python;
mod stop;
mod template;
mod tool_call;

use std::path::Path;

pub use detok::{Detok, TokenBytes};
pub use parse::{Delta, Message, OutputParser, ParserOptions, ToolCall};
pub use stop::StopMatcher;
pub use template::ChatTemplate;

/// The ids that end generation: `eos_token_id` of generation_config.json (an id or a list)
/// then of config.json, without repeats. A missing file or field adds nothing; a file that
/// cannot be read or is not JSON, or an `eos_token_id` that is not token ids, is an error
/// naming the file.
pub fn generation_eos_ids(dir: &Path) -> Result<Vec<u32>, String> {
    let mut ids = Vec::new();
    for file in ["generation_config.json", "config.json"] {
        let path = dir.join(file);
        let text = match std::fs::read_to_string(&path) {
            Ok(text) => text,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(e) => return Err(format!("reading {}: {e}", path.display())),
        };
        let v: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| format!("{} is not valid JSON: {e}", path.display()))?;
        let id = |n: &serde_json::Value| n.as_u64().and_then(|n| u32::try_from(n).ok());
        let found: Option<Vec<u32>> = match &v["eos_token_id"] {
            serde_json::Value::Null => Some(vec![]),
            serde_json::Value::Array(a) => a.iter().map(id).collect(),
            n => id(n).map(|n| vec![n]),
        };
        let Some(found) = found else {
            return Err(format!(
                "{}: `eos_token_id` must be a token id or a list of them, not {}",
                path.display(),
                v["eos_token_id"]
            ));
        };
        for id in found {
            if !ids.contains(&id) {
                ids.push(id);
            }
        }
    }
    Ok(ids)
}

/// The id of the token that starts a chat turn, `<|im_start|>` (ChatML's, Nemotron's
/// templates'), where the tokenizer has it: the prefix cache's
/// [`crate::prefix::PrefixSettings::turn_start`].
pub fn turn_start(tokenizer: &tokenizers::Tokenizer) -> Option<u32> {
    tokenizer.token_to_id("<|im_start|>")
}

/// Whether a rendered prompt leaves the model inside a `<think>` block (its last `<think>`
/// comes after its last `</think>`), as a thinking-enabled template's generation prompt
/// (`<|im_start|>assistant\n<think>\n`) does: then the output starts as reasoning
/// ([`ParserOptions::starts_in_reasoning`]).
pub fn prompt_opens_reasoning(prompt: &str) -> bool {
    match (prompt.rfind("<think>"), prompt.rfind("</think>")) {
        (Some(open), Some(close)) => open > close,
        (Some(_), None) => true,
        _ => false,
    }
}
