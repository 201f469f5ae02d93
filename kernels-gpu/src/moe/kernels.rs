//! The device code of the MoE family (nvptx64 only): its kernels and their helpers.
//! Launch parameters, sizes and the math the host shares are in `../moe.rs`.

use super::*;
use crate::device::*;
use crate::gemv::{Chunk, Fp4, Streamed, WARP_UNROLL, block_row0, partial_dots, warp_rows, warp_token_scale};
use crate::qgemv::{Fp8, Nvfp4, QG_ROWS, TcRows, TcWeights, tc_tiles};
use crate::{EW_BLOCK, VEC, chunks};

/// Routing choices [`moe_combine_bf16`] loads at a time (a choice's 8 channels in 4 registers).
const COMBINE_GROUP: usize = 8;

/// Dispatch, [`DispatchParams`]. One block of [`DISPATCH_BLOCK`] threads, dynamic shared
/// memory [`DISPATCH_SMEM_BYTES`]: counts per expert (shared atomics), offsets and the
/// active list by one warp's prefix sum, then each entry takes the next row of its expert's
/// range. The order of the rows within an expert's range depends on atomic order; every
/// consumer computes each row on its own, so results do not.
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn moe_dispatch(p: DispatchParams) {
    grid_dependency_wait();
    use core::sync::atomic::{AtomicU32, Ordering::Relaxed};
    let (n, e) = (p.entries as usize, p.experts as usize);
    let tid = thread_x() as usize;
    let step = DISPATCH_BLOCK as usize;
    // SAFETY: launch contract checked by host/src/moe.rs (experts <= MAX_EXPERTS, array
    // extents); an expert id out of range traps before it indexes anything.
    unsafe {
        let count = dyn_smem_f32() as *mut u32;
        let cursor = count.wrapping_add(MAX_EXPERTS as usize);
        let mut i = tid;
        while i < e {
            st(count, i, 0);
            i += step;
        }
        sync_threads();
        each_entry(p.idx, n, (tid, step), |_, x| {
            if x < 0 || x as usize >= e {
                trap();
            }
            AtomicU32::from_ptr(count.wrapping_add(x as usize)).fetch_add(1, Relaxed);
        });
        sync_threads();
        if warp_id() == 0 {
            // Lane l owns experts 8l..8l+8. Counts are below 2^24, so the f32 prefix sums
            // are exact.
            let per = (MAX_EXPERTS / 32) as usize;
            let first = lane_id() as usize * per;
            let (mut rows, mut used) = (0u32, 0u32);
            for x in first..(first + per).min(e) {
                rows += ld(count, x);
                used += u32::from(ld(count, x) > 0);
            }
            let mut row = (warp_inclusive_sum(rows as f32) as u32) - rows;
            let mut a = (warp_inclusive_sum(used as f32) as u32) - used;
            for x in first..(first + per).min(e) {
                st(p.offsets, x, row);
                st(cursor, x, row);
                if ld(count, x) > 0 {
                    st(p.active, a as usize, x as u32);
                    a += 1;
                }
                row += ld(count, x);
            }
            if lane_id() == 31 {
                st(p.offsets, e, row);
                st(p.active_count, 0, a);
            }
        }
        sync_threads();
        each_entry(p.idx, n, (tid, step), |i, x| {
            let row = AtomicU32::from_ptr(cursor.wrapping_add(x as usize)).fetch_add(1, Relaxed);
            st(p.token, row as usize, (i / p.top_k as usize) as u32);
            st(p.slot, i, row as i32);
        });
    }
}

/// Entries [`each_entry`] loads at a time.
const DISPATCH_BATCH: usize = 8;

/// Calls `f(i, idx[i])` for this thread's entries `tid, tid + step, ...` below `n`, their ids
/// loaded [`DISPATCH_BATCH`] at a time before the calls: the calls' shared atomics would
/// otherwise order each load after the one before.
///
/// # Safety
/// `idx[..n]` readable.
#[inline(always)]
unsafe fn each_entry(idx: *const i32, n: usize, (tid, step): (usize, usize), mut f: impl FnMut(usize, i32)) {
    let mut i0 = tid;
    while i0 < n {
        let mut x = [0i32; DISPATCH_BATCH];
        for (u, xu) in x.iter_mut().enumerate() {
            let i = i0 + u * step;
            if i < n {
                // SAFETY: i < n (the caller's extent).
                *xu = unsafe { ld(idx, i) };
            }
        }
        for (u, xu) in x.iter().enumerate() {
            let i = i0 + u * step;
            if i < n {
                f(i, *xu);
            }
        }
        i0 += DISPATCH_BATCH * step;
    }
}

/// Where the weight rows `row0..` of expert `e` of an `[experts, n, k]` array start (in
/// elements) and the elements from one row to the next: experts `piece0..piece0 + pieces`
/// are the column blocks of one `[n, pieces * k]` matrix stored where expert `piece0`
/// would start (see [`ExpertParams::piece0`]).
#[inline(always)]
pub(crate) fn weight_rows(
    e: usize,
    row0: usize,
    (n, k): (usize, usize),
    (piece0, pieces): (usize, usize),
) -> (usize, usize) {
    if e >= piece0 && e < piece0 + pieces {
        ((piece0 * n + row0 * pieces) * k + (e - piece0) * k, pieces * k)
    } else {
        ((e * n + row0) * k, k)
    }
}

/// The expert and the grouped rows of block row `block_y` of an expert launch over a
/// dispatch (expert `active[block_y]`), none past the active count.
///
/// # Safety
/// offsets, active and active_count from the dispatch kernel over the launch's entries.
#[inline(always)]
unsafe fn active_expert(p: &ExpertParams) -> Option<(usize, (usize, usize))> {
    let a = block_y() as usize;
    // SAFETY: the caller's contract.
    unsafe {
        if a as u32 >= ld(p.active_count, 0) {
            return None;
        }
        let e = ld(p.active, a) as usize;
        Some((e, (ld(p.offsets, e) as usize, ld(p.offsets, e + 1) as usize)))
    }
}

/// Row of x of grouped row j of an expert launch over a dispatch.
///
/// # Safety
/// `x_row` null or holding the launch's entries.
#[inline(always)]
unsafe fn x_row(p: &ExpertParams, j: usize) -> usize {
    // SAFETY: the caller's contract.
    if p.x_row.is_null() { j } else { unsafe { ld(p.x_row, j) as usize } }
}

/// The body of both warp-mode expert kernels (see [`moe_expert_bf16`]); `W` the weight
/// chunk, `fp8` whether inputs are quantized.
#[inline(always)]
unsafe fn expert_rows<W: Chunk>(p: ExpertParams, fp8: bool) {
    grid_dependency_wait();
    // SAFETY: launch contract checked by host/src/moe.rs: offsets/active/active_count from
    // the dispatch kernel over the same entries.
    unsafe {
        if let Some((e, rows)) = active_expert(&p) {
            expert_warp::<W, false>(&p, e, block_row0(), rows, |j| x_row(&p, j), fp8);
        }
    }
}

/// Expert projection per routing choice, bf16 weights, [`ExpertParams`] with `idx` (the
/// other row fields null). Grid `(ceil(n / WARP_BLOCK_ROWS), entries)`, block
/// [`WARP_BLOCK`](crate::gemv::WARP_BLOCK): block `(b, a)` computes choice a, expert
/// `idx[a]`, for row `a / per` of x into row a of out, as [`moe_expert_bf16`] computes an
/// expert's rows. The next kernel launches only once this one's wait has returned (the
/// routing has completed): the expert-combine kernel after it reads the choices before its
/// wait.
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn moe_expert_choices_bf16(p: ExpertParams) {
    // SAFETY: forwarded launch contract.
    unsafe { choice_rows::<Streamed>(&p, false) }
}

/// As [`moe_expert_choices_bf16`], e4m3 weights (W8A8): each choice's input quantized to
/// e4m3 with its token's scale before the product, as [`moe_expert_fp8`] computes it.
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn moe_expert_choices_fp8(p: ExpertParams) {
    // SAFETY: forwarded launch contract.
    unsafe { choice_rows::<u64>(&p, true) }
}

/// As [`moe_expert_choices_bf16`], NVFP4 weights (weight-only, as
/// [`gemv_nvfp4`](crate::gemv) computes them).
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn moe_expert_choices_nvfp4(p: ExpertParams) {
    // SAFETY: forwarded launch contract (k a multiple of 16).
    unsafe { choice_rows::<Fp4>(&p, false) }
}

/// The body of the per-choice kernels (see [`moe_expert_choices_bf16`]); `W` the weight
/// chunk, `fp8` whether inputs are quantized.
///
/// # Safety
/// The launch contract checked by host/src/moe.rs: idx holds entries ids (one out of range
/// traps), x entries / per rows, w experts * n * k (the scales one per expert), out
/// entries * n.
#[inline(always)]
unsafe fn choice_rows<W: Chunk>(p: &ExpertParams, fp8: bool) {
    grid_dependency_wait_first();
    let a = block_y() as usize;
    // SAFETY: the caller's contract.
    unsafe {
        let e = ld(p.idx, a);
        if e < 0 || e as u32 >= p.experts {
            trap();
        }
        let x = a / p.per as usize;
        expert_warp::<W, false>(p, e as usize, block_row0(), (a, a + 1), |_| x, fp8);
    }
}

/// One warp's share of an expert launch ([`warp_rows`]): its weight rows `row0..` of expert
/// `e` (pieces as [`ExpertParams::piece0`] says) for rows `rows` of out, row j of x row
/// `x_row(j)`.
///
/// # Safety
/// The launch contract of the calling kernel, `e` a valid expert.
#[inline(always)]
unsafe fn expert_warp<W: Chunk, const EARLY: bool>(
    p: &ExpertParams,
    e: usize,
    row0: usize,
    rows: (usize, usize),
    x_row: impl Fn(usize) -> usize,
    fp8: bool,
) {
    let nk = (p.o.n as usize, p.o.k as usize);
    let at = weight_rows(e, row0, nk, (p.piece0 as usize, p.pieces as usize));
    // SAFETY: forwarded.
    unsafe { warp_rows::<W, EARLY>(&p.o, fp8, e, row0, at, rows, x_row) }
}

/// Expert down projections and combining, bf16 weights, [`ExpertCombineParams`]. Grid
/// `(ceil(n / COMBINE_ROWS), rows)`, block `32 * per`: warp j streams the [`COMBINE_ROWS`]
/// weight rows of token `block_y`'s j-th chosen expert against the choice's hidden row (as
/// [`moe_expert_bf16`] does) and rounds each product to bf16; then one thread per output
/// row adds them with their weights to the f32 sum in the order j (the shared output
/// first): [`moe_expert_bf16`] then [`moe_combine_bf16`] in one launch, bit for bit.
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn moe_expert_combine_bf16(p: ExpertCombineParams) {
    // SAFETY: forwarded launch contract.
    unsafe { expert_combine::<Streamed, true>(&p, false) }
}

/// As [`moe_expert_combine_bf16`], e4m3 weights (W8A8): each choice's hidden row quantized
/// to e4m3 with its expert's static input scale or, where there are none, its own
/// (docs/MATH.md section 4), each product scaled by both scales before its rounding to
/// bf16, as [`moe_expert_fp8`] computes it. With static scales its first weights load
/// before it waits, as there; with per-token scales (found from the hidden rows that the
/// kernel before writes) it waits first.
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn moe_expert_combine_fp8(p: ExpertCombineParams) {
    // SAFETY: forwarded launch contract; early only with static scales.
    unsafe {
        if p.in_scale.is_null() {
            grid_dependency_wait();
            expert_combine::<u64, false>(&p, true)
        } else {
            expert_combine::<u64, true>(&p, true)
        }
    }
}

/// As [`moe_expert_combine_bf16`], NVFP4 weights (weight-only, as
/// [`gemv_nvfp4`](crate::gemv) computes them), each product scaled by its expert's
/// per-tensor scale before its rounding to bf16; its first weights load before it waits.
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn moe_expert_combine_nvfp4(p: ExpertCombineParams) {
    // SAFETY: forwarded launch contract (k a multiple of 16).
    unsafe { expert_combine::<Fp4, true>(&p, false) }
}

/// The body of the expert-combine kernels (see [`moe_expert_combine_bf16`]); `W` the
/// weight chunk, `fp8` whether the hidden rows are quantized, `EARLY` whether the first
/// weights load before the wait (with `fp8` only for static input scales).
///
/// # Safety
/// The launch contract checked by host/src/moe.rs: x holds rows * per rows of k, w an n *
/// k matrix for each expert (the pieces among them; FP8: the scales one per expert), idx
/// and weight per values for each row, shared (when not null) and out rows * n, per <=
/// MAX_TOP_K; an expert id out of range traps. Before its wait (in the first pass of `partial_dots`) it reads only the
/// choices, the weights and their scales: the kernel before it, the per-choice kernel,
/// lets it launch once the routing that wrote the choices has completed.
#[inline(always)]
unsafe fn expert_combine<W: Chunk, const EARLY: bool>(p: &ExpertCombineParams, fp8: bool) {
    const R: usize = COMBINE_ROWS as usize;
    let (n, k, per) = (p.n as usize, p.k as usize, p.per as usize);
    let (t, j) = (block_y() as usize, warp_id() as usize);
    let row0 = block_x() as usize * R;
    let rows = (n - row0).min(R);
    // SAFETY: the caller's contract. Shared memory: the products below, each written by
    // lane 0 of its warp before the barrier. Each output element is written by the one
    // thread owning its row.
    unsafe {
        let y = static_smem!("combine_y", MAX_TOP_K * COMBINE_ROWS * 4);
        let c = t * per + j;
        let e = ld_l2(p.idx, c);
        if e < 0 || e as u32 >= p.experts {
            trap();
        }
        let e = e as usize;
        let (at, stride) = weight_rows(e, row0, (n, k), (p.piece0 as usize, p.pieces as usize));
        let x = [p.x.wrapping_add(c * k)];
        let w = p.w.wrapping_add(W::bytes(at, k));
        let w_scale = if W::MATRIX_SCALE { ld(p.w_scale, e) } else { 1.0 };
        let s = match fp8 {
            false => 1.0,
            true if p.in_scale.is_null() => warp_token_scale(x[0], k),
            true => ld(p.in_scale, e),
        };
        let warp = (lane_id() as usize, 32);
        let dots = partial_dots::<W, R, 1, WARP_UNROLL, EARLY>(
            w,
            W::bytes(stride, k),
            rows,
            (&x, 1, &[(s, 1.0 / s)]),
            (k, fp8),
            warp,
        );
        for (r, d) in dots.iter().enumerate() {
            let v = bf16_to_f32(f32_to_bf16(warp_sum(d[0]) * w_scale * s));
            if lane_id() == 0 {
                st(y, j * R + r, v);
            }
        }
        sync_threads();
        let r = thread_x() as usize;
        if r < rows {
            let mut acc = if p.shared.is_null() { 0.0 } else { bf16_to_f32(ld(p.shared, t * n + row0 + r)) };
            for j in 0..per {
                acc += ld(p.weight, t * per + j) * ld(y, j * R + r);
            }
            st(p.out, t * n + row0 + r, f32_to_bf16(acc));
        }
    }
}

/// Expert projection, bf16 weights, [`ExpertParams`]. Grid `(ceil(n / WARP_BLOCK_ROWS),
/// slots)` with `slots >= active_count` (blocks past it return), block
/// [`WARP_BLOCK`](crate::gemv::WARP_BLOCK). Block `(b, a)` takes expert `active[a]`; each
/// warp streams [`WARP_ROWS`] weight rows once per
/// [`WARP_TOKENS`](crate::gemv::WARP_TOKENS) of the expert's rows (see [`warp_rows`]).
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn moe_expert_bf16(p: ExpertParams) {
    // SAFETY: forwarded launch contract (it waits on the kernel before).
    unsafe { expert_rows::<[u32; 4]>(p, false) }
}

/// Expert projection, e4m3 weights (W8A8), [`ExpertParams`]; as [`moe_expert_bf16`], each
/// input chunk quantized to e4m3 with its token's scale before the product.
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn moe_expert_fp8(p: ExpertParams) {
    // SAFETY: forwarded launch contract (it waits on the kernel before).
    unsafe { expert_rows::<u64>(p, true) }
}

/// Expert projection, NVFP4 weights (weight-only, as [`gemv_nvfp4`](crate::gemv)
/// computes them), [`ExpertParams`]; as [`moe_expert_bf16`].
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn moe_expert_nvfp4(p: ExpertParams) {
    // SAFETY: forwarded launch contract (it waits on the kernel before; k a multiple of 16).
    unsafe { expert_rows::<Fp4>(p, false) }
}

/// As [`moe_expert_fp8`] on tensor cores (kernels-gpu/src/qgemv.rs): grid `(ceil(n /
/// QG_ROWS), slots)` with `slots >= active_count` (blocks past it return), block
/// [`QG_BLOCK`](crate::qgemv::QG_BLOCK); block `(b, a)` computes weight rows `b * QG_ROWS..`
/// of expert `active[a]` for its rows, [`QG_TOKENS`](crate::qgemv::QG_TOKENS) a pass over
/// the weights.
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn moe_expert_tc_fp8(p: ExpertParams) {
    // SAFETY: forwarded launch contract.
    unsafe { expert_tiles::<Fp8>(&p) }
}

/// As [`moe_expert_tc_fp8`], NVFP4 weights (weight-only, as
/// [`gemv_tc_nvfp4`](crate::qgemv) computes them; k a multiple of 16).
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn moe_expert_tc_nvfp4(p: ExpertParams) {
    // SAFETY: forwarded launch contract.
    unsafe { expert_tiles::<Nvfp4>(&p) }
}

/// The body of the tensor-core expert kernels, weights of format `F`.
///
/// # Safety
/// As for [`moe_expert_fp8`] (k a multiple of 16 for NVFP4); the whole block calls it.
#[inline(always)]
unsafe fn expert_tiles<F: TcWeights>(p: &ExpertParams) {
    grid_dependency_wait();
    let (n, k) = (p.o.n as usize, p.o.k as usize);
    let row0 = block_x() as usize * QG_ROWS as usize;
    // SAFETY: the caller's contract; the whole block returns or goes on together.
    unsafe {
        let Some((e, rows)) = active_expert(p) else { return };
        if row0 >= n {
            return;
        }
        let (at, stride) = weight_rows(e, row0, (n, k), (p.piece0 as usize, p.pieces as usize));
        let (at, stride) = (F::bytes(at, k), F::bytes(stride, k));
        let r = TcRows { w: p.o.w.wrapping_add(at), stride, valid: (n - row0).min(QG_ROWS as usize), e };
        tc_tiles::<F>(&p.o, &r, row0, rows, |j| x_row(p, j));
    }
}

/// Combining, [`CombineParams`]. Grid `(ceil(rows * chunks(hidden) / EW_BLOCK))`, block
/// [`EW_BLOCK`]: thread i sums chunk `i % chunks(hidden)` (8 channels, 16-byte loads where
/// whole and aligned) of token `i / chunks(hidden)`: the shared output and the weighted expert
/// rows in order k, [`COMBINE_GROUP`] rows' loads issued before their sums.
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn moe_combine_bf16(p: CombineParams) {
    grid_dependency_wait();
    let (h, k) = (p.hidden as usize, p.top_k as usize);
    let n = chunks(p.hidden) as usize;
    let i = (block_x() * EW_BLOCK + thread_x()) as usize;
    if i >= p.rows as usize * n {
        return;
    }
    let (t, c0) = (i / n, (i % n) * VEC as usize);
    // SAFETY: launch contract checked by host/src/moe.rs; a slot outside y traps before it
    // is read.
    unsafe {
        let mut acc = if p.shared.is_null() { [0.0; 8] } else { load8_bf16(p.shared.wrapping_add(t * h), c0, h) };
        // COMBINE_GROUP choices at a time: their rows' loads all in flight, then their sums.
        let mut j0 = 0;
        while j0 < k {
            let (mut raw, mut w) = ([[0u32; 4]; COMBINE_GROUP], [0.0f32; COMBINE_GROUP]);
            for (j, (rj, wj)) in raw.iter_mut().zip(w.iter_mut()).enumerate() {
                if j0 + j < k {
                    let s = ld(p.slot, t * k + j0 + j);
                    if s < 0 || s as u32 >= p.y_rows {
                        trap();
                    }
                    *wj = ld(p.weight, t * k + j0 + j);
                    *rj = load8_raw(p.y.wrapping_add(s as usize * h), c0, h);
                }
            }
            for (j, (rj, wj)) in raw.iter().zip(w.iter()).enumerate() {
                if j0 + j < k {
                    let v = raw8_values(*rj);
                    for i in 0..8 {
                        acc[i] += *wj * v[i];
                    }
                }
            }
            j0 += COMBINE_GROUP;
        }
        store8_bf16(p.out.wrapping_add(t * h), c0, h, acc);
    }
}
