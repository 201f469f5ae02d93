//! The chat side of the server, behind one seam over [`crate::chat`]: a conversation to a
//! prompt (the checkpoint's chat template, with `tools` and `chat_template_kwargs`), the ids
//! that end a turn (`generation_eos_ids`), and the generated text split into content,
//! reasoning and tool calls ([`OutputParser`]).
//!
//! A call the request forces (`tool_choice` `required` or a named function) is made as vLLM
//! makes it: the output is held to a JSON schema over the tools ([`Forced::schema`]) and the
//! JSON becomes the reply's tool calls at its end ([`Reply`]).
//!
//! A checkpoint without a chat template gets plain ChatML turns of the messages' text
//! (`<|im_start|>role\ncontent<|im_end|>\n`, then `<|im_start|>assistant\n`).

use std::path::Path;

use serde_json::{Map, Value, json};

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
    /// offered `tools`, or made of the output when it `forced` one.
    pub fn parser(&self, prompt: &str, tools: Option<&Value>, forced: Option<&Forced>, id: u64) -> Reply {
        let parser = OutputParser::new(ParserOptions {
            reasoning: true,
            starts_in_reasoning: prompt_opens_reasoning(prompt),
            tools: if forced.is_some() { None } else { tools.cloned() },
        });
        Reply { parser, forced: forced.cloned(), json: String::new(), id }
    }
}

/// A call the request forces through `tool_choice`.
#[derive(Clone, Debug, PartialEq)]
pub enum Forced {
    /// This function (`{"type": "function", "function": {"name": ...}}`).
    Named(String),
    /// One or more of the tools (`required`).
    Required,
}

impl Forced {
    /// The JSON schema the output is held to, over `tools` (checked to be functions): a named
    /// function's `parameters` (its arguments object; none: an empty object), or for
    /// `required` a non-empty list of `{"name", "parameters"}` objects, one of the tools each
    /// (vLLM's form).
    pub fn schema(&self, tools: &[Value]) -> Value {
        let params = |t: &Value| match &t["function"]["parameters"] {
            p @ Value::Object(_) => p.clone(),
            // A function without parameters takes no arguments.
            _ => json!({"type": "object", "properties": {}, "additionalProperties": false}),
        };
        match self {
            Forced::Named(name) => {
                tools.iter().find(|t| t["function"]["name"] == *name.as_str()).map_or(json!({}), params)
            }
            Forced::Required => {
                let each: Vec<Value> = (tools.iter())
                    .map(|t| {
                        json!({"type": "object", "additionalProperties": false, "required": ["name", "parameters"],
                               "properties": {"name": {"const": t["function"]["name"]}, "parameters": params(t)}})
                    })
                    .collect();
                json!({"type": "array", "minItems": 1, "items": {"anyOf": each}})
            }
        }
    }
}

/// The reply's splitter: the output parser's deltas, and where a call was forced, the
/// content (the JSON the structured output held it to) turned into tool calls at the end.
pub struct Reply {
    parser: OutputParser,
    forced: Option<Forced>,
    /// A forced call's JSON, as it came.
    json: String,
    /// The base of the calls' ids.
    id: u64,
}

impl Reply {
    /// The next piece of text; the deltas that are final now.
    pub fn push(&mut self, text: &str) -> Vec<Delta> {
        let deltas = self.parser.push(text);
        route(self.forced.is_some(), &mut self.json, deltas)
    }

    /// The end of the output: the deltas held back, and a forced call's tool calls.
    pub fn finish(self) -> Vec<Delta> {
        let Reply { parser, forced, mut json, id } = self;
        let mut deltas = route(forced.is_some(), &mut json, parser.finish());
        if let Some(forced) = &forced {
            deltas.extend(calls(forced, &json, id));
        }
        deltas
    }
}

/// Where a call is `forced`, content goes to its `json`; the rest passes.
fn route(forced: bool, json: &mut String, deltas: Vec<Delta>) -> Vec<Delta> {
    if !forced {
        return deltas;
    }
    (deltas.into_iter())
        .filter_map(|d| match d {
            Delta::Content(t) => {
                json.push_str(&t);
                None
            }
            d => Some(d),
        })
        .collect()
}

/// The tool calls of a forced call's JSON (as [`Forced::schema`] shaped it); JSON that does not
/// parse (an output cut at its length) stays content.
fn calls(forced: &Forced, json: &str, id: u64) -> Vec<Delta> {
    let pairs: Option<Vec<(String, Value)>> = match (forced, serde_json::from_str::<Value>(json.trim())) {
        (Forced::Named(name), Ok(args @ Value::Object(_))) => Some(vec![(name.clone(), args)]),
        (Forced::Required, Ok(Value::Array(list))) => (list.iter())
            .map(|c| Some((c["name"].as_str()?.to_string(), c.get("parameters").filter(|p| p.is_object())?.clone())))
            .collect(),
        _ => None,
    };
    let Some(pairs) = pairs else {
        return if json.is_empty() { vec![] } else { vec![Delta::Content(json.to_string())] };
    };
    (pairs.into_iter().enumerate())
        .flat_map(|(index, (name, args))| {
            let id = format!("call_{id:016x}{:08x}", index as u32);
            [Delta::ToolCallStart { index, id, name }, Delta::ToolCallArguments { index, json: args.to_string() }]
        })
        .collect()
}
