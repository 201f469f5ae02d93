//! The one module that talks to the hardware: thread ids, warp shuffles, barriers, dynamic shared
//! memory, bf16 and FP8 conversions, fast exp. Kernels use only these wrappers.

use core::arch::asm;
use core::arch::nvptx;

unsafe extern "C" {
    #[link_name = "llvm.nvvm.shfl.sync.bfly.f32"]
    fn shfl_bfly_f32(mask: u32, v: f32, lane_mask: u32, clamp: u32) -> f32;
    #[link_name = "llvm.nvvm.shfl.sync.up.f32"]
    fn shfl_up_f32(mask: u32, v: f32, delta: u32, clamp: u32) -> f32;
    #[link_name = "llvm.nvvm.shfl.sync.idx.f32"]
    fn shfl_idx_f32(mask: u32, v: f32, lane: u32, clamp: u32) -> f32;
    #[link_name = "llvm.nvvm.shfl.sync.bfly.i32"]
    fn shfl_bfly_i32(mask: u32, v: i32, lane_mask: u32, clamp: u32) -> i32;
    #[link_name = "llvm.nvvm.shfl.sync.up.i32"]
    fn shfl_up_i32(mask: u32, v: i32, delta: u32, clamp: u32) -> i32;
    #[link_name = "llvm.nvvm.shfl.sync.idx.i32"]
    fn shfl_idx_i32(mask: u32, v: i32, lane: u32, clamp: u32) -> i32;
    #[link_name = "llvm.fma.f32"]
    fn fma_f32(a: f32, b: f32, c: f32) -> f32;
}

/// `a * b + c` rounded once (one `fma.rn.f32`; Rust does not contract a product and a sum).
#[inline(always)]
pub fn fma(a: f32, b: f32, c: f32) -> f32 {
    // SAFETY: a pure arithmetic intrinsic.
    unsafe { fma_f32(a, b, c) }
}

// The block's dynamic shared memory (sized by the launch). A module-level `.extern .shared`
// declaration is the only form ptxas accepts for it.
core::arch::global_asm!(".extern .shared .align 16 .b8 dyn_smem[];");

/// A generic `*mut f32` to a static shared array of the block, `$bytes` bytes (4-byte aligned)
/// named `$name` (unique in the module): a `.shared` declaration inside an asm block, the form
/// of static shared memory the NVPTX backend takes. Expands to inline assembly: use it inside
/// an `unsafe` block (the assembly only declares the array and takes its address).
macro_rules! static_smem {
    ($name:literal, $bytes:expr) => {{
        let p: *mut f32;
        core::arch::asm!(
            concat!("{{ .shared .align 4 .b8 ", $name, "[{n}]; cvta.shared.u64 {p}, ", $name, "; }}"),
            p = out(reg64) p,
            n = const ($bytes),
            options(nostack),
        );
        p
    }};
}
pub(crate) use static_smem;

/// The first statement of every kernel, or of a weight-streaming kernel the first after it
/// has issued its first weight loads (weights are never written while kernels run; see
/// moe.rs `partial_dots`), or of the fused Mamba decode the first after its loads of what
/// only earlier steps wrote (mamba.rs) (programmatic dependent launch, sm_90+): lets the
/// stream's next kernel start launching its blocks now, then waits until the kernel before
/// this one has completed and its memory is visible. Kernels that load early are launched
/// with programmatic stream serialization allowed (host/src/gpu.rs, `Kernel::loads_early`),
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

#[cfg(feature = "timeline")]
#[inline(always)]
fn globaltimer() -> u64 {
    let t: u64;
    // SAFETY: reads a special register.
    unsafe { asm!("mov.u64 {t}, %globaltimer;", t = out(reg64) t, options(nomem, nostack)) };
    t
}

/// The `timeline` feature (a diagnostic build: `NEMO_TIMELINE` set when host/build.rs runs):
/// block 0 of every launch records (start, wait returned, grid x | y << 32, block size) in
/// `TIMELINE`, slots taken in arrival order by `TIMELINE_N` (read and reset by the host's
/// `Gpu::timeline`).
#[cfg(feature = "timeline")]
mod timeline {
    use super::*;
    const SLOTS: usize = 8192;
    #[unsafe(no_mangle)]
    static mut TIMELINE: [u64; 4 * SLOTS] = [0; 4 * SLOTS];
    #[unsafe(no_mangle)]
    static TIMELINE_N: core::sync::atomic::AtomicU32 = core::sync::atomic::AtomicU32::new(0);

    #[inline(always)]
    pub(super) fn record(t0: u64) {
        if thread_x() == 0 && block_x() == 0 && block_y() == 0 && block_z() == 0 {
            let t1 = globaltimer();
            let slot = TIMELINE_N.fetch_add(1, core::sync::atomic::Ordering::Relaxed) as usize;
            if slot < SLOTS {
                let grid = u64::from(grid_dim_x()) | (u64::from(grid_dim_y()) << 32);
                // SAFETY: slot < SLOTS; one writer per slot.
                unsafe {
                    let p = (&raw mut TIMELINE) as *mut u64;
                    st(p, 4 * slot, t0);
                    st(p, 4 * slot + 1, t1);
                    st(p, 4 * slot + 2, grid);
                    st(p, 4 * slot + 3, u64::from(block_dim_x()));
                }
            }
        }
    }
}

/// Stops the kernel (used by the panic handler; bounds-check failures end here).
#[inline(always)]
pub fn trap() -> ! {
    // SAFETY: `trap` has no preconditions; it aborts the kernel.
    unsafe { nvptx::trap() }
}

#[inline(always)]
pub fn thread_x() -> u32 {
    // SAFETY: reading a special register.
    unsafe { nvptx::_thread_idx_x() as u32 }
}

#[inline(always)]
pub fn block_x() -> u32 {
    // SAFETY: reading a special register.
    unsafe { nvptx::_block_idx_x() as u32 }
}

/// This block's rank in its cluster (`%cluster_ctarank`).
#[inline(always)]
pub fn cluster_rank() -> u32 {
    let r: u32;
    // SAFETY: reading a special register.
    unsafe { asm!("mov.u32 {r}, %cluster_ctarank;", r = out(reg32) r, options(pure, nomem, nostack)) };
    r
}

/// Barrier over every thread of every block of the cluster: what each wrote to its shared
/// memory before it is visible to all of them after it (arrive with release, wait with
/// acquire): [`cluster_arrive`] then [`cluster_wait`]. Call in uniform flow, every thread of
/// every block.
#[inline(always)]
pub fn cluster_sync() {
    cluster_arrive();
    cluster_wait();
}

/// The first half of a cluster barrier (`barrier.cluster.arrive`, release; `.relaxed` needs
/// PTX 8.0, above sm_90's 7.8): arrived early, it lets the [`cluster_wait`] that completes it
/// return at once once every block of the cluster has started. Call in uniform flow, every
/// thread of every block, and complete it with [`cluster_wait`] before the next arrival.
#[inline(always)]
pub fn cluster_arrive() {
    // SAFETY: no operands; the memory clobber keeps memory accesses on their side.
    unsafe { asm!("barrier.cluster.arrive.aligned;", options(nostack)) }
}

/// The second half of a cluster barrier ([`cluster_arrive`]): returns once every thread of
/// every block of the cluster has arrived.
#[inline(always)]
pub fn cluster_wait() {
    // SAFETY: no operands; the memory clobber keeps memory accesses on their side.
    unsafe { asm!("barrier.cluster.wait.aligned;", options(nostack)) }
}

/// Stores `v` at `p`'s offset in the shared memory of block `rank` of this cluster
/// (distributed shared memory), `p` pointing into this block's.
///
/// # Safety
/// `p` a generic pointer into this block's shared memory, `rank` below the cluster's size,
/// every block of the cluster started (a cluster barrier passed) and not exited.
#[inline(always)]
pub unsafe fn st_cluster_f32(p: *mut f32, rank: u32, v: f32) {
    // SAFETY: the caller's contract.
    unsafe {
        asm!(
            "{{ .reg .u64 s64; .reg .u32 s32, r32;",
            "cvta.to.shared.u64 s64, {p};",
            "cvt.u32.u64 s32, s64;",
            "mapa.shared::cluster.u32 r32, s32, {rank};",
            "st.shared::cluster.f32 [r32], {v}; }}",
            p = in(reg64) p,
            rank = in(reg32) rank,
            v = in(reg32) v,
            options(nostack),
        )
    };
}

/// Loads the u64 at `p`'s offset in the shared memory of block `rank` of this cluster
/// (distributed shared memory), `p` pointing into this block's.
///
/// # Safety
/// As [`st_cluster_f32`], and `p` 8-byte aligned.
#[inline(always)]
pub unsafe fn ld_cluster_u64(p: *const u64, rank: u32) -> u64 {
    let v: u64;
    // SAFETY: the caller's contract.
    unsafe {
        asm!(
            "{{ .reg .u64 s64; .reg .u32 s32, r32;",
            "cvta.to.shared.u64 s64, {p};",
            "cvt.u32.u64 s32, s64;",
            "mapa.shared::cluster.u32 r32, s32, {rank};",
            "ld.shared::cluster.u64 {v}, [r32]; }}",
            p = in(reg64) p,
            rank = in(reg32) rank,
            v = out(reg64) v,
            options(nostack, readonly),
        )
    };
    v
}

/// Lane of this thread within its warp.
#[inline(always)]
pub fn lane_id() -> u32 {
    thread_x() % 32
}

/// Warp of this thread within its block.
#[inline(always)]
pub fn warp_id() -> u32 {
    thread_x() / 32
}

#[inline(always)]
pub fn block_y() -> u32 {
    // SAFETY: reading a special register.
    unsafe { nvptx::_block_idx_y() as u32 }
}

#[inline(always)]
pub fn block_z() -> u32 {
    // SAFETY: reading a special register.
    unsafe { nvptx::_block_idx_z() as u32 }
}

#[cfg(feature = "timeline")]
#[inline(always)]
pub fn grid_dim_y() -> u32 {
    // SAFETY: reading a special register.
    unsafe { nvptx::_grid_dim_y() as u32 }
}

#[inline(always)]
pub fn grid_dim_x() -> u32 {
    // SAFETY: reading a special register.
    unsafe { nvptx::_grid_dim_x() as u32 }
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

/// Start of the block's dynamic shared memory, as f32 words.
#[inline(always)]
pub fn dyn_smem_f32() -> *mut f32 {
    let p: u64;
    // SAFETY: takes the generic address of the module's `dyn_smem` symbol.
    unsafe { asm!("cvta.shared.u64 {p}, dyn_smem;", p = out(reg64) p, options(pure, nomem, nostack)) };
    p as *mut f32
}

/// Sum over the 32 lanes of a full warp; every lane gets the total.
#[inline(always)]
pub fn warp_sum(v: f32) -> f32 {
    warp_sum_bits(v, 1, 16)
}

/// Sum over the lanes that differ from this one only in the lane-number bits `lo..=hi` (powers
/// of two; none when `lo > hi`), by butterfly steps from `hi` down: `warp_sum_bits(v, 1, 16)`
/// is [`warp_sum`]; `(v, 1, 8)` sums each half-warp; `(v, 16, 16)` lanes l and l ^ 16.
#[inline(always)]
pub fn warp_sum_bits(mut v: f32, lo: u32, hi: u32) -> f32 {
    let mut m = hi;
    while m >= lo && m > 0 {
        // SAFETY: all 32 lanes take part (full mask); callers run full warps.
        v += unsafe { shfl_bfly_f32(u32::MAX, v, m, 0x1f) };
        m >>= 1;
    }
    v
}

/// Inclusive prefix sum over the lanes of a full warp: lane l gets the sum of lanes 0..=l.
#[inline(always)]
pub fn warp_inclusive_sum(mut v: f32) -> f32 {
    let lane = lane_id();
    let mut d = 1;
    while d < 32 {
        // SAFETY: all 32 lanes take part (full mask); callers run full warps.
        let up = unsafe { shfl_up_f32(u32::MAX, v, d, 0) };
        if lane >= d {
            v += up;
        }
        d <<= 1;
    }
    v
}

/// The largest `(value, index)` over the lanes of a full warp, the lowest index among equal
/// values; every lane gets it.
#[inline(always)]
pub fn warp_argmax(mut v: f32, mut i: u32) -> (f32, u32) {
    let mut m = 16;
    while m > 0 {
        // SAFETY: as in `warp_sum`.
        let (ov, oi) =
            unsafe { (shfl_bfly_f32(u32::MAX, v, m, 0x1f), shfl_bfly_i32(u32::MAX, i as i32, m, 0x1f) as u32) };
        if ov > v || (ov == v && oi < i) {
            (v, i) = (ov, oi);
        }
        m >>= 1;
    }
    (v, i)
}

/// How [`shfl_u64`] picks the lane it reads.
#[derive(Clone, Copy, PartialEq)]
enum Shfl {
    /// Lane `lane ^ m`.
    Bfly,
    /// Lane `lane - m` (a lane below m keeps its own value).
    Up,
    /// Lane `m`.
    Idx,
}

/// A u64 shuffled as its two halves, from the lane `mode` and `m` name.
#[inline(always)]
fn shfl_u64(mode: Shfl, v: u64, m: u32) -> u64 {
    let (lo, hi) = (v as u32 as i32, (v >> 32) as u32 as i32);
    // SAFETY: all 32 lanes take part (full mask); callers run full warps.
    let (lo, hi) = unsafe {
        match mode {
            Shfl::Bfly => (shfl_bfly_i32(u32::MAX, lo, m, 0x1f), shfl_bfly_i32(u32::MAX, hi, m, 0x1f)),
            Shfl::Up => (shfl_up_i32(u32::MAX, lo, m, 0), shfl_up_i32(u32::MAX, hi, m, 0)),
            Shfl::Idx => (shfl_idx_i32(u32::MAX, lo, m, 0x1f), shfl_idx_i32(u32::MAX, hi, m, 0x1f)),
        }
    };
    u64::from(lo as u32) | (u64::from(hi as u32) << 32)
}

/// `op` over the 32 lanes of a full warp, by butterfly steps; every lane gets the result.
#[inline(always)]
fn warp_reduce_u64(mut v: u64, op: impl Fn(u64, u64) -> u64) -> u64 {
    let mut m = 16;
    while m > 0 {
        v = op(v, shfl_u64(Shfl::Bfly, v, m));
        m >>= 1;
    }
    v
}

/// Sum over the 32 lanes of a full warp (wrapping); every lane gets the total.
#[inline(always)]
pub fn warp_sum_u64(v: u64) -> u64 {
    warp_reduce_u64(v, u64::wrapping_add)
}

/// Max over the 32 lanes of a full warp; every lane gets it.
#[inline(always)]
pub fn warp_max_u64(v: u64) -> u64 {
    warp_reduce_u64(v, u64::max)
}

/// Inclusive prefix sum over the lanes of a full warp (wrapping): lane l gets lanes 0..=l.
#[inline(always)]
pub fn warp_inclusive_sum_u64(mut v: u64) -> u64 {
    let lane = lane_id();
    let mut d = 1;
    while d < 32 {
        let up = shfl_u64(Shfl::Up, v, d);
        if lane >= d {
            v = v.wrapping_add(up);
        }
        d <<= 1;
    }
    v
}

/// Lane `from`'s `v`, by a full warp.
#[inline(always)]
pub fn warp_read_u64(v: u64, from: u32) -> u64 {
    shfl_u64(Shfl::Idx, v, from)
}

/// Lane `from`'s `v` (each lane may name its own), by a full warp.
#[inline(always)]
pub fn warp_read(v: f32, from: u32) -> f32 {
    // SAFETY: as in `warp_sum`.
    unsafe { shfl_idx_f32(u32::MAX, v, from, 0x1f) }
}

/// Warp barrier: orders the shared-memory accesses of a full warp's lanes.
#[inline(always)]
pub fn sync_warp() {
    // SAFETY: all 32 lanes take part; callers run full warps in uniform flow.
    unsafe { asm!("bar.warp.sync 0xffffffff;", options(nostack)) }
}

/// Max over the 32 lanes of a full warp (NaN-ignoring, like `max.f32`); every lane gets it.
#[inline(always)]
pub fn warp_max(mut v: f32) -> f32 {
    let mut m = 16;
    while m > 0 {
        // SAFETY: as in `warp_sum`.
        v = fmax(v, unsafe { shfl_bfly_f32(u32::MAX, v, m, 0x1f) });
        m >>= 1;
    }
    v
}

/// `max.f32`: the non-NaN operand when one is NaN.
#[inline(always)]
pub fn fmax(a: f32, b: f32) -> f32 {
    a.max(b)
}

/// bf16 bits to f32 (exact).
#[inline(always)]
pub fn bf16_to_f32(bits: u16) -> f32 {
    f32::from_bits((bits as u32) << 16)
}

/// Two f32 to bf16 bits, round to nearest even: `hi << 16 | lo` (`cvt.rn.bf16x2.f32`, one
/// instruction for the pair).
#[inline(always)]
pub fn f32x2_to_bf16x2(hi: f32, lo: f32) -> u32 {
    let r: u32;
    // SAFETY: a register-to-register conversion (sm_80+).
    unsafe {
        asm!("cvt.rn.bf16x2.f32 {r}, {a}, {b};", r = out(reg32) r, a = in(reg32) hi, b = in(reg32) lo,
             options(pure, nomem, nostack))
    };
    r
}

/// One f32 to bf16 bits, round to nearest even.
#[inline(always)]
pub fn f32_to_bf16(v: f32) -> u16 {
    f32x2_to_bf16x2(0.0, v) as u16
}

/// Eight f32 rounded to bf16 (nearest even), as bits.
#[inline(always)]
pub fn f32x8_to_bf16(v: [f32; 8]) -> [u16; 8] {
    let mut out = [0u16; 8];
    for i in 0..4 {
        let pair = f32x2_to_bf16x2(v[2 * i + 1], v[2 * i]);
        out[2 * i] = pair as u16;
        out[2 * i + 1] = (pair >> 16) as u16;
    }
    out
}

/// `x / s`, correctly rounded like `div.rn.f32`, given `r = 1 / s` correctly rounded: one
/// multiply and two FMAs instead of a full division per element (Markstein: the FMA residual
/// correction of a quotient within 1 ulp, with a reciprocal within half an ulp, rounds
/// correctly). Used where one divisor serves many elements.
#[inline(always)]
pub fn div_rn_by(x: f32, s: f32, r: f32) -> f32 {
    let q = x * r;
    core::f32::math::mul_add(core::f32::math::mul_add(-q, s, x), r, q)
}

/// Two f32 to FP8 e4m3 codes, round to nearest even, saturating to +-448, NaN kept:
/// returns `hi << 8 | lo` (`cvt.rn.satfinite.e4m3x2.f32`, sm_89+).
#[inline(always)]
pub fn f32x2_to_e4m3(hi: f32, lo: f32) -> u16 {
    let r: u16;
    // SAFETY: a register-to-register conversion.
    unsafe {
        asm!("cvt.rn.satfinite.e4m3x2.f32 {r}, {a}, {b};", r = out(reg16) r, a = in(reg32) hi, b = in(reg32) lo,
             options(pure, nomem, nostack))
    };
    r
}

/// Two e4m3 codes (`lo` in bits 0..8) to f32, exactly (`cvt.rn.f16x2.e4m3x2`, sm_89+).
#[inline(always)]
pub fn e4m3x2_to_f32(codes: u16) -> (f32, f32) {
    let h: u32;
    // SAFETY: a register-to-register conversion.
    unsafe {
        asm!("cvt.rn.f16x2.e4m3x2 {h}, {c};", h = out(reg32) h, c = in(reg16) codes, options(pure, nomem, nostack))
    };
    let (lo, hi): (f32, f32);
    // SAFETY: register-to-register conversions (every f16 is exact in f32).
    unsafe {
        asm!("cvt.f32.f16 {lo}, {a};", lo = out(reg32) lo, a = in(reg16) h as u16, options(pure, nomem, nostack));
        asm!("cvt.f32.f16 {hi}, {a};", hi = out(reg32) hi, a = in(reg16) (h >> 16) as u16, options(pure, nomem, nostack));
    }
    (lo, hi)
}

/// e^v through `ex2.approx.ftz.f32` (relative error about 2^-22).
#[inline(always)]
pub fn exp_fast(v: f32) -> f32 {
    let r: f32;
    let a = v * core::f32::consts::LOG2_E;
    // SAFETY: a register-to-register instruction.
    unsafe { asm!("ex2.approx.ftz.f32 {r}, {a};", r = out(reg32) r, a = in(reg32) a, options(pure, nomem, nostack)) };
    r
}

/// ln(v) through `lg2.approx.f32` (relative error about 2^-22).
#[inline(always)]
pub fn ln_fast(v: f32) -> f32 {
    let r: f32;
    // SAFETY: a register-to-register instruction.
    unsafe { asm!("lg2.approx.f32 {r}, {a};", r = out(reg32) r, a = in(reg32) v, options(pure, nomem, nostack)) };
    r * core::f32::consts::LN_2
}

/// silu(v) = v / (1 + e^-v), with the full-range approximate division (2 ulp).
#[inline(always)]
pub fn silu(v: f32) -> f32 {
    let r: f32;
    // SAFETY: a register-to-register instruction.
    unsafe {
        asm!("div.full.f32 {r}, {a}, {b};", r = out(reg32) r, a = in(reg32) v, b = in(reg32) 1.0 + exp_fast(-v),
             options(pure, nomem, nostack))
    };
    r
}

/// Correctly rounded square root (`sqrt.rn.f32`).
#[inline(always)]
pub fn sqrt(v: f32) -> f32 {
    core::f32::math::sqrt(v)
}

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

/// Max over the block (NaN-ignoring); every thread gets it. Uses `scratch[0..warps()]` of
/// shared memory; barriers inside, so call it in uniform flow.
#[inline(always)]
pub fn block_max(v: f32, scratch: *mut f32) -> f32 {
    block_reduce(warp_max(v), scratch, fmax)
}

/// Sum over the block; every thread gets it. As [`block_max`].
#[inline(always)]
pub fn block_sum(v: f32, scratch: *mut f32) -> f32 {
    block_reduce(warp_sum(v), scratch, |a, b| a + b)
}

/// Combines the per-warp results `warp_total` in warp order (deterministic).
#[inline(always)]
fn block_reduce(warp_total: f32, scratch: *mut f32, op: impl Fn(f32, f32) -> f32) -> f32 {
    // SAFETY: `scratch` holds warps() floats of shared memory; lane 0 of warp w alone writes
    // slot w, and the barriers order those writes before the reads and the reads before the
    // next reuse of `scratch`.
    unsafe {
        if lane_id() == 0 {
            st(scratch, warp_id() as usize, warp_total);
        }
        sync_threads();
        let mut acc = ld(scratch, 0);
        for w in 1..warps() as usize {
            acc = op(acc, ld(scratch, w));
        }
        sync_threads();
        acc
    }
}

/// Eight bf16 as one 16-byte load.
#[repr(C, align(16))]
#[derive(Clone, Copy)]
struct Bf16x8([u16; 8]);

/// Four words as one 16-byte load (`[u32; 4]` alone is 4-byte aligned: four loads).
#[repr(C, align(16))]
#[derive(Clone, Copy)]
struct U32x4([u32; 4]);

/// Two words as one 8-byte load or store (four bf16).
#[repr(C, align(8))]
#[derive(Clone, Copy)]
struct U32x2([u32; 2]);

/// Eight e4m3 codes as one 8-byte store.
#[repr(C, align(8))]
#[derive(Clone, Copy)]
struct U8x8([u8; 8]);

/// Elements `c0..c0 + 8` of a bf16 array of `len` as f32, zero past `len`: one 16-byte load
/// when the chunk is whole and aligned, element loads otherwise.
///
/// # Safety
/// `p[c0..min(c0 + 8, len)]` must be readable.
#[inline(always)]
pub unsafe fn load8_bf16(p: *const u16, c0: usize, len: usize) -> [f32; 8] {
    let q = p.wrapping_add(c0);
    let mut v = [0.0f32; 8];
    // SAFETY: the vector load reads q[0..8], within len; element loads stay below len.
    unsafe {
        if c0 + 8 <= len && (q as usize).is_multiple_of(16) {
            v = (*(q as *const Bf16x8)).0.map(bf16_to_f32);
        } else {
            for (i, vi) in v.iter_mut().enumerate() {
                if c0 + i < len {
                    *vi = bf16_to_f32(ld(p, c0 + i));
                }
            }
        }
    }
    v
}

/// The f32 values of a chunk as [`load8_raw`] returns it.
#[inline(always)]
pub fn raw8_values(raw: [u32; 4]) -> [f32; 8] {
    let mut v = [0.0; 8];
    for i in 0..4 {
        (v[2 * i], v[2 * i + 1]) = (f32::from_bits(raw[i] << 16), f32::from_bits(raw[i] & 0xffff_0000));
    }
    v
}

/// Elements `c0..c0 + 8` of a bf16 array of `len` as raw pairs (element `2i` in the low half
/// of word `i`), zero past `len`; converted where used, so a thread can keep many loads in
/// flight in few registers.
///
/// # Safety
/// As [`load8_bf16`].
#[inline(always)]
pub unsafe fn load8_raw(p: *const u16, c0: usize, len: usize) -> [u32; 4] {
    let q = p.wrapping_add(c0);
    // SAFETY: as in load8_bf16.
    unsafe {
        if c0 + 8 <= len && (q as usize).is_multiple_of(16) {
            load8_raw_whole(q)
        } else {
            let mut v = [0u32; 4];
            for i in 0..8 {
                if c0 + i < len {
                    v[i / 2] |= u32::from(ld(p, c0 + i)) << (16 * (i % 2));
                }
            }
            v
        }
    }
}

/// `q[0..8]` as [`load8_raw`] returns it, one 16-byte load with no checks.
///
/// # Safety
/// `q[0..8]` must be readable and `q` 16-byte aligned.
#[inline(always)]
pub unsafe fn load8_raw_whole(q: *const u16) -> [u32; 4] {
    // SAFETY: guaranteed by the caller.
    unsafe { (*(q as *const U32x4)).0 }
}

/// As [`load8_raw`] for data that stays unchanged while the kernel runs and that this thread
/// reads once (weights streamed from memory): the whole aligned chunk through the read-only
/// path, not kept in L1, with L2 fetching 256-byte blocks around it.
///
/// # Safety
/// As [`load8_bf16`]; nothing writes `p[c0..c0 + 8]` while the kernel runs.
#[inline(always)]
pub unsafe fn load8_stream(p: *const u16, c0: usize, len: usize) -> [u32; 4] {
    let q = p.wrapping_add(c0);
    // SAFETY: q[0..8] is within len and 16-byte aligned (checked), read-only (caller), or
    // forwarded.
    unsafe {
        if c0 + 8 <= len && (q as usize).is_multiple_of(16) { load8_stream_whole(q) } else { load8_raw(p, c0, len) }
    }
}

/// `q[0..8]` as [`load8_stream`] loads a whole chunk, with no checks.
///
/// # Safety
/// As [`load8_raw_whole`]; nothing writes `q[0..8]` while the kernel runs.
#[inline(always)]
pub unsafe fn load8_stream_whole(q: *const u16) -> [u32; 4] {
    let (a, b, c, d): (u32, u32, u32, u32);
    // SAFETY: guaranteed by the caller.
    unsafe {
        asm!(
            "ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {{{a}, {b}, {c}, {d}}}, [{q}];",
            a = out(reg32) a, b = out(reg32) b, c = out(reg32) c, d = out(reg32) d,
            q = in(reg64) q,
            options(pure, readonly, nostack),
        )
    };
    [a, b, c, d]
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

/// `q[0..4]` as raw pairs (element `2i` in the low half of word `i`), one 8-byte load.
///
/// # Safety
/// `q[0..4]` must be readable and `q` 8-byte aligned.
#[inline(always)]
pub unsafe fn load4_raw_whole(q: *const u16) -> [u32; 2] {
    // SAFETY: guaranteed by the caller.
    unsafe { (*(q as *const U32x2)).0 }
}

/// The f32 values of four bf16 as [`load4_raw_whole`] returns them.
#[inline(always)]
pub fn raw4_values(raw: [u32; 2]) -> [f32; 4] {
    let mut v = [0.0; 4];
    for i in 0..2 {
        (v[2 * i], v[2 * i + 1]) = (f32::from_bits(raw[i] << 16), f32::from_bits(raw[i] & 0xffff_0000));
    }
    v
}

/// Writes `v` rounded to bf16 at `q[0..4]`, one 8-byte store.
///
/// # Safety
/// `q[0..4]` must be writable by this thread alone and `q` 8-byte aligned.
#[inline(always)]
pub unsafe fn store4_bf16_whole(q: *mut u16, v: [f32; 4]) {
    let raw = U32x2([f32x2_to_bf16x2(v[1], v[0]), f32x2_to_bf16x2(v[3], v[2])]);
    // SAFETY: guaranteed by the caller.
    unsafe { *(q as *mut U32x2) = raw }
}

/// Writes `v` rounded to bf16 at elements `c0..min(c0 + 8, len)` (one 16-byte store when whole
/// and aligned).
///
/// # Safety
/// `p[c0..min(c0 + 8, len)]` must be writable by this thread alone.
#[inline(always)]
pub unsafe fn store8_bf16(p: *mut u16, c0: usize, len: usize, v: [f32; 8]) {
    let q = p.wrapping_add(c0);
    let raw = Bf16x8(f32x8_to_bf16(v));
    // SAFETY: as for load8_bf16, for writes.
    unsafe {
        if c0 + 8 <= len && (q as usize).is_multiple_of(16) {
            *(q as *mut Bf16x8) = raw;
        } else {
            for i in 0..8 {
                if c0 + i < len {
                    st(p, c0 + i, raw.0[i]);
                }
            }
        }
    }
}

/// Writes the e4m3 codes of `v` at elements `c0..min(c0 + 8, len)` (one 8-byte store when whole
/// and aligned).
///
/// # Safety
/// `p[c0..min(c0 + 8, len)]` must be writable by this thread alone.
#[inline(always)]
pub unsafe fn store8_e4m3(p: *mut u8, c0: usize, len: usize, v: [f32; 8]) {
    let q = p.wrapping_add(c0);
    let mut raw = U8x8([0; 8]);
    for i in 0..4 {
        let pair = f32x2_to_e4m3(v[2 * i + 1], v[2 * i]);
        raw.0[2 * i] = pair as u8;
        raw.0[2 * i + 1] = (pair >> 8) as u8;
    }
    // SAFETY: as for load8_bf16, for writes.
    unsafe {
        if c0 + 8 <= len && (q as usize).is_multiple_of(8) {
            *(q as *mut U8x8) = raw;
        } else {
            for i in 0..8 {
                if c0 + i < len {
                    st(p, c0 + i, raw.0[i]);
                }
            }
        }
    }
}

/// Threads in this block.
#[inline(always)]
pub fn block_dim_x() -> u32 {
    // SAFETY: reading a special register.
    unsafe { nvptx::_block_dim_x() as u32 }
}

/// Warps in this block (blocks are whole warps).
#[inline(always)]
pub fn warps() -> u32 {
    block_dim_x() / 32
}

/// ln(1 + e^v), and v itself above 20 (docs/MATH.md's softplus).
#[inline(always)]
pub fn softplus(v: f32) -> f32 {
    if v > 20.0 {
        return v;
    }
    let r: f32;
    // SAFETY: a register-to-register instruction (lg2.approx: relative error about 2^-22).
    unsafe {
        asm!("lg2.approx.ftz.f32 {r}, {a};", r = out(reg32) r, a = in(reg32) 1.0 + exp_fast(v),
             options(pure, nomem, nostack))
    };
    r * core::f32::consts::LN_2
}

#[repr(C, align(16))]
#[derive(Clone, Copy)]
struct F32x4([f32; 4]);

#[repr(C, align(8))]
#[derive(Clone, Copy)]
struct Bf16x4([u16; 4]);

/// An SSM state element type: f32, or u16 holding bf16 bits. Four consecutive elements move
/// as one aligned access.
pub trait StateElem: Copy {
    /// # Safety
    /// `p[0..4]` readable, `p` aligned to 4 elements.
    unsafe fn load4(p: *const Self) -> [f32; 4];
    /// # Safety
    /// `p[0..4]` writable by this thread alone, `p` aligned to 4 elements.
    unsafe fn store4(p: *mut Self, v: [f32; 4]);
    /// # Safety
    /// `p` readable.
    unsafe fn load(p: *const Self) -> f32;
    /// # Safety
    /// `p` writable by this thread alone.
    unsafe fn store(p: *mut Self, v: f32);
}

impl StateElem for f32 {
    #[inline(always)]
    unsafe fn load4(p: *const f32) -> [f32; 4] {
        // SAFETY: guaranteed by the caller.
        unsafe { (*(p as *const F32x4)).0 }
    }
    #[inline(always)]
    unsafe fn store4(p: *mut f32, v: [f32; 4]) {
        // SAFETY: guaranteed by the caller.
        unsafe { *(p as *mut F32x4) = F32x4(v) }
    }
    #[inline(always)]
    unsafe fn load(p: *const f32) -> f32 {
        // SAFETY: guaranteed by the caller.
        unsafe { *p }
    }
    #[inline(always)]
    unsafe fn store(p: *mut f32, v: f32) {
        // SAFETY: guaranteed by the caller.
        unsafe { *p = v }
    }
}

impl StateElem for u16 {
    #[inline(always)]
    unsafe fn load4(p: *const u16) -> [f32; 4] {
        // SAFETY: guaranteed by the caller.
        unsafe { (*(p as *const Bf16x4)).0.map(bf16_to_f32) }
    }
    #[inline(always)]
    unsafe fn store4(p: *mut u16, v: [f32; 4]) {
        let lo = f32x2_to_bf16x2(v[1], v[0]);
        let hi = f32x2_to_bf16x2(v[3], v[2]);
        // SAFETY: guaranteed by the caller.
        unsafe { *(p as *mut Bf16x4) = Bf16x4([lo as u16, (lo >> 16) as u16, hi as u16, (hi >> 16) as u16]) }
    }
    #[inline(always)]
    unsafe fn load(p: *const u16) -> f32 {
        // SAFETY: guaranteed by the caller.
        bf16_to_f32(unsafe { *p })
    }
    #[inline(always)]
    unsafe fn store(p: *mut u16, v: f32) {
        // SAFETY: guaranteed by the caller.
        unsafe { *p = f32_to_bf16(v) }
    }
}

/// Grid-stride loop of the element-wise kernels (blocks of [`crate::EW_BLOCK`] threads) over
/// the chunks of `0..n`: `f(c0)` for each chunk start `c0`, each chunk by one thread.
#[inline(always)]
pub fn for_each_chunk(n: u32, mut f: impl FnMut(usize)) {
    let stride = grid_dim_x() * crate::EW_BLOCK;
    let mut k = block_x() * crate::EW_BLOCK + thread_x();
    while k < crate::chunks(n) {
        f((k * crate::VEC) as usize);
        k += stride;
    }
}
