//! The operations the model is composed of. The model's code path ([`crate::model::Model`]) is
//! written once against this trait; a backend implements each operation once: the CPU
//! reference backend ([`crate::cpu::Cpu`]) with the host crate's CPU references, the CUDA
//! backend with the host crate's kernels.
//!
//! Activations are bf16 rows. An operation reads rows through [`In`] (a buffer, the offset of
//! row 0 and the row stride, so slices of wider rows need no copy) and writes contiguous rows
//! at an offset of an output buffer ([`Out`]), so decode rows and prefill rows of one step can
//! go through different kernels into one buffer.

use half::bf16;

use crate::config::{AttentionConfig, MambaConfig, MoeConfig};
use crate::error::Result;
use crate::layout::{Linear, Mlp};

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

/// The sequences of a step's prefill part, as the backend needs them.
#[derive(Clone, Debug, PartialEq)]
pub struct PrefillSeqs {
    pub lens: Vec<usize>,
    pub slots: Vec<i32>,
    pub initial: Vec<bool>,
}

/// A MoE layer's uploaded weights.
pub struct MoeWeights<B: Backend> {
    /// Router `[experts, hidden]`.
    pub gate: B::Buf,
    /// `[experts]` selection bias (zeros when the checkpoint has none).
    pub score_bias: B::Buf32,
    /// The routed experts.
    pub experts: B::Experts,
    pub shared: Option<(B::Weight, B::Weight)>,
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
    /// A MoE layer's routed experts, ready for [`Backend::moe`].
    type Experts;

    fn upload(&self, v: &[bf16]) -> Result<Self::Buf>;
    fn upload32(&self, v: &[f32]) -> Result<Self::Buf32>;
    fn zeros(&self, n: usize) -> Result<Self::Buf>;
    fn zeros32(&self, n: usize) -> Result<Self::Buf32>;
    fn download(&self, b: &Self::Buf) -> Result<Vec<bf16>>;
    fn weight(&self, l: &Linear) -> Result<Self::Weight>;
    /// Uploads the routed experts of a MoE layer (all of one shape).
    fn experts(&self, list: &[Mlp]) -> Result<Self::Experts>;

    /// Rows `tokens[i]` of `table [vocab, width]` into `out`.
    fn embed(&self, table: &Self::Buf, width: usize, tokens: &[u32], out: Out<Self::Buf>) -> Result<()>;
    /// RMSNorm of `rows` rows of `width`.
    fn rms_norm(
        &self,
        x: In<Self::Buf>,
        w: &Self::Buf,
        rows: usize,
        width: usize,
        eps: f32,
        y: Out<Self::Buf>,
    ) -> Result<()>;
    /// Gated group RMSNorm: `x * silu(z)` normalized per group of `width / groups`.
    #[allow(clippy::too_many_arguments)]
    fn gated_norm(
        &self,
        x: In<Self::Buf>,
        z: In<Self::Buf>,
        w: &Self::Buf,
        rows: usize,
        width: usize,
        groups: usize,
        eps: f32,
        y: Out<Self::Buf>,
    ) -> Result<()>;
    /// `y = x W^T` for `rows` contiguous rows of `x`.
    fn linear(&self, x: In<Self::Buf>, rows: usize, w: &Self::Weight, y: Out<Self::Buf>) -> Result<()>;
    /// `h += x`, elementwise over `n` values.
    fn add(&self, h: &mut Self::Buf, x: &Self::Buf, n: usize) -> Result<()>;
    /// `x = relu(x)^2`, elementwise over `n` values.
    fn relu2(&self, x: &mut Self::Buf, n: usize) -> Result<()>;

    /// Conv update for decode rows, in place at their slots' states.
    #[allow(clippy::too_many_arguments)]
    fn conv_decode(
        &self,
        c: &MambaConfig,
        x: In<Self::Buf>,
        w: &Self::Buf,
        bias: Option<&Self::Buf>,
        state: &mut Self::Buf,
        slots: &[i32],
        y: Out<Self::Buf>,
    ) -> Result<()>;
    /// Conv forward for prefill sequences (final inputs written to their slots).
    #[allow(clippy::too_many_arguments)]
    fn conv_prefill(
        &self,
        c: &MambaConfig,
        x: In<Self::Buf>,
        w: &Self::Buf,
        bias: Option<&Self::Buf>,
        state: &mut Self::Buf,
        seqs: &PrefillSeqs,
        y: Out<Self::Buf>,
    ) -> Result<()>;
    /// Selective state update for decode rows; `xbc` rows hold x, B, C; `dt` rows the heads' dt.
    #[allow(clippy::too_many_arguments)]
    fn ssm_decode(
        &self,
        c: &MambaConfig,
        xbc: In<Self::Buf>,
        dt: In<Self::Buf>,
        heads: (&Self::Buf32, &Self::Buf32, &Self::Buf32),
        state: &mut Self::Buf32,
        slots: &[i32],
        y: Out<Self::Buf>,
    ) -> Result<()>;
    /// Chunked scan for prefill sequences (final states written to their slots).
    #[allow(clippy::too_many_arguments)]
    fn ssm_prefill(
        &self,
        c: &MambaConfig,
        xbc: In<Self::Buf>,
        dt: In<Self::Buf>,
        heads: (&Self::Buf32, &Self::Buf32, &Self::Buf32),
        state: &mut Self::Buf32,
        seqs: &PrefillSeqs,
        y: Out<Self::Buf>,
    ) -> Result<()>;
    /// The whole MoE layer for `rows` rows: routing, routed experts, shared expert.
    fn moe(&self, c: &MoeConfig, x: In<Self::Buf>, rows: usize, w: &MoeWeights<Self>, y: Out<Self::Buf>) -> Result<()>;
    /// Causal attention: appends each row's k and v to its sequence's cache (`[slots,
    /// max_len, kv_heads * head_dim]`) after the `past[i]` tokens already there, and attends
    /// over the cache. Rows are grouped by sequence: `lens[i]` rows of sequence i, slot
    /// `slots[i]`.
    #[allow(clippy::too_many_arguments)]
    fn attention(
        &self,
        c: &AttentionConfig,
        q: In<Self::Buf>,
        k: In<Self::Buf>,
        v: In<Self::Buf>,
        cache: (&mut Self::Buf, &mut Self::Buf),
        max_len: usize,
        seqs: (&[usize], &[i32], &[usize]),
        y: Out<Self::Buf>,
    ) -> Result<()>;
}
