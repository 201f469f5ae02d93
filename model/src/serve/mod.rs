//! An OpenAI-compatible HTTP server over the [`Engine`](crate::engine::Engine) (the `serve`
//! binary): `POST /v1/chat/completions`, `POST /v1/completions` (each streamed as
//! server-sent events or not), `GET /v1/models`, vLLM's `POST /tokenize` and `POST /detokenize`,
//! `GET /metrics` ([`metrics`]), `GET /health`; while the model loads, 503s
//! ([`loading`]).
//!
//! One thread owns the engine ([`worker`]); each HTTP request (its handler in `chat.rs` or
//! `completions.rs`) checks its body ([`api`]), renders and tokenizes its prompt (these on the
//! blocking pool, `Served::blocking`, not on the async threads) and hands it over, then
//! turns the tokens it gets back into text (`generation.rs`: [`text`], then `stop` strings;
//! for chat the reasoning and tool-call split of [`crate::chat`]) and OpenAI's response or
//! chunks. A client that goes away drops its end of the token channel, and the engine thread
//! cancels its request at the next step: a stream's task sees its SSE channel close, and a
//! non-streamed request's handler is dropped mid-await (hyper drops it when the connection
//! closes), with the receiver it holds. Bad requests get a 4xx with an OpenAI error body and
//! never reach the engine. Connections are accepted by [`conn`] (timeouts, a cap, draining);
//! at shutdown [`Ending::cut`] ends the generations still running.

pub mod api;
mod chat;
mod completions;
pub mod conn;
mod format;
mod generation;
pub mod metrics;
pub mod prompt;
pub mod request;
#[cfg(feature = "scripted")]
pub mod scripted;
pub mod special;
#[cfg(test)]
mod tests;
mod tokenize;
pub mod worker;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::Request;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::header::CONTENT_TYPE;
use axum::http::{Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Router, middleware};
use serde_json::json;
use tokenizers::Tokenizer;
use tower::ServiceExt;

use crate::chat::Detok;
use crate::chat::StopMatcher;
use crate::engine::Constraint;
use crate::structured::Structured;
use api::ApiError;
use generation::{Gen, RequestLog};
use prompt::Chat;
use request::{Common, Limits};
use worker::EngineHandle;

/// What the handlers share.
pub struct Served {
    /// The name clients give as `model`.
    pub name: String,
    pub tokenizer: Arc<Tokenizer>,
    pub chat: Chat,
    pub engine: EngineHandle,
    /// When the server started (the model's `created`).
    pub created: u64,
    /// What a request may ask for.
    pub limits: Limits,
    /// What becomes of special-token text in chat content.
    pub special: special::Special,
    /// The server's shutdown, as the generations see it.
    pub ending: Ending,
    /// Who may call the API.
    pub access: Access,
    /// The counters `/metrics` shows.
    pub metrics: Arc<metrics::Metrics>,
    /// Structured outputs for this tokenizer, or why there are none.
    pub structured: Result<Structured, String>,
}

/// What a request hands the engine: its prompt's ids and its structured output's constraint.
type Submission = (Vec<u32>, Option<Box<dyn Constraint>>);

/// Who may call the API: with an `api_key`, every route but `/health` (open for probes) wants
/// `Authorization: Bearer KEY` (compared in constant time; else 401 in OpenAI's error JSON); with `allowed_origins`, browsers on those origins (`*`: any) may call it (CORS,
/// preflight `OPTIONS` answered).
#[derive(Clone, Debug, Default)]
pub struct Access {
    pub api_key: Option<String>,
    pub allowed_origins: Vec<String>,
}

impl Access {
    /// Fails on an empty key or an origin that is neither `*` nor `http(s)://HOST[:PORT]`.
    pub fn check(&self) -> Result<(), String> {
        if self.api_key.as_deref() == Some("") {
            return Err("the API key is empty".into());
        }
        for o in &self.allowed_origins {
            let url = o.strip_prefix("https://").or_else(|| o.strip_prefix("http://"));
            let ok = o == "*"
                || url.is_some_and(|h| !h.is_empty() && !h.contains('/'))
                    && o.parse::<axum::http::HeaderValue>().is_ok();
            if !ok {
                return Err(format!("the allowed origin `{o}` is neither `*` nor http(s)://HOST[:PORT]"));
            }
        }
        Ok(())
    }
}

/// The end of the generations still running when the server shuts down: once [`Ending::cut`],
/// each ends at once with finish reason `abort` (a stream with its final chunk and `[DONE]`,
/// a non-streamed request with the text it has), its engine request cancelled.
#[derive(Debug)]
pub struct Ending(tokio::sync::watch::Sender<bool>);

impl Default for Ending {
    fn default() -> Ending {
        Ending(tokio::sync::watch::Sender::new(false))
    }
}

impl Ending {
    /// Ends every generation running now or started later.
    pub fn cut(&self) {
        self.0.send_replace(true);
    }
}

/// The largest request body the server reads (axum's default, stated): past it a request gets
/// 413.
pub const BODY_LIMIT: usize = 2 << 20;

/// The server's routes. Every error answer is OpenAI's error JSON, also those that axum makes
/// itself (an unknown path: 404, a wrong method: 405, a body past [`BODY_LIMIT`]: 413; see
/// [`json_errors`]).
pub fn router(state: Arc<Served>) -> Router {
    let access = state.access.clone();
    let routes = Router::new()
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .route("/v1/models", get(models))
        .route("/health", get(health))
        .route("/tokenize", post(tokenize))
        .route("/detokenize", post(detokenize))
        .route("/metrics", get(metrics))
        .fallback(|uri: Uri| async move { ApiError::no_route(uri.path()) })
        .method_not_allowed_fallback(|method: Method, uri: Uri| async move {
            ApiError::wrong_method(method.as_str(), uri.path())
        })
        .layer(DefaultBodyLimit::max(BODY_LIMIT))
        .layer(middleware::map_response(json_errors))
        .layer(middleware::from_fn_with_state(Arc::new(access.api_key), authorized))
        .layer(middleware::from_fn_with_state(state.metrics.clone(), counted))
        .with_state(state);
    match cors(&access.allowed_origins) {
        Some(cors) => routes.layer(cors),
        None => routes,
    }
}

/// Counts each answer by route and status.
async fn counted(State(m): State<Arc<metrics::Metrics>>, req: Request, next: middleware::Next) -> Response {
    let route = req.extensions().get::<axum::extract::MatchedPath>().map(|p| p.as_str().to_string());
    let r = next.run(req).await;
    m.response(route.as_deref(), r.status().as_u16());
    r
}

async fn metrics(State(s): State<Arc<Served>>) -> Response {
    let text = s.metrics.render(&s.engine);
    ([(CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")], text).into_response()
}

/// Passes a request on where no key is set, where it asks for `/health`, or where it carries
/// `Authorization: Bearer KEY`; else 401 in OpenAI's error JSON.
async fn authorized(State(key): State<Arc<Option<String>>>, req: Request, next: middleware::Next) -> Response {
    let Some(key) = key.as_deref() else { return next.run(req).await };
    let given = req.headers().get(axum::http::header::AUTHORIZATION).and_then(|v| v.to_str().ok());
    let given = given.and_then(|v| v.strip_prefix("Bearer ")).unwrap_or_default();
    if req.uri().path() == "/health" || same_secret(given.as_bytes(), key.as_bytes()) {
        return next.run(req).await;
    }
    ApiError {
        status: StatusCode::UNAUTHORIZED,
        message: "Incorrect or missing API key: send `Authorization: Bearer KEY`".into(),
        kind: "invalid_request_error",
        param: None,
        code: Some("invalid_api_key"),
    }
    .into_response()
}

/// Whether `a` equals `b`, in a time that depends on their lengths only.
fn same_secret(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |d, (x, y)| d | (x ^ y)) == 0
}

/// The CORS layer for `origins` (`*`: any), none without them.
fn cors(origins: &[String]) -> Option<tower_http::cors::CorsLayer> {
    use tower_http::cors::{AllowOrigin, CorsLayer};
    if origins.is_empty() {
        return None;
    }
    let allow = if origins.iter().any(|o| o == "*") {
        AllowOrigin::any()
    } else {
        AllowOrigin::list(origins.iter().filter_map(|o| o.parse().ok()))
    };
    let headers = [axum::http::header::AUTHORIZATION, CONTENT_TYPE];
    Some(CorsLayer::new().allow_origin(allow).allow_methods([Method::GET, Method::POST]).allow_headers(headers))
}

/// What the server answers before the model has loaded (the port is bound first, so a port
/// clash shows at once): every request is handed to the router in `ready` once it is set; until
/// then `/health` answers 503 `{"status": "loading"}` and every other request 503 in OpenAI's
/// error JSON.
pub fn loading(ready: Arc<OnceLock<Router>>) -> Router {
    let serve = tower::service_fn(move |req: Request| {
        let ready = ready.clone();
        async move {
            match ready.get() {
                Some(router) => router.clone().oneshot(req).await,
                None if req.uri().path() == "/health" => {
                    Ok((StatusCode::SERVICE_UNAVAILABLE, axum::Json(json!({"status": "loading"}))).into_response())
                }
                None => Ok(ApiError::other(StatusCode::SERVICE_UNAVAILABLE, "The model is still loading; retry later")
                    .into_response()),
            }
        }
    });
    Router::new().fallback_service(serve)
}

/// An error answer that is not JSON (axum's own rejections, such as the body limit's plain
/// text) as OpenAI's error JSON with the same status: 413 with the limit, others with their
/// text (its first 1024 bytes).
async fn json_errors(r: Response) -> Response {
    let status = r.status();
    let json = r.headers().get(CONTENT_TYPE).is_some_and(|t| t.as_bytes().starts_with(b"application/json"));
    if !(status.is_client_error() || status.is_server_error()) || json {
        return r;
    }
    if status == StatusCode::PAYLOAD_TOO_LARGE {
        return ApiError::too_large(BODY_LIMIT).into_response();
    }
    let text = axum::body::to_bytes(r.into_body(), 1024).await.unwrap_or_default();
    let text = String::from_utf8_lossy(&text);
    let message = if text.trim().is_empty() {
        status.canonical_reason().unwrap_or("error").to_string()
    } else {
        text.trim().to_string()
    };
    ApiError::other(status, message).into_response()
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
    chat::handle(s, body).await.unwrap_or_else(IntoResponse::into_response)
}

async fn completions(State(s): State<Arc<Served>>, body: Bytes) -> Response {
    completions::handle(s, body).await.unwrap_or_else(IntoResponse::into_response)
}

async fn tokenize(State(s): State<Arc<Served>>, body: Bytes) -> Response {
    tokenize::tokenize(s, body).await.unwrap_or_else(IntoResponse::into_response)
}

async fn detokenize(State(s): State<Arc<Served>>, body: Bytes) -> Response {
    tokenize::detokenize(s, body).await.unwrap_or_else(IntoResponse::into_response)
}

impl Served {
    fn check_model(&self, c: &Common) -> Result<(), ApiError> {
        match &c.model {
            Some(m) if *m != self.name => Err(ApiError::unknown_model(m, &self.name)),
            _ => Ok(()),
        }
    }

    /// `f(self)` on tokio's blocking pool: the parsing, template rendering and tokenizing of a
    /// request (seconds for a prompt of megabytes) never hold an async thread, so `/health`
    /// and the streams of other requests go on meanwhile.
    async fn blocking<T: Send + 'static>(
        self: &Arc<Self>,
        f: impl FnOnce(&Served) -> Result<T, ApiError> + Send + 'static,
    ) -> Result<T, ApiError> {
        let s = self.clone();
        tokio::task::spawn_blocking(move || f(&s))
            .await
            .map_err(|e| ApiError::internal(format!("preparing the request: {e}")))?
    }

    fn encode(&self, text: &str) -> Result<Vec<u32>, ApiError> {
        special::encode(&self.tokenizer, text)
    }

    /// The request's structured output compiled to its constraint (an error names the field it
    /// came in); `after_reasoning`: it starts once the reasoning block the prompt opened ends.
    fn constraint(&self, c: &Common, after_reasoning: bool) -> Result<Option<Box<dyn Constraint>>, ApiError> {
        let Some((format, field)) = &c.format else { return Ok(None) };
        let structured = self.structured.as_ref().map_err(|why| {
            ApiError::invalid(Some(field), format!("`{field}`: structured outputs are not available here ({why})"))
        })?;
        let constraint = structured
            .constraint(format, after_reasoning)
            .map_err(|e| ApiError::invalid(Some(field), format!("`{field}` does not compile: {e}")))?;
        Ok(Some(constraint))
    }

    /// Checks the prompt and hands it to the engine (`id`: the response's, for the log).
    fn start(&self, c: &Common, (prompt, constraint): Submission, param: &str, id: &str) -> Result<Gen, ApiError> {
        let vocab = self.engine.info.vocab;
        if let Some(t) = prompt.iter().find(|&&t| t as usize >= vocab) {
            return Err(ApiError::invalid(Some(param), format!("Token id {t} is outside the vocabulary of {vocab}")));
        }
        if let Some(t) = c.stop_token_ids.iter().find(|&&t| t as usize >= vocab) {
            let message = format!("Token id {t} is outside the vocabulary of {vocab}");
            return Err(ApiError::invalid(Some("stop_token_ids"), message));
        }
        let params = request::request_params(c, prompt.len(), self.engine.info.max_len, self.chat.stop_ids(), param)?;
        let rx = self.engine.submit(prompt.clone(), params, constraint).map_err(|b| ApiError::busy(b.limit))?;
        Ok(Gen {
            rx,
            detok: Detok::new(self.tokenizer.clone(), &prompt),
            stop: Some(StopMatcher::new(&c.stop)),
            stop_ids: c.stop_token_ids.clone(),
            min_tokens: c.min_tokens,
            prompt_tokens: prompt.len(),
            cached_tokens: 0,
            tokens: 0,
            done: false,
            cut: self.ending.0.subscribe(),
            log: RequestLog { id: id.into(), t0: Instant::now(), first: None, last: None, finish: None },
            metrics: self.metrics.clone(),
        })
    }

    /// A token's name in logprobs: its text, or `token_id:N` when asked.
    fn token_name(&self, id: u32, as_id: bool) -> String {
        if as_id { format!("token_id:{id}") } else { self.tokenizer.decode(&[id], false).unwrap_or_default() }
    }
}
