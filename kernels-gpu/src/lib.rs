//! NemotronH kernels, written in `#![no_std]` Rust and compiled to PTX by rustc's NVPTX backend.
//!
//! The crate builds for two targets:
//! - `nvptx64-nvidia-cuda`: the kernels themselves (`host/ptx_build.rs` drives that build);
//! - the host: only the shared ABI — each family's `#[repr(C)]` launch parameters, block sizes,
//!   shared-memory sizes and the list of entry points ([`Kernel`]) — so host and device never
//!   mirror a struct by hand.
//!
//! The math each kernel computes is specified in `shared/SPEC.md`; the CPU references that tests
//! compare against live in `host/src/cpu/`.
#![no_std]
#![cfg_attr(target_arch = "nvptx64", allow(internal_features))]
#![cfg_attr(
    target_arch = "nvptx64",
    feature(abi_ptx, stdarch_nvptx, asm_experimental_arch, link_llvm_intrinsics, core_float_math)
)]

#[cfg(target_arch = "nvptx64")]
mod device;

pub mod norm;
pub mod quant;

/// Threads per block of the row-wise kernels (norm, quant); 8 warps.
pub const ROW_BLOCK: u32 = 256;
/// Warps per block of the row-wise kernels.
pub const ROW_WARPS: u32 = ROW_BLOCK / 32;

macro_rules! kernels {
    ($($(#[$doc:meta])* $variant:ident = $name:literal,)*) => {
        /// Every kernel entry point in the PTX, by its `.entry` name. The host names kernels
        /// only through this enum; a test checks each name is an `.entry` of every arch's PTX.
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        pub enum Kernel {
            $($(#[$doc])* $variant,)*
        }

        impl Kernel {
            /// All entries, in declaration order.
            pub const ALL: &'static [Kernel] = &[$(Kernel::$variant,)*];

            /// The `.entry` name in the PTX.
            pub const fn name(self) -> &'static str {
                match self {
                    $(Kernel::$variant => $name,)*
                }
            }
        }
    };
}

kernels! {
    /// [`norm::RmsNormParams`]: plain RMSNorm.
    NormRms = "norm_rms_bf16",
    /// [`norm::GatedNormParams`]: gated group RMSNorm.
    NormGated = "norm_gated_bf16",
    /// [`norm::GatedNormFp8Params`]: gated group RMSNorm fused with per-token FP8 quantization.
    NormGatedFp8 = "norm_gated_fp8_bf16",
    /// [`quant::QuantTokenParams`]: per-token dynamic FP8 e4m3 quantization.
    QuantToken = "quant_token_fp8_bf16",
    /// [`quant::QuantAmaxParams`]: per-tensor max |x| (first pass of per-tensor dynamic quantization).
    QuantAmax = "quant_amax_bf16",
    /// [`quant::QuantTensorParams`]: per-tensor dynamic FP8 e4m3 quantization (second pass).
    QuantTensor = "quant_tensor_fp8_bf16",
    /// [`quant::QuantStaticParams`]: FP8 e4m3 quantization with a given (static) scale.
    QuantStatic = "quant_static_fp8_bf16",
}

/// Marker for the `#[repr(C)]` launch-parameter structs passed by value to a kernel.
///
/// # Safety
/// Implementors must be `#[repr(C)]`, `Copy`, and contain only integers, floats and raw
/// pointers, so their bytes are the exact `.param` block the PTX entry expects.
pub unsafe trait KernelParams: Copy {}

#[cfg(target_arch = "nvptx64")]
#[panic_handler]
fn panic(_: &core::panic::PanicInfo) -> ! {
    device::trap()
}
