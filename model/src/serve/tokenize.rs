//! vLLM's `POST /tokenize` and `POST /detokenize`: a prompt's token ids as the server would
//! feed them to the model, and token ids back to text.

use std::sync::Arc;

use axum::body::Bytes;
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};

use super::Served;
use super::api::{self, ApiError, Fields};
use super::request;

/// `{"prompt": TEXT}` or a chat request's `{"messages": [...], "tools": ...}` (rendered with
/// the chat template, special-token text in content as the server's setting says) to `{"count",
/// "max_model_len", "tokens"}`, with `"token_strs"` (the tokenizer's own token strings) where
/// `return_token_strs` is true.
pub(super) async fn tokenize(s: Arc<Served>, body: Bytes) -> Result<Response, ApiError> {
    let (ids, strs) = s
        .blocking(move |s| {
            let m = api::parse_body(&body)?;
            let f = Fields(&m);
            let want_strs = f.bool("return_token_strs")?.unwrap_or(false);
            if f.bool("add_generation_prompt")? == Some(false) {
                return Err(ApiError::invalid(
                    Some("add_generation_prompt"),
                    "`add_generation_prompt: false` is not supported: the prompt is what a chat request feeds",
                ));
            }
            if f.bool("add_special_tokens")? == Some(true) {
                return Err(ApiError::invalid(
                    Some("add_special_tokens"),
                    "`add_special_tokens: true` is not supported: the server adds none",
                ));
            }
            let ids = match (m.get("prompt"), m.get("messages")) {
                (Some(_), Some(_)) => {
                    return Err(ApiError::invalid(Some("prompt"), "give `prompt` or `messages`, not both"));
                }
                (Some(Value::String(t)), None) => s.encode(t)?,
                (Some(_), None) => return Err(ApiError::invalid(Some("prompt"), "`prompt` must be a string")),
                (None, Some(_)) => super::chat::prepare(s, &body)?.prompt,
                (None, None) => return Err(ApiError::invalid(None, "`prompt` or `messages` is required")),
            };
            let strs: Option<Vec<String>> =
                want_strs.then(|| ids.iter().map(|&t| s.tokenizer.id_to_token(t).unwrap_or_default()).collect());
            Ok((ids, strs))
        })
        .await?;
    let mut out = json!({"count": ids.len(), "max_model_len": s.engine.info.max_len, "tokens": ids});
    if let Some(strs) = strs {
        out["token_strs"] = json!(strs);
    }
    Ok(axum::Json(out).into_response())
}

/// `{"tokens": [ids]}` to `{"prompt": TEXT}` (special tokens kept as their text); an id past
/// the vocabulary is a 400.
pub(super) async fn detokenize(s: Arc<Served>, body: Bytes) -> Result<Response, ApiError> {
    let text = s
        .blocking(move |s| {
            let m = api::parse_body(&body)?;
            let bad = |msg: String| ApiError::invalid(Some("tokens"), msg);
            let Some(Value::Array(list)) = m.get("tokens") else {
                return Err(bad("`tokens` must be a list of token ids".into()));
            };
            let vocab = s.engine.info.vocab;
            let ids = request::token_ids(list)
                .filter(|ids| ids.iter().all(|&t| (t as usize) < vocab))
                .ok_or_else(|| bad(format!("`tokens` must hold token ids below the vocabulary of {vocab}")))?;
            s.tokenizer.decode(&ids, false).map_err(|e| ApiError::internal(format!("detokenizing: {e}")))
        })
        .await?;
    Ok(axum::Json(json!({"prompt": text})).into_response())
}
