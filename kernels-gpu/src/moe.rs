//! MoE experts and combining (docs/MATH.md section 6; the routing is [`crate::router`]'s):
//! the dispatch (each token's choices grouped by expert), the experts' projections at few
//! rows (warp mode, per choice, tensor cores), and the combining: each token's expert outputs
//! (in the grouped order of the dispatch) summed with its routing weights in f32, plus the
//! shared expert's output.

use crate::KernelParams;
use crate::gemv::{Operands, WARP_ROWS};

/// Most experts the routing kernel handles.
pub const MAX_EXPERTS: u32 = 256;
/// Most experts per token.
pub const MAX_TOP_K: u32 = 16;

/// Combining of `rows` tokens.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct CombineParams {
    /// `[slots, hidden]` expert outputs in grouped order.
    pub y: *const u16,
    /// `[rows, hidden]` shared expert output, or null.
    pub shared: *const u16,
    /// `[rows, top_k]` row of `y` holding token t's k-th expert output; each below `y_rows`,
    /// else the kernel traps.
    pub slot: *const i32,
    /// `[rows, top_k]` routing weights.
    pub weight: *const f32,
    /// `[rows, hidden]` bf16, written.
    pub out: *mut u16,
    pub rows: u32,
    pub top_k: u32,
    pub hidden: u32,
    pub y_rows: u32,
}

/// Dispatch of `entries = rows * top_k` routing choices: groups them by expert.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct DispatchParams {
    /// `[entries]` chosen experts (the routing kernel's `idx`); each in `0..experts`, else the
    /// kernel traps.
    pub idx: *const i32,
    /// `[experts + 1]` start of each expert's rows in the grouped order; the last is `entries`.
    pub offsets: *mut u32,
    /// `[experts]` the experts with rows, ascending, in `active[0..active_count]`.
    pub active: *mut u32,
    /// `[1]` how many experts have rows.
    pub active_count: *mut u32,
    /// `[entries]` grouped row -> the token it holds.
    pub token: *mut u32,
    /// `[entries]` entry `t * top_k + j` -> the grouped row holding it.
    pub slot: *mut i32,
    pub entries: u32,
    pub top_k: u32,
    pub experts: u32,
}

/// One projection of every expert with rows: grouped row `j` of expert `e`
/// (`offsets[e] <= j < offsets[e + 1]`) gets `out[j] = f(x[row(j)] W_e^T)`: [`Operands`] of
/// `[experts, n, k]` weights (`out` of `[entries, n]`; `relu2` as the experts' hidden
/// activation), by the warp mode of the gemv kernels (kernels-gpu/src/gemv.rs) with an expert
/// per row.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct ExpertParams {
    pub o: Operands,
    /// `[entries]` grouped row -> row of `x`; null: row `j` of `x` itself.
    pub x_row: *const u32,
    /// The dispatch's offsets, active list and count (null for the per-choice kernels,
    /// [`moe_expert_choices_bf16`] and `_fp8`).
    pub offsets: *const u32,
    pub active: *const u32,
    pub active_count: *const u32,
    /// Experts `piece0..piece0 + pieces` are the column blocks of one `[n, pieces * k]`
    /// matrix stored where expert `piece0` would start (a shared expert's down projection cut
    /// into pieces): row r of piece j at `(piece0 * n + r * pieces) * k + j * k`. 0: none.
    pub piece0: u32,
    pub pieces: u32,
    /// Per choice (the per-choice kernels only; offsets, active, active_count and x_row
    /// null): `[entries]` the expert of each choice, tokens' choices in order, `per` per token;
    /// choice a (expert `idx[a]`, below `experts`, else the kernel traps) takes row `a / per`
    /// of x into row a of out.
    pub idx: *const i32,
    pub per: u32,
    pub experts: u32,
}

/// The down projection of each of `rows` tokens' `per` choices, combined: `out[t] =
/// shared[t] + sum_j weight[t, j] * bf16(x[t * per + j] W_{idx[t, j]}^T)` (the order of j;
/// pieces as in [`ExpertParams`]; with e4m3 weights the product is W8A8's, as in
/// [`Operands`]).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct ExpertCombineParams {
    /// `[rows * per, k]` bf16 hidden rows, in choice order.
    pub x: *const u16,
    /// `[experts, n, k]` bf16 weights, e4m3 codes for the FP8 kernel, NVFP4 rows
    /// ([`crate::nvfp4`]) for the NVFP4 one.
    pub w: *const u8,
    /// FP8, NVFP4: `[experts]` weight scales (unused by the bf16 kernel).
    pub w_scale: *const f32,
    /// FP8: `[experts]` static input scales, or null for per-token scales.
    pub in_scale: *const f32,
    /// `[rows, per]` chosen experts; each below `experts`, else the kernel traps.
    pub idx: *const i32,
    /// `[rows, per]` their weights.
    pub weight: *const f32,
    /// `[rows, n]` bf16 shared expert output, or null.
    pub shared: *const u16,
    /// `[rows, n]` bf16, written.
    pub out: *mut u16,
    pub n: u32,
    pub k: u32,
    pub per: u32,
    pub experts: u32,
    pub piece0: u32,
    pub pieces: u32,
}

// SAFETY: #[repr(C)], Copy, only pointers, integers and floats.
unsafe impl KernelParams for CombineParams {}
// SAFETY: as above.
unsafe impl KernelParams for DispatchParams {}
// SAFETY: as above (and Operands, likewise).
unsafe impl KernelParams for ExpertParams {}
// SAFETY: as above.
unsafe impl KernelParams for ExpertCombineParams {}

/// Threads of the dispatch kernel (one block).
pub const DISPATCH_BLOCK: u32 = 1024;
/// Dynamic shared memory of the dispatch kernel: a count and a cursor per expert.
pub const DISPATCH_SMEM_BYTES: u32 = 2 * MAX_EXPERTS * 4;
/// Output rows per block of the expert-combine kernel (each warp streams them for its choice).
pub const COMBINE_ROWS: u32 = WARP_ROWS;

#[cfg(target_arch = "nvptx64")]
mod kernels;
#[cfg(target_arch = "nvptx64")]
pub(crate) use kernels::weight_rows;
