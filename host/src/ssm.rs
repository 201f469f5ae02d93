//! Launcher of the selective state update (kernels-gpu/src/ssm.rs; reference: cpu/ssm.rs),
//! and the per-token inputs and per-head parameters it shares with the chunked scan.

use cudarc::driver::{CudaSlice, DevicePtrMut, ValidAsZeroBits};
use half::bf16;
use kernels_gpu::ssd::SsdPassParams;
use kernels_gpu::ssm::{
    SSM_FEW_ROWS, SSM_MANY_ROWS_BATCH, SSM_MAX_STATE, SSM_ROWS, SSM_WARPS, SsmGeometry, SsmUpdateParams,
};
use kernels_gpu::{Entry, Kernel, KernelParams, entry};

use crate::args::{Args, Elem, Len, Rows};
use crate::batch::Slots;
use crate::check::{Check, MAX_ELEMS};
use crate::error::Result;
use crate::gpu::{Gpu, Grid};

/// The per-token inputs of the SSM (docs/MATH.md sections 2 and 3): x `[rows, heads * head_dim]`,
/// dt `[rows, heads]`, B and C `[rows, groups * state_size]` (all of the same rows; columns of
/// wider rows, such as the conv output's, as [`Rows::cols`]).
#[derive(Clone, Copy)]
pub struct SsmInputs<'a> {
    pub x: Rows<'a>,
    pub dt: Rows<'a>,
    pub b: Rows<'a>,
    pub c: Rows<'a>,
}

/// Per-head parameters, f32 `[heads]`: dt_bias, A (= -exp(A_log)) and the optional D.
#[derive(Clone, Copy)]
pub struct SsmHeads<'a> {
    pub dt_bias: &'a CudaSlice<f32>,
    pub a: &'a CudaSlice<f32>,
    pub d: Option<&'a CudaSlice<f32>>,
}

impl SsmHeads<'_> {
    /// The kernel's pointers to dt_bias, A and D (null where absent), each of `heads`.
    pub(crate) fn args(&self, a: &Args, heads: usize) -> Result<(*const f32, *const f32, *const f32)> {
        let n = Len::Exactly(heads);
        Ok((a.input("dt_bias", self.dt_bias, n)?, a.input("a", self.a, n)?, a.opt_input("d", self.d, n)?))
    }
}

/// A state cache `[slots, heads, head_dim, state_size]` and the slots decode rows read it at,
/// writing it at `dst` where given (else back at `slots`).
pub struct SsmCache<'a, T> {
    pub state: &'a mut CudaSlice<T>,
    pub slots: &'a Slots,
    pub dst: Option<&'a Slots>,
}

/// SSM geometry and the dt clamp applied after softplus (NemotronH: `(0, inf)`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SsmShape {
    pub heads: usize,
    pub head_dim: usize,
    pub groups: usize,
    pub state_size: usize,
    pub dt_min: f32,
    pub dt_max: f32,
}

impl SsmShape {
    /// The clamp-free shape.
    pub fn new(heads: usize, head_dim: usize, groups: usize, state_size: usize) -> SsmShape {
        SsmShape { heads, head_dim, groups, state_size, dt_min: 0.0, dt_max: f32::INFINITY }
    }

    /// The kernels' form of it (sizes the launchers checked).
    pub(crate) fn geometry(&self) -> SsmGeometry {
        SsmGeometry {
            heads: self.heads as u32,
            head_dim: self.head_dim as u32,
            groups: self.groups as u32,
            state_size: self.state_size as u32,
            dt_min: self.dt_min,
            dt_max: self.dt_max,
        }
    }

    /// Channels of x (and y, z).
    pub fn width(&self) -> usize {
        self.heads * self.head_dim
    }

    /// Elements of one slot of the state cache.
    pub fn slot_len(&self) -> usize {
        self.heads * self.head_dim * self.state_size
    }

    /// Checks the geometry, the per-head parameters and the state cache (`num_slots` slots):
    /// the chunked scan's check (the state update and the fused decode check the lengths where
    /// they take the pointers, [`SsmHeads::args`]).
    pub(crate) fn check(&self, k: Kernel, heads: &SsmHeads, state: usize, num_slots: usize) -> Result<()> {
        let c = Check(k.name());
        self.check_geometry(c)?;
        c.len("dt_bias", self.heads, heads.dt_bias.len())?;
        c.len("a", self.heads, heads.a.len())?;
        if let Some(d) = heads.d {
            c.len("d", self.heads, d.len())?;
        }
        c.len("state", self.cache_len(c, num_slots)?, state)
    }

    /// Checks the geometry: heads in groups, head_dim, state_size, the dt clamp.
    pub(crate) fn check_geometry(&self, c: Check) -> Result<()> {
        c.count("heads", 65535, self.heads)?;
        c.count("groups", self.heads, self.groups)?;
        c.that(
            "groups",
            self.heads.is_multiple_of(self.groups),
            format!("a divisor of heads {}", self.heads),
            self.groups,
        )?;
        c.count("head_dim", MAX_ELEMS, self.head_dim)?;
        c.that(
            "state_size",
            self.state_size.is_multiple_of(4) && (4..=SSM_MAX_STATE as usize).contains(&self.state_size),
            format!("a multiple of 4 in 4..={SSM_MAX_STATE}"),
            self.state_size,
        )?;
        c.that(
            "dt_min",
            !self.dt_min.is_nan() && !self.dt_max.is_nan() && self.dt_min <= self.dt_max,
            "dt_min <= dt_max, neither NaN",
            format!("({}, {})", self.dt_min, self.dt_max),
        )
    }

    /// Elements of a state cache of `num_slots` slots, checked to fit in usize.
    pub(crate) fn cache_len(&self, c: Check, num_slots: usize) -> Result<usize> {
        let len = num_slots.checked_mul(self.slot_len());
        c.that("state", len.is_some(), "a cache that fits in usize", num_slots)?;
        Ok(len.unwrap_or(usize::MAX))
    }
}

/// A state-cache element type: f32 or bf16 (as the kernels see it, `Elem::Raw`: f32, or u16
/// holding bf16 bits), with its kernels.
pub trait StateDtype: Elem + ValidAsZeroBits {
    /// The state update kernel for this state type.
    const UPDATE: Entry<SsmUpdateParams<Self::Raw>>;
    /// The chunked scan's state-passing kernel for this state type.
    const PASS: Entry<SsdPassParams<Self::Raw>>;
}

impl StateDtype for f32 {
    const UPDATE: Entry<SsmUpdateParams<f32>> = entry::SSM_UPDATE_F32;
    const PASS: Entry<SsdPassParams<f32>> = entry::SSD_STATE_PASS_F32;
}

impl StateDtype for bf16 {
    const UPDATE: Entry<SsmUpdateParams<u16>> = entry::SSM_UPDATE_BF16;
    const PASS: Entry<SsdPassParams<u16>> = entry::SSD_STATE_PASS_BF16;
}

/// Fails when a row writes a slot another row reads (the update runs rows concurrently).
fn check_dst(k: Kernel, src: &Slots, dst: &Slots) -> Result<()> {
    let c = Check(k.name());
    c.len("dst", src.len(), dst.len())?;
    c.that(
        "dst",
        dst.num_slots() == src.num_slots(),
        format!("slots of a {}-slot cache", src.num_slots()),
        dst.num_slots(),
    )?;
    for (i, &d) in dst.as_slice().iter().enumerate() {
        let clash = src.as_slice().iter().enumerate().any(|(j, &s)| j != i && s == d && d >= 0);
        c.that(
            "dst",
            !clash,
            "destination slots no other row reads",
            format!("row {i} writes slot {d}, which another row reads"),
        )?;
    }
    Ok(())
}

/// Selective state update (docs/MATH.md section 2) for each decode row, in place: reads the
/// state at `cache.slots`, writes it at `cache.dst` (or back at the slots), skips the write for
/// pad rows (whose input state is zero) and writes `y [batch, heads * head_dim]`, gated by
/// `silu(z)` when `z` is given.
pub fn ssm_update<T: StateDtype>(
    gpu: &Gpu,
    shape: SsmShape,
    inputs: SsmInputs,
    z: Option<Rows>,
    heads: SsmHeads,
    cache: SsmCache<T>,
    y: &mut impl DevicePtrMut<bf16>,
) -> Result<()>
where
    SsmUpdateParams<T::Raw>: KernelParams,
{
    let k = T::UPDATE;
    let a = gpu.args(k);
    let (slots, batch) = (cache.slots, cache.slots.len());
    a.check().count("batch", 65535, batch)?;
    shape.check_geometry(a.check())?;
    if let Some(dst) = cache.dst {
        check_dst(k.kernel, slots, dst)?;
    }
    let (w, gn) = (shape.width(), shape.groups * shape.state_size);
    let (x, x_stride) = a.rows("x", &inputs.x, (batch, w))?;
    let (dt, dt_stride) = a.rows("dt", &inputs.dt, (batch, shape.heads))?;
    let (b, b_stride) = a.rows("b", &inputs.b, (batch, gn))?;
    let (c, c_stride) = a.rows("c", &inputs.c, (batch, gn))?;
    let (z, z_stride) = z.map_or(Ok((std::ptr::null(), 0)), |z| a.rows("z", &z, (batch, w)))?;
    let (dt_bias, a_log, d) = heads.args(&a, shape.heads)?;
    let warp_rows = if batch >= SSM_MANY_ROWS_BATCH { SSM_ROWS } else { SSM_FEW_ROWS };
    let p = SsmUpdateParams::<T::Raw> {
        state: a.output("state", cache.state, Len::Exactly(shape.cache_len(a.check(), slots.num_slots())?))?,
        x,
        dt,
        b,
        c,
        z,
        dt_bias,
        a: a_log,
        d,
        cache_index: a.input("slots", &slots.dev, Len::Any)?,
        dst_index: a.opt_input("dst", cache.dst.map(|d| &d.dev), Len::Any)?,
        y: a.output("y", y, Len::Exactly(batch * w))?,
        batch: batch as u32,
        warp_rows,
        geo: shape.geometry(),
        x_stride,
        dt_stride,
        b_stride,
        c_stride,
        z_stride,
    };
    let grid = (shape.head_dim.div_ceil((SSM_WARPS * warp_rows) as usize) as u32, shape.heads as u32, batch as u32);
    // SAFETY: the shape checks and `Args` proved every input covers `batch` rows, the per-head
    // arrays `heads`, the cache `num_slots` slots; Slots holds PAD_SLOT or distinct in-range
    // slots and `check_dst` that no row writes a slot another reads; state_size % 4 == 0 keeps
    // the 4-element state accesses aligned; state and y are `&mut`.
    unsafe { gpu.launch(Grid::new(k, grid), p) }
}
