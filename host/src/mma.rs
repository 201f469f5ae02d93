//! Launcher of the tensor-core matrix product (kernels-gpu/src/mma.rs), the test of the
//! fragment and staging helpers the tensor-core kernels are built from.

use cudarc::driver::{DevicePtr, DevicePtrMut};
use half::bf16;
use kernels_gpu::entry;
use kernels_gpu::mma::{MATMUL_TILE, MatmulParams};

use crate::args::Len;
use crate::check::MAX_ROWS;
use crate::error::Result;
use crate::gpu::{Gpu, Grid};

/// How an operand of [`matmul`] is stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Order {
    /// The rows of the matrix, one after another.
    RowMajor,
    /// The rows of its transpose (the columns of the matrix), one after another.
    Transposed,
}

/// `d [m, n] = a [m, k] · b [k, n]` in f32 from bf16 operands on tensor cores, each operand in
/// either [`Order`]. Every size from 1 to 65535 · 64 (rows) and `MAX_ROWS` (k).
pub fn matmul(
    gpu: &Gpu,
    (m, n, k): (usize, usize, usize),
    a: &impl DevicePtr<bf16>,
    a_order: Order,
    b: &impl DevicePtr<bf16>,
    b_order: Order,
    d: &mut impl DevicePtrMut<f32>,
) -> Result<()> {
    let kn = entry::TC_MATMUL;
    let args = gpu.args(kn);
    let c = args.check();
    let most = 65535 * MATMUL_TILE as usize;
    c.count("m", most, m)?;
    c.count("n", most, n)?;
    c.count("k", MAX_ROWS, k)?;
    let (pa, pb) = (args.input("a", a, Len::Exactly(m * k))?, args.input("b", b, Len::Exactly(k * n))?);
    let aligned = |p: *const u16| (p as usize).is_multiple_of(16);
    let vec = [m, n, k].iter().all(|v| v.is_multiple_of(8)) && aligned(pa) && aligned(pb);
    let p = MatmulParams {
        a: pa,
        b: pb,
        d: args.output("d", d, Len::Exactly(m * n))?,
        m: m as u32,
        n: n as u32,
        k: k as u32,
        a_t: u32::from(a_order == Order::Transposed),
        b_nk: u32::from(b_order == Order::Transposed),
        vec: u32::from(vec),
    };
    let grid = (n.div_ceil(MATMUL_TILE as usize) as u32, m.div_ceil(MATMUL_TILE as usize) as u32, 1);
    // SAFETY: a, b and d hold exactly the sizes given (checked above); `vec` only where every
    // row of a and b is whole 16-byte groups from a 16-byte aligned start; grid, block and
    // shared memory as the kernel documents.
    unsafe { gpu.launch(Grid::new(kn, grid), p) }
}
