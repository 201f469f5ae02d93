//! Where a thread is: its thread, warp, lane and block indices, the block and grid sizes, and
//! the grid-stride loop over chunks built on them.

use core::arch::nvptx;

#[inline(always)]
pub fn thread_x() -> u32 {
    // SAFETY: reading a special register.
    unsafe { nvptx::_thread_idx_x() as u32 }
}

#[inline(always)]
pub fn block_x() -> u32 {
    // SAFETY: reading a special register.
    unsafe { nvptx::_block_idx_x() as u32 }
}

#[inline(always)]
pub fn block_y() -> u32 {
    // SAFETY: reading a special register.
    unsafe { nvptx::_block_idx_y() as u32 }
}

#[inline(always)]
pub fn block_z() -> u32 {
    // SAFETY: reading a special register.
    unsafe { nvptx::_block_idx_z() as u32 }
}

/// Blocks of the grid along y.
#[inline(always)]
pub fn grid_dim_y() -> u32 {
    // SAFETY: reading a special register.
    unsafe { nvptx::_grid_dim_y() as u32 }
}

#[inline(always)]
pub fn grid_dim_x() -> u32 {
    // SAFETY: reading a special register.
    unsafe { nvptx::_grid_dim_x() as u32 }
}

/// Threads in this block.
#[inline(always)]
pub fn block_dim_x() -> u32 {
    // SAFETY: reading a special register.
    unsafe { nvptx::_block_dim_x() as u32 }
}

/// Warps in this block (blocks are whole warps).
#[inline(always)]
pub fn warps() -> u32 {
    block_dim_x() / 32
}

/// Lane of this thread within its warp.
#[inline(always)]
pub fn lane_id() -> u32 {
    thread_x() % 32
}

/// Warp of this thread within its block.
#[inline(always)]
pub fn warp_id() -> u32 {
    thread_x() / 32
}

/// Grid-stride loop of the element-wise kernels (blocks of [`crate::EW_BLOCK`] threads) over
/// the chunks of `0..n`: `f(c0)` for each chunk start `c0`, each chunk by one thread.
#[inline(always)]
pub fn for_each_chunk(n: u32, mut f: impl FnMut(usize)) {
    let stride = grid_dim_x() * crate::EW_BLOCK;
    let mut k = block_x() * crate::EW_BLOCK + thread_x();
    while k < crate::chunks(n) {
        f((k * crate::VEC) as usize);
        k += stride;
    }
}
