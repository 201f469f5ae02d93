//! The CPU backend's linear layers: bf16, FP8 (W8A8) and NVFP4 (weight-only) weights from
//! the host crate's references, unrounded until the caller rounds.

use half::bf16;
use host::cpu::gemm;

use crate::fp8::Fp8Linear;
use crate::nvfp4::Nvfp4Linear;

/// A linear layer's weight `[n, k]`: bf16, FP8 (W8A8), or NVFP4 (weight-only, exact).
#[derive(Clone)]
pub enum CpuWeight {
    Bf16 { w: Vec<bf16>, n: usize, k: usize },
    Fp8(Fp8Linear),
    Nvfp4(Nvfp4Linear),
}

impl CpuWeight {
    pub(super) fn k(&self) -> usize {
        match self {
            CpuWeight::Bf16 { k, .. } => *k,
            CpuWeight::Fp8(f) => f.k,
            CpuWeight::Nvfp4(f) => f.k,
        }
    }

    /// `rows` rows of `xs` (contiguous, `k` each) times the weight, unrounded.
    pub(super) fn apply(&self, xs: &[bf16], rows: usize) -> Vec<f64> {
        match self {
            CpuWeight::Bf16 { w, n, k } => gemm::linear(xs, w, rows, *n, *k),
            CpuWeight::Fp8(f) => {
                xs.chunks_exact(f.k).flat_map(|r| f.apply(&r.iter().map(|v| v.to_f32()).collect::<Vec<_>>())).collect()
            }
            CpuWeight::Nvfp4(f) => {
                xs.chunks_exact(f.k).flat_map(|r| f.apply(&r.iter().map(|v| v.to_f64()).collect::<Vec<_>>())).collect()
            }
        }
    }
}

/// A dense MLP (or expert) on one row: bf16 up projection, relu^2 in bf16, down (unrounded).
pub(super) fn mlp_row((up, down): (&CpuWeight, &CpuWeight), xr: &[bf16]) -> Vec<f64> {
    let h: Vec<bf16> =
        up.apply(xr, 1).into_iter().map(|v| bf16::from_f32(bf16::from_f64(v).to_f32().max(0.0).powi(2))).collect();
    down.apply(&h, 1)
}
