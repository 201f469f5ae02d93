//! What the sampling suites share (tests/sample.rs on the CPU, tests/sample_gpu.rs): rows to
//! sample ([`Case`]) and an independent reference of the kernel's steps ([`Reference`]), the
//! settings and logits the suites draw, the chi-square machinery, and the rows whose draws the
//! specification fixes exactly.

use std::cmp::Reverse;
use std::rc::Rc;

use half::bf16;
use host::cpu::sample::sample_row;
use kernels_gpu::sample::{
    SAMPLE_ALL_NEG_INF, SAMPLE_MAX_TOP, SAMPLE_NAN, SAMPLE_OK, SampleOut, SampleRow, keeps_min_p, keeps_top_p, key,
    log2e_over, penalize, random, scaled, target, weight,
};
use nemotron_rs::Rng;

pub const GREEDY: SampleRow = SampleRow::GREEDY;
pub const INF: f32 = f32::INFINITY;
pub const NEG_INF: f32 = f32::NEG_INFINITY;
/// Nemotron Nano's vocabulary.
pub const NANO_VOCAB: usize = 131072;
/// Draws of each CPU chi-square test: enough that a temperature 10% off fails.
pub const DRAWS: u64 = 100_000;

/// One row to sample: its logits (bf16 values, except the CPU-only continuous kind), settings,
/// penalized tokens (token, count) and mask (a bit a token, 1: allowed).
#[derive(Clone)]
pub struct Case {
    pub label: String,
    pub logits: Rc<[f32]>,
    pub row: SampleRow,
    pub penalties: Vec<(u32, u32)>,
    pub mask: Option<Vec<u32>>,
}

impl Case {
    pub fn new(label: impl Into<String>, logits: &[f32], row: SampleRow) -> Case {
        Case { label: label.into(), logits: logits.into(), row, penalties: Vec::new(), mask: None }
    }

    pub fn penalized(self, penalties: &[(u32, u32)]) -> Case {
        Case { penalties: penalties.to_vec(), ..self }
    }

    /// The case with only the tokens `allowed` says allowed.
    pub fn masked(self, allowed: impl Fn(usize) -> bool) -> Case {
        let mut mask = vec![0u32; self.logits.len().div_ceil(32)];
        for i in (0..self.logits.len()).filter(|&i| allowed(i)) {
            mask[i / 32] |= 1 << (i % 32);
        }
        Case { label: format!("{}, masked", self.label), mask: Some(mask), ..self }
    }

    /// The row at `counter`.
    pub fn at(&self, counter: u64) -> SampleRow {
        SampleRow { counter, ..self.row }
    }

    /// The CPU implementation's output at `counter`.
    pub fn cpu(&self, counter: u64) -> SampleOut {
        sample_row(&self.logits, &self.at(counter), &self.penalties, self.mask.as_deref())
    }
}

// ---------------------------------------------------------------------------------------------
// The reference: the module doc's steps, written out without `cpu::sample`.

/// A row after steps 1-5: its status and, when OK, the kept tokens in id order with their
/// weights (greedy: the argmax alone, weight 1).
pub struct Reference {
    pub status: u32,
    pub kept: Vec<(u32, u64)>,
    /// The penalized logits and their maximum (step 7).
    pub x: Vec<f32>,
    pub m: f32,
}

impl Reference {
    pub fn new(logits: &[f32], row: &SampleRow, penalties: &[(u32, u32)], mask: Option<&[u32]>) -> Reference {
        let mut x = logits.to_vec();
        // Step 0: a masked-out token is -inf.
        if let Some(mask) = mask {
            for (i, v) in x.iter_mut().enumerate() {
                if mask[i / 32] & (1 << (i % 32)) == 0 {
                    *v = NEG_INF;
                }
            }
        }
        for &(t, count) in penalties {
            x[t as usize] = penalize(x[t as usize], count, row);
        }
        let m = x.iter().copied().fold(NEG_INF, f32::max);
        let status = if x.iter().any(|v| v.is_nan()) {
            SAMPLE_NAN
        } else if m == NEG_INF {
            SAMPLE_ALL_NEG_INF
        } else {
            SAMPLE_OK
        };
        let kept = if status != SAMPLE_OK {
            Vec::new()
        } else if row.temperature == 0.0 {
            vec![(x.iter().position(|&v| v == m).unwrap() as u32, 1)]
        } else {
            truncate(&x, m, row)
        };
        Reference { status, kept, x, m }
    }

    /// Step 6: the kept token, in id order, whose range of cumulative mass holds the target.
    pub fn token(&self, seed: u64, counter: u64) -> u32 {
        if self.status != SAMPLE_OK {
            return u32::MAX;
        }
        let total: u64 = self.kept.iter().map(|e| e.1).sum();
        let goal = target(random(seed, counter), total);
        let mut start = 0;
        for &(t, q) in &self.kept {
            if goal < start + q {
                return t;
            }
            start += q;
        }
        panic!("the target {goal} lies past the kept mass {total}")
    }

    /// Step 7, in f64: `x_t - m - ln sum_i e^(x_i - m)`, with `x_i - m` 0 where `x_i == m`.
    pub fn logprob(&self, t: u32) -> f64 {
        let rel = |v: f32| if v == self.m { 0.0 } else { f64::from(v) - f64::from(self.m) };
        rel(self.x[t as usize]) - self.x.iter().map(|&v| rel(v).exp()).sum::<f64>().ln()
    }

    /// Step 7's `n` most likely tokens: a full sort by logit (as f64: -0 and +0 equal), ties by
    /// id.
    pub fn top(&self, n: usize) -> Vec<u32> {
        let mut ids: Vec<u32> = (0..self.x.len() as u32).collect();
        let v = |i: u32| f64::from(self.x[i as usize]) + 0.0;
        ids.sort_by(|&a, &b| v(b).total_cmp(&v(a)).then(a.cmp(&b)));
        ids.truncate(n);
        ids
    }
}

/// Steps 4-5 by their definitions over a full sort by key (descending): the weights, then
/// top-k, top-p over the top-k set, min-p. Returns the kept tokens in id order.
pub fn truncate(x: &[f32], m: f32, row: &SampleRow) -> Vec<(u32, u64)> {
    let c = log2e_over(row.temperature);
    let q: Vec<u64> = x.iter().map(|&v| weight(scaled(v, m, c))).collect();
    let mut order: Vec<usize> = (0..x.len()).collect();
    order.sort_by_key(|&i| Reverse(key(x[i])));
    // Runs of equal keys, largest first: the tokens strictly above a run are those before it.
    let runs: Vec<&[usize]> = order.chunk_by(|&a, &b| key(x[a]) == key(x[b])).collect();
    let mut keep = vec![true; x.len()];
    if row.top_k > 0 {
        let mut above = 0;
        for run in &runs {
            run.iter().for_each(|&i| keep[i] = above < row.top_k as usize);
            above += run.len();
        }
    }
    if row.top_p < 1.0 {
        let total: u64 = (0..x.len()).filter(|&i| keep[i]).map(|i| q[i]).sum();
        let mut above = 0;
        for run in &runs {
            let in_set: Vec<usize> = run.iter().copied().filter(|&i| keep[i]).collect();
            let kept = keeps_top_p(above, total, row.top_p);
            above += in_set.iter().map(|&i| q[i]).sum::<u64>();
            in_set.into_iter().for_each(|i| keep[i] = kept);
        }
    }
    (0..x.len()).filter(|&i| keep[i] && keeps_min_p(q[i], row.min_p)).map(|i| (i as u32, q[i])).collect()
}

/// Compares `sample_row` with the reference on `case` at each of `counters`: token, status and
/// kept count exactly, the log-probability (when asked) within 1e-4. Returns the rows compared.
pub fn check_against_reference(case: &Case, counters: &[u64]) -> usize {
    let r = Reference::new(&case.logits, &case.row, &case.penalties, case.mask.as_deref());
    for &counter in counters {
        let got = case.cpu(counter);
        let want = (r.token(case.row.seed, counter), r.status, r.kept.len() as u32);
        assert_eq!(
            (got.token, got.status, got.kept),
            want,
            "{} at counter {counter}: (token, status, kept)",
            case.label
        );
        if case.row.logprobs != 0 && got.status == SAMPLE_OK {
            let want = r.logprob(got.token);
            assert!(
                (f64::from(got.logprob) - want).abs() <= 1e-4,
                "{} at counter {counter}: logprob {} want {want}",
                case.label,
                got.logprob
            );
            let n = case.row.logprobs.saturating_sub(1).min(SAMPLE_MAX_TOP) as usize;
            let ids: Vec<u32> = got.top().iter().map(|e| e.0).collect();
            assert_eq!(ids, r.top(n), "{} at counter {counter}: the top {n}", case.label);
            for &(t, lp) in got.top() {
                let want = r.logprob(t);
                // A masked token among them: -inf both.
                let close = f64::from(lp) == want || (f64::from(lp) - want).abs() <= 1e-4;
                assert!(close, "{}: top token {t} logprob {lp} want {want}", case.label);
            }
        } else {
            assert_eq!(got.logprob, 0.0, "{} at counter {counter}: a logprob not asked for", case.label);
        }
    }
    counters.len()
}

// ---------------------------------------------------------------------------------------------
// Logits and settings.

pub fn bf16_round(v: f64) -> f32 {
    bf16::from_f64(v).to_f32()
}

/// `n` values N(0, sigma) (Box-Muller).
pub fn normals(rng: &mut Rng, n: usize, sigma: f64) -> Vec<f64> {
    (0..n)
        .map(|_| {
            let (u, v) = (1.0 - rng.uniform(0.0, 1.0), rng.uniform(0.0, 1.0));
            sigma * (-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos()
        })
        .collect()
}

/// Rows of `n` bf16 logits as a model gives them: N(0, sigma) for a few sigmas (bf16 makes
/// equal values common), a peaked row (one token 20 above N(0, 1)), and a row of massive ties
/// (integers in -4..=4).
pub fn logit_kinds(rng: &mut Rng, n: usize) -> Vec<(&'static str, Vec<f32>)> {
    let normal = |rng: &mut Rng, sigma| normals(rng, n, sigma).into_iter().map(bf16_round).collect::<Vec<_>>();
    let mut peaked = normal(rng, 1.0);
    peaked[(rng.next_u64() % n as u64) as usize] = 20.0;
    let ties = (0..n).map(|_| (rng.next_u64() % 9) as f32 - 4.0).collect();
    vec![
        ("N(0, 0.5)", normal(rng, 0.5)),
        ("N(0, 2)", normal(rng, 2.0)),
        ("N(0, 8)", normal(rng, 8.0)),
        ("peaked", peaked),
        ("ties", ties),
    ]
}

/// Penalized tokens of a row: its 5 largest logits (so the penalties matter) and up to 10
/// random ones, counts 1 to 4.
pub fn penalized_tokens(logits: &[f32], rng: &mut Rng) -> Vec<(u32, u32)> {
    let mut ids: Vec<u32> = (0..logits.len() as u32).collect();
    ids.sort_by_key(|&i| Reverse(key(logits[i as usize])));
    let mut tokens: Vec<u32> = ids.into_iter().take(5).collect();
    for _ in 0..10 {
        let t = (rng.next_u64() % logits.len() as u64) as u32;
        if !tokens.contains(&t) {
            tokens.push(t);
        }
    }
    tokens.into_iter().map(|t| (t, 1 + (rng.next_u64() % 4) as u32)).collect()
}

/// Settings covering each step alone and together (26 of them), each with its own seed, on
/// `logits` (labelled `kind`).
pub fn settings(kind: &str, logits: &[f32], rng: &mut Rng) -> Vec<Case> {
    let v = logits.len() as u32;
    let t = |temperature| SampleRow { temperature, ..GREEDY };
    let list = [
        ("greedy", GREEDY, false),
        ("greedy, logprob", SampleRow { logprobs: 1, ..GREEDY }, false),
        ("greedy, top 20 logprobs", SampleRow { logprobs: 21, ..GREEDY }, false),
        ("greedy ignores truncations", SampleRow { top_k: 3, top_p: 0.1, min_p: 0.9, ..GREEDY }, false),
        ("T 1", t(1.0), false),
        ("T 0.6, logprob", SampleRow { logprobs: 1, ..t(0.6) }, false),
        ("T 0.9, top 5 logprobs", SampleRow { logprobs: 6, ..t(0.9) }, false),
        ("top-k 5, top 20 logprobs", SampleRow { top_k: 5, logprobs: 21, ..t(1.0) }, false),
        ("T 1.7", t(1.7), false),
        ("T 0.001", t(1e-3), false),
        ("top-k 1", SampleRow { top_k: 1, ..t(1.0) }, false),
        ("top-k 2", SampleRow { top_k: 2, ..t(0.8) }, false),
        ("top-k 50", SampleRow { top_k: 50, ..t(1.2) }, false),
        ("top-k = vocab", SampleRow { top_k: v, ..t(1.0) }, false),
        ("top-k > vocab", SampleRow { top_k: v + 7, ..t(1.0) }, false),
        ("top-p 0.9", SampleRow { top_p: 0.9, ..t(1.0) }, false),
        ("top-p 0.3", SampleRow { top_p: 0.3, ..t(0.7) }, false),
        ("top-p 0.999", SampleRow { top_p: 0.999, ..t(1.5) }, false),
        ("min-p 0.1", SampleRow { min_p: 0.1, ..t(1.0) }, false),
        ("min-p 1", SampleRow { min_p: 1.0, ..t(1.0) }, false),
        ("min-p 0.001, T 2", SampleRow { min_p: 1e-3, ..t(2.0) }, false),
        ("T 0.8, top-k 40, top-p 0.95, min-p 0.01", SampleRow { top_k: 40, top_p: 0.95, min_p: 0.01, ..t(0.8) }, false),
        (
            "T 1.3, top-k 1000, top-p 0.5, min-p 0.001, logprob",
            SampleRow { top_k: 1000, top_p: 0.5, min_p: 1e-3, logprobs: 1, ..t(1.3) },
            false,
        ),
        (
            "penalties, T 1, top 3 logprobs",
            SampleRow { repetition: 1.2, presence: 0.4, frequency: 0.1, logprobs: 4, ..t(1.0) },
            true,
        ),
        ("penalties, greedy", SampleRow { repetition: 1.5, frequency: 0.5, ..GREEDY }, true),
        (
            "boosting penalties, top-k 20, top-p 0.8",
            SampleRow { repetition: 0.8, presence: -0.5, frequency: 0.3, top_k: 20, top_p: 0.8, ..t(1.0) },
            true,
        ),
    ];
    let penalties = penalized_tokens(logits, rng);
    let logits: Rc<[f32]> = logits.into();
    list.into_iter()
        .map(|(what, row, penalized)| Case {
            label: format!("vocab {v}, {kind}, {what}"),
            logits: logits.clone(),
            row: SampleRow { seed: rng.next_u64(), ..row },
            penalties: if penalized { penalties.clone() } else { Vec::new() },
            mask: None,
        })
        .collect()
}

/// `n` rows of `vocab` logits: row r has logit kind r mod 5 and setting r mod 26 (coprime: up
/// to 130 distinct pairs); every third row is masked (a seeded half of the tokens allowed).
pub fn mixed_cases(rng: &mut Rng, vocab: usize, n: usize) -> Vec<Case> {
    let per_kind: Vec<Vec<Case>> =
        logit_kinds(rng, vocab).iter().map(|(kind, logits)| settings(kind, logits, rng)).collect();
    (0..n)
        .map(|r| {
            let cases = &per_kind[r % per_kind.len()];
            let case = cases[r % cases.len()].clone();
            let seed = rng.next_u64();
            match r % 3 {
                1 => case.masked(|i| (i as u64 ^ seed).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 63 == 0),
                _ => case,
            }
        })
        .collect()
}

// ---------------------------------------------------------------------------------------------
// Distributions: chi-square against the exact softmax.

/// A fixed distribution of 16 tokens: logits 0.25 apart (bf16), in scrambled id order.
pub fn chi_logits() -> Vec<f32> {
    (0..16).map(|i| -0.25 * ((i * 7) % 16) as f32).collect()
}

/// The softmax of `x` at temperature `t` (f64) over the tokens of `keep`, renormalized.
pub fn softmax(x: &[f32], t: f64, keep: &[bool]) -> Vec<f64> {
    let e: Vec<f64> = x.iter().zip(keep).map(|(&v, &k)| if k { (f64::from(v) / t).exp() } else { 0.0 }).collect();
    let sum: f64 = e.iter().sum();
    e.iter().map(|v| v / sum).collect()
}

/// The `k` largest logits of `x` (distinct values).
pub fn top_k_mask(x: &[f32], k: usize) -> Vec<bool> {
    x.iter().map(|&v| x.iter().filter(|&&u| u > v).count() < k).collect()
}

/// How many tokens top-p `p` keeps at temperature `t` (f64; asserts no cumulative mass is
/// within 1e-3 of `p`, so the integer weights cut at the same token).
pub fn top_p_count(x: &[f32], t: f64, p: f64) -> usize {
    let mut probs = softmax(x, t, &vec![true; x.len()]);
    probs.sort_by(|a, b| b.total_cmp(a));
    let mut above = 0.0;
    let mut n = 0;
    for q in probs {
        assert!((above - p).abs() > 1e-3, "mass {above} too close to top-p {p}");
        if above < p {
            n += 1;
        }
        above += q;
    }
    n
}

/// Token counts of `outs` over `vocab` tokens (every one OK).
pub fn tally(outs: impl IntoIterator<Item = SampleOut>, vocab: usize) -> Vec<u64> {
    let mut counts = vec![0; vocab];
    for o in outs {
        assert_eq!(o.status, SAMPLE_OK, "{o:?}");
        counts[o.token as usize] += 1;
    }
    counts
}

/// The CPU's token counts for `case` over counters `0..draws`.
pub fn cpu_counts(case: &Case, draws: u64) -> Vec<u64> {
    tally((0..draws).map(|c| case.cpu(c)), case.logits.len())
}

/// Pearson's statistic of `counts` against probabilities `p` and its degrees of freedom
/// (infinite where a token of probability 0 was drawn).
pub fn chi_square(counts: &[u64], p: &[f64]) -> (f64, usize) {
    let n = counts.iter().sum::<u64>() as f64;
    let (mut stat, mut cells) = (0.0, 0);
    for (&o, &p) in counts.iter().zip(p) {
        if p == 0.0 {
            if o > 0 {
                stat = f64::INFINITY;
            }
        } else {
            stat += (o as f64 - n * p).powi(2) / (n * p);
            cells += 1;
        }
    }
    (stat, cells - 1)
}

/// The chi-square distribution's upper 1e-4 point with `df` degrees of freedom
/// (Wilson-Hilferty).
pub fn chi_square_limit(df: usize) -> f64 {
    const Z: f64 = 3.719; // the standard normal's upper 1e-4 point
    let (d, a) = (df as f64, 2.0 / (9.0 * df as f64));
    d * (1.0 - a + Z * a.sqrt()).powi(3)
}

/// Asserts `counts` fit `p`, and fit none of the `wrong` expectations (planted defects: the
/// test would catch an implementation that sampled those).
pub fn assert_fits(label: &str, counts: &[u64], p: &[f64], wrong: &[(&str, Vec<f64>)]) {
    let (stat, df) = chi_square(counts, p);
    let limit = chi_square_limit(df);
    println!(
        "{label}: {} draws, chi-square {stat:.1} on {df} degrees of freedom (limit {limit:.1})",
        counts.iter().sum::<u64>()
    );
    assert!(stat < limit, "{label}: the draws do not follow the distribution: {counts:?} vs {p:?}");
    for (what, q) in wrong {
        let (s, d) = chi_square(counts, q);
        let l = chi_square_limit(d);
        println!("  against {what} (a planted defect): {s:.1} (limit {l:.1})");
        assert!(s > l, "{label}: the draws cannot tell {what} apart");
    }
}

// ---------------------------------------------------------------------------------------------
// Boundaries, special values and penalties.

/// Ids 0..8 with logits -2, -inf, 0, -3, -50, -1, -3, -inf. At temperature log2(e) the factor
/// of [`scaled`] is exactly 1, so the weights are exact powers of two: in units u = 2^37,
/// 2, 0, 8, 1, 0 (z = -50 < -40), 4, 1, 0: 16u in all.
pub const BOUNDARY: [f32; 8] = [-2.0, NEG_INF, 0.0, -3.0, -50.0, -1.0, -3.0, NEG_INF];
/// The tokens of [`BOUNDARY`] that weigh nothing: kept by no truncation, never drawn.
pub const WEIGHTLESS: [u32; 3] = [1, 4, 7];

/// Rows on [`BOUNDARY`] and the tokens each keeps (derived by hand from the weights).
pub fn boundary_cases() -> Vec<(Case, Vec<u32>)> {
    let t = SampleRow { temperature: std::f32::consts::LOG2_E, seed: 21, ..GREEDY };
    let up = |p: f32| p.next_up();
    let rows = [
        ("no truncation (weightless tokens count as kept)", t, vec![0, 1, 2, 3, 4, 5, 6, 7]),
        // Mass above -2 is 12u = 0.75 * 16u exactly: -1 (crossing exactly) kept, -2 not.
        ("top-p 0.75", SampleRow { top_p: 0.75, ..t }, vec![2, 5]),
        ("top-p 0.7", SampleRow { top_p: 0.7, ..t }, vec![2, 5]),
        ("top-p just above 0.75", SampleRow { top_p: up(0.75), ..t }, vec![0, 2, 5]),
        // Mass above the tied -3s is 14u = 0.875 * 16u: both out, or both in.
        ("top-p 0.875", SampleRow { top_p: 0.875, ..t }, vec![0, 2, 5]),
        ("top-p just above 0.875 (a tie kept whole)", SampleRow { top_p: up(0.875), ..t }, vec![0, 2, 3, 5, 6]),
        ("top-p 0.99", SampleRow { top_p: 0.99, ..t }, vec![0, 2, 3, 5, 6]),
        // Thresholds 2u = 0.25 Q_ONE exactly: -2 kept at 0.25.
        ("min-p 0.25", SampleRow { min_p: 0.25, ..t }, vec![0, 2, 5]),
        ("min-p just above 0.25", SampleRow { min_p: up(0.25), ..t }, vec![2, 5]),
        ("min-p 1", SampleRow { min_p: 1.0, ..t }, vec![2]),
        ("top-k 3", SampleRow { top_k: 3, ..t }, vec![0, 2, 5]),
        ("top-k 4 (the tie at 4th place kept whole)", SampleRow { top_k: 4, ..t }, vec![0, 2, 3, 5, 6]),
        ("top-k 6", SampleRow { top_k: 6, ..t }, vec![0, 2, 3, 4, 5, 6]),
        ("top-k 7", SampleRow { top_k: 7, ..t }, vec![0, 1, 2, 3, 4, 5, 6, 7]),
        // Top-p over the top-k set's mass (12u: 0.6 of it is 7.2u < 8u above -1); over the
        // whole mass (9.6u) -1 would be kept.
        ("top-k 2, top-p 0.6", SampleRow { top_k: 2, top_p: 0.6, ..t }, vec![2]),
        ("top-k 4, top-p just above 0.75", SampleRow { top_k: 4, top_p: up(0.75), ..t }, vec![0, 2, 5]),
        ("top-p 0.99, min-p 0.25", SampleRow { top_p: 0.99, min_p: 0.25, ..t }, vec![0, 2, 5]),
    ];
    rows.into_iter().map(|(what, row, kept)| (Case::new(format!("boundary, {what}"), &BOUNDARY, row), kept)).collect()
}

/// What a row must do over counters `0..4000`.
pub enum Expect {
    /// The same token every time.
    Always(u32),
    /// Only these tokens, each at least once (and about equally often when `true`).
    Among(Vec<u32>, bool),
    /// No token: this status.
    Fails(u32),
}

pub fn assert_draws(case: &Case, expect: &Expect) {
    let draws = 4000;
    let label = &case.label;
    let counts = || cpu_counts(case, draws);
    match expect {
        Expect::Always(t) => assert_eq!(counts()[*t as usize], draws, "{label}: always token {t}"),
        Expect::Among(tokens, even) => {
            let counts = counts();
            for (t, &n) in counts.iter().enumerate() {
                let share = n as f64 / draws as f64;
                if tokens.contains(&(t as u32)) {
                    assert!(n > 0, "{label}: token {t} never drawn: {counts:?}");
                    let fair = 1.0 / tokens.len() as f64;
                    assert!(!even || (share - fair).abs() < 0.05, "{label}: token {t} drawn {share}, not ~{fair}");
                } else {
                    assert_eq!(n, 0, "{label}: token {t} drawn: {counts:?}");
                }
            }
        }
        Expect::Fails(status) => {
            for c in 0..draws {
                let o = case.cpu(c);
                assert_eq!((o.token, o.status, o.kept, o.logprob), (u32::MAX, *status, 0, 0.0), "{label}");
            }
        }
    }
}

/// Rows with infinities, NaN and penalties that make them, and what each must do.
pub fn special_cases() -> Vec<(Case, Expect)> {
    use Expect::*;
    let (big, small) = (bf16::MAX.to_f32(), bf16::MIN.to_f32());
    let t1 = SampleRow { temperature: 1.0, seed: 31, logprobs: 1, ..GREEDY };
    let greedy = SampleRow { logprobs: 1, ..GREEDY };
    let plus_inf = [1.0, INF, 3.0, NEG_INF];
    let two_inf = [INF, 0.0, INF, NEG_INF];
    let with_neg_inf = [NEG_INF, 2.0, NEG_INF, 1.0, NEG_INF];
    let top_first = [5.0, 1.0, 0.5, 4.5];
    let case = |what: &str, logits: &[f32], row| Case::new(what, logits, row);
    vec![
        (case("+inf, T 1", &plus_inf, t1), Always(1)),
        (case("+inf, greedy", &plus_inf, greedy), Always(1)),
        (case("+inf, top-p 0.5, min-p 0.5", &plus_inf, SampleRow { top_p: 0.5, min_p: 0.5, ..t1 }), Always(1)),
        (case("two +inf, T 1", &two_inf, t1), Among(vec![0, 2], true)),
        (case("two +inf, top-k 1", &two_inf, SampleRow { top_k: 1, ..t1 }), Among(vec![0, 2], true)),
        (case("two +inf, greedy", &two_inf, greedy), Always(0)),
        (case("-inf, T 2", &with_neg_inf, SampleRow { temperature: 2.0, ..t1 }), Among(vec![1, 3], false)),
        (case("-inf, top-k 4", &with_neg_inf, SampleRow { top_k: 4, ..t1 }), Among(vec![1, 3], false)),
        (case("NaN, T 1", &[1.0, f32::NAN, 2.0], t1), Fails(SAMPLE_NAN)),
        (case("NaN, greedy", &[1.0, 2.0, f32::NAN], greedy), Fails(SAMPLE_NAN)),
        (case("NaN beside +inf", &[INF, f32::NAN], t1), Fails(SAMPLE_NAN)),
        (case("NaN among -inf", &[NEG_INF, f32::NAN, NEG_INF], greedy), Fails(SAMPLE_NAN)),
        (case("all -inf, T 1", &[NEG_INF; 5], t1), Fails(SAMPLE_ALL_NEG_INF)),
        (case("all -inf, greedy, vocab 1", &[NEG_INF], greedy), Fails(SAMPLE_ALL_NEG_INF)),
        (case("vocab 1, T 1", &[3.0], t1), Always(0)),
        (case("-0 and +0 tie, greedy", &[-0.0, 0.0, -1.0], greedy), Always(0)),
        (case("-0 and +0 tie, top-k 1", &[-0.0, 0.0, -1.0], SampleRow { top_k: 1, ..t1 }), Among(vec![0, 1], true)),
        // Penalties making special values: +inf - (3e38 * 2 = inf) is NaN; the most negative
        // bf16 times 2 is -inf; a presence of -3e38 pushes the largest bf16 to +inf (breaking a
        // tie); a huge presence takes the top token out.
        (
            case("frequency makes NaN", &[INF, 0.0], SampleRow { frequency: 3e38, ..t1 }).penalized(&[(0, 2)]),
            Fails(SAMPLE_NAN),
        ),
        (
            case("repetition makes -inf", &[small, 1.0], SampleRow { repetition: 2.0, ..t1 }).penalized(&[(0, 1)]),
            Always(1),
        ),
        (
            case("repetition makes all -inf", &[small], SampleRow { repetition: 2.0, ..greedy }).penalized(&[(0, 3)]),
            Fails(SAMPLE_ALL_NEG_INF),
        ),
        (
            case("presence makes +inf", &[big, big, 0.0], SampleRow { presence: -3e38, ..t1 }).penalized(&[(1, 1)]),
            Always(1),
        ),
        (
            case("huge presence, T 1", &top_first, SampleRow { presence: 1e30, ..t1 }).penalized(&[(0, 1)]),
            Among(vec![1, 2, 3], false),
        ),
        (
            case("huge presence, greedy", &top_first, SampleRow { presence: 1e30, ..greedy }).penalized(&[(0, 1)]),
            Always(3),
        ),
    ]
}
