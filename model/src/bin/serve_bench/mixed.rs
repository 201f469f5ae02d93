//! `--mixed`: long prompts arriving among decoding streams (the module doc of main.rs).

use std::time::{Duration, Instant};

use anyhow::{Result, bail};

use crate::http::{Sample, joined, percentile, quantile_ms, request};
use crate::{Args, UNIT, repeats};

/// `--mixed` (module doc).
pub(crate) fn mixed(addr: &str, args: &Args) -> Result<()> {
    if args.streams == 0 || args.seconds == 0 || args.long_tokens < 64 {
        bail!("--streams and --seconds must be at least 1, --long-tokens at least 64");
    }
    let reps = repeats(addr, args, args.long_tokens)?;
    let long = |i: usize| args.body(&format!("{i}: {}", UNIT.repeat(reps)), 1);
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
        let q = |p: f64| quantile_ms(&gaps, p);
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
