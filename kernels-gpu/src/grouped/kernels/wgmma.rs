//! The `wgmma` kernels of the tensor-core GEMM family (sm_90a PTX only): the grouped and
//! one-matrix products on warpgroup matrix products, bf16, FP8 and NVFP4 (weight-only). The
//! launch parameters and sizes are in `../../grouped.rs`; the block's tile lookup and the
//! [`Job`] they run are the parent's.

use super::*;

/// Grouped bf16 projection on `wgmma`, [`GroupedParams`]: [`WGMMA_M`] x [`WGMMA_N`] tiles.
/// Grid `(grouped_m_tiles(entries, experts, WGMMA_M), ceil(n / WGMMA_N))`, block
/// [`GROUPED_BLOCK`] (two warpgroups), dynamic shared memory [`wgmma_smem_bytes`];
/// sm_90a only.
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn moe_grouped_wgmma_bf16(p: GroupedParams) {
    // SAFETY: the launch contract is the caller's.
    unsafe { grouped_wgmma(bf16_job(p)) }
}

/// As `moe_grouped_wgmma_bf16` for [`GroupedFp8Params`] (e4m3 `wgmma`, k32 a step) with the
/// launch's tensor maps ([`Tma`]): [`grouped_wgmma_ws`]'s grid, block and shared memory.
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn moe_grouped_wgmma_fp8(p: Tma<GroupedFp8Params>) {
    let maps = tma_maps(param_address!("moe_grouped_wgmma_fp8_param_0"));
    // SAFETY: the launch contract is the caller's.
    unsafe { grouped_wgmma_ws(fp8_job(p.p), maps) }
}

/// Grouped NVFP4 projection on `wgmma` (weight-only), [`GroupedNvfp4Params`]: grid and block
/// as `moe_grouped_wgmma_bf16`'s, dynamic shared memory [`wgmma_nvfp4_smem_bytes`]; sm_90a
/// only.
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn moe_grouped_wgmma_nvfp4(p: GroupedNvfp4Params) {
    let job = Job::plain(p.a as *const u8, p.w, p.out, (0, p.n, p.k, p.relu2));
    let job = Job { token: p.token, w_scale: p.global, offsets: p.offsets, experts: p.experts, ..job };
    // SAFETY: the launch contract is the caller's.
    unsafe { grouped_wgmma_nvfp4(job) }
}

/// bf16 product of rows by one matrix on `wgmma`, [`GemmParams`]: grid `(ceil(rows /
/// WGMMA_M), ceil(n / WGMMA_N))`, block and shared memory as `moe_grouped_wgmma_bf16`'s;
/// sm_90a only.
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn gemm_wgmma_bf16(p: GemmParams) {
    // SAFETY: the launch contract is the caller's.
    unsafe { grouped_wgmma(gemm_bf16_job(p)) }
}

/// As `gemm_wgmma_bf16` for [`GemmFp8Params`] (e4m3 `wgmma`) with the launch's tensor maps
/// ([`Tma`]): [`grouped_wgmma_ws`]'s grid, block and shared memory.
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn gemm_wgmma_fp8(p: Tma<GemmFp8Params>) {
    let maps = tma_maps(param_address!("gemm_wgmma_fp8_param_0"));
    // SAFETY: the launch contract is the caller's.
    unsafe { grouped_wgmma_ws(gemm_job(p.p), maps) }
}

/// The generic address of the 64-byte aligned copy of the maps of the [`Tma`] parameter at
/// `at`.
#[inline(always)]
fn tma_maps(at: u64) -> u64 {
    at + (core::mem::size_of::<TmaMaps>() * tma_maps_copy(at)) as u64
}

impl BlockTile {
    /// Stores this thread's accumulators of the tile: `f(v s)` by [`BlockTile::put`], `s` the
    /// matrix's scale `ws` times the row's scale where `j.a_scale` is given. `acc` holds the
    /// warpgroup's halves of `width` columns each (128, or 96 in their first 48 accumulators)
    /// side by side from column `col0`, its rows from `row0`.
    ///
    /// # Safety
    /// The outputs and `j.a_scale` (where given) hold the tile's rows.
    #[inline(always)]
    unsafe fn store_wgmma(&self, j: &Job, acc: &[[f32; 64]], (row0, col0, width): (u32, u32, u32), ws: f32) {
        use crate::wgmma::{acc_col, acc_row};
        let (w, lane) = (warp_id(), lane_id());
        let relu2 = j.relu2 != 0;
        let f = |v: f32| relu2_if(v, relu2);
        // SAFETY: forwarded.
        let next = unsafe { self.next_scale(j) };
        for rh in 0..2u32 {
            let row = row0 + acc_row(w % 4, lane, 2 * rh);
            if row >= self.rows {
                continue;
            }
            // SAFETY: forwarded (row is one of the tile's).
            let s = if j.a_scale.is_null() { ws } else { ws * unsafe { ld(j.a_scale, (self.lo + row) as usize) } };
            for (h, half) in acc.iter().enumerate() {
                for q in 0..width / 8 {
                    let i = 4 * q + 2 * rh;
                    let col = col0 + width * h as u32 + acc_col(lane, i);
                    if col < self.cols {
                        let v = (f(half[i as usize] * s), f(half[i as usize + 1] * s));
                        // SAFETY: forwarded (the tile's row and column).
                        unsafe { self.put(j, (row, col), v, next) };
                    }
                }
            }
        }
    }
}

/// The `wgmma` grouped kernel: a block's [`WGMMA_M`] x [`WGMMA_N`] tile, warpgroup g its rows
/// `64 g .. + 64`, k through a ring of [`WGMMA_STAGES`] stages of 128 bytes of every row
/// (swizzled tiles, `cp.async` by all 256 threads, 4 chunks of A and 8 of B each), each
/// stage's products one [`mma_stage`] a warpgroup (waited for before the next barrier, so
/// the stage loaded after that barrier, the one read before it, is free). The loads run
/// three stages ahead of the products. A tile of at most 64 rows (an expert's last) is split
/// by columns instead: each warpgroup its 128 over the 64 rows ([`mma_half`]), half a full
/// tile's products.
///
/// # Safety
/// As [`grouped`], with this kernel's grid and shared memory.
#[inline(always)]
unsafe fn grouped_wgmma(j: Job) {
    use crate::wgmma::{STAGE_ROW_BYTES, SwizzledTile, mma_half, mma_stage};
    grid_dependency_wait();
    let tid = thread_x();
    let g = warp_id() / 4;
    let (n_tile, stages) = (WGMMA_N, WGMMA_STAGES);
    let (a_bytes, b_bytes) = (WGMMA_M * STAGE_ROW_BYTES, n_tile * STAGE_ROW_BYTES);
    let base = smem_addr(0);
    let pad = base.next_multiple_of(1024) - base;
    let found = dyn_smem_f32().wrapping_add(((pad + stages * (a_bytes + b_bytes)) / 4) as usize) as *mut u32;
    let stage_tiles = |s: u32| {
        let at = base + pad + s * (a_bytes + b_bytes);
        (SwizzledTile { addr: at }, SwizzledTile { addr: at + a_bytes })
    };
    // SAFETY: as the doc says; the stages (1024-byte aligned) and the two words fit in the
    // shared memory; each stage's copies are complete, fenced to the async proxy and
    // published by the barrier before any warpgroup's products read it, and reloaded only
    // after the barrier that follows every warpgroup's wait for those products.
    unsafe {
        let Some(t) = BlockTile::of_block(&j, (WGMMA_M, n_tile), found) else { return };
        let kb = 2 * j.k as usize;
        // This thread's 16-byte chunks of a stage: chunk c of rows `r + 32 i` (4 of A, 8
        // of B), the sources' rows fixed for the whole product.
        let (r, c) = (tid / 8, tid % 8);
        let (a_src, a_ok) = t.a_rows(&j, kb, (r, 32, 16 * c), 4);
        let b_src = j.w.wrapping_add((t.e as usize * j.n as usize + (t.n0 + r) as usize) * kb + 16 * c as usize);
        let steps = (kb as u32).div_ceil(STAGE_ROW_BYTES);
        let load = |step: u32| {
            if step < steps {
                let (at, bt) = stage_tiles(step % stages);
                let k0 = step * STAGE_ROW_BYTES;
                let in_k = k0 + 16 * c < kb as u32;
                let off = k0 as usize;
                for i in 0..4 {
                    let ok = a_ok[i] && in_k;
                    let src = if ok { a_src[i].wrapping_add(off) } else { j.a };
                    copy16_l2(at.chunk(r + 32 * i as u32, c), src as *const u16, ok);
                }
                for i in 0..(n_tile / 32) as usize {
                    let br = r + 32 * i as u32;
                    let ok = br < t.cols && in_k;
                    let src = b_src.wrapping_add(off + 32 * i * kb);
                    copy16_l2(bt.chunk(br, c), if ok { src } else { j.w } as *const u16, ok);
                }
            }
            commit();
        };
        for s in 0..stages - 1 {
            load(s);
        }
        let mut acc = [[0.0f32; 64]; 2];
        let (half, split) = (n_tile / 2, t.rows <= 64);
        for step in 0..steps {
            // Stage `step` in: this thread's copies done and fenced, then everyone's.
            core::arch::asm!("cp.async.wait_group {n};", n = const WGMMA_STAGES - 2, options(nostack));
            fence_async_shared();
            sync_threads();
            load(step + stages - 1);
            let (at, bt) = stage_tiles(step % stages);
            if split {
                let a: [u64; 4] = core::array::from_fn(|kk| at.desc(0, 32 * kk as u32));
                let b: [u64; 4] = core::array::from_fn(|kk| bt.desc(half * g, 32 * kk as u32));
                mma_half(&mut acc[0], a, b);
            } else {
                let a: [u64; 4] = core::array::from_fn(|kk| at.desc(64 * g, 32 * kk as u32));
                let b: [[u64; 4]; 2] =
                    core::array::from_fn(|h| core::array::from_fn(|kk| bt.desc(half * h as u32, 32 * kk as u32)));
                mma_stage(&mut acc, a, b);
            }
        }
        let ws = if j.w_scale.is_null() { 1.0 } else { ld(j.w_scale, t.e as usize) };
        if split {
            t.store_wgmma(&j, &acc[..1], (0, half * g, half), ws);
        } else {
            t.store_wgmma(&j, &acc, (64 * g, 0, half), ws);
        }
    }
}

/// Registers (`setmaxnreg`) of a producer thread and of a consumer thread of
/// [`grouped_wgmma_ws`]: 128 x 40 + 256 x 232 of the 65536 an SM has.
const WS_PRODUCER_REGS: u32 = 40;
const WS_CONSUMER_REGS: u32 = 232;

/// The FP8 `wgmma` grouped kernel, warp-specialized: a block's [`WGMMA_M`] x [`WGMMA_FP8_N`]
/// tile, consumer warpgroup g (0 or 1) its rows `64 g .. + 64`, thread 256 of warpgroup 2 the
/// producer ([`WGMMA_WS_BLOCK`] threads; the rest of warpgroup 2 leaves at once). k runs
/// through a ring of [`WGMMA_FP8_STAGES`] stages of 128 bytes of every row (swizzled tiles),
/// each with two mbarriers: `full` (the producer's arrival with the stage's bytes, then the
/// copies' bytes) and `empty` (each of the 8 consumer warps done with the products that read
/// it). For each stage, once its `empty` phase of the round before completed, the producer
/// copies it with the tensor memory accelerator (`maps`: [`TmaMaps`] at that generic address):
/// A's boxes of [`TMA_A_BOX_ROWS`] rows, as many as the tile's rows need (rows past them hold
/// an earlier stage's: each product row reads only its own row of A, and rows past the tile
/// are never stored), and the weights' box of the tile's columns. A consumer warpgroup waits
/// for `full`, runs its [`mma_stage_fp8`] (waited for inside) and each of its warps arrives on
/// `empty`. No block barrier in the k loop: the two consumer warpgroups run apart, so one's
/// products overlap the other's waits and promotions, and neither issues a copy. A tile of at
/// most 64 rows (an expert's last) is split by columns instead: each consumer warpgroup its 96
/// over the 64 rows ([`mma_half_fp8`]), half a full tile's products.
///
/// # Safety
/// As [`grouped`] (no `token`: A is the rows as they lie), with this kernel's grid, block and
/// shared memory ([`wgmma_ws_smem_bytes`]); `maps` the launch's [`TmaMaps`] (A `[rows, k]`,
/// the weights `[matrices, n, k]`), 64-byte aligned.
#[inline(always)]
unsafe fn grouped_wgmma_ws(j: Job, maps: u64) {
    use crate::wgmma::{STAGE_ROW_BYTES, SwizzledTile, mma_half_fp8, mma_stage_fp8, set_max_regs};
    grid_dependency_wait();
    let tid = thread_x();
    let g = warp_id() / 4;
    let (n_tile, stages) = (WGMMA_FP8_N, WGMMA_FP8_STAGES);
    let (a_bytes, b_bytes) = (WGMMA_M * STAGE_ROW_BYTES, n_tile * STAGE_ROW_BYTES);
    let base = smem_addr(0);
    let ring = base.next_multiple_of(1024);
    let stage_tiles = |s: u32| {
        let at = ring + s * (a_bytes + b_bytes);
        (SwizzledTile { addr: at }, SwizzledTile { addr: at + a_bytes })
    };
    let full = |s: u32| ring + stages * (a_bytes + b_bytes) + 8 * s;
    let empty = |s: u32| full(stages) + 8 * s;
    let found = dyn_smem_f32().wrapping_add(((empty(stages) - base) / 4) as usize) as *mut u32;
    // SAFETY: as the doc says; the stages (1024-byte aligned), the mbarriers and the two words
    // fit in the shared memory; the mbarriers are initialized before the block barrier that
    // publishes them; a stage is read only after its `full` phase completed (its copies
    // landed) and copied again only after its `empty` phase (every consumer warp done with the
    // products that read it) completed.
    unsafe {
        let Some(t) = BlockTile::of_block(&j, (WGMMA_M, n_tile), found) else { return };
        if tid == 0 {
            for s in 0..stages {
                mbar_init(full(s), 1);
                mbar_init(empty(s), 8);
            }
            fence_mbar_init();
        }
        sync_threads();
        let steps = j.k.div_ceil(STAGE_ROW_BYTES);
        if g == 2 {
            set_max_regs::<false, WS_PRODUCER_REGS>();
            if tid == 256 {
                let box_a = TMA_A_BOX_ROWS * STAGE_ROW_BYTES;
                let a_boxes = t.rows.div_ceil(TMA_A_BOX_ROWS);
                let (a_map, w_map) = (maps, maps + core::mem::offset_of!(TmaMaps, w) as u64);
                for step in 0..steps {
                    let s = step % stages;
                    if step >= stages {
                        mbar_wait(empty(s), (step / stages - 1) % 2);
                    }
                    mbar_arrive_expect(full(s), a_boxes * box_a + b_bytes);
                    let (at, bt) = stage_tiles(s);
                    let k0 = step * STAGE_ROW_BYTES;
                    for b in 0..a_boxes {
                        tma_load_2d(at.addr + b * box_a, a_map, full(s), (k0, t.lo + b * TMA_A_BOX_ROWS));
                    }
                    tma_load_3d(bt.addr, w_map, full(s), (k0, t.n0, t.e));
                }
            }
            return;
        }
        set_max_regs::<true, WS_CONSUMER_REGS>();
        let half = n_tile / 2;
        let ws = if j.w_scale.is_null() { 1.0 } else { ld(j.w_scale, t.e as usize) };
        if t.rows <= 64 {
            // A tile of at most 64 rows (an expert's last): each warpgroup its half of the
            // columns over the 64 rows, so the block's products are half a full tile's.
            let mut acc = [0.0f32; 64];
            for step in 0..steps {
                let s = step % stages;
                mbar_wait(full(s), (step / stages) % 2);
                let (at, bt) = stage_tiles(s);
                let a: [u64; 4] = core::array::from_fn(|kk| at.desc(0, 32 * kk as u32));
                let b: [u64; 4] = core::array::from_fn(|kk| bt.desc(half * g, 32 * kk as u32));
                mma_half_fp8(&mut acc, a, b);
                mbar_arrive_warp(empty(s));
            }
            t.store_wgmma(&j, core::slice::from_ref(&acc), (0, half * g, half), ws);
            return;
        }
        let mut acc = [[0.0f32; 64]; 2];
        for step in 0..steps {
            let s = step % stages;
            mbar_wait(full(s), (step / stages) % 2);
            let (at, bt) = stage_tiles(s);
            let a: [u64; 4] = core::array::from_fn(|kk| at.desc(64 * g, 32 * kk as u32));
            let b: [[u64; 4]; 2] =
                core::array::from_fn(|h| core::array::from_fn(|kk| bt.desc(half * h as u32, 32 * kk as u32)));
            mma_stage_fp8(&mut acc, a, b);
            mbar_arrive_warp(empty(s));
        }
        t.store_wgmma(&j, &acc, (64 * g, 0, half), ws);
    }
}

/// The NVFP4 `wgmma` grouped kernel: as [`grouped_wgmma`] for bf16, but B's stage is staged
/// as codes and scales ([`NVFP4_STAGE_ROW_BYTES`] of each weight row: thread t copies row t's
/// two 16-byte chunks of codes and its 4 scales) and made into bf16 by the thread that copied
/// it ([`fp4_in_order`]: each code times its block scale times 2^-9, exact) in one of two B
/// tiles, so a stage needs one barrier: after it this thread's copies of the stage are done, it
/// writes B tile `step % 2` (last read by the products two stages back, which every warpgroup
/// waited for before the last barrier), fences, and the barrier publishes A and B; then the
/// next loads (into the ring slot the products before the barrier read) and the products.
/// The sums times 2^9 and the matrix's per-tensor scale.
///
/// # Safety
/// As [`grouped`] with [`GroupedNvfp4Params`]' contract (k a multiple of 64, the weight rows
/// 16-byte aligned), this kernel's grid and shared memory.
#[inline(always)]
unsafe fn grouped_wgmma_nvfp4(j: Job) {
    use crate::mma::{copy4, lds4, lds16, sts16};
    use crate::qgemv::{FP4_SUM_SCALE, fp4_chunks};
    use crate::wgmma::{STAGE_ROW_BYTES, SwizzledTile, mma_stage};
    grid_dependency_wait();
    let tid = thread_x();
    let g = warp_id() / 4;
    let (a_bytes, b_bytes, raw_bytes) =
        (WGMMA_M * STAGE_ROW_BYTES, WGMMA_N * STAGE_ROW_BYTES, WGMMA_N * NVFP4_STAGE_ROW_BYTES);
    let base = smem_addr(0);
    let pad = base.next_multiple_of(1024) - base;
    let [a_at, b_at, raw_at, words] = wgmma_nvfp4_layout().map(|at| base + pad + at);
    let a_tile = |s: u32| SwizzledTile { addr: a_at + s * a_bytes };
    let b_tile = |s: u32| SwizzledTile { addr: b_at + s * b_bytes };
    let raw = |s: u32| raw_at + s * raw_bytes;
    let found = dyn_smem_f32().wrapping_add(((words - base) / 4) as usize) as *mut u32;
    // SAFETY: as the doc says; the tiles (1024-byte aligned), the ring and the two words fit in
    // the shared memory; each stage's A copies and B tile are complete, fenced to the async
    // proxy and published by the barrier before any warpgroup's products read them; a ring
    // slot is reloaded, and a B tile rewritten, only after the barrier that follows every
    // warpgroup's wait for the products that read it; a thread reads only the codes and
    // scales it copied itself, after its own wait.
    unsafe {
        let Some(t) = BlockTile::of_block(&j, (WGMMA_M, WGMMA_N), found) else { return };
        let (r, c) = (tid / 8, tid % 8);
        let (a_src, a_ok) = t.a_rows(&j, 2 * j.k as usize, (r, 32, 16 * c), 4);
        // Weight row t.n0 + tid: its codes, then its scales.
        let w_ok = tid < t.cols;
        let row_bytes = crate::nvfp4::row_bytes(j.k as usize);
        let w_row = j.w.wrapping_add((t.e as usize * j.n as usize + (t.n0 + tid) as usize) * row_bytes);
        let steps = j.k / 64;
        let load = |step: u32| {
            if step < steps {
                let s = step % WGMMA_STAGES;
                let off = (step * STAGE_ROW_BYTES) as usize;
                for i in 0..4 {
                    let src = if a_ok[i] { a_src[i].wrapping_add(off) } else { j.a };
                    copy16_l2(a_tile(s).chunk(r + 32 * i as u32, c), src as *const u16, a_ok[i]);
                }
                let codes = w_row.wrapping_add(32 * step as usize);
                for h in 0..2 {
                    let src = if w_ok { codes.wrapping_add(16 * h as usize) } else { j.w };
                    copy16_l2(raw(s) + 16 * (WGMMA_N * h + tid), src as *const u16, w_ok);
                }
                let scales = w_row.wrapping_add(j.k as usize / 2 + 4 * step as usize);
                copy4(raw(s) + 32 * WGMMA_N + 4 * tid, if w_ok { scales } else { j.w }, w_ok);
            }
            commit();
        };
        for s in 0..WGMMA_STAGES - 1 {
            load(s);
        }
        let mut acc = [[0.0f32; 64]; 2];
        for step in 0..steps {
            core::arch::asm!("cp.async.wait_group {n};", n = const WGMMA_STAGES - 2, options(nostack));
            let (rs, bt) = (raw(step % WGMMA_STAGES), b_tile(step % 2));
            let codes = [lds16(rs + 16 * tid), lds16(rs + 16 * (WGMMA_N + tid))];
            let scales = lds4(rs + 32 * WGMMA_N + 4 * tid);
            for pair in 0..2u32 {
                // Blocks 2 pair and 2 pair + 1: 32 weights, chunks 4 pair .. 4 pair + 4.
                let v = fp4_chunks(codes[pair as usize], (scales >> (16 * pair)) as u16);
                for (q, v) in v.into_iter().enumerate() {
                    sts16(bt.chunk(tid, 4 * pair + q as u32), v);
                }
            }
            fence_async_shared();
            sync_threads();
            load(step + WGMMA_STAGES - 1);
            let at = a_tile(step % WGMMA_STAGES);
            let a: [u64; 4] = core::array::from_fn(|kk| at.desc(64 * g, 32 * kk as u32));
            let b: [[u64; 4]; 2] =
                core::array::from_fn(|h| core::array::from_fn(|kk| bt.desc(128 * h as u32, 32 * kk as u32)));
            mma_stage(&mut acc, a, b);
        }
        t.store_wgmma(&j, &acc, (64 * g, 0, 128), ld(j.w_scale, t.e as usize) * FP4_SUM_SCALE);
    }
}
