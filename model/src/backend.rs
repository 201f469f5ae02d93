//! The operations the model is composed of. The model's code path ([`crate::model::Model`]) is
//! written once against this trait; a backend implements each operation once: the CPU
//! reference backend ([`crate::cpu::Cpu`]) with the host crate's CPU references, the CUDA
//! backend with the host crate's kernels.
//!
//! Activations are bf16 rows. An operation reads rows through [`In`] (a buffer, the offset of
//! row 0 and the row stride, so slices of wider rows need no copy) and writes contiguous rows
//! at an offset of an output buffer ([`Out`]), so decode rows and prefill rows of one step can
//! go through different kernels into one buffer.
//!
//! A layer with weights, state and a choice of kernels of its own is an object the backend
//! builds once at load from the layout: a Mamba mixer ([`Backend::Mamba`], from
//! [`MambaWeights`]), an attention layer ([`Backend::Attention`]), a MoE layer's experts
//! ([`Backend::Experts`]); a linear layer's weight ([`Backend::Weight`]) likewise. The model
//! calls one operation per part of a layer with its object (the parts a profile times apart),
//! and the object picks the kernels of that part: on the CUDA backend the fused Mamba decode
//! or its three launches, the fused q/k/v projection, the MoE path by rows. The state cache
//! (each slot's conv, SSM, key and value state) lives in the layers' objects.
//!
//! What indexes a step's rows (tokens, cache slots, positions) is given once per step
//! ([`StepRows`], readied by [`Backend::rows`]); the operations read it from there, so a
//! backend uploads it once, and a recorded step ([`Backend::record`]) replays with new rows
//! written over the old in place ([`Backend::set_rows`]).

use half::bf16;
use host::sample::RowSampling;
use kernels_gpu::sample::SampleOut;

use crate::config::{AttentionConfig, Config, MambaConfig, MoeConfig};
use crate::error::{Error, Result};
use crate::layout::{self, Linear, Mlp};
use crate::weights::Tensor;

/// Rows read by an operation: row r at `buf[offset + r * stride ..]`.
pub struct In<'a, B> {
    pub buf: &'a B,
    pub offset: usize,
    pub stride: usize,
}

impl<B> Clone for In<'_, B> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<B> Copy for In<'_, B> {}

impl<'a, B> In<'a, B> {
    /// Contiguous rows of `width` from row 0.
    pub fn rows(buf: &'a B, width: usize) -> In<'a, B> {
        In { buf, offset: 0, stride: width }
    }

    /// The same rows shifted by `rows` rows and `cols` columns.
    pub fn at(self, rows: usize, cols: usize) -> In<'a, B> {
        In { buf: self.buf, offset: self.offset + rows * self.stride + cols, stride: self.stride }
    }
}

/// Contiguous rows written by an operation, from element `offset` of `buf`.
pub struct Out<'a, B> {
    pub buf: &'a mut B,
    pub offset: usize,
}

/// A norm's weight (`[width]`) and epsilon.
pub struct Norm<'a, B> {
    pub w: &'a B,
    pub width: usize,
    pub eps: f32,
}

impl<B> Clone for Norm<'_, B> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<B> Copy for Norm<'_, B> {}

/// Elements of one layer's state cache per kind, for `slots` slots of `max_len` tokens, each
/// product checked: an overflow is an error naming the load parameters, never a wrapped size.
pub struct CacheSizes {
    /// A Mamba mixer's conv state, `[slots, conv_dim, k - 1]`.
    pub conv: usize,
    /// A Mamba mixer's SSM state, `[slots, heads, head_dim, state_size]`.
    pub ssm: usize,
    /// An attention layer's key cache (or value cache), `[slots, max_len, kv_heads * head_dim]`.
    pub kv: usize,
    /// Tokens a slot holds.
    pub max_len: usize,
}

impl CacheSizes {
    /// The sizes of `config`'s layers' caches; an error unless there is at least one slot of
    /// at least one token.
    pub fn new(config: &Config, slots: usize, max_len: usize) -> Result<CacheSizes> {
        if slots == 0 || max_len == 0 {
            return Err(Error::Capacity(format!(
                "a state cache needs at least one slot of at least one token (slots {slots}, max_len {max_len})"
            )));
        }
        let product = |what: &str, factors: &[usize]| {
            factors.iter().try_fold(1usize, |a, &f| a.checked_mul(f)).ok_or_else(|| {
                Error::Capacity(format!(
                    "the {what} cache of {slots} slots of {max_len} tokens overflows ({} elements)",
                    factors.iter().map(|f| f.to_string()).collect::<Vec<_>>().join(" x ")
                ))
            })
        };
        let (mut conv, mut ssm, mut kv) = (0, 0, 0);
        if let Some(c) = &config.mamba {
            conv = product("conv", &[slots, c.conv_dim(), c.conv_kernel.saturating_sub(1)])?;
            ssm = product("SSM state", &[slots, c.inner(), c.state_size])?;
        }
        if let Some(c) = &config.attention {
            kv = product("KV", &[slots, max_len, c.kv_heads, c.head_dim])?;
        }
        Ok(CacheSizes { conv, ssm, kv, max_len })
    }
}

/// A tensor as bf16 on the backend.
pub(crate) fn bf16s<B: Backend>(b: &B, t: &Tensor) -> Result<B::Buf> {
    b.upload(&t.to_bf16()?)
}

/// A Mamba mixer's weights, uploaded once (A = -exp(A_log)), and its slots' conv and SSM
/// states (zeros at load, updated in place by each step): what a backend's Mamba layer
/// ([`Backend::Mamba`]) holds, beside its choice of kernels.
pub struct MambaWeights<B: Backend> {
    pub c: MambaConfig,
    /// The gated norm's epsilon.
    pub eps: f32,
    pub in_proj: B::Weight,
    /// The causal conv's weights `[conv_dim, k]` and bias.
    pub conv_w: B::Buf,
    pub conv_b: Option<B::Buf>,
    /// Per head: dt's bias, A and D.
    pub dt_bias: B::Buf32,
    pub a: B::Buf32,
    pub d: B::Buf32,
    /// The gated norm's weight `[heads * head_dim]`.
    pub norm: B::Buf,
    pub out_proj: B::Weight,
    /// `[slots, conv_dim, k - 1]`: each slot's last k - 1 conv inputs.
    pub conv_state: B::Buf,
    /// `[slots, heads, head_dim, state_size]`.
    pub ssm_state: B::Buf32,
}

impl<B: Backend> MambaWeights<B> {
    /// Uploads the mixer `m` of `c` (its gated norm's epsilon `eps`) with zero states of
    /// `sizes`.
    pub fn upload(b: &B, c: &MambaConfig, eps: f32, m: &layout::Mamba, sizes: &CacheSizes) -> Result<Self> {
        let a: Vec<f32> = m.a_log.to_f32()?.into_iter().map(|v| -v.exp()).collect();
        Ok(MambaWeights {
            c: c.clone(),
            eps,
            in_proj: b.weight(&m.in_proj)?,
            conv_w: bf16s(b, &m.conv_w)?,
            conv_b: m.conv_b.as_ref().map(|t| bf16s(b, t)).transpose()?,
            dt_bias: b.upload32(&m.dt_bias.to_f32()?)?,
            a: b.upload32(&a)?,
            d: b.upload32(&m.d.to_f32()?)?,
            norm: bf16s(b, &m.norm)?,
            out_proj: b.weight(&m.out_proj)?,
            conv_state: b.zeros(sizes.conv)?,
            ssm_state: b.zeros32(sizes.ssm)?,
        })
    }
}

/// The rows attention reads: queries, keys and values.
pub struct QkvRows<'a, B> {
    pub q: In<'a, B>,
    pub k: In<'a, B>,
    pub v: In<'a, B>,
}

/// A step's q, k and v rows as an attention layer's projections wrote them
/// ([`AttentionOps::qkv`]): side by side in one buffer (one projection of the three
/// weights' rows in order), or a buffer each.
pub enum QkvBufs<B> {
    Fused(B),
    Apart { q: B, k: B, v: B },
}

impl<B> QkvBufs<B> {
    /// The q, k and v rows, `qw`, `kw` and `kw` wide.
    pub fn rows(&self, qw: usize, kw: usize) -> QkvRows<'_, B> {
        match self {
            QkvBufs::Fused(p) => {
                let p = In::rows(p, qw + 2 * kw);
                QkvRows { q: p, k: p.at(0, qw), v: p.at(0, qw + kw) }
            }
            QkvBufs::Apart { q, k, v } => QkvRows { q: In::rows(q, qw), k: In::rows(k, kw), v: In::rows(v, kw) },
        }
    }
}

/// `rows` contiguous rows of `x` through the linear layer `w` (`width` outputs), into a buffer
/// of their own.
pub(crate) fn project<B: Backend>(b: &B, x: In<B::Buf>, rows: usize, w: &B::Weight, width: usize) -> Result<B::Buf> {
    let mut buf = b.scratch(rows * width)?;
    b.linear(x, rows, w, Out { buf: &mut buf, offset: 0 })?;
    Ok(buf)
}

/// The sequences of a step's prefill part, as the backend needs them.
#[derive(Clone, Debug, PartialEq)]
pub struct PrefillSeqs {
    pub lens: Vec<usize>,
    pub slots: Vec<i32>,
    pub initial: Vec<bool>,
}

/// The rows of one step, in the order of its activations: the decode rows (one token each),
/// then the prefill sequences' tokens, sequence after sequence.
#[derive(Clone, Debug, PartialEq)]
pub struct StepRows {
    /// The token of each row.
    pub tokens: Vec<u32>,
    /// The cache slot of each decode row.
    pub decode_slots: Vec<i32>,
    /// The prefill sequences (empty `lens` when the step has no prefill).
    pub prefill: PrefillSeqs,
    /// The cache slot of each row, decode and prefill (attention).
    pub slots: Vec<i32>,
    /// The position of each row's token in its sequence (attention).
    pub positions: Vec<u32>,
    /// The rows whose logits the step returns (all rows, in order, in a step without
    /// prefill: it then reads no gather of them).
    pub last: Vec<u32>,
}

/// A MoE layer's uploaded weights.
pub struct MoeWeights<B: Backend> {
    /// Router `[experts, hidden]`.
    pub gate: B::Buf,
    /// `[experts]` selection bias (zeros when the checkpoint has none).
    pub score_bias: B::Buf32,
    /// The routed experts and the shared expert.
    pub experts: B::Experts,
}

impl<B: Backend> MoeWeights<B> {
    /// The whole MoE layer for `rows` rows of `x`: routing, routed experts, shared expert.
    pub fn forward(&self, b: &B, c: &MoeConfig, x: In<B::Buf>, rows: usize, y: Out<B::Buf>) -> Result<()> {
        self.experts.forward(b, c, (&self.gate, &self.score_bias), (x, rows), y)
    }

    /// The routed experts of each of `rows` rows of `x` (`top_k` ids a row, row by row) as
    /// [`MoeWeights::forward`]'s routing picks them, on the host (so it waits for the queue):
    /// for a step that tallies its experts' loads ([`crate::model::Model::set_expert_tally`]).
    pub fn choices(&self, b: &B, c: &MoeConfig, x: In<B::Buf>, rows: usize) -> Result<Vec<u32>> {
        self.experts.choices(b, c, (&self.gate, &self.score_bias), (x, rows))
    }
}

/// A backend: buffers, uploads, and the model's operations. All operations are queued in
/// order; results are visible to the next operation and to downloads.
pub trait Backend: Sized {
    /// bf16 elements (activations, bf16 weights, conv states, KV caches).
    type Buf;
    /// f32 elements (per-head parameters, SSM states).
    type Buf32;
    /// A linear layer's weight, ready for [`Backend::linear`].
    type Weight;
    /// A MoE layer's routed experts and shared expert, with their operations
    /// ([`ExpertsOps`]), beside the layer's router in [`MoeWeights`].
    type Experts: ExpertsOps<Self>;
    /// A Mamba mixer: its weights, its slots' states and its choice of kernels, with its
    /// operations ([`MambaOps`]).
    type Mamba: MambaOps<Self>;
    /// An attention layer: its projections, its slots' key and value caches and its choice of
    /// kernels, with its operations ([`AttentionOps`]).
    type Attention: AttentionOps<Self>;
    /// A step's [`StepRows`] as the operations read them.
    type Rows;
    /// A recorded step (see [`Backend::record`]).
    type Graph;
    /// A step's sampling rows and where their tokens go (see [`Backend::sample`]).
    type Sampling;
    /// A point in the queue of work, for profiles (see [`Backend::stamp`]).
    type Stamp;

    fn upload(&self, v: &[bf16]) -> Result<Self::Buf>;
    fn upload32(&self, v: &[f32]) -> Result<Self::Buf32>;
    fn zeros(&self, n: usize) -> Result<Self::Buf>;
    fn zeros32(&self, n: usize) -> Result<Self::Buf32>;
    /// A buffer of `n` elements whose values are unspecified until written: for activations
    /// a step writes entirely before it reads them.
    fn scratch(&self, n: usize) -> Result<Self::Buf>;
    /// The buffer's rows of `width` values (its length a multiple of it), as f32.
    fn download_rows(&self, b: &Self::Buf, width: usize) -> Result<Vec<Vec<f32>>>;
    /// Copies `n` elements of `src` from element `from` into `dst` from element `to`, in queue
    /// order (a range past either buffer is an error).
    fn copy(&self, src: &Self::Buf, from: usize, dst: &mut Self::Buf, to: usize, n: usize) -> Result<()>;
    /// [`Backend::copy`] of f32 buffers.
    fn copy32(&self, src: &Self::Buf32, from: usize, dst: &mut Self::Buf32, to: usize, n: usize) -> Result<()>;
    fn weight(&self, l: &Linear) -> Result<Self::Weight>;
    /// Uploads the routed experts of a MoE layer (all of one shape) and its shared expert.
    fn experts(&self, list: &[Mlp], shared: Option<&Mlp>) -> Result<Self::Experts>;
    /// Uploads a Mamba mixer of `c` (its gated norm's epsilon `eps`) with zero states of
    /// `sizes`.
    fn mamba(&self, c: &MambaConfig, eps: f32, m: &layout::Mamba, sizes: &CacheSizes) -> Result<Self::Mamba>;
    /// Uploads an attention layer of `c` with zero key and value caches of `sizes`.
    fn attention(&self, c: &AttentionConfig, a: &layout::Attention, sizes: &CacheSizes) -> Result<Self::Attention>;

    /// Readies a step's rows for the operations, for a cache of `slots` slots of `max_len`
    /// tokens. The model has checked them (slots in range and distinct, positions below
    /// `max_len`); a backend that indexes device memory with them checks them again.
    fn rows(&self, rows: &StepRows, slots: usize, max_len: usize) -> Result<Self::Rows>;
    /// Writes `rows` over `into` in place (the same numbers of decode rows and prefill
    /// sequences as when `into` was made), so a recorded step reads the new rows (a backend
    /// may leave `last` out: a step without prefill does not read it).
    fn set_rows(&self, into: &mut Self::Rows, rows: &StepRows) -> Result<()>;
    /// Runs the operations `f` queues, for a step of `decode` decode rows and no prefill, or
    /// records them to replay: `Some(graph)` when recorded (nothing ran yet: replay it),
    /// `None` when `f` ran (a backend that does not record, or a step it will not record).
    /// What `f` reads and writes besides its own temporaries must stay in place while the
    /// graph lives; the rows it reads are replaced through [`Backend::set_rows`].
    fn record(&self, decode: usize, f: &mut dyn FnMut() -> Result<()>) -> Result<Option<Self::Graph>>;
    /// Runs a recorded step again.
    fn replay(&self, graph: &Self::Graph) -> Result<()>;

    /// Readies one sampling row per row of logits (checked as `host::sample::check_row`
    /// does), with room for `capacity` penalty pairs in all.
    fn sampling(&self, rows: &[RowSampling], vocab: usize, capacity: usize) -> Result<Self::Sampling>;
    /// Writes `rows` over `into` in place (as many as before), for a recorded step.
    fn set_sampling(&self, into: &mut Self::Sampling, rows: &[RowSampling]) -> Result<()>;
    /// Whether `rows`' penalty pairs (and masks) fit the room `s` was readied with.
    fn sampling_fits(&self, s: &Self::Sampling, rows: &[RowSampling]) -> bool;
    /// Picks each row's token from its row of `logits` (rows of `vocab`), where the logits
    /// are (kernels-gpu's sample.rs has the math).
    fn sample(&self, logits: &Self::Buf, vocab: usize, s: &mut Self::Sampling) -> Result<()>;
    /// What the last [`Backend::sample`] into `s` picked, a row each.
    fn sampled(&self, s: &Self::Sampling) -> Result<Vec<SampleOut>>;

    /// A point after the work queued so far, for profiles ([`crate::profile`]); outside a
    /// recording ([`Backend::record`]) only.
    fn stamp(&self) -> Result<Self::Stamp>;
    /// Milliseconds from stamp `from` to stamp `to` (made after it), once the work before
    /// `to` is done (a backend may wait for it).
    fn ms_between(&self, from: &Self::Stamp, to: &Self::Stamp) -> Result<f64>;

    /// Rows `rows.tokens` of `table [vocab, width]` into `out`.
    fn embed(&self, table: &Self::Buf, width: usize, rows: &Self::Rows, out: Out<Self::Buf>) -> Result<()>;
    /// Rows `rows.last` of `x` (rows of `width`) into `out`.
    fn last_rows(&self, x: &Self::Buf, width: usize, rows: &Self::Rows, out: Out<Self::Buf>) -> Result<()>;
    /// RMSNorm of `rows` rows of the norm's width.
    fn rms_norm(&self, x: In<Self::Buf>, norm: Norm<Self::Buf>, rows: usize, y: Out<Self::Buf>) -> Result<()>;
    /// `y = x W^T` for `rows` contiguous rows of `x`.
    fn linear(&self, x: In<Self::Buf>, rows: usize, w: &Self::Weight, y: Out<Self::Buf>) -> Result<()>;
    /// The residual add and the next RMSNorm: `h = bf16(h + x)` over `rows` contiguous rows
    /// of the norm's width, then `y` the RMSNorm of those rows of h.
    fn add_rms_norm(
        &self,
        h: &mut Self::Buf,
        x: &Self::Buf,
        norm: Norm<Self::Buf>,
        rows: usize,
        y: Out<Self::Buf>,
    ) -> Result<()>;
    /// A dense MLP over `rows` contiguous rows: `down(relu(up x)^2)`, the hidden activation
    /// rounded to bf16 before and after the square.
    fn mlp(
        &self,
        x: In<Self::Buf>,
        rows: usize,
        up: &Self::Weight,
        down: &Self::Weight,
        y: Out<Self::Buf>,
    ) -> Result<()>;
}

/// A Mamba mixer's operations on backend `B`, on its layer object ([`Backend::Mamba`], built
/// at load). Every operation is queued on `b` in order, as the backend's own.
pub trait MambaOps<B: Backend> {
    /// The mixer's in_proj over `rows` contiguous rows of `x`: rows of z, xBC and dt.
    fn in_proj(&self, b: &B, x: In<B::Buf>, rows: usize, zx: Out<B::Buf>) -> Result<()>;
    /// The `nd` decode rows between the projections, from `zx` (in_proj's output rows): the
    /// conv update of their xBC and the selective state update, in place at their slots'
    /// states, then the gated norm into `y` (a backend may do it in one launch).
    fn decode(&mut self, b: &B, zx: In<B::Buf>, nd: usize, rows: &B::Rows, y: Out<B::Buf>) -> Result<()>;
    /// The conv forward of the prefill sequences' xBC rows `x` (their final inputs written to
    /// their slots' conv states).
    fn conv(&mut self, b: &B, x: In<B::Buf>, rows: &B::Rows, y: Out<B::Buf>) -> Result<()>;
    /// The chunked scan of the prefill sequences; `xbc` rows hold x, B, C, `dt` rows the heads'
    /// dt (their final states written to their slots' SSM states).
    fn scan(&mut self, b: &B, xbc: In<B::Buf>, dt: In<B::Buf>, rows: &B::Rows, y: Out<B::Buf>) -> Result<()>;
    /// The gated group RMSNorm of `rows` rows `x` with their gates `z`: `x * silu(z)`
    /// normalized per group of the mixer's heads.
    fn gated_norm(&self, b: &B, x: In<B::Buf>, z: In<B::Buf>, rows: usize, y: Out<B::Buf>) -> Result<()>;
    /// The mixer's out_proj over `rows` contiguous rows of `x`.
    fn out_proj(&self, b: &B, x: In<B::Buf>, rows: usize, y: Out<B::Buf>) -> Result<()>;
    /// The slots' states, as [`MambaWeights`] holds them: the conv state `[slots, conv_dim, k
    /// - 1]` and the SSM state `[slots, heads, head_dim, state_size]`.
    fn state(&mut self) -> (&mut B::Buf, &mut B::Buf32);
}

/// A MoE layer's experts' operations on backend `B`, on their layer object
/// ([`Backend::Experts`], built at load), routed by the layer's router: its `gate` and
/// selection bias ([`MoeWeights`]).
pub trait ExpertsOps<B: Backend> {
    /// The whole layer for `rows` rows of `x`: routing, routed experts, shared expert.
    fn forward(
        &self,
        b: &B,
        c: &MoeConfig,
        router: (&B::Buf, &B::Buf32),
        x: (In<B::Buf>, usize),
        y: Out<B::Buf>,
    ) -> Result<()>;
    /// The routed experts of each row (`top_k` ids a row, row by row) as `forward` routes
    /// them, on the host.
    fn choices(&self, b: &B, c: &MoeConfig, router: (&B::Buf, &B::Buf32), x: (In<B::Buf>, usize)) -> Result<Vec<u32>>;
}

/// An attention layer's operations on backend `B`, on its layer object
/// ([`Backend::Attention`], built at load).
pub trait AttentionOps<B: Backend> {
    /// The q, k and v projections of `rows` contiguous rows of `x`.
    fn qkv(&self, b: &B, x: In<B::Buf>, rows: usize) -> Result<QkvBufs<B::Buf>>;
    /// Causal attention: writes each row's k and v into its slot's cache at its position,
    /// then attends each row over its slot's positions up to its own.
    fn attend(&mut self, b: &B, qkv: &QkvBufs<B::Buf>, rows: &B::Rows, y: Out<B::Buf>) -> Result<()>;
    /// The o_proj over `rows` contiguous rows of `x`.
    fn out(&self, b: &B, x: In<B::Buf>, rows: usize, y: Out<B::Buf>) -> Result<()>;
    /// The key and value caches, `[slots, max_len, kv_heads * head_dim]` each.
    fn kv_cache(&mut self) -> (&mut B::Buf, &mut B::Buf);
}

/// Checks that `n` elements from `at` lie within a buffer of `len` ([`Backend::copy`]).
pub(crate) fn check_range(len: usize, at: usize, n: usize, what: &str) -> Result<()> {
    match at.checked_add(n) {
        Some(end) if end <= len => Ok(()),
        _ => Err(Error::Unsupported(format!("a copy of {n} elements from {at} {what} a buffer of {len}"))),
    }
}

/// `v`'s rows of `width` values as f32 ([`Backend::download_rows`]): each bf16's bits as the
/// high half of an f32's, its exact value (a NaN keeps its payload), a shift the compiler
/// vectorizes (half's `to_f32` also quiets NaNs, per value; on a step's logits it took twice
/// as long).
pub(crate) fn rows_f32(v: &[bf16], width: usize) -> Vec<Vec<f32>> {
    let f32_of = |x: &bf16| f32::from_bits(u32::from(x.to_bits()) << 16);
    v.chunks_exact(width.max(1)).map(|r| r.iter().map(f32_of).collect()).collect()
}

#[cfg(test)]
mod tests {
    use half::bf16;

    use super::rows_f32;

    #[test]
    fn rows_f32_is_every_bf16_value_in_rows() {
        let all: Vec<bf16> = (0..=u16::MAX).map(bf16::from_bits).collect();
        let rows = rows_f32(&all, 256);
        assert_eq!(rows.len(), 256);
        let mut compared = 0;
        for (got, want) in rows.iter().flatten().zip(&all) {
            let want = want.to_f32();
            assert!(got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()), "{got} for {want}");
            compared += 1;
        }
        assert_eq!(compared, 65536);
    }
}
