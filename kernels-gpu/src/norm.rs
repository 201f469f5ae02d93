//! RMSNorm family (docs/MATH.md section 5): plain RMSNorm, gated group RMSNorm, and gated group
//! RMSNorm fused with per-token FP8 e4m3 quantization.
//!
//! Layout: row-major `[rows, width]` bf16 activations (rows may be strided), `w` is `[width]`
//! bf16, math in f32. One block of [`crate::row_block`]`(width)` threads per row; the row is cut
//! into chunks of [`crate::VEC`] channels and thread t holds chunks `t, t + B, t + 2B, ...` (at
//! most [`crate::CHUNKS_PER_THREAD`]) in registers, loaded with 16-byte loads where aligned.
//! Each thread writes its chunks' sums of squares to shared memory; warp w then sums the
//! chunks of groups `w, w + warps, ...` in a fixed order (deterministic) into `rstd[g]`; each
//! thread finally scales its own chunks: `y = w * (u * rstd[g])`.
//!
//! A group must hold whole chunks: `groups == 1` or `(width / groups) % 8 == 0`.

use crate::KernelParams;

/// Plain RMSNorm: `y[r, c] = w[c] * x[r, c] * rsqrt(mean_c(x[r, :]^2) + eps)`; with `add`,
/// of the residual sum: `x = bf16(x + add)` written back to `x` first (contiguous rows).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct RmsNormParams {
    /// `[rows, x_stride]` bf16, read (and written with `add`).
    pub x: *mut u16,
    /// `[rows, width]` bf16 added to x first, or null.
    pub add: *const u16,
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

/// Dynamic shared memory of a norm launch: one sum of squares per chunk, one `rstd` per
/// group, the block-reduction scratch, then (from [`w_stage_offset`]) the row's w, 16 bytes a
/// chunk.
pub const fn smem_bytes(width: u32, groups: u32) -> u32 {
    w_stage_offset(width, groups) + crate::chunks(width) * 16
}

/// Byte offset of the staged w in a norm launch's dynamic shared memory (16-byte aligned, past
/// the sums of squares, `rstd` and the reduction scratch of [`smem_bytes`]).
pub const fn w_stage_offset(width: u32, groups: u32) -> u32 {
    ((crate::chunks(width) + groups + crate::REDUCE_SMEM_FLOATS) * 4).next_multiple_of(16)
}

#[cfg(target_arch = "nvptx64")]
mod kernels {
    use super::*;
    use crate::device::*;
    use crate::mma::{copied, copy8, lds16, smem_addr, sts16};
    use crate::quant::token_scale;
    use crate::{CHUNKS_PER_THREAD, VEC, chunks};

    const J: usize = CHUNKS_PER_THREAD as usize;

    /// One row of a norm launch: where its inputs are and how it is grouped.
    struct Row {
        x: *const u16,
        /// Null for plain RMSNorm.
        z: *const u16,
        /// Added to x (rounded to bf16, written back to x) before the norm; or null.
        add: *const u16,
        w: *const u16,
        width: u32,
        groups: u32,
    }

    /// This thread's chunks: `j`-th is chunk `t + j * B`, present when `< chunks(width)`.
    #[inline(always)]
    fn chunk(j: usize) -> u32 {
        thread_x() + j as u32 * block_dim_x()
    }

    impl Row {
        /// Starts copying this thread's chunks of w to shared memory ([`w_stage_offset`]; a
        /// whole aligned chunk by `cp.async`, no registers held; any other by element loads,
        /// zero past the width): w is a weight no kernel writes, so a launch starts the copy
        /// before its dependency wait and it overlaps that wait and the row's loads.
        /// [`Row::normalize`] reads it back.
        ///
        /// # Safety
        /// The launch's shared memory laid out by [`smem_bytes`] for this row's width and groups.
        #[inline(always)]
        unsafe fn stage_w(&self) {
            let (width, n) = (self.width as usize, chunks(self.width));
            let at = w_stage_offset(self.width, self.groups);
            for j in 0..J {
                let k = chunk(j);
                let (c0, to) = ((k * VEC) as usize, smem_addr(at + k * 16));
                let from = self.w.wrapping_add(c0);
                // SAFETY: chunk k of the stage lies inside smem_bytes (caller), 16-byte aligned;
                // the copy reads w[c0..c0 + 8] only when whole and aligned, load8_raw only
                // below the width.
                unsafe {
                    if k < n && c0 + 8 <= width && (from as usize).is_multiple_of(16) {
                        // Through L1 (`.ca`): a multiprocessor's blocks read the same w.
                        copy8(to, from as *const u8);
                        copy8(to + 8, from.wrapping_add(4) as *const u8);
                    } else if k < n {
                        sts16(to, load8_raw(self.w, c0, width));
                    }
                }
            }
        }

        /// The normalized row, this thread's chunks, in f32 (before rounding). Uses the shared
        /// memory laid out by [`smem_bytes`], with `STAGED` w staged there by
        /// [`Row::stage_w`] (else loaded from global memory after the sums); contains
        /// barriers: call in uniform flow.
        #[inline(always)]
        unsafe fn normalize<const STAGED: bool>(&self, smem: *mut f32, eps: f32) -> [[f32; 8]; J] {
            let (width, n) = (self.width as usize, chunks(self.width));
            let gs = self.width / self.groups;
            let css = smem;
            let rstd = smem.wrapping_add(n as usize);
            let mut u = [[0.0f32; 8]; J];
            // SAFETY: chunk k < n covers channels < width of rows the launcher checked; css
            // has n slots, rstd `groups`; each thread writes only its own css slots, warp w
            // only rstd of its groups, and the barriers order writes before reads.
            unsafe {
                // Every load of this thread's chunks first (x, add, z), so they are all in
                // flight at once: a store in between (the residual's, or to css) would order
                // the next chunk's loads after it. (w is on its way to shared memory: loaded
                // into registers here, it made the kernels spill at the 64 a block of 1024
                // threads allows.)
                let (mut xr, mut ar, mut zr) = ([[0u32; 4]; J], [[0u32; 4]; J], [[0u32; 4]; J]);
                for j in 0..J {
                    let k = chunk(j);
                    if k < n {
                        let c0 = (k * VEC) as usize;
                        xr[j] = load8_raw(self.x, c0, width);
                        if !self.add.is_null() {
                            ar[j] = load8_raw(self.add, c0, width);
                        }
                        if !self.z.is_null() {
                            zr[j] = load8_raw(self.z, c0, width);
                        }
                    }
                }
                for (j, uj) in u.iter_mut().enumerate() {
                    let k = chunk(j);
                    if k < n {
                        let c0 = (k * VEC) as usize;
                        *uj = raw8_values(xr[j]);
                        if !self.add.is_null() {
                            let a = raw8_values(ar[j]);
                            let sum = f32x8_to_bf16(core::array::from_fn(|i| uj[i] + a[i]));
                            *uj = sum.map(bf16_to_f32);
                            store8_bf16(self.x as *mut u16, c0, width, *uj);
                        }
                        if !self.z.is_null() {
                            let z = raw8_values(zr[j]);
                            for i in 0..8 {
                                uj[i] *= silu(z[i]);
                            }
                        }
                        st(css, k as usize, uj.iter().map(|v| v * v).sum());
                    }
                }
                sync_threads();
                // Chunks per group: every chunk when there is one group (the last may be
                // partial), else gs / VEC (the launcher checked gs % VEC == 0).
                let cpg = if self.groups == 1 { n } else { gs / VEC };
                let mut g = warp_id();
                while g < self.groups {
                    let mut s = 0.0f32;
                    let mut k = g * cpg + lane_id();
                    while k < (g + 1) * cpg {
                        s += ld(css, k as usize);
                        k += 32;
                    }
                    let s = warp_sum(s);
                    if lane_id() == 0 {
                        st(rstd, g as usize, 1.0 / sqrt(s / gs as f32 + eps));
                    }
                    g += warps();
                }
                sync_threads();
                if STAGED {
                    // This thread's own copies of w (stage_w): complete and visible to it.
                    copied();
                }
                let at = w_stage_offset(self.width, self.groups);
                for (j, uj) in u.iter_mut().enumerate() {
                    let k = chunk(j);
                    if k < n {
                        let c0 = (k * VEC) as usize;
                        let w = if STAGED {
                            raw8_values(lds16(smem_addr(at + k * 16)))
                        } else {
                            load8_bf16(self.w, c0, width)
                        };
                        let r = ld(rstd, c0 / gs as usize);
                        for i in 0..8 {
                            uj[i] = w[i] * (uj[i] * r);
                        }
                    }
                }
            }
            u
        }
    }

    /// Normalizes row `block_x()` and writes it to `y` (bf16).
    #[inline(always)]
    unsafe fn norm_row(row: Row, y: *mut u16, eps: f32) {
        let (width, n) = (row.width as usize, chunks(row.width));
        // SAFETY: the launcher sized y as [rows, width] and shared memory as smem_bytes;
        // each thread writes its own chunks.
        unsafe {
            let v = row.normalize::<true>(dyn_smem_f32(), eps);
            for (j, vj) in v.iter().enumerate() {
                let k = chunk(j);
                if k < n {
                    store8_bf16(y, (k * VEC) as usize, width, *vj);
                }
            }
        }
    }

    /// Plain RMSNorm, [`RmsNormParams`]. Grid `(rows)`, block `row_block(width)`, dynamic
    /// shared memory `smem_bytes(width, 1)`. Block r reads row r of x (and of add, then writes
    /// row r of x) and all of w, writes row r of y.
    #[unsafe(no_mangle)]
    pub unsafe extern "ptx-kernel" fn norm_rms_bf16(p: RmsNormParams) {
        let r = block_x() as usize;
        let row = Row {
            x: p.x.wrapping_add(r * p.x_stride as usize),
            z: core::ptr::null(),
            add: if p.add.is_null() { p.add } else { p.add.wrapping_add(r * p.width as usize) },
            w: p.w,
            width: p.width,
            groups: 1,
        };
        // SAFETY: shared memory as the host launcher sized it (smem_bytes of this row).
        unsafe { row.stage_w() };
        grid_dependency_wait();
        // SAFETY: launch contract checked by the host launcher (host/src/norm.rs).
        unsafe { norm_row(row, p.y.wrapping_add(r * p.width as usize), p.eps) }
    }

    /// Gated group RMSNorm, [`GatedNormParams`]. Grid `(rows)`, block `row_block(width)` (or
    /// `row_block_many`), dynamic shared memory `smem_bytes(width, groups)`: block r reads rows
    /// r of x and z and all of w, writes row r of y. Or grid `(rows, groups)`, block
    /// `row_block(width / groups)`, dynamic shared memory `smem_bytes(width / groups, 1)`: block
    /// (r, g) normalizes group g of row r alone (the same sums in the same order, so the same
    /// bits), more blocks than rows for few rows.
    #[unsafe(no_mangle)]
    pub unsafe extern "ptx-kernel" fn norm_gated_bf16(p: GatedNormParams) {
        let r = block_x() as usize;
        let (g, width, groups) =
            if grid_dim_y() > 1 { (block_y() as usize, p.width / p.groups, 1) } else { (0, p.width, p.groups) };
        let at = g * width as usize;
        let row = Row {
            x: p.x.wrapping_add(r * p.x_stride as usize + at),
            z: p.z.wrapping_add(r * p.z_stride as usize + at),
            add: core::ptr::null(),
            w: p.w.wrapping_add(at),
            width,
            groups,
        };
        // SAFETY: shared memory as the host launcher sized it (smem_bytes of this row).
        unsafe { row.stage_w() };
        grid_dependency_wait();
        // SAFETY: launch contract checked by the host launcher (host/src/norm.rs).
        unsafe { norm_row(row, p.y.wrapping_add(r * p.width as usize + at), p.eps) }
    }

    /// Gated group RMSNorm + per-token FP8, [`GatedNormFp8Params`]. Grid `(rows)`, block
    /// `row_block(width)`, dynamic shared memory `w_stage_offset(width, groups)` (no staged w).
    /// Block r: the normalized row rounded to bf16, its max |.|, then codes `e4m3(y / s)`;
    /// thread 0 writes `s`.
    #[unsafe(no_mangle)]
    pub unsafe extern "ptx-kernel" fn norm_gated_fp8_bf16(p: GatedNormFp8Params) {
        let r = block_x() as usize;
        let row = Row {
            x: p.x.wrapping_add(r * p.x_stride as usize),
            z: p.z.wrapping_add(r * p.z_stride as usize),
            add: core::ptr::null(),
            w: p.w,
            width: p.width,
            groups: p.groups,
        };
        // w is not staged here (its copies pushed this kernel past 64 registers into spills).
        grid_dependency_wait();
        let (width, n) = (p.width as usize, chunks(p.width));
        let q = p.q.wrapping_add(r * width);
        // SAFETY: launch contract checked by the host launcher; the reduction scratch follows
        // css and rstd in shared memory (w_stage_offset).
        unsafe {
            let smem = dyn_smem_f32();
            let mut v = row.normalize::<false>(smem, p.eps);
            let mut amax = 0.0f32;
            for vj in v.iter_mut() {
                *vj = f32x8_to_bf16(*vj).map(bf16_to_f32);
                amax = vj.iter().fold(amax, |a, y| fmax(a, y.abs()));
            }
            let scratch = smem.wrapping_add((n + p.groups) as usize);
            let s = token_scale(block_max(amax, scratch), p.amax_ub);
            let inv_s = 1.0 / s;
            for (j, vj) in v.iter().enumerate() {
                let k = chunk(j);
                if k < n {
                    store8_e4m3(q, (k * VEC) as usize, width, vj.map(|y| div_rn_by(y, s, inv_s)));
                }
            }
            if thread_x() == 0 {
                st(p.scales, r, s);
            }
        }
    }
}
