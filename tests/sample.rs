//! Token sampling (kernels-gpu/src/sample.rs, whose module doc is the specification):
//! - `cpu::sample::sample_row` against an independent reference written from the doc's steps
//!   (a full sort by key, top-k, top-p and min-p by their definitions, the draw walked in id
//!   order) at vocabularies 1 to 131072, over many settings and counters;
//! - the shared pieces against independent answers: Philox4x32-10 against Random123's
//!   known-answer vectors, the fixed-point weights against f64 powers of two;
//! - the distribution of draws against the exact (f64) softmax by chi-square, with planted
//!   defects (a wrong temperature, a truncation one token off) shown to fail; truncation
//!   boundaries on exactly representable weights; infinities and NaN; penalties; masks (step
//!   0: only allowed tokens drawn, NaN on a masked token ignored); reproducibility; the host's
//!   argument checks;
//! - on the GPU (`#[ignore]`d): the kernel against the CPU at Nano's vocabulary and at edge
//!   sizes up to `SAMPLE_MAX_VOCAB` (rows padded with NaN past the vocabulary), the special
//!   rows above, batch independence, the launcher's refusals and a chi-square smoke test.

use std::cmp::Reverse;
use std::collections::BTreeMap;
use std::rc::Rc;

use half::bf16;
use host::cpu::sample::sample_row;
use host::sample::{RowSampling, SampleRows, check_row, read_out, sample, sample_out};
use host::{Gpu, Rows};
use kernels_gpu::sample::{
    Q_ONE, SAMPLE_ALL_NEG_INF, SAMPLE_MAX_TOP, SAMPLE_MAX_VOCAB, SAMPLE_NAN, SAMPLE_OK, SAMPLE_OUT_WORDS, SampleOut,
    SampleRow, keeps_min_p, keeps_top_p, key, log2e_over, penalize, philox4x32, random, scaled, target, weight,
};
use nemotron_rs::{Rng, gpu};

const GREEDY: SampleRow = SampleRow::GREEDY;
const INF: f32 = f32::INFINITY;
const NEG_INF: f32 = f32::NEG_INFINITY;
/// Nemotron Nano's vocabulary.
const NANO_VOCAB: usize = 131072;
/// Draws of each CPU chi-square test: enough that a temperature 10% off fails.
const DRAWS: u64 = 100_000;

/// One row to sample: its logits (bf16 values, except the CPU-only continuous kind), settings,
/// penalized tokens (token, count) and mask (a bit a token, 1: allowed).
#[derive(Clone)]
struct Case {
    label: String,
    logits: Rc<[f32]>,
    row: SampleRow,
    penalties: Vec<(u32, u32)>,
    mask: Option<Vec<u32>>,
}

impl Case {
    fn new(label: impl Into<String>, logits: &[f32], row: SampleRow) -> Case {
        Case { label: label.into(), logits: logits.into(), row, penalties: Vec::new(), mask: None }
    }

    fn penalized(self, penalties: &[(u32, u32)]) -> Case {
        Case { penalties: penalties.to_vec(), ..self }
    }

    /// The case with only the tokens `allowed` says allowed.
    fn masked(self, allowed: impl Fn(usize) -> bool) -> Case {
        let mut mask = vec![0u32; self.logits.len().div_ceil(32)];
        for i in (0..self.logits.len()).filter(|&i| allowed(i)) {
            mask[i / 32] |= 1 << (i % 32);
        }
        Case { label: format!("{}, masked", self.label), mask: Some(mask), ..self }
    }

    /// The row at `counter`.
    fn at(&self, counter: u64) -> SampleRow {
        SampleRow { counter, ..self.row }
    }

    /// The CPU implementation's output at `counter`.
    fn cpu(&self, counter: u64) -> SampleOut {
        sample_row(&self.logits, &self.at(counter), &self.penalties, self.mask.as_deref())
    }
}

// ---------------------------------------------------------------------------------------------
// The reference: the module doc's steps, written out without `cpu::sample`.

/// A row after steps 1-5: its status and, when OK, the kept tokens in id order with their
/// weights (greedy: the argmax alone, weight 1).
struct Reference {
    status: u32,
    kept: Vec<(u32, u64)>,
    /// The penalized logits and their maximum (step 7).
    x: Vec<f32>,
    m: f32,
}

impl Reference {
    fn new(logits: &[f32], row: &SampleRow, penalties: &[(u32, u32)], mask: Option<&[u32]>) -> Reference {
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
    fn token(&self, seed: u64, counter: u64) -> u32 {
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
    fn logprob(&self, t: u32) -> f64 {
        let rel = |v: f32| if v == self.m { 0.0 } else { f64::from(v) - f64::from(self.m) };
        rel(self.x[t as usize]) - self.x.iter().map(|&v| rel(v).exp()).sum::<f64>().ln()
    }

    /// Step 7's `n` most likely tokens: a full sort by logit (as f64: -0 and +0 equal), ties by
    /// id.
    fn top(&self, n: usize) -> Vec<u32> {
        let mut ids: Vec<u32> = (0..self.x.len() as u32).collect();
        let v = |i: u32| f64::from(self.x[i as usize]) + 0.0;
        ids.sort_by(|&a, &b| v(b).total_cmp(&v(a)).then(a.cmp(&b)));
        ids.truncate(n);
        ids
    }
}

/// Steps 4-5 by their definitions over a full sort by key (descending): the weights, then
/// top-k, top-p over the top-k set, min-p. Returns the kept tokens in id order.
fn truncate(x: &[f32], m: f32, row: &SampleRow) -> Vec<(u32, u64)> {
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
fn check_against_reference(case: &Case, counters: &[u64]) -> usize {
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

fn bf16_round(v: f64) -> f32 {
    bf16::from_f64(v).to_f32()
}

/// `n` values N(0, sigma) (Box-Muller).
fn normals(rng: &mut Rng, n: usize, sigma: f64) -> Vec<f64> {
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
fn logit_kinds(rng: &mut Rng, n: usize) -> Vec<(&'static str, Vec<f32>)> {
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
fn penalized_tokens(logits: &[f32], rng: &mut Rng) -> Vec<(u32, u32)> {
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
fn settings(kind: &str, logits: &[f32], rng: &mut Rng) -> Vec<Case> {
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
fn mixed_cases(rng: &mut Rng, vocab: usize, n: usize) -> Vec<Case> {
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

/// A mask leaves its tokens out whatever their logits: greedy takes the best allowed token,
/// draws only allowed ones, a NaN or `+inf` on a masked token changes nothing, a mask that
/// allows nothing gives no token; the log-probabilities are those of the masked row.
#[test]
fn masked_tokens_are_never_drawn() {
    let mut rng = Rng::new(71);
    let vocab = 1000;
    let logits: Vec<f32> = (0..vocab).map(|_| bf16_round(rng.uniform(-4.0, 4.0))).collect();
    let best = |allowed: &dyn Fn(usize) -> bool| {
        (0..vocab).filter(|&i| allowed(i)).max_by(|&a, &b| logits[a].total_cmp(&logits[b]).then(b.cmp(&a))).unwrap()
    };
    let even = |i: usize| i.is_multiple_of(2);
    let argmax = best(&|_| true);
    let no_argmax = move |i: usize| i != argmax;
    let greedy = Case::new("greedy", &logits, GREEDY);
    assert_eq!(greedy.clone().masked(no_argmax).cpu(0).token as usize, best(&no_argmax));
    assert_eq!(greedy.clone().masked(even).cpu(0).token as usize, best(&even));
    let t1 = Case::new("T 1", &logits, SampleRow { temperature: 1.0, seed: 9, logprobs: 1, ..GREEDY }).masked(even);
    let mut drawn = 0;
    for c in 0..2000 {
        let out = t1.cpu(c);
        assert!(out.status == SAMPLE_OK && out.token.is_multiple_of(2), "counter {c}: {out:?}");
        drawn += 1;
    }
    // The log-probability of a token under the masked row: over the allowed tokens only.
    let out = t1.cpu(0);
    let lse = (0..vocab).filter(|&i| even(i)).map(|i| f64::from(logits[i]).exp()).sum::<f64>().ln();
    assert!((f64::from(out.logprob) - (f64::from(logits[out.token as usize]) - lse)).abs() < 1e-4, "{out:?}");
    let mut poisoned = logits.clone();
    poisoned[1] = f32::NAN;
    poisoned[3] = INF;
    let p = Case::new("NaN and inf on masked tokens", &poisoned, GREEDY).masked(even);
    assert_eq!((p.cpu(0).status, p.cpu(0).token as usize), (SAMPLE_OK, best(&even)));
    let none = greedy.masked(|_| false).cpu(0);
    assert_eq!(none.status, SAMPLE_ALL_NEG_INF);
    assert_eq!(drawn, 2000);
}

#[test]
fn cpu_matches_the_reference() {
    let mut rng = Rng::new(1);
    let (mut compared, mut expected) = (0, 0);
    for vocab in [1, 2, 7, 8, 9, 1000, NANO_VOCAB] {
        // Counters with high words set too.
        let counters: Vec<u64> = if vocab <= 1000 {
            (0..48).chain([u64::from(u32::MAX), (1 << 32) | 5, u64::MAX]).collect()
        } else {
            vec![0, 1, (1 << 40) + 3]
        };
        let mut kinds = logit_kinds(&mut rng, vocab);
        // Continuous f32 logits, almost no ties.
        kinds.push(("uniform f32", (0..vocab).map(|_| rng.uniform(-6.0, 6.0) as f32).collect()));
        for (kind, logits) in &kinds {
            let mut cases = settings(kind, logits, &mut rng);
            // Each setting again under a mask: a seeded half of the tokens, and the first token only.
            let seed = rng.next_u64();
            let half = |i: usize| (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15).wrapping_add(seed) >> 63 == 0;
            cases.extend(cases.clone().into_iter().map(|c| c.masked(half)));
            cases.push(cases[0].clone().masked(|i| i == 0));
            expected += cases.len() * counters.len();
            compared += cases.iter().map(|c| check_against_reference(c, &counters)).sum::<usize>();
        }
    }
    println!("sample_row vs the reference: {compared} rows compared (token, status, kept), all identical");
    assert_eq!(compared, expected);
}

// ---------------------------------------------------------------------------------------------
// The shared pieces against independent answers.

#[test]
fn philox_matches_random123_known_answers() {
    // Random123's examples/kat_vectors, the "philox4x32 10" lines: counter, key, result.
    let vectors: [([u32; 4], [u32; 2], [u32; 4]); 3] = [
        ([0; 4], [0; 2], [0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8]),
        ([u32::MAX; 4], [u32::MAX; 2], [0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd]),
        (
            [0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344],
            [0xa4093822, 0x299f31d0],
            [0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1],
        ),
    ];
    for (ctr, key, want) in vectors {
        let got = philox4x32(ctr, key);
        assert_eq!(got, want, "philox4x32({ctr:08x?}, {key:08x?})");
    }
    // Step 6's bits: the first two words of the block of counter (counter, 0) under the seed.
    assert_eq!(random(0, 0), 0xe169c58d_6627e8d5);
    println!("Philox4x32-10: {} known-answer vectors and random(0, 0) match", vectors.len());
}

#[test]
fn weight_is_two_to_the_z_in_q_one_units() {
    assert_eq!(Q_ONE, 1 << 40);
    assert_eq!(weight(0.0), Q_ONE);
    assert_eq!(weight(-0.0), Q_ONE);
    for k in 0..=40 {
        assert_eq!(weight(-(k as f32)), 1 << (40 - k), "2^-{k}: exact");
    }
    for z in [-40.000004, -40.5, -41.0, -1e30, NEG_INF, f32::NAN] {
        assert_eq!(weight(z), 0, "weight({z})");
    }
    // Against f64 on a grid over [-40, 0]: relative error < 1e-6 above z = -20, below it
    // within a unit (the truncation to an integer) as well.
    let steps = 400_000;
    let (mut worst, mut worst_poly) = (0.0f64, 0.0f64);
    for i in 0..=steps {
        let z = (-40.0 * f64::from(i) / f64::from(steps)) as f32;
        let want = (f64::from(z) + 40.0).exp2();
        let (got, err) = (weight(z) as f64, |g: f64| (g - want).abs());
        // The polynomial (relative error below 1e-7 by the doc) and f32 rounding, then the
        // truncation to an integer.
        worst_poly = worst_poly.max((err(got) - 1.0).max(0.0) / want);
        if z > -20.0 {
            worst = worst.max(err(got) / want);
            assert!(err(got) / want < 1e-6, "weight({z}) = {got}, want {want}");
        } else {
            assert!(err(got) <= 1e-6 * want + 1.0, "weight({z}) = {got}, want {want}");
        }
    }
    println!(
        "weight: {} points of [-40, 0] against 2^(z + 40), worst relative error above -20: {worst:e}, less the truncation: {worst_poly:e}",
        steps + 1
    );
    assert!(worst_poly < 1.5e-7, "the polynomial's error: {worst_poly:e}");
    // Monotone over a fine grid and the 64 floats around every integer and half-integer (where
    // the range reduction switches).
    let mut zs: Vec<f32> = (0..=410_000).map(|i| (-41.0 + f64::from(i) * 1e-4) as f32).collect();
    for h in 0..=82 {
        let b = (-(h as f32) / 2.0).to_bits() as i64;
        zs.extend((-32..=32).map(|d| f32::from_bits((b + d) as u32)).filter(|&z| z <= 0.0));
    }
    zs.sort_by(f32::total_cmp);
    let w: Vec<u64> = zs.iter().map(|&z| weight(z)).collect();
    let bad = (1..zs.len()).find(|&i| w[i] < w[i - 1]);
    assert!(bad.is_none(), "weight decreases from z = {} to {}", zs[bad.unwrap() - 1], zs[bad.unwrap()]);
    println!("weight: monotone over {} points", zs.len());
}

/// A row's output words: the top pairs past `top_len` (left as they were by the kernel; the
/// host poisons a fresh buffer) read as (0, 0), so outputs compare equal whatever they held.
#[test]
fn out_words_past_top_len_are_not_read() {
    let mut w = vec![u32::MAX; SAMPLE_OUT_WORDS as usize];
    w[..7].copy_from_slice(&[5, SAMPLE_OK, (-0.5f32).to_bits(), 3, 1, 9, (-0.25f32).to_bits()]);
    let out = SampleOut::from_words(&w);
    assert_eq!((out.token, out.status, out.logprob, out.kept), (5, SAMPLE_OK, -0.5, 3));
    assert_eq!(out.top(), &[(9, -0.25)]);
    assert!(out.top[1..].iter().all(|&t| t == (0, 0.0)), "{:?}", out.top);
    assert_eq!(out, SampleOut::from_words(&w), "equal to itself: no NaN left in it");
}

#[test]
fn target_scales_the_draw_into_the_kept_mass() {
    for total in [1, 3, Q_ONE, 5 * Q_ONE + 7, u64::MAX] {
        assert_eq!(target(0, total), 0);
        assert_eq!(target(1 << 63, total), total / 2);
        assert_eq!(target(u64::MAX, total), total - 1, "never past the mass");
    }
}

// ---------------------------------------------------------------------------------------------
// Distributions: chi-square against the exact softmax.

/// A fixed distribution of 16 tokens: logits 0.25 apart (bf16), in scrambled id order.
fn chi_logits() -> Vec<f32> {
    (0..16).map(|i| -0.25 * ((i * 7) % 16) as f32).collect()
}

/// The softmax of `x` at temperature `t` (f64) over the tokens of `keep`, renormalized.
fn softmax(x: &[f32], t: f64, keep: &[bool]) -> Vec<f64> {
    let e: Vec<f64> = x.iter().zip(keep).map(|(&v, &k)| if k { (f64::from(v) / t).exp() } else { 0.0 }).collect();
    let sum: f64 = e.iter().sum();
    e.iter().map(|v| v / sum).collect()
}

/// The `k` largest logits of `x` (distinct values).
fn top_k_mask(x: &[f32], k: usize) -> Vec<bool> {
    x.iter().map(|&v| x.iter().filter(|&&u| u > v).count() < k).collect()
}

/// How many tokens top-p `p` keeps at temperature `t` (f64; asserts no cumulative mass is
/// within 1e-3 of `p`, so the integer weights cut at the same token).
fn top_p_count(x: &[f32], t: f64, p: f64) -> usize {
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
fn tally(outs: impl IntoIterator<Item = SampleOut>, vocab: usize) -> Vec<u64> {
    let mut counts = vec![0; vocab];
    for o in outs {
        assert_eq!(o.status, SAMPLE_OK, "{o:?}");
        counts[o.token as usize] += 1;
    }
    counts
}

/// The CPU's token counts for `case` over counters `0..draws`.
fn cpu_counts(case: &Case, draws: u64) -> Vec<u64> {
    tally((0..draws).map(|c| case.cpu(c)), case.logits.len())
}

/// Pearson's statistic of `counts` against probabilities `p` and its degrees of freedom
/// (infinite where a token of probability 0 was drawn).
fn chi_square(counts: &[u64], p: &[f64]) -> (f64, usize) {
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
fn chi_square_limit(df: usize) -> f64 {
    const Z: f64 = 3.719; // the standard normal's upper 1e-4 point
    let (d, a) = (df as f64, 2.0 / (9.0 * df as f64));
    d * (1.0 - a + Z * a.sqrt()).powi(3)
}

/// Asserts `counts` fit `p`, and fit none of the `wrong` expectations (planted defects: the
/// test would catch an implementation that sampled those).
fn assert_fits(label: &str, counts: &[u64], p: &[f64], wrong: &[(&str, Vec<f64>)]) {
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

#[test]
fn temperature_draws_follow_the_softmax() {
    let x = chi_logits();
    let all = vec![true; x.len()];
    for (t, seed) in [(0.5, 11), (1.0, 12), (2.0, 13)] {
        let case = Case::new(format!("T {t}"), &x, SampleRow { temperature: t, seed, ..GREEDY });
        let t = f64::from(t);
        let wrong = [("T x 1.1", softmax(&x, t * 1.1, &all)), ("T / 1.1", softmax(&x, t / 1.1, &all))];
        assert_fits(&case.label, &cpu_counts(&case, DRAWS), &softmax(&x, t, &all), &wrong);
    }
}

#[test]
fn truncated_draws_follow_the_renormalized_softmax() {
    let x = chi_logits();
    let (t, k) = (0.7, 5);
    let case = Case::new("T 0.7, top-k 5", &x, SampleRow { temperature: t, top_k: k as u32, seed: 14, ..GREEDY });
    let t = f64::from(t);
    let wrong = [
        ("T x 1.1", softmax(&x, t * 1.1, &top_k_mask(&x, k))),
        ("top-4", softmax(&x, t, &top_k_mask(&x, k - 1))),
        ("top-6", softmax(&x, t, &top_k_mask(&x, k + 1))),
    ];
    assert_fits(&case.label, &cpu_counts(&case, DRAWS), &softmax(&x, t, &top_k_mask(&x, k)), &wrong);

    let (t, p) = (1.0, 0.6);
    let case = Case::new("T 1, top-p 0.6", &x, SampleRow { temperature: t, top_p: p, seed: 15, ..GREEDY });
    let (t, n) = (f64::from(t), top_p_count(&x, 1.0, f64::from(p)));
    assert_eq!(n, 4, "the cut of top-p 0.6 at T 1");
    let wrong = [
        ("T x 1.1", softmax(&x, t * 1.1, &top_k_mask(&x, n))),
        ("one token fewer", softmax(&x, t, &top_k_mask(&x, n - 1))),
        ("one token more", softmax(&x, t, &top_k_mask(&x, n + 1))),
    ];
    assert_fits(&case.label, &cpu_counts(&case, DRAWS), &softmax(&x, t, &top_k_mask(&x, n)), &wrong);
}

// ---------------------------------------------------------------------------------------------
// Boundaries, special values and penalties.

/// Ids 0..8 with logits -2, -inf, 0, -3, -50, -1, -3, -inf. At temperature log2(e) the factor
/// of [`scaled`] is exactly 1, so the weights are exact powers of two: in units u = 2^37,
/// 2, 0, 8, 1, 0 (z = -50 < -40), 4, 1, 0: 16u in all.
const BOUNDARY: [f32; 8] = [-2.0, NEG_INF, 0.0, -3.0, -50.0, -1.0, -3.0, NEG_INF];
/// The tokens of [`BOUNDARY`] that weigh nothing: kept by no truncation, never drawn.
const WEIGHTLESS: [u32; 3] = [1, 4, 7];

/// Rows on [`BOUNDARY`] and the tokens each keeps (derived by hand from the weights).
fn boundary_cases() -> Vec<(Case, Vec<u32>)> {
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

#[test]
fn truncations_cut_at_exact_boundaries() {
    let counters: Vec<u64> = (0..4000).collect();
    let mut compared = 0;
    for (case, kept) in boundary_cases() {
        let r = Reference::new(&case.logits, &case.row, &case.penalties, case.mask.as_deref());
        assert_eq!(r.kept.iter().map(|e| e.0).collect::<Vec<_>>(), kept, "{}: the reference's kept tokens", case.label);
        compared += check_against_reference(&case, &counters);
        let drawable: Vec<u32> = kept.into_iter().filter(|t| !WEIGHTLESS.contains(t)).collect();
        assert_draws(&case, &Expect::Among(drawable, false));
    }
    println!("boundaries: {compared} rows compared with the reference");
}

/// What a row must do over counters `0..4000`.
enum Expect {
    /// The same token every time.
    Always(u32),
    /// Only these tokens, each at least once (and about equally often when `true`).
    Among(Vec<u32>, bool),
    /// No token: this status.
    Fails(u32),
}

fn assert_draws(case: &Case, expect: &Expect) {
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
fn special_cases() -> Vec<(Case, Expect)> {
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

#[test]
fn special_values_follow_the_spec() {
    let counters: Vec<u64> = (0..256).collect();
    let mut compared = 0;
    for (case, expect) in special_cases() {
        compared += check_against_reference(&case, &counters);
        assert_draws(&case, &expect);
    }
    // +inf tokens share all of the mass: log-probability -ln(count).
    let logprob = |label: &str| special_cases().into_iter().find(|e| e.0.label == label).unwrap().0.cpu(0).logprob;
    let (one, two) = (logprob("+inf, T 1"), logprob("two +inf, T 1"));
    assert_eq!(one, 0.0, "a lone +inf: logprob 0");
    assert!((f64::from(two) + 2f64.ln()).abs() < 1e-6, "two +inf: logprob {two}, want -ln 2");
    println!("special values: {compared} rows compared with the reference, each row's draws as expected");
}

#[test]
fn penalties_apply_as_specified() {
    let r = SampleRow { repetition: 2.0, presence: 0.5, frequency: 0.25, ..GREEDY };
    // Positives divided by the repetition penalty, negatives (and 0) multiplied.
    assert_eq!(penalize(2.0, 1, &r), 1.0 - 0.5 - 0.25);
    assert_eq!(penalize(-2.0, 3, &r), -4.0 - 0.5 - 0.75);
    assert_eq!(penalize(0.0, 1, &r), -0.75);
    // Through the sampler: greedy picks the penalized logits' argmax.
    let greedy = |logits: &[f32], row: SampleRow, penalties: &[(u32, u32)]| {
        let case = Case::new("penalties", logits, row).penalized(penalties);
        check_against_reference(&case, &[0]);
        case.cpu(0).token
    };
    let rep = SampleRow { repetition: 2.0, ..GREEDY };
    assert_eq!(greedy(&[2.0, -1.0, 1.5], rep, &[(0, 1)]), 2, "2 / 2 = 1 < 1.5");
    assert_eq!(greedy(&[-1.0, -1.5], rep, &[(0, 1)]), 1, "-1 * 2 = -2 < -1.5 (a division would give -0.5)");
    assert_eq!(greedy(&[2.0, 1.5], SampleRow { repetition: 0.5, ..GREEDY }, &[(1, 1)]), 1, "1.5 / 0.5 = 3 > 2");
    // Frequency scales with the count; presence does not.
    let freq = SampleRow { frequency: 0.06, ..GREEDY };
    assert_eq!(greedy(&[1.0, 0.9], freq, &[(0, 1)]), 0, "1 - 0.06 > 0.9");
    assert_eq!(greedy(&[1.0, 0.9], freq, &[(0, 2)]), 1, "1 - 0.12 < 0.9");
    let pres = SampleRow { presence: 0.06, ..GREEDY };
    assert_eq!(greedy(&[1.0, 0.9], pres, &[(0, 5)]), 0, "1 - 0.06 > 0.9 at any count");
    // The log-probability is the penalized logits': [1, 1] after a presence of 1 on [2, 1].
    let case = Case::new("penalized logprob", &[2.0, 1.0], SampleRow { presence: 1.0, logprobs: 1, ..GREEDY })
        .penalized(&[(0, 1)]);
    assert!((f64::from(case.cpu(0).logprob) + 2f64.ln()).abs() < 1e-6, "{:?}", case.cpu(0));
    // A huge presence keeps a token out of every draw.
    let mut rng = Rng::new(41);
    let logits = normals(&mut rng, 1000, 1.0).into_iter().map(bf16_round).collect::<Vec<_>>();
    let top = (0..1000u32).max_by_key(|&i| key(logits[i as usize])).unwrap();
    let case = Case::new(
        "presence 1e30 on the top token",
        &logits,
        SampleRow { temperature: 1.0, presence: 1e30, seed: 42, ..GREEDY },
    )
    .penalized(&[(top, 1)]);
    let counts = cpu_counts(&case, 20_000);
    assert_eq!(counts[top as usize], 0, "the penalized top token was drawn");
    println!("penalties: as specified; the penalized top token never drawn in 20000 draws");
}

#[test]
fn draws_depend_on_seed_and_counter_only() {
    let flat = vec![0.0f32; 1000];
    let case = |seed| Case::new("flat", &flat, SampleRow { temperature: 1.0, seed, ..GREEDY });
    // The same (seed, counter, logits): the same token, whatever other settings that do not
    // change the kept set.
    let a = case(5);
    let b = Case { row: SampleRow { logprobs: 1, top_k: 5000, min_p: 1e-6, ..a.row }, ..case(5) };
    for c in 0..256 {
        assert_eq!(a.cpu(c).token, a.cpu(c).token);
        assert_eq!(a.cpu(c).token, b.cpu(c).token);
    }
    // Different seeds, and different counters, differ: about 1000 (1 - e^-0.256) = 226 distinct
    // tokens in 256 draws of 1000 equally likely ones.
    let distinct = |tokens: Vec<u32>| {
        let mut t = tokens;
        t.sort_unstable();
        t.dedup();
        t.len()
    };
    let by_seed = distinct((0..256).map(|s| case(s).cpu(7).token).collect());
    let by_counter = distinct((0..256).map(|c| a.cpu(c).token).collect());
    assert!(by_seed > 190 && by_counter > 190, "distinct tokens: {by_seed} over seeds, {by_counter} over counters");
    // Both words of the seed and of the counter matter.
    let seq = |seed: u64, c0: u64| (0..16).map(|c| case(seed).cpu(c0 + c).token).collect::<Vec<_>>();
    assert_ne!(seq(5, 0), seq(5 + (1 << 32), 0), "the seed's high word");
    assert_ne!(seq(5, 0), seq(5, 1 << 32), "the counter's high word");
    println!("draws: {by_seed} distinct tokens over 256 seeds, {by_counter} over 256 counters");
}

#[test]
fn check_row_refuses_bad_settings() {
    let t1 = SampleRow { temperature: 1.0, ..GREEDY };
    let ok_row = |row| RowSampling { row, penalties: &[], mask: None };
    let nan = f32::NAN;
    let bad: Vec<(RowSampling, &str)> = vec![
        (ok_row(SampleRow { temperature: nan, ..t1 }), "temperature"),
        (ok_row(SampleRow { temperature: -0.5, ..t1 }), "temperature"),
        (ok_row(SampleRow { temperature: INF, ..t1 }), "temperature"),
        (ok_row(SampleRow { top_p: 0.0, ..t1 }), "top_p"),
        (ok_row(SampleRow { top_p: 1.01, ..t1 }), "top_p"),
        (ok_row(SampleRow { top_p: -0.5, ..t1 }), "top_p"),
        (ok_row(SampleRow { top_p: nan, ..t1 }), "top_p"),
        (ok_row(SampleRow { min_p: -0.01, ..t1 }), "min_p"),
        (ok_row(SampleRow { min_p: 1.01, ..t1 }), "min_p"),
        (ok_row(SampleRow { min_p: nan, ..t1 }), "min_p"),
        (ok_row(SampleRow { repetition: 0.0, ..t1 }), "repetition_penalty"),
        (ok_row(SampleRow { repetition: -1.0, ..t1 }), "repetition_penalty"),
        (ok_row(SampleRow { repetition: nan, ..t1 }), "repetition_penalty"),
        (ok_row(SampleRow { repetition: INF, ..t1 }), "repetition_penalty"),
        (ok_row(SampleRow { presence: nan, ..t1 }), "presence_penalty"),
        (ok_row(SampleRow { presence: NEG_INF, ..t1 }), "presence_penalty"),
        (ok_row(SampleRow { frequency: nan, ..t1 }), "frequency_penalty"),
        (ok_row(SampleRow { frequency: INF, ..t1 }), "frequency_penalty"),
        (RowSampling { row: t1, penalties: &[(100, 1)], mask: None }, "penalties"),
        (RowSampling { row: t1, penalties: &[(3, 0)], mask: None }, "penalties"),
        (RowSampling { row: t1, penalties: &[(3, 1), (5, 1), (3, 2)], mask: None }, "penalties"),
        (RowSampling { row: t1, penalties: &[], mask: Some(&[u32::MAX; 3]) }, "mask"),
        (RowSampling { row: t1, penalties: &[], mask: Some(&[u32::MAX; 5]) }, "mask"),
    ];
    for (r, arg) in &bad {
        let e = check_row(r, 100).expect_err(&format!("{r:?} accepted")).to_string();
        assert!(e.contains(&format!("`{arg}`")), "{r:?}: the error names `{arg}`: {e}");
        println!("refused: {e}");
    }
    let good = [
        ok_row(GREEDY),
        ok_row(SampleRow { temperature: 1e-30, top_p: 1e-6, min_p: 1.0, ..t1 }),
        ok_row(SampleRow {
            top_k: u32::MAX,
            top_p: 1.0,
            min_p: 0.0,
            repetition: 1e-3,
            presence: -5.0,
            frequency: -1.0,
            ..t1
        }),
        RowSampling { row: t1, penalties: &[(0, 1), (99, u32::MAX)], mask: None },
        RowSampling { row: t1, penalties: &[(0, 1)], mask: Some(&[1; 4]) },
    ];
    for r in &good {
        check_row(r, 100).unwrap_or_else(|e| panic!("{r:?} refused: {e}"));
    }
    println!("check_row: {} bad rows refused naming the argument, {} good ones accepted", bad.len(), good.len());
}

// ---------------------------------------------------------------------------------------------
// The GPU kernel.

/// Samples `cases` (one vocabulary) on the GPU, rows `stride` apart with NaN past the
/// vocabulary, once per offset of `launches` (each row at its counter plus the offset, the rows
/// rewritten in place between launches); returns each launch's outputs.
fn gpu_run(gpu: &Gpu, cases: &[Case], stride: usize, launches: &[u64]) -> Vec<Vec<SampleOut>> {
    let vocab = cases[0].logits.len();
    let mut logits = vec![bf16::NAN; cases.len() * stride];
    for (r, c) in cases.iter().enumerate() {
        assert_eq!(c.logits.len(), vocab, "{}: one vocabulary a launch", c.label);
        for (j, &v) in c.logits.iter().enumerate() {
            let b = bf16::from_f32(v);
            assert!(v.is_nan() || b.to_f32().to_bits() == v.to_bits(), "{}: logit {j} ({v}) is no bf16", c.label);
            logits[r * stride + j] = b;
        }
    }
    let logits = gpu.upload(&logits).unwrap();
    let rows_at = |offset: u64| -> Vec<RowSampling> {
        cases
            .iter()
            .map(|c| RowSampling {
                row: c.at(c.row.counter.wrapping_add(offset)),
                penalties: &c.penalties,
                mask: c.mask.as_deref(),
            })
            .collect()
    };
    let capacity = cases.iter().map(|c| c.penalties.len()).sum();
    let mut rows = SampleRows::new(gpu, &rows_at(launches[0]), vocab, capacity).unwrap();
    launches
        .iter()
        .map(|&offset| {
            rows.set(gpu, &rows_at(offset)).unwrap();
            // Poisoned: every field of every row must be written.
            let mut out = gpu.upload(&vec![0xDEAD_BEEFu32; cases.len() * SAMPLE_OUT_WORDS as usize]).unwrap();
            sample(gpu, Rows::strided(&logits, cases.len(), vocab, stride), &rows, &mut out).unwrap();
            read_out(&gpu.download(&out).unwrap())
        })
        .collect()
}

/// Compares the GPU's outputs `got` for `cases` at counter offset `offset` with `sample_row`'s:
/// token, status, kept count and the top tokens' ids exactly, the log-probabilities within
/// 1e-3. Returns the rows compared.
fn compare_with_cpu(cases: &[Case], offset: u64, got: &[SampleOut]) -> usize {
    assert_eq!(got.len(), cases.len());
    let bad: Vec<String> = cases
        .iter()
        .zip(got)
        .filter_map(|(c, g)| {
            let want = c.cpu(c.row.counter.wrapping_add(offset));
            let ids = |o: &SampleOut| o.top().iter().map(|e| e.0).collect::<Vec<_>>();
            let close = |a: f32, b: f32| (a - b).abs() <= 1e-3 || a == b;
            let same = (g.token, g.status, g.kept, ids(g)) == (want.token, want.status, want.kept, ids(&want))
                && close(g.logprob, want.logprob)
                && g.top().iter().zip(want.top()).all(|(a, b)| close(a.1, b.1));
            (!same).then(|| {
                format!("{} (counter {}): GPU {g:?}, CPU {want:?}", c.label, c.row.counter.wrapping_add(offset))
            })
        })
        .collect();
    assert!(bad.is_empty(), "{} of {} rows differ:\n{}", bad.len(), cases.len(), bad.join("\n"));
    cases.len()
}

/// Runs `cases` on the GPU at each of `launches` and compares every row with the CPU; returns
/// the rows compared.
fn gpu_check(gpu: &Gpu, cases: &[Case], stride: usize, launches: &[u64]) -> usize {
    let outs = gpu_run(gpu, cases, stride, launches);
    launches.iter().zip(&outs).map(|(&offset, got)| compare_with_cpu(cases, offset, got)).sum()
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_matches_cpu_at_nano_vocab() {
    let gpu = gpu();
    let mut rng = Rng::new(51);
    let cases = mixed_cases(&mut rng, NANO_VOCAB, 64);
    let launches = [0, 1, 2, 1 << 33];
    let compared = gpu_check(&gpu, &cases, NANO_VOCAB, &launches);
    println!(
        "GPU vs CPU, vocab {NANO_VOCAB}: {compared} rows compared (token, status, kept, top ids; logprobs within 1e-3)"
    );
    assert_eq!(compared, 64 * launches.len());
}

/// Every setting once at a small vocabulary, one launch: the GPU test compute-sanitizer runs
/// (racecheck instruments every shared-memory access; the large suites take minutes there).
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_small_rows_for_the_sanitizers() {
    let gpu = gpu();
    let mut rng = Rng::new(61);
    let cases = mixed_cases(&mut rng, 4099, 25);
    let compared = gpu_check(&gpu, &cases, 4099, &[3]);
    println!("GPU vs CPU, vocab 4099: {compared} rows compared");
    assert_eq!(compared, 25);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_matches_cpu_at_edge_vocabs_and_padded_rows() {
    let gpu = gpu();
    let mut rng = Rng::new(52);
    let (mut compared, mut expected) = (0, 0);
    for vocab in [1, 7, 8, 9, 1000, SAMPLE_MAX_VOCAB as usize] {
        let n = if vocab <= 1000 { 115 } else { 64 };
        let cases = mixed_cases(&mut rng, vocab, n);
        // An odd stride: rows at unaligned offsets, NaN between them.
        for stride in [vocab, vocab + 13] {
            compared += gpu_check(&gpu, &cases, stride, &[0, 77]);
            expected += 2 * n;
        }
    }
    println!("GPU vs CPU, edge vocabularies and strides: {compared} rows compared");
    assert_eq!(compared, expected);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_special_rows_match_cpu() {
    let gpu = gpu();
    let mut by_vocab: BTreeMap<usize, Vec<Case>> = BTreeMap::new();
    let cases = special_cases().into_iter().map(|e| e.0).chain(boundary_cases().into_iter().map(|e| e.0));
    for c in cases {
        by_vocab.entry(c.logits.len()).or_default().push(c);
    }
    let (mut compared, mut expected) = (0, 0);
    for cases in by_vocab.values() {
        let launches: Vec<u64> = (0..8).map(|i| i * 1000 + 3).collect();
        compared += gpu_check(&gpu, cases, cases[0].logits.len() + 3, &launches);
        expected += cases.len() * launches.len();
    }
    println!("GPU vs CPU, special values and boundaries: {compared} rows compared");
    assert_eq!(compared, expected);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_rows_do_not_depend_on_the_batch() {
    let gpu = gpu();
    let mut rng = Rng::new(53);
    let mixed = mixed_cases(&mut rng, NANO_VOCAB, 64);
    // Probes: rows of different settings (penalized ones among them), each alone and at
    // positions 0, 21, 42, 63 of a batch, then the reverse.
    let probes: Vec<Case> =
        ["T 1", "top-p 0.3", "penalties, T 1, top 3 logprobs", "boosting penalties, top-k 20, top-p 0.8"]
            .iter()
            .map(|what| mixed.iter().find(|c| c.label.ends_with(&format!(", {what}"))).unwrap().clone())
            .collect();
    let alone: Vec<SampleOut> =
        probes.iter().map(|p| gpu_run(&gpu, std::slice::from_ref(p), NANO_VOCAB, &[0])[0][0]).collect();
    let mut compared = 0;
    for positions in [[0, 21, 42, 63], [63, 42, 21, 0]] {
        let mut batch = mixed.clone();
        for (p, &at) in probes.iter().zip(&positions) {
            batch[at] = p.clone();
        }
        let got = &gpu_run(&gpu, &batch, NANO_VOCAB, &[0])[0];
        compare_with_cpu(&batch, 0, got);
        for ((p, &at), want) in probes.iter().zip(&positions).zip(&alone) {
            assert_eq!(got[at], *want, "{} at row {at} of 64 vs alone", p.label);
            compared += 1;
        }
    }
    println!("batch independence: {compared} probe rows identical alone and in a batch of 64");
    assert_eq!(compared, 2 * probes.len());
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_chi_square_smoke() {
    let gpu = gpu();
    let x = chi_logits();
    let n = 4096;
    let rows = |label: &str, row: SampleRow| -> Vec<Case> {
        (0..n).map(|c| Case::new(label, &x, SampleRow { counter: c, ..row })).collect()
    };
    let (t, k) = (0.7, 5);
    let mut cases = rows("T 1", SampleRow { temperature: 1.0, seed: 61, ..GREEDY });
    cases.extend(rows("T 0.7, top-k 5", SampleRow { temperature: t, top_k: k as u32, seed: 62, ..GREEDY }));
    let got = &gpu_run(&gpu, &cases, x.len(), &[0])[0];
    let compared = compare_with_cpu(&cases, 0, got);
    let all = vec![true; x.len()];
    assert_fits("GPU, T 1", &tally(got[..n as usize].iter().copied(), x.len()), &softmax(&x, 1.0, &all), &[]);
    let want = softmax(&x, f64::from(t), &top_k_mask(&x, k));
    assert_fits("GPU, T 0.7, top-k 5", &tally(got[n as usize..].iter().copied(), x.len()), &want, &[]);
    println!("GPU chi-square smoke: {compared} rows, identical to the CPU");
    assert_eq!(compared, 2 * n as usize);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_launcher_refuses_bad_arguments() {
    let gpu = gpu();
    let names = |r: Result<(), host::Error>, arg: &str| {
        let e = r.expect_err(&format!("{arg}: accepted")).to_string();
        assert!(e.contains(arg), "the error names {arg}: {e}");
        println!("refused: {e}");
    };
    let t1 = SampleRow { temperature: 1.0, seed: 71, ..GREEDY };
    let two = [
        RowSampling { row: t1, penalties: &[(1, 1)], mask: None },
        RowSampling { row: t1, penalties: &[(2, 1)], mask: None },
    ];
    let max = SAMPLE_MAX_VOCAB as usize;
    names(SampleRows::new(&gpu, &two, 0, 2).map(drop), "`vocab`");
    names(SampleRows::new(&gpu, &two, max + 1, 2).map(drop), "`vocab`");
    names(SampleRows::new(&gpu, &[], 8, 2).map(drop), "`rows`");
    names(
        SampleRows::new(&gpu, &[RowSampling { row: SampleRow { top_p: 0.0, ..t1 }, penalties: &[], mask: None }], 8, 0)
            .map(drop),
        "`top_p`",
    );
    names(SampleRows::new(&gpu, &two, 8, 1).map(drop), "`penalties`");
    SampleRows::new(&gpu, &two, max, 2).expect("the largest vocabulary");

    let vocab = 8;
    let mut rows = SampleRows::new(&gpu, &two, vocab, 2).unwrap();
    let logits = gpu.upload(&vec![bf16::from_f32(0.5); 2 * vocab]).unwrap();
    let mut out = sample_out(&gpu, 2).unwrap();
    let two_rows = Rows::new(&logits, 2, vocab);
    sample(&gpu, two_rows, &rows, &mut out).unwrap();
    let before = read_out(&gpu.download(&out).unwrap());
    // Refused rewrites leave the rows as they were.
    names(rows.set(&gpu, &two[..1]), "1 sampling rows given for 2");
    let three = [RowSampling { row: t1, penalties: &[(1, 1), (3, 2)], mask: None }, two[1]];
    names(rows.set(&gpu, &three), "`penalties`");
    names(
        rows.set(&gpu, &[two[0], RowSampling { row: t1, penalties: &[(vocab as u32, 1)], mask: None }]),
        "`penalties`",
    );
    names(
        rows.set(&gpu, &[two[0], RowSampling { row: SampleRow { min_p: 2.0, ..t1 }, penalties: &[], mask: None }]),
        "`min_p`",
    );
    sample(&gpu, two_rows, &rows, &mut out).unwrap();
    assert_eq!(read_out(&gpu.download(&out).unwrap()), before, "the rows after refused rewrites");
    // The launch itself.
    names(sample(&gpu, Rows { stride: vocab - 1, ..two_rows }, &rows, &mut out), "`logits`: expected a row stride");
    names(sample(&gpu, Rows { stride: vocab + 1, ..two_rows }, &rows, &mut out), "`logits`");
    names(sample(&gpu, Rows { rows: 1, ..two_rows }, &rows, &mut out), "`logits`: expected 2 rows");
    let mut short = sample_out(&gpu, 1).unwrap();
    names(sample(&gpu, two_rows, &rows, &mut short), "`out`");
    println!("launcher: refusals name their argument; the rows survive refused rewrites");
}
