//! NVFP4 weights as ModelOpt exports them (docs/MATH.md, "Checkpoint formats"): a linear
//! layer's `weight` is `[out, in / 2]` bytes, two e2m1 codes a byte (element `2i` of a row in
//! the low four bits, `2i + 1` in the high four); `weight_scale` `[out, in / 16]` e4m3 holds a
//! scale per block of 16 elements along `in`, `weight_scale_2` one f32 for the tensor, so that
//! `W[o][i] = e2m1(code) * e4m3(weight_scale[o][i / 16]) * weight_scale_2`.
//!
//! The backends run NVFP4 layers weight-only: the weights dequantized once at load (exactly
//! in f64 here; the CUDA backend rounds them to bf16), the activations as they are. A
//! checkpoint made for W4A4 also holds an `input_scale`, its activations' scale for FP4
//! products; it is kept in the layout and not applied (the difference is measured on the
//! fixture in model/tests/nvfp4.rs).

use host::cpu::quant::e4m3_decode;

use crate::error::{Error, Result};
use crate::layout::Linear;

/// Elements along `in` that share a block scale.
pub const NVFP4_BLOCK: usize = 16;

/// The value of each e2m1 code: bit 3 the sign, bits 2..1 the exponent (bias 1), bit 0 the
/// mantissa; exponent 0 is subnormal (0 and 0.5).
pub const E2M1: [f32; 16] = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0];

/// The weights of NVFP4 layer `l` (`[out, in]` row-major), dequantized exactly (each is the
/// product of an e2m1 value, an e4m3 value and an f32, held exactly by an f64); an error when
/// `l` is not NVFP4.
pub fn dequantize(l: &Linear) -> Result<Vec<f64>> {
    let Some(s) = l.nvfp4 else {
        return Err(Error::Unsupported(format!("`{}` is not an NVFP4 weight", l.weight.name)));
    };
    let (out, half) = (l.weight.shape[0], l.weight.shape[1]);
    let inp = 2 * half;
    let global = f64::from(s.global);
    let mut w = Vec::with_capacity(out * inp);
    for (row, scales) in l.weight.bytes.chunks_exact(half).zip(s.block.bytes.chunks_exact(inp / NVFP4_BLOCK)) {
        for (i, &byte) in row.iter().enumerate() {
            let scale = f64::from(e4m3_decode(scales[2 * i / NVFP4_BLOCK])) * global;
            w.push(f64::from(E2M1[usize::from(byte & 15)]) * scale);
            w.push(f64::from(E2M1[usize::from(byte >> 4)]) * scale);
        }
    }
    Ok(w)
}

#[cfg(test)]
mod tests {
    use super::E2M1;

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
}
