//! Token sampling on the CPU (model::sampling): greedy, the distributions temperature, top-k,
//! top-p and min-p must produce (frequencies over many draws against the exact
//! probabilities), the penalties over a request's generated tokens, log-probabilities, the
//! seed (a counter-based generator: the k-th token depends only on the seed, k and the
//! logits, not on other samplers), infinite and NaN logits, and the parameters refused.

use model::sampling::{SampleError, Sampled, Sampler, SamplingParams};

fn params(temperature: f32, top_k: Option<usize>, top_p: Option<f32>, seed: u64) -> SamplingParams {
    SamplingParams { temperature, top_k, top_p, seed, ..SamplingParams::greedy() }
}

fn sampler(p: SamplingParams) -> Sampler {
    Sampler::new(p).unwrap()
}

/// The next token, which must exist.
fn token(s: &mut Sampler, logits: &[f32]) -> u32 {
    s.sample(logits).unwrap().token
}

/// `n` tokens drawn from the same logits.
fn draws(p: SamplingParams, logits: &[f32], n: usize) -> Vec<u32> {
    let mut s = sampler(p);
    (0..n).map(|_| token(&mut s, logits)).collect()
}

/// Frequencies of each id over `n` draws.
fn frequencies(p: SamplingParams, logits: &[f32], n: usize) -> Vec<f64> {
    let mut counts = vec![0usize; logits.len()];
    for t in draws(p, logits, n) {
        counts[t as usize] += 1;
    }
    counts.iter().map(|&c| c as f64 / n as f64).collect()
}

/// Frequencies within 0.01 of the probabilities (5 standard deviations at 60 000 draws); an
/// id of probability 0 never drawn.
fn assert_freq(got: &[f64], want: &[f64]) {
    assert_eq!(got.len(), want.len());
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let ok = if *w == 0.0 { *g == 0.0 } else { (g - w).abs() < 0.01 };
        assert!(ok, "id {i}: frequency {g:.4}, probability {w:.4} (all: {got:?})");
    }
}

/// Probabilities proportional to `w`.
fn normalized(w: &[f64]) -> Vec<f64> {
    let t: f64 = w.iter().sum();
    w.iter().map(|x| x / t).collect()
}

/// Probabilities 1/6, 2/6, 3/6 at temperature 1 (and a fourth token of probability ~0).
fn logits() -> Vec<f32> {
    vec![1f32.ln(), 2f32.ln(), 3f32.ln(), -50.0]
}

const N: usize = 60_000;

#[test]
fn greedy_takes_the_highest_lowest_id_on_ties() {
    let mut s = sampler(SamplingParams::greedy());
    assert_eq!(s.sample(&logits()).unwrap(), Sampled { token: 2, logprob: None, top_logprobs: vec![] });
    assert_eq!(token(&mut s, &[1.0, 5.0, 5.0, 0.0]), 1);
    assert_eq!(token(&mut s, &[-3.0, -1.0, -2.0]), 1, "negative logits");
    assert_eq!(token(&mut s, &[7.0; 5]), 0, "all equal");
    assert_eq!(token(&mut s, &[f32::NEG_INFINITY, -1e30, f32::NEG_INFINITY]), 1);
    assert_eq!(token(&mut s, &[-0.0, 0.0]), 0, "-0 and +0 are equal logits");
    assert_eq!(draws(SamplingParams::greedy(), &logits(), 20), vec![2; 20], "greedy does not drift");
    assert_eq!(draws(params(1.0, Some(1), None, 3), &logits(), 50), vec![2; 50], "top-1 is greedy");
    assert_eq!(draws(params(1.0, None, None, 3), &[0.0, 100.0, 0.0], 50), vec![1; 50], "a far higher logit");
    assert_eq!(SamplingParams::default(), SamplingParams::greedy());
}

#[test]
fn distributions_match_the_probabilities() {
    assert_freq(&frequencies(params(1.0, None, None, 1), &logits(), N), &[1.0 / 6.0, 2.0 / 6.0, 0.5, 0.0]);
    // Temperature 2 flattens: probabilities proportional to sqrt(1), sqrt(2), sqrt(3).
    let flat = normalized(&[1.0, 2f64.sqrt(), 3f64.sqrt()]);
    assert_freq(&frequencies(params(2.0, None, None, 2), &logits(), N), &[flat[0], flat[1], flat[2], 0.0]);
    // Temperature 0.5 sharpens: proportional to 1, 4, 9.
    let sharp = normalized(&[1.0, 4.0, 9.0]);
    assert_freq(&frequencies(params(0.5, None, None, 9), &logits(), N), &[sharp[0], sharp[1], sharp[2], 0.0]);
    // Top-k keeps the k most likely, renormalized; k past the vocabulary keeps all.
    assert_freq(&frequencies(params(1.0, Some(2), None, 3), &logits(), N), &[0.0, 0.4, 0.6, 0.0]);
    assert_freq(&frequencies(params(1.0, Some(99), None, 1), &logits(), N), &[1.0 / 6.0, 2.0 / 6.0, 0.5, 0.0]);
    // top_p 0.5: token 2 alone reaches it; 0.6: tokens 2 and 1 (1 crosses it), renormalized.
    assert_freq(&frequencies(params(1.0, None, Some(0.5), 4), &logits(), N), &[0.0, 0.0, 1.0, 0.0]);
    assert_freq(&frequencies(params(1.0, None, Some(0.6), 5), &logits(), N), &[0.0, 0.4, 0.6, 0.0]);
    assert_freq(&frequencies(params(1.0, None, Some(1.0), 6), &logits(), N), &[1.0 / 6.0, 2.0 / 6.0, 0.5, 0.0]);
    // Top-p over what top-k kept: 0.7 of tokens 1 and 2 (masses 0.4, 0.6) keeps both.
    assert_freq(&frequencies(params(1.0, Some(2), Some(0.7), 7), &logits(), N), &[0.0, 0.4, 0.6, 0.0]);
    // Top-p at temperature 2: token 2 has mass 0.42 there, so 0.45 also keeps token 1.
    assert_freq(
        &frequencies(params(2.0, None, Some(0.45), 8), &logits(), N),
        &[0.0, flat[1] / (flat[1] + flat[2]), flat[2] / (flat[1] + flat[2]), 0.0],
    );
}

#[test]
fn truncations_never_split_equal_logits() {
    let tied = [5.0, 1.0, 5.0, 5.0, 0.0];
    assert_freq(&frequencies(params(1.0, Some(1), None, 1), &tied, N), &[1.0 / 3.0, 0.0, 1.0 / 3.0, 1.0 / 3.0, 0.0]);
    assert_freq(&frequencies(params(1.0, None, Some(0.1), 2), &tied, N), &[1.0 / 3.0, 0.0, 1.0 / 3.0, 1.0 / 3.0, 0.0]);
    let min_p = SamplingParams { min_p: Some(1.0), ..params(1.0, None, None, 3) };
    assert_freq(&frequencies(min_p, &tied, N), &[1.0 / 3.0, 0.0, 1.0 / 3.0, 1.0 / 3.0, 0.0]);
}

#[test]
fn min_p_keeps_tokens_near_the_most_likely() {
    let with = |min_p, t, seed| SamplingParams { min_p: Some(min_p), ..params(t, None, None, seed) };
    // At temperature 1 tokens weigh 1/3, 2/3 and 1 of the most likely: 0.5 drops token 0.
    assert_freq(&frequencies(with(0.5, 1.0, 1), &logits(), N), &[0.0, 0.4, 0.6, 0.0]);
    assert_freq(&frequencies(with(0.3, 1.0, 2), &logits(), N), &[1.0 / 6.0, 2.0 / 6.0, 0.5, 0.0]);
    assert_freq(&frequencies(with(0.0, 1.0, 3), &logits(), N), &[1.0 / 6.0, 2.0 / 6.0, 0.5, 0.0]);
    assert_eq!(draws(with(1.0, 1.0, 4), &logits(), 100), vec![2; 100], "min_p 1 keeps only the most likely");
    // It applies to the tempered probabilities: at temperature 2 they weigh 0.58, 0.82, 1.
    let flat = [2f64.sqrt(), 3f64.sqrt()];
    let kept = normalized(&flat);
    assert_freq(&frequencies(with(0.7, 2.0, 5), &logits(), N), &[0.0, kept[0], kept[1], 0.0]);
    assert_freq(&frequencies(with(0.5, 2.0, 6), &logits(), N), &normalized(&[1.0, flat[0], flat[1], 0.0]));
    // With top-k: both truncations hold.
    let both = SamplingParams { min_p: Some(0.5), ..params(1.0, Some(1), None, 7) };
    assert_eq!(draws(both, &logits(), 100), vec![2; 100]);
}

#[test]
fn a_huge_presence_penalty_never_repeats_a_token() {
    let logits: Vec<f32> = (0..8).map(|i| 8.0 - i as f32).collect();
    let p = SamplingParams { presence_penalty: 1000.0, ..SamplingParams::greedy() };
    // Each token once, the most likely first; then all are penalized alike, so token 0 again.
    assert_eq!(draws(p, &logits, 9), vec![0, 1, 2, 3, 4, 5, 6, 7, 0]);
    // Sampled: 8 draws over 8 tokens are a permutation, whatever the seed.
    for seed in 0..20 {
        let p = SamplingParams { presence_penalty: 1000.0, ..params(1.0, None, None, seed) };
        let mut d = draws(p, &logits, 8);
        d.sort();
        assert_eq!(d, (0..8).collect::<Vec<u32>>(), "seed {seed}");
    }
    // A negative presence penalty favours what was generated.
    let p = SamplingParams { presence_penalty: -1000.0, ..params(1.0, None, None, 1) };
    let d = draws(p, &[0.0; 8], 50);
    assert!(d.iter().all(|&t| t == d[0]), "{d:?}");
}

#[test]
fn the_frequency_penalty_grows_with_the_count() {
    // Token 0 scores 2.5 - (times generated), token 1 0 - (times generated).
    let p = SamplingParams { frequency_penalty: 1.0, ..SamplingParams::greedy() };
    assert_eq!(draws(p, &[2.5, 0.0], 7), vec![0, 0, 0, 1, 0, 1, 0]);
    // The presence penalty does not grow: 1.5 stays above 0.
    let p = SamplingParams { presence_penalty: 1.0, ..SamplingParams::greedy() };
    assert_eq!(draws(p, &[2.5, 0.0], 7), vec![0; 7]);
    // Both: 2.5 - 1 - 1 * count.
    let p = SamplingParams { presence_penalty: 1.0, frequency_penalty: 1.0, ..SamplingParams::greedy() };
    assert_eq!(draws(p, &[2.5, 0.0], 4), vec![0, 0, 1, 0]);
}

#[test]
fn the_repetition_penalty_divides_positive_logits_and_multiplies_negative_ones() {
    let p = SamplingParams { repetition_penalty: 2.0, ..SamplingParams::greedy() };
    // 2.0 -> 1.0 < 1.5: token 1; then 1.0 > 0.75: token 0 from then on (it does not compound).
    assert_eq!(draws(p, &[2.0, 1.5], 6), vec![0, 1, 0, 0, 0, 0]);
    // -1.0 -> -2.0 < -1.5: token 1; then -2.0 > -3.0: token 0 from then on.
    assert_eq!(draws(p, &[-1.0, -1.5], 6), vec![0, 1, 0, 0, 0, 0]);
    // Below 1 it favours repeats: a generated token's logit 1 becomes 10.
    let p = SamplingParams { repetition_penalty: 0.1, ..params(1.0, None, None, 1) };
    let d = draws(p, &[1.0, 1.0, 1.0, 1.0], 30);
    assert!(d.iter().filter(|&&t| t == d[0]).count() > 20, "{d:?}");
    // Off at 1.
    let p = SamplingParams { repetition_penalty: 1.0, ..SamplingParams::greedy() };
    assert_eq!(draws(p, &[2.0, 1.5], 4), vec![0; 4]);
}

#[test]
fn sampled_penalties_shift_the_probabilities() {
    // Logits [0, 0] with presence ln 2: the second token repeats the first with probability
    // 1/3, over many requests (seeds).
    let n = 30_000;
    let repeats = (0..n)
        .filter(|&seed| {
            let p = SamplingParams { presence_penalty: 2f32.ln(), ..params(1.0, None, None, seed) };
            let d = draws(p, &[0.0, 0.0], 2);
            d[0] == d[1]
        })
        .count();
    let f = repeats as f64 / n as f64;
    assert!((f - 1.0 / 3.0).abs() < 0.015, "repeat frequency {f}");
}

#[test]
fn logprobs_are_under_the_penalized_logits_at_temperature_1() {
    let close = |got: Option<f32>, want: f64| {
        let got = got.expect("a logprob was asked");
        assert!((f64::from(got) - want).abs() < 1e-5, "logprob {got}, want {want}");
    };
    let p = SamplingParams { logprobs: true, ..SamplingParams::greedy() };
    close(sampler(p).sample(&logits()).unwrap().logprob, 0.5f64.ln());
    // At any temperature, the probability at temperature 1.
    let mut s = sampler(SamplingParams { logprobs: true, ..params(2.0, None, Some(0.9), 1) });
    let mut seen = [false; 3];
    for _ in 0..200 {
        let Sampled { token, logprob, .. } = s.sample(&logits()).unwrap();
        close(logprob, (f64::from(token + 1) / 6.0).ln());
        seen[token as usize] = true;
    }
    assert_eq!(seen, [true; 3]);
    // Four equal logits, presence ln 3: 1/4, then the penalized token weighs 1/3 of each other.
    let mut s = sampler(SamplingParams { logprobs: true, presence_penalty: 3f32.ln(), ..SamplingParams::greedy() });
    let first = s.sample(&[0.0; 4]).unwrap();
    assert_eq!(first.token, 0);
    close(first.logprob, 0.25f64.ln());
    let second = s.sample(&[0.0; 4]).unwrap();
    assert_eq!(second.token, 1);
    close(second.logprob, -(10.0f64 / 3.0).ln());
    // The most likely tokens: ties by id, the penalized ones last; top_logprobs alone implies
    // logprobs.
    let mut s = sampler(SamplingParams { top_logprobs: 3, ..params(1.0, None, None, 9) });
    let got = s.sample(&[1.0, 3.0, 2.0, 3.0, 0.0]).unwrap();
    assert!(got.logprob.is_some());
    let ids: Vec<u32> = got.top_logprobs.iter().map(|e| e.0).collect();
    assert_eq!(ids, vec![1, 3, 2]);
    let total: f64 = [1.0f64, 3.0, 2.0, 3.0, 0.0].iter().map(|v| (v - 3.0).exp()).sum();
    for (&(t, lp), v) in got.top_logprobs.iter().zip([3.0, 3.0, 2.0]) {
        assert!((f64::from(lp) - (v - 3.0 - total.ln())).abs() < 1e-5, "token {t}: {lp}");
    }
    let many = sampler(SamplingParams { top_logprobs: 20, ..SamplingParams::greedy() }).sample(&[0.5; 4]).unwrap();
    assert_eq!(many.top_logprobs.len(), 4, "no more than the vocabulary");
    assert!(Sampler::new(SamplingParams { top_logprobs: 21, ..SamplingParams::greedy() }).is_err());
    // Not asked: none.
    assert_eq!(sampler(params(1.0, None, None, 1)).sample(&logits()).unwrap().logprob, None);
}

#[test]
fn the_seed_makes_it_reproducible() {
    let draw = |seed| draws(params(1.0, None, None, seed), &logits(), 50);
    assert_eq!(draw(7), draw(7));
    assert_ne!(draw(7), draw(8));
    assert_ne!(draw(0), draw(1 << 32), "the seed's high bits count");
    let seqs: std::collections::HashSet<Vec<u32>> = (0..20).map(draw).collect();
    assert_eq!(seqs.len(), 20, "20 seeds, 20 different sequences");
    // A clone goes on as the original would.
    let mut a = sampler(params(1.0, None, None, 5));
    for _ in 0..10 {
        token(&mut a, &logits());
    }
    let mut b = a.clone();
    let (ta, tb): (Vec<u32>, Vec<u32>) = (0..30).map(|_| (token(&mut a, &logits()), token(&mut b, &logits()))).unzip();
    assert_eq!(ta, tb);
}

#[test]
fn the_kth_token_depends_only_on_the_seed_k_and_its_logits() {
    let want = draws(params(1.0, None, None, 11), &logits(), 40);
    // Other logits for the first tokens (no penalties): the later tokens are the same.
    let mut s = sampler(params(1.0, None, None, 11));
    for i in 0..20 {
        token(&mut s, &[0.0, 0.0, 0.0, (i % 4) as f32]);
    }
    let rest: Vec<u32> = (0..20).map(|_| token(&mut s, &logits())).collect();
    assert_eq!(rest, want[20..]);
}

#[test]
fn samplers_do_not_disturb_each_other() {
    let alone = |seed| draws(params(1.0, None, Some(0.9), seed), &logits(), 60);
    let (mut a, mut b) = (sampler(params(1.0, None, Some(0.9), 1)), sampler(params(1.0, None, Some(0.9), 2)));
    let (mut ta, mut tb) = (Vec::new(), Vec::new());
    for i in 0..60 {
        // Unevenly interleaved, b also drawing from other logits in between.
        ta.push(token(&mut a, &logits()));
        if i % 3 == 0 {
            let mut c = sampler(params(1.0, None, None, 2));
            token(&mut c, &[1.0, 2.0, 3.0, 4.0]);
        }
        tb.push(token(&mut b, &logits()));
    }
    assert_eq!(ta, alone(1));
    assert_eq!(tb, alone(2));
    // Two requests with the same seed draw the same tokens.
    assert_eq!(alone(3), alone(3));
}

#[test]
fn nan_logits_give_no_token_and_do_not_advance_the_request() {
    for p in [SamplingParams::greedy(), params(1.0, None, None, 4), params(1.0, Some(2), Some(0.9), 4)] {
        let mut s = sampler(p);
        assert_eq!(s.sample(&[0.0, f32::NAN]), Err(SampleError::NanLogits), "{p:?}");
        assert_eq!(s.sample(&[f32::NAN; 3]), Err(SampleError::NanLogits));
        assert_eq!(s.sample(&[f32::INFINITY, f32::NAN]), Err(SampleError::NanLogits), "a NaN beside +inf");
        // The failures neither advanced the generator nor counted a token.
        assert_eq!(draws(p, &logits(), 30), (0..30).map(|_| token(&mut s, &logits())).collect::<Vec<_>>());
    }
    // Nor counted a token for the penalties (as the_frequency_penalty_grows_with_the_count,
    // a failure between each two tokens).
    let mut s = sampler(SamplingParams { frequency_penalty: 1.0, ..SamplingParams::greedy() });
    let d: Vec<u32> = (0..4)
        .map(|_| {
            assert!(s.sample(&[f32::NAN, 0.0]).is_err());
            token(&mut s, &[2.5, 0.0])
        })
        .collect();
    assert_eq!(d, [0, 0, 0, 1]);
    assert_eq!(SampleError::NanLogits.to_string(), "its logits contain NaN");
}

#[test]
fn all_neg_inf_logits_give_no_token() {
    for p in [SamplingParams::greedy(), params(1.0, None, None, 1), params(0.7, Some(3), Some(0.5), 1)] {
        let mut s = sampler(p);
        assert_eq!(s.sample(&[f32::NEG_INFINITY; 4]), Err(SampleError::AllNegInf), "{p:?}");
        assert_eq!(s.sample(&[f32::NEG_INFINITY]), Err(SampleError::AllNegInf));
        assert!(s.sample(&[]).is_err(), "no logits");
        assert_eq!(draws(p, &logits(), 10), (0..10).map(|_| token(&mut s, &logits())).collect::<Vec<_>>());
    }
    assert_eq!(SampleError::AllNegInf.to_string(), "every logit is -inf");
    // A -inf logit beside finite ones is never drawn.
    let f = frequencies(params(1.0, None, None, 2), &[f32::NEG_INFINITY, 0.0, 0.0], N);
    assert_freq(&f, &[0.0, 0.5, 0.5]);
}

#[test]
fn pos_inf_logits_take_all_the_probability() {
    let inf = f32::INFINITY;
    assert_eq!(token(&mut sampler(SamplingParams::greedy()), &[0.0, inf, 1e30, inf]), 1);
    assert_eq!(draws(params(1.0, None, None, 1), &[1e30, 0.0, inf, -5.0], 200), vec![2; 200]);
    assert_eq!(draws(params(100.0, None, Some(0.1), 2), &[1e30, inf, 3.0], 200), vec![1; 200]);
    // Shared by the +inf ones.
    assert_freq(&frequencies(params(1.0, None, None, 3), &[0.0, inf, 5.0, inf], N), &[0.0, 0.5, 0.0, 0.5]);
    let mut s = sampler(SamplingParams { logprobs: true, ..params(1.0, None, None, 4) });
    let lp = s.sample(&[0.0, inf, 5.0, inf]).unwrap().logprob.unwrap();
    assert!((lp - -(2f32.ln())).abs() < 1e-6, "{lp}");
    let mut s = sampler(SamplingParams { logprobs: true, ..SamplingParams::greedy() });
    assert_eq!(s.sample(&[0.0, inf, 5.0]).unwrap(), Sampled { token: 1, logprob: Some(0.0), top_logprobs: vec![] });
    // Penalties keep it infinite.
    let p = SamplingParams { presence_penalty: 1e6, repetition_penalty: 3.0, ..SamplingParams::greedy() };
    assert_eq!(draws(p, &[0.0, inf, 5.0], 5), vec![1; 5]);
}

#[test]
fn bad_parameters_are_refused_naming_them() {
    let g = SamplingParams::greedy;
    let cases = [
        ("temperature", SamplingParams { temperature: f32::NAN, ..g() }),
        ("temperature", SamplingParams { temperature: -1.0, ..g() }),
        ("temperature", SamplingParams { temperature: f32::INFINITY, ..g() }),
        ("top_k", SamplingParams { top_k: Some(0), ..g() }),
        ("top_p", SamplingParams { top_p: Some(0.0), ..g() }),
        ("top_p", SamplingParams { top_p: Some(1.5), ..g() }),
        ("top_p", SamplingParams { top_p: Some(-0.5), ..g() }),
        ("top_p", SamplingParams { top_p: Some(f32::NAN), ..g() }),
        ("min_p", SamplingParams { min_p: Some(-0.1), ..g() }),
        ("min_p", SamplingParams { min_p: Some(1.5), ..g() }),
        ("min_p", SamplingParams { min_p: Some(f32::NAN), ..g() }),
        ("repetition_penalty", SamplingParams { repetition_penalty: 0.0, ..g() }),
        ("repetition_penalty", SamplingParams { repetition_penalty: -1.0, ..g() }),
        ("repetition_penalty", SamplingParams { repetition_penalty: f32::NAN, ..g() }),
        ("repetition_penalty", SamplingParams { repetition_penalty: f32::INFINITY, ..g() }),
        ("presence_penalty", SamplingParams { presence_penalty: f32::NAN, ..g() }),
        ("presence_penalty", SamplingParams { presence_penalty: f32::INFINITY, ..g() }),
        ("presence_penalty", SamplingParams { presence_penalty: f32::NEG_INFINITY, ..g() }),
        ("frequency_penalty", SamplingParams { frequency_penalty: f32::NAN, ..g() }),
        ("frequency_penalty", SamplingParams { frequency_penalty: f32::INFINITY, ..g() }),
    ];
    for (name, p) in cases {
        let e = Sampler::new(p).map(|_| ()).expect_err(&format!("{p:?} accepted"));
        let msg = e.to_string();
        assert!(msg.contains(name), "{p:?}: `{msg}` does not name {name}");
        assert!(msg.starts_with("invalid: "), "an out-of-range value is invalid, not unsupported: {msg}");
        assert_eq!(p.check().map_err(|e| e.to_string()), Err(msg), "check and Sampler::new agree");
    }
}

#[test]
fn edge_parameters_are_accepted() {
    let g = SamplingParams::greedy;
    for p in [
        g(),
        SamplingParams::nucleus(0.7, 0.9, 1),
        SamplingParams { temperature: 1e-3, ..g() },
        SamplingParams { temperature: 1e6, ..g() },
        SamplingParams { top_k: Some(1), ..g() },
        SamplingParams { top_k: Some(usize::MAX), ..g() },
        SamplingParams { top_p: Some(1.0), ..g() },
        SamplingParams { top_p: Some(1e-6), ..g() },
        SamplingParams { min_p: Some(0.0), ..g() },
        SamplingParams { min_p: Some(1.0), ..g() },
        SamplingParams { repetition_penalty: 0.5, ..g() },
        SamplingParams { repetition_penalty: 1e-3, ..g() },
        SamplingParams { presence_penalty: -2.0, frequency_penalty: -2.0, ..g() },
        SamplingParams { seed: u64::MAX, logprobs: true, ..g() },
    ] {
        assert!(p.check().is_ok(), "{p:?}");
        let mut s = sampler(p);
        assert_eq!(s.params(), &p);
        assert!(s.sample(&logits()).is_ok(), "{p:?}");
    }
    let n = SamplingParams::nucleus(0.7, 0.9, 5);
    assert_eq!((n.temperature, n.top_p, n.seed), (0.7, Some(0.9), 5));
    assert_eq!(SamplingParams { temperature: 0.0, top_p: None, seed: 0, ..n }, SamplingParams::greedy());
}
