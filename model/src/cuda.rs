//! The CUDA backend: each operation through the host crate's kernels and cuBLASLt.
//!
//! Not complete: FP8 weights are not handled yet; MoE dispatch (grouping tokens by expert) runs
//! on the host after the routing kernel, a sync per MoE layer; attention assumes q, k, v rows
//! are contiguous (they are: the model computes them). Step metadata (slots,
//! sequences, the scan plan) is uploaded per operation, which a later version will hoist to
//! once per step.

use half::bf16;
use host::attn::{AttnShape, attention};
use host::batch::{Prefill, Slots};
use host::conv1d::{ConvShape, conv_fwd, conv_update};
use host::cpu::moe::dispatch;
use host::moe::{RouteShape, combine, route};
use host::norm::{NormShape, gated_norm, rms_norm};
use host::ssd::{SsdPlan, ssd_scan};
use host::ssm::{Rows, SsmHeads, SsmInputs, SsmShape, ssm_update};
use host::{CudaSlice, CudaView, CudaViewMut, Gpu};

use crate::backend::{Backend, In, MoeWeights, Out, PrefillSeqs};
use crate::config::{AttentionConfig, MambaConfig, MoeConfig};
use crate::error::{Error, Result};
use crate::layout::Linear;

/// The CUDA backend on one GPU.
pub struct Cuda {
    gpu: Gpu,
}

impl Cuda {
    /// Opens device `ordinal` (a clear error without a driver or GPU).
    pub fn new(ordinal: usize) -> Result<Cuda> {
        Ok(Cuda { gpu: Gpu::new(ordinal)? })
    }

    /// The device.
    pub fn gpu(&self) -> &Gpu {
        &self.gpu
    }
}

/// A bf16 weight `[n, k]` on the device.
pub struct CudaWeight {
    w: CudaSlice<bf16>,
    n: usize,
    k: usize,
}

/// The rows an [`In`] reads, from row 0 to the end of its buffer.
fn view<'a>(x: &In<'a, CudaSlice<bf16>>) -> CudaView<'a, bf16> {
    x.buf.slice(x.offset..)
}

/// The output region of an [`Out`] of `len` elements.
fn view_mut<'a>(y: Out<'a, CudaSlice<bf16>>, len: usize) -> Result<CudaViewMut<'a, bf16>> {
    let end = y.offset + len;
    if end > y.buf.len() {
        return Err(Error::Unsupported(format!("output region {}..{end} past a buffer of {}", y.offset, y.buf.len())));
    }
    Ok(y.buf.slice_mut(y.offset..end))
}

fn rows<'a>(x: &In<'a, CudaSlice<bf16>>, cols: usize) -> Rows<'a> {
    Rows { buf: x.buf, offset: x.offset + cols, stride: x.stride }
}

/// x, B and C inside the conv output rows, dt inside in_proj's.
fn ssm_inputs<'a>(c: &MambaConfig, xbc: &In<'a, CudaSlice<bf16>>, dt: &In<'a, CudaSlice<bf16>>) -> SsmInputs<'a> {
    let gn = c.groups * c.state_size;
    SsmInputs { x: rows(xbc, 0), dt: rows(dt, 0), b: rows(xbc, c.inner()), c: rows(xbc, c.inner() + gn) }
}

fn ssm_shape(c: &MambaConfig) -> SsmShape {
    SsmShape {
        dt_min: c.dt_limit.0,
        dt_max: c.dt_limit.1,
        ..SsmShape::new(c.heads, c.head_dim, c.groups, c.state_size)
    }
}

impl Cuda {
    /// `down(relu(up x)^2)` over the rows `tokens` of `x`, into `out` (`tokens.len()` rows).
    fn mlp(
        &self,
        x: &CudaView<bf16>,
        tokens: &[u32],
        (up, down): &(CudaWeight, CudaWeight),
        out: &mut CudaViewMut<bf16>,
    ) -> Result<()> {
        let (g, n, hidden) = (&self.gpu, tokens.len(), up.k);
        let mut xs = g.zeros::<bf16>(n * hidden)?;
        host::act::gather(g, x, hidden, tokens, &mut xs)?;
        let mut h = g.zeros::<bf16>(n * up.n)?;
        host::gemm::linear(g, n, &xs.as_view(), &up.w.as_view(), up.n, hidden, &mut h)?;
        host::act::relu2(g, &mut h, n * up.n)?;
        Ok(host::gemm::linear(g, n, &h.as_view(), &down.w.as_view(), down.n, up.n, out)?)
    }
}

fn unsupported(what: &str) -> Error {
    Error::Unsupported(format!("the CUDA backend has no {what} yet"))
}

impl Backend for Cuda {
    type Buf = CudaSlice<bf16>;
    type Buf32 = CudaSlice<f32>;
    type Weight = CudaWeight;

    fn upload(&self, v: &[bf16]) -> Result<CudaSlice<bf16>> {
        Ok(self.gpu.upload(v)?)
    }
    fn upload32(&self, v: &[f32]) -> Result<CudaSlice<f32>> {
        Ok(self.gpu.upload(v)?)
    }
    fn zeros(&self, n: usize) -> Result<CudaSlice<bf16>> {
        Ok(self.gpu.zeros(n.max(1))?)
    }
    fn zeros32(&self, n: usize) -> Result<CudaSlice<f32>> {
        Ok(self.gpu.zeros(n.max(1))?)
    }
    fn download(&self, b: &CudaSlice<bf16>) -> Result<Vec<bf16>> {
        Ok(self.gpu.download(b)?)
    }

    fn weight(&self, l: &Linear) -> Result<CudaWeight> {
        if l.fp8.is_some() || l.bias.is_some() {
            return Err(unsupported("FP8 or biased linear layers"));
        }
        Ok(CudaWeight { w: self.gpu.upload(&l.weight.to_bf16()?)?, n: l.weight.shape[0], k: l.weight.shape[1] })
    }

    fn embed(&self, table: &CudaSlice<bf16>, width: usize, tokens: &[u32], out: Out<CudaSlice<bf16>>) -> Result<()> {
        let mut y = view_mut(out, tokens.len() * width)?;
        Ok(host::act::gather(&self.gpu, table, width, tokens, &mut y)?)
    }

    fn rms_norm(
        &self,
        x: In<CudaSlice<bf16>>,
        w: &CudaSlice<bf16>,
        rows: usize,
        width: usize,
        eps: f32,
        y: Out<CudaSlice<bf16>>,
    ) -> Result<()> {
        let shape = NormShape { x_stride: x.stride, ..NormShape::new(rows, width, 1, eps) };
        let mut y = view_mut(y, rows * width)?;
        Ok(rms_norm(&self.gpu, shape, &view(&x), w, &mut y)?)
    }

    fn gated_norm(
        &self,
        x: In<CudaSlice<bf16>>,
        z: In<CudaSlice<bf16>>,
        w: &CudaSlice<bf16>,
        rows: usize,
        width: usize,
        groups: usize,
        eps: f32,
        y: Out<CudaSlice<bf16>>,
    ) -> Result<()> {
        let shape = NormShape { x_stride: x.stride, z_stride: z.stride, ..NormShape::new(rows, width, groups, eps) };
        let mut y = view_mut(y, rows * width)?;
        Ok(gated_norm(&self.gpu, shape, &view(&x), &view(&z), w, &mut y)?)
    }

    fn linear(&self, x: In<CudaSlice<bf16>>, rows: usize, w: &CudaWeight, y: Out<CudaSlice<bf16>>) -> Result<()> {
        if x.stride != w.k {
            return Err(unsupported("strided linear inputs"));
        }
        let xv = x.buf.slice(x.offset..x.offset + rows * w.k);
        let mut y = view_mut(y, rows * w.n)?;
        Ok(host::gemm::linear(&self.gpu, rows, &xv, &w.w.as_view(), w.n, w.k, &mut y)?)
    }

    fn add(&self, h: &mut CudaSlice<bf16>, x: &CudaSlice<bf16>, n: usize) -> Result<()> {
        Ok(host::act::add(&self.gpu, h, x, n)?)
    }

    fn relu2(&self, x: &mut CudaSlice<bf16>, n: usize) -> Result<()> {
        Ok(host::act::relu2(&self.gpu, x, n)?)
    }

    fn conv_decode(
        &self,
        c: &MambaConfig,
        x: In<CudaSlice<bf16>>,
        w: &CudaSlice<bf16>,
        bias: Option<&CudaSlice<bf16>>,
        state: &mut CudaSlice<bf16>,
        slots: &[i32],
        y: Out<CudaSlice<bf16>>,
    ) -> Result<()> {
        let (cd, k) = (c.conv_dim(), c.conv_kernel);
        let slots = Slots::new(&self.gpu, slots, state.len() / (cd * (k - 1)))?;
        let mut y = view_mut(y, slots.len() * cd)?;
        Ok(conv_update(
            &self.gpu,
            ConvShape { dim: cd, k, x_stride: x.stride },
            &view(&x),
            w,
            bias,
            state,
            &slots,
            &mut y,
        )?)
    }

    fn conv_prefill(
        &self,
        c: &MambaConfig,
        x: In<CudaSlice<bf16>>,
        w: &CudaSlice<bf16>,
        bias: Option<&CudaSlice<bf16>>,
        state: &mut CudaSlice<bf16>,
        seqs: &PrefillSeqs,
        y: Out<CudaSlice<bf16>>,
    ) -> Result<()> {
        let (cd, k) = (c.conv_dim(), c.conv_kernel);
        let p = Prefill::new(&self.gpu, &seqs.lens, &seqs.slots, &seqs.initial, state.len() / (cd * (k - 1)))?;
        let mut y = view_mut(y, p.tokens() * cd)?;
        Ok(conv_fwd(&self.gpu, ConvShape { dim: cd, k, x_stride: x.stride }, &view(&x), w, bias, state, &p, &mut y)?)
    }

    fn ssm_decode(
        &self,
        c: &MambaConfig,
        xbc: In<CudaSlice<bf16>>,
        dt: In<CudaSlice<bf16>>,
        heads: (&CudaSlice<f32>, &CudaSlice<f32>, &CudaSlice<f32>),
        state: &mut CudaSlice<f32>,
        slots: &[i32],
        y: Out<CudaSlice<bf16>>,
    ) -> Result<()> {
        let shape = ssm_shape(c);
        let slots = Slots::new(&self.gpu, slots, state.len() / shape.slot_len())?;
        let inputs = ssm_inputs(c, &xbc, &dt);
        let h = SsmHeads { dt_bias: heads.0, a: heads.1, d: Some(heads.2) };
        let mut y = view_mut(y, slots.len() * c.inner())?;
        Ok(ssm_update(&self.gpu, shape, inputs, None, h, state, &slots, None, &mut y)?)
    }

    fn ssm_prefill(
        &self,
        c: &MambaConfig,
        xbc: In<CudaSlice<bf16>>,
        dt: In<CudaSlice<bf16>>,
        heads: (&CudaSlice<f32>, &CudaSlice<f32>, &CudaSlice<f32>),
        state: &mut CudaSlice<f32>,
        seqs: &PrefillSeqs,
        y: Out<CudaSlice<bf16>>,
    ) -> Result<()> {
        let shape = ssm_shape(c);
        let p = Prefill::new(&self.gpu, &seqs.lens, &seqs.slots, &seqs.initial, state.len() / shape.slot_len())?;
        let mut plan = SsdPlan::new(&self.gpu, &p, c.heads, c.head_dim, c.state_size)?;
        let inputs = ssm_inputs(c, &xbc, &dt);
        let h = SsmHeads { dt_bias: heads.0, a: heads.1, d: Some(heads.2) };
        let mut y = view_mut(y, p.tokens() * c.inner())?;
        Ok(ssd_scan(&self.gpu, shape, inputs, h, state, &p, &mut plan, &mut y)?)
    }

    fn moe(
        &self,
        c: &MoeConfig,
        x: In<CudaSlice<bf16>>,
        rows: usize,
        w: &MoeWeights<Cuda>,
        y: Out<CudaSlice<bf16>>,
    ) -> Result<()> {
        let g = &self.gpu;
        let hidden = w.gate.len() / c.experts;
        if x.stride != hidden {
            return Err(unsupported("strided MoE inputs"));
        }
        let xv = x.buf.slice(x.offset..x.offset + rows * hidden);
        let shape = RouteShape {
            experts: c.experts,
            top_k: c.top_k,
            n_group: c.n_group,
            topk_group: c.topk_group,
            renormalize: c.norm_topk_prob,
            scaling: c.routed_scaling_factor,
        };
        let (mut idx, mut wts) = (g.zeros::<i32>(rows * c.top_k)?, g.zeros::<f32>(rows * c.top_k)?);
        route(g, shape, &xv, hidden, &w.gate, &w.score_bias, &mut idx, &mut wts)?;
        // Dispatch on the host (a sync per MoE layer; a device-side dispatch is to come).
        let idx = g.download(&idx)?;
        let routes: Vec<Vec<(usize, f64)>> =
            idx.chunks(c.top_k).map(|r| r.iter().map(|&e| (e as usize, 1.0)).collect()).collect();
        let d = dispatch(&routes, c.experts);
        let mut grouped = g.zeros::<bf16>(d.order.len().max(1) * hidden)?;
        for e in 0..c.experts {
            let (lo, hi) = (d.offsets[e], d.offsets[e + 1]);
            if lo == hi {
                continue;
            }
            let tokens: Vec<u32> = d.order[lo..hi].iter().map(|&(t, _)| t as u32).collect();
            let mut out = grouped.slice_mut(lo * hidden..hi * hidden);
            self.mlp(&xv, &tokens, &w.experts[e], &mut out)?;
        }
        let mut slot = vec![0i32; rows * c.top_k];
        for (j, &(t, k)) in d.order.iter().enumerate() {
            slot[t * c.top_k + k] = j as i32;
        }
        let shared = match &w.shared {
            Some(s) => {
                let all: Vec<u32> = (0..rows as u32).collect();
                let mut out = g.zeros::<bf16>(rows * hidden)?;
                self.mlp(&xv, &all, s, &mut out.as_view_mut())?;
                Some(out)
            }
            None => None,
        };
        let mut y = view_mut(y, rows * hidden)?;
        Ok(combine(g, &grouped, shared.as_ref(), &slot, &wts, c.top_k, hidden, &mut y)?)
    }

    fn attention(
        &self,
        c: &AttentionConfig,
        q: In<CudaSlice<bf16>>,
        k: In<CudaSlice<bf16>>,
        v: In<CudaSlice<bf16>>,
        cache: (&mut CudaSlice<bf16>, &mut CudaSlice<bf16>),
        max_len: usize,
        seqs: (&[usize], &[i32], &[usize]),
        y: Out<CudaSlice<bf16>>,
    ) -> Result<()> {
        let (lens, slots, past) = seqs;
        let mut row_slots = Vec::new();
        let mut row_pos = Vec::new();
        for s in 0..lens.len() {
            if past[s] + lens[s] > max_len {
                return Err(Error::Capacity(format!(
                    "sequence of {} tokens exceeds the KV cache's {max_len}",
                    past[s] + lens[s]
                )));
            }
            row_slots.extend(std::iter::repeat_n(slots[s], lens[s]));
            row_pos.extend((past[s]..past[s] + lens[s]).map(|p| p as u32));
        }
        let shape = AttnShape { heads: c.heads, kv_heads: c.kv_heads, head_dim: c.head_dim, max_len };
        let rows = row_slots.len();
        let mut y = view_mut(y, rows * c.heads * c.head_dim)?;
        let (q, k, v) = (view(&q), view(&k), view(&v));
        Ok(attention(&self.gpu, shape, &q, &k, &v, cache.0, cache.1, &row_slots, &row_pos, &mut y)?)
    }
}
