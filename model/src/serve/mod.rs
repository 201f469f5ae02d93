//! An OpenAI-compatible HTTP server over the [`Engine`](crate::engine::Engine) (the `serve`
//! binary): `POST /v1/chat/completions`, `POST /v1/completions` (each streamed as
//! server-sent events or not), `GET /v1/models`, `GET /health`.
//!
//! One thread owns the engine ([`worker`]); each HTTP request checks its body ([`api`]),
//! tokenizes its prompt and hands it over, then turns the tokens it gets back into text
//! ([`text`]; then `stop` strings, and for chat the reasoning and tool-call split of
//! [`crate::chat`]) and OpenAI's response or chunks. A client that goes away drops its end of the
//! token channel, and the engine thread cancels its request at the next step. Bad requests get
//! a 4xx with an OpenAI error body and never reach the engine.

pub mod api;
pub mod prompt;
pub mod text;
pub mod worker;

use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::Uri;
use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde_json::{Map, Value, json};
use tokenizers::Tokenizer;
use tokio::sync::mpsc;
use tokio_stream::StreamExt;
use tokio_stream::wrappers::ReceiverStream;

use crate::chat::StopMatcher;
use crate::engine::Finish;
use api::{ApiError, Common, Fields};
use prompt::{Chat, Delta};
use text::Detok;
use worker::{EngineHandle, Update};

/// What the handlers share.
pub struct Served {
    /// The name clients give as `model`.
    pub name: String,
    pub tokenizer: Arc<Tokenizer>,
    pub chat: Chat,
    pub engine: EngineHandle,
    /// When the server started (the model's `created`).
    pub created: u64,
}

/// The server's routes.
pub fn router(state: Arc<Served>) -> Router {
    Router::new()
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .route("/v1/models", get(models))
        .route("/health", get(health))
        .fallback(|uri: Uri| async move { ApiError::no_route(uri.path()) })
        .with_state(state)
}

/// Seconds since the Unix epoch.
pub fn now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}

/// A number no other request of this process gets (response ids, default seeds).
fn fresh() -> u64 {
    static N: AtomicU64 = AtomicU64::new(0);
    let t = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(0);
    (t ^ N.fetch_add(1, Ordering::Relaxed).wrapping_mul(0x9E37_79B9_7F4A_7C15)).wrapping_mul(0xBF58_476D_1CE4_E5B9)
}

async fn health() -> Response {
    axum::Json(json!({"status": "ok"})).into_response()
}

async fn models(State(s): State<Arc<Served>>) -> Response {
    let model = json!({"id": s.name, "object": "model", "created": s.created, "owned_by": "nemotron-rs"});
    axum::Json(json!({"object": "list", "data": [model]})).into_response()
}

async fn chat(State(s): State<Arc<Served>>, body: Bytes) -> Response {
    chat_inner(s, body).await.unwrap_or_else(IntoResponse::into_response)
}

async fn completions(State(s): State<Arc<Served>>, body: Bytes) -> Response {
    completions_inner(s, body).await.unwrap_or_else(IntoResponse::into_response)
}

impl Served {
    fn check_model(&self, c: &Common) -> Result<(), ApiError> {
        match &c.model {
            Some(m) if *m != self.name => Err(ApiError::unknown_model(m, &self.name)),
            _ => Ok(()),
        }
    }

    fn encode(&self, text: &str) -> Result<Vec<u32>, ApiError> {
        let enc = self.tokenizer.encode(text, false).map_err(|e| ApiError::internal(format!("tokenizing: {e}")))?;
        Ok(enc.get_ids().to_vec())
    }

    /// Checks the prompt and hands it to the engine.
    fn start(&self, c: &Common, prompt: Vec<u32>, param: &str) -> Result<Gen, ApiError> {
        let vocab = self.engine.info.vocab;
        if let Some(t) = prompt.iter().find(|&&t| t as usize >= vocab) {
            return Err(ApiError::invalid(Some(param), format!("Token id {t} is outside the vocabulary of {vocab}")));
        }
        let params = api::request_params(c, prompt.len(), self.engine.info.max_len, self.chat.stop_ids(), param)?;
        let rx = self.engine.submit(prompt.clone(), params).map_err(|b| ApiError::busy(b.limit))?;
        Ok(Gen {
            rx,
            detok: Detok::new(self.tokenizer.clone(), &prompt),
            stop: Some(StopMatcher::new(&c.stop)),
            prompt_tokens: prompt.len(),
            tokens: 0,
            done: false,
        })
    }

    /// A token's name in logprobs: its text, or `token_id:N` when asked.
    fn token_name(&self, id: u32, as_id: bool) -> String {
        if as_id { format!("token_id:{id}") } else { self.tokenizer.decode(&[id], false).unwrap_or_default() }
    }

    /// Chat's logprobs entry for one token.
    fn chat_logprob(&self, t: &TokenOut, as_id: bool) -> Value {
        let entry = |id: u32, lp: f32| {
            let name = self.token_name(id, as_id);
            json!({"token": name, "logprob": lp, "bytes": name.as_bytes()})
        };
        let mut e = entry(t.id, t.logprob.unwrap_or(0.0));
        e["top_logprobs"] = t.top.iter().map(|&(id, lp)| entry(id, lp)).collect();
        e
    }
}

/// One generated token as the handlers see it.
struct TokenOut {
    id: u32,
    logprob: Option<f32>,
    top: Vec<(u32, f32)>,
}

/// What one token adds to a response: its text (possibly empty: held back), and the finish
/// reason on the last.
struct Piece {
    text: String,
    token: TokenOut,
    finish: Option<&'static str>,
}

/// One request's generation, from the engine's tokens to text.
struct Gen {
    rx: mpsc::UnboundedReceiver<Update>,
    detok: Detok,
    stop: Option<StopMatcher>,
    prompt_tokens: usize,
    /// Tokens generated so far.
    tokens: usize,
    done: bool,
}

impl Gen {
    /// The next token's piece; `None` after the last.
    async fn next(&mut self) -> Result<Option<Piece>, ApiError> {
        if self.done {
            return Ok(None);
        }
        let event = match self.rx.recv().await {
            None => return Err(ApiError::internal("the engine stopped")),
            Some(Update::Error { message, client: true }) => return Err(ApiError::invalid(None, message)),
            Some(Update::Error { message, .. }) => return Err(ApiError::internal(message)),
            Some(Update::Token(e)) => e,
        };
        let finish = match event.finished {
            Some(Finish::Failed(why)) => return Err(ApiError::internal(format!("the model gave no token: {why}"))),
            Some(Finish::Stop) => Some("stop"),
            Some(Finish::Length) => Some("length"),
            None => None,
        };
        self.tokens += 1;
        let mut text = self.detok.push(event.token).map_err(ApiError::internal)?;
        if finish.is_some() {
            text += &self.detok.finish().map_err(ApiError::internal)?;
        }
        let stop = self.stop.as_mut().expect("taken only when done");
        let (mut text, hit) = stop.push(&text);
        let finish = if hit { Some("stop") } else { finish };
        if finish.is_some() {
            self.done = true;
            if let Some(stop) = self.stop.take().filter(|_| !hit) {
                text += &stop.finish();
            }
            // A stop string ends the request early: closing the channel cancels it.
            self.rx.close();
        }
        let token = TokenOut { id: event.token, logprob: event.logprob, top: event.top_logprobs };
        Ok(Some(Piece { text, token, finish }))
    }

    fn usage(&self) -> Value {
        json!({"prompt_tokens": self.prompt_tokens, "completion_tokens": self.tokens,
               "total_tokens": self.prompt_tokens + self.tokens})
    }
}

/// A streamed response: the chunks a task sends, as server-sent events.
fn sse(rx: mpsc::Receiver<String>) -> Response {
    let events = ReceiverStream::new(rx).map(|data| Ok::<_, Infallible>(SseEvent::default().data(data)));
    Sse::new(events).into_response()
}

/// Where a streaming task sends its chunks; `false` once the client is gone.
struct Out(mpsc::Sender<String>);

impl Out {
    async fn send(&self, chunk: &Value) -> bool {
        self.0.send(chunk.to_string()).await.is_ok()
    }

    async fn done(&self) {
        let _ = self.0.send("[DONE]".into()).await;
    }

    /// The stream's end: where the client asked for usage, a last chunk without choices that
    /// carries it (`head`: the stream's id, object, created and model), then `[DONE]`.
    async fn finish(&self, head: Value, usage: Option<Value>) {
        if let Some(usage) = usage {
            let mut v = head;
            v["choices"] = json!([]);
            v["usage"] = usage;
            if !self.send(&v).await {
                return;
            }
        }
        self.done().await;
    }

    /// The stream's next piece (`Some(None)` at the generation's end), or `None` when the
    /// stream is over: the client left, or the generation failed and its error went out as the
    /// last chunk before `[DONE]`.
    async fn piece(&self, gen_: &mut Gen) -> Option<Option<Piece>> {
        match self.next(gen_).await? {
            Ok(p) => Some(p),
            Err(e) => {
                let _ = self.send(&e.body()).await;
                self.done().await;
                None
            }
        }
    }

    /// The generation's next piece, or `None` when the client left first (a request still
    /// waiting for a slot has no tokens to notice it by).
    async fn next(&self, gen_: &mut Gen) -> Option<Result<Option<Piece>, ApiError>> {
        tokio::select! {
            p = gen_.next() => Some(p),
            _ = self.0.closed() => None,
        }
    }
}

async fn chat_inner(s: Arc<Served>, body: Bytes) -> Result<Response, ApiError> {
    let m = api::parse_body(&body)?;
    let f = Fields(&m);
    let c = api::common(&f, true, fresh())?;
    s.check_model(&c)?;
    let messages = m.get("messages").ok_or_else(|| ApiError::invalid(Some("messages"), "`messages` is required"))?;
    check_messages(messages)?;
    let tools = match m.get("tools") {
        None | Some(Value::Null) => None,
        Some(t @ Value::Array(_)) => Some(t),
        Some(_) => return Err(ApiError::invalid(Some("tools"), "`tools` must be a list")),
    };
    let kwargs = f.object("chat_template_kwargs")?.cloned().unwrap_or_default();
    // `tool_choice: "none"`: the tools stay in the prompt, their calls are not parsed.
    let parse_tools = if f.get_raw("tool_choice").and_then(Value::as_str) == Some("none") { None } else { tools };
    let text = s
        .chat
        .render(messages, tools, &kwargs)
        .map_err(|e| ApiError::invalid(Some("messages"), format!("The chat template failed: {e}")))?;
    let prompt = s.encode(&text)?;
    let mut g = s.start(&c, prompt, "messages")?;
    let new_parser = {
        let (chat, text, tools) = (s.clone(), text.clone(), parse_tools.cloned());
        move || chat.chat.parser(&text, tools.as_ref())
    };
    let (id, created) = (format!("chatcmpl-{:016x}", fresh()), now());
    if !c.stream {
        let mut parser = new_parser();
        let (mut deltas, mut logprobs, mut finish) = (vec![], vec![], "stop");
        while let Some(p) = g.next().await? {
            deltas.extend(parser.push(&p.text));
            if c.sampling.logprobs {
                logprobs.push(s.chat_logprob(&p.token, c.token_ids));
            }
            finish = p.finish.unwrap_or(finish);
        }
        let calls = parser.tool_calls();
        deltas.extend(parser.finish());
        let m = crate::chat::Message::from_deltas(deltas);
        let mut message = json!({"role": "assistant", "content": m.content});
        if let Some(r) = m.reasoning {
            message["reasoning_content"] = json!(r);
        }
        if !m.tool_calls.is_empty() {
            message["tool_calls"] = m
                .tool_calls
                .iter()
                .map(|t| json!({"id": t.id, "type": "function", "function": {"name": t.name, "arguments": t.arguments_json}}))
                .collect();
        }
        if finish == "stop" && (calls > 0 || !m.tool_calls.is_empty()) {
            finish = "tool_calls";
        }
        let logprobs = if c.sampling.logprobs { json!({"content": logprobs}) } else { Value::Null };
        let body = json!({
            "id": id, "object": "chat.completion", "created": created, "model": s.name,
            "choices": [{"index": 0, "message": message, "logprobs": logprobs, "finish_reason": finish}],
            "usage": g.usage(),
        });
        return Ok(axum::Json(body).into_response());
    }
    let (tx, rx) = mpsc::channel(64);
    tokio::spawn(async move {
        let out = Out(tx);
        let usage_field = c.include_usage;
        let chunk = |delta: Value, logprobs: Value, finish: Option<&str>| {
            let mut v = json!({
                "id": id, "object": "chat.completion.chunk", "created": created, "model": s.name,
                "choices": [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}],
            });
            if usage_field {
                v["usage"] = Value::Null;
            }
            v
        };
        if !out.send(&chunk(json!({"role": "assistant", "content": ""}), Value::Null, None)).await {
            return;
        }
        let mut parser = Some(new_parser());
        let mut pending = vec![];
        loop {
            let piece = match out.piece(&mut g).await {
                None => return,
                Some(Some(p)) => p,
                Some(None) => break,
            };
            if c.sampling.logprobs {
                pending.push(s.chat_logprob(&piece.token, c.token_ids));
            }
            let Some(p) = parser.as_mut() else { break };
            let mut deltas = p.push(&piece.text);
            let mut finish = piece.finish;
            if finish.is_some() {
                let p = parser.take().expect("there until the finish");
                if finish == Some("stop") && p.tool_calls() > 0 {
                    finish = Some("tool_calls");
                }
                let rest = p.finish();
                if finish == Some("stop") && rest.iter().any(|d| matches!(d, Delta::ToolCall { .. })) {
                    finish = Some("tool_calls");
                }
                deltas.extend(rest);
            }
            for d in deltas {
                let delta = match d {
                    Delta::Content(t) => json!({"content": t}),
                    Delta::Reasoning(t) => json!({"reasoning_content": t}),
                    Delta::ToolCall { index, id, name, arguments_json } => json!({"tool_calls": [{
                        "index": index, "id": id, "type": "function",
                        "function": {"name": name, "arguments": arguments_json}}]}),
                };
                let lp =
                    if pending.is_empty() { Value::Null } else { json!({"content": std::mem::take(&mut pending)}) };
                if !out.send(&chunk(delta, lp, None)).await {
                    return;
                }
            }
            if let Some(finish) = finish {
                let lp =
                    if pending.is_empty() { Value::Null } else { json!({"content": std::mem::take(&mut pending)}) };
                if !out.send(&chunk(json!({}), lp, Some(finish))).await {
                    return;
                }
            }
        }
        let head = json!({"id": id, "object": "chat.completion.chunk", "created": created, "model": s.name});
        out.finish(head, usage_field.then(|| g.usage())).await;
    });
    Ok(sse(rx))
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
            None | Some(Value::Null | Value::String(_) | Value::Array(_)) => {}
            Some(_) => return bad(format!("`messages[{i}].content` must be a string or a list of parts")),
        }
    }
    Ok(())
}

/// The completions prompt: a string, a list of token ids, or either alone in a list.
fn completion_prompt(s: &Served, m: &Map<String, Value>) -> Result<Vec<u32>, ApiError> {
    let bad = |msg: &str| Err(ApiError::invalid(Some("prompt"), msg.to_string()));
    let ids = |a: &[Value]| -> Option<Vec<u32>> {
        a.iter().map(|t| t.as_u64().and_then(|t| u32::try_from(t).ok())).collect()
    };
    match m.get("prompt") {
        None | Some(Value::Null) => bad("`prompt` is required"),
        Some(Value::String(t)) => s.encode(t),
        Some(Value::Array(a)) if a.first().is_some_and(Value::is_number) => {
            ids(a).map_or_else(|| bad("`prompt` as a list must hold token ids (non-negative integers)"), Ok)
        }
        Some(Value::Array(a)) if a.len() == 1 => match &a[0] {
            Value::String(t) => s.encode(t),
            Value::Array(t) => ids(t).map_or_else(|| bad("`prompt[0]` must hold token ids"), Ok),
            _ => bad("`prompt[0]` must be a string or a list of token ids"),
        },
        Some(Value::Array(a)) if a.is_empty() => bad("`prompt` is empty"),
        Some(Value::Array(_)) => bad("`prompt` must be one prompt: a batch of several is not supported"),
        Some(_) => bad("`prompt` must be a string or a list of token ids"),
    }
}

async fn completions_inner(s: Arc<Served>, body: Bytes) -> Result<Response, ApiError> {
    let m = api::parse_body(&body)?;
    let f = Fields(&m);
    let c = api::common(&f, false, fresh())?;
    s.check_model(&c)?;
    if f.bool("echo")? == Some(true) {
        return Err(ApiError::invalid(Some("echo"), "`echo` is not supported"));
    }
    if f.str("suffix")?.is_some() {
        return Err(ApiError::invalid(Some("suffix"), "`suffix` is not supported"));
    }
    let prompt = completion_prompt(&s, &m)?;
    let mut g = s.start(&c, prompt, "prompt")?;
    let (id, created) = (format!("cmpl-{:016x}", fresh()), now());
    if !c.stream {
        let (mut text, mut tokens, mut finish) = (String::new(), vec![], "stop");
        while let Some(p) = g.next().await? {
            tokens.push((text.len(), p.token));
            text += &p.text;
            finish = p.finish.unwrap_or(finish);
        }
        let body = json!({
            "id": id, "object": "text_completion", "created": created, "model": s.name,
            "choices": [{"index": 0, "text": text, "logprobs": completion_logprobs(&s, &c, &tokens), "finish_reason": finish}],
            "usage": g.usage(),
        });
        return Ok(axum::Json(body).into_response());
    }
    let (tx, rx) = mpsc::channel(64);
    tokio::spawn(async move {
        let out = Out(tx);
        let chunk = |text: &str, lp: Value, finish: Option<&str>| {
            let mut v = json!({
                "id": id, "object": "text_completion", "created": created, "model": s.name,
                "choices": [{"index": 0, "text": text, "logprobs": lp, "finish_reason": finish}],
            });
            if c.include_usage {
                v["usage"] = Value::Null;
            }
            v
        };
        let (mut offset, mut pending) = (0, vec![]);
        loop {
            let p = match out.piece(&mut g).await {
                None => return,
                Some(Some(p)) => p,
                Some(None) => break,
            };
            pending.push((offset, p.token));
            offset += p.text.len();
            if (!p.text.is_empty() || p.finish.is_some())
                && !out
                    .send(&chunk(&p.text, completion_logprobs(&s, &c, &std::mem::take(&mut pending)), p.finish))
                    .await
            {
                return;
            }
        }
        let head = json!({"id": id, "object": "text_completion", "created": created, "model": s.name});
        out.finish(head, c.include_usage.then(|| g.usage())).await;
    });
    Ok(sse(rx))
}

/// Completions' logprobs for some tokens, each with its offset in the text.
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
