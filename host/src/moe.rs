//! Launchers of the MoE experts: dispatch, the expert kernels and GEMMs, combining
//! (kernels-gpu/src/moe.rs; reference: cpu/moe.rs). The routing is [`crate::router`]'s.

use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut};
use half::bf16;
use kernels_gpu::gemv::WARP_BLOCK_ROWS;
use kernels_gpu::moe::{COMBINE_ROWS, CombineParams, DispatchParams, ExpertCombineParams, ExpertParams};
/// The kernels' limits: experts a dispatch groups, choices per token.
pub use kernels_gpu::moe::{MAX_EXPERTS, MAX_TOP_K};
use kernels_gpu::qgemv::QG_ROWS;
use kernels_gpu::{Kernel, entry};

use crate::args::Len;
use crate::check::{Check, MAX_ELEMS, MAX_ROWS};
use crate::error::Result;
use crate::gemv::{FP8_TC_MIN_ROWS, NVFP4_TC_MIN_ROWS, Proj};
use crate::gpu::{Gpu, Grid};

/// Routing choices grouped by expert, on the device (written by [`dispatch`]): expert `e`'s
/// rows are `offsets[e]..offsets[e + 1]` of the grouped order, `token[j]` is the token of
/// grouped row `j`, `slot[t * top_k + k]` the grouped row of token t's k-th choice, and
/// `active[..active_count]` the experts with rows. Within an expert the order of its rows is
/// unspecified (atomics); every consumer computes each row on its own. The buffers are read
/// only from outside, and the consumers refuse a `Dispatch` that [`dispatch`] has not filled,
/// so the kernels can index with them unchecked.
pub struct Dispatch {
    offsets: CudaSlice<u32>,
    active: CudaSlice<u32>,
    active_count: CudaSlice<u32>,
    token: CudaSlice<u32>,
    slot: CudaSlice<i32>,
    experts: usize,
    top_k: usize,
    filled: bool,
}

/// Most routing choices one dispatch groups: the kernel's f32 prefix sums are exact below.
const MAX_ENTRIES: usize = 1 << 24;

impl Dispatch {
    /// Buffers for `rows` tokens choosing `top_k` of `experts` each.
    pub fn new(gpu: &Gpu, experts: usize, top_k: usize, rows: usize) -> Result<Dispatch> {
        let c = Check(Kernel::MoeDispatch.name());
        c.choices(experts, top_k)?;
        c.count("rows", (MAX_ENTRIES - 1) / top_k, rows)?;
        let entries = rows * top_k;
        // SAFETY: nothing reads these before `dispatch` fills them (`filled`), and it writes
        // every element a reader uses: all offsets, the count, active[..count], every token
        // and slot.
        unsafe {
            Ok(Dispatch {
                offsets: gpu.uninit(experts + 1)?,
                active: gpu.uninit(experts)?,
                active_count: gpu.uninit(1)?,
                token: gpu.uninit(entries)?,
                slot: gpu.uninit(entries)?,
                experts,
                top_k,
                filled: false,
            })
        }
    }

    /// Grouped rows (`rows * top_k`).
    pub fn entries(&self) -> usize {
        self.slot.len()
    }

    /// Tokens (`entries / top_k`).
    pub fn rows(&self) -> usize {
        self.slot.len() / self.top_k
    }

    /// Experts.
    pub fn experts(&self) -> usize {
        self.experts
    }

    /// `[experts + 1]` start of each expert's grouped rows; the last is `entries`.
    pub fn offsets(&self) -> &CudaSlice<u32> {
        &self.offsets
    }

    /// `[experts]` the experts with rows, ascending, in the first [`Dispatch::active_count`].
    pub fn active(&self) -> &CudaSlice<u32> {
        &self.active
    }

    /// `[1]` how many experts have rows.
    pub fn active_count(&self) -> &CudaSlice<u32> {
        &self.active_count
    }

    /// `[entries]` grouped row -> its token.
    pub fn token(&self) -> &CudaSlice<u32> {
        &self.token
    }

    /// `[entries]` choice `t * top_k + k` -> its grouped row.
    pub fn slot(&self) -> &CudaSlice<i32> {
        &self.slot
    }

    /// Fails unless [`dispatch`] filled this (`what`: the consumer).
    pub(crate) fn check_filled(&self, what: &'static str) -> Result<()> {
        Check(what).that("dispatch", self.filled, "one filled by `dispatch`", "one never dispatched")
    }
}

/// The weights of one projection of every expert, `[experts, n, k]`: a matrix (and its scales)
/// per expert.
pub use crate::gemv::Weights as ExpertWeights;

/// Groups the routing choices `idx [rows, top_k]` (from [`route`]) by expert into `d`. An
/// expert id outside `0..experts` traps the kernel (an error at the next synchronization).
pub fn dispatch(gpu: &Gpu, idx: &CudaSlice<i32>, d: &mut Dispatch) -> Result<()> {
    let k = entry::MOE_DISPATCH;
    let a = gpu.args(k);
    let p = DispatchParams {
        idx: a.input("idx", idx, Len::Exactly(d.entries()))?,
        offsets: a.output("offsets", &mut d.offsets, Len::Any)?,
        active: a.output("active", &mut d.active, Len::Any)?,
        active_count: a.output("active_count", &mut d.active_count, Len::Any)?,
        token: a.output("token", &mut d.token, Len::Any)?,
        slot: a.output("slot", &mut d.slot, Len::Any)?,
        entries: d.entries() as u32,
        top_k: d.top_k as u32,
        experts: d.experts as u32,
    };
    // SAFETY: the buffers have the extents Dispatch::new gave them for these counts (experts
    // <= MAX_EXPERTS, entries < 2^24); out-of-range ids trap in the kernel.
    unsafe { gpu.launch(Grid::new(k, (1, 1, 1)), p) }?;
    d.filled = true;
    Ok(())
}

/// Routing choices as [`route`] writes them: `idx` and `weight` `[rows, per]` (at most 65535
/// choices), each id below `experts` (a larger one traps the kernels that use it).
#[derive(Clone, Copy)]
pub struct Choices<'a> {
    pub idx: &'a CudaSlice<i32>,
    pub weight: &'a CudaSlice<f32>,
    /// Choices per token.
    pub per: usize,
    pub experts: usize,
}

impl Choices<'_> {
    /// Checks the shape for `what` (at most 65535 choices: a block row each); the tokens.
    fn rows(&self, what: &'static str) -> Result<usize> {
        let c = Check(what);
        c.choices(self.experts, self.per)?;
        c.count("idx", 65535, self.idx.len())?;
        let rows = self.idx.len() / self.per;
        c.that(
            "idx",
            self.idx.len() == rows * self.per && rows > 0,
            format!("whole rows of {}", self.per),
            self.idx.len(),
        )?;
        c.len("weight", self.idx.len(), self.weight.len())?;
        Ok(rows)
    }
}

/// The rows an expert launch computes: the grouped rows of a dispatch, or each routing choice
/// (no dispatch).
#[derive(Clone, Copy)]
enum ExpertRows<'a> {
    Routed {
        d: &'a Dispatch,
        by_token: bool,
        pieces: usize,
    },
    /// Every choice, or (one token) only its first `usize`: the rest computed elsewhere.
    Choices(Choices<'a>, usize),
}

/// A MoE layer's expert MLPs `down_e(relu(up_e x)^2)`: `up [experts, inter, hidden]`, `down
/// [experts, hidden, inter]` (`W`: [`ExpertWeights`], or bf16 ones).
#[derive(Clone, Copy)]
pub struct ExpertMlp<W> {
    pub up: W,
    pub down: W,
    pub inter: usize,
    pub hidden: usize,
}

impl<W: Copy> ExpertMlp<W> {
    /// The up projections, relu^2 fused.
    pub(crate) fn up_proj(&self) -> Proj<W> {
        Proj { w: self.up, n: self.inter, k: self.hidden, relu2: true }
    }

    /// The down projections.
    pub(crate) fn down_proj(&self) -> Proj<W> {
        Proj { w: self.down, n: self.hidden, k: self.inter, relu2: false }
    }
}

impl<'a> ExpertMlp<&'a CudaSlice<bf16>> {
    /// These bf16 weights as [`ExpertWeights`].
    fn weights(self) -> ExpertMlp<ExpertWeights<'a>> {
        let (up, down) = (ExpertWeights::Bf16(self.up), ExpertWeights::Bf16(self.down));
        ExpertMlp { up, down, inter: self.inter, hidden: self.hidden }
    }
}

/// One projection `p` of every expert with rows in `d`: grouped row `j` of expert `e` gets
/// `out[j] = f(x_j W_e^T)`, `x_j` row `token[j]` of `x` when `by_token` (the layer input), row
/// `j` otherwise (the grouped hidden rows); `p.w [experts, n, k]`, except that the last
/// `pieces` experts may be the column blocks of one `[n, pieces * k]` matrix in their place (a
/// shared expert's down projection cut into pieces; see [`experts_mlp`]). FP8 weights: W8A8,
/// each input row quantized to e4m3 first. For small batches: each warp streams its weight rows
/// once per [`kernels_gpu::gemv::WARP_TOKENS`] rows of the expert (again from cache for the
/// next), as [`crate::gemv::gemv`] for one matrix; FP8 weights from [`FP8_TC_MIN_ROWS`] tokens
/// and NVFP4 ones from [`NVFP4_TC_MIN_ROWS`] dispatched rows an expert on average (entries
/// against experts) on tensor cores, eight rows of an expert a pass over its weights.
pub fn experts(
    gpu: &Gpu,
    d: &Dispatch,
    x: &impl DevicePtr<bf16>,
    by_token: bool,
    p: Proj<ExpertWeights>,
    pieces: usize,
    out: &mut impl DevicePtrMut<bf16>,
) -> Result<()> {
    project(gpu, ExpertRows::Routed { d, by_token, pieces }, x, p, out)
}

/// [`experts`], and the per-choice up projections of [`experts_mlp_choices`].
fn project(
    gpu: &Gpu,
    rows: ExpertRows,
    x: &impl DevicePtr<bf16>,
    p: Proj<ExpertWeights>,
    out: &mut impl DevicePtrMut<bf16>,
) -> Result<()> {
    let kern = match (p.w, rows) {
        (ExpertWeights::Bf16(_), ExpertRows::Choices(..)) => entry::MOE_EXPERT_CHOICES,
        (ExpertWeights::Fp8 { .. }, ExpertRows::Choices(..)) => entry::MOE_EXPERT_CHOICES_FP8,
        (ExpertWeights::Bf16(_), _) => entry::MOE_EXPERT,
        (ExpertWeights::Fp8 { .. }, ExpertRows::Routed { d, .. }) if d.rows() >= FP8_TC_MIN_ROWS => {
            entry::MOE_EXPERT_TC_FP8
        }
        (ExpertWeights::Fp8 { .. }, _) => entry::MOE_EXPERT_FP8,
        (ExpertWeights::Nvfp4 { .. }, ExpertRows::Choices(..)) => entry::MOE_EXPERT_CHOICES_NVFP4,
        (ExpertWeights::Nvfp4 { .. }, ExpertRows::Routed { d, .. }) if d.entries() >= NVFP4_TC_MIN_ROWS * d.experts => {
            entry::MOE_EXPERT_TC_NVFP4
        }
        (ExpertWeights::Nvfp4 { .. }, _) => entry::MOE_EXPERT_NVFP4,
    };
    let a = gpu.args(kern);
    let c = a.check();
    let (experts, entries, x_rows) = match rows {
        ExpertRows::Routed { d, by_token, pieces } => {
            d.check_filled(kern.name())?;
            c.that("pieces", pieces <= d.experts, format!("at most the {} experts", d.experts), pieces)?;
            // The tokens are 0..entries / top_k (dispatch writes choice i's token as i / top_k).
            (d.experts, d.entries(), if by_token { d.rows() } else { d.entries() })
        }
        ExpertRows::Choices(ch, launched) => {
            let tokens = ch.rows(kern.name())?;
            let all = ch.idx.len();
            c.that("choices", launched == all || (tokens == 1 && launched <= all), "all, or of one token", launched)?;
            (ch.experts, all, tokens)
        }
    };
    let o = p.operands(&a, (x, x_rows), experts, (out, entries))?;
    let null = core::ptr::null();
    let (idx, per) = match rows {
        ExpertRows::Choices(ch, _) => (a.input("idx", ch.idx, Len::Any)?, ch.per),
        _ => (core::ptr::null(), 1),
    };
    let (x_row, offsets, active, active_count, slots, pieces) = match rows {
        ExpertRows::Routed { d, by_token, pieces } => (
            if by_token { a.input("token", &d.token, Len::Any)? } else { null },
            a.input("offsets", &d.offsets, Len::Any)?,
            a.input("active", &d.active, Len::Any)?,
            a.input("active_count", &d.active_count, Len::Any)?,
            d.experts.min(d.entries()) as u32,
            pieces,
        ),
        ExpertRows::Choices(_, launched) => (null, null, null, null, launched as u32, 0),
    };
    let params = ExpertParams {
        o,
        x_row,
        offsets,
        active,
        active_count,
        piece0: (experts - pieces) as u32,
        pieces: pieces as u32,
        idx,
        per: per as u32,
        experts: experts as u32,
    };
    let block_rows = match kern.kernel {
        Kernel::MoeExpertTcFp8 | Kernel::MoeExpertTcNvfp4 => QG_ROWS,
        _ => WARP_BLOCK_ROWS,
    };
    // SAFETY: the dispatch buffers come from [`dispatch`] (offsets within entries, token ids
    // below rows: the tokens are the rows of x when by_token, x has entries rows otherwise);
    // choices read row a / per of x (entries / per rows) and trap on an id not below experts;
    // w holds experts * n * k weights and the scales one per expert; out holds entries * n; k
    // is a multiple of 8.
    unsafe { gpu.launch(Grid::new(kern, ((p.n as u32).div_ceil(block_rows), slots, 1)), params) }
}

/// The routed experts' MLPs for every grouped row of `d`, into `out [entries, hidden]` in
/// grouped order; `x [rows, hidden]` the layer input. The last `pieces` experts may be a
/// shared expert of intermediate size `pieces * inter` cut into pieces (each token choosing
/// all of them, with weight 1): their up projections are its up projection's rows in order,
/// their down projections the column blocks of its `[hidden, pieces * inter]` down projection
/// in their place. Two launches of [`experts`], no synchronization (a CUDA graph can hold
/// them): the path for small batches.
pub fn experts_mlp(
    gpu: &Gpu,
    d: &Dispatch,
    x: &impl DevicePtr<bf16>,
    mlp: ExpertMlp<ExpertWeights>,
    pieces: usize,
    out: &mut impl DevicePtrMut<bf16>,
) -> Result<()> {
    // SAFETY: the up projection writes every row of every active expert: all entries.
    let mut h = unsafe { gpu.scratch::<bf16>(d.entries() * mlp.inter) }?;
    experts(gpu, d, x, true, mlp.up_proj(), 0, &mut h)?;
    experts(gpu, d, &h, false, mlp.down_proj(), pieces, out)
}

/// The MLPs of each token's chosen experts, combined, without a dispatch: `out[t] =
/// shared.out[t] + sum_j weight[t, j] * down_e(relu(up_e x_t)^2)`, `e = idx[t, j]`, each
/// expert output rounded to bf16 (as [`experts_mlp`] then [`combine`], bit for bit where
/// [`experts_mlp`] runs the warp mode). Weights as for [`experts_mlp`] (bf16: the last
/// `shared.pieces` experts may be a shared expert's pieces; FP8: W8A8), `x [rows, hidden]`,
/// `out [rows, hidden]`. Every choice
/// streams its expert's weights on its own: the path for a token or a few, where a dispatch
/// and a combine cost more than repeated experts. Two launches, no synchronization.
pub fn experts_mlp_choices(
    gpu: &Gpu,
    ch: Choices,
    x: &impl DevicePtr<bf16>,
    mlp: ExpertMlp<ExpertWeights>,
    shared: SharedExpert,
    out: &mut impl DevicePtrMut<bf16>,
) -> Result<()> {
    // SAFETY: the up projection writes every choice's row before the down projection reads it.
    let mut h = unsafe { gpu.scratch::<bf16>(ch.idx.len() * mlp.inter) }?;
    choices_mlp(gpu, ch, x, mlp, shared, Appended { h: &mut h, rows: 0 }, out)
}

/// The shared expert beside a layer's routed ones, for the per-choice path: the last `pieces`
/// experts are its pieces (0: none; each token chooses all of them), and `out`, its output
/// rows computed apart, is added where given.
#[derive(Clone, Copy)]
pub struct SharedExpert<'a> {
    pub pieces: usize,
    pub out: Option<&'a CudaSlice<bf16>>,
}

/// The hidden rows of one token's choices (`h [choices, inter]`) whose last `rows` hold the
/// appended pieces' up projections already ([`route_appended_up`]).
pub struct Appended<'a> {
    pub h: &'a mut CudaSlice<bf16>,
    pub rows: usize,
}

/// [`experts_mlp_choices`] of one token after [`route_appended_up`]: `up.h` holds the appended
/// pieces' up projections; the routed choices' up projections go into its first rows, then
/// the down projections and the combining as there.
pub fn experts_mlp_choices_after(
    gpu: &Gpu,
    ch: Choices,
    x: &impl DevicePtr<bf16>,
    mlp: ExpertMlp<&CudaSlice<bf16>>,
    shared: SharedExpert,
    up: Appended,
    out: &mut impl DevicePtrMut<bf16>,
) -> Result<()> {
    let c = Check(Kernel::MoeExpertChoices.name());
    c.that("idx", ch.idx.len() == ch.per, format!("one token's {} choices", ch.per), ch.idx.len())?;
    c.count("appended", ch.per.min(shared.pieces), up.rows)?;
    choices_mlp(gpu, ch, x, mlp.weights(), shared, up, out)
}

/// The up projections of the choices whose rows of `up.h` are not there yet (all of them, or
/// of one token all but the appended ones), then the down projections and the combining.
fn choices_mlp(
    gpu: &Gpu,
    ch: Choices,
    x: &impl DevicePtr<bf16>,
    mlp: ExpertMlp<ExpertWeights>,
    SharedExpert { pieces, out: shared }: SharedExpert,
    Appended { h, rows: appended }: Appended,
    out: &mut impl DevicePtrMut<bf16>,
) -> Result<()> {
    let launched = ch.idx.len() - appended;
    let k = match mlp.down {
        ExpertWeights::Bf16(_) => entry::MOE_EXPERT_COMBINE,
        ExpertWeights::Fp8 { .. } => entry::MOE_EXPERT_COMBINE_FP8,
        ExpertWeights::Nvfp4 { .. } => entry::MOE_EXPERT_COMBINE_NVFP4,
    };
    let a = gpu.args(k);
    let c = a.check();
    let (inter, hidden) = (mlp.inter, mlp.hidden);
    let rows = ch.rows(k.name())?;
    c.that("pieces", pieces <= ch.experts, format!("at most the {} experts", ch.experts), pieces)?;
    c.that("inter", inter.is_multiple_of(8), "a multiple of 8", inter)?;
    let (w, w_scale, in_scale) = mlp.down.args(&a, ch.experts, (hidden, inter))?;
    let p = ExpertCombineParams {
        x: a.input("h", h, Len::Exactly(ch.idx.len() * inter))?,
        w,
        w_scale,
        in_scale,
        idx: a.input("idx", ch.idx, Len::Any)?,
        weight: a.input("weight", ch.weight, Len::Any)?,
        shared: a.opt_input("shared", shared, Len::Exactly(rows * hidden))?,
        out: a.output("out", out, Len::Exactly(rows * hidden))?,
        n: hidden as u32,
        k: inter as u32,
        per: ch.per as u32,
        experts: ch.experts as u32,
        piece0: (ch.experts - pieces) as u32,
        pieces: pieces as u32,
    };
    // The combining kernel reads the choices before its wait: the per-choice kernel just
    // before it lets it launch only once the routing has completed.
    c.that("launched", launched > 0, "at least one choice's up projection in this call", launched)?;
    project(gpu, ExpertRows::Choices(ch, launched), x, mlp.up_proj(), h)?;
    let blocks = (hidden as u32).div_ceil(COMBINE_ROWS);
    // SAFETY: h holds rows * per rows of inter (a multiple of 8; its first `launched` rows
    // written by the up projection above, the others before the call), down experts * hidden
    // * inter, idx and weight rows * per (per <= MAX_TOP_K: a warp each), shared and out rows
    // * hidden; ids not below experts trap; the per-choice launch right before it (its
    // programmatic predecessor) completes its wait on the routing before letting it launch.
    unsafe { gpu.launch(Grid::new(k, (blocks, rows as u32, 1)).threads(32 * ch.per as u32), p) }
}

/// As [`experts_mlp`] without pieces (every down projection `[hidden, inter]` in its own
/// place), through cuBLASLt: per expert with rows, its tokens gathered, then two GEMMs. Reads
/// the offsets back (a synchronization): the path for large batches, where tensor cores pay.
pub fn experts_mlp_gemm(
    gpu: &Gpu,
    d: &Dispatch,
    x: &impl DevicePtr<bf16>,
    mlp: ExpertMlp<&CudaSlice<bf16>>,
    out: &mut CudaSlice<bf16>,
) -> Result<()> {
    let ExpertMlp { up, down, inter, hidden } = mlp;
    let c = Check("moe_experts_gemm");
    d.check_filled("moe_experts_gemm")?;
    c.len_at_least("x", d.rows() * hidden, x.len())?;
    c.len("up", d.experts * inter * hidden, up.len())?;
    c.len("down", d.experts * hidden * inter, down.len())?;
    c.len("out", d.entries() * hidden, out.len())?;
    let offsets = gpu.download(&d.offsets)?;
    let most = offsets.windows(2).map(|o| (o[1] - o[0]) as usize).max().unwrap_or(0);
    // SAFETY: each expert's rows are written (gather, up GEMM) before they are read.
    let (mut xs, mut h) =
        unsafe { (gpu.uninit::<bf16>(most.max(1) * hidden)?, gpu.uninit::<bf16>(most.max(1) * inter)?) };
    for e in 0..d.experts {
        let (lo, hi) = (offsets[e] as usize, offsets[e + 1] as usize);
        if lo == hi {
            continue;
        }
        let m = hi - lo;
        let mut xs = xs.slice_mut(..m * hidden);
        crate::act::gather_by(gpu, x, hidden, &d.token.slice(lo..hi), &mut xs)?;
        let mut h = h.slice_mut(..m * inter);
        let up_e = up.slice(e * inter * hidden..(e + 1) * inter * hidden);
        crate::gemm::linear(gpu, m, &xs.as_view(), &up_e, inter, hidden, &mut h)?;
        crate::act::relu2(gpu, &mut h, m * inter)?;
        let down_e = down.slice(e * hidden * inter..(e + 1) * hidden * inter);
        crate::gemm::linear(
            gpu,
            m,
            &h.as_view(),
            &down_e,
            hidden,
            inter,
            &mut out.slice_mut(lo * hidden..hi * hidden),
        )?;
    }
    Ok(())
}

/// Each token's `top_k` rows of the expert outputs (`slot`, as [`Dispatch::slot`]) and their
/// weights, `[rows, top_k]` each.
#[derive(Clone, Copy)]
pub struct Picks<'a> {
    pub slot: &'a CudaSlice<i32>,
    pub weight: &'a CudaSlice<f32>,
    pub top_k: usize,
}

/// `out[t] = shared[t] + sum_k weight[t, k] * y[slot[t, k]]` for `y`'s rows of `hidden` (one
/// slot outside the rows of `y` traps the kernel).
pub fn combine(
    gpu: &Gpu,
    (y, hidden): (&impl DevicePtr<bf16>, usize),
    shared: Option<&CudaSlice<bf16>>,
    Picks { slot, weight, top_k }: Picks,
    out: &mut impl DevicePtrMut<bf16>,
) -> Result<()> {
    let k = entry::MOE_COMBINE;
    let a = gpu.args(k);
    let c = a.check();
    c.count("top_k", MAX_TOP_K as usize, top_k)?;
    c.count("hidden", MAX_ELEMS, hidden)?;
    let rows = slot.len() / top_k;
    c.count("rows", MAX_ROWS, rows)?;
    let (choices, out_rows) = (Len::Exactly(rows * top_k), Len::Exactly(rows * hidden));
    let p = CombineParams {
        y: a.input("y", y, Len::Any)?,
        shared: a.opt_input("shared", shared, out_rows)?,
        slot: a.input("slot", slot, choices)?,
        weight: a.input("weight", weight, choices)?,
        out: a.output("out", out, out_rows)?,
        rows: rows as u32,
        top_k: top_k as u32,
        hidden: hidden as u32,
        y_rows: (y.len() / hidden) as u32,
    };
    // SAFETY: extents checked above; a slot outside y traps; out is `&mut`.
    let blocks = (rows * kernels_gpu::chunks(hidden as u32) as usize).div_ceil(kernels_gpu::EW_BLOCK as usize);
    unsafe { gpu.launch(Grid::new(k, (blocks as u32, 1, 1)), p) }
}
