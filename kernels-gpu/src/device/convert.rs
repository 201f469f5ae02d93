//! Conversions between f32 and the storage formats: bf16, FP8 e4m3 and FP4 e2m1.

use core::arch::asm;

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

/// Eight e2m1 codes (code i in bits `4i..4i + 4`: sign, two exponent bits of bias 1, one
/// mantissa bit) to their values times 2^-14, exactly: each pair of codes `i` and `i + 4`
/// becomes an f16 pair by placing the sign at bit 15 and the other three bits at 9..12 (an
/// f16 of exponent field e and mantissa m << 9 is `(1 + m / 2) 2^(e - 15)`, and for e = 0 the
/// subnormal `m / 2 * 2^-14`: the e2m1 value times 2^-14 either way), then to f32.
#[inline(always)]
pub fn e2m1x8_to_f32(codes: u32) -> [f32; 8] {
    let mut v = [0.0; 8];
    for i in 0..4 {
        let t = codes >> (4 * i);
        let h = ((t << 9) & 0x0e00_0e00) | ((t << 12) & 0x8000_8000);
        let (lo, hi): (f32, f32);
        // SAFETY: register-to-register conversions (every f16 is exact in f32).
        unsafe {
            asm!("cvt.f32.f16 {lo}, {a};", lo = out(reg32) lo, a = in(reg16) h as u16, options(pure, nomem, nostack));
            asm!("cvt.f32.f16 {hi}, {a};", hi = out(reg32) hi, a = in(reg16) (h >> 16) as u16, options(pure, nomem, nostack));
        }
        (v[i], v[i + 4]) = (lo, hi);
    }
    v
}
