//! Launchers of MoE routing and combining (kernels-gpu/src/moe.rs; reference: cpu/moe.rs).

use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut};
use half::bf16;
use kernels_gpu::Kernel;
use kernels_gpu::moe::{CombineParams, MAX_EXPERTS, MAX_TOP_K, ROUTE_BLOCK, ROUTE_SMEM_BYTES, RouteParams};

use crate::check::{Check, MAX_ELEMS, MAX_ROWS};
use crate::error::Result;
use crate::gpu::Gpu;

/// Routing settings (SPEC.md section 6).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RouteShape {
    pub experts: usize,
    pub top_k: usize,
    pub n_group: usize,
    pub topk_group: usize,
    pub renormalize: bool,
    pub scaling: f32,
}

/// Routes `rows` tokens of `x [rows, hidden]`: writes `idx` and `weight` `[rows, top_k]`.
#[allow(clippy::too_many_arguments)]
pub fn route(
    gpu: &Gpu,
    s: RouteShape,
    x: &impl DevicePtr<bf16>,
    hidden: usize,
    gate: &CudaSlice<bf16>,
    bias: &CudaSlice<f32>,
    idx: &mut CudaSlice<i32>,
    weight: &mut CudaSlice<f32>,
) -> Result<()> {
    let k = Kernel::MoeRoute;
    let c = Check(k.name());
    c.count("experts", MAX_EXPERTS as usize, s.experts)?;
    c.count("top_k", (MAX_TOP_K as usize).min(s.experts), s.top_k)?;
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
    c.that("x", x.len().is_multiple_of(hidden) && !x.is_empty(), format!("whole rows of {hidden}"), x.len())?;
    let rows = x.len() / hidden;
    c.count("rows", MAX_ROWS, rows)?;
    c.len("gate", s.experts * hidden, gate.len())?;
    c.len("bias", s.experts, bias.len())?;
    c.len("idx", rows * s.top_k, idx.len())?;
    c.len("weight", rows * s.top_k, weight.len())?;
    let p = RouteParams {
        x: gpu.addr(k, "x", x)? as *const u16,
        gate: gpu.addr(k, "gate", gate)? as *const u16,
        bias: gpu.addr(k, "bias", bias)? as *const f32,
        idx: gpu.addr_mut(k, "idx", idx)? as *mut i32,
        weight: gpu.addr_mut(k, "weight", weight)? as *mut f32,
        rows: rows as u32,
        hidden: hidden as u32,
        experts: s.experts as u32,
        top_k: s.top_k as u32,
        n_group: s.n_group as u32,
        topk_group: s.topk_group as u32,
        renormalize: u32::from(s.renormalize),
        scaling: s.scaling,
    };
    // SAFETY: all extents checked above; the group settings can always fill top_k; outputs
    // are `&mut`.
    unsafe { gpu.launch(k, (rows as u32, 1, 1), ROUTE_BLOCK, ROUTE_SMEM_BYTES, p) }
}

/// `out[t] = shared[t] + sum_k weight[t, k] * y[slot[t, k]]` for rows of `hidden`; `slot`
/// (host indices into the rows of `y`) is checked and uploaded.
#[allow(clippy::too_many_arguments)]
pub fn combine(
    gpu: &Gpu,
    y: &impl DevicePtr<bf16>,
    shared: Option<&CudaSlice<bf16>>,
    slot: &[i32],
    weight: &CudaSlice<f32>,
    top_k: usize,
    hidden: usize,
    out: &mut impl DevicePtrMut<bf16>,
) -> Result<()> {
    let k = Kernel::MoeCombine;
    let c = Check(k.name());
    c.count("top_k", MAX_TOP_K as usize, top_k)?;
    c.count("hidden", MAX_ELEMS, hidden)?;
    let rows = slot.len() / top_k;
    c.count("rows", MAX_ROWS, rows)?;
    c.len("slot", rows * top_k, slot.len())?;
    c.len("weight", rows * top_k, weight.len())?;
    c.len("out", rows * hidden, out.len())?;
    if let Some(s) = shared {
        c.len("shared", rows * hidden, s.len())?;
    }
    let y_rows = y.len() / hidden;
    if let Some(&bad) = slot.iter().find(|&&s| s < 0 || s as usize >= y_rows) {
        c.that("slot", false, format!("rows of y below {y_rows}"), bad)?;
    }
    let dslot = gpu.upload(slot)?;
    let p = CombineParams {
        y: gpu.addr(k, "y", y)? as *const u16,
        shared: shared.map_or(Ok(0), |s| gpu.addr(k, "shared", s))? as *const u16,
        slot: gpu.addr(k, "slot", &dslot)? as *const i32,
        weight: gpu.addr(k, "weight", weight)? as *const f32,
        out: gpu.addr_mut(k, "out", out)? as *mut u16,
        rows: rows as u32,
        top_k: top_k as u32,
        hidden: hidden as u32,
    };
    // SAFETY: extents checked above, every slot indexes a row of y; out is `&mut`; the slot
    // buffer is freed in stream order after the kernel.
    unsafe { gpu.launch(k, (rows as u32, 1, 1), kernels_gpu::EW_BLOCK, 0, p) }
}
