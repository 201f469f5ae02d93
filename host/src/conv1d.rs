//! Launchers of the causal conv1d family (kernels-gpu/src/conv1d.rs; reference: cpu/conv1d.rs).

use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut};
use half::bf16;
use kernels_gpu::Kernel;
use kernels_gpu::conv1d::{CONV_BLOCK, ConvFwdParams, ConvUpdateParams, MAX_K, TILE_BATCH, TILE_CHANNELS, TILED_MAX_K};

use crate::batch::{Prefill, Slots};
use crate::check::{Check, MAX_ELEMS};
use crate::error::Result;
use crate::gpu::Gpu;

/// Geometry of the conv: `dim` channels, `k` taps, input rows `x_stride` elements apart
/// (channels `0..dim` at the start of each row).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ConvShape {
    pub dim: usize,
    pub k: usize,
    pub x_stride: usize,
}

impl ConvShape {
    /// Checks the geometry, the weights and the state cache (`num_slots` slots); `rows` input
    /// rows must fit in `x`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn check(
        &self,
        kernel: Kernel,
        rows: usize,
        x: usize,
        w: usize,
        bias: Option<usize>,
        state: usize,
        num_slots: usize,
    ) -> Result<()> {
        let c = Check(kernel.name());
        c.count("dim", MAX_ELEMS, self.dim)?;
        c.that("k", (2..=MAX_K as usize).contains(&self.k), format!("2..={MAX_K} taps"), self.k)?;
        c.that("x_stride", self.x_stride >= self.dim, format!(">= dim {}", self.dim), self.x_stride)?;
        let need = (rows - 1).checked_mul(self.x_stride).and_then(|v| v.checked_add(self.dim));
        c.that("x", need.is_some(), "an extent that fits in usize", format!("stride {}", self.x_stride))?;
        c.len_at_least("x", need.unwrap_or(0), x)?;
        c.len("w", self.dim * self.k, w)?;
        if let Some(b) = bias {
            c.len("bias", self.dim, b)?;
        }
        c.len("state", num_slots * self.dim * (self.k - 1), state)
    }

    fn blocks(&self) -> u32 {
        self.dim.div_ceil(CONV_BLOCK as usize) as u32
    }
}

/// Decode step (docs/MATH.md section 1): for each row, `y = silu(bias + w . [state[slot], x])`,
/// then the slot's state shifted left with x appended. Pad rows are skipped entirely.
/// `state` is the whole `[slots, dim, k - 1]` cache; `y` is `[batch, dim]`.
#[allow(clippy::too_many_arguments)]
pub fn conv_update(
    gpu: &Gpu,
    shape: ConvShape,
    x: &impl DevicePtr<bf16>,
    w: &CudaSlice<bf16>,
    bias: Option<&CudaSlice<bf16>>,
    state: &mut impl DevicePtrMut<bf16>,
    slots: &Slots,
    y: &mut impl DevicePtrMut<bf16>,
) -> Result<()> {
    let k = Kernel::ConvUpdate;
    let batch = slots.len();
    Check(k.name()).count("batch", 65535, batch)?;
    shape.check(k, batch, x.len(), w.len(), bias.map(|b| b.len()), state.len(), slots.num_slots())?;
    Check(k.name()).len("y", batch * shape.dim, y.len())?;
    let p = ConvUpdateParams {
        x: gpu.addr(k, "x", x)? as *const u16,
        w: gpu.addr(k, "w", w)? as *const u16,
        bias: gpu.opt_addr(k, "bias", bias)? as *const u16,
        state: gpu.addr_mut(k, "state", state)? as *mut u16,
        cache_index: gpu.addr(k, "slots", &slots.dev)? as *const i32,
        y: gpu.addr_mut(k, "y", y)? as *mut u16,
        batch: batch as u32,
        dim: shape.dim as u32,
        k: shape.k as u32,
        x_stride: shape.x_stride as u32,
    };
    // SAFETY: `check` proved x, w, bias, the state cache and y cover the shape; Slots holds
    // only PAD_SLOT or distinct slots < num_slots, the cache's slot count; state and y are
    // `&mut`; grid/block as conv1d_update_bf16 documents.
    unsafe { gpu.launch(k, (shape.blocks(), batch as u32, 1), CONV_BLOCK, 0, p) }
}

/// Which kernel computes a prefill's outputs (the same values bit for bit).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ConvPath {
    /// `conv1d_fwd_bf16`: a thread per channel and token, the shortest time for few tokens.
    PerToken,
    /// `conv1d_fwd_tiled_bf16`: a thread per 4 channels and a run of tokens, 8-byte loads and
    /// each input read once: the copy bandwidth at many tokens. Needs `k <= 4`, `dim` and
    /// `x_stride` multiples of 4 and 8-byte aligned buffers.
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
/// its inputs, then its last k - 1 inputs as the slot's new state. Two launches. Pad
/// sequences are skipped entirely. `y` is `[tokens, dim]`. The outputs' kernel is picked by
/// token count and shape ([`ConvPath`]).
#[allow(clippy::too_many_arguments)]
pub fn conv_fwd(
    gpu: &Gpu,
    shape: ConvShape,
    x: &impl DevicePtr<bf16>,
    w: &CudaSlice<bf16>,
    bias: Option<&CudaSlice<bf16>>,
    state: &mut impl DevicePtrMut<bf16>,
    seqs: &Prefill,
    y: &mut impl DevicePtrMut<bf16>,
) -> Result<()> {
    conv_fwd_on(gpu, None, shape, x, w, bias, state, seqs, y)
}

/// [`conv_fwd`] with the outputs' kernel given (`None`: as [`conv_fwd`] picks); tests and
/// benches compare them. [`ConvPath::Tiled`] on a shape it does not take is an error.
#[allow(clippy::too_many_arguments)]
pub fn conv_fwd_on(
    gpu: &Gpu,
    path: Option<ConvPath>,
    shape: ConvShape,
    x: &impl DevicePtr<bf16>,
    w: &CudaSlice<bf16>,
    bias: Option<&CudaSlice<bf16>>,
    state: &mut impl DevicePtrMut<bf16>,
    seqs: &Prefill,
    y: &mut impl DevicePtrMut<bf16>,
) -> Result<()> {
    let (kf, ks, kt) = (Kernel::ConvFwd, Kernel::ConvFwdState, Kernel::ConvFwdTiled);
    let tokens = seqs.tokens();
    Check(ks.name()).count("sequences", 65535, seqs.nseq())?;
    shape.check(kf, tokens, x.len(), w.len(), bias.map(|b| b.len()), state.len(), seqs.num_slots())?;
    Check(kf.name()).len("y", tokens * shape.dim, y.len())?;
    let mut p = ConvFwdParams {
        x: gpu.addr(kf, "x", x)? as *const u16,
        w: gpu.addr(kf, "w", w)? as *const u16,
        bias: gpu.opt_addr(kf, "bias", bias)? as *const u16,
        state: gpu.addr_mut(kf, "state", state)? as *mut u16,
        cu_seqlens: gpu.addr(kf, "seqs", &seqs.cu_seqlens)? as *const i32,
        cache_index: gpu.addr(kf, "seqs", &seqs.slots)? as *const i32,
        has_initial: gpu.addr(kf, "seqs", &seqs.has_initial)? as *const u8,
        y: gpu.addr_mut(kf, "y", y)? as *mut u16,
        tokens: tokens as u32,
        nseq: seqs.nseq() as u32,
        dim: shape.dim as u32,
        k: shape.k as u32,
        x_stride: shape.x_stride as u32,
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
            ConvPath::PerToken => gpu.launch(kf, (tokens as u32, shape.blocks(), 1), CONV_BLOCK, 0, p)?,
            ConvPath::Tiled => {
                let grid = (tokens.div_ceil(p.tile as usize) as u32, p.dim.div_ceil(TILE_CHANNELS * CONV_BLOCK), 1);
                gpu.launch(kt, grid, CONV_BLOCK, 0, p)?
            }
        }
        p.tile = 0;
        gpu.launch(ks, (shape.blocks(), seqs.nseq() as u32, 1), CONV_BLOCK, 0, p)
    }
}

/// Why the tiled forward cannot take this launch, as (argument, expected, got); `None` when
/// it can.
fn tiled_refusal(shape: &ConvShape, p: &ConvFwdParams) -> Option<(&'static str, String, String)> {
    let v = TILE_CHANNELS as usize;
    if shape.k > TILED_MAX_K as usize {
        return Some(("k", format!("at most {TILED_MAX_K} taps"), shape.k.to_string()));
    }
    if !shape.dim.is_multiple_of(v) || !shape.x_stride.is_multiple_of(v) {
        return Some((
            "dim",
            format!("dim and x_stride multiples of {v}"),
            format!("{} and {}", shape.dim, shape.x_stride),
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
