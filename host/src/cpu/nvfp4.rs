//! NVFP4 on the CPU (docs/MATH.md, "Checkpoint formats"): dequantization, the reference of the
//! device's ([`crate::nvfp4::to_bf16`]) and of the products that read the codes; and
//! quantization with ModelOpt's rounding ([`quantize`]), what the tests' fixtures and the
//! synthetic checkpoints are made with.

pub use kernels_gpu::nvfp4::BLOCK as NVFP4_BLOCK;

use super::quant::{E4M3_MAX, e4m3_decode, e4m3_encode};

/// The value of each e2m1 code: bit 3 the sign, bits 2..1 the exponent (bias 1), bit 0 the
/// mantissa; exponent 0 is subnormal (0 and 0.5).
pub const E2M1: [f32; 16] = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0];

/// Rows of `k` weights (`[rows, k]` row-major) from their `codes` (`[rows, k / 2]`, element `2i`
/// of a row in the low four bits of byte i) and e4m3 block `scales` (`[rows, k / 16]`), times
/// `global`: each `e2m1 * scale * global`, exact in f64. `k` a multiple of 16; the lengths must
/// agree (else a panic: a caller's bug).
pub fn dequantize(codes: &[u8], scales: &[u8], global: f32, k: usize) -> Vec<f64> {
    assert!(k.is_multiple_of(NVFP4_BLOCK) && codes.len() * 2 / k == scales.len() * NVFP4_BLOCK / k);
    let global = f64::from(global);
    let mut w = Vec::with_capacity(codes.len() * 2);
    for (row, scales) in codes.chunks_exact(k / 2).zip(scales.chunks_exact(k / NVFP4_BLOCK)) {
        for (i, &byte) in row.iter().enumerate() {
            let scale = f64::from(e4m3_decode(scales[2 * i / NVFP4_BLOCK])) * global;
            w.push(f64::from(E2M1[usize::from(byte & 15)]) * scale);
            w.push(f64::from(E2M1[usize::from(byte >> 4)]) * scale);
        }
    }
    w
}

/// `v` rounded once to bf16, nearest even: through an f32 rounded to odd (toward zero, the
/// last bit set where inexact), whose rounding to bf16 is that of `v` (an f32 keeps more than
/// two bits past bf16's). `half::bf16::from_f64` is not this: it drops the f64's mantissa
/// bits past an f32's first, so a value just past a bf16 tie by less than those rounds to
/// even (the dequantized NVFP4 weight of `e2m1 * scale * global` can be such a value).
pub fn bf16_nearest(v: f64) -> half::bf16 {
    let f = v as f32;
    let odd = if f64::from(f) == v || !f.is_finite() {
        f
    } else {
        // The f32 toward zero from v, its last bit set.
        let toward_zero = if f64::from(f).abs() > v.abs() { f32::from_bits(f.to_bits() - 1) } else { f };
        f32::from_bits(toward_zero.to_bits() | 1)
    };
    half::bf16::from_f32(odd)
}

/// The e2m1 code nearest `x` (ties to the even code, saturating at 6), sign in bit 3.
pub fn e2m1_encode(x: f32) -> u8 {
    let a = x.abs().min(6.0);
    let mut best = 0;
    for (c, &g) in E2M1[..8].iter().enumerate() {
        let (d, e) = ((a - g).abs(), (a - E2M1[best]).abs());
        if d < e || (d == e && c % 2 == 0) {
            best = c;
        }
    }
    best as u8 | if x < 0.0 { 8 } else { 0 }
}

/// One NVFP4 weight `[out, inp]` as a checkpoint holds it: packed codes (`[out, inp / 2]`, the
/// even element low), block scales (e4m3 codes, `[out, inp / 16]`), per-tensor scale.
pub struct Quantized {
    pub packed: Vec<u8>,
    pub block: Vec<u8>,
    pub global: f32,
}

/// `w` (`[out, inp]`, inp a multiple of 16) quantized with ModelOpt's rounding: a per-tensor
/// `global = amax / (6 * 448)`, a block scale per 16 inputs `block amax / 6 / global` rounded
/// to e4m3 (1 for a block of zeros), each weight divided by both and rounded to the nearest
/// e2m1 value ([`e2m1_encode`]).
pub fn quantize(w: &[f32], out: usize, inp: usize) -> Quantized {
    let global = w.iter().map(|v| v.abs()).fold(0.0, f32::max) / (6.0 * E4M3_MAX);
    let (mut packed, mut block) = (Vec::with_capacity(out * inp / 2), Vec::with_capacity(out * inp / 16));
    let mut codes = Vec::with_capacity(inp);
    for row in w.chunks_exact(inp).take(out) {
        codes.clear();
        for b in row.chunks_exact(NVFP4_BLOCK) {
            let amax = b.iter().map(|v| v.abs()).fold(0.0, f32::max);
            let s = amax / 6.0 / global;
            let code = e4m3_encode(if s == 0.0 { 1.0 } else { s });
            block.push(code);
            let scale = e4m3_decode(code) * global;
            codes.extend(b.iter().map(|&v| e2m1_encode(v / scale)));
        }
        packed.extend(codes.chunks_exact(2).map(|p| p[0] | p[1] << 4));
    }
    Quantized { packed, block, global }
}

#[cfg(test)]
mod tests {
    use super::{E2M1, bf16_nearest, e2m1_encode};

    /// Each code's value from its bits: sign, exponent (bias 1; 0 subnormal), mantissa.
    #[test]
    fn e2m1_values_follow_the_bits() {
        for (code, &v) in E2M1.iter().enumerate() {
            let (sign, exp, man) = (code >> 3, (code >> 1) & 3, code & 1);
            let mag = if exp == 0 { 0.5 * man as f32 } else { (1.0 + 0.5 * man as f32) * 2f32.powi(exp as i32 - 1) };
            let want = if sign == 1 { -mag } else { mag };
            assert_eq!(v.to_bits(), want.to_bits(), "code {code:#06b}");
        }
    }

    /// Each value encodes to its own code; halfway between two values to the even code;
    /// past 6 to 6.
    #[test]
    fn e2m1_rounds_to_nearest_even() {
        for (code, &v) in E2M1.iter().enumerate().filter(|&(c, _)| c != 8) {
            assert_eq!(e2m1_encode(v), code as u8, "{v}");
        }
        for (x, code) in
            [(0.25, 0), (0.75, 2), (1.25, 2), (1.75, 4), (2.5, 4), (3.5, 6), (5.0, 6), (9.0, 7), (-5.0, 14)]
        {
            assert_eq!(e2m1_encode(x), code, "{x}");
        }
    }

    /// Just past a bf16 tie by less than an f32 step: up (half rounds it to even, down); on the
    /// tie itself to even; below it down; negative values alike; exact values as they are.
    #[test]
    fn bf16_rounds_once_from_f64() {
        let tie = 1.0 + 2f64.powi(-8); // halfway between bf16 1 and 1 + 2^-7
        let past = tie + 2f64.powi(-40);
        assert_eq!(half::bf16::from_f64(past).to_bits(), 0x3f80, "half rounds it down (the case)");
        assert_eq!(bf16_nearest(past).to_bits(), 0x3f81);
        assert_eq!(bf16_nearest(-past).to_bits(), 0xbf81);
        assert_eq!(bf16_nearest(tie).to_bits(), 0x3f80);
        assert_eq!(bf16_nearest(tie - 2f64.powi(-40)).to_bits(), 0x3f80);
        assert_eq!(bf16_nearest(1.0 + 3.0 * 2f64.powi(-8)).to_bits(), 0x3f82, "a tie to the even above");
        assert_eq!(bf16_nearest(0.15625).to_bits(), half::bf16::from_f32(0.15625).to_bits());
    }
}
