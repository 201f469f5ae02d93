//! Launchers of the causal conv1d family (kernels-gpu/src/conv1d.rs; reference: cpu/conv1d.rs).

use cudarc::driver::{CudaSlice, DevicePtrMut};
use half::bf16;
use kernels_gpu::conv1d::{CONV_BLOCK, ConvFwdParams, ConvUpdateParams, MAX_K, TILE_BATCH, TILE_CHANNELS, TILED_MAX_K};
use kernels_gpu::entry;

use crate::args::{Args, Len, Rows};
use crate::batch::{Prefill, Slots};
use crate::check::{Check, MAX_ELEMS};
use crate::error::Result;
use crate::gpu::{Gpu, Grid};

/// Geometry of the conv: `dim` channels, `k` taps.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ConvShape {
    pub dim: usize,
    pub k: usize,
}

impl ConvShape {
    /// Checks the geometry.
    pub(crate) fn check(&self, c: Check) -> Result<()> {
        c.count("dim", MAX_ELEMS, self.dim)?;
        c.that("k", (2..=MAX_K as usize).contains(&self.k), format!("2..={MAX_K} taps"), self.k)
    }

    fn blocks(&self) -> u32 {
        self.dim.div_ceil(CONV_BLOCK as usize) as u32
    }
}

/// A causal conv's weights `[dim, k]`, its bias `[dim]` or none, and its state cache
/// `[slots, dim, k - 1]` (the last k - 1 inputs of each slot's sequence, updated in place).
pub struct Conv<'a> {
    pub w: &'a CudaSlice<bf16>,
    pub bias: Option<&'a CudaSlice<bf16>>,
    pub state: &'a mut CudaSlice<bf16>,
}

impl Conv<'_> {
    /// The kernel's pointers to the weights, the bias (null without) and the state cache of a
    /// conv of `shape` with `num_slots` slots.
    pub(crate) fn args(
        &mut self,
        a: &Args,
        shape: ConvShape,
        num_slots: usize,
    ) -> Result<(*const u16, *const u16, *mut u16)> {
        let state = Len::Exactly(num_slots * shape.dim * (shape.k - 1));
        Ok((
            a.input("w", self.w, Len::Exactly(shape.dim * shape.k))?,
            a.opt_input("bias", self.bias, Len::Exactly(shape.dim))?,
            a.output("state", self.state, state)?,
        ))
    }
}

/// Decode step (docs/MATH.md section 1): for each row of `x` (`[batch, dim]` rows),
/// `y = silu(bias + w . [state[slot], x])`, then the slot's state shifted left with x appended.
/// Pad rows are skipped entirely. `y` is `[batch, dim]`.
pub fn conv_update(
    gpu: &Gpu,
    shape: ConvShape,
    x: Rows,
    mut conv: Conv,
    slots: &Slots,
    y: &mut impl DevicePtrMut<bf16>,
) -> Result<()> {
    let k = entry::CONV_UPDATE;
    let a = gpu.args(k);
    let batch = slots.len();
    a.check().count("batch", 65535, batch)?;
    shape.check(a.check())?;
    let (x, x_stride) = a.rows("x", &x, (batch, shape.dim))?;
    let (w, bias, state) = conv.args(&a, shape, slots.num_slots())?;
    let p = ConvUpdateParams {
        x,
        w,
        bias,
        state,
        cache_index: a.input("slots", &slots.dev, Len::Any)?,
        y: a.output("y", y, Len::Exactly(batch * shape.dim))?,
        batch: batch as u32,
        dim: shape.dim as u32,
        k: shape.k as u32,
        x_stride,
    };
    // SAFETY: `Args` proved x, w, bias, the state cache and y cover the shape; Slots holds
    // only PAD_SLOT or distinct slots < num_slots, the cache's slot count; state and y are
    // `&mut`; grid/block as conv1d_update_bf16 documents.
    unsafe { gpu.launch(Grid::new(k, (shape.blocks(), batch as u32, 1)), p) }
}

/// Which kernel computes a prefill's outputs (the same values bit for bit).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ConvPath {
    /// `conv1d_fwd_bf16`: a thread per channel and token, the shortest time for few tokens.
    PerToken,
    /// `conv1d_fwd_tiled_bf16`: a thread per 4 channels and a run of tokens, 8-byte loads and
    /// each input read once: the copy bandwidth at many tokens. Needs `k <= 4`, `dim` and
    /// x's row stride multiples of 4 and 8-byte aligned buffers.
    Tiled,
}

/// Tokens from which [`conv_fwd`] takes [`ConvPath::Tiled`] where the shape allows it (H200,
/// 64 tokens of 6144 channels: 5.3 us tiled, 6.6 per token).
pub const TILED_TOKENS: usize = 64;

/// Tokens per thread of the tiled forward: two batches once there are tiles enough to fill
/// the GPU with them, one below.
fn tile_tokens(tokens: usize) -> u32 {
    if tokens >= 2048 { 2 * TILE_BATCH } else { TILE_BATCH }
}

/// Prefill (docs/MATH.md section 1): each sequence's outputs from its slot's state (or zeros) and
/// its inputs (`x`, `[tokens, dim]` rows), then its last k - 1 inputs as the slot's new state.
/// Two launches. Pad sequences are skipped entirely. `y` is `[tokens, dim]`. The outputs'
/// kernel is picked by token count and shape ([`ConvPath`]).
pub fn conv_fwd(
    gpu: &Gpu,
    shape: ConvShape,
    x: Rows,
    conv: Conv,
    seqs: &Prefill,
    y: &mut impl DevicePtrMut<bf16>,
) -> Result<()> {
    conv_fwd_on(gpu, None, shape, x, conv, seqs, y)
}

/// [`conv_fwd`] with the outputs' kernel given (`None`: as [`conv_fwd`] picks); tests and
/// benches compare them. [`ConvPath::Tiled`] on a shape it does not take is an error.
pub fn conv_fwd_on(
    gpu: &Gpu,
    path: Option<ConvPath>,
    shape: ConvShape,
    x: Rows,
    mut conv: Conv,
    seqs: &Prefill,
    y: &mut impl DevicePtrMut<bf16>,
) -> Result<()> {
    let (kf, ks, kt) = (entry::CONV_FWD, entry::CONV_FWD_STATE, entry::CONV_FWD_TILED);
    let a = gpu.args(kf);
    let tokens = seqs.tokens();
    Check(ks.name()).count("sequences", 65535, seqs.nseq())?;
    shape.check(a.check())?;
    let (x, x_stride) = a.rows("x", &x, (tokens, shape.dim))?;
    let (w, bias, state) = conv.args(&a, shape, seqs.num_slots())?;
    let mut p = ConvFwdParams {
        x,
        w,
        bias,
        state,
        cu_seqlens: a.input("seqs", &seqs.cu_seqlens, Len::Any)?,
        cache_index: a.input("seqs", &seqs.slots, Len::Any)?,
        has_initial: a.input("seqs", &seqs.has_initial, Len::Any)?,
        y: a.output("y", y, Len::Exactly(tokens * shape.dim))?,
        tokens: tokens as u32,
        nseq: seqs.nseq() as u32,
        dim: shape.dim as u32,
        k: shape.k as u32,
        x_stride,
        tile: tile_tokens(tokens),
    };
    let tiled = tiled_refusal(&shape, &p);
    let path = match path {
        Some(ConvPath::Tiled) => {
            if let Some((arg, expected, got)) = tiled {
                return Check(kt.name()).that(arg, false, expected, got);
            }
            ConvPath::Tiled
        }
        Some(ConvPath::PerToken) => ConvPath::PerToken,
        None if tokens >= TILED_TOKENS && tiled.is_none() => ConvPath::Tiled,
        None => ConvPath::PerToken,
    };
    // SAFETY: as in conv_update, with Prefill's cu_seqlens (0 .. tokens, each sequence >= 1
    // token), slots (PAD_SLOT or distinct, in range) and flags (no initial state for pads);
    // the tiled kernel only where `tiled_refusal` found nothing against it (k, whole aligned
    // runs of 4 channels); the outputs launch only reads states, the state launch runs after it on the
    // stream.
    unsafe {
        match path {
            ConvPath::PerToken => gpu.launch(Grid::new(kf, (tokens as u32, shape.blocks(), 1)), p)?,
            ConvPath::Tiled => {
                let grid = (tokens.div_ceil(p.tile as usize) as u32, p.dim.div_ceil(TILE_CHANNELS * CONV_BLOCK), 1);
                gpu.launch(Grid::new(kt, grid), p)?
            }
        }
        p.tile = 0;
        gpu.launch(Grid::new(ks, (shape.blocks(), seqs.nseq() as u32, 1)), p)
    }
}

/// Why the tiled forward cannot take this launch, as (argument, expected, got); `None` when
/// it can.
fn tiled_refusal(shape: &ConvShape, p: &ConvFwdParams) -> Option<(&'static str, String, String)> {
    let v = TILE_CHANNELS as usize;
    if shape.k > TILED_MAX_K as usize {
        return Some(("k", format!("at most {TILED_MAX_K} taps"), shape.k.to_string()));
    }
    if !shape.dim.is_multiple_of(v) || !(p.x_stride as usize).is_multiple_of(v) {
        return Some((
            "dim",
            format!("dim and x's row stride multiples of {v}"),
            format!("{} and {}", shape.dim, p.x_stride),
        ));
    }
    let addrs = [
        ("x", p.x as usize),
        ("w", p.w as usize),
        ("bias", p.bias as usize),
        ("state", p.state as usize),
        ("y", p.y as usize),
    ];
    addrs
        .into_iter()
        .find(|(_, a)| !a.is_multiple_of(16))
        .map(|(arg, a)| (arg, "a 16-byte aligned address".into(), format!("{a:#x}")))
}
