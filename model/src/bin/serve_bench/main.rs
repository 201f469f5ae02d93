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
//! `--turns T` and `--shared-prefix N` measure the server's prefix cache (`serve
//! --prefix-cache-gb`; run the server with 0 beside it for the cache's cost to decoding).
//! `--turns`: `--conversations` conversations at once, each T turns back to back (a user
//! message of about `--turn-tokens` tokens, the answer's content sent back with the next); per
//! turn the prompt tokens, those restored (`usage.prompt_tokens_details.cached_tokens`) and the
//! time to first token; then turn T+1 of every conversation at once, and the same prompts each
//! with a first message of its own (nothing to restore): the time to first token with the
//! cache against without. `--shared-prefix`: a system prompt of about N tokens shared by every
//! request, user messages of about each of `--suffixes` tokens after it (a word repeated: one
//! token a word in Nemotron's tokenizer), `--requests` of each one after another (after two
//! that let the server find the shared prefix); per suffix length, the share of the system
//! prompt restored (least and median) and the time to first token, beside the same requests
//! each with a system prompt of its own. Both start their conversations and system prompts with
//! a tag of the run, so a run restores nothing an earlier one against the same server saved.
//!
//! The clients speak HTTP/1.1 over plain TCP (one connection a request) and read the
//! server-sent events as they come; no Python, no client library, so it runs where only the
//! binaries are.

mod http;
mod mixed;
mod prefix;

use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use clap::Parser;
use serde_json::{Value, json};

use http::{Sample, quantile_ms, request};

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
    /// Conversations of this many turns instead of the client sweep: what the prefix cache
    /// (`serve --prefix-cache-gb`) does for them.
    #[arg(long)]
    turns: Option<usize>,
    /// With --turns: the conversations at once.
    #[arg(long, default_value_t = 32)]
    conversations: usize,
    /// With --turns: the tokens of each user message (about: a sentence repeated).
    #[arg(long, default_value_t = 500)]
    turn_tokens: usize,
    /// A system prompt of about this many tokens shared by every request instead of the client
    /// sweep: what the prefix cache does for it, whatever follows.
    #[arg(long)]
    shared_prefix: Option<usize>,
    /// With --shared-prefix: the tokens of the user messages after it (about; a comma-separated
    /// list, a row each).
    #[arg(long, value_delimiter = ',', default_value = "1,16,64,256,700")]
    suffixes: Vec<usize>,
    /// With --shared-prefix: the requests of each suffix length.
    #[arg(long, default_value_t = 8)]
    requests: usize,
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
        self.chat(json!([{"role": "user", "content": content}]), max_tokens).to_string()
    }

    /// [`Args::body`] of a conversation, as JSON.
    fn chat(&self, messages: Value, max_tokens: usize) -> Value {
        let mut body = json!({
            "messages": messages,
            "stream": true, "stream_options": {"include_usage": true},
            "max_tokens": max_tokens, "temperature": 0, "ignore_eos": true,
        });
        if let Some(schema) = self.json_schema.as_deref().and_then(|s| serde_json::from_str::<Value>(s).ok()) {
            body["response_format"] =
                json!({"type": "json_schema", "json_schema": {"name": "bench", "schema": schema}});
            body["chat_template_kwargs"] = json!({"enable_thinking": false});
        }
        body
    }
}

/// The sentence long prompts repeat.
const UNIT: &str = "The keeper climbed the winding stairs at dusk and lit the great lamp above the sea. ";

/// How many times a user message repeats [`UNIT`] to make a prompt of about `tokens` tokens:
/// the tokens of a repeat found from two requests (8 and 16 repeats, max_tokens 1).
fn repeats(addr: &str, args: &Args, tokens: usize) -> Result<usize> {
    let of = |reps: usize| request(addr, &args.body(&UNIT.repeat(reps), 1)).map(|s| s.prompt_tokens);
    let (t8, t16) = (of(8)?, of(16)?);
    let per = (t16.saturating_sub(t8) as f64 / 8.0).max(1.0);
    let fixed = t8 as f64 - 8.0 * per;
    Ok(((tokens as f64 - fixed) / per).round().max(1.0) as usize)
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
        return mixed::mixed(addr, &args);
    }
    if let Some(turns) = args.turns {
        return prefix::turns(addr, &args, turns);
    }
    if let Some(tokens) = args.shared_prefix {
        return prefix::shared(addr, &args, tokens);
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
        println!(
            "{n:>7} {:>8} {tokens:>8} {:>8.2} {:>10.1} {:>9} {:>9} {:>9} {:>9} {:>12.2}",
            samples.len(),
            wall.as_secs_f64(),
            tokens as f64 / wall.as_secs_f64(),
            quantile_ms(&ttft, 0.5),
            quantile_ms(&ttft, 0.9),
            quantile_ms(&gaps, 0.5),
            quantile_ms(&gaps, 0.9),
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
