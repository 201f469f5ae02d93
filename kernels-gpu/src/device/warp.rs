//! Reductions: warp shuffles (sums, maxima, prefix sums, argmax, reads of another lane's value,
//! for f32 and u64) and block-wide sums and maxima built on them.

use super::{fmax, lane_id, ld, st, sync_threads, warp_id, warps};

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
