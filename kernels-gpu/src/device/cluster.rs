//! Thread block clusters (sm_90+): a block's rank, cluster barriers, and loads and stores of
//! another block's shared memory (distributed shared memory).

use core::arch::asm;

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
