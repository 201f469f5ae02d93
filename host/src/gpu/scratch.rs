//! Temporaries of a step: [`Buffer`], from [`Gpu::scratch`] (inside a capture a range of the
//! `Gpu`'s arena, else its own allocation).

use std::sync::Arc;
use std::sync::atomic::Ordering;

use cudarc::driver::sys;
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut, DeviceRepr, DeviceSlice, SyncOnDrop};

use super::Gpu;
use crate::error::Result;

/// Bytes of the scratch arena that captures take their temporaries from (see
/// [`Gpu::scratch`]); past it they fall back to allocations in the graph.
pub const ARENA_BYTES: usize = 512 << 20;

/// A device buffer from [`Gpu::scratch`]: its own allocation, or a range of the Gpu's
/// capture arena (then dropping it frees nothing). Dereferences to the [`CudaSlice`].
pub struct Buffer<T> {
    slice: std::mem::ManuallyDrop<CudaSlice<T>>,
    in_arena: bool,
}

impl<T> From<CudaSlice<T>> for Buffer<T> {
    fn from(slice: CudaSlice<T>) -> Self {
        Buffer { slice: std::mem::ManuallyDrop::new(slice), in_arena: false }
    }
}

impl<T> std::ops::Deref for Buffer<T> {
    type Target = CudaSlice<T>;
    fn deref(&self) -> &CudaSlice<T> {
        &self.slice
    }
}

impl<T> std::ops::DerefMut for Buffer<T> {
    fn deref_mut(&mut self) -> &mut CudaSlice<T> {
        &mut self.slice
    }
}

impl<T> DeviceSlice<T> for Buffer<T> {
    fn len(&self) -> usize {
        self.slice.len()
    }
    fn stream(&self) -> &Arc<CudaStream> {
        self.slice.stream()
    }
}

impl<T> DevicePtr<T> for Buffer<T> {
    fn device_ptr<'a>(&'a self, stream: &'a CudaStream) -> (sys::CUdeviceptr, SyncOnDrop<'a>) {
        self.slice.device_ptr(stream)
    }
}

impl<T> DevicePtrMut<T> for Buffer<T> {
    fn device_ptr_mut<'a>(&'a mut self, stream: &'a CudaStream) -> (sys::CUdeviceptr, SyncOnDrop<'a>) {
        self.slice.device_ptr_mut(stream)
    }
}

impl<T> Drop for Buffer<T> {
    fn drop(&mut self) {
        // SAFETY: the slice is taken once, here, and not used after.
        let slice = unsafe { std::mem::ManuallyDrop::take(&mut self.slice) };
        if self.in_arena {
            // The arena owns the memory.
            slice.leak();
        }
    }
}

impl Gpu {
    /// A device buffer of `len` elements with undefined contents for the temporaries of a
    /// step: inside a capture a fresh range of the Gpu's arena (a graph allocation node
    /// between two kernels would cost their programmatic dependent launch), else its own
    /// allocation. Arena ranges are not reused within a capture; every capture starts the
    /// arena over, so a buffer taken inside one must not be used after the next capture
    /// begins (graphs replay one at a time: their temporaries are dead between replays).
    ///
    /// # Safety
    /// As [`Gpu::uninit`], and the arena rule above.
    pub unsafe fn scratch<T: DeviceRepr>(&self, len: usize) -> Result<Buffer<T>> {
        if self.capturing.load(Ordering::Relaxed) {
            let mut arena = self.arena.lock().unwrap_or_else(|e| e.into_inner());
            let bytes = (len * std::mem::size_of::<T>()).next_multiple_of(256);
            let (base, used) = (&arena.0, arena.1);
            if let Some(base) = base
                && used + bytes <= base.len()
            {
                let at = base.device_ptr(&self.stream).0 + used as u64;
                arena.1 += bytes;
                // SAFETY: the range lies within the arena, which lives as long as this Gpu; the
                // Buffer leaks the slice instead of freeing it.
                let slice = unsafe { self.stream.upgrade_device_ptr(at, len) };
                return Ok(Buffer { slice: std::mem::ManuallyDrop::new(slice), in_arena: true });
            }
        }
        // SAFETY: forwarded to the caller.
        Ok(unsafe { self.uninit(len) }?.into())
    }
}
