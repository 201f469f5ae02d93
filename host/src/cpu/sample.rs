//! Token sampling on the CPU: the math of kernels-gpu/src/sample.rs's module doc, with the
//! same shared steps (penalties, weights, keys, Philox, the draw), so it picks the same token
//! as the GPU from the same logits. No full sort: an argmax, a selection for top-k, and a sort
//! of the weighted candidates only for top-p.

use kernels_gpu::sample::{
    SAMPLE_ALL_NEG_INF, SAMPLE_MAX_TOP, SAMPLE_NAN, SAMPLE_OK, SampleOut, SampleRow, keeps_min_p, keeps_top_p, key,
    log2e_over, penalize, random, rank, scaled, target, unrank, weight,
};

/// The token `row` picks from `logits` (f32 values of the bf16 logits), its penalized tokens
/// `penalties` (pairs (token, count), checked as `sample::check_row` does).
pub fn sample_row(logits: &[f32], row: &SampleRow, penalties: &[(u32, u32)]) -> SampleOut {
    let mut x = logits.to_vec();
    for &(t, n) in penalties {
        x[t as usize] = penalize(x[t as usize], n, row);
    }
    if x.iter().any(|v| v.is_nan()) {
        return SampleOut::failed(SAMPLE_NAN);
    }
    // The maximum at its lowest id.
    let (arg, m) =
        x.iter().enumerate().fold((0, f32::NEG_INFINITY), |(a, m), (i, &v)| if v > m { (i, v) } else { (a, m) });
    if m == f32::NEG_INFINITY {
        return SampleOut::failed(SAMPLE_ALL_NEG_INF);
    }
    let rel = |v: f32| if v == m { 0.0 } else { f64::from(v) - f64::from(m) };
    let lse = if row.logprobs == 0 { 0.0 } else { x.iter().map(|&v| rel(v).exp()).sum::<f64>().ln() };
    let logprob = |v: f32| if row.logprobs == 0 { 0.0 } else { (rel(v) - lse) as f32 };
    // The most likely tokens, by rank.
    let n_top = (row.logprobs.saturating_sub(1).min(SAMPLE_MAX_TOP) as usize).min(x.len());
    let mut top = [(0, 0.0); SAMPLE_MAX_TOP as usize];
    if n_top > 0 {
        let mut ranks: Vec<u64> = x.iter().enumerate().map(|(i, &v)| rank(v, i as u32)).collect();
        ranks.select_nth_unstable_by(n_top - 1, |a, b| b.cmp(a));
        ranks[..n_top].sort_unstable_by(|a, b| b.cmp(a));
        for (t, &r) in top.iter_mut().zip(&ranks[..n_top]) {
            let (id, v) = unrank(r);
            *t = (id, logprob(v));
        }
    }
    let pick = |token: usize, kept| SampleOut {
        token: token as u32,
        status: SAMPLE_OK,
        logprob: logprob(x[token]),
        kept,
        top_len: n_top as u32,
        top,
    };
    if row.temperature == 0.0 {
        return pick(arg, 1);
    }
    let c = log2e_over(row.temperature);
    let q: Vec<u64> = x.iter().map(|&v| weight(scaled(v, m, c))).collect();
    let keys: Vec<u32> = x.iter().map(|&v| key(v)).collect();
    let mut floor = 0;
    let k = row.top_k as usize;
    if k > 0 && k < x.len() {
        // The k-th largest key: tokens with fewer than k strictly above are at or above it.
        let mut sorted = keys.clone();
        floor = *sorted.select_nth_unstable_by(k - 1, |a, b| b.cmp(a)).1;
    }
    if row.top_p < 1.0 {
        floor = top_p_floor(&keys, &q, floor, row.top_p);
    }
    let kept: Vec<usize> = (0..x.len()).filter(|&i| keys[i] >= floor && keeps_min_p(q[i], row.min_p)).collect();
    let goal = target(random(row.seed, row.counter), kept.iter().map(|&i| q[i]).sum());
    let mut cum = 0;
    let token = kept.iter().copied().find(|&i| {
        cum += q[i];
        cum > goal
    });
    pick(token.unwrap_or(arg), kept.len() as u32)
}

/// The smallest key at or above `floor` whose mass strictly above it (among keys >= floor)
/// top-p keeps. Weightless tokens rank below every weighted one (a lower logit) and are never
/// kept (the whole mass is above them), so only the weighted ones are sorted.
fn top_p_floor(keys: &[u32], q: &[u64], floor: u32, p: f32) -> u32 {
    let mut c: Vec<(u32, u64)> =
        keys.iter().zip(q).filter(|&(&k, &w)| k >= floor && w > 0).map(|(&k, &w)| (k, w)).collect();
    let total: u64 = c.iter().map(|e| e.1).sum();
    c.sort_unstable_by_key(|e| std::cmp::Reverse(e.0));
    let (mut above, mut t, mut i) = (0, u32::MAX, 0);
    while i < c.len() {
        if !keeps_top_p(above, total, p) {
            break;
        }
        t = c[i].0;
        while i < c.len() && c[i].0 == t {
            above += c[i].1;
            i += 1;
        }
    }
    t
}
