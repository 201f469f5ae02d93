//! The chat side of the server, behind one seam: a conversation to a prompt, the ids that end
//! a turn, and the generated text split into what the client sees (content, reasoning, tool
//! calls).
//!
//! For now (the chat-template module is not in yet): a ChatML rendering of the messages'
//! text, the checkpoint's eos ids, and every generated piece as content.

use std::path::Path;

use serde_json::{Map, Value};

/// What the generated text turns into for a chat client.
#[derive(Clone, Debug, PartialEq)]
pub enum Delta {
    Content(String),
    Reasoning(String),
}

/// How the served model chats.
pub struct Chat {
    eos: Vec<u32>,
}

impl Chat {
    /// The chat setup of a checkpoint directory.
    pub fn from_dir(dir: &Path) -> Result<Chat, String> {
        Ok(Chat { eos: eos_ids(dir) })
    }

    /// The prompt for `messages` (checked to be a non-empty list of `{role, content}`).
    /// `tools` and `kwargs` are for the template; the fallback rendering ignores them.
    pub fn render(
        &self,
        messages: &Value,
        _tools: Option<&Value>,
        _kwargs: &Map<String, Value>,
    ) -> Result<String, String> {
        let mut prompt = String::new();
        for m in messages.as_array().into_iter().flatten() {
            let role = m["role"].as_str().unwrap_or("user");
            let content = match &m["content"] {
                Value::String(s) => s.clone(),
                Value::Array(parts) => parts.iter().filter_map(|p| p["text"].as_str()).collect(),
                _ => String::new(),
            };
            prompt.push_str(&format!("<|im_start|>{role}\n{content}<|im_end|>\n"));
        }
        prompt.push_str("<|im_start|>assistant\n");
        Ok(prompt)
    }

    /// The token ids that end a generation.
    pub fn stop_ids(&self) -> Vec<u32> {
        self.eos.clone()
    }

    /// A fresh splitter of one response's text.
    pub fn parser(&self) -> Parser {
        Parser
    }
}

/// Splits one response's text as it streams.
pub struct Parser;

impl Parser {
    pub fn push(&mut self, text: &str) -> Vec<Delta> {
        if text.is_empty() { vec![] } else { vec![Delta::Content(text.to_string())] }
    }

    pub fn finish(self) -> Vec<Delta> {
        vec![]
    }
}

/// The end-of-sequence ids config.json names (a number or a list), if any.
pub fn eos_ids(dir: &Path) -> Vec<u32> {
    let text = std::fs::read_to_string(dir.join("config.json")).unwrap_or_default();
    let v: Value = serde_json::from_str(&text).unwrap_or_default();
    match &v["eos_token_id"] {
        Value::Number(n) => n.as_u64().map(|n| vec![n as u32]).unwrap_or_default(),
        Value::Array(a) => a.iter().filter_map(|n| n.as_u64()).map(|n| n as u32).collect(),
        _ => Vec::new(),
    }
}
