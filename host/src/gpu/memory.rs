//! Device memory and transfers: allocations, copies to and from the device (the page-locked
//! staging of large uploads and of `download_with`), and copies on the device.

use cudarc::driver::{
    CudaEvent, CudaSlice, CudaViewMut, DevicePtr, DevicePtrMut, DeviceRepr, PinnedHostSlice, ValidAsZeroBits,
};

use super::{Gpu, view_refused};
use crate::error::{During, Error, Result};

/// Bytes of each of the two page-locked buffers [`Gpu::upload_bytes_into`] stages through.
pub const UPLOAD_STAGE_BYTES: usize = 32 << 20;

/// A page-locked staging buffer and the event of the last copy from it, if any.
pub(super) type Stage = (PinnedHostSlice<u8>, Option<CudaEvent>);

impl Gpu {
    /// Copies `data` to a new device buffer.
    pub fn upload<T: DeviceRepr>(&self, data: &[T]) -> Result<CudaSlice<T>> {
        self.not_capturing("a copy to the device")?;
        self.stream.clone_htod(data).during("copying to the device")
    }

    /// Copies `data` into the start of an existing device buffer (at least as long).
    pub fn upload_into<T: DeviceRepr>(&self, data: &[T], dst: &mut impl DevicePtrMut<T>) -> Result<()> {
        if dst.len() < data.len() {
            return Err(Error::Shape {
                kernel: "upload_into",
                arg: "dst",
                expected: format!("at least {} elements", data.len()),
                got: format!("{} elements", dst.len()),
            });
        }
        self.not_capturing("a copy to the device")?;
        self.stream.memcpy_htod(data, dst).during("copying to the device")
    }

    /// Copies a device buffer back (waits for the stream).
    pub fn download<T: DeviceRepr, S: DevicePtr<T>>(&self, buf: &S) -> Result<Vec<T>> {
        self.not_capturing("a copy from the device")?;
        self.stream.clone_dtoh(buf).during("copying from the device")
    }

    /// Copies a device buffer to the host and hands it to `f` (waits for the stream): through
    /// page-locked memory this Gpu keeps (grown to the largest copy), so the copy runs at the
    /// bus's rate and `f` reads it in place, with no second copy into pageable memory.
    pub fn download_with<T: bytemuck::Pod, R>(&self, buf: &CudaSlice<T>, f: impl FnOnce(&[T]) -> R) -> Result<R> {
        self.not_capturing("a copy from the device")?;
        let bytes = buf.len() * std::mem::size_of::<T>();
        // A panic elsewhere while it was held leaves the buffer as good as before.
        let mut staging = self.staging.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let host = match staging.take() {
            Some(s) if s.len() >= bytes => staging.insert(s),
            old => {
                // The old buffer goes first (no copy into it is in flight: each call waits
                // for its own before it returns).
                drop(old);
                // SAFETY: its contents are unset; f reads only the bytes the copy below writes.
                let s = unsafe { self.ctx.alloc_pinned_with_flags::<u8>(bytes.max(1), 0) };
                staging.insert(s.during("allocating page-locked memory")?)
            }
        };
        // SAFETY: T is plain data (Pod); the view covers exactly buf's bytes.
        let src = unsafe { buf.transmute::<u8>(bytes) }.ok_or_else(|| view_refused("copying from the device"))?;
        // The copy's length is the destination's: exactly buf's bytes of the staging buffer.
        let data = &mut host.as_mut_slice().during("reading page-locked memory")?[..bytes];
        self.stream.memcpy_dtoh(&src, data).during("copying from the device")?;
        self.stream.synchronize().during("waiting for the stream")?;
        Ok(f(bytemuck::cast_slice(data)))
    }

    /// Copies `bytes` into the start of `dst`'s memory (at least as many bytes), staged through
    /// two page-locked buffers of [`UPLOAD_STAGE_BYTES`] this Gpu keeps: the host copies into
    /// one while the other's transfer runs. For large uploads (weights read from a file mapping
    /// or generated): faster than a pageable copy, and no intermediate `Vec`. Returns once
    /// `bytes` is no longer read; the transfers run on in stream order.
    pub fn upload_bytes_into<T: DeviceRepr>(&self, bytes: &[u8], dst: &mut CudaViewMut<'_, T>) -> Result<()> {
        let room = dst.len() * std::mem::size_of::<T>();
        if room < bytes.len() {
            return Err(Error::Shape {
                kernel: "upload_bytes_into",
                arg: "dst",
                expected: format!("at least {} bytes", bytes.len()),
                got: format!("{room} bytes"),
            });
        }
        self.not_capturing("a copy to the device")?;
        // SAFETY: every byte pattern is a valid u8; the view covers dst's memory.
        let mut dst = unsafe { dst.transmute_mut::<u8>(room) }.ok_or_else(|| view_refused("copying to the device"))?;
        // A panic elsewhere while it was held leaves the buffers as good as before.
        let mut held = self.uploads.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let bufs = match held.take() {
            Some(b) => held.insert(b),
            None => {
                let alloc = || {
                    // SAFETY: its contents are unset; each copy reads only what was written
                    // into it first.
                    unsafe { self.ctx.alloc_pinned_with_flags::<u8>(UPLOAD_STAGE_BYTES, 0) }
                        .during("allocating page-locked memory")
                };
                held.insert([(alloc()?, None), (alloc()?, None)])
            }
        };
        for (i, chunk) in bytes.chunks(UPLOAD_STAGE_BYTES).enumerate() {
            let (buf, done) = &mut bufs[i % 2];
            // The buffer's last transfer must be over before it is written again.
            if let Some(e) = done.take() {
                e.synchronize().during("waiting for a copy to the device")?;
            }
            let host = &mut buf.as_mut_slice().during("writing page-locked memory")?[..chunk.len()];
            host.copy_from_slice(chunk);
            let at = i * UPLOAD_STAGE_BYTES;
            let mut to = dst.slice_mut(at..at + chunk.len());
            self.stream.memcpy_htod(host, &mut to).during("copying to the device")?;
            *done = Some(self.stream.record_event(None).during("recording a copy to the device")?);
        }
        Ok(())
    }

    /// A new zeroed device buffer of `len` elements.
    pub fn zeros<T: DeviceRepr + ValidAsZeroBits>(&self, len: usize) -> Result<CudaSlice<T>> {
        self.stream.alloc_zeros(len).during("allocating device memory")
    }

    /// A new device buffer of `len` elements with undefined contents.
    ///
    /// # Safety
    /// Every element must be written (in stream order) before it is read.
    pub unsafe fn uninit<T: DeviceRepr>(&self, len: usize) -> Result<CudaSlice<T>> {
        // SAFETY: forwarded to the caller.
        unsafe { self.stream.alloc(len) }.during("allocating device memory")
    }

    /// Copies `src` into `dst` on the device (equal lengths).
    pub fn copy<T: DeviceRepr>(&self, src: &impl DevicePtr<T>, dst: &mut impl DevicePtrMut<T>) -> Result<()> {
        self.stream.memcpy_dtod(src, dst).during("copying on the device")
    }
}
