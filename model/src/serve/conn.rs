//! The server's connections: an accept loop of its own in place of `axum::serve`, so that
//! slow or idle clients and floods of connections cannot hold the server. Each connection must
//! send a request's headers within [`ConnLimits::header`] of the connection opening or of its
//! last response (hyper's header read timeout: an idle keep-alive connection is closed too),
//! and its body within [`ConnLimits::body`] (`read_body`: 408 past it); past
//! [`ConnLimits::max`] open connections a new one gets 503 in OpenAI's error JSON and is
//! closed, so the process stays below its descriptor limit (the cap is lowered to fit it) and
//! refuses instead of going silent. hyper's own answers to requests it cannot parse (400, 431)
//! get OpenAI's error JSON as their body (`JsonErrors`).

use std::io;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::Request;
use axum::http::StatusCode;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{Notify, watch};

use super::BODY_LIMIT;
use super::api::ApiError;

/// What a connection may take.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ConnLimits {
    /// Open connections at most (lowered to the descriptor limit less a reserve).
    pub max: usize,
    /// To send a request's headers, from the connection's start or its last response.
    pub header: Duration,
    /// To send a request's body once its headers are in.
    pub body: Duration,
}

impl Default for ConnLimits {
    fn default() -> ConnLimits {
        ConnLimits { max: 512, header: Duration::from_secs(30), body: Duration::from_secs(30) }
    }
}

/// Descriptors the process keeps for itself beside its connections (the model's files, the
/// listener, logs, the GPU driver's).
const RESERVE_FDS: usize = 64;

/// How long a refusal may take to write before its connection is dropped unanswered.
const REFUSAL_WRITE: Duration = Duration::from_secs(1);

/// The cap on open connections that fits `max` under this process's descriptor limit: half of
/// its soft `RLIMIT_NOFILE` less a reserve of 64 (the other half for connections on their way
/// to a refusal, each holding a descriptor until its 503 is written).
pub fn fitted_max(max: usize) -> usize {
    let mut lim = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit writes the struct it is given.
    let soft = if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } == 0 {
        usize::try_from(lim.rlim_cur).unwrap_or(usize::MAX)
    } else {
        usize::MAX
    };
    max.min(soft.saturating_sub(RESERVE_FDS) / 2).max(1)
}

/// Serves `app` on `listener` within `limits` (`limits.max` as given: see [`fitted_max`]) until
/// `drain` turns true and every connection has closed: from then on a new connection gets 503,
/// and each open one finishes the request it is serving (a stream runs to its end) and closes.
pub async fn serve(
    listener: TcpListener,
    app: Router,
    limits: ConnLimits,
    mut drain: watch::Receiver<bool>,
) -> io::Result<()> {
    let (open, closed) = (Arc::new(AtomicUsize::new(0)), Arc::new(Notify::new()));
    let app = app.layer(axum::middleware::from_fn_with_state(limits.body, read_body));
    loop {
        let draining = *drain.borrow();
        if draining && open.load(Ordering::Acquire) == 0 {
            return Ok(());
        }
        let accepted = tokio::select! {
            a = listener.accept() => a,
            _ = drained(&mut drain), if !draining => continue,
            _ = closed.notified(), if draining => continue,
        };
        let stream = match accepted {
            Ok((stream, _)) => stream,
            Err(e) => {
                // Out of descriptors (or another passing failure): wait for some to close.
                tracing::warn!("accept failed: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        if draining {
            tokio::spawn(refuse(stream, "The server is shutting down; retry elsewhere or later".into()));
            continue;
        }
        if open.fetch_add(1, Ordering::AcqRel) >= limits.max {
            open.fetch_sub(1, Ordering::AcqRel);
            let message = format!("The server has {} connections open, its limit; retry later", limits.max);
            tokio::spawn(refuse(stream, message));
            continue;
        }
        let guard = Open(open.clone(), closed.clone());
        let (service, mut drain) = (TowerToHyperService::new(app.clone()), drain.clone());
        tokio::spawn(async move {
            let _guard = guard;
            let mut http = hyper::server::conn::http1::Builder::new();
            http.timer(TokioTimer::new()).header_read_timeout(limits.header);
            let io = TokioIo::new(JsonErrors { inner: stream, pending: Vec::new() });
            let conn = http.serve_connection(io, service);
            tokio::pin!(conn);
            let ended = tokio::select! {
                r = conn.as_mut() => r,
                _ = drained(&mut drain) => {
                    conn.as_mut().graceful_shutdown();
                    conn.await
                }
            };
            if let Err(e) = ended {
                tracing::debug!("connection ended: {e}");
            }
        });
    }
}

/// Waits for `drain` to be true; for ever once its sender is gone while it is false.
async fn drained(drain: &mut watch::Receiver<bool>) {
    if drain.wait_for(|&d| d).await.is_err() {
        std::future::pending::<()>().await;
    }
}

/// A connection whose error answers from hyper itself (a malformed request: 400, headers past
/// its buffer: 431; an empty body, written before any route sees the request) go out with
/// OpenAI's error JSON as their body instead. Every other answer passes as written: the
/// routes' errors already carry JSON, so an error status with `content-length: 0` is hyper's.
struct JsonErrors<T> {
    inner: T,
    /// The rewritten answer's bytes not yet written.
    pending: Vec<u8>,
}

impl<T> JsonErrors<T> {
    /// The JSON answer for `buf` where it is one of hyper's bodiless error answers.
    fn rewritten(buf: &[u8]) -> Option<Vec<u8>> {
        let head_end = buf.windows(4).position(|w| w == b"\r\n\r\n")?;
        let head = std::str::from_utf8(&buf[..head_end]).ok()?;
        let status_line = head.lines().next()?;
        let code: u16 = status_line.strip_prefix("HTTP/1.1 ")?.get(..3)?.parse().ok()?;
        let status = StatusCode::from_u16(code).ok()?;
        let empty = head.lines().any(|l| l.eq_ignore_ascii_case("content-length: 0"));
        if !(status.is_client_error() || status.is_server_error()) || !empty || head_end + 4 != buf.len() {
            return None;
        }
        let message = match status {
            StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE => {
                "The request's headers are too large or too many".to_string()
            }
            StatusCode::BAD_REQUEST => "The request is not valid HTTP/1.1".to_string(),
            s => s.canonical_reason().unwrap_or("error").to_string(),
        };
        let body = ApiError::other(status, message).body().to_string();
        let answer = format!(
            "{status_line}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
            body.len()
        );
        Some(answer.into_bytes())
    }
}

impl<T: AsyncWrite + Unpin> JsonErrors<T> {
    /// Writes what is pending of a rewritten answer.
    fn drain(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        while !self.pending.is_empty() {
            let n = ready!(Pin::new(&mut self.inner).poll_write(cx, &self.pending))?;
            if n == 0 {
                return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
            }
            self.pending.drain(..n);
        }
        Poll::Ready(Ok(()))
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for JsonErrors<T> {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for JsonErrors<T> {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        ready!(self.drain(cx))?;
        if let Some(answer) = Self::rewritten(buf) {
            self.pending = answer;
            // Taken whole: the rest goes out with the next write, flush or shutdown.
            let _ = self.drain(cx)?;
            return Poll::Ready(Ok(buf.len()));
        }
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        ready!(self.drain(cx))?;
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        ready!(self.drain(cx))?;
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// One open connection, counted until it is dropped (then the accept loop is told).
struct Open(Arc<AtomicUsize>, Arc<Notify>);

impl Drop for Open {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
        self.1.notify_one();
    }
}

/// Answers a connection with 503 (`message` in OpenAI's error JSON) and closes it.
async fn refuse(mut stream: TcpStream, message: String) {
    let body = ApiError::other(StatusCode::SERVICE_UNAVAILABLE, message).body().to_string();
    let answer = format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\
         connection: close\r\nretry-after: 1\r\n\r\n{body}",
        body.len()
    );
    let _ = tokio::time::timeout(REFUSAL_WRITE, async {
        stream.write_all(answer.as_bytes()).await?;
        stream.shutdown().await
    })
    .await;
}

/// Reads a request's body (at most [`BODY_LIMIT`] bytes) within `timeout` before the routes
/// see it: past the time 408, past the size 413, both in OpenAI's error JSON.
async fn read_body(
    axum::extract::State(timeout): axum::extract::State<Duration>,
    req: Request,
    next: Next,
) -> Response {
    let (parts, body) = req.into_parts();
    let bytes = match tokio::time::timeout(timeout, axum::body::to_bytes(body, BODY_LIMIT)).await {
        Err(_) => {
            let message = format!("The request body did not arrive within {} s", timeout.as_secs_f64());
            return ApiError::other(StatusCode::REQUEST_TIMEOUT, message).into_response();
        }
        Ok(Err(e)) if is_too_large(&e) => return ApiError::too_large(BODY_LIMIT).into_response(),
        Ok(Err(e)) => return ApiError::invalid(None, format!("Reading the request body: {e}")).into_response(),
        Ok(Ok(bytes)) => bytes,
    };
    next.run(Request::from_parts(parts, Body::from(bytes))).await
}

/// Whether reading a body failed on its length limit.
fn is_too_large(e: &axum::Error) -> bool {
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(s) = source {
        if s.is::<http_body_util::LengthLimitError>() {
            return true;
        }
        source = s.source();
    }
    false
}

#[cfg(test)]
mod tests {
    use std::time::Instant;

    use axum::routing::{get, post};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::*;

    /// A server of `/health` and an echoing `POST /echo` within `limits` on a free port.
    async fn server(limits: ConnLimits) -> String {
        let app = Router::new()
            .route("/health", get(|| async { "ok" }))
            .route("/echo", post(|body: axum::body::Bytes| async move { body }));
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let (drain, rx) = watch::channel(false);
        tokio::spawn(async move {
            let _drain = drain;
            serve(listener, app, limits, rx).await
        });
        addr
    }

    /// What the server sends on `stream` until it closes it (an error counts as closed), and
    /// how long that took; `None` if it is still open after `wait`.
    async fn until_closed(stream: &mut TcpStream, wait: Duration) -> Option<(String, Duration)> {
        let t0 = Instant::now();
        let mut got = Vec::new();
        let read = async {
            let mut buf = [0u8; 4096];
            while let Ok(n @ 1..) = stream.read(&mut buf).await {
                got.extend_from_slice(&buf[..n]);
            }
        };
        tokio::time::timeout(wait, read).await.ok()?;
        Some((String::from_utf8_lossy(&got).into_owned(), t0.elapsed()))
    }

    async fn health(addr: &str) -> String {
        let mut s = TcpStream::connect(addr).await.unwrap();
        s.write_all(b"GET /health HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n").await.unwrap();
        until_closed(&mut s, Duration::from_secs(5)).await.expect("an answer").0
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn slow_and_idle_connections_are_closed() {
        let limits = ConnLimits { max: 64, header: Duration::from_secs(1), body: Duration::from_secs(1) };
        let addr = server(limits).await;
        let wait = Duration::from_secs(5);
        // Half a request header, then nothing.
        let mut s = TcpStream::connect(&addr).await.unwrap();
        s.write_all(b"GET /health HTTP/1.1\r\nHo").await.unwrap();
        let (_, t) = until_closed(&mut s, wait).await.expect("a half header is closed");
        assert!(t >= Duration::from_millis(900), "closed after {t:?}");
        // A request answered on a kept-alive connection, then idle.
        let mut s = TcpStream::connect(&addr).await.unwrap();
        s.write_all(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n").await.unwrap();
        let (got, t) = until_closed(&mut s, wait).await.expect("an idle connection is closed");
        assert!(got.starts_with("HTTP/1.1 200") && got.ends_with("ok"), "{got}");
        assert!(t >= Duration::from_millis(900), "closed after {t:?}");
        // A body that stops short: 408 in OpenAI's error JSON.
        let mut s = TcpStream::connect(&addr).await.unwrap();
        s.write_all(b"POST /echo HTTP/1.1\r\nhost: x\r\ncontent-length: 100\r\n\r\n0123456789").await.unwrap();
        let (got, _) = until_closed(&mut s, wait).await.expect("a short body is answered");
        assert!(got.starts_with("HTTP/1.1 408"), "{got}");
        assert!(got.contains(r#""type":"invalid_request_error""#) && got.contains("within 1 s"), "{got}");
        // A whole body still passes.
        let mut s = TcpStream::connect(&addr).await.unwrap();
        s.write_all(b"POST /echo HTTP/1.1\r\nhost: x\r\ncontent-length: 5\r\nconnection: close\r\n\r\nhello")
            .await
            .unwrap();
        let (got, _) = until_closed(&mut s, wait).await.expect("an answer");
        assert!(got.starts_with("HTTP/1.1 200") && got.ends_with("hello"), "{got}");
    }

    /// Draining: a new connection gets 503, a stream in flight runs to its end, then `serve`
    /// returns.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn draining_finishes_what_is_in_flight_and_refuses_the_rest() {
        use tokio_stream::StreamExt;
        // Ten pieces, 100 ms apart.
        let slow = || async {
            let pieces = tokio_stream::iter(0..10).throttle(Duration::from_millis(100));
            Body::from_stream(pieces.map(|i| Ok::<_, std::convert::Infallible>(format!("piece {i}\n"))))
        };
        let app = Router::new().route("/slow", get(slow)).route("/health", get(|| async { "ok" }));
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let (drain, rx) = watch::channel(false);
        let served = tokio::spawn(serve(listener, app, ConnLimits::default(), rx));
        let mut s = TcpStream::connect(&addr).await.unwrap();
        s.write_all(b"GET /slow HTTP/1.1\r\nhost: x\r\n\r\n").await.unwrap();
        tokio::time::sleep(Duration::from_millis(250)).await;
        drain.send_replace(true);
        tokio::time::sleep(Duration::from_millis(50)).await;
        let got = health(&addr).await;
        assert!(got.starts_with("HTTP/1.1 503") && got.contains("shutting down"), "{got}");
        let (got, _) = until_closed(&mut s, Duration::from_secs(5)).await.expect("the stream ends");
        assert!(got.contains("piece 0") && got.contains("piece 9\n"), "{got}");
        let ended = tokio::time::timeout(Duration::from_secs(5), served).await;
        assert!(matches!(ended, Ok(Ok(Ok(())))), "serve returns once drained: {ended:?}");
    }

    /// hyper's own answers to what never reaches the routes, in OpenAI's error JSON: 431 for
    /// too many headers (or too large), 400 for what is not HTTP/1.1.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn malformed_requests_get_json_errors() {
        let addr = server(ConnLimits::default()).await;
        let many: String = (0..150).map(|i| format!("h{i}: v\r\n")).collect();
        let huge = format!("x-big: {}\r\n", "a".repeat(1 << 19));
        for (head, want) in [(many, "431"), (huge, "431"), (String::new(), "400")] {
            let mut s = TcpStream::connect(&addr).await.unwrap();
            let request = if head.is_empty() {
                "GARBAGE\r\n\r\n".to_string()
            } else {
                format!("GET /health HTTP/1.1\r\n{head}\r\n")
            };
            // The server may answer and close before it has read all of a huge head.
            let _ = s.write_all(request.as_bytes()).await;
            let (got, _) = until_closed(&mut s, Duration::from_secs(5)).await.expect("an answer");
            assert!(got.starts_with(&format!("HTTP/1.1 {want}")), "{got}");
            let body = got.split_once("\r\n\r\n").map(|(_, b)| b).unwrap_or_default();
            let json: serde_json::Value = serde_json::from_str(body).unwrap_or_else(|e| panic!("{e}: {got}"));
            assert_eq!(json["error"]["type"], "invalid_request_error", "{got}");
        }
    }

    /// 300 slow sockets against a cap of 256: the ones past it get 503 at once, and so does
    /// any client while they hold the server (a refusal, not silence); once the slow ones time
    /// out the server answers again.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn past_the_cap_connections_get_503() {
        let limits = ConnLimits { max: 256, header: Duration::from_secs(2), body: Duration::from_secs(2) };
        let addr = server(limits).await;
        let mut slow = Vec::new();
        for _ in 0..300 {
            let mut s = TcpStream::connect(&addr).await.unwrap();
            s.write_all(b"POST /echo HTTP/1.1\r\n").await.unwrap();
            slow.push(s);
        }
        let mut refused = 0;
        for s in &mut slow[256..] {
            let (got, _) = until_closed(s, Duration::from_secs(2)).await.expect("a refusal");
            assert!(got.starts_with("HTTP/1.1 503"), "{got}");
            assert!(got.contains("256 connections open, its limit"), "{got}");
            refused += 1;
        }
        assert_eq!(refused, 44);
        let got = health(&addr).await;
        assert!(got.starts_with("HTTP/1.1 503"), "while the slow sockets hold the server: {got}");
        // The slow ones close at their header timeout; then the server answers.
        let t0 = Instant::now();
        loop {
            let got = health(&addr).await;
            if got.starts_with("HTTP/1.1 200") {
                break;
            }
            assert!(t0.elapsed() < Duration::from_secs(10), "still refused: {got}");
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
}
