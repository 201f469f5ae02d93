//! Causal attention over a per-slot KV cache (SPEC.md section 7): grouped-query heads, no
//! positional encoding, scale 1/sqrt(head_dim). Two launches: the step's new keys and values
//! are written into the cache, then every (row, head) attends over its sequence's keys up to
//! and including its own position.
//!
//! Layouts: `q [rows, heads * head_dim]`, new `k`, `v` `[rows, kv_heads * head_dim]`, caches
//! `[slots, max_len, kv_heads * head_dim]`, all bf16; per row its slot and its position in its
//! sequence; `out [rows, heads * head_dim]`.

use crate::KernelParams;

/// Threads per block of the attention kernels.
pub const ATTN_BLOCK: u32 = 128;

/// Both attention launches.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct AttnParams {
    /// Row r's query at `q + r * q_stride`, its key and value at `k` and `v` `+ r * kv_stride`.
    pub q: *const u16,
    pub k: *const u16,
    pub v: *const u16,
    pub q_stride: u32,
    pub kv_stride: u32,
    pub k_cache: *mut u16,
    pub v_cache: *mut u16,
    /// `[rows]` slot of each row.
    pub slot: *const i32,
    /// `[rows]` position of each row's token in its sequence (< max_len).
    pub pos: *const u32,
    pub out: *mut u16,
    pub rows: u32,
    pub heads: u32,
    pub kv_heads: u32,
    pub head_dim: u32,
    pub max_len: u32,
    pub scale: f32,
}

// SAFETY: #[repr(C)], Copy, only pointers, integers and floats.
unsafe impl KernelParams for AttnParams {}

/// Largest head the attention kernel takes (a lane holds 8 of its channels).
pub const MAX_HEAD_DIM: u32 = 256;

/// Dynamic shared memory of `attn_bf16`: the query head, a score per key, reduction scratch,
/// and each warp's partial output head.
pub const fn smem_bytes(head_dim: u32, max_len: u32) -> u32 {
    (head_dim + max_len + ATTN_BLOCK / 32 + ATTN_BLOCK / 32 * head_dim) * 4
}

#[cfg(target_arch = "nvptx64")]
mod kernels {
    use super::*;
    use crate::device::*;

    /// Cache write, [`AttnParams`]. Grid `(rows)`, block [`ATTN_BLOCK`]: block r copies row r
    /// of k and v to position `pos[r]` of slot `slot[r]` of the caches.
    #[unsafe(no_mangle)]
    pub unsafe extern "ptx-kernel" fn attn_cache_write_bf16(p: AttnParams) {
        grid_dependency_wait();
        let r = block_x() as usize;
        let (kw, row) = ((p.kv_heads * p.head_dim) as usize, r * p.kv_stride as usize);
        // SAFETY: launch contract checked by host/src/attn.rs (slots and positions in range,
        // no two rows at the same slot and position).
        unsafe {
            let at = (ld(p.slot, r) as usize * p.max_len as usize + ld(p.pos, r) as usize) * kw;
            let mut c = thread_x() as usize;
            while c < kw {
                st(p.k_cache, at + c, ld(p.k, row + c));
                st(p.v_cache, at + c, ld(p.v, row + c));
                c += ATTN_BLOCK as usize;
            }
        }
    }

    /// Attention, [`AttnParams`], after the cache write. Grid `(rows, heads)`, block
    /// [`ATTN_BLOCK`], dynamic shared memory `smem_bytes(head_dim, max_len)`. Block (r, h):
    /// scores of keys `0..=pos[r]` (one warp per key, lanes over the head's channels, 16-byte
    /// loads of the key row), softmax with block reductions, then each warp sums the weighted
    /// value rows of its keys (lanes over channels) and one thread per output channel adds
    /// the warps' sums in order.
    #[unsafe(no_mangle)]
    pub unsafe extern "ptx-kernel" fn attn_bf16(p: AttnParams) {
        grid_dependency_wait();
        let (r, h) = (block_x() as usize, block_y() as usize);
        let t = thread_x() as usize;
        let (d, blk) = (p.head_dim as usize, ATTN_BLOCK as usize);
        let kw = p.kv_heads as usize * d;
        let kvh = h / (p.heads / p.kv_heads) as usize;
        // SAFETY: launch contract checked by host/src/attn.rs (head_dim <= MAX_HEAD_DIM);
        // shared memory as smem_bytes; barriers separate writes and reads of it.
        unsafe {
            let smem = dyn_smem_f32();
            let (qs, scores) = (smem, smem.wrapping_add(d));
            let scratch = scores.wrapping_add(p.max_len as usize);
            let mut i = t;
            while i < d {
                st(qs, i, bf16_to_f32(ld(p.q, r * p.q_stride as usize + h * d + i)));
                i += blk;
            }
            sync_threads();
            let n = ld(p.pos, r) as usize + 1;
            let base = ld(p.slot, r) as usize * p.max_len as usize * kw + kvh * d;
            let mut m = f32::NEG_INFINITY;
            let (lane, warps) = (lane_id() as usize, (ATTN_BLOCK / 32) as usize);
            let mut j = warp_id() as usize;
            while j < n {
                let mut s = 0.0f32;
                let mut c = lane * 8;
                while c < d {
                    let kv = load8_bf16(p.k_cache.wrapping_add(base + j * kw), c, d);
                    for (i, k) in kv.iter().enumerate() {
                        if c + i < d {
                            s += ld(qs, c + i) * k;
                        }
                    }
                    c += 256;
                }
                // Every lane holds the warp's sum.
                let s = warp_sum(s) * p.scale;
                if lane == 0 {
                    st(scores, j, s);
                }
                m = m.max(s);
                j += warps;
            }
            // The barrier in the block reduction orders the scores before they are read.
            let m = block_max(m, scratch);
            let mut total = 0.0f32;
            let mut j = t;
            while j < n {
                let e = exp_fast(ld(scores, j) - m);
                st(scores, j, e);
                total += e;
                j += blk;
            }
            let total = block_sum(total, scratch);
            // d <= MAX_HEAD_DIM: lane l holds channels 8l..8l + 8.
            let (c, w) = (lane * 8, warp_id() as usize);
            let mut acc = [0.0f32; 8];
            if c < d {
                let mut j = w;
                while j < n {
                    let (e, v) = (ld(scores, j), load8_bf16(p.v_cache.wrapping_add(base + j * kw), c, d));
                    for i in 0..8 {
                        acc[i] += e * v[i];
                    }
                    j += warps;
                }
            }
            let partial = scratch.wrapping_add(warps);
            for (i, &a) in acc.iter().enumerate() {
                if c + i < d {
                    st(partial, w * d + c + i, a);
                }
            }
            sync_threads();
            let mut i = t;
            while i < d {
                let mut acc = 0.0f32;
                for w in 0..warps {
                    acc += ld(partial, w * d + i);
                }
                st(p.out, r * p.heads as usize * d + h * d + i, f32_to_bf16(acc / total));
                i += blk;
            }
        }
    }
}
