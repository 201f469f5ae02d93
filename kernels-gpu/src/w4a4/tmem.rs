//! [`GemmParams`] on the fifth-generation tensor cores (sm_110a: Jetson Thor), the layouts and
//! instructions of [`crate::tcgen05`] (its docs say how a block's product runs). First form:
//! assembled by ptxas and its data placement emulated on the CPU (host's tests/w4a4.rs); not
//! yet run on a GPU.

use super::*;
use crate::device::*;
use crate::mma::{commit, copy4, copy16, lds4, smem_addr};
use crate::tcgen05::*;

/// [`GemmParams`] in [`TC_M`] x [`TC_N`] tiles. Grid `(n / TC_N, m / TC_M)` rounded up, block
/// [`TC_BLOCK`], dynamic shared memory [`tc_smem_bytes`]: every thread copies its share of a
/// stage's rows and scales (`cp.async`: 8 chunks of A's rows and 8 of B's by
/// [`tile_copy`], row `t`'s four scale words of each), thread 0 issues the stage's scale
/// copies and products and commits them to the stage's mbarrier; the next stage's copies run
/// meanwhile, into the other slot once its products are done. Warp w writes rows `32 w ..`,
/// a thread its row's columns one at a time (a first form: a shared-memory transpose would
/// make the stores whole lines). Three blocks' shared memory fits an SM, two blocks' TMEM
/// ([`TMEM_COLS`] of 512): a third waits in its allocation until one of them ends.
///
/// # Safety
/// The launch contract of [`GemmParams`] (checked by host/src/w4a4.rs).
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn gemm_nvfp4_w4a4_tcgen05(p: GemmParams) {
    grid_dependency_wait();
    let (tid, warp, lane) = (thread_x(), warp_id(), lane_id());
    let (m0, n0) = (block_y() * TC_M, block_x() * TC_N);
    let base = smem_addr(0);
    let at = base.next_multiple_of(1024);
    let stage = |s: u32| at + s * STAGE_BYTES;
    let done = |s: u32| at + TC_STAGES * STAGE_BYTES + 8 * s;
    let slot = done(TC_STAGES);
    let bytes = row_bytes(p.k as usize);
    let steps = p.k.div_ceil(STAGE_K);
    // MMAs of stage `step`: k is a multiple of 64.
    let mmas = |step: u32| ((p.k - step * STAGE_K) / MMA_K).min(STAGE_K / MMA_K);
    // SAFETY: a holds m rows and w n rows of row_bytes(k) (the launcher checks them), read
    // only below m, n and k (the rest zeros); the stages, mbarriers and slot fit the shared
    // memory. A slot is refilled only after its stage's products and scale copies completed
    // (its mbarrier's phase), read by the tensor cores only after every thread's copies
    // landed and were fenced to the async proxy before the barrier; TMEM is allocated by warp
    // 0 before the barrier that publishes its address, freed by warp 0 after every warp's
    // loads (fenced, barrier).
    unsafe {
        if warp == 0 {
            tmem_alloc(slot);
        }
        if tid == 0 {
            for s in 0..TC_STAGES {
                mbar_init(done(s), 1);
            }
            fence_mbar_init();
        }
        fence_before_sync();
        sync_threads();
        fence_after_sync();
        let tmem = lds4(slot);
        let load = |step: u32| {
            if step < steps {
                let st = stage(step % TC_STAGES);
                let (kb, n_mma) = (step * STAGE_K / 2, mmas(step));
                for (rows, r0, operand, src) in [(p.m, m0, 0, p.a), (p.n, n0, 1, p.w)] {
                    let tile = st + stage_offsets(0)[operand];
                    for i in 0..8 {
                        let (r, c) = tile_copy(tid, i);
                        let ok = r0 + r < rows && kb + 16 * c < p.k / 2;
                        let from = src.wrapping_add((r0 + r) as usize * bytes + (kb + 16 * c) as usize);
                        copy16(tile + crate::swizzle_128(r, c), if ok { from } else { src } as *const u16, ok);
                    }
                    let scales =
                        src.wrapping_add((r0 + tid) as usize * bytes + (p.k / 2 + step * STAGE_K / 16) as usize);
                    for j in 0..4 {
                        let ok = r0 + tid < rows && j < n_mma;
                        let chunk = st + stage_offsets(j)[2 + operand];
                        copy4(
                            chunk + scale_offset(tid),
                            if ok { scales.wrapping_add(4 * j as usize) } else { src },
                            ok,
                        );
                    }
                }
            }
            commit();
        };
        load(0);
        for step in 0..steps {
            let s = step % TC_STAGES;
            if step + 1 >= TC_STAGES && step + 1 < steps {
                // The products of the stage last in the slot stage step + 1 fills are done.
                let prev = step + 1 - TC_STAGES;
                mbar_wait(done(prev % TC_STAGES), (prev / TC_STAGES) % 2);
            }
            load(step + 1);
            core::arch::asm!("cp.async.wait_group 1;", options(nostack));
            fence_async_shared();
            sync_threads();
            if tid == 0 {
                fence_after_sync();
                let st = stage(s);
                for j in 0..mmas(step) {
                    let [_, _, sa, sb] = stage_offsets(j);
                    copy_scales(tmem + sfa_col(s, j), st + sa);
                    copy_scales(tmem + sfb_col(s, j), st + sb);
                }
                for j in 0..mmas(step) {
                    let [a, b, ..] = stage_offsets(0);
                    let descs = (smem_desc(st + a + 32 * j), smem_desc(st + b + 32 * j));
                    mma(tmem + ACC_COL, descs, (tmem + sfa_col(s, j), tmem + sfb_col(s, j)), step + j > 0);
                }
                commit_tc(done(s));
            }
        }
        let last = steps - 1;
        mbar_wait(done(last % TC_STAGES), (last / TC_STAGES) % 2);
        fence_after_sync();
        let alpha = p.scale * ld(p.global, 0);
        let row = m0 + 32 * warp + lane;
        for c in 0..TC_N / 16 {
            let v = load16(tmem + ((32 * warp) << 16) + ACC_COL + 16 * c);
            for (j, v) in v.into_iter().enumerate() {
                let col = n0 + 16 * c + j as u32;
                if row < p.m && col < p.n {
                    st(p.y, row as usize * p.n as usize + col as usize, f32_to_bf16(v * alpha));
                }
            }
        }
        fence_before_sync();
        sync_threads();
        if warp == 0 {
            fence_after_sync();
            tmem_free(tmem);
        }
    }
}
