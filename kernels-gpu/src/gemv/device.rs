//! The device code of the mat-vec family (nvptx64 only): its kernels and their helpers.
//! Launch parameters, sizes and the math the host shares are in `../gemv.rs`.

use super::*;
use crate::device::*;

/// A chunk of 8 weights of one row, as loaded: bf16 pairs, e4m3 codes, or e2m1 codes with
/// their block's scale.
pub trait Chunk: Copy {
    const ZERO: Self;
    /// Bytes of a chunk's weights: the alignment [`Chunk::load_whole`] needs.
    const BYTES: usize;
    /// Whether each matrix has a weight scale ([`Operands::w_scale`]) that the sums are
    /// multiplied by: FP8's, NVFP4's per-tensor one.
    const MATRIX_SCALE: bool = false;
    /// Bytes that `elems` weights take, whole rows of `k` (`elems` a multiple of k; NVFP4:
    /// a row its codes, block scales and padding, [`crate::nvfp4::row_bytes`]).
    fn bytes(elems: usize, k: usize) -> usize;
    /// Elements `c..c + 8` of the row at `w` (`k` elements; zero past k).
    unsafe fn load(w: *const u8, c: usize, k: usize) -> Self;
    /// Elements `c..c + 8` of the row at `w` (`k` elements), all within it and aligned to
    /// [`Chunk::BYTES`]: one load of the weights (NVFP4: and one of their scale), no checks.
    unsafe fn load_whole(w: *const u8, c: usize, k: usize) -> Self;
    /// The weights as f32 (bf16 values, e4m3 code values, or e2m1 values times 2^-14),
    /// before [`Chunk::scale`].
    fn values(self) -> [f32; 8];
    /// What the chunk's dot product with the input is multiplied by before it is added to
    /// the sum (NVFP4: its block scale times 2^14), where [`Chunk::SCALED`].
    #[inline(always)]
    fn scale(self) -> f32 {
        1.0
    }
    /// Whether [`Chunk::scale`] applies: each chunk's products summed apart, then scaled
    /// and added (else every product goes into the sum itself).
    const SCALED: bool = false;
}

/// Eight bf16 weights that the launch reads once (one row: each weight row streamed by
/// one warp or block), loaded past L1 (see [`load8_stream`]). Where rows share weights
/// (a dispatch's rows of one expert), `[u32; 4]` keeps them in L1.
#[derive(Clone, Copy)]
pub struct Streamed([u32; 4]);

impl Chunk for Streamed {
    const ZERO: Self = Streamed([0; 4]);
    const BYTES: usize = 16;
    #[inline(always)]
    fn bytes(elems: usize, _: usize) -> usize {
        2 * elems
    }
    #[inline(always)]
    unsafe fn load(w: *const u8, c: usize, k: usize) -> Self {
        // SAFETY: forwarded (w holds k bf16, weights: unchanged while the kernel runs).
        Streamed(unsafe { load8_stream(w as *const u16, c, k) })
    }
    #[inline(always)]
    unsafe fn load_whole(w: *const u8, c: usize, _: usize) -> Self {
        // SAFETY: forwarded (the chunk within the row and aligned, weights unchanged).
        Streamed(unsafe { load8_stream_whole((w as *const u16).wrapping_add(c)) })
    }
    #[inline(always)]
    fn values(self) -> [f32; 8] {
        self.0.values()
    }
}

impl Chunk for [u32; 4] {
    const ZERO: Self = [0; 4];
    const BYTES: usize = 16;
    #[inline(always)]
    fn bytes(elems: usize, _: usize) -> usize {
        2 * elems
    }
    #[inline(always)]
    unsafe fn load(w: *const u8, c: usize, k: usize) -> Self {
        // SAFETY: forwarded (w holds k bf16).
        unsafe { load8_raw(w as *const u16, c, k) }
    }
    #[inline(always)]
    unsafe fn load_whole(w: *const u8, c: usize, _: usize) -> Self {
        // SAFETY: forwarded (the chunk within the row and aligned).
        unsafe { load8_raw_whole((w as *const u16).wrapping_add(c)) }
    }
    #[inline(always)]
    fn values(self) -> [f32; 8] {
        raw8_values(self)
    }
}

impl Chunk for u64 {
    const ZERO: Self = 0;
    const BYTES: usize = 8;
    const MATRIX_SCALE: bool = true;
    #[inline(always)]
    fn bytes(elems: usize, _: usize) -> usize {
        elems
    }
    #[inline(always)]
    unsafe fn load_whole(w: *const u8, c: usize, _: usize) -> Self {
        // SAFETY: forwarded (the chunk within the row and 8-byte aligned).
        unsafe { *(w.wrapping_add(c) as *const u64) }
    }
    #[inline(always)]
    unsafe fn load(w: *const u8, c: usize, k: usize) -> Self {
        // SAFETY: forwarded (w holds k codes); 8-byte loads when whole and aligned.
        unsafe {
            if c + 8 <= k && (w.wrapping_add(c) as usize).is_multiple_of(8) {
                Self::load_whole(w, c, k)
            } else {
                let mut v = 0u64;
                for i in 0..8 {
                    if c + i < k {
                        v |= u64::from(ld(w, c + i)) << (8 * i);
                    }
                }
                v
            }
        }
    }
    #[inline(always)]
    fn values(self) -> [f32; 8] {
        let mut v = [0.0; 8];
        for i in 0..4 {
            (v[2 * i], v[2 * i + 1]) = e4m3x2_to_f32((self >> (16 * i)) as u16);
        }
        v
    }
}

/// Eight NVFP4 weights (docs/MATH.md, "Checkpoint formats") of a row laid out as
/// [`crate::nvfp4`] says (the row's codes, then its block scales): the 8 e2m1 codes
/// (element `c + i` in bits `4i..4i + 4`) and their block's e4m3 scale. Loaded past L1: a
/// launch reads each weight once per row of x, as [`Streamed`].
#[derive(Clone, Copy)]
pub struct Fp4 {
    codes: u32,
    scale: u16,
}

impl Chunk for Fp4 {
    const ZERO: Self = Fp4 { codes: 0, scale: 0 };
    const BYTES: usize = 4;
    const MATRIX_SCALE: bool = true;
    const SCALED: bool = true;
    #[inline(always)]
    fn bytes(elems: usize, k: usize) -> usize {
        elems / k * crate::nvfp4::row_bytes(k)
    }
    #[inline(always)]
    unsafe fn load(w: *const u8, c: usize, k: usize) -> Self {
        // k is a multiple of 16 and c of 8: a chunk lies wholly within k or wholly past it.
        if c >= k {
            return Self::ZERO;
        }
        // SAFETY: forwarded (w holds the row's k / 2 code bytes, then its scales).
        unsafe {
            let mut codes = 0u32;
            for i in 0..4 {
                codes |= u32::from(ld(w, c / 2 + i)) << (8 * i);
            }
            Fp4 { codes, scale: u16::from(ld(w, k / 2 + c / crate::nvfp4::BLOCK)) }
        }
    }
    #[inline(always)]
    unsafe fn load_whole(w: *const u8, c: usize, k: usize) -> Self {
        // SAFETY: forwarded (the chunk's 4 code bytes within the row and 4-byte aligned,
        // its scale after the row's codes).
        unsafe {
            Fp4 {
                codes: load4_stream_whole(w.wrapping_add(c / 2)),
                scale: u16::from(ld(w, k / 2 + c / crate::nvfp4::BLOCK)),
            }
        }
    }
    #[inline(always)]
    fn values(self) -> [f32; 8] {
        e2m1x8_to_f32(self.codes)
    }
    #[inline(always)]
    fn scale(self) -> f32 {
        e4m3x2_to_f32(self.scale).0 * 16384.0
    }
}

/// This lane's share of the dot products of `rows` (<= R) weight rows (`w` the first,
/// `stride` bytes apart, `k` elements each) with `toks` (<= T) inputs `xs` (`k`
/// bf16 each), thread `me` of `threads` sharing them: threads over chunks of 8, U chunks of
/// each row in flight, f32 sums (a fused multiply-add per product); the sum over the
/// threads (in any fixed order) is the product. FP8 (`fp8`): each input chunk is first
/// quantized to e4m3 with its token's `(scale, 1 / scale)`. Where the rows and inputs are
/// aligned to whole chunks (k is a multiple of 8, so a chunk is wholly within k or wholly
/// past it), each chunk is one unchecked load or zero; otherwise the loads check each
/// element. Either way the same sums in the same order.
///
/// # Safety
/// The rows and inputs must be readable for `k` elements.
#[inline(always)]
pub unsafe fn partial_dots<W: Chunk, const R: usize, const T: usize, const U: usize, const EARLY: bool>(
    w: *const u8,
    stride: usize,
    rows: usize,
    (xs, toks, scale): (&[*const u16; T], usize, &[(f32, f32); T]),
    (k, fp8): (usize, bool),
    (me, threads): (usize, usize),
) -> [[f32; T]; R] {
    let step = threads * 8;
    let mut acc = [[0.0f32; T]; R];
    let mut c = me * 8;
    let aligned = (w as usize).is_multiple_of(W::BYTES)
        && stride.is_multiple_of(W::BYTES)
        && xs.iter().all(|&x| (x as usize).is_multiple_of(16));
    let d = Dots { w, stride, rows, xs, toks, scale, k, fp8, step };
    // SAFETY: unchecked chunk loads only where all is aligned, without a test only where
    // the pass lies within k (caller: the rows and inputs readable for k elements; with
    // `early`, nothing else read yet that the kernel before writes).
    unsafe {
        if EARLY {
            // The first pass on its own, waiting between its weights and its inputs (every
            // lane, its chunks past k or not).
            if aligned {
                d.pass::<W, R, U, CHUNKS, true>(c, &mut acc);
            } else {
                d.pass::<W, R, U, ELEMENTS, true>(c, &mut acc);
            }
            c += step * U;
        }
        if aligned {
            // Whole passes while every lane's chunks lie within k (in a warp's dot products,
            // threads == 32: the last lane's chunk is `31 - me` chunks past this one's; a
            // block's threads, the split kernel, test their own: its shapes split no warp,
            // and the test would cost it registers), then one checked pass while the first
            // thread's chunk (`me` chunks before this one's) does: the same for every lane,
            // so a warp does not split into a whole pass for some lanes and a checked one
            // for the others, each its own round trip.
            let last = if threads == 32 { (threads - 1 - me) * 8 } else { 0 };
            while c + last + (U - 1) * step < k {
                d.pass::<W, R, U, WHOLE, false>(c, &mut acc);
                c += step * U;
            }
            if c - me * 8 < k {
                d.pass::<W, R, U, CHUNKS, false>(c, &mut acc);
            }
        } else {
            while c < k {
                d.pass::<W, R, U, ELEMENTS, false>(c, &mut acc);
                c += step * U;
            }
        }
    }
    acc
}

/// How a pass of [`partial_dots`] loads: every chunk within k, aligned (one load each);
/// aligned, a chunk within k or past it (one load or zero); elements checked.
const WHOLE: u8 = 0;
const CHUNKS: u8 = 1;
const ELEMENTS: u8 = 2;

/// What one pass of [`partial_dots`] reads (`stride` in bytes).
struct Dots<'a, const T: usize> {
    w: *const u8,
    stride: usize,
    rows: usize,
    xs: &'a [*const u16; T],
    toks: usize,
    scale: &'a [(f32, f32); T],
    k: usize,
    fp8: bool,
    step: usize,
}

impl<const T: usize> Dots<'_, T> {
    /// Chunks `c, c + step, .. c + (U - 1) * step` of every row, each against its
    /// tokens' input chunk, added into `acc` in the order (token, chunk, row), chunks
    /// past k as zeros, loaded as `MODE` ([`WHOLE`], [`CHUNKS`] or [`ELEMENTS`]) says.
    /// `WAIT`: the weights' loads issued, the kernel waits on the one before, then reads
    /// the inputs.
    ///
    /// # Safety
    /// As [`partial_dots`]; `MODE` only as its constant says.
    #[inline(always)]
    unsafe fn pass<W: Chunk, const R: usize, const U: usize, const MODE: u8, const WAIT: bool>(
        &self,
        c: usize,
        acc: &mut [[f32; T]; R],
    ) {
        let (k, step) = (self.k, self.step);
        // Whether the chunk at `at` is one unchecked load (else zero, or, for ELEMENTS,
        // checked element by element).
        let whole = |at: usize| MODE == WHOLE || (MODE == CHUNKS && (at as u32) < k as u32);
        // SAFETY: forwarded from the caller.
        unsafe {
            let mut wv = [[W::ZERO; U]; R];
            for (r, wv) in wv.iter_mut().enumerate() {
                if r < self.rows {
                    let row = self.w.wrapping_add(r * self.stride);
                    for (u, v) in wv.iter_mut().enumerate() {
                        let at = c + u * step;
                        *v = match MODE {
                            ELEMENTS => W::load(row, at, k),
                            _ if whole(at) => W::load_whole(row, at, k),
                            _ => W::ZERO,
                        };
                    }
                }
            }
            if WAIT {
                grid_dependency_wait();
            }
            for (t, &x) in self.xs.iter().enumerate() {
                if t < self.toks {
                    for u in 0..U {
                        let at = c + u * step;
                        let mut xv = match MODE {
                            ELEMENTS => load8_bf16(x, at, k),
                            _ if whole(at) => raw8_values(load8_raw_whole(x.wrapping_add(at))),
                            _ => [0.0; 8],
                        };
                        if self.fp8 {
                            let (s, inv) = self.scale[t];
                            for i in 0..4 {
                                let q = f32x2_to_e4m3(div_rn_by(xv[2 * i + 1], s, inv), div_rn_by(xv[2 * i], s, inv));
                                (xv[2 * i], xv[2 * i + 1]) = e4m3x2_to_f32(q);
                            }
                        }
                        for (acc, wv) in acc.iter_mut().zip(&wv) {
                            let wf = wv[u].values();
                            if W::SCALED {
                                let mut dot = 0.0f32;
                                for i in 0..8 {
                                    dot = fma(wf[i], xv[i], dot);
                                }
                                acc[t] = fma(dot, wv[u].scale(), acc[t]);
                            } else {
                                for i in 0..8 {
                                    acc[t] = fma(wf[i], xv[i], acc[t]);
                                }
                            }
                        }
                    }
                }
            }
        }
    }
}

/// The per-token FP8 scale of the bf16 row at `x` (`k` elements, docs/MATH.md section 4),
/// found by a whole warp (every lane gets it).
///
/// # Safety
/// The row readable for k elements.
#[inline(always)]
pub unsafe fn warp_token_scale(x: *const u16, k: usize) -> f32 {
    let mut amax = 0.0f32;
    let mut c = lane_id() as usize * 8;
    while c < k {
        // SAFETY: forwarded (load8_bf16 reads only below k).
        amax = unsafe { load8_bf16(x, c, k) }.iter().fold(amax, |m, v| fmax(m, v.abs()));
        c += 256;
    }
    crate::quant::token_scale(warp_max(amax), f32::INFINITY)
}

/// The first weight row of this warp's in the warp mode: block x's rows are the
/// [`WARP_BLOCK_ROWS`] from `block_x * WARP_BLOCK_ROWS`, [`WARP_ROWS`] a warp.
#[inline(always)]
pub fn block_row0() -> usize {
    (block_x() * WARP_BLOCK_ROWS + warp_id() * WARP_ROWS) as usize
}

/// One warp's share of a launch of the warp mode: its weight rows `row0..` ([`WARP_ROWS`] at
/// most, none past n) of matrix `e`, the first `at` elements into `o.w` and each next one
/// `stride` elements on, for rows `lo..hi` of out, row j of x row `x_row(j)`; each weight
/// row streamed once per [`WARP_TOKENS`] rows (again from cache for the next). `fp8`: e4m3
/// weights, inputs quantized. The sums are scaled by matrix e's weight scale where `W` has
/// one ([`Chunk::MATRIX_SCALE`]). `EARLY`: the first weight loads issued before it waits on
/// the kernel before (see [`partial_dots`]).
///
/// # Safety
/// k a multiple of 8 (NVFP4: of 16), `at` and `stride` multiples of k (whole rows, whose
/// bytes [`Chunk::bytes`] gives); the weights (and the scales of matrix e, the pieces
/// of a matrix wherever they are) readable; `x_row` rows of x for rows `lo..hi`, which out holds. Each
/// output element is written by lane 0 of the one warp owning its weight row.
#[inline(always)]
pub unsafe fn warp_rows<W: Chunk, const EARLY: bool>(
    o: &Operands,
    fp8: bool,
    e: usize,
    row0: usize,
    (at, stride): (usize, usize),
    (lo, hi): (usize, usize),
    x_row: impl Fn(usize) -> usize,
) {
    if row0 >= o.n as usize {
        return;
    }
    // SAFETY: forwarded from the caller.
    unsafe {
        let w_scale = if W::MATRIX_SCALE { ld(o.w_scale, e) } else { 1.0 };
        let k = o.k as usize;
        let wr = WarpRows { w: o.w.wrapping_add(W::bytes(at, k)), stride: W::bytes(stride, k), row0, e, w_scale, fp8 };
        // EARLY: the first group apart (it waits on the kernel before once its weights
        // are loading), so its loads are not hoisted out of the loop of the others.
        let mut j0 = lo;
        if EARLY && j0 < hi {
            wr.group::<W, true>(o, j0, hi, &x_row);
            j0 += WARP_TOKENS;
        }
        while j0 < hi {
            wr.group::<W, false>(o, j0, hi, &x_row);
            j0 += WARP_TOKENS;
        }
    }
}

/// A warp's weight rows of [`warp_rows`]: the first (`w`, `stride` bytes apart), the
/// first's index, the matrix and its weight scale; inputs quantized (FP8) or not.
struct WarpRows {
    w: *const u8,
    stride: usize,
    row0: usize,
    e: usize,
    w_scale: f32,
    fp8: bool,
}

impl WarpRows {
    /// Rows `j0..min(j0 + WARP_TOKENS, hi)` of out.
    ///
    /// # Safety
    /// As [`warp_rows`].
    #[inline(always)]
    unsafe fn group<W: Chunk, const EARLY: bool>(
        &self,
        o: &Operands,
        j0: usize,
        hi: usize,
        x_row: &impl Fn(usize) -> usize,
    ) {
        const R: usize = WARP_ROWS as usize;
        const T: usize = WARP_TOKENS;
        let (n, k, fp8) = (o.n as usize, o.k as usize, self.fp8);
        let lane = lane_id() as usize;
        let rows = (n - self.row0).min(R);
        let toks = (hi - j0).min(T);
        // SAFETY: forwarded from the caller.
        unsafe {
            // Constant indices only (t, r < T, R), so the arrays stay in registers.
            let mut xs = [o.x; T];
            // FP8: each token's scale and its reciprocal.
            let mut scale = [(1.0f32, 1.0f32); T];
            for (t, x) in xs.iter_mut().enumerate() {
                if t < toks {
                    *x = o.x.wrapping_add(x_row(j0 + t) * k);
                    if fp8 {
                        let s = if o.in_scale.is_null() { warp_token_scale(*x, k) } else { ld(o.in_scale, self.e) };
                        scale[t] = (s, 1.0 / s);
                    }
                }
            }
            let acc = partial_dots::<W, R, T, WARP_UNROLL, EARLY>(
                self.w,
                self.stride,
                rows,
                (&xs, toks, &scale),
                (k, fp8),
                (lane, 32),
            );
            for (r, acc) in acc.iter().enumerate() {
                for (t, &v) in acc.iter().enumerate() {
                    if r < rows && t < toks {
                        let s = warp_sum(v) * self.w_scale * scale[t].0;
                        let y = relu2_if(s, o.relu2 != 0);
                        if lane == 0 {
                            st(o.out, (j0 + t) * n + self.row0 + r, f32_to_bf16(y));
                        }
                    }
                }
            }
        }
    }
}

/// A linear layer in the warp mode, bf16 weights, [`DenseParams`]. Grid `(ceil(n /
/// WARP_BLOCK_ROWS), 1)`, block [`WARP_BLOCK`]: each warp streams its [`WARP_ROWS`] weight
/// rows past L1 ([`Streamed`]) once per [`WARP_TOKENS`] rows (see [`warp_rows`]), the first
/// of its weight loads issued before it waits on the kernel before (which, running, may be
/// writing x).
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn gemv_bf16(p: DenseParams) {
    // SAFETY: launch contract checked by host/src/gemv.rs; it reads nothing of the kernel
    // before until it waits.
    unsafe { dense_rows::<Streamed, true>(&p, false) }
}

/// As [`gemv_bf16`], e4m3 weights (W8A8), each input chunk quantized to e4m3 with its
/// row's scale before the product; it waits on the kernel before first.
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn gemv_fp8(p: DenseParams) {
    grid_dependency_wait();
    // SAFETY: launch contract checked by host/src/gemv.rs.
    unsafe { dense_rows::<u64, false>(&p, true) }
}

/// As [`gemv_bf16`], NVFP4 weights ([`Fp4`]: e2m1 codes with their block scales, laid
/// out as [`crate::nvfp4`] says), weight-only: the inputs as they are, each chunk's dot
/// product scaled by its block scale, the sum by the matrix's per-tensor scale
/// (`w_scale`). Its first weights load before it waits, as there.
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn gemv_nvfp4(p: DenseParams) {
    // SAFETY: launch contract checked by host/src/gemv.rs (k a multiple of 16); it reads
    // nothing of the kernel before until it waits.
    unsafe { dense_rows::<Fp4, true>(&p, false) }
}

/// The body of the kernels of the warp mode: one matrix, row j of x for row j of out.
///
/// # Safety
/// x holds rows * k, w n * k (and the scales one value each), out rows * n; k a multiple
/// of 8.
#[inline(always)]
unsafe fn dense_rows<W: Chunk, const EARLY: bool>(p: &DenseParams, fp8: bool) {
    let (row0, k) = (block_row0(), p.o.k as usize);
    // SAFETY: forwarded from the caller.
    unsafe { warp_rows::<W, EARLY>(&p.o, fp8, 0, row0, (row0 * k, k), (0, p.rows as usize), |j| j) }
}

/// A bf16 linear layer in the split mode, [`SplitParams`]: for long rows, where one warp
/// per row needs many round trips. Grid `(ceil(n / SPLIT_ROWS), rows)`, block
/// [`SPLIT_BLOCK`]: block `(b, j)` computes outputs `b * SPLIT_ROWS..` of row j, its threads
/// over the chunks of k ([`SPLIT_UNROLL`] in flight per weight row), each warp's sums
/// through shared memory, added in warp order by one thread per output.
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn gemv_split_bf16(p: SplitParams) {
    const R: usize = SPLIT_ROWS as usize;
    const WARPS: usize = (SPLIT_BLOCK / 32) as usize;
    let (n, k) = (p.n as usize, p.k as usize);
    let (j, row0) = (block_y() as usize, block_x() as usize * R);
    let rows = (n - row0).min(R);
    let (warp, me) = (warp_id() as usize, thread_x() as usize);
    // SAFETY: launch contract checked by host/src/gemv.rs: x holds rows * k, w n * k, out
    // rows * n, k a multiple of 8. Shared memory: the per-warp sums, each written by lane 0
    // of its warp before the barrier; each output written by the one thread owning it.
    unsafe {
        let part = static_smem!("split_part", WARPS * R * 4);
        let x = [p.x.wrapping_add(j * k)];
        let w = p.w.wrapping_add(row0 * k * 2);
        let block = (me, SPLIT_BLOCK as usize);
        // It waits on the kernel before once its weights are loading (partial_dots).
        let one = [(1.0, 1.0)];
        let acc = partial_dots::<Streamed, R, 1, SPLIT_UNROLL, true>(w, 2 * k, rows, (&x, 1, &one), (k, false), block);
        for (r, a) in acc.iter().enumerate() {
            let v = warp_sum(a[0]);
            if lane_id() == 0 {
                st(part, warp * R + r, v);
            }
        }
        sync_threads();
        if me < rows {
            let mut sum = 0.0f32;
            for w in 0..WARPS {
                sum += ld(part, w * R + me);
            }
            st(p.out, j * n + row0 + me, f32_to_bf16(sum));
        }
    }
}
