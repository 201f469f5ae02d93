//! Launchers of the RMSNorm family (kernels-gpu/src/norm.rs; reference: cpu/norm.rs).

use cudarc::driver::{DevicePtr, DevicePtrMut};
use half::bf16;
use kernels_gpu::norm::{GatedNormFp8Params, GatedNormParams, RmsNormParams, smem_bytes, w_stage_offset};
use kernels_gpu::{MAX_ROW_WIDTH, VEC, entry, row_block, row_block_many};

use crate::args::{Len, Rows};
use crate::check::{Check, MAX_ROWS};
use crate::error::Result;
use crate::gpu::{Gpu, Grid};

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
    /// For the gated norm of several groups: a block per group of a row, a chunk per thread
    /// (more blocks than rows for few rows); the other row kernels take it as [`RowPath::Few`].
    Group,
}

/// Rows from which the launchers pick [`RowPath::Many`] (H200: at 256 rows the few-rows shape
/// was faster, 4.80 against 6.40 us for the gated norm at 4096; at 512 about even).
pub const MANY_ROWS: usize = 512;

/// Rows below which the gated norm of several groups runs a block a group ([`RowPath::Group`]):
/// at 64 rows a block a row used 64 of the H200's 132 SMs (3.55 us against Triton's 2.35).
/// A first guess, not yet measured.
pub const GROUP_ROWS: usize = 128;

impl RowPath {
    /// The launchers' choice for `rows` rows.
    pub fn for_rows(rows: usize) -> RowPath {
        if rows >= MANY_ROWS { RowPath::Many } else { RowPath::Few }
    }

    /// Threads per block for rows of `width`.
    pub fn block(self, width: u32) -> u32 {
        match self {
            RowPath::Few | RowPath::Group => row_block(width),
            RowPath::Many => row_block_many(width),
        }
    }
}

/// Geometry of a norm launch: `rows` rows of `width` channels in `groups` equal groups (the
/// rows of x and z as [`Rows`] of it). Outputs are contiguous. `path`: the block shape, `None`
/// for [`RowPath::for_rows`] (tests and benches pick one).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct NormShape {
    pub rows: usize,
    pub width: usize,
    pub groups: usize,
    pub eps: f32,
    pub path: Option<RowPath>,
}

impl NormShape {
    /// The block shape picked by row count.
    pub fn new(rows: usize, width: usize, groups: usize, eps: f32) -> NormShape {
        NormShape { rows, width, groups, eps, path: None }
    }

    /// Threads per block of this shape's launch.
    fn block(&self) -> u32 {
        self.path.unwrap_or(RowPath::for_rows(self.rows)).block(self.width as u32)
    }

    /// Checks the geometry.
    pub(crate) fn check(&self, c: Check) -> Result<()> {
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
        c.positive("eps", self.eps)
    }
}

/// Plain RMSNorm: `y = w * x * rsqrt(mean(x^2) + eps)` per row (`shape.groups` must be 1).
pub fn rms_norm(
    gpu: &Gpu,
    shape: NormShape,
    x: Rows,
    w: &impl DevicePtr<bf16>,
    y: &mut impl DevicePtrMut<bf16>,
) -> Result<()> {
    let a = gpu.args(entry::NORM_RMS);
    a.check().that("groups", shape.groups == 1, "1 (plain RMSNorm)", shape.groups)?;
    shape.check(a.check())?;
    let (x, x_stride) = a.rows("x", &x, (shape.rows, shape.width))?;
    // SAFETY: `Args` proved x covers the shape's rows; with no add, x is only read.
    unsafe { launch_rms(gpu, shape, (x.cast_mut(), x_stride), std::ptr::null(), w, y) }
}

/// Launches `norm_rms_bf16` on checked rows (`x`: row 0 and the row stride).
///
/// # Safety
/// `x` covers the shape's rows (written back only with `add`, then as the launch's own
/// rows), `add` is null or holds `rows * width`, neither aliases `y`; `shape` passed `check`.
unsafe fn launch_rms(
    gpu: &Gpu,
    shape: NormShape,
    (x, x_stride): (*mut u16, u32),
    add: *const u16,
    w: &impl DevicePtr<bf16>,
    y: &mut impl DevicePtrMut<bf16>,
) -> Result<()> {
    let k = entry::NORM_RMS;
    let a = gpu.args(k);
    let p = RmsNormParams {
        x,
        add,
        w: a.input("w", w, Len::Exactly(shape.width))?,
        y: a.output("y", y, Len::Exactly(shape.rows * shape.width))?,
        rows: shape.rows as u32,
        width: shape.width as u32,
        x_stride,
        eps: shape.eps,
    };
    // SAFETY: the caller's contract; w = width and y = rows * width elements (Args), y is
    // `&mut`, so it aliases no input; grid/block/smem as norm_rms_bf16 documents.
    unsafe {
        gpu.launch(Grid::new(k, (shape.rows as u32, 1, 1)).threads(shape.block()).smem(smem_bytes(p.width, 1)), p)
    }
}

/// The residual add fused with the next RMSNorm: `h = bf16(h + add)`, then `y = rms_norm(h)`
/// (contiguous rows of h and add, `shape.groups == 1`).
pub fn add_rms_norm(
    gpu: &Gpu,
    shape: NormShape,
    h: &mut impl DevicePtrMut<bf16>,
    add: &impl DevicePtr<bf16>,
    w: &impl DevicePtr<bf16>,
    y: &mut impl DevicePtrMut<bf16>,
) -> Result<()> {
    let a = gpu.args(entry::NORM_RMS);
    a.check().that("groups", shape.groups == 1, "1 (plain RMSNorm)", shape.groups)?;
    shape.check(a.check())?;
    let n = Len::AtLeast(shape.rows * shape.width);
    let (h, add) = (a.output("h", h, n)?, a.input("add", add, n)?);
    // SAFETY: h (contiguous, checked) is `&mut`, so distinct from add and y; each block
    // writes back only its own row of h, each thread its own chunks.
    unsafe { launch_rms(gpu, shape, (h, shape.width as u32), add, w, y) }
}

/// Gated group RMSNorm (docs/MATH.md section 5): `u = x * silu(z)`, normalized per group.
pub fn gated_norm(
    gpu: &Gpu,
    shape: NormShape,
    x: Rows,
    z: Rows,
    w: &impl DevicePtr<bf16>,
    y: &mut impl DevicePtrMut<bf16>,
) -> Result<()> {
    let k = entry::NORM_GATED;
    let a = gpu.args(k);
    shape.check(a.check())?;
    let (x, x_stride) = a.rows("x", &x, (shape.rows, shape.width))?;
    let (z, z_stride) = a.rows("z", &z, (shape.rows, shape.width))?;
    let p = GatedNormParams {
        x,
        z,
        w: a.input("w", w, Len::Exactly(shape.width))?,
        y: a.output("y", y, Len::Exactly(shape.rows * shape.width))?,
        rows: shape.rows as u32,
        width: shape.width as u32,
        groups: shape.groups as u32,
        x_stride,
        z_stride,
        eps: shape.eps,
    };
    let per_group = match shape.path {
        Some(path) => path == RowPath::Group && shape.groups > 1,
        None => shape.groups > 1 && shape.rows < GROUP_ROWS,
    };
    let grid = if per_group { (shape.rows as u32, p.groups, 1) } else { (shape.rows as u32, 1, 1) };
    let (width, groups) = if per_group { (p.width / p.groups, 1) } else { (p.width, p.groups) };
    let threads = if per_group { row_block(width) } else { shape.block() };
    // SAFETY: `check` and `Args` proved the extents of x, z (strided), w and y and the group
    // count (dividing width into whole chunks); y is `&mut`; grid/block/smem as
    // norm_gated_bf16 documents for either shape.
    unsafe { gpu.launch(Grid::new(k, grid).threads(threads).smem(smem_bytes(width, groups)), p) }
}

/// Gated group RMSNorm fused with per-token FP8 e4m3 quantization of its bf16 output into
/// `(q, scales)`: the same codes and scales as [`gated_norm`] followed by
/// [`crate::quant::quant_token`].
pub fn gated_norm_fp8(
    gpu: &Gpu,
    shape: NormShape,
    (x, z): (Rows, Rows),
    w: &impl DevicePtr<bf16>,
    amax_ub: Option<f32>,
    (q, scales): (&mut impl DevicePtrMut<u8>, &mut impl DevicePtrMut<f32>),
) -> Result<()> {
    let k = entry::NORM_GATED_FP8;
    let a = gpu.args(k);
    shape.check(a.check())?;
    let (x, x_stride) = a.rows("x", &x, (shape.rows, shape.width))?;
    let (z, z_stride) = a.rows("z", &z, (shape.rows, shape.width))?;
    let p = GatedNormFp8Params {
        x,
        z,
        w: a.input("w", w, Len::Exactly(shape.width))?,
        q: a.output("q", q, Len::Exactly(shape.rows * shape.width))?,
        scales: a.output("scales", scales, Len::Exactly(shape.rows))?,
        rows: shape.rows as u32,
        width: shape.width as u32,
        groups: shape.groups as u32,
        x_stride,
        z_stride,
        eps: shape.eps,
        amax_ub: Check(k.name()).amax_ub(amax_ub)?,
    };
    // SAFETY: as in `gated_norm`, plus q = rows * width and scales = rows elements, both
    // `&mut`; grid/block/smem as norm_gated_fp8_bf16 documents.
    unsafe {
        gpu.launch(
            Grid::new(k, (shape.rows as u32, 1, 1)).threads(shape.block()).smem(w_stage_offset(p.width, p.groups)),
            p,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::check::arg_of;

    /// Rows of the shape's geometry, `stride` apart, for the pure check.
    fn rows_of(s: NormShape, stride: usize) -> Rows<'static, ()> {
        Rows { buf: &(), offset: 0, rows: s.rows, width: s.width, stride }
    }

    #[test]
    fn accepts_the_production_geometry() {
        let s = NormShape::new(64, 4096, 8, 1e-5);
        let c = Check(entry::NORM_GATED.name());
        s.check(c).unwrap();
        rows_of(s, 4096).check(c, "x", 64 * 4096).unwrap();
        // z: the gate's columns of in_proj's rows.
        rows_of(s, 10304).check(c, "z", 63 * 10304 + 4096).unwrap();
    }

    #[test]
    fn names_the_bad_argument() {
        let c = Check(entry::NORM_GATED.name());
        let bad = |shape: NormShape| arg_of(shape.check(c));
        assert_eq!(bad(NormShape::new(4, 4096, 7, 1e-5)), "groups");
        assert_eq!(bad(NormShape::new(4, 4096, 0, 1e-5)), "groups");
        assert_eq!(bad(NormShape::new(4, 4096, 4096 * 2, 1e-5)), "groups");
        assert_eq!(bad(NormShape::new(4, 1000, 8, 1e-5)), "groups"); // groups of 125
        assert_eq!(bad(NormShape::new(4, MAX_ROW_WIDTH as usize + 8, 1, 1e-5)), "width");
        assert_eq!(bad(NormShape::new(0, 4096, 8, 1e-5)), "rows");
        assert_eq!(bad(NormShape::new(4, 0, 1, 1e-5)), "width");
        assert_eq!(bad(NormShape::new(4, 4096, 8, 0.0)), "eps");
        assert_eq!(bad(NormShape::new(4, 4096, 8, f32::NAN)), "eps");
        let s = NormShape::new(4, 4096, 8, 1e-5);
        assert_eq!(arg_of(rows_of(s, 4096).check(c, "x", 4 * 4096 - 1)), "x");
        assert_eq!(arg_of(rows_of(s, 4095).check(c, "x", usize::MAX)), "x");
        assert_eq!(arg_of(rows_of(s, usize::MAX).check(c, "z", usize::MAX)), "z");
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
        let e = NormShape::new(2, 8, 3, 1e-5).check(Check(entry::NORM_GATED.name())).unwrap_err().to_string();
        assert_eq!(e, "norm_gated_bf16: argument `groups`: expected a divisor of width 8, got 3");
    }
}
