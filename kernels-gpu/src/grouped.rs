//! Grouped GEMM on tensor cores: one projection of every MoE expert with rows, in one launch
//! (docs/MATH.md's expert MLP). A dispatch (`moe_dispatch`) has grouped the routing choices by
//! expert: expert e's rows are `offsets[e] .. offsets[e + 1]` of the grouped order. Grouped row
//! j of expert e gets `out[j] = f(a_j W_eᵀ)` with `W [experts, n, k]` (each expert's weight
//! row-major, a row per output), `a_j` row `token[j]` of `a` (gathered: the layer input) or row
//! j (the grouped hidden rows), and `f` either the identity or `relu(bf16(.))^2`, rounded to
//! bf16.
//!
//! # Work split
//! The grid is `(m tiles, n tiles)`: each expert's rows in tiles of [`GROUPED_M`] (as many
//! tiles as its rows need; the grid has room for the most any dispatch of this many rows and
//! experts can need, and the blocks past the dispatch's tiles return at once), outputs in tiles
//! of [`GROUPED_N`]. A block finds its expert and first row from the offsets (a warp's prefix
//! sum of the experts' tile counts), then runs `k` in steps of [`GROUPED_K`] through a ring of
//! [`GROUPED_STAGES`] shared-memory stages loaded by `cp.async` (zero past the rows and the
//! columns); warp w computes rows `32 (w / 4)` and columns `32 (w % 4)` of the block's tile on
//! `mma.sync` m16n8k16 (bf16 in, f32 sums). Blocks next to each other along x share an expert's
//! weight tile in L2.

use crate::KernelParams;
use crate::mma::tile_bytes;

/// Threads of a block: eight warps, 2 x 4 over the output tile.
pub const GROUPED_BLOCK: u32 = 256;
/// Rows of an output tile.
pub const GROUPED_M: u32 = 64;
/// Columns of an output tile.
pub const GROUPED_N: u32 = 128;
/// k staged at a time.
pub const GROUPED_K: u32 = 32;
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

/// Dynamic shared memory of `moe_grouped_bf16`: the stages' A and B tiles, then the block's
/// expert and first row.
pub const fn grouped_smem_bytes() -> u32 {
    GROUPED_STAGES * (tile_bytes(GROUPED_M, GROUPED_K) + tile_bytes(GROUPED_N, GROUPED_K)) + 8
}

/// Most m tiles a dispatch of `entries` rows over `experts` experts can need: every expert's
/// last tile may be partial.
pub const fn grouped_m_tiles(entries: u32, experts: u32) -> u32 {
    entries.div_ceil(GROUPED_M) + if experts < entries { experts } else { entries }
}

#[cfg(target_arch = "nvptx64")]
mod kernels {
    use super::*;
    use crate::device::*;
    use crate::mma::{Tile, acc_col, acc_row, commit, copy16, mma, pack, smem_addr, staged_but, tile_stride};

    /// Grouped projection, [`GroupedParams`]. Grid `(grouped_m_tiles(entries, experts),
    /// ceil(n / GROUPED_N))`, block [`GROUPED_BLOCK`], dynamic shared memory
    /// [`grouped_smem_bytes`]; the module docs say what a block does.
    #[unsafe(no_mangle)]
    pub unsafe extern "ptx-kernel" fn moe_grouped_bf16(p: GroupedParams) {
        grid_dependency_wait();
        let (tid, w, lane) = (thread_x(), warp_id(), lane_id());
        let (a_bytes, b_bytes) = (tile_bytes(GROUPED_M, GROUPED_K), tile_bytes(GROUPED_N, GROUPED_K));
        let found = dyn_smem_f32().wrapping_add((GROUPED_STAGES * (a_bytes + b_bytes) / 4) as usize) as *mut u32;
        let stride = tile_stride(GROUPED_K);
        let stage_tiles = |s: u32| {
            let at = s * (a_bytes + b_bytes);
            (Tile { addr: smem_addr(at), stride }, Tile { addr: smem_addr(at + a_bytes), stride })
        };
        // SAFETY: launch contract checked by host/src/grouped.rs (a, w, out and the dispatch's
        // buffers of the sizes given, k and n multiples of 8, a and w 16-byte aligned); the
        // stages and the two words fit in grouped_smem_bytes; `staged_but` separates each
        // stage's loads from its reads, and stage s is reloaded only after the barrier that
        // follows every warp's reads of it.
        unsafe {
            if w == 0 {
                // This block's expert and first row: lane l sums the tiles of experts
                // `l per .. (l + 1) per`, a prefix sum over the lanes finds whose tiles hold
                // block x.
                let per = p.experts.div_ceil(32);
                let (e0, e1) = ((lane * per).min(p.experts), ((lane + 1) * per).min(p.experts));
                let tiles = |e: u32| (ld(p.offsets, e as usize + 1) - ld(p.offsets, e as usize)).div_ceil(GROUPED_M);
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
                            st(found, 1, ((i - at) as u32) * GROUPED_M);
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
            let rows = (ld(p.offsets, e as usize + 1) - lo).min(GROUPED_M);
            let n0 = block_y() * GROUPED_N;
            let cols = (p.n - n0).min(GROUPED_N);
            let k = p.k as usize;
            // This thread's 16-byte chunks of a stage: A row `ar`, B rows `br + 64 i`, columns
            // `c .. c + 8` of the step; the sources' rows fixed for the whole product.
            let (ar, br, c) = (tid / 4, tid / 4, 8 * (tid % 4));
            let a_ok = ar < rows;
            let a_row = if !a_ok {
                0
            } else if p.token.is_null() {
                (lo + ar) as usize
            } else {
                ld(p.token, (lo + ar) as usize) as usize
            };
            let a_src = p.a.wrapping_add(a_row * k + c as usize);
            let b_src = p.w.wrapping_add((e as usize * p.n as usize + (n0 + br) as usize) * k + c as usize);
            let b_ok = [br < cols, br + 64 < cols];
            let steps = p.k.div_ceil(GROUPED_K);
            let load = |step: u32| {
                if step < steps {
                    let (at, bt) = stage_tiles(step % GROUPED_STAGES);
                    let k0 = step * GROUPED_K;
                    let in_k = k0 + c < p.k;
                    let off = k0 as usize;
                    copy16(at.at(ar, c), if a_ok && in_k { a_src.wrapping_add(off) } else { p.a }, a_ok && in_k);
                    for (i, ok) in b_ok.iter().enumerate() {
                        let ok = *ok && in_k;
                        let src = b_src.wrapping_add(off + i * 64 * k);
                        copy16(bt.at(br + 64 * i as u32, c), if ok { src } else { p.w }, ok);
                    }
                }
                commit();
            };
            for s in 0..GROUPED_STAGES - 1 {
                load(s);
            }
            let (wm, wn) = (32 * (w / 4), 32 * (w % 4));
            let mut acc = [[[0.0f32; 4]; 4]; 2];
            for step in 0..steps {
                staged_but::<{ GROUPED_STAGES - 2 }>();
                load(step + GROUPED_STAGES - 1);
                let (at, bt) = stage_tiles(step % GROUPED_STAGES);
                for ks in 0..GROUPED_K / 16 {
                    let a = [at.a(wm, 16 * ks), at.a(wm + 16, 16 * ks)];
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
