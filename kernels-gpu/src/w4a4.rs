//! W4A4 NVFP4 linear layers (docs/MATH.md, "W4A4"): the activations quantized to NVFP4 with the
//! layer's static input scale ([`QuantizeParams`], every arch), then `y = x W^T` on the
//! block-scaled FP4 tensor cores of the sm_120a family (DGX Spark's sm_121a), both operands as
//! e2m1 codes with e4m3 block scales ([`GemmParams`]): what an NVFP4 checkpoint's `input_scale`
//! asks for, where the weight-only kernels (`crate::nvfp4`, `crate::qgemv`) keep bf16 inputs.
//!
//! Both operands are rows in [`crate::nvfp4`]'s layout (a row's codes, then its block scales,
//! [`row_bytes`] a row), so one loader serves both.
//!
//! # The product
//! `mma.sync.aligned.m16n8k64.row.col.kind::mxf4nvf4.block_scale.scale_vec::4X.f32.e2m1.e2m1.f32.ue4m3`
//! (PTX ISA 8.7+, sm_120a and sm_121a only: the `gemm_nvfp4_w4a4` entry is in the sm_121a PTX
//! alone, `Kernel::in_arch`) multiplies 16 x 64 codes of A by 64 x 8 of B, each code times its
//! block's scale, into a 16 x 8 f32 accumulator. With `g = lane / 4` and `q = lane % 4`, a
//! word is 8 codes of a row at consecutive k (4 bytes, the lower k in the lower four bits):
//! - A, four words: word `r` of row `g + 8 (r % 2)`, k from `8q + 32 (r / 2)` ([`a_word`]);
//! - B, two words: word `r` of column (weight row) `g`, k from `8q + 32 r` ([`b_word`]);
//! - the scales, a word of four e4m3 block scales each (blocks 0..3 of the 64, the first in the
//!   low byte: as a row stores them): with the selectors `{0, 0}` the instruction reads row
//!   m's of A from lane `4 (m % 8) + m / 8` and column n's of B from lane `4 n`; every lane
//!   loads those of row [`scale_a_row`] and column [`scale_b_col`], which are them where read;
//! - the accumulators as the bf16 `mma`'s ([`crate::mma::acc_row`], [`crate::mma::acc_col`]).
//!
//! No GPU of this family is at hand: host's tests/w4a4.rs emulates the instruction on the CPU
//! from this layout and holds the loaders to a plain product; ptxas assembles the kernel; and
//! `gemm_nvfp4_w4a4_emulated`, the same kernel with the instruction emulated by the warp
//! through shared memory (every arch), runs its loads, guards and output on any GPU.

use crate::KernelParams;
pub use crate::nvfp4::{BLOCK, row_bytes};

/// k of one product.
pub const MMA_K: u32 = 64;
/// Threads of a `gemm_nvfp4_w4a4` block: four warps, 2 x 2 over the block's tile.
pub const GEMM_BLOCK: u32 = 128;
/// Rows (of x and y) of a block's tile; a warp's are half of them, two 16-row products.
pub const GEMM_ROWS: u32 = 64;
/// Columns (weight rows) of a block's tile; a warp's are half of them, four 8-column products.
pub const GEMM_COLS: u32 = 64;
/// The 16-row products of a warp.
pub const WARP_M_TILES: usize = (GEMM_ROWS / 2 / 16) as usize;
/// The 8-column products of a warp.
pub const WARP_N_TILES: usize = (GEMM_COLS / 2 / 8) as usize;

/// Row (of the 16) and first k (of the 64) of word `r` (0..4) of `lane`'s A fragment.
pub const fn a_word(lane: u32, r: u32) -> (u32, u32) {
    (lane / 4 + 8 * (r % 2), 8 * (lane % 4) + 32 * (r / 2))
}

/// Column (of the 8) and first k (of the 64) of word `r` (0..2) of `lane`'s B fragment.
pub const fn b_word(lane: u32, r: u32) -> (u32, u32) {
    (lane / 4, 8 * (lane % 4) + 32 * r)
}

/// Row (of the 16) whose four block scales `lane` holds for A.
pub const fn scale_a_row(lane: u32) -> u32 {
    lane / 4 + 8 * (lane % 2)
}

/// Column (of the 8) whose four block scales `lane` holds for B.
pub const fn scale_b_col(lane: u32) -> u32 {
    lane / 4
}

/// Rows of bf16 activations to NVFP4 rows ([`row_bytes`] each): with `g = 1 / scale`, each
/// block of 16 gets the e4m3 scale `s = e4m3(amax g / 6)` (nearest even, saturating), and each
/// element the e2m1 code nearest `x (g / s)` (ties to even, saturating at 6; all codes 0 where
/// `s` is 0). The padding of a row is not written.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct QuantizeParams {
    /// Row r at `x + r * stride`, `k` bf16.
    pub x: *const u16,
    /// `rows` rows of [`row_bytes`]`(k)` bytes, written.
    pub out: *mut u8,
    /// The layer's input scale (the activations' amax / (6 * 448) at calibration), positive.
    pub scale: f32,
    pub stride: u32,
    /// A multiple of [`BLOCK`].
    pub k: u32,
    /// `rows * k / 16` below 2^31.
    pub rows: u32,
}

// SAFETY: #[repr(C)], Copy, only pointers, integers and floats.
unsafe impl KernelParams for QuantizeParams {}

/// `y [m, n] = bf16(scale * global * sum_k a[., k] w[., k])` for NVFP4 rows `a` (activations,
/// [`QuantizeParams`]'s) and `w` (weights), each code times its block scale, f32 sums.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct GemmParams {
    /// `m` rows of [`row_bytes`]`(k)` bytes.
    pub a: *const u8,
    /// `n` rows of [`row_bytes`]`(k)` bytes.
    pub w: *const u8,
    /// The weight's per-tensor scale (one).
    pub global: *const f32,
    /// `[m, n]` bf16, written.
    pub y: *mut u16,
    /// The activations' scale ([`QuantizeParams::scale`]).
    pub scale: f32,
    pub m: u32,
    pub n: u32,
    /// A multiple of [`MMA_K`].
    pub k: u32,
}

// SAFETY: #[repr(C)], Copy, only pointers, integers and floats.
unsafe impl KernelParams for GemmParams {}

#[cfg(all(target_arch = "nvptx64", tcgen05))]
mod tmem;

#[cfg(target_arch = "nvptx64")]
mod kernels {
    use super::*;
    use crate::device::*;
    use crate::mma::{acc_col, acc_row};

    /// The e2m1 code nearest `v` (ties to the even code, saturating at 6), sign in bit 3: the
    /// magnitude code counts the midpoints below |v|, a tie counted where the code above it is
    /// even (0.75, 1.75, 3.5).
    #[inline(always)]
    fn e2m1_code(v: f32) -> u32 {
        let a = v.abs();
        let up = [a > 0.25, a >= 0.75, a > 1.25, a >= 1.75, a > 2.5, a >= 3.5, a > 5.0];
        up.iter().map(|&u| u32::from(u)).sum::<u32>() | if v < 0.0 { 8 } else { 0 }
    }

    /// [`QuantizeParams`]. Any grid, block [`crate::EW_BLOCK`]: a thread quantizes a block of
    /// 16 at a time.
    #[unsafe(no_mangle)]
    pub unsafe extern "ptx-kernel" fn nvfp4_quantize_bf16(p: QuantizeParams) {
        grid_dependency_wait();
        let (k, per_row) = (p.k as usize, p.k / BLOCK as u32);
        let bytes = row_bytes(k);
        let g = 1.0 / p.scale;
        let stride = grid_dim_x() * crate::EW_BLOCK;
        let mut i = block_x() * crate::EW_BLOCK + thread_x();
        while i < p.rows * per_row {
            let (r, b) = ((i / per_row) as usize, (i % per_row) as usize);
            let mut v = [0.0f32; BLOCK];
            // SAFETY: row r of x holds k bf16 at x + r * stride, out rows * row_bytes(k) bytes
            // (the launcher checks them); each block's codes and scale are written by its
            // thread alone, the codes' 8 bytes 4-byte aligned (rows of 16-byte multiples,
            // 8 bytes a block).
            unsafe {
                for (j, v) in v.iter_mut().enumerate() {
                    *v = bf16_to_f32(ld(p.x, r * p.stride as usize + BLOCK * b + j));
                }
                let amax = v.iter().fold(0.0f32, |m, x| m.max(x.abs()));
                let code = f32x2_to_e4m3(0.0, amax * g / 6.0) as u8;
                let s = e4m3x2_to_f32(u16::from(code)).0;
                let mut words = [0u32; 2];
                if s > 0.0 {
                    let inv = g / s;
                    for (j, &x) in v.iter().enumerate() {
                        words[j / 8] |= e2m1_code(x * inv) << (4 * (j % 8));
                    }
                }
                let row = p.out.wrapping_add(r * bytes);
                let codes = row.wrapping_add(BLOCK / 2 * b) as *mut u32;
                st(codes, 0, words[0]);
                st(codes, 1, words[1]);
                st(row, k / 2 + b, code);
            }
            i += stride;
        }
    }

    /// `c += a · b` for one 16 x 64 by 64 x 8 product of codes and block scales, on the
    /// block-scaled FP4 `mma` (the sm_120a family) or emulated.
    trait Mma {
        /// What the products need (once a kernel).
        fn new() -> Self;
        fn mma(&self, c: [f32; 4], a: [u32; 4], b: [u32; 2], sa: u32, sb: u32) -> [f32; 4];
    }

    /// The instruction itself.
    #[cfg(block_scaled_fp4)]
    struct Native;

    #[cfg(block_scaled_fp4)]
    impl Mma for Native {
        #[inline(always)]
        fn new() -> Native {
            Native
        }

        #[inline(always)]
        fn mma(&self, mut c: [f32; 4], a: [u32; 4], b: [u32; 2], sa: u32, sb: u32) -> [f32; 4] {
            // SAFETY: register-only tensor-core instruction (sm_120a family); the whole warp
            // executes it (callers keep it in warp-uniform flow).
            unsafe {
                core::arch::asm!("mma.sync.aligned.m16n8k64.row.col.kind::mxf4nvf4.block_scale.scale_vec::4X.f32.e2m1.e2m1.f32.ue4m3 {{{c0}, {c1}, {c2}, {c3}}}, {{{a0}, {a1}, {a2}, {a3}}}, {{{b0}, {b1}}}, {{{c0}, {c1}, {c2}, {c3}}}, {sa}, {{0, 0}}, {sb}, {{0, 0}};",
                     c0 = inout(reg32) c[0], c1 = inout(reg32) c[1], c2 = inout(reg32) c[2], c3 = inout(reg32) c[3],
                     a0 = in(reg32) a[0], a1 = in(reg32) a[1], a2 = in(reg32) a[2], a3 = in(reg32) a[3],
                     b0 = in(reg32) b[0], b1 = in(reg32) b[1], sa = in(reg32) sa, sb = in(reg32) sb,
                     options(pure, nomem, nostack))
            }
            c
        }
    }

    /// Words of a warp's operands in [`Emulated`]'s shared memory: A's four registers, B's two,
    /// the two scale registers, 32 lanes each.
    const EMULATED_WORDS: usize = 8 * 32;

    /// The instruction emulated from the PTX ISA's description of its operands (the module's
    /// doc): the warp puts its registers in shared memory, then each lane reads its
    /// accumulators' rows of A, columns of B and their scales from where the instruction takes
    /// them and sums their products in f32 (each exact: codes of at most 2 significant bits,
    /// scales of 4). Many instructions a product: for the GPU test of the kernel's data path
    /// where no GPU of the family is.
    struct Emulated {
        /// This warp's [`EMULATED_WORDS`].
        words: *mut u32,
    }

    impl Mma for Emulated {
        #[inline(always)]
        fn new() -> Emulated {
            const BYTES: u32 = GEMM_BLOCK / 32 * EMULATED_WORDS as u32 * 4;
            // SAFETY: the block's static shared memory, a region a warp.
            let base = unsafe { static_smem!("w4a4_emulated", BYTES) } as *mut u32;
            Emulated { words: base.wrapping_add(warp_id() as usize * EMULATED_WORDS) }
        }

        #[inline(always)]
        fn mma(&self, c: [f32; 4], a: [u32; 4], b: [u32; 2], sa: u32, sb: u32) -> [f32; 4] {
            emulate(self.words, c, a, b, (sa, sb))
        }
    }

    /// [`Emulated`]'s product, a function of its own (inlined, its size would keep the
    /// kernel's loops over the tiles from unrolling, and their accumulators in local memory).
    #[inline(never)]
    fn emulate(w: *mut u32, c: [f32; 4], a: [u32; 4], b: [u32; 2], (sa, sb): (u32, u32)) -> [f32; 4] {
        let lane = lane_id() as usize;
        // SAFETY: this warp's own words; the barriers order the warp's writes and reads.
        unsafe {
            sync_warp();
            for (r, &v) in a.iter().chain(&b).chain(&[sa, sb]).enumerate() {
                st(w, 32 * r + lane, v);
            }
            sync_warp();
            // Element e of the accumulator: row g + 8 (e / 2), column 2q + e % 2. Row i's
            // word j (k from 8j) is register i / 8 + 2 (j / 4) of lane 4 (i % 8) + j % 4,
            // column n's register 4 + j / 4 of lane 4n + j % 4; row i's scales lane
            // 4 (i % 8) + i / 8's register 6, column n's lane 4n's register 7.
            let (g, q) = (lane / 4, lane % 4);
            let sum = |e: usize| {
                let (row, col) = (g + 8 * (e / 2), 2 * q + e % 2);
                let (row_scales, col_scales) = (ld(w, 32 * 6 + 4 * (row % 8) + row / 8), ld(w, 32 * 7 + 4 * col));
                let mut sum = 0.0f32;
                for j in 0..8 {
                    let x = e2m1x8_to_f32(ld(w, 32 * (row / 8 + 2 * (j / 4)) + 4 * (row % 8) + j % 4));
                    let y = e2m1x8_to_f32(ld(w, 32 * (4 + j / 4) + 4 * col + j % 4));
                    let dot: f32 = (0..8).map(|i| x[i] * y[i]).sum();
                    // The codes' values are times 2^-14 each; word j is in block j / 2.
                    let scale = |s: u32| e4m3x2_to_f32(((s >> (8 * (j / 2))) & 0xff) as u16).0;
                    sum += dot * (scale(row_scales) * scale(col_scales)) * 268_435_456.0;
                }
                sum
            };
            [c[0] + sum(0), c[1] + sum(1), c[2] + sum(2), c[3] + sum(3)]
        }
    }

    /// The word of 8 codes from k of row `row` (below `rows`, else 0) of NVFP4 rows at `base`.
    ///
    /// # Safety
    /// `base` holds `rows` rows of `bytes`; k + 8 within the row's k.
    #[inline(always)]
    unsafe fn codes(base: *const u8, bytes: usize, row: u32, rows: u32, k: u32) -> u32 {
        if row >= rows {
            return 0;
        }
        // SAFETY: guaranteed by the caller; rows start 16-byte aligned, k a multiple of 8.
        unsafe { ld(base.wrapping_add(row as usize * bytes + k as usize / 2) as *const u32, 0) }
    }

    /// The word of the four block scales of k0..k0 + 64 of row `row` (below `rows`, else 0) of
    /// NVFP4 rows of `k` at `base`.
    ///
    /// # Safety
    /// As [`codes`]; k0 + 64 within k.
    #[inline(always)]
    unsafe fn scales(base: *const u8, bytes: usize, row: u32, rows: u32, (k, k0): (u32, u32)) -> u32 {
        if row >= rows {
            return 0;
        }
        // SAFETY: guaranteed by the caller; k / 2 and k0 / 16 are multiples of 4.
        unsafe {
            let at = row as usize * bytes + (k / 2 + k0 / BLOCK as u32) as usize;
            ld(base.wrapping_add(at) as *const u32, 0)
        }
    }

    /// [`GemmParams`] through `M`'s product. Grid `(n / 64, m / 64)` rounded up, block
    /// [`GEMM_BLOCK`]: warp w takes rows `32 (w % 2)` and columns `32 (w / 2)` of the block's
    /// 64 x 64, every fragment loaded from global memory.
    ///
    /// # Safety
    /// The launch contract of [`GemmParams`] (checked by host/src/w4a4.rs).
    #[inline(always)]
    unsafe fn gemm<M: Mma>(p: GemmParams) {
        grid_dependency_wait();
        let (lane, warp) = (lane_id(), warp_id());
        let m0 = block_y() * GEMM_ROWS + GEMM_ROWS / 2 * (warp % 2);
        let n0 = block_x() * GEMM_COLS + GEMM_COLS / 2 * (warp / 2);
        let bytes = row_bytes(p.k as usize);
        let mut acc = [[[0.0f32; 4]; WARP_N_TILES]; WARP_M_TILES];
        let product = M::new();
        let mut k0 = 0;
        while k0 < p.k {
            let (mut a, mut sa) = ([[0u32; 4]; WARP_M_TILES], [0u32; WARP_M_TILES]);
            let (mut b, mut sb) = ([[0u32; 2]; WARP_N_TILES], [0u32; WARP_N_TILES]);
            // SAFETY: a holds m rows and w n rows of row_bytes(k) (the launcher checks them);
            // rows past m or n are not read; k0 + 64 <= k.
            unsafe {
                for t in 0..WARP_M_TILES {
                    let r0 = m0 + 16 * t as u32;
                    for (r, word) in a[t].iter_mut().enumerate() {
                        let (row, k) = a_word(lane, r as u32);
                        *word = codes(p.a, bytes, r0 + row, p.m, k0 + k);
                    }
                    sa[t] = scales(p.a, bytes, r0 + scale_a_row(lane), p.m, (p.k, k0));
                }
                for u in 0..WARP_N_TILES {
                    let c0 = n0 + 8 * u as u32;
                    for (r, word) in b[u].iter_mut().enumerate() {
                        let (col, k) = b_word(lane, r as u32);
                        *word = codes(p.w, bytes, c0 + col, p.n, k0 + k);
                    }
                    sb[u] = scales(p.w, bytes, c0 + scale_b_col(lane), p.n, (p.k, k0));
                }
            }
            for t in 0..WARP_M_TILES {
                for u in 0..WARP_N_TILES {
                    acc[t][u] = product.mma(acc[t][u], a[t], b[u], sa[t], sb[u]);
                }
            }
            k0 += MMA_K;
        }
        // SAFETY: global holds one scale; y m x n (the launcher checks them); each output
        // element is written by the one lane whose accumulator holds it.
        unsafe {
            let alpha = p.scale * ld(p.global, 0);
            for (t, acc) in acc.iter().enumerate() {
                for (u, acc) in acc.iter().enumerate() {
                    for (e, &v) in acc.iter().enumerate() {
                        let row = m0 + 16 * t as u32 + acc_row(lane, e as u32);
                        let col = n0 + 8 * u as u32 + acc_col(lane, e as u32);
                        if row < p.m && col < p.n {
                            st(p.y, row as usize * p.n as usize + col as usize, f32_to_bf16(v * alpha));
                        }
                    }
                }
            }
        }
    }

    /// [`GemmParams`] on the block-scaled FP4 `mma` (first form: not yet run on a GPU).
    #[cfg(block_scaled_fp4)]
    #[unsafe(no_mangle)]
    pub unsafe extern "ptx-kernel" fn gemm_nvfp4_w4a4(p: GemmParams) {
        // SAFETY: the launch contract.
        unsafe { gemm::<Native>(p) }
    }

    /// [`GemmParams`] with the product emulated ([`Emulated`]): the test of the kernel's data
    /// path on every arch.
    #[unsafe(no_mangle)]
    pub unsafe extern "ptx-kernel" fn gemm_nvfp4_w4a4_emulated(p: GemmParams) {
        // SAFETY: the launch contract.
        unsafe { gemm::<Emulated>(p) }
    }
}
