//! Grouped GEMM on tensor cores: one projection of every MoE expert with rows, in one launch
//! (docs/MATH.md's expert MLP), and the same product for one matrix (a linear layer of many
//! rows: [`GemmParams`], `gemm_bf16` and `gemm_m128_bf16`; `gemm_fp8`). A dispatch
//! (`moe_dispatch`) has grouped the routing choices by expert: expert e's rows are
//! `offsets[e] .. offsets[e + 1]` of the grouped order. Grouped row j of expert e gets
//! `out[j] = f(a_j W_eᵀ)` with `W [experts, n, k]` (each expert's weight row-major, a row per
//! output), and `f` either the identity or `relu(bf16(.))^2`, rounded to bf16.
//!
//! # Operands
//! - bf16 ([`GroupedParams`]: `moe_grouped_bf16`, `moe_grouped_m128_bf16`): `a_j` row
//!   `token[j]` of `a` (gathered: the layer input) or row j (the grouped hidden rows);
//!   `mma.sync` m16n8k16, f32 sums.
//! - FP8 W8A8 ([`GroupedFp8Params`]: `moe_grouped_fp8`; for one matrix [`GemmFp8Params`]:
//!   `gemm_fp8`), the narrow tiles only: `a` the e4m3 codes of the rows with a scale `s_j` each
//!   (`quant_rows_fp8_bf16` writes both), W e4m3 codes with a scale `ws_e` per matrix;
//!   `out[j] = f((q_j · Q_eᵀ) (ws_e s_j))`, the codes' products on `mma.sync` m16n8k32 (e4m3
//!   products are exact in f32; the sums f32); optionally the results written as the next
//!   projection's e4m3 input with its static scales (`codes`). On sm_90 ptxas runs that
//!   instruction as two f16 `HMMA`s after unpacking the codes (the bf16 rate, more registers:
//!   the wide tiles spill, so FP8 has none); sm_120 and later have it natively.
//! - NVFP4 weights, weight-only ([`GroupedNvfp4Params`]: `moe_grouped_wgmma_nvfp4` on sm_90a,
//!   `moe_grouped_nvfp4` on `mma.sync` with the 64-row tiles and 64 weights a stage): `a`
//!   bf16 as above, W each expert's rows in [`crate::nvfp4`]'s layout (e2m1 codes, e4m3 block
//!   scales) with a per-tensor scale `g_e`; `out[j] = f((a_j · B_eᵀ) 2^9 g_e)`, `B_e` each code
//!   times its block scale times 2^-9 as bf16 (exact: at most 6 significant bits, the form of
//!   `crate::qgemv`'s tensor-core mat-vec), made in shared memory from the staged codes
//!   (the weights are read as codes, never as bf16 from global memory).
//!
//! # Work split
//! The grid is `(m tiles, n tiles)`: each expert's rows in tiles of m = [`GROUPED_M`] rows
//! (staging [`GROUPED_K_BYTES`] of each row at a time) or [`GROUPED_M_WIDE`]
//! (`moe_grouped_m128_bf16`, staging [`GROUPED_K_BYTES_WIDE`], for experts of many rows) (as many tiles as its
//! rows need; the grid has room for the most any dispatch of this many rows and experts can
//! need, and the blocks past the dispatch's tiles return at once), outputs in tiles of
//! [`GROUPED_N`]. A block finds its expert and first row from the offsets (a warp's prefix sum
//! of the experts' tile counts; one matrix: block x's rows), then runs `k` through a ring of
//! [`GROUPED_STAGES`] shared-memory stages loaded by `cp.async` (zero past the rows and the
//! columns); warp w computes rows `(m / 2) (w / 4)` and columns `32 (w % 4)` of the block's
//! tile, 32 bytes of k per `mma` step (16 bf16 or 32 e4m3). Blocks next to each other along x
//! share an expert's weight tile in L2.

use crate::KernelParams;
use crate::mma::tile_bytes;

/// Threads of a block: eight warps, 2 x 4 over the output tile.
pub const GROUPED_BLOCK: u32 = 256;
/// Rows of an output tile of the narrow kernels (k staged [`GROUPED_K_BYTES`] at a time).
pub const GROUPED_M: u32 = 64;
/// Rows of an output tile of `moe_grouped_m128_bf16` (k staged [`GROUPED_K_BYTES_WIDE`] at a
/// time): for experts of many rows, each input and weight tile read half as often per product.
pub const GROUPED_M_WIDE: u32 = 128;
/// Columns of an output tile.
pub const GROUPED_N: u32 = 128;
/// Bytes of each row's k staged at a time by the narrow kernels (32 bf16, 64 e4m3).
pub const GROUPED_K_BYTES: u32 = 64;
/// Bytes of each row's k staged at a time by `moe_grouped_m128_bf16` (64 bf16).
pub const GROUPED_K_BYTES_WIDE: u32 = 128;
/// Stages of the shared-memory ring.
pub const GROUPED_STAGES: u32 = 3;

/// Rows of an output tile of the `wgmma` kernels (two warpgroups of 64).
pub const WGMMA_M: u32 = 128;
/// Columns of an output tile of the `wgmma` kernels.
pub const WGMMA_N: u32 = 256;
/// Stages of the `wgmma` kernels' ring, each [`crate::wgmma::STAGE_ROW_BYTES`] of every row
/// of the A and B tiles.
pub const WGMMA_STAGES: u32 = 4;

/// Columns of an output tile of the FP8 `wgmma` kernels: two halves of 96, so that a
/// warpgroup adds one half's fresh sums while the other half's products run
/// ([`crate::wgmma::mma_stage_fp8`]).
pub const WGMMA_FP8_N: u32 = 192;
/// Stages of the FP8 `wgmma` kernels' ring (their narrower B tiles leave room for a fifth).
pub const WGMMA_FP8_STAGES: u32 = 5;

/// Dynamic shared memory of the `wgmma` kernels: room to align the stages to 1024 bytes, the
/// stages' A (`WGMMA_M` rows) and B (`WGMMA_N` rows) tiles of 128-byte rows, the block's
/// expert and first row.
pub const fn wgmma_smem_bytes() -> u32 {
    1024 + WGMMA_STAGES * (WGMMA_M + WGMMA_N) * crate::wgmma::STAGE_ROW_BYTES + 8
}

/// Rows of A a tensor-memory-accelerator box of the FP8 `wgmma` kernels copies (128 bytes of
/// each): a tile's stage copies as many as its rows need.
pub const TMA_A_BOX_ROWS: u32 = 16;
/// Weight rows a box of the FP8 `wgmma` kernels copies (128 bytes of each): a tile's
/// [`WGMMA_FP8_N`].
pub const TMA_W_BOX_ROWS: u32 = WGMMA_FP8_N;

/// The tensor maps of one FP8 `wgmma` launch (`cuTensorMapEncodeTiled`'s 128-byte opaque
/// values): `a` the rows `[rows, k]` (u8, boxes of 128 x [`TMA_A_BOX_ROWS`]), `w` the weights
/// `[matrices, n, k]` (boxes of 128 x [`TMA_W_BOX_ROWS`] x 1), both in the 128-byte swizzle;
/// `skew` pads the size to 272 bytes, 16 past a multiple of 64 (see [`Tma`]).
#[repr(C, align(16))]
#[derive(Clone, Copy, Debug)]
pub struct TmaMaps {
    pub a: [u64; 16],
    pub w: [u64; 16],
    pub skew: [u64; 2],
}

/// Copies of [`TmaMaps`] in a [`Tma`] parameter.
pub const TMA_MAPS_COPIES: usize = 4;

/// The parameter of the FP8 `wgmma` kernels: the maps, then the launch's params `p`. A tensor
/// map must be 64-byte aligned where the copy engine reads it, and a kernel parameter is
/// aligned to 16 bytes only (rustc's kernels take no parameter aligned past 16), so `maps`
/// holds [`TMA_MAPS_COPIES`] equal copies 272 bytes apart: whatever the parameter's address
/// modulo 64 (a multiple of 16), one copy starts at a multiple of 64 ([`tma_maps_copy`]).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct Tma<P> {
    pub maps: [TmaMaps; TMA_MAPS_COPIES],
    pub p: P,
}

/// Which of a [`Tma`]'s map copies is 64-byte aligned when the parameter starts at `at` (a
/// multiple of 16).
pub const fn tma_maps_copy(at: u64) -> usize {
    ((64 - at % 64) % 64 / 16) as usize
}

// Every 16-byte residue of the parameter's address has its aligned copy.
const _: () = {
    let size = core::mem::size_of::<TmaMaps>() as u64;
    let mut r = 0;
    while r < 64 {
        let i = tma_maps_copy(r);
        assert!(i < TMA_MAPS_COPIES && (r + size * i as u64).is_multiple_of(64));
        r += 16;
    }
};

/// Threads of a block of the warp-specialized FP8 `wgmma` kernels (`moe_grouped_wgmma_fp8`,
/// `gemm_wgmma_fp8`): two consumer warpgroups of 64 rows each and a producer warpgroup.
pub const WGMMA_WS_BLOCK: u32 = 384;

/// Dynamic shared memory of the warp-specialized FP8 `wgmma` kernels: room to align the stages
/// to 1024 bytes, [`WGMMA_FP8_STAGES`] stages of A (`WGMMA_M` rows) and B ([`WGMMA_FP8_N`] rows)
/// tiles of 128-byte rows, then two mbarriers a stage (`full`, `empty`) and the block's expert
/// and first row.
pub const fn wgmma_ws_smem_bytes() -> u32 {
    1024 + WGMMA_FP8_STAGES * ((WGMMA_M + WGMMA_FP8_N) * crate::wgmma::STAGE_ROW_BYTES + 16) + 8
}

/// Bytes of each weight row's codes and block scales a stage of `moe_grouped_wgmma_nvfp4`
/// stages: [`crate::wgmma::STAGE_ROW_BYTES`] / 2 = 64 weights, 32 bytes of codes and 4 scales.
pub const NVFP4_STAGE_ROW_BYTES: u32 = 36;

/// Where the parts of `moe_grouped_wgmma_nvfp4`'s dynamic shared memory start, from its first
/// 1024-byte aligned byte: the stages' A tiles (`WGMMA_M` rows of 128 bytes each), two bf16 B
/// tiles (`WGMMA_N` rows of 128 bytes: the stage being multiplied and the one before), the
/// stages' codes and scales (`WGMMA_N` rows of [`NVFP4_STAGE_ROW_BYTES`] each), the block's
/// expert and first row (8 bytes).
pub const fn wgmma_nvfp4_layout() -> [u32; 4] {
    let row = crate::wgmma::STAGE_ROW_BYTES;
    let b = WGMMA_STAGES * WGMMA_M * row;
    let raw = b + 2 * WGMMA_N * row;
    [0, b, raw, raw + WGMMA_STAGES * WGMMA_N * NVFP4_STAGE_ROW_BYTES]
}

/// Dynamic shared memory of `moe_grouped_wgmma_nvfp4`: room to align to 1024 bytes, then
/// [`wgmma_nvfp4_layout`]'s parts.
pub const fn wgmma_nvfp4_smem_bytes() -> u32 {
    1024 + wgmma_nvfp4_layout()[3] + 8
}

/// Bytes each thread of `moe_grouped_nvfp4` stages of a weight row a stage: 16 bytes of codes
/// (32 weights, half of the stage's 64) and the row's 4 block scales of the stage.
pub const NVFP4_THREAD_STAGE_BYTES: u32 = 20;

/// Where the parts of `moe_grouped_nvfp4`'s dynamic shared memory start: the stages' A tiles
/// ([`GROUPED_M`] rows of 64 bf16), two bf16 B tiles ([`GROUPED_N`] rows of 64), the stages'
/// codes and scales ([`NVFP4_THREAD_STAGE_BYTES`] a thread), the block's expert and first row
/// (8 bytes).
pub const fn nvfp4_layout() -> [u32; 4] {
    let b = GROUPED_STAGES * tile_bytes(GROUPED_M, 64);
    let raw = b + 2 * tile_bytes(GROUPED_N, 64);
    [0, b, raw, raw + GROUPED_STAGES * GROUPED_BLOCK * NVFP4_THREAD_STAGE_BYTES]
}

/// Dynamic shared memory of `moe_grouped_nvfp4` ([`nvfp4_layout`]'s parts): 79880 bytes, within
/// the 99 KiB a block of the sm_12x family may have.
pub const NVFP4_SMEM_BYTES: u32 = nvfp4_layout()[3] + 8;

// The NVFP4 kernels' staging: thread t of `moe_grouped_wgmma_nvfp4` owns B row t (32 bytes of
// codes and 4 scales a stage of 64 weights), thread t of `moe_grouped_nvfp4` half t % 2 of B
// row t / 2, each A row's stage is 128 bytes (8 chunks of 16).
const _: () = assert!(GROUPED_BLOCK == WGMMA_N && NVFP4_STAGE_ROW_BYTES == 64 / 2 + 64 / 16);
const _: () = assert!(GROUPED_BLOCK == 2 * GROUPED_N && GROUPED_M == 2 * (GROUPED_BLOCK / 8));

/// One grouped bf16 projection.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct GroupedParams {
    /// Rows of `k`: grouped row j's input at `a + (token[j] or j) * k`.
    pub a: *const u16,
    /// `[entries]` grouped row -> its token; null: `a` holds the grouped rows themselves.
    pub token: *const u32,
    /// `[experts, n, k]`.
    pub w: *const u16,
    /// `[experts + 1]`.
    pub offsets: *const u32,
    /// `[entries, n]`.
    pub out: *mut u16,
    pub experts: u32,
    pub n: u32,
    pub k: u32,
    /// 1: `f = relu(bf16(.))^2`; 0: the identity.
    pub relu2: u32,
}

/// One grouped FP8 projection.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct GroupedFp8Params {
    /// `[entries, k]` e4m3 codes of the grouped rows.
    pub a: *const u8,
    /// `[entries]` their scales.
    pub a_scale: *const f32,
    /// `[experts, n, k]` e4m3 codes.
    pub w: *const u8,
    /// `[experts]` the weights' scales.
    pub w_scale: *const f32,
    /// `[experts + 1]`.
    pub offsets: *const u32,
    /// `[entries, n]`; unused where `codes` is given.
    pub out: *mut u16,
    /// Null: the results go to `out`. Else they are the next projection's input: `[entries, n]`
    /// e4m3 codes `e4m3(bf16(f(.)) / next_scale[e])`, as `quant_rows_fp8_bf16` makes them from
    /// the bf16 results with static scales, and each grouped row's scale `next_scale[e]` to
    /// `codes_scale`.
    pub codes: *mut u8,
    /// `[entries]`, with `codes`.
    pub codes_scale: *mut f32,
    /// `[experts]` the next projection's static input scales, with `codes`.
    pub next_scale: *const f32,
    pub experts: u32,
    pub n: u32,
    pub k: u32,
    /// 1: `f = relu(bf16(.))^2`; 0: the identity.
    pub relu2: u32,
}

/// One grouped NVFP4 projection (weight-only), the module docs' NVFP4 operands.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct GroupedNvfp4Params {
    /// Rows of `k` bf16: grouped row j's input at `a + (token[j] or j) * k`.
    pub a: *const u16,
    /// `[entries]` grouped row -> its token; null: `a` holds the grouped rows themselves.
    pub token: *const u32,
    /// `experts * n` rows of [`crate::nvfp4::row_bytes`]`(k)` bytes.
    pub w: *const u8,
    /// `[experts]` the per-tensor scales.
    pub global: *const f32,
    /// `[experts + 1]`.
    pub offsets: *const u32,
    /// `[entries, n]`.
    pub out: *mut u16,
    pub experts: u32,
    pub n: u32,
    /// A multiple of 64 (whole stages of codes).
    pub k: u32,
    /// 1: `f = relu(bf16(.))^2`; 0: the identity.
    pub relu2: u32,
}

/// One bf16 product of `rows` rows by one matrix (a linear layer).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct GemmParams {
    /// `[rows, k]`.
    pub a: *const u16,
    /// `[n, k]`.
    pub w: *const u16,
    /// `[rows, n]`.
    pub out: *mut u16,
    pub rows: u32,
    pub n: u32,
    pub k: u32,
    /// 1: `f = relu(bf16(.))^2`; 0: the identity.
    pub relu2: u32,
}

/// One FP8 product of `rows` rows by one matrix (a linear layer).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct GemmFp8Params {
    /// `[rows, k]` e4m3 codes.
    pub a: *const u8,
    /// `[rows]` their scales.
    pub a_scale: *const f32,
    /// `[n, k]` e4m3 codes.
    pub w: *const u8,
    /// One f32, the weight's scale.
    pub w_scale: *const f32,
    /// `[rows, n]`.
    pub out: *mut u16,
    pub rows: u32,
    pub n: u32,
    pub k: u32,
    /// 1: `f = relu(bf16(.))^2`; 0: the identity.
    pub relu2: u32,
}

// SAFETY: #[repr(C)], Copy, only pointers and integers.
unsafe impl KernelParams for GroupedParams {}
// SAFETY: as above.
unsafe impl KernelParams for GroupedFp8Params {}
// SAFETY: as above.
unsafe impl KernelParams for GroupedNvfp4Params {}
// SAFETY: as above.
unsafe impl KernelParams for GemmParams {}
// SAFETY: as above.
unsafe impl KernelParams for GemmFp8Params {}
// SAFETY: #[repr(C)], Copy, integers and a KernelParams.
unsafe impl<P: KernelParams> KernelParams for Tma<P> {}

/// Dynamic shared memory of the grouped kernels of `m`-row tiles staging `k_bytes` of each row
/// at a time: the stages' A and B tiles, then the block's expert and first row.
pub const fn grouped_smem_bytes(m: u32, k_bytes: u32) -> u32 {
    GROUPED_STAGES * (tile_bytes(m, k_bytes / 2) + tile_bytes(GROUPED_N, k_bytes / 2)) + 8
}

/// [`grouped_smem_bytes`] of the 64-row tiles (the FP8 and narrow bf16 kernels).
pub const NARROW_SMEM_BYTES: u32 = grouped_smem_bytes(GROUPED_M, GROUPED_K_BYTES);

/// [`grouped_smem_bytes`] of the 128-row tiles (`moe_grouped_m128_bf16`, `gemm_m128_bf16`).
pub const WIDE_SMEM_BYTES: u32 = grouped_smem_bytes(GROUPED_M_WIDE, GROUPED_K_BYTES_WIDE);

/// Most `m`-row tiles a dispatch of `entries` rows over `experts` experts can need: every
/// expert's last tile may be partial.
pub const fn grouped_m_tiles(entries: u32, experts: u32, m: u32) -> u32 {
    entries.div_ceil(m) + if experts < entries { experts } else { entries }
}

#[cfg(target_arch = "nvptx64")]
mod kernels;
