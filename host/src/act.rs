//! Launchers of the small row and element-wise kernels (kernels-gpu/src/act.rs).

use cudarc::driver::{DevicePtr, DevicePtrMut};
use half::bf16;
use kernels_gpu::act::{GatherParams, Relu2Params};
use kernels_gpu::entry;

use crate::args::Len;
use crate::check::{Check, MAX_ELEMS, MAX_ROWS};
use crate::error::Result;
use crate::gpu::{Gpu, Grid};
use crate::quant::elementwise_grid;

/// `x = bf16(relu(x)^2)` over the first `n` elements.
pub fn relu2(gpu: &Gpu, x: &mut impl DevicePtrMut<bf16>, n: usize) -> Result<()> {
    let k = entry::ACT_RELU2;
    let a = gpu.args(k);
    a.check().count("n", MAX_ELEMS, n)?;
    let p = Relu2Params { x: a.output("x", x, Len::AtLeast(n))?, n: n as u32 };
    // SAFETY: x holds at least n elements.
    unsafe { gpu.launch(Grid::new(k, (elementwise_grid(n), 1, 1)), p) }
}

/// `out[r] = table[idx[r]]`, rows of `width`; the indices are checked here (an index
/// outside the table is an error naming it) and uploaded.
pub fn gather(
    gpu: &Gpu,
    table: &impl DevicePtr<bf16>,
    width: usize,
    idx: &[u32],
    out: &mut impl DevicePtrMut<bf16>,
) -> Result<()> {
    let c = Check(entry::ACT_GATHER.name());
    c.count("width", MAX_ELEMS, width)?;
    let table_rows = table.len() / width;
    if let Some(&bad) = idx.iter().find(|&&i| i as usize >= table_rows) {
        c.that("idx", false, format!("row indices below {table_rows}"), bad)?;
    }
    gather_by(gpu, table, width, &gpu.upload(idx)?, out)
}

/// [`gather`] with the indices already on the device (e.g. written by a kernel): an index
/// outside the table traps the kernel, an error at the next synchronization.
pub fn gather_by(
    gpu: &Gpu,
    table: &impl DevicePtr<bf16>,
    width: usize,
    idx: &impl DevicePtr<u32>,
    out: &mut impl DevicePtrMut<bf16>,
) -> Result<()> {
    let k = entry::ACT_GATHER;
    let a = gpu.args(k);
    a.check().count("width", MAX_ELEMS, width)?;
    a.check().count("rows", MAX_ROWS, idx.len())?;
    let p = GatherParams {
        table: a.input("table", table, Len::Any)?,
        idx: a.input("idx", idx, Len::Any)?,
        out: a.output("out", out, Len::Exactly(idx.len() * width))?,
        rows: idx.len() as u32,
        width: width as u32,
        table_rows: (table.len() / width) as u32,
    };
    // SAFETY: the table holds table_rows * width, out rows * width; out is `&mut`. The index
    // buffer outlives the launch in stream order (cudarc frees on the same stream).
    unsafe { gpu.launch(Grid::new(k, (idx.len() as u32, 1, 1)), p) }
}
