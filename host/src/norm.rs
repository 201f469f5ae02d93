//! Launchers of the RMSNorm family (kernels-gpu/src/norm.rs; reference: cpu/norm.rs).

use cudarc::driver::{DevicePtr, DevicePtrMut};
use half::bf16;
use kernels_gpu::norm::{GatedNormFp8Params, GatedNormParams, RmsNormParams, smem_bytes};
use kernels_gpu::{Kernel, MAX_ROW_WIDTH, VEC, row_block, row_block_many};

use crate::check::{Check, MAX_ROWS};
use crate::error::Result;
use crate::gpu::Gpu;

/// The block shape a row kernel (the norms, per-token quantization) runs with: one block per
/// row either way, the same kernel and the same results bit for bit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RowPath {
    /// [`row_block`]: a chunk per thread up to 1024 threads, the shortest time for a row alone
    /// (decode).
    Few,
    /// [`row_block_many`]: four chunks per thread, so an SM holds several rows with all their
    /// loads in flight: the copy bandwidth at many rows (prefill).
    Many,
}

/// Rows from which the launchers pick [`RowPath::Many`] (H200: at 256 rows the few-rows shape
/// was faster, 4.80 against 6.40 us for the gated norm at 4096; at 512 about even).
pub const MANY_ROWS: usize = 512;

impl RowPath {
    /// The launchers' choice for `rows` rows.
    pub fn for_rows(rows: usize) -> RowPath {
        if rows >= MANY_ROWS { RowPath::Many } else { RowPath::Few }
    }

    /// Threads per block for rows of `width`.
    pub fn block(self, width: u32) -> u32 {
        match self {
            RowPath::Few => row_block(width),
            RowPath::Many => row_block_many(width),
        }
    }
}

/// Geometry of a norm launch: `rows` rows of `width` channels in `groups` equal groups; row r
/// of x starts at element `r * x_stride` (and of z at `r * z_stride`). Outputs are contiguous.
/// `path`: the block shape, `None` for [`RowPath::for_rows`] (tests and benches pick one).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct NormShape {
    pub rows: usize,
    pub width: usize,
    pub groups: usize,
    pub x_stride: usize,
    pub z_stride: usize,
    pub eps: f32,
    pub path: Option<RowPath>,
}

impl NormShape {
    /// Contiguous rows (strides = width), the block shape picked by row count.
    pub fn new(rows: usize, width: usize, groups: usize, eps: f32) -> NormShape {
        NormShape { rows, width, groups, x_stride: width, z_stride: width, eps, path: None }
    }

    /// Threads per block of this shape's launch.
    fn block(&self) -> u32 {
        self.path.unwrap_or(RowPath::for_rows(self.rows)).block(self.width as u32)
    }

    /// Checks the geometry and buffer lengths of `kernel`'s launch. `z` is the gate's length
    /// (gated kernels), `outs` the lengths and names of the outputs with their expected size
    /// in units of rows (`rows * per_row`).
    pub(crate) fn check(
        &self,
        kernel: Kernel,
        x: usize,
        z: Option<usize>,
        w: usize,
        outs: &[(&'static str, usize, usize)],
    ) -> Result<()> {
        let c = Check(kernel.name());
        c.count("rows", MAX_ROWS, self.rows)?;
        c.count("width", MAX_ROW_WIDTH as usize, self.width)?;
        c.count("groups", self.width, self.groups)?;
        c.that(
            "groups",
            self.width.is_multiple_of(self.groups),
            format!("a divisor of width {}", self.width),
            self.groups,
        )?;
        let gs = self.width / self.groups;
        c.that(
            "groups",
            self.groups == 1 || gs.is_multiple_of(VEC as usize),
            format!("1, or a group size (width / groups) that is a multiple of {VEC}"),
            format!("{} groups of {gs}", self.groups),
        )?;
        c.positive("eps", self.eps)?;
        let rows_extent = |stride: usize| (self.rows - 1).checked_mul(stride).and_then(|v| v.checked_add(self.width));
        let mut strided = vec![("x", self.x_stride, x)];
        if let Some(z) = z {
            strided.push(("z", self.z_stride, z));
        }
        for (arg, stride, len) in strided {
            c.that(arg, stride >= self.width, format!("a row stride >= width {}", self.width), stride)?;
            let need = rows_extent(stride);
            c.that(arg, need.is_some(), "an extent that fits in usize", format!("stride {stride}"))?;
            c.len_at_least(arg, need.unwrap_or(0), len)?;
        }
        c.len("w", self.width, w)?;
        for &(arg, per_row, len) in outs {
            c.len(arg, self.rows * per_row, len)?;
        }
        Ok(())
    }
}

/// Plain RMSNorm: `y = w * x * rsqrt(mean(x^2) + eps)` per row (`shape.groups` must be 1).
pub fn rms_norm(
    gpu: &Gpu,
    shape: NormShape,
    x: &impl DevicePtr<bf16>,
    w: &impl DevicePtr<bf16>,
    y: &mut impl DevicePtrMut<bf16>,
) -> Result<()> {
    let k = Kernel::NormRms;
    Check(k.name()).that("groups", shape.groups == 1, "1 (plain RMSNorm)", shape.groups)?;
    shape.check(k, x.len(), None, w.len(), &[("y", shape.width, y.len())])?;
    let x = gpu.addr(k, "x", x)? as *mut u16;
    // SAFETY: `check` proved x covers rows * x_stride elements; with no add, x is only read.
    unsafe { launch_rms(gpu, shape, x, core::ptr::null(), w, y) }
}

/// Launches `norm_rms_bf16` on checked rows.
///
/// # Safety
/// `x` covers the shape's rows (written back only with `add`, then as the launch's own
/// rows), `add` is null or holds `rows * width`, neither aliases `y`; `shape` passed `check`.
unsafe fn launch_rms(
    gpu: &Gpu,
    shape: NormShape,
    x: *mut u16,
    add: *const u16,
    w: &impl DevicePtr<bf16>,
    y: &mut impl DevicePtrMut<bf16>,
) -> Result<()> {
    let k = Kernel::NormRms;
    let p = RmsNormParams {
        x,
        add,
        w: gpu.addr(k, "w", w)? as *const u16,
        y: gpu.addr_mut(k, "y", y)? as *mut u16,
        rows: shape.rows as u32,
        width: shape.width as u32,
        x_stride: shape.x_stride as u32,
        eps: shape.eps,
    };
    // SAFETY: the caller's contract; w = width and y = rows * width elements (check), y is
    // `&mut`, so it aliases no input; grid/block/smem as norm_rms_bf16 documents.
    unsafe { gpu.launch(k, (shape.rows as u32, 1, 1), shape.block(), smem_bytes(p.width, 1), p) }
}

/// The residual add fused with the next RMSNorm: `h = bf16(h + add)`, then `y = rms_norm(h)`
/// (contiguous rows: `shape.x_stride == width`, `shape.groups == 1`).
pub fn add_rms_norm(
    gpu: &Gpu,
    shape: NormShape,
    h: &mut impl DevicePtrMut<bf16>,
    add: &impl DevicePtr<bf16>,
    w: &impl DevicePtr<bf16>,
    y: &mut impl DevicePtrMut<bf16>,
) -> Result<()> {
    let k = Kernel::NormRms;
    let c = Check(k.name());
    c.that("groups", shape.groups == 1, "1 (plain RMSNorm)", shape.groups)?;
    c.that("h", shape.x_stride == shape.width, "contiguous rows", format!("stride {}", shape.x_stride))?;
    shape.check(k, h.len(), None, w.len(), &[("y", shape.width, y.len())])?;
    c.len_at_least("add", shape.rows * shape.width, add.len())?;
    let (h, add) = (gpu.addr_mut(k, "h", h)? as *mut u16, gpu.addr(k, "add", add)? as *const u16);
    // SAFETY: h (contiguous, checked) is `&mut`, so distinct from add and y; each block
    // writes back only its own row of h, each thread its own chunks.
    unsafe { launch_rms(gpu, shape, h, add, w, y) }
}

/// Gated group RMSNorm (docs/MATH.md section 5): `u = x * silu(z)`, normalized per group.
pub fn gated_norm(
    gpu: &Gpu,
    shape: NormShape,
    x: &impl DevicePtr<bf16>,
    z: &impl DevicePtr<bf16>,
    w: &impl DevicePtr<bf16>,
    y: &mut impl DevicePtrMut<bf16>,
) -> Result<()> {
    let k = Kernel::NormGated;
    shape.check(k, x.len(), Some(z.len()), w.len(), &[("y", shape.width, y.len())])?;
    let p = GatedNormParams {
        x: gpu.addr(k, "x", x)? as *const u16,
        z: gpu.addr(k, "z", z)? as *const u16,
        w: gpu.addr(k, "w", w)? as *const u16,
        y: gpu.addr_mut(k, "y", y)? as *mut u16,
        rows: shape.rows as u32,
        width: shape.width as u32,
        groups: shape.groups as u32,
        x_stride: shape.x_stride as u32,
        z_stride: shape.z_stride as u32,
        eps: shape.eps,
    };
    // SAFETY: `check` proved the extents of x, z (strided), w and y and the group count
    // (dividing width into whole chunks); y is `&mut`; grid/block/smem as norm_gated_bf16 documents.
    unsafe { gpu.launch(k, (shape.rows as u32, 1, 1), shape.block(), smem_bytes(p.width, p.groups), p) }
}

/// Gated group RMSNorm fused with per-token FP8 e4m3 quantization of its bf16 output: the
/// same codes and scales as [`gated_norm`] followed by [`crate::quant::quant_token`].
#[allow(clippy::too_many_arguments)]
pub fn gated_norm_fp8(
    gpu: &Gpu,
    shape: NormShape,
    x: &impl DevicePtr<bf16>,
    z: &impl DevicePtr<bf16>,
    w: &impl DevicePtr<bf16>,
    amax_ub: Option<f32>,
    q: &mut impl DevicePtrMut<u8>,
    scales: &mut impl DevicePtrMut<f32>,
) -> Result<()> {
    let k = Kernel::NormGatedFp8;
    shape.check(k, x.len(), Some(z.len()), w.len(), &[("q", shape.width, q.len()), ("scales", 1, scales.len())])?;
    let amax_ub = crate::quant::check_amax_ub(k, amax_ub)?;
    let p = GatedNormFp8Params {
        x: gpu.addr(k, "x", x)? as *const u16,
        z: gpu.addr(k, "z", z)? as *const u16,
        w: gpu.addr(k, "w", w)? as *const u16,
        q: gpu.addr_mut(k, "q", q)? as *mut u8,
        scales: gpu.addr_mut(k, "scales", scales)? as *mut f32,
        rows: shape.rows as u32,
        width: shape.width as u32,
        groups: shape.groups as u32,
        x_stride: shape.x_stride as u32,
        z_stride: shape.z_stride as u32,
        eps: shape.eps,
        amax_ub,
    };
    // SAFETY: as in `gated_norm`, plus q = rows * width and scales = rows elements, both
    // `&mut`; grid/block/smem as norm_gated_fp8_bf16 documents.
    unsafe { gpu.launch(k, (shape.rows as u32, 1, 1), shape.block(), smem_bytes(p.width, p.groups), p) }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Error;

    /// The argument a failed check names.
    fn arg_of(r: Result<()>) -> &'static str {
        match r {
            Err(Error::Shape { arg, .. }) => arg,
            other => panic!("expected a shape error, got {other:?}"),
        }
    }

    #[test]
    fn accepts_the_production_geometry() {
        let s = NormShape { z_stride: 10304, ..NormShape::new(64, 4096, 8, 1e-5) };
        s.check(Kernel::NormGated, 64 * 4096, Some(63 * 10304 + 4096), 4096, &[("y", 4096, 64 * 4096)]).unwrap();
    }

    #[test]
    fn names_the_bad_argument() {
        let s = NormShape::new(4, 4096, 8, 1e-5);
        let k = Kernel::NormGated;
        let ok_outs = [("y", 4096, 4 * 4096)];
        assert_eq!(arg_of(s.check(k, 4 * 4096 - 1, Some(4 * 4096), 4096, &ok_outs)), "x");
        assert_eq!(arg_of(s.check(k, 4 * 4096, Some(4096), 4096, &ok_outs)), "z");
        assert_eq!(arg_of(s.check(k, 4 * 4096, Some(4 * 4096), 4095, &ok_outs)), "w");
        assert_eq!(arg_of(s.check(k, 4 * 4096, Some(4 * 4096), 4096, &[("y", 4096, 4 * 4096 + 1)])), "y");
        let bad = |shape: NormShape| arg_of(shape.check(k, usize::MAX, Some(usize::MAX), shape.width, &[]));
        assert_eq!(bad(NormShape::new(4, 4096, 7, 1e-5)), "groups");
        assert_eq!(bad(NormShape::new(4, 4096, 0, 1e-5)), "groups");
        assert_eq!(bad(NormShape::new(4, 4096, 4096 * 2, 1e-5)), "groups");
        assert_eq!(bad(NormShape::new(4, 1000, 8, 1e-5)), "groups"); // groups of 125
        assert_eq!(bad(NormShape::new(4, MAX_ROW_WIDTH as usize + 8, 1, 1e-5)), "width");
        assert_eq!(bad(NormShape::new(0, 4096, 8, 1e-5)), "rows");
        assert_eq!(bad(NormShape::new(4, 0, 1, 1e-5)), "width");
        assert_eq!(bad(NormShape::new(4, 4096, 8, 0.0)), "eps");
        assert_eq!(bad(NormShape::new(4, 4096, 8, f32::NAN)), "eps");
        assert_eq!(bad(NormShape { x_stride: 4095, ..NormShape::new(4, 4096, 8, 1e-5) }), "x");
        assert_eq!(bad(NormShape { z_stride: usize::MAX, ..NormShape::new(4, 4096, 8, 1e-5) }), "z");
    }

    #[test]
    fn many_rows_take_four_chunks_a_thread() {
        assert_eq!(RowPath::for_rows(MANY_ROWS - 1), RowPath::Few);
        assert_eq!(RowPath::for_rows(MANY_ROWS), RowPath::Many);
        // 4096 = 512 chunks: 512 threads of one, or 128 of four; 2688 = 336 chunks on 96.
        assert_eq!((RowPath::Few.block(4096), RowPath::Many.block(4096)), (512, 128));
        assert_eq!((RowPath::Few.block(2688), RowPath::Many.block(2688)), (352, 96));
        assert_eq!((RowPath::Few.block(1), RowPath::Many.block(1)), (32, 32));
        assert_eq!(RowPath::Many.block(MAX_ROW_WIDTH), 1024);
    }

    #[test]
    fn message_says_kernel_argument_expected_and_got() {
        let s = NormShape::new(2, 8, 1, 1e-5);
        let e = s.check(Kernel::NormRms, 16, None, 7, &[]).unwrap_err().to_string();
        assert_eq!(e, "norm_rms_bf16: argument `w`: expected 8 elements, got 7 elements");
    }
}
