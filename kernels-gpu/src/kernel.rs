//! Every kernel entry point: its `.entry` name ([`Kernel`]), the one parameter type it takes
//! and the block it runs in ([`Entry`], the constants of [`entry`]). The host launches
//! through the typed entries, so a launch with another parameter type does not compile and a
//! block or shared-memory size the kernel does not take is refused before it reaches the
//! driver; the kernels' threads also bound their registers in the PTX (`.maxntid`, host's
//! ptx_build.rs).

use core::marker::PhantomData;

use crate::*;

/// Threads of a kernel's blocks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Threads {
    /// Always this many.
    Fixed(u32),
    /// As many as the launch's shape needs (its launcher sizes the block), at most this many.
    UpTo(u32),
}

impl Threads {
    /// The most threads a block of the kernel has.
    pub const fn most(self) -> u32 {
        match self {
            Threads::Fixed(n) | Threads::UpTo(n) => n,
        }
    }
}

/// Bytes of dynamic shared memory a kernel's blocks take.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Smem {
    /// Always this many (0: none).
    Fixed(u32),
    /// What the launch's shape needs (its launcher computes it; the device's limit bounds it).
    PerLaunch,
}

/// A kernel entry with the parameter block `P` it takes and its block and shared-memory sizes
/// ([`Kernel::threads`], [`Kernel::smem`]): the constants of [`entry`].
pub struct Entry<P> {
    /// The entry point.
    pub kernel: Kernel,
    params: PhantomData<fn(P)>,
}

impl<P: KernelParams> Entry<P> {
    const fn new(kernel: Kernel) -> Self {
        Entry { kernel, params: PhantomData }
    }
}

impl<P> Entry<P> {
    /// The `.entry` name in the PTX.
    pub const fn name(self) -> &'static str {
        self.kernel.name()
    }
}

impl<P> From<Entry<P>> for Kernel {
    fn from(entry: Entry<P>) -> Kernel {
        entry.kernel
    }
}

impl<P> Clone for Entry<P> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<P> Copy for Entry<P> {}

impl<P> core::fmt::Debug for Entry<P> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.write_str(self.kernel.name())
    }
}

macro_rules! kernels {
    ($($(#[$doc:meta])* $entry:ident = $variant:ident($name:literal, $params:ty, $threads:expr, $smem:expr),)*) => {
        /// Every kernel entry point in the PTX, by its `.entry` name. A test checks each name
        /// is an `.entry` of every arch's PTX; launches go through [`entry`]'s typed constants.
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

            /// The threads of the kernel's blocks.
            pub const fn threads(self) -> Threads {
                match self {
                    $(Kernel::$variant => $threads,)*
                }
            }

            /// The dynamic shared memory of the kernel's blocks.
            pub const fn smem(self) -> Smem {
                match self {
                    $(Kernel::$variant => $smem,)*
                }
            }
        }

        /// The typed entries, one a kernel: what a launch names.
        pub mod entry {
            use super::*;

            $($(#[$doc])* pub const $entry: Entry<$params> = Entry::new(Kernel::$variant);)*
        }
    };
}

kernels! {
    /// Plain RMSNorm.
    NORM_RMS = NormRms("norm_rms_bf16", norm::RmsNormParams, Threads::UpTo(MAX_BLOCK), Smem::PerLaunch),
    /// Gated group RMSNorm.
    NORM_GATED = NormGated("norm_gated_bf16", norm::GatedNormParams, Threads::UpTo(MAX_BLOCK), Smem::PerLaunch),
    /// Gated group RMSNorm fused with per-token FP8 quantization.
    NORM_GATED_FP8 = NormGatedFp8("norm_gated_fp8_bf16", norm::GatedNormFp8Params, Threads::UpTo(MAX_BLOCK), Smem::PerLaunch),
    /// Per-token dynamic FP8 e4m3 quantization.
    QUANT_TOKEN = QuantToken("quant_token_fp8_bf16", quant::QuantTokenParams, Threads::UpTo(MAX_BLOCK), Smem::Fixed(quant::REDUCE_SMEM_BYTES)),
    /// FP8 e4m3 quantization of gathered rows, each with its
    /// matrix's static scale or its own dynamic one (a grouped or plain FP8 product's input).
    QUANT_ROWS = QuantRows("quant_rows_fp8_bf16", quant::QuantRowsParams, Threads::UpTo(MAX_BLOCK), Smem::Fixed(quant::REDUCE_SMEM_BYTES)),
    /// Per-tensor max |x| (first pass of per-tensor dynamic quantization).
    QUANT_AMAX = QuantAmax("quant_amax_bf16", quant::QuantAmaxParams, Threads::Fixed(EW_BLOCK), Smem::Fixed(quant::AMAX_SMEM_BYTES)),
    /// Per-tensor dynamic FP8 e4m3 quantization (second pass).
    QUANT_TENSOR = QuantTensor("quant_tensor_fp8_bf16", quant::QuantTensorParams, Threads::Fixed(EW_BLOCK), Smem::Fixed(0)),
    /// FP8 e4m3 quantization with a given (static) scale.
    QUANT_STATIC = QuantStatic("quant_static_fp8_bf16", quant::QuantStaticParams, Threads::Fixed(EW_BLOCK), Smem::Fixed(0)),
    /// Causal conv1d decode step, in place at the rows' slots.
    CONV_UPDATE = ConvUpdate("conv1d_update_bf16", conv1d::ConvUpdateParams, Threads::Fixed(conv1d::CONV_BLOCK), Smem::Fixed(0)),
    /// Causal conv1d prefill outputs (varlen).
    CONV_FWD = ConvFwd("conv1d_fwd_bf16", conv1d::ConvFwdParams, Threads::Fixed(conv1d::CONV_BLOCK), Smem::Fixed(0)),
    /// Causal conv1d prefill outputs, 4 channels by a run of tokens
    /// a thread (many tokens).
    CONV_FWD_TILED = ConvFwdTiled("conv1d_fwd_tiled_bf16", conv1d::ConvFwdParams, Threads::Fixed(conv1d::CONV_BLOCK), Smem::Fixed(0)),
    /// Causal conv1d prefill final states.
    CONV_FWD_STATE = ConvFwdState("conv1d_fwd_state_bf16", conv1d::ConvFwdParams, Threads::Fixed(conv1d::CONV_BLOCK), Smem::Fixed(0)),
    /// Selective state update, f32 state.
    SSM_UPDATE_F32 = SsmUpdateF32("ssm_update_f32", ssm::SsmUpdateParams<f32>, Threads::Fixed(32 * ssm::SSM_WARPS), Smem::Fixed(ssm::ssm_smem_bytes(4))),
    /// Selective state update, bf16 state.
    SSM_UPDATE_BF16 = SsmUpdateBf16("ssm_update_bf16", ssm::SsmUpdateParams<u16>, Threads::Fixed(32 * ssm::SSM_WARPS), Smem::Fixed(ssm::ssm_smem_bytes(2))),
    /// Chunk cumsum and per-chunk states of the chunked scan.
    SSD_CHUNK_STATE = SsdChunkState("ssd_chunk_state_f32", ssd::SsdParams, Threads::Fixed(ssd::SSD_STATE_BLOCK), Smem::PerLaunch),
    /// State passing, f32 state cache.
    SSD_STATE_PASS_F32 = SsdStatePassF32("ssd_state_pass_f32", ssd::SsdPassParams<f32>, Threads::Fixed(ssd::SSD_PASS_BLOCK), Smem::Fixed(0)),
    /// State passing, bf16 state cache.
    SSD_STATE_PASS_BF16 = SsdStatePassBf16("ssd_state_pass_bf16", ssd::SsdPassParams<u16>, Threads::Fixed(ssd::SSD_PASS_BLOCK), Smem::Fixed(0)),
    /// Chunk scan outputs.
    SSD_SCAN = SsdScan("ssd_scan_bf16", ssd::SsdParams, Threads::Fixed(ssd::SSD_SCAN_BLOCK), Smem::PerLaunch),
    /// A matrix product on tensor cores (the test of the `mma` module).
    TC_MATMUL = TcMatmul("tc_matmul_bf16", mma::MatmulParams, Threads::Fixed(mma::MATMUL_BLOCK), Smem::Fixed(mma::matmul_smem_bytes())),
    /// Relu^2 in place.
    ACT_RELU2 = ActRelu2("act_relu2_bf16", act::Relu2Params, Threads::Fixed(EW_BLOCK), Smem::Fixed(0)),
    /// Rows gathered by index.
    ACT_GATHER = ActGather("act_gather_bf16", act::GatherParams, Threads::Fixed(EW_BLOCK), Smem::Fixed(0)),
    /// New keys and values into the cache.
    ATTN_CACHE_WRITE = AttnCacheWrite("attn_cache_write_bf16", attn::AttnParams, Threads::Fixed(attn::ATTN_BLOCK), Smem::Fixed(0)),
    /// Causal attention over the cache (a part of each row's keys a
    /// block where they are split).
    ATTN = Attn("attn_bf16", attn::AttnParams, Threads::Fixed(attn::ATTN_BLOCK), Smem::PerLaunch),
    /// The parts of a split `Attn` merged into the output.
    ATTN_COMBINE = AttnCombine("attn_combine_bf16", attn::AttnParams, Threads::Fixed(attn::ATTN_BLOCK), Smem::Fixed(0)),
    /// Causal attention of many rows over the cache, on tensor cores.
    ATTN_FLASH = AttnFlash("attn_flash_bf16", flash::FlashParams, Threads::Fixed(flash::FLASH_BLOCK), Smem::Fixed(flash::flash_smem_bytes(flash::FLASH_KEYS))),
    /// As `AttnFlash`, heads of 113 to 128 channels.
    ATTN_FLASH_D128 = AttnFlashD128("attn_flash_d128_bf16", flash::FlashParams, Threads::Fixed(flash::FLASH_BLOCK), Smem::Fixed(flash::flash_smem_bytes(flash::FLASH_KEYS))),
    /// As `AttnFlash`, 32 keys at a time: within an sm_12x block's shared memory.
    ATTN_FLASH_K32 = AttnFlashK32("attn_flash_k32_bf16", flash::FlashParams, Threads::Fixed(flash::FLASH_BLOCK), Smem::Fixed(flash::flash_smem_bytes(flash::FLASH_KEYS_SMALL))),
    /// As `AttnFlashD128`, 32 keys at a time.
    ATTN_FLASH_K32_D128 = AttnFlashK32D128("attn_flash_k32_d128_bf16", flash::FlashParams, Threads::Fixed(flash::FLASH_BLOCK), Smem::Fixed(flash::flash_smem_bytes(flash::FLASH_KEYS_SMALL))),
    /// As `AttnFlashD128` on `wgmma` (sm_90a PTX only), 128 keys at a time,
    /// q and the caches 16-byte aligned.
    ATTN_FLASH_WGMMA = AttnFlashWgmma("attn_flash_wgmma_d128_bf16", flash::FlashParams, Threads::Fixed(flash::FLASH_WGMMA_BLOCK), Smem::Fixed(flash::flash_wgmma_smem_bytes())),
    /// A bf16 linear layer at few rows, a warp per weight row pair, its
    /// first weights loading before it waits on the kernel before.
    GEMV = Gemv("gemv_bf16", gemv::DenseParams, Threads::Fixed(gemv::WARP_BLOCK), Smem::Fixed(0)),
    /// As `Gemv`, e4m3 weights (W8A8).
    GEMV_FP8 = GemvFp8("gemv_fp8", gemv::DenseParams, Threads::Fixed(gemv::WARP_BLOCK), Smem::Fixed(0)),
    /// An FP8 linear layer of a few rows (W8A8) on tensor cores
    /// ([`qgemv`]).
    GEMV_TC_FP8 = GemvTcFp8("gemv_tc_fp8", gemv::DenseParams, Threads::Fixed(qgemv::QG_BLOCK), Smem::Fixed(0)),
    /// An NVFP4 linear layer of a few rows (weight-only) on tensor
    /// cores ([`qgemv`]).
    GEMV_TC_NVFP4 = GemvTcNvfp4("gemv_tc_nvfp4", gemv::DenseParams, Threads::Fixed(qgemv::QG_BLOCK), Smem::Fixed(0)),
    /// As `Gemv`, NVFP4 weights (weight-only), its first weights
    /// loading before it waits.
    GEMV_NVFP4 = GemvNvfp4("gemv_nvfp4", gemv::DenseParams, Threads::Fixed(gemv::WARP_BLOCK), Smem::Fixed(0)),
    /// NVFP4 weights dequantized to bf16.
    NVFP4_TO_BF16 = Nvfp4ToBf16("nvfp4_to_bf16", nvfp4::ToBf16Params, Threads::Fixed(EW_BLOCK), Smem::Fixed(0)),
    /// Rows of bf16 activations to NVFP4 with a static input scale (W4A4).
    NVFP4_QUANTIZE = Nvfp4Quantize("nvfp4_quantize_bf16", w4a4::QuantizeParams, Threads::Fixed(EW_BLOCK), Smem::Fixed(0)),
    /// A bf16 linear layer, each weight row split along k over a block.
    GEMV_SPLIT = GemvSplit("gemv_split_bf16", gemv::SplitParams, Threads::Fixed(gemv::SPLIT_BLOCK), Smem::Fixed(0)),
    /// Router logits in f32, then sigmoid, bias, group-limited top-k,
    /// weights.
    MOE_ROUTE = MoeRoute("moe_route_bf16", router::RouteParams, Threads::Fixed(router::LOGITS_BLOCK), Smem::Fixed(router::ROUTE_SMEM_BYTES)),
    /// As `MoeRoute`, one token fused with its appended pieces' up projections.
    MOE_ROUTE_UP = MoeRouteUp("moe_route_up_bf16", router::RouteParams, Threads::Fixed(router::LOGITS_BLOCK), Smem::Fixed(router::ROUTE_SMEM_BYTES)),
    /// The selection alone, from logits already written (cuBLASLt's, for many tokens).
    MOE_SELECT = MoeSelect("moe_select_bf16", router::RouteParams, Threads::Fixed(router::LOGITS_BLOCK), Smem::Fixed(router::ROUTE_SMEM_BYTES)),
    /// Routing choices grouped by expert.
    MOE_DISPATCH = MoeDispatch("moe_dispatch", moe::DispatchParams, Threads::Fixed(moe::DISPATCH_BLOCK), Smem::Fixed(moe::DISPATCH_SMEM_BYTES)),
    /// One projection of every expert with rows (small batches).
    MOE_EXPERT = MoeExpert("moe_expert_bf16", moe::ExpertParams, Threads::Fixed(gemv::WARP_BLOCK), Smem::Fixed(0)),
    /// As `MoeExpert`, e4m3 weights (W8A8).
    MOE_EXPERT_FP8 = MoeExpertFp8("moe_expert_fp8", moe::ExpertParams, Threads::Fixed(gemv::WARP_BLOCK), Smem::Fixed(0)),
    /// As `MoeExpert`, NVFP4 weights (weight-only).
    MOE_EXPERT_NVFP4 = MoeExpertNvfp4("moe_expert_nvfp4", moe::ExpertParams, Threads::Fixed(gemv::WARP_BLOCK), Smem::Fixed(0)),
    /// As `MoeExpertFp8`, on tensor cores ([`qgemv`]).
    MOE_EXPERT_TC_FP8 = MoeExpertTcFp8("moe_expert_tc_fp8", moe::ExpertParams, Threads::Fixed(qgemv::QG_BLOCK), Smem::Fixed(0)),
    /// As `MoeExpertNvfp4`, on tensor cores ([`qgemv`]).
    MOE_EXPERT_TC_NVFP4 = MoeExpertTcNvfp4("moe_expert_tc_nvfp4", moe::ExpertParams, Threads::Fixed(qgemv::QG_BLOCK), Smem::Fixed(0)),
    /// One projection per routing choice, no dispatch (small batches).
    MOE_EXPERT_CHOICES = MoeExpertChoices("moe_expert_choices_bf16", moe::ExpertParams, Threads::Fixed(gemv::WARP_BLOCK), Smem::Fixed(0)),
    /// As `MoeExpertChoices`, e4m3 weights (W8A8).
    MOE_EXPERT_CHOICES_FP8 = MoeExpertChoicesFp8("moe_expert_choices_fp8", moe::ExpertParams, Threads::Fixed(gemv::WARP_BLOCK), Smem::Fixed(0)),
    /// As `MoeExpertChoices`, NVFP4 weights (weight-only).
    MOE_EXPERT_CHOICES_NVFP4 = MoeExpertChoicesNvfp4("moe_expert_choices_nvfp4", moe::ExpertParams, Threads::Fixed(gemv::WARP_BLOCK), Smem::Fixed(0)),
    /// Each token's chosen down projections, combined.
    MOE_EXPERT_COMBINE = MoeExpertCombine("moe_expert_combine_bf16", moe::ExpertCombineParams, Threads::UpTo(32 * moe::MAX_TOP_K), Smem::Fixed(0)),
    /// As `MoeExpertCombine`, e4m3 weights (W8A8).
    MOE_EXPERT_COMBINE_FP8 = MoeExpertCombineFp8("moe_expert_combine_fp8", moe::ExpertCombineParams, Threads::UpTo(32 * moe::MAX_TOP_K), Smem::Fixed(0)),
    /// As `MoeExpertCombine`, NVFP4 weights (weight-only).
    MOE_EXPERT_COMBINE_NVFP4 = MoeExpertCombineNvfp4("moe_expert_combine_nvfp4", moe::ExpertCombineParams, Threads::UpTo(32 * moe::MAX_TOP_K), Smem::Fixed(0)),
    /// One projection of every expert with rows, on tensor cores.
    MOE_GROUPED = MoeGrouped("moe_grouped_bf16", grouped::GroupedParams, Threads::Fixed(grouped::GROUPED_BLOCK), Smem::Fixed(grouped::NARROW_SMEM_BYTES)),
    /// As `MoeGrouped`, tiles of 128 rows (experts of many rows).
    MOE_GROUPED_WIDE = MoeGroupedWide("moe_grouped_m128_bf16", grouped::GroupedParams, Threads::Fixed(grouped::GROUPED_BLOCK), Smem::Fixed(grouped::WIDE_SMEM_BYTES)),
    /// As `MoeGrouped`, FP8 e4m3 codes (W8A8).
    MOE_GROUPED_FP8 = MoeGroupedFp8("moe_grouped_fp8", grouped::GroupedFp8Params, Threads::Fixed(grouped::GROUPED_BLOCK), Smem::Fixed(grouped::NARROW_SMEM_BYTES)),
    /// As `MoeGrouped`, 128 x 256 tiles on `wgmma` (sm_90a PTX
    /// only).
    MOE_GROUPED_WGMMA = MoeGroupedWgmma("moe_grouped_wgmma_bf16", grouped::GroupedParams, Threads::Fixed(grouped::GROUPED_BLOCK), Smem::Fixed(grouped::wgmma_smem_bytes())),
    /// As `MoeGrouped`, NVFP4 weights made bf16 in shared memory (weight-only).
    MOE_GROUPED_NVFP4 = MoeGroupedNvfp4("moe_grouped_nvfp4", grouped::GroupedNvfp4Params, Threads::Fixed(grouped::GROUPED_BLOCK), Smem::Fixed(grouped::NVFP4_SMEM_BYTES)),
    /// As `MoeGroupedFp8`, 128 x 192 tiles on `wgmma`, warp-specialized (sm_90a PTX only).
    MOE_GROUPED_WGMMA_FP8 = MoeGroupedWgmmaFp8("moe_grouped_wgmma_fp8", grouped::Tma<grouped::GroupedFp8Params>, Threads::Fixed(grouped::WGMMA_WS_BLOCK), Smem::Fixed(grouped::wgmma_ws_smem_bytes())),
    /// As `MoeGroupedWgmma`, NVFP4 weights made bf16 in shared memory (weight-only; sm_90a
    /// PTX only).
    MOE_GROUPED_WGMMA_NVFP4 = MoeGroupedWgmmaNvfp4("moe_grouped_wgmma_nvfp4", grouped::GroupedNvfp4Params, Threads::Fixed(grouped::GROUPED_BLOCK), Smem::Fixed(grouped::wgmma_nvfp4_smem_bytes())),
    /// A bf16 linear layer of many rows on tensor cores.
    GEMM_BF16 = GemmBf16("gemm_bf16", grouped::GemmParams, Threads::Fixed(grouped::GROUPED_BLOCK), Smem::Fixed(grouped::NARROW_SMEM_BYTES)),
    /// As `GemmBf16`, tiles of 128 rows.
    GEMM_WIDE_BF16 = GemmWideBf16("gemm_m128_bf16", grouped::GemmParams, Threads::Fixed(grouped::GROUPED_BLOCK), Smem::Fixed(grouped::WIDE_SMEM_BYTES)),
    /// As `GemmBf16`, 128 x 256 tiles on `wgmma` (sm_90a PTX only).
    GEMM_WGMMA = GemmWgmma("gemm_wgmma_bf16", grouped::GemmParams, Threads::Fixed(grouped::GROUPED_BLOCK), Smem::Fixed(grouped::wgmma_smem_bytes())),
    /// As `GemmFp8`, 128 x 192 tiles on `wgmma`, warp-specialized (sm_90a PTX only).
    GEMM_WGMMA_FP8 = GemmWgmmaFp8("gemm_wgmma_fp8", grouped::Tma<grouped::GemmFp8Params>, Threads::Fixed(grouped::WGMMA_WS_BLOCK), Smem::Fixed(grouped::wgmma_ws_smem_bytes())),
    /// An FP8 linear layer of many rows on tensor cores (W8A8).
    GEMM_FP8 = GemmFp8("gemm_fp8", grouped::GemmFp8Params, Threads::Fixed(grouped::GROUPED_BLOCK), Smem::Fixed(grouped::NARROW_SMEM_BYTES)),
    /// An NVFP4 linear layer of NVFP4 activations (W4A4) on block-scaled FP4 tensor cores
    /// (sm_121a PTX only).
    GEMM_NVFP4_W4A4 = GemmNvfp4W4a4("gemm_nvfp4_w4a4", w4a4::GemmParams, Threads::Fixed(w4a4::GEMM_BLOCK), Smem::Fixed(0)),
    /// As `GemmNvfp4W4a4` on the fifth-generation tensor cores (`tcgen05`: sm_110a's PTX only),
    /// 128 x 128 tiles.
    GEMM_NVFP4_W4A4_TCGEN05 = GemmNvfp4W4a4Tcgen05("gemm_nvfp4_w4a4_tcgen05", w4a4::GemmParams, Threads::Fixed(tcgen05::TC_BLOCK), Smem::Fixed(tcgen05::tc_smem_bytes())),
    /// As `GemmNvfp4W4a4`, the product emulated by the warp through shared memory (every arch:
    /// the GPU test of its data path).
    GEMM_NVFP4_W4A4_EMULATED = GemmNvfp4W4a4Emulated("gemm_nvfp4_w4a4_emulated", w4a4::GemmParams, Threads::Fixed(w4a4::GEMM_BLOCK), Smem::Fixed(0)),
    /// Weighted sum of a token's expert outputs and the shared one.
    MOE_COMBINE = MoeCombine("moe_combine_bf16", moe::CombineParams, Threads::Fixed(EW_BLOCK), Smem::Fixed(0)),
    /// A Mamba2 mixer's decode rows between its projections
    /// (conv update, state update, gated norm), in clusters of a group's heads.
    MAMBA_DECODE = MambaDecode("mamba_decode_bf16", mamba::MambaDecodeParams, Threads::Fixed(mamba::MAMBA_BLOCK), Smem::Fixed(0)),
    /// Each row's next token from its logits (greedy, or
    /// temperature with top-k, top-p, min-p and penalties), in clusters of blocks.
    SAMPLE = Sample("sample_bf16", sample::SampleParams, Threads::Fixed(sample::SAMPLE_BLOCK), Smem::PerLaunch),
}

impl Kernel {
    /// Whether the entry is in the PTX built for `arch` (`-C target-cpu`): the `wgmma`
    /// kernels exist in the sm_90a PTX only, the block-scaled FP4 one in sm_121a's and the
    /// `tcgen05` one in sm_110a's (arch-specific instructions), every other kernel in every
    /// arch's.
    pub const fn in_arch(self, arch: &str) -> bool {
        if self.needs_wgmma() {
            matches!(arch.as_bytes(), b"sm_90a")
        } else if self.needs_block_scaled_fp4() {
            block_scaled_fp4(arch)
        } else if self.needs_tcgen05() {
            has_tcgen05(arch)
        } else {
            true
        }
    }

    /// Whether the kernel runs on the fifth-generation tensor cores (`tcgen05`, the sm_100a
    /// family).
    pub const fn needs_tcgen05(self) -> bool {
        matches!(self, Kernel::GemmNvfp4W4a4Tcgen05)
    }

    /// Whether the kernel runs on the block-scaled FP4 `mma.sync` (the sm_120a family).
    pub const fn needs_block_scaled_fp4(self) -> bool {
        matches!(self, Kernel::GemmNvfp4W4a4)
    }

    /// Whether the kernel runs on `wgmma` (warpgroup matrix products, sm_90a only).
    pub const fn needs_wgmma(self) -> bool {
        matches!(
            self,
            Kernel::MoeGroupedWgmma
                | Kernel::MoeGroupedWgmmaFp8
                | Kernel::MoeGroupedWgmmaNvfp4
                | Kernel::GemmWgmma
                | Kernel::GemmWgmmaFp8
                | Kernel::AttnFlashWgmma
        )
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
                | Kernel::MoeRouteUp
                | Kernel::MoeExpertCombine
                | Kernel::MoeExpertCombineFp8
                | Kernel::MoeExpertCombineNvfp4
                | Kernel::MambaDecode
                | Kernel::NormRms
                | Kernel::NormGated
        )
    }
}

/// Whether `arch` (`-C target-cpu`) has the block-scaled FP4 `mma.sync` (`kind::mxf4nvf4`):
/// of the arches built, sm_121a. Its PTX build compiles those kernels (`--cfg
/// block_scaled_fp4`, host's ptx_build.rs).
pub const fn block_scaled_fp4(arch: &str) -> bool {
    matches!(arch.as_bytes(), b"sm_121a")
}

/// Whether `arch` (`-C target-cpu`) has the fifth-generation tensor cores (`tcgen05`): of the
/// arches built, sm_110a. Its PTX build compiles those kernels (`--cfg tcgen05`, host's
/// ptx_build.rs).
pub const fn has_tcgen05(arch: &str) -> bool {
    matches!(arch.as_bytes(), b"sm_110a")
}
