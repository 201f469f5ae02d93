//! Routing of many tokens on tensor cores (docs/MATH.md section 6): the same math as
//! `moe_route_bf16` (router logits in f32 from bf16 activations and router weights, then its
//! selection, [`crate::moe`]), with the logits of a tile of [`ROUTER_TOKENS`] tokens against
//! every expert as one matrix product, so each token's activations are read once (the
//! one-launch kernel reads them once per expert).
//!
//! Block b: tokens `ROUTER_TOKENS b ..`; k (hidden) in steps of [`ROUTER_K`] through a ring of
//! [`ROUTER_STAGES`] shared-memory stages (`cp.async`, zero past the tokens and hidden); warp w
//! computes tokens `16 (w % 2) ..` against experts `(experts / 4) (w / 2) ..` on `mma.sync`
//! m16n8k16. The logits go to the launch's `[rows, experts]` f32 buffer; after the block's
//! barrier each warp selects for tokens `w, w + 8, ..` as `moe_route_bf16` does.

use crate::mma::tile_bytes;
use crate::moe::{LOGITS_BLOCK, MAX_EXPERTS};

/// Tokens per block.
pub const ROUTER_TOKENS: u32 = 32;
/// Threads per block: eight warps (the routing kernel's block).
pub const ROUTER_BLOCK: u32 = LOGITS_BLOCK;
/// k staged at a time.
pub const ROUTER_K: u32 = 32;
/// Stages of the shared-memory ring.
pub const ROUTER_STAGES: u32 = 3;

/// Dynamic shared memory of `moe_route_tc_bf16`: the stages (tokens and every expert's router
/// row), reused by the selection afterwards (`2 * MAX_EXPERTS` floats a warp).
pub const fn router_smem_bytes() -> u32 {
    let stages = ROUTER_STAGES * (tile_bytes(ROUTER_TOKENS, ROUTER_K) + tile_bytes(MAX_EXPERTS, ROUTER_K));
    let select = ROUTER_BLOCK / 32 * 2 * MAX_EXPERTS * 4;
    if stages > select { stages } else { select }
}

/// Whether the kernel takes `experts` (a multiple of 32 up to [`MAX_EXPERTS`]: each warp's
/// columns whole 16-wide steps).
pub const fn router_takes(experts: u32) -> bool {
    experts > 0 && experts.is_multiple_of(32) && experts <= MAX_EXPERTS
}

#[cfg(target_arch = "nvptx64")]
mod kernels {
    use super::*;
    use crate::device::*;
    use crate::mma::{Tile, acc_col, acc_row, commit, copy16, mma, smem_addr, staged_but, tile_stride};
    use crate::moe::{RouteParams, select};

    /// n8 tiles a warp holds at the most experts.
    const NT: usize = (MAX_EXPERTS / 4 / 8) as usize;

    /// Routing on tensor cores, [`RouteParams`] (no appended up projections, no counters).
    /// Grid `(ceil(rows / ROUTER_TOKENS))`, block [`ROUTER_BLOCK`], dynamic shared memory
    /// [`router_smem_bytes`]; experts as [`router_takes`] says.
    #[unsafe(no_mangle)]
    pub unsafe extern "ptx-kernel" fn moe_route_tc_bf16(p: RouteParams) {
        grid_dependency_wait();
        let (tid, w, lane) = (thread_x(), warp_id(), lane_id());
        let t0 = block_x() * ROUTER_TOKENS;
        let toks = (p.rows - t0).min(ROUTER_TOKENS);
        let (e, h) = (p.experts, p.hidden);
        let (a_bytes, b_bytes) = (tile_bytes(ROUTER_TOKENS, ROUTER_K), tile_bytes(MAX_EXPERTS, ROUTER_K));
        let stride = tile_stride(ROUTER_K);
        let stage_tiles = |s: u32| {
            let at = s * (a_bytes + b_bytes);
            (Tile { addr: smem_addr(at), stride }, Tile { addr: smem_addr(at + a_bytes), stride })
        };
        // SAFETY: launch contract checked by host/src/moe.rs (x rows * hidden, gate experts *
        // hidden, logits rows * experts, idx and weight rows * top_k; hidden a multiple of 8,
        // x and gate 16-byte aligned; experts as router_takes); the stages fit in
        // router_smem_bytes; `staged_but` separates each stage's loads from its reads, a stage
        // is reloaded only after the barrier that follows every warp's reads of it, and the
        // selection's shared memory is used only after the barrier that ends the products.
        unsafe {
            // A: token `tid / 4` (128 chunks: threads 0..128), columns `c .. c + 8`; B: expert rows
            // `tid / 4 + 64 i`.
            let (r, c) = (tid / 4, 8 * (tid % 4));
            let x = p.x.wrapping_add((t0 + r) as usize * h as usize + c as usize);
            let g = p.gate.wrapping_add((r * h + c) as usize);
            let steps = h.div_ceil(ROUTER_K);
            let load = |step: u32| {
                if step < steps {
                    let (at, bt) = stage_tiles(step % ROUTER_STAGES);
                    let k0 = step * ROUTER_K;
                    let in_k = k0 + c < h;
                    if r < ROUTER_TOKENS {
                        let ok = in_k && r < toks;
                        copy16(at.at(r, c), if ok { x.wrapping_add(k0 as usize) } else { p.x }, ok);
                    }
                    let mut i = 0;
                    while r + 64 * i < e {
                        let src = g.wrapping_add((64 * i * h + k0) as usize);
                        copy16(bt.at(r + 64 * i, c), if in_k { src } else { p.gate }, in_k);
                        i += 1;
                    }
                }
                commit();
            };
            for s in 0..ROUTER_STAGES - 1 {
                load(s);
            }
            let (wm, per) = (16 * (w % 2), e / 4);
            let wn = per * (w / 2);
            let mut acc = [[0.0f32; 4]; NT];
            for step in 0..steps {
                staged_but::<{ ROUTER_STAGES - 2 }>();
                load(step + ROUTER_STAGES - 1);
                let (at, bt) = stage_tiles(step % ROUTER_STAGES);
                for ks in 0..ROUTER_K / 16 {
                    let a = at.a(wm, 16 * ks);
                    for j in 0..NT / 2 {
                        if (16 * j as u32) < per {
                            let b = bt.b_nk(16 * ks, wn + 16 * j as u32);
                            mma(&mut acc[2 * j], a, b[0]);
                            mma(&mut acc[2 * j + 1], a, b[1]);
                        }
                    }
                }
            }
            for (j, t) in acc.iter().enumerate() {
                for (i, v) in t.iter().enumerate() {
                    let (row, col) = (wm + acc_row(lane, i as u32), wn + 8 * j as u32 + acc_col(lane, i as u32));
                    if (8 * j as u32) < per && row < toks {
                        st(p.logits, ((t0 + row) * e + col) as usize, *v);
                    }
                }
            }
            // Every warp's logits (and its reads of the stages) before any selection.
            sync_threads();
            let mut tok = w;
            while tok < toks {
                select(&p, (t0 + tok) as usize, dyn_smem_f32().wrapping_add((2 * MAX_EXPERTS * w) as usize));
                tok += ROUTER_BLOCK / 32;
            }
        }
    }
}
