//! The bench's client: one streamed chat request on a connection of its own, timed as its
//! server-sent events arrive.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use serde_json::Value;

/// What one request measured.
pub(crate) struct Sample {
    /// From connecting to its first chunk with text.
    pub(crate) ttft: Option<Duration>,
    /// From connecting to the stream's end.
    pub(crate) total: Duration,
    /// Between the stream's chunks with text.
    pub(crate) gaps: Vec<Duration>,
    pub(crate) chunks: usize,
    /// Generated tokens and prompt tokens (the usage the server reports).
    pub(crate) tokens: usize,
    pub(crate) prompt_tokens: usize,
    /// Of the prompt tokens, those the server restored from its prefix cache.
    pub(crate) cached_tokens: usize,
    /// The answer's content (what a client sends back in the conversation's next turn).
    pub(crate) content: String,
}

/// What a client thread returned, a panic as an error.
pub(crate) fn joined<T>(h: std::thread::ScopedJoinHandle<'_, Result<T>>) -> Result<T> {
    h.join().map_err(|_| anyhow::anyhow!("a client panicked"))?
}

/// One streamed chat request on a connection of its own.
pub(crate) fn request(addr: &str, body: &str) -> Result<Sample> {
    let t0 = Instant::now();
    let mut stream = TcpStream::connect(addr).with_context(|| format!("connecting to {addr}"))?;
    stream.set_nodelay(true)?;
    write!(
        stream,
        "POST /v1/chat/completions HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )?;
    let mut r = BufReader::new(stream);
    let mut line = String::new();
    r.read_line(&mut line)?;
    let status = line.trim_end().to_string();
    let mut chunked = false;
    loop {
        line.clear();
        if r.read_line(&mut line)? == 0 || line == "\r\n" {
            break;
        }
        let (name, value) = line.split_once(':').unwrap_or((&line, ""));
        chunked |= name.eq_ignore_ascii_case("transfer-encoding") && value.trim().eq_ignore_ascii_case("chunked");
    }
    if !status.starts_with("HTTP/1.1 200") {
        let mut rest = String::new();
        r.read_to_string(&mut rest)?;
        bail!("{status}: {rest}");
    }
    let (mut events, mut last) = (Events::default(), t0);
    let mut sample = Sample {
        ttft: None,
        total: Duration::ZERO,
        gaps: vec![],
        chunks: 0,
        tokens: 0,
        prompt_tokens: 0,
        cached_tokens: 0,
        content: String::new(),
    };
    let (mut tokens, mut prompt_tokens) = (None, None);
    while let Some(bytes) = body_piece(&mut r, chunked)? {
        let now = Instant::now();
        for data in events.push(&bytes) {
            if data == "[DONE]" {
                continue;
            }
            let v: Value = serde_json::from_str(&data).with_context(|| format!("a chunk that is not JSON: {data}"))?;
            if let Some(e) = v.get("error") {
                bail!("the stream failed: {e}");
            }
            if let Some(n) = v["usage"]["completion_tokens"].as_u64() {
                tokens = Some(n as usize);
                prompt_tokens = v["usage"]["prompt_tokens"].as_u64().map(|n| n as usize);
                let cached = v["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64();
                sample.cached_tokens = cached.unwrap_or_default() as usize;
            }
            let delta = &v["choices"][0]["delta"];
            sample.content += delta["content"].as_str().unwrap_or_default();
            let text = ["content", "reasoning"].iter().any(|k| delta[k].as_str().is_some_and(|t| !t.is_empty()));
            if !text && delta.get("tool_calls").is_none() {
                continue;
            }
            match sample.ttft {
                None => sample.ttft = Some(now - t0),
                Some(_) => sample.gaps.push(now - last),
            }
            sample.chunks += 1;
            last = now;
        }
    }
    sample.total = t0.elapsed();
    sample.tokens = tokens.context("the stream ended without usage")?;
    sample.prompt_tokens = prompt_tokens.context("the usage has no prompt_tokens")?;
    Ok(sample)
}

/// The next piece of the response body as it arrives (`None` at its end): a chunk of a
/// chunked body, else whatever the connection has.
fn body_piece(r: &mut BufReader<TcpStream>, chunked: bool) -> Result<Option<Vec<u8>>> {
    if !chunked {
        let mut buf = vec![0; 16384];
        let n = r.read(&mut buf)?;
        buf.truncate(n);
        return Ok((n > 0).then_some(buf));
    }
    let mut line = String::new();
    r.read_line(&mut line)?;
    let size = usize::from_str_radix(line.trim().split(';').next().unwrap_or(""), 16)
        .with_context(|| format!("a chunk size that is not hex: {line:?}"))?;
    if size == 0 {
        return Ok(None);
    }
    let mut buf = vec![0; size + 2];
    r.read_exact(&mut buf)?;
    buf.truncate(size);
    Ok(Some(buf))
}

/// Server-sent events split out of a byte stream.
#[derive(Default)]
struct Events {
    pending: Vec<u8>,
}

impl Events {
    /// The `data` of each event that `bytes` completes.
    fn push(&mut self, bytes: &[u8]) -> Vec<String> {
        self.pending.extend_from_slice(bytes);
        let mut out = Vec::new();
        while let Some(end) = self.pending.windows(2).position(|w| w == b"\n\n") {
            let event: Vec<u8> = self.pending.drain(..end + 2).collect();
            let event = String::from_utf8_lossy(&event);
            let data: Vec<&str> = event
                .lines()
                .filter_map(|l| l.strip_prefix("data:"))
                .map(|d| d.strip_prefix(' ').unwrap_or(d))
                .collect();
            if !data.is_empty() {
                out.push(data.join("\n"));
            }
        }
        out
    }
}

/// The `p` quantile of `v` in milliseconds to a hundredth, `-` for no values.
pub(crate) fn quantile_ms(v: &[Duration], p: f64) -> String {
    percentile(v, p).map_or("-".into(), |d| format!("{:.2}", d.as_secs_f64() * 1e3))
}

/// The `p` quantile of `v` (nearest rank), `None` for no values.
pub(crate) fn percentile(v: &[Duration], p: f64) -> Option<Duration> {
    let mut v = v.to_vec();
    v.sort();
    let rank = ((p * v.len() as f64).ceil() as usize).clamp(1, v.len().max(1));
    v.get(rank - 1).copied()
}
