//! Linear layers and the dense MLP on the CUDA backend: a weight on the device ([`CudaWeight`],
//! bf16, FP8 codes with their scales, or NVFP4 codes with theirs) and the kernel it runs
//! through, by rows and weight kind ([`CudaWeight::forward`]).

use std::borrow::Cow;

use half::bf16;
use host::gemv::{self, Proj, gemv, gemv_split};
use host::grouped::linear_fp8;
use host::{CudaSlice, CudaView, CudaViewMut, Gpu};

use super::unsupported;
use crate::error::{Error, Result};
use crate::layout::Linear;
use crate::weights::Dtype;

/// A weight `[n, k]` on the device.
pub struct CudaWeight {
    pub(super) w: Weights,
    pub(super) n: usize,
    pub(super) k: usize,
}

/// Weights of one shape, of one layer or of all experts of a MoE projection.
pub(super) enum Weights {
    Bf16(CudaSlice<bf16>),
    /// e4m3 codes, a weight scale per matrix, and input scales per matrix when static.
    Fp8 {
        codes: CudaSlice<u8>,
        w_scale: CudaSlice<f32>,
        in_scale: Option<CudaSlice<f32>>,
    },
    /// NVFP4 rows as the kernels take them ([`host::nvfp4::pack_rows`]: each row's e2m1 codes,
    /// then its e4m3 block scales) and a per-tensor scale per matrix; run weight-only.
    Nvfp4 {
        rows: CudaSlice<u8>,
        global: CudaSlice<f32>,
    },
}

impl Weights {
    /// The launchers' view of them.
    pub(super) fn view(&self) -> gemv::Weights<'_> {
        match self {
            Weights::Bf16(w) => gemv::Weights::Bf16(w),
            Weights::Fp8 { codes, w_scale, in_scale } => {
                gemv::Weights::Fp8 { codes, w_scale, in_scale: in_scale.as_ref() }
            }
            Weights::Nvfp4 { rows, global } => gemv::Weights::Nvfp4 { rows, global },
        }
    }

    /// `matrices` NVFP4 matrices of `[n, k]` dequantized to bf16 into a temporary
    /// ([`host::nvfp4::to_bf16`]), for the bf16 GEMMs of many rows; other weights are an error.
    pub(super) fn dequantized(&self, g: &Gpu, matrices: usize, (n, k): (usize, usize)) -> Result<host::Buffer<bf16>> {
        // SAFETY: to_bf16 writes all matrices * n * k values before they are read (it refuses
        // weights that are not NVFP4 before it launches).
        let mut w = unsafe { g.scratch::<bf16>(matrices * n * k) }?;
        host::nvfp4::to_bf16(g, self.view(), matrices, (n, k), &mut *w)?;
        Ok(w)
    }

    /// Uploads `list` (all of `shape`, all bf16, all NVFP4, or all FP8 with or without input
    /// scales) into one buffer, with room for `spare` more matrices after them (zeros, their
    /// scales 1, for the shared expert's pieces to be written there).
    pub(super) fn upload(gpu: &Gpu, list: &[&Linear], shape: [usize; 2], spare: usize) -> Result<Weights> {
        let first = list.first().ok_or_else(|| Error::Unsupported("no weights to upload".into()))?;
        let size = shape[0] * shape[1];
        for l in list {
            check_linear(l, shape, "its siblings'")?;
            if l.fp8.is_some() != first.fp8.is_some()
                || l.nvfp4.is_some() != first.nvfp4.is_some()
                || l.fp8.map(|f| f.input_scale.is_some()) != first.fp8.map(|f| f.input_scale.is_some())
            {
                return Err(Error::Unsupported(format!(
                    "`{}` mixes formats (bf16, FP8, NVFP4), or static and dynamic FP8 inputs, with `{}`",
                    l.weight.name, first.weight.name
                )));
            }
        }
        if first.nvfp4.is_some() {
            let [n, k] = shape;
            let mut rows = Vec::with_capacity((list.len() + spare) * n * host::nvfp4::row_bytes(k));
            let mut global = Vec::with_capacity(list.len());
            for l in list {
                let s = l.nvfp4.ok_or_else(|| unsupported("NVFP4 without scales"))?;
                rows.extend(host::nvfp4::pack_rows(l.weight.bytes, s.block.bytes, n, k)?);
                global.push(s.global);
            }
            rows.resize((list.len() + spare) * n * host::nvfp4::row_bytes(k), 0);
            global.resize(list.len() + spare, 1.0);
            return Ok(Weights::Nvfp4 { rows: gpu.upload(&rows)?, global: gpu.upload(&global)? });
        }
        if first.fp8.is_none() {
            let mut w = gpu.zeros::<bf16>((list.len() + spare) * size)?;
            for (i, l) in list.iter().enumerate() {
                put_bf16(gpu, l, &mut w.slice_mut(i * size..(i + 1) * size))?;
            }
            return Ok(Weights::Bf16(w));
        }
        let mut codes = gpu.zeros::<u8>((list.len() + spare) * size)?;
        for (i, l) in list.iter().enumerate() {
            if l.weight.dtype != Dtype::F8E4M3 {
                return Err(Error::Unsupported(format!(
                    "`{}`: FP8 scales on a {:?} weight",
                    l.weight.name, l.weight.dtype
                )));
            }
            gpu.upload_bytes_into(l.weight.bytes, &mut codes.slice_mut(i * size..(i + 1) * size))?;
        }
        let scales = |f: fn(&Linear) -> Option<f32>| {
            let mut v = list.iter().map(|l| f(l)).collect::<Option<Vec<f32>>>()?;
            v.resize(list.len() + spare, 1.0);
            Some(v)
        };
        let w_scale = gpu.upload(&scales(|l| l.fp8.map(|f| f.weight_scale)).unwrap_or_default())?;
        let in_scale = scales(|l| l.fp8.and_then(|f| f.input_scale)).map(|s| gpu.upload(&s)).transpose()?;
        Ok(Weights::Fp8 { codes, w_scale, in_scale })
    }
}

/// Shortest input of a bf16 linear layer that runs at one row through the split mode of the
/// gemv kernels ([`gemv_split`]) rather than their warp mode ([`gemv`]), whose one warp per
/// weight row needs more round trips on long rows.
pub const SPLIT_MIN_K: usize = 3072;

/// Most rows of an FP8 linear layer that run through the gemv kernels; more run through an
/// FP8 GEMM ([`linear_fp8`]: cuBLASLt's with a static input scale). On the H200 (`cargo bench
/// --bench gemv -- fp8/`, static input scale, the quantization launch included) at 16 rows the
/// gemv (on tensor cores from 2 rows, eight rows a pass: `host::gemv::FP8_TC_MIN_ROWS`) took
/// 17.9 us against cuBLASLt's FP8 20.5 for q (4096 x 2688) and 17.3 against 20.5 for the shared
/// expert's up projection, but 36.8 against 33.8 for Mamba's in_proj (10304 x 2688); at 64 rows
/// 47.8 against 21.4 for q.
pub const FP8_GEMV_MAX_ROWS: usize = 8;

/// Most rows of an NVFP4 linear layer that run through the gemv kernels (weight-only, from the
/// codes: the warp mode at one row, the tensor cores from `host::gemv::NVFP4_TC_MIN_ROWS`,
/// eight rows a pass); more dequantize the weight to bf16 ([`Weights::dequantized`]) and go
/// through cuBLASLt. On the H200 (`cargo bench --bench gemv -- nvfp4/`, cold) at 32 rows the
/// tensor-core gemv took 43.6 us for Mamba's in_proj (10304 x 2688) against 54.2 dequantized and
/// through cuBLASLt, 26.3 against 28.1 for out_proj (2688 x 4096), 19.9 against 30.9 for q (4096
/// x 2688); at 64 rows 82.8 against 54.0 for in_proj (the two paths from two leases of the same
/// day).
pub const NVFP4_GEMV_MAX_ROWS: usize = 32;

impl CudaWeight {
    /// Uploads `l`'s weight (bf16, FP8 codes, or NVFP4 codes; no bias).
    pub(super) fn upload(gpu: &Gpu, l: &Linear) -> Result<CudaWeight> {
        let [n, k] = l.shape();
        Ok(CudaWeight { w: Weights::upload(gpu, &[l], [n, k], 0)?, n, k })
    }

    /// `y = f(x W^T)` for `rows` contiguous rows of `x`, `f` relu^2 (in bf16) when `relu2`:
    /// bf16 weights at one row through the gemv kernels' split mode (long rows) or warp mode
    /// (`cargo bench --bench gemv`: each at least as fast as cuBLASLt there, and chained to the
    /// launches around them), at more rows through cuBLASLt; FP8 weights through the warp
    /// mode, or past [`FP8_GEMV_MAX_ROWS`] rows an FP8 GEMM; NVFP4 weights through the gemv
    /// kernels, or past [`NVFP4_GEMV_MAX_ROWS`] rows dequantized to bf16 and through cuBLASLt.
    pub(super) fn forward(
        &self,
        g: &Gpu,
        x: &CudaView<bf16>,
        rows: usize,
        relu2: bool,
        y: &mut CudaViewMut<bf16>,
    ) -> Result<()> {
        match &self.w {
            Weights::Bf16(b) if rows == 1 && self.k >= SPLIT_MIN_K && !relu2 => {
                Ok(gemv_split(g, x, rows, b, (self.n, self.k), y)?)
            }
            Weights::Bf16(b) if rows != 1 => gemm_rows(g, x, rows, &b.as_view(), (self.n, self.k), relu2, y),
            Weights::Fp8 { .. }
                if rows > FP8_GEMV_MAX_ROWS && self.k.is_multiple_of(16) && self.n.is_multiple_of(8) =>
            {
                Ok(linear_fp8(g, (x, rows), Proj { w: self.w.view(), n: self.n, k: self.k, relu2 }, y)?)
            }
            Weights::Nvfp4 { .. } if rows > NVFP4_GEMV_MAX_ROWS => {
                let w = self.w.dequantized(g, 1, (self.n, self.k))?;
                gemm_rows(g, x, rows, &w.as_view(), (self.n, self.k), relu2, y)
            }
            weights => Ok(gemv(g, x, rows, Proj { w: weights.view(), n: self.n, k: self.k, relu2 }, y)?),
        }
    }
}

/// `y = f(x w^T)` over `rows` rows of `x` through cuBLASLt, `w [n, k]`, `f` as for
/// [`CudaWeight::forward`].
pub(super) fn gemm_rows(
    g: &Gpu,
    x: &CudaView<bf16>,
    rows: usize,
    w: &CudaView<bf16>,
    (n, k): (usize, usize),
    relu2: bool,
    y: &mut CudaViewMut<bf16>,
) -> Result<()> {
    host::gemm::linear(g, rows, x, w, n, k, y)?;
    if relu2 {
        host::act::relu2(g, y, rows * n)?;
    }
    Ok(())
}

/// `down(relu(up x)^2)` over `n` rows of `x`, into `out`.
pub(super) fn mlp_rows(
    g: &Gpu,
    x: &CudaView<bf16>,
    n: usize,
    (up, down): (&CudaWeight, &CudaWeight),
    out: &mut CudaViewMut<bf16>,
) -> Result<()> {
    // SAFETY: the up projection writes all n * up.n values before they are read.
    let mut h = unsafe { g.scratch::<bf16>(n * up.n) }?;
    up.forward(g, x, n, true, &mut h.as_view_mut())?;
    down.forward(g, &h.as_view(), n, false, out)
}

/// Uploads `l`'s weight into `dst` as bf16 ([`bf16_bytes`]: staged, no copy in between where it
/// is bf16).
pub(super) fn put_bf16(gpu: &Gpu, l: &Linear, dst: &mut CudaViewMut<bf16>) -> Result<()> {
    Ok(gpu.upload_bytes_into(&bf16_bytes(l)?, dst)?)
}

/// `l`'s weight as the bytes of bf16 values: its bytes as they are where it is bf16, else
/// converted (NVFP4 dequantized on the host: [`Linear::to_bf16`]).
pub(super) fn bf16_bytes<'a>(l: &Linear<'a>) -> Result<Cow<'a, [u8]>> {
    if l.weight.dtype == Dtype::Bf16 {
        return Ok(Cow::Borrowed(l.weight.bytes));
    }
    Ok(Cow::Owned(bytemuck::cast_slice(&l.to_bf16()?).to_vec()))
}

/// Fails unless `l` has `shape` (`whose`: whose shape that is, for the message) and no bias.
pub(super) fn check_linear(l: &Linear, shape: [usize; 2], whose: &str) -> Result<()> {
    if l.shape() != shape {
        return Err(Error::Unsupported(format!("`{}` has shape {:?}; {whose} is {shape:?}", l.weight.name, l.shape())));
    }
    if l.bias.is_some() {
        return Err(unsupported("biased linear layers"));
    }
    Ok(())
}
