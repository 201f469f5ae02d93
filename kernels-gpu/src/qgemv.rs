//! Quantized linear layers of a few rows on tensor cores, eight rows of x a product (the `mma`'s
//! n), so that one pass over the weights serves up to eight rows at about the cost of one (the
//! warp mode of kernels-gpu/src/gemv.rs streams the weights once per row; host/src/gemv.rs says
//! where each is the faster). Two weight formats ([`TcWeights`]):
//! - FP8 e4m3 (W8A8, docs/MATH.md section 7): `mma.sync` m16n8k32 straight from the loaded
//!   codes, the inputs quantized to e4m3 as their products come;
//! - NVFP4 (weight-only, [`crate::nvfp4`]'s layout): `mma.sync` m16n8k16 on bf16, each weight
//!   made a bf16 from its e2m1 code by moving bits and one multiplication by its block scale
//!   (exact: [`fp4_pairs`]), the inputs as they are.
//!
//! The dense kernels `gemv_tc_fp8` and `gemv_tc_nvfp4` ([`DenseParams`](crate::gemv::DenseParams))
//! and MoE's `moe_expert_tc_fp8` and `moe_expert_tc_nvfp4` (kernels-gpu/src/moe.rs, an expert
//! per block row) share [`tc_tiles`].
//!
//! # Layout of the work
//! A block ([`QG_BLOCK`] threads, [`QG_WARPS`] warps) owns [`QG_ROWS`] weight rows, one 16-row
//! `mma` tile ([`QG_TILES`]) each warp; its warps split k: k runs in *half steps* of
//! [`QG_HALF`] code bytes of a row (64 elements of FP8, 128 of NVFP4), half step `i` to warp
//! `i % QG_WARPS`, [`QG_UNROLL`] of them in flight per warp (a round). A pass over the weights
//! serves up to [`QG_TOKENS`] rows of x; FP8 quantizes each to e4m3 as its products come, with
//! the matrix's static input scale or, without one, its own (docs/MATH.md section 4: the warps
//! find the rows' amax first). The partial sums meet in shared memory at the end, added in warp
//! order (deterministic), and are scaled by the matrix's scale (and FP8's input scale).
//!
//! In a half step, lane `(g, q) = (lane / 4, lane % 4)` loads code bytes `16q..16q + 16` of
//! weight rows `g, g + 8` of each tile (one 16-byte load each: a row's 64 bytes in four lanes;
//! NVFP4 also their two block scales) and the same elements of x row g. FP8: word `2s` of those
//! 16 bytes is its `a[0]` (row g) / `a[1]` (row g + 8) of the half step's product s, word
//! `2s + 1` its `a[2]` / `a[3]`, and the quantized input words likewise its `b[0]`, `b[1]`
//! (kernels-gpu/src/mma.rs gives the fragments). NVFP4: each word of 8 codes gives two
//! products, its elements paired `(i, i + 4)` ([`fp4_pairs`]) and the inputs paired alike. The
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
/// Code bytes of each weight row per half step (FP8: two `m16n8k32` products; NVFP4: eight
/// `m16n8k16` ones).
pub const QG_HALF: usize = 64;
/// Half steps in flight per warp (a round): with [`QG_WARPS`] over k, 1536 bytes of a row a
/// round trip. Three, not six (a row of 3072 bytes a round): 80 registers and three blocks an
/// SM rather than 125 and two; on an H100 the dense FP8 projections at 8 rows took 3-6% less
/// time and FP8 decode batch 8 1.5-2.7% less (docs/PERFORMANCE.md).
pub const QG_UNROLL: usize = 3;

#[cfg(target_arch = "nvptx64")]
pub(crate) use device::*;

#[cfg(target_arch = "nvptx64")]
mod device {
    use core::arch::asm;

    use super::*;
    use crate::device::*;
    use crate::gemv::{DenseParams, Operands, warp_token_scale};
    use crate::mma::{acc_col, acc_row, mma, mma_e4m3};

    /// A weight format of the tensor-core mat-vec: what a lane loads of a weight row in a half
    /// step and how its products with the inputs are made.
    pub trait TcWeights {
        /// A lane's load of one weight row in a half step.
        type Half: Copy;
        const ZERO: Self::Half;
        /// Elements of a row per code byte.
        const PER_BYTE: usize;
        /// Whether the inputs are quantized (FP8, with a scale per row of x; the sums then
        /// multiplied by it).
        const QUANTIZED: bool;
        /// Bytes that `elems` weights take, whole rows of `k` (`elems` a multiple of k).
        fn bytes(elems: usize, k: usize) -> usize;
        /// What the sums are multiplied by, besides the matrix's weight scale.
        const SUM_SCALE: f32;
        /// Code bytes `c..c + 16` of the row at `w` (`k` elements), zero past k: 16-byte loads
        /// where `WIDE`.
        ///
        /// # Safety
        /// The row readable as its format lays it out, its start 8-byte aligned (16 where
        /// `WIDE`).
        unsafe fn load<const WIDE: bool>(w: *const u8, c: usize, k: usize) -> Self::Half;
        /// `acc[m] += w[m] . x` for this lane's share of the half step at code byte `c` of each
        /// tile m (rows g and g + 8 in `w[m]`; `at` is `(c, k)`), x the lane's input row
        /// (`None`: zeros) of k elements, `s` its `(scale, 1 / scale)` where quantized.
        ///
        /// # Safety
        /// x readable for k elements.
        unsafe fn products(
            acc: &mut [[f32; 4]; QG_TILES],
            w: &[[Self::Half; 2]; QG_TILES],
            x: Option<*const u16>,
            at: (usize, usize),
            s: (f32, f32),
        );
    }

    /// FP8 e4m3 weights, W8A8.
    pub struct Fp8;

    impl TcWeights for Fp8 {
        type Half = [u32; 4];
        const ZERO: [u32; 4] = [0; 4];
        const PER_BYTE: usize = 1;
        const QUANTIZED: bool = true;
        const SUM_SCALE: f32 = 1.0;
        #[inline(always)]
        fn bytes(elems: usize, _: usize) -> usize {
            elems
        }
        #[inline(always)]
        unsafe fn load<const WIDE: bool>(w: *const u8, c: usize, k: usize) -> [u32; 4] {
            // SAFETY: forwarded (k code bytes).
            unsafe { codes16::<WIDE>(w, c, k) }
        }
        #[inline(always)]
        unsafe fn products(
            acc: &mut [[f32; 4]; QG_TILES],
            w: &[[[u32; 4]; 2]; QG_TILES],
            x: Option<*const u16>,
            (c, k): (usize, usize),
            s: (f32, f32),
        ) {
            // SAFETY: forwarded.
            let b = match x {
                Some(x) => unsafe { quant16(x, c, k, s) },
                None => [0; 4],
            };
            for h in 0..2 {
                for (acc, w) in acc.iter_mut().zip(w) {
                    let a = [w[0][2 * h], w[1][2 * h], w[0][2 * h + 1], w[1][2 * h + 1]];
                    mma_e4m3(acc, a, [b[2 * h], b[2 * h + 1]]);
                }
            }
        }
    }

    /// NVFP4 weights, weight-only: 32 e2m1 codes of a row (element `8j + i` in bits `4i..4i +
    /// 4` of word j) and the e4m3 scales of their two blocks (the first in the low byte).
    #[derive(Clone, Copy)]
    pub struct Fp4Half {
        codes: [u32; 4],
        scales: u16,
    }

    /// NVFP4 weights ([`crate::nvfp4`]'s layout), weight-only.
    pub struct Nvfp4;

    /// 2^117: what the block scales are multiplied by in [`fp4_pairs`] (a scale of at most 448
    /// stays below bf16's largest power of two, 2^127), and 2^9 its complement in the sums:
    /// 2^117 times the codes' 2^-126.
    const FP4_SCALE_UP: f32 = f32::from_bits((127 + 117) << 23);
    pub const FP4_SUM_SCALE: f32 = 512.0;

    impl TcWeights for Nvfp4 {
        type Half = Fp4Half;
        const ZERO: Fp4Half = Fp4Half { codes: [0; 4], scales: 0 };
        const PER_BYTE: usize = 2;
        const QUANTIZED: bool = false;
        const SUM_SCALE: f32 = FP4_SUM_SCALE;
        #[inline(always)]
        fn bytes(elems: usize, k: usize) -> usize {
            elems / k * crate::nvfp4::row_bytes(k)
        }
        #[inline(always)]
        unsafe fn load<const WIDE: bool>(w: *const u8, c: usize, k: usize) -> Fp4Half {
            let (bytes, at) = (k / 2, k / 2 + c / 8);
            // SAFETY: forwarded (the row's k / 2 code bytes, a multiple of 8, then its k / 16
            // scales; a scale pair at an even offset from an 8-byte aligned row start).
            unsafe {
                let codes = codes16::<WIDE>(w, c, bytes);
                let scales = if c + 16 <= bytes {
                    ld(w.wrapping_add(at) as *const u16, 0)
                } else if c + 8 <= bytes {
                    u16::from(ld(w, at))
                } else {
                    0
                };
                Fp4Half { codes, scales }
            }
        }
        #[inline(always)]
        unsafe fn products(
            acc: &mut [[f32; 4]; QG_TILES],
            w: &[[Fp4Half; 2]; QG_TILES],
            x: Option<*const u16>,
            (c, k): (usize, usize),
            _: (f32, f32),
        ) {
            let s = w.map(|w| [fp4_scales(w[0].scales), fp4_scales(w[1].scales)]);
            for j in 0..4 {
                // Elements 2c + 8j..2c + 8j + 8 of x, as pairs (i, i + 4).
                let xp = match x {
                    // SAFETY: forwarded (load8_raw reads only below k).
                    Some(x) => {
                        let v = unsafe { load8_raw(x, 2 * c + 8 * j, k) };
                        [
                            prmt(v[0], v[2], 0x5410),
                            prmt(v[0], v[2], 0x7632),
                            prmt(v[1], v[3], 0x5410),
                            prmt(v[1], v[3], 0x7632),
                        ]
                    }
                    None => [0; 4],
                };
                for ((acc, w), s) in acc.iter_mut().zip(w).zip(&s) {
                    let lo = fp4_pairs(w[0].codes[j], s[0][j / 2]);
                    let hi = fp4_pairs(w[1].codes[j], s[1][j / 2]);
                    mma(acc, [lo[0], hi[0], lo[1], hi[1]], [xp[0], xp[1]]);
                    mma(acc, [lo[2], hi[2], lo[3], hi[3]], [xp[2], xp[3]]);
                }
            }
        }
    }

    /// Bytes of `a` and `b` (`b`'s are 4..8) picked by the four selector nibbles of `sel`.
    #[inline(always)]
    fn prmt(a: u32, b: u32, sel: u32) -> u32 {
        let r: u32;
        // SAFETY: a register-to-register byte permutation.
        unsafe {
            asm!("prmt.b32 {r}, {a}, {b}, {s};", r = out(reg32) r, a = in(reg32) a, b = in(reg32) b, s = in(reg32) sel,
                 options(pure, nomem, nostack))
        };
        r
    }

    /// The two e4m3 block scales of `pair` (the first in the low byte) times 2^117 as bf16
    /// pairs of one value each (exact: an e4m3 value has four significant bits).
    #[inline(always)]
    fn fp4_scales(pair: u16) -> [u32; 2] {
        let (a, b) = e4m3x2_to_f32(pair);
        [f32x2_to_bf16x2(a * FP4_SCALE_UP, a * FP4_SCALE_UP), f32x2_to_bf16x2(b * FP4_SCALE_UP, b * FP4_SCALE_UP)]
    }

    /// Eight e2m1 codes (code i in bits `4i..4i + 4`) times their block scale as four bf16
    /// pairs, codes `(i, i + 4)` pair i, each value times 2^-9, exactly: a code's sign to bit 15
    /// and its other three bits to bits 6..9 make a bf16 of exponent field e and mantissa m << 6,
    /// `(1 + m / 2) 2^(e - 127)` and for e = 0 the subnormal `m / 2 * 2^-126`: the e2m1 value
    /// times 2^-126 either way; multiplied by `scale` (the block scale times 2^117, both halves)
    /// the product has at most 6 significant bits and lies within 2^-19..6 * 448 * 2^-9, so bf16
    /// holds it and the rounding of `mul.rn.bf16x2` changes nothing.
    #[inline(always)]
    pub fn fp4_pairs(codes: u32, scale: u32) -> [u32; 4] {
        let mut out = [0u32; 4];
        for (i, o) in out.iter_mut().enumerate() {
            // Code i's bits 0..3 to 6..9 and bit 3 to 15 (and code i + 4's 16 bits higher).
            let mag = if i < 2 { codes << (6 - 4 * i) } else { codes >> (4 * i - 6) };
            let bits = (mag & 0x01c0_01c0) | ((codes << (12 - 4 * i)) & 0x8000_8000);
            // SAFETY: a register-to-register product (sm_90+).
            unsafe {
                asm!("mul.rn.bf16x2 {r}, {a}, {b};", r = out(reg32) *o, a = in(reg32) bits, b = in(reg32) scale,
                     options(pure, nomem, nostack))
            };
        }
        out
    }

    /// [`fp4_pairs`] of eight codes in order: pair i codes `(2i, 2i + 1)`, the four words eight
    /// consecutive weights of a row as bf16 (times 2^-9, exactly). The codes' nibbles are first
    /// put in the order `0 2 4 6 1 3 5 7` (the middle two of each half swapped, then the middle
    /// two bytes), which pairs `(i, i + 4)` take in order.
    #[inline(always)]
    fn fp4_in_order(codes: u32, scale: u32) -> [u32; 4] {
        let t = (codes ^ (codes >> 4)) & 0x00f0_00f0;
        fp4_pairs(prmt(codes ^ t ^ (t << 4), 0, 0x3120), scale)
    }

    /// 32 consecutive weights of a row, their 16 code bytes as four words and the e4m3 scales of
    /// their two blocks (the first in the low byte), as four chunks of 8 bf16 in order
    /// ([`fp4_in_order`]: each value times 2^-9, exactly): the B tiles the NVFP4 grouped GEMMs
    /// make in shared memory.
    #[inline(always)]
    pub fn fp4_chunks(codes: [u32; 4], scales: u16) -> [[u32; 4]; 4] {
        let s = fp4_scales(scales);
        core::array::from_fn(|q| fp4_in_order(codes[q], s[q / 2]))
    }

    /// A block's weight rows of one matrix: the first at `w`, each next `stride` bytes on,
    /// `valid` of them within n (the rest of the block's [`QG_ROWS`] are not computed), of
    /// matrix `e` (its scales).
    pub struct TcRows {
        pub w: *const u8,
        pub stride: usize,
        pub valid: usize,
        pub e: usize,
    }

    /// A block's share of a launch: `out[j, row0 + r] = f(x[x_row(j)] W_r^T)` for the block's
    /// rows `r` of `w` (format `F`) and rows `lo..hi` of out, [`QG_TOKENS`] of them a pass; `o`
    /// gives x, out, n, k, the scales and f (module doc).
    ///
    /// # Safety
    /// k a multiple of 8 (NVFP4: of 16), the rows of `w` (`valid` >= 1 of them) readable as
    /// `F` lays out k elements, the scales of matrix e readable, `x_row` rows of x for rows
    /// `lo..hi` of out, which holds them; the whole block calls it (barriers inside). Each
    /// output element is written by the one thread owning it.
    #[inline(always)]
    pub unsafe fn tc_tiles<F: TcWeights>(
        o: &Operands,
        r: &TcRows,
        row0: usize,
        (lo, hi): (usize, usize),
        x_row: impl Fn(usize) -> usize,
    ) {
        // SAFETY: forwarded; the wide loads only where every row start is 16-byte aligned.
        unsafe {
            if (r.w as usize).is_multiple_of(16) && r.stride.is_multiple_of(16) {
                tiles::<F, true>(o, r, row0, (lo, hi), &x_row)
            } else {
                tiles::<F, false>(o, r, row0, (lo, hi), &x_row)
            }
        }
    }

    /// [`tc_tiles`], its weights loaded 16 bytes at a time where `WIDE`, else 8.
    ///
    /// # Safety
    /// As [`tc_tiles`]; `WIDE` only with every row start 16-byte aligned.
    #[inline(always)]
    unsafe fn tiles<F: TcWeights, const WIDE: bool>(
        o: &Operands,
        r: &TcRows,
        row0: usize,
        (lo, hi): (usize, usize),
        x_row: &impl Fn(usize) -> usize,
    ) {
        const RED: usize = QG_TILES * 4 * 32;
        let (n, k) = (o.n as usize, o.k as usize);
        let (lane, warp, tid) = (lane_id() as usize, warp_id() as usize, thread_x() as usize);
        let (g, q) = (lane / 4, lane % 4);
        let halves = (k / F::PER_BYTE).div_ceil(QG_HALF);
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
            let w_scale = ld(o.w_scale, r.e) * F::SUM_SCALE;
            let mut j0 = lo;
            while j0 < hi {
                let toks = (hi - j0).min(QG_TOKENS);
                let xr = |t: usize| o.x.wrapping_add(x_row(j0 + t) * k);
                if !F::QUANTIZED {
                    if tid < toks {
                        st(scales, tid, 1.0);
                    }
                } else if o.in_scale.is_null() {
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
                // This lane's input row (the products' column g), none where there is none.
                let x = if g < toks { Some(xr(g)) } else { None };
                let s = if g < toks { ld(scales, g) } else { 1.0 };
                let inv = 1.0 / s;
                let mut acc = [[0.0f32; 4]; QG_TILES];
                let mut i0 = warp;
                while i0 < halves {
                    // Every weight load of the round first, then each half step's products.
                    let mut a = [[[F::ZERO; 2]; QG_TILES]; QG_UNROLL];
                    for (u, a) in a.iter_mut().enumerate() {
                        let c = (i0 + QG_WARPS * u) * QG_HALF + 16 * q;
                        if i0 + QG_WARPS * u < halves {
                            for (a, w) in a.iter_mut().zip(&wrow) {
                                a[0] = F::load::<WIDE>(w[0], c, k);
                                a[1] = F::load::<WIDE>(w[1], c, k);
                            }
                        }
                    }
                    for (u, a) in a.iter().enumerate() {
                        // Warp-uniform: i0 and u are the same for every lane.
                        if i0 + QG_WARPS * u < halves {
                            let c = (i0 + QG_WARPS * u) * QG_HALF + 16 * q;
                            F::products(&mut acc, a, x, (c, k), (s, inv));
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

    /// Bytes `c..c + 16` of the row at `w` (`k` bytes, a multiple of 8), zero past k: one
    /// 16-byte load past L1 where `WIDE` (the row start 16-byte aligned), else two 8-byte loads.
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

    /// The body of the dense tensor-core kernels: one matrix of format `F`, row j of x for row
    /// j of out, block x's rows `block_x * QG_ROWS..`.
    ///
    /// # Safety
    /// The launch contract of the kernels below (checked by host/src/gemv.rs); the whole block
    /// calls it.
    #[inline(always)]
    unsafe fn dense_tiles<F: TcWeights>(p: &DenseParams) {
        grid_dependency_wait();
        let (n, k) = (p.o.n as usize, p.o.k as usize);
        let row0 = block_x() as usize * QG_ROWS as usize;
        if row0 >= n {
            return;
        }
        let (at, stride) = (F::bytes(row0 * k, k), F::bytes(k, k));
        let r = TcRows { w: p.o.w.wrapping_add(at), stride, valid: (n - row0).min(QG_ROWS as usize), e: 0 };
        // SAFETY: forwarded; the whole block got here.
        unsafe { tc_tiles::<F>(&p.o, &r, row0, (0, p.rows as usize), |j| j) }
    }

    /// An FP8 linear layer of 2 to a few rows (W8A8) on tensor cores, [`DenseParams`]: `out[j]
    /// = f(x[j] W^T)` for rows `0..rows`, e4m3 weights with their scale, inputs quantized with
    /// the static input scale or per row (module doc). Grid `(ceil(n / QG_ROWS), 1)`, block
    /// [`QG_BLOCK`]; it waits on the kernel before first.
    #[unsafe(no_mangle)]
    pub unsafe extern "ptx-kernel" fn gemv_tc_fp8(p: DenseParams) {
        // SAFETY: launch contract checked by host/src/gemv.rs: x holds rows * k, w n * k (the
        // scales one value each), out rows * n, k a multiple of 8.
        unsafe { dense_tiles::<Fp8>(&p) }
    }

    /// An NVFP4 linear layer of a few rows on tensor cores, weight-only, [`DenseParams`]: as
    /// [`gemv_tc_fp8`], the weights NVFP4 rows ([`crate::nvfp4`]) with their per-tensor scale
    /// (`w_scale`), the inputs as they are.
    #[unsafe(no_mangle)]
    pub unsafe extern "ptx-kernel" fn gemv_tc_nvfp4(p: DenseParams) {
        // SAFETY: launch contract checked by host/src/gemv.rs: x holds rows * k, w n NVFP4
        // rows of k (a multiple of 16), the scale one value, out rows * n.
        unsafe { dense_tiles::<Nvfp4>(&p) }
    }
}
