//! Grouped GEMM on tensor cores: one projection of every MoE expert with rows, in one launch
//! (docs/MATH.md's expert MLP). A dispatch (`moe_dispatch`) has grouped the routing choices by
//! expert: expert e's rows are `offsets[e] .. offsets[e + 1]` of the grouped order. Grouped row
//! j of expert e gets `out[j] = f(a_j W_eᵀ)` with `W [experts, n, k]` (each expert's weight
//! row-major, a row per output), `a_j` row `token[j]` of `a` (gathered: the layer input) or row
//! j (the grouped hidden rows), and `f` either the identity or `relu(bf16(.))^2`, rounded to
//! bf16.
//!
//! # Work split
//! The grid is `(m tiles, n tiles)`: each expert's rows in tiles of m = [`GROUPED_M`] rows
//! (`moe_grouped_bf16`) or [`GROUPED_M_WIDE`] (`moe_grouped_m128_bf16`, staging
//! [`GROUPED_K_WIDE`] of k at a time, for experts of many rows) (as many
//! tiles as its rows need; the grid has room for the most any dispatch of this many rows and
//! experts can need, and the blocks past the dispatch's tiles return at once), outputs in tiles
//! of [`GROUPED_N`]. A block finds its expert and first row from the offsets (a warp's prefix
//! sum of the experts' tile counts), then runs `k` in steps of [`GROUPED_K`] through a ring of
//! [`GROUPED_STAGES`] shared-memory stages loaded by `cp.async` (zero past the rows and the
//! columns); warp w computes rows `(m / 2) (w / 4)` and columns `32 (w % 4)` of the block's tile on
//! `mma.sync` m16n8k16 (bf16 in, f32 sums). Blocks next to each other along x share an expert's
//! weight tile in L2.

use crate::KernelParams;
use crate::mma::tile_bytes;

/// Threads of a block: eight warps, 2 x 4 over the output tile.
pub const GROUPED_BLOCK: u32 = 256;
/// Rows of an output tile of `moe_grouped_bf16` (k staged [`GROUPED_K`] at a time).
pub const GROUPED_M: u32 = 64;
/// Rows of an output tile of `moe_grouped_m128_bf16` (k staged [`GROUPED_K_WIDE`] at a time):
/// for experts of many rows, each input and weight tile read half as often per product.
pub const GROUPED_M_WIDE: u32 = 128;
/// Columns of an output tile.
pub const GROUPED_N: u32 = 128;
/// k staged at a time by `moe_grouped_bf16`.
pub const GROUPED_K: u32 = 32;
/// k staged at a time by `moe_grouped_m128_bf16`.
pub const GROUPED_K_WIDE: u32 = 64;
/// Stages of the shared-memory ring.
pub const GROUPED_STAGES: u32 = 3;

/// One grouped projection.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct GroupedParams {
    /// Rows of `k`: grouped row j's input at `a + (token[j] or j) * k`.
    pub a: *const u16,
    /// `[entries]` grouped row -> its token; null: `a` holds the grouped rows themselves.
    pub token: *const u32,
    /// `[experts, n, k]`.
    pub w: *const u16,
    /// `[experts + 1]`.
    pub offsets: *const u32,
    /// `[entries, n]`.
    pub out: *mut u16,
    pub experts: u32,
    pub n: u32,
    pub k: u32,
    /// 1: `f = relu(bf16(.))^2`; 0: the identity.
    pub relu2: u32,
}

// SAFETY: #[repr(C)], Copy, only pointers and integers.
unsafe impl KernelParams for GroupedParams {}

/// Dynamic shared memory of the grouped kernel of `m`-row tiles staging `k` at a time: the
/// stages' A and B tiles, then the block's expert and first row.
pub const fn grouped_smem_bytes(m: u32, k: u32) -> u32 {
    GROUPED_STAGES * (tile_bytes(m, k) + tile_bytes(GROUPED_N, k)) + 8
}

/// Most `m`-row tiles a dispatch of `entries` rows over `experts` experts can need: every
/// expert's last tile may be partial.
pub const fn grouped_m_tiles(entries: u32, experts: u32, m: u32) -> u32 {
    entries.div_ceil(m) + if experts < entries { experts } else { entries }
}

#[cfg(target_arch = "nvptx64")]
mod kernels {
    use super::*;
    use crate::device::*;
    use crate::mma::{Tile, acc_col, acc_row, commit, copy16, mma, pack, smem_addr, staged_but, tile_stride};

    /// Grouped projection, [`GroupedParams`], [`GROUPED_M`]-row tiles. Grid
    /// `(grouped_m_tiles(entries, experts, GROUPED_M), ceil(n / GROUPED_N))`, block
    /// [`GROUPED_BLOCK`], dynamic shared memory `grouped_smem_bytes(GROUPED_M, GROUPED_K)`; the
    /// module docs say what a block does.
    #[unsafe(no_mangle)]
    pub unsafe extern "ptx-kernel" fn moe_grouped_bf16(p: GroupedParams) {
        // SAFETY: the launch contract is the caller's.
        unsafe { grouped::<2, GROUPED_K>(p) }
    }

    /// As `moe_grouped_bf16` with [`GROUPED_M_WIDE`]-row tiles and [`GROUPED_K_WIDE`] staged at
    /// a time (grid and shared memory of those sizes).
    #[unsafe(no_mangle)]
    pub unsafe extern "ptx-kernel" fn moe_grouped_m128_bf16(p: GroupedParams) {
        // SAFETY: the launch contract is the caller's.
        unsafe { grouped::<4, GROUPED_K_WIDE>(p) }
    }

    /// The grouped kernel: tiles of `32 MT` rows (each warp `MT` 16-row tiles of them) staging
    /// `BK` of k at a time.
    ///
    /// # Safety
    /// Launch contract checked by host/src/grouped.rs: a, w, out and the dispatch's buffers of
    /// the sizes given, k and n multiples of 8, a and w 16-byte aligned, grid and shared memory
    /// for these tiles.
    #[inline(always)]
    unsafe fn grouped<const MT: usize, const BK: u32>(p: GroupedParams) {
        grid_dependency_wait();
        let bm = 32 * MT as u32;
        let (tid, w, lane) = (thread_x(), warp_id(), lane_id());
        let (a_bytes, b_bytes) = (tile_bytes(bm, BK), tile_bytes(GROUPED_N, BK));
        let found = dyn_smem_f32().wrapping_add((GROUPED_STAGES * (a_bytes + b_bytes) / 4) as usize) as *mut u32;
        let stride = tile_stride(BK);
        let stage_tiles = |s: u32| {
            let at = s * (a_bytes + b_bytes);
            (Tile { addr: smem_addr(at), stride }, Tile { addr: smem_addr(at + a_bytes), stride })
        };
        // SAFETY: as the doc says; the stages and the two words fit in the shared memory;
        // `staged_but` separates each stage's loads from its reads, and stage s is reloaded
        // only after the barrier that follows every warp's reads of it.
        unsafe {
            if w == 0 {
                // This block's expert and first row: lane l sums the tiles of experts
                // `l per .. (l + 1) per`, a prefix sum over the lanes finds whose tiles hold
                // block x.
                let per = p.experts.div_ceil(32);
                let (e0, e1) = ((lane * per).min(p.experts), ((lane + 1) * per).min(p.experts));
                let tiles = |e: u32| (ld(p.offsets, e as usize + 1) - ld(p.offsets, e as usize)).div_ceil(bm);
                let mut mine = 0u64;
                for e in e0..e1 {
                    mine += tiles(e) as u64;
                }
                let end = warp_inclusive_sum_u64(mine);
                let (i, mut at) = (block_x() as u64, end - mine);
                if lane == 0 {
                    st(found, 0, u32::MAX);
                }
                sync_warp();
                if at <= i && i < end {
                    for e in e0..e1 {
                        let t = tiles(e) as u64;
                        if at <= i && i < at + t {
                            st(found, 0, e);
                            st(found, 1, ((i - at) as u32) * bm);
                        }
                        at += t;
                    }
                }
            }
            sync_threads();
            let (e, m0) = (ld(found, 0), ld(found, 1));
            if e == u32::MAX {
                return;
            }
            let lo = ld(p.offsets, e as usize) + m0;
            let rows = (ld(p.offsets, e as usize + 1) - lo).min(bm);
            let n0 = block_y() * GROUPED_N;
            let cols = (p.n - n0).min(GROUPED_N);
            let k = p.k as usize;
            // This thread's 16-byte chunks of a stage: rows `r + rpp i` (A rows below bm, B rows
            // below GROUPED_N), columns `c .. c + 8` of the step; the sources' rows fixed for the
            // whole product.
            let per_row = BK / 8;
            let (rpp, r, c) = (GROUPED_BLOCK / per_row, tid / per_row, 8 * (tid % per_row));
            let (a_passes, b_passes) = ((bm / rpp) as usize, (GROUPED_N / rpp) as usize);
            let mut a_src = [p.a; 4];
            let mut a_ok = [false; 4];
            for i in 0..a_passes {
                let ar = r + rpp * i as u32;
                a_ok[i] = ar < rows;
                if a_ok[i] {
                    let row =
                        if p.token.is_null() { (lo + ar) as usize } else { ld(p.token, (lo + ar) as usize) as usize };
                    a_src[i] = p.a.wrapping_add(row * k + c as usize);
                }
            }
            let b_src = p.w.wrapping_add((e as usize * p.n as usize + (n0 + r) as usize) * k + c as usize);
            let steps = p.k.div_ceil(BK);
            let load = |step: u32| {
                if step < steps {
                    let (at, bt) = stage_tiles(step % GROUPED_STAGES);
                    let k0 = step * BK;
                    let in_k = k0 + c < p.k;
                    let off = k0 as usize;
                    for i in 0..a_passes {
                        let ok = a_ok[i] && in_k;
                        copy16(at.at(r + rpp * i as u32, c), if ok { a_src[i].wrapping_add(off) } else { p.a }, ok);
                    }
                    for i in 0..b_passes {
                        let br = r + rpp * i as u32;
                        let ok = br < cols && in_k;
                        let src = b_src.wrapping_add(off + i * rpp as usize * k);
                        copy16(bt.at(br, c), if ok { src } else { p.w }, ok);
                    }
                }
                commit();
            };
            for s in 0..GROUPED_STAGES - 1 {
                load(s);
            }
            let (wm, wn) = (16 * MT as u32 * (w / 4), 32 * (w % 4));
            let mut acc = [[[0.0f32; 4]; 4]; MT];
            for step in 0..steps {
                staged_but::<{ GROUPED_STAGES - 2 }>();
                load(step + GROUPED_STAGES - 1);
                let (at, bt) = stage_tiles(step % GROUPED_STAGES);
                for ks in 0..BK / 16 {
                    let a: [[u32; 4]; MT] = core::array::from_fn(|i| at.a(wm + 16 * i as u32, 16 * ks));
                    for j in 0..2 {
                        let b = bt.b_nk(16 * ks, wn + 16 * j);
                        for (i, a) in a.iter().enumerate() {
                            mma(&mut acc[i][2 * j as usize], *a, b[0]);
                            mma(&mut acc[i][2 * j as usize + 1], *a, b[1]);
                        }
                    }
                }
            }
            let relu2 = p.relu2 != 0;
            let f = |v: f32| {
                if relu2 {
                    let r = fmax(bf16_to_f32(f32_to_bf16(v)), 0.0);
                    r * r
                } else {
                    v
                }
            };
            for (i, tiles) in acc.iter().enumerate() {
                for (j, t) in tiles.iter().enumerate() {
                    let col = wn + 8 * j as u32 + acc_col(lane, 0);
                    for h in 0..2 {
                        let row = wm + 16 * i as u32 + acc_row(lane, 2 * h);
                        if row < rows && col < cols {
                            let v = pack(f(t[2 * h as usize]), f(t[2 * h as usize + 1]));
                            let at = (lo + row) as usize * p.n as usize + (n0 + col) as usize;
                            st(p.out.wrapping_add(at) as *mut u32, 0, v);
                        }
                    }
                }
            }
        }
    }
}
