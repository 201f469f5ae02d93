//! `serve_bench`: a serving benchmark against a running `serve`. For each concurrency N of
//! `--clients` (1, 8 and 64 by default), N clients at once each run `--rounds` streamed chat
//! requests one after another (after `--warmup` rounds that are not counted: a first step of
//! each batch size records its CUDA graph), each greedy, asking for `--max-tokens` tokens with
//! `ignore_eos` (so every request generates exactly that many). Then it prints, per N: the
//! requests, the tokens generated (the usage the server reports), the aggregate tokens/s (all
//! of them over the measured rounds' wall time), the time to first token (connecting to the
//! first chunk with text) and the inter-token latency (the gaps between a stream's chunks with
//! text), each as median and p90, and the tokens a chunk (1.00 when every token came in a chunk
//! of its own, so the gaps are per token; a token whose text is held back, an incomplete
//! character, arrives with the next). `--json-schema SCHEMA` asks every request for it as
//! `response_format` (thinking off): the cost of structured outputs beside a run without.
//!
//! `--mixed` measures instead what long prompts do to decoding streams (chunked prefill:
//! `serve --max-step-tokens`): a long prompt alone (`--long-tokens` tokens, its length found by
//! two short requests first; max_tokens 1) three times, its whole request's time giving the
//! prefill rate; then `--streams` streams decoding alone for `--seconds` (each running
//! `--max-tokens` requests back to back, after a warm-up request each), then the same streams
//! for as long again while a new long prompt arrives every `--long-every-ms`. It prints the
//! streams' inter-token latency (median, p90, p99, max) in both phases, the p99 with long
//! prompts against the median without, and the long prompts' whole-request times.
//!
//! The clients speak HTTP/1.1 over plain TCP (one connection a request) and read the
//! server-sent events as they come; no Python, no client library, so it runs where only the
//! binaries are.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use clap::Parser;
use serde_json::{Value, json};

/// Streams chat completions from a running `serve` with N concurrent clients and reports
/// tokens/s, time to first token and inter-token latency.
#[derive(Parser, Debug)]
#[command(name = "serve_bench", version)]
struct Args {
    /// The server (http://HOST:PORT).
    #[arg(long, default_value = "http://127.0.0.1:8000")]
    url: String,
    /// Concurrent clients, one run each (a comma-separated list).
    #[arg(long, value_delimiter = ',', default_value = "1,8,64")]
    clients: Vec<usize>,
    /// Tokens each request generates.
    #[arg(long, default_value_t = 256)]
    max_tokens: usize,
    /// Measured requests per client, one after another.
    #[arg(long, default_value_t = 2)]
    rounds: usize,
    /// Requests per client before the measured ones (not counted).
    #[arg(long, default_value_t = 1)]
    warmup: usize,
    /// The user message of every request (client i's is prefixed with its number).
    #[arg(long, default_value = "Write a long story about a lighthouse keeper and the sea.")]
    prompt: String,
    /// Long prompts arriving among decoding streams instead of the client sweep.
    #[arg(long)]
    mixed: bool,
    /// With --mixed: the decoding streams.
    #[arg(long, default_value_t = 32)]
    streams: usize,
    /// With --mixed: the tokens of each long prompt (about: its text is a sentence repeated).
    #[arg(long, default_value_t = 4000)]
    long_tokens: usize,
    /// With --mixed: a new long prompt every this many milliseconds.
    #[arg(long, default_value_t = 1000)]
    long_every_ms: u64,
    /// With --mixed: seconds of each phase (streams alone, streams with long prompts).
    #[arg(long, default_value_t = 15)]
    seconds: u64,
    /// A JSON schema (its text) every request asks for as `response_format`, with thinking off
    /// so the constraint holds from the first token: what structured outputs cost. The output
    /// must not be able to end before --max-tokens (a request ends where its JSON is complete):
    /// `{"type": "array", "items": {"type": "string"}, "minItems": 200}` at 256 tokens, say.
    #[arg(long)]
    json_schema: Option<String>,
}

impl Args {
    /// A streamed greedy chat request of one user message, `max_tokens` tokens with
    /// ignore_eos, held to `--json-schema` when given.
    fn body(&self, content: &str, max_tokens: usize) -> String {
        let mut body = json!({
            "messages": [{"role": "user", "content": content}],
            "stream": true, "stream_options": {"include_usage": true},
            "max_tokens": max_tokens, "temperature": 0, "ignore_eos": true,
        });
        if let Some(schema) = self.json_schema.as_deref().and_then(|s| serde_json::from_str::<Value>(s).ok()) {
            body["response_format"] =
                json!({"type": "json_schema", "json_schema": {"name": "bench", "schema": schema}});
            body["chat_template_kwargs"] = json!({"enable_thinking": false});
        }
        body.to_string()
    }
}

/// What one request measured.
struct Sample {
    /// From connecting to its first chunk with text.
    ttft: Option<Duration>,
    /// From connecting to the stream's end.
    total: Duration,
    /// Between the stream's chunks with text.
    gaps: Vec<Duration>,
    chunks: usize,
    /// Generated tokens and prompt tokens (the usage the server reports).
    tokens: usize,
    prompt_tokens: usize,
}

fn main() -> Result<()> {
    let args = Args::parse();
    let addr = args.url.strip_prefix("http://").context("--url must be http://HOST:PORT")?.trim_end_matches('/');
    if args.clients.contains(&0) || args.rounds == 0 || args.max_tokens == 0 {
        bail!("--clients, --rounds and --max-tokens must be at least 1");
    }
    if let Some(schema) = &args.json_schema {
        let parsed: Value = serde_json::from_str(schema).context("--json-schema must be a JSON schema")?;
        if !parsed.is_object() {
            bail!("--json-schema must be a JSON schema (an object)");
        }
    }
    if args.mixed {
        return mixed(addr, &args);
    }
    println!(
        "serve_bench: {} with {} tokens a request (greedy, ignore_eos{}), {} measured rounds after {} warm-up",
        args.url,
        args.max_tokens,
        if args.json_schema.is_some() { ", held to --json-schema" } else { "" },
        args.rounds,
        args.warmup
    );
    println!("clients requests   tokens   wall s   tokens/s  TTFT p50  TTFT p90   ITL p50   ITL p90 tokens/chunk");
    for &n in &args.clients {
        let (samples, wall) = run(addr, &args, n)?;
        let tokens: usize = samples.iter().map(|s| s.tokens).sum();
        let chunks: usize = samples.iter().map(|s| s.chunks).sum();
        if let Some(s) = samples.iter().find(|s| s.tokens != args.max_tokens) {
            let why = match args.json_schema {
                Some(_) => "a schema whose output can end sooner (raise its minItems, say)?",
                None => "does the server honour ignore_eos?",
            };
            bail!("a request generated {} tokens, not --max-tokens {}: {why}", s.tokens, args.max_tokens);
        }
        let ttft = samples.iter().map(|s| s.ttft.context("a stream ended without text")).collect::<Result<Vec<_>>>()?;
        let gaps: Vec<Duration> = samples.iter().flat_map(|s| s.gaps.iter().copied()).collect();
        let ms = |v: &[Duration], p: f64| {
            percentile(v, p).map_or("-".to_string(), |d| format!("{:.2}", d.as_secs_f64() * 1e3))
        };
        println!(
            "{n:>7} {:>8} {tokens:>8} {:>8.2} {:>10.1} {:>9} {:>9} {:>9} {:>9} {:>12.2}",
            samples.len(),
            wall.as_secs_f64(),
            tokens as f64 / wall.as_secs_f64(),
            ms(&ttft, 0.5),
            ms(&ttft, 0.9),
            ms(&gaps, 0.5),
            ms(&gaps, 0.9),
            tokens as f64 / chunks.max(1) as f64,
        );
    }
    println!(
        "(times in ms; TTFT: connecting to the first chunk with text; ITL: gaps between a stream's chunks with text)"
    );
    Ok(())
}

/// `n` clients, each running the warm-up requests, then the measured ones: the measured
/// requests' samples and the wall time from their start (all clients at once) to the last
/// one's end.
fn run(addr: &str, args: &Args, n: usize) -> Result<(Vec<Sample>, Duration)> {
    let start = Arc::new(Barrier::new(n + 1));
    let clients: Vec<_> = (0..n)
        .map(|i| {
            let body = args.body(&format!("{i}: {}", args.prompt), args.max_tokens);
            let (addr, start, warmup, rounds) = (addr.to_string(), start.clone(), args.warmup, args.rounds);
            std::thread::spawn(move || -> Result<Vec<Sample>> {
                let warm = (0..warmup).try_for_each(|_| request(&addr, &body).map(drop));
                // Every client reaches the start, failed or not, so that none waits for ever.
                start.wait();
                warm?;
                (0..rounds).map(|_| request(&addr, &body)).collect()
            })
        })
        .collect();
    start.wait();
    let t0 = Instant::now();
    let mut samples = Vec::new();
    for c in clients {
        samples.extend(c.join().map_err(|_| anyhow::anyhow!("a client panicked"))??);
    }
    Ok((samples, t0.elapsed()))
}

/// `--mixed` (module doc).
fn mixed(addr: &str, args: &Args) -> Result<()> {
    if args.streams == 0 || args.seconds == 0 || args.long_tokens < 64 {
        bail!("--streams and --seconds must be at least 1, --long-tokens at least 64");
    }
    // The long prompt's length: a sentence repeated, its tokens a repeat found from two sizes.
    let unit = "The keeper climbed the winding stairs at dusk and lit the great lamp above the sea. ";
    let tokens = |reps: usize| request(addr, &args.body(&unit.repeat(reps), 1)).map(|s| s.prompt_tokens);
    let (t8, t16) = (tokens(8)?, tokens(16)?);
    let per = (t16.saturating_sub(t8) as f64 / 8.0).max(1.0);
    let fixed = t8 as f64 - 8.0 * per;
    let reps = ((args.long_tokens as f64 - fixed) / per).round().max(1.0) as usize;
    let long = |i: usize| args.body(&format!("{i}: {}", unit.repeat(reps)), 1);
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    let alone: Vec<Sample> = (0..3).map(|i| request(addr, &long(i))).collect::<Result<_>>()?;
    let prompt = alone[0].prompt_tokens;
    let total: Vec<Duration> = alone.iter().map(|s| s.total).collect();
    let p50 = percentile(&total, 0.5).unwrap_or_default();
    println!(
        "serve_bench --mixed: {}; a long prompt of {prompt} tokens alone (max_tokens 1): {:.1} ms (median of 3), \
         {:.0} prompt tokens/s",
        args.url,
        ms(p50),
        prompt as f64 / p50.as_secs_f64()
    );
    // Each stream's warm-up request first (a first step of each batch size records its graph).
    let warm: Vec<String> = (0..args.streams).map(|i| args.body(&format!("{i}: {}", args.prompt), 8)).collect();
    std::thread::scope(|s| {
        let all: Vec<_> = warm.iter().map(|b| s.spawn(|| request(addr, b))).collect();
        all.into_iter().try_for_each(|h| joined(h).map(drop))
    })?;
    println!(
        "phase                    ITL p50   ITL p90   ITL p99   ITL max  tokens/s  long prompts  their time p50 / max"
    );
    let mut plain = Duration::ZERO;
    for with_long in [false, true] {
        let until = Instant::now() + Duration::from_secs(args.seconds);
        let (streams, longs, wall) = std::thread::scope(|s| -> Result<_> {
            let t0 = Instant::now();
            let streams: Vec<_> = (0..args.streams)
                .map(|i| {
                    let body = args.body(&format!("{i}: {}", args.prompt), args.max_tokens);
                    s.spawn(move || {
                        let mut out = Vec::new();
                        while Instant::now() < until {
                            out.push(request(addr, &body)?);
                        }
                        Ok::<_, anyhow::Error>(out)
                    })
                })
                .collect();
            // A new long prompt every period, each on a thread of its own (they may overlap).
            let mut longs = Vec::new();
            let period = Duration::from_millis(args.long_every_ms);
            let mut k = 0;
            while with_long && t0 + period * k < until {
                std::thread::sleep((t0 + period * k).saturating_duration_since(Instant::now()));
                let body = long(1000 + k as usize);
                longs.push(s.spawn(move || request(addr, &body)));
                k += 1;
            }
            let streams: Vec<Vec<Sample>> = streams.into_iter().map(joined).collect::<Result<_>>()?;
            let longs: Vec<Sample> = longs.into_iter().map(joined).collect::<Result<_>>()?;
            let streams: Vec<Sample> = streams.into_iter().flatten().collect();
            Ok((streams, longs, t0.elapsed()))
        })?;
        let gaps: Vec<Duration> = streams.iter().flat_map(|s| s.gaps.iter().copied()).collect();
        let q = |p: f64| percentile(&gaps, p).map_or("-".into(), |d| format!("{:.2}", ms(d)));
        let tokens: usize = streams.iter().map(|s| s.tokens).sum();
        let total: Vec<Duration> = longs.iter().map(|s| s.total).collect();
        let long_time = match (percentile(&total, 0.5), total.iter().max()) {
            (Some(a), Some(b)) => format!("{:.1} / {:.1}", ms(a), ms(*b)),
            _ => "-".into(),
        };
        let name =
            if with_long { format!("{} streams + long", args.streams) } else { format!("{} streams", args.streams) };
        println!(
            "{name:<22} {:>9} {:>9} {:>9} {:>9} {:>9.1} {:>13}  {long_time}",
            q(0.5),
            q(0.9),
            q(0.99),
            q(1.0),
            tokens as f64 / wall.as_secs_f64(),
            longs.len(),
        );
        match with_long {
            false => plain = percentile(&gaps, 0.5).unwrap_or_default(),
            true => println!(
                "ITL p99 with long prompts / ITL p50 without: {:.2}",
                percentile(&gaps, 0.99).unwrap_or_default().as_secs_f64() / plain.as_secs_f64().max(1e-9)
            ),
        }
    }
    println!("(times in ms; each phase {} s)", args.seconds);
    Ok(())
}

/// What a client thread returned, a panic as an error.
fn joined<T>(h: std::thread::ScopedJoinHandle<'_, Result<T>>) -> Result<T> {
    h.join().map_err(|_| anyhow::anyhow!("a client panicked"))?
}

/// One streamed chat request on a connection of its own.
fn request(addr: &str, body: &str) -> Result<Sample> {
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
    let mut sample = Sample { ttft: None, total: Duration::ZERO, gaps: vec![], chunks: 0, tokens: 0, prompt_tokens: 0 };
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
            }
            let delta = &v["choices"][0]["delta"];
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

/// The `p` quantile of `v` (nearest rank), `None` for no values.
fn percentile(v: &[Duration], p: f64) -> Option<Duration> {
    let mut v = v.to_vec();
    v.sort();
    let rank = ((p * v.len() as f64).ceil() as usize).clamp(1, v.len().max(1));
    v.get(rank - 1).copied()
}
