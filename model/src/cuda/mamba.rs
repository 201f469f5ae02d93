//! Mamba mixers on the CUDA backend: the conv and the state update for decode rows (at up to
//! [`FUSED_MAMBA_ROWS`] rows with the gated norm in one launch), the conv and the chunked scan
//! for prefill sequences.

use half::bf16;
use host::conv1d::{Conv, ConvShape, conv_fwd, conv_update};
use host::mamba::{MambaLayer, mamba_decode, mamba_decode_fits};
use host::ssd::{SsdPlan, ssd_scan};
use host::ssm::{SsmCache, SsmHeads, SsmInputs, SsmShape, ssm_update};
use host::{Buffer, CudaSlice, Gpu};

use super::{Cuda, CudaRows, rows_of, view_mut};
use crate::backend::{In, MambaDecode, Out, mamba_decode_apart};
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

fn ssm_shape(c: &MambaConfig) -> SsmShape {
    SsmShape {
        dt_min: c.dt_limit.0,
        dt_max: c.dt_limit.1,
        ..SsmShape::new(c.heads, c.head_dim, c.groups, c.state_size)
    }
}

/// The conv update of the step's decode rows.
#[allow(clippy::too_many_arguments)]
pub(super) fn conv_decode(
    g: &Gpu,
    c: &MambaConfig,
    x: In<Buffer<bf16>>,
    w: &Buffer<bf16>,
    bias: Option<&Buffer<bf16>>,
    state: &mut Buffer<bf16>,
    rows: &CudaRows,
    y: Out<Buffer<bf16>>,
) -> Result<()> {
    let (cd, k) = (c.conv_dim(), c.conv_kernel);
    let slots = rows.decode()?;
    let mut y = view_mut(y, slots.len() * cd)?;
    let conv = Conv { w, bias: bias.map(|b| &**b), state };
    Ok(conv_update(g, ConvShape { dim: cd, k }, rows_of(&x, slots.len(), cd), conv, slots, &mut y)?)
}

/// The conv of the step's prefill sequences.
#[allow(clippy::too_many_arguments)]
pub(super) fn conv_prefill(
    g: &Gpu,
    c: &MambaConfig,
    x: In<Buffer<bf16>>,
    w: &Buffer<bf16>,
    bias: Option<&Buffer<bf16>>,
    state: &mut Buffer<bf16>,
    rows: &CudaRows,
    y: Out<Buffer<bf16>>,
) -> Result<()> {
    let (cd, k) = (c.conv_dim(), c.conv_kernel);
    let p = rows.prefill()?;
    let mut y = view_mut(y, p.tokens() * cd)?;
    let conv = Conv { w, bias: bias.map(|b| &**b), state };
    Ok(conv_fwd(g, ConvShape { dim: cd, k }, rows_of(&x, p.tokens(), cd), conv, p, &mut y)?)
}

/// The state update of the step's decode rows.
#[allow(clippy::too_many_arguments)]
pub(super) fn ssm_decode(
    g: &Gpu,
    c: &MambaConfig,
    xbc: In<Buffer<bf16>>,
    dt: In<Buffer<bf16>>,
    heads: (&CudaSlice<f32>, &CudaSlice<f32>, &CudaSlice<f32>),
    state: &mut CudaSlice<f32>,
    rows: &CudaRows,
    y: Out<Buffer<bf16>>,
) -> Result<()> {
    let shape = ssm_shape(c);
    let slots = rows.decode()?;
    let inputs = ssm_inputs(c, &xbc, &dt, slots.len());
    let h = SsmHeads { dt_bias: heads.0, a: heads.1, d: Some(heads.2) };
    let mut y = view_mut(y, slots.len() * c.inner())?;
    Ok(ssm_update(g, shape, inputs, None, h, SsmCache { state, slots, dst: None }, &mut y)?)
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
    let (w, bias, state) = m.conv;
    let layer = MambaLayer {
        conv: Conv { w, bias: bias.map(|b| &**b), state },
        k: c.conv_kernel,
        heads: SsmHeads { dt_bias: m.heads.0, a: m.heads.1, d: Some(m.heads.2) },
        state: m.state,
        norm: m.norm.0,
        eps: m.norm.1,
    };
    let zx = rows_of(&zx, slots.len(), c.in_proj_width());
    Ok(mamba_decode(&cuda.gpu, shape, zx, layer, slots, &mut y)?)
}

/// The chunked scan of the step's prefill sequences.
#[allow(clippy::too_many_arguments)]
pub(super) fn ssm_prefill(
    g: &Gpu,
    c: &MambaConfig,
    xbc: In<Buffer<bf16>>,
    dt: In<Buffer<bf16>>,
    heads: (&CudaSlice<f32>, &CudaSlice<f32>, &CudaSlice<f32>),
    state: &mut CudaSlice<f32>,
    rows: &CudaRows,
    y: Out<Buffer<bf16>>,
) -> Result<()> {
    let shape = ssm_shape(c);
    let p = rows.prefill()?;
    let mut plan = SsdPlan::new(g, p, shape)?;
    let inputs = ssm_inputs(c, &xbc, &dt, p.tokens());
    let h = SsmHeads { dt_bias: heads.0, a: heads.1, d: Some(heads.2) };
    let mut y = view_mut(y, p.tokens() * c.inner())?;
    Ok(ssd_scan(g, shape, inputs, h, state, p, &mut plan, &mut y)?)
}
