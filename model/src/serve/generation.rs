//! A request's generation as the handlers see it: the engine's tokens to text ([`Gen`]), and
//! the sink a streaming response's task sends its chunks to ([`Out`]).

use std::convert::Infallible;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};
use tokio::sync::{mpsc, watch};
use tokio_stream::StreamExt;
use tokio_stream::wrappers::ReceiverStream;

use super::api::ApiError;
use super::metrics::Metrics;
use super::worker::Update;
use crate::chat::Detok;
use crate::chat::StopMatcher;
use crate::engine::Finish;

/// One generated token as the handlers see it.
pub(super) struct TokenOut {
    pub(super) id: u32,
    pub(super) logprob: Option<f32>,
    pub(super) top: Vec<(u32, f32)>,
}

/// What one token adds to a response: its text (possibly empty: held back), and the finish
/// reason on the last, with vLLM's `stop_reason`: the stop string found, or the token id of
/// the request's `stop_token_ids` that ended it; null otherwise (the checkpoint's
/// end-of-sequence ids among them). The piece that ends a generation cut short by the server's
/// shutdown has no token: its text is what was held back, its finish `abort`.
pub(super) struct Piece {
    pub(super) text: String,
    pub(super) token: Option<TokenOut>,
    pub(super) finish: Option<&'static str>,
    pub(super) stop_reason: Value,
}

/// One request's generation, from the engine's tokens to text.
pub(super) struct Gen {
    pub(super) rx: mpsc::UnboundedReceiver<Update>,
    pub(super) detok: Detok,
    pub(super) stop: Option<StopMatcher>,
    /// The request's `stop_token_ids` (a `stop_reason` when one ends it).
    pub(super) stop_ids: Vec<u32>,
    /// The request's `min_tokens`: the text of its first this many tokens ends nothing.
    pub(super) min_tokens: usize,
    pub(super) prompt_tokens: usize,
    /// Prompt tokens the engine restored from its prefix cache (known from the first token).
    pub(super) cached_tokens: usize,
    /// Tokens generated so far.
    pub(super) tokens: usize,
    pub(super) done: bool,
    /// Set when the server's shutdown cuts the generations still running ([`super::Ending`]).
    pub(super) cut: watch::Receiver<bool>,
    pub(super) log: RequestLog,
    pub(super) metrics: Arc<Metrics>,
}

/// What the request's log line says when its generation is dropped: its response id, when it
/// was handed to the engine (after its parsing and tokenizing), its first token's time from
/// then, how it ended (`None`: the client left first).
pub(super) struct RequestLog {
    pub(super) id: String,
    pub(super) t0: Instant,
    pub(super) first: Option<Duration>,
    /// When its last token came.
    pub(super) last: Option<Instant>,
    pub(super) finish: Option<&'static str>,
}

impl Drop for Gen {
    /// One info line a request: id, tokens in and out, time to first token, duration, finish.
    fn drop(&mut self) {
        self.metrics.request(
            (self.prompt_tokens, self.cached_tokens, self.tokens),
            self.log.first,
            self.log.t0.elapsed(),
        );
        // Milliseconds to a tenth; no time to first token where none came.
        let ms = |d: Duration| (d.as_secs_f64() * 1e4).round() / 10.0;
        tracing::info!(
            id = %self.log.id,
            prompt_tokens = self.prompt_tokens,
            cached_tokens = self.cached_tokens,
            completion_tokens = self.tokens,
            ttft_ms = self.log.first.map(ms),
            duration_ms = ms(self.log.t0.elapsed()),
            finish = %self.log.finish.unwrap_or("client left"),
            "request"
        );
    }
}

impl Gen {
    /// The next token's piece; `None` after the last.
    pub(super) async fn next(&mut self) -> Result<Option<Piece>, ApiError> {
        let next = self.step().await;
        match &next {
            Ok(Some(p)) => {
                let now = Instant::now();
                if let (Some(last), Some(_)) = (self.log.last, &p.token) {
                    self.metrics.gap(now - last);
                }
                self.log.last = p.token.as_ref().map(|_| now).or(self.log.last);
                self.log.first = self.log.first.or(Some(now - self.log.t0));
                self.log.finish = p.finish.or(self.log.finish);
            }
            Ok(None) => {}
            Err(_) => self.log.finish = Some("error"),
        }
        next
    }

    /// [`Gen::next`] before its log.
    async fn step(&mut self) -> Result<Option<Piece>, ApiError> {
        if self.done {
            return Ok(None);
        }
        let update = tokio::select! {
            u = self.rx.recv() => Some(u),
            _ = self.cut.wait_for(|&cut| cut) => None,
        };
        let Some(update) = update else { return self.abort().map(Some) };
        let event = match update {
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
        self.cached_tokens = event.cached;
        let mut text = self.detok.push(event.token).map_err(ApiError::internal)?;
        if finish.is_some() {
            text += &self.detok.finish().map_err(ApiError::internal)?;
        }
        let stop = self.stop.as_mut().expect("taken only when done");
        let (mut text, hit) =
            if self.tokens <= self.min_tokens { (stop.push_unmatched(&text), false) } else { stop.push(&text) };
        let stop_reason = match stop.matched() {
            Some(s) => json!(s),
            None if event.finished == Some(Finish::Stop) && self.stop_ids.contains(&event.token) => json!(event.token),
            None => Value::Null,
        };
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
        Ok(Some(Piece { text, token: Some(token), finish, stop_reason }))
    }

    /// The generation ended by the server's shutdown: what text was held back, finish `abort`;
    /// closing the channel cancels the request.
    fn abort(&mut self) -> Result<Piece, ApiError> {
        self.done = true;
        self.rx.close();
        let text = self.detok.finish().map_err(ApiError::internal)?;
        let stop = self.stop.as_mut().expect("taken only when done");
        let (mut text, _) = stop.push(&text);
        if let Some(stop) = self.stop.take() {
            text += &stop.finish();
        }
        Ok(Piece { text, token: None, finish: Some("abort"), stop_reason: Value::Null })
    }

    pub(super) fn usage(&self) -> Value {
        json!({"prompt_tokens": self.prompt_tokens, "completion_tokens": self.tokens,
               "total_tokens": self.prompt_tokens + self.tokens,
               "prompt_tokens_details": {"cached_tokens": self.cached_tokens}})
    }
}

/// A streamed response: the chunks a task sends, as server-sent events.
pub(super) fn sse(rx: mpsc::Receiver<String>) -> Response {
    let events = ReceiverStream::new(rx).map(|data| Ok::<_, Infallible>(SseEvent::default().data(data)));
    Sse::new(events).into_response()
}

/// Where a streaming task sends its chunks; `false` once the client is gone.
pub(super) struct Out(pub(super) mpsc::Sender<String>);

impl Out {
    pub(super) async fn send(&self, chunk: &Value) -> bool {
        self.0.send(chunk.to_string()).await.is_ok()
    }

    async fn done(&self) {
        let _ = self.0.send("[DONE]".into()).await;
    }

    /// The stream's end: where the client asked for usage, a last chunk without choices that
    /// carries it (`head`: the stream's id, object, created and model), then `[DONE]`.
    pub(super) async fn finish(&self, head: Value, usage: Option<Value>) {
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
    pub(super) async fn piece(&self, gen_: &mut Gen) -> Option<Option<Piece>> {
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
