//! `cargo bench --bench nano`: the whole model at Nemotron-3 Nano 30B-A3B sizes (52 layers,
//! `model/assets/nano-30b-a3b.json`; random bf16 weights generated in-process by
//! `model::synthetic::in_memory`, 63 GB on the device, or with `--fp8` every linear projection
//! as FP8 W8A8 with static input scales, `model::synthetic::Precision::Fp8`, or with `--nvfp4`
//! NVIDIA's NVFP4 recipe for Nano, `Precision::Nvfp4`) on the CUDA backend.
//! - prefill: one fresh request of 512, of 4096 and of 16384 tokens; wall time of `Model::step` (which
//!   returns the last row's logits, so it includes the synchronization); median of 3; then the
//!   same prompt as one greedy request through `Engine::step` (its first token sampled on the
//!   device), median of 3. Then
//!   where that step's time goes: 3 more runs of it with profiling on (`Model::set_profiling`:
//!   a CUDA event on the stream after each stage; the plain runs record none), each stage's
//!   median summed by group (embedding, each layer kind with its number of layers, LM head),
//!   as ms, % of the timed total and ms per layer, and each layer kind by part (Mamba:
//!   in_proj, conv1d, chunked scan, gated norm, out_proj; attention: qkv_proj, attention,
//!   o_proj; MoE: routing + experts as one; each kind's residual add with the next norm,
//!   which after the last layer is the final norm). The timed total (from before the
//!   embedding to after the LM head) is printed beside the profiled and the plain step's wall
//!   times: their gaps are the step's host work outside the stamps (rows and logits copies)
//!   and the events' overhead. `--no-breakdown` leaves the profiled runs out.
//! - decode: `batch` requests of 16 prompt tokens each, then steps of one token per request;
//!   wall time per step, median of 20 after 3 warm-up steps: `Model::step` (every row's
//!   logits copied back), then what a user gets, `Engine::step` (sampling on the device, the
//!   token ids copied back), greedy and at temperature 0.8 with top-p 0.95.
//! - decode at depth: `batch` requests (1 and 16) of a 32768-token prompt each through the
//!   engine (`Engine::set_max_step_tokens` 8192: the prompts in chunks, as a server feeds
//!   them), then greedy `Engine::step`s of a token per request with attention reading the
//!   long KV cache; wall time per step, median of 20 after 3.
//!
//! Each case runs on a model whose cache holds 64 slots of the fewest tokens the case needs
//! (4160 up to prefill 4096 and decode after 16, 16448 for prefill 16384, 33024 at depth),
//! loaded anew when the length changes: decode attention's shared memory grows with it.
//!
//! `cargo bench --bench nano -- decode` (or `prefill`, `batch 8`, `depth`, ...) runs only the
//! cases whose name contains the filter; `--no-graphs` launches decode steps one operation at
//! a time instead of replaying CUDA graphs; `--profile` turns the CUDA profiler on for one
//! decode step of each batch and the last plain run of each prefill (`ncu
//! --profile-from-start off`); `--timeline` prints one decode step's launches, each with when
//! it started and when its wait on the kernel before returned (needs the PTX built with
//! `NEMO_TIMELINE` set, e.g. `NEMO_TIMELINE=1 cargo bench --bench nano -- "decode batch 1"
//! --timeline`).
//!
//! A prefill breakdown looks like this (numbers made up):
//! ```text
//!   breakdown: 480.00 ms timed (CUDA events between stages, each stage's median of 3 profiled steps)
//!     wall time: profiled step 482.40 ms (timed 99.5% of it), plain step 481.90 ms
//!     stage                    layers         ms   % step   ms/layer
//!     embedding                     -      0.050     0.0%
//!     mamba                        23    200.000    41.7%      8.696
//!       in_proj                           50.000    10.4%      2.174
//!       chunked scan                     100.000    20.8%      4.348
//!       ...
//!     moe                          23    240.000    50.0%     10.435
//!       routing + experts                235.000    49.0%     10.217
//!       residual + norm                    5.000     1.0%      0.217
//!     attention                     6     38.950     8.1%      6.492
//!       ...
//!     lm head                       -      1.000     0.2%
//! ```
//!
//! The synthetic routers route as a trained model's (`Routing::Balanced`: each token picks its
//! own experts); `--skewed-routing` draws them as the stress case `Routing::Skewed`, whose
//! score bias picks nearly the same experts for every token. After each case above batch 1 one
//! more step of the same shape runs with the expert tally on (`Model::set_expert_tally`) and
//! prints the experts a MoE layer touched (mean and min over the layers, beside uniform
//! routing's expectation `E (1 - (1 - k/E)^rows)`) and the largest expert's rows.
//!
//! Beside each time: the bytes the step must read at least: every non-expert weight once, the
//! experts that step's routing touched (counted by the tally; at batch 1 its top k), the SSM
//! state read and written (prefill: written), at depth the KV cache each row attends over;
//! and that floor at the copy bandwidth measured in the same run.

use std::time::Instant;

use model::Config;
use model::cache::Part;
use model::cuda::Cuda;
use model::engine::{Engine, RequestParams};
use model::layout::Layout;
use model::model::Model;
use model::profile::{ExpertLoad, Group, Profile};
use model::sampling::SamplingParams;
use model::synthetic::{Draws, Precision, Routing};
use model::weights::Checkpoint;
use nemotron_rs::BenchGpu;

/// Context of the decode-at-depth cases, and the prompt tokens a step of their prefill takes.
const DEPTH: usize = 32768;
const DEPTH_STEP_TOKENS: usize = 8192;

/// What a step of the model reads at least, in bytes.
struct Bytes {
    /// Every weight but the embeddings and the routed experts (the projections as the
    /// checkpoint holds them: bf16, FP8 codes, NVFP4 codes and block scales; every scale).
    always: f64,
    /// One routed expert's up and down projections (the mean over the layers' experts).
    expert: f64,
    /// The SSM state of one slot.
    state: f64,
    /// The keys and values of one token in every attention layer.
    kv_token: f64,
    /// The copy rate of the run, bytes a second.
    bw: f64,
}

impl Bytes {
    fn of(c: &Config, ck: &Checkpoint, bw: f64) -> Bytes {
        let m = c.mamba.as_ref().expect("Nano has Mamba layers");
        let e = c.moe.as_ref().expect("Nano has MoE layers");
        let a = c.attention.as_ref().expect("Nano has attention layers");
        let (nm, ne, na, _) = c.layer_counts();
        let (mut always, mut experts) = (0.0, 0.0);
        for name in ck.names() {
            let bytes = ck.tensor(name).expect("a listed tensor").bytes.len() as f64;
            if name.contains(".experts.") {
                experts += bytes;
            } else if name != "backbone.embeddings.weight" {
                always += bytes;
            }
        }
        Bytes {
            always,
            expert: experts / (ne * e.experts) as f64,
            state: (nm * m.inner() * m.state_size * 4) as f64,
            kv_token: na as f64 * 2.0 * (a.kv_heads * a.head_dim) as f64 * 2.0,
            bw,
        }
    }

    /// The floor of a step whose MoE layers touched the experts `loads` counts, with `other`
    /// bytes of state and cache traffic; as "X GB = Y ms at Z GB/s".
    fn floor(&self, loads: &[ExpertLoad], other: f64) -> String {
        let touched: usize = loads.iter().map(ExpertLoad::touched).sum();
        let bytes = self.always + touched as f64 * self.expert + other;
        format!("bytes floor {:.2} GB = {:.3} ms at {:.0} GB/s", bytes / 1e9, bytes / self.bw * 1e3, self.bw / 1e9)
    }
}

fn median(mut t: Vec<f64>) -> f64 {
    t.sort_by(f64::total_cmp);
    t[t.len() / 2]
}

/// The experts a MoE layer touched in a tallied step of `rows` rows: mean and min over the
/// layers against uniform routing's expectation, and the largest expert's rows.
fn print_loads(loads: &[ExpertLoad], rows: usize, (experts, top_k): (usize, usize)) {
    let Some(min) = loads.iter().map(ExpertLoad::touched).min() else { return };
    let mean = loads.iter().map(ExpertLoad::touched).sum::<usize>() as f64 / loads.len() as f64;
    let (e, k) = (experts as f64, top_k as f64);
    let uniform = e * (1.0 - (1.0 - k / e).powi(rows as i32));
    let largest = loads.iter().map(ExpertLoad::largest).max().unwrap_or(0);
    println!(
        "  experts touched a MoE layer: mean {mean:.1}, min {min} of {experts} (uniform routing: {uniform:.1}); \
         largest expert {largest} rows (mean {:.1}), {} layers tallied",
        (rows * top_k) as f64 / experts as f64,
        loads.len()
    );
}

/// Decode step `step`'s token for each of `batch` rows.
fn decode_tokens(step: usize, batch: usize) -> Vec<[u32; 1]> {
    (0..batch).map(|r| [((step * 13 + r) % 1000) as u32]).collect()
}

/// A decode step's parts: row r's token `toks[r]` at slot r after `computed` tokens.
fn decode_parts(toks: &[[u32; 1]], computed: usize) -> Vec<Part<'_>> {
    toks.iter().enumerate().map(|(r, t)| Part { slot: r as i32, computed, tokens: t }).collect()
}

/// `model`'s expert loads over one step of `parts` (tallied, so not recorded or replayed).
fn tally(model: &mut Model<Cuda>, parts: &[Part]) -> Vec<ExpertLoad> {
    model.set_expert_tally(true);
    model.step(parts).expect("a tallied step");
    model.set_expert_tally(false);
    model.expert_loads().to_vec()
}

/// The model at one cache length: a case that needs another loads it anew (the one before
/// dropped first), with its routers fitted when they are balanced. Decode attention's shared
/// memory grows with the cache length, so each case runs at the shortest length that holds it:
/// [`SHORT`] for prefill 512 and 4096 and decode at 16 tokens, 16384 + 64 for prefill 16384,
/// [`DEPTH`] + 256 for decode at depth.
struct Loader<'a> {
    gpu: std::sync::Arc<host::Gpu>,
    graphs: bool,
    config: &'a Config,
    layout: &'a Layout<'a>,
    routing: Routing,
    loaded: Option<Model<Cuda>>,
}

/// The cache length of the cases at up to 4096 tokens.
const SHORT: usize = 4096 + 64;

impl Loader<'_> {
    fn model(&mut self, max_len: usize) -> Model<Cuda> {
        // Another length's model is dropped here, before the new one takes its memory.
        if let Some(m) = self.loaded.take()
            && m.max_len() == max_len
        {
            return m;
        }
        let t = Instant::now();
        let cuda = Cuda::on(self.gpu.clone()).with_graphs(self.graphs);
        let mut model = Model::load(cuda, self.config, self.layout, 64, max_len).expect("loading the model");
        println!("model loaded with 64 slots of {max_len} tokens in {:.1} s", t.elapsed().as_secs_f64());
        if self.routing == Routing::Balanced {
            let t = Instant::now();
            let loads = model::synthetic::balance_routers(&mut model).expect("fitting the routers");
            print!("routers fitted (synthetic::balance_routers) in {:.1} s; on its tokens:", t.elapsed().as_secs_f64());
            let e = self.config.moe.as_ref().expect("Nano has MoE layers");
            print_loads(&loads, model::synthetic::BALANCE_TOKENS, (e.experts, e.top_k));
        }
        model
    }

    fn keep(&mut self, model: Model<Cuda>) {
        self.loaded = Some(model);
    }
}

/// What every case prints beside its time.
struct Run<'a> {
    b: &'a BenchGpu,
    bytes: Bytes,
    /// Experts and top k.
    shape: (usize, usize),
    vocab: u32,
    breakdown: bool,
    timeline: bool,
    profile: bool,
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let flag = |f: &str| args.iter().any(|a| a == f);
    let filter = args.iter().filter(|a| !a.starts_with("--")).cloned().collect::<Vec<_>>().join(" ");
    let wanted = |case: &str| case.contains(&filter);
    let Some(b) = BenchGpu::open() else { return };
    let json = include_str!("../model/assets/nano-30b-a3b.json");
    let config = Config::from_json(json).expect("the Nano config parses");
    let t = Instant::now();
    let precision = match (flag("--fp8"), flag("--nvfp4")) {
        (true, true) => panic!("--fp8 and --nvfp4: one precision a run"),
        (true, false) => Precision::Fp8,
        (false, true) => Precision::Nvfp4,
        (false, false) => Precision::Bf16,
    };
    let routing = if flag("--skewed-routing") { Routing::Skewed } else { Routing::Balanced };
    let ck = model::synthetic::in_memory_as(&config, 7, Draws { precision, routing }).expect("synthetic weights");
    let layout = Layout::trusting_values(&config, &ck).expect("a complete layout");
    println!(
        "Nano 30B-A3B, random {precision:?} weights, {routing:?} routing: {:.1} GB of tensors generated in {:.1} s",
        ck.total_bytes() as f64 / 1e9,
        t.elapsed().as_secs_f64()
    );
    let (graphs, gpu) = (!flag("--no-graphs"), b.gpu.clone());
    let mut loader = Loader { gpu, graphs, config: &config, layout: &layout, routing, loaded: None };
    let e = config.moe.as_ref().expect("Nano has MoE layers");
    let run = Run {
        b: &b,
        bytes: Bytes::of(&config, &ck, b.copy_bytes_per_s),
        shape: (e.experts, e.top_k),
        vocab: config.vocab_size as u32,
        breakdown: !flag("--no-breakdown"),
        timeline: flag("--timeline"),
        profile: flag("--profile"),
    };
    for len in [512usize, 4096].into_iter().filter(|l| wanted(&format!("prefill {l}"))) {
        let model = run.prefill(loader.model(SHORT), len);
        loader.keep(model);
    }
    for batch in [1usize, 8, 64].into_iter().filter(|b| wanted(&format!("decode batch {b}"))) {
        let model = run.decode(loader.model(SHORT), batch);
        loader.keep(model);
    }
    if wanted("prefill 16384") {
        let model = run.prefill(loader.model(16384 + 64), 16384);
        loader.keep(model);
    }
    for batch in [1usize, 16].into_iter().filter(|b| wanted(&format!("decode depth {DEPTH} batch {b}"))) {
        let (model, t, loads) = engine_depth(loader.model(DEPTH + 256), batch, run.vocab);
        loader.keep(model);
        // Each row reads its slot's state and its keys and values, one token more each step.
        let bytes = &run.bytes;
        let other = batch as f64 * (2.0 * bytes.state + (DEPTH + 12) as f64 * bytes.kv_token);
        println!(
            "decode depth {DEPTH} batch {batch:>3}: Engine::step greedy {:8.3} ms/step {:8.3} ms/token   {}",
            t * 1e3,
            t * 1e3 / batch as f64,
            bytes.floor(&loads, other)
        );
        if batch > 1 {
            print_loads(&loads, batch, run.shape);
        }
    }
}

impl Run<'_> {
    /// One fresh request of `len` tokens: `Model::step`, the tally, `Engine::step`, the
    /// breakdown.
    fn prefill(&self, mut model: Model<Cuda>, len: usize) -> Model<Cuda> {
        let prompt: Vec<u32> = (0..len as u32).map(|i| i.wrapping_mul(7919) % self.vocab).collect();
        let parts = [Part { slot: 0, computed: 0, tokens: &prompt }];
        let times: Vec<f64> = (0..3)
            .map(|run| {
                let t = Instant::now();
                if run == 2 && self.profile {
                    self.b.gpu.profile(|| model.step(&parts)).expect("profiler").expect("prefill");
                } else {
                    model.step(&parts).expect("prefill");
                }
                t.elapsed().as_secs_f64()
            })
            .collect();
        let s = median(times);
        let loads = tally(&mut model, &parts);
        println!(
            "prefill {len:>5} tokens: {:8.2} ms  {:9.0} tokens/s   {}",
            s * 1e3,
            len as f64 / s,
            self.bytes.floor(&loads, self.bytes.state)
        );
        print_loads(&loads, len, self.shape);
        let (mut model, t) = engine_prefill(model, &prompt);
        println!("  Engine::step prefill: {:8.2} ms   {:+.1}% against Model::step", t * 1e3, (t / s - 1.0) * 100.0);
        if self.breakdown {
            prefill_breakdown(&mut model, &prompt, s);
        }
        model
    }

    /// `batch` requests of 16 prompt tokens, then decode steps: `Model::step`, the tally,
    /// `Engine::step` greedy and sampled.
    fn decode(&self, mut model: Model<Cuda>, batch: usize) -> Model<Cuda> {
        let vocab = self.vocab;
        let prompts: Vec<Vec<u32>> =
            (0..batch).map(|r| (0..16u32).map(|i| (i * 31 + r as u32 * 977) % vocab).collect()).collect();
        let parts: Vec<Part> =
            prompts.iter().enumerate().map(|(r, p)| Part { slot: r as i32, computed: 0, tokens: p }).collect();
        model.step(&parts).expect("prompts");
        let mut times = Vec::new();
        let gpu = &self.b.gpu;
        for step in 0..23 {
            let toks = decode_tokens(step, batch);
            let parts = decode_parts(&toks, 16 + step);
            let t = Instant::now();
            if step == 5 && self.timeline {
                gpu.timeline().expect("timeline");
                model.step(&parts).expect("decode");
                print_timeline(
                    gpu.timeline().expect("timeline").expect("--timeline needs the PTX built with NEMO_TIMELINE"),
                );
            } else if step == 5 && self.profile {
                gpu.profile(|| model.step(&parts)).expect("profiler").expect("decode");
            } else {
                model.step(&parts).expect("decode");
            }
            if step >= 3 {
                times.push(t.elapsed().as_secs_f64());
            }
        }
        let s = median(times);
        let last = decode_tokens(23, batch);
        let loads = tally(&mut model, &decode_parts(&last, 16 + 23));
        println!(
            "decode batch {batch:>3}: {:8.3} ms/step {:8.3} ms/token   {}",
            s * 1e3,
            s * 1e3 / batch as f64,
            self.bytes.floor(&loads, 2.0 * self.bytes.state * batch as f64)
        );
        if batch > 1 {
            print_loads(&loads, batch, self.shape);
        }
        for (mode, sampling) in
            [("greedy", SamplingParams::greedy()), ("T 0.8 top-p 0.95", SamplingParams::nucleus(0.8, 0.95, 0))]
        {
            let (back, t) = engine_decode(model, &prompts, sampling);
            model = back;
            println!(
                "  Engine::step {mode:>16}: {:8.3} ms/step {:8.3} ms/token   {:+.1}% against Model::step",
                t * 1e3,
                t * 1e3 / batch as f64,
                (t / s - 1.0) * 100.0
            );
        }
        model
    }
}

/// `Engine::step` over `batch` greedy requests of a [`DEPTH`]-token prompt each (fed
/// [`DEPTH_STEP_TOKENS`] a step): once every request has its first token, the wall time per
/// decode step, median of 20 after 3 warm-up steps, and one more step's expert loads.
/// Returns the model, that time and those loads.
fn engine_depth(model: Model<Cuda>, batch: usize, vocab: u32) -> (Model<Cuda>, f64, Vec<ExpertLoad>) {
    let mut engine = Engine::new(model);
    engine.set_max_step_tokens(DEPTH_STEP_TOKENS).expect("a step bound");
    let t = Instant::now();
    let mut ids = Vec::new();
    for r in 0..batch as u32 {
        let prompt: Vec<u32> = (0..DEPTH as u32).map(|i| (i.wrapping_mul(7919) + r * 104_729) % vocab).collect();
        let params = RequestParams {
            max_new_tokens: 256,
            sampling: SamplingParams::greedy(),
            stop_tokens: Vec::new(),
            min_new_tokens: 0,
        };
        ids.push(engine.add(&prompt, params).expect("a request"));
    }
    let mut started = std::collections::HashSet::new();
    while started.len() < batch {
        started.extend(engine.step().expect("prefill").iter().map(|e| e.id));
    }
    println!("  {batch} prompts of {DEPTH} tokens prefilled in {:.2} s", t.elapsed().as_secs_f64());
    let mut times = Vec::new();
    for step in 0..23 {
        let t = Instant::now();
        let events = engine.step().expect("decode");
        let dt = t.elapsed().as_secs_f64();
        assert_eq!(events.len(), batch, "a token per request");
        if step >= 3 {
            times.push(dt);
        }
    }
    engine.set_expert_tally(true);
    assert_eq!(engine.step().expect("a tallied step").len(), batch, "a token per request");
    engine.set_expert_tally(false);
    let loads = engine.model().expert_loads().to_vec();
    for id in ids {
        engine.cancel(id).expect("a running request");
    }
    (engine.into_model(), median(times), loads)
}

/// `Engine::step` of one greedy request of `prompt` with one new token: the prompt's prefill
/// and its first token (sampled on the device, copied back); wall time, median of 3. Returns the
/// model and that time.
fn engine_prefill(model: Model<Cuda>, prompt: &[u32]) -> (Model<Cuda>, f64) {
    let mut engine = Engine::new(model);
    let times = (0..3)
        .map(|_| {
            let params = RequestParams {
                max_new_tokens: 1,
                sampling: SamplingParams::greedy(),
                stop_tokens: Vec::new(),
                min_new_tokens: 0,
            };
            engine.add(prompt, params).expect("a request");
            let t = Instant::now();
            let events = engine.step().expect("prefill");
            let dt = t.elapsed().as_secs_f64();
            assert_eq!(events.len(), 1, "the prompt's first token");
            assert!(!engine.has_work(), "one token");
            dt
        })
        .collect();
    (engine.into_model(), median(times))
}

/// `Engine::step` over one request per prompt (seeds 0.., 24 new tokens each, no stop
/// tokens): the prompts in one step, then decode steps of a token per request; wall time per
/// decode step, median of 20 after 3 warm-up steps. Returns the model and that time.
fn engine_decode(model: Model<Cuda>, prompts: &[Vec<u32>], sampling: SamplingParams) -> (Model<Cuda>, f64) {
    let mut engine = Engine::new(model);
    for (r, p) in prompts.iter().enumerate() {
        let sampling = SamplingParams { seed: r as u64, ..sampling };
        engine
            .add(p, RequestParams { max_new_tokens: 24, sampling, stop_tokens: Vec::new(), min_new_tokens: 0 })
            .expect("a request");
    }
    let first = engine.step().expect("prompts");
    assert_eq!(first.len(), prompts.len(), "every prompt gave its first token");
    let mut times = Vec::new();
    for step in 0..23 {
        let t = Instant::now();
        let events = engine.step().expect("decode");
        let dt = t.elapsed().as_secs_f64();
        assert_eq!(events.len(), prompts.len(), "a token per request");
        if step >= 3 {
            times.push(dt);
        }
    }
    assert!(!engine.has_work(), "24 tokens each");
    (engine.into_model(), median(times))
}

/// The same prefill step as the plain runs, 3 times more with profiling on (a CUDA event on the
/// stream after each stage): each stage's median time, summed by layer kind and by part of a
/// layer, beside the profiled and the plain (`plain_s`) steps' median wall times.
fn prefill_breakdown(model: &mut Model<Cuda>, prompt: &[u32], plain_s: f64) {
    model.set_profiling(true);
    let (mut walls, mut runs) = (Vec::new(), Vec::new());
    for _ in 0..3 {
        let t = Instant::now();
        if let Err(e) = model.step(&[Part { slot: 0, computed: 0, tokens: prompt }]) {
            model.set_profiling(false);
            return println!("  breakdown: none (a profiled step failed: {e})");
        }
        walls.push(t.elapsed().as_secs_f64());
        runs.extend(model.profile().cloned());
    }
    model.set_profiling(false);
    let p = match Profile::median(&runs) {
        Ok(p) => p,
        Err(e) => return println!("  breakdown: none ({e})"),
    };
    let (total, wall) = (p.total_ms(), median(walls) * 1e3);
    println!("  breakdown: {total:.2} ms timed (CUDA events between stages, each stage's median of 3 profiled steps)");
    println!(
        "    wall time: profiled step {wall:.2} ms (timed {:.1}% of it), plain step {:.2} ms",
        total / wall * 100.0,
        plain_s * 1e3
    );
    println!("    {:24} {:>6} {:>10} {:>8} {:>10}", "stage", "layers", "ms", "% step", "ms/layer");
    let share = |ms: f64| ms / total * 100.0;
    for g in p.by_group() {
        let Group::Layers(kind) = g.group else {
            println!("    {:24} {:>6} {:10.3} {:7.1}%", g.group.name(), "-", g.ms, share(g.ms));
            continue;
        };
        let each = |ms: f64| ms / g.layers as f64;
        println!("    {:24} {:>6} {:10.3} {:7.1}% {:10.3}", g.group.name(), g.layers, g.ms, share(g.ms), each(g.ms));
        for (part, ms) in p.parts(kind) {
            println!("      {:22} {:>6} {ms:10.3} {:7.1}% {:10.3}", part.name(), "", share(ms), each(ms));
        }
    }
}

/// One decode step's launches in order (`--timeline`, PTX built with `NEMO_TIMELINE`): when
/// block 0 of each started, how long before its wait returned, and the span from its wait's
/// return to the next launch's (its own time, plus any cuBLASLt kernel between them); then the
/// spans summed by pair of neighbours.
fn print_timeline(t: host::Timeline) {
    let Some(first) = t.records.first() else { return };
    println!("timeline: {} launches recorded, {} kernels captured", t.records.len(), t.kernels.len());
    // Per boundary: count, spans, and how long the next launch's block 0 ran before its wait
    // returned (whether programmatic dependent launch overlapped the boundary).
    let mut totals: std::collections::BTreeMap<String, (usize, u64, u64)> = Default::default();
    for (i, r) in t.records.iter().enumerate() {
        let name = t.kernels.get(i).copied().unwrap_or("?");
        let after = t.kernels.get(i + 1).copied().unwrap_or("end");
        let span = t.records.get(i + 1).map_or(0, |n| n.go_ns.saturating_sub(r.go_ns));
        println!(
            "{i:4} {name:28} -> {after:28} grid {:>6}x{:<4} block {:4} start {:9.3} us  early {:7.3} us  span {:7.3} us",
            r.grid.0,
            r.grid.1,
            r.block,
            (r.start_ns as f64 - first.go_ns as f64) / 1e3,
            (r.go_ns - r.start_ns) as f64 / 1e3,
            span as f64 / 1e3
        );
        let e = totals.entry(format!("{name} -> {after}")).or_default();
        e.0 += 1;
        e.1 += span;
        e.2 += t.records.get(i + 1).map_or(0, |n| n.go_ns - n.start_ns);
    }
    let mut v: Vec<_> = totals.into_iter().collect();
    v.sort_by_key(|(_, (_, t, _))| std::cmp::Reverse(*t));
    for (k, (n, t, early)) in v {
        let each = |x: u64| x as f64 / 1e3 / n as f64;
        println!("  {k:60} {n:4} x {:7.3} us = {:8.3} us, next early {:6.3} us", each(t), t as f64 / 1e3, each(early));
    }
}
