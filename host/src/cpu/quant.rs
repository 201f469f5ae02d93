//! Reference FP8 e4m3 quantization (docs/MATH.md section 4).
//!
//! e4m3 (OCP FP8, "fn"): 1 sign bit, 4 exponent bits (bias 7), 3 mantissa bits, no infinities,
//! 0x7f / 0xff are NaN, largest finite 448 (0x7e), smallest subnormal 2^-9.

use half::bf16;

/// Largest finite e4m3 value.
pub const E4M3_MAX: f32 = 448.0;

/// f32 to e4m3: round to nearest, ties to even; magnitudes beyond 448 saturate to 448; NaN
/// gives 0x7f (sign kept).
pub fn e4m3_encode(v: f32) -> u8 {
    let sign = if v.is_sign_negative() { 0x80 } else { 0x00 };
    if v.is_nan() {
        return sign | 0x7f;
    }
    let a = f64::from(v.abs());
    if a >= 448.0 {
        return sign | 0x7e;
    }
    // Below 2^-6 the spacing is the subnormal quantum 2^-9; a result of 8 quanta is the
    // smallest normal, whose code is also 8.
    if a < 2f64.powi(-6) {
        return sign | (a * 512.0).round_ties_even() as u8;
    }
    let e = a.log2().floor() as i32;
    let e = if 2f64.powi(e) > a { e - 1 } else { e };
    let mut m = ((a / 2f64.powi(e) - 1.0) * 8.0).round_ties_even() as i32;
    let mut e = e;
    if m == 8 {
        m = 0;
        e += 1;
    }
    let code = (((e + 7) << 3) | m).min(0x7e);
    sign | code as u8
}

/// e4m3 code to f32 (exact).
pub fn e4m3_decode(code: u8) -> f32 {
    let sign = if code & 0x80 != 0 { -1.0 } else { 1.0 };
    let (e, m) = (i32::from((code >> 3) & 0xf), f32::from(code & 7));
    if e == 15 && m == 7.0 {
        return f32::NAN;
    }
    if e == 0 { sign * m / 8.0 * 2f32.powi(-6) } else { sign * (1.0 + m / 8.0) * 2f32.powi(e - 7) }
}

/// max |x| in f32, ignoring NaN.
fn amax(x: &[bf16]) -> f32 {
    x.iter().map(|v| v.to_f32().abs()).filter(|v| !v.is_nan()).fold(0.0, f32::max)
}

/// Smallest dynamic scale, 1 / (448 * 512): the scale of an all-zero row or tensor.
pub const MIN_SCALE: f32 = 1.0 / (448.0 * 512.0);

/// Per-token dynamic: for each row of `width`, `s = max(min(amax, ub) / 448, 1/(448*512))`,
/// `q = e4m3(x / s)`. Returns (codes, scales).
pub fn quant_token(x: &[bf16], width: usize, amax_ub: Option<f32>) -> (Vec<u8>, Vec<f32>) {
    let mut q = Vec::with_capacity(x.len());
    let mut scales = Vec::new();
    for row in x.chunks_exact(width) {
        let a = amax(row);
        let a = amax_ub.map_or(a, |ub| a.min(ub));
        let s = (a / E4M3_MAX).max(MIN_SCALE);
        q.extend(row.iter().map(|v| e4m3_encode(v.to_f32() / s)));
        scales.push(s);
    }
    (q, scales)
}

/// Per-tensor dynamic: `s = max(amax / 448, 1/(448*512))`, `q = e4m3(x * (1/s))`.
/// Returns (codes, amax, scale).
pub fn quant_tensor(x: &[bf16]) -> (Vec<u8>, f32, f32) {
    let a = amax(x);
    let s = (a / E4M3_MAX).max(MIN_SCALE);
    let inv = 1.0 / s;
    (x.iter().map(|v| e4m3_encode(v.to_f32() * inv)).collect(), a, s)
}

/// Static scale: `q = e4m3(x / scale)`.
pub fn quant_static(x: &[bf16], scale: f32) -> Vec<u8> {
    x.iter().map(|v| e4m3_encode(v.to_f32() / scale)).collect()
}
