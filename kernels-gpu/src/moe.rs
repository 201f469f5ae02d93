//! MoE routing and combining (SPEC.md section 6). Routing: router logits in f32 from the bf16
//! activations and router weights, sigmoid, `+ bias` for selection only, group-limited top-k,
//! weights from the unbiased scores (renormalized, scaled); ties go to the lowest index.
//! Combining: each token's expert outputs (in the grouped order of the dispatch) summed with
//! its routing weights in f32, plus the shared expert's output.

use crate::KernelParams;

/// Threads per block of the routing kernel (one block per token).
pub const ROUTE_BLOCK: u32 = 256;
/// Most experts the routing kernel handles.
pub const MAX_EXPERTS: u32 = 256;
/// Most experts per token.
pub const MAX_TOP_K: u32 = 16;

/// Routing of `rows` tokens.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct RouteParams {
    /// `[rows, hidden]` bf16.
    pub x: *const u16,
    /// Router `[experts, hidden]` bf16.
    pub gate: *const u16,
    /// `[experts]` f32 selection bias.
    pub bias: *const f32,
    /// `[rows, top_k]` chosen experts, highest selection score first.
    pub idx: *mut i32,
    /// `[rows, top_k]` their weights.
    pub weight: *mut f32,
    pub rows: u32,
    pub hidden: u32,
    pub experts: u32,
    pub top_k: u32,
    pub n_group: u32,
    pub topk_group: u32,
    /// 1: divide the weights by their sum.
    pub renormalize: u32,
    pub scaling: f32,
}

/// Combining of `rows` tokens.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct CombineParams {
    /// `[slots, hidden]` expert outputs in grouped order.
    pub y: *const u16,
    /// `[rows, hidden]` shared expert output, or null.
    pub shared: *const u16,
    /// `[rows, top_k]` row of `y` holding token t's k-th expert output.
    pub slot: *const i32,
    /// `[rows, top_k]` routing weights.
    pub weight: *const f32,
    /// `[rows, hidden]` bf16, written.
    pub out: *mut u16,
    pub rows: u32,
    pub top_k: u32,
    pub hidden: u32,
}

// SAFETY: #[repr(C)], Copy, only pointers, integers and floats.
unsafe impl KernelParams for RouteParams {}
// SAFETY: as above.
unsafe impl KernelParams for CombineParams {}

/// Dynamic shared memory of the routing kernel: scores, selection scores, group scores, kept
/// flags.
pub const ROUTE_SMEM_BYTES: u32 = 4 * MAX_EXPERTS * 4;

#[cfg(target_arch = "nvptx64")]
mod kernels {
    use super::*;
    use crate::EW_BLOCK;
    use crate::device::*;

    /// Index of the largest `v[i]` with `ok(i)` (lowest index on ties), if any.
    #[inline(always)]
    unsafe fn argmax(v: *const f32, n: usize, ok: impl Fn(usize) -> bool) -> Option<usize> {
        let mut best: Option<usize> = None;
        for i in 0..n {
            // SAFETY: i < n, within v (shared memory of at least n floats).
            if ok(i) && best.is_none_or(|b| unsafe { ld(v, i) > ld(v, b) }) {
                best = Some(i);
            }
        }
        best
    }

    /// Routing, [`RouteParams`]. Grid `(rows)`, block [`ROUTE_BLOCK`], dynamic shared memory
    /// [`ROUTE_SMEM_BYTES`]. Block t: warp w computes the logits of experts w, w + 8, ...
    /// (lanes over hidden, f32); then thread 0 selects groups and experts serially.
    #[unsafe(no_mangle)]
    pub unsafe extern "ptx-kernel" fn moe_route_bf16(p: RouteParams) {
        let t = block_x() as usize;
        let (h, e) = (p.hidden as usize, p.experts as usize);
        // SAFETY: launch contract checked by host/src/moe.rs (experts <= MAX_EXPERTS, top_k <=
        // MAX_TOP_K, groups dividing experts); shared memory as ROUTE_SMEM_BYTES.
        unsafe {
            let smem = dyn_smem_f32();
            let (score, sel) = (smem, smem.wrapping_add(MAX_EXPERTS as usize));
            let x = p.x.wrapping_add(t * h);
            let mut ex = warp_id() as usize;
            while ex < e {
                let mut acc = 0.0f32;
                let mut i = lane_id() as usize;
                while i < h {
                    acc += bf16_to_f32(ld(x, i)) * bf16_to_f32(ld(p.gate, ex * h + i));
                    i += 32;
                }
                let logit = warp_sum(acc);
                if lane_id() == 0 {
                    let s = 1.0 / (1.0 + exp_fast(-logit));
                    st(score, ex, s);
                    st(sel, ex, s + ld(p.bias, ex));
                }
                ex += warps() as usize;
            }
            sync_threads();
            if thread_x() != 0 {
                return;
            }
            let (ng, k) = (p.n_group as usize, p.top_k as usize);
            let per = e / ng;
            let gscore = sel.wrapping_add(MAX_EXPERTS as usize);
            let kept = gscore.wrapping_add(MAX_EXPERTS as usize);
            for g in 0..ng {
                let base = sel.wrapping_add(g * per);
                let a = argmax(base, per, |_| true).unwrap_or(0);
                let b = argmax(base, per, |i| i != a);
                st(gscore, g, ld(base, a) + b.map_or(0.0, |b| ld(base, b)));
                st(kept, g, 0.0);
            }
            for _ in 0..p.topk_group {
                if let Some(g) = argmax(gscore, ng, |g| ld(kept, g) == 0.0) {
                    st(kept, g, 1.0);
                }
            }
            // Experts of dropped groups, and experts already chosen, cannot be chosen.
            for i in 0..e {
                if ld(kept, i / per) == 0.0 {
                    st(sel, i, f32::NEG_INFINITY);
                }
            }
            let out = t * k;
            let mut total = 0.0f32;
            for j in 0..k {
                let pick = argmax(sel, e, |_| true).unwrap_or(0);
                st(sel, pick, f32::NEG_INFINITY);
                st(p.idx, out + j, pick as i32);
                total += ld(score, pick);
            }
            for j in 0..k {
                let s = ld(score, ld(p.idx, out + j) as usize);
                let w = if p.renormalize != 0 { s / total } else { s };
                st(p.weight, out + j, w * p.scaling);
            }
        }
    }

    /// Combining, [`CombineParams`]. Grid `(rows)`, block [`EW_BLOCK`]: block t, one thread
    /// per channel (coalesced), sums the shared output and the weighted expert rows in order k.
    #[unsafe(no_mangle)]
    pub unsafe extern "ptx-kernel" fn moe_combine_bf16(p: CombineParams) {
        let t = block_x() as usize;
        let (h, k) = (p.hidden as usize, p.top_k as usize);
        // SAFETY: launch contract checked by host/src/moe.rs (slots index rows of y).
        unsafe {
            let mut c = thread_x() as usize;
            while c < h {
                let mut acc = if p.shared.is_null() { 0.0 } else { bf16_to_f32(ld(p.shared, t * h + c)) };
                for j in t * k..(t + 1) * k {
                    acc += ld(p.weight, j) * bf16_to_f32(ld(p.y, ld(p.slot, j) as usize * h + c));
                }
                st(p.out, t * h + c, f32_to_bf16(acc));
                c += EW_BLOCK as usize;
            }
        }
    }
}
