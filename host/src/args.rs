//! The arguments of a launch, each checked once: [`Args`] turns a buffer into the kernel's
//! pointer after checking that it belongs to this `Gpu` and holds the elements the launch
//! needs ([`Len`]).

use cudarc::driver::{DevicePtr, DevicePtrMut, DeviceRepr};
use half::bf16;
use kernels_gpu::Kernel;

use crate::check::Check;
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
plain_elems!(f32, i32, u32, u8);

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
    pub(crate) fn args(&self, kernel: Kernel) -> Args<'_> {
        Args { gpu: self, kernel }
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
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Error;

    /// The expected and the actual value of a failed check of `x`.
    fn refusal(r: Result<()>) -> (String, String) {
        match r {
            Err(Error::Shape { kernel: "test", arg: "x", expected, got }) => (expected, got),
            other => panic!("expected a shape error of `x`, got {other:?}"),
        }
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
        let e = Len::Exactly(8).check(k, "w", 7).unwrap_err().to_string();
        assert_eq!(e, "norm_rms_bf16: argument `w`: expected 8 elements, got 7 elements");
    }
}
