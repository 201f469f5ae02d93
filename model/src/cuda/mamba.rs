//! Mamba mixers on the CUDA backend: a mixer on the device ([`CudaMamba`], its weights and
//! states) and how a step's rows run through it: decode rows at up to [`FUSED_MAMBA_ROWS`]
//! rows with the conv update, state update and gated norm in one launch, else the three; the
//! conv and the chunked scan for prefill sequences.

use half::bf16;
use host::conv1d::{Conv, ConvShape, conv_fwd, conv_update};
use host::mamba::{MambaLayer, mamba_decode, mamba_decode_fits};
use host::norm::{NormShape, gated_norm};
use host::ssd::ssd_scan;
use host::ssm::{SsmCache, SsmHeads, SsmInputs, SsmShape, ssm_update};
use host::{Buffer, CudaSlice, Gpu};

use super::{Cuda, CudaRows, rows_of, view_mut};
use crate::backend::{Backend, CacheSizes, In, MambaOps, MambaWeights, Out};
use crate::config::MambaConfig;
use crate::error::Result;
use crate::layout;

/// Decode rows up to which a Mamba mixer's conv update, state update and gated norm run as
/// one launch (`mamba_decode_bf16`); more rows take the three launches. One row measured
/// faster fused (docs/PERFORMANCE.md, the fused Mamba decode); three rows, in Nsight Compute
/// with cold caches, took 18.7 us fused against 15.1 us for the three.
pub const FUSED_MAMBA_ROWS: usize = 1;

/// A Mamba mixer on the device: its weights and its slots' states ([`MambaWeights`]).
pub struct CudaMamba {
    w: MambaWeights<Cuda>,
}

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

fn ssm_shape(c: &MambaConfig) -> SsmShape {
    SsmShape {
        dt_min: c.dt_limit.0,
        dt_max: c.dt_limit.1,
        ..SsmShape::new(c.heads, c.head_dim, c.groups, c.state_size)
    }
}

impl CudaMamba {
    /// Uploads the mixer `m` of `c` (its gated norm's epsilon `eps`) with zero states of
    /// `sizes`.
    pub(super) fn upload(
        cuda: &Cuda,
        c: &MambaConfig,
        eps: f32,
        m: &layout::Mamba,
        sizes: &CacheSizes,
    ) -> Result<CudaMamba> {
        Ok(CudaMamba { w: MambaWeights::upload(cuda, c, eps, m, sizes)? })
    }

    /// The mixer as the host crate's launchers take it: the fused decode whole, the others
    /// their parts of it.
    fn host(&mut self) -> MambaLayer<'_> {
        let w = &mut self.w;
        MambaLayer {
            heads: SsmHeads { dt_bias: &w.dt_bias, a: &w.a, d: Some(&w.d) },
            conv: Conv { w: &w.conv_w, bias: w.conv_b.as_deref(), state: &mut w.conv_state },
            k: w.c.conv_kernel,
            state: &mut w.ssm_state,
            norm: &w.norm,
            eps: w.eps,
        }
    }

    /// The conv update of the step's decode rows.
    fn conv_decode(&mut self, g: &Gpu, x: In<Buffer<bf16>>, rows: &CudaRows, y: Out<Buffer<bf16>>) -> Result<()> {
        let (shape, cd, slots) = (conv_shape(&self.w.c), self.w.c.conv_dim(), rows.decode()?);
        let mut y = view_mut(y, slots.len() * cd)?;
        Ok(conv_update(g, shape, rows_of(&x, slots.len(), cd), self.host().conv, slots, &mut y)?)
    }

    /// The state update of the step's decode rows.
    fn ssm_decode(
        &mut self,
        g: &Gpu,
        (xbc, dt): (In<Buffer<bf16>>, In<Buffer<bf16>>),
        rows: &CudaRows,
        y: Out<Buffer<bf16>>,
    ) -> Result<()> {
        let (c, slots) = (&self.w.c, rows.decode()?);
        let (shape, inputs) = (ssm_shape(c), ssm_inputs(c, &xbc, &dt, slots.len()));
        let mut y = view_mut(y, slots.len() * c.inner())?;
        let layer = self.host();
        let cache = SsmCache { state: layer.state, slots, dst: None };
        Ok(ssm_update(g, shape, inputs, None, layer.heads, cache, &mut y)?)
    }
}

impl MambaOps<Cuda> for CudaMamba {
    fn in_proj(&self, cuda: &Cuda, x: In<Buffer<bf16>>, rows: usize, y: Out<Buffer<bf16>>) -> Result<()> {
        cuda.linear(x, rows, &self.w.in_proj, y)
    }

    /// The gated norm of `rows` rows `x` with their gates `z`.
    fn gated_norm(
        &self,
        cuda: &Cuda,
        x: In<Buffer<bf16>>,
        z: In<Buffer<bf16>>,
        rows: usize,
        y: Out<Buffer<bf16>>,
    ) -> Result<()> {
        let (c, width) = (&self.w.c, self.w.c.inner());
        let shape = NormShape::new(rows, width, c.groups, self.w.eps);
        let mut y = view_mut(y, rows * width)?;
        Ok(gated_norm(&cuda.gpu, shape, rows_of(&x, rows, width), rows_of(&z, rows, width), &self.w.norm, &mut y)?)
    }

    /// The mixer's decode rows after in_proj: in one launch at up to [`FUSED_MAMBA_ROWS`] rows
    /// (where the kernel fits the shape), else conv, state update and gated norm apart.
    fn decode(
        &mut self,
        cuda: &Cuda,
        zx: In<Buffer<bf16>>,
        nd: usize,
        rows: &CudaRows,
        y: Out<Buffer<bf16>>,
    ) -> Result<()> {
        let (inner, cd, wd) = (self.w.c.inner(), self.w.c.conv_dim(), self.w.c.in_proj_width());
        let shape = ssm_shape(&self.w.c);
        if nd > FUSED_MAMBA_ROWS || !mamba_decode_fits(&shape) {
            let mut xbc = cuda.scratch(nd * cd)?;
            self.conv_decode(&cuda.gpu, zx.at(0, inner), rows, Out { buf: &mut xbc, offset: 0 })?;
            let mut ys = cuda.scratch(nd * inner)?;
            let dt = zx.at(0, inner + cd);
            self.ssm_decode(&cuda.gpu, (In::rows(&xbc, cd), dt), rows, Out { buf: &mut ys, offset: 0 })?;
            return self.gated_norm(cuda, In::rows(&ys, inner), zx, nd, y);
        }
        let slots = rows.decode()?;
        let mut y = view_mut(y, slots.len() * inner)?;
        let zx = rows_of(&zx, slots.len(), wd);
        Ok(mamba_decode(&cuda.gpu, shape, zx, self.host(), slots, &mut y)?)
    }

    /// The chunked scan of the step's prefill sequences.
    fn scan(
        &mut self,
        cuda: &Cuda,
        xbc: In<Buffer<bf16>>,
        dt: In<Buffer<bf16>>,
        rows: &CudaRows,
        y: Out<Buffer<bf16>>,
    ) -> Result<()> {
        let (g, c, p) = (&cuda.gpu, &self.w.c, rows.prefill()?);
        let shape = ssm_shape(c);
        let mut plan = rows.ssd_plan(g, shape)?;
        let inputs = ssm_inputs(c, &xbc, &dt, p.tokens());
        let mut y = view_mut(y, p.tokens() * c.inner())?;
        let layer = self.host();
        Ok(ssd_scan(g, shape, (inputs, layer.heads), (layer.state, p), &mut plan, &mut y)?)
    }

    /// The conv of the step's prefill sequences.
    fn conv(&mut self, cuda: &Cuda, x: In<Buffer<bf16>>, rows: &CudaRows, y: Out<Buffer<bf16>>) -> Result<()> {
        let (shape, cd, p) = (conv_shape(&self.w.c), self.w.c.conv_dim(), rows.prefill()?);
        let mut y = view_mut(y, p.tokens() * cd)?;
        Ok(conv_fwd(&cuda.gpu, shape, rows_of(&x, p.tokens(), cd), self.host().conv, p, &mut y)?)
    }

    fn out_proj(&self, cuda: &Cuda, x: In<Buffer<bf16>>, rows: usize, y: Out<Buffer<bf16>>) -> Result<()> {
        cuda.linear(x, rows, &self.w.out_proj, y)
    }

    fn state(&mut self) -> (&mut Buffer<bf16>, &mut CudaSlice<f32>) {
        (&mut self.w.conv_state, &mut self.w.ssm_state)
    }
}
