//! RMSNorm family (SPEC.md section 5): plain RMSNorm, gated group RMSNorm, and gated group
//! RMSNorm fused with per-token FP8 e4m3 quantization.
//!
//! Layout: row-major `[rows, width]` bf16 activations (rows may be strided), `w` is `[width]`
//! bf16, math in f32. One block of [`crate::ROW_BLOCK`] threads per row: pass 1 accumulates
//! each group's sum of squares (block-strided over the group's channels, reduced per warp into
//! shared memory), then one thread per group turns the partials into `rstd[g]`, then pass 2
//! recomputes the (gated) input and writes `w * (u * rstd[g])`.

use crate::KernelParams;

/// Plain RMSNorm: `y[r, c] = w[c] * x[r, c] * rsqrt(mean_c(x[r, :]^2) + eps)`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct RmsNormParams {
    /// `[rows, x_stride]` bf16, read.
    pub x: *const u16,
    /// `[width]` bf16, read.
    pub w: *const u16,
    /// `[rows, width]` bf16, written.
    pub y: *mut u16,
    pub rows: u32,
    pub width: u32,
    /// Elements between consecutive rows of `x` (>= width).
    pub x_stride: u32,
    pub eps: f32,
}

/// Gated group RMSNorm (norm_before_gate = false): `u = x * silu(z)`, then per group of
/// `width / groups` contiguous channels `y = w * u * rsqrt(mean(u^2) + eps)`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct GatedNormParams {
    /// `[rows, x_stride]` bf16, read.
    pub x: *const u16,
    /// `[rows, z_stride]` bf16 gate, read.
    pub z: *const u16,
    /// `[width]` bf16, read.
    pub w: *const u16,
    /// `[rows, width]` bf16, written.
    pub y: *mut u16,
    pub rows: u32,
    pub width: u32,
    /// Number of groups; divides `width`.
    pub groups: u32,
    pub x_stride: u32,
    pub z_stride: u32,
    pub eps: f32,
}

/// Gated group RMSNorm whose bf16-rounded output is quantized per token to FP8 e4m3 exactly as
/// `quant_token_fp8_bf16` would quantize the output of `norm_gated_bf16` (same codes, same scales).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct GatedNormFp8Params {
    pub x: *const u16,
    pub z: *const u16,
    pub w: *const u16,
    /// `[rows, width]` e4m3 codes, written.
    pub q: *mut u8,
    /// `[rows]` f32 per-token scales, written.
    pub scales: *mut f32,
    pub rows: u32,
    pub width: u32,
    pub groups: u32,
    pub x_stride: u32,
    pub z_stride: u32,
    pub eps: f32,
    /// Upper bound on a row's max |y| before the scale is taken (`f32::INFINITY`: none).
    pub amax_ub: f32,
}

// SAFETY: #[repr(C)], Copy, only pointers, integers and floats.
unsafe impl KernelParams for RmsNormParams {}
// SAFETY: as above.
unsafe impl KernelParams for GatedNormParams {}
// SAFETY: as above.
unsafe impl KernelParams for GatedNormFp8Params {}

/// Most groups a norm kernel accepts (bounds its shared memory).
pub const MAX_GROUPS: u32 = 1024;

/// Dynamic shared memory of a norm launch with `groups` groups: per-warp partial sums of
/// every group, then one `rstd` per group.
pub const fn smem_bytes(groups: u32) -> u32 {
    groups * (crate::ROW_WARPS + 1) * 4
}

#[cfg(target_arch = "nvptx64")]
mod kernels {
    use super::*;
    use crate::device::*;
    use crate::quant::token_scale;
    use crate::{ROW_BLOCK, ROW_WARPS};

    /// One row of a norm launch: where its inputs are and how it is grouped.
    struct Row {
        x: *const u16,
        /// Null for plain RMSNorm.
        z: *const u16,
        w: *const u16,
        width: u32,
        groups: u32,
    }

    impl Row {
        /// The (gated) input `u` at channel `c`, in f32.
        #[inline(always)]
        unsafe fn u(&self, c: u32) -> f32 {
            // SAFETY: c < width; the launcher checked x and z hold `width` channels per row.
            unsafe {
                let x = bf16_to_f32(ld(self.x, c as usize));
                if self.z.is_null() { x } else { x * silu(bf16_to_f32(ld(self.z, c as usize))) }
            }
        }

        /// Computes `rstd[g]` of every group into shared memory (`smem_bytes(groups)` bytes
        /// at `smem`) and returns a pointer to it. Contains barriers: call in uniform flow.
        #[inline(always)]
        unsafe fn group_rstd(&self, smem: *mut f32, eps: f32) -> *mut f32 {
            let t = thread_x();
            let gs = self.width / self.groups;
            let rstd = smem.wrapping_add((self.groups * ROW_WARPS) as usize);
            // SAFETY: every index below is < groups * (ROW_WARPS + 1), the launch's shared
            // memory; lane 0 of warp w alone writes partial (g, w); the barrier orders them
            // before the per-group sums, and the second barrier orders those before any read.
            unsafe {
                for g in 0..self.groups {
                    let mut acc = 0.0f32;
                    let mut c = g * gs + t;
                    while c < (g + 1) * gs {
                        let u = self.u(c);
                        acc += u * u;
                        c += ROW_BLOCK;
                    }
                    let acc = warp_sum(acc);
                    if lane_id() == 0 {
                        st(smem, (g * ROW_WARPS + warp_id()) as usize, acc);
                    }
                }
                sync_threads();
                let mut g = t;
                while g < self.groups {
                    let mut s = 0.0f32;
                    for w in 0..ROW_WARPS {
                        s += ld(smem, (g * ROW_WARPS + w) as usize);
                    }
                    st(rstd, g as usize, 1.0 / sqrt(s / gs as f32 + eps));
                    g += ROW_BLOCK;
                }
                sync_threads();
            }
            rstd
        }

        /// The normalized output at channel `c` in f32 (before rounding to bf16).
        #[inline(always)]
        unsafe fn y(&self, c: u32, rstd: *const f32) -> f32 {
            let gs = self.width / self.groups;
            // SAFETY: c < width, so c / gs < groups, within `rstd`; w holds `width` values.
            unsafe { bf16_to_f32(ld(self.w, c as usize)) * (self.u(c) * ld(rstd, (c / gs) as usize)) }
        }
    }

    /// Normalizes row `block_x()` of `[rows, width]` into `y` (bf16).
    #[inline(always)]
    unsafe fn norm_row(row: Row, y: *mut u16, eps: f32) {
        let t = thread_x();
        // SAFETY: the launcher sized dynamic shared memory as smem_bytes(groups) and y as
        // [rows, width]; each thread writes its own channels.
        unsafe {
            let rstd = row.group_rstd(dyn_smem_f32(), eps);
            let mut c = t;
            while c < row.width {
                st(y, c as usize, f32_to_bf16(row.y(c, rstd)));
                c += ROW_BLOCK;
            }
        }
    }

    /// Plain RMSNorm, [`RmsNormParams`]. Grid `(rows)`, block [`ROW_BLOCK`], dynamic shared
    /// memory `smem_bytes(1)`. Block r reads row r of x and all of w, writes row r of y.
    #[unsafe(no_mangle)]
    pub unsafe extern "ptx-kernel" fn norm_rms_bf16(p: RmsNormParams) {
        let r = block_x();
        let row = Row {
            x: p.x.wrapping_add(r as usize * p.x_stride as usize),
            z: core::ptr::null(),
            w: p.w,
            width: p.width,
            groups: 1,
        };
        // SAFETY: launch contract checked by the host launcher (host/src/norm.rs).
        unsafe { norm_row(row, p.y.wrapping_add(r as usize * p.width as usize), p.eps) }
    }

    /// Gated group RMSNorm, [`GatedNormParams`]. Grid `(rows)`, block [`ROW_BLOCK`], dynamic
    /// shared memory `smem_bytes(groups)`. Block r reads rows r of x and z and all of w,
    /// writes row r of y.
    #[unsafe(no_mangle)]
    pub unsafe extern "ptx-kernel" fn norm_gated_bf16(p: GatedNormParams) {
        let r = block_x() as usize;
        let row = Row {
            x: p.x.wrapping_add(r * p.x_stride as usize),
            z: p.z.wrapping_add(r * p.z_stride as usize),
            w: p.w,
            width: p.width,
            groups: p.groups,
        };
        // SAFETY: launch contract checked by the host launcher (host/src/norm.rs).
        unsafe { norm_row(row, p.y.wrapping_add(r * p.width as usize), p.eps) }
    }

    /// Gated group RMSNorm + per-token FP8, [`GatedNormFp8Params`]. Grid `(rows)`, block
    /// [`ROW_BLOCK`], dynamic shared memory `smem_bytes(groups)`. Block r: rstd per group,
    /// then max |bf16(y)| over the row, then codes `e4m3(bf16(y) / s)`; thread 0 writes `s`.
    #[unsafe(no_mangle)]
    pub unsafe extern "ptx-kernel" fn norm_gated_fp8_bf16(p: GatedNormFp8Params) {
        let r = block_x() as usize;
        let t = thread_x();
        let row = Row {
            x: p.x.wrapping_add(r * p.x_stride as usize),
            z: p.z.wrapping_add(r * p.z_stride as usize),
            w: p.w,
            width: p.width,
            groups: p.groups,
        };
        let q = p.q.wrapping_add(r * p.width as usize);
        // SAFETY: launch contract checked by the host launcher; `smem[0..ROW_WARPS]` is free
        // again after group_rstd's last barrier (rstd lives past groups * ROW_WARPS >= ROW_WARPS).
        unsafe {
            let smem = dyn_smem_f32();
            let rstd = row.group_rstd(smem, p.eps);
            let y = |c| bf16_to_f32(f32_to_bf16(row.y(c, rstd)));
            let mut amax = 0.0f32;
            let mut c = t;
            while c < row.width {
                amax = fmax(amax, y(c).abs());
                c += ROW_BLOCK;
            }
            let s = token_scale(block_max(amax, smem), p.amax_ub);
            let mut c = t;
            while c < row.width {
                st(q, c as usize, f32_to_e4m3(y(c) / s));
                c += ROW_BLOCK;
            }
            if t == 0 {
                st(p.scales, r, s);
            }
        }
    }
}
