//! Reference MoE experts (docs/MATH.md section 6), in f64: one expert, the dispatch of a
//! step's routing choices by expert, permuting and combining. The routing is `router.rs`'s.

/// A non-gated relu^2 expert: `down (relu(up x))^2`, `up` `[inter, hidden]`, `down`
/// `[hidden, inter]`, row-major.
pub fn expert(x: &[f64], up: &[f64], down: &[f64]) -> Vec<f64> {
    let hidden = x.len();
    let inter = up.len() / hidden;
    let h: Vec<f64> = (0..inter)
        .map(|j| {
            let v: f64 = (0..hidden).map(|i| up[j * hidden + i] * x[i]).sum();
            v.max(0.0).powi(2)
        })
        .collect();
    (0..hidden).map(|o| (0..inter).map(|j| down[o * inter + j] * h[j]).sum()).collect()
}

/// Tokens grouped by expert so each expert's weights are read once per step (docs/MATH.md
/// section 6, dispatch): slot `j` of the grouped order holds (token, choice) `order[j]`;
/// expert e's slots are `offsets[e]..offsets[e + 1]`, in token order.
#[derive(Clone, Debug, PartialEq)]
pub struct Dispatch {
    pub counts: Vec<usize>,
    pub offsets: Vec<usize>,
    pub order: Vec<(usize, usize)>,
}

/// Groups the routing of `routes.len()` tokens (each a list of (expert, weight)) over
/// `experts` experts.
pub fn dispatch(routes: &[Vec<(usize, f64)>], experts: usize) -> Dispatch {
    let mut counts = vec![0; experts];
    for r in routes {
        for &(e, _) in r {
            counts[e] += 1;
        }
    }
    let mut offsets = vec![0];
    for c in &counts {
        offsets.push(offsets.last().copied().unwrap_or(0) + c);
    }
    let mut next = offsets.clone();
    let mut order = vec![(0, 0); offsets[experts]];
    for (t, r) in routes.iter().enumerate() {
        for (k, &(e, _)) in r.iter().enumerate() {
            order[next[e]] = (t, k);
            next[e] += 1;
        }
    }
    Dispatch { counts, offsets, order }
}

/// Rows of `x` (`[tokens, width]`) in grouped order.
pub fn permute(x: &[f64], width: usize, d: &Dispatch) -> Vec<f64> {
    d.order.iter().flat_map(|&(t, _)| x[t * width..(t + 1) * width].iter().copied()).collect()
}

/// The inverse: each token's rows of `y` (grouped order, `[slots, width]`) summed with its
/// routing weights into `[tokens, width]`.
pub fn combine(y: &[f64], width: usize, d: &Dispatch, routes: &[Vec<(usize, f64)>]) -> Vec<f64> {
    let mut out = vec![0.0; routes.len() * width];
    for (j, &(t, k)) in d.order.iter().enumerate() {
        let w = routes[t][k].1;
        for c in 0..width {
            out[t * width + c] += w * y[j * width + c];
        }
    }
    out
}
