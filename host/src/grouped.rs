//! Launcher of the grouped expert GEMM on tensor cores (kernels-gpu/src/grouped.rs; reference:
//! cpu/moe.rs's expert MLP).

use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut};
use half::bf16;
use kernels_gpu::Kernel;
use kernels_gpu::grouped::{
    GROUPED_BLOCK, GROUPED_K, GROUPED_K_WIDE, GROUPED_M, GROUPED_M_WIDE, GROUPED_N, GroupedParams, grouped_m_tiles,
    grouped_smem_bytes,
};

use crate::args::Len;
use crate::check::MAX_ELEMS;
use crate::error::Result;
use crate::gemv::Proj;
use crate::gpu::Gpu;
use crate::moe::{Dispatch, ExpertMlp};

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

/// One projection `p` of every expert with rows in `d`, one launch: grouped row j of expert e
/// gets `out[j] = f(a_j W_eᵀ)`, `a_j` row `token[j]` of `a` when `by_token` (the layer input),
/// row j otherwise (grouped rows); `p.w [experts, n, k]`. `n` and `k` multiples of 8. No
/// synchronization.
pub fn grouped(
    gpu: &Gpu,
    d: &Dispatch,
    (a, by_token): (&impl DevicePtr<bf16>, bool),
    p: Proj<&CudaSlice<bf16>>,
    tiles: Tiles,
    out: &mut impl DevicePtrMut<bf16>,
) -> Result<()> {
    let (kn, m, bk) = tiles.kernel();
    let args = gpu.args(kn);
    let c = args.check();
    d.check_filled(kn.name())?;
    for (what, v) in [("n", p.n), ("k", p.k)] {
        c.that(what, v.is_multiple_of(8) && v > 0 && v <= MAX_ELEMS, "a positive multiple of 8", v)?;
    }
    let (entries, experts) = (d.entries(), d.experts());
    let m_tiles = grouped_m_tiles(entries as u32, experts as u32, m);
    let n_tiles = p.n.div_ceil(GROUPED_N as usize);
    c.count("n (tiles)", 65535, n_tiles)?;
    let params = GroupedParams {
        a: args.input("a", a, Len::AtLeast(if by_token { d.rows() } else { entries } * p.k))?,
        token: if by_token { args.input("token", d.token(), Len::Any)? } else { std::ptr::null() },
        w: args.input("w", p.w, Len::Exactly(experts * p.n * p.k))?,
        offsets: args.input("offsets", d.offsets(), Len::Any)?,
        out: args.output("out", out, Len::Exactly(entries * p.n))?,
        experts: experts as u32,
        n: p.n as u32,
        k: p.k as u32,
        relu2: u32::from(p.relu2),
    };
    // SAFETY: extents checked above; the dispatch's tokens are below the rows it was made for
    // (which `a` holds where by_token) and its offsets cover `entries`; out is `&mut`.
    unsafe { gpu.launch(kn, (m_tiles, n_tiles as u32, 1), GROUPED_BLOCK, grouped_smem_bytes(m, bk), params) }
}

/// The expert MLPs of every grouped row (as `moe::experts_mlp` without pieces), on tensor
/// cores: the up projection with relu^2 into a hidden buffer `[entries, inter]`, then the down
/// projection into `out [entries, hidden]`. `x [rows, hidden]` the layer input; two launches,
/// no synchronization: the path for many rows. Tiles as [`Tiles::for_dispatch`].
pub fn experts_mlp_grouped(
    gpu: &Gpu,
    d: &Dispatch,
    x: &impl DevicePtr<bf16>,
    mlp: ExpertMlp<&CudaSlice<bf16>>,
    out: &mut impl DevicePtrMut<bf16>,
) -> Result<()> {
    experts_mlp_grouped_as(gpu, d, x, mlp, Tiles::for_dispatch(d), out)
}

/// [`experts_mlp_grouped`] with the tiles given.
pub fn experts_mlp_grouped_as(
    gpu: &Gpu,
    d: &Dispatch,
    x: &impl DevicePtr<bf16>,
    mlp: ExpertMlp<&CudaSlice<bf16>>,
    tiles: Tiles,
    out: &mut impl DevicePtrMut<bf16>,
) -> Result<()> {
    // SAFETY: the up projection writes every grouped row (every expert's tiles cover its rows).
    let mut h = unsafe { gpu.scratch::<bf16>(d.entries() * mlp.inter) }?;
    grouped(gpu, d, (x, true), mlp.up_proj(), tiles, &mut h)?;
    grouped(gpu, d, (&h, false), mlp.down_proj(), tiles, out)
}
