//! Launchers of the FP8 e4m3 quantization family (kernels-gpu/src/quant.rs; reference:
//! cpu/quant.rs).

use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut};
use half::bf16;
use kernels_gpu::quant::{
    EW_CHUNKS_PER_THREAD, MAX_GRID, QuantAmaxParams, QuantRowsParams, QuantStaticParams, QuantTensorParams,
    QuantTokenParams,
};
use kernels_gpu::{EW_BLOCK, Kernel, MAX_ROW_WIDTH, chunks, entry};

use crate::args::Len;
use crate::check::{Check, MAX_ELEMS, MAX_ROWS};
use crate::error::Result;
use crate::gpu::{Gpu, Grid};
use crate::moe::Dispatch;
use crate::norm::RowPath;

/// Rows of a `[rows, width]` buffer of `len` elements, checked.
fn rows_of(kernel: Kernel, len: usize, width: usize) -> Result<usize> {
    let c = Check(kernel.name());
    c.count("width", MAX_ROW_WIDTH as usize, width)?;
    c.that("x", len.is_multiple_of(width) && len > 0, format!("a non-empty multiple of width {width} elements"), len)?;
    c.count("rows", MAX_ROWS, len / width)?;
    Ok(len / width)
}

/// Blocks of a grid-stride launch over `n` elements (`n <= MAX_ELEMS`): the element-wise
/// kernels' (here, act.rs, nvfp4.rs).
pub(crate) fn elementwise_grid(n: usize) -> u32 {
    chunks(n as u32).div_ceil(EW_BLOCK * EW_CHUNKS_PER_THREAD).clamp(1, MAX_GRID)
}

/// Per-token dynamic FP8: `x` is `[rows, width]`; writes codes `q` (same shape) and one scale
/// per row, `s = max(min(amax, amax_ub) / 448, 1/(448*512))`, `q = e4m3(x / s)`.
pub fn quant_token(
    gpu: &Gpu,
    width: usize,
    x: &impl DevicePtr<bf16>,
    amax_ub: Option<f32>,
    q: &mut impl DevicePtrMut<u8>,
    scales: &mut impl DevicePtrMut<f32>,
) -> Result<()> {
    let path = RowPath::for_rows(x.len().checked_div(width).unwrap_or(0));
    quant_token_on(gpu, path, width, x, amax_ub, q, scales)
}

/// [`quant_token`] with the block shape given (tests and benches compare the two; the
/// results are the same bit for bit).
pub fn quant_token_on(
    gpu: &Gpu,
    path: RowPath,
    width: usize,
    x: &impl DevicePtr<bf16>,
    amax_ub: Option<f32>,
    q: &mut impl DevicePtrMut<u8>,
    scales: &mut impl DevicePtrMut<f32>,
) -> Result<()> {
    let k = entry::QUANT_TOKEN;
    let a = gpu.args(k);
    let rows = rows_of(k.kernel, x.len(), width)?;
    let p = QuantTokenParams {
        x: a.input("x", x, Len::Any)?,
        q: a.output("q", q, Len::Exactly(x.len()))?,
        scales: a.output("scales", scales, Len::Exactly(rows))?,
        rows: rows as u32,
        width: width as u32,
        amax_ub: Check(k.name()).amax_ub(amax_ub)?,
    };
    // SAFETY: x and q hold rows * width elements, scales rows, all checked; outputs are `&mut`;
    // grid/block/smem as quant_token_fp8_bf16 documents.
    unsafe { gpu.launch(Grid::new(k, (rows as u32, 1, 1)).threads(path.block(width as u32)), p) }
}

/// The rows an FP8 product takes as its input ([`quant_rows`]).
#[derive(Clone, Copy)]
pub enum Source<'a> {
    /// Every row of `x` in order, for one matrix (a linear layer).
    Plain,
    /// The grouped order of a dispatch: row j is row `token[j]` of `x` (the layer input) where
    /// `by_token`, else row j (the grouped hidden rows); its matrix is its expert.
    Grouped { d: &'a Dispatch, by_token: bool },
}

/// FP8 codes `q` and a scale per row (`scales`) of the rows `source` takes from `x`
/// (`width` wide) for a W8A8 product: static where `in_scale` is given (a scale per matrix:
/// each row's expert's, one for `Plain`), `q = e4m3(x / s)`; else dynamic per row as
/// [`quant_token`] without a bound. One launch.
pub fn quant_rows(
    gpu: &Gpu,
    width: usize,
    x: &impl DevicePtr<bf16>,
    source: Source<'_>,
    in_scale: Option<&CudaSlice<f32>>,
    q: &mut impl DevicePtrMut<u8>,
    scales: &mut impl DevicePtrMut<f32>,
) -> Result<()> {
    let k = entry::QUANT_ROWS;
    let args = gpu.args(k);
    let c = args.check();
    let sources = rows_of(k.kernel, x.len(), width)?;
    let (rows, token, offsets, matrices) = match source {
        Source::Plain => (sources, std::ptr::null(), std::ptr::null(), 1),
        Source::Grouped { d, by_token } => {
            d.check_filled(k.name())?;
            let need = if by_token { d.rows() } else { d.entries() };
            c.that("x", sources >= need, format!("at least {need} rows"), sources)?;
            let token = if by_token { args.input("token", d.token(), Len::Any)? } else { std::ptr::null() };
            (d.entries(), token, args.input("offsets", d.offsets(), Len::Any)?, d.experts())
        }
    };
    c.count("rows", MAX_ROWS, rows)?;
    let p = QuantRowsParams {
        x: args.input("x", x, Len::Any)?,
        token,
        in_scale: args.opt_input("in_scale", in_scale, Len::Exactly(matrices))?,
        offsets,
        q: args.output("q", q, Len::Exactly(rows * width))?,
        scales: args.output("scales", scales, Len::Exactly(rows))?,
        rows: rows as u32,
        width: width as u32,
        experts: matrices as u32,
    };
    let path = RowPath::for_rows(rows);
    // SAFETY: x holds `sources` rows of width, and a filled dispatch's tokens are below the
    // rows it was made for (at most sources where by_token), its offsets nondecreasing from 0
    // over its entries (= rows, at most sources otherwise); in_scale a scale per matrix, q and scales rows each (`&mut`);
    // grid/block/smem as quant_rows_fp8_bf16 documents.
    unsafe { gpu.launch(Grid::new(k, (rows as u32, 1, 1)).threads(path.block(width as u32)), p) }
}

/// Per-tensor dynamic FP8 over all of `x`: writes `amax = max |x|` (NaN ignored), the scale
/// `s = max(amax / 448, 1/(448*512))` and codes `q = e4m3(x * (1/s))`. Two launches.
pub fn quant_tensor(
    gpu: &Gpu,
    x: &impl DevicePtr<bf16>,
    q: &mut impl DevicePtrMut<u8>,
    amax: &mut impl DevicePtrMut<f32>,
    scale: &mut impl DevicePtrMut<f32>,
) -> Result<()> {
    let (ka, kq) = (gpu.args(entry::QUANT_AMAX), gpu.args(entry::QUANT_TENSOR));
    let n = x.len();
    ka.check().count("x", MAX_ELEMS, n)?;
    let pa = QuantAmaxParams {
        x: ka.input("x", x, Len::Any)?,
        amax: ka.output("amax", amax, Len::Exactly(1))?,
        scratch: gpu.counters() as *mut u32,
        n: n as u32,
    };
    let pq = QuantTensorParams {
        x: pa.x,
        amax: pa.amax,
        q: kq.output("q", q, Len::Exactly(n))?,
        scale: kq.output("scale", scale, Len::Exactly(1))?,
        n: n as u32,
    };
    let grid = elementwise_grid(n);
    // SAFETY: x holds n elements, amax one; the scratch is two of the Gpu's zeroed counters,
    // which the kernel leaves zero (every kernel waits for the one before it before it touches
    // them); any grid, block EW_BLOCK, smem AMAX_SMEM_BYTES as quant_amax_bf16 documents.
    unsafe { gpu.launch(Grid::new(entry::QUANT_AMAX, (grid, 1, 1)), pa)? };
    // SAFETY: x and q hold n elements, amax and scale one each (distinct `&mut` buffers, so
    // the scale write cannot race the amax reads); runs after the amax launch on the stream,
    // with its grid.
    unsafe { gpu.launch(Grid::new(entry::QUANT_TENSOR, (grid, 1, 1)), pq) }
}

/// Static-scale FP8 (a checkpoint's `input_scale`): `q = e4m3(x / scale)`.
pub fn quant_static(gpu: &Gpu, x: &impl DevicePtr<bf16>, scale: f32, q: &mut impl DevicePtrMut<u8>) -> Result<()> {
    let k = entry::QUANT_STATIC;
    let a = gpu.args(k);
    let n = x.len();
    a.check().count("x", MAX_ELEMS, n)?;
    a.check().positive("scale", scale)?;
    let p =
        QuantStaticParams { x: a.input("x", x, Len::Any)?, q: a.output("q", q, Len::Exactly(n))?, n: n as u32, scale };
    // SAFETY: x and q hold n elements, q is `&mut`; any grid, block EW_BLOCK.
    unsafe { gpu.launch(Grid::new(k, (elementwise_grid(n), 1, 1)), p) }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::check::arg_of;

    #[test]
    fn rows_of_checks_width_and_length() {
        let k = Kernel::QuantToken;
        assert_eq!(rows_of(k, 64 * 2688, 2688).unwrap(), 64);
        assert_eq!(arg_of(rows_of(k, 64 * 2688 + 1, 2688)), "x");
        assert_eq!(arg_of(rows_of(k, 0, 2688)), "x");
        assert_eq!(arg_of(rows_of(k, 10, 0)), "width");
        assert_eq!(arg_of(rows_of(k, 40000, 40000)), "width");
    }

    #[test]
    fn elementwise_grid_is_bounded() {
        assert_eq!(elementwise_grid(1), 1);
        assert_eq!(elementwise_grid((EW_BLOCK * EW_CHUNKS_PER_THREAD * 8) as usize + 1), 2);
        assert_eq!(elementwise_grid(MAX_ELEMS), MAX_GRID);
    }
}
