//! The single place kernels are launched from ([`Gpu::launch`], [`Gpu::launch_clusters`]), and
//! the device addresses of their buffers, checked to be of this `Gpu`'s context (launchers take
//! them through `Args`, host/src/args.rs, which checks their lengths too).

use std::sync::Arc;
use std::sync::atomic::Ordering;

use cudarc::driver::sys;
use cudarc::driver::{DevicePtr, DevicePtrMut, DeviceSlice};
use kernels_gpu::{Kernel, KernelParams};

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

    /// Whether this device's PTX has `kernel` (`Kernel::in_arch`: the `wgmma` kernels only on
    /// sm_90a).
    pub fn has(&self, kernel: Kernel) -> bool {
        self.functions[kernel as usize].is_some()
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
        let f = self.functions[kernel as usize]
            .as_ref()
            .ok_or(Error::NotInArch { kernel: kernel.name(), arch: self.arch.name() })?;
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
