//! Reference linear layer: `Y = X W^T` in f64 for row-major `X [m, k]`, `W [n, k]`.

use half::bf16;

/// `Y [m, n]`, unrounded.
pub fn linear(x: &[bf16], w: &[bf16], m: usize, n: usize, k: usize) -> Vec<f64> {
    let w: Vec<f64> = w.iter().map(|v| v.to_f64()).collect();
    let mut y = Vec::with_capacity(m * n);
    for row in x.chunks_exact(k).take(m) {
        let row: Vec<f64> = row.iter().map(|v| v.to_f64()).collect();
        y.extend(w.chunks_exact(k).take(n).map(|wr| wr.iter().zip(&row).map(|(a, b)| a * b).sum::<f64>()));
    }
    y
}
