//! MoE routing (docs/MATH.md section 6): router logits in f32 from the bf16 activations and
//! router weights, sigmoid, `+ bias` for selection only, group-limited top-k, weights from the
//! unbiased scores (renormalized, scaled); ties go to the lowest index. Two kernels:
//! - `moe_route_bf16` ([`RouteParams`], one launch): blocks of [`LOGITS_TOKENS`] tokens
//!   against an expert each write the logits, and the last block of a tile of tokens selects
//!   for them; for one token whose routing appends the shared expert's pieces, blocks past the
//!   experts' also compute the pieces' up projections (they need no routing);
//! - `moe_select_bf16`, for more tokens: the selection alone, a warp a token, from logits a
//!   GEMM wrote before (cuBLASLt's, host/src/router.rs).
//!
//! The device code is in router/kernels.rs.

use crate::KernelParams;
use crate::gemv::WARP_ROWS;
use crate::moe::MAX_EXPERTS;

/// Tokens per block of the routing kernel (the router row read once for all of them).
pub const LOGITS_TOKENS: u32 = 8;
/// Threads per block of the routing kernel: a warp per token of the block for the selection.
pub const LOGITS_BLOCK: u32 = 32 * LOGITS_TOKENS;

/// Routing of `rows` tokens in one kernel: router logits, then selection by the last block of
/// each tile of tokens.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct RouteParams {
    /// `[rows, hidden]` bf16.
    pub x: *const u16,
    /// Router `[experts, hidden]` bf16.
    pub gate: *const u16,
    /// `[rows, experts]` f32 router logits: written by every block, read by the last of a tile.
    pub logits: *mut f32,
    /// `[ceil(rows / LOGITS_TOKENS)]` arrival counters, zero on entry (and left zero).
    pub counters: *mut u32,
    /// `[experts]` f32 selection bias.
    pub bias: *const f32,
    /// `[rows, top_k + shared]` chosen experts, highest selection score first, then the
    /// appended ones.
    pub idx: *mut i32,
    /// `[rows, top_k + shared]` their weights.
    pub weight: *mut f32,
    pub rows: u32,
    pub hidden: u32,
    pub experts: u32,
    pub top_k: u32,
    pub n_group: u32,
    pub topk_group: u32,
    /// 1: divide the weights by their sum.
    pub renormalize: u32,
    pub scaling: f32,
    /// Choices appended to each token's `top_k` (rows of `idx` and `weight` hold `top_k +
    /// shared`): experts `experts..experts + shared` with weight 1, the shared expert cut into
    /// pieces of the routed experts' shape.
    pub shared: u32,
    /// One token (`rows` 1) only, else null: the up projections of the appended pieces (they
    /// need no routing), `relu(bf16(.))^2`, computed by the launch's blocks past the experts'
    /// into rows `top_k..` of `h`, as `moe_expert_choices_bf16` computes them. `up`: `[experts
    /// + shared, inter, hidden]` bf16 (the pieces' rows after the routed experts'); `h`:
    /// `[top_k + shared, inter]` bf16.
    pub up: *const u16,
    pub h: *mut u16,
    pub inter: u32,
}

// SAFETY: #[repr(C)], Copy, only pointers, integers and floats.
unsafe impl KernelParams for RouteParams {}

/// Rows of an appended piece's up projection one block of `moe_route_bf16` computes (a warp
/// per [`WARP_ROWS`]).
pub const ROUTE_UP_ROWS: u32 = LOGITS_BLOCK / 32 * WARP_ROWS;

/// Dynamic shared memory of the routing kernel: per token of a block, selection scores and
/// group scores (group-limited routing).
pub const ROUTE_SMEM_BYTES: u32 = LOGITS_TOKENS * 2 * MAX_EXPERTS * 4;

#[cfg(target_arch = "nvptx64")]
mod kernels;
