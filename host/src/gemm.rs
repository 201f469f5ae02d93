//! Linear layers through cuBLASLt: bf16 in and out ([`linear`]; reference: cpu/gemm.rs),
//! FP8 W8A8 with per-tensor scales ([`linear_fp8`]), and bf16 in, f32 out for a router's
//! logits ([`logits_f32`]); f32 accumulation all.

use std::ffi::c_void;

use cudarc::cublaslt::result::{self as lt, CublasError};
use cudarc::cublaslt::sys::{
    cublasComputeType_t, cublasLtMatmulDesc_t, cublasLtMatmulDescAttributes_t as Attr, cublasLtMatmulPreference_t,
    cublasLtMatmulPreferenceAttributes_t as PrefAttr, cublasLtMatrixLayout_t, cudaDataType,
};
use cudarc::cublaslt::{Matmul, MatmulConfig, MatmulShared};
use cudarc::driver::{CudaView, DevicePtr, DevicePtrMut, DeviceSlice};
use half::bf16;

use crate::check::Check;
use crate::error::{Error, Result};
use crate::gemv::{Proj, Weights};
use crate::gpu::{BLAS_WORKSPACE, Gpu};
use crate::quant::{Source, quant_rows};

/// The name shape errors of this entry carry (no PTX kernel runs here).
const NAME: &str = "linear_bf16";

/// `Y = X W^T` for row-major `X [m, k]`, `W [n, k]` (a checkpoint's `[out, in]` weight) and
/// `Y [m, n]`: a linear layer over `m` tokens. `x` and `w` are views (`buf.as_view()`, or
/// `buf.slice(range)` for rows of a larger buffer).
pub fn linear(
    gpu: &Gpu,
    m: usize,
    x: &CudaView<'_, bf16>,
    w: &CudaView<'_, bf16>,
    n: usize,
    k: usize,
    y: &mut impl DevicePtrMut<bf16>,
) -> Result<()> {
    check_gemm(gpu, NAME, (m, n, k), x, w, y)?;
    // Row-major Y[m, n] = X W^T is column-major Y^T[n, m] = W^T' X^T', with W read as the
    // column-major [k, n] matrix it is in memory, transposed.
    let cfg = MatmulConfig {
        transa: true,
        transb: false,
        transc: false,
        m: n as u64,
        n: m as u64,
        k: k as u64,
        alpha: 1.0,
        lda: k as i64,
        ldb: k as i64,
        beta: 0.0,
        ldc: n as i64,
        stride_a: None,
        stride_b: None,
        stride_c: None,
        stride_bias: None,
        batch_size: None,
    };
    let blas = gpu.blas()?;
    // SAFETY: x holds m * k, w n * k and y m * n elements (checked), all of this Gpu's context
    // and ordered on its stream (cuBLASLt runs on it); y is `&mut`, so it aliases neither input.
    unsafe { blas.lt.matmul(cfg, w, x, y, None, None) }
        .map_err(|source| Error::Cublas { during: "a bf16 GEMM", source })
}

/// What [`linear`] and [`logits_f32`] check of `Y [m, n] = X [m, k] W [n, k]^T` before
/// cuBLASLt sees it (errors named `name`): each size in `1..=i32::MAX`, each buffer exactly
/// its matrix's elements, all three this Gpu's.
fn check_gemm<T, U>(
    gpu: &Gpu,
    name: &'static str,
    (m, n, k): (usize, usize, usize),
    x: &impl DeviceSlice<T>,
    w: &impl DeviceSlice<T>,
    y: &impl DeviceSlice<U>,
) -> Result<()> {
    let c = Check(name);
    for (arg, v) in [("m", m), ("n", n), ("k", k)] {
        c.count(arg, i32::MAX as usize, v)?;
    }
    c.len("x", m * k, x.len())?;
    c.len("w", n * k, w.len())?;
    c.len("y", m * n, y.len())?;
    gpu.check_owner(name, "x", x)?;
    gpu.check_owner(name, "w", w)?;
    gpu.check_owner(name, "y", y)
}

/// The name shape errors of [`linear_fp8`] carry.
const NAME_FP8: &str = "linear_fp8";

/// An FP8 (W8A8) linear layer `p` over `rows` rows of `x` through cuBLASLt's FP8 GEMM: the rows
/// quantized to e4m3 with the weight's static input scale ([`quant_rows`]), then `out =
/// f(bf16(in_scale w_scale Xq Wq^T))` with the two per-tensor scales as cuBLASLt's scale
/// pointers, f32 accumulation (not cuBLASLt's fast accumulation, whose sums are not promoted
/// to f32 along k: on the H200 it was at most 6% faster and fell out of the band the W8A8
/// reference holds the other paths to), `f` relu^2 after it where `p.relu2`
/// ([`crate::act::relu2`]). The weights must be FP8 with an input scale (dynamic per-row scales
/// are not cuBLASLt's per-tensor form), k a multiple of 16 and n of 8 (cuBLASLt's FP8
/// alignment). Two or three launches.
pub fn linear_fp8(
    gpu: &Gpu,
    (x, rows): (&CudaView<'_, bf16>, usize),
    p: Proj<Weights<'_>>,
    out: &mut impl DevicePtrMut<bf16>,
) -> Result<()> {
    let c = Check(NAME_FP8);
    let Weights::Fp8 { codes, w_scale, in_scale: Some(in_scale) } = p.w else {
        return Err(Error::Shape {
            kernel: NAME_FP8,
            arg: "w",
            expected: "FP8 weights with a static input scale".into(),
            got: "other weights".into(),
        });
    };
    p.check(c)?;
    c.count("rows", i32::MAX as usize, rows)?;
    c.that("k", p.k.is_multiple_of(16), "a multiple of 16", p.k)?;
    c.that("n", p.n.is_multiple_of(8), "a multiple of 8", p.n)?;
    c.len_at_least("x", rows * p.k, x.len())?;
    c.len("w", p.n * p.k, codes.len())?;
    c.len("w_scale", 1, w_scale.len())?;
    c.len("in_scale", 1, in_scale.len())?;
    c.len("out", rows * p.n, out.len())?;
    for (arg, buf) in [("w_scale", w_scale), ("in_scale", in_scale)] {
        gpu.check_owner(NAME_FP8, arg, buf)?;
    }
    gpu.check_owner(NAME_FP8, "w", codes)?;
    gpu.check_owner(NAME_FP8, "out", out)?;
    // cuBLASLt there before anything is queued.
    gpu.blas()?;
    // SAFETY: quant_rows writes every row's codes (and scale) before the GEMM reads them.
    let (mut q, mut s) = unsafe { (gpu.scratch::<u8>(rows * p.k)?, gpu.scratch::<f32>(rows)?) };
    quant_rows(gpu, p.k, &x.slice(0..rows * p.k), Source::Plain, Some(in_scale), &mut q, &mut s)?;
    let stream = gpu.stream();
    let (w, xq) = (codes.device_ptr(stream).0 as *const c_void, q.device_ptr(stream).0 as *const c_void);
    let (ws, xs) = (w_scale.device_ptr(stream).0 as *const c_void, in_scale.device_ptr(stream).0 as *const c_void);
    let y = out.device_ptr_mut(stream).0 as *mut c_void;
    let types = (cudaDataType::CUDA_R_8F_E4M3, cudaDataType::CUDA_R_16BF);
    // SAFETY: the pointers are this Gpu's buffers of the extents checked above (q its own),
    // their work ordered on its stream; out is `&mut`, so it aliases no input.
    unsafe { matmul_tn(gpu, "an FP8 GEMM", types, (p.n, rows, p.k), (w, xq, y), Some((ws, xs)))? };
    if p.relu2 {
        crate::act::relu2(gpu, out, rows * p.n)?;
    }
    Ok(())
}

/// The name shape errors of [`logits_f32`] carry.
const NAME_LOGITS: &str = "logits_f32";

/// `Y = X W^T` in f32 for row-major `X [m, k]` and `W [n, k]` bf16 (f32 sums), `Y [m, n]`:
/// a MoE router's logits over `m` tokens. One cuBLASLt call.
pub fn logits_f32(
    gpu: &Gpu,
    m: usize,
    x: &impl DevicePtr<bf16>,
    w: &impl DevicePtr<bf16>,
    n: usize,
    k: usize,
    y: &mut impl DevicePtrMut<f32>,
) -> Result<()> {
    check_gemm(gpu, NAME_LOGITS, (m, n, k), x, w, y)?;
    let stream = gpu.stream();
    let (wp, xp) = (w.device_ptr(stream).0 as *const c_void, x.device_ptr(stream).0 as *const c_void);
    let yp = y.device_ptr_mut(stream).0 as *mut c_void;
    let types = (cudaDataType::CUDA_R_16BF, cudaDataType::CUDA_R_32F);
    // SAFETY: x holds m * k, w n * k and y m * n elements (checked), all this Gpu's, ordered
    // on its stream; y is `&mut`, so it aliases neither input.
    unsafe { matmul_tn(gpu, "the router logits' GEMM", types, (n, m, k), (wp, xp, yp), None) }
}

/// One cuBLASLt matmul, f32 compute: row-major `Y [rows, n] = X [rows, k] W [n, k]^T` as
/// column-major `Y^T [n, rows] = W^T' X^T'` (W read transposed: "TN", the one layout FP8
/// takes), `w` and `x` of the first type, `y` of the second, with per-tensor scale pointers
/// `(w's, x's)` where given.
///
/// # Safety
/// The pointers are this Gpu's buffers of those extents and types (the scales one f32 each),
/// their work ordered on its stream (cuBLASLt runs on it); `y` aliases no input.
unsafe fn matmul_tn(
    gpu: &Gpu,
    during: &'static str,
    (ab, d_type): (cudaDataType, cudaDataType),
    (n, rows, k): (usize, usize, usize),
    (w, x, y): (*const c_void, *const c_void, *mut c_void),
    scales: Option<(*const c_void, *const c_void)>,
) -> Result<()> {
    let blas = gpu.blas()?;
    let stream = gpu.stream();
    let work = blas.workspace.device_ptr(stream).0 as *mut c_void;
    let fail = |source| Error::Cublas { during, source };
    // SAFETY: every descriptor lives until the call has been queued and is destroyed once;
    // the attribute values are read during the calls that set them; the pointers as the
    // caller promises, the workspace this Gpu's own.
    unsafe {
        let desc = Desc(
            lt::create_matmul_desc(cublasComputeType_t::CUBLAS_COMPUTE_32F, cudaDataType::CUDA_R_32F).map_err(fail)?,
        );
        let t: i32 = 1;
        lt::set_matmul_desc_attribute(desc.0, Attr::CUBLASLT_MATMUL_DESC_TRANSA, (&raw const t).cast(), 4)
            .map_err(fail)?;
        if let Some((ws, xs)) = &scales {
            for (attr, p) in
                [(Attr::CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, ws), (Attr::CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, xs)]
            {
                let size = size_of::<*const c_void>();
                lt::set_matmul_desc_attribute(desc.0, attr, (p as *const *const c_void).cast(), size).map_err(fail)?;
            }
        }
        let layout = |ty, r: usize, c: usize| lt::create_matrix_layout(ty, r as u64, c as u64, r as i64).map(Layout);
        let a = layout(ab, k, n).map_err(fail)?;
        let b = layout(ab, k, rows).map_err(fail)?;
        let d = layout(d_type, n, rows).map_err(fail)?;
        let pref = Pref(lt::create_matmul_pref().map_err(fail)?);
        let size = BLAS_WORKSPACE;
        let attr = PrefAttr::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES;
        lt::set_matmul_pref_attribute(pref.0, attr, (&raw const size).cast(), size_of::<usize>()).map_err(fail)?;
        let handle = *blas.lt.handle();
        let algo = lt::get_matmul_algo_heuristic(handle, desc.0, a.0, b.0, d.0, d.0, pref.0).map_err(fail)?;
        let (alpha, beta) = (1.0f32, 0.0f32);
        let (alpha, beta) = ((&raw const alpha).cast(), (&raw const beta).cast());
        let cu = stream.cu_stream() as *mut _;
        lt::matmul(handle, desc.0, alpha, beta, w, a.0, x, b.0, y, d.0, y, d.0, &algo.algo, work, size, cu)
            .map_err(fail)?;
    }
    Ok(())
}

/// A cuBLASLt matmul description, destroyed on drop.
struct Desc(cublasLtMatmulDesc_t);
/// A cuBLASLt matrix layout, destroyed on drop.
struct Layout(cublasLtMatrixLayout_t);
/// A cuBLASLt matmul preference, destroyed on drop.
struct Pref(cublasLtMatmulPreference_t);

/// Drops each wrapper by its destroy call (an error there is cuBLASLt's own; nothing to do).
macro_rules! destroyed_by {
    ($($t:ident: $f:ident),*) => {$(
        impl Drop for $t {
            fn drop(&mut self) {
                // SAFETY: created by cuBLASLt and destroyed only here.
                let _: std::result::Result<(), CublasError> = unsafe { lt::$f(self.0) };
            }
        }
    )*};
}
destroyed_by!(Desc: destroy_matmul_desc, Layout: destroy_matrix_layout, Pref: destroy_matmul_pref);
