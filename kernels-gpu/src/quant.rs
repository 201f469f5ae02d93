//! FP8 e4m3 activation quantization (docs/MATH.md section 4). Codes are round-to-nearest-even,
//! saturated to +-448 (`cvt.rn.satfinite`), NaN stays NaN. Dequantize as `q * s`.
//!
//! - per-token dynamic: `s_t = max(min(amax_t, amax_ub) / 448, 1/(448*512))`, `q = e4m3(x / s_t)`;
//! - per-tensor dynamic: `s = max(amax / 448, 1/(448*512))`, `q = e4m3(x * (1/s))`, in two
//!   launches (amax, then quantize);
//! - static: `q = e4m3(x / scale)` with a given scale (a checkpoint's `input_scale`);
//! - rows of a grouped or plain product's input: each output row a gathered row of x, with its
//!   matrix's static scale or per row as per-token (`quant_rows_fp8_bf16`).
//!
//! Max |x| ignores NaN (`max.f32`). An all-zero input has amax 0, so the scale is the floor
//! `1/(448*512)` and every code is +0: no NaN, no garbage.

use crate::KernelParams;

/// Largest finite e4m3 value.
pub const E4M3_MAX: f32 = 448.0;
/// Smallest scale a dynamic quantization produces (the all-zero input's scale).
pub const MIN_SCALE: f32 = 1.0 / (448.0 * 512.0);

/// Per-token dynamic quantization of `[rows, width]` bf16.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct QuantTokenParams {
    /// `[rows, width]` bf16, read.
    pub x: *const u16,
    /// `[rows, width]` e4m3 codes, written.
    pub q: *mut u8,
    /// `[rows]` f32 scales, written.
    pub scales: *mut f32,
    pub rows: u32,
    pub width: u32,
    /// Upper bound on a row's amax before the scale is taken (`f32::INFINITY`: none).
    pub amax_ub: f32,
}

/// Rows quantized each by its own scale, gathered and scaled as a grouped (MoE) or plain
/// product's input wants them: output row r quantizes row `token[r]` of `x` (or row r), with
/// the static scale of its matrix or, without static scales, per row as `quant_token` does
/// (no amax bound).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct QuantRowsParams {
    /// Rows of `width` bf16, read.
    pub x: *const u16,
    /// `[rows]` the row of `x` each output row quantizes; null: row r itself.
    pub token: *const u32,
    /// Static scales, one per matrix: output row r takes `in_scale[e]`, e its matrix in the
    /// grouped order `offsets` (or 0 without offsets); null: per-row dynamic scales.
    pub in_scale: *const f32,
    /// `[experts + 1]` the grouped order's offsets (row r belongs to the e with
    /// `offsets[e] <= r < offsets[e + 1]`); null: one matrix.
    pub offsets: *const u32,
    /// `[rows, width]` e4m3 codes, written.
    pub q: *mut u8,
    /// `[rows]` f32 scales, written.
    pub scales: *mut f32,
    pub rows: u32,
    pub width: u32,
    pub experts: u32,
}

/// First pass of per-tensor quantization: `*amax = max |x|`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct QuantAmaxParams {
    /// `[n]` bf16, read.
    pub x: *const u16,
    /// One f32, written by the last block to finish.
    pub amax: *mut f32,
    /// Two u32 that are zero when the launch starts, left zero: `[0]` the running max |x| as
    /// bits (updated with an atomic max: f32 >= 0 order like their bits), `[1]` the blocks
    /// that have added theirs.
    pub scratch: *mut u32,
    pub n: u32,
}

/// Second pass of per-tensor quantization.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct QuantTensorParams {
    /// `[n]` bf16, read.
    pub x: *const u16,
    /// The first pass's amax, read.
    pub amax: *const f32,
    /// `[n]` e4m3 codes, written.
    pub q: *mut u8,
    /// One f32, the tensor's scale, written by thread 0 of block 0.
    pub scale: *mut f32,
    pub n: u32,
}

/// Static-scale quantization.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct QuantStaticParams {
    /// `[n]` bf16, read.
    pub x: *const u16,
    /// `[n]` e4m3 codes, written.
    pub q: *mut u8,
    pub n: u32,
    /// The scale (finite, > 0).
    pub scale: f32,
}

// SAFETY: #[repr(C)], Copy, only pointers, integers and floats.
unsafe impl KernelParams for QuantTokenParams {}
// SAFETY: as above.
unsafe impl KernelParams for QuantRowsParams {}
// SAFETY: as above.
unsafe impl KernelParams for QuantAmaxParams {}
// SAFETY: as above.
unsafe impl KernelParams for QuantTensorParams {}
// SAFETY: as above.
unsafe impl KernelParams for QuantStaticParams {}

/// Dynamic shared memory of the per-token kernel (the block-reduction scratch).
pub const REDUCE_SMEM_BYTES: u32 = crate::REDUCE_SMEM_FLOATS * 4;
/// Dynamic shared memory of the amax kernel: the block-reduction scratch and a flag word.
pub const AMAX_SMEM_BYTES: u32 = REDUCE_SMEM_BYTES + 4;

/// Chunks each thread of the element-wise kernels handles per grid pass, on average; the
/// host sizes their grid as `ceil(chunks / (EW_BLOCK * EW_CHUNKS_PER_THREAD))`, capped at
/// [`MAX_GRID`]. The per-tensor kernels also load this many chunks at once.
pub const EW_CHUNKS_PER_THREAD: u32 = 4;
/// Most blocks of an element-wise (grid-stride) launch.
pub const MAX_GRID: u32 = 2048;

/// The per-token scale for a row whose max |x| is `amax` (device side; the CPU reference
/// computes it independently from docs/MATH.md).
#[inline(always)]
pub fn token_scale(amax: f32, amax_ub: f32) -> f32 {
    (amax.min(amax_ub) / E4M3_MAX).max(MIN_SCALE)
}

#[cfg(target_arch = "nvptx64")]
mod kernels {
    use super::*;
    use crate::device::*;
    use crate::{CHUNKS_PER_THREAD, EW_BLOCK, VEC, chunks};

    /// Per-token dynamic FP8, [`QuantTokenParams`]. Grid `(rows)`, block `row_block(width)`,
    /// dynamic shared memory [`REDUCE_SMEM_BYTES`]. Block r loads row r once into registers
    /// (thread t: chunks t, t + B, ...), reduces max |x|, writes row r of q and `scales[r]`.
    #[unsafe(no_mangle)]
    pub unsafe extern "ptx-kernel" fn quant_token_fp8_bf16(p: QuantTokenParams) {
        grid_dependency_wait();
        let r = block_x() as usize;
        let width = p.width as usize;
        // SAFETY: launch contract checked by host/src/quant.rs: rows r of x and q hold width
        // elements, scales rows entries.
        unsafe {
            quant_row(
                p.x.wrapping_add(r * width),
                p.q.wrapping_add(r * width),
                p.width,
                None,
                p.amax_ub,
                p.scales.wrapping_add(r),
            )
        }
    }

    /// FP8 of gathered rows with static or per-row scales, [`QuantRowsParams`]. Grid `(rows)`,
    /// block `row_block(width)` (or `row_block_many`), dynamic shared memory
    /// [`REDUCE_SMEM_BYTES`]. Block r finds its source row and, with static scales, its
    /// matrix (a binary search of the offsets), then quantizes as `quant_token_fp8_bf16`.
    #[unsafe(no_mangle)]
    pub unsafe extern "ptx-kernel" fn quant_rows_fp8_bf16(p: QuantRowsParams) {
        grid_dependency_wait();
        let r = block_x();
        let width = p.width as usize;
        // SAFETY: launch contract checked by host/src/quant.rs: token (where given) holds rows
        // entries, each a row of x; offsets (where given) experts + 1 nondecreasing entries from
        // 0 covering rows; in_scale a scale per matrix; q rows x width, scales rows.
        unsafe {
            let src = if p.token.is_null() { r } else { ld(p.token, r as usize) } as usize;
            let fixed = if p.in_scale.is_null() {
                None
            } else {
                let e = if p.offsets.is_null() { 0 } else { matrix_of(p.offsets, p.experts, r) };
                Some(ld(p.in_scale, e as usize))
            };
            let q = p.q.wrapping_add(r as usize * width);
            quant_row(
                p.x.wrapping_add(src * width),
                q,
                p.width,
                fixed,
                f32::INFINITY,
                p.scales.wrapping_add(r as usize),
            )
        }
    }

    /// The matrix of grouped row r: the last e below `experts` with `offsets[e] <= r` (experts
    /// without rows have `offsets[e] == offsets[e + 1]`, so that e's range holds r).
    ///
    /// # Safety
    /// `offsets[0..experts]` readable, `offsets[0] == 0`.
    #[inline(always)]
    unsafe fn matrix_of(offsets: *const u32, experts: u32, r: u32) -> u32 {
        let (mut lo, mut hi) = (0, experts);
        while hi - lo > 1 {
            let mid = (lo + hi) / 2;
            // SAFETY: mid < experts.
            if unsafe { ld(offsets, mid as usize) } <= r {
                lo = mid;
            } else {
                hi = mid;
            }
        }
        lo
    }

    /// One row to e4m3: `x` its `width` bf16, loaded once into registers (thread t: chunks t,
    /// t + B, ...), the scale `fixed` or else the row's per-token one (max |x| reduced over the
    /// block, bounded by `amax_ub`), codes `e4m3(x / s)` to `q`, the scale to `*scale` (thread
    /// 0). Called by a whole block in uniform flow (the reduction has barriers).
    ///
    /// # Safety
    /// `x` and `q` hold `width` elements, `scale` one; the block has threads for the row's
    /// chunks ([`CHUNKS_PER_THREAD`] each) and [`REDUCE_SMEM_BYTES`] of dynamic shared memory.
    #[inline(always)]
    unsafe fn quant_row(x: *const u16, q: *mut u8, width: u32, fixed: Option<f32>, amax_ub: f32, scale: *mut f32) {
        let (w, n) = (width as usize, chunks(width));
        let mut v = [[0.0f32; 8]; CHUNKS_PER_THREAD as usize];
        let chunk = |j: usize| thread_x() + j as u32 * block_dim_x();
        // SAFETY: as the doc says; chunk k < n covers channels below width; each thread writes
        // its own chunks.
        unsafe {
            let mut amax = 0.0f32;
            for (j, vj) in v.iter_mut().enumerate() {
                if chunk(j) < n {
                    *vj = load8_bf16(x, (chunk(j) * VEC) as usize, w);
                    amax = vj.iter().fold(amax, |a, y| fmax(a, y.abs()));
                }
            }
            let s = match fixed {
                Some(s) => s,
                None => token_scale(block_max(amax, dyn_smem_f32()), amax_ub),
            };
            let inv_s = 1.0 / s;
            for (j, vj) in v.iter().enumerate() {
                if chunk(j) < n {
                    store8_e4m3(q, (chunk(j) * VEC) as usize, w, vj.map(|y| div_rn_by(y, s, inv_s)));
                }
            }
            if thread_x() == 0 {
                st(scale, 0, s);
            }
        }
    }

    /// Block `b`'s chunks in the per-tensor kernels: a contiguous range of
    /// `ceil(chunks / grid)` chunks (rounded up to whole blocks), so the amax pass finishes
    /// the tensor's end last and the quantization pass, which takes the ranges in reverse
    /// block order, starts with what is most likely still in L2. `f(c0)` for each chunk start
    /// below `n`, [`EW_CHUNKS_PER_THREAD`] chunks a thread loaded together where whole.
    #[inline(always)]
    fn for_block_range(n: u32, b: u32, mut f: impl FnMut(&[usize; J], u32)) {
        let nc = chunks(n);
        let per = nc.div_ceil(grid_dim_x()).div_ceil(EW_BLOCK) * EW_BLOCK;
        let (start, end) = (b.saturating_mul(per).min(nc), (b.saturating_mul(per)).saturating_add(per).min(nc));
        let mut k = start + thread_x();
        while k + (J as u32 - 1) * EW_BLOCK < end {
            f(&core::array::from_fn(|j| ((k + j as u32 * EW_BLOCK) * VEC) as usize), J as u32);
            k += J as u32 * EW_BLOCK;
        }
        while k < end {
            f(&[(k * VEC) as usize; J], 1);
            k += EW_BLOCK;
        }
    }

    const J: usize = EW_CHUNKS_PER_THREAD as usize;

    /// Per-tensor amax, [`QuantAmaxParams`]. Any grid, block [`crate::EW_BLOCK`], dynamic shared
    /// memory [`AMAX_SMEM_BYTES`]. Each block reduces its range of chunks and thread 0 does one
    /// `red.global.max.u32` on the bits of `scratch[0]`; the last block to arrive writes
    /// `*amax` and sets `scratch[0]` back to zero.
    #[unsafe(no_mangle)]
    pub unsafe extern "ptx-kernel" fn quant_amax_bf16(p: QuantAmaxParams) {
        grid_dependency_wait();
        let n = p.n as usize;
        let mut amax = 0.0f32;
        for_block_range(p.n, block_x(), |c0, m| {
            // SAFETY: chunks stay below n, the length the launcher checked; all m loads first.
            let v: [[u32; 4]; J] =
                core::array::from_fn(|j| if (j as u32) < m { unsafe { load8_raw(p.x, c0[j], n) } } else { [0; 4] });
            for vj in v {
                amax = raw8_values(vj).iter().fold(amax, |a, y| fmax(a, y.abs()));
            }
        });
        let smem = dyn_smem_f32();
        let amax = block_max(amax, smem);
        // SAFETY: `p.scratch` points at two u32 of global memory only this grid touches (the
        // launcher's contract); the atomic serializes blocks; the arrival (release) follows
        // the max in thread 0's program order, the last block's reads follow its acquire.
        unsafe {
            if thread_x() == 0 {
                core::arch::asm!("red.global.max.u32 [{p}], {v};", p = in(reg64) p.scratch, v = in(reg32) amax.to_bits(),
                                 options(nostack));
            }
            let flag = smem.wrapping_add(crate::REDUCE_SMEM_FLOATS as usize) as *mut u32;
            if last_block(p.scratch.wrapping_add(1), grid_dim_x(), flag) && thread_x() == 0 {
                let acc = core::sync::atomic::AtomicU32::from_ptr(p.scratch);
                st(p.amax, 0, f32::from_bits(acc.load(core::sync::atomic::Ordering::Relaxed)));
                acc.store(0, core::sync::atomic::Ordering::Relaxed);
            }
        }
    }

    /// Per-tensor quantization, [`QuantTensorParams`]. The amax launch's grid, block
    /// [`crate::EW_BLOCK`]. Each thread reads `*amax`, derives the scale, and writes the codes
    /// of its chunks: block `b` those of the amax launch's block `grid - 1 - b`.
    #[unsafe(no_mangle)]
    pub unsafe extern "ptx-kernel" fn quant_tensor_fp8_bf16(p: QuantTensorParams) {
        grid_dependency_wait();
        // SAFETY: launch contract checked by host/src/quant.rs.
        unsafe {
            let s = (ld(p.amax, 0) / E4M3_MAX).max(MIN_SCALE);
            let inv = 1.0 / s;
            let n = p.n as usize;
            for_block_range(p.n, grid_dim_x() - 1 - block_x(), |c0, m| {
                let v: [[u32; 4]; J] =
                    core::array::from_fn(|j| if (j as u32) < m { load8_raw(p.x, c0[j], n) } else { [0; 4] });
                for (j, vj) in v.iter().enumerate() {
                    if (j as u32) < m {
                        store8_e4m3(p.q, c0[j], n, raw8_values(*vj).map(|v| v * inv));
                    }
                }
            });
            if block_x() == 0 && thread_x() == 0 {
                st(p.scale, 0, s);
            }
        }
    }

    /// Static-scale quantization, [`QuantStaticParams`]. Any grid, block [`crate::EW_BLOCK`].
    #[unsafe(no_mangle)]
    pub unsafe extern "ptx-kernel" fn quant_static_fp8_bf16(p: QuantStaticParams) {
        grid_dependency_wait();
        let (n, s) = (p.n as usize, p.scale);
        let r = 1.0 / s;
        // SAFETY: chunks stay below n, the length the launcher checked.
        for_each_chunk(p.n, |c0| unsafe {
            store8_e4m3(p.q, c0, n, load8_bf16(p.x, c0, n).map(|v| div_rn_by(v, s, r)))
        });
    }
}
