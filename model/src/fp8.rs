//! W8A8 as ModelOpt FP8 checkpoints define it (docs/MATH.md section 7): a weight is e4m3 codes
//! times its per-tensor `weight_scale`; the activation is quantized to e4m3 with the static
//! `input_scale` (per token, dynamically, when the checkpoint gives none) before the product.
//! The CPU backend and the f64 reference both compute FP8 layers through this one definition.

use host::cpu::quant::{E4M3_MAX, MIN_SCALE, e4m3_decode, e4m3_encode};

use crate::error::{Error, Result};
use crate::layout::Linear;
use crate::weights::Dtype;

/// An FP8 linear layer `[n, k]`, its weights decoded (without the scale).
#[derive(Clone)]
pub struct Fp8Linear {
    w: Vec<f64>,
    pub n: usize,
    pub k: usize,
    weight_scale: f64,
    input_scale: Option<f32>,
}

impl Fp8Linear {
    /// The layer, when `l` is FP8.
    pub fn new(l: &Linear) -> Result<Option<Fp8Linear>> {
        let Some(s) = l.fp8 else { return Ok(None) };
        if l.weight.dtype != Dtype::F8E4M3 || l.bias.is_some() {
            return Err(Error::Unsupported(format!("`{}`: FP8 layers without bias only", l.weight.name)));
        }
        Ok(Some(Fp8Linear {
            w: l.weight.bytes.iter().map(|&c| f64::from(e4m3_decode(c))).collect(),
            n: l.weight.shape[0],
            k: l.weight.shape[1],
            weight_scale: f64::from(s.weight_scale),
            input_scale: s.input_scale,
        }))
    }

    /// `y = dequant(quant(x)) W^T` for one row `x` of `k` values.
    pub fn apply(&self, x: &[f32]) -> Vec<f64> {
        let s = self.input_scale.unwrap_or_else(|| {
            let amax = x.iter().map(|v| v.abs()).filter(|v| !v.is_nan()).fold(0.0, f32::max);
            (amax / E4M3_MAX).max(MIN_SCALE)
        });
        let xq: Vec<f64> = x.iter().map(|&v| f64::from(e4m3_decode(e4m3_encode(v / s))) * f64::from(s)).collect();
        self.w
            .chunks_exact(self.k)
            .map(|row| row.iter().zip(&xq).map(|(a, b)| a * b).sum::<f64>() * self.weight_scale)
            .collect()
    }
}
