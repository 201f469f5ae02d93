//! Chunks of four or eight elements moved as one 8- or 16-byte access: bf16 loads (converted,
//! raw, streamed past L1) and bf16 and e4m3 stores, with element accesses at a ragged end.

use core::arch::asm;

use super::{bf16_to_f32, f32x2_to_bf16x2, f32x2_to_e4m3, f32x8_to_bf16, ld, st};

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

/// Four bytes at `q` as [`load8_stream_whole`] loads (read-only path, not kept in L1): a
/// chunk of 8 NVFP4 codes.
///
/// # Safety
/// `q[0..4]` must be readable and `q` 4-byte aligned; nothing writes them while the kernel runs.
#[inline(always)]
pub unsafe fn load4_stream_whole(q: *const u8) -> u32 {
    let v: u32;
    // SAFETY: guaranteed by the caller.
    unsafe {
        asm!(
            "ld.global.nc.L1::no_allocate.L2::256B.u32 {v}, [{q}];",
            v = out(reg32) v,
            q = in(reg64) q,
            options(pure, readonly, nostack),
        )
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
