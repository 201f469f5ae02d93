//! Small element-wise and row operations the model needs between the big kernels: relu^2
//! (after a cuBLASLt up projection), and gathering rows by index (embedding lookup, picking
//! the rows the LM head reads). The residual add is fused into the next RMSNorm (norm.rs). bf16 in and out, f32 math, chunks of [`crate::VEC`] elements per thread.

use crate::KernelParams;

/// `x = bf16(relu(x)^2)` over `n` elements.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct Relu2Params {
    pub x: *mut u16,
    pub n: u32,
}

/// `out[r, :] = table[idx[r], :]` for `rows` rows of `width`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct GatherParams {
    pub table: *const u16,
    /// `[rows]`, each below `table_rows`, else the kernel traps.
    pub idx: *const u32,
    pub out: *mut u16,
    pub rows: u32,
    pub width: u32,
    pub table_rows: u32,
}

// SAFETY: #[repr(C)], Copy, only pointers, integers and floats.
unsafe impl KernelParams for Relu2Params {}
// SAFETY: as above.
unsafe impl KernelParams for GatherParams {}

#[cfg(target_arch = "nvptx64")]
mod kernels {
    use super::*;
    use crate::device::*;
    use crate::{EW_BLOCK, VEC, chunks};

    /// relu^2, [`Relu2Params`]. Any grid, block [`EW_BLOCK`].
    #[unsafe(no_mangle)]
    pub unsafe extern "ptx-kernel" fn act_relu2_bf16(p: Relu2Params) {
        grid_dependency_wait();
        let n = p.n as usize;
        // SAFETY: x holds n elements (checked by the launcher); chunks are disjoint.
        for_each_chunk(p.n, |c0| unsafe {
            let v = load8_bf16(p.x, c0, n).map(|v| v.max(0.0) * v.max(0.0));
            store8_bf16(p.x, c0, n, v);
        });
    }

    /// Row gather, [`GatherParams`]. Grid `(rows)`, block [`EW_BLOCK`]: block r copies row
    /// `idx[r]` of the table into row r of out.
    #[unsafe(no_mangle)]
    pub unsafe extern "ptx-kernel" fn act_gather_bf16(p: GatherParams) {
        grid_dependency_wait();
        let r = block_x() as usize;
        let w = p.width as usize;
        // SAFETY: the table holds table_rows * width and out rows * width (checked by the
        // launcher); an index outside the table traps.
        unsafe {
            let i = ld(p.idx, r);
            if i >= p.table_rows {
                trap();
            }
            let src = p.table.wrapping_add(i as usize * w);
            let dst = p.out.wrapping_add(r * w);
            let mut k = thread_x();
            while k < chunks(p.width) {
                let c0 = (k * VEC) as usize;
                store8_bf16(dst, c0, w, load8_bf16(src, c0, w));
                k += EW_BLOCK;
            }
        }
    }
}
