//! Launchers of the matrix-vector kernels (kernels-gpu/src/gemv.rs): linear layers at few rows,
//! and the weight checks the expert launchers (host/src/moe.rs) share with them.

use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut};
use half::bf16;
use kernels_gpu::Kernel;
use kernels_gpu::gemv::{DenseParams, Operands, SPLIT_BLOCK, SPLIT_ROWS, SplitParams, WARP_BLOCK, WARP_BLOCK_ROWS};

use crate::check::{Check, MAX_ELEMS};
use crate::error::Result;
use crate::gpu::Gpu;

/// The weights of one projection, `[matrices, n, k]`: one matrix for a linear layer, one per
/// expert for MoE. FP8 scales must be finite and > 0 (the model's layout checks a
/// checkpoint's); others give garbage, not unsafety.
#[derive(Clone, Copy)]
pub enum Weights<'a> {
    Bf16(&'a CudaSlice<bf16>),
    /// e4m3 codes with a weight scale per matrix and, for static activation quantization, an
    /// input scale per matrix (none: each input row gets its own scale).
    Fp8 {
        codes: &'a CudaSlice<u8>,
        w_scale: &'a CudaSlice<f32>,
        in_scale: Option<&'a CudaSlice<f32>>,
    },
}

impl Weights<'_> {
    /// Checks the shape `(n, k)` (k a multiple of 8) and that these are `matrices` of it with a
    /// scale each, for kernel `kern`.
    pub(crate) fn check(self, kern: Kernel, matrices: usize, (n, k): (usize, usize)) -> Result<()> {
        let c = Check(kern.name());
        c.count("n", MAX_ELEMS, n)?;
        c.count("k", MAX_ELEMS, k)?;
        c.that("k", k.is_multiple_of(8), "a multiple of 8", k)?;
        match self {
            Weights::Bf16(w) => c.len("w", matrices * n * k, w.len()),
            Weights::Fp8 { codes, w_scale, in_scale } => {
                c.len("w", matrices * n * k, codes.len())?;
                c.len("w_scale", matrices, w_scale.len())?;
                in_scale.map_or(Ok(()), |s| c.len("in_scale", matrices, s.len()))
            }
        }
    }
}

/// The [`Operands`] of a launch of `kern` (the warp mode's, or an expert kernel's), after
/// [`Weights::check`] and the checks of x and out.
pub(crate) fn operands(
    gpu: &Gpu,
    kern: Kernel,
    x: &impl DevicePtr<bf16>,
    w: Weights,
    out: &mut impl DevicePtrMut<bf16>,
    (n, k): (usize, usize),
    relu2: bool,
) -> Result<Operands> {
    let (w, w_scale, in_scale) = match w {
        Weights::Bf16(w) => (gpu.addr(kern, "w", w)?, 0, 0),
        Weights::Fp8 { codes, w_scale, in_scale } => (
            gpu.addr(kern, "w", codes)?,
            gpu.addr(kern, "w_scale", w_scale)?,
            gpu.opt_addr(kern, "in_scale", in_scale)?,
        ),
    };
    Ok(Operands {
        x: gpu.addr(kern, "x", x)? as *const u16,
        w: w as *const u8,
        w_scale: w_scale as *const f32,
        in_scale: in_scale as *const f32,
        out: gpu.addr_mut(kern, "out", out)? as *mut u16,
        relu2: u32::from(relu2),
        n: n as u32,
        k: k as u32,
    })
}

/// Most rows of a launch of the warp mode (each warp loops over them): 2^24 - 1, as for the
/// expert launches, whose kernels share its code.
const MAX_WARP_ROWS: usize = (1 << 24) - 1;

/// A linear layer at few rows: `out = f(x W^T)` for `rows` rows of `x`, `w [n, k]` one matrix,
/// `f` `relu(bf16(.))^2` when `relu2` (else the identity); a warp per pair of weight rows,
/// each streamed once for all the rows (a bandwidth-bound GEMV for small batches), and the FP8
/// path of linear layers (W8A8: each input row quantized to e4m3 first).
pub fn gemv(
    gpu: &Gpu,
    x: &impl DevicePtr<bf16>,
    rows: usize,
    w: Weights,
    (n, k): (usize, usize),
    relu2: bool,
    out: &mut impl DevicePtrMut<bf16>,
) -> Result<()> {
    let kern = match w {
        Weights::Bf16(_) => Kernel::Gemv,
        Weights::Fp8 { .. } => Kernel::GemvFp8,
    };
    let c = Check(kern.name());
    c.count("rows", MAX_WARP_ROWS, rows)?;
    w.check(kern, 1, (n, k))?;
    c.len("out", rows * n, out.len())?;
    c.len_at_least("x", rows * k, x.len())?;
    let p = DenseParams { o: operands(gpu, kern, x, w, out, (n, k), relu2)?, rows: rows as u32 };
    // SAFETY: x holds rows * k, w one matrix of n * k (and the scales one value each), out
    // rows * n; k is a multiple of 8.
    unsafe { gpu.launch(kern, ((n as u32).div_ceil(WARP_BLOCK_ROWS), 1, 1), WARP_BLOCK, 0, p) }
}

/// As [`gemv`] for bf16 weights, each weight row split along k over the threads of a block:
/// faster than [`gemv`] and than cuBLASLt (which splits k in a second launch) for a row or a
/// few of a long k.
pub fn gemv_split(
    gpu: &Gpu,
    x: &impl DevicePtr<bf16>,
    rows: usize,
    w: &CudaSlice<bf16>,
    (n, k): (usize, usize),
    out: &mut impl DevicePtrMut<bf16>,
) -> Result<()> {
    let kern = Kernel::GemvSplit;
    let c = Check(kern.name());
    c.count("rows", 65535, rows)?;
    Weights::Bf16(w).check(kern, 1, (n, k))?;
    c.len("out", rows * n, out.len())?;
    c.len_at_least("x", rows * k, x.len())?;
    let p = SplitParams {
        x: gpu.addr(kern, "x", x)? as *const u16,
        w: gpu.addr(kern, "w", w)? as *const u8,
        out: gpu.addr_mut(kern, "out", out)? as *mut u16,
        n: n as u32,
        k: k as u32,
    };
    // SAFETY: x holds rows * k, w n * k, out rows * n (a block row each, rows <= 65535); k is a
    // multiple of 8.
    unsafe { gpu.launch(kern, ((n as u32).div_ceil(SPLIT_ROWS), rows as u32, 1), SPLIT_BLOCK, 0, p) }
}
