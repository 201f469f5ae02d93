//! MoE layers on the CUDA backend: the experts on the device ([`CudaExperts`], the shared expert as
//! pieces of the routed experts' shape, its own MLP, or both: [`Shared`]; the pieces' layout in
//! `pieces.rs`) and the execution of a step's plan ([`CudaExperts::execute`]: route, shared expert,
//! dispatch, experts, combine). Which path a step takes is `plan.rs`'s ([`MoePlan`], with the row
//! counts where the paths switch: per routing choice up to [`CHOICES_MAX_ROWS`], the expert kernel
//! up to [`EXPERT_KERNEL_MAX_ROWS`] (FP8 [`FP8_EXPERT_KERNEL_MAX_ROWS`], NVFP4
//! [`NVFP4_EXPERT_KERNEL_MAX_ROWS`]), then the grouped GEMM (NVFP4 on the 64-row tiles up to
//! [`NVFP4_NARROW_MAX_ROWS`] where there is `wgmma`) or, without `wgmma` past [`GROUPED_MAX_ROWS`],
//! per-expert cuBLASLt GEMMs).

use half::bf16;
use host::grouped::{Tiles, experts_mlp_grouped, experts_mlp_grouped_as};
use host::moe::{
    Appended, Choices, Dispatch, ExpertMlp, ExpertWeights, Picks, SharedExpert, combine, dispatch, experts_mlp,
    experts_mlp_choices, experts_mlp_choices_after, experts_mlp_gemm,
};
use host::router::{AppendedUp, Routed, Router, route, route_appended_up};
use host::{Buffer, CudaSlice, CudaView, Gpu};

mod pieces;
mod plan;
#[cfg(test)]
mod tests;

use pieces::put_pieces;
pub use plan::{
    CHOICES_MAX_ROWS, EXPERT_KERNEL_MAX_ROWS, FP8_EXPERT_KERNEL_MAX_ROWS, GROUPED_MAX_ROWS,
    NVFP4_EXPERT_KERNEL_MAX_ROWS, NVFP4_NARROW_MAX_ROWS, SHARED_PIECES_MAX_ROWS,
};
use plan::{ExpertPath, Format, MoeKind, MoePlan, SharedForm, SharedPath, shared_pieces};

use super::linear::{CudaWeight, Weights, gemm_rows, mlp_rows};
use super::{Cuda, unsupported, view_mut};
use crate::backend::{ExpertsOps, In, Out};
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
    /// Its own MLP (FP8 and NVFP4 layers that take no pieces: [`Shared::MlpAndPieces`] says
    /// which do).
    Mlp(Box<(CudaWeight, CudaWeight)>),
    /// FP8 layers whose routed and shared experts all quantize their inputs with static scales,
    /// and NVFP4 layers (pieces of a multiple of 16 columns): its own MLP for steps of more than
    /// one row (the quantized GEMMs take no pieces), and as many pieces as [`Shared::Pieces`]
    /// (each with its projection's scales) for a step of one row, appended to the token's
    /// choices as there, so that the shared expert runs in the routed experts' two launches
    /// instead of two launches of its own. Its weights are held twice (FP8: 20 MB a Nano layer,
    /// 1.4% of the checkpoint). FP8 inputs of a piece are quantized with the same static scales
    /// as the MLP's, element by element; the down projection's pieces are rounded to bf16 apart
    /// before the combine sums them, as bf16's.
    MlpAndPieces(Box<(CudaWeight, CudaWeight)>, usize),
}

impl CudaExperts {
    /// Uploads the routed experts `list` (all of one shape) and the shared expert.
    pub(super) fn upload(gpu: &Gpu, list: &[Mlp], shared: Option<&Mlp>) -> Result<CudaExperts> {
        let first = list.first().ok_or_else(|| Error::Unsupported("a MoE layer without experts".into()))?;
        let [inter, hidden] = first.up.shape();
        let bf16 = |m: &Mlp| [&m.up, &m.down].iter().all(|l| l.fp8.is_none() && l.nvfp4.is_none());
        let fp8 = |m: &Mlp| [&m.up, &m.down].iter().all(|l| l.fp8.is_some_and(|f| f.input_scale.is_some()));
        let nvfp4 = |m: &Mlp| [&m.up, &m.down].iter().all(|l| l.nvfp4.is_some()) && inter.is_multiple_of(16);
        let formats: [&dyn Fn(&Mlp) -> bool; 3] = [&bf16, &fp8, &nvfp4];
        let pieces = match shared {
            Some(s) if formats.iter().any(|f| f(s) && list.iter().all(f)) => {
                shared_pieces(list.len(), inter, s.up.shape()[0])
            }
            _ => 0,
        };
        let ups: Vec<&Linear> = list.iter().map(|m| &m.up).collect();
        let downs: Vec<&Linear> = list.iter().map(|m| &m.down).collect();
        let mut up = Weights::upload(gpu, &ups, [inter, hidden], pieces)?;
        let mut down = Weights::upload(gpu, &downs, [hidden, inter], pieces)?;
        let shared = match shared {
            None => Shared::None,
            Some(s) => {
                if pieces > 0 {
                    put_pieces(gpu, s, list.len(), (inter, hidden), (&mut up, &mut down))?;
                }
                let mlp =
                    || Ok::<_, Error>(Box::new((CudaWeight::upload(gpu, &s.up)?, CudaWeight::upload(gpu, &s.down)?)));
                match &up {
                    Weights::Bf16(_) if pieces > 0 => Shared::Pieces(pieces),
                    _ if pieces > 0 => Shared::MlpAndPieces(mlp()?, pieces),
                    _ => Shared::Mlp(mlp()?),
                }
            }
        };
        Ok(CudaExperts { up, down, inter, shared })
    }

    /// What the layer is, for its plans.
    fn kind(&self, g: &Gpu, c: &MoeConfig, hidden: usize) -> MoeKind {
        let format = match (&self.up, &self.down) {
            (Weights::Bf16(_), Weights::Bf16(_)) => Format::Bf16,
            (Weights::Fp8 { .. }, Weights::Fp8 { .. }) => Format::Fp8,
            (Weights::Nvfp4 { .. }, Weights::Nvfp4 { .. }) => Format::Nvfp4,
            _ => Format::Mixed,
        };
        let shared = match self.shared {
            Shared::None => SharedForm::None,
            Shared::Mlp(_) => SharedForm::Mlp,
            Shared::Pieces(n) => SharedForm::Pieces(n),
            Shared::MlpAndPieces(_, n) => SharedForm::MlpAndPieces(n),
        };
        let wgmma = Tiles::for_grouped(g) == Tiles::Wgmma;
        MoeKind { format, shared, top_k: c.top_k, inter: self.inter, hidden, wgmma }
    }

    /// The MoE layer over `rows` rows of `x` into `y`, routed by `router`: the step's
    /// [`MoePlan`] run as route, shared expert, dispatch, experts and combine.
    fn execute(
        &self,
        g: &Gpu,
        c: &MoeConfig,
        (x, rows): (In<Buffer<bf16>>, usize),
        router: Router,
        y: Out<Buffer<bf16>>,
    ) -> Result<()> {
        let (xv, hidden) = moe_input(c, (x, rows), &router)?;
        let plan = MoePlan::new(&self.kind(g, c, hidden), rows);
        let pieces = match self.shared {
            Shared::Pieces(n) | Shared::MlpAndPieces(_, n) => n,
            _ => 0,
        };
        let mut shape = c.route_shape();
        shape.shared = plan.appended();
        let choices = shape.choices();
        // SAFETY (the uninitialized buffers below): routing writes every idx and weight, the
        // experts every grouped row, the shared expert every row of its output, each before
        // the next operation reads it.
        let (mut idx, mut wts) = unsafe { (g.scratch::<i32>(rows * choices)?, g.scratch::<f32>(rows * choices)?) };
        // Pieces appended to the choices of a step run per choice: their up projections in the
        // routing's launch (`h`, the choices' hidden rows, its last rows written there).
        let mut h = match &self.up {
            Weights::Bf16(up) if shape.shared > 0 && plan.experts == ExpertPath::Choices => {
                // SAFETY: the routing writes the pieces' rows, the choices launch the others,
                // before the down projections read them.
                let mut h = unsafe { g.scratch::<bf16>(choices * self.inter) }?;
                route_appended_up(
                    g,
                    shape,
                    (&xv, hidden),
                    router,
                    Routed { idx: &mut idx, weight: &mut wts },
                    AppendedUp { up, inter: self.inter, h: &mut h },
                )?;
                Some(h)
            }
            _ => {
                route(g, shape, (&xv, hidden), router, Routed { idx: &mut idx, weight: &mut wts })?;
                None
            }
        };
        let shared = match (plan.shared, &self.shared, &self.up, &self.down) {
            (SharedPath::Mlp, Shared::Mlp(mlp) | Shared::MlpAndPieces(mlp, _), ..) => {
                // SAFETY: the down projection writes all rows * hidden values before combine.
                let mut out = unsafe { g.scratch::<bf16>(rows * hidden) }?;
                mlp_rows(g, &xv, rows, (&mlp.0, &mlp.1), &mut out.as_view_mut())?;
                Some(out)
            }
            (SharedPath::PiecesGemm, Shared::Pieces(n), Weights::Bf16(up), Weights::Bf16(down)) => {
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
            (SharedPath::None | SharedPath::Appended(_), ..) => None,
            (path, ..) => {
                return Err(Error::Unsupported(format!("a shared expert held otherwise than {path:?} takes")));
            }
        };
        let mut y = view_mut(y, rows * hidden)?;
        let experts = c.experts + pieces;
        if plan.experts == ExpertPath::Choices {
            let ch = Choices { idx: &idx, weight: &wts, per: choices, experts };
            let pieces = SharedExpert { pieces, out: shared.as_deref() };
            match (&mut h, &self.up, &self.down) {
                (Some(h), Weights::Bf16(up), Weights::Bf16(down)) => {
                    let mlp = ExpertMlp { up, down, inter: self.inter, hidden };
                    experts_mlp_choices_after(g, ch, &xv, mlp, pieces, Appended { h, rows: shape.shared }, &mut y)?
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
        // NVFP4 weights dequantized to bf16 for bf16's GEMMs, where the plan says so.
        let dequantized = match plan.experts {
            ExpertPath::Grouped { dequantize: true } | ExpertPath::PerExpertGemm { dequantize: true } => Some((
                self.up.dequantized(g, experts, (self.inter, hidden))?,
                self.down.dequantized(g, experts, (hidden, self.inter))?,
            )),
            _ => None,
        };
        let (up, down) = match &dequantized {
            Some((up, down)) => (ExpertWeights::Bf16(up), ExpertWeights::Bf16(down)),
            None => (self.up.view(), self.down.view()),
        };
        let mlp = ExpertMlp { up, down, inter: self.inter, hidden };
        match (plan.experts, mlp) {
            (ExpertPath::Grouped { .. }, mlp) => experts_mlp_grouped(g, &d, &xv, mlp, &mut grouped)?,
            (ExpertPath::GroupedNarrow, mlp) => experts_mlp_grouped_as(g, &d, &xv, mlp, Tiles::Narrow, &mut grouped)?,
            (ExpertPath::ExpertKernel, mlp) => experts_mlp(g, &d, &xv, mlp, pieces, &mut grouped)?,
            (
                ExpertPath::PerExpertGemm { .. },
                ExpertMlp { up: ExpertWeights::Bf16(up), down: ExpertWeights::Bf16(down), .. },
            ) => experts_mlp_gemm(g, &d, &xv, ExpertMlp { up, down, inter: self.inter, hidden }, &mut grouped)?,
            (path, _) => return Err(Error::Unsupported(format!("MoE experts of these weights by {path:?}"))),
        }
        Ok(combine(
            g,
            (&grouped, hidden),
            shared.as_deref(),
            Picks { slot: d.slot(), weight: &wts, top_k: choices },
            &mut y,
        )?)
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
/// [`CudaExperts::execute`] routes them, on the host.
fn choices(g: &Gpu, c: &MoeConfig, x: (In<Buffer<bf16>>, usize), router: Router) -> Result<Vec<u32>> {
    let rows = x.1;
    let (xv, hidden) = moe_input(c, x, &router)?;
    let (mut idx, mut wts) = (g.zeros::<i32>(rows * c.top_k)?, g.zeros::<f32>(rows * c.top_k)?);
    route(g, c.route_shape(), (&xv, hidden), router, Routed { idx: &mut idx, weight: &mut wts })?;
    Ok(g.download(&idx)?.into_iter().map(|e| e as u32).collect())
}

impl ExpertsOps<Cuda> for CudaExperts {
    fn forward(
        &self,
        cuda: &Cuda,
        c: &MoeConfig,
        (gate, bias): (&Buffer<bf16>, &CudaSlice<f32>),
        x: (In<Buffer<bf16>>, usize),
        y: Out<Buffer<bf16>>,
    ) -> Result<()> {
        self.execute(&cuda.gpu, c, x, Router { gate, bias }, y)
    }

    fn choices(
        &self,
        cuda: &Cuda,
        c: &MoeConfig,
        (gate, bias): (&Buffer<bf16>, &CudaSlice<f32>),
        x: (In<Buffer<bf16>>, usize),
    ) -> Result<Vec<u32>> {
        choices(&cuda.gpu, c, x, Router { gate, bias })
    }
}
