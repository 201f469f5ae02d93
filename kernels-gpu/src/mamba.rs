//! The Mamba2 mixer's decode step between its two projections, one launch: the causal conv
//! update of xBC, the selective state update, and the gated group RMSNorm of its output (docs/MATH.md
//! sections 1, 2 and 5), bit for bit as `conv1d_update_bf16` then `ssm_update_f32` (each
//! output rounded to bf16 where those kernels store it), and the norm as `norm_gated_bf16` up
//! to the order of its group's sum of squares.
//!
//! Work split: a cluster of `heads / groups` blocks per (group, row), block h (rank `h % (heads
//! / groups)`) for head h: it convolves its head's x channels and its group's B and C channels
//! (every block of the cluster the same B and C; rank 0 writes their state, after a cluster
//! barrier that follows every block's read of it), updates its head's state rows (each row by
//! one warp, as `ssm_update_f32`), and sums the squares of its gated outputs; the blocks exchange
//! those sums through distributed shared memory and each normalizes its own channels.
//!
//! Before its dependency wait it reads what no kernel of the step writes (the row's slot, the
//! head's state rows) and asks the rest of that kind into L1 (conv taps, bias and state, the
//! head's parameters, its norm weights); launched programmatically, that overlaps the end of
//! in_proj, whose output it reads after the wait.

use crate::KernelParams;
use crate::ssm::SsmGeometry;

/// Threads per block of the fused decode kernel (host/ptx_build.rs bounds the entry at this
/// many: `.maxntid`, so ptxas keeps it within 128 registers a thread; tests/ptx.rs checks the
/// directive).
pub const MAMBA_BLOCK: u32 = 512;
/// Largest head_dim it handles (every warp [`MAMBA_ROWS_PER_WARP`] state rows).
pub const MAMBA_MAX_HEAD_DIM: u32 = MAMBA_BLOCK / 32 * MAMBA_ROWS_PER_WARP;
/// State rows of its head each warp updates (all their loads issued together).
pub const MAMBA_ROWS_PER_WARP: u32 = 4;
/// Largest state size (4 columns a lane).
pub const MAMBA_MAX_STATE: u32 = 128;
/// Largest cluster (heads per group): the portable cluster size.
pub const MAMBA_MAX_CLUSTER: u32 = 8;

/// Decode rows' conv update, state update and gated norm, each row's inputs in the row of
/// in_proj's output: z at column 0, xBC (x, B, C) at `xbc_at`, dt at `dt_at`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct MambaDecodeParams {
    /// `[batch, zx_stride]` bf16, read.
    pub zx: *const u16,
    /// `[conv_dim, k]` bf16, read.
    pub conv_w: *const u16,
    /// `[conv_dim]` bf16 or null, read.
    pub conv_b: *const u16,
    /// `[slots, conv_dim, k - 1]` bf16, read and written at the rows' slots.
    pub conv_state: *mut u16,
    /// `[slots, heads, head_dim, state_size]` f32, read and written at the rows' slots.
    pub ssm_state: *mut f32,
    /// `[heads]` f32 each, read (`d` may be null).
    pub dt_bias: *const f32,
    pub a: *const f32,
    pub d: *const f32,
    /// `[heads * head_dim]` bf16, read.
    pub norm_w: *const u16,
    /// `[batch]` slot of each row, or PAD_SLOT (nothing read or written for it).
    pub cache_index: *const i32,
    /// `[batch, heads * head_dim]` bf16, written.
    pub y: *mut u16,
    pub zx_stride: u32,
    pub xbc_at: u32,
    pub dt_at: u32,
    pub geo: SsmGeometry,
    pub k: u32,
    pub eps: f32,
}

// SAFETY: #[repr(C)], Copy, only pointers, integers and floats.
unsafe impl KernelParams for MambaDecodeParams {}

#[cfg(target_arch = "nvptx64")]
mod kernels {
    use super::*;
    use crate::conv1d::{KM1, PAD_SLOT, conv_step, put_state};
    use crate::device::*;
    use crate::ssm::{cols4, head_step};

    const R: usize = MAMBA_ROWS_PER_WARP as usize;
    /// Warps of a block.
    const WARPS: usize = (MAMBA_BLOCK / 32) as usize;
    /// B and C channels a thread convolves at most (`2 * state_size` over the block).
    const BC: usize = (2 * MAMBA_MAX_STATE).div_ceil(MAMBA_BLOCK) as usize;

    /// [`MambaDecodeParams`]. Grid `(heads, batch)`, clusters of `(heads / groups, 1, 1)`,
    /// block [`MAMBA_BLOCK`]; head_dim at most [`MAMBA_MAX_HEAD_DIM`], state_size a multiple
    /// of 4 at most [`MAMBA_MAX_STATE`], heads / groups at most [`MAMBA_MAX_CLUSTER`].
    #[unsafe(no_mangle)]
    pub unsafe extern "ptx-kernel" fn mamba_decode_bf16(p: MambaDecodeParams) {
        let (h, b) = (block_x() as usize, block_y() as usize);
        let (hd, n, k) = (p.geo.head_dim as usize, p.geo.state_size as usize, p.k as usize);
        let hpg = (p.geo.heads / p.geo.groups) as usize;
        let g = h / hpg;
        let (inner, gn) = (p.geo.heads as usize * hd, p.geo.groups as usize * n);
        let conv_dim = inner + 2 * gn;
        let t = thread_x() as usize;
        // SAFETY: launch contract checked by host/src/mamba.rs (shapes as documented above,
        // the rows' slots PAD_SLOT or distinct and below the caches' slots); this block alone
        // writes its head's x-channel conv state, state rows and outputs, rank 0 alone its
        // group's B and C conv state; shared memory as laid out below, written before the
        // barriers that order its reads.
        unsafe {
            // Before its wait it reads only what no kernel of the step writes: the row's slot
            // (uploaded before the step's first launch), its caches at that slot (written by
            // earlier steps) and the weights; what in_proj writes (zx) only after it.
            let slot = ld(p.cache_index, b);
            if slot == PAD_SLOT {
                // It writes nothing, but waits: a programmatic launch whose blocks all left
                // without waiting would let the launch after it start before in_proj ends.
                grid_dependency_wait();
                return;
            }
            let slot = slot as usize;
            // The cluster barrier's first phase, arrived now and completed before the group's
            // sums are pushed into the other blocks' shared memory (they have all started
            // by then): the push then needs one barrier after it, not one before and after.
            cluster_arrive();
            let (lane, warp) = (lane_id() as usize, warp_id() as usize);
            let n0 = 4 * lane;
            let srow = |pi: usize| p.ssm_state.wrapping_add(((slot * p.geo.heads as usize + h) * hd + pi) * n + n0);
            let mut s = [[0.0f32; 4]; R];
            for (i, s4) in s.iter_mut().enumerate() {
                let pi = warp + WARPS * i;
                if pi < hd && n0 < n {
                    *s4 = <f32 as StateElem>::load4(srow(pi));
                }
            }
            // Conv: local channel lc < hd is x channel h * hd + lc, then the group's B and C.
            let channel = |lc: usize| {
                if lc < hd {
                    h * hd + lc
                } else if lc < hd + n {
                    inner + g * n + (lc - hd)
                } else {
                    inner + gn + g * n + (lc - hd - n)
                }
            };
            // The rest of what it reads before the wait, asked into L1 (the conv taps, bias
            // and state of the thread's channels, the head's parameters, its norm weights).
            let state_row = |c: usize| p.conv_state.wrapping_add((slot * conv_dim + c) * (k - 1));
            let mut lc = t;
            while lc < hd + 2 * n {
                let c = channel(lc);
                prefetch_l1(p.conv_w.wrapping_add(c * k));
                prefetch_l1(state_row(c));
                if !p.conv_b.is_null() {
                    prefetch_l1(p.conv_b.wrapping_add(c));
                }
                lc += MAMBA_BLOCK as usize;
            }
            if t == 0 {
                prefetch_l1(p.dt_bias.wrapping_add(h));
                prefetch_l1(p.a.wrapping_add(h));
                if !p.d.is_null() {
                    prefetch_l1(p.d.wrapping_add(h));
                }
            }
            if t < hd {
                prefetch_l1(p.norm_w.wrapping_add(h * hd + t));
            }
            grid_dependency_wait();
            // Everything it reads of in_proj's row at once: the head's dt and its rows' z here,
            // xBC in the conv below (one round trip to L2, not three).
            let row = p.zx.wrapping_add(b * p.zx_stride as usize);
            let dt = ld(row, p.dt_at as usize + h);
            let mut zs = [0u16; R];
            for (i, z) in zs.iter_mut().enumerate() {
                let pi = warp + WARPS * i;
                if pi < hd {
                    *z = ld(row, h * hd + pi);
                }
            }
            // The conv outputs (bf16 values as f32): the head's x, then the group's B and C.
            let conv = static_smem!("mamba_conv", (MAMBA_MAX_HEAD_DIM + 2 * MAMBA_MAX_STATE) * 4);
            // The gated outputs u, this block's sum of their squares, the reduction scratch.
            let u = static_smem!("mamba_u", MAMBA_MAX_HEAD_DIM * 4);
            let part = static_smem!("mamba_part", (1 + MAMBA_BLOCK / 32) * 4);
            // The group's blocks' sums of squares, in rank order (each pushed here by its block).
            let sums = static_smem!("mamba_sums", MAMBA_MAX_CLUSTER * 4);
            let xbc = row.wrapping_add(p.xbc_at as usize);
            let mut bc_next = [[0u16; KM1]; BC];
            let mut lc = t;
            let mut j = 0;
            while lc < hd + 2 * n {
                let c = channel(lc);
                let (yc, next) = conv_step(p.conv_w, p.conv_b, c, k, state_row(c), ld(xbc, c));
                st(conv, lc, bf16_to_f32(yc));
                if lc < hd {
                    put_state(state_row(c), k, &next);
                } else {
                    for (i, bn) in bc_next.iter_mut().enumerate() {
                        if i == j {
                            *bn = next;
                        }
                    }
                    j += 1;
                }
                lc += MAMBA_BLOCK as usize;
            }
            sync_threads();
            // State update: warp w takes rows w, w + WARPS, .. of the head, every row's state
            // loaded before the wait.
            let (delta, da) = head_step(dt, ld(p.dt_bias, h), ld(p.a, h), p.geo);
            let (bs, cs) = (conv.wrapping_add(hd), conv.wrapping_add(hd + n));
            for (i, (s4, &z)) in s.iter_mut().zip(&zs).enumerate() {
                let pi = warp + WARPS * i;
                if pi < hd {
                    let xv = ld(conv, pi);
                    let mut acc = 0.0f32;
                    if n0 < n {
                        cols4(s4, (da, delta * xv), (|c| ld(bs, n0 + c), |c| ld(cs, n0 + c)), &mut acc);
                        <f32 as StateElem>::store4(srow(pi), *s4);
                    }
                    let mut yv = warp_sum(acc);
                    if !p.d.is_null() {
                        yv += ld(p.d, h) * xv;
                    }
                    if lane == 0 {
                        // The state update's output rounded to bf16, gated (the norm's u).
                        st(u, pi, bf16_to_f32(f32_to_bf16(yv)) * silu(bf16_to_f32(z)));
                    }
                }
            }
            sync_threads();
            let uv = if t < hd { ld(u, t) } else { 0.0 };
            let sq = block_sum(uv * uv, part.wrapping_add(1));
            cluster_wait();
            if t < hpg {
                // This block's sum into slot `rank` of block t's.
                st_cluster_f32(sums.wrapping_add(cluster_rank() as usize), t as u32, sq);
            }
            cluster_sync();
            // Every block has read the group's B and C state: rank 0 writes their next.
            if cluster_rank() == 0 {
                let (mut lc, mut j) = (t, 0);
                while lc < hd + 2 * n {
                    if lc >= hd {
                        let c = channel(lc);
                        for (i, bn) in bc_next.iter().enumerate() {
                            if i == j {
                                put_state(state_row(c), k, bn);
                            }
                        }
                        j += 1;
                    }
                    lc += MAMBA_BLOCK as usize;
                }
            }
            let mut total = 0.0f32;
            for r in 0..hpg {
                total += ld(sums, r);
            }
            if t < hd {
                let rstd = 1.0 / sqrt(total / (hpg * hd) as f32 + p.eps);
                let w = bf16_to_f32(ld(p.norm_w, h * hd + t));
                st(p.y, b * inner + h * hd + t, f32_to_bf16(w * (uv * rstd)));
            }
        }
    }
}
