//! Reference causal attention (docs/MATH.md section 7), in f64: grouped-query heads, no positional
//! encoding, scale 1/sqrt(head_dim), softmax over the keys up to and including the query's own
//! position.

/// Attention of one query token over `n` cached keys and values (the last of them the query's
/// own): `q [heads * head_dim]`, `keys`/`values` `n` rows of `[kv_heads * head_dim]`. Query
/// head h reads kv head `h / (heads / kv_heads)`. Returns `[heads * head_dim]`.
pub fn attend(
    q: &[f64],
    keys: &[Vec<f64>],
    values: &[Vec<f64>],
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
) -> Vec<f64> {
    let scale = 1.0 / (head_dim as f64).sqrt();
    let mut out = vec![0.0; heads * head_dim];
    for h in 0..heads {
        let kv = h / (heads / kv_heads);
        let qh = &q[h * head_dim..(h + 1) * head_dim];
        let scores: Vec<f64> = keys
            .iter()
            .map(|k| qh.iter().zip(&k[kv * head_dim..(kv + 1) * head_dim]).map(|(a, b)| a * b).sum::<f64>() * scale)
            .collect();
        let max = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let weights: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
        let total: f64 = weights.iter().sum();
        for (w, v) in weights.iter().zip(values) {
            for d in 0..head_dim {
                out[h * head_dim + d] += w / total * v[kv * head_dim + d];
            }
        }
    }
    out
}
