use cudarc::driver::DriverError;

/// Everything the host crate can fail with. Messages say what to do.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(
        "no CUDA driver found (libcuda.so could not be loaded): install the NVIDIA driver, or use the CPU reference backend"
    )]
    NoDriver,
    #[error("no CUDA device {ordinal}: the driver reports {count} device(s)")]
    NoDevice { ordinal: usize, count: usize },
    #[error("CUDA driver error while {during}: {source}")]
    Driver {
        during: &'static str,
        #[source]
        source: DriverError,
    },
    #[error("{kernel}: argument `{arg}`: expected {expected}, got {got}")]
    Shape { kernel: &'static str, arg: &'static str, expected: String, got: String },
    #[error(
        "unsupported GPU: compute capability {major}.{minor}; the kernels need 9.0 or newer (PTX is embedded for sm_90, sm_90a, sm_110a and sm_121a)"
    )]
    UnsupportedArch { major: i32, minor: i32 },
    #[error("the CUDA driver (version {driver}) cannot load {arch} PTX (ISA {isa}): update the NVIDIA driver")]
    DriverTooOld { driver: String, arch: &'static str, isa: &'static str },
    #[error(
        "kernel entry `{0}` is missing from the loaded PTX module: the build is inconsistent, run `cargo clean` and rebuild"
    )]
    MissingEntry(&'static str),
    #[error("kernel `{kernel}` is not in this GPU's PTX ({arch}): it needs {needs}; callers check `Gpu::has`")]
    NotInArch { kernel: &'static str, arch: &'static str, needs: &'static str },
    #[error(
        "NEMO_ARCH={name}: not a PTX this build has that runs on a device of compute capability {major}.{minor} (sm_90 runs on 9.0 and newer; sm_90a, sm_110a, sm_121a each on its own)"
    )]
    ArchRefused { name: String, major: i32, minor: i32 },
    #[error("{0} inside a CUDA graph capture: the graph would replay it with stale host data")]
    InCapture(&'static str),
    #[error("invalid batch: {0}")]
    Batch(String),
    #[error("cuBLASLt is not available (libcublasLt.so could not be loaded): install the CUDA toolkit's cuBLAS")]
    NoCublas,
    #[error("cuBLASLt error while {during}: {source}")]
    Cublas {
        during: &'static str,
        #[source]
        source: cudarc::cublaslt::result::CublasError,
    },
}

/// The host crate's result type.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Wraps a driver error with what was being done.
pub(crate) trait During<T> {
    fn during(self, what: &'static str) -> Result<T>;
}

impl<T> During<T> for std::result::Result<T, DriverError> {
    fn during(self, during: &'static str) -> Result<T> {
        self.map_err(|source| Error::Driver { during, source })
    }
}
