//! `--turns` and `--shared-prefix`: what the server's prefix cache does for conversations and
//! for a system prompt shared by every request (the module doc of main.rs).

use std::sync::Barrier;
use std::time::Duration;

use anyhow::{Result, bail};
use serde_json::{Value, json};

use crate::http::{Sample, joined, percentile, quantile_ms, request};
use crate::{Args, UNIT, repeats};

/// The median of `v`.
fn median(mut v: Vec<usize>) -> usize {
    v.sort_unstable();
    v.get(v.len() / 2).copied().unwrap_or_default()
}

fn ttfts(samples: &[Sample]) -> Vec<Duration> {
    samples.iter().filter_map(|s| s.ttft).collect()
}

/// The requests `bodies`, all at once (a thread each, started together).
fn at_once(addr: &str, bodies: &[Value]) -> Result<Vec<Sample>> {
    let start = Barrier::new(bodies.len());
    std::thread::scope(|s| {
        let all: Vec<_> = bodies
            .iter()
            .map(|b| {
                let (b, start) = (b.to_string(), &start);
                s.spawn(move || {
                    start.wait();
                    request(addr, &b)
                })
            })
            .collect();
        all.into_iter().map(joined).collect()
    })
}

fn user(content: String) -> Value {
    json!({"role": "user", "content": content})
}

/// A tag of this run (the clock's milliseconds) that starts every conversation and system
/// prompt, so that no run restores what an earlier run against the same server saved.
fn run_tag() -> u128 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis())
}

/// `--turns`: `--conversations` conversations at once, each `turns` turns back to back (a user
/// message of about `--turn-tokens` tokens, then the answer's content sent back with the next);
/// per turn, the prompt tokens, those restored and the time to first token. Then every
/// conversation's next turn at once, and the same prompts again each with a first message of its
/// own (nothing to restore): the time to first token with the cache against without.
pub(crate) fn turns(addr: &str, args: &Args, turns: usize) -> Result<()> {
    let n = args.conversations;
    if turns == 0 || n == 0 || args.turn_tokens == 0 {
        bail!("--turns, --conversations and --turn-tokens must be at least 1");
    }
    let reps = repeats(addr, args, args.turn_tokens)?;
    let tag = run_tag();
    let message = |c: usize, t: usize| user(format!("{tag}.{c}.{t}: {}", UNIT.repeat(reps)));
    let runs: Vec<(Vec<Sample>, Vec<Value>)> = std::thread::scope(|s| {
        let all: Vec<_> = (0..n)
            .map(|c| {
                s.spawn(move || -> Result<_> {
                    let (mut messages, mut samples) = (Vec::new(), Vec::new());
                    for t in 0..turns {
                        messages.push(message(c, t));
                        let sample = request(addr, &args.chat(json!(messages), args.max_tokens).to_string())?;
                        messages.push(json!({"role": "assistant", "content": sample.content}));
                        samples.push(sample);
                    }
                    Ok((samples, messages))
                })
            })
            .collect();
        all.into_iter().map(joined).collect::<Result<_>>()
    })?;
    println!(
        "serve_bench --turns {turns}: {}, {n} conversations at once, user messages of about {} tokens, answers of {}",
        args.url, args.turn_tokens, args.max_tokens
    );
    println!("turn  prompt p50  restored p50  TTFT p50  TTFT p90");
    for t in 0..turns {
        let samples: Vec<&Sample> = runs.iter().map(|r| &r.0[t]).collect();
        let ttft: Vec<Duration> = samples.iter().filter_map(|s| s.ttft).collect();
        let prompt = median(samples.iter().map(|s| s.prompt_tokens).collect());
        let restored = median(samples.iter().map(|s| s.cached_tokens).collect());
        println!(
            "{:>4} {prompt:>11} {restored:>13} {:>9} {:>9}",
            t + 1,
            quantile_ms(&ttft, 0.5),
            quantile_ms(&ttft, 0.9)
        );
    }
    let next = |cold: bool| -> Vec<Value> {
        let bodies = runs.iter().enumerate().map(|(c, (_, history))| {
            let mut m = history.clone();
            if cold {
                m[0]["content"] = json!(format!("cold {c}: {}", m[0]["content"].as_str().unwrap_or_default()));
            }
            m.push(message(c, turns));
            args.chat(json!(m), args.max_tokens)
        });
        bodies.collect()
    };
    let (hit, cold) = (at_once(addr, &next(false))?, at_once(addr, &next(true))?);
    let p50 = |s: &[Sample]| percentile(&ttfts(s), 0.5).unwrap_or_default().as_secs_f64();
    println!(
        "turn {} of all {n} at once: prompts p50 {} tokens, {} restored; TTFT p50 {} ms, without the cache \
         (a first message of its own) {} ms: {:.1}%",
        turns + 1,
        median(hit.iter().map(|s| s.prompt_tokens).collect()),
        median(hit.iter().map(|s| s.cached_tokens).collect()),
        quantile_ms(&ttfts(&hit), 0.5),
        quantile_ms(&ttfts(&cold), 0.5),
        100.0 * p50(&hit) / p50(&cold).max(1e-9)
    );
    Ok(())
}

/// `--shared-prefix`: a system prompt of about `tokens` tokens shared by every request, with
/// user messages of about each of `--suffixes` tokens, `--requests` of each one after another
/// (after two that find the shared prefix): the share of the system prompt's tokens restored
/// and the time to first token, beside the same requests each with a system prompt of its own.
pub(crate) fn shared(addr: &str, args: &Args, tokens: usize) -> Result<()> {
    if tokens == 0 || args.requests == 0 || args.suffixes.is_empty() {
        bail!("--shared-prefix, --requests and --suffixes must be at least 1 (and some)");
    }
    let reps = repeats(addr, args, tokens)?;
    let tag = run_tag();
    let system = |own: &str| json!({"role": "system", "content": format!("{tag} {own}{}", UNIT.repeat(reps))});
    let ask = |own: &str, i: usize, n: usize| {
        let message = user(format!("{i}{}", " sea".repeat(n.saturating_sub(1))));
        args.chat(json!([system(own), message]), args.max_tokens).to_string()
    };
    // The system turn's tokens: a request with it less one without.
    let alone = args.chat(json!([user("0".into())]), 1).to_string();
    let shared = request(addr, &ask("", 0, 1))?.prompt_tokens.saturating_sub(request(addr, &alone)?.prompt_tokens);
    request(addr, &ask("", 1, 8))?;
    println!(
        "serve_bench --shared-prefix: {}, a system prompt of {shared} tokens, {} requests a suffix one after another, \
         {} tokens each",
        args.url, args.requests, args.max_tokens
    );
    println!("suffix  prompt p50  restored of shared: min   p50  TTFT p50  TTFT p50 without");
    for (k, &n) in args.suffixes.iter().enumerate() {
        let id = |r: usize| 100 + k * args.requests + r;
        let hit: Vec<Sample> = (0..args.requests).map(|r| request(addr, &ask("", id(r), n))).collect::<Result<_>>()?;
        let cold: Vec<Sample> =
            (0..args.requests).map(|r| request(addr, &ask(&format!("{} ", id(r)), id(r), n))).collect::<Result<_>>()?;
        let share = |s: &Sample| 100.0 * s.cached_tokens.min(shared) as f64 / shared.max(1) as f64;
        let mut shares: Vec<f64> = hit.iter().map(share).collect();
        shares.sort_by(f64::total_cmp);
        println!(
            "{n:>6} {:>11} {:>24.1}% {:>5.1}% {:>9} {:>17}",
            median(hit.iter().map(|s| s.prompt_tokens).collect()),
            shares[0],
            shares[shares.len() / 2],
            quantile_ms(&ttfts(&hit), 0.5),
            quantile_ms(&ttfts(&cold), 0.5)
        );
    }
    Ok(())
}
