//! Arithmetic: fused multiply-add, max, the correctly rounded division by a reciprocal, square
//! root, and the fast exp, ln, silu and softplus.

use core::arch::asm;

unsafe extern "C" {
    #[link_name = "llvm.fma.f32"]
    fn fma_f32(a: f32, b: f32, c: f32) -> f32;
}

/// `a * b + c` rounded once (one `fma.rn.f32`; Rust does not contract a product and a sum).
#[inline(always)]
pub fn fma(a: f32, b: f32, c: f32) -> f32 {
    // SAFETY: a pure arithmetic intrinsic.
    unsafe { fma_f32(a, b, c) }
}

/// `max.f32`: the non-NaN operand when one is NaN.
#[inline(always)]
pub fn fmax(a: f32, b: f32) -> f32 {
    a.max(b)
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

/// e^v through `ex2.approx.ftz.f32` (relative error about 2^-22).
#[inline(always)]
pub fn exp_fast(v: f32) -> f32 {
    exp2_fast(v * core::f32::consts::LOG2_E)
}

/// 2^v through `ex2.approx.ftz.f32` (relative error about 2^-22).
#[inline(always)]
pub fn exp2_fast(v: f32) -> f32 {
    let r: f32;
    // SAFETY: a register-to-register instruction.
    unsafe { asm!("ex2.approx.ftz.f32 {r}, {a};", r = out(reg32) r, a = in(reg32) v, options(pure, nomem, nostack)) };
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

/// A projection's output activation: `relu(bf16(v))^2` where `relu2` (the experts' and the
/// MLPs' hidden activation, the square of the value rounded as the un-fused path stores it),
/// else `v`.
#[inline(always)]
pub fn relu2_if(v: f32, relu2: bool) -> f32 {
    if relu2 {
        let r = fmax(super::bf16_to_f32(super::f32_to_bf16(v)), 0.0);
        r * r
    } else {
        v
    }
}

/// Correctly rounded square root (`sqrt.rn.f32`).
#[inline(always)]
pub fn sqrt(v: f32) -> f32 {
    core::f32::math::sqrt(v)
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
