//! Quantized linear layers of a few rows on tensor cores: FP8 e4m3 weights (W8A8, docs/MATH.md
//! section 7) multiplied with `mma.sync` m16n8k32 straight from the loaded codes, eight rows of
//! x a product (its n), so that one pass over the weights serves up to eight rows at about the
//! cost of one (the warp mode of kernels-gpu/src/gemv.rs streams the weights once per row: the
//! faster at one row, host/src/gemv.rs says by how much). The dense kernel `gemv_tc_fp8`
//! ([`DenseParams`](crate::gemv::DenseParams)) and MoE's `moe_expert_tc_fp8`
//! (kernels-gpu/src/moe.rs, an expert per block row) share [`fp8_tiles`].
//!
//! # Layout of the work
//! A block ([`QG_BLOCK`] threads, [`QG_WARPS`] warps) owns [`QG_ROWS`] weight rows, one 16-row
//! `mma` tile ([`QG_TILES`]) each warp; its warps split k: k runs in *half steps* of
//! [`QG_HALF`] bytes, half step `i` to warp `i % QG_WARPS`, [`QG_UNROLL`] of them in flight per
//! warp (a round). A pass over the weights serves up to [`QG_TOKENS`] rows of x, each quantized
//! to e4m3 as its products come, with the matrix's static input scale or, without one, its own
//! (docs/MATH.md section 4: the warps find the rows' amax first). The partial sums meet in
//! shared memory at the end, added in warp order (deterministic), and are scaled by both
//! scales.
//!
//! In a half step, lane `(g, q) = (lane / 4, lane % 4)` loads bytes `16q..16q + 16` of weight
//! rows `g, g + 8` of each tile (one 16-byte load each: a row's 64 bytes in four lanes) and
//! quantizes the same 16 elements of x row g. Word `2s` of those 16 bytes is its `a[0]` (row g)
//! / `a[1]` (row g + 8) of the half step's product s, word `2s + 1` its `a[2]` / `a[3]`, and the
//! input words likewise its `b[0]`, `b[1]` (kernels-gpu/src/mma.rs gives the fragments): the
//! products see k in an order of their own, the same for the weights and the inputs, which is
//! all a dot product needs.

/// Threads per block.
pub const QG_BLOCK: u32 = 256;
/// Warps per block, splitting k.
pub const QG_WARPS: usize = (QG_BLOCK / 32) as usize;
/// 16-row `mma` tiles per warp.
pub const QG_TILES: usize = 1;
/// Weight rows per block.
pub const QG_ROWS: u32 = 16 * QG_TILES as u32;
/// Rows of x per pass over the weights: the `mma`'s n.
pub const QG_TOKENS: usize = 8;
/// Bytes of each weight row per half step (two `m16n8k32` products).
pub const QG_HALF: usize = 64;
/// Half steps in flight per warp (a round): with [`QG_WARPS`] over k, all of a warp's share of
/// a row of up to 3072 bytes (Nano's 2688 and 1856) in one round trip (8 spilled on sm_121a).
pub const QG_UNROLL: usize = 6;

#[cfg(target_arch = "nvptx64")]
pub(crate) use device::*;

#[cfg(target_arch = "nvptx64")]
mod device {
    use super::*;
    use crate::device::*;
    use crate::gemv::{DenseParams, Operands, warp_token_scale};
    use crate::mma::{acc_col, acc_row, mma_e4m3};

    /// A block's weight rows of one matrix: the first at `w`, each next `stride` bytes on,
    /// `valid` of them within n (the rest of the block's [`QG_ROWS`] are not computed), of
    /// matrix `e` (its scales).
    pub struct Fp8Rows {
        pub w: *const u8,
        pub stride: usize,
        pub valid: usize,
        pub e: usize,
    }

    /// A block's share of an FP8 launch: `out[j, row0 + r] = f(x[x_row(j)] W_r^T)` for the
    /// block's rows `r` of `w` and rows `lo..hi` of out, [`QG_TOKENS`] of them a pass; `o` gives
    /// x, out, n, k, the scales and f (module doc).
    ///
    /// # Safety
    /// k a multiple of 8, the rows of `w` (`valid` >= 1 of them) readable for k bytes, the
    /// scales of matrix e readable, `x_row` rows of x for rows `lo..hi` of out, which holds
    /// them; the whole block calls it (barriers inside). Each output element is written by the
    /// one thread owning it.
    #[inline(always)]
    pub unsafe fn fp8_tiles(
        o: &Operands,
        r: &Fp8Rows,
        row0: usize,
        (lo, hi): (usize, usize),
        x_row: impl Fn(usize) -> usize,
    ) {
        // SAFETY: forwarded; the wide loads only where every row start is 16-byte aligned.
        unsafe {
            if (r.w as usize).is_multiple_of(16) && r.stride.is_multiple_of(16) {
                tiles::<true>(o, r, row0, (lo, hi), &x_row)
            } else {
                tiles::<false>(o, r, row0, (lo, hi), &x_row)
            }
        }
    }

    /// [`fp8_tiles`], its weights loaded 16 bytes at a time where `WIDE`, else 8.
    ///
    /// # Safety
    /// As [`fp8_tiles`]; `WIDE` only with every row start 16-byte aligned.
    #[inline(always)]
    unsafe fn tiles<const WIDE: bool>(
        o: &Operands,
        r: &Fp8Rows,
        row0: usize,
        (lo, hi): (usize, usize),
        x_row: &impl Fn(usize) -> usize,
    ) {
        const RED: usize = QG_TILES * 4 * 32;
        let (n, k) = (o.n as usize, o.k as usize);
        let (lane, warp, tid) = (lane_id() as usize, warp_id() as usize, thread_x() as usize);
        let (g, q) = (lane / 4, lane % 4);
        let halves = k.div_ceil(QG_HALF);
        // SAFETY: the caller's contract. Shared memory: the scales (written before the first
        // barrier of a pass, read after it) and the partial sums (each slot by its one lane,
        // read after the second barrier; the third keeps the next pass's writes after the
        // reads).
        unsafe {
            let scales = static_smem!("qg_scales", QG_TOKENS * 4);
            let red = static_smem!("qg_partial", QG_WARPS * RED * 4);
            // This lane's weight rows: g and g + 8 of each tile, a row past `valid` read as
            // the last valid one (its sums are not stored).
            let mut wrow = [[r.w; 2]; QG_TILES];
            for (m, rows) in wrow.iter_mut().enumerate() {
                for (h, w) in rows.iter_mut().enumerate() {
                    *w = r.w.wrapping_add((16 * m + 8 * h + g).min(r.valid - 1) * r.stride);
                }
            }
            let w_scale = ld(o.w_scale, r.e);
            let mut j0 = lo;
            while j0 < hi {
                let toks = (hi - j0).min(QG_TOKENS);
                let xr = |t: usize| o.x.wrapping_add(x_row(j0 + t) * k);
                if o.in_scale.is_null() {
                    // Warp w finds the amax of rows w, w + QG_WARPS, ...
                    let mut t = warp;
                    while t < toks {
                        let s = warp_token_scale(xr(t), k);
                        if lane == 0 {
                            st(scales, t, s);
                        }
                        t += QG_WARPS;
                    }
                } else if tid < toks {
                    st(scales, tid, ld(o.in_scale, r.e));
                }
                sync_threads();
                // This lane's input row (the products' column g), zero where there is none.
                let mine = g < toks;
                let x = if mine { xr(g) } else { o.x };
                let s = if mine { ld(scales, g) } else { 1.0 };
                let inv = 1.0 / s;
                let mut acc = [[0.0f32; 4]; QG_TILES];
                let mut i0 = warp;
                while i0 < halves {
                    // Every weight load of the round first, then each half step's inputs and
                    // products (the inputs quantized as their products come).
                    let mut a = [[[[0u32; 4]; 2]; QG_TILES]; QG_UNROLL];
                    for (u, a) in a.iter_mut().enumerate() {
                        let c = (i0 + QG_WARPS * u) * QG_HALF + 16 * q;
                        if i0 + QG_WARPS * u < halves {
                            for (a, w) in a.iter_mut().zip(&wrow) {
                                a[0] = codes16::<WIDE>(w[0], c, k);
                                a[1] = codes16::<WIDE>(w[1], c, k);
                            }
                        }
                    }
                    for (u, a) in a.iter().enumerate() {
                        // Warp-uniform: i0 and u are the same for every lane.
                        if i0 + QG_WARPS * u < halves {
                            let c = (i0 + QG_WARPS * u) * QG_HALF + 16 * q;
                            let b = if mine { quant16(x, c, k, (s, inv)) } else { [0; 4] };
                            for h in 0..2 {
                                for (acc, a) in acc.iter_mut().zip(a) {
                                    let a = [a[0][2 * h], a[1][2 * h], a[0][2 * h + 1], a[1][2 * h + 1]];
                                    mma_e4m3(acc, a, [b[2 * h], b[2 * h + 1]]);
                                }
                            }
                        }
                    }
                    i0 += QG_WARPS * QG_UNROLL;
                }
                for (m, acc) in acc.iter().enumerate() {
                    for (e, &v) in acc.iter().enumerate() {
                        st(red, warp * RED + (m * 4 + e) * 32 + lane, v);
                    }
                }
                sync_threads();
                // The first RED threads finish a sum each (a loop should RED outgrow the
                // block): slot v is tile v / 128, element (v / 32) % 4 of lane v % 32.
                let mut v = tid;
                while v < RED {
                    let (m, e, l) = (v / 128, (v / 32) % 4, (v % 32) as u32);
                    let (row, t) = (16 * m + acc_row(l, e as u32) as usize, acc_col(l, e as u32) as usize);
                    if row < r.valid && t < toks {
                        let mut sum = 0.0f32;
                        for w in 0..QG_WARPS {
                            sum += ld(red, w * RED + v);
                        }
                        let y = relu2_if(sum * w_scale * ld(scales, t), o.relu2 != 0);
                        st(o.out, (j0 + t) * n + row0 + row, f32_to_bf16(y));
                    }
                    v += QG_BLOCK as usize;
                }
                sync_threads();
                j0 += QG_TOKENS;
            }
        }
    }

    /// Bytes `c..c + 16` of the weight row at `w` (k bytes), zero past k: one 16-byte load
    /// past L1 where `WIDE` (the row start 16-byte aligned), else two 8-byte loads.
    ///
    /// # Safety
    /// The row readable for k bytes, k a multiple of 8, the row start 8-byte aligned (16 where
    /// `WIDE`).
    #[inline(always)]
    unsafe fn codes16<const WIDE: bool>(w: *const u8, c: usize, k: usize) -> [u32; 4] {
        let p = w.wrapping_add(c);
        // SAFETY: each load lies within the row (checked against k) and is aligned to its size.
        unsafe {
            if c + 16 <= k {
                if WIDE {
                    load8_stream_whole(p as *const u16)
                } else {
                    let (lo, hi) = (load4_raw_whole(p as *const u16), load4_raw_whole(p.wrapping_add(8) as *const u16));
                    [lo[0], lo[1], hi[0], hi[1]]
                }
            } else if c + 8 <= k {
                let lo = load4_raw_whole(p as *const u16);
                [lo[0], lo[1], 0, 0]
            } else {
                [0; 4]
            }
        }
    }

    /// Elements `c..c + 16` of the bf16 row at `x` (k of them, zero past k) as e4m3 codes of
    /// `x / s` (`(s, 1 / s)`), four a word, the lower k in the lower byte.
    ///
    /// # Safety
    /// The row readable for k elements.
    #[inline(always)]
    unsafe fn quant16(x: *const u16, c: usize, k: usize, (s, inv): (f32, f32)) -> [u32; 4] {
        // SAFETY: forwarded (load8_bf16 reads only below k).
        let v = unsafe { [load8_bf16(x, c, k), load8_bf16(x, c + 8, k)] };
        let code = |i: usize| {
            let e = |j: usize| div_rn_by(v[j / 8][j % 8], s, inv);
            u32::from(f32x2_to_e4m3(e(i + 1), e(i)))
        };
        [0, 1, 2, 3].map(|w| code(4 * w) | code(4 * w + 2) << 16)
    }

    /// An FP8 linear layer of 2 to a few rows (W8A8) on tensor cores, [`DenseParams`]: `out[j]
    /// = f(x[j] W^T)` for rows `0..rows`, e4m3 weights with their scale, inputs quantized with
    /// the static input scale or per row (module doc). Grid `(ceil(n / QG_ROWS), 1)`, block
    /// [`QG_BLOCK`]; it waits on the kernel before first.
    #[unsafe(no_mangle)]
    pub unsafe extern "ptx-kernel" fn gemv_tc_fp8(p: DenseParams) {
        grid_dependency_wait();
        let (n, k) = (p.o.n as usize, p.o.k as usize);
        let row0 = block_x() as usize * QG_ROWS as usize;
        if row0 >= n {
            return;
        }
        let r = Fp8Rows { w: p.o.w.wrapping_add(row0 * k), stride: k, valid: (n - row0).min(QG_ROWS as usize), e: 0 };
        // SAFETY: launch contract checked by host/src/gemv.rs: x holds rows * k, w n * k (the
        // scales one value each), out rows * n, k a multiple of 8; the whole block got here.
        unsafe { fp8_tiles(&p.o, &r, row0, (0, p.rows as usize), |j| j) }
    }
}
