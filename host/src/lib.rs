//! Host side of the NemotronH kernels: the PTX of every supported arch embedded at build time,
//! the module picked by the device's compute capability, safe typed launchers, and each
//! family's CPU reference (`cpu/`, what the tests hold the kernels to; the model crate's CPU
//! backend is built on them).
//!
//! ```no_run
//! use half::bf16;
//! use host::{Gpu, Rows, norm::{rms_norm, NormShape}};
//! # fn main() -> host::Result<()> {
//! let gpu = Gpu::new(0)?; // a clear error without a driver or GPU
//! let (rows, width) = (4, 2688);
//! let x = gpu.upload(&vec![bf16::from_f32(0.5); rows * width])?;
//! let w = gpu.upload(&vec![bf16::ONE; width])?;
//! let mut y = gpu.zeros::<bf16>(rows * width)?;
//! rms_norm(&gpu, NormShape::new(rows, width, 1, 1e-5), Rows::new(&x, rows, width), &w, &mut y)?;
//! let y = gpu.download(&y)?;
//! # Ok(()) }
//! ```

pub mod act;
mod args;
pub mod attn;
pub mod batch;
mod check;
pub mod conv1d;
pub mod cpu;
mod error;
pub mod gemm;
pub mod gemv;
mod gpu;
pub mod grouped;
pub mod mamba;
pub mod mma;
pub mod moe;
pub mod norm;
pub mod nvfp4;
pub mod quant;
pub mod router;
pub mod sample;
pub mod ssd;
pub mod ssm;
pub mod w4a4;

pub use args::{Elem, Rows};
pub use cudarc::driver::{CudaSlice, CudaView, CudaViewMut, DeviceRepr};
pub use error::{Error, Result};
pub use gpu::{Arch, Buffer, Gpu, Graph, Launch, Stamp, Timeline, UPLOAD_STAGE_BYTES};
pub use kernels_gpu::{Kernel, Smem};
