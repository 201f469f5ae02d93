//! Reference MoE routing (docs/MATH.md section 6), in f64.
//!
//! Routing of one token from its router logits: `s = sigmoid(logits)`, `s' = s + bias` (for
//! selection only); with `n_group` groups of experts, each group scores the sum of its top two
//! `s'`, the best `topk_group` groups are kept; the top-k experts by `s'` among the kept ones
//! are chosen; their weights are the unbiased `s`, divided by their sum when `norm_topk_prob`,
//! times `routed_scaling_factor`. Ties (equal scores, of groups or experts) go to the lowest
//! index.

/// Routing settings.
#[derive(Clone, Copy, Debug)]
pub struct Routing {
    pub top_k: usize,
    pub n_group: usize,
    pub topk_group: usize,
    pub norm_topk_prob: bool,
    pub scaling: f64,
}

/// The indices of the `k` largest `scores`, largest first; equal scores in index order.
fn top_k(scores: &[f64], k: usize) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..scores.len()).collect();
    // Stable sort by descending score keeps equal scores in ascending index order.
    idx.sort_by(|&a, &b| scores[b].total_cmp(&scores[a]));
    idx.truncate(k);
    idx
}

/// A token's selection: the sigmoid scores `s`, the selection scores `s + bias` of the kept
/// groups' experts (the others -inf), the chosen experts (the highest first), and the gap
/// between the weakest kept group and the best dropped one (infinity where none is dropped).
struct Selection {
    s: Vec<f64>,
    masked: Vec<f64>,
    chosen: Vec<usize>,
    group_gap: f64,
}

fn select(logits: &[f64], bias: &[f64], r: &Routing) -> Selection {
    let e = logits.len();
    let s: Vec<f64> = logits.iter().map(|&l| 1.0 / (1.0 + (-l).exp())).collect();
    let sel: Vec<f64> = s.iter().zip(bias).map(|(a, b)| a + b).collect();
    let per = e / r.n_group;
    let group_score: Vec<f64> = (0..r.n_group)
        .map(|g| {
            let members = &sel[g * per..(g + 1) * per];
            top_k(members, 2.min(per)).iter().map(|&i| members[i]).sum()
        })
        .collect();
    let kept = top_k(&group_score, r.topk_group);
    let weakest_kept = kept.iter().map(|&g| group_score[g]).fold(f64::INFINITY, f64::min);
    let best_dropped =
        (0..r.n_group).filter(|g| !kept.contains(g)).map(|g| group_score[g]).fold(f64::NEG_INFINITY, f64::max);
    let masked: Vec<f64> = (0..e).map(|i| if kept.contains(&(i / per)) { sel[i] } else { f64::NEG_INFINITY }).collect();
    let chosen = top_k(&masked, r.top_k);
    Selection { s, masked, chosen, group_gap: weakest_kept - best_dropped }
}

/// The chosen experts with their weights: `s` over the chosen ones' sum when
/// `norm_topk_prob`, times the scaling.
fn weighed(s: &[f64], chosen: Vec<usize>, r: &Routing) -> Vec<(usize, f64)> {
    let total: f64 = chosen.iter().map(|&i| s[i]).sum();
    chosen
        .into_iter()
        .map(|i| {
            let w = if r.norm_topk_prob { s[i] / total } else { s[i] };
            (i, w * r.scaling)
        })
        .collect()
}

/// The best expert of the kept groups left out of `chosen` (the lowest index on ties; none
/// where all are chosen).
fn best_left_out(masked: &[f64], chosen: &[usize]) -> Option<usize> {
    (0..masked.len())
        .filter(|i| !chosen.contains(i) && masked[*i] > f64::NEG_INFINITY)
        .max_by(|&a, &b| masked[a].total_cmp(&masked[b]).then(b.cmp(&a)))
}

/// Routes one token: returns (expert, weight) pairs, the highest selection score first.
/// `bias` is the e_score_correction_bias (zeros when the checkpoint has none).
pub fn route(logits: &[f64], bias: &[f64], r: &Routing) -> Vec<(usize, f64)> {
    let Selection { s, chosen, .. } = select(logits, bias, r);
    weighed(&s, chosen, r)
}

/// The routing next to [`route`]'s: its last chosen expert replaced by the best left out of
/// the kept groups (the swap [`margin`] measures), weighed as `route` weighs; `route`'s own
/// where every expert of the kept groups is chosen. What a backend whose rounding tips a
/// near-tie computes.
pub fn route_otherwise(logits: &[f64], bias: &[f64], r: &Routing) -> Vec<(usize, f64)> {
    let Selection { s, masked, mut chosen, .. } = select(logits, bias, r);
    if let (Some(out), Some(last)) = (best_left_out(&masked, &chosen), chosen.last_mut()) {
        *last = out;
    }
    weighed(&s, chosen, r)
}

/// How near a token's choice of experts is to another: the smaller of the gap between its
/// last chosen expert's selection score and the best left out (of the kept groups) and, where
/// groups are dropped, the gap between the weakest kept group's score and the best dropped
/// one's. No one selection score moved by less changes the choice; with one group, moving the
/// best left out by more does (with groups dropped the margin is a lower bound). Infinity
/// where every expert is chosen. A backend whose rounding moves the scores by about the
/// margin may choose otherwise: a near-tie, not an error.
pub fn margin(logits: &[f64], bias: &[f64], r: &Routing) -> f64 {
    let Selection { masked, chosen, group_gap, .. } = select(logits, bias, r);
    let last = chosen.last().map_or(f64::INFINITY, |&i| masked[i]);
    let left_out = best_left_out(&masked, &chosen).map_or(f64::NEG_INFINITY, |i| masked[i]);
    (last - left_out).min(group_gap)
}
