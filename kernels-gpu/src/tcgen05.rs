//! The fifth-generation tensor cores (`tcgen05`, the sm_100a family: Jetson Thor's sm_110a)
//! for the W4A4 NVFP4 product ([`crate::w4a4`]'s `gemm_nvfp4_w4a4_tcgen05`): operands in
//! shared memory, block scales and f32 accumulators in tensor memory (TMEM: 128 lanes of
//! 32-bit columns a block), everything through inline PTX (ISA 9.0). Only the sm_110a PTX has
//! the kernel (`Kernel::in_arch`; `--cfg tcgen05`, host's ptx_build.rs).
//!
//! The layouts live here as functions the host compiles too, so host's tests/w4a4.rs can run
//! the kernel's own data placement through an emulation of the instructions written from the
//! PTX ISA's description of them (no GPU of the family is at hand).
//!
//! # A block's product
//! One thread issues, for a [`TC_M`] x [`TC_N`] tile, per stage of [`STAGE_K`] codes of k:
//! - `tcgen05.cp.cta_group::1.32x128b.warpx4` of each 64-k step's block scales, A's and B's,
//!   from a 512-byte chunk of shared memory ([`scale_offset`]: row m's four scales, the block
//!   of k 16 s at byte s, at `16 (m % 32) + 4 (m / 32)`) to four TMEM columns ([`sfa_col`],
//!   [`sfb_col`]): row `m % 32` of the chunk to lanes `m % 32 + 32 q` (every q), its four
//!   words to the four columns, so row m's scales sit in lane m, column `m / 32`;
//! - `tcgen05.mma.cta_group::1.kind::mxf4nvf4.block_scale.block16` for each 64-k step: A and B
//!   each a tile of 128-byte rows (256 codes of k, two a byte, the lower k in the low four
//!   bits) in the 128-byte swizzle ([`crate::swizzle_128`]), described by [`smem_desc`], the
//!   step's 32 bytes in by a start address 32 bytes further; [`IDESC`] says e2m1 codes, ue4m3
//!   scales, M 128, N 128; the accumulators row m column n at lane m, column [`ACC_COL`] + n;
//! - `tcgen05.commit` to the stage's mbarrier, on which every thread waits before its copies
//!   refill the stage's shared memory (and the one thread before its next scale copies into
//!   the stage's TMEM columns).
//!
//! Then warp w reads lanes `32 w ..` (a warp reaches only its quarter of the lanes):
//! `tcgen05.ld.32x32b`, lane l's register j the accumulator of row `32 w + l`, column c0 + j.

/// Rows (of the activations, of y) of a block's tile: the MMA's M.
pub const TC_M: u32 = 128;
/// Columns (weight rows) of a block's tile: the MMA's N.
pub const TC_N: u32 = 128;
/// Threads of a block: four warps, one for each quarter of TMEM's lanes.
pub const TC_BLOCK: u32 = 128;
/// Codes of k a stage: a 128-byte row of codes, four MMAs of [`crate::w4a4::MMA_K`].
pub const STAGE_K: u32 = 256;
/// Stages in the ring: the copies of one run while the products of the other do.
pub const TC_STAGES: u32 = 2;
/// Bytes of a block-scale chunk: 128 rows of one MMA's four scales.
pub const SCALE_CHUNK: u32 = 512;
/// Bytes of a stage: A's and B's tiles, then A's and B's four scale chunks.
pub const STAGE_BYTES: u32 = (TC_M + TC_N) * 128 + 2 * 4 * SCALE_CHUNK;
/// TMEM columns a block allocates (a power of two): the accumulators and each stage's scales.
pub const TMEM_COLS: u32 = 256;
/// The accumulators' first TMEM column.
pub const ACC_COL: u32 = 0;

/// Offset in a stage of A's tile, B's, and A's and B's scale chunk of MMA j.
pub const fn stage_offsets(j: u32) -> [u32; 4] {
    let scales = (TC_M + TC_N) * 128;
    [0, TC_M * 128, scales + SCALE_CHUNK * j, scales + SCALE_CHUNK * (4 + j)]
}

/// Dynamic shared memory of a block: 1024 bytes of alignment, the stages, two mbarriers and
/// the word TMEM's allocation writes its address to.
pub const fn tc_smem_bytes() -> u32 {
    1024 + TC_STAGES * STAGE_BYTES + 8 * TC_STAGES + 8
}

/// The instruction descriptor of `kind::mxf4nvf4` for an `m` x `n` product (PTX ISA, the
/// instruction descriptor's table): A's and B's type e2m1 (1, bits 7-9 and 10-12), both
/// K-major (bits 15, 16 clear), N / 8 (bits 17-22), scale type ue4m3 (bit 23 clear), M / 128
/// (bits 27-28); dense, no negation, scale-factor ids 0.
pub const fn idesc(m: u32, n: u32) -> u32 {
    (1 << 7) | (1 << 10) | ((n / 8) << 17) | ((m / 128) << 27)
}

/// [`idesc`] of the kernel's products.
pub const IDESC: u32 = idesc(TC_M, TC_N);

/// The shared-memory descriptor (the sm_100 form) of a tile of 128-byte rows in the 128-byte
/// swizzle from shared address `addr` (a row's start, the tile 1024-byte aligned, plus a
/// multiple of 32 for a later k step): `wgmma`'s ([`crate::swizzle_128_desc`]) with the
/// fixed bit 46 set (its swizzle mode 2 in bits 61-63 is `wgmma`'s mode 1 in bits 62-63).
pub const fn smem_desc(addr: u32) -> u64 {
    crate::swizzle_128_desc(addr) | (1 << 46)
}

/// The shared-memory descriptor of a scale chunk at `addr` (16-byte aligned), no swizzle:
/// rows of 16 bytes, 8 of them 128 bytes to the next 8 (stride offset), the fixed bit 46.
pub const fn scale_desc(addr: u32) -> u64 {
    ((addr as u64 >> 4) & 0x3fff) | ((128u64 >> 4) << 32) | (1 << 46)
}

/// Byte of row `m`'s four block scales (one MMA's) in its scale chunk.
pub const fn scale_offset(m: u32) -> u32 {
    16 * (m % 32) + 4 * (m / 32)
}

/// TMEM column of A's scales of MMA `j` (0..4) of a stage in ring slot `slot`.
pub const fn sfa_col(slot: u32, j: u32) -> u32 {
    TC_N + 32 * slot + 4 * j
}

/// TMEM column of B's scales of MMA `j` of a stage in ring slot `slot`.
pub const fn sfb_col(slot: u32, j: u32) -> u32 {
    sfa_col(slot, j) + 16
}

/// Row and 16-byte chunk of a tile (A's or B's) that copy `i` (0..8) of thread `t` fills: a
/// warp's copies are four whole rows.
pub const fn tile_copy(t: u32, i: u32) -> (u32, u32) {
    (t / 8 + 16 * i, t % 8)
}

#[cfg(all(target_arch = "nvptx64", tcgen05))]
pub(crate) use device::*;

#[cfg(all(target_arch = "nvptx64", tcgen05))]
mod device {
    use super::*;
    use core::arch::asm;

    const _: () = assert!(ACC_COL + TC_N <= sfa_col(0, 0) && sfb_col(TC_STAGES - 1, 3) + 4 <= TMEM_COLS);

    /// Allocates [`TMEM_COLS`] columns, their address written to the shared word at `slot`,
    /// and gives up the right to allocate more.
    ///
    /// # Safety
    /// One whole warp of the block calls it, once; [`tmem_free`] by the same warp before exit.
    #[inline(always)]
    pub unsafe fn tmem_alloc(slot: u32) {
        // SAFETY: guaranteed by the caller.
        unsafe {
            asm!(
                "tcgen05.alloc.cta_group::1.sync.aligned.shared::cta.b32 [{s}], {n};",
                "tcgen05.relinquish_alloc_permit.cta_group::1.sync.aligned;",
                s = in(reg32) slot, n = const TMEM_COLS, options(nostack)
            )
        };
    }

    /// Frees [`tmem_alloc`]'s columns at `tmem`.
    ///
    /// # Safety
    /// The warp that allocated them, every other use of them ordered before
    /// ([`fence_before_sync`], a barrier, [`fence_after_sync`]).
    #[inline(always)]
    pub unsafe fn tmem_free(tmem: u32) {
        // SAFETY: guaranteed by the caller.
        unsafe {
            asm!("tcgen05.dealloc.cta_group::1.sync.aligned.b32 {t}, {n};", t = in(reg32) tmem, n = const TMEM_COLS,
                 options(nostack))
        };
    }

    /// Orders this thread's `tcgen05` operations before its next barrier or mbarrier arrival.
    #[inline(always)]
    pub fn fence_before_sync() {
        // SAFETY: no operands.
        unsafe { asm!("tcgen05.fence::before_thread_sync;", options(nostack)) };
    }

    /// Orders this thread's `tcgen05` operations after its last barrier or mbarrier wait.
    #[inline(always)]
    pub fn fence_after_sync() {
        // SAFETY: no operands.
        unsafe { asm!("tcgen05.fence::after_thread_sync;", options(nostack)) };
    }

    /// Copies the scale chunk at shared address `chunk` to TMEM columns `tmem ..= tmem + 3`
    /// (the module docs).
    ///
    /// # Safety
    /// The chunk written and fenced to the async proxy, the columns allocated and not read by
    /// a product in flight.
    #[inline(always)]
    pub unsafe fn copy_scales(tmem: u32, chunk: u32) {
        // SAFETY: guaranteed by the caller.
        unsafe {
            asm!("tcgen05.cp.cta_group::1.32x128b.warpx4 [{t}], {d};", t = in(reg32) tmem,
                 d = in(reg64) scale_desc(chunk), options(nostack))
        };
    }

    /// One 128 x 128 x 64 product: `d (+)= (a x sfa) (b x sfb)^T`, `accumulate` false for the
    /// first.
    ///
    /// # Safety
    /// The operands' tiles written and fenced, the scales' copies issued before by this
    /// thread, the columns allocated.
    #[inline(always)]
    pub unsafe fn mma(d: u32, (a, b): (u64, u64), (sfa, sfb): (u32, u32), accumulate: bool) {
        // SAFETY: guaranteed by the caller.
        unsafe {
            asm!(
                "{{",
                ".reg .pred p;",
                "setp.ne.b32 p, {acc}, 0;",
                "tcgen05.mma.cta_group::1.kind::mxf4nvf4.block_scale.block16 [{d}], {a}, {b}, {i}, [{sa}], [{sb}], p;",
                "}}",
                d = in(reg32) d, a = in(reg64) a, b = in(reg64) b, i = in(reg32) IDESC,
                sa = in(reg32) sfa, sb = in(reg32) sfb, acc = in(reg32) u32::from(accumulate),
                options(nostack)
            )
        };
    }

    /// One arrival on the mbarrier at `bar` once every `tcgen05` operation this thread issued
    /// before has completed.
    ///
    /// # Safety
    /// `bar` an initialized mbarrier of the block expecting the arrival.
    #[inline(always)]
    pub unsafe fn commit_tc(bar: u32) {
        // SAFETY: guaranteed by the caller.
        unsafe {
            asm!("tcgen05.commit.cta_group::1.mbarrier::arrive::one.shared::cluster.b64 [{b}];", b = in(reg32) bar,
                 options(nostack))
        };
    }

    /// 16 columns from `tmem` of this warp's 32 lanes (lane l its own), as f32.
    ///
    /// # Safety
    /// `tmem`'s lane field this warp's quarter, the columns written by completed products.
    #[inline(always)]
    pub unsafe fn load16(tmem: u32) -> [f32; 16] {
        let mut v = [0u32; 16];
        // SAFETY: guaranteed by the caller; the wait completes the load inside the block.
        unsafe {
            asm!(
                "tcgen05.ld.sync.aligned.32x32b.x16.b32 {{{0}, {1}, {2}, {3}, {4}, {5}, {6}, {7}, {8}, {9}, {10}, {11}, {12}, {13}, {14}, {15}}}, [{t}];",
                "tcgen05.wait::ld.sync.aligned;",
                out(reg32) v[0], out(reg32) v[1], out(reg32) v[2], out(reg32) v[3],
                out(reg32) v[4], out(reg32) v[5], out(reg32) v[6], out(reg32) v[7],
                out(reg32) v[8], out(reg32) v[9], out(reg32) v[10], out(reg32) v[11],
                out(reg32) v[12], out(reg32) v[13], out(reg32) v[14], out(reg32) v[15],
                t = in(reg32) tmem, options(nostack)
            )
        };
        v.map(f32::from_bits)
    }
}
