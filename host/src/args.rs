//! The arguments of a launch, each checked once: [`Args`] turns a buffer into the kernel's
//! pointer after checking that it belongs to this `Gpu` and holds the elements the launch
//! needs ([`Len`]); [`Rows`] is the one form strided rows of activations take, whose extent
//! check (overflow included) lives here.

use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut, DeviceRepr};
use half::bf16;
use kernels_gpu::Kernel;

use crate::check::{Check, MAX_ELEMS};
use crate::error::Result;
use crate::gpu::Gpu;

/// An element type of device buffers, and the type a kernel's parameter block points to it
/// as (kernels-gpu has no bf16: it reads bf16 as its u16 bits).
pub trait Elem: DeviceRepr {
    /// The element as the kernels see it.
    type Raw: Copy;
}

impl Elem for bf16 {
    type Raw = u16;
}

/// Elements that are their own kernel type.
macro_rules! plain_elems {
    ($($t:ty),*) => { $(impl Elem for $t { type Raw = $t; })* };
}
plain_elems!(f32, i32, u32, u16, u8);

/// How many elements a launch needs of a buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Len {
    /// Exactly these.
    Exactly(usize),
    /// At least these (the launch reads a prefix).
    AtLeast(usize),
    /// Any: what the launch reads follows from the buffer's own length (the kernel is told
    /// it, as gather's table rows), or from the type that holds the buffer, which checked it
    /// when it was built ([`crate::batch::Slots`], [`crate::batch::Prefill`],
    /// [`crate::moe::Dispatch`], [`crate::attn::AttnRows`], [`crate::sample::SampleRows`]).
    Any,
}

impl Len {
    /// Fails unless a buffer of `got` elements is long enough for `arg`.
    fn check(self, c: Check, arg: &'static str, got: usize) -> Result<()> {
        match self {
            Len::Exactly(n) => c.len(arg, n, got),
            Len::AtLeast(n) => c.len_at_least(arg, n, got),
            Len::Any => Ok(()),
        }
    }
}

/// The checked arguments of one launch of `kernel` ([`Gpu::args`]): every failure names the
/// kernel and the argument.
#[derive(Clone, Copy)]
pub(crate) struct Args<'g> {
    gpu: &'g Gpu,
    kernel: Kernel,
}

impl Gpu {
    /// The arguments of a launch of `kernel`.
    pub(crate) fn args(&self, kernel: impl Into<Kernel>) -> Args<'_> {
        Args { gpu: self, kernel: kernel.into() }
    }
}

impl Args<'_> {
    /// The checks of this launch's other arguments (shapes, scalars), under the same name.
    pub fn check(&self) -> Check {
        Check(self.kernel.name())
    }

    /// An input buffer of `len` elements, as the kernel's pointer.
    pub fn input<T: Elem>(&self, arg: &'static str, buf: &impl DevicePtr<T>, len: Len) -> Result<*const T::Raw> {
        len.check(self.check(), arg, buf.len())?;
        Ok(self.gpu.addr(self.kernel, arg, buf)? as *const T::Raw)
    }

    /// An optional input buffer: [`Args::input`], or null where absent.
    pub fn opt_input<T: Elem>(
        &self,
        arg: &'static str,
        buf: Option<&impl DevicePtr<T>>,
        len: Len,
    ) -> Result<*const T::Raw> {
        buf.map_or(Ok(std::ptr::null()), |b| self.input(arg, b, len))
    }

    /// An output buffer of `len` elements, as the kernel's pointer.
    pub fn output<T: Elem>(&self, arg: &'static str, buf: &mut impl DevicePtrMut<T>, len: Len) -> Result<*mut T::Raw> {
        len.check(self.check(), arg, buf.len())?;
        Ok(self.gpu.addr_mut(self.kernel, arg, buf)? as *mut T::Raw)
    }

    /// Strided rows the launch reads `rows` rows of `width` of: the address of row 0 and the
    /// row stride, after [`Rows::check`].
    pub fn rows(&self, arg: &'static str, r: &Rows, (rows, width): (usize, usize)) -> Result<(*const u16, u32)> {
        let c = self.check();
        c.that(arg, r.rows == rows, format!("{rows} rows"), format!("{} rows", r.rows))?;
        c.that(arg, r.width == width, format!("rows of {width}"), format!("rows of {}", r.width))?;
        r.check(c, arg, r.buf.len())?;
        let row0 = self.input(arg, r.buf, Len::Any)?.wrapping_add(r.offset);
        Ok((row0, r.stride as u32))
    }
}

/// `rows` rows of `width` bf16 activations inside a device buffer, row r from element
/// `offset + r * stride` (a column block of wider rows, such as q, k and v in the fused
/// projection's output, or the mixer's xBC inside in_proj's). Nothing is checked until a
/// launcher takes them: then their row count and width, a stride of at least the width, and
/// that the extent fits in the buffer (an overflowing one is refused). `B` is the buffer: a
/// device buffer for launches (the default), anything for the pure check.
pub struct Rows<'a, B = CudaSlice<bf16>> {
    pub buf: &'a B,
    pub offset: usize,
    pub rows: usize,
    pub width: usize,
    pub stride: usize,
}

impl<B> Clone for Rows<'_, B> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<B> Copy for Rows<'_, B> {}

impl<'a> Rows<'a> {
    /// Contiguous rows of `width` from the buffer's start.
    pub fn new(buf: &'a CudaSlice<bf16>, rows: usize, width: usize) -> Rows<'a> {
        Rows::strided(buf, rows, width, width)
    }

    /// Rows of `width` from the buffer's start, `stride` apart.
    pub fn strided(buf: &'a CudaSlice<bf16>, rows: usize, width: usize, stride: usize) -> Rows<'a> {
        Rows { buf, offset: 0, rows, width, stride }
    }

    /// Columns `from..from + width` of these rows.
    pub fn cols(self, from: usize, width: usize) -> Rows<'a> {
        Rows { offset: self.offset + from, width, ..self }
    }
}

impl<B> Rows<'_, B> {
    /// One past the last element the rows cover (of row 0 when there are none), `None` where
    /// that overflows.
    pub fn extent(&self) -> Option<usize> {
        (self.rows.max(1) - 1).checked_mul(self.stride)?.checked_add(self.offset)?.checked_add(self.width)
    }

    /// Fails unless the rows lie inside a buffer of `len` elements with a stride of at least
    /// their width that the kernels' u32 indexing takes; `arg` names them.
    pub(crate) fn check(&self, c: Check, arg: &'static str, len: usize) -> Result<()> {
        c.that(
            arg,
            (self.width..=MAX_ELEMS).contains(&self.stride),
            format!("a row stride in {}..={MAX_ELEMS}", self.width),
            format!("stride {}", self.stride),
        )?;
        let need = self.extent();
        c.that(
            arg,
            need.is_some(),
            "an extent that fits in usize",
            format!("{} rows of stride {} from {}", self.rows, self.stride, self.offset),
        )?;
        c.len_at_least(arg, need.unwrap_or(usize::MAX), len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Error;

    /// Rows of `width` at `offset`, `stride` apart: only their geometry, for the pure check.
    fn rows(offset: usize, rows: usize, width: usize, stride: usize) -> Rows<'static, ()> {
        Rows { buf: &(), offset, rows, width, stride }
    }

    /// The expected and the actual value of a failed check of `x`.
    fn refusal(r: Result<()>) -> (String, String) {
        match r {
            Err(Error::Shape { kernel: "test", arg: "x", expected, got }) => (expected, got),
            other => panic!("expected a shape error of `x`, got {other:?}"),
        }
    }

    #[test]
    fn the_extent_ends_with_the_last_row() {
        assert_eq!(rows(0, 4, 8, 8).extent(), Some(32));
        // A column block of wider rows: 3 rows of 4 from column 2 of rows of 10.
        assert_eq!(rows(2, 3, 4, 10).extent(), Some(26));
        // No rows: still row 0's extent.
        assert_eq!(rows(5, 0, 4, 10).extent(), Some(9));
        assert_eq!(rows(0, 2, 1, usize::MAX).extent(), None);
        assert_eq!(rows(usize::MAX, 1, 1, 1).extent(), None);
        assert_eq!(rows(1, 3, 8, usize::MAX / 2).extent(), None);
    }

    #[test]
    fn rows_fit_their_buffer() {
        let c = Check("test");
        rows(2, 3, 4, 10).check(c, "x", 26).unwrap();
        rows(0, 4, 8, 8).check(c, "x", 1000).unwrap();
        assert_eq!(refusal(rows(2, 3, 4, 10).check(c, "x", 25)), ("at least 26 elements".into(), "25 elements".into()));
        assert_eq!(refusal(rows(0, 1, 4, 4).check(c, "x", 0)).0, "at least 4 elements");
    }

    #[test]
    fn the_stride_covers_a_row_and_fits_u32_indexing() {
        let c = Check("test");
        let (expected, got) = refusal(rows(0, 4, 8, 7).check(c, "x", 1000));
        assert_eq!((expected.as_str(), got.as_str()), ("a row stride in 8..=2147483647", "stride 7"));
        refusal(rows(0, 1, 8, MAX_ELEMS + 1).check(c, "x", usize::MAX));
        rows(0, 1, 8, MAX_ELEMS).check(c, "x", usize::MAX).unwrap();
    }

    #[test]
    fn an_overflowing_extent_is_refused_not_wrapped() {
        let c = Check("test");
        // (2^62 - 1) rows of the largest stride: more elements than usize counts.
        let (expected, _) = refusal(rows(0, 1 << 62, 8, MAX_ELEMS).check(c, "x", usize::MAX));
        assert_eq!(expected, "an extent that fits in usize");
        let (expected, _) = refusal(rows(usize::MAX - 4, 1, 8, 8).check(c, "x", usize::MAX));
        assert_eq!(expected, "an extent that fits in usize");
    }

    #[test]
    fn buffers_hold_what_the_launch_needs() {
        let c = Check("test");
        Len::Exactly(8).check(c, "x", 8).unwrap();
        Len::AtLeast(8).check(c, "x", 9).unwrap();
        Len::Any.check(c, "x", 0).unwrap();
        assert_eq!(refusal(Len::Exactly(8).check(c, "x", 9)), ("8 elements".into(), "9 elements".into()));
        assert_eq!(refusal(Len::AtLeast(8).check(c, "x", 7)), ("at least 8 elements".into(), "7 elements".into()));
    }

    #[test]
    fn message_says_kernel_argument_expected_and_got() {
        let k = Check(Kernel::NormRms.name());
        let e = rows(0, 2, 8, 8).check(k, "x", 15).unwrap_err().to_string();
        assert_eq!(e, "norm_rms_bf16: argument `x`: expected at least 16 elements, got 15 elements");
        let e = Len::Exactly(8).check(k, "w", 7).unwrap_err().to_string();
        assert_eq!(e, "norm_rms_bf16: argument `w`: expected 8 elements, got 7 elements");
    }
}
