//! Launchers of the grouped expert GEMM on tensor cores and of its one-matrix forms
//! (kernels-gpu/src/grouped.rs; references: cpu/moe.rs's expert MLP, W8A8 as cpu/quant.rs
//! quantizes).

use cudarc::driver::{CudaSlice, CudaView, DevicePtr, DevicePtrMut};
use half::bf16;
use kernels_gpu::Kernel;
use kernels_gpu::grouped::{
    GROUPED_BLOCK, GROUPED_K_BYTES, GROUPED_K_BYTES_WIDE, GROUPED_M, GROUPED_M_WIDE, GROUPED_N, GemmFp8Params,
    GemmParams, GroupedFp8Params, GroupedParams, grouped_m_tiles, grouped_smem_bytes,
};

use crate::check::{Check, MAX_ELEMS, MAX_ROWS};
use crate::error::{Error, Result};
use crate::gemv::Weights;
use crate::gpu::Gpu;
use crate::moe::Dispatch;
use crate::quant::{Source, quant_rows};

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

    /// The kernel, its tile rows and the bytes of k it stages at a time.
    fn kernel(self) -> (Kernel, u32, u32) {
        match self {
            Tiles::Narrow => (Kernel::MoeGrouped, GROUPED_M, GROUPED_K_BYTES),
            Tiles::Wide => (Kernel::MoeGroupedWide, GROUPED_M_WIDE, GROUPED_K_BYTES_WIDE),
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
    check_nk(c, (n, k), 8)?;
    let (entries, experts) = (d.entries(), d.experts());
    c.len_at_least("a", if by_token { d.rows() } else { entries } * k, a.len())?;
    c.len("w", experts * n * k, w.len())?;
    c.len("out", entries * n, out.len())?;
    let m_tiles = grouped_m_tiles(entries as u32, experts as u32, m);
    let n_tiles = n.div_ceil(GROUPED_N as usize) as u32;
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
    unsafe { gpu.launch(kn, (m_tiles, n_tiles, 1), GROUPED_BLOCK, grouped_smem_bytes(m, bk), p) }
}

/// Checks `n` and `k`: positive multiples of 8 (`k` of `k_multiple`: whole 16-byte chunks of a
/// row), `n` in at most 65535 tiles.
fn check_nk(c: Check, (n, k): (usize, usize), k_multiple: usize) -> Result<()> {
    c.that("n", n.is_multiple_of(8) && n > 0 && n <= MAX_ELEMS, "a positive multiple of 8", n)?;
    c.that(
        "k",
        k.is_multiple_of(k_multiple) && k > 0 && k <= MAX_ELEMS,
        format!("a positive multiple of {k_multiple}"),
        k,
    )?;
    c.count("n (tiles)", 65535, n.div_ceil(GROUPED_N as usize))
}

/// FP8 weights' codes and scales, checked to be `matrices` of `[n, k]` with a scale each.
fn fp8_weights<'a>(
    c: Check,
    w: Weights<'a>,
    matrices: usize,
    (n, k): (usize, usize),
) -> Result<(&'a CudaSlice<u8>, &'a CudaSlice<f32>)> {
    match w {
        Weights::Fp8 { codes, w_scale, .. } => {
            c.len("w", matrices * n * k, codes.len())?;
            c.len("w_scale", matrices, w_scale.len())?;
            Ok((codes, w_scale))
        }
        Weights::Bf16(_) => {
            Err(Error::Shape { kernel: c.0, arg: "w", expected: "FP8 weights".into(), got: "bf16 weights".into() })
        }
    }
}

/// The FP8 codes of an FP8 product's input rows and their scales ([`quant_rows`]).
pub struct Fp8Rows<'a, Q: DevicePtr<u8>, S: DevicePtr<f32>> {
    pub codes: &'a Q,
    pub scales: &'a S,
}

/// One FP8 (W8A8) projection of every expert with rows in `d`, one launch: grouped row j of
/// expert e gets `out[j] = f((q_j Q_eᵀ) ws_e s_j)`, `(q_j, s_j)` row j's codes and scale in
/// `a` (the grouped rows, [`quant_rows`] with [`Source::Grouped`]), `w` the experts' codes
/// `[experts, n, k]` and scales (its `in_scale` is what `a` was quantized with, not read
/// here); `f` is `relu(bf16(.))^2` when `relu2`. `n` a multiple of 8, `k` of 16. 64-row
/// tiles. No synchronization.
pub fn grouped_fp8(
    gpu: &Gpu,
    d: &Dispatch,
    a: Fp8Rows<'_, impl DevicePtr<u8>, impl DevicePtr<f32>>,
    w: Weights<'_>,
    (n, k): (usize, usize),
    relu2: bool,
    out: &mut impl DevicePtrMut<bf16>,
) -> Result<()> {
    let kn = Kernel::MoeGroupedFp8;
    let c = Check(kn.name());
    d.check_filled(kn.name())?;
    check_nk(c, (n, k), 16)?;
    let (entries, experts) = (d.entries(), d.experts());
    let (codes, w_scale) = fp8_weights(c, w, experts, (n, k))?;
    c.len("a", entries * k, a.codes.len())?;
    c.len("a scales", entries, a.scales.len())?;
    c.len("out", entries * n, out.len())?;
    let p = GroupedFp8Params {
        a: gpu.addr(kn, "a", a.codes)? as *const u8,
        a_scale: gpu.addr(kn, "a scales", a.scales)? as *const f32,
        w: gpu.addr(kn, "w", codes)? as *const u8,
        w_scale: gpu.addr(kn, "w_scale", w_scale)? as *const f32,
        offsets: gpu.addr(kn, "offsets", d.offsets())? as *const u32,
        out: gpu.addr_mut(kn, "out", out)? as *mut u16,
        experts: experts as u32,
        n: n as u32,
        k: k as u32,
        relu2: u32::from(relu2),
    };
    let grid = (grouped_m_tiles(entries as u32, experts as u32, GROUPED_M), n.div_ceil(GROUPED_N as usize) as u32, 1);
    // SAFETY: extents checked above (codes and scales of every grouped row, the experts'
    // codes and scales, out); the dispatch's offsets cover `entries`; out is `&mut`.
    unsafe { gpu.launch(kn, grid, GROUPED_BLOCK, grouped_smem_bytes(GROUPED_M, GROUPED_K_BYTES), p) }
}

/// A bf16 linear layer over `rows` rows of `x` on tensor cores, one launch: `out [rows, n] =
/// f(x wᵀ)`, `w [n, k]`; `f` is `relu(bf16(.))^2` when `relu2`. `n` and `k` multiples of 8;
/// tiles of 64 rows or, [`Tiles::Wide`], 128 (k staged 64 at a time).
pub fn gemm(
    gpu: &Gpu,
    x: &impl DevicePtr<bf16>,
    w: &CudaSlice<bf16>,
    (rows, n, k): (usize, usize, usize),
    relu2: bool,
    tiles: Tiles,
    out: &mut impl DevicePtrMut<bf16>,
) -> Result<()> {
    let (kn, m, bk) = match tiles {
        Tiles::Narrow => (Kernel::GemmBf16, GROUPED_M, GROUPED_K_BYTES),
        Tiles::Wide => (Kernel::GemmWideBf16, GROUPED_M_WIDE, GROUPED_K_BYTES_WIDE),
    };
    let c = Check(kn.name());
    check_nk(c, (n, k), 8)?;
    c.count("rows", MAX_ROWS, rows)?;
    c.len_at_least("x", rows * k, x.len())?;
    c.len("w", n * k, w.len())?;
    c.len_at_least("out", rows * n, out.len())?;
    let p = GemmParams {
        a: gpu.addr(kn, "x", x)? as *const u16,
        w: gpu.addr(kn, "w", w)? as *const u16,
        out: gpu.addr_mut(kn, "out", out)? as *mut u16,
        rows: rows as u32,
        n: n as u32,
        k: k as u32,
        relu2: u32::from(relu2),
    };
    let grid = (rows.div_ceil(m as usize) as u32, n.div_ceil(GROUPED_N as usize) as u32, 1);
    // SAFETY: extents checked above; out is `&mut`.
    unsafe { gpu.launch(kn, grid, GROUPED_BLOCK, grouped_smem_bytes(m, bk), p) }
}

/// An FP8 (W8A8) linear layer over `rows` rows on tensor cores: `out [rows, n] = f((q Qᵀ) ws
/// s)`, `a` the rows' codes and scales ([`quant_rows`] with [`Source::Plain`]), `w` one
/// matrix `[n, k]`; `f` is `relu(bf16(.))^2` when `relu2`. `n` a multiple of 8, `k` of 16.
pub fn gemm_fp8(
    gpu: &Gpu,
    a: Fp8Rows<'_, impl DevicePtr<u8>, impl DevicePtr<f32>>,
    rows: usize,
    w: Weights<'_>,
    (n, k): (usize, usize),
    relu2: bool,
    out: &mut impl DevicePtrMut<bf16>,
) -> Result<()> {
    let kn = Kernel::GemmFp8;
    let c = Check(kn.name());
    check_nk(c, (n, k), 16)?;
    c.count("rows", MAX_ROWS, rows)?;
    let (codes, w_scale) = fp8_weights(c, w, 1, (n, k))?;
    c.len("a", rows * k, a.codes.len())?;
    c.len("a scales", rows, a.scales.len())?;
    c.len("out", rows * n, out.len())?;
    let p = GemmFp8Params {
        a: gpu.addr(kn, "a", a.codes)? as *const u8,
        a_scale: gpu.addr(kn, "a scales", a.scales)? as *const f32,
        w: gpu.addr(kn, "w", codes)? as *const u8,
        w_scale: gpu.addr(kn, "w_scale", w_scale)? as *const f32,
        out: gpu.addr_mut(kn, "out", out)? as *mut u16,
        rows: rows as u32,
        n: n as u32,
        k: k as u32,
        relu2: u32::from(relu2),
    };
    let grid = (rows.div_ceil(GROUPED_M as usize) as u32, n.div_ceil(GROUPED_N as usize) as u32, 1);
    // SAFETY: extents checked above; out is `&mut`.
    unsafe { gpu.launch(kn, grid, GROUPED_BLOCK, grouped_smem_bytes(GROUPED_M, GROUPED_K_BYTES), p) }
}

/// The expert MLPs of every grouped row (as `moe::experts_mlp` without pieces), on tensor
/// cores: the up projection with relu^2 into a hidden buffer `[entries, inter]`, then the down
/// projection into `out [entries, hidden]`. `x [rows, hidden]` the layer input. bf16 weights:
/// two launches, tiles as [`Tiles::for_dispatch`]; FP8 weights (W8A8, both projections): each
/// projection's input quantized first ([`quant_rows`], with the projection's static scales or
/// per row), four launches. No synchronization: the path for many rows.
pub fn experts_mlp_grouped(
    gpu: &Gpu,
    d: &Dispatch,
    x: &impl DevicePtr<bf16>,
    (up, down): (Weights<'_>, Weights<'_>),
    (inter, hidden): (usize, usize),
    out: &mut impl DevicePtrMut<bf16>,
) -> Result<()> {
    match (up, down) {
        (Weights::Bf16(u), Weights::Bf16(dn)) => {
            experts_mlp_grouped_as(gpu, d, x, (u, dn), (inter, hidden), Tiles::for_dispatch(d), out)
        }
        (Weights::Fp8 { in_scale: up_in, .. }, Weights::Fp8 { in_scale: down_in, .. }) => {
            let e = d.entries();
            // SAFETY: each temporary is written whole (quant_rows writes every row's codes and
            // scale; the up projection every grouped row) before it is read.
            let (mut q, mut s, mut h, mut q2, mut s2) = unsafe {
                (
                    gpu.scratch::<u8>(e * hidden)?,
                    gpu.scratch::<f32>(e)?,
                    gpu.scratch::<bf16>(e * inter)?,
                    gpu.scratch::<u8>(e * inter)?,
                    gpu.scratch::<f32>(e)?,
                )
            };
            quant_rows(gpu, hidden, x, Source::Grouped { d, by_token: true }, up_in, &mut q, &mut s)?;
            grouped_fp8(gpu, d, Fp8Rows { codes: &q, scales: &s }, up, (inter, hidden), true, &mut h)?;
            quant_rows(gpu, inter, &h, Source::Grouped { d, by_token: false }, down_in, &mut q2, &mut s2)?;
            grouped_fp8(gpu, d, Fp8Rows { codes: &q2, scales: &s2 }, down, (hidden, inter), false, out)
        }
        _ => Err(Error::Shape {
            kernel: Kernel::MoeGroupedFp8.name(),
            arg: "down",
            expected: "weights of the up projection's kind".into(),
            got: "bf16 and FP8 weights mixed".into(),
        }),
    }
}

/// The bf16 [`experts_mlp_grouped`] with the tiles given.
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

/// An FP8 (W8A8) linear layer over `rows` rows of `x` on tensor cores: the rows quantized
/// ([`quant_rows`], the weight's static scale or per row), then [`gemm_fp8`]. Two launches.
pub fn linear_fp8(
    gpu: &Gpu,
    x: &CudaView<'_, bf16>,
    rows: usize,
    w: Weights<'_>,
    (n, k): (usize, usize),
    relu2: bool,
    out: &mut impl DevicePtrMut<bf16>,
) -> Result<()> {
    let in_scale = match w {
        Weights::Fp8 { in_scale, .. } => in_scale,
        Weights::Bf16(_) => None,
    };
    Check(Kernel::GemmFp8.name()).len_at_least("x", rows * k, x.len())?;
    let xs = x.slice(0..rows * k);
    // SAFETY: quant_rows writes every row's codes and scale before gemm_fp8 reads them.
    let (mut q, mut s) = unsafe { (gpu.scratch::<u8>(rows * k)?, gpu.scratch::<f32>(rows)?) };
    quant_rows(gpu, k, &xs, Source::Plain, in_scale, &mut q, &mut s)?;
    gemm_fp8(gpu, Fp8Rows { codes: &q, scales: &s }, rows, w, (n, k), relu2, out)
}
