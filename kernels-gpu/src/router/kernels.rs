//! The device code of the router family (nvptx64 only): the one-launch routing kernel
//! (`moe_route_bf16`: logits by blocks of experts, the selection by each tile's last block,
//! one token's appended pieces' up projections by blocks past the experts') and the selection
//! alone (`moe_select_bf16`, after cuBLASLt's logits). Launch parameters and sizes are in
//! `../router.rs`.

use super::*;
use crate::device::*;
use crate::gemv::{Operands, Streamed, WARP_ROWS, warp_rows};
use crate::moe::{MAX_EXPERTS, weight_rows};

/// Selection only, from logits already written ([`RouteParams`]' `logits`, `[rows, experts]`
/// f32; x, gate, counters and the appended pieces unused): grid `(ceil(rows /
/// LOGITS_TOKENS))`, block [`LOGITS_BLOCK`], dynamic shared memory [`ROUTE_SMEM_BYTES`]; warp
/// w of block b selects for token `LOGITS_TOKENS b + w` as `moe_route_bf16` does.
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn moe_select_bf16(p: RouteParams) {
    grid_dependency_wait();
    let (w, tok) = (warp_id(), block_x() * LOGITS_TOKENS + warp_id());
    if tok < p.rows {
        // SAFETY: launch contract checked by host/src/router.rs (logits rows * experts, idx
        // and weight rows * choices); each warp its own 2 * MAX_EXPERTS floats of the shared
        // memory.
        unsafe { select(&p, tok as usize, dyn_smem_f32().wrapping_add((2 * MAX_EXPERTS * w) as usize)) }
    }
}

/// The largest of `v[0..n]` (shared memory) and its index, lowest index among equal
/// values, by one full warp (lanes over i). NaN marks an entry already taken: skipped.
#[inline(always)]
unsafe fn warp_pick(v: *const f32, n: usize) -> (f32, u32) {
    let (mut best, mut at) = (f32::NEG_INFINITY, u32::MAX);
    let mut i = lane_id() as usize;
    while i < n {
        // SAFETY: i < n, within v.
        let x = unsafe { ld(v, i) };
        // Ascending i per lane: a later equal value never replaces an earlier one.
        if !x.is_nan() && (x > best || at == u32::MAX) {
            (best, at) = (x, i as u32);
        }
        i += 32;
    }
    warp_argmax(best, at)
}

/// Routing, [`RouteParams`] without the appended up projections. Grid `(experts, ceil(rows /
/// LOGITS_TOKENS))`, block [`LOGITS_BLOCK`], dynamic shared memory [`ROUTE_SMEM_BYTES`]: block
/// `(e, b)` forms `logits[t, e]` for the tokens of tile b, threads over hidden (16-byte loads,
/// f32 sums), reduced across the block in warp order; the tile's last block to finish
/// (counted in `counters[b]`) then selects for them, warp w for token w of the tile (see
/// [`select`]).
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn moe_route_bf16(p: RouteParams) {
    // SAFETY: the launch contract.
    unsafe { route(&p) }
}

/// [`moe_route_bf16`] of one token fused with its appended pieces' up projections (they need
/// no routing): blocks past the experts' compute them ([`appended_up`]). Grid `(experts +
/// shared * ceil(inter / ROUTE_UP_ROWS), 1)`, block and shared memory as there.
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn moe_route_up_bf16(p: RouteParams) {
    if block_x() >= p.experts {
        // SAFETY: launch contract (up and h set for one token). It waits on the kernel
        // before once its weights are loading.
        unsafe { appended_up(&p, (block_x() - p.experts) as usize) };
        return;
    }
    // SAFETY: the launch contract.
    unsafe { route(&p) }
}

/// The routing of [`moe_route_bf16`], by a block of the experts'.
///
/// # Safety
/// [`moe_route_bf16`]'s launch contract; `block_x() < experts`.
#[inline(always)]
unsafe fn route(p: &RouteParams) {
    const T: usize = LOGITS_TOKENS as usize;
    let (h, e, ex) = (p.hidden as usize, p.experts as usize, block_x() as usize);
    let t0 = block_y() as usize * T;
    let toks = (p.rows as usize - t0).min(T);
    // SAFETY: launch contract checked by host/src/moe.rs (x holds rows * hidden, gate
    // experts * hidden, logits rows * experts, counters a zero per tile; hidden a multiple
    // of 8); shared memory: the static per-warp partial sums and the last-block flag below,
    // the dynamic selection buffers.
    unsafe {
        let partial = static_smem!("route_partial", LOGITS_BLOCK / 32 * LOGITS_TOKENS * 4 + 4);
        let x = p.x.wrapping_add(t0 * h);
        let w = p.gate.wrapping_add(ex * h);
        let mut acc = [0.0f32; T];
        // Two chunks of the gate row per pass, both loads issued before either is used
        // (hidden up to 4096 in one round trip); past hidden they read as zeros.
        // The first pass's gate chunks are loading before the wait (weights are never
        // written while kernels run), the inputs after it.
        let step = LOGITS_BLOCK as usize * 8;
        let mut c = thread_x() as usize * 8;
        let gate = |c: usize| [load8_bf16(w, c, h), load8_bf16(w, c + step, h)];
        let mut wv = gate(c);
        grid_dependency_wait();
        while c < h {
            for (t, acc) in acc.iter_mut().enumerate() {
                if t < toks {
                    let xt = x.wrapping_add(t * h);
                    for (u, wv) in wv.iter().enumerate() {
                        let xv = load8_bf16(xt, c + u * step, h);
                        for i in 0..8 {
                            *acc += wv[i] * xv[i];
                        }
                    }
                }
            }
            c += 2 * step;
            if c < h {
                wv = gate(c);
            }
        }
        let warp = warp_id() as usize;
        for (t, &v) in acc.iter().enumerate() {
            let s = warp_sum(v);
            if lane_id() == 0 {
                st(partial, warp * T + t, s);
            }
        }
        sync_threads();
        let t = thread_x() as usize;
        if t < toks {
            let mut logit = 0.0f32;
            for w in 0..(LOGITS_BLOCK / 32) as usize {
                logit += ld(partial, w * T + t);
            }
            st(p.logits, (t0 + t) * e + ex, logit);
        }
        let flag = partial.wrapping_add((LOGITS_BLOCK / 32 * LOGITS_TOKENS) as usize) as *mut u32;
        if last_block(p.counters.wrapping_add(block_y() as usize), p.experts, flag) && warp < toks {
            select(p, t0 + warp, dyn_smem_f32().wrapping_add(2 * MAX_EXPERTS as usize * warp));
        }
    }
}

/// Block `b` past the experts' of [`moe_route_up_bf16`]: rows `(b % per_piece) *
/// ROUTE_UP_ROWS..` of appended piece `b / per_piece`'s up projection for the one token,
/// each warp [`WARP_ROWS`] rows as [`moe_expert_choices_bf16`] computes them (the same
/// code: [`warp_rows`]), into its choice's row `top_k + piece` of h.
///
/// # Safety
/// [`RouteParams::up`] and `h` valid for one token; `b` below `shared * per_piece`.
#[inline(always)]
unsafe fn appended_up(p: &RouteParams, b: usize) {
    let n = p.inter as usize;
    let per_piece = n.div_ceil(ROUTE_UP_ROWS as usize);
    let (piece, row0) = (b / per_piece, (b % per_piece) * ROUTE_UP_ROWS as usize + (warp_id() * WARP_ROWS) as usize);
    // The pieces' up projections are whole experts after the routed ones (row blocks of
    // the shared expert's; only its down projection is cut by columns): no pieces here.
    let up = Operands {
        x: p.x,
        w: p.up as *const u8,
        w_scale: core::ptr::null(),
        in_scale: core::ptr::null(),
        out: p.h,
        relu2: 1,
        n: p.inter,
        k: p.hidden,
    };
    let (e, a) = (p.experts as usize + piece, p.top_k as usize + piece);
    let at = weight_rows(e, row0, (n, p.hidden as usize), (0, 0));
    // SAFETY: up holds (experts + shared) * n * k, x one row of k, h (top_k + shared) * n
    // (caller): choice a, of x row 0. It waits on the kernel before once its weights are
    // loading.
    unsafe { warp_rows::<Streamed, true>(&up, false, e, row0, at, (a, a + 1), |_| 0) }
}

/// Experts per lane of [`select`]'s warp (lane l holds experts `l, l + 32, ..`).
const PER_LANE: usize = (MAX_EXPERTS / 32) as usize;

/// Selection for token `tok` of [`RouteParams`] by one warp, after its logits are visible;
/// also writes the appended choices. Lane l holds the scores and selection scores of
/// experts `l + 32 m` in registers; `smem`: `2 * MAX_EXPERTS` floats of shared memory of
/// this warp's own, for group-limited routing only (selection scores by experts, group
/// scores by one lane per group). Groups and experts by warp-wide argmax (lowest index on
/// ties).
///
/// # Safety
/// Launch contract of [`moe_route_bf16`]; `tok < rows`.
#[inline(always)]
pub(crate) unsafe fn select(p: &RouteParams, tok: usize, smem: *mut f32) {
    let e = p.experts as usize;
    let lane = lane_id() as usize;
    let me = MAX_EXPERTS as usize;
    // SAFETY: launch contract checked by host/src/moe.rs (experts <= MAX_EXPERTS, top_k +
    // shared <= MAX_TOP_K, top_k <= the experts of the kept groups, groups dividing
    // experts, idx and weight rows of top_k + shared); smem as documented.
    unsafe {
        // Every load first (no store between them), then the scores.
        let (mut score, mut sel) = ([0.0f32; PER_LANE], [f32::NAN; PER_LANE]);
        for m in 0..PER_LANE {
            let i = lane + 32 * m;
            if i < e {
                (score[m], sel[m]) = (ld(p.logits, tok * e + i), ld(p.bias, i));
            }
        }
        for m in 0..PER_LANE {
            if lane + 32 * m < e {
                score[m] = 1.0 / (1.0 + exp_fast(-score[m]));
                // NaN marks a taken (or absent) entry below: a NaN score (from NaN inputs)
                // ranks last.
                let v = score[m] + sel[m];
                sel[m] = if v.is_nan() { f32::NEG_INFINITY } else { v };
            }
        }
        let (ng, k) = (p.n_group as usize, p.top_k as usize);
        if (p.topk_group as usize) < ng {
            let (sm, gscore) = (smem, smem.wrapping_add(me));
            for (m, &v) in sel.iter().enumerate() {
                if lane + 32 * m < e {
                    st(sm, lane + 32 * m, v);
                }
            }
            sync_warp();
            // Each group's score is the sum of its two best selection scores.
            let per = e / ng;
            let mut g = lane;
            while g < ng {
                let (mut a, mut b) = (f32::NEG_INFINITY, f32::NEG_INFINITY);
                for i in g * per..(g + 1) * per {
                    let v = ld(sm, i);
                    if v > a {
                        (a, b) = (v, a);
                    } else if v > b {
                        b = v;
                    }
                }
                st(gscore, g, if per > 1 { a + b } else { a });
                g += 32;
            }
            sync_warp();
            // Keep the best topk_group groups (marked NaN), then mask the others' experts.
            // A group whose score is NaN (NaN activations, or +inf and -inf biases in it)
            // counts as kept; with every group NaN there is nothing left to pick, and all
            // stay kept: bad values never trap (they give NaN weights, and the row's
            // request fails alone at sampling).
            for _ in 0..p.topk_group {
                let (_, g) = warp_pick(gscore, ng);
                sync_warp();
                if lane == 0 && g != u32::MAX {
                    st(gscore, g as usize, f32::NAN);
                }
                sync_warp();
            }
            for (m, v) in sel.iter_mut().enumerate() {
                let i = lane + 32 * m;
                if i < e && !ld(gscore, i / per).is_nan() {
                    *v = f32::NEG_INFINITY;
                }
            }
            sync_warp();
        }
        // Lane j keeps the j-th pick and its score.
        let (mut mine, mut mine_score) = (0u32, 0.0f32);
        for j in 0..k {
            // This lane's best in ascending index (a later equal value never replaces an
            // earlier one), then the warp's.
            let (mut best, mut at, mut best_score) = (f32::NEG_INFINITY, u32::MAX, 0.0f32);
            for (m, (&v, &s)) in sel.iter().zip(&score).enumerate() {
                if !v.is_nan() && (v > best || at == u32::MAX) {
                    (best, at, best_score) = (v, (lane + 32 * m) as u32, s);
                }
            }
            let (_, pick) = warp_argmax(best, at);
            // Every selection score NaN (bad values, as above): expert j, in range, with
            // a NaN weight.
            let (pick, best_score) = if pick == u32::MAX { (j as u32, f32::NAN) } else { (pick, best_score) };
            let s = warp_read(best_score, pick % 32);
            if lane == j {
                (mine, mine_score) = (pick, s);
            }
            for (m, v) in sel.iter_mut().enumerate() {
                if (lane + 32 * m) as u32 == pick {
                    *v = f32::NAN;
                }
            }
        }
        // The picks' scores summed in pick order.
        let mut total = 0.0f32;
        for j in 0..k {
            total += warp_read(mine_score, j as u32);
        }
        let out = tok * (k + p.shared as usize) + lane;
        if lane < k {
            let w = if p.renormalize != 0 { mine_score / total } else { mine_score };
            st(p.idx, out, mine as i32);
            st(p.weight, out, w * p.scaling);
        } else if lane < k + p.shared as usize {
            st(p.idx, out, (e + lane - k) as i32);
            st(p.weight, out, 1.0);
        }
    }
}
