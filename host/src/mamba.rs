//! Launcher of the fused Mamba2 decode kernel (kernels-gpu/src/mamba.rs; the same math as
//! conv1d's update, ssm's update and norm's gated norm in turn, whose references are in cpu/).

use cudarc::driver::{CudaSlice, DevicePtrMut};
use half::bf16;
use kernels_gpu::mamba::{MAMBA_MAX_CLUSTER, MAMBA_MAX_HEAD_DIM, MAMBA_MAX_STATE, MambaDecodeParams};
use kernels_gpu::{Kernel, entry};

use crate::args::{Len, Rows};
use crate::batch::Slots;
use crate::check::Check;
use crate::conv1d::{Conv, ConvShape};
use crate::error::Result;
use crate::gpu::{Gpu, Grid};
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

/// What the fused decode reads and updates of a Mamba mixer besides its rows.
pub struct MambaLayer<'a> {
    /// The causal conv over xBC, of `k` taps, with its state cache.
    pub conv: Conv<'a>,
    pub k: usize,
    pub heads: SsmHeads<'a>,
    /// The SSM state cache `[slots, heads, head_dim, state_size]`.
    pub state: &'a mut CudaSlice<f32>,
    /// The gated norm's weight `[heads * head_dim]` and epsilon.
    pub norm: &'a CudaSlice<bf16>,
    pub eps: f32,
}

/// The decode rows of a Mamba2 mixer between its projections, one launch: for each row of
/// `zx` (in_proj's output rows: z, then xBC, then dt), the conv update of xBC at the row's slot
/// (docs/MATH.md section 1), the selective state update without a gate (section 2), and the
/// gated group RMSNorm of its output with the layer's norm (section 5, `shape.groups` groups)
/// into `y [batch, heads * head_dim]`; the conv and state caches updated in place. As
/// `conv1d::conv_update`, `ssm::ssm_update` and `norm::gated_norm` in turn: the caches bit for
/// bit, y up to the order of the norm's sums. Pad rows: nothing read or written. The clusters
/// of its launch need sm_90 or later.
pub fn mamba_decode(
    gpu: &Gpu,
    shape: SsmShape,
    zx: Rows,
    mut layer: MambaLayer,
    slots: &Slots,
    y: &mut impl DevicePtrMut<bf16>,
) -> Result<()> {
    let k = entry::MAMBA_DECODE;
    let a = gpu.args(k);
    let c = a.check();
    let batch = slots.len();
    c.count("batch", 65535, batch)?;
    shape.check_geometry(c)?;
    let hpg = shape.heads / shape.groups;
    check_limits(c, &shape)?;
    let inner = shape.width();
    let conv_dim = inner + 2 * shape.groups * shape.state_size;
    let conv = ConvShape { dim: conv_dim, k: layer.k };
    conv.check(c)?;
    c.positive("eps", layer.eps)?;
    // The row: z (inner), xBC (conv_dim), dt (heads).
    let (zx, zx_stride) = a.rows("zx", &zx, (batch, inner + conv_dim + shape.heads))?;
    let (conv_w, conv_b, conv_state) = layer.conv.args(&a, conv, slots.num_slots())?;
    let (dt_bias, a_log, d) = layer.heads.args(&a, shape.heads)?;
    let state = Len::Exactly(shape.cache_len(c, slots.num_slots())?);
    let p = MambaDecodeParams {
        zx,
        conv_w,
        conv_b,
        conv_state,
        ssm_state: a.output("state", layer.state, state)?,
        dt_bias,
        a: a_log,
        d,
        norm_w: a.input("norm", layer.norm, Len::Exactly(inner))?,
        cache_index: a.input("slots", &slots.dev, Len::Any)?,
        y: a.output("y", y, Len::Exactly(batch * inner))?,
        zx_stride,
        xbc_at: inner as u32,
        dt_at: (inner + conv_dim) as u32,
        geo: shape.geometry(),
        k: layer.k as u32,
        eps: layer.eps,
    };
    if batch == 0 {
        return Ok(());
    }
    // SAFETY: the checks above proved zx covers batch rows of z, xBC and dt, the conv weights,
    // bias and cache and the state cache and per-head arrays cover the shape and the Slots'
    // slots (PAD_SLOT or distinct, in range), head_dim, state_size (a multiple of 4) and the
    // cluster (heads / groups) within the kernel's limits; the caches and y are `&mut`.
    unsafe { gpu.launch(Grid::new(k, (shape.heads as u32, batch as u32, 1)).clusters(hpg as u32), p) }
}
