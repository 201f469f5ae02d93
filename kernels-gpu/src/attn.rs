//! Causal attention over a per-slot KV cache (docs/MATH.md section 7): grouped-query heads, no
//! positional encoding, scale 1/sqrt(head_dim). Two launches: the step's new keys and values
//! are written into the cache, then every (row, head) attends over its sequence's keys up to
//! and including its own position; where each row has a slot of its own (decode rows), one:
//! the attention reads each row's own key and value from the step's and writes them.
//!
//! A row's keys are split over blocks ([`split_keys`] each, at most [`MAX_SPLITS`] blocks a
//! row and head, by the cache's length), so a long context is read by many blocks at once:
//! each block writes its part's softmax (maximum, sum, unnormalized output) and a combine
//! launch ([`attn_combine_bf16`]) merges the parts. A cache of at most [`MIN_SPLIT_KEYS`]
//! positions takes one block a row and head, which writes the output itself.
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
    /// 1: every row's slot is its own (decode rows), so a row's keys before its position are
    /// in the cache and its own key and value are only in `k` and `v`: [`attn_bf16`] reads
    /// them there and writes them into the caches itself (no cache-write launch). 0: the
    /// cache-write launch ran before.
    pub own_rows: u32,
    /// Keys a block takes ([`split_keys`] of `max_len`) and the blocks a row and head's keys
    /// are split over (`ceil(max_len / split_keys)`).
    pub split_keys: u32,
    pub splits: u32,
    /// With `splits > 1`, `[rows, heads, splits, head_dim + 2]`: each part's unnormalized
    /// output, then its maximum score and its sum of exponentials (0 for a part past the
    /// row's keys, whose other values are not written).
    pub partial: *mut f32,
}

/// Most blocks one row and head's keys are split over.
pub const MAX_SPLITS: u32 = 32;

/// Fewest keys a block of a split row takes.
pub const MIN_SPLIT_KEYS: u32 = 512;

/// Keys a block takes in a cache of `max_len` positions: all of them up to [`MIN_SPLIT_KEYS`],
/// else the share of [`MAX_SPLITS`] blocks, at least [`MIN_SPLIT_KEYS`].
pub const fn split_keys(max_len: u32) -> u32 {
    let share = max_len.div_ceil(MAX_SPLITS);
    if max_len <= MIN_SPLIT_KEYS {
        max_len
    } else if share < MIN_SPLIT_KEYS {
        MIN_SPLIT_KEYS
    } else {
        share
    }
}

// SAFETY: #[repr(C)], Copy, only pointers, integers and floats.
unsafe impl KernelParams for AttnParams {}

/// Largest head the attention kernel takes (a lane holds 8 of its channels).
pub const MAX_HEAD_DIM: u32 = 256;

/// Dynamic shared memory of `attn_bf16` taking `keys` keys a block ([`split_keys`]): a score
/// per key, reduction scratch, and each warp's partial output head.
pub const fn smem_bytes(head_dim: u32, keys: u32) -> u32 {
    // Saturating: a block of 2^30 keys or more asks for u32::MAX bytes, which the launch
    // refuses, rather than a wrapped small size.
    keys.saturating_add(ATTN_BLOCK / 32).saturating_add((ATTN_BLOCK / 32).saturating_mul(head_dim)).saturating_mul(4)
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

    /// Keys (or value rows) a lane loads per pass of [`attn_bf16`]: all in flight at once.
    const KEYS_PER_PASS: usize = 4;

    /// Attention, [`AttnParams`], after the cache write (or, with `own_rows`, instead of it:
    /// row r's key and value at its position come from k and v, and the blocks of each kv
    /// head's first query head that hold that position write them into the caches). Grid
    /// `(rows, heads, splits)`, block [`ATTN_BLOCK`], dynamic shared memory
    /// `smem_bytes(head_dim, split_keys)`. Block (r, h, s) takes keys `s * split_keys..` up to
    /// the next part or the row's own position: `lanes` = ceil(head_dim / 8) rounded up to a
    /// power of two lanes hold a key row (8 channels each, 16-byte loads), so a warp takes
    /// `32 / lanes` keys side by side: key j goes to warp `(j / per) % warps`, lane group
    /// `j % per` (`per = 32 / lanes`), and each lane has [`KEYS_PER_PASS`] keys' loads in
    /// flight at once. Scores (the lane group's sum of its lanes' products, times the scale),
    /// softmax with block reductions, then the value rows weighted the same way, summed per
    /// lane, across the lane groups of a warp, then one thread per output channel adds the
    /// warps' sums in order: the output (one part), or the part's unnormalized output, maximum
    /// and sum into `partial` (several; a part past the row's keys writes its sum as 0).
    #[unsafe(no_mangle)]
    pub unsafe extern "ptx-kernel" fn attn_bf16(p: AttnParams) {
        grid_dependency_wait();
        let (r, h, part) = (block_x() as usize, block_y() as usize, block_z() as usize);
        let t = thread_x() as usize;
        let (d, blk) = (p.head_dim as usize, ATTN_BLOCK as usize);
        let kw = p.kv_heads as usize * d;
        let kvh = h / (p.heads / p.kv_heads) as usize;
        let lanes = d.div_ceil(8).next_power_of_two();
        let per = 32 / lanes;
        let warps = (ATTN_BLOCK / 32) as usize;
        let (lane, w) = (lane_id() as usize, warp_id() as usize);
        // This lane's channels c..c + 8 (none when c >= d) of keys `b + group + u * stride`
        // for the warp's bases b (warp-uniform, so every lane takes part in each shuffle).
        let (c, group, stride) = (lane % lanes * 8, lane / lanes, warps * per);
        // SAFETY: launch contract checked by host/src/attn.rs (head_dim <= MAX_HEAD_DIM,
        // split_keys and splits as split_keys gives them, partial of its extent when split);
        // shared memory as smem_bytes; barriers separate writes and reads of it.
        unsafe {
            let n = ld(p.pos, r) as usize + 1;
            // This block's keys lo..hi.
            let lo = part * p.split_keys as usize;
            let hi = n.min(lo + p.split_keys as usize);
            let at = ((r * p.heads as usize + h) * p.splits as usize + part) * (d + 2);
            if lo >= n {
                // A part past the row's keys (only when split): its sum, 0, says so.
                if t == 0 {
                    st(p.partial, at + d + 1, 0.0);
                }
                return;
            }
            let smem = dyn_smem_f32();
            let scratch = smem.wrapping_add(p.split_keys as usize);
            let q = p.q.wrapping_add(r * p.q_stride as usize + h * d);
            let qv = if c < d { load8_bf16(q, c, d) } else { [0.0; 8] };
            let base = ld(p.slot, r) as usize * p.max_len as usize * kw + kvh * d;
            let own = p.own_rows != 0;
            let row = r * p.kv_stride as usize + kvh * d;
            if own && h % (p.heads / p.kv_heads) as usize == 0 && hi == n {
                // This row's key and value into the caches: no block of this launch reads
                // them there (no other row has this slot).
                let at = base + (n - 1) * kw;
                let mut i = t;
                while i < d {
                    st(p.k_cache, at + i, ld(p.k, row + i));
                    st(p.v_cache, at + i, ld(p.v, row + i));
                    i += blk;
                }
            }
            // Key j's chunk of this lane (zeros past hi or d); with own_rows, the row's own
            // from k or v (`new`).
            let chunk = |(cache, new): (*const u16, *const u16), j: usize| {
                if j >= hi || c >= d {
                    [0.0; 8]
                } else if own && j == n - 1 {
                    load8_bf16(new.wrapping_add(row), c, d)
                } else {
                    load8_bf16(cache.wrapping_add(base + j * kw), c, d)
                }
            };
            let mut m = f32::NEG_INFINITY;
            let mut b = lo + w * per;
            while b < hi {
                let j0 = b + group;
                let kv: [[f32; 8]; KEYS_PER_PASS] = core::array::from_fn(|u| chunk((p.k_cache, p.k), j0 + u * stride));
                for (u, kv) in kv.iter().enumerate() {
                    let mut s = 0.0f32;
                    for i in 0..8 {
                        s += qv[i] * kv[i];
                    }
                    // Every lane of the group holds the group's sum.
                    let s = warp_sum_bits(s, 1, lanes as u32 / 2) * p.scale;
                    let j = j0 + u * stride;
                    if j < hi {
                        if lane % lanes == 0 {
                            st(smem, j - lo, s);
                        }
                        m = m.max(s);
                    }
                }
                b += KEYS_PER_PASS * stride;
            }
            // The barrier in the block reduction orders the scores before they are read.
            let m = block_max(m, scratch);
            let mut total = 0.0f32;
            let mut j = lo + t;
            while j < hi {
                let e = exp_fast(ld(smem, j - lo) - m);
                st(smem, j - lo, e);
                total += e;
                j += blk;
            }
            let total = block_sum(total, scratch);
            let mut acc = [0.0f32; 8];
            let mut b = lo + w * per;
            while b < hi {
                let j0 = b + group;
                let v: [[f32; 8]; KEYS_PER_PASS] = core::array::from_fn(|u| chunk((p.v_cache, p.v), j0 + u * stride));
                for (u, v) in v.iter().enumerate() {
                    let j = j0 + u * stride;
                    let e = if j < hi { ld(smem, j - lo) } else { 0.0 };
                    for i in 0..8 {
                        acc[i] += e * v[i];
                    }
                }
                b += KEYS_PER_PASS * stride;
            }
            // The warp's lane groups' sums, in lane group 0.
            for a in acc.iter_mut() {
                *a = warp_sum_bits(*a, lanes as u32, 16);
            }
            let partial = scratch.wrapping_add(warps);
            if lane < lanes {
                for (i, &a) in acc.iter().enumerate() {
                    if c + i < d {
                        st(partial, w * d + c + i, a);
                    }
                }
            }
            sync_threads();
            let mut i = t;
            while i < d {
                let mut acc = 0.0f32;
                for w in 0..warps {
                    acc += ld(partial, w * d + i);
                }
                if p.splits == 1 {
                    st(p.out, r * p.heads as usize * d + h * d + i, f32_to_bf16(acc / total));
                } else {
                    st(p.partial, at + i, acc);
                }
                i += blk;
            }
            if p.splits > 1 && t == 0 {
                st(p.partial, at + d, m);
                st(p.partial, at + d + 1, total);
            }
        }
    }

    /// The parts of a split [`attn_bf16`] merged, [`AttnParams`] (its `partial`, `out`, the
    /// shape). Grid `(rows, heads)`, block [`ATTN_BLOCK`]: each thread takes output channels
    /// and weighs each written part (sum above 0) by `exp(its maximum - the largest)`, so the
    /// output is the softmax over all the row's keys.
    #[unsafe(no_mangle)]
    pub unsafe extern "ptx-kernel" fn attn_combine_bf16(p: AttnParams) {
        grid_dependency_wait();
        let (r, h) = (block_x() as usize, block_y() as usize);
        let (d, splits) = (p.head_dim as usize, p.splits as usize);
        let at = (r * p.heads as usize + h) * splits * (d + 2);
        // SAFETY: launch contract checked by host/src/attn.rs (partial of rows * heads * splits
        // * (head_dim + 2), out of rows * heads * head_dim); attn_bf16 wrote every part's sum,
        // and the other values of each part whose sum is above 0.
        unsafe {
            let sum = |s: usize| ld(p.partial, at + s * (d + 2) + d + 1);
            let max = |s: usize| ld(p.partial, at + s * (d + 2) + d);
            let mut top = f32::NEG_INFINITY;
            for s in 0..splits {
                if sum(s) > 0.0 {
                    top = top.max(max(s));
                }
            }
            let mut total = 0.0f32;
            for s in 0..splits {
                if sum(s) > 0.0 {
                    total += sum(s) * exp_fast(max(s) - top);
                }
            }
            let mut i = thread_x() as usize;
            while i < d {
                let mut acc = 0.0f32;
                for s in 0..splits {
                    if sum(s) > 0.0 {
                        acc += ld(p.partial, at + s * (d + 2) + i) * exp_fast(max(s) - top);
                    }
                }
                st(p.out, r * p.heads as usize * d + h * d + i, f32_to_bf16(acc / total));
                i += ATTN_BLOCK as usize;
            }
        }
    }
}
