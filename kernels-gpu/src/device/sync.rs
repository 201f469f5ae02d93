//! Ordering: the grid dependency wait of programmatic dependent launch, block and warp
//! barriers, and `last_block` (the last block of a grid to arrive).

use core::arch::{asm, nvptx};

use super::thread_x;
#[cfg(feature = "timeline")]
use super::timeline::{self, globaltimer};

/// The first statement of every kernel, or of a weight-streaming kernel the first after it
/// has issued its first weight loads (weights are never written while kernels run; see
/// moe.rs `partial_dots`), or of the fused Mamba decode the first after its loads of what
/// only earlier steps wrote (mamba.rs) (programmatic dependent launch, sm_90+): lets the
/// stream's next kernel start launching its blocks now, then waits until the kernel before
/// this one has completed and its memory is visible. Kernels that load early are launched
/// with programmatic stream serialization allowed (host/src/gpu/launch.rs, `Kernel::loads_early`),
/// so without this wait one could read its inputs before they are written; with it, work is
/// ordered as on a plain stream while the next launch overlaps this kernel's tail. (For the
/// others the wait returns at once: they start after the kernel before has completed.)
#[inline(always)]
pub fn grid_dependency_wait() {
    dependency::<false>();
}

/// [`grid_dependency_wait`] in the other order: waits, then lets the next kernel launch. Once
/// this wait has returned every kernel before this one has completed, so the next kernel may
/// read what they wrote before its own wait (not what this one writes).
#[inline(always)]
pub fn grid_dependency_wait_first() {
    dependency::<true>();
}

#[inline(always)]
fn dependency<const WAIT_FIRST: bool>() {
    #[cfg(feature = "timeline")]
    let t0 = globaltimer();
    // SAFETY: no operands; the implicit memory clobber keeps every access after the wait.
    unsafe {
        if WAIT_FIRST {
            asm!("griddepcontrol.wait;", "griddepcontrol.launch_dependents;", options(nostack))
        } else {
            asm!("griddepcontrol.launch_dependents;", "griddepcontrol.wait;", options(nostack))
        }
    }
    #[cfg(feature = "timeline")]
    timeline::record(t0);
}

/// Barrier `id` (1 to 15; 0 is [`sync_threads`]'s) of the `threads` threads (a multiple of
/// 32: whole warps) that use it: a part of the block waiting for itself alone (sm_90a's PTX
/// only, where its one user is).
///
/// # Safety
/// Exactly `threads` threads use barrier `id` (each of its warps whole, in uniform flow), and
/// no one else at the same time.
#[cfg(target_feature = "sm_90a")]
#[inline(always)]
pub unsafe fn sync_named(id: u32, threads: u32) {
    // SAFETY: guaranteed by the caller.
    unsafe { asm!("bar.sync {i}, {n};", i = in(reg32) id, n = in(reg32) threads, options(nostack)) }
}

/// Block-wide barrier. Every thread of the block must reach it.
#[inline(always)]
pub fn sync_threads() {
    // SAFETY: callers keep the barrier in uniform control flow.
    unsafe { nvptx::_syncthreads() }
}

/// Whether this block is the last of `blocks` to get here (every thread gets the answer), by
/// the counter `*count` in global memory: zero on entry, zero again when the last block
/// leaves (it resets it). Everything the block's threads wrote before the call is visible to
/// the last block's threads after it: a barrier, then one thread's release (a gpu-scope fence
/// and the arrival) and, in the last block, its acquire (a fence) before a second barrier, the
/// shape of a grid-wide barrier. Barriers inside: call it in uniform flow, with `flag` one word
/// of shared memory.
///
/// # Safety
/// `count` must point at a u32 in global memory that only the blocks of this grid update.
#[inline(always)]
pub unsafe fn last_block(count: *mut u32, blocks: u32, flag: *mut u32) -> bool {
    use core::sync::atomic::{AtomicU32, Ordering::Relaxed};
    sync_threads();
    if thread_x() == 0 {
        // SAFETY: count is a live global u32 (caller), flag a shared word; the fences have no
        // operands.
        unsafe {
            asm!("fence.acq_rel.gpu;", options(nostack));
            let counter = AtomicU32::from_ptr(count);
            let last = counter.fetch_add(1, Relaxed) == blocks - 1;
            if last {
                counter.store(0, Relaxed);
                asm!("fence.acq_rel.gpu;", options(nostack));
            }
            *flag = u32::from(last);
        }
    }
    sync_threads();
    // SAFETY: flag was written before the barrier.
    unsafe { *flag != 0 }
}

/// Warp barrier: orders the shared-memory accesses of a full warp's lanes.
#[inline(always)]
pub fn sync_warp() {
    // SAFETY: all 32 lanes take part; callers run full warps in uniform flow.
    unsafe { asm!("bar.warp.sync 0xffffffff;", options(nostack)) }
}
