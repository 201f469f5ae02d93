//! Launcher of the grouped expert GEMM on tensor cores (kernels-gpu/src/grouped.rs; reference:
//! cpu/moe.rs's expert MLP).

use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut};
use half::bf16;
use kernels_gpu::Kernel;
use kernels_gpu::grouped::{
    GROUPED_BLOCK, GROUPED_K, GROUPED_K_WIDE, GROUPED_M, GROUPED_M_WIDE, GROUPED_N, GroupedParams, grouped_m_tiles,
    grouped_smem_bytes,
};

use crate::check::{Check, MAX_ELEMS};
use crate::error::Result;
use crate::gpu::Gpu;
use crate::moe::Dispatch;

/// The grouped kernel's output tiles.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Tiles {
    /// 64 rows (`moe_grouped_bf16`).
    Narrow,
    /// 128 rows, k staged 64 at a time (`moe_grouped_m128_bf16`): each input and weight tile
    /// read half as often per product, more rows wasted in an expert's last tile.
    Wide,
}

impl Tiles {
    /// Wide where a dispatch's experts average at least 128 rows each.
    pub fn for_dispatch(d: &Dispatch) -> Tiles {
        if d.entries() >= GROUPED_M_WIDE as usize * d.experts() { Tiles::Wide } else { Tiles::Narrow }
    }

    /// The kernel, its tile rows and k step.
    fn kernel(self) -> (Kernel, u32, u32) {
        match self {
            Tiles::Narrow => (Kernel::MoeGrouped, GROUPED_M, GROUPED_K),
            Tiles::Wide => (Kernel::MoeGroupedWide, GROUPED_M_WIDE, GROUPED_K_WIDE),
        }
    }
}

/// One projection of every expert with rows in `d`, one launch: grouped row j of expert e gets
/// `out[j] = f(a_j W_eᵀ)`, `a_j` row `token[j]` of `a` when `by_token` (the layer input), row j
/// otherwise (grouped rows); `w [experts, n, k]`; `f` is `relu(bf16(.))^2` when `relu2`.
/// `n` and `k` multiples of 8. No synchronization.
#[allow(clippy::too_many_arguments)]
pub fn grouped(
    gpu: &Gpu,
    d: &Dispatch,
    (a, by_token): (&impl DevicePtr<bf16>, bool),
    w: &CudaSlice<bf16>,
    (n, k): (usize, usize),
    relu2: bool,
    tiles: Tiles,
    out: &mut impl DevicePtrMut<bf16>,
) -> Result<()> {
    let (kn, m, bk) = tiles.kernel();
    let c = Check(kn.name());
    d.check_filled(kn.name())?;
    for (what, v) in [("n", n), ("k", k)] {
        c.that(what, v.is_multiple_of(8) && v > 0 && v <= MAX_ELEMS, "a positive multiple of 8", v)?;
    }
    let (entries, experts) = (d.entries(), d.experts());
    c.len_at_least("a", if by_token { d.rows() } else { entries } * k, a.len())?;
    c.len("w", experts * n * k, w.len())?;
    c.len("out", entries * n, out.len())?;
    let m_tiles = grouped_m_tiles(entries as u32, experts as u32, m);
    let n_tiles = n.div_ceil(GROUPED_N as usize);
    c.count("n (tiles)", 65535, n_tiles)?;
    let p = GroupedParams {
        a: gpu.addr(kn, "a", a)? as *const u16,
        token: if by_token { gpu.addr(kn, "token", d.token())? as *const u32 } else { std::ptr::null() },
        w: gpu.addr(kn, "w", w)? as *const u16,
        offsets: gpu.addr(kn, "offsets", d.offsets())? as *const u32,
        out: gpu.addr_mut(kn, "out", out)? as *mut u16,
        experts: experts as u32,
        n: n as u32,
        k: k as u32,
        relu2: u32::from(relu2),
    };
    // SAFETY: extents checked above; the dispatch's tokens are below the rows it was made for
    // (which `a` holds where by_token) and its offsets cover `entries`; out is `&mut`.
    unsafe { gpu.launch(kn, (m_tiles, n_tiles as u32, 1), GROUPED_BLOCK, grouped_smem_bytes(m, bk), p) }
}

/// The expert MLPs of every grouped row (as `moe::experts_mlp` without pieces), on tensor
/// cores: the up projection with relu^2 into a hidden buffer `[entries, inter]`, then the down
/// projection into `out [entries, hidden]`. `x [rows, hidden]` the layer input; two launches,
/// no synchronization: the path for many rows. Tiles as [`Tiles::for_dispatch`].
pub fn experts_mlp_grouped(
    gpu: &Gpu,
    d: &Dispatch,
    x: &impl DevicePtr<bf16>,
    up: &CudaSlice<bf16>,
    down: &CudaSlice<bf16>,
    sizes: (usize, usize),
    out: &mut impl DevicePtrMut<bf16>,
) -> Result<()> {
    experts_mlp_grouped_as(gpu, d, x, (up, down), sizes, Tiles::for_dispatch(d), out)
}

/// [`experts_mlp_grouped`] with the tiles given.
pub fn experts_mlp_grouped_as(
    gpu: &Gpu,
    d: &Dispatch,
    x: &impl DevicePtr<bf16>,
    (up, down): (&CudaSlice<bf16>, &CudaSlice<bf16>),
    (inter, hidden): (usize, usize),
    tiles: Tiles,
    out: &mut impl DevicePtrMut<bf16>,
) -> Result<()> {
    // SAFETY: the up projection writes every grouped row (every expert's tiles cover its rows).
    let mut h = unsafe { gpu.scratch::<bf16>(d.entries() * inter) }?;
    grouped(gpu, d, (x, true), up, (inter, hidden), true, tiles, &mut h)?;
    grouped(gpu, d, (&h, false), down, (hidden, inter), false, tiles, out)
}
