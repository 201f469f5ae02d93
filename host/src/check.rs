//! Pure argument checks for the launchers: each failure names the kernel, the argument, the
//! expected and the actual value. No GPU needed, so they are tested in CI.

use std::fmt::Display;

use kernels_gpu::moe::{MAX_EXPERTS, MAX_TOP_K};

use crate::error::{Error, Result};

/// Checks for one launch, named by its kernel (or host entry).
#[derive(Clone, Copy)]
pub(crate) struct Check(pub &'static str);

impl Check {
    /// Fails unless `ok`, reporting `expected` and `got` for `arg`.
    pub fn that(self, arg: &'static str, ok: bool, expected: impl Display, got: impl Display) -> Result<()> {
        if ok {
            Ok(())
        } else {
            Err(Error::Shape { kernel: self.0, arg, expected: expected.to_string(), got: got.to_string() })
        }
    }

    /// A buffer of exactly `expected` elements.
    pub fn len(self, arg: &'static str, expected: usize, got: usize) -> Result<()> {
        self.that(arg, got == expected, format!("{expected} elements"), format!("{got} elements"))
    }

    /// A buffer of at least `min` elements.
    pub fn len_at_least(self, arg: &'static str, min: usize, got: usize) -> Result<()> {
        self.that(arg, got >= min, format!("at least {min} elements"), format!("{got} elements"))
    }

    /// A count in `1..=max` (grid and index limits of the device code).
    pub fn count(self, arg: &'static str, max: usize, got: usize) -> Result<()> {
        self.that(arg, (1..=max).contains(&got), format!("1..={max}"), got)
    }

    /// A device address that is a multiple of `align` bytes.
    pub fn aligned(self, arg: &'static str, addr: u64, align: u64) -> Result<()> {
        self.that(arg, addr.is_multiple_of(align), format!("a {align}-byte aligned address"), format!("{addr:#x}"))
    }

    /// A finite, strictly positive float.
    pub fn positive(self, arg: &'static str, got: f32) -> Result<()> {
        self.that(arg, got.is_finite() && got > 0.0, "a finite value > 0", got)
    }

    /// Experts within the MoE kernels' limit, and top-k choices of at most as many of them.
    pub fn choices(self, experts: usize, top_k: usize) -> Result<()> {
        self.count("experts", MAX_EXPERTS as usize, experts)?;
        self.count("top_k", (MAX_TOP_K as usize).min(experts), top_k)
    }

    /// An FP8 quantization's amax upper bound as the kernels take it (`INFINITY`: none); a
    /// finite value > 0 when given.
    pub fn amax_ub(self, amax_ub: Option<f32>) -> Result<f32> {
        match amax_ub {
            None => Ok(f32::INFINITY),
            Some(ub) => self.positive("amax_ub", ub).map(|()| ub),
        }
    }
}

/// Most rows (blocks) of a row-wise launch, and most elements of an element-wise one: the
/// device code indexes with u32 arithmetic that must not overflow.
pub(crate) const MAX_ROWS: usize = i32::MAX as usize;
pub(crate) const MAX_ELEMS: usize = i32::MAX as usize;

/// The argument a failed check names (tests of the launchers' checks).
#[cfg(test)]
pub(crate) fn arg_of<T: std::fmt::Debug>(r: Result<T>) -> &'static str {
    match r {
        Err(Error::Shape { arg, .. }) => arg,
        other => panic!("expected a shape error, got {other:?}"),
    }
}

#[cfg(test)]
mod tests {
    use super::{Check, arg_of};

    #[test]
    fn amax_ub_must_be_positive_and_finite() {
        let c = Check("quant_token_fp8_bf16");
        assert_eq!(c.amax_ub(None).unwrap(), f32::INFINITY);
        assert_eq!(c.amax_ub(Some(2.0)).unwrap(), 2.0);
        for bad in [0.0, -1.0, f32::NAN, f32::INFINITY] {
            assert_eq!(arg_of(c.amax_ub(Some(bad))), "amax_ub");
        }
    }
}
