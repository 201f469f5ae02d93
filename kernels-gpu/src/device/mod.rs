//! The one module that talks to the hardware: thread ids, warp shuffles, barriers, dynamic shared
//! memory, bf16 and FP8 conversions, fast exp, the async proxy's fence and mbarriers, the tensor
//! memory accelerator's copies. Kernels use only these wrappers, through `use crate::device::*;`:
//! every submodule's items are re-exported here (each submodule's doc says what it holds), and
//! this file holds `trap`.

mod chunks;
mod cluster;
mod convert;
mod ids;
mod math;
mod memory;
// The arches with tensor cores that read through the async proxy.
#[cfg(any(target_feature = "sm_90a", tcgen05))]
mod proxy;
mod smem;
mod state;
mod sync;
#[cfg(feature = "timeline")]
mod timeline;
#[cfg(target_feature = "sm_90a")]
mod tma;
mod warp;

use core::arch::nvptx;

pub use self::chunks::*;
pub use self::cluster::*;
pub use self::convert::*;
pub use self::ids::*;
pub use self::math::*;
pub use self::memory::*;
#[cfg(any(target_feature = "sm_90a", tcgen05))]
pub use self::proxy::*;
pub use self::smem::*;
pub use self::state::*;
pub use self::sync::*;
#[cfg(target_feature = "sm_90a")]
pub use self::tma::*;
pub use self::warp::*;

/// Stops the kernel (used by the panic handler; bounds-check failures end here).
#[inline(always)]
pub fn trap() -> ! {
    // SAFETY: `trap` has no preconditions; it aborts the kernel.
    unsafe { nvptx::trap() }
}
