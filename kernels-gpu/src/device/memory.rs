//! Element loads and stores of device arrays, and the cache-steered ones: an L1 prefetch and a
//! load through L2.

use core::arch::asm;

/// Reads element `i` of a device array.
///
/// # Safety
/// `p.add(i)` must be in bounds of a live allocation the kernel may read.
#[inline(always)]
pub unsafe fn ld<T: Copy>(p: *const T, i: usize) -> T {
    // SAFETY: guaranteed by the caller.
    unsafe { *p.add(i) }
}

/// Writes element `i` of a device array.
///
/// # Safety
/// `p.add(i)` must be in bounds of a live allocation this thread alone writes at `i`.
#[inline(always)]
pub unsafe fn st<T: Copy>(p: *mut T, i: usize, v: T) {
    // SAFETY: guaranteed by the caller.
    unsafe { *p.add(i) = v }
}

/// Asks for the line holding `*p` in this SM's L1 (`prefetch.global.L1`: a hint, nothing
/// read into a register): for a kernel's reads of what no kernel running beside it writes,
/// started before its dependency wait.
///
/// # Safety
/// `p` must point into global memory the kernel may read.
#[inline(always)]
pub unsafe fn prefetch_l1<T>(p: *const T) {
    // SAFETY: guaranteed by the caller; a prefetch writes nothing.
    unsafe { asm!("prefetch.global.L1 [{a}];", a = in(reg64) p, options(readonly, nostack, preserves_flags)) }
}

/// `p[i]` read through L2 (`ld.global.cg`), past this SM's L1: for what another kernel wrote
/// that this one reads before its dependency wait (a line of an earlier kernel's read could
/// still be in L1).
///
/// # Safety
/// `p[i]` must be readable.
#[inline(always)]
pub unsafe fn ld_l2(p: *const i32, i: usize) -> i32 {
    let v: i32;
    // SAFETY: guaranteed by the caller.
    unsafe {
        asm!("ld.global.cg.s32 {v}, [{a}];", v = out(reg32) v, a = in(reg64) p.wrapping_add(i), options(readonly, nostack))
    };
    v
}
