//! `POST /v1/chat/completions`.

use std::sync::Arc;

use axum::body::Bytes;
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};
use tokio::sync::mpsc;

use super::api::{self, ApiError, Fields};
use super::generation::{Out, TokenOut, sse};
use super::prompt::{Delta, Forced};
use super::request::{self, Common};
use super::{Served, fresh, now};
use crate::chat::TokenBytes;
use crate::engine::Constraint;
use crate::structured::Format;

/// A chat request checked, its messages rendered with the chat template and tokenized.
pub(super) struct Prepared {
    c: Common,
    pub(super) prompt: Vec<u32>,
    /// The rendered prompt (the output parser starts from its end).
    text: String,
    /// The tools whose calls the output is parsed for.
    parse_tools: Option<Value>,
    /// The call `tool_choice` forces.
    forced: Option<Forced>,
    /// The structured output's constraint.
    constraint: Option<Box<dyn Constraint>>,
}

/// The blocking part of a chat request (parsing, checks, the template, the tokenizer): run on
/// the blocking pool ([`Served::blocking`]), never on the async threads.
pub(super) fn prepare(s: &Served, body: &[u8]) -> Result<Prepared, ApiError> {
    let m = api::parse_body(body)?;
    let f = Fields(&m);
    let c = request::common(&f, true, fresh(), &s.limits)?;
    s.check_model(&c)?;
    let messages = m.get("messages").ok_or_else(|| ApiError::invalid(Some("messages"), "`messages` is required"))?;
    check_messages(messages)?;
    let tools = match m.get("tools") {
        None | Some(Value::Null) => None,
        Some(t @ Value::Array(list)) => {
            check_tools(list)?;
            Some(t)
        }
        Some(_) => return Err(ApiError::invalid(Some("tools"), "`tools` must be a list")),
    };
    let kwargs = f.object("chat_template_kwargs")?.cloned().unwrap_or_default();
    // `tool_choice: "none"`: the tools stay in the prompt, their calls are not parsed;
    // `required` or a named function: the output is held to a schema over the tools, and its
    // JSON made the calls (as vLLM does).
    let listed = tools.and_then(Value::as_array).map_or(&[][..], Vec::as_slice);
    let bad_choice = |why: String| Err(ApiError::invalid(Some("tool_choice"), why));
    let (parse_tools, forced) = match f.get_raw("tool_choice") {
        None => (tools, None),
        Some(Value::String(c)) if c == "auto" => (tools, None),
        Some(Value::String(c)) if c == "none" => (None, None),
        Some(Value::String(c)) if c == "required" && !listed.is_empty() => (tools, Some(Forced::Required)),
        Some(Value::String(c)) if c == "required" => {
            return bad_choice("`tool_choice` `required` needs `tools`".into());
        }
        Some(c @ Value::Object(_)) if c["type"] == "function" && c["function"]["name"].is_string() => {
            let name = c["function"]["name"].as_str().unwrap_or_default();
            if !listed.iter().any(|t| t["function"]["name"] == name) {
                return bad_choice(format!("`tool_choice` names `{name}`, which is not among `tools`"));
            }
            (tools, Some(Forced::Named(name.to_string())))
        }
        Some(c) => {
            return bad_choice(format!(
                "`tool_choice` must be `auto`, `none`, `required` or {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}, not {c}"
            ));
        }
    };
    f.refuse(&["functions", "function_call"], "pass `tools`")?;
    let mut c = c;
    if let Some(forced) = &forced {
        if let Some((_, field)) = &c.format {
            return Err(ApiError::invalid(
                Some(field),
                format!("`{field}` and a forced `tool_choice`: one or the other"),
            ));
        }
        c.format = Some((Format::JsonSchema(forced.schema(listed)), "tool_choice".into()));
    }
    let p = s.special.prompt((&s.chat, &s.tokenizer), messages, tools, &kwargs)?;
    let constraint = s.constraint(&c, crate::chat::prompt_opens_reasoning(&p.text))?;
    Ok(Prepared { c, prompt: p.ids, text: p.text, parse_tools: parse_tools.cloned(), forced, constraint })
}

pub(super) async fn handle(s: Arc<Served>, body: Bytes) -> Result<Response, ApiError> {
    let Prepared { c, prompt, text, parse_tools, forced, constraint } = s.blocking(move |s| prepare(s, &body)).await?;
    let new_parser = {
        let chat = s.clone();
        move || chat.chat.parser(&text, parse_tools.as_ref(), forced.as_ref(), fresh())
    };
    let (id, created) = (format!("chatcmpl-{:016x}", fresh()), now());
    let mut g = s.start(&c, (prompt, constraint), "messages", &id)?;
    if !c.stream {
        let mut parser = new_parser();
        let (mut deltas, mut logprobs, mut finish, mut stop_reason) = (vec![], vec![], "stop", Value::Null);
        let bytes = c.sampling.logprobs.then(|| TokenBytes::new(&s.tokenizer));
        while let Some(p) = g.next().await? {
            deltas.extend(parser.push(&p.text));
            if let (Some(bytes), Some(t)) = (&bytes, &p.token) {
                logprobs.push(s.chat_logprob(bytes, t, c.token_ids));
            }
            if let Some(f) = p.finish {
                (finish, stop_reason) = (f, p.stop_reason);
            }
        }
        deltas.extend(parser.finish());
        let m = crate::chat::Message::from_deltas(deltas);
        let mut message = json!({"role": "assistant", "content": m.content});
        if let Some(r) = &m.reasoning {
            set_reasoning(&mut message, r);
        }
        if !m.tool_calls.is_empty() {
            message["tool_calls"] = m
                .tool_calls
                .iter()
                .map(|t| json!({"id": t.id, "type": "function", "function": {"name": t.name, "arguments": t.arguments_json}}))
                .collect();
        }
        let finish = finish_reason(finish, !m.tool_calls.is_empty());
        let logprobs = if c.sampling.logprobs { json!({"content": logprobs}) } else { Value::Null };
        let body = json!({
            "id": id, "object": "chat.completion", "created": created, "model": s.name,
            "choices": [{"index": 0, "message": message, "logprobs": logprobs, "finish_reason": finish,
                         "stop_reason": stop_reason}],
            "usage": g.usage(),
        });
        return Ok(axum::Json(body).into_response());
    }
    let (tx, rx) = mpsc::channel(64);
    tokio::spawn(async move {
        let out = Out(tx);
        let usage_field = c.include_usage;
        let chunk = |delta: Value, logprobs: Value, finish: Option<&str>, stop_reason: Value| {
            let mut v = json!({
                "id": id, "object": "chat.completion.chunk", "created": created, "model": s.name,
                "choices": [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish,
                             "stop_reason": stop_reason}],
            });
            if usage_field {
                v["usage"] = Value::Null;
            }
            v
        };
        if !out.send(&chunk(json!({"role": "assistant", "content": ""}), Value::Null, None, Value::Null)).await {
            return;
        }
        let mut parser = Some(new_parser());
        let (mut pending, mut called) = (vec![], false);
        let bytes = c.sampling.logprobs.then(|| TokenBytes::new(&s.tokenizer));
        loop {
            let piece = match out.piece(&mut g).await {
                None => return,
                Some(Some(p)) => p,
                Some(None) => break,
            };
            if let (Some(bytes), Some(t)) = (&bytes, &piece.token) {
                pending.push(s.chat_logprob(bytes, t, c.token_ids));
            }
            let Some(p) = parser.as_mut() else { break };
            let mut deltas = p.push(&piece.text);
            if piece.finish.is_some() {
                deltas.extend(parser.take().expect("there until the finish").finish());
            }
            for d in deltas {
                called |= matches!(d, Delta::ToolCallStart { .. });
                let delta = match d {
                    Delta::Content(t) => json!({"content": t}),
                    Delta::Reasoning(t) => {
                        let mut v = json!({});
                        set_reasoning(&mut v, &t);
                        v
                    }
                    Delta::ToolCallStart { index, id, name } => json!({"tool_calls": [{
                        "index": index, "id": id, "type": "function", "function": {"name": name, "arguments": ""}}]}),
                    Delta::ToolCallArguments { index, json } => {
                        json!({"tool_calls": [{"index": index, "function": {"arguments": json}}]})
                    }
                };
                let lp =
                    if pending.is_empty() { Value::Null } else { json!({"content": std::mem::take(&mut pending)}) };
                if !out.send(&chunk(delta, lp, None, Value::Null)).await {
                    return;
                }
            }
            if let Some(finish) = piece.finish {
                let finish = finish_reason(finish, called);
                let lp =
                    if pending.is_empty() { Value::Null } else { json!({"content": std::mem::take(&mut pending)}) };
                if !out.send(&chunk(json!({}), lp, Some(finish), piece.stop_reason.clone())).await {
                    return;
                }
            }
        }
        let head = json!({"id": id, "object": "chat.completion.chunk", "created": created, "model": s.name});
        out.finish(head, usage_field.then(|| g.usage())).await;
    });
    Ok(sse(rx))
}

/// The finish reason of a generation that wrote a tool call (`called`) or not: a turn that
/// ended by itself after a call ends for the call.
fn finish_reason(finish: &'static str, called: bool) -> &'static str {
    if finish == "stop" && called { "tool_calls" } else { finish }
}

/// Reasoning text in a message or delta: under vLLM's name for it, `reasoning`, and its
/// former one, `reasoning_content`, which clients still read.
fn set_reasoning(v: &mut Value, text: &str) {
    for key in ["reasoning", "reasoning_content"] {
        v[key] = json!(text);
    }
}

/// `messages` must be a non-empty list of objects with a string `role`.
fn check_messages(messages: &Value) -> Result<(), ApiError> {
    let bad = |m: String| Err(ApiError::invalid(Some("messages"), m));
    let Some(list) = messages.as_array() else { return bad("`messages` must be a list".into()) };
    if list.is_empty() {
        return bad("`messages` must not be empty".into());
    }
    for (i, m) in list.iter().enumerate() {
        if !m.get("role").is_some_and(Value::is_string) {
            return bad(format!("`messages[{i}]` must be an object with a string `role`"));
        }
        match m.get("content") {
            None | Some(Value::Null | Value::String(_)) => {}
            Some(Value::Array(parts)) => {
                // The template takes the text of each part: any other part would vanish.
                if let Some(j) = parts.iter().position(|p| p["type"] != "text" || !p["text"].is_string()) {
                    return bad(format!(
                        "`messages[{i}].content[{j}]` must be a text part, {{\"type\": \"text\", \"text\": ...}}: \
                         this server takes no images, audio or files"
                    ));
                }
            }
            Some(_) => return bad(format!("`messages[{i}].content` must be a string or a list of parts")),
        }
    }
    Ok(())
}

/// `tools`: a list of `{"type": "function", "function": {"name": ...}}` (the template renders
/// each function; anything else would be rendered as garbage or dropped).
fn check_tools(tools: &[Value]) -> Result<(), ApiError> {
    for (i, t) in tools.iter().enumerate() {
        if t["type"] != "function" || !t["function"]["name"].is_string() {
            return Err(ApiError::invalid(
                Some("tools"),
                format!("`tools[{i}]` must be {{\"type\": \"function\", \"function\": {{\"name\": ..., ...}}}}"),
            ));
        }
    }
    Ok(())
}

impl Served {
    /// Chat's logprobs entry for one token, its bytes (and its top tokens') from `bytes` (made
    /// once a request: it reads the tokenizer's added tokens).
    fn chat_logprob(&self, bytes: &TokenBytes, t: &TokenOut, as_id: bool) -> Value {
        let entry =
            |id: u32, lp: f32| json!({"token": self.token_name(id, as_id), "logprob": lp, "bytes": bytes.of(id)});
        let mut e = entry(t.id, t.logprob.unwrap_or(0.0));
        e["top_logprobs"] = t.top.iter().map(|&(id, lp)| entry(id, lp)).collect();
        e
    }
}
