//! Launchers of the grouped expert GEMM on tensor cores and of its one-matrix forms
//! (kernels-gpu/src/grouped.rs; references: cpu/moe.rs's expert MLP, W8A8 as cpu/quant.rs
//! quantizes).

use cudarc::driver::{CudaSlice, CudaView, DevicePtr, DevicePtrMut};
use half::bf16;
use kernels_gpu::grouped::{
    GROUPED_M, GROUPED_M_WIDE, GROUPED_N, GemmFp8Params, GemmParams, GroupedFp8Params, GroupedNvfp4Params,
    GroupedParams, TMA_A_BOX_ROWS, TMA_MAPS_COPIES, TMA_W_BOX_ROWS, Tma, TmaMaps, WGMMA_FP8_N, WGMMA_M, WGMMA_N,
    grouped_m_tiles,
};
use kernels_gpu::wgmma::STAGE_ROW_BYTES;
use kernels_gpu::{Entry, Kernel, KernelParams, entry};

use crate::args::{Args, Len};
use crate::check::{Check, MAX_ELEMS, MAX_ROWS};
use crate::error::{Error, Result};
use crate::gemv::{Proj, Weights};
use crate::gpu::{Gpu, Grid, byte_tensor_map};
use crate::moe::{Dispatch, ExpertMlp};
use crate::quant::{Source, quant_rows};

/// The grouped kernels' output tiles.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Tiles {
    /// 64 x 128 on `mma.sync` (`moe_grouped_bf16`, `moe_grouped_fp8`, `moe_grouped_nvfp4`,
    /// `gemm_bf16`, `gemm_fp8`).
    Narrow,
    /// 128 x 128, k staged 64 at a time (`moe_grouped_m128_bf16`, `gemm_m128_bf16`; bf16
    /// only): each input and weight tile read half as often per product, more rows wasted in
    /// an expert's last tile.
    Wide,
    /// 128 x 256 (FP8 128 x 192) on `wgmma` (`moe_grouped_wgmma_bf16`, `_fp8`, `_nvfp4`,
    /// `gemm_wgmma_bf16`, `_fp8`; sm_90a only: [`Gpu::has`]).
    Wgmma,
}

/// The launch shape of one tensor-core GEMM kernel: its entry and output tile (rows, columns).
struct Shape<P> {
    entry: Entry<P>,
    m: u32,
    n: u32,
}

/// The launch shape of an FP8 GEMM kernel: the narrow kernels take their params as they are,
/// the `wgmma` ones with the launch's tensor maps ([`Tma`]).
enum Fp8Shape<P> {
    Narrow(Shape<P>),
    Wgmma(Shape<Tma<P>>),
}

/// What the tensor maps of an FP8 `wgmma` launch describe: A's codes `[rows, k]` (address,
/// rows), the weights' codes `[matrices, n, k]` (address, matrices), `(n, k)`.
struct Fp8Operands {
    a: (u64, usize),
    w: (u64, usize),
    nk: (usize, usize),
}

impl<P: KernelParams> Fp8Shape<P> {
    /// The kernel and its output tile (rows, columns).
    fn tile(&self) -> (Kernel, u32, u32) {
        match self {
            Fp8Shape::Narrow(s) => (s.entry.kernel, s.m, s.n),
            Fp8Shape::Wgmma(s) => (s.entry.kernel, s.m, s.n),
        }
    }

    /// Launches this kernel over the row tiles `m_tiles(m)` gives for tiles of `m` rows and
    /// the column tiles of `o`'s n; the `wgmma` kernels with the tensor maps of `o`'s operands.
    ///
    /// # Safety
    /// `params` satisfies the kernel's contract for these tiles, its operands' addresses
    /// aligned ([`check_aligned`]) and those of `o`.
    unsafe fn launch(self, gpu: &Gpu, m_tiles: impl Fn(u32) -> u32, o: Fp8Operands, params: P) -> Result<()> {
        let m = m_tiles(self.tile().1);
        match self {
            // SAFETY: the caller's contract.
            Fp8Shape::Narrow(s) => unsafe { launch_tiles(gpu, s, m, o.nk.0, params) },
            Fp8Shape::Wgmma(s) => {
                let ((a, rows), (w, matrices), (n, k)) = (o.a, o.w, (o.nk.0 as u64, o.nk.1 as u64));
                let maps = TmaMaps {
                    a: byte_tensor_map(a, &[k, rows as u64], &[k], &[STAGE_ROW_BYTES, TMA_A_BOX_ROWS])?,
                    w: byte_tensor_map(
                        w,
                        &[k, n, matrices as u64],
                        &[k, n * k],
                        &[STAGE_ROW_BYTES, TMA_W_BOX_ROWS, 1],
                    )?,
                    skew: [0; 2],
                };
                let params = Tma { maps: [maps; TMA_MAPS_COPIES], p: params };
                // SAFETY: the caller's contract; the maps are of the params' operands.
                unsafe { launch_tiles(gpu, s, m, o.nk.0, params) }
            }
        }
    }
}

impl Tiles {
    /// The tiles the grouped projections run on here: `wgmma` where the GPU has it, else the
    /// 128-row tiles where a block may have their shared memory ([`Gpu::fits`]: not on the
    /// sm_12x family), else the 64-row ones (FP8 takes the 64-row ones for the 128-row
    /// ones). On the H200 (`cargo bench --bench
    /// moe -- experts/b`, Nano's 128 experts of 1856 x 2688, top-6, both projections) `wgmma`
    /// was the fastest at every size from 16 rows (419.4 us; 128-row tiles 467.5, 64-row
    /// 567.0) to 16384 (4673.3 us; 6725.4, 11096.5), and without it the 128-row tiles beat the
    /// 64-row ones at every size as well.
    pub fn for_grouped(gpu: &Gpu) -> Tiles {
        if gpu.has(Kernel::MoeGroupedWgmma) {
            Tiles::Wgmma
        } else if gpu.fits(Kernel::MoeGroupedWide) {
            Tiles::Wide
        } else {
            Tiles::Narrow
        }
    }

    /// `entry` on these tiles.
    fn shape<P>(self, entry: Entry<P>) -> Shape<P> {
        let (m, n) = match self {
            Tiles::Narrow => (GROUPED_M, GROUPED_N),
            Tiles::Wide => (GROUPED_M_WIDE, GROUPED_N),
            Tiles::Wgmma => (WGMMA_M, WGMMA_N),
        };
        Shape { entry, m, n }
    }

    /// The grouped kernel of these tiles for bf16 operands.
    fn grouped(self) -> Shape<GroupedParams> {
        self.shape(match self {
            Tiles::Narrow => entry::MOE_GROUPED,
            Tiles::Wide => entry::MOE_GROUPED_WIDE,
            Tiles::Wgmma => entry::MOE_GROUPED_WGMMA,
        })
    }

    /// The grouped kernel of these tiles for e4m3 operands (no 128-row tiles).
    fn grouped_fp8(self) -> Result<Fp8Shape<GroupedFp8Params>> {
        match self {
            Tiles::Narrow => Ok(Fp8Shape::Narrow(self.shape(entry::MOE_GROUPED_FP8))),
            Tiles::Wgmma => Ok(Fp8Shape::Wgmma(Shape { n: WGMMA_FP8_N, ..self.shape(entry::MOE_GROUPED_WGMMA_FP8) })),
            Tiles::Wide => Err(no_wide(Kernel::MoeGroupedFp8, "FP8")),
        }
    }

    /// The one-matrix kernel of these tiles for bf16 operands.
    fn dense(self) -> Shape<GemmParams> {
        self.shape(match self {
            Tiles::Narrow => entry::GEMM_BF16,
            Tiles::Wide => entry::GEMM_WIDE_BF16,
            Tiles::Wgmma => entry::GEMM_WGMMA,
        })
    }

    /// The one-matrix kernel of these tiles for e4m3 operands (no 128-row tiles).
    fn dense_fp8(self) -> Result<Fp8Shape<GemmFp8Params>> {
        match self {
            Tiles::Narrow => Ok(Fp8Shape::Narrow(self.shape(entry::GEMM_FP8))),
            Tiles::Wgmma => Ok(Fp8Shape::Wgmma(Shape { n: WGMMA_FP8_N, ..self.shape(entry::GEMM_WGMMA_FP8) })),
            Tiles::Wide => Err(no_wide(Kernel::GemmFp8, "FP8")),
        }
    }

    /// The grouped kernel of these tiles for NVFP4 weights (no 128-row tiles).
    fn grouped_nvfp4(self) -> Result<Shape<GroupedNvfp4Params>> {
        match self {
            Tiles::Narrow => Ok(self.shape(entry::MOE_GROUPED_NVFP4)),
            Tiles::Wgmma => Ok(self.shape(entry::MOE_GROUPED_WGMMA_NVFP4)),
            Tiles::Wide => Err(no_wide(Kernel::MoeGroupedNvfp4, "NVFP4")),
        }
    }

    /// The tiles of an FP8 linear layer here: `wgmma` where the GPU has it, else the 64-row
    /// ones.
    pub fn for_fp8_linear(gpu: &Gpu) -> Tiles {
        if gpu.has(Kernel::GemmWgmmaFp8) { Tiles::Wgmma } else { Tiles::Narrow }
    }
}

/// The FP8 and NVFP4 kernels have no 128-row tiles.
fn no_wide(kernel: Kernel, format: &str) -> Error {
    Error::Shape {
        kernel: kernel.name(),
        arg: "tiles",
        expected: format!("Narrow or Wgmma tiles for {format}"),
        got: "Wide".into(),
    }
}

/// Launches `s` over `m_tiles` row tiles and the column tiles of `n`.
///
/// # Safety
/// `params` satisfies the kernel's contract for these tiles, its operands' addresses aligned
/// ([`check_aligned`]).
unsafe fn launch_tiles<P: KernelParams>(gpu: &Gpu, s: Shape<P>, m_tiles: u32, n: usize, params: P) -> Result<()> {
    // SAFETY: the caller's contract; the grid covers every tile, block and shared memory are
    // the entry's own.
    unsafe { gpu.launch(Grid::new(s.entry, (m_tiles, n.div_ceil(s.n as usize) as u32, 1)), params) }
}

/// Checks a grouped launch's operand addresses ([`check_aligned`]: `a`, `w`, `out`) and
/// launches `s` over the row tiles a dispatch like `d` can need.
///
/// # Safety
/// `params` satisfies the kernel's contract for `d` and these tiles.
unsafe fn launch_grouped<P: KernelParams>(
    gpu: &Gpu,
    (c, s): (Check, Shape<P>),
    d: &Dispatch,
    n: usize,
    params: P,
    (a, w, out): (u64, u64, u64),
) -> Result<()> {
    check_aligned(c, (a, w, out))?;
    let m_tiles = grouped_m_tiles(d.entries() as u32, d.experts() as u32, s.m);
    // SAFETY: the caller's contract; the addresses aligned.
    unsafe { launch_tiles(gpu, s, m_tiles, n, params) }
}

/// One projection `p` of every expert with rows in `d`, one launch: grouped row j of expert e
/// gets `out[j] = f(a_j W_eᵀ)`, `a_j` row `token[j]` of `a` when `by_token` (the layer input),
/// row j otherwise (grouped rows); `p.w [experts, n, k]`. `n` and `k` multiples of 8. No
/// synchronization.
pub fn grouped(
    gpu: &Gpu,
    d: &Dispatch,
    a: &impl DevicePtr<bf16>,
    by_token: bool,
    p: Proj<&CudaSlice<bf16>>,
    tiles: Tiles,
    out: &mut impl DevicePtrMut<bf16>,
) -> Result<()> {
    let shape = tiles.grouped();
    let args = gpu.args(shape.entry);
    let c = args.check();
    d.check_filled(shape.entry.name())?;
    check_nk(c, (p.n, p.k), 8)?;
    let (entries, experts) = (d.entries(), d.experts());
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
    let addrs = (params.a as u64, params.w as u64, params.out as u64);
    // SAFETY: extents checked above; the dispatch's tokens are below the rows it was made for
    // (which `a` holds where by_token) and its offsets cover `entries`; out is `&mut`.
    unsafe { launch_grouped(gpu, (c, shape), d, p.n, params, addrs) }
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

/// Checks the operands' addresses: `a` and `w` 16-byte aligned (the kernels stage 16-byte
/// chunks with `cp.async`; with k a multiple of 8 bf16 or 16 e4m3 every row is then aligned),
/// `out` 4-byte aligned (pairs of bf16 stored as one word). A misaligned access would end the
/// CUDA context, so a misaligned view is refused here.
fn check_aligned(c: Check, (a, w, out): (u64, u64, u64)) -> Result<()> {
    for (arg, addr, align) in [("a", a, 16), ("w", w, 16), ("out", out, 4)] {
        c.aligned(arg, addr, align)?;
    }
    Ok(())
}

/// The kernel's pointers to FP8 weights' codes and their scales: `matrices` of `[n, k]`, a
/// scale each (their input scales are what the rows were quantized with, not read here).
fn fp8_weights(
    args: &Args,
    w: Weights<'_>,
    matrices: usize,
    (n, k): (usize, usize),
) -> Result<(*const u8, *const f32)> {
    match w {
        Weights::Fp8 { .. } => w.args(args, matrices, (n, k)).map(|(codes, scale, _)| (codes, scale)),
        Weights::Bf16(_) | Weights::Nvfp4 { .. } => Err(Error::Shape {
            kernel: args.check().0,
            arg: "w",
            expected: "FP8 weights".into(),
            got: "bf16 or NVFP4 weights".into(),
        }),
    }
}

/// Multiple of k the NVFP4 grouped GEMM takes: whole stages of 64 weights (Nano's 2688 and
/// 1856 are).
pub const NVFP4_GROUPED_K_MULTIPLE: usize = 64;

/// One NVFP4 projection `p` (weight-only) of every expert with rows in `d`, one launch on
/// `tiles` ([`Tiles::Narrow`]: `moe_grouped_nvfp4` on `mma.sync`, any GPU; [`Tiles::Wgmma`]:
/// `moe_grouped_wgmma_nvfp4`, sm_90a only, [`Gpu::has`]): grouped row j of expert e gets
/// `out[j] = f(a_j W_eᵀ)` with `W_e` the expert's exact NVFP4 values (the codes made bf16 in
/// shared memory, each times its block scale exactly; the per-tensor scale on the f32 sums),
/// `a_j` as [`grouped`] takes it. `n` a multiple of 8, `k` of [`NVFP4_GROUPED_K_MULTIPLE`]. No
/// synchronization.
pub fn grouped_nvfp4(
    gpu: &Gpu,
    d: &Dispatch,
    a: &impl DevicePtr<bf16>,
    by_token: bool,
    p: Proj<Weights<'_>>,
    tiles: Tiles,
    out: &mut impl DevicePtrMut<bf16>,
) -> Result<()> {
    let shape = tiles.grouped_nvfp4()?;
    let args = gpu.args(shape.entry);
    let c = args.check();
    d.check_filled(shape.entry.name())?;
    check_nk(c, (p.n, p.k), NVFP4_GROUPED_K_MULTIPLE)?;
    let (entries, experts) = (d.entries(), d.experts());
    c.that("w", matches!(p.w, Weights::Nvfp4 { .. }), "NVFP4 weights", "bf16 or FP8 weights")?;
    let (w, global, _) = p.w.args(&args, experts, (p.n, p.k))?;
    let params = GroupedNvfp4Params {
        a: args.input("a", a, Len::AtLeast(if by_token { d.rows() } else { entries } * p.k))?,
        token: if by_token { args.input("token", d.token(), Len::Any)? } else { std::ptr::null() },
        w,
        global,
        offsets: args.input("offsets", d.offsets(), Len::Any)?,
        out: args.output("out", out, Len::Exactly(entries * p.n))?,
        experts: experts as u32,
        n: p.n as u32,
        k: p.k as u32,
        relu2: u32::from(p.relu2),
    };
    let addrs = (params.a as u64, params.w as u64, params.out as u64);
    // SAFETY: extents checked above (the experts' rows of row_bytes(k), a multiple of 16, so
    // every row 16-byte aligned from an aligned start); the dispatch's tokens are below the
    // rows it was made for and its offsets cover `entries`; out is `&mut`.
    unsafe { launch_grouped(gpu, (c, shape), d, p.n, params, addrs) }
}

/// The FP8 codes of an FP8 product's input rows and their scales ([`quant_rows`]).
pub struct Fp8Rows<'a, Q: DevicePtr<u8>, S: DevicePtr<f32>> {
    pub codes: &'a Q,
    pub scales: &'a S,
}

/// One FP8 (W8A8) projection `p` of every expert with rows in `d`, one launch: grouped row j
/// of expert e gets `out[j] = f((q_j Q_eᵀ) ws_e s_j)`, `(q_j, s_j)` row j's codes and scale in
/// `a` (the grouped rows, [`quant_rows`] with [`Source::Grouped`]), `p.w` the experts' codes
/// `[experts, n, k]` and scales. `n` a multiple of 8, `k` of 16; tiles [`Tiles::Narrow`] or
/// [`Tiles::Wgmma`]. No synchronization.
pub fn grouped_fp8(
    gpu: &Gpu,
    d: &Dispatch,
    a: Fp8Rows<'_, impl DevicePtr<u8>, impl DevicePtr<f32>>,
    p: Proj<Weights<'_>>,
    tiles: Tiles,
    out: &mut impl DevicePtrMut<bf16>,
) -> Result<()> {
    let null = (std::ptr::null_mut(), std::ptr::null_mut(), std::ptr::null());
    grouped_fp8_to(gpu, d, a, p, tiles, |args, n| Ok((args.output("out", out, Len::Exactly(n))?, null)))
}

/// The codes and scales [`grouped_fp8_quant`] writes.
pub struct Fp8RowsMut<'a, Q: DevicePtrMut<u8>, S: DevicePtrMut<f32>> {
    pub codes: &'a mut Q,
    pub scales: &'a mut S,
}

/// As [`grouped_fp8`], its results written as the next projection's input: what
/// [`quant_rows`] with [`Source::Grouped`] (`by_token` false) and the static input scales
/// `next_in_scale` (a scale per expert) writes from the bf16 results, bit for bit (each
/// result rounded to bf16, then `e4m3(v / s_e)`): the codes `[entries, p.n]` into `next.codes`
/// and each grouped row's scale into `next.scales`. One launch in place of two, and a byte a
/// result written in place of two. No synchronization.
pub fn grouped_fp8_quant(
    gpu: &Gpu,
    d: &Dispatch,
    a: Fp8Rows<'_, impl DevicePtr<u8>, impl DevicePtr<f32>>,
    p: Proj<Weights<'_>>,
    tiles: Tiles,
    next_in_scale: &CudaSlice<f32>,
    next: Fp8RowsMut<'_, impl DevicePtrMut<u8>, impl DevicePtrMut<f32>>,
) -> Result<()> {
    let (entries, experts) = (d.entries(), d.experts());
    grouped_fp8_to(gpu, d, a, p, tiles, |args, n| {
        let codes = args.output("codes", next.codes, Len::Exactly(n))?;
        let scales = args.output("codes' scales", next.scales, Len::Exactly(entries))?;
        let in_scale = args.input("next input scales", next_in_scale, Len::Exactly(experts))?;
        Ok((std::ptr::null_mut(), (codes, scales, in_scale)))
    })
}

/// The outputs of a grouped FP8 launch: `out`, or `codes`, `codes_scale` and `next_scale`
/// ([`GroupedFp8Params`]).
type Fp8Outs = (*mut u16, (*mut u8, *mut f32, *const f32));

/// [`grouped_fp8`] and [`grouped_fp8_quant`]: `outs(args, entries * n)` checks and gives the
/// outputs.
fn grouped_fp8_to(
    gpu: &Gpu,
    d: &Dispatch,
    a: Fp8Rows<'_, impl DevicePtr<u8>, impl DevicePtr<f32>>,
    p: Proj<Weights<'_>>,
    tiles: Tiles,
    outs: impl FnOnce(&Args, usize) -> Result<Fp8Outs>,
) -> Result<()> {
    let shape = tiles.grouped_fp8()?;
    let args = gpu.args(shape.tile().0);
    let c = args.check();
    d.check_filled(c.0)?;
    check_nk(c, (p.n, p.k), 16)?;
    let (entries, experts) = (d.entries(), d.experts());
    let (w, w_scale) = fp8_weights(&args, p.w, experts, (p.n, p.k))?;
    let (out, (codes, codes_scale, next_scale)) = outs(&args, entries * p.n)?;
    let params = GroupedFp8Params {
        a: args.input("a", a.codes, Len::Exactly(entries * p.k))?,
        a_scale: args.input("a scales", a.scales, Len::Exactly(entries))?,
        w,
        w_scale,
        offsets: args.input("offsets", d.offsets(), Len::Any)?,
        out,
        codes,
        codes_scale,
        next_scale,
        experts: experts as u32,
        n: p.n as u32,
        k: p.k as u32,
        relu2: u32::from(p.relu2),
    };
    let written = if codes.is_null() { out as u64 } else { codes as u64 };
    check_aligned(c, (params.a as u64, params.w as u64, written))?;
    let o = Fp8Operands { a: (params.a as u64, entries), w: (w as u64, experts), nk: (p.n, p.k) };
    let m_tiles = |m| grouped_m_tiles(entries as u32, experts as u32, m);
    // SAFETY: extents checked above (codes and scales of every grouped row, the experts'
    // codes and scales, the outputs: out or the codes, their scales and the next scales);
    // the dispatch's offsets cover `entries`; the outputs are `&mut`; the addresses aligned.
    unsafe { shape.launch(gpu, m_tiles, o, params) }
}

/// A bf16 linear layer `p` over `rows` rows of `x` on tensor cores, one launch: `out [rows,
/// n] = f(x wᵀ)`, `p.w [n, k]`. `n` and `k` multiples of 8; any [`Tiles`] (`Wgmma` where the
/// GPU has it).
pub fn gemm(
    gpu: &Gpu,
    (x, rows): (&impl DevicePtr<bf16>, usize),
    p: Proj<&CudaSlice<bf16>>,
    tiles: Tiles,
    out: &mut impl DevicePtrMut<bf16>,
) -> Result<()> {
    let shape = tiles.dense();
    let args = gpu.args(shape.entry);
    let c = args.check();
    check_nk(c, (p.n, p.k), 8)?;
    c.count("rows", MAX_ROWS, rows)?;
    let params = GemmParams {
        a: args.input("x", x, Len::AtLeast(rows * p.k))?,
        w: args.input("w", p.w, Len::Exactly(p.n * p.k))?,
        out: args.output("out", out, Len::AtLeast(rows * p.n))?,
        rows: rows as u32,
        n: p.n as u32,
        k: p.k as u32,
        relu2: u32::from(p.relu2),
    };
    check_aligned(c, (params.a as u64, params.w as u64, params.out as u64))?;
    let m_tiles = rows.div_ceil(shape.m as usize) as u32;
    // SAFETY: extents checked above; out is `&mut`.
    unsafe { launch_tiles(gpu, shape, m_tiles, p.n, params) }
}

/// An FP8 (W8A8) linear layer `p` over `rows` rows on tensor cores: `out [rows, n] = f((q Qᵀ)
/// ws s)`, `a` the rows' codes and scales ([`quant_rows`] with [`Source::Plain`]), `p.w` one
/// matrix `[n, k]` of codes with its scale. `n` a multiple of 8, `k` of 16; tiles
/// [`Tiles::Narrow`] or [`Tiles::Wgmma`].
pub fn gemm_fp8(
    gpu: &Gpu,
    (a, rows): (Fp8Rows<'_, impl DevicePtr<u8>, impl DevicePtr<f32>>, usize),
    p: Proj<Weights<'_>>,
    tiles: Tiles,
    out: &mut impl DevicePtrMut<bf16>,
) -> Result<()> {
    let shape = tiles.dense_fp8()?;
    let args = gpu.args(shape.tile().0);
    let c = args.check();
    check_nk(c, (p.n, p.k), 16)?;
    c.count("rows", MAX_ROWS, rows)?;
    let (w, w_scale) = fp8_weights(&args, p.w, 1, (p.n, p.k))?;
    let params = GemmFp8Params {
        a: args.input("a", a.codes, Len::Exactly(rows * p.k))?,
        a_scale: args.input("a scales", a.scales, Len::Exactly(rows))?,
        w,
        w_scale,
        out: args.output("out", out, Len::Exactly(rows * p.n))?,
        rows: rows as u32,
        n: p.n as u32,
        k: p.k as u32,
        relu2: u32::from(p.relu2),
    };
    check_aligned(c, (params.a as u64, params.w as u64, params.out as u64))?;
    let o = Fp8Operands { a: (params.a as u64, rows), w: (w as u64, 1), nk: (p.n, p.k) };
    // SAFETY: extents checked above; out is `&mut`; the addresses aligned.
    unsafe { shape.launch(gpu, |m| rows.div_ceil(m as usize) as u32, o, params) }
}

/// The expert MLPs of every grouped row (as `moe::experts_mlp` without pieces), on tensor
/// cores: the up projection with relu^2 into a hidden buffer `[entries, inter]`, then the down
/// projection into `out [entries, hidden]`. `x [rows, hidden]` the layer input. bf16 weights:
/// two launches; FP8 weights (W8A8, both projections): each projection's input quantized
/// first ([`quant_rows`], with the projection's static scales or per row), four launches;
/// NVFP4 weights (both projections, weight-only): two launches of [`grouped_nvfp4`]. Tiles as
/// [`Tiles::for_grouped`] (FP8 and NVFP4: narrow for wide). No synchronization: the path for
/// many rows.
pub fn experts_mlp_grouped(
    gpu: &Gpu,
    d: &Dispatch,
    x: &impl DevicePtr<bf16>,
    mlp: ExpertMlp<Weights<'_>>,
    out: &mut impl DevicePtrMut<bf16>,
) -> Result<()> {
    let tiles = match (Tiles::for_grouped(gpu), mlp.up) {
        (Tiles::Wide, Weights::Fp8 { .. } | Weights::Nvfp4 { .. }) => Tiles::Narrow,
        (tiles, _) => tiles,
    };
    experts_mlp_grouped_as(gpu, d, x, mlp, tiles, out)
}

/// [`experts_mlp_grouped`] with the tiles given.
pub fn experts_mlp_grouped_as(
    gpu: &Gpu,
    d: &Dispatch,
    x: &impl DevicePtr<bf16>,
    mlp: ExpertMlp<Weights<'_>>,
    tiles: Tiles,
    out: &mut impl DevicePtrMut<bf16>,
) -> Result<()> {
    let (e, inter, hidden) = (d.entries(), mlp.inter, mlp.hidden);
    let (up, down) = (mlp.up_proj(), mlp.down_proj());
    // SAFETY (the temporaries): each is written whole before it is read: the up projection
    // writes every grouped row (every expert's tiles cover its rows), quant_rows every row's
    // codes and scale.
    let hidden_rows = || unsafe { gpu.scratch::<bf16>(e * inter) };
    match (mlp.up, mlp.down) {
        (Weights::Bf16(u), Weights::Bf16(dn)) => {
            let bf16 = ExpertMlp { up: u, down: dn, inter, hidden };
            let mut h = hidden_rows()?;
            grouped(gpu, d, x, true, bf16.up_proj(), tiles, &mut h)?;
            grouped(gpu, d, &h, false, bf16.down_proj(), tiles, out)
        }
        (Weights::Fp8 { in_scale: up_in, .. }, Weights::Fp8 { in_scale: down_in, .. }) => {
            // SAFETY: as above.
            let (mut q, mut s, mut q2, mut s2) = unsafe {
                (
                    gpu.scratch::<u8>(e * hidden)?,
                    gpu.scratch::<f32>(e)?,
                    gpu.scratch::<u8>(e * inter)?,
                    gpu.scratch::<f32>(e)?,
                )
            };
            quant_rows(gpu, hidden, x, Source::Grouped { d, by_token: true }, up_in, &mut q, &mut s)?;
            let a = Fp8Rows { codes: &q, scales: &s };
            match down_in {
                // Static scales: the up projection writes the down projection's codes.
                Some(down_in) => {
                    let next = Fp8RowsMut { codes: &mut q2, scales: &mut s2 };
                    grouped_fp8_quant(gpu, d, a, up, tiles, down_in, next)?
                }
                None => {
                    let mut h = hidden_rows()?;
                    grouped_fp8(gpu, d, a, up, tiles, &mut h)?;
                    quant_rows(gpu, inter, &h, Source::Grouped { d, by_token: false }, None, &mut q2, &mut s2)?
                }
            }
            grouped_fp8(gpu, d, Fp8Rows { codes: &q2, scales: &s2 }, down, tiles, out)
        }
        (Weights::Nvfp4 { .. }, Weights::Nvfp4 { .. }) => {
            let mut h = hidden_rows()?;
            grouped_nvfp4(gpu, d, x, true, up, tiles, &mut h)?;
            grouped_nvfp4(gpu, d, &h, false, down, tiles, out)
        }
        _ => Err(Error::Shape {
            kernel: Kernel::MoeGroupedFp8.name(),
            arg: "down",
            expected: "bf16, FP8 or NVFP4 weights, the up and down projections of one kind".into(),
            got: "kinds mixed".into(),
        }),
    }
}

/// An FP8 (W8A8) linear layer `p` over `rows` rows of `x` on tensor cores: with a static input
/// scale (k a multiple of 16, n of 8) cuBLASLt's FP8 GEMM ([`crate::gemm::linear_fp8`]), faster
/// than ours at every row count measured (docs/PERFORMANCE.md); else the rows quantized
/// ([`quant_rows`], per row), then [`gemm_fp8`] with the tiles of [`Tiles::for_fp8_linear`].
/// Two launches (three with relu^2 through cuBLASLt).
pub fn linear_fp8(
    gpu: &Gpu,
    (x, rows): (&CudaView<'_, bf16>, usize),
    p: Proj<Weights<'_>>,
    out: &mut impl DevicePtrMut<bf16>,
) -> Result<()> {
    match p.w {
        Weights::Fp8 { in_scale: Some(_), .. }
            if p.k.is_multiple_of(16) && p.n.is_multiple_of(8) && gpu.blas().is_ok() =>
        {
            crate::gemm::linear_fp8(gpu, (x, rows), p, out)
        }
        _ => linear_fp8_as(gpu, (x, rows), p, Tiles::for_fp8_linear(gpu), out),
    }
}

/// The rows quantized ([`quant_rows`], the weight's static scale or per row), then
/// [`gemm_fp8`] with the tiles given: [`linear_fp8`]'s own path.
pub fn linear_fp8_as(
    gpu: &Gpu,
    (x, rows): (&CudaView<'_, bf16>, usize),
    p: Proj<Weights<'_>>,
    tiles: Tiles,
    out: &mut impl DevicePtrMut<bf16>,
) -> Result<()> {
    let in_scale = match p.w {
        Weights::Fp8 { in_scale, .. } => in_scale,
        Weights::Bf16(_) | Weights::Nvfp4 { .. } => None,
    };
    Check(Kernel::GemmFp8.name()).len_at_least("x", rows * p.k, x.len())?;
    let xs = x.slice(0..rows * p.k);
    // SAFETY: quant_rows writes every row's codes and scale before gemm_fp8 reads them.
    let (mut q, mut s) = unsafe { (gpu.scratch::<u8>(rows * p.k)?, gpu.scratch::<f32>(rows)?) };
    quant_rows(gpu, p.k, &xs, Source::Plain, in_scale, &mut q, &mut s)?;
    gemm_fp8(gpu, (Fp8Rows { codes: &q, scales: &s }, rows), p, tiles, out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::check::arg_of;

    #[test]
    fn misaligned_operands_are_refused() {
        let c = Check("test");
        check_aligned(c, (0x1000, 0x2000, 0x3004)).unwrap();
        assert_eq!(arg_of(check_aligned(c, (0x1008, 0x2000, 0x3000))), "a");
        assert_eq!(arg_of(check_aligned(c, (0x1000, 0x2008, 0x3000))), "w");
        assert_eq!(arg_of(check_aligned(c, (0x1000, 0x2000, 0x3002))), "out");
    }

    #[test]
    fn fp8_and_nvfp4_have_no_wide_tiles_and_dense_tiles_match_grouped() {
        assert_eq!(arg_of(Tiles::Wide.grouped_fp8().map(|_| ())), "tiles");
        assert_eq!(arg_of(Tiles::Wide.dense_fp8().map(|_| ())), "tiles");
        let smem = |k: Kernel| k.smem();
        for t in [Tiles::Narrow, Tiles::Wide, Tiles::Wgmma] {
            let (g, d) = (t.grouped(), t.dense());
            let (gk, dk) = (g.entry.kernel, d.entry.kernel);
            assert_eq!((g.m, g.n, smem(gk)), (d.m, d.n, smem(dk)), "{t:?}: grouped and dense tiles agree");
        }
        for t in [Tiles::Narrow, Tiles::Wgmma] {
            let ((gk, gm, gn), (dk, dm, dn)) = (t.grouped_fp8().unwrap().tile(), t.dense_fp8().unwrap().tile());
            assert_eq!((gm, gn, smem(gk)), (dm, dn, smem(dk)), "{t:?} FP8");
        }
        let w = Tiles::Wgmma.grouped_fp8().unwrap().tile();
        assert_eq!(w, (Kernel::MoeGroupedWgmmaFp8, WGMMA_M, WGMMA_FP8_N));
        // NVFP4: no 128-row tiles either; the narrow kernel of the bf16 one's tile, within a
        // sm_12x block's shared memory.
        assert_eq!(arg_of(Tiles::Wide.grouped_nvfp4().map(|_| ())), "tiles");
        let n = Tiles::Narrow.grouped_nvfp4().unwrap();
        assert_eq!((n.entry.kernel, n.m, n.n), (Kernel::MoeGroupedNvfp4, GROUPED_M, GROUPED_N));
        assert_eq!(smem(n.entry.kernel), kernels_gpu::Smem::Fixed(79880));
        let w = Tiles::Wgmma.grouped_nvfp4().unwrap();
        assert_eq!((w.entry.kernel, w.m, w.n), (Kernel::MoeGroupedWgmmaNvfp4, WGMMA_M, WGMMA_N));
    }
}
