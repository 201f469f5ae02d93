//! Token sampling on the CPU: the math of kernels-gpu/src/sample.rs's module doc, with the
//! same shared steps (penalties, weights, keys, Philox, the draw), so it picks the same token
//! as the GPU from the same logits. No sort: an argmax, a selection for top-k and one by mass
//! for top-p.

use std::borrow::Cow;

use kernels_gpu::sample::{
    Q_ONE, SAMPLE_ALL_NEG_INF, SAMPLE_MAX_TOP, SAMPLE_NAN, SAMPLE_OK, SampleOut, SampleRow, keeps_top_p, key,
    log2e_over, penalize, random, rank, scaled, target, unrank, weight,
};

/// The token `row` picks from `logits` (f32 values of the bf16 logits), its penalized tokens
/// `penalties` (pairs (token, count)) and its `mask` (a bit a token, 1: allowed; checked as
/// `sample::check_row` checks them).
pub fn sample_row(logits: &[f32], row: &SampleRow, penalties: &[(u32, u32)], mask: Option<&[u32]>) -> SampleOut {
    let x: Cow<[f32]> = if penalties.is_empty() && mask.is_none() {
        Cow::Borrowed(logits)
    } else {
        let mut x = logits.to_vec();
        if let Some(mask) = mask {
            for (i, v) in x.iter_mut().enumerate() {
                if (mask[i / 32] >> (i % 32)) & 1 == 0 {
                    *v = f32::NEG_INFINITY;
                }
            }
        }
        for &(t, n) in penalties {
            x[t as usize] = penalize(x[t as usize], n, row);
        }
        Cow::Owned(x)
    };
    // The maximum at its lowest id, in the pass that looks for a NaN.
    let (mut arg, mut m, mut nan) = (0, f32::NEG_INFINITY, false);
    for (i, &v) in x.iter().enumerate() {
        nan |= v.is_nan();
        if v > m {
            (arg, m) = (i, v);
        }
    }
    if nan {
        return SampleOut::failed(SAMPLE_NAN);
    }
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
    // The row's weights, in a buffer the thread keeps (a fresh one a token faults its pages
    // in: a tenth of the time at Nano's vocabulary).
    let mut q = WEIGHTS.take();
    weights(&x, m, c, &mut q);
    let mut floor = 0;
    let k = row.top_k as usize;
    if k > 0 && k < x.len() {
        // The k-th largest key: tokens with fewer than k strictly above are at or above it.
        let mut keys: Vec<u32> = x.iter().map(|&v| key(v)).collect();
        floor = *keys.select_nth_unstable_by(k - 1, |a, b| b.cmp(a)).1;
    }
    if row.top_p < 1.0 {
        floor = top_p_floor(&x, &q, floor, row.top_p);
    }
    // Min-p keeps the weights `keeps_min_p` keeps: at least min_p * Q_ONE (exact in f64, as
    // is every weight, at most Q_ONE = 2^40), so at least its ceiling. The weights of the
    // tokens not kept become 0, in a pass without branches that counts the kept ones.
    let min_q = (f64::from(row.min_p) * Q_ONE as f64).ceil() as u64;
    let (mut kept, mut total) = (0u32, 0u64);
    for (w, &v) in q.iter_mut().zip(x.iter()) {
        let keep = key(v) >= floor && *w >= min_q;
        kept += u32::from(keep);
        *w = if keep { *w } else { 0 };
        total += *w;
    }
    let goal = target(random(row.seed, row.counter), total);
    // The first token whose mass up to it exceeds the goal: the chunk it is in, then in it.
    let (mut cum, mut token) = (0, None);
    for (j, chunk) in q.chunks(1024).enumerate() {
        let sum: u64 = chunk.iter().sum();
        if cum + sum > goal {
            token = chunk.iter().position(|&w| {
                cum += w;
                cum > goal
            });
            token = token.map(|i| j * 1024 + i);
            break;
        }
        cum += sum;
    }
    WEIGHTS.set(q);
    pick(token.unwrap_or(arg), kept)
}

thread_local! {
    /// [`sample_row`]'s buffer of weights.
    static WEIGHTS: std::cell::Cell<Vec<u64>> = const { std::cell::Cell::new(Vec::new()) };
}

/// Every token's weight (step 4) at the row's maximum `m` and scale `c`, into `q`: on x86-64 CPUs with
/// FMA through a copy compiled for it, so that `weight`'s fused multiply-adds are
/// instructions rather than calls to the C library's `fma` (the same bits: a fused
/// multiply-add rounds once either way); it took 23x an argmax over the row through the calls.
fn weights(x: &[f32], m: f32, c: f32, q: &mut Vec<u64>) {
    q.resize(x.len(), 0);
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("fma") {
        // SAFETY: the CPU has the FMA instructions `weights_fma` is compiled to use.
        return unsafe { weights_fma(x, m, c, q) };
    }
    weights_of(x, m, c, q)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "fma")]
unsafe fn weights_fma(x: &[f32], m: f32, c: f32, q: &mut [u64]) {
    weights_of(x, m, c, q)
}

/// A plain loop, so that its body is compiled in the caller (with the caller's features).
#[inline(always)]
fn weights_of(x: &[f32], m: f32, c: f32, q: &mut [u64]) {
    for (q, &v) in q.iter_mut().zip(x) {
        *q = weight(scaled(v, m, c));
    }
}

/// The smallest key at or above `floor` whose mass strictly above it (among keys >= floor)
/// top-p keeps, of the tokens of logits `x` and weights `q`. Weightless tokens rank below
/// every weighted one (a lower logit) and are never kept (the whole mass is above them), so
/// only the weighted ones are searched, without a sort: their mass by the top bits of the key
/// ([`BUCKET_BITS`]) finds the bucket the threshold is in, and a selection by mass among that
/// bucket's tokens ([`select_floor`]) the key.
fn top_p_floor(x: &[f32], q: &[u64], floor: u32, p: f32) -> u32 {
    let shift = 32 - BUCKET_BITS;
    let mut mass = vec![0u64; 1 << BUCKET_BITS];
    for (k, w) in x.iter().zip(q).map(|(&v, &w)| (key(v), w)) {
        if k >= floor {
            mass[(k >> shift) as usize] += w;
        }
    }
    let total: u64 = mass.iter().sum();
    // The lowest bucket whose largest key qualifies (the mass above it kept), and that mass.
    let (mut above, mut found) = (0, None);
    for (b, &m) in mass.iter().enumerate().rev().filter(|(_, m)| **m > 0) {
        if !keeps_top_p(above, total, p) {
            break;
        }
        found = Some((b as u32, above));
        above += m;
    }
    let Some((bucket, above)) = found else { return u32::MAX };
    let mut c: Vec<(u32, u64)> = x
        .iter()
        .zip(q)
        .map(|(&v, &w)| (key(v), w))
        .filter(|&(k, w)| k >> shift == bucket && k >= floor && w > 0)
        .collect();
    select_floor(&mut c, above, total, p)
}

/// Top bits of a key that [`top_p_floor`] buckets the mass by.
const BUCKET_BITS: u32 = 11;

/// The smallest key of `c` whose mass strictly above it, `above` (the mass of the keys above
/// all of `c`) included, top-p keeps among `total`; `c`'s largest key is known to qualify.
/// Quickselect by mass: three-way partitions around a median of three, expected linear.
fn select_floor(c: &mut [(u32, u64)], mut above: u64, total: u64, p: f32) -> u32 {
    // c[lo..hi] holds the keys still in question, `t` the smallest key found to qualify.
    let (mut lo, mut hi, mut t) = (0, c.len(), u32::MAX);
    while lo < hi {
        let r = &mut c[lo..hi];
        let (a, b, z) = (r[0].0, r[r.len() / 2].0, r[r.len() - 1].0);
        let pivot = a.max(b).min(a.min(b).max(z));
        let (gt, eq, gt_mass, eq_mass) = partition(r, pivot);
        if !keeps_top_p(above + gt_mass, total, p) {
            // The pivot's mass above is too much: the threshold is a larger key.
            hi = lo + gt;
        } else {
            t = pivot;
            above += gt_mass + eq_mass;
            if !keeps_top_p(above, total, p) {
                break;
            }
            lo += gt + eq;
        }
    }
    t
}

/// Orders `r` as keys above `pivot`, equal to it, below it; their counts (above, equal) and
/// masses (above, equal).
fn partition(r: &mut [(u32, u64)], pivot: u32) -> (usize, usize, u64, u64) {
    let (mut gt, mut i, mut lt) = (0, 0, r.len());
    let (mut gt_mass, mut eq_mass) = (0, 0);
    while i < lt {
        let (k, w) = r[i];
        if k > pivot {
            r.swap(gt, i);
            gt_mass += w;
            gt += 1;
            i += 1;
        } else if k < pivot {
            lt -= 1;
            r.swap(i, lt);
        } else {
            eq_mass += w;
            i += 1;
        }
    }
    (gt, lt - gt, gt_mass, eq_mass)
}

#[cfg(test)]
mod tests {
    use super::top_p_floor;
    use kernels_gpu::sample::{keeps_top_p, key};

    /// The definition: walking the weighted keys at or above `floor` from the largest down,
    /// the last key reached while the mass strictly above it is kept.
    fn sorted_floor(x: &[f32], q: &[u64], floor: u32, p: f32) -> u32 {
        let keys: Vec<u32> = x.iter().map(|&v| key(v)).collect();
        let mut c: Vec<(u32, u64)> =
            keys.iter().zip(q).filter(|&(&k, &w)| k >= floor && w > 0).map(|(&k, &w)| (k, w)).collect();
        let total: u64 = c.iter().map(|e| e.1).sum();
        c.sort_by_key(|e| std::cmp::Reverse(e.0));
        let mut t = u32::MAX;
        for (i, &(k, _)) in c.iter().enumerate() {
            let above: u64 = c[..i].iter().filter(|e| e.0 > k).map(|e| e.1).sum();
            if i > 0 && c[i - 1].0 == k {
                continue;
            }
            if !keeps_top_p(above, total, p) {
                break;
            }
            t = k;
        }
        t
    }

    /// Against the definition on seeded logits with many ties (few distinct values) at three
    /// spreads (within one bucket of the keys' top bits, over a few, over many), weightless
    /// tokens and a floor, at every p from almost 0 to almost 1; and the edge cases.
    #[test]
    fn top_p_floor_is_the_definitions() {
        let mut state = 0x2545_F491_4F6C_DD1Du64;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        let mut compared = 0;
        for case in 0..300 {
            let n = 1 + (next() % 600) as usize;
            let distinct = 1 + next() % [3, 40, 1 << 20][case % 3];
            let spread = [1e-3f32, 0.37, 91.0][case / 3 % 3];
            let x: Vec<f32> = (0..n).map(|_| ((next() % distinct) as f32 - distinct as f32 / 2.0) * spread).collect();
            let q: Vec<u64> = (0..n).map(|_| if next() % 7 == 0 { 0 } else { next() % (1 << 40) }).collect();
            let floor = if case % 4 == 0 { key(x[(next() % n as u64) as usize]) } else { 0 };
            for p in [1e-6f32, 0.1, 0.5, 0.9, 0.95, 0.999_999] {
                assert_eq!(top_p_floor(&x, &q, floor, p), sorted_floor(&x, &q, floor, p), "case {case} p {p}");
                compared += 1;
            }
        }
        assert_eq!(compared, 1800);
        assert_eq!(top_p_floor(&[], &[], 0, 0.5), u32::MAX, "no candidates");
        assert_eq!(top_p_floor(&[5.0, 6.0], &[0, 0], 0, 0.5), u32::MAX, "no weight");
        assert_eq!(top_p_floor(&[7.0; 9], &[3; 9], 0, 0.01), key(7.0), "one key");
        let x = [3.0, 9.0, 9.0, -1.0];
        assert_eq!(top_p_floor(&x, &[1, 1, 1, 1], 0, 0.5), key(9.0), "the two 9s are half");
        assert_eq!(top_p_floor(&x, &[1, 1, 1, 1], 0, 0.51), key(3.0));
    }
}
