//! The CUDA device: driver context, one stream, the PTX module of the device's arch, and the
//! single place kernels are launched from.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use cudarc::cublaslt::CudaBlasLT;
use cudarc::driver::sys::{self, CUresult};
use cudarc::driver::{
    CudaContext, CudaEvent, CudaFunction, CudaGraph, CudaModule, CudaSlice, CudaStream, CudaViewMut, DevicePtr,
    DevicePtrMut, DeviceRepr, DeviceSlice, DriverError, PinnedHostSlice, SyncOnDrop, ValidAsZeroBits,
};
use cudarc::nvrtc::Ptx;
use kernels_gpu::{Kernel, KernelParams};

use crate::check::Check;
use crate::error::{During, Error, Result};

/// A PTX flavour embedded in this crate.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Arch {
    /// Hopper (H100, H200): compute capability 9.0; PTX ISA 7.8.
    Sm90,
    /// Jetson Thor: compute capability 11.0; PTX ISA 9.0.
    Sm110,
    /// DGX Spark GB10: compute capability 12.1, arch-specific features; PTX ISA 8.8.
    Sm121a,
}

impl Arch {
    /// Every embedded arch.
    pub const ALL: [Arch; 3] = [Arch::Sm90, Arch::Sm110, Arch::Sm121a];

    /// The `-C target-cpu` / `.target` name.
    pub const fn name(self) -> &'static str {
        match self {
            Arch::Sm90 => "sm_90",
            Arch::Sm110 => "sm_110",
            Arch::Sm121a => "sm_121a",
        }
    }

    /// The PTX ISA version rustc emits for this arch.
    pub const fn ptx_isa(self) -> &'static str {
        match self {
            Arch::Sm90 => "7.8",
            Arch::Sm110 => "9.0",
            Arch::Sm121a => "8.8",
        }
    }

    /// The embedded PTX text.
    pub const fn ptx(self) -> &'static str {
        match self {
            Arch::Sm90 => include_str!(concat!(env!("OUT_DIR"), "/sm_90.ptx")),
            Arch::Sm110 => include_str!(concat!(env!("OUT_DIR"), "/sm_110.ptx")),
            Arch::Sm121a => include_str!(concat!(env!("OUT_DIR"), "/sm_121a.ptx")),
        }
    }

    /// Picks the PTX for a device of compute capability `major.minor`.
    ///
    /// 9.0, 11.0 and 12.1 get their own PTX. Any other device of 9.0 or newer gets the sm_90
    /// PTX, which the driver JIT-compiles for it (plain `sm_90` PTX is forward compatible);
    /// that pairing is not verified by this project. Older devices are refused: the kernels
    /// use sm_89+ FP8 conversions.
    pub fn for_compute_capability(major: i32, minor: i32) -> Result<Arch> {
        match (major, minor) {
            (11, 0) => Ok(Arch::Sm110),
            (12, 1) => Ok(Arch::Sm121a),
            (m, _) if m >= 9 => Ok(Arch::Sm90),
            _ => Err(Error::UnsupportedArch { major, minor }),
        }
    }
}

/// One CUDA device with the module of its arch loaded, and the stream every launch goes to.
///
/// All work is ordered on that one stream; cudarc's per-allocation event tracking is disabled
/// (it is redundant on one stream and breaks CUDA graph capture), so buffers must only be used
/// through this `Gpu`'s stream.
pub struct Gpu {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    arch: Arch,
    functions: Vec<CudaFunction>,
    /// Most threads per block each function can launch with (its register use decides).
    max_threads: Vec<u32>,
    /// cuBLASLt on `stream`, created on first use (see [`Gpu::blas`]).
    blas: std::sync::OnceLock<CudaBlasLT>,
    /// Most dynamic shared memory a block of each function may use (the device's opt-in
    /// limit less the function's static shared memory, enabled at load).
    max_smem: Vec<u32>,
    /// Whether [`Gpu::capture`] is recording: host copies are refused then (a graph would
    /// replay a copy from host memory that is gone, or hold stale data).
    capturing: AtomicBool,
    /// Arrival counters of kernels that finish with their last block (zero between kernels;
    /// see [`Gpu::counters`]).
    counters: CudaSlice<u32>,
    /// The kernels launched during the last capture, in order (see [`Gpu::timeline`]).
    captured: std::sync::Mutex<Vec<&'static str>>,
    /// Where [`Gpu::scratch`] takes its buffers inside a capture (allocated at the first
    /// capture), and the bytes of it taken by this capture so far.
    arena: std::sync::Mutex<(Option<CudaSlice<u8>>, usize)>,
    /// Page-locked host memory for [`Gpu::download_with`], grown to the largest copy.
    staging: std::sync::Mutex<Option<PinnedHostSlice<u8>>>,
    /// The two page-locked buffers [`Gpu::upload_bytes_into`] stages through, each with the
    /// event of its last copy; allocated on first use.
    uploads: std::sync::Mutex<Option<[Stage; 2]>>,
    _module: Arc<CudaModule>,
}

/// What [`Gpu::timeline`] read: one record per launch, in the order their block 0 started.
#[derive(Clone, Debug)]
pub struct Timeline {
    /// Our kernels of the last capture, in launch order (the records' order, where the
    /// records are of a replay of that capture).
    pub kernels: Vec<&'static str>,
    pub records: Vec<Launch>,
}

/// One launch of a [`Timeline`]: global timer nanoseconds when its block 0 started and when its
/// wait on the kernel before returned (that kernel's end, give or take its memory flush).
#[derive(Clone, Copy, Debug)]
pub struct Launch {
    pub start_ns: u64,
    pub go_ns: u64,
    pub grid: (u32, u32),
    pub block: u32,
}

/// A point in a [`Gpu`]'s stream ([`Gpu::stamp`]): a CUDA event with timing, for the GPU time
/// between two points of one stream's work.
pub struct Stamp(CudaEvent);

impl Stamp {
    /// Milliseconds of GPU time from `earlier` to this stamp; waits until the work before both
    /// is done. The events' resolution is about half a microsecond.
    pub fn ms_since(&self, earlier: &Stamp) -> Result<f32> {
        earlier.0.elapsed_ms(&self.0).during("reading a timing event")
    }
}

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

/// Arrival counters [`Gpu::counters`] holds: one per block row of a grid (at most 65535).
pub(crate) const COUNTERS: usize = 65535;

/// Bytes of each of the two page-locked buffers [`Gpu::upload_bytes_into`] stages through.
pub const UPLOAD_STAGE_BYTES: usize = 32 << 20;

/// A page-locked staging buffer and the event of the last copy from it, if any.
type Stage = (PinnedHostSlice<u8>, Option<CudaEvent>);

impl Gpu {
    /// Opens device `ordinal`, picks its arch and loads the embedded PTX.
    pub fn new(ordinal: usize) -> Result<Gpu> {
        // SAFETY: only probes whether the driver library can be opened.
        if !unsafe { sys::is_culib_present() } {
            return Err(Error::NoDriver);
        }
        let count = CudaContext::device_count().during("counting devices")?;
        if ordinal >= count.max(0) as usize {
            return Err(Error::NoDevice { ordinal, count: count.max(0) as usize });
        }
        let ctx = CudaContext::new(ordinal).during("creating the context")?;
        // SAFETY: no buffers exist yet; everything this Gpu does is on one stream.
        unsafe { ctx.disable_event_tracking() };
        let (major, minor) = ctx.compute_capability().during("reading the compute capability")?;
        let arch = Arch::for_compute_capability(major, minor)?;
        let module = ctx.load_module(Ptx::from_src(arch.ptx())).map_err(|e| match e {
            DriverError(CUresult::CUDA_ERROR_UNSUPPORTED_PTX_VERSION) => {
                Error::DriverTooOld { driver: driver_version(), arch: arch.name(), isa: arch.ptx_isa() }
            }
            source => Error::Driver { during: "loading the PTX module", source },
        })?;
        let functions = Kernel::ALL
            .iter()
            .map(|k| module.load_function(k.name()).map_err(|_| Error::MissingEntry(k.name())))
            .collect::<Result<Vec<_>>>()?;
        let max_threads = functions
            .iter()
            .map(|f| f.get_attribute(sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK))
            .map(|r| r.map(|v| v.max(0) as u32))
            .collect::<Result<Vec<_>, _>>()
            .during("reading kernel attributes")?;
        let optin = sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN;
        let optin = ctx.attribute(optin).during("reading the shared memory limit")?.max(0);
        let mut max_smem = Vec::with_capacity(functions.len());
        for f in &functions {
            let fixed = sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES;
            let dynamic = optin - f.get_attribute(fixed).during("reading kernel attributes")?.clamp(0, optin);
            let attr = sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES;
            f.set_attribute(attr, dynamic).during("enabling large shared memory")?;
            max_smem.push(dynamic as u32);
        }
        let stream = ctx.new_stream().during("creating a stream")?;
        let counters = stream.alloc_zeros(COUNTERS).during("allocating device memory")?;
        Ok(Gpu {
            ctx,
            stream,
            arch,
            functions,
            max_threads,
            max_smem,
            blas: std::sync::OnceLock::new(),
            capturing: AtomicBool::new(false),
            counters,
            captured: std::sync::Mutex::new(Vec::new()),
            arena: std::sync::Mutex::new((None, 0)),
            staging: std::sync::Mutex::new(None),
            uploads: std::sync::Mutex::new(None),
            _module: module,
        })
    }

    /// The device address of [`COUNTERS`] zeroed u32 for a kernel whose blocks count their
    /// arrivals: it must leave them zero. Kernels on the one stream may overlap (programmatic
    /// dependent launch of the kernels that load early), but each waits for its predecessor to
    /// complete before it touches memory other than weights (`grid_dependency_wait`), so they
    /// can all use the same ones.
    pub(crate) fn counters(&self) -> u64 {
        self.counters.device_ptr(&self.stream).0
    }

    /// The arch whose PTX was loaded.
    pub fn arch(&self) -> Arch {
        self.arch
    }

    /// The device's name as the driver reports it.
    pub fn name(&self) -> Result<String> {
        self.ctx.name().during("reading the device name")
    }

    /// cuBLASLt bound to this Gpu's stream (its workspace is allocated on first use).
    pub(crate) fn blas(&self) -> Result<&CudaBlasLT> {
        if let Some(b) = self.blas.get() {
            return Ok(b);
        }
        // SAFETY: only probes whether the library can be opened.
        if !unsafe { cudarc::cublaslt::sys::is_culib_present() } {
            return Err(Error::NoCublas);
        }
        let b = CudaBlasLT::new(self.stream.clone())
            .map_err(|source| Error::Cublas { during: "creating a handle", source })?;
        Ok(self.blas.get_or_init(|| b))
    }

    /// The stream all of this Gpu's work runs on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// Fails while a capture records (`what`: the host copy refused).
    fn not_capturing(&self, what: &'static str) -> Result<()> {
        if self.capturing.load(Ordering::Relaxed) {
            return Err(Error::InCapture(what));
        }
        Ok(())
    }

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

    /// Waits until all queued work is done; reports errors of earlier launches.
    pub fn synchronize(&self) -> Result<()> {
        self.not_capturing("a synchronization")?;
        self.stream.synchronize().during("waiting for the stream")
    }

    /// Runs `f` with the CUDA profiler on: the range a profiler started with collection off
    /// (`ncu --profile-from-start off`) records.
    pub fn profile<T>(&self, f: impl FnOnce() -> T) -> Result<T> {
        self.ctx.bind_to_thread().during("binding the context")?;
        // SAFETY: plain driver calls without arguments, on a bound context.
        unsafe { sys::cuProfilerStart() }.result().during("starting the profiler")?;
        let out = f();
        // SAFETY: as above.
        unsafe { sys::cuProfilerStop() }.result().during("stopping the profiler")?;
        Ok(out)
    }

    /// The launch records since the last call (then cleared), and the kernels of the last
    /// capture in order: a decode step's timeline where the PTX was built with
    /// `NEMO_TIMELINE` set (kernels-gpu's `timeline` feature: block 0 of every launch records
    /// when it started and when its wait on the kernel before returned); `None` without it.
    /// cuBLASLt's kernels record nothing: they fall between two records.
    pub fn timeline(&self) -> Result<Option<Timeline>> {
        self.not_capturing("reading the timeline")?;
        self.ctx.bind_to_thread().during("binding the context")?;
        let mut n = match self._module.get_global("TIMELINE_N", &self.stream) {
            Err(DriverError(CUresult::CUDA_ERROR_NOT_FOUND)) => return Ok(None),
            r => r.during("finding the timeline")?,
        };
        let mut count = [0u8; 4];
        self.stream.memcpy_dtoh(&n, &mut count[..]).during("reading the timeline")?;
        let mut t = self._module.get_global("TIMELINE", &self.stream).during("finding the timeline")?;
        let len = (u32::from_le_bytes(count) as usize).min(t.len() / 32);
        let mut raw = vec![0u64; 4 * len];
        // SAFETY: the global is an array of u64 (4 per record).
        let words =
            unsafe { t.transmute_mut::<u64>(t.len() / 8) }.ok_or_else(|| view_refused("reading the timeline"))?;
        self.stream.memcpy_dtoh(&words.slice(..4 * len), &mut raw[..]).during("reading the timeline")?;
        self.stream.memcpy_htod(&[0u8; 4], &mut n).during("resetting the timeline")?;
        self.stream.synchronize().during("reading the timeline")?;
        let records = raw
            .chunks(4)
            .map(|c| Launch {
                start_ns: c[0],
                go_ns: c[1],
                grid: (c[2] as u32, (c[2] >> 32) as u32),
                block: c[3] as u32,
            })
            .collect();
        let kernels = self.captured.lock().map(|k| k.clone()).unwrap_or_default();
        Ok(Some(Timeline { kernels, records }))
    }

    /// GPU time in milliseconds of the work `f` queues, between two CUDA events on the stream.
    pub fn time_ms(&self, f: impl FnOnce() -> Result<()>) -> Result<f32> {
        let flags = Some(sys::CUevent_flags::CU_EVENT_DEFAULT);
        let start = self.stream.record_event(flags).during("recording a timing event")?;
        f()?;
        let end = self.stream.record_event(flags).during("recording a timing event")?;
        end.synchronize().during("waiting for a timing event")?;
        start.elapsed_ms(&end).during("reading a timing event")
    }

    /// A timing event recorded on the stream after the work queued so far (see [`Stamp`]);
    /// refused while a capture records (an event in a graph times nothing).
    pub fn stamp(&self) -> Result<Stamp> {
        self.not_capturing("a timing event")?;
        let flags = Some(sys::CUevent_flags::CU_EVENT_DEFAULT);
        Ok(Stamp(self.stream.record_event(flags).during("recording a timing event")?))
    }

    /// Records the work `f` queues into a CUDA graph instead of running it; replay it with
    /// [`Graph::replay`]. The buffers the work uses must outlive the graph and stay in place.
    /// While it records, this `Gpu` belongs to `f`: host copies and synchronizations are
    /// refused, and launches from other threads would join the graph.
    pub fn capture<E: From<Error>>(&self, f: impl FnOnce() -> Result<(), E>) -> Result<Graph, E> {
        // cuBLASLt's handle allocates its workspace when first used: create it before the
        // capture, or the graph would hold that allocation and refuse a second launch. Where
        // cuBLASLt is missing the capture goes on; a GEMM inside it reports that.
        let _ = self.blas();
        let mode = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL;
        if self.capturing.swap(true, Ordering::Relaxed) {
            return Err(Error::InCapture("a capture").into());
        }
        // Ends the capture and clears the flag however `f` leaves, a panic included.
        struct Recording<'a>(&'a Gpu);
        impl Recording<'_> {
            fn end(&self) -> Result<Option<CudaGraph>> {
                let graph = self.0.stream.end_capture(sys::CUgraphInstantiate_flags(0));
                self.0.capturing.store(false, Ordering::Relaxed);
                graph.during("ending a graph capture")
            }
        }
        impl Drop for Recording<'_> {
            fn drop(&mut self) {
                if self.0.capturing.load(Ordering::Relaxed) {
                    let _ = self.end();
                }
            }
        }
        if let Ok(mut k) = self.captured.lock() {
            k.clear();
        }
        {
            let mut arena = self.arena.lock().unwrap_or_else(|e| e.into_inner());
            if arena.0.is_none() {
                // SAFETY: the arena's contents are only ever scratch (see Gpu::scratch).
                arena.0 = Some(unsafe { self.stream.alloc(ARENA_BYTES) }.during("allocating device memory")?);
            }
            arena.1 = 0;
        }
        let recording = Recording(self);
        let begun = self.stream.begin_capture(mode).during("starting a graph capture");
        let queued = begun.map_err(E::from).and_then(|()| f());
        let graph = recording.end();
        queued?;
        let graph = graph?.ok_or(Error::Driver {
            during: "ending a graph capture (nothing was captured)",
            source: DriverError(CUresult::CUDA_ERROR_STREAM_CAPTURE_INVALIDATED),
        })?;
        graph.upload().during("uploading a graph")?;
        Ok(Graph(graph))
    }

    /// Copies `src` into `dst` on the device (equal lengths).
    pub fn copy<T: DeviceRepr>(&self, src: &impl DevicePtr<T>, dst: &mut impl DevicePtrMut<T>) -> Result<()> {
        self.stream.memcpy_dtod(src, dst).during("copying on the device")
    }

    /// Fails unless `buf` was allocated in this Gpu's context (`what`: the kernel or entry).
    pub(crate) fn check_owner<T>(
        &self,
        what: &'static str,
        arg: &'static str,
        buf: &impl DeviceSlice<T>,
    ) -> Result<()> {
        let ctx = buf.stream().context();
        if Arc::ptr_eq(ctx, &self.ctx) {
            return Ok(());
        }
        Err(Error::Shape {
            kernel: what,
            arg,
            expected: format!("a buffer of this Gpu's context (device {})", self.ctx.ordinal()),
            got: format!("a buffer of another context (device {})", ctx.ordinal()),
        })
    }

    /// The device address of an input buffer of this Gpu.
    pub(crate) fn addr<T>(&self, kernel: Kernel, arg: &'static str, buf: &impl DevicePtr<T>) -> Result<u64> {
        self.check_owner(kernel.name(), arg, buf)?;
        Ok(buf.device_ptr(&self.stream).0)
    }

    /// The device address of an optional input buffer of this Gpu; 0 (null) where absent.
    pub(crate) fn opt_addr<T>(
        &self,
        kernel: Kernel,
        arg: &'static str,
        buf: Option<&impl DevicePtr<T>>,
    ) -> Result<u64> {
        buf.map_or(Ok(0), |b| self.addr(kernel, arg, b))
    }

    /// The device address of an output buffer of this Gpu.
    pub(crate) fn addr_mut<T>(&self, kernel: Kernel, arg: &'static str, buf: &mut impl DevicePtrMut<T>) -> Result<u64> {
        self.check_owner(kernel.name(), arg, buf)?;
        Ok(buf.device_ptr_mut(&self.stream).0)
    }

    /// Queues `kernel` with its parameter block on a grid of `grid` blocks (x, y, z).
    ///
    /// # Safety
    /// `params` must satisfy `kernel`'s launch contract (its doc comment in kernels-gpu): every
    /// pointer valid for the extent the shape fields imply, outputs not aliasing inputs, and
    /// `grid`, `block`, `smem` as the kernel documents.
    pub(crate) unsafe fn launch<P: KernelParams>(
        &self,
        kernel: Kernel,
        grid: (u32, u32, u32),
        block: u32,
        smem: u32,
        params: P,
    ) -> Result<()> {
        // SAFETY: forwarded.
        unsafe { self.launch_clusters(kernel, grid, 1, block, smem, params) }
    }

    /// Most bytes of dynamic shared memory a block of `kernel` can have on this device.
    pub(crate) fn max_smem(&self, kernel: Kernel) -> u32 {
        self.max_smem[kernel as usize]
    }

    /// [`Gpu::launch`] in clusters of `cluster` blocks along x (thread block clusters, sm_90+;
    /// 1: none), grid.0 a multiple of it.
    ///
    /// # Safety
    /// As [`Gpu::launch`].
    pub(crate) unsafe fn launch_clusters<P: KernelParams>(
        &self,
        kernel: Kernel,
        grid: (u32, u32, u32),
        cluster: u32,
        block: u32,
        smem: u32,
        params: P,
    ) -> Result<()> {
        let f = &self.functions[kernel as usize];
        if self.capturing.load(Ordering::Relaxed)
            && let Ok(mut k) = self.captured.lock()
        {
            k.push(kernel.name());
        }
        Check(kernel.name()).that(
            "shape",
            smem <= self.max_smem[kernel as usize],
            format!(
                "one needing at most {} bytes of shared memory per block (this kernel's limit on this GPU)",
                self.max_smem[kernel as usize]
            ),
            format!("one needing {smem}"),
        )?;
        Check(kernel.name()).that(
            "shape",
            grid.1 <= 65535 && grid.2 <= 65535,
            "a grid of at most 65535 in y and z",
            format!("{grid:?}"),
        )?;
        let max = self.max_threads[kernel as usize];
        Check(kernel.name()).that(
            "width",
            block <= max,
            format!("a shape needing at most {max} threads per block (this kernel's limit on this GPU)"),
            format!("one needing {block}"),
        )?;
        Check(kernel.name()).that(
            "shape",
            (1..=8).contains(&cluster) && grid.0.is_multiple_of(cluster),
            "clusters of 1..=8 blocks dividing the grid",
            format!("clusters of {cluster} over {grid:?}"),
        )?;
        // Programmatic stream serialization for the kernels that load before their wait
        // (`Kernel::loads_early`): such a kernel may start launching while the one before it
        // finishes; every kernel waits for its predecessor (`grid_dependency_wait` in
        // kernels-gpu) before it reads what that one writes, so the order is that of a plain
        // stream. The others start once the kernel before has completed. The cluster
        // dimension only where there are clusters.
        let mut attrs = [
            sys::CUlaunchAttribute {
                id: sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION,
                pad: [0; 4],
                value: sys::CUlaunchAttributeValue {
                    programmaticStreamSerializationAllowed: i32::from(kernel.loads_early()),
                },
            },
            sys::CUlaunchAttribute {
                id: sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION,
                pad: [0; 4],
                value: sys::CUlaunchAttributeValue {
                    clusterDim: sys::CUlaunchAttributeValue_union__bindgen_ty_1 { x: cluster, y: 1, z: 1 },
                },
            },
        ];
        let cfg = sys::CUlaunchConfig {
            gridDimX: grid.0,
            gridDimY: grid.1,
            gridDimZ: grid.2,
            blockDimX: block,
            blockDimY: 1,
            blockDimZ: 1,
            sharedMemBytes: smem,
            hStream: self.stream.cu_stream(),
            attrs: attrs.as_mut_ptr(),
            numAttrs: if cluster > 1 { 2 } else { 1 },
        };
        let mut params = params;
        let mut args = [(&mut params as *mut P).cast::<std::ffi::c_void>()];
        self.ctx.bind_to_thread().during("binding the context")?;
        // SAFETY: the config, attribute and argument array live across the call; the one
        // argument is the kernel's parameter block (`P: KernelParams`: #[repr(C)], plain
        // fields, exactly the entry's `.param` bytes);
        // the rest is forwarded from this function's contract.
        unsafe { sys::cuLaunchKernelEx(&cfg, f.cu_function(), args.as_mut_ptr(), std::ptr::null_mut()) }
            .result()
            .during("launching a kernel")
    }
}

/// A captured sequence of launches (see [`Gpu::capture`]).
pub struct Graph(CudaGraph);

impl Graph {
    /// Queues the whole graph on the stream it was captured from.
    pub fn replay(&self) -> Result<()> {
        self.0.launch().during("launching a graph")
    }
}

/// The error for a typed view of a buffer that cudarc refused (`transmute` of a buffer to a
/// length it holds: not expected), while `during`.
fn view_refused(during: &'static str) -> Error {
    Error::Driver { during, source: DriverError(CUresult::CUDA_ERROR_INVALID_VALUE) }
}

/// The driver's CUDA version, as `major.minor`.
fn driver_version() -> String {
    let mut v = 0;
    // SAFETY: writes one int; the driver library is loaded (checked in Gpu::new).
    match unsafe { sys::cuDriverGetVersion(&mut v) } {
        CUresult::CUDA_SUCCESS => format!("{}.{}", v / 1000, v % 1000 / 10),
        _ => "unknown".into(),
    }
}
