//! NVFP4 weights as ModelOpt exports them (docs/MATH.md, "Checkpoint formats"): a linear
//! layer's `weight` is `[out, in / 2]` bytes, two e2m1 codes a byte (element `2i` of a row in
//! the low four bits, `2i + 1` in the high four); `weight_scale` `[out, in / 16]` e4m3 holds a
//! scale per block of 16 elements along `in`, `weight_scale_2` one f32 for the tensor, so that
//! `W[o][i] = e2m1(code) * e4m3(weight_scale[o][i / 16]) * weight_scale_2`.
//!
//! The backends run NVFP4 layers weight-only, the activations as they are: the CPU backend
//! from the codes, each product exact in f64 ([`Nvfp4Linear`]); the CUDA backend from the
//! codes at few rows (each chunk's products with the bf16 inputs summed in f32, scaled by its
//! block scale, the sum by the per-tensor one), and at many rows with the weights dequantized
//! to bf16 (rounded once) for its bf16 GEMMs. A checkpoint made for W4A4 also holds an
//! `input_scale`, its activations' scale for FP4 products; it is kept in the layout and not
//! applied. The f64 reference computes that W4A4 form too (`Reference::w4a4`), and
//! model/tests/nvfp4.rs measures the difference on the fixture.

use crate::error::{Error, Result};
use crate::layout::Linear;

pub use host::cpu::nvfp4::{E2M1, NVFP4_BLOCK};

/// The weights of NVFP4 layer `l` (`[out, in]` row-major), dequantized exactly (each is the
/// product of an e2m1 value, an e4m3 value and an f32, held exactly by an f64); an error when
/// `l` is not NVFP4.
pub fn dequantize(l: &Linear) -> Result<Vec<f64>> {
    let Some(s) = l.nvfp4 else {
        return Err(Error::Unsupported(format!("`{}` is not an NVFP4 weight", l.weight.name)));
    };
    Ok(host::cpu::nvfp4::dequantize(l.weight.bytes, s.block.bytes, s.global, 2 * l.weight.shape[1]))
}

/// An NVFP4 linear layer `[n, k]` as the CPU backend holds it: its codes and decoded block
/// scales (a byte a weight), multiplied exactly ([`Nvfp4Linear::apply`]).
#[derive(Clone)]
pub struct Nvfp4Linear {
    codes: Vec<u8>,
    block: Vec<f64>,
    global: f64,
    pub n: usize,
    pub k: usize,
}

impl Nvfp4Linear {
    /// The layer, when `l` is NVFP4.
    pub fn new(l: &Linear) -> Result<Option<Nvfp4Linear>> {
        let Some(s) = l.nvfp4 else { return Ok(None) };
        let [n, k] = l.shape();
        let block = s.block.bytes.iter().map(|&c| f64::from(host::cpu::quant::e4m3_decode(c))).collect();
        Ok(Some(Nvfp4Linear { codes: l.weight.bytes.to_vec(), block, global: f64::from(s.global), n, k }))
    }

    /// `y = x W^T` for one row `x` of `k` values, each weight `e2m1 * block scale * global`:
    /// a block's products summed, times its scale, the row's sum times the per-tensor scale
    /// (in f64: exact products, sums to f64's rounding).
    pub fn apply(&self, x: &[f64]) -> Vec<f64> {
        let (half, blocks) = (self.k / 2, self.k / NVFP4_BLOCK);
        let rows = self.codes.chunks_exact(half).zip(self.block.chunks_exact(blocks));
        rows.map(|(codes, scales)| {
            let mut sum = 0.0;
            for ((c, x), s) in codes.chunks_exact(NVFP4_BLOCK / 2).zip(x.chunks_exact(NVFP4_BLOCK)).zip(scales) {
                let pairs = c.iter().zip(x.chunks_exact(2));
                let dot: f64 = pairs.map(|(&b, x)| e2m1(b & 15) * x[0] + e2m1(b >> 4) * x[1]).sum();
                sum += dot * s;
            }
            sum * self.global
        })
        .collect()
    }
}

/// The value of e2m1 code `c` (the low four bits).
fn e2m1(c: u8) -> f64 {
    f64::from(E2M1[usize::from(c)])
}
