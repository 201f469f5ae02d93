//! Launchers of the MoE router (kernels-gpu/src/router.rs's routing and selection kernels,
//! cuBLASLt's logits for many tokens; reference: cpu/moe.rs's `route`): each token's top-k
//! experts and weights, and the shared expert's pieces appended to them.

use cudarc::driver::{CudaSlice, DevicePtr};
use half::bf16;
use kernels_gpu::entry;
use kernels_gpu::moe::MAX_TOP_K;
use kernels_gpu::router::{LOGITS_TOKENS, ROUTE_UP_ROWS, RouteParams};

use crate::args::Len;
use crate::check::{MAX_ELEMS, MAX_ROWS};
use crate::error::Result;
use crate::gpu::{Gpu, Grid};

/// Routing settings (docs/MATH.md section 6).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RouteShape {
    pub experts: usize,
    pub top_k: usize,
    pub n_group: usize,
    pub topk_group: usize,
    pub renormalize: bool,
    pub scaling: f32,
    /// Choices appended to each token's top-k: experts `experts..experts + shared`, weight 1
    /// (the shared expert as pieces of the routed experts' shape; 0: none).
    pub shared: usize,
}

impl RouteShape {
    /// Choices per token: the top-k and the appended ones.
    pub fn choices(&self) -> usize {
        self.top_k + self.shared
    }
}

/// A MoE layer's router: `gate [experts, hidden]` and the selection bias `[experts]`.
#[derive(Clone, Copy)]
pub struct Router<'a> {
    pub gate: &'a CudaSlice<bf16>,
    pub bias: &'a CudaSlice<f32>,
}

/// Where a routing goes: `idx` and `weight` `[rows, choices]`.
pub struct Routed<'a> {
    pub idx: &'a mut CudaSlice<i32>,
    pub weight: &'a mut CudaSlice<f32>,
}

/// The shared expert's pieces' up projections that a one-token routing computes beside it
/// ([`route_appended_up`]): from `up [experts + shared, inter, hidden]` into `h [choices,
/// inter]`.
pub struct AppendedUp<'a> {
    pub up: &'a CudaSlice<bf16>,
    pub inter: usize,
    pub h: &'a mut CudaSlice<bf16>,
}

/// Routes the tokens of `x [rows, hidden]`: writes `out`'s `[rows, s.choices()]`, each row its
/// top-k (highest selection score first), then the appended choices.
pub fn route(
    gpu: &Gpu,
    s: RouteShape,
    (x, hidden): (&impl DevicePtr<bf16>, usize),
    router: Router,
    out: Routed,
) -> Result<()> {
    launch_route(gpu, s, (x, hidden), router, out, None)
}

/// [`route`] of one token whose routing appends the shared expert's pieces (`s.shared > 0`),
/// with the pieces' up projections in the same launch (they need no routing): rows `top_k..`
/// of `up.h [s.choices(), inter]` get `relu(bf16(x W^T))^2` of piece j's rows of `up.up` (the
/// pieces after the routed experts, as [`experts_mlp_choices`] takes them), bit for bit as
/// [`experts_mlp_choices`] computes them; the routed choices' rows are left to
/// [`experts_mlp_choices_after`].
pub fn route_appended_up(
    gpu: &Gpu,
    s: RouteShape,
    x: (&impl DevicePtr<bf16>, usize),
    router: Router,
    out: Routed,
    up: AppendedUp,
) -> Result<()> {
    launch_route(gpu, s, x, router, out, Some(up))
}

/// [`route`], and with `appended` the pieces' up projections of [`route_appended_up`].
fn launch_route(
    gpu: &Gpu,
    s: RouteShape,
    (x, hidden): (&impl DevicePtr<bf16>, usize),
    router: Router,
    Routed { idx, weight }: Routed,
    appended: Option<AppendedUp>,
) -> Result<()> {
    let k = if appended.is_some() { entry::MOE_ROUTE_UP } else { entry::MOE_ROUTE };
    let a = gpu.args(k);
    let c = a.check();
    c.choices(s.experts, s.top_k)?;
    c.choices(s.experts + s.shared, s.choices())?;
    c.count("n_group", s.experts, s.n_group)?;
    c.that("n_group", s.experts.is_multiple_of(s.n_group), format!("a divisor of experts {}", s.experts), s.n_group)?;
    c.count("topk_group", s.n_group, s.topk_group)?;
    c.that(
        "top_k",
        s.top_k <= s.topk_group * (s.experts / s.n_group),
        "at most the experts of the kept groups",
        s.top_k,
    )?;
    c.count("hidden", MAX_ELEMS, hidden)?;
    c.that("hidden", hidden.is_multiple_of(8), "a multiple of 8", hidden)?;
    c.that("x", x.len().is_multiple_of(hidden) && !x.is_empty(), format!("whole rows of {hidden}"), x.len())?;
    let rows = x.len() / hidden;
    c.count("rows", MAX_ROWS, rows)?;
    let choices = Len::Exactly(rows * s.choices());
    let (gate, bias) = (
        a.input("gate", router.gate, Len::Exactly(s.experts * hidden))?,
        a.input("bias", router.bias, Len::Exactly(s.experts))?,
    );
    let (idx, weight) = (a.output("idx", idx, choices)?, a.output("weight", weight, choices)?);
    let tiles = rows.div_ceil(LOGITS_TOKENS as usize);
    c.count("rows", crate::gpu::COUNTERS * LOGITS_TOKENS as usize, rows)?;
    // SAFETY: every logit is written before the selection (by the tile's last block) reads it.
    let mut logits = unsafe { gpu.scratch::<f32>(rows * s.experts) }?;
    let p = RouteParams {
        x: a.input("x", x, Len::Any)?,
        gate,
        logits: a.output("logits", &mut logits, Len::Any)?,
        counters: gpu.counters() as *mut u32,
        bias,
        idx,
        weight,
        rows: rows as u32,
        hidden: hidden as u32,
        experts: s.experts as u32,
        top_k: s.top_k as u32,
        n_group: s.n_group as u32,
        topk_group: s.topk_group as u32,
        renormalize: u32::from(s.renormalize),
        scaling: s.scaling,
        shared: s.shared as u32,
        up: core::ptr::null(),
        h: core::ptr::null_mut(),
        inter: 0,
    };
    let (p, extra) = match appended {
        None => (p, 0),
        Some(AppendedUp { up, inter, h }) => {
            c.that("rows", rows == 1, "one token (the pieces' up projections in the routing)", rows)?;
            c.count("shared", MAX_TOP_K as usize, s.shared)?;
            c.count("inter", MAX_ELEMS, inter)?;
            let up = a.input("up", up, Len::Exactly((s.experts + s.shared) * inter * hidden))?;
            let h = a.output("h", h, Len::Exactly(s.choices() * inter))?;
            (RouteParams { up, h, inter: inter as u32, ..p }, s.shared * inter.div_ceil(ROUTE_UP_ROWS as usize))
        }
    };
    c.count("blocks", u32::MAX as usize, s.experts + extra)?;
    if extra == 0 && rows >= ROUTE_LT_MIN_ROWS && gpu.blas().is_ok() {
        crate::gemm::logits_f32(gpu, rows, x, router.gate, s.experts, hidden, &mut logits)?;
        let ks = entry::MOE_SELECT;
        // SAFETY: as below: the logits of every row written before (cuBLASLt on this stream);
        // no counters used.
        return unsafe { gpu.launch(Grid::new(ks, (tiles as u32, 1, 1)), p) };
    }
    // SAFETY: all extents checked above (logits allocated for rows * experts, a zeroed
    // counter per tile; with the pieces' up projections, one token, up and h of their
    // shapes); the group settings can always fill top_k; outputs are `&mut`.
    unsafe { gpu.launch(Grid::new(k, ((s.experts + extra) as u32, tiles as u32, 1)), p) }
}

/// Fewest tokens whose router logits run as one GEMM through cuBLASLt
/// ([`crate::gemm::logits_f32`], f32 out), then the selection (`moe_select_bf16`), rather than
/// in the one-launch kernel (a block per expert and 8 tokens, each reading the tokens'
/// activations again). On an H100 (`moe -- route/b`, cold) at 8 tokens 9.41 us against the
/// one-launch kernel's 9.90, at 64 11.09 against 28.85 (and at 4096 18.97 against the
/// tensor-core kernel this replaced, 55.35); one token stays one launch (5.9 us either way).
pub const ROUTE_LT_MIN_ROWS: usize = 8;
