//! Selective state update, the Mamba2 decode step (docs/MATH.md section 2), in place at the rows'
//! cache slots.
//!
//! For row b, head h, group g = h / (heads / groups), slot s = cache_index[b]:
//! `delta = clamp(softplus(dt[b, h] + dt_bias[h]), dt_min, dt_max)`,
//! `S = S_in * exp(A[h] * delta) + delta * x[b, h, :] (outer) B[b, g, :]` (`S_in = 0` for a pad
//! row), `y[p] = sum_n S[p, n] * C[b, g, n] + D[h] * x[b, h, p]`, times `silu(z)` when a gate is
//! given; `S` is written to slot `dst_index[b]` (or `s` without a destination array) unless
//! that is [`crate::conv1d::PAD_SLOT`].
//!
//! Layouts: state cache `[slots, heads, head_dim, state_size]` in f32 or bf16; `x` and `z` rows
//! hold `heads * head_dim` channels head-major; `dt` rows `heads`; `B`, `C` rows
//! `groups * state_size`; every row has its own stride (they are slices of wider rows). `A`,
//! `D`, `dt_bias` are f32 per head (A = -exp(A_log), computed at load).
//!
//! Work split: one warp per (row, head) and [`SSM_ROWS`] head-dim rows `p`: lane l holds
//! state columns `4l + 128j` of each, its B and C columns and the head's step loaded once for
//! them, every row's state loaded before any is updated; the warp sums each `S[p, :] . C`. So
//! the state moves once through 16-byte (f32) or 8-byte (bf16) accesses, several rows' at a
//! time a warp.

use crate::KernelParams;

/// Warps per block of the state update.
pub const SSM_WARPS: u32 = 8;
/// Head-dim rows `p` a warp of the state update takes.
pub const SSM_ROWS: u32 = 4;
/// Largest state size the update handles (each lane holds `state_size / 32` columns).
pub const SSM_MAX_STATE: u32 = 512;

/// The state's geometry and the time step's clamp, as every kernel of the state takes them
/// (the state update, the chunked scan, the fused Mamba decode).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct SsmGeometry {
    pub heads: u32,
    pub head_dim: u32,
    /// B and C groups; `heads / groups` heads share one.
    pub groups: u32,
    pub state_size: u32,
    /// The time step after softplus is clamped to `[dt_min, dt_max]`.
    pub dt_min: f32,
    pub dt_max: f32,
}

/// Launch parameters of the state update; `S` is the state element (f32, or u16 for bf16).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct SsmUpdateParams<S> {
    /// `[slots, heads, head_dim, state_size]`, read at `cache_index`, written at `dst_index`.
    pub state: *mut S,
    /// `[batch, x_stride]` bf16.
    pub x: *const u16,
    /// `[batch, dt_stride]` bf16.
    pub dt: *const u16,
    /// `[batch, b_stride]` bf16.
    pub b: *const u16,
    /// `[batch, c_stride]` bf16.
    pub c: *const u16,
    /// `[batch, z_stride]` bf16, or null for no gate.
    pub z: *const u16,
    /// `[heads]` f32.
    pub dt_bias: *const f32,
    /// `[heads]` f32, A = -exp(A_log).
    pub a: *const f32,
    /// `[heads]` f32, or null for no skip term.
    pub d: *const f32,
    /// `[batch]` slot read, or PAD_SLOT.
    pub cache_index: *const i32,
    /// `[batch]` slot written, or PAD_SLOT; null: the read slot.
    pub dst_index: *const i32,
    /// `[batch, heads * head_dim]` bf16, written.
    pub y: *mut u16,
    pub batch: u32,
    pub geo: SsmGeometry,
    pub x_stride: u32,
    pub dt_stride: u32,
    pub b_stride: u32,
    pub c_stride: u32,
    pub z_stride: u32,
}

// SAFETY: #[repr(C)], Copy, only pointers, integers and floats.
unsafe impl KernelParams for SsmUpdateParams<f32> {}
// SAFETY: as above.
unsafe impl KernelParams for SsmUpdateParams<u16> {}

#[cfg(target_arch = "nvptx64")]
pub(crate) use kernels::{cols4, head_step};

#[cfg(target_arch = "nvptx64")]
mod kernels {
    use super::*;
    use crate::conv1d::PAD_SLOT;
    use crate::device::*;

    const J: usize = (SSM_MAX_STATE / 128) as usize;

    /// A row's step of head h: `(delta, exp(A[h] * delta))`, `delta = clamp(softplus(dt +
    /// dt_bias[h]), min, max)` from its dt (bf16 bits).
    #[inline(always)]
    pub(crate) fn head_step(dt: u16, dt_bias: f32, a: f32, geo: SsmGeometry) -> (f32, f32) {
        let delta = softplus(bf16_to_f32(dt) + dt_bias).max(geo.dt_min).min(geo.dt_max);
        (delta, exp_fast(a * delta))
    }

    /// Four state columns `i` of a row: `s = s * da + dx * b(i)`, then `s * c(i)` added to
    /// `acc`, in column order.
    #[inline(always)]
    pub(crate) fn cols4(
        s4: &mut [f32; 4],
        (da, dx): (f32, f32),
        (b, c): (impl Fn(usize) -> f32, impl Fn(usize) -> f32),
        acc: &mut f32,
    ) {
        for (i, s) in s4.iter_mut().enumerate() {
            *s = *s * da + dx * b(i);
            *acc += *s * c(i);
        }
    }

    /// The state update for one (row, head) and [`SSM_ROWS`] rows `p` from `(block_x *
    /// SSM_WARPS + warp) * SSM_ROWS`, by the calling warp. Grid `(ceil(head_dim / (SSM_WARPS *
    /// SSM_ROWS)), heads, batch)`, block `32 * SSM_WARPS`. The group's B and C columns and the
    /// head's step are loaded once for the warp's rows (each row's warp loaded them before,
    /// and a bf16 state then took as long as an f32 one: docs/PERFORMANCE.md), and in each
    /// chunk of columns the rows' states are all loading before the first is updated.
    #[inline(always)]
    unsafe fn update<S: StateElem>(p: &SsmUpdateParams<S>) {
        const R: usize = SSM_ROWS as usize;
        let (b, h) = (block_z() as usize, block_y() as usize);
        let p0 = ((block_x() * SSM_WARPS + warp_id()) * SSM_ROWS) as usize;
        let (hd, n) = (p.geo.head_dim as usize, p.geo.state_size as usize);
        if p0 >= hd {
            return;
        }
        let rows = (hd - p0).min(R);
        let g = h / (p.geo.heads / p.geo.groups) as usize;
        let lane = lane_id() as usize;
        // SAFETY: launch contract checked by host/src/ssm.rs: rows, heads, slots in range, dst
        // slots distinct, state_size % 4 == 0 (4-aligned columns); this warp alone touches
        // state[slot, h, p0..p0 + rows, ..] and y[b, h, p0..p0 + rows].
        unsafe {
            let slot = ld(p.cache_index, b);
            let dst = if p.dst_index.is_null() { slot } else { ld(p.dst_index, b) };
            let row = |s: i32, pi: usize| ((s as usize * p.geo.heads as usize + h) * hd + pi) * n;
            let dt = ld(p.dt, b * p.dt_stride as usize + h);
            let (delta, da) = head_step(dt, ld(p.dt_bias, h), ld(p.a, h), p.geo);
            let mut xv = [0.0f32; R];
            // Every loop over the rows runs R times (unrolled: the arrays stay in registers),
            // rows past head_dim skipped inside.
            for (r, xv) in xv.iter_mut().enumerate() {
                if r < rows {
                    *xv = bf16_to_f32(ld(p.x, b * p.x_stride as usize + h * hd + p0 + r));
                }
            }
            let (bp, cp) =
                (p.b.wrapping_add(b * p.b_stride as usize + g * n), p.c.wrapping_add(b * p.c_stride as usize + g * n));
            // A chunk of 4 columns a lane at a time (128 a warp): its B and C once, every row's
            // state loading before the first is updated.
            let mut acc = [0.0f32; R];
            for j in 0..J {
                let n0 = 4 * lane + 128 * j;
                if n0 >= n {
                    break;
                }
                let mut state = [[0.0f32; 4]; R];
                for (r, s4) in state.iter_mut().enumerate() {
                    if r < rows && slot != PAD_SLOT {
                        *s4 = S::load4(p.state.wrapping_add(row(slot, p0 + r) + n0));
                    }
                }
                let (bv, cv) = (|i| bf16_to_f32(ld(bp, n0 + i)), |i| bf16_to_f32(ld(cp, n0 + i)));
                let (bv, cv): ([f32; 4], [f32; 4]) = (core::array::from_fn(bv), core::array::from_fn(cv));
                for (r, (s4, acc)) in state.iter_mut().zip(&mut acc).enumerate() {
                    cols4(s4, (da, delta * xv[r]), (|i| bv[i], |i| cv[i]), acc);
                    if r < rows && dst != PAD_SLOT {
                        S::store4(p.state.wrapping_add(row(dst, p0 + r) + n0), *s4);
                    }
                }
            }
            for (r, (&acc, &xv)) in acc.iter().zip(&xv).enumerate() {
                let pi = p0 + r;
                // Warp-uniform: rows is the warp's.
                if r >= rows {
                    break;
                }
                let mut y = warp_sum(acc);
                if !p.d.is_null() {
                    y += ld(p.d, h) * xv;
                }
                if !p.z.is_null() {
                    y *= silu(bf16_to_f32(ld(p.z, b * p.z_stride as usize + h * hd + pi)));
                }
                if lane == 0 {
                    st(p.y, (b * p.geo.heads as usize + h) * hd + pi, f32_to_bf16(y));
                }
            }
        }
    }

    /// Selective state update with an f32 state cache, [`SsmUpdateParams`]`<f32>`.
    #[unsafe(no_mangle)]
    pub unsafe extern "ptx-kernel" fn ssm_update_f32(p: SsmUpdateParams<f32>) {
        grid_dependency_wait();
        // SAFETY: launch contract checked by the host launcher.
        unsafe { update(&p) }
    }

    /// Selective state update with a bf16 state cache, [`SsmUpdateParams`]`<u16>`.
    #[unsafe(no_mangle)]
    pub unsafe extern "ptx-kernel" fn ssm_update_bf16(p: SsmUpdateParams<u16>) {
        grid_dependency_wait();
        // SAFETY: launch contract checked by the host launcher.
        unsafe { update(&p) }
    }
}
