//! W4A4 NVFP4 on the CPU (docs/MATH.md, "W4A4"): activations quantized with a static input
//! scale, bit for bit what `nvfp4_quantize_bf16` writes ([`quantize_rows`]), and the product of
//! two matrices of NVFP4 rows, exact in f64 ([`product`]): the references of
//! [`crate::w4a4`].

use half::bf16;

use super::nvfp4::{NVFP4_BLOCK, dequantize, e2m1_encode};
use super::quant::{e4m3_decode, e4m3_encode};
use kernels_gpu::nvfp4::row_bytes;

/// `rows` rows of `k` bf16 activations (`x`, row r at `r * stride`) as NVFP4 rows in the
/// device layout ([`row_bytes`] a row, the padding zero): with `g = 1 / scale` in f32, each
/// block of 16 gets the e4m3 code of `amax * g / 6` (f32 operations in that order) and each
/// element the e2m1 code of `x * (g / s)`, `s` the code's value (codes 0 where it is not
/// positive).
pub fn quantize_rows(x: &[bf16], (rows, k, stride): (usize, usize, usize), scale: f32) -> Vec<u8> {
    assert!(k.is_multiple_of(NVFP4_BLOCK) && stride >= k && (rows == 0 || x.len() >= (rows - 1) * stride + k));
    let g = 1.0 / scale;
    let mut out = vec![0u8; rows * row_bytes(k)];
    for r in 0..rows {
        let row = &mut out[r * row_bytes(k)..][..row_bytes(k)];
        for (b, block) in x[r * stride..][..k].chunks_exact(NVFP4_BLOCK).enumerate() {
            let v: Vec<f32> = block.iter().map(|x| x.to_f32()).collect();
            let amax = v.iter().fold(0.0f32, |m, x| m.max(x.abs()));
            let code = e4m3_encode(amax * g / 6.0);
            row[k / 2 + b] = code;
            let s = e4m3_decode(code);
            if s.is_nan() || s <= 0.0 {
                continue;
            }
            let inv = g / s;
            // A NaN input (never from finite ones within host::w4a4's scales) codes as 0.
            let e = |x: f32| if x.is_nan() { 0 } else { e2m1_encode(x) };
            for (j, pair) in v.chunks_exact(2).enumerate() {
                row[NVFP4_BLOCK / 2 * b + j] = e(pair[0] * inv) | e(pair[1] * inv) << 4;
            }
        }
    }
    out
}

/// The values of NVFP4 rows of `k` in the device layout (each code times its block's scale,
/// exact), `[rows, k]`.
pub fn row_values(rows: &[u8], k: usize) -> Vec<f64> {
    let bytes = row_bytes(k);
    rows.chunks_exact(bytes).flat_map(|r| dequantize(&r[..k / 2], &r[k / 2..k / 2 + k / NVFP4_BLOCK], 1.0, k)).collect()
}

/// `a [m] x w [n]` NVFP4 rows of `k` (device layout): `out[i][j] = sum_k a[i][k] w[j][k]` in
/// f64 (each product exact), and beside it the sum of the products' magnitudes (what an f32
/// accumulation's error is bounded by).
pub fn product(a: &[u8], w: &[u8], (m, n, k): (usize, usize, usize)) -> (Vec<f64>, Vec<f64>) {
    assert!(a.len() == m * row_bytes(k) && w.len() == n * row_bytes(k));
    let (a, w) = (row_values(a, k), row_values(w, k));
    let (mut out, mut mag) = (vec![0.0; m * n], vec![0.0; m * n]);
    for (i, a) in a.chunks_exact(k).enumerate() {
        for (j, w) in w.chunks_exact(k).enumerate() {
            let terms = a.iter().zip(w).map(|(x, y)| x * y);
            out[i * n + j] = terms.clone().sum();
            mag[i * n + j] = terms.map(f64::abs).sum();
        }
    }
    (out, mag)
}
