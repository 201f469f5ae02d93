//! NemotronH kernels, written in `#![no_std]` Rust and compiled to PTX by rustc's NVPTX backend.
//!
//! The crate builds for two targets:
//! - `nvptx64-nvidia-cuda`: the kernels themselves (`host/ptx_build.rs` drives that build);
//! - the host: only the shared ABI — each family's `#[repr(C)]` launch parameters, block sizes,
//!   shared-memory sizes and the list of entry points ([`Kernel`], typed as [`entry`]) — so host and device never
//!   mirror a struct by hand.
//!
//! The math each kernel computes is specified in `docs/MATH.md`; the CPU references that tests
//! compare against live in `host/src/cpu/`.
#![no_std]
#![cfg_attr(target_arch = "nvptx64", allow(internal_features))]
#![cfg_attr(target_arch = "nvptx64", feature(abi_ptx, stdarch_nvptx, asm_experimental_arch, link_llvm_intrinsics))]
// `core::f32::math` (the device's FMA and square root); the host has them from std, so the
// host build of the ABI stays on stable Rust.
#![cfg_attr(target_arch = "nvptx64", feature(core_float_math))]

#[cfg(not(target_arch = "nvptx64"))]
extern crate std;

#[cfg(target_arch = "nvptx64")]
mod device;

pub mod act;
pub mod attn;
pub mod conv1d;
pub mod flash;
pub mod gemv;
pub mod grouped;
mod kernel;
pub mod mamba;
pub mod mma;
pub mod moe;
pub mod norm;
pub mod nvfp4;
pub mod qgemv;
pub mod quant;
pub mod router;
pub mod sample;
pub mod ssd;
pub mod ssm;
pub mod tcgen05;
pub mod w4a4;
pub mod wgmma;

pub use kernel::{Entry, Kernel, Smem, Threads, block_scaled_fp4, entry, has_tcgen05};

/// Elements in one chunk: the unit of a 16-byte bf16 load, and what a thread converts at once.
pub const VEC: u32 = 8;
/// Chunks each thread of a row kernel keeps in registers.
pub const CHUNKS_PER_THREAD: u32 = 4;
/// Most threads in a block.
pub const MAX_BLOCK: u32 = 1024;
/// Widest row a row kernel handles (every chunk of a row held in registers by one block).
pub const MAX_ROW_WIDTH: u32 = VEC * CHUNKS_PER_THREAD * MAX_BLOCK;
/// Floats of shared memory a block reduction uses (one per warp of the largest block).
pub const REDUCE_SMEM_FLOATS: u32 = MAX_BLOCK / 32;

/// Byte offset of 16-byte chunk `c` (0..8) of row `r` in a tile of 128-byte rows in the
/// 128-byte swizzle the tensor cores read (`wgmma`, `tcgen05`): the chunk sits at chunk
/// `c ^ (r % 8)` of its row (the pattern repeats every 8 rows, 1024 bytes, from a 1024-byte
/// aligned tile).
pub const fn swizzle_128(r: u32, c: u32) -> u32 {
    128 * r + ((c ^ (r % 8)) << 4)
}

/// The shared-memory matrix descriptor of a K-major tile in [`swizzle_128`]'s layout from
/// shared address `addr` (a row's start plus a multiple of 32 for a later k step), in
/// `wgmma`'s form: start address / 16 (bits 0-13), leading offset 1 (unused with this
/// swizzle), stride offset 1024 / 16 (bits 32-45: 8 rows to the next 8), the 128-byte swizzle
/// (bit 62). `tcgen05`'s form adds bit 46 ([`tcgen05::smem_desc`]).
pub const fn swizzle_128_desc(addr: u32) -> u64 {
    ((addr as u64 >> 4) & 0x3fff) | (1 << 16) | ((1024u64 >> 4) << 32) | (1 << 62)
}

/// The shared-memory matrix descriptor of an MN-major operand (a `wgmma` B read transposed:
/// its rows run along k, each 128 bytes of n) in [`swizzle_128`]'s layout from shared address
/// `addr` (a row's start, 1024-byte aligned): start address / 16, leading offset `panel` / 16
/// (bits 16-29: the next 64 bf16 of n, a panel of rows of 128 bytes further on), stride offset
/// 1024 / 16 (the next 8 rows of k), the 128-byte swizzle.
pub const fn swizzle_128_desc_mn(addr: u32, panel: u32) -> u64 {
    ((addr as u64 >> 4) & 0x3fff) | (((panel as u64 >> 4) & 0x3fff) << 16) | ((1024u64 >> 4) << 32) | (1 << 62)
}

/// Chunks of a row of `width` elements.
pub const fn chunks(width: u32) -> u32 {
    width.div_ceil(VEC)
}

/// Threads per block of the row kernels (norm, per-token quant) for rows of `width`
/// (<= [`MAX_ROW_WIDTH`]): whole warps, a chunk each up to [`MAX_BLOCK`] threads (a thread's
/// chunks are loaded one after another: a single row's latency grows with them), then up to
/// [`CHUNKS_PER_THREAD`] each. One block handles one row.
pub const fn row_block(width: u32) -> u32 {
    let c = chunks(width);
    let threads = (if c < MAX_BLOCK { c } else { MAX_BLOCK }).div_ceil(32) * 32;
    if threads < 32 { 32 } else { threads }
}

/// Threads per block of the row kernels at many rows ([`row_block`] is for few): whole warps
/// of [`CHUNKS_PER_THREAD`] chunks each, so a block's threads have all of its row's loads in
/// flight at once and an SM holds several rows. The kernels are the same; only the chunks per
/// thread change.
pub const fn row_block_many(width: u32) -> u32 {
    let threads = chunks(width).div_ceil(CHUNKS_PER_THREAD).div_ceil(32) * 32;
    if threads < 32 { 32 } else { threads }
}

/// Threads per block of the element-wise (grid-stride) kernels.
pub const EW_BLOCK: u32 = 256;

/// Marker for the `#[repr(C)]` launch-parameter structs passed by value to a kernel.
///
/// # Safety
/// Implementors must be `#[repr(C)]`, `Copy`, and contain only integers, floats and raw
/// pointers, so their bytes are the exact `.param` block the PTX entry expects.
pub unsafe trait KernelParams: Copy {}

#[cfg(target_arch = "nvptx64")]
#[panic_handler]
fn panic(_: &core::panic::PanicInfo) -> ! {
    device::trap()
}
