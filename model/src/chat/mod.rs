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
//! A server's order: tokens through the tokenizer's decode stream (`Tokenizer::decode_stream`,
//! UTF-8 safe: a character split over tokens comes out once whole; the project has no other
//! streaming detokenizer), keeping the tags the parser reads (`<think>`, `<tool_call>`: the
//! built-in tokenizer does not mark them special, so `decode_stream(true)` keeps them; for a
//! tokenizer that marks them special, decode with `false` and leave the eos token out); that
//! text through a [`StopMatcher`]; what it lets through into an [`OutputParser`]. The eos ids
//! ([`generation_eos_ids`]) go to the engine as stop tokens.

mod parse;
mod python;
mod stop;
mod template;
mod tool_call;

use std::path::Path;

pub use parse::{Delta, Message, OutputParser, ParserOptions, ToolCall};
pub use stop::StopMatcher;
pub use template::ChatTemplate;

/// The ids that end generation: `eos_token_id` of generation_config.json (an id or a list)
/// then of config.json, without repeats. Missing or unreadable files and fields add nothing.
pub fn generation_eos_ids(dir: &Path) -> Vec<u32> {
    let mut ids = Vec::new();
    for file in ["generation_config.json", "config.json"] {
        let Ok(text) = std::fs::read_to_string(dir.join(file)) else { continue };
        let Ok(v) = serde_json::from_str::<serde_json::Value>(&text) else { continue };
        let found: Vec<u64> = match &v["eos_token_id"] {
            serde_json::Value::Array(a) => a.iter().filter_map(|n| n.as_u64()).collect(),
            n => n.as_u64().into_iter().collect(),
        };
        let found = found.into_iter().filter_map(|n| u32::try_from(n).ok());
        for id in found {
            if !ids.contains(&id) {
                ids.push(id);
            }
        }
    }
    ids
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
