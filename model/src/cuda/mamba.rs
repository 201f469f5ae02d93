//! Mamba mixers on the CUDA backend: the conv and the state update for decode rows (at up to
//! [`FUSED_MAMBA_ROWS`] rows with the gated norm in one launch), the conv and the chunked scan
//! for prefill sequences.

use half::bf16;
use host::conv1d::{Conv, ConvShape, conv_fwd, conv_update};
use host::mamba::{MambaLayer, mamba_decode, mamba_decode_fits};
use host::ssd::{SsdPlan, ssd_scan};
use host::ssm::{SsmCache, SsmHeads, SsmInputs, SsmShape, ssm_update};
use host::{Buffer, Gpu};

use super::{Cuda, CudaRows, rows_of, view_mut};
use crate::backend::{In, MambaConv, MambaDecode, MambaSsm, Out, mamba_decode_apart};
use crate::config::MambaConfig;
use crate::error::Result;

/// Decode rows up to which a Mamba mixer's conv update, state update and gated norm run as
/// one launch (`mamba_decode_bf16`); more rows take the three launches. One row measured
/// faster fused (docs/PERFORMANCE.md, the fused Mamba decode); three rows, in Nsight Compute
/// with cold caches, took 18.7 us fused against 15.1 us for the three.
pub const FUSED_MAMBA_ROWS: usize = 1;

/// x, B and C of `n` rows of the conv output `xbc`, dt of in_proj's.
fn ssm_inputs<'a>(c: &MambaConfig, xbc: &In<'a, Buffer<bf16>>, dt: &In<'a, Buffer<bf16>>, n: usize) -> SsmInputs<'a> {
    let (inner, gn) = (c.inner(), c.groups * c.state_size);
    let xbc = rows_of(xbc, n, c.conv_dim());
    SsmInputs {
        x: xbc.cols(0, inner),
        dt: rows_of(dt, n, c.heads),
        b: xbc.cols(inner, gn),
        c: xbc.cols(inner + gn, gn),
    }
}

fn conv_shape(c: &MambaConfig) -> ConvShape {
    ConvShape { dim: c.conv_dim(), k: c.conv_kernel }
}

/// The conv as the host crate's launchers take it.
fn host_conv(conv: MambaConv<Cuda>) -> Conv {
    Conv { w: conv.w, bias: conv.bias.map(|b| &**b), state: conv.state }
}

/// The per-head parameters as the host crate's launchers take them.
fn heads<'a>(ssm: &MambaSsm<'a, Cuda>) -> SsmHeads<'a> {
    let (dt_bias, a, d) = ssm.heads;
    SsmHeads { dt_bias, a, d: Some(d) }
}

fn ssm_shape(c: &MambaConfig) -> SsmShape {
    SsmShape {
        dt_min: c.dt_limit.0,
        dt_max: c.dt_limit.1,
        ..SsmShape::new(c.heads, c.head_dim, c.groups, c.state_size)
    }
}

/// The conv update of the step's decode rows.
pub(super) fn conv_decode(
    g: &Gpu,
    c: &MambaConfig,
    x: In<Buffer<bf16>>,
    conv: MambaConv<Cuda>,
    rows: &CudaRows,
    y: Out<Buffer<bf16>>,
) -> Result<()> {
    let (cd, slots) = (c.conv_dim(), rows.decode()?);
    let mut y = view_mut(y, slots.len() * cd)?;
    Ok(conv_update(g, conv_shape(c), rows_of(&x, slots.len(), cd), host_conv(conv), slots, &mut y)?)
}

/// The conv of the step's prefill sequences.
pub(super) fn conv_prefill(
    g: &Gpu,
    c: &MambaConfig,
    x: In<Buffer<bf16>>,
    conv: MambaConv<Cuda>,
    rows: &CudaRows,
    y: Out<Buffer<bf16>>,
) -> Result<()> {
    let (cd, p) = (c.conv_dim(), rows.prefill()?);
    let mut y = view_mut(y, p.tokens() * cd)?;
    Ok(conv_fwd(g, conv_shape(c), rows_of(&x, p.tokens(), cd), host_conv(conv), p, &mut y)?)
}

/// The state update of the step's decode rows.
pub(super) fn ssm_decode(
    g: &Gpu,
    c: &MambaConfig,
    (xbc, dt): (In<Buffer<bf16>>, In<Buffer<bf16>>),
    ssm: MambaSsm<Cuda>,
    rows: &CudaRows,
    y: Out<Buffer<bf16>>,
) -> Result<()> {
    let slots = rows.decode()?;
    let inputs = ssm_inputs(c, &xbc, &dt, slots.len());
    let mut y = view_mut(y, slots.len() * c.inner())?;
    let heads = heads(&ssm);
    let cache = SsmCache { state: ssm.state, slots, dst: None };
    Ok(ssm_update(g, ssm_shape(c), inputs, None, heads, cache, &mut y)?)
}

/// A Mamba mixer's decode rows after in_proj: in one launch at up to [`FUSED_MAMBA_ROWS`]
/// rows (where the kernel fits the shape), else conv, state update and gated norm apart.
pub(super) fn decode(
    cuda: &Cuda,
    c: &MambaConfig,
    zx: In<Buffer<bf16>>,
    nd: usize,
    m: MambaDecode<Cuda>,
    y: Out<Buffer<bf16>>,
) -> Result<()> {
    let shape = ssm_shape(c);
    if nd > FUSED_MAMBA_ROWS || !mamba_decode_fits(&shape) {
        return mamba_decode_apart(cuda, c, zx, nd, m, y);
    }
    let slots = m.rows.decode()?;
    let mut y = view_mut(y, slots.len() * c.inner())?;
    let layer = MambaLayer {
        heads: heads(&m.ssm),
        conv: host_conv(m.conv),
        k: c.conv_kernel,
        state: m.ssm.state,
        norm: m.norm.w,
        eps: m.norm.eps,
    };
    let zx = rows_of(&zx, slots.len(), c.in_proj_width());
    Ok(mamba_decode(&cuda.gpu, shape, zx, layer, slots, &mut y)?)
}

/// The chunked scan of the step's prefill sequences.
pub(super) fn ssm_prefill(
    g: &Gpu,
    c: &MambaConfig,
    (xbc, dt): (In<Buffer<bf16>>, In<Buffer<bf16>>),
    ssm: MambaSsm<Cuda>,
    rows: &CudaRows,
    y: Out<Buffer<bf16>>,
) -> Result<()> {
    let (shape, p) = (ssm_shape(c), rows.prefill()?);
    let mut plan = SsdPlan::new(g, p, shape)?;
    let inputs = ssm_inputs(c, &xbc, &dt, p.tokens());
    let mut y = view_mut(y, p.tokens() * c.inner())?;
    Ok(ssd_scan(g, shape, (inputs, heads(&ssm)), (ssm.state, p), &mut plan, &mut y)?)
}
