//! Launchers of the matrix-vector kernels (kernels-gpu/src/gemv.rs): linear layers at few rows,
//! and the projections ([`Proj`], [`Weights`]) and their checked operands that the expert
//! launchers (host/src/moe.rs, host/src/grouped.rs) share with them.

use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut};
use half::bf16;
use kernels_gpu::gemv::{DenseParams, Operands, SPLIT_ROWS, SplitParams, WARP_BLOCK_ROWS};
use kernels_gpu::qgemv::QG_ROWS;
use kernels_gpu::{Entry, Kernel, entry, nvfp4};

use crate::args::{Args, Len};
use crate::check::{Check, MAX_ELEMS};
use crate::error::Result;
use crate::gpu::{Gpu, Grid};

/// The weights of one projection, `[matrices, n, k]`: one matrix for a linear layer, one per
/// expert for MoE (a [`Proj`]'s). FP8 and NVFP4 scales must be finite and > 0 (the model's
/// layout checks a checkpoint's); others give garbage, not unsafety.
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
    /// NVFP4 rows as [`kernels_gpu::nvfp4`] lays them out (e2m1 codes, then the row's e4m3
    /// block scales; [`crate::nvfp4::pack_rows`]) with a per-tensor scale per matrix, run
    /// weight-only (k a multiple of 16).
    Nvfp4 {
        rows: &'a CudaSlice<u8>,
        global: &'a CudaSlice<f32>,
    },
}

impl Weights<'_> {
    /// The kernel's pointers to `matrices` matrices of `[n, k]` (bf16, e4m3 codes or NVFP4
    /// rows, as bytes), the weight scales and the input scales (null where there are none),
    /// one per matrix.
    pub(crate) fn args(
        self,
        a: &Args,
        matrices: usize,
        (n, k): (usize, usize),
    ) -> Result<(*const u8, *const f32, *const f32)> {
        let (w, scale) = (Len::Exactly(matrices * n * k), Len::Exactly(matrices));
        match self {
            Weights::Bf16(w16) => Ok((a.input("w", w16, w)?.cast(), std::ptr::null(), std::ptr::null())),
            Weights::Fp8 { codes, w_scale, in_scale } => Ok((
                a.input("w", codes, w)?,
                a.input("w_scale", w_scale, scale)?,
                a.opt_input("in_scale", in_scale, scale)?,
            )),
            Weights::Nvfp4 { rows, global } => {
                a.check().that("k", k.is_multiple_of(nvfp4::BLOCK), "a multiple of 16 (NVFP4 blocks)", k)?;
                let w = Len::Exactly(matrices * n * nvfp4::row_bytes(k));
                Ok((a.input("w", rows, w)?, a.input("w_scale", global, scale)?, std::ptr::null()))
            }
        }
    }
}

/// A projection `f(x W^T)` of rows of x: weights `w` of `[matrices, n, k]` (`W`: [`Weights`],
/// or bf16 ones), `f` `relu(bf16(.))^2` when `relu2`, else the identity.
#[derive(Clone, Copy)]
pub struct Proj<W> {
    pub w: W,
    pub n: usize,
    pub k: usize,
    pub relu2: bool,
}

impl<W> Proj<W> {
    /// Checks n and k (a multiple of 8: the kernels' 16-byte loads).
    pub(crate) fn check(&self, c: Check) -> Result<()> {
        c.count("n", MAX_ELEMS, self.n)?;
        c.count("k", MAX_ELEMS, self.k)?;
        c.that("k", self.k.is_multiple_of(8), "a multiple of 8", self.k)
    }
}

impl Proj<Weights<'_>> {
    /// The [`Operands`] of a launch (the warp mode's, or an expert kernel's) of `matrices` of
    /// these weights on `x_rows` rows of `x`, writing `out_rows` rows of `out`.
    pub(crate) fn operands(
        &self,
        a: &Args,
        (x, x_rows): (&impl DevicePtr<bf16>, usize),
        matrices: usize,
        (out, out_rows): (&mut impl DevicePtrMut<bf16>, usize),
    ) -> Result<Operands> {
        self.check(a.check())?;
        let (w, w_scale, in_scale) = self.w.args(a, matrices, (self.n, self.k))?;
        Ok(Operands {
            x: a.input("x", x, Len::AtLeast(x_rows * self.k))?,
            w,
            w_scale,
            in_scale,
            out: a.output("out", out, Len::Exactly(out_rows * self.n))?,
            relu2: u32::from(self.relu2),
            n: self.n as u32,
            k: self.k as u32,
        })
    }
}

/// Fewest rows of an FP8 projection (a linear layer's, or an expert launch's tokens) that run on
/// tensor cores (kernels-gpu/src/qgemv.rs) rather than the warp mode. On the H200 (`cargo bench
/// --bench gemv -- m1/`, `m8/`, cold) the warp mode took 6.66 us at one row for q (4096 x 2688)
/// and 12.54 for Mamba's in_proj (10304 x 2688), the tensor-core kernel 7.73 and 18.05 (as
/// first built); at eight rows the tensor-core kernel 7.78 and 18.16 against the warp mode's
/// 31.10 for q (it streams the weights once per row). FP8 `Engine::step` at decode batch 8 and
/// 64 went from 9.476 and 34.489 ms to 7.222 and 22.457 (docs/PERFORMANCE.md).
pub const FP8_TC_MIN_ROWS: usize = 2;

/// Fewest rows of an NVFP4 linear layer, and fewest dispatched rows an expert on average of an
/// expert launch, that run on tensor cores (kernels-gpu/src/qgemv.rs) rather than the warp mode.
/// On the H200 (`cargo bench --bench gemv -- nvfp4/`, cold) the tensor-core kernel took 12.86 us
/// at one row for Mamba's in_proj (10304 x 2688) against the warp mode's 12.54, 6.52 against
/// 5.28 for q (4096 x 2688), and 14.31 and 6.74 at eight rows, where the warp mode had taken
/// 75.13 and 31.13. NVFP4 `Engine::step` at decode batch 8 (48 choices over 128 experts, most
/// given one row) took 7.128 ms with every expert launch on tensor cores, 6.224 (the next lease)
/// with them in the warp mode.
pub const NVFP4_TC_MIN_ROWS: usize = 2;

/// Most rows of a launch of the warp mode (each warp loops over them): 2^24 - 1, as for the
/// expert launches, whose kernels share its code.
const MAX_WARP_ROWS: usize = (1 << 24) - 1;

/// A linear layer at few rows: `out = f(x W^T)` for `rows` rows of `x`, one matrix of weights
/// `[n, k]`, each weight row streamed once for all the rows (a bandwidth-bound GEMV for small
/// batches): bf16 weights a warp per pair of weight rows (kernels-gpu/src/gemv.rs); FP8 ones
/// (W8A8: each input row quantized to e4m3 first) the same way at one row, on tensor cores from
/// [`FP8_TC_MIN_ROWS`] ([`gemv_tc`]); NVFP4 ones (weight-only) as bf16's at one row, on tensor
/// cores from [`NVFP4_TC_MIN_ROWS`].
pub fn gemv(
    gpu: &Gpu,
    x: &impl DevicePtr<bf16>,
    rows: usize,
    p: Proj<Weights>,
    out: &mut impl DevicePtrMut<bf16>,
) -> Result<()> {
    let kern = match p.w {
        Weights::Bf16(_) => entry::GEMV,
        Weights::Fp8 { .. } if rows < FP8_TC_MIN_ROWS => entry::GEMV_FP8,
        Weights::Nvfp4 { .. } if rows < NVFP4_TC_MIN_ROWS => entry::GEMV_NVFP4,
        _ => return gemv_tc(gpu, x, rows, p, out),
    };
    dense(gpu, (kern, WARP_BLOCK_ROWS), x, rows, p, out)
}

/// [`gemv`] of FP8 or NVFP4 weights on tensor cores (kernels-gpu/src/qgemv.rs): eight rows of
/// x a pass over the weights, at any number of rows (bf16 weights are refused).
pub fn gemv_tc(
    gpu: &Gpu,
    x: &impl DevicePtr<bf16>,
    rows: usize,
    p: Proj<Weights>,
    out: &mut impl DevicePtrMut<bf16>,
) -> Result<()> {
    let kern = match p.w {
        Weights::Fp8 { .. } => entry::GEMV_TC_FP8,
        Weights::Nvfp4 { .. } => entry::GEMV_TC_NVFP4,
        Weights::Bf16(_) => {
            return Err(crate::Error::Shape {
                kernel: Kernel::GemvTcFp8.name(),
                arg: "w",
                expected: "FP8 or NVFP4 weights".into(),
                got: "bf16 weights".into(),
            });
        }
    };
    dense(gpu, (kern, QG_ROWS), x, rows, p, out)
}

/// A launch of a dense gemv kernel with its weight rows a block.
fn dense(
    gpu: &Gpu,
    (kern, block_rows): (Entry<DenseParams>, u32),
    x: &impl DevicePtr<bf16>,
    rows: usize,
    p: Proj<Weights>,
    out: &mut impl DevicePtrMut<bf16>,
) -> Result<()> {
    let a = gpu.args(kern);
    a.check().count("rows", MAX_WARP_ROWS, rows)?;
    let params = DenseParams { o: p.operands(&a, (x, rows), 1, (out, rows))?, rows: rows as u32 };
    // SAFETY: x holds rows * k, w one matrix of n rows of k (the scales one value each), out
    // rows * n; k is a multiple of 8 (NVFP4: 16); the caller pairs the kernel with its rows a block.
    unsafe { gpu.launch(Grid::new(kern, ((p.n as u32).div_ceil(block_rows), 1, 1)), params) }
}

/// As [`gemv`] for bf16 weights and no activation, each weight row split along k over the
/// threads of a block: faster than [`gemv`] and than cuBLASLt (which splits k in a second
/// launch) for a row or a few of a long k.
pub fn gemv_split(
    gpu: &Gpu,
    x: &impl DevicePtr<bf16>,
    rows: usize,
    w: &CudaSlice<bf16>,
    (n, k): (usize, usize),
    out: &mut impl DevicePtrMut<bf16>,
) -> Result<()> {
    let kern = entry::GEMV_SPLIT;
    let a = gpu.args(kern);
    a.check().count("rows", 65535, rows)?;
    let proj = Proj { w: Weights::Bf16(w), n, k, relu2: false };
    let o = proj.operands(&a, (x, rows), 1, (out, rows))?;
    let p = SplitParams { x: o.x, w: o.w, out: o.out, n: o.n, k: o.k };
    // SAFETY: x holds rows * k, w n * k, out rows * n (a block row each, rows <= 65535); k is a
    // multiple of 8.
    unsafe { gpu.launch(Grid::new(kern, ((n as u32).div_ceil(SPLIT_ROWS), rows as u32, 1)), p) }
}
