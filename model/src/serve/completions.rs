//! `POST /v1/completions`.

use std::sync::Arc;

use axum::body::Bytes;
use axum::response::{IntoResponse, Response};
use serde_json::{Map, Value, json};
use tokio::sync::mpsc;

use super::api::{self, ApiError, Fields};
use super::generation::{Out, Piece, TokenOut, sse};
use super::request::{self, Common};
use super::{Served, Submission, fresh, now};

/// The completions prompt: a string, a list of token ids, or either alone in a list.
fn completion_prompt(s: &Served, m: &Map<String, Value>) -> Result<Vec<u32>, ApiError> {
    let bad = |msg: &str| Err(ApiError::invalid(Some("prompt"), msg.to_string()));
    match m.get("prompt") {
        None | Some(Value::Null) => bad("`prompt` is required"),
        Some(Value::String(t)) => s.encode(t),
        Some(Value::Array(a)) if a.first().is_some_and(Value::is_number) => request::token_ids(a)
            .map_or_else(|| bad("`prompt` as a list must hold token ids (non-negative integers)"), Ok),
        Some(Value::Array(a)) if a.len() == 1 => match &a[0] {
            Value::String(t) => s.encode(t),
            Value::Array(t) => request::token_ids(t).map_or_else(|| bad("`prompt[0]` must hold token ids"), Ok),
            _ => bad("`prompt[0]` must be a string or a list of token ids"),
        },
        Some(Value::Array(a)) if a.is_empty() => bad("`prompt` is empty"),
        Some(Value::Array(_)) => bad("`prompt` must be one prompt: a batch of several is not supported"),
        Some(_) => bad("`prompt` must be a string or a list of token ids"),
    }
}

/// The blocking part of a completions request (parsing, checks, the tokenizer): run on the
/// blocking pool ([`Served::blocking`]), never on the async threads.
fn prepare(s: &Served, body: &[u8]) -> Result<(Common, Submission), ApiError> {
    let m = api::parse_body(body)?;
    let f = Fields(&m);
    let c = request::common(&f, false, fresh(), &s.limits)?;
    s.check_model(&c)?;
    if f.bool("echo")? == Some(true) {
        return Err(ApiError::invalid(Some("echo"), "`echo` is not supported"));
    }
    if f.str("suffix")?.is_some() {
        return Err(ApiError::invalid(Some("suffix"), "`suffix` is not supported"));
    }
    let prompt = completion_prompt(s, &m)?;
    let constraint = s.constraint(&c, false)?;
    Ok((c, (prompt, constraint)))
}

pub(super) async fn handle(s: Arc<Served>, body: Bytes) -> Result<Response, ApiError> {
    let (c, prompt) = s.blocking(move |s| prepare(s, &body)).await?;

    let (id, created) = (format!("cmpl-{:016x}", fresh()), now());
    let mut g = s.start(&c, prompt, "prompt", &id)?;
    if !c.stream {
        let (mut text, mut tokens, mut finish, mut chars) = (String::new(), vec![], "stop", 0);
        let mut stop_reason = Value::Null;
        while let Some(p) = g.next().await? {
            tokens.extend(p.token.map(|t| (chars, t)));
            chars += p.text.chars().count();
            text += &p.text;
            if let Some(f) = p.finish {
                (finish, stop_reason) = (f, p.stop_reason);
            }
        }
        let lp = completion_logprobs(&s, &c, &tokens);
        let body = json!({
            "id": id, "object": "text_completion", "created": created, "model": s.name,
            "choices": [{"index": 0, "text": text, "logprobs": lp, "finish_reason": finish, "stop_reason": stop_reason}],
            "usage": g.usage(),
        });
        return Ok(axum::Json(body).into_response());
    }
    let (tx, rx) = mpsc::channel(64);
    tokio::spawn(async move {
        let out = Out(tx);
        let chunk = |text: &str, lp: Value, finish: Option<&str>, stop_reason: &Value| {
            let mut v = json!({
                "id": id, "object": "text_completion", "created": created, "model": s.name,
                "choices": [{"index": 0, "text": text, "logprobs": lp, "finish_reason": finish,
                             "stop_reason": stop_reason}],
            });
            if c.include_usage {
                v["usage"] = Value::Null;
            }
            v
        };
        let (mut offset, mut pending) = (0, vec![]);
        loop {
            let Piece { text, token, finish, stop_reason } = match out.piece(&mut g).await {
                None => return,
                Some(Some(p)) => p,
                Some(None) => break,
            };
            pending.extend(token.map(|t| (offset, t)));
            offset += text.chars().count();
            // A token whose text is held back has its logprobs sent with the next text.
            if text.is_empty() && finish.is_none() {
                continue;
            }
            let lp = completion_logprobs(&s, &c, &std::mem::take(&mut pending));
            if !out.send(&chunk(&text, lp, finish, &stop_reason)).await {
                return;
            }
        }
        let head = json!({"id": id, "object": "text_completion", "created": created, "model": s.name});
        out.finish(head, c.include_usage.then(|| g.usage())).await;
    });
    Ok(sse(rx))
}

/// Completions' logprobs for some tokens, each with its offset in the text in characters (as
/// OpenAI and vLLM count them; a token whose text is held back, part of a character, gets the
/// offset where its text will start).
fn completion_logprobs(s: &Served, c: &Common, pieces: &[(usize, TokenOut)]) -> Value {
    if !c.sampling.logprobs {
        return Value::Null;
    }
    let names = pieces.iter().map(|(_, t)| s.token_name(t.id, c.token_ids)).collect::<Vec<_>>();
    let top: Vec<Value> = pieces
        .iter()
        .map(|(_, t)| Value::Object(t.top.iter().map(|&(id, lp)| (s.token_name(id, c.token_ids), json!(lp))).collect()))
        .collect();
    json!({
        "tokens": names,
        "token_logprobs": pieces.iter().map(|(_, t)| t.logprob).collect::<Vec<_>>(),
        "top_logprobs": if c.sampling.top_logprobs > 0 { json!(top) } else { Value::Null },
        "text_offset": pieces.iter().map(|(o, _)| *o).collect::<Vec<_>>(),
    })
}
