//! `GET /metrics`: the server's counters in Prometheus's text format (version 0.0.4). Requests
//! by route and status; prompt and generated tokens; the time to first token, the gaps between
//! a request's tokens and a request's whole time as histograms (from its hand-over to the
//! engine); the requests in the engine as the admission counts them, busy slots and the queue.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use super::worker::EngineHandle;

/// Upper bounds of the histograms' buckets, in seconds (then `+Inf`).
const TTFT_BOUNDS: &[f64] = &[0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0];
const GAP_BOUNDS: &[f64] = &[0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0];
const DURATION_BOUNDS: &[f64] = &[0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0];

/// A histogram of durations: a count a bucket (the last past every bound) and the sum.
struct Histogram {
    bounds: &'static [f64],
    counts: Vec<AtomicU64>,
    sum_ns: AtomicU64,
}

impl Histogram {
    fn new(bounds: &'static [f64]) -> Histogram {
        Histogram { bounds, counts: (0..=bounds.len()).map(|_| AtomicU64::new(0)).collect(), sum_ns: AtomicU64::new(0) }
    }

    fn observe(&self, d: Duration) {
        let s = d.as_secs_f64();
        let i = self.bounds.iter().position(|&b| s <= b).unwrap_or(self.bounds.len());
        self.counts[i].fetch_add(1, Ordering::Relaxed);
        self.sum_ns.fetch_add(u64::try_from(d.as_nanos()).unwrap_or(u64::MAX), Ordering::Relaxed);
    }

    /// The `_bucket` lines (cumulative), `_sum` and `_count` of `name`.
    fn render(&self, out: &mut String, name: &str, help: &str) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        let mut total = 0;
        for (i, c) in self.counts.iter().enumerate() {
            total += c.load(Ordering::Relaxed);
            let le = self.bounds.get(i).map_or("+Inf".to_string(), |b| b.to_string());
            let _ = writeln!(out, "{name}_bucket{{le=\"{le}\"}} {total}");
        }
        let sum = self.sum_ns.load(Ordering::Relaxed) as f64 * 1e-9;
        let _ = writeln!(out, "{name}_sum {sum}\n{name}_count {total}");
    }
}

/// The server's counters.
pub struct Metrics {
    /// Answers by route (`other` for a path the server does not have) and status.
    responses: Mutex<BTreeMap<(String, u16), u64>>,
    prompt_tokens: AtomicU64,
    cached_tokens: AtomicU64,
    generation_tokens: AtomicU64,
    ttft: Histogram,
    gaps: Histogram,
    duration: Histogram,
}

impl Default for Metrics {
    fn default() -> Metrics {
        Metrics {
            responses: Mutex::new(BTreeMap::new()),
            prompt_tokens: AtomicU64::new(0),
            cached_tokens: AtomicU64::new(0),
            generation_tokens: AtomicU64::new(0),
            ttft: Histogram::new(TTFT_BOUNDS),
            gaps: Histogram::new(GAP_BOUNDS),
            duration: Histogram::new(DURATION_BOUNDS),
        }
    }
}

impl Metrics {
    /// One answer of `status` to a request for `route` (the route it matched, none for a path
    /// the server does not have).
    pub fn response(&self, route: Option<&str>, status: u16) {
        let route = route.unwrap_or("other").to_string();
        let mut map = self.responses.lock().unwrap_or_else(|e| e.into_inner());
        *map.entry((route, status)).or_default() += 1;
    }

    /// A generation's end: its tokens in (and of them restored from the prefix cache) and out,
    /// its first token's time (none if no token came) and its whole time.
    pub fn request(
        &self,
        (prompt, cached, generated): (usize, usize, usize),
        first: Option<Duration>,
        whole: Duration,
    ) {
        self.prompt_tokens.fetch_add(prompt as u64, Ordering::Relaxed);
        self.cached_tokens.fetch_add(cached as u64, Ordering::Relaxed);
        self.generation_tokens.fetch_add(generated as u64, Ordering::Relaxed);
        if let Some(first) = first {
            self.ttft.observe(first);
        }
        self.duration.observe(whole);
    }

    /// The time between two tokens of one request.
    pub fn gap(&self, d: Duration) {
        self.gaps.observe(d);
    }

    /// Everything in Prometheus's text format, with `engine`'s admission counts.
    pub fn render(&self, engine: &EngineHandle) -> String {
        let mut out = String::new();
        let name = "nemotron_requests_total";
        let _ = writeln!(out, "# HELP {name} Answers by route and status.\n# TYPE {name} counter");
        for ((route, status), n) in self.responses.lock().unwrap_or_else(|e| e.into_inner()).iter() {
            let _ = writeln!(out, "{name}{{route=\"{route}\",status=\"{status}\"}} {n}");
        }
        let counters = [
            ("nemotron_prompt_tokens_total", "Prompt tokens of the generations.", &self.prompt_tokens),
            (
                "nemotron_prompt_tokens_cached_total",
                "Prompt tokens restored from the prefix cache.",
                &self.cached_tokens,
            ),
            ("nemotron_generation_tokens_total", "Tokens generated.", &self.generation_tokens),
        ];
        for (name, help, v) in counters {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} counter\n{name} {}", v.load(Ordering::Relaxed));
        }
        self.ttft.render(
            &mut out,
            "nemotron_time_to_first_token_seconds",
            "From a request's hand-over to the engine to its first token.",
        );
        self.gaps.render(&mut out, "nemotron_inter_token_latency_seconds", "Between two tokens of one request.");
        self.duration.render(
            &mut out,
            "nemotron_request_duration_seconds",
            "From a request's hand-over to the engine to its end.",
        );
        let (admitted, slots) = (engine.admitted(), engine.info.slots);
        let gauges = [
            ("nemotron_requests_admitted", "Requests running or waiting for a slot.", admitted),
            ("nemotron_slots", "Requests the engine runs at once.", slots),
            ("nemotron_busy_slots", "Slots the admitted requests take.", admitted.min(slots)),
            ("nemotron_queue_depth", "Admitted requests waiting for a slot.", admitted.saturating_sub(slots)),
        ];
        for (name, help, v) in gauges {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} gauge\n{name} {v}");
        }
        if let Some(s) = engine.prefix_stats() {
            // f64 prints whole values as integers, exact below 2^53.
            let prefix = [
                ("hits_total", "counter", "Requests that restored a prefix.", s.hits as f64),
                ("hit_tokens_total", "counter", "Prompt tokens restored.", s.hit_tokens as f64),
                ("misses_total", "counter", "Requests that found no prefix.", s.misses as f64),
                ("saved_total", "counter", "Snapshots taken.", s.saved as f64),
                ("evictions_total", "counter", "Snapshots evicted past the budget.", s.evictions as f64),
                ("snapshots", "gauge", "Snapshots held.", s.entries as f64),
                ("bytes", "gauge", "Bytes the snapshots take.", s.bytes as f64),
                (
                    "save_seconds_total",
                    "counter",
                    "Host time the saves took (allocating, queueing the copies).",
                    s.save_us as f64 / 1e6,
                ),
            ];
            for (name, kind, help, v) in prefix {
                let name = format!("nemotron_prefix_cache_{name}");
                let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {v}");
            }
        }
        out
    }
}
