//! Matrix-vector products: linear layers at few rows (`out = f(x W^T)`, bandwidth-bound: each
//! weight row streamed once for all the rows), and the row-dot code that MoE's expert kernels
//! (kernels-gpu/src/moe.rs) run with an expert per row. Two modes: a warp per pair of weight
//! rows ([`DenseParams`]: `gemv_bf16`, `gemv_fp8`), and each weight row split along k over a
//! block ([`SplitParams`]: `gemv_split_bf16`, for a row of a long k).

use crate::KernelParams;

/// What a launch of the warp mode multiplies: rows `j` of out get `f(x[row(j)] W^T)`, `W` one
/// of `[matrices, n, k]` weights, `f` the identity or `relu(bf16(.))^2`; which rows and which
/// matrix the kernel's other params say ([`DenseParams`]: one matrix, row j of x; an expert
/// kernel's `moe::ExpertParams`: an expert per row). FP8 weights (W8A8, docs/MATH.md section 7):
/// `W_e = codes * w_scale[e]`, and each input row is quantized to e4m3 first, with
/// `in_scale[e]` or, when `in_scale` is null, its own per-token scale (docs/MATH.md section 4);
/// the product of the codes is summed in f32 and scaled by both scales. NVFP4 weights
/// (weight-only, [`crate::nvfp4`]): `W_e = e2m1 * block scale * w_scale[e]`, each chunk's
/// products with the bf16 inputs summed in f32, scaled by its block scale and added, the sum
/// scaled by `w_scale[e]`.
///
/// The order of the fields moves registers: with `relu2` before `n` ptxas 13.5 gave `gemv_bf16`
/// 96 registers on sm_90, 80 with this order.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct Operands {
    /// Input rows of `k` bf16.
    pub x: *const u16,
    /// `[matrices, n, k]` weights: bf16, e4m3 codes for the FP8 kernels, NVFP4 rows
    /// ([`crate::nvfp4`]) for the NVFP4 ones.
    pub w: *const u8,
    /// FP8, NVFP4: `[matrices]` weight scales (unused by the bf16 kernels).
    pub w_scale: *const f32,
    /// FP8: `[matrices]` static input scales, or null for per-token scales.
    pub in_scale: *const f32,
    /// Output rows of `n` bf16, written.
    pub out: *mut u16,
    pub n: u32,
    pub k: u32,
    /// 1: `relu(bf16(.))^2`.
    pub relu2: u32,
}

/// A linear layer in the warp mode: [`Operands`] of one matrix, `out[j] = f(x[j] W^T)` for
/// rows `0..rows`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct DenseParams {
    pub o: Operands,
    pub rows: u32,
}

/// A bf16 linear layer in the split mode: `out[j] = x[j] W^T`, a block row per row j.
/// (`k` before `n`: with `n` first ptxas 13.5 gave `gemv_split_bf16` 95 registers on sm_90, 78
/// this way, as many as before the kernel moved here.)
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct SplitParams {
    /// `[rows, k]` bf16.
    pub x: *const u16,
    /// `[n, k]` bf16 weights (as bytes, as [`Operands::w`]).
    pub w: *const u8,
    /// `[rows, n]` bf16, written.
    pub out: *mut u16,
    pub k: u32,
    pub n: u32,
}

// SAFETY: #[repr(C)], Copy, only pointers, integers and floats (and Operands, likewise).
unsafe impl KernelParams for DenseParams {}
// SAFETY: as above.
unsafe impl KernelParams for SplitParams {}

/// Threads per block of the warp mode (the gemv kernels' and MoE's expert kernels).
pub const WARP_BLOCK: u32 = 128;
/// Weight rows each warp of the warp mode computes together.
pub const WARP_ROWS: u32 = 2;
/// Chunks of each row a lane of the warp mode loads at once (loads in flight). 6 and 8 took
/// more registers and made the batch-1 step slower (docs/PERFORMANCE.md, MoE).
pub const WARP_UNROLL: usize = 4;
/// Weight rows per block of the warp mode.
pub const WARP_BLOCK_ROWS: u32 = WARP_ROWS * WARP_BLOCK / 32;
/// Rows of out the warp mode multiplies with one pass over its weight rows.
pub const WARP_TOKENS: usize = 1;
/// Threads per block of the split mode (together over each weight row).
pub const SPLIT_BLOCK: u32 = 128;
/// Weight rows per block of the split mode.
pub const SPLIT_ROWS: u32 = 4;
/// Chunks of each weight row a thread of the split mode loads at once. 4 (128 registers on
/// sm_90) was no faster (docs/PERFORMANCE.md, linear layers).
pub const SPLIT_UNROLL: usize = 2;

#[cfg(target_arch = "nvptx64")]
pub(crate) use device::*;

#[cfg(target_arch = "nvptx64")]
mod device;
