//! Launcher of the selective state update (kernels-gpu/src/ssm.rs; reference: cpu/ssm.rs),
//! and the per-token inputs and per-head parameters it shares with the chunked scan.

use cudarc::driver::{CudaSlice, DevicePtrMut, DeviceRepr, ValidAsZeroBits};
use half::bf16;
use kernels_gpu::ssm::{SSM_MAX_STATE, SSM_WARPS, SsmUpdateParams};
use kernels_gpu::{Kernel, KernelParams};

use crate::batch::Slots;
use crate::check::{Check, MAX_ELEMS};
use crate::error::Result;
use crate::gpu::Gpu;

/// Rows of bf16 activations inside a buffer: row r starts at `offset + r * stride` (a slice
/// of wider rows, such as the mixer's x, B and C inside the conv output).
#[derive(Clone, Copy)]
pub struct Rows<'a> {
    pub buf: &'a CudaSlice<bf16>,
    pub offset: usize,
    pub stride: usize,
}

impl<'a> Rows<'a> {
    /// Contiguous rows of `width`.
    pub fn contiguous(buf: &'a CudaSlice<bf16>, width: usize) -> Rows<'a> {
        Rows { buf, offset: 0, stride: width }
    }

    /// Checks `rows` rows of `width` fit, and returns the address of row 0.
    pub(crate) fn addr(
        &self,
        gpu: &Gpu,
        k: Kernel,
        arg: &'static str,
        rows: usize,
        width: usize,
    ) -> Result<*const u16> {
        let c = Check(k.name());
        c.that(
            arg,
            self.stride >= width && self.stride <= MAX_ELEMS,
            format!("a row stride in {width}..={MAX_ELEMS}"),
            self.stride,
        )?;
        let need = (rows.max(1) - 1).checked_mul(self.stride).and_then(|v| v.checked_add(self.offset + width));
        c.len_at_least(arg, need.unwrap_or(usize::MAX), self.buf.len())?;
        Ok((gpu.addr(k, arg, self.buf)? + 2 * self.offset as u64) as *const u16)
    }
}

/// The per-token inputs of the SSM (docs/MATH.md sections 2 and 3): x `[rows, heads * head_dim]`,
/// dt `[rows, heads]`, B and C `[rows, groups * state_size]`.
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

    /// Channels of x (and y, z).
    pub fn width(&self) -> usize {
        self.heads * self.head_dim
    }

    /// Elements of one slot of the state cache.
    pub fn slot_len(&self) -> usize {
        self.heads * self.head_dim * self.state_size
    }

    /// Checks the geometry, the per-head parameters and the state cache (`num_slots` slots).
    pub(crate) fn check(&self, k: Kernel, heads: &SsmHeads, state: usize, num_slots: usize) -> Result<()> {
        let c = Check(k.name());
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
        )?;
        c.len("dt_bias", self.heads, heads.dt_bias.len())?;
        c.len("a", self.heads, heads.a.len())?;
        if let Some(d) = heads.d {
            c.len("d", self.heads, d.len())?;
        }
        let slot = self.slot_len();
        c.that("state", num_slots.checked_mul(slot).is_some(), "a cache that fits in usize", num_slots)?;
        c.len("state", num_slots * slot, state)
    }
}

/// A state-cache element type: f32 or bf16, with its kernels.
pub trait StateDtype: DeviceRepr + ValidAsZeroBits {
    /// The element as the kernels see it (f32, or u16 holding bf16 bits).
    type Raw: Copy;
    /// The state update kernel for this state type.
    const UPDATE: Kernel;
    /// The chunked scan's state-passing kernel for this state type.
    const PASS: Kernel;
}

impl StateDtype for f32 {
    type Raw = f32;
    const UPDATE: Kernel = Kernel::SsmUpdateF32;
    const PASS: Kernel = Kernel::SsdStatePassF32;
}

impl StateDtype for bf16 {
    type Raw = u16;
    const UPDATE: Kernel = Kernel::SsmUpdateBf16;
    const PASS: Kernel = Kernel::SsdStatePassBf16;
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
/// state at `slots`, writes it at `dst` (or back at `slots`), skips the write for pad rows
/// (whose input state is zero) and writes `y [batch, heads * head_dim]`, gated by `silu(z)`
/// when `z` is given.
#[allow(clippy::too_many_arguments)]
pub fn ssm_update<T: StateDtype>(
    gpu: &Gpu,
    shape: SsmShape,
    inputs: SsmInputs,
    z: Option<Rows>,
    heads: SsmHeads,
    state: &mut CudaSlice<T>,
    slots: &Slots,
    dst: Option<&Slots>,
    y: &mut impl DevicePtrMut<bf16>,
) -> Result<()>
where
    SsmUpdateParams<T::Raw>: KernelParams,
{
    let k = T::UPDATE;
    let batch = slots.len();
    Check(k.name()).count("batch", 65535, batch)?;
    shape.check(k, &heads, state.len(), slots.num_slots())?;
    if let Some(dst) = dst {
        check_dst(k, slots, dst)?;
    }
    let (w, gn) = (shape.width(), shape.groups * shape.state_size);
    Check(k.name()).len("y", batch * w, y.len())?;
    let p = SsmUpdateParams::<T::Raw> {
        state: gpu.addr_mut(k, "state", state)? as *mut T::Raw,
        x: inputs.x.addr(gpu, k, "x", batch, w)?,
        dt: inputs.dt.addr(gpu, k, "dt", batch, shape.heads)?,
        b: inputs.b.addr(gpu, k, "b", batch, gn)?,
        c: inputs.c.addr(gpu, k, "c", batch, gn)?,
        z: z.map_or(Ok(std::ptr::null()), |z| z.addr(gpu, k, "z", batch, w))?,
        dt_bias: gpu.addr(k, "dt_bias", heads.dt_bias)? as *const f32,
        a: gpu.addr(k, "a", heads.a)? as *const f32,
        d: gpu.opt_addr(k, "d", heads.d)? as *const f32,
        cache_index: gpu.addr(k, "slots", &slots.dev)? as *const i32,
        dst_index: gpu.opt_addr(k, "dst", dst.map(|d| &d.dev))? as *const i32,
        y: gpu.addr_mut(k, "y", y)? as *mut u16,
        batch: batch as u32,
        heads: shape.heads as u32,
        head_dim: shape.head_dim as u32,
        groups: shape.groups as u32,
        state_size: shape.state_size as u32,
        x_stride: inputs.x.stride as u32,
        dt_stride: inputs.dt.stride as u32,
        b_stride: inputs.b.stride as u32,
        c_stride: inputs.c.stride as u32,
        z_stride: z.map_or(0, |z| z.stride as u32),
        dt_min: shape.dt_min,
        dt_max: shape.dt_max,
    };
    let grid = (shape.head_dim.div_ceil(SSM_WARPS as usize) as u32, shape.heads as u32, batch as u32);
    // SAFETY: `check` and `Rows::addr` proved every input covers `batch` rows, the per-head
    // arrays `heads`, the cache `num_slots` slots; Slots holds PAD_SLOT or distinct in-range
    // slots and `check_dst` that no row writes a slot another reads; state_size % 4 == 0 keeps
    // the 4-element state accesses aligned; state and y are `&mut`.
    unsafe { gpu.launch(k, grid, 32 * SSM_WARPS, 0, p) }
}
