//! Token sampling: greedy, reproducibility, and the distributions temperature, top-k and top-p
//! must produce (frequencies over many draws against the exact probabilities).

use model::sampling::{Sampler, SamplingParams};

fn params(temperature: f32, top_k: Option<usize>, top_p: Option<f32>, seed: u64) -> SamplingParams {
    SamplingParams { temperature, top_k, top_p, seed }
}

/// Frequencies of each id over `n` draws.
fn frequencies(p: SamplingParams, logits: &[f32], n: usize) -> Vec<f64> {
    let mut s = Sampler::new(p).unwrap();
    let mut counts = vec![0usize; logits.len()];
    for _ in 0..n {
        counts[s.sample(logits).unwrap() as usize] += 1;
    }
    counts.iter().map(|&c| c as f64 / n as f64).collect()
}

fn assert_freq(got: &[f64], want: &[f64]) {
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!((g - w).abs() < 0.01, "id {i}: frequency {g:.4}, probability {w:.4} (all: {got:?})");
    }
}

/// Probabilities 1/6, 2/6, 3/6 at temperature 1 (and a fourth token of probability ~0).
fn logits() -> Vec<f32> {
    vec![1f32.ln(), 2f32.ln(), 3f32.ln(), -50.0]
}

#[test]
fn greedy_takes_the_highest_lowest_id_on_ties() {
    let mut s = Sampler::new(SamplingParams::greedy()).unwrap();
    assert_eq!(s.sample(&logits()).unwrap(), 2);
    assert_eq!(s.sample(&[1.0, 5.0, 5.0, 0.0]).unwrap(), 1);
    assert_eq!(Sampler::new(params(1.0, Some(1), None, 3)).unwrap().sample(&logits()).unwrap(), 2, "top-1 is greedy");
}

#[test]
fn distributions() {
    let n = 60_000;
    assert_freq(&frequencies(params(1.0, None, None, 1), &logits(), n), &[1.0 / 6.0, 2.0 / 6.0, 0.5, 0.0]);
    // Temperature 2 flattens: probabilities proportional to sqrt(1), sqrt(2), sqrt(3).
    let r = [1f64, 2f64.sqrt(), 3f64.sqrt()];
    let t: f64 = r.iter().sum();
    assert_freq(&frequencies(params(2.0, None, None, 2), &logits(), n), &[r[0] / t, r[1] / t, r[2] / t, 0.0]);
    assert_freq(&frequencies(params(1.0, Some(2), None, 3), &logits(), n), &[0.0, 0.4, 0.6, 0.0]);
    // top_p 0.5: token 2 alone reaches it; 0.6: tokens 2 and 1, renormalized.
    assert_freq(&frequencies(params(1.0, None, Some(0.5), 4), &logits(), n), &[0.0, 0.0, 1.0, 0.0]);
    assert_freq(&frequencies(params(1.0, None, Some(0.6), 5), &logits(), n), &[0.0, 0.4, 0.6, 0.0]);
}

#[test]
fn the_seed_makes_it_reproducible() {
    let draw = |seed| {
        let mut s = Sampler::new(params(1.0, None, None, seed)).unwrap();
        (0..50).map(|_| s.sample(&logits()).unwrap()).collect::<Vec<_>>()
    };
    assert_eq!(draw(7), draw(7));
    assert_ne!(draw(7), draw(8));
}

#[test]
fn bad_parameters_and_logits_are_errors() {
    for p in [
        params(-1.0, None, None, 0),
        params(f32::NAN, None, None, 0),
        params(1.0, Some(0), None, 0),
        params(1.0, None, Some(0.0), 0),
        params(1.0, None, Some(1.5), 0),
    ] {
        assert!(Sampler::new(p).is_err(), "{p:?}");
    }
    let mut s = Sampler::new(SamplingParams::greedy()).unwrap();
    assert!(s.sample(&[]).is_err());
    assert!(s.sample(&[0.0, f32::NAN]).is_err());
}
