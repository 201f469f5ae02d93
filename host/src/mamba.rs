//! Launcher of the fused Mamba2 decode kernel (kernels-gpu/src/mamba.rs; the same math as
//! conv1d's update, ssm's update and norm's gated norm in turn, whose references are in cpu/).

use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut};
use half::bf16;
use kernels_gpu::Kernel;
use kernels_gpu::mamba::{MAMBA_BLOCK, MAMBA_MAX_CLUSTER, MAMBA_MAX_HEAD_DIM, MAMBA_MAX_STATE, MambaDecodeParams};

use crate::batch::Slots;
use crate::check::Check;
use crate::conv1d::ConvShape;
use crate::error::Result;
use crate::gpu::Gpu;
use crate::ssm::{SsmHeads, SsmShape};

/// Whether [`mamba_decode`] takes this shape: at most [`MAMBA_MAX_CLUSTER`] heads a group, a
/// head_dim of at most [`MAMBA_MAX_HEAD_DIM`], a state of at most [`MAMBA_MAX_STATE`] (the
/// other checks as for the state update's).
pub fn mamba_decode_fits(shape: &SsmShape) -> bool {
    shape.groups > 0 && check_limits(Check(Kernel::MambaDecode.name()), shape).is_ok()
}

/// The fused kernel's own limits on a shape (see [`mamba_decode_fits`]).
fn check_limits(c: Check, shape: &SsmShape) -> Result<()> {
    c.count("heads", MAMBA_MAX_CLUSTER as usize * shape.groups, shape.heads)?;
    c.count("head_dim", MAMBA_MAX_HEAD_DIM as usize, shape.head_dim)?;
    c.count("state_size", MAMBA_MAX_STATE as usize, shape.state_size)
}

/// A Mamba mixer's causal conv: weights `[conv_dim, k]`, bias `[conv_dim]` or none.
#[derive(Clone, Copy)]
pub struct MambaConv<'a> {
    pub w: &'a CudaSlice<bf16>,
    pub bias: Option<&'a CudaSlice<bf16>>,
    pub k: usize,
}

/// The decode rows of a Mamba2 mixer between its projections, one launch: for each row of
/// `zx` (in_proj's output, rows of `zx_stride`: z, then xBC, then dt), the conv update of xBC
/// at the row's slot (docs/MATH.md section 1), the selective state update without a gate (section
/// 2), and the gated group RMSNorm of its output with `norm` (section 5, `shape.groups`
/// groups) into `y [batch, heads * head_dim]`; the conv and state caches updated in place. As
/// `conv1d::conv_update`, `ssm::ssm_update` and `norm::gated_norm` in turn: the caches bit for
/// bit, y up to the order of the norm's sums. Pad rows: nothing read or written. The clusters
/// of its launch need sm_90 or later.
#[allow(clippy::too_many_arguments)]
pub fn mamba_decode(
    gpu: &Gpu,
    shape: SsmShape,
    (zx, zx_stride): (&impl DevicePtr<bf16>, usize),
    (conv, conv_state): (MambaConv, &mut impl DevicePtrMut<bf16>),
    (heads, ssm_state): (SsmHeads, &mut CudaSlice<f32>),
    (norm, eps): (&CudaSlice<bf16>, f32),
    slots: &Slots,
    y: &mut impl DevicePtrMut<bf16>,
) -> Result<()> {
    let k = Kernel::MambaDecode;
    let c = Check(k.name());
    let batch = slots.len();
    c.count("batch", 65535, batch)?;
    shape.check(k, &heads, ssm_state.len(), slots.num_slots())?;
    let hpg = shape.heads / shape.groups;
    check_limits(c, &shape)?;
    let inner = shape.width();
    let conv_dim = inner + 2 * shape.groups * shape.state_size;
    // The row: z (inner), xBC (conv_dim), dt (heads).
    let row = inner + conv_dim + shape.heads;
    c.that("zx_stride", zx_stride >= row, format!(">= {row} (z, xBC, dt)"), zx_stride)?;
    let need = (batch.max(1) - 1).checked_mul(zx_stride).and_then(|v| v.checked_add(row));
    c.len_at_least("zx", need.unwrap_or(usize::MAX), zx.len())?;
    let cs = ConvShape { dim: conv_dim, k: conv.k, x_stride: zx_stride };
    let conv_x = zx.len() - inner;
    cs.check(k, batch.max(1), conv_x, conv.w.len(), conv.bias.map(|b| b.len()), conv_state.len(), slots.num_slots())?;
    c.len("norm", inner, norm.len())?;
    c.positive("eps", eps)?;
    c.len("y", batch * inner, y.len())?;
    let p = MambaDecodeParams {
        zx: gpu.addr(k, "zx", zx)? as *const u16,
        conv_w: gpu.addr(k, "conv w", conv.w)? as *const u16,
        conv_b: gpu.opt_addr(k, "conv bias", conv.bias)? as *const u16,
        conv_state: gpu.addr_mut(k, "conv state", conv_state)? as *mut u16,
        ssm_state: gpu.addr_mut(k, "state", ssm_state)? as *mut f32,
        dt_bias: gpu.addr(k, "dt_bias", heads.dt_bias)? as *const f32,
        a: gpu.addr(k, "a", heads.a)? as *const f32,
        d: gpu.opt_addr(k, "d", heads.d)? as *const f32,
        norm_w: gpu.addr(k, "norm", norm)? as *const u16,
        cache_index: gpu.addr(k, "slots", &slots.dev)? as *const i32,
        y: gpu.addr_mut(k, "y", y)? as *mut u16,
        zx_stride: zx_stride as u32,
        xbc_at: inner as u32,
        dt_at: (inner + conv_dim) as u32,
        heads: shape.heads as u32,
        head_dim: shape.head_dim as u32,
        groups: shape.groups as u32,
        state_size: shape.state_size as u32,
        k: conv.k as u32,
        dt_min: shape.dt_min,
        dt_max: shape.dt_max,
        eps,
    };
    if batch == 0 {
        return Ok(());
    }
    // SAFETY: the checks above proved zx covers batch rows of z, xBC and dt, the conv weights,
    // bias and cache and the state cache and per-head arrays cover the shape and the Slots'
    // slots (PAD_SLOT or distinct, in range), head_dim, state_size (a multiple of 4) and the
    // cluster (heads / groups) within the kernel's limits; the caches and y are `&mut`.
    unsafe { gpu.launch_clusters(k, (shape.heads as u32, batch as u32, 1), hpg as u32, MAMBA_BLOCK, 0, p) }
}
