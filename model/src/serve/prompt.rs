//! The chat side of the server, behind one seam over [`crate::chat`]: a conversation to a
//! prompt (the checkpoint's chat template, with `tools` and `chat_template_kwargs`), the ids
//! that end a turn (`generation_eos_ids`), and the generated text split into content,
//! reasoning and tool calls ([`OutputParser`]).
//!
//! A checkpoint without a chat template gets plain ChatML turns of the messages' text
//! (`<|im_start|>role\ncontent<|im_end|>\n`, then `<|im_start|>assistant\n`).

use std::path::Path;

use serde_json::{Map, Value};

pub use crate::chat::Delta;
use crate::chat::{ChatTemplate, OutputParser, ParserOptions, generation_eos_ids, prompt_opens_reasoning};

/// How the served model chats.
pub struct Chat {
    template: Option<ChatTemplate>,
    eos: Vec<u32>,
}

impl Chat {
    /// The chat setup of a checkpoint directory.
    pub fn from_dir(dir: &Path) -> Result<Chat, String> {
        let template = ChatTemplate::from_dir(dir).map_err(|e| e.to_string())?;
        Ok(Chat { template, eos: generation_eos_ids(dir)? })
    }

    /// The prompt for `messages` (checked by the caller to be a non-empty list of objects
    /// with a `role`), with the generation prompt added.
    pub fn render(
        &self,
        messages: &Value,
        tools: Option<&Value>,
        kwargs: &Map<String, Value>,
    ) -> Result<String, String> {
        if let Some(t) = &self.template {
            return t.render(messages, tools, true, kwargs).map_err(|e| e.to_string());
        }
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

    /// A fresh splitter of the response to `prompt`; tool calls are parsed when the request
    /// offered `tools`.
    pub fn parser(&self, prompt: &str, tools: Option<&Value>) -> OutputParser {
        OutputParser::new(ParserOptions {
            reasoning: true,
            starts_in_reasoning: prompt_opens_reasoning(prompt),
            tools: tools.cloned(),
        })
    }
}
