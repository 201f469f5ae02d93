//! NVFP4 weights on the device (docs/MATH.md, "Checkpoint formats"): how a matrix is laid out
//! for the kernels, and its dequantization to bf16 (the input of the bf16 GEMMs at many rows).
//! The products at few rows read the codes themselves: the warp mode of the gemv kernels
//! (kernels-gpu/src/gemv.rs, its `Fp4` chunk) and the expert kernels built on it.
//!
//! Layout: each row of `k` weights (k a multiple of [`BLOCK`]) is its `k / 2` code bytes (two
//! e2m1 codes a byte, element `2i` in the low four bits) followed by its `k / 16` e4m3 block
//! scales, padded with zeros to a multiple of 16 bytes: [`row_bytes`] a row, rows one after
//! another, matrices one after another; a f32 per-tensor scale per matrix apart. So a chunk of
//! weights and its block scale lie in the row that a warp streams, and every row starts
//! 16-byte aligned (the tensor-core kernels load 16 bytes of codes at a time).

use crate::KernelParams;

/// Elements along k that share a block scale.
pub const BLOCK: usize = 16;

/// Bytes of `k` NVFP4 weights of a row (`k` a multiple of [`BLOCK`]): the codes, then the
/// block scales, then zeros to a multiple of 16.
pub const fn row_bytes(k: usize) -> usize {
    (k / 2 + k / BLOCK).next_multiple_of(16)
}

/// `out = bf16(W)` for `rows` rows of NVFP4 weights laid out as this module says, `W[r][c] =
/// e2m1 * e4m3 block scale * global[r / n]` rounded to bf16 once (nearest even, from the exact
/// product).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct ToBf16Params {
    /// `rows` rows of [`row_bytes`]`(k)` bytes.
    pub w: *const u8,
    /// `[rows / n]` per-tensor scales, finite.
    pub global: *const f32,
    /// `[rows, k]` bf16, written.
    pub out: *mut u16,
    /// Rows of a matrix (its global scale's).
    pub n: u32,
    pub k: u32,
    /// Rows of all matrices; `rows * k` below 2^32.
    pub rows: u32,
}

// SAFETY: #[repr(C)], Copy, only pointers, integers and floats.
unsafe impl KernelParams for ToBf16Params {}

#[cfg(target_arch = "nvptx64")]
mod kernels {
    use super::*;
    use crate::device::*;

    /// `a * g` as the f32 whose rounding to bf16 (nearest even) is that of the exact product:
    /// the f32 product, moved one f32 unit toward the exact one where it falls on a bf16 tie
    /// that the exact product is not (its error, found by an FMA, not zero).
    #[inline(always)]
    fn product_for_bf16(a: f32, g: f32) -> f32 {
        let p = a * g;
        let e = fma(a, g, -p);
        let bits = p.to_bits();
        if bits & 0xffff != 0x8000 || e == 0.0 {
            return p;
        }
        f32::from_bits(if (e > 0.0) == (p > 0.0) { bits + 1 } else { bits - 1 })
    }

    /// [`ToBf16Params`]. Any grid, block [`crate::EW_BLOCK`]: a thread dequantizes 8 weights
    /// (a chunk of a row) at a time.
    #[unsafe(no_mangle)]
    pub unsafe extern "ptx-kernel" fn nvfp4_to_bf16(p: ToBf16Params) {
        grid_dependency_wait();
        let (k, n) = (p.k as usize, p.n as usize);
        let bytes = row_bytes(k);
        // SAFETY: w holds rows * row_bytes(k) bytes, global rows / n values, out rows * k (the
        // launcher checks them); chunks are disjoint, each written by its thread alone.
        for_each_chunk(p.rows * p.k, |c0| unsafe {
            let (r, c) = (c0 / k, c0 % k);
            let row = p.w.wrapping_add(r * bytes);
            let mut codes = 0u32;
            for i in 0..4 {
                codes |= u32::from(ld(row, c / 2 + i)) << (8 * i);
            }
            let scale = e4m3x2_to_f32(u16::from(ld(row, k / 2 + c / BLOCK))).0 * 16384.0;
            let g = ld(p.global, r / n);
            let v = e2m1x8_to_f32(codes).map(|v| product_for_bf16(v * scale, g));
            store8_bf16(p.out.wrapping_add(r * k), c, k, v);
        });
    }
}
