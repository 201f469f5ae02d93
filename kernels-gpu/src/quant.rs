//! FP8 e4m3 activation quantization (SPEC.md section 4). Codes are round-to-nearest-even,
//! saturated to +-448 (`cvt.rn.satfinite`), NaN stays NaN. Dequantize as `q * s`.
//!
//! - per-token dynamic: `s_t = max(min(amax_t, amax_ub) / 448, 1/(448*512))`, `q = e4m3(x / s_t)`;
//! - per-tensor dynamic: `s = max(amax / 448, 1/(448*512))`, `q = e4m3(x * (1/s))`, in two
//!   launches (amax, then quantize);
//! - static: `q = e4m3(x / scale)` with a given scale (a checkpoint's `input_scale`).
//!
//! Max |x| ignores NaN (`max.f32`). An all-zero input has amax 0, so the scale is the floor
//! `1/(448*512)` and every code is +0: no NaN, no garbage.

use crate::KernelParams;

/// Largest finite e4m3 value.
pub const E4M3_MAX: f32 = 448.0;
/// Smallest scale a dynamic quantization produces (the all-zero input's scale).
pub const MIN_SCALE: f32 = 1.0 / (448.0 * 512.0);

/// Per-token dynamic quantization of `[rows, width]` bf16.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct QuantTokenParams {
    /// `[rows, width]` bf16, read.
    pub x: *const u16,
    /// `[rows, width]` e4m3 codes, written.
    pub q: *mut u8,
    /// `[rows]` f32 scales, written.
    pub scales: *mut f32,
    pub rows: u32,
    pub width: u32,
    /// Upper bound on a row's amax before the scale is taken (`f32::INFINITY`: none).
    pub amax_ub: f32,
}

/// First pass of per-tensor quantization: `*amax = max(*amax, max |x|)`. `*amax` must start at 0.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct QuantAmaxParams {
    /// `[n]` bf16, read.
    pub x: *const u16,
    /// One f32, updated with an atomic max on its bits (valid: it only holds values >= 0).
    pub amax: *mut f32,
    pub n: u32,
}

/// Second pass of per-tensor quantization.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct QuantTensorParams {
    /// `[n]` bf16, read.
    pub x: *const u16,
    /// The first pass's amax, read.
    pub amax: *const f32,
    /// `[n]` e4m3 codes, written.
    pub q: *mut u8,
    /// One f32, the tensor's scale, written by thread 0 of block 0.
    pub scale: *mut f32,
    pub n: u32,
}

/// Static-scale quantization.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct QuantStaticParams {
    /// `[n]` bf16, read.
    pub x: *const u16,
    /// `[n]` e4m3 codes, written.
    pub q: *mut u8,
    pub n: u32,
    /// The scale (finite, > 0).
    pub scale: f32,
}

// SAFETY: #[repr(C)], Copy, only pointers, integers and floats.
unsafe impl KernelParams for QuantTokenParams {}
// SAFETY: as above.
unsafe impl KernelParams for QuantAmaxParams {}
// SAFETY: as above.
unsafe impl KernelParams for QuantTensorParams {}
// SAFETY: as above.
unsafe impl KernelParams for QuantStaticParams {}

/// Dynamic shared memory of the per-token and amax kernels (the block-reduction scratch).
pub const REDUCE_SMEM_BYTES: u32 = crate::REDUCE_SMEM_FLOATS * 4;

/// Chunks each thread of the element-wise kernels handles per grid pass, on average; the
/// host sizes their grid as `ceil(chunks / (EW_BLOCK * EW_CHUNKS_PER_THREAD))`, capped at
/// [`MAX_GRID`].
pub const EW_CHUNKS_PER_THREAD: u32 = 4;
/// Most blocks of an element-wise (grid-stride) launch.
pub const MAX_GRID: u32 = 2048;

/// The per-token scale for a row whose max |x| is `amax` (device side; the CPU reference
/// computes it independently from SPEC.md).
#[inline(always)]
pub fn token_scale(amax: f32, amax_ub: f32) -> f32 {
    (amax.min(amax_ub) / E4M3_MAX).max(MIN_SCALE)
}

#[cfg(target_arch = "nvptx64")]
mod kernels {
    use super::*;
    use crate::device::*;
    use crate::{CHUNKS_PER_THREAD, VEC, chunks};

    /// Per-token dynamic FP8, [`QuantTokenParams`]. Grid `(rows)`, block `row_block(width)`,
    /// dynamic shared memory [`REDUCE_SMEM_BYTES`]. Block r loads row r once into registers
    /// (thread t: chunks t, t + B, ...), reduces max |x|, writes row r of q and `scales[r]`.
    #[unsafe(no_mangle)]
    pub unsafe extern "ptx-kernel" fn quant_token_fp8_bf16(p: QuantTokenParams) {
        grid_dependency_wait();
        let r = block_x() as usize;
        let (width, n) = (p.width as usize, chunks(p.width));
        let (x, q) = (p.x.wrapping_add(r * width), p.q.wrapping_add(r * width));
        let mut v = [[0.0f32; 8]; CHUNKS_PER_THREAD as usize];
        let chunk = |j: usize| thread_x() + j as u32 * block_dim_x();
        // SAFETY: launch contract checked by host/src/quant.rs; chunk k < n covers channels
        // below width; each thread writes its own chunks.
        unsafe {
            let mut amax = 0.0f32;
            for (j, vj) in v.iter_mut().enumerate() {
                if chunk(j) < n {
                    *vj = load8_bf16(x, (chunk(j) * VEC) as usize, width);
                    amax = vj.iter().fold(amax, |a, y| fmax(a, y.abs()));
                }
            }
            let s = token_scale(block_max(amax, dyn_smem_f32()), p.amax_ub);
            let inv_s = 1.0 / s;
            for (j, vj) in v.iter().enumerate() {
                if chunk(j) < n {
                    store8_e4m3(q, (chunk(j) * VEC) as usize, width, vj.map(|y| div_rn_by(y, s, inv_s)));
                }
            }
            if thread_x() == 0 {
                st(p.scales, r, s);
            }
        }
    }

    /// Per-tensor amax, [`QuantAmaxParams`]. Any grid, block [`crate::EW_BLOCK`], dynamic shared
    /// memory [`REDUCE_SMEM_BYTES`]. Each block reduces its chunks and thread 0 does one
    /// `red.global.max.u32` on the bits of `*amax` (f32 >= 0 order like their bits).
    #[unsafe(no_mangle)]
    pub unsafe extern "ptx-kernel" fn quant_amax_bf16(p: QuantAmaxParams) {
        grid_dependency_wait();
        let mut amax = 0.0f32;
        // SAFETY: chunks stay below n, the length the launcher checked.
        for_each_chunk(p.n, |c0| {
            amax = unsafe { load8_bf16(p.x, c0, p.n as usize) }.iter().fold(amax, |a, y| fmax(a, y.abs()))
        });
        let amax = block_max(amax, dyn_smem_f32());
        if thread_x() == 0 {
            // SAFETY: `p.amax` points at one f32 in global memory; the atomic serializes blocks.
            unsafe {
                core::arch::asm!("red.global.max.u32 [{p}], {v};", p = in(reg64) p.amax, v = in(reg32) amax.to_bits(),
                                 options(nostack))
            };
        }
    }

    /// Per-tensor quantization, [`QuantTensorParams`]. Any grid, block [`crate::EW_BLOCK`]. Each
    /// thread reads `*amax`, derives the scale, and writes the codes of its chunks.
    #[unsafe(no_mangle)]
    pub unsafe extern "ptx-kernel" fn quant_tensor_fp8_bf16(p: QuantTensorParams) {
        grid_dependency_wait();
        // SAFETY: launch contract checked by host/src/quant.rs.
        unsafe {
            let s = (ld(p.amax, 0) / E4M3_MAX).max(MIN_SCALE);
            let inv = 1.0 / s;
            let n = p.n as usize;
            for_each_chunk(p.n, |c0| store8_e4m3(p.q, c0, n, load8_bf16(p.x, c0, n).map(|v| v * inv)));
            if block_x() == 0 && thread_x() == 0 {
                st(p.scale, 0, s);
            }
        }
    }

    /// Static-scale quantization, [`QuantStaticParams`]. Any grid, block [`crate::EW_BLOCK`].
    #[unsafe(no_mangle)]
    pub unsafe extern "ptx-kernel" fn quant_static_fp8_bf16(p: QuantStaticParams) {
        grid_dependency_wait();
        let (n, s) = (p.n as usize, p.scale);
        let r = 1.0 / s;
        // SAFETY: chunks stay below n, the length the launcher checked.
        for_each_chunk(p.n, |c0| unsafe {
            store8_e4m3(p.q, c0, n, load8_bf16(p.x, c0, n).map(|v| div_rn_by(v, s, r)))
        });
    }
}
