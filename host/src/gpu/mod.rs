//! The CUDA device: driver context, one stream, the PTX module of the device's arch, and the
//! single place kernels are launched from.
//!
//! - `arch`: the embedded PTX flavours and which a device gets;
//! - this file: [`Gpu`] (opening the device, its context and stream, cuBLASLt, synchronizing);
//! - `memory`: allocations and transfers (page-locked staging);
//! - `scratch`: [`Buffer`], the temporaries of a step, and the capture arena they come from;
//! - `capture`: CUDA graph capture and replay ([`Graph`]);
//! - `timing`: timing events, the profiler range, and the [`Timeline`] of a timeline build;
//! - `launch`: [`Gpu::launch`] of a typed entry on a [`Grid`], and buffer addresses;
//! - `tma`: tensor maps, the tensor memory accelerator's view of a tensor.

mod arch;
mod capture;
mod launch;
mod memory;
mod scratch;
mod timing;
mod tma;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use cudarc::cublaslt::CudaBlasLT;
use cudarc::driver::sys::{self, CUresult};
use cudarc::driver::{
    CudaContext, CudaFunction, CudaModule, CudaSlice, CudaStream, DevicePtr, DriverError, PinnedHostSlice,
};
use cudarc::nvrtc::Ptx;
use kernels_gpu::Kernel;

pub use self::arch::Arch;
pub use self::capture::Graph;
pub(crate) use self::launch::Grid;
use self::memory::Stage;
pub use self::memory::UPLOAD_STAGE_BYTES;
pub use self::scratch::{ARENA_BYTES, Buffer};
pub use self::timing::{Launch, Stamp, Timeline};
pub(crate) use self::tma::byte_tensor_map;
use crate::error::{During, Error, Result};

/// One CUDA device with the module of its arch loaded, and the stream every launch goes to.
///
/// All work is ordered on that one stream; cudarc's per-allocation event tracking is disabled
/// (it is redundant on one stream and breaks CUDA graph capture), so buffers must only be used
/// through this `Gpu`'s stream.
pub struct Gpu {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    arch: Arch,
    /// Each kernel's function, `None` where this arch's PTX lacks it (`Kernel::in_arch`).
    functions: Vec<Option<CudaFunction>>,
    /// Most threads per block each function can launch with (its register use decides).
    max_threads: Vec<u32>,
    /// cuBLASLt on `stream`, created on first use (see [`Gpu::blas`]).
    blas: std::sync::OnceLock<Blas>,
    /// Most dynamic shared memory a block of each function may use (the device's opt-in
    /// limit less the function's static shared memory, enabled at load).
    max_smem: Vec<u32>,
    /// The device's streaming multiprocessors (a persistent kernel's grid).
    sms: u32,
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

/// cuBLASLt's handle on a [`Gpu`]'s stream (cudarc's matmuls, with a workspace of its own)
/// and the workspace of the matmuls this crate describes itself (host/src/gemm.rs).
pub(crate) struct Blas {
    pub(crate) lt: CudaBlasLT,
    pub(crate) workspace: CudaSlice<u8>,
}

/// Bytes of [`Blas::workspace`]: what NVIDIA advises for Hopper and later.
pub(crate) const BLAS_WORKSPACE: usize = 32 << 20;

/// Arrival counters [`Gpu::counters`] holds: one per block row of a grid (at most 65535).
pub(crate) const COUNTERS: usize = 65535;

/// Keeps the memory buffers free in the device's default pool (cudarc allocates from it,
/// stream-ordered) instead of handing it back to the driver at each synchronization (the
/// pool's release threshold, 0 by default): the engine synchronizes every step, and a prefix
/// cache that evicts a snapshot and saves another in one step would otherwise have the
/// driver map the memory again for each (tens of MiB each at Nano size).
fn keep_freed_memory(ctx: &CudaContext) -> Result<()> {
    // SAFETY: the device is the context's own; the attribute takes a u64 (cuuint64_t), which
    // lives across the call.
    unsafe {
        let pool = cudarc::driver::result::device::get_default_mem_pool(ctx.cu_device())
            .during("reading the device's memory pool")?;
        let mut keep = u64::MAX;
        let attr = sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD;
        cudarc::driver::result::mem_pool::set_attribute(pool, attr, (&raw mut keep).cast())
            .during("setting the memory pool's release threshold")
    }
}

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
        let arch = Arch::for_device(major, minor)?;
        let module = ctx.load_module(Ptx::from_src(arch.ptx())).map_err(|e| match e {
            DriverError(CUresult::CUDA_ERROR_UNSUPPORTED_PTX_VERSION) => {
                Error::DriverTooOld { driver: driver_version(), arch: arch.name(), isa: arch.ptx_isa() }
            }
            source => Error::Driver { during: "loading the PTX module", source },
        })?;
        // The kernels of this arch's PTX (`Kernel::in_arch`); the others stay `None`.
        let functions = Kernel::ALL
            .iter()
            .map(|k| {
                k.in_arch(arch.name())
                    .then(|| module.load_function(k.name()).map_err(|_| Error::MissingEntry(k.name())))
                    .transpose()
            })
            .collect::<Result<Vec<_>>>()?;
        let optin = sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN;
        let optin = ctx.attribute(optin).during("reading the shared memory limit")?.max(0);
        let (mut max_threads, mut max_smem) = (Vec::new(), Vec::new());
        for f in &functions {
            let (threads, dynamic) = match f {
                Some(f) => {
                    let attr = sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK;
                    let threads = f.get_attribute(attr).during("reading kernel attributes")?.max(0);
                    let fixed = sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES;
                    let dynamic = optin - f.get_attribute(fixed).during("reading kernel attributes")?.clamp(0, optin);
                    let attr = sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES;
                    f.set_attribute(attr, dynamic).during("enabling large shared memory")?;
                    (threads, dynamic)
                }
                None => (0, 0),
            };
            max_threads.push(threads as u32);
            max_smem.push(dynamic as u32);
        }
        let sms = sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT;
        let sms = ctx.attribute(sms).during("reading the multiprocessor count")?.max(1) as u32;
        if ctx.has_async_alloc() {
            keep_freed_memory(&ctx)?;
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
            sms,
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

    /// The device's streaming multiprocessors.
    pub fn sms(&self) -> u32 {
        self.sms
    }

    /// The device's name as the driver reports it.
    pub fn name(&self) -> Result<String> {
        self.ctx.name().during("reading the device name")
    }

    /// cuBLASLt bound to this Gpu's stream, with a workspace (allocated on first use).
    pub(crate) fn blas(&self) -> Result<&Blas> {
        if let Some(b) = self.blas.get() {
            return Ok(b);
        }
        // SAFETY: only probes whether the library can be opened.
        if !unsafe { cudarc::cublaslt::sys::is_culib_present() } {
            return Err(Error::NoCublas);
        }
        let lt = CudaBlasLT::new(self.stream.clone())
            .map_err(|source| Error::Cublas { during: "creating a handle", source })?;
        let workspace = self.stream.alloc_zeros(BLAS_WORKSPACE).during("allocating cuBLASLt's workspace")?;
        Ok(self.blas.get_or_init(|| Blas { lt, workspace }))
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

    /// Waits until all queued work is done; reports errors of earlier launches.
    pub fn synchronize(&self) -> Result<()> {
        self.not_capturing("a synchronization")?;
        self.stream.synchronize().during("waiting for the stream")
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
