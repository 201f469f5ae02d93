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
//! - on the GPU: tests/sample_gpu.rs. The shared cases and references: tests/common/sampling.rs.

mod common;

use common::sampling::*;
use host::sample::{RowSampling, check_row};
use kernels_gpu::sample::{
    Q_ONE, SAMPLE_ALL_NEG_INF, SAMPLE_OK, SAMPLE_OUT_WORDS, SampleOut, SampleRow, key, penalize, philox4x32, random,
    target, weight,
};
use nemotron_rs::Rng;

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
