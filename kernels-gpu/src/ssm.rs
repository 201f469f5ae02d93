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
//! Work split: one warp per (row, head) and [`SSM_ROWS`] head-dim rows `p` ([`SSM_FEW_ROWS`]
//! for small batches): lane l holds state columns `4l + 128j` of each, its B and C columns and
//! the head's step loaded once for them, every row's state staged in shared memory by
//! `cp.async` before any is updated; the warp sums each `S[p, :] . C`. So the state moves once
//! through 16-byte (f32) or 8-byte (bf16) accesses, all the warp's rows at a time.

use crate::KernelParams;

/// Warps per block of the state update.
pub const SSM_WARPS: u32 = 4;
/// Most head-dim rows `p` a warp of the state update takes ([`SsmUpdateParams::warp_rows`]):
/// all their state loading at once (8 KB of f32 a warp at state size 128), so that a
/// short-lived warp keeps enough bytes in flight.
pub const SSM_ROWS: u32 = 16;
/// Head-dim rows a warp takes below [`SSM_MANY_ROWS_BATCH`] rows of a batch: there
/// [`SSM_ROWS`] a warp leaves most SMs idle (64 blocks for one row of Nano's 64 heads).
pub const SSM_FEW_ROWS: u32 = 4;
/// The batch from which a warp of the state update takes [`SSM_ROWS`] rows.
pub const SSM_MANY_ROWS_BATCH: usize = 4;
/// Largest state size the update handles (each lane holds `state_size / 32` columns).
pub const SSM_MAX_STATE: u32 = 512;
/// Dynamic shared memory of a state-update block whose state elements take `elem_bytes`: a
/// slot of four elements for each lane and row of each warp.
pub const fn ssm_smem_bytes(elem_bytes: u32) -> u32 {
    SSM_WARPS * SSM_ROWS * 32 * 4 * elem_bytes
}

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
    /// Head-dim rows a warp takes: [`SSM_ROWS`] or [`SSM_FEW_ROWS`].
    pub warp_rows: u32,
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
    use crate::mma::{copied, copy8, copy16, lds8, lds16, smem_addr};

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

    /// How a lane stages its four state columns of a row in shared memory: one `cp.async` of
    /// 16 (f32) or 8 (bf16) bytes, read back as f32.
    trait Staged: StateElem {
        /// # Safety
        /// `at` the lane's slot of four elements in the block's shared memory; `src[0..4]`
        /// readable, aligned to 4 elements.
        unsafe fn stage4(at: u32, src: *const Self);
        /// # Safety
        /// `at` staged by this thread, its copies complete ([`copied`]).
        unsafe fn staged4(at: u32) -> [f32; 4];
    }

    impl Staged for f32 {
        #[inline(always)]
        unsafe fn stage4(at: u32, src: *const f32) {
            // SAFETY: forwarded.
            unsafe { copy16(at, src as *const u16, true) }
        }
        #[inline(always)]
        unsafe fn staged4(at: u32) -> [f32; 4] {
            // SAFETY: forwarded.
            unsafe { lds16(at) }.map(f32::from_bits)
        }
    }

    impl Staged for u16 {
        #[inline(always)]
        unsafe fn stage4(at: u32, src: *const u16) {
            // SAFETY: forwarded.
            unsafe { copy8(at, src as *const u8) }
        }
        #[inline(always)]
        unsafe fn staged4(at: u32) -> [f32; 4] {
            // SAFETY: forwarded.
            raw4_values(unsafe { lds8(at) })
        }
    }

    /// The state update for one (row, head) and `w = warp_rows` rows `p` from `(block_x *
    /// SSM_WARPS + warp) * w`, by the calling warp. Grid `(ceil(head_dim / (SSM_WARPS * w)),
    /// heads, batch)`, block `32 * SSM_WARPS`, [`ssm_smem_bytes`] of its element of shared
    /// memory.
    /// In each chunk of 128 columns every lane copies its four columns of all the warp's rows
    /// into its own slots of shared memory (`cp.async`: the bytes in flight hold no registers,
    /// so a warp that lives for one round trip keeps 8 KB of f32 state loading), waits for its
    /// own copies, and updates the rows one after the other from there. The group's B and C
    /// columns and the head's step are loaded once for the warp's rows, its rows' x and z one a
    /// lane.
    #[inline(always)]
    unsafe fn update<S: Staged>(p: &SsmUpdateParams<S>) {
        const R: usize = SSM_ROWS as usize;
        let (b, h, warp) = (block_z() as usize, block_y() as usize, warp_id());
        let p0 = ((block_x() * SSM_WARPS + warp) * p.warp_rows) as usize;
        let (hd, n) = (p.geo.head_dim as usize, p.geo.state_size as usize);
        if p0 >= hd {
            return;
        }
        let rows = (hd - p0).min(p.warp_rows as usize);
        let g = h / (p.geo.heads / p.geo.groups) as usize;
        let lane = lane_id() as usize;
        // SAFETY: launch contract checked by host/src/ssm.rs: rows, heads, slots in range, dst
        // slots distinct, state_size % 4 == 0 (4-aligned columns), the state a whole
        // allocation (16-byte aligned, as its 16-byte copies need); this warp alone touches
        // state[slot, h, p0..p0 + rows, ..] and y[b, h, p0..p0 + rows], each lane alone its
        // slots of shared memory (four elements a row).
        unsafe {
            let slot = ld(p.cache_index, b);
            let dst = if p.dst_index.is_null() { slot } else { ld(p.dst_index, b) };
            let row = |s: i32, pi: usize| ((s as usize * p.geo.heads as usize + h) * hd + pi) * n;
            let dt = ld(p.dt, b * p.dt_stride as usize + h);
            let (delta, da) = head_step(dt, ld(p.dt_bias, h), ld(p.a, h), p.geo);
            // Row p0 + lane's x and gate (lanes past the rows none), read by every lane below.
            let (mut x_l, mut gate_l) = (0.0f32, 1.0f32);
            if lane < rows {
                let at = h * hd + p0 + lane;
                x_l = bf16_to_f32(ld(p.x, b * p.x_stride as usize + at));
                if !p.z.is_null() {
                    gate_l = silu(bf16_to_f32(ld(p.z, b * p.z_stride as usize + at)));
                }
            }
            let (bp, cp) =
                (p.b.wrapping_add(b * p.b_stride as usize + g * n), p.c.wrapping_add(b * p.c_stride as usize + g * n));
            // B's and C's four columns a lane as one 8-byte load each where the rows allow.
            let vector = (bp as usize).is_multiple_of(8) && (cp as usize).is_multiple_of(8);
            let slot_bytes = 4 * size_of::<S>() as u32;
            let stage = smem_addr((warp as usize * R * 32 + lane) as u32 * slot_bytes);
            let mut acc = [0.0f32; R];
            // Chunks of 4 columns a lane (128 a warp), every lane through every chunk (the
            // shuffles below are the warp's), those past the state size idle.
            for j in 0..J {
                if 128 * j >= n {
                    break;
                }
                let n0 = 4 * lane + 128 * j;
                let live = n0 < n;
                let read = live && slot != PAD_SLOT;
                // Row by row from the first row's address (as in the stores below), so no
                // row's address is kept across the chunks.
                let mut src = p.state.wrapping_add(if read { row(slot, p0) + n0 } else { 0 });
                for r in 0..R {
                    if r < rows && read {
                        S::stage4(stage + (r * 32) as u32 * slot_bytes, src);
                    }
                    src = src.wrapping_add(n);
                }
                let (mut bv, mut cv) = ([0.0f32; 4], [0.0f32; 4]);
                if live {
                    (bv, cv) = if vector {
                        (<u16 as StateElem>::load4(bp.wrapping_add(n0)), <u16 as StateElem>::load4(cp.wrapping_add(n0)))
                    } else {
                        let (bv, cv) = (|i| bf16_to_f32(ld(bp, n0 + i)), |i| bf16_to_f32(ld(cp, n0 + i)));
                        (core::array::from_fn(bv), core::array::from_fn(cv))
                    };
                }
                copied();
                let mut out = p.state.wrapping_add(if dst == PAD_SLOT { 0 } else { row(dst, p0) + n0 });
                for (r, acc) in acc.iter_mut().enumerate() {
                    let xv = warp_read(x_l, r as u32);
                    if r < rows && live {
                        let mut s4 = if read { S::staged4(stage + (r * 32) as u32 * slot_bytes) } else { [0.0; 4] };
                        cols4(&mut s4, (da, delta * xv), (|i| bv[i], |i| cv[i]), acc);
                        if dst != PAD_SLOT {
                            S::store4(out, s4);
                        }
                    }
                    out = out.wrapping_add(n);
                }
            }
            for (r, &acc) in acc.iter().enumerate() {
                let (xv, gate) = (warp_read(x_l, r as u32), warp_read(gate_l, r as u32));
                // Warp-uniform: rows is the warp's.
                if r >= rows {
                    break;
                }
                let mut y = warp_sum(acc);
                if !p.d.is_null() {
                    y += ld(p.d, h) * xv;
                }
                y *= gate;
                if lane == 0 {
                    st(p.y, (b * p.geo.heads as usize + h) * hd + p0 + r, f32_to_bf16(y));
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
