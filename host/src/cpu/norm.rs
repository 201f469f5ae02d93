//! Reference RMSNorm and gated group RMSNorm (docs/MATH.md section 5).

use half::bf16;

/// Gated group RMSNorm over contiguous `[rows, width]`: `u = x * silu(z)` (or `u = x` when
/// `z` is `None`), then per group of `width / groups` channels `y = w * u / sqrt(mean(u^2) + eps)`.
/// Returns the unrounded outputs. Plain RMSNorm is `z = None, groups = 1`.
///
/// # Panics
/// If `groups` does not divide `width` or a buffer is shorter than its shape (test misuse).
pub fn gated_norm<T: Copy + Into<f64>>(
    x: &[T],
    z: Option<&[T]>,
    w: &[bf16],
    width: usize,
    groups: usize,
    eps: f64,
) -> Vec<f64> {
    assert!(width.is_multiple_of(groups) && x.len().is_multiple_of(width) && w.len() == width, "reference misuse");
    let gs = width / groups;
    let mut y = Vec::with_capacity(x.len());
    for (r, xr) in x.chunks_exact(width).enumerate() {
        let u: Vec<f64> = (0..width)
            .map(|c| {
                let xv: f64 = xr[c].into();
                match z {
                    Some(z) => {
                        let zv: f64 = z[r * width + c].into();
                        xv * zv / (1.0 + (-zv).exp())
                    }
                    None => xv,
                }
            })
            .collect();
        for g in u.chunks_exact(gs).enumerate() {
            let (gi, ug) = g;
            let mean_sq = ug.iter().map(|v| v * v).sum::<f64>() / gs as f64;
            let rstd = 1.0 / (mean_sq + eps).sqrt();
            y.extend(ug.iter().enumerate().map(|(i, v)| w[gi * gs + i].to_f64() * v * rstd));
        }
    }
    y
}

/// Plain RMSNorm (the pre-norm of every block and norm_f).
pub fn rms_norm<T: Copy + Into<f64>>(x: &[T], w: &[bf16], width: usize, eps: f64) -> Vec<f64> {
    gated_norm(x, None, w, width, 1, eps)
}
