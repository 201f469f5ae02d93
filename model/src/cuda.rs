//! The CUDA backend: each operation through the host crate's kernels and cuBLASLt (bf16 linear
//! layers of more than one row).
//!
//! MoE layers route and run their experts on the device: up to [`CHOICES_MAX_ROWS`] rows of
//! bf16 experts per routing choice (no dispatch; down projections and combining in one
//! launch), else dispatched: up to [`EXPERT_KERNEL_MAX_ROWS`] rows through the expert kernel
//! (no synchronization), up to [`GROUPED_MAX_ROWS`] through the grouped GEMM on tensor cores
//! (one launch a projection, no synchronization), more through per-expert cuBLASLt GEMMs (one
//! synchronization to read the expert offsets).
//!
//! FP8 (W8A8) linear layers and experts keep their e4m3 codes on the device and run through
//! the FP8 gemv kernel and the expert kernel (the same row-dot code, an expert per row), which
//! quantize each input row with the checkpoint's `input_scale` (or per token without one)
//! before the product: right at any batch, fast at small ones (prefill of FP8 checkpoints does
//! not use tensor cores yet).
//!
//! A step's rows (tokens, slots, positions, prefill sequences) are checked and uploaded once
//! per step ([`CudaRows`]). Steps of decode rows only, up to [`EXPERT_KERNEL_MAX_ROWS`] of
//! them (no operation synchronizes then), are recorded into a CUDA graph once per row count
//! and replayed after that, with the new rows copied over the recorded ones; the graph's
//! temporaries are ranges of the Gpu's capture arena (`Gpu::scratch`; allocations inside the
//! capture past it). The prefill scan's plan is still built per layer.
//!
//! Attention takes q, k and v as strided rows (column blocks of the fused q/k/v projection's
//! output), keys and values with one stride.

use std::sync::Arc;

use half::bf16;
use host::attn::{AttnRows, AttnShape, attention};
use host::batch::{Prefill, Slots};
use host::conv1d::{ConvShape, conv_fwd, conv_update};
use host::gemv::{gemv, gemv_split};
use host::grouped::experts_mlp_grouped;
use host::mamba::{MambaConv, mamba_decode, mamba_decode_fits};
use host::moe::{
    Choices, Dispatch, ExpertWeights, MAX_EXPERTS, MAX_TOP_K, combine, dispatch, experts_mlp, experts_mlp_choices,
    experts_mlp_choices_after, experts_mlp_gemm, route, route_appended_up,
};
use host::norm::{NormShape, add_rms_norm, gated_norm, rms_norm};
use host::sample::{RowSampling, SampleRows, read_out, sample_out};
use host::ssd::{SsdPlan, ssd_scan};
use host::ssm::{Rows, SsmHeads, SsmInputs, SsmShape, ssm_update};
use host::{Buffer, CudaSlice, CudaView, CudaViewMut, Gpu, Graph, Stamp, UPLOAD_STAGE_BYTES};

use kernels_gpu::sample::SampleOut;

use crate::backend::{Backend, In, MambaDecode, MoeWeights, Out, StepRows, mamba_decode_apart, rows_f32};
use crate::config::{AttentionConfig, MambaConfig, MoeConfig};
use crate::error::{Error, Result};
use crate::layout::{Linear, Mlp};
use crate::weights::Dtype;

/// The CUDA backend on one GPU.
pub struct Cuda {
    gpu: Arc<Gpu>,
    graphs: bool,
}

impl Cuda {
    /// Opens device `ordinal` (a clear error without a driver or GPU).
    pub fn new(ordinal: usize) -> Result<Cuda> {
        Ok(Cuda::on(Arc::new(Gpu::new(ordinal)?)))
    }

    /// The backend on an opened device, shared with other users of its stream.
    pub fn on(gpu: Arc<Gpu>) -> Cuda {
        Cuda { gpu, graphs: true }
    }

    /// Whether decode steps are recorded into CUDA graphs (the default) or every step's
    /// operations are launched one by one.
    pub fn with_graphs(self, graphs: bool) -> Cuda {
        Cuda { graphs, ..self }
    }

    /// The device.
    pub fn gpu(&self) -> &Gpu {
        &self.gpu
    }
}

/// A weight `[n, k]` on the device.
pub struct CudaWeight {
    w: Weights,
    n: usize,
    k: usize,
}

/// Weights of one shape, of one layer or of all experts of a MoE projection.
enum Weights {
    Bf16(CudaSlice<bf16>),
    /// e4m3 codes, a weight scale per matrix, and input scales per matrix when static.
    Fp8 {
        codes: CudaSlice<u8>,
        w_scale: CudaSlice<f32>,
        in_scale: Option<CudaSlice<f32>>,
    },
}

impl Weights {
    fn view(&self) -> ExpertWeights<'_> {
        match self {
            Weights::Bf16(w) => ExpertWeights::Bf16(w),
            Weights::Fp8 { codes, w_scale, in_scale } => {
                ExpertWeights::Fp8 { codes, w_scale, in_scale: in_scale.as_ref() }
            }
        }
    }

    /// Uploads `list` (all of `shape`, all bf16 or all FP8 with or without input scales)
    /// into one buffer, with room for `spare` more bf16 matrices (zeros) after them.
    fn upload(gpu: &Gpu, list: &[&Linear], shape: [usize; 2], spare: usize) -> Result<Weights> {
        let first = list.first().ok_or_else(|| Error::Unsupported("no weights to upload".into()))?;
        let size = shape[0] * shape[1];
        for l in list {
            check_linear(l, shape, "its siblings'")?;
            if l.fp8.is_some() != first.fp8.is_some()
                || l.fp8.map(|f| f.input_scale.is_some()) != first.fp8.map(|f| f.input_scale.is_some())
            {
                return Err(Error::Unsupported(format!(
                    "`{}` mixes FP8 and bf16, or static and dynamic FP8 inputs, with `{}`",
                    l.weight.name, first.weight.name
                )));
            }
        }
        if first.fp8.is_none() {
            let mut w = gpu.zeros::<bf16>((list.len() + spare) * size)?;
            for (i, l) in list.iter().enumerate() {
                put_bf16(gpu, l, &mut w.slice_mut(i * size..(i + 1) * size))?;
            }
            return Ok(Weights::Bf16(w));
        }
        if spare > 0 {
            return Err(unsupported("FP8 matrices beside bf16 ones"));
        }
        let mut codes = gpu.zeros::<u8>(list.len() * size)?;
        for (i, l) in list.iter().enumerate() {
            if l.weight.dtype != Dtype::F8E4M3 {
                return Err(Error::Unsupported(format!(
                    "`{}`: FP8 scales on a {:?} weight",
                    l.weight.name, l.weight.dtype
                )));
            }
            gpu.upload_bytes_into(l.weight.bytes, &mut codes.slice_mut(i * size..(i + 1) * size))?;
        }
        let scales = |f: fn(&Linear) -> Option<f32>| list.iter().map(|l| f(l)).collect::<Option<Vec<f32>>>();
        let w_scale = gpu.upload(&scales(|l| l.fp8.map(|f| f.weight_scale)).unwrap_or_default())?;
        let in_scale = scales(|l| l.fp8.and_then(|f| f.input_scale)).map(|s| gpu.upload(&s)).transpose()?;
        Ok(Weights::Fp8 { codes, w_scale, in_scale })
    }
}

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

/// Most rows of a MoE layer that go through the expert kernel rather than a GEMM.
pub const EXPERT_KERNEL_MAX_ROWS: usize = 64;

/// Most rows of a bf16 MoE layer whose experts run as the grouped GEMM (one launch a
/// projection, no synchronization); more go through per-expert cuBLASLt GEMMs. On the H200 at
/// Nano size (benches/nano prefill breakdown, routing + experts a MoE layer) the grouped GEMM
/// took 0.759 ms at 512 tokens against cuBLASLt's 1.412, but 4.368 ms at 4096 against 3.411
/// (its 64 x 128 tiles reread their inputs from L2 more than the larger GEMMs do).
pub const GROUPED_MAX_ROWS: usize = 1024;

/// Shortest input of a bf16 linear layer that runs at one row through the split mode of the
/// gemv kernels ([`gemv_split`]) rather than their warp mode ([`gemv`]), whose one warp per
/// weight row needs more round trips on long rows.
pub const SPLIT_MIN_K: usize = 3072;

/// Decode rows up to which a Mamba mixer's conv update, state update and gated norm run as
/// one launch (`mamba_decode_bf16`); more rows take the three launches. One row measured
/// faster fused (docs/PERFORMANCE.md, the fused Mamba decode); three rows, in Nsight Compute
/// with cold caches, took 18.7 us fused against 15.1 us for the three.
pub const FUSED_MAMBA_ROWS: usize = 1;

/// Most rows of a bf16 MoE layer whose experts run per routing choice, without a dispatch, the
/// down projections and the combining in one launch ([`experts_mlp_choices`]).
pub const CHOICES_MAX_ROWS: usize = 1;

/// Most rows of a MoE layer whose shared expert runs as pieces inside the routed experts'
/// launches (see [`Shared::Pieces`]) rather than as two cuBLASLt GEMMs: the expert kernel
/// streams the weights once per row, so only a single row gains.
pub const SHARED_PIECES_MAX_ROWS: usize = 1;

/// A step's rows on the device, checked (see [`Backend::rows`]).
pub struct CudaRows {
    tokens: CudaSlice<u32>,
    decode: Option<Slots>,
    prefill: Option<Prefill>,
    attn: AttnRows,
    last: CudaSlice<u32>,
}

/// A step's sampling rows on the device and where the kernel writes their tokens.
pub struct CudaSampling {
    rows: SampleRows,
    out: CudaSlice<u32>,
}

impl CudaRows {
    fn decode(&self) -> Result<&Slots> {
        self.decode
            .as_ref()
            .ok_or_else(|| Error::Unsupported("a decode operation in a step without decode rows".into()))
    }

    fn prefill(&self) -> Result<&Prefill> {
        self.prefill.as_ref().ok_or_else(|| Error::Unsupported("a prefill operation in a step without prefill".into()))
    }
}

/// The rows an [`In`] reads, from row 0 to the end of its buffer.
fn view<'a>(x: &In<'a, Buffer<bf16>>) -> CudaView<'a, bf16> {
    x.buf.slice(x.offset..)
}

/// The output region of an [`Out`] of `len` elements.
fn view_mut<'a>(y: Out<'a, Buffer<bf16>>, len: usize) -> Result<CudaViewMut<'a, bf16>> {
    let end = y.offset + len;
    if end > y.buf.len() {
        return Err(Error::Unsupported(format!("output region {}..{end} past a buffer of {}", y.offset, y.buf.len())));
    }
    Ok(y.buf.slice_mut(y.offset..end))
}

fn rows<'a>(x: &In<'a, Buffer<bf16>>, cols: usize) -> Rows<'a> {
    Rows { buf: x.buf, offset: x.offset + cols, stride: x.stride }
}

/// x, B and C inside the conv output rows, dt inside in_proj's.
fn ssm_inputs<'a>(c: &MambaConfig, xbc: &In<'a, Buffer<bf16>>, dt: &In<'a, Buffer<bf16>>) -> SsmInputs<'a> {
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
    /// `y = f(x W^T)` for `rows` contiguous rows of `x`, `f` relu^2 (in bf16) when `relu2`:
    /// bf16 weights at one row through the gemv kernels' split mode (long rows) or warp mode
    /// (`cargo bench --bench gemv`: each at least as fast as cuBLASLt there, and chained to the
    /// launches around them), at more rows through cuBLASLt; FP8 weights through the warp
    /// mode.
    fn linear_rows(
        &self,
        x: &CudaView<bf16>,
        rows: usize,
        w: &CudaWeight,
        relu2: bool,
        y: &mut CudaViewMut<bf16>,
    ) -> Result<()> {
        let g = &self.gpu;
        match &w.w {
            Weights::Bf16(b) if rows == 1 && w.k >= SPLIT_MIN_K && !relu2 => {
                Ok(gemv_split(g, x, rows, b, (w.n, w.k), y)?)
            }
            Weights::Bf16(b) if rows != 1 => self.gemm_rows(x, rows, &b.as_view(), (w.n, w.k), relu2, y),
            weights => Ok(gemv(g, x, rows, weights.view(), (w.n, w.k), relu2, y)?),
        }
    }

    /// `y = f(x w^T)` over `rows` rows of `x` through cuBLASLt, `w [n, k]`, `f` as for
    /// [`Cuda::linear_rows`].
    fn gemm_rows(
        &self,
        x: &CudaView<bf16>,
        rows: usize,
        w: &CudaView<bf16>,
        (n, k): (usize, usize),
        relu2: bool,
        y: &mut CudaViewMut<bf16>,
    ) -> Result<()> {
        host::gemm::linear(&self.gpu, rows, x, w, n, k, y)?;
        if relu2 {
            host::act::relu2(&self.gpu, y, rows * n)?;
        }
        Ok(())
    }

    /// `down(relu(up x)^2)` over `n` rows of `x`, into `out`.
    fn mlp_rows(
        &self,
        x: &CudaView<bf16>,
        n: usize,
        (up, down): (&CudaWeight, &CudaWeight),
        out: &mut CudaViewMut<bf16>,
    ) -> Result<()> {
        // SAFETY: the up projection writes all n * up.n values before they are read.
        let mut h = unsafe { self.gpu.scratch::<bf16>(n * up.n) }?;
        self.linear_rows(x, n, up, true, &mut h.as_view_mut())?;
        self.linear_rows(&h.as_view(), n, down, false, out)
    }
}

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
    let si = s.up.weight.shape[0];
    for (l, shape) in [(&s.up, [si, hidden]), (&s.down, [hidden, si])] {
        check_linear(l, shape, "the shared expert's")?;
    }
    let at = routed * inter * hidden;
    let padded = si.next_multiple_of(inter);
    // Up: the shared up's rows in order; down: its rows, each padded to `padded` columns.
    put_bf16(gpu, &s.up, &mut up.slice_mut(at..at + si * hidden))?;
    let d = s.down.weight.to_bf16()?;
    let mut wide = vec![bf16::ZERO; hidden * padded];
    for (to, from) in wide.chunks_mut(padded).zip(d.chunks(si)) {
        to[..si].copy_from_slice(from);
    }
    Ok(gpu.upload_into(&wide, &mut down.slice_mut(at..at + hidden * padded))?)
}

/// Uploads `l`'s weight into `dst` as bf16: its bytes as they are where it is bf16 (staged, no
/// copy in between), else converted.
fn put_bf16(gpu: &Gpu, l: &Linear, dst: &mut CudaViewMut<bf16>) -> Result<()> {
    if l.weight.dtype == Dtype::Bf16 {
        return Ok(gpu.upload_bytes_into(l.weight.bytes, dst)?);
    }
    Ok(gpu.upload_into(&l.weight.to_bf16()?, dst)?)
}

/// Fails unless `l` has `shape` (`whose`: whose shape that is, for the message) and no bias.
fn check_linear(l: &Linear, shape: [usize; 2], whose: &str) -> Result<()> {
    if l.weight.shape != shape {
        return Err(Error::Unsupported(format!(
            "`{}` has shape {:?}; {whose} is {shape:?}",
            l.weight.name, l.weight.shape
        )));
    }
    if l.bias.is_some() {
        return Err(unsupported("biased linear layers"));
    }
    Ok(())
}

fn unsupported(what: &str) -> Error {
    Error::Unsupported(format!("the CUDA backend has no {what} yet"))
}

impl Backend for Cuda {
    type Buf = Buffer<bf16>;
    type Buf32 = CudaSlice<f32>;
    type Weight = CudaWeight;
    type Experts = CudaExperts;
    type Rows = CudaRows;
    type Graph = Graph;
    type Sampling = CudaSampling;
    type Stamp = Stamp;

    fn upload(&self, v: &[bf16]) -> Result<Buffer<bf16>> {
        if std::mem::size_of_val(v) < UPLOAD_STAGE_BYTES {
            return Ok(self.gpu.upload(v)?.into());
        }
        // SAFETY: the copy below writes every element, in stream order before any use.
        let mut b = unsafe { self.gpu.uninit::<bf16>(v.len()) }?;
        self.gpu.upload_bytes_into(bytemuck::cast_slice(v), &mut b.as_view_mut())?;
        Ok(b.into())
    }
    fn upload32(&self, v: &[f32]) -> Result<CudaSlice<f32>> {
        Ok(self.gpu.upload(v)?)
    }
    fn zeros(&self, n: usize) -> Result<Buffer<bf16>> {
        Ok(self.gpu.zeros(n.max(1))?.into())
    }
    fn zeros32(&self, n: usize) -> Result<CudaSlice<f32>> {
        Ok(self.gpu.zeros(n.max(1))?)
    }
    fn scratch(&self, n: usize) -> Result<Buffer<bf16>> {
        // SAFETY: unwritten device memory holds arbitrary bf16 values, not undefined
        // behaviour: no kernel indexes memory with activation values (routing ranks NaN last
        // and traps on an empty pick). The model writes these buffers before reading them;
        // one taken while recording lives only as long as the step it serves (Gpu::scratch).
        Ok(unsafe { self.gpu.scratch(n.max(1)) }?)
    }
    fn download_rows(&self, b: &Buffer<bf16>, width: usize) -> Result<Vec<Vec<f32>>> {
        Ok(self.gpu.download_with(b, |v| rows_f32(v, width))?)
    }

    fn weight(&self, l: &Linear) -> Result<CudaWeight> {
        let (n, k) = (l.weight.shape[0], l.weight.shape[1]);
        Ok(CudaWeight { w: Weights::upload(&self.gpu, &[l], [n, k], 0)?, n, k })
    }

    fn experts(&self, list: &[Mlp], shared: Option<&Mlp>) -> Result<CudaExperts> {
        let first = list.first().ok_or_else(|| Error::Unsupported("a MoE layer without experts".into()))?;
        let (inter, hidden) = (first.up.weight.shape[0], first.up.weight.shape[1]);
        let bf16 = |m: &Mlp| m.up.fp8.is_none() && m.down.fp8.is_none();
        let pieces = match shared {
            Some(s) if bf16(s) && list.iter().all(bf16) => shared_pieces(list.len(), inter, s.up.weight.shape[0]),
            _ => 0,
        };
        let ups: Vec<&Linear> = list.iter().map(|m| &m.up).collect();
        let downs: Vec<&Linear> = list.iter().map(|m| &m.down).collect();
        let mut up = Weights::upload(&self.gpu, &ups, [inter, hidden], pieces)?;
        let mut down = Weights::upload(&self.gpu, &downs, [hidden, inter], pieces)?;
        let shared = match (shared, &mut up, &mut down) {
            (None, ..) => Shared::None,
            (Some(s), Weights::Bf16(up), Weights::Bf16(down)) if pieces > 0 => {
                put_pieces(&self.gpu, s, list.len(), (inter, hidden), (up, down))?;
                Shared::Pieces(pieces)
            }
            (Some(s), ..) => Shared::Mlp(Box::new((self.weight(&s.up)?, self.weight(&s.down)?))),
        };
        Ok(CudaExperts { up, down, inter, shared })
    }

    fn rows(&self, r: &StepRows, slots: usize, max_len: usize) -> Result<CudaRows> {
        let g = &self.gpu;
        let p = &r.prefill;
        Ok(CudaRows {
            tokens: g.upload(&r.tokens)?,
            decode: (!r.decode_slots.is_empty()).then(|| Slots::new(g, &r.decode_slots, slots)).transpose()?,
            prefill: (!p.lens.is_empty()).then(|| Prefill::new(g, &p.lens, &p.slots, &p.initial, slots)).transpose()?,
            attn: AttnRows::new(g, &r.slots, &r.positions, slots, max_len)?,
            last: g.upload(&r.last)?,
        })
    }

    fn set_rows(&self, into: &mut CudaRows, r: &StepRows) -> Result<()> {
        let g = &self.gpu;
        let same = into.tokens.len() == r.tokens.len()
            && into.last.len() == r.last.len()
            && into.decode.as_ref().map_or(0, Slots::len) == r.decode_slots.len()
            && into.prefill.is_none()
            && r.prefill.lens.is_empty();
        if !same {
            return Err(Error::Unsupported("rows written in place must be decode rows only, as many as before".into()));
        }
        g.upload_into(&r.tokens, &mut into.tokens)?;
        if let Some(d) = &mut into.decode {
            d.set(g, &r.decode_slots)?;
        }
        // Not `last`: a step of decode rows only reads no gather of last rows (each row is its
        // part's last; see model.rs `forward`).
        Ok(into.attn.set(g, &r.slots, &r.positions)?)
    }

    fn record(&self, decode: usize, f: &mut dyn FnMut() -> Result<()>) -> Result<Option<Graph>> {
        if !self.graphs || decode > EXPERT_KERNEL_MAX_ROWS {
            return f().map(|()| None);
        }
        self.gpu.capture(f).map(Some)
    }

    fn replay(&self, graph: &Graph) -> Result<()> {
        Ok(graph.replay()?)
    }

    fn sampling(&self, rows: &[RowSampling], vocab: usize, capacity: usize) -> Result<CudaSampling> {
        let g = &self.gpu;
        Ok(CudaSampling { rows: SampleRows::new(g, rows, vocab, capacity)?, out: sample_out(g, rows.len())? })
    }

    fn set_sampling(&self, into: &mut CudaSampling, rows: &[RowSampling]) -> Result<()> {
        Ok(into.rows.set(&self.gpu, rows)?)
    }

    fn sampling_fits(&self, s: &CudaSampling, rows: &[RowSampling]) -> bool {
        rows.iter().map(|r| r.penalties.len()).sum::<usize>() <= s.rows.capacity()
    }

    fn sample(&self, logits: &Buffer<bf16>, vocab: usize, s: &mut CudaSampling) -> Result<()> {
        Ok(host::sample::sample(&self.gpu, logits, vocab, &s.rows, &mut s.out)?)
    }

    fn sampled(&self, s: &CudaSampling) -> Result<Vec<SampleOut>> {
        let mut out = read_out(&self.gpu.download(&s.out)?);
        out.truncate(s.rows.len());
        Ok(out)
    }

    fn stamp(&self) -> Result<Stamp> {
        Ok(self.gpu.stamp()?)
    }

    fn ms_between(&self, from: &Stamp, to: &Stamp) -> Result<f64> {
        Ok(f64::from(to.ms_since(from)?))
    }

    fn embed(&self, table: &Buffer<bf16>, width: usize, rows: &CudaRows, out: Out<Buffer<bf16>>) -> Result<()> {
        let mut y = view_mut(out, rows.tokens.len() * width)?;
        Ok(host::act::gather_by(&self.gpu, table, width, &rows.tokens, &mut y)?)
    }

    fn last_rows(&self, x: &Buffer<bf16>, width: usize, rows: &CudaRows, out: Out<Buffer<bf16>>) -> Result<()> {
        let mut y = view_mut(out, rows.last.len() * width)?;
        Ok(host::act::gather_by(&self.gpu, x, width, &rows.last, &mut y)?)
    }

    fn rms_norm(
        &self,
        x: In<Buffer<bf16>>,
        w: &Buffer<bf16>,
        rows: usize,
        width: usize,
        eps: f32,
        y: Out<Buffer<bf16>>,
    ) -> Result<()> {
        let shape = NormShape { x_stride: x.stride, ..NormShape::new(rows, width, 1, eps) };
        let mut y = view_mut(y, rows * width)?;
        Ok(rms_norm(&self.gpu, shape, &view(&x), w, &mut y)?)
    }

    fn gated_norm(
        &self,
        x: In<Buffer<bf16>>,
        z: In<Buffer<bf16>>,
        w: &Buffer<bf16>,
        rows: usize,
        width: usize,
        groups: usize,
        eps: f32,
        y: Out<Buffer<bf16>>,
    ) -> Result<()> {
        let shape = NormShape { x_stride: x.stride, z_stride: z.stride, ..NormShape::new(rows, width, groups, eps) };
        let mut y = view_mut(y, rows * width)?;
        Ok(gated_norm(&self.gpu, shape, &view(&x), &view(&z), w, &mut y)?)
    }

    fn linear(&self, x: In<Buffer<bf16>>, rows: usize, w: &CudaWeight, y: Out<Buffer<bf16>>) -> Result<()> {
        if x.stride != w.k {
            return Err(unsupported("strided linear inputs"));
        }
        let xv = x.buf.slice(x.offset..x.offset + rows * w.k);
        let mut y = view_mut(y, rows * w.n)?;
        self.linear_rows(&xv, rows, w, false, &mut y)
    }

    fn add_rms_norm(
        &self,
        h: &mut Buffer<bf16>,
        x: &Buffer<bf16>,
        w: &Buffer<bf16>,
        rows: usize,
        width: usize,
        eps: f32,
        y: Out<Buffer<bf16>>,
    ) -> Result<()> {
        let n = rows * width;
        let mut y = view_mut(y, n)?;
        let shape = NormShape::new(rows, width, 1, eps);
        Ok(add_rms_norm(&self.gpu, shape, &mut h.slice_mut(..n), &x.slice(..n), w, &mut y)?)
    }

    fn mlp(
        &self,
        x: In<Buffer<bf16>>,
        rows: usize,
        up: &CudaWeight,
        down: &CudaWeight,
        y: Out<Buffer<bf16>>,
    ) -> Result<()> {
        if x.stride != up.k {
            return Err(unsupported("strided MLP inputs"));
        }
        let xv = x.buf.slice(x.offset..x.offset + rows * up.k);
        let mut y = view_mut(y, rows * down.n)?;
        self.mlp_rows(&xv, rows, (up, down), &mut y)
    }

    fn conv_decode(
        &self,
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
        Ok(conv_update(
            &self.gpu,
            ConvShape { dim: cd, k, x_stride: x.stride },
            &view(&x),
            w,
            bias.map(|b| &**b),
            state,
            slots,
            &mut y,
        )?)
    }

    fn conv_prefill(
        &self,
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
        Ok(conv_fwd(
            &self.gpu,
            ConvShape { dim: cd, k, x_stride: x.stride },
            &view(&x),
            w,
            bias.map(|b| &**b),
            state,
            p,
            &mut y,
        )?)
    }

    fn ssm_decode(
        &self,
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
        let inputs = ssm_inputs(c, &xbc, &dt);
        let h = SsmHeads { dt_bias: heads.0, a: heads.1, d: Some(heads.2) };
        let mut y = view_mut(y, slots.len() * c.inner())?;
        Ok(ssm_update(&self.gpu, shape, inputs, None, h, state, slots, None, &mut y)?)
    }

    fn mamba_decode(
        &self,
        c: &MambaConfig,
        zx: In<Buffer<bf16>>,
        nd: usize,
        m: MambaDecode<Cuda>,
        y: Out<Buffer<bf16>>,
    ) -> Result<()> {
        let shape = ssm_shape(c);
        if nd > FUSED_MAMBA_ROWS || !mamba_decode_fits(&shape) {
            return mamba_decode_apart(self, c, zx, nd, m, y);
        }
        let slots = m.rows.decode()?;
        let mut y = view_mut(y, slots.len() * c.inner())?;
        let (w, bias, conv_state) = m.conv;
        let conv = MambaConv { w, bias: bias.map(|b| &**b), k: c.conv_kernel };
        let heads = SsmHeads { dt_bias: m.heads.0, a: m.heads.1, d: Some(m.heads.2) };
        let zx = (&view(&zx), zx.stride);
        let norm = (&**m.norm.0, m.norm.1);
        Ok(mamba_decode(&self.gpu, shape, zx, (conv, &mut **conv_state), (heads, m.state), norm, slots, &mut y)?)
    }

    fn ssm_prefill(
        &self,
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
        let mut plan = SsdPlan::new(&self.gpu, p, shape)?;
        let inputs = ssm_inputs(c, &xbc, &dt);
        let h = SsmHeads { dt_bias: heads.0, a: heads.1, d: Some(heads.2) };
        let mut y = view_mut(y, p.tokens() * c.inner())?;
        Ok(ssd_scan(&self.gpu, shape, inputs, h, state, p, &mut plan, &mut y)?)
    }

    fn moe(
        &self,
        c: &MoeConfig,
        x: In<Buffer<bf16>>,
        rows: usize,
        w: &MoeWeights<Cuda>,
        y: Out<Buffer<bf16>>,
    ) -> Result<()> {
        let g = &self.gpu;
        let hidden = w.gate.len() / c.experts;
        if x.stride != hidden {
            return Err(unsupported("strided MoE inputs"));
        }
        let xv = x.buf.slice(x.offset..x.offset + rows * hidden);
        let ex = &w.experts;
        let pieces = match ex.shared {
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
        let router = (&*w.gate, &w.score_bias);
        // One token whose routing appends the shared expert's pieces: their up projections in
        // the routing's launch (`h`, the choices' hidden rows, its last rows written there).
        let mut h = match &ex.up {
            Weights::Bf16(up) if shape.shared > 0 && rows <= CHOICES_MAX_ROWS => {
                // SAFETY: the routing writes the pieces' rows, the choices launch the others,
                // before the down projections read them.
                let mut h = unsafe { g.scratch::<bf16>(choices * ex.inter) }?;
                route_appended_up(g, shape, &xv, hidden, router, (&mut idx, &mut wts), (up, ex.inter), &mut h)?;
                Some(h)
            }
            _ => {
                route(g, shape, &xv, hidden, router.0, router.1, &mut idx, &mut wts)?;
                None
            }
        };
        let shared = match (&ex.shared, &ex.up, &ex.down) {
            (Shared::Mlp(mlp), ..) => {
                let mut out = unsafe { g.scratch::<bf16>(rows * hidden) }?;
                self.mlp_rows(&xv, rows, (&mlp.0, &mlp.1), &mut out.as_view_mut())?;
                Some(out)
            }
            (Shared::Pieces(n), Weights::Bf16(up), Weights::Bf16(down)) if shape.shared == 0 => {
                // The pieces together are the shared expert's up and down projections, padded
                // with zeros to n * inter.
                let (si, at) = (n * ex.inter, c.experts * ex.inter * hidden);
                let (up, down) = (up.slice(at..at + si * hidden), down.slice(at..at + si * hidden));
                let mut out = unsafe { g.scratch::<bf16>(rows * hidden) }?;
                // SAFETY: the up projection writes all rows * si values before they are read.
                let mut h = unsafe { g.scratch::<bf16>(rows * si) }?;
                self.gemm_rows(&xv, rows, &up, (si, hidden), true, &mut h.as_view_mut())?;
                self.gemm_rows(&h.as_view(), rows, &down, (hidden, si), false, &mut out.as_view_mut())?;
                Some(out)
            }
            _ => None,
        };
        let mut y = view_mut(y, rows * hidden)?;
        let experts = c.experts + pieces;
        if let (Weights::Bf16(up), Weights::Bf16(down)) = (&ex.up, &ex.down)
            && rows <= CHOICES_MAX_ROWS
        {
            let ch = Choices { idx: &idx, weight: &wts, per: choices, experts };
            let dims = (ex.inter, hidden);
            match &mut h {
                Some(h) => {
                    let pieces = (pieces, shared.as_deref());
                    experts_mlp_choices_after(g, ch, &xv, (up, down), dims, pieces, (h, shape.shared), &mut y)?
                }
                None => experts_mlp_choices(g, ch, &xv, up, down, dims, pieces, shared.as_deref(), &mut y)?,
            }
            return Ok(());
        }
        let mut d = Dispatch::new(g, experts, choices, rows)?;
        dispatch(g, &idx, &mut d)?;
        let mut grouped = unsafe { g.scratch::<bf16>(d.entries() * hidden) }?;
        match (&ex.up, &ex.down) {
            (Weights::Bf16(up), Weights::Bf16(down)) if rows > EXPERT_KERNEL_MAX_ROWS => {
                if rows <= GROUPED_MAX_ROWS && ex.inter.is_multiple_of(8) && hidden.is_multiple_of(8) {
                    experts_mlp_grouped(g, &d, &xv, up, down, (ex.inter, hidden), &mut grouped)?
                } else {
                    experts_mlp_gemm(g, &d, &xv, up, down, (ex.inter, hidden), &mut grouped)?
                }
            }
            (up, down) => experts_mlp(g, &d, &xv, up.view(), down.view(), (ex.inter, hidden), pieces, &mut grouped)?,
        }
        Ok(combine(g, &grouped, shared.as_deref(), d.slot(), &wts, choices, hidden, &mut y)?)
    }

    fn attention(
        &self,
        c: &AttentionConfig,
        q: In<Buffer<bf16>>,
        k: In<Buffer<bf16>>,
        v: In<Buffer<bf16>>,
        cache: (&mut Buffer<bf16>, &mut Buffer<bf16>),
        max_len: usize,
        rows: &CudaRows,
        y: Out<Buffer<bf16>>,
    ) -> Result<()> {
        let shape = AttnShape { heads: c.heads, kv_heads: c.kv_heads, head_dim: c.head_dim, max_len };
        let mut y = view_mut(y, rows.attn.len() * c.heads * c.head_dim)?;
        if k.stride != v.stride {
            return Err(unsupported("keys and values with different row strides"));
        }
        let (qs, kvs) = (q.stride, k.stride);
        let (q, k, v) = (view(&q), view(&k), view(&v));
        Ok(attention(&self.gpu, shape, (&q, qs), (&k, &v, kvs), cache.0, cache.1, &rows.attn, &mut y)?)
    }
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
