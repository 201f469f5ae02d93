//! Shared memory the tensor cores read through the async proxy (`wgmma` on sm_90a, `tcgen05`
//! on the sm_100a family): the fence that hands the generic proxy's writes to the async proxy,
//! and mbarriers (sm_90+), the phases by which producers and consumers of such tiles hand them
//! over.

use core::arch::asm;

/// Makes this thread's writes to shared memory (completed `cp.async` copies, stores) visible
/// to the async proxy the tensor cores read through (`wgmma`, `tcgen05`); before the barrier
/// that publishes them.
#[inline(always)]
pub fn fence_async_shared() {
    // SAFETY: no operands.
    unsafe { asm!("fence.proxy.async.shared::cta;", options(nostack)) };
}

/// Makes `addr` (8 bytes of shared memory, 8-byte aligned) an mbarrier expecting `count`
/// arrivals a phase, in phase 0. Publish it (a block barrier) before any thread uses it.
///
/// # Safety
/// `addr` as said, no thread using it.
#[inline(always)]
pub unsafe fn mbar_init(addr: u32, count: u32) {
    // SAFETY: guaranteed by the caller.
    unsafe {
        asm!("mbarrier.init.shared::cta.b64 [{a}], {n};", a = in(reg32) addr, n = in(reg32) count, options(nostack))
    };
}

/// Makes this thread's mbarrier initializations visible to the arrivals that do not come from
/// the block's threads' own instructions (the tensor cores', copies'), before the barrier that
/// publishes them.
#[inline(always)]
pub fn fence_mbar_init() {
    // SAFETY: no operands.
    unsafe { asm!("fence.mbarrier_init.release.cluster;", options(nostack)) };
}

/// One arrival on the mbarrier at `addr` for this warp, by one of its lanes (`elect.sync`):
/// release, for what every lane did before a point the whole warp passed together (a
/// `.sync.aligned` wait, say); no lane's id held for it.
///
/// # Safety
/// `addr` an initialized mbarrier of the block whose current phase expects the arrival; the
/// whole warp calls it in uniform flow.
#[cfg(target_feature = "sm_90a")]
#[inline(always)]
pub unsafe fn mbar_arrive_warp(addr: u32) {
    // SAFETY: guaranteed by the caller.
    unsafe {
        asm!(
            "{{",
            ".reg .pred p;",
            "elect.sync _|p, 0xffffffff;",
            "@p mbarrier.arrive.release.cta.shared::cta.b64 _, [{a}];",
            "}}",
            a = in(reg32) addr,
            options(nostack),
        )
    };
}

/// One arrival on the mbarrier at `addr` once all of this thread's `cp.async` copies issued
/// before have landed (`cp.async.mbarrier.arrive.noinc`: the arrival counts toward the
/// phase's expected count), so a thread whose wait sees the phase complete reads them. The
/// thread itself goes on at once.
///
/// # Safety
/// `addr` an initialized mbarrier of the block whose current phase expects the arrival.
#[cfg(target_feature = "sm_90a")]
#[inline(always)]
pub unsafe fn mbar_arrive_copies(addr: u32) {
    // SAFETY: guaranteed by the caller.
    unsafe { asm!("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [{a}];", a = in(reg32) addr, options(nostack)) };
}

/// Waits until the phase of parity `parity` of the mbarrier at `addr` has completed
/// (acquire: what the arrivals released is visible after it). A fresh barrier counts its
/// phase before 0, parity 1, as completed.
///
/// # Safety
/// `addr` an initialized mbarrier of the block; its phases do not run two ahead of this
/// wait (the parity names one phase).
#[inline(always)]
pub unsafe fn mbar_wait(addr: u32, parity: u32) {
    loop {
        let done: u32;
        // SAFETY: guaranteed by the caller (try_wait suspends a while, then answers).
        unsafe {
            asm!(
                "{{",
                ".reg .pred ok;",
                "mbarrier.try_wait.parity.shared::cta.b64 ok, [{a}], {par};",
                "selp.u32 {d}, 1, 0, ok;",
                "}}",
                a = in(reg32) addr,
                par = in(reg32) parity,
                d = out(reg32) done,
                options(nostack),
            )
        };
        if done != 0 {
            return;
        }
    }
}
