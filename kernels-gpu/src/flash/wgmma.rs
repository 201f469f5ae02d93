//! The flash kernel on warpgroup matrix products (`wgmma`, sm_90a PTX only), heads of exactly
//! 128 channels, q and the caches 16-byte aligned: the parent's math and work items (a query
//! tile of [`FLASH_ROWS`] rows and a head), in two warpgroups of 64 rows each and key tiles of
//! [`FLASH_WGMMA_KEYS`].
//!
//! Shared memory (from a 1024-byte aligned byte): the Q tile, then a ring of
//! [`FLASH_WGMMA_STAGES`] K and V tiles, then two mbarriers a stage. Each tile is rows of 256
//! bytes (128 bf16 channels) in two panels: channels `64 p .. 64 p + 64` of every row in panel
//! p, rows of 128 bytes in [`crate::swizzle_128`]'s layout (the one every `wgmma` operand here
//! is read in). Q and K are read K-major (k the channels), as the GEMMs' tiles; V is read
//! MN-major (its rows run along k, the keys), the transposed form `wgmma` has for 16-bit
//! operands ([`crate::swizzle_128_desc_mn`], the next 64 channels a panel further on), so no
//! thread moves V's elements around.
//!
//! Three warpgroups: two consumers of 64 query rows each and a producer. The producer copies
//! each key tile's K and V into the ring (`cp.async`, 16 bytes a copy) once every consumer warp
//! is done with the tile that stage held (the stage's `empty` mbarrier), and its copies'
//! landing completes the stage's `full` mbarrier (`cp.async.mbarrier.arrive.noinc`); the
//! consumers wait for `full`, so neither waits for the other at a block barrier. A key tile of
//! a consumer: its 64 x 128 scores `S = Q Kᵀ` (8 k steps over the channels,
//! [`products_k128`]), the keys past each row's position masked on the diagonal, the running
//! max and sum updated and `O` rescaled exactly as the parent kernel, `P` rounded to bf16 in
//! registers (the accumulators of 16 keys are step kk's A fragment as they are) and `O += P V`
//! (8 k steps over the keys, [`products_regs_k128`]). `setmaxnreg` gives the producer's
//! registers to the consumers.
//!
//! The blocks are persistent, one an SM: each takes one work item (a query tile and head) of
//! every `grid` in turn, in a snake (round k forward, round k + 1 backward: the items come
//! heaviest first, so each block's rounds pair heavier with lighter), the producer running on
//! into the next item's key tiles through the same ring while the consumers finish the last.
//! Each consumer copies its own 64 rows of the next item's Q between two passes of its
//! warpgroup's barrier (`bar.sync 1 + g`): the first after every one of its warps waited for
//! its products, the second after the copies and their proxy fence.

use super::*;
use crate::device::*;
use crate::mma::{copied, copy16, pack, smem_addr};
use crate::wgmma::{acc_col, acc_row, products_k128, products_regs_k128, set_max_regs};
use crate::{swizzle_128, swizzle_128_desc, swizzle_128_desc_mn};

/// Registers (`setmaxnreg`) of a producer thread and of a consumer thread: 128 x 56 + 256 x
/// 224 of the 65536 an SM has.
const PRODUCER_REGS: u32 = 56;
const CONSUMER_REGS: u32 = 224;

/// Bytes of one panel of a tile of `rows` rows (64 channels of each, 128 bytes a row).
const fn panel(rows: u32) -> u32 {
    rows * 128
}

/// Flash attention on `wgmma`, [`FlashParams`] with head_dim 128 and `vec` 1. Grid at most
/// `items` blocks (one an SM: the host gives it as many as the GPU has SMs), each taking one
/// item of every `grid` in turn (a snake: `block_x` forward, then backward from the end of the
/// next round); block [`FLASH_WGMMA_BLOCK`], dynamic shared memory
/// [`flash_wgmma_smem_bytes`]; sm_90a only. The module docs say what a block does.
///
/// # Safety
/// The parent's launch contract, with head_dim 128, q, q_stride and the caches 16-byte aligned.
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn attn_flash_wgmma_d128_bf16(p: FlashParams) {
    grid_dependency_wait();
    let tid = thread_x();
    let (w, lane) = (warp_id(), lane_id());
    let (g, wi) = (w / 4, w % 4);
    let kw = (p.kv_heads * 128) as usize;
    let keys = FLASH_WGMMA_KEYS;
    let stages = FLASH_WGMMA_STAGES;
    let base = smem_addr(0);
    let q_at = base.next_multiple_of(1024);
    let (qp, kp) = (panel(FLASH_ROWS), panel(keys));
    // K and V tiles of stage s (two panels each), then the mbarriers: full[s] (the producer's
    // copies of a key tile landed), empty[s] (every consumer warp done reading it).
    let kv_at = |s: u32| {
        let at = q_at + 2 * qp + 4 * s * kp;
        (at, at + 2 * kp)
    };
    let full = |s: u32| q_at + 2 * qp + 4 * stages * kp + 8 * s;
    let empty = |s: u32| full(stages) + 8 * s;
    let scale = p.scale * core::f32::consts::LOG2_E;
    // Shared address of 16-byte chunk c (panel c / 8, chunk c % 8 of its row) of `row`.
    let chunk = |tile: u32, rows: u32, row: u32, c: u32| tile + (c / 8) * panel(rows) + swizzle_128(row, c % 8);
    // Item i's query tile, its head and its kv head's first channel in the caches' rows.
    let item = |i: u32| {
        let (t, h) = (i / p.heads, i % p.heads);
        // SAFETY: t is below the tiles (items = tiles x heads, the launch contract).
        let tile = unsafe { ld(p.tiles, t as usize) };
        let cache = (tile.slot as usize * p.max_len as usize) * kw + (h / (p.heads / p.kv_heads) * 128) as usize;
        (tile, h, cache)
    };
    // This block's items, in rounds of `grid`: forward in even rounds, backward in odd ones (a
    // snake: the items come heaviest first, so a block's rounds pair heavier with lighter).
    let grid = grid_dim_x();
    let mine = || {
        let b = block_x();
        (0..p.items.div_ceil(grid))
            .map(move |k| if k % 2 == 0 { k * grid + b } else { (k + 1) * grid - 1 - b })
            .filter(move |&i| i < p.items)
    };
    // SAFETY: launch contract as the doc says; the tiles and mbarriers fit in
    // flash_wgmma_smem_bytes (1024 bytes of room to align them); the mbarriers are initialized
    // and published by the block barrier before any use; a key tile's copies are read only
    // after its full phase completed and the reader's proxy fence, and copied again only after
    // its empty phase (every consumer warp's products on it waited for) completed; a
    // warpgroup's Q rows are copied only after its barrier that follows every one of its
    // warps' wait for the products of the item before, and read after the barrier that
    // follows the copies and their proxy fence.
    unsafe {
        if tid == 0 {
            for s in 0..stages {
                mbar_init(full(s), 128);
                mbar_init(empty(s), 8);
            }
            fence_mbar_init();
        }
        sync_threads();
        if g == 2 {
            // The producer warpgroup: thread 256 + i copies chunk `i % 16` of rows `i / 16 + 8
            // j` of each key tile's K and V, the items' key tiles one after another through
            // the ring (n: the key tiles this block copied before).
            set_max_regs::<false, PRODUCER_REGS>();
            let (r, c) = ((tid - 256) / 16, tid % 16);
            let mut n = 0u32;
            for i in mine() {
                let (tile, _, cache) = item(i);
                let (k_at, v_at) = (p.k_cache.wrapping_add(cache), p.v_cache.wrapping_add(cache));
                let n_keys = tile.pos0 + tile.rows;
                for jt in 0..n_keys.div_ceil(keys) {
                    let s = n % stages;
                    if n >= stages {
                        mbar_wait(empty(s), (n / stages - 1) % 2);
                    }
                    let (kt, vt) = kv_at(s);
                    let j0 = jt * keys;
                    for k in 0..keys / 8 {
                        let row = r + 8 * k;
                        let ok = j0 + row < n_keys;
                        let at = (j0 + row) as usize * kw + 8 * c as usize;
                        copy16(chunk(kt, keys, row, c), if ok { k_at.wrapping_add(at) } else { k_at }, ok);
                        copy16(chunk(vt, keys, row, c), if ok { v_at.wrapping_add(at) } else { v_at }, ok);
                    }
                    mbar_arrive_copies(full(s));
                    n += 1;
                }
            }
            copied();
            return;
        }
        set_max_regs::<true, CONSUMER_REGS>();
        // The warpgroup's Q rows `64 g ..`: thread tid copies chunk `tid % 16` of rows `64 g +
        // (tid % 128) / 16 + 8 i`. Its accumulators 0, 1 and 2, 3 lie on rows `acc_row`.
        let (qr, qc) = (64 * g + (tid % 128) / 16, tid % 16);
        let rows_at = [acc_row(wi, lane, 0), acc_row(wi, lane, 2)];
        // The Q descriptors of the 8 k steps (channels 16 kk ..: panel kk / 4, 32 bytes a step).
        let qd: [u64; 8] = core::array::from_fn(|kk| {
            swizzle_128_desc(q_at + (kk as u32 / 4) * qp + 64 * g * 128 + 32 * (kk as u32 % 4))
        });
        let width = (p.heads * 128) as usize;
        let mut n = 0u32;
        for i in mine() {
            let (tile, h, _) = item(i);
            let n_keys = tile.pos0 + tile.rows;
            sync_named(1 + g, 128);
            let q = p.q.wrapping_add(tile.row0 as usize * p.q_stride as usize + (h * 128) as usize);
            for k in 0..8 {
                let row = qr + 8 * k;
                let ok = row < tile.rows;
                let src = q.wrapping_add(row as usize * p.q_stride as usize + 8 * qc as usize);
                copy16(chunk(q_at, FLASH_ROWS, row, qc), if ok { src } else { p.q }, ok);
            }
            copied();
            fence_async_shared();
            sync_named(1 + g, 128);
            // Positions of the warpgroup's first row and of this thread's two.
            let first = tile.pos0 + 64 * g;
            let row_pos = [first + rows_at[0], first + rows_at[1]];
            let active = 64 * g < tile.rows;
            let mut o = [0.0f32; 64];
            let (mut m, mut l) = ([f32::NEG_INFINITY; 2], [0.0f32; 2]);
            for jt in 0..n_keys.div_ceil(keys) {
                let s = n % stages;
                mbar_wait(full(s), (n / stages) % 2);
                let j0 = jt * keys;
                // Warpgroup-uniform: whether any of its rows sees a key of this tile, and
                // whether a key of it lies past one of its rows.
                if active && j0 <= first + 63 {
                    fence_async_shared();
                    let mask = (j0 + keys - 1 > first).then_some((j0, row_pos));
                    attend(&mut o, (&mut m, &mut l), qd, kv_at(s), (scale, mask));
                }
                mbar_arrive_warp(empty(s));
                n += 1;
            }
            if active {
                for rh in 0..2u32 {
                    let total = warp_sum_bits(l[rh as usize], 1, 2);
                    let row = 64 * g + acc_row(wi, lane, 2 * rh);
                    if row < tile.rows {
                        let at = (tile.row0 + row) as usize * width + (h * 128) as usize;
                        for q in 0..16u32 {
                            let a = 4 * q + 2 * rh;
                            let v = pack(o[a as usize] / total, o[a as usize + 1] / total);
                            st(p.out.wrapping_add(at + acc_col(lane, a) as usize) as *mut u32, 0, v);
                        }
                    }
                }
            }
        }
    }
}

/// One key tile of a warpgroup (the module docs): its scores against the K tile at `kv.0`,
/// masked past each row's position where `mask` is given (`(j0, row_pos)`: the tile's first
/// key, this thread's two rows' positions, as [`online_softmax`] takes it), the running max
/// `m` and sum `l` updated and `o` rescaled, then `o += P V` with the V tile at `kv.1`.
///
/// # Safety
/// The whole warpgroup calls it in uniform flow, the tiles complete and fenced to the async
/// proxy.
#[inline(always)]
unsafe fn attend(
    o: &mut [f32; 64],
    (m, l): (&mut [f32; 2], &mut [f32; 2]),
    qd: [u64; 8],
    (kt, vt): (u32, u32),
    (scale, mask): (f32, Option<(u32, [u32; 2])>),
) {
    let kp = panel(FLASH_WGMMA_KEYS);
    let kd: [u64; 8] = core::array::from_fn(|kk| swizzle_128_desc(kt + (kk as u32 / 4) * kp + 32 * (kk as u32 % 4)));
    let mut s = [0.0f32; 64];
    // SAFETY: forwarded.
    unsafe { products_k128(&mut s, qd, kd) };
    online_softmax(quads(&mut s), quads(o), (m, l), scale, mask);
    // Keys 16 kk .. + 16: accumulators 8 kk .. 8 kk + 8 (columns 16 kk + 2 (lane % 4) and 8
    // further on, rows lane / 4 and 8 further on), in pairs: step kk's fragment is pairs
    // 4 kk .. 4 kk + 4, as they are.
    let pf: [u32; 32] = core::array::from_fn(|i| pack(s[2 * i], s[2 * i + 1]));
    let vd: [u64; 8] = core::array::from_fn(|kk| swizzle_128_desc_mn(vt + 16 * kk as u32 * 128, kp));
    // SAFETY: forwarded.
    unsafe { products_regs_k128(o, &pf, vd) };
}

/// A warpgroup's 64 accumulators as the 16 groups of 4 (8 columns each) that the parent's
/// [`online_softmax`] takes: accumulator `4 nt + e` is element e of group nt (`acc_col`).
#[inline(always)]
fn quads(a: &mut [f32; 64]) -> &mut [[f32; 4]; 16] {
    // SAFETY: the same 256 bytes, 4-byte aligned either way.
    unsafe { &mut *(a as *mut [f32; 64]).cast::<[[f32; 4]; 16]>() }
}
