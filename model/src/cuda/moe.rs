//! MoE layers on the CUDA backend: the experts on the device ([`CudaExperts`], the shared
//! expert as pieces of the routed experts' shape or its own MLP) and how a step's rows run
//! through them ([`CudaExperts::forward`]): routing, then by rows per routing choice
//! ([`CHOICES_MAX_ROWS`]), through the expert kernel ([`EXPERT_KERNEL_MAX_ROWS`]), the grouped
//! GEMM ([`GROUPED_MAX_ROWS`]) or per-expert cuBLASLt GEMMs (see the backend's doc); FP8
//! experts per routing choice as bf16's, then through the expert kernel up to
//! [`FP8_EXPERT_KERNEL_MAX_ROWS`] rows, the FP8 grouped GEMM past them.

use half::bf16;
use host::grouped::{Tiles, experts_mlp_grouped};
use host::moe::{
    Choices, Dispatch, ExpertMlp, ExpertWeights, MAX_EXPERTS, MAX_TOP_K, Router, combine, dispatch, experts_mlp,
    experts_mlp_choices, experts_mlp_choices_after, experts_mlp_gemm, route, route_appended_up,
};
use host::{Buffer, CudaSlice, CudaView, Gpu};

use super::linear::{CudaWeight, Weights, check_linear, gemm_rows, mlp_rows, put_bf16};
use super::{unsupported, view_mut};
use crate::backend::{In, Out};
use crate::config::MoeConfig;
use crate::error::{Error, Result};
use crate::layout::{Linear, Mlp};

/// A MoE layer's experts on the device, each kind in one buffer: `up [experts, inter,
/// hidden]`, `down [experts, hidden, inter]` (the routed experts, then the shared expert's
/// pieces).
pub struct CudaExperts {
    up: Weights,
    down: Weights,
    inter: usize,
    shared: Shared,
}

/// How the CUDA backend runs a MoE layer's shared expert.
enum Shared {
    None,
    /// Cut into this many pieces of the routed experts' shape, stored after them: up rows
    /// `j * inter..` and down columns `j * inter..` are piece j's; the up projection as one
    /// `[pieces * inter, hidden]` matrix, the down projection as one `[hidden, pieces * inter]`
    /// matrix, zero past the shared intermediate size (bf16 layers, when the routed experts
    /// and the pieces are at most `MAX_EXPERTS`). At one row the routing appends the pieces to
    /// the token's choices with weight 1 (when top-k and pieces are at most `MAX_TOP_K`), so
    /// they run in the routed experts' launches and the combine sums them; otherwise the two
    /// matrices go through cuBLASLt.
    Pieces(usize),
    /// Its own MLP (FP8 layers).
    Mlp(Box<(CudaWeight, CudaWeight)>),
}

/// Most rows of a bf16 MoE layer that go through the expert kernel rather than a GEMM: the
/// routed experts alone (`cargo bench --bench moe -- experts/b`, H200, Nano sizes) took 370.0
/// us by the expert kernel at 16 rows against 419.4 by the grouped GEMM on `wgmma` and 467.5
/// on the 128-row `mma.sync` tiles, 969.7 at 64 rows against 706.3 and 809.7; the lines cross
/// near 23 rows (`wgmma`) and 34 (`mma.sync`).
pub const EXPERT_KERNEL_MAX_ROWS: usize = 32;

/// Most rows of an FP8 MoE layer that go through the expert kernel rather than the FP8
/// grouped GEMM (where its sizes allow it: multiples of 16): none past the one row that runs
/// per routing choice. The routed experts alone (`cargo bench --bench moe -- experts/b`, H200,
/// Nano sizes) took 216.5 us by the expert kernel on tensor cores at 8 rows against 187.0 by
/// the FP8 grouped GEMM on `wgmma`, 657.3 against 461.2 at 64; FP8 `Engine::step` (one lease,
/// 2026-12-04) went from 7.264 to 6.467 ms at decode batch 8 and from 22.524 to 17.958 at 64
/// when this went from 64 to 1.
pub const FP8_EXPERT_KERNEL_MAX_ROWS: usize = 1;

/// Most rows of an NVFP4 MoE layer that go through the expert kernels (weight-only, from the
/// codes: the warp mode, or the tensor cores where the experts average two rows or more,
/// `host::gemv::NVFP4_TC_MIN_ROWS`); more dequantize every expert to bf16 and take bf16's path
/// past its expert kernel.
pub const NVFP4_EXPERT_KERNEL_MAX_ROWS: usize = 64;

/// Most rows of a bf16 MoE layer whose experts run as the grouped GEMM on `mma.sync` where the
/// GPU has no `wgmma` kernels; more go through per-expert cuBLASLt GEMMs. Where it has them
/// (sm_90a) the grouped GEMM on `wgmma` takes every row count past the expert kernel's. The
/// routed experts on the H200 (`cargo bench --bench moe -- experts/b`, Nano sizes): the
/// 128-row `mma.sync` tiles took 2098.5 us at 4096 rows against cuBLASLt's 3338.8, 6725.4 at
/// 16384 against 4886.0 (the lines cross between); `wgmma` 1532.4 and 4673.3.
pub const GROUPED_MAX_ROWS: usize = 8192;

/// Most rows of a MoE layer (bf16 or FP8) whose experts run per routing choice, without a
/// dispatch, the down projections and the combining in one launch ([`experts_mlp_choices`]).
pub const CHOICES_MAX_ROWS: usize = 1;

/// Most rows of a MoE layer whose shared expert runs as pieces inside the routed experts'
/// launches (see [`Shared::Pieces`]) rather than as two cuBLASLt GEMMs: the expert kernel
/// streams the weights once per row, so only a single row gains.
pub const SHARED_PIECES_MAX_ROWS: usize = 1;

/// How many pieces of the routed experts' shape (`inter` wide) a bf16 shared expert `shared`
/// wide is cut into beside `routed` experts; 0 (its own MLP) where a dispatch could not count
/// them among the experts.
fn shared_pieces(routed: usize, inter: usize, shared: usize) -> usize {
    let pieces = shared.div_ceil(inter);
    if routed + pieces <= MAX_EXPERTS as usize { pieces } else { 0 }
}

/// The pieces the routing appends to each token's top-k in a step of `rows` rows: all of them
/// at one row (they then run in the routed experts' launches; the expert kernel streams weights
/// once per row, so more rows take cuBLASLt) when the choices fit the routing, else none.
fn appended_pieces(rows: usize, top_k: usize, pieces: usize) -> usize {
    if rows <= SHARED_PIECES_MAX_ROWS && top_k + pieces <= MAX_TOP_K as usize { pieces } else { 0 }
}

/// Writes the shared expert `s` as pieces of the routed experts' shape after the `routed`
/// experts of `up [.., inter, hidden]` and `down [.., hidden, inter]` (see [`Shared::Pieces`]).
fn put_pieces(
    gpu: &Gpu,
    s: &Mlp,
    routed: usize,
    (inter, hidden): (usize, usize),
    (up, down): (&mut CudaSlice<bf16>, &mut CudaSlice<bf16>),
) -> Result<()> {
    let si = s.up.shape()[0];
    for (l, shape) in [(&s.up, [si, hidden]), (&s.down, [hidden, si])] {
        check_linear(l, shape, "the shared expert's")?;
    }
    let at = routed * inter * hidden;
    let padded = si.next_multiple_of(inter);
    // Up: the shared up's rows in order; down: its rows, each padded to `padded` columns.
    put_bf16(gpu, &s.up, &mut up.slice_mut(at..at + si * hidden))?;
    let d = s.down.to_bf16()?;
    let mut wide = vec![bf16::ZERO; hidden * padded];
    for (to, from) in wide.chunks_mut(padded).zip(d.chunks(si)) {
        to[..si].copy_from_slice(from);
    }
    Ok(gpu.upload_into(&wide, &mut down.slice_mut(at..at + hidden * padded))?)
}

impl CudaExperts {
    /// Uploads the routed experts `list` (all of one shape) and the shared expert.
    pub(super) fn upload(gpu: &Gpu, list: &[Mlp], shared: Option<&Mlp>) -> Result<CudaExperts> {
        let first = list.first().ok_or_else(|| Error::Unsupported("a MoE layer without experts".into()))?;
        let [inter, hidden] = first.up.shape();
        let bf16 = |m: &Mlp| [&m.up, &m.down].iter().all(|l| l.fp8.is_none() && l.nvfp4.is_none());
        let pieces = match shared {
            Some(s) if bf16(s) && list.iter().all(bf16) => shared_pieces(list.len(), inter, s.up.shape()[0]),
            _ => 0,
        };
        let ups: Vec<&Linear> = list.iter().map(|m| &m.up).collect();
        let downs: Vec<&Linear> = list.iter().map(|m| &m.down).collect();
        let mut up = Weights::upload(gpu, &ups, [inter, hidden], pieces)?;
        let mut down = Weights::upload(gpu, &downs, [hidden, inter], pieces)?;
        let shared = match (shared, &mut up, &mut down) {
            (None, ..) => Shared::None,
            (Some(s), Weights::Bf16(up), Weights::Bf16(down)) if pieces > 0 => {
                put_pieces(gpu, s, list.len(), (inter, hidden), (up, down))?;
                Shared::Pieces(pieces)
            }
            (Some(s), ..) => {
                Shared::Mlp(Box::new((CudaWeight::upload(gpu, &s.up)?, CudaWeight::upload(gpu, &s.down)?)))
            }
        };
        Ok(CudaExperts { up, down, inter, shared })
    }

    /// The MoE layer over `rows` rows of `x` into `y`, routed by `router`.
    pub(super) fn forward(
        &self,
        g: &Gpu,
        c: &MoeConfig,
        (x, rows): (In<Buffer<bf16>>, usize),
        router: Router,
        y: Out<Buffer<bf16>>,
    ) -> Result<()> {
        let (xv, hidden) = moe_input(c, (x, rows), &router)?;
        let pieces = match self.shared {
            Shared::Pieces(n) => n,
            _ => 0,
        };
        let mut shape = c.route_shape();
        shape.shared = appended_pieces(rows, c.top_k, pieces);
        let choices = shape.choices();
        // SAFETY (the uninitialized buffers below): routing writes every idx and weight, the
        // experts every grouped row, the shared expert every row of its output, each before
        // the next operation reads it.
        let (mut idx, mut wts) = unsafe { (g.scratch::<i32>(rows * choices)?, g.scratch::<f32>(rows * choices)?) };
        // One token whose routing appends the shared expert's pieces: their up projections in
        // the routing's launch (`h`, the choices' hidden rows, its last rows written there).
        let mut h = match &self.up {
            Weights::Bf16(up) if shape.shared > 0 && rows <= CHOICES_MAX_ROWS => {
                // SAFETY: the routing writes the pieces' rows, the choices launch the others,
                // before the down projections read them.
                let mut h = unsafe { g.scratch::<bf16>(choices * self.inter) }?;
                route_appended_up(g, shape, (&xv, hidden), router, (&mut idx, &mut wts), (up, self.inter), &mut h)?;
                Some(h)
            }
            _ => {
                route(g, shape, (&xv, hidden), router, (&mut idx, &mut wts))?;
                None
            }
        };
        let shared = match (&self.shared, &self.up, &self.down) {
            (Shared::Mlp(mlp), ..) => {
                // SAFETY: the down projection writes all rows * hidden values before combine.
                let mut out = unsafe { g.scratch::<bf16>(rows * hidden) }?;
                mlp_rows(g, &xv, rows, (&mlp.0, &mlp.1), &mut out.as_view_mut())?;
                Some(out)
            }
            (Shared::Pieces(n), Weights::Bf16(up), Weights::Bf16(down)) if shape.shared == 0 => {
                // The pieces together are the shared expert's up and down projections, padded
                // with zeros to n * inter.
                let (si, at) = (n * self.inter, c.experts * self.inter * hidden);
                let (up, down) = (up.slice(at..at + si * hidden), down.slice(at..at + si * hidden));
                // SAFETY: the down projection writes all rows * hidden values before combine.
                let mut out = unsafe { g.scratch::<bf16>(rows * hidden) }?;
                // SAFETY: the up projection writes all rows * si values before they are read.
                let mut h = unsafe { g.scratch::<bf16>(rows * si) }?;
                gemm_rows(g, &xv, rows, &up, (si, hidden), true, &mut h.as_view_mut())?;
                gemm_rows(g, &h.as_view(), rows, &down, (hidden, si), false, &mut out.as_view_mut())?;
                Some(out)
            }
            _ => None,
        };
        let mut y = view_mut(y, rows * hidden)?;
        let experts = c.experts + pieces;
        if rows <= CHOICES_MAX_ROWS {
            let ch = Choices { idx: &idx, weight: &wts, per: choices, experts };
            let pieces = (pieces, shared.as_deref());
            match (&mut h, &self.up, &self.down) {
                (Some(h), Weights::Bf16(up), Weights::Bf16(down)) => {
                    let mlp = ExpertMlp { up, down, inter: self.inter, hidden };
                    experts_mlp_choices_after(g, ch, &xv, mlp, pieces, (h, shape.shared), &mut y)?
                }
                _ => {
                    let mlp = ExpertMlp { up: self.up.view(), down: self.down.view(), inter: self.inter, hidden };
                    experts_mlp_choices(g, ch, &xv, mlp, pieces, &mut y)?
                }
            }
            return Ok(());
        }
        let mut d = Dispatch::new(g, experts, choices, rows)?;
        dispatch(g, &idx, &mut d)?;
        // SAFETY: each expert path below writes every dispatched row before combine reads it.
        let mut grouped = unsafe { g.scratch::<bf16>(d.entries() * hidden) }?;
        match (&self.up, &self.down) {
            (Weights::Bf16(up), Weights::Bf16(down)) if rows > EXPERT_KERNEL_MAX_ROWS => {
                let mlp = ExpertMlp { up, down, inter: self.inter, hidden };
                bf16_experts(g, (&d, rows), &xv, mlp, &mut grouped)?
            }
            (Weights::Nvfp4 { .. }, Weights::Nvfp4 { .. }) if rows > NVFP4_EXPERT_KERNEL_MAX_ROWS => {
                let up = self.up.dequantized(g, c.experts, (self.inter, hidden))?;
                let down = self.down.dequantized(g, c.experts, (hidden, self.inter))?;
                let mlp = ExpertMlp { up: &*up, down: &*down, inter: self.inter, hidden };
                bf16_experts(g, (&d, rows), &xv, mlp, &mut grouped)?
            }
            (Weights::Fp8 { .. }, Weights::Fp8 { .. })
                if rows > FP8_EXPERT_KERNEL_MAX_ROWS
                    && pieces == 0
                    && self.inter.is_multiple_of(16)
                    && hidden.is_multiple_of(16) =>
            {
                let mlp = ExpertMlp { up: self.up.view(), down: self.down.view(), inter: self.inter, hidden };
                experts_mlp_grouped(g, &d, &xv, mlp, &mut grouped)?
            }
            (up, down) => {
                let mlp = ExpertMlp { up: up.view(), down: down.view(), inter: self.inter, hidden };
                experts_mlp(g, &d, &xv, mlp, pieces, &mut grouped)?
            }
        }
        Ok(combine(g, (&grouped, hidden), shared.as_deref(), (d.slot(), &wts, choices), &mut y)?)
    }
}

/// The dispatched rows of bf16 experts `mlp` (`rows` tokens) past the expert kernel's rows:
/// the grouped GEMM (on `wgmma` where the GPU has it, else on `mma.sync` up to
/// [`GROUPED_MAX_ROWS`]), otherwise per-expert cuBLASLt GEMMs.
fn bf16_experts(
    g: &Gpu,
    (d, rows): (&Dispatch, usize),
    xv: &CudaView<bf16>,
    mlp: ExpertMlp<&CudaSlice<bf16>>,
    grouped: &mut Buffer<bf16>,
) -> Result<()> {
    let wgmma = Tiles::for_grouped(g) == Tiles::Wgmma;
    if (rows <= GROUPED_MAX_ROWS || wgmma) && mlp.inter.is_multiple_of(8) && mlp.hidden.is_multiple_of(8) {
        let (up, down) = (ExpertWeights::Bf16(mlp.up), ExpertWeights::Bf16(mlp.down));
        let w = ExpertMlp { up, down, inter: mlp.inter, hidden: mlp.hidden };
        Ok(experts_mlp_grouped(g, d, xv, w, grouped)?)
    } else {
        Ok(experts_mlp_gemm(g, d, xv, mlp, grouped)?)
    }
}

/// A MoE layer's `rows` rows of `x` (contiguous: the kernels take no stride) and the hidden
/// size, read from the router's `[experts, hidden]`.
fn moe_input<'a>(
    c: &MoeConfig,
    (x, rows): (In<'a, Buffer<bf16>>, usize),
    router: &Router,
) -> Result<(CudaView<'a, bf16>, usize)> {
    let hidden = router.gate.len() / c.experts;
    if x.stride != hidden {
        return Err(unsupported("strided MoE inputs"));
    }
    Ok((x.buf.slice(x.offset..x.offset + rows * hidden), hidden))
}

/// The routed experts of each of `rows` rows of `x` (`top_k` ids a row) as
/// [`CudaExperts::forward`] routes them, on the host.
pub(super) fn choices(g: &Gpu, c: &MoeConfig, x: (In<Buffer<bf16>>, usize), router: Router) -> Result<Vec<u32>> {
    let rows = x.1;
    let (xv, hidden) = moe_input(c, x, &router)?;
    let (mut idx, mut wts) = (g.zeros::<i32>(rows * c.top_k)?, g.zeros::<f32>(rows * c.top_k)?);
    route(g, c.route_shape(), (&xv, hidden), router, (&mut idx, &mut wts))?;
    Ok(g.download(&idx)?.into_iter().map(|e| e as u32).collect())
}

#[cfg(test)]
mod tests {
    use super::{appended_pieces, shared_pieces};

    #[test]
    fn shared_expert_pieces_only_where_the_kernels_take_them() {
        // Nano: 128 experts of 1856, a shared expert of 3712; one wider; at the dispatch's
        // limit of 256 experts and past it.
        assert_eq!(shared_pieces(128, 1856, 3712), 2);
        assert_eq!(shared_pieces(128, 1856, 3713), 3);
        assert_eq!(shared_pieces(254, 32, 64), 2);
        assert_eq!(shared_pieces(255, 32, 64), 0);
        // Appended at one row only, and only when top-k and pieces fit the routing's 16.
        assert_eq!(appended_pieces(1, 6, 2), 2);
        assert_eq!(appended_pieces(2, 6, 2), 0);
        assert_eq!(appended_pieces(1, 14, 2), 2);
        assert_eq!(appended_pieces(1, 15, 3), 0);
        assert_eq!(appended_pieces(1, 6, 0), 0);
    }
}
