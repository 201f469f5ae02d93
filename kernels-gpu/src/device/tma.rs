//! The tensor memory accelerator (sm_90a): copies of a tensor map's boxes into shared memory
//! (`cp.async.bulk.tensor`, zeros where a box reaches past the tensor), completing on an
//! mbarrier by their bytes; the arrival that expects those bytes; and the address of a kernel
//! parameter, where the maps travel (by value, as CUDA's grid constants).

use core::arch::asm;

/// The generic address of kernel parameter `$name` (`<entry>_param_<i>`, as the PTX names an
/// entry's parameters): `mov` of the parameter's symbol (its address in the parameter space),
/// then `cvta.param`. A name that is not a parameter of the entry the code is inlined into
/// fails ptxas.
macro_rules! param_address {
    ($name:literal) => {{
        let at: u64;
        // SAFETY: reads an address; no memory touched.
        unsafe {
            core::arch::asm!(
                concat!("mov.u64 {a}, ", $name, ";"),
                "cvta.param.u64 {a}, {a};",
                a = out(reg64) at,
                options(pure, nomem, nostack),
            )
        };
        at
    }};
}
pub(crate) use param_address;

/// One arrival on the mbarrier at `addr` (release) that also raises the bytes its current
/// phase waits for by `bytes` (`mbarrier.arrive.expect_tx`): the phase completes once its
/// arrivals are in and that many bytes of copies completed on it. Copies that complete before
/// this arrival count toward the same phase.
///
/// # Safety
/// `addr` an initialized mbarrier of the block whose current phase expects the arrival.
#[inline(always)]
pub unsafe fn mbar_arrive_expect(addr: u32, bytes: u32) {
    // SAFETY: guaranteed by the caller.
    unsafe {
        asm!(
            "mbarrier.arrive.expect_tx.release.cta.shared::cta.b64 _, [{a}], {n};",
            a = in(reg32) addr,
            n = in(reg32) bytes,
            options(nostack),
        )
    };
}

/// Copies the box of the 2-D tensor map at `map` (a generic address) whose first element is
/// at coordinates `(x, y)` (innermost first) to shared address `dst`, completing `bytes` of
/// the mbarrier at `mbar` (the box's full size, also where part of it lies past the tensor and
/// is filled with zeros).
///
/// # Safety
/// `map` a valid tensor map, 64-byte aligned, in the parameter, constant or global space;
/// `dst` as its swizzle needs (1024-byte aligned for the 128-byte swizzle) with the box's
/// bytes free until the phase completes; `mbar` an initialized mbarrier of the block whose
/// current phase expects the bytes.
#[inline(always)]
pub unsafe fn tma_load_2d(dst: u32, map: u64, mbar: u32, (x, y): (u32, u32)) {
    // SAFETY: guaranteed by the caller.
    unsafe {
        asm!(
            "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [{d}], [{m}, {{{x}, {y}}}], [{b}];",
            d = in(reg32) dst,
            m = in(reg64) map,
            x = in(reg32) x,
            y = in(reg32) y,
            b = in(reg32) mbar,
            options(nostack),
        )
    };
}

/// As [`tma_load_2d`] for a 3-D tensor map, the box at `(x, y, z)`.
///
/// # Safety
/// As [`tma_load_2d`].
#[inline(always)]
pub unsafe fn tma_load_3d(dst: u32, map: u64, mbar: u32, (x, y, z): (u32, u32, u32)) {
    // SAFETY: guaranteed by the caller.
    unsafe {
        asm!(
            "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [{d}], [{m}, {{{x}, {y}, {z}}}], [{b}];",
            d = in(reg32) dst,
            m = in(reg64) map,
            x = in(reg32) x,
            y = in(reg32) y,
            z = in(reg32) z,
            b = in(reg32) mbar,
            options(nostack),
        )
    };
}
