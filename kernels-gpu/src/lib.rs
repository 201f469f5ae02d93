//! NemotronH kernels, written in `#![no_std]` Rust and compiled to PTX by rustc's NVPTX backend.
//!
//! The crate builds for two targets:
//! - `nvptx64-nvidia-cuda`: the kernels themselves (`host/ptx_build.rs` drives that build);
//! - the host: only the shared ABI — each family's `#[repr(C)]` launch parameters, block sizes,
//!   shared-memory sizes and the list of entry points ([`Kernel`]) — so host and device never
//!   mirror a struct by hand.
//!
//! The math each kernel computes is specified in `docs/MATH.md`; the CPU references that tests
//! compare against live in `host/src/cpu/`.
#![no_std]
#![cfg_attr(target_arch = "nvptx64", allow(internal_features))]
#![cfg_attr(target_arch = "nvptx64", feature(abi_ptx, stdarch_nvptx, asm_experimental_arch, link_llvm_intrinsics))]
// `core::f32::math` (the device's FMA and square root); the host has them from std, so the
// host build of the ABI stays on stable Rust.
#![cfg_attr(target_arch = "nvptx64", feature(core_float_math))]

#[cfg(not(target_arch = "nvptx64"))]
extern crate std;

#[cfg(target_arch = "nvptx64")]
mod device;

pub mod act;
pub mod attn;
pub mod conv1d;
pub mod flash;
pub mod gemv;
pub mod grouped;
pub mod mamba;
pub mod mma;
pub mod moe;
pub mod norm;
pub mod nvfp4;
pub mod qgemv;
pub mod quant;
pub mod router;
pub mod sample;
pub mod ssd;
pub mod ssm;
pub mod wgmma;

/// Elements in one chunk: the unit of a 16-byte bf16 load, and what a thread converts at once.
pub const VEC: u32 = 8;
/// Chunks each thread of a row kernel keeps in registers.
pub const CHUNKS_PER_THREAD: u32 = 4;
/// Most threads in a block.
pub const MAX_BLOCK: u32 = 1024;
/// Widest row a row kernel handles (every chunk of a row held in registers by one block).
pub const MAX_ROW_WIDTH: u32 = VEC * CHUNKS_PER_THREAD * MAX_BLOCK;
/// Floats of shared memory a block reduction uses (one per warp of the largest block).
pub const REDUCE_SMEM_FLOATS: u32 = MAX_BLOCK / 32;

/// Chunks of a row of `width` elements.
pub const fn chunks(width: u32) -> u32 {
    width.div_ceil(VEC)
}

/// Threads per block of the row kernels (norm, per-token quant) for rows of `width`
/// (<= [`MAX_ROW_WIDTH`]): whole warps, a chunk each up to [`MAX_BLOCK`] threads (a thread's
/// chunks are loaded one after another: a single row's latency grows with them), then up to
/// [`CHUNKS_PER_THREAD`] each. One block handles one row.
pub const fn row_block(width: u32) -> u32 {
    let c = chunks(width);
    let threads = (if c < MAX_BLOCK { c } else { MAX_BLOCK }).div_ceil(32) * 32;
    if threads < 32 { 32 } else { threads }
}

/// Threads per block of the row kernels at many rows ([`row_block`] is for few): whole warps
/// of [`CHUNKS_PER_THREAD`] chunks each, so a block's threads have all of its row's loads in
/// flight at once and an SM holds several rows. The kernels are the same; only the chunks per
/// thread change.
pub const fn row_block_many(width: u32) -> u32 {
    let threads = chunks(width).div_ceil(CHUNKS_PER_THREAD).div_ceil(32) * 32;
    if threads < 32 { 32 } else { threads }
}

/// Threads per block of the element-wise (grid-stride) kernels.
pub const EW_BLOCK: u32 = 256;

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
    /// [`quant::QuantRowsParams`]: FP8 e4m3 quantization of gathered rows, each with its
    /// matrix's static scale or its own dynamic one (a grouped or plain FP8 product's input).
    QuantRows = "quant_rows_fp8_bf16",
    /// [`quant::QuantAmaxParams`]: per-tensor max |x| (first pass of per-tensor dynamic quantization).
    QuantAmax = "quant_amax_bf16",
    /// [`quant::QuantTensorParams`]: per-tensor dynamic FP8 e4m3 quantization (second pass).
    QuantTensor = "quant_tensor_fp8_bf16",
    /// [`quant::QuantStaticParams`]: FP8 e4m3 quantization with a given (static) scale.
    QuantStatic = "quant_static_fp8_bf16",
    /// [`conv1d::ConvUpdateParams`]: causal conv1d decode step, in place at the rows' slots.
    ConvUpdate = "conv1d_update_bf16",
    /// [`conv1d::ConvFwdParams`]: causal conv1d prefill outputs (varlen).
    ConvFwd = "conv1d_fwd_bf16",
    /// [`conv1d::ConvFwdParams`]: causal conv1d prefill outputs, 4 channels by a run of tokens
    /// a thread (many tokens).
    ConvFwdTiled = "conv1d_fwd_tiled_bf16",
    /// [`conv1d::ConvFwdParams`]: causal conv1d prefill final states.
    ConvFwdState = "conv1d_fwd_state_bf16",
    /// [`ssm::SsmUpdateParams`]`<f32>`: selective state update, f32 state.
    SsmUpdateF32 = "ssm_update_f32",
    /// [`ssm::SsmUpdateParams`]`<u16>`: selective state update, bf16 state.
    SsmUpdateBf16 = "ssm_update_bf16",
    /// [`ssd::SsdParams`]: chunk cumsum and per-chunk states of the chunked scan.
    SsdChunkState = "ssd_chunk_state_f32",
    /// [`ssd::SsdPassParams`]`<f32>`: state passing, f32 state cache.
    SsdStatePassF32 = "ssd_state_pass_f32",
    /// [`ssd::SsdPassParams`]`<u16>`: state passing, bf16 state cache.
    SsdStatePassBf16 = "ssd_state_pass_bf16",
    /// [`ssd::SsdParams`]: chunk scan outputs.
    SsdScan = "ssd_scan_bf16",
    /// [`mma::MatmulParams`]: a matrix product on tensor cores (the test of the `mma` module).
    TcMatmul = "tc_matmul_bf16",
    /// [`act::Relu2Params`]: relu^2 in place.
    ActRelu2 = "act_relu2_bf16",
    /// [`act::GatherParams`]: rows gathered by index.
    ActGather = "act_gather_bf16",
    /// [`attn::AttnParams`]: new keys and values into the cache.
    AttnCacheWrite = "attn_cache_write_bf16",
    /// [`attn::AttnParams`]: causal attention over the cache (a part of each row's keys a
    /// block where they are split).
    Attn = "attn_bf16",
    /// [`attn::AttnParams`]: the parts of a split `Attn` merged into the output.
    AttnCombine = "attn_combine_bf16",
    /// [`flash::FlashParams`]: causal attention of many rows over the cache, on tensor cores.
    AttnFlash = "attn_flash_bf16",
    /// [`flash::FlashParams`]: as `AttnFlash`, heads of 113 to 128 channels.
    AttnFlashD128 = "attn_flash_d128_bf16",
    /// [`gemv::DenseParams`]: a bf16 linear layer at few rows, a warp per weight row pair, its
    /// first weights loading before it waits on the kernel before.
    Gemv = "gemv_bf16",
    /// [`gemv::DenseParams`]: as `Gemv`, e4m3 weights (W8A8).
    GemvFp8 = "gemv_fp8",
    /// [`gemv::DenseParams`]: an FP8 linear layer of a few rows (W8A8) on tensor cores
    /// ([`qgemv`]).
    GemvTcFp8 = "gemv_tc_fp8",
    /// [`gemv::DenseParams`]: an NVFP4 linear layer of a few rows (weight-only) on tensor
    /// cores ([`qgemv`]).
    GemvTcNvfp4 = "gemv_tc_nvfp4",
    /// [`gemv::DenseParams`]: as `Gemv`, NVFP4 weights (weight-only), its first weights
    /// loading before it waits.
    GemvNvfp4 = "gemv_nvfp4",
    /// [`nvfp4::ToBf16Params`]: NVFP4 weights dequantized to bf16.
    Nvfp4ToBf16 = "nvfp4_to_bf16",
    /// [`gemv::SplitParams`]: a bf16 linear layer, each weight row split along k over a block.
    GemvSplit = "gemv_split_bf16",
    /// [`moe::RouteParams`]: router logits in f32, then sigmoid, bias, group-limited top-k,
    /// weights.
    MoeRoute = "moe_route_bf16",
    /// [`moe::RouteParams`]: routing of many tokens, the router logits on tensor cores.
    MoeRouteTc = "moe_route_tc_bf16",
    /// [`moe::DispatchParams`]: routing choices grouped by expert.
    MoeDispatch = "moe_dispatch",
    /// [`moe::ExpertParams`]: one projection of every expert with rows (small batches).
    MoeExpert = "moe_expert_bf16",
    /// [`moe::ExpertParams`]: as `MoeExpert`, e4m3 weights (W8A8).
    MoeExpertFp8 = "moe_expert_fp8",
    /// [`moe::ExpertParams`]: as `MoeExpert`, NVFP4 weights (weight-only).
    MoeExpertNvfp4 = "moe_expert_nvfp4",
    /// [`moe::ExpertParams`]: as `MoeExpertFp8`, on tensor cores ([`qgemv`]).
    MoeExpertTcFp8 = "moe_expert_tc_fp8",
    /// [`moe::ExpertParams`]: as `MoeExpertNvfp4`, on tensor cores ([`qgemv`]).
    MoeExpertTcNvfp4 = "moe_expert_tc_nvfp4",
    /// [`moe::ExpertParams`]: one projection per routing choice, no dispatch (small batches).
    MoeExpertChoices = "moe_expert_choices_bf16",
    /// [`moe::ExpertParams`]: as `MoeExpertChoices`, e4m3 weights (W8A8).
    MoeExpertChoicesFp8 = "moe_expert_choices_fp8",
    /// [`moe::ExpertParams`]: as `MoeExpertChoices`, NVFP4 weights (weight-only).
    MoeExpertChoicesNvfp4 = "moe_expert_choices_nvfp4",
    /// [`moe::ExpertCombineParams`]: each token's chosen down projections, combined.
    MoeExpertCombine = "moe_expert_combine_bf16",
    /// [`moe::ExpertCombineParams`]: as `MoeExpertCombine`, e4m3 weights (W8A8).
    MoeExpertCombineFp8 = "moe_expert_combine_fp8",
    /// [`moe::ExpertCombineParams`]: as `MoeExpertCombine`, NVFP4 weights (weight-only).
    MoeExpertCombineNvfp4 = "moe_expert_combine_nvfp4",
    /// [`grouped::GroupedParams`]: one projection of every expert with rows, on tensor cores.
    MoeGrouped = "moe_grouped_bf16",
    /// [`grouped::GroupedParams`]: as `MoeGrouped`, tiles of 128 rows (experts of many rows).
    MoeGroupedWide = "moe_grouped_m128_bf16",
    /// [`grouped::GroupedFp8Params`]: as `MoeGrouped`, FP8 e4m3 codes (W8A8).
    MoeGroupedFp8 = "moe_grouped_fp8",
    /// [`grouped::GroupedParams`]: as `MoeGrouped`, 128 x 256 tiles on `wgmma` (sm_90a PTX
    /// only).
    MoeGroupedWgmma = "moe_grouped_wgmma_bf16",
    /// [`grouped::GroupedFp8Params`]: as `MoeGroupedFp8`, 128 x 256 tiles on `wgmma` (sm_90a
    /// PTX only).
    MoeGroupedWgmmaFp8 = "moe_grouped_wgmma_fp8",
    /// [`grouped::GemmParams`]: a bf16 linear layer of many rows on tensor cores.
    GemmBf16 = "gemm_bf16",
    /// [`grouped::GemmParams`]: as `GemmBf16`, tiles of 128 rows.
    GemmWideBf16 = "gemm_m128_bf16",
    /// [`grouped::GemmParams`]: as `GemmBf16`, 128 x 256 tiles on `wgmma` (sm_90a PTX only).
    GemmWgmma = "gemm_wgmma_bf16",
    /// [`grouped::GemmFp8Params`]: as `GemmFp8`, 128 x 256 tiles on `wgmma` (sm_90a PTX only).
    GemmWgmmaFp8 = "gemm_wgmma_fp8",
    /// [`grouped::GemmFp8Params`]: an FP8 linear layer of many rows on tensor cores (W8A8).
    GemmFp8 = "gemm_fp8",
    /// [`moe::CombineParams`]: weighted sum of a token's expert outputs and the shared one.
    MoeCombine = "moe_combine_bf16",
    /// [`mamba::MambaDecodeParams`]: a Mamba2 mixer's decode rows between its projections
    /// (conv update, state update, gated norm), in clusters of a group's heads.
    MambaDecode = "mamba_decode_bf16",
    /// [`sample::SampleParams`]: each row's next token from its logits (greedy, or
    /// temperature with top-k, top-p, min-p and penalties), in clusters of blocks.
    Sample = "sample_bf16",
}

impl Kernel {
    /// Whether the entry is in the PTX built for `arch` (`-C target-cpu`): the `wgmma`
    /// kernels exist in the sm_90a PTX only (arch-specific instructions), every other kernel
    /// in every arch's.
    pub const fn in_arch(self, arch: &str) -> bool {
        !self.needs_wgmma() || matches!(arch.as_bytes(), b"sm_90a")
    }

    /// Whether the kernel runs on `wgmma` (warpgroup matrix products, sm_90a only).
    pub const fn needs_wgmma(self) -> bool {
        matches!(self, Kernel::MoeGroupedWgmma | Kernel::MoeGroupedWgmmaFp8 | Kernel::GemmWgmma | Kernel::GemmWgmmaFp8)
    }

    /// Whether the kernel issues its first loads before it waits on the kernel before it
    /// (weights; the fused Mamba decode also its slot's caches), so that starting while that
    /// one still runs (programmatic dependent launch) gains it something. The host launches
    /// only these with programmatic stream serialization; the others start once the kernel
    /// before has completed (their wait returns at once): an early start of a kernel with
    /// nothing to do before its wait took SM time from the one it waits on
    /// (docs/PERFORMANCE.md, the whole model's findings).
    pub const fn loads_early(self) -> bool {
        matches!(
            self,
            Kernel::Gemv
                | Kernel::GemvNvfp4
                | Kernel::GemvSplit
                | Kernel::MoeRoute
                | Kernel::MoeExpertCombine
                | Kernel::MoeExpertCombineFp8
                | Kernel::MoeExpertCombineNvfp4
                | Kernel::MambaDecode
        )
    }
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
