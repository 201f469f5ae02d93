//! Launchers of the W4A4 NVFP4 family (kernels-gpu/src/w4a4.rs; reference: cpu/w4a4.rs): rows
//! of activations quantized to NVFP4 with a layer's static input scale ([`quantize`], every
//! arch), and the linear layer on block-scaled FP4 tensor cores ([`linear`], where the GPU's
//! PTX has them: sm_121a's `mma.sync`, sm_110a's `tcgen05`; elsewhere
//! [`crate::Error::NotInArch`]).

use cudarc::driver::{DevicePtr, DevicePtrMut};
use half::bf16;
use kernels_gpu::quant::MAX_GRID;
use kernels_gpu::tcgen05::{TC_M, TC_N};
use kernels_gpu::w4a4::{BLOCK, GEMM_COLS, GEMM_ROWS, GemmParams, MMA_K, QuantizeParams, row_bytes};
use kernels_gpu::{Kernel, entry};

use crate::args::{Len, Rows};
use crate::check::{Check, MAX_ELEMS};
use crate::error::Result;
use crate::gemv::Weights;
use crate::gpu::{Gpu, Grid};

/// Checks an input scale: finite, and at least 2^-100 (so `1 / scale` and every block's `g /
/// s` stay finite: the device and the CPU reference then quantize alike).
fn check_scale(c: Check, scale: f32) -> Result<()> {
    c.that("scale", scale.is_finite() && scale >= MIN_SCALE, "a finite input scale of at least 2^-100", scale)
}

/// The smallest input scale taken: 2^-100.
pub const MIN_SCALE: f32 = f32::from_bits((127 - 100) << 23);

/// Alignment of the NVFP4 rows' addresses: the kernels load and store them a 4-byte word at a
/// time, at 16-byte row starts.
const ROW_ALIGN: u64 = 16;

/// `out` = the `x.rows` rows of `k = x.width` activations as NVFP4 rows ([`row_bytes`]`(k)`
/// each; kernels-gpu's `w4a4::QuantizeParams` says how), with the layer's input `scale`.
pub fn quantize(gpu: &Gpu, x: Rows<'_>, scale: f32, out: &mut impl DevicePtrMut<u8>) -> Result<()> {
    let kern = entry::NVFP4_QUANTIZE;
    let a = gpu.args(kern);
    let c = a.check();
    let k = x.width;
    c.that("k", k.is_multiple_of(BLOCK) && k > 0, "a positive multiple of 16 (NVFP4 blocks)", k)?;
    c.count("rows * k", MAX_ELEMS, x.rows * k)?;
    check_scale(c, scale)?;
    let (x_ptr, stride) = a.rows("x", &x, (x.rows, k))?;
    let out = a.output("out", out, Len::Exactly(x.rows * row_bytes(k)))?;
    c.aligned("out", out as u64, ROW_ALIGN)?;
    let p = QuantizeParams { x: x_ptr, out, scale, stride, k: k as u32, rows: x.rows as u32 };
    let grid = (x.rows * k / BLOCK).div_ceil(kernels_gpu::EW_BLOCK as usize).clamp(1, MAX_GRID as usize) as u32;
    // SAFETY: x holds rows rows of k at the checked stride, out rows * row_bytes(k) bytes; k a
    // multiple of 16 and rows * k below 2^31.
    unsafe { gpu.launch(Grid::new(kern, (grid, 1, 1)), p) }
}

/// How [`linear`] forms its products.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Product {
    /// The block-scaled FP4 tensor cores where the GPU's PTX has them (`Gpu::has`): the
    /// `mma.sync` of `gemm_nvfp4_w4a4` (sm_121a), else `tcgen05` (`gemm_nvfp4_w4a4_tcgen05`,
    /// sm_110a).
    Native,
    /// The same kernel with the instruction emulated by the warp through shared memory
    /// (`gemm_nvfp4_w4a4_emulated`, every arch, many times slower): the test of its data path
    /// where no GPU of the sm_120a family is at hand.
    Emulated,
}

/// `y [m, n] = bf16(scale * global * a w^T)`: `a` the `m` NVFP4 rows of [`quantize`] (with
/// this `scale`), `w` an NVFP4 weight `[n, k]` ([`Weights::Nvfp4`]), k a multiple of 64; the
/// products by `product`.
pub fn linear(
    gpu: &Gpu,
    a: &impl DevicePtr<u8>,
    w: Weights<'_>,
    (m, n, k): (usize, usize, usize),
    scale: f32,
    product: Product,
    y: &mut impl DevicePtrMut<bf16>,
) -> Result<()> {
    let (kern, (rows, cols)) = match product {
        Product::Native if !gpu.has(Kernel::GemmNvfp4W4a4) && gpu.has(Kernel::GemmNvfp4W4a4Tcgen05) => {
            (entry::GEMM_NVFP4_W4A4_TCGEN05, (TC_M, TC_N))
        }
        Product::Native => (entry::GEMM_NVFP4_W4A4, (GEMM_ROWS, GEMM_COLS)),
        Product::Emulated => (entry::GEMM_NVFP4_W4A4_EMULATED, (GEMM_ROWS, GEMM_COLS)),
    };
    let args = gpu.args(kern);
    let c = args.check();
    c.that("w", matches!(w, Weights::Nvfp4 { .. }), "NVFP4 weights", "bf16 or FP8 weights")?;
    c.that("k", k.is_multiple_of(MMA_K as usize) && k > 0, "a positive multiple of 64", k)?;
    c.count("m * k", MAX_ELEMS, m * k)?;
    c.count("n * k", MAX_ELEMS, n * k)?;
    c.count("m * n", MAX_ELEMS, m * n)?;
    c.that("m", m > 0 && n > 0, "at least a row and a column", format!("{m} x {n}"))?;
    c.count("m", usize::from(u16::MAX) * rows as usize, m)?;
    check_scale(c, scale)?;
    let (w_ptr, global, _) = w.args(&args, 1, (n, k))?;
    let a = args.input("a", a, Len::Exactly(m * row_bytes(k)))?;
    c.aligned("a", a as u64, ROW_ALIGN)?;
    c.aligned("w", w_ptr as u64, ROW_ALIGN)?;
    let p = GemmParams {
        a,
        w: w_ptr,
        global,
        y: args.output("y", y, Len::Exactly(m * n))?,
        scale,
        m: m as u32,
        n: n as u32,
        k: k as u32,
    };
    let grid = ((n as u32).div_ceil(cols), (m as u32).div_ceil(rows), 1);
    // SAFETY: a holds m rows and w n rows of row_bytes(k), global one scale, y m * n; k a
    // multiple of 64; m * n below 2^31.
    unsafe { gpu.launch(Grid::new(kern, grid), p) }
}
