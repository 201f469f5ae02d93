//! Linear layers through cuBLASLt (bf16 in and out, f32 accumulation); reference: cpu/gemm.rs.

use cudarc::cublaslt::{Matmul, MatmulConfig};
use cudarc::driver::{CudaView, DevicePtrMut};
use half::bf16;

use crate::check::Check;
use crate::error::{Error, Result};
use crate::gpu::Gpu;

/// The name shape errors of this entry carry (no PTX kernel runs here).
const NAME: &str = "linear_bf16";

/// `Y = X W^T` for row-major `X [m, k]`, `W [n, k]` (a checkpoint's `[out, in]` weight) and
/// `Y [m, n]`: a linear layer over `m` tokens. `x` and `w` are views (`buf.as_view()`, or
/// `buf.slice(range)` for rows of a larger buffer).
pub fn linear(
    gpu: &Gpu,
    m: usize,
    x: &CudaView<'_, bf16>,
    w: &CudaView<'_, bf16>,
    n: usize,
    k: usize,
    y: &mut impl DevicePtrMut<bf16>,
) -> Result<()> {
    let c = Check(NAME);
    for (arg, v) in [("m", m), ("n", n), ("k", k)] {
        c.count(arg, i32::MAX as usize, v)?;
    }
    c.len("x", m * k, x.len())?;
    c.len("w", n * k, w.len())?;
    c.len("y", m * n, y.len())?;
    // Row-major Y[m, n] = X W^T is column-major Y^T[n, m] = W^T' X^T', with W read as the
    // column-major [k, n] matrix it is in memory, transposed.
    let cfg = MatmulConfig {
        transa: true,
        transb: false,
        transc: false,
        m: n as u64,
        n: m as u64,
        k: k as u64,
        alpha: 1.0,
        lda: k as i64,
        ldb: k as i64,
        beta: 0.0,
        ldc: n as i64,
        stride_a: None,
        stride_b: None,
        stride_c: None,
        stride_bias: None,
        batch_size: None,
    };
    gpu.check_owner(NAME, "x", x)?;
    gpu.check_owner(NAME, "w", w)?;
    gpu.check_owner(NAME, "y", y)?;
    let blas = gpu.blas()?;
    // SAFETY: x holds m * k, w n * k and y m * n elements (checked), all of this Gpu's context
    // and ordered on its stream (cuBLASLt runs on it); y is `&mut`, so it aliases neither input.
    unsafe { blas.matmul(cfg, w, x, y, None, None) }.map_err(|source| Error::Cublas { during: "a bf16 GEMM", source })
}
