//! `StateElem`: the element types an SSM state is kept in (f32, or bf16 bits), with their
//! loads and stores.

use super::{bf16_to_f32, f32_to_bf16, f32x2_to_bf16x2};

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
