//! Causal attention for many query rows on tensor cores (flash attention, docs/MATH.md
//! section 7): the same math as [`crate::attn`]'s kernel (grouped-query heads, no positional
//! encoding, scale 1/sqrt(head_dim), each row over its sequence's keys up to and including its
//! own position), computed a tile of query rows at a time against tiles of keys with an online
//! softmax, so no row's scores are ever stored whole.
//!
//! The keys and values are read from the cache (`[slots, max_len, kv_heads * head_dim]`), so
//! the step's new ones must be written there first (`attn_cache_write_bf16`); a sequence's
//! rows may continue a cached prefix (chunked prefill) — they attend over it the same way.
//!
//! # Work split
//! The host cuts the step's rows into query tiles ([`FlashTile`]): up to [`FLASH_ROWS`]
//! consecutive rows of one slot at consecutive positions. Block `t * heads + h` computes query
//! head h of tile t (the heads of a tile side by side, sharing its keys in L2): warp w its rows
//! `16 w .. 16 w + 16`, holding their Q fragments in registers. Key tiles of [`FLASH_KEYS`]
//! positions are staged in shared memory from 0 up to the tile's last row's position, in a ring
//! of [`FLASH_BUFFERS`] (the next key and value tiles load while this one is used); per key tile each
//! warp computes its 16 x 64 scores `S = Q Kᵀ` on tensor cores (keys past a row's position set
//! to -inf where the tile reaches the diagonal), updates each row's running max `m` of
//! `scale log2(e) S` and sum `l` (`O` rescaled by `2^(m_old - m_new)`), and adds `P V` with
//! `P = 2^(scale log2(e) S - m)` rounded to bf16 as the A operand (the one rounding this kernel adds to the
//! math: each weight's relative error at most 2^-9). Finally `O / l`, rounded to bf16, is
//! written to `out [rows, heads * head_dim]`.

use crate::KernelParams;
use crate::mma::tile_bytes;

/// Threads of a block: eight warps of 16 query rows.
pub const FLASH_BLOCK: u32 = 256;
/// Query rows of a tile (a block).
pub const FLASH_ROWS: u32 = 128;
/// Keys staged at a time.
pub const FLASH_KEYS: u32 = 64;
/// Keys staged at a time by the kernels for small blocks (`attn_flash_k32_bf16`,
/// `attn_flash_k32_d128_bf16`): their shared memory, [`flash_smem_bytes`]`(32)`, fits the 99 KiB
/// of an sm_12x block (DGX Spark), where 64 keys' does not.
pub const FLASH_KEYS_SMALL: u32 = 32;
/// Widest head the kernel takes (its Q fragments and output accumulators live in registers).
pub const FLASH_MAX_HEAD_DIM: u32 = 128;

/// A query tile: rows `row0 .. row0 + rows` of the step, all of slot `slot`, at positions
/// `pos0 .. pos0 + rows`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FlashTile {
    pub row0: u32,
    pub rows: u32,
    pub slot: u32,
    pub pos0: u32,
}

/// The flash attention launch.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct FlashParams {
    /// Row r's query heads at `q + r * q_stride`.
    pub q: *const u16,
    pub q_stride: u32,
    /// `[slots, max_len, kv_heads * head_dim]`, the step's keys and values already written.
    pub k_cache: *const u16,
    pub v_cache: *const u16,
    /// `[tiles]`.
    pub tiles: *const FlashTile,
    /// `[rows, heads * head_dim]`.
    pub out: *mut u16,
    pub heads: u32,
    pub kv_heads: u32,
    pub head_dim: u32,
    pub max_len: u32,
    pub scale: f32,
    /// 1: q and the caches 16-byte aligned, head_dim and q_stride multiples of 8, so tiles are
    /// staged 16 bytes at a time (`cp.async`); 0: element by element.
    pub vec: u32,
    /// Query tiles times heads: the work items (item i: tile `i / heads`, head `i % heads`).
    /// The `mma.sync` kernels take item `block_x`; the `wgmma` kernel's blocks (at most one an
    /// SM) loop over them.
    pub items: u32,
}

// SAFETY: #[repr(C)], Copy, only pointers, integers and floats.
unsafe impl KernelParams for FlashParams {}

/// Buffers of key and value tiles: the next one loads while this one is read, and a third
/// lets one barrier a key tile keep both apart (see the kernel).
pub const FLASH_BUFFERS: u32 = 3;

/// Dynamic shared memory of the flash kernels staging `keys` keys at a time: the Q tile and the
/// buffers of K and V tiles (139264 bytes at [`FLASH_KEYS`], 87040 at [`FLASH_KEYS_SMALL`]).
pub const fn flash_smem_bytes(keys: u32) -> u32 {
    tile_bytes(FLASH_ROWS, FLASH_MAX_HEAD_DIM) + 2 * FLASH_BUFFERS * tile_bytes(keys, FLASH_MAX_HEAD_DIM)
}

/// Threads of a block of the `wgmma` kernel: two warpgroups of 64 query rows, then one that
/// copies the key tiles.
pub const FLASH_WGMMA_BLOCK: u32 = 384;
/// Keys the `wgmma` kernel stages at a time.
pub const FLASH_WGMMA_KEYS: u32 = 128;
/// Key tiles in the `wgmma` kernel's ring.
pub const FLASH_WGMMA_STAGES: u32 = 3;

/// Dynamic shared memory of the `wgmma` kernel (`attn_flash_wgmma_d128_bf16`): room to align
/// to 1024 bytes, the Q tile and the ring's K and V tiles, 256 bytes a row, then two mbarriers
/// a stage (230448).
pub const fn flash_wgmma_smem_bytes() -> u32 {
    1024 + 256 * (FLASH_ROWS + 2 * FLASH_WGMMA_STAGES * FLASH_WGMMA_KEYS) + 16 * FLASH_WGMMA_STAGES
}

/// `v` reduced by `f` pairwise (a tree: independent operations side by side).
#[cfg(target_arch = "nvptx64")]
#[inline(always)]
fn tree<const N: usize>(mut v: [f32; N], f: impl Fn(f32, f32) -> f32) -> f32 {
    let mut n = N;
    while n > 1 {
        for i in 0..n / 2 {
            v[i] = f(v[2 * i], v[2 * i + 1]);
        }
        n /= 2;
    }
    v[0]
}

/// A key tile's step of the online softmax for one thread's two rows, in the accumulator
/// layout `mma.sync` m16n8 and `wgmma` share: element e of 8-key group nt of `s` (the scores)
/// and of `o` (the outputs) lies on row half e / 2, column `8 nt + acc_col(lane, e)`. With
/// `mask` (`(j0, row_pos)`: the tile's first key, the two rows' positions) the keys past a
/// row's position are masked; then the running max `m` (in units of the scaled scores, log2 e
/// folded in: weights `2^(scale s - m)`) and sum `l` updated, `o` rescaled, and the scores made
/// those weights. The four lanes of a quad hold a row's scores.
#[cfg(target_arch = "nvptx64")]
#[inline(always)]
fn online_softmax<const S: usize, const N: usize>(
    s: &mut [[f32; 4]; S],
    o: &mut [[f32; 4]; N],
    (m, l): (&mut [f32; 2], &mut [f32; 2]),
    scale: f32,
    mask: Option<(u32, [u32; 2])>,
) {
    use crate::device::{exp2_fast, fma, fmax, lane_id, warp_read};
    let lane = lane_id();
    if let Some((j0, row_pos)) = mask {
        for (nt, c) in s.iter_mut().enumerate() {
            for (e, v) in c.iter_mut().enumerate() {
                if j0 + 8 * nt as u32 + crate::mma::acc_col(lane, e as u32) > row_pos[e / 2] {
                    *v = f32::NEG_INFINITY;
                }
            }
        }
    }
    for r in 0..2 {
        let mx = tree(core::array::from_fn::<f32, S, _>(|nt| fmax(s[nt][2 * r], s[nt][2 * r + 1])), fmax);
        let mx = fmax(mx, warp_read(mx, lane ^ 1));
        let mx = fmax(mx, warp_read(mx, lane ^ 2));
        let new = fmax(m[r], mx * scale);
        let alpha = exp2_fast(m[r] - new);
        m[r] = new;
        for c in s.iter_mut() {
            c[2 * r] = exp2_fast(fma(c[2 * r], scale, -new));
            c[2 * r + 1] = exp2_fast(fma(c[2 * r + 1], scale, -new));
        }
        let sum = tree(core::array::from_fn::<f32, S, _>(|nt| s[nt][2 * r] + s[nt][2 * r + 1]), |a, b| a + b);
        l[r] = l[r] * alpha + sum;
        for c in o.iter_mut() {
            c[2 * r] *= alpha;
            c[2 * r + 1] *= alpha;
        }
    }
}

#[cfg(all(target_arch = "nvptx64", target_feature = "sm_90a"))]
mod wgmma;

#[cfg(target_arch = "nvptx64")]
mod kernels {
    use super::*;
    use crate::device::*;
    use crate::mma::{Tile, acc_to_a, commit, copy16, mma, smem_addr, staged_but, tile_stride};

    /// k steps (16 channels each) of the widest head.
    const DK: usize = (FLASH_MAX_HEAD_DIM / 16) as usize;
    /// 16 x 8 score tiles of a key tile of [`FLASH_KEYS`] and of [`FLASH_KEYS_SMALL`].
    const NS: usize = (FLASH_KEYS / 8) as usize;
    const NS_SMALL: usize = (FLASH_KEYS_SMALL / 8) as usize;

    /// Flash attention, [`FlashParams`], heads of 113 to 128 channels (eight k steps, known
    /// when compiled). Grid `(tiles * heads)`, block [`FLASH_BLOCK`], dynamic shared memory
    /// [`flash_smem_bytes`]`(FLASH_KEYS)`; the module docs say what a block does.
    #[unsafe(no_mangle)]
    pub unsafe extern "ptx-kernel" fn attn_flash_d128_bf16(p: FlashParams) {
        // SAFETY: the launch contract is the caller's.
        unsafe { flash::<true, NS>(p) }
    }

    /// As `attn_flash_d128_bf16`, for any head up to [`FLASH_MAX_HEAD_DIM`] channels.
    #[unsafe(no_mangle)]
    pub unsafe extern "ptx-kernel" fn attn_flash_bf16(p: FlashParams) {
        // SAFETY: the launch contract is the caller's.
        unsafe { flash::<false, NS>(p) }
    }

    /// As `attn_flash_d128_bf16`, [`FLASH_KEYS_SMALL`] keys at a time (dynamic shared memory
    /// [`flash_smem_bytes`]`(FLASH_KEYS_SMALL)`).
    #[unsafe(no_mangle)]
    pub unsafe extern "ptx-kernel" fn attn_flash_k32_d128_bf16(p: FlashParams) {
        // SAFETY: the launch contract is the caller's.
        unsafe { flash::<true, NS_SMALL>(p) }
    }

    /// As `attn_flash_bf16`, [`FLASH_KEYS_SMALL`] keys at a time (dynamic shared memory
    /// [`flash_smem_bytes`]`(FLASH_KEYS_SMALL)`).
    #[unsafe(no_mangle)]
    pub unsafe extern "ptx-kernel" fn attn_flash_k32_bf16(p: FlashParams) {
        // SAFETY: the launch contract is the caller's.
        unsafe { flash::<false, NS_SMALL>(p) }
    }

    /// The flash kernel over key tiles of `8 S` keys (`S` a power of two); with `EIGHT_STEPS`
    /// the head's k steps are [`DK`] (no run-time bound between the products, so they schedule
    /// as one block of code).
    ///
    /// # Safety
    /// The launch contract of host/src/attn.rs: tiles inside the rows and the caches, head_dim
    /// <= FLASH_MAX_HEAD_DIM (and above 112 with `EIGHT_STEPS`), vec only where aligned.
    #[inline(always)]
    unsafe fn flash<const EIGHT_STEPS: bool, const S: usize>(p: FlashParams) {
        grid_dependency_wait();
        let (t, h) = (block_x() / p.heads, block_x() % p.heads);
        let (tid, w, lane) = (thread_x(), warp_id(), lane_id());
        let d = p.head_dim;
        let dk = if EIGHT_STEPS { DK } else { d.div_ceil(16) as usize };
        let kw = (p.kv_heads * d) as usize;
        let kvh = h / (p.heads / p.kv_heads);
        let vec = p.vec != 0;
        let stride = tile_stride(FLASH_MAX_HEAD_DIM);
        let keys = 8 * S as u32;
        let (qsize, kvsize) = (tile_bytes(FLASH_ROWS, FLASH_MAX_HEAD_DIM), tile_bytes(keys, FLASH_MAX_HEAD_DIM));
        let qt = Tile { addr: smem_addr(0), stride };
        // Key and value tiles of buffer b.
        let kv_tiles = |b: u32| {
            let at = qsize + 2 * b * kvsize;
            (Tile { addr: smem_addr(at), stride }, Tile { addr: smem_addr(at + kvsize), stride })
        };
        let scale = p.scale * core::f32::consts::LOG2_E;
        // SAFETY: launch contract as the doc says; the tiles fit in flash_smem_bytes; `staged_but` separates each tile's staging from its reads. Key tile
        // jt + 1 is staged (at the top of key tile jt) into the buffer key tile jt - 2 was read
        // from: every warp read it before it reached the barrier of key tile jt - 1, which this
        // thread has passed.
        unsafe {
            let tile = ld(p.tiles, t as usize);
            let n_keys = tile.pos0 + tile.rows;
            let q = p.q.wrapping_add(tile.row0 as usize * p.q_stride as usize + (h * d) as usize);
            let cache = (tile.slot as usize * p.max_len as usize) * kw + (kvh * d) as usize;
            let (k_at, v_at) = (p.k_cache.wrapping_add(cache), p.v_cache.wrapping_add(cache));
            // Columns past head_dim zero-filled (the staging's geometry the same for every head).
            let stage = |t: Tile, rows: u32, src: *const u16, src_stride: usize, valid: u32| {
                t.stage(src, src_stride, (rows, FLASH_MAX_HEAD_DIM), (valid, d), vec, (tid, FLASH_BLOCK))
            };
            // With vec, this thread's chunks of a key tile: 16 bytes at rows `cr + 16 i`, columns
            // `cc .. cc + 8` (the same each tile: only the source moves on).
            let (cr, cc) = (tid / 16, 8 * (tid % 16));
            let (row_at, step) = (cr as usize * kw + cc as usize, 16 * kw);
            let stage_keys = |jt: u32| {
                let (kt, vt) = kv_tiles(jt % FLASH_BUFFERS);
                let j0 = jt * keys;
                let valid = (n_keys - j0).min(keys);
                let (ks, vs) = (k_at.wrapping_add(j0 as usize * kw), v_at.wrapping_add(j0 as usize * kw));
                if vec {
                    for i in 0..keys * 16 / FLASH_BLOCK {
                        let r = cr + 16 * i;
                        let (ok, at) = (r < valid && cc < d, row_at + i as usize * step);
                        copy16(kt.at(r, cc), if ok { ks.wrapping_add(at) } else { ks }, ok);
                        copy16(vt.at(r, cc), if ok { vs.wrapping_add(at) } else { vs }, ok);
                    }
                } else {
                    stage(kt, keys, ks, kw, valid);
                    stage(vt, keys, vs, kw, valid);
                }
                commit();
            };
            stage(qt, FLASH_ROWS, q, p.q_stride as usize, tile.rows);
            stage_keys(0);
            let key_tiles = n_keys.div_ceil(keys);
            // This lane's two rows (accumulator elements 0, 1 and 2, 3): their positions.
            let first = tile.pos0 + 16 * w;
            let row_pos = [first + lane / 4, first + lane / 4 + 8];
            let mut qf = [[0u32; 4]; DK];
            let mut o = [[0.0f32; 4]; 2 * DK];
            let (mut m, mut l) = ([f32::NEG_INFINITY; 2], [0.0f32; 2]);
            for jt in 0..key_tiles {
                if jt + 1 < key_tiles {
                    stage_keys(jt + 1);
                    staged_but::<1>();
                } else {
                    staged_but::<0>();
                }
                if jt == 0 {
                    for (kk, f) in qf.iter_mut().enumerate() {
                        if kk < dk {
                            *f = qt.a(16 * w, 16 * kk as u32);
                        }
                    }
                }
                let (kt, vt) = kv_tiles(jt % FLASH_BUFFERS);
                let j0 = jt * keys;
                // Warp-uniform: whether any of the warp's rows sees a key of this tile, and
                // whether some key of it lies past one of the warp's rows.
                if j0 <= first + 15 {
                    let diagonal = j0 + keys > first;
                    let mut s = [[0.0f32; 4]; S];
                    for (kk, f) in qf.iter().enumerate() {
                        if kk < dk {
                            for np in 0..S / 2 {
                                let b = kt.b_nk(16 * kk as u32, 16 * np as u32);
                                mma(&mut s[2 * np], *f, b[0]);
                                mma(&mut s[2 * np + 1], *f, b[1]);
                            }
                        }
                    }
                    online_softmax(&mut s, &mut o, (&mut m, &mut l), scale, diagonal.then_some((j0, row_pos)));
                    for kk in 0..S / 2 {
                        let a = acc_to_a(s[2 * kk], s[2 * kk + 1]);
                        for dp in 0..DK {
                            if dp < dk {
                                let b = vt.b_kn(16 * kk as u32, 16 * dp as u32);
                                mma(&mut o[2 * dp], a, b[0]);
                                mma(&mut o[2 * dp + 1], a, b[1]);
                            }
                        }
                    }
                }
            }
            let width = (p.heads * d) as usize;
            for r in 0..2 {
                let total = warp_sum_bits(l[r], 1, 2);
                let row = 16 * w + lane / 4 + 8 * r as u32;
                if row < tile.rows {
                    let at = (tile.row0 + row) as usize * width + (h * d) as usize;
                    for (nt, c) in o.iter().enumerate() {
                        for e in 0..2 {
                            let col = 8 * nt as u32 + 2 * (lane % 4) + e;
                            if col < d {
                                st(p.out, at + col as usize, f32_to_bf16(c[2 * r + e as usize] / total));
                            }
                        }
                    }
                }
            }
        }
    }
}
