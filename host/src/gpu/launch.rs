//! The single place kernels are launched from ([`Gpu::launch`] of a typed entry on a [`Grid`]), and
//! the device addresses of their buffers, checked to be of this `Gpu`'s context (launchers take
//! them through `Args`, host/src/args.rs, which checks their lengths too).

use std::sync::Arc;
use std::sync::atomic::Ordering;

use cudarc::driver::sys;
use cudarc::driver::{DevicePtr, DevicePtrMut, DeviceSlice};
use kernels_gpu::{Entry, Kernel, KernelParams, Smem, Threads};

use super::Gpu;
use crate::check::Check;
use crate::error::{During, Error, Result};

impl Gpu {
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

    /// The device address of an output buffer of this Gpu.
    pub(crate) fn addr_mut<T>(&self, kernel: Kernel, arg: &'static str, buf: &mut impl DevicePtrMut<T>) -> Result<u64> {
        self.check_owner(kernel.name(), arg, buf)?;
        Ok(buf.device_ptr_mut(&self.stream).0)
    }

    /// Whether this device's PTX has `kernel` (`Kernel::in_arch`: the `wgmma` kernels only on
    /// sm_90a, the block-scaled FP4 one only on sm_121a).
    pub fn has(&self, kernel: Kernel) -> bool {
        self.functions[kernel as usize].is_some()
    }

    /// Whether this device runs `kernel` as it is built: its PTX has it ([`Gpu::has`]) and a
    /// block may have the shared memory it always takes (`Smem::Fixed`). A block of the sm_12x
    /// family (DGX Spark's sm_121a) has at most 99 KiB where sm_90 and sm_100 blocks have 227
    /// KiB, so the 128-row grouped GEMM tiles (108 KiB) and the flash attention kernels of 64
    /// keys a tile (136 KiB) do not fit there; their callers take another path where this says
    /// no (the 64-row tiles, the flash kernels of 32 keys). A kernel
    /// whose shared memory each launch sizes (`Smem::PerLaunch`) fits here: its launcher
    /// checks the size it asks for.
    pub fn fits(&self, kernel: Kernel) -> bool {
        self.has(kernel)
            && match kernel.smem() {
                Smem::Fixed(bytes) => bytes <= self.max_smem(kernel),
                Smem::PerLaunch => true,
            }
    }

    /// Most bytes of dynamic shared memory a block of `kernel` can have on this device.
    pub(crate) fn max_smem(&self, kernel: Kernel) -> u32 {
        self.max_smem[kernel as usize]
    }

    /// Queues the launch `l` with its parameter block.
    ///
    /// # Safety
    /// `params` must satisfy the kernel's launch contract (its doc comment in kernels-gpu):
    /// every pointer valid for the extent the shape fields imply, outputs not aliasing inputs,
    /// and the grid, block and shared memory as the kernel documents.
    pub(crate) unsafe fn launch<P: KernelParams>(&self, l: Grid<P>, params: P) -> Result<()> {
        let (block, smem) = l.sizes()?;
        let Grid { entry, grid, cluster, .. } = l;
        let kernel = entry.kernel;
        let f = self.functions[kernel as usize].as_ref().ok_or(Error::NotInArch {
            kernel: kernel.name(),
            arch: self.arch.name(),
            needs: if kernel.needs_wgmma() {
                "sm_90a (`wgmma`)"
            } else if kernel.needs_tcgen05() {
                "sm_110a (`tcgen05`)"
            } else {
                "sm_121a (block-scaled FP4 `mma`)"
            },
        })?;
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

/// A launcher's block or shared memory (`got`: `None` where it gave none) that its entry's
/// `expected` does not take.
fn misuse(kernel: Kernel, arg: &'static str, expected: impl std::fmt::Debug, got: Option<u32>) -> Error {
    let got = got.map_or("none from its launcher".to_string(), |n| format!("{n} from its launcher"));
    Error::Shape { kernel: kernel.name(), arg, expected: format!("{expected:?}"), got }
}

/// One launch of a typed entry: its grid (x, y, z), clusters, and the block and shared memory
/// where the entry leaves them to its launcher ([`Threads::UpTo`], [`Smem::PerLaunch`]);
/// [`Gpu::launch`] refuses any other pairing.
///
/// An entry names the one parameter type its kernel takes, so a launch cannot pair it with
/// another:
/// ```
/// let _: kernels_gpu::Entry<kernels_gpu::norm::RmsNormParams> = kernels_gpu::entry::NORM_RMS;
/// ```
/// ```compile_fail
/// let _: kernels_gpu::Entry<kernels_gpu::norm::GatedNormParams> = kernels_gpu::entry::NORM_RMS;
/// ```
pub(crate) struct Grid<P> {
    entry: Entry<P>,
    grid: (u32, u32, u32),
    cluster: u32,
    threads: Option<u32>,
    smem: Option<u32>,
}

impl<P> Grid<P> {
    /// `entry` on `grid` blocks, no clusters, its own block and shared memory.
    pub(crate) fn new(entry: Entry<P>, grid: (u32, u32, u32)) -> Self {
        Grid { entry, grid, cluster: 1, threads: None, smem: None }
    }

    /// Blocks of `n` threads (an entry of [`Threads::UpTo`]).
    pub(crate) fn threads(self, n: u32) -> Self {
        Grid { threads: Some(n), ..self }
    }

    /// `bytes` of dynamic shared memory a block (an entry of [`Smem::PerLaunch`]).
    pub(crate) fn smem(self, bytes: u32) -> Self {
        Grid { smem: Some(bytes), ..self }
    }

    /// Thread block clusters of `blocks` along x (sm_90+; 1: none), grid.0 a multiple of it.
    pub(crate) fn clusters(self, blocks: u32) -> Self {
        Grid { cluster: blocks, ..self }
    }

    /// The block's threads and shared memory: the entry's own where it fixes them, the
    /// launcher's where the entry leaves them to it (within its bound); any other pairing is
    /// an error naming the kernel.
    fn sizes(&self) -> Result<(u32, u32)> {
        let kernel = self.entry.kernel;
        let block = match (kernel.threads(), self.threads) {
            (Threads::Fixed(n), None) => n,
            (Threads::UpTo(most), Some(n)) if n <= most => n,
            (t, n) => return Err(misuse(kernel, "threads", t, n)),
        };
        let smem = match (kernel.smem(), self.smem) {
            (Smem::Fixed(bytes), None) => bytes,
            (Smem::PerLaunch, Some(bytes)) => bytes,
            (m, b) => return Err(misuse(kernel, "smem", m, b)),
        };
        Ok((block, smem))
    }
}

#[cfg(test)]
mod tests {
    use kernels_gpu::entry;

    use super::*;
    use crate::check::arg_of;

    #[test]
    fn a_grid_takes_the_sizes_its_entry_leaves_open_and_no_others() {
        // Fixed block and shared memory: the entry's own, nothing from the launcher.
        let fixed = || Grid::new(entry::MOE_DISPATCH, (1, 1, 1));
        let own = (kernels_gpu::moe::DISPATCH_BLOCK, kernels_gpu::moe::DISPATCH_SMEM_BYTES);
        assert_eq!(fixed().sizes().unwrap(), own);
        assert_eq!(arg_of(fixed().threads(own.0).sizes()), "threads");
        assert_eq!(arg_of(fixed().smem(own.1).sizes()), "smem");
        // Threads up to a bound and shared memory per launch: both from the launcher.
        let norm = || Grid::new(entry::NORM_RMS, (4, 1, 1));
        assert_eq!(norm().threads(96).smem(16).sizes().unwrap(), (96, 16));
        assert_eq!(norm().threads(kernels_gpu::MAX_BLOCK).smem(0).sizes().unwrap(), (kernels_gpu::MAX_BLOCK, 0));
        assert_eq!(arg_of(norm().threads(kernels_gpu::MAX_BLOCK + 32).smem(16).sizes()), "threads");
        assert_eq!(arg_of(norm().smem(16).sizes()), "threads");
        assert_eq!(arg_of(norm().threads(96).sizes()), "smem");
        let e = norm().smem(16).sizes().unwrap_err().to_string();
        assert!(e.contains("norm_rms_bf16") && e.contains("UpTo(1024)"), "{e}");
    }
}
