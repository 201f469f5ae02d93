//! The CUDA model against Hugging Face transformers at Nemotron-3 Nano widths: the first 13
//! layers of Nano (`MEMEM*EMEMEM*`: 6 Mamba, 5 MoE layers of 128 experts, 2 attention; every
//! width Nano's, 15 GB of bf16 weights) drawn as [`Scaling::Residual`] so the layers matter,
//! against transformers in float32 on the GPU, with transformers in bfloat16 as the noise band.
//!
//! The checkpoint is too large to keep, so it is made where it is checked, in three steps, each
//! with `NANO_CHECK_DIR` naming the same folder (15 GB free):
//!
//! 1. `nano_check --ignored --exact write_nano_checkpoint`: config.json, model.safetensors and
//!    prompt.json (the token ids and the positions compared);
//! 2. `python3 scripts/nano_check.py $NANO_CHECK_DIR` (torch and transformers 5.17, a GPU that
//!    holds the float32 model, 30 GB, and its scans): transformers' logits at those positions
//!    in float32 and in bfloat16 and its routers' margins, into reference.json and
//!    reference.bin;
//! 3. `nano_check --ignored --exact cuda_matches_transformers_at_nano_widths --nocapture`.
//!
//! `nano_check` is `cargo test --release -p model --test nano_check --` where Rust is, and
//! `.device/tests/nano_check` from `./x bundle` on a GPU machine without it.
//!
//! What runs: a prompt of 600 seeded random tokens (five scan chunks, several attention tiles)
//! in one prefill; the same prompt in two steps, the second continuing the first's state; fresh
//! prefills of prefixes ending on each side of the chunk boundaries, several to a step; then 8
//! decode steps after both, the tokens given (so both sides see the same sequence).
//!
//! The rule. A row is the logits at one position. transformers-bf16 against transformers-f32
//! gives each row's noise: its largest |difference| and its RMS. Ours against f32 must stay
//! within [`K`] times that noise, or the median over rows of it where that is larger (a row
//! bf16 happened to get nearly exact sets no tighter band than bf16's usual noise). K is 2:
//! ours is another bf16 computation, with its own roundings (f32 sums where transformers
//! rounds to bf16 and the other way around), not a copy of transformers', and twice the noise
//! leaves room for that but not for a wrong operation (a missed state, a wrong expert: a
//! layer's output changed, not rounded). A row outside the band must be
//! explained by a router near-tie: a MoE layer, at the row's token or one of the [`MEMORY`]
//! tokens before it, where f32's margin between its k-th and (k+1)-th choice scores is under
//! K times the most bf16 can move a margin there (twice the largest change bf16 made to any
//! choice score): there a different expert, a different output, is within noise of the right
//! one. Nothing else explains a row. The argmax of a row must be f32's unless f32's top two
//! logits are closer than twice the row's band for the largest difference (each may be off by
//! that much), or a router near-tie explains the row. Over each group of rows (one prefill,
//! two steps, prefixes, decode after each) but those explained, ours' RMS and largest
//! difference must be within K times bf16's (or the medians, where larger). And since a wrong
//! operation moves most rows while flips move a few, in ours as in bf16, ours may have no more
//! rows past K times bf16's medians than twice as many as bf16 has, and two more.

use std::path::PathBuf;

use model::cache::Part;
use model::config::Config;
use model::cuda::Cuda;
use model::layout::Layout;
use model::model::Model;
use model::synthetic::{Scaling, tensor_shapes, write_checkpoint_scaled};
use model::weights::Checkpoint;
use nemotron_rs::Rng;
use serde::Deserialize;

/// Layers of Nano kept.
const LAYERS: usize = 13;
/// The weights' seed and the prompt's.
const SEED: u64 = 13;
const PROMPT_SEED: u64 = 600;
/// Prompt tokens, the split of its two-step variant, and decode steps after it.
const PROMPT: usize = 600;
const SPLIT: usize = 300;
const DECODE: usize = 8;
/// Last positions of the fresh prefills of prefixes: both sides of each 128-token chunk
/// boundary and of 64-token ones, a one-token prompt, and points between.
const PREFIX_ENDS: [usize; 17] = [0, 1, 63, 64, 127, 128, 129, 255, 256, 257, 383, 384, 450, 511, 512, 513, 598];
/// Most tokens in one step of prefixes.
const STEP_TOKENS: usize = 4096;
/// The band's multiple of transformers-bf16's noise (see the module doc).
const K: f64 = 2.0;
/// Tokens before a row whose router near-ties may explain it: a different expert at a token
/// reaches later ones through the Mamba states, which decay by exp(-dt |A|) a token (|A| at
/// least 1/e here, dt of order 1). A first estimate: the test prints the rows it explains.
const MEMORY: usize = 16;

/// How to run the check, for the tests' failure messages.
const STEPS: &str = "set NANO_CHECK_DIR to a folder with 15 GB free, run `nano_check --ignored --exact \
    write_nano_checkpoint`, `python3 scripts/nano_check.py $NANO_CHECK_DIR` (torch, transformers 5.17, a GPU), \
    then `nano_check --ignored --exact cuda_matches_transformers_at_nano_widths` (model/tests/nano_check.rs)";

/// Where the three steps meet: `NANO_CHECK_DIR`, named on purpose (a run of every ignored
/// test does not write 15 GB somewhere unasked).
fn check_dir() -> PathBuf {
    PathBuf::from(std::env::var_os("NANO_CHECK_DIR").unwrap_or_else(|| panic!("NANO_CHECK_DIR is not set: {STEPS}")))
}

/// Nano's config.json with its first [`LAYERS`] layers.
fn config_json() -> String {
    let mut c: serde_json::Value = serde_json::from_str(include_str!("../assets/nano-30b-a3b.json")).unwrap();
    let pattern = c["hybrid_override_pattern"].as_str().unwrap()[..LAYERS].to_string();
    c["hybrid_override_pattern"] = pattern.into();
    c["num_hidden_layers"] = LAYERS.into();
    serde_json::to_string_pretty(&c).unwrap()
}

/// The prompt and its given continuation: `PROMPT + DECODE` seeded token ids.
fn tokens(vocab: usize) -> Vec<u32> {
    let mut rng = Rng::new(PROMPT_SEED);
    (0..PROMPT + DECODE).map(|_| (rng.next_u64() % vocab as u64) as u32).collect()
}

/// Every position whose logits are compared, sorted.
fn positions() -> Vec<usize> {
    let mut p: Vec<usize> =
        PREFIX_ENDS.iter().copied().chain([SPLIT - 1, PROMPT - 1]).chain(PROMPT..PROMPT + DECODE).collect();
    p.sort_unstable();
    p.dedup();
    p
}

#[test]
fn nano_13_layers_keep_every_nano_width() {
    let nano = Config::from_json(include_str!("../assets/nano-30b-a3b.json")).unwrap();
    let c = Config::from_json(&config_json()).unwrap();
    assert_eq!(c.layers, nano.layers[..LAYERS]);
    assert_eq!(c.layer_counts(), (6, 5, 2, 0));
    assert_eq!((&c.mamba, &c.moe, &c.attention), (&nano.mamba, &nano.moe, &nano.attention));
    assert_eq!((c.vocab_size, c.hidden_size), (nano.vocab_size, nano.hidden_size));
    let bytes: usize = tensor_shapes(&c).iter().map(|(_, s)| 2 * s.iter().product::<usize>()).sum();
    println!("the {LAYERS}-layer checkpoint: {:.2} GB of bf16 weights", bytes as f64 / 1e9);
}

/// [`Scaling::Residual`] draws each kind of matrix with its standard deviation and everything
/// else as [`Scaling::FanIn`] does.
#[test]
fn residual_scaling_draws_each_matrix_as_documented() {
    const CONFIG: &str = r#"{
      "vocab_size": 256, "hidden_size": 512, "hybrid_override_pattern": "ME*",
      "mamba_num_heads": 8, "mamba_head_dim": 64, "ssm_state_size": 64, "n_groups": 2, "conv_kernel": 4,
      "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 256,
      "moe_shared_expert_intermediate_size": 384, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64
    }"#;
    let base = std::env::temp_dir().join(format!("nemotron-scaling-{}", std::process::id()));
    let (fan_in, residual) = (base.join("fan-in"), base.join("residual"));
    write_checkpoint_scaled(&fan_in, CONFIG, 5, Scaling::FanIn).unwrap();
    write_checkpoint_scaled(&residual, CONFIG, 5, Scaling::Residual).unwrap();
    let (a, b) = (Checkpoint::open(&fan_in).unwrap(), Checkpoint::open(&residual).unwrap());
    let out = 0.02 / 6f64.sqrt();
    let mut checked = 0;
    for name in b.names() {
        let t = b.tensor(name).unwrap();
        let v = t.to_f32().unwrap();
        let matrix = t.shape.len() == 2;
        let want = match name {
            "backbone.embeddings.weight" => 1.0,
            n if n.ends_with("out_proj.weight") || n.ends_with("o_proj.weight") || n.ends_with("down_proj.weight") => {
                out
            }
            _ if matrix => 0.02,
            _ => {
                assert_eq!(t.bytes, a.tensor(name).unwrap().bytes, "{name}: as FanIn draws it");
                continue;
            }
        };
        let mean = v.iter().map(|&x| f64::from(x)).sum::<f64>() / v.len() as f64;
        let std = (v.iter().map(|&x| (f64::from(x) - mean).powi(2)).sum::<f64>() / v.len() as f64).sqrt();
        let kurtosis = v.iter().map(|&x| ((f64::from(x) - mean) / std).powi(4)).sum::<f64>() / v.len() as f64;
        assert!(
            (std / want - 1.0).abs() < 0.02 && mean.abs() < 0.02 * want,
            "{name}: mean {mean}, std {std}, not N(0, {want})"
        );
        assert!((kurtosis - 3.0).abs() < 0.2, "{name}: kurtosis {kurtosis}, not a normal's 3");
        checked += 1;
    }
    assert_eq!(checked, 19, "embeddings, 2 Mamba, router, 2 x 4 experts, 2 shared, 4 attention, LM head");
    std::fs::remove_dir_all(&base).ok();
}

/// The rule on made-up rows: ours as noisy as bf16 passes; three times as noisy fails every
/// row, the group and the count of rows past the medians; one logit far off fails its row and
/// the group unless a router near-tie at most [`MEMORY`] tokens before explains it; rows far
/// off and all explained fail as too many.
#[test]
fn the_rule_passes_bf16_like_noise_and_nothing_else() {
    let (vocab, n) = (4096, 40);
    let mut rng = Rng::new(3);
    let noisy = |rng: &mut Rng, v: &[f32], a: f64| v.iter().map(|&x| x + rng.uniform(-a, a) as f32).collect::<Vec<_>>();
    let f32s: Vec<Vec<f32>> = (0..n).map(|_| (0..vocab).map(|_| rng.uniform(-3.0, 3.0) as f32).collect()).collect();
    let bf16s: Vec<Vec<f32>> = f32s.iter().map(|v| noisy(&mut rng, v, 0.01)).collect();
    let values = [f32s.concat(), bf16s.concat()].concat();
    let mut t = Transformers { positions: (0..n).collect(), vocab, values, tie_ratio: vec![10.0; n] };
    let mut ours = |a: f64| -> Vec<Row> {
        (0..n).map(|pos| Row { group: "prefixes", pos, logits: noisy(&mut rng, &f32s[pos], a) }).collect()
    };
    assert_eq!(judge(&ours(0.01), &t), Vec::<String>::new());
    assert_eq!(judge(&ours(0.03), &t).len(), n + 2, "every row, the group, the count past the medians");
    let mut off = ours(0.01);
    off[30].logits[7] += 0.5;
    assert_eq!(judge(&off, &t).len(), 2);
    t.tie_ratio[30 - MEMORY - 1] = 1.0;
    assert_eq!(judge(&off, &t).len(), 2, "a near-tie too long before");
    t.tie_ratio[30 - MEMORY] = 1.0;
    assert_eq!(judge(&off, &t), Vec::<String>::new());
    t.tie_ratio.fill(1.0);
    for row in &mut off[..6] {
        row.logits[7] += 0.5;
    }
    assert_eq!(judge(&off, &t).len(), 1, "7 rows far off, each explained");
}

#[test]
#[ignore = "writes a 15 GB checkpoint: step 1 of the Nano check (see this file's doc)"]
fn write_nano_checkpoint() {
    let dir = check_dir();
    let started = std::time::Instant::now();
    write_checkpoint_scaled(&dir, &config_json(), SEED, Scaling::Residual).unwrap();
    let vocab = Config::from_dir(&dir).unwrap().vocab_size;
    let prompt = serde_json::json!({ "tokens": tokens(vocab), "positions": positions() });
    std::fs::write(dir.join("prompt.json"), prompt.to_string()).unwrap();
    let bytes = std::fs::metadata(dir.join("model.safetensors")).unwrap().len();
    println!("wrote {} ({:.2} GB) in {:.0?}", dir.display(), bytes as f64 / 1e9, started.elapsed());
    println!("next: python3 scripts/nano_check.py {}", dir.display());
}

/// reference.json, as scripts/nano_check.py writes it (reference.bin holds the logits).
#[derive(Deserialize)]
struct Reference {
    transformers: String,
    torch: String,
    device: String,
    tokens: Vec<u32>,
    positions: Vec<usize>,
    vocab: usize,
    /// Per token: the smallest over MoE layers of f32's top-k margin over twice the largest
    /// change bf16 made to a choice score there.
    tie_ratio: Vec<f64>,
}

/// One compared row: its group, position and our logits.
struct Row {
    group: &'static str,
    pos: usize,
    logits: Vec<f32>,
}

/// Our rows: every variant of the module doc on the CUDA backend.
fn our_rows(dir: &std::path::Path, tokens: &[u32]) -> Vec<Row> {
    let config = Config::from_dir(dir).unwrap();
    let ck = Checkpoint::open(dir).unwrap();
    let layout = Layout::new(&config, &ck).unwrap();
    let slots = 2 + PREFIX_ENDS.len();
    let mut gpu = Model::load(Cuda::new(0).unwrap(), &config, &layout, slots, PROMPT + DECODE).unwrap();
    let row = |group, pos, logits| Row { group, pos, logits };
    let fresh = |slot, n| Part { slot, computed: 0, tokens: &tokens[..n] };
    let mut rows = Vec::new();
    // The whole prompt (slot 0) and its first part (slot 1) in one step; then its second part
    // from slot 1's state.
    let out = gpu.step(&[fresh(0, PROMPT), fresh(1, SPLIT)]).unwrap();
    let [whole, first] = <[Vec<f32>; 2]>::try_from(out).unwrap();
    rows.push(row("one prefill", PROMPT - 1, whole));
    rows.push(row("two steps", SPLIT - 1, first));
    let second = gpu.step(&[Part { slot: 1, computed: SPLIT, tokens: &tokens[SPLIT..PROMPT] }]).unwrap();
    rows.push(row("two steps", PROMPT - 1, second.into_iter().next().unwrap()));
    // Prefixes, each a fresh prefill on its own slot, several to a step.
    let mut pending: Vec<Part> = Vec::new();
    for (i, &end) in PREFIX_ENDS.iter().enumerate() {
        pending.push(fresh(2 + i as i32, end + 1));
        let queued: usize = pending.iter().map(|p| p.tokens.len()).sum();
        if PREFIX_ENDS.get(i + 1).is_none_or(|&next| queued + next + 1 > STEP_TOKENS) {
            let out = gpu.step(&pending).unwrap();
            rows.extend(pending.drain(..).zip(out).map(|(p, l)| row("prefixes", p.tokens.len() - 1, l)));
        }
    }
    // Decode after both, the same given token on both slots each step.
    for (pos, &t) in tokens.iter().enumerate().skip(PROMPT) {
        let t = [t];
        let out = gpu.step(&[0, 1].map(|slot| Part { slot, computed: pos, tokens: &t })).unwrap();
        let [a, b] = <[Vec<f32>; 2]>::try_from(out).unwrap();
        rows.push(row("decode after one prefill", pos, a));
        rows.push(row("decode after two steps", pos, b));
    }
    rows
}

/// The largest |a - b| and the RMS of a - b.
fn gap(a: &[f32], b: &[f32]) -> (f64, f64) {
    let (max, sq) = a.iter().zip(b).fold((0.0f64, 0.0f64), |(m, s), (&x, &y)| {
        let d = f64::from(x) - f64::from(y);
        (m.max(d.abs()), s + d * d)
    });
    (max, (sq / a.len() as f64).sqrt())
}

/// The index of the largest value and its lead over the next largest.
fn top(v: &[f32]) -> (usize, f64) {
    let best = (0..v.len()).fold(0, |b, i| if v[i] > v[b] { i } else { b });
    let second = (0..v.len()).filter(|&i| i != best).map(|i| v[i]).fold(f32::NEG_INFINITY, f32::max);
    (best, f64::from(v[best] - second))
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn cuda_matches_transformers_at_nano_widths() {
    let dir = check_dir();
    let (json, bin) = (dir.join("reference.json"), dir.join("reference.bin"));
    assert!(json.exists() && bin.exists(), "{} or {} is missing: {STEPS}", json.display(), bin.display());
    let r: Reference = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let tokens = tokens(r.vocab);
    assert!(
        r.tokens == tokens && r.positions == positions(),
        "{} is for another prompt: run the script again",
        json.display()
    );
    assert_eq!(r.tie_ratio.len(), tokens.len(), "{}: a tie ratio per token", json.display());
    let values: Vec<f32> =
        std::fs::read(&bin).unwrap().chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect();
    assert_eq!(values.len(), 2 * r.positions.len() * r.vocab, "{}: f32 then bf16 logits", bin.display());
    assert!(values.iter().all(|x| x.is_finite()), "{}: a NaN or infinite logit", bin.display());
    println!("transformers {} (torch {}) on {}", r.transformers, r.torch, r.device);
    let t = Transformers { positions: r.positions, vocab: r.vocab, values, tie_ratio: r.tie_ratio };
    let rows = our_rows(&dir, &tokens);
    assert_eq!(rows.len(), 3 + PREFIX_ENDS.len() + 2 * DECODE);
    let failures = judge(&rows, &t);
    assert!(
        failures.is_empty(),
        "outside {K} x transformers-bf16's noise with no router near-tie to explain it:\n{}",
        failures.join("\n")
    );
}

/// transformers' side: logits at `positions` (f32 run, then bf16 run) and tie ratios per token.
struct Transformers {
    positions: Vec<usize>,
    vocab: usize,
    values: Vec<f32>,
    tie_ratio: Vec<f64>,
}

impl Transformers {
    /// The logits at `pos` of the f32 run (`run` 0) or the bf16 run (1).
    fn logits(&self, pos: usize, run: usize) -> &[f32] {
        let i = self.positions.binary_search(&pos).expect("a compared position");
        &self.values[(run * self.positions.len() + i) * self.vocab..][..self.vocab]
    }
}

/// Our rows against transformers' by the module doc's rule: prints what it compared and
/// returns what fails it.
fn judge(rows: &[Row], t: &Transformers) -> Vec<String> {
    // Per row, against f32: ours and bf16's (largest, RMS).
    let gaps: Vec<[(f64, f64); 2]> = rows
        .iter()
        .map(|row| [gap(&row.logits, t.logits(row.pos, 0)), gap(t.logits(row.pos, 1), t.logits(row.pos, 0))])
        .collect();
    let floor = (median(gaps.iter().map(|g| g[1].0).collect()), median(gaps.iter().map(|g| g[1].1).collect()));
    let band = |(b_max, b_rms): (f64, f64)| (K * b_max.max(floor.0), K * b_rms.max(floor.1));
    let near_tie = |pos: usize| t.tie_ratio[pos.saturating_sub(MEMORY)..=pos].iter().any(|&t| t < K);
    // Per row: whether a router near-tie explains it being outside the band.
    let mut explained = vec![false; rows.len()];
    let mut failures = Vec::new();
    for (i, (row, [(o_max, o_rms), (b_max, b_rms)])) in rows.iter().zip(&gaps).enumerate() {
        assert!(row.logits.iter().all(|x| x.is_finite()), "{} at {}: a NaN or infinite logit", row.group, row.pos);
        let band = band((*b_max, *b_rms));
        let (ours, (want, margin)) = (top(&row.logits).0, top(t.logits(row.pos, 0)));
        let flipped = ours != want && margin >= 2.0 * band.0;
        if *o_max <= band.0 && *o_rms <= band.1 && !flipped {
            continue;
        }
        let at = format!(
            "{} at {}: ours {o_max:.3e} / {o_rms:.3e} (largest / RMS), bf16 {b_max:.3e} / {b_rms:.3e}, argmax {ours}, f32's {want} by {margin:.3e}",
            row.group, row.pos
        );
        explained[i] = near_tie(row.pos);
        match explained[i] {
            true => println!("explained by a router near-tie: {at}"),
            false => failures.push(at),
        }
    }
    let mut groups: Vec<&str> = Vec::new();
    for r in rows {
        if !groups.contains(&r.group) {
            groups.push(r.group);
        }
    }
    for group in groups {
        let kept: Vec<&[(f64, f64); 2]> = gaps
            .iter()
            .zip(rows)
            .zip(&explained)
            .filter(|((_, r), e)| r.group == group && !**e)
            .map(|((g, _), _)| g)
            .collect();
        let largest = |k: usize| kept.iter().map(|g| g[k].0).fold(0.0, f64::max);
        let rms = |k: usize| (kept.iter().map(|g| g[k].1.powi(2)).sum::<f64>() / kept.len().max(1) as f64).sqrt();
        let (ours, bf16) = ((largest(0), rms(0)), (largest(1), rms(1)));
        println!(
            "{group}: {} rows, ours {:.3e} / {:.3e} (largest / RMS), bf16 {:.3e} / {:.3e}",
            kept.len(),
            ours.0,
            ours.1,
            bf16.0,
            bf16.1
        );
        let band = band(bf16);
        if ours.0 > band.0 || ours.1 > band.1 {
            failures.push(format!(
                "{group}: ours {:.3e} / {:.3e}, over the band {:.3e} / {:.3e}",
                ours.0, ours.1, band.0, band.1
            ));
        }
    }
    // A wrong operation moves most rows, router flips a few, in ours as in bf16: ours may have
    // no more rows past K times bf16's medians than twice bf16's, and two more.
    let past = |k: usize| gaps.iter().filter(|g| g[k].0 > K * floor.0 || g[k].1 > K * floor.1).count();
    let (ours_past, bf16_past) = (past(0), past(1));
    println!("rows past {K} x bf16's medians: ours {ours_past}, bf16 {bf16_past}");
    if ours_past > 2 * bf16_past + 2 {
        failures.push(format!("{ours_past} rows past {K} x bf16's medians, bf16 has {bf16_past}: not a few flips"));
    }
    let explainable = rows.iter().filter(|row| near_tie(row.pos)).count();
    println!(
        "{} logits compared ({} rows of {}); {} rows outside the band explained by router near-ties \
         ({explainable} rows have one within {MEMORY} tokens); K = {K}, bf16's medians {:.3e} / {:.3e}",
        rows.iter().map(|r| r.logits.len()).sum::<usize>(),
        rows.len(),
        t.vocab,
        explained.iter().filter(|&&e| e).count(),
        floor.0,
        floor.1
    );
    failures
}
