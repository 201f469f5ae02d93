//! The device code of the tensor-core GEMM family (nvptx64 only): its kernels and their helpers.
//! Launch parameters, sizes and the math the host shares are in `../grouped.rs`.

use super::*;
use crate::device::*;
use crate::mma::{
    Tile, acc_col, acc_row, commit, copy16_l2, mma, mma_e4m3, pack, smem_addr, staged_but, tile_stride, unpack,
};

#[cfg(target_feature = "sm_90a")]
mod wgmma;

/// What a launch of the generic kernel multiplies, from any of the params structs (byte
/// pointers; the absent parts null, which the entry points fix at compile time).
#[derive(Clone, Copy)]
struct Job {
    /// Rows of `k` elements.
    a: *const u8,
    /// Grouped row -> its row of `a`; null: row j itself.
    token: *const u32,
    /// A scale per row of the grouped order; null: none.
    a_scale: *const f32,
    w: *const u8,
    /// A scale per matrix; null: none.
    w_scale: *const f32,
    /// `[experts + 1]`; null: one matrix over `rows` rows.
    offsets: *const u32,
    out: *mut u16,
    /// Null: results to `out`; else as e4m3 codes of `next_scale[e]` ([`GroupedFp8Params`]).
    codes: *mut u8,
    codes_scale: *mut f32,
    next_scale: *const f32,
    experts: u32,
    rows: u32,
    n: u32,
    k: u32,
    relu2: u32,
}

/// Grouped bf16 projection, [`GroupedParams`], [`GROUPED_M`]-row tiles. Grid
/// `(grouped_m_tiles(entries, experts, GROUPED_M), ceil(n / GROUPED_N))`, block
/// [`GROUPED_BLOCK`], dynamic shared memory `grouped_smem_bytes(GROUPED_M, GROUPED_K_BYTES)`;
/// the module docs say what a block does.
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn moe_grouped_bf16(p: GroupedParams) {
    // SAFETY: the launch contract is the caller's.
    unsafe { grouped::<false, 2, GROUPED_K_BYTES>(bf16_job(p)) }
}

/// As `moe_grouped_bf16` with [`GROUPED_M_WIDE`]-row tiles and [`GROUPED_K_BYTES_WIDE`]
/// staged at a time (grid and shared memory of those sizes).
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn moe_grouped_m128_bf16(p: GroupedParams) {
    // SAFETY: the launch contract is the caller's.
    unsafe { grouped::<false, 4, GROUPED_K_BYTES_WIDE>(bf16_job(p)) }
}

/// Grouped NVFP4 projection (weight-only), [`GroupedNvfp4Params`], on `mma.sync`: grid and
/// block as `moe_grouped_bf16`'s, dynamic shared memory [`NVFP4_SMEM_BYTES`].
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn moe_grouped_nvfp4(p: GroupedNvfp4Params) {
    // SAFETY: the launch contract is the caller's.
    unsafe { grouped_nvfp4(nvfp4_job(p)) }
}

/// Grouped FP8 projection, [`GroupedFp8Params`]; grid, block and shared memory as
/// `moe_grouped_bf16`'s.
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn moe_grouped_fp8(p: GroupedFp8Params) {
    // SAFETY: the launch contract is the caller's.
    unsafe { grouped::<true, 2, GROUPED_K_BYTES>(fp8_job(p)) }
}

/// bf16 product of rows by one matrix, [`GemmParams`]. Grid `(ceil(rows / GROUPED_M),
/// ceil(n / GROUPED_N))`, block and shared memory as `moe_grouped_bf16`'s.
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn gemm_bf16(p: GemmParams) {
    // SAFETY: the launch contract is the caller's.
    unsafe { grouped::<false, 2, GROUPED_K_BYTES>(gemm_bf16_job(p)) }
}

/// As `gemm_bf16` with [`GROUPED_M_WIDE`]-row tiles (grid x `ceil(rows / GROUPED_M_WIDE)`)
/// and `moe_grouped_m128_bf16`'s shared memory.
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn gemm_m128_bf16(p: GemmParams) {
    // SAFETY: the launch contract is the caller's.
    unsafe { grouped::<false, 4, GROUPED_K_BYTES_WIDE>(gemm_bf16_job(p)) }
}

/// FP8 product of rows by one matrix, [`GemmFp8Params`]. Grid `(ceil(rows / GROUPED_M),
/// ceil(n / GROUPED_N))`, block and shared memory as `moe_grouped_bf16`'s.
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn gemm_fp8(p: GemmFp8Params) {
    // SAFETY: the launch contract is the caller's.
    unsafe { grouped::<true, 2, GROUPED_K_BYTES>(gemm_job(p)) }
}

impl Job {
    /// One matrix `w` over `rows` rows of `a`, no gather, no scales.
    #[inline(always)]
    fn plain(a: *const u8, w: *const u8, out: *mut u16, (rows, n, k, relu2): (u32, u32, u32, u32)) -> Job {
        let null = core::ptr::null();
        Job {
            a,
            token: null as _,
            a_scale: null as _,
            w,
            w_scale: null as _,
            offsets: null as _,
            out,
            codes: null as _,
            codes_scale: null as _,
            next_scale: null,
            experts: 1,
            rows,
            n,
            k,
            relu2,
        }
    }
}

#[inline(always)]
fn bf16_job(p: GroupedParams) -> Job {
    let job = Job::plain(p.a as *const u8, p.w as *const u8, p.out, (0, p.n, p.k, p.relu2));
    Job { token: p.token, offsets: p.offsets, experts: p.experts, ..job }
}

#[inline(always)]
fn fp8_job(p: GroupedFp8Params) -> Job {
    let job = Job::plain(p.a, p.w, p.out, (0, p.n, p.k, p.relu2));
    Job {
        a_scale: p.a_scale,
        w_scale: p.w_scale,
        offsets: p.offsets,
        experts: p.experts,
        codes: p.codes,
        codes_scale: p.codes_scale,
        next_scale: p.next_scale,
        ..job
    }
}

#[inline(always)]
fn nvfp4_job(p: GroupedNvfp4Params) -> Job {
    let job = Job::plain(p.a as *const u8, p.w, p.out, (0, p.n, p.k, p.relu2));
    Job { token: p.token, w_scale: p.global, offsets: p.offsets, experts: p.experts, ..job }
}

#[inline(always)]
fn gemm_bf16_job(p: GemmParams) -> Job {
    Job::plain(p.a as *const u8, p.w as *const u8, p.out, (p.rows, p.n, p.k, p.relu2))
}

#[inline(always)]
fn gemm_job(p: GemmFp8Params) -> Job {
    let job = Job::plain(p.a, p.w, p.out, (p.rows, p.n, p.k, p.relu2));
    Job { a_scale: p.a_scale, w_scale: p.w_scale, ..job }
}

/// Row tile i's matrix and first row in the grouped order, for tiles of `bm` rows: lane l of
/// warp 0 sums the tiles of experts `l per .. (l + 1) per`, a prefix sum over the lanes
/// finds whose tiles hold tile i; written to `found` (`u32::MAX` first: no tile). One
/// matrix: matrix 0, rows from `bm i`. Every thread gets it (a barrier inside: call it in
/// uniform flow).
///
/// # Safety
/// `found` two words of the block's shared memory; `j.offsets` (where given) `experts + 1`
/// readable offsets.
#[inline(always)]
unsafe fn block_tile(j: &Job, i: u32, bm: u32, found: *mut u32) -> (u32, u32) {
    if j.offsets.is_null() {
        return (0, i * bm);
    }
    let lane = lane_id();
    // SAFETY: as the doc says.
    unsafe {
        if warp_id() == 0 {
            let per = j.experts.div_ceil(32);
            let (e0, e1) = ((lane * per).min(j.experts), ((lane + 1) * per).min(j.experts));
            let tiles = |e: u32| (ld(j.offsets, e as usize + 1) - ld(j.offsets, e as usize)).div_ceil(bm);
            let mut mine = 0u64;
            for e in e0..e1 {
                mine += tiles(e) as u64;
            }
            let end = warp_inclusive_sum_u64(mine);
            let (i, mut at) = (i as u64, end - mine);
            if lane == 0 {
                st(found, 0, u32::MAX);
            }
            sync_warp();
            if at <= i && i < end {
                for e in e0..e1 {
                    let t = tiles(e) as u64;
                    if at <= i && i < at + t {
                        st(found, 0, e);
                        st(found, 1, ((i - at) as u32) * bm);
                    }
                    at += t;
                }
            }
        }
        sync_threads();
        (ld(found, 0), ld(found, 1))
    }
}

/// A block's output tile: its matrix `e`, its first row `lo` in the grouped order and `rows`
/// real rows from there, its first column `n0` and `cols` real columns.
struct BlockTile {
    e: u32,
    lo: u32,
    rows: u32,
    n0: u32,
    cols: u32,
}

impl BlockTile {
    /// Block (x, y)'s tile of `bm` x `bn`, or None where it has none (every thread gets the
    /// same answer: a barrier inside, call it in uniform flow). One matrix: row tile x, column
    /// tile y, so the blocks launched together (x first) share the column tile's weights.
    /// Grouped: the blocks in launch order take every column tile of a row tile before the
    /// next row tile (row tile `b / ny`, column tile `b % ny` of block `b = x + nx y`), so the
    /// blocks resident together share an expert's weights and each row tile of A is read
    /// once, not once a column tile (A outgrows L2 at thousands of rows).
    ///
    /// # Safety
    /// As [`block_tile`].
    #[inline(always)]
    unsafe fn of_block(j: &Job, (bm, bn): (u32, u32), found: *mut u32) -> Option<BlockTile> {
        // SAFETY: forwarded.
        unsafe {
            let (i, col) = if j.offsets.is_null() {
                (block_x(), block_y())
            } else {
                let b = block_x() + grid_dim_x() * block_y();
                (b / grid_dim_y(), b % grid_dim_y())
            };
            let (e, m0) = block_tile(j, i, bm, found);
            if e == u32::MAX {
                return None;
            }
            let (lo, end) = if j.offsets.is_null() {
                (m0, j.rows)
            } else {
                (ld(j.offsets, e as usize) + m0, ld(j.offsets, e as usize + 1))
            };
            if lo >= end {
                return None;
            }
            let n0 = col * bn;
            Some(BlockTile { e, lo, rows: (end - lo).min(bm), n0, cols: (j.n - n0).min(bn) })
        }
    }

    /// This thread's rows of A to stage, rows `r + rpp i` of the tile (i below `passes`, at
    /// most 4): each one's address at byte `c` (`kb` bytes a row; `j.a` for rows past the
    /// tile's) and whether it is real.
    ///
    /// # Safety
    /// `j.token` (where given) readable at the tile's rows.
    #[inline(always)]
    unsafe fn a_rows(
        &self,
        j: &Job,
        kb: usize,
        (r, rpp, c): (u32, u32, u32),
        passes: usize,
    ) -> ([*const u8; 4], [bool; 4]) {
        let mut src = [j.a; 4];
        let mut ok = [false; 4];
        for i in 0..passes {
            let ar = r + rpp * i as u32;
            ok[i] = ar < self.rows;
            if ok[i] {
                let at = (self.lo + ar) as usize;
                // SAFETY: forwarded.
                let row = if j.token.is_null() { at } else { unsafe { ld(j.token, at) as usize } };
                src[i] = j.a.wrapping_add(row * kb + c as usize);
            }
        }
        (src, ok)
    }

    /// The next projection's static input scale of this tile's matrix and its reciprocal, where
    /// `j.codes` is given (else unused ones).
    ///
    /// # Safety
    /// `j.next_scale` (where `j.codes` is given) holds the tile's matrix.
    #[inline(always)]
    unsafe fn next_scale(&self, j: &Job) -> (f32, f32) {
        if j.codes.is_null() {
            return (1.0, 1.0);
        }
        // SAFETY: forwarded.
        let qs = unsafe { ld(j.next_scale, self.e as usize) };
        (qs, 1.0 / qs)
    }

    /// Writes two results `(lo, hi)` (`f(v s)`) at tile row `row`, columns `col` and `col + 1`:
    /// rounded to bf16 into `j.out`, or where `j.codes` is given those bf16 values as e4m3
    /// codes of the scale `qs` (`inv` = 1 / qs: `quant_rows_fp8_bf16`'s arithmetic), and at
    /// the output's column 0 the row's scale `qs` too.
    ///
    /// # Safety
    /// The outputs ([`GroupedFp8Params`]) hold the tile's rows; `col` even.
    #[inline(always)]
    unsafe fn put(&self, j: &Job, (row, col): (u32, u32), (lo, hi): (f32, f32), (qs, inv): (f32, f32)) {
        let v = pack(lo, hi);
        let (r, c) = ((self.lo + row) as usize, (self.n0 + col) as usize);
        let at = r * j.n as usize + c;
        // SAFETY: forwarded (the tile's row and column; `at` even, n a multiple of 8).
        unsafe {
            if j.codes.is_null() {
                st(j.out.wrapping_add(at) as *mut u32, 0, v);
            } else {
                let (l, h) = unpack(v);
                st(
                    j.codes.wrapping_add(at) as *mut u16,
                    0,
                    f32x2_to_e4m3(div_rn_by(h, qs, inv), div_rn_by(l, qs, inv)),
                );
                if c == 0 {
                    st(j.codes_scale, r, qs);
                }
            }
        }
    }

    /// Stores this thread's `mma.sync` accumulators of the tile (warp rows from `wm`, columns
    /// from `wn`, `MT` 16-row tiles of four 8-column ones): `f(v s)` by [`BlockTile::put`], `s`
    /// the matrix's scale `ws` times the row's scale where `j.a_scale` is given.
    ///
    /// # Safety
    /// The outputs and `j.a_scale` (where given) hold the tile's rows.
    #[inline(always)]
    unsafe fn store_mma<const MT: usize>(&self, j: &Job, acc: &[[[f32; 4]; 4]; MT], (wm, wn): (u32, u32), ws: f32) {
        let lane = lane_id();
        let relu2 = j.relu2 != 0;
        let f = |v: f32| relu2_if(v, relu2);
        // SAFETY: forwarded.
        let next = unsafe { self.next_scale(j) };
        for (i, tiles) in acc.iter().enumerate() {
            for h in 0..2 {
                let row = wm + 16 * i as u32 + acc_row(lane, 2 * h);
                if row >= self.rows {
                    continue;
                }
                // SAFETY: forwarded (row is one of the tile's).
                let s = if j.a_scale.is_null() { ws } else { ws * unsafe { ld(j.a_scale, (self.lo + row) as usize) } };
                for (jj, t) in tiles.iter().enumerate() {
                    let col = wn + 8 * jj as u32 + acc_col(lane, 0);
                    if col < self.cols {
                        let v = (f(t[2 * h as usize] * s), f(t[2 * h as usize + 1] * s));
                        // SAFETY: forwarded (the tile's row and column).
                        unsafe { self.put(j, (row, col), v, next) };
                    }
                }
            }
        }
    }
}

/// One mma step's products of a warp: `MT` A fragments (rows `wm + 16 i`) against B's columns
/// `wn .. wn + 32`, k16 step `ks` of the stage's tiles (32 bytes of k: 16 bf16 or 32 e4m3).
///
/// # Safety
/// The tiles hold the stage, written before a barrier this warp passed.
#[inline(always)]
unsafe fn mma_step<const FP8: bool, const MT: usize>(
    acc: &mut [[[f32; 4]; 4]; MT],
    (at, bt): (Tile, Tile),
    (wm, wn): (u32, u32),
    ks: u32,
) {
    // SAFETY: forwarded.
    unsafe {
        let a: [[u32; 4]; MT] = core::array::from_fn(|i| at.a(wm + 16 * i as u32, 16 * ks));
        for jj in 0..2 {
            let b = bt.b_nk(16 * ks, wn + 16 * jj);
            for (i, a) in a.iter().enumerate() {
                for h in 0..2 {
                    let t = &mut acc[i][2 * jj as usize + h];
                    if FP8 { mma_e4m3(t, *a, b[h]) } else { mma(t, *a, b[h]) }
                }
            }
        }
    }
}

/// The grouped kernel: tiles of `32 MT` rows (each warp `MT` 16-row tiles of them) staging
/// `BKB` bytes of each row's k at a time, e4m3 operands where `FP8` (else bf16).
///
/// # Safety
/// Launch contract checked by host/src/grouped.rs: a, w, out, the scales and the dispatch's
/// buffers of the sizes given, k a multiple of 8 (bf16) or 16 (e4m3) and n of 8, a and w
/// 16-byte aligned, grid and shared memory for these tiles.
#[inline(always)]
unsafe fn grouped<const FP8: bool, const MT: usize, const BKB: u32>(j: Job) {
    grid_dependency_wait();
    let bm = 32 * MT as u32;
    let (tid, w) = (thread_x(), warp_id());
    // The tiles' columns in bf16 units (two e4m3 codes each).
    let (a_bytes, b_bytes) = (tile_bytes(bm, BKB / 2), tile_bytes(GROUPED_N, BKB / 2));
    let found = dyn_smem_f32().wrapping_add((GROUPED_STAGES * (a_bytes + b_bytes) / 4) as usize) as *mut u32;
    let stride = tile_stride(BKB / 2);
    let stage_tiles = |s: u32| {
        let at = s * (a_bytes + b_bytes);
        (Tile { addr: smem_addr(at), stride }, Tile { addr: smem_addr(at + a_bytes), stride })
    };
    // SAFETY: as the doc says; the stages and the two words fit in the shared memory;
    // `staged_but` separates each stage's loads from its reads, and stage s is reloaded
    // only after the barrier that follows every warp's reads of it.
    unsafe {
        let Some(t) = BlockTile::of_block(&j, (bm, GROUPED_N), found) else { return };
        // A row's bytes (every row of a and w starts 16-byte aligned).
        let kb = (j.k * if FP8 { 1 } else { 2 }) as usize;
        // This thread's 16-byte chunks of a stage: rows `r + rpp i` (A rows below bm, B rows
        // below GROUPED_N), bytes `c .. c + 16` of the step; the sources' rows fixed for the
        // whole product.
        let per_row = BKB / 16;
        let (rpp, r, c) = (GROUPED_BLOCK / per_row, tid / per_row, 16 * (tid % per_row));
        let (a_passes, b_passes) = ((bm / rpp) as usize, (GROUPED_N / rpp) as usize);
        let (a_src, a_ok) = t.a_rows(&j, kb, (r, rpp, c), a_passes);
        let b_src = j.w.wrapping_add((t.e as usize * j.n as usize + (t.n0 + r) as usize) * kb + c as usize);
        let steps = (kb as u32).div_ceil(BKB);
        // Tile addresses in bf16 units: byte c is unit c / 2.
        let cu = c / 2;
        let load = |step: u32| {
            if step < steps {
                let (at, bt) = stage_tiles(step % GROUPED_STAGES);
                let k0 = step * BKB;
                let in_k = k0 + c < kb as u32;
                let off = k0 as usize;
                for i in 0..a_passes {
                    let ok = a_ok[i] && in_k;
                    let src = if ok { a_src[i].wrapping_add(off) } else { j.a };
                    copy16_l2(at.at(r + rpp * i as u32, cu), src as *const u16, ok);
                }
                for i in 0..b_passes {
                    let br = r + rpp * i as u32;
                    let ok = br < t.cols && in_k;
                    let src = b_src.wrapping_add(off + i * rpp as usize * kb);
                    copy16_l2(bt.at(br, cu), if ok { src } else { j.w } as *const u16, ok);
                }
            }
            commit();
        };
        for s in 0..GROUPED_STAGES - 1 {
            load(s);
        }
        let warp_at = (16 * MT as u32 * (w / 4), 32 * (w % 4));
        let mut acc = [[[0.0f32; 4]; 4]; MT];
        for step in 0..steps {
            staged_but::<{ GROUPED_STAGES - 2 }>();
            load(step + GROUPED_STAGES - 1);
            for ks in 0..BKB / 32 {
                mma_step::<FP8, MT>(&mut acc, stage_tiles(step % GROUPED_STAGES), warp_at, ks);
            }
        }
        t.store_mma(&j, &acc, warp_at, if j.w_scale.is_null() { 1.0 } else { ld(j.w_scale, t.e as usize) });
    }
}

/// The NVFP4 grouped kernel on `mma.sync`: as [`grouped`] with 64-row tiles (each warp two
/// 16-row tiles) and 64 weights of k a stage, but B staged as codes and scales (thread t copies
/// 16 bytes of weight row t / 2's codes, half t % 2 of the stage's 32, and the row's 4 block
/// scales of the stage) and made bf16 by the thread that copied them ([`fp4_in_order`]: each
/// code times its block scale times 2^-9, exact) into one of two B tiles, so a stage needs one
/// barrier: after its own copies of the stage are done a thread writes B tile `step % 2` (last
/// read by the products two stages back, which every warp finished before the last barrier),
/// and the barrier publishes A and B; then the next loads (into the ring slot the products
/// before the barrier read) and the products. The sums times 2^9 and the matrix's per-tensor
/// scale.
///
/// # Safety
/// As [`grouped`] with [`GroupedNvfp4Params`]' contract (k a multiple of 64, the weight rows
/// 16-byte aligned), this kernel's grid and shared memory.
#[inline(always)]
unsafe fn grouped_nvfp4(j: Job) {
    use crate::mma::{copy4, lds4, lds16, sts16};
    use crate::qgemv::{FP4_SUM_SCALE, fp4_chunks};
    const MT: usize = 2;
    grid_dependency_wait();
    let (tid, w) = (thread_x(), warp_id());
    let (a_bytes, b_bytes) = (tile_bytes(GROUPED_M, 64), tile_bytes(GROUPED_N, 64));
    let [a_at, b_at, raw_at, words] = nvfp4_layout();
    let stride = tile_stride(64);
    let a_tile = |s: u32| Tile { addr: smem_addr(a_at + s * a_bytes), stride };
    let b_tile = |s: u32| Tile { addr: smem_addr(b_at + s * b_bytes), stride };
    let raw = |s: u32| smem_addr(raw_at + s * GROUPED_BLOCK * NVFP4_THREAD_STAGE_BYTES);
    let found = dyn_smem_f32().wrapping_add((words / 4) as usize) as *mut u32;
    // SAFETY: as the doc says; the tiles, the ring and the two words fit in the shared memory;
    // each stage's A copies and B tile are complete and published by the barrier before any
    // warp's products read them; a ring slot is reloaded, and a B tile rewritten, only after
    // the barrier that follows every warp's products that read it; a thread reads only the
    // codes and scales it copied itself, after its own wait.
    unsafe {
        let Some(t) = BlockTile::of_block(&j, (GROUPED_M, GROUPED_N), found) else { return };
        // A: 16-byte chunk tid % 8 of rows tid / 8 and tid / 8 + 32 (128 bytes a row a stage).
        let (r, c) = (tid / 8, 16 * (tid % 8));
        let (a_src, a_ok) = t.a_rows(&j, 2 * j.k as usize, (r, 32, c), 2);
        // B: half `bh` of weight row `br`.
        let (br, bh) = (tid / 2, tid % 2);
        let w_ok = br < t.cols;
        let row_bytes = crate::nvfp4::row_bytes(j.k as usize);
        let w_row = j.w.wrapping_add((t.e as usize * j.n as usize + (t.n0 + br) as usize) * row_bytes);
        let steps = j.k / 64;
        let load = |step: u32| {
            if step < steps {
                let s = step % GROUPED_STAGES;
                let off = 128 * step as usize;
                for i in 0..2 {
                    let src = if a_ok[i] { a_src[i].wrapping_add(off) } else { j.a };
                    copy16_l2(a_tile(s).at(r + 32 * i as u32, c / 2), src as *const u16, a_ok[i]);
                }
                let codes = w_row.wrapping_add(32 * step as usize + 16 * bh as usize);
                copy16_l2(raw(s) + 16 * tid, if w_ok { codes } else { j.w } as *const u16, w_ok);
                let scales = w_row.wrapping_add(j.k as usize / 2 + 4 * step as usize);
                copy4(raw(s) + 16 * GROUPED_BLOCK + 4 * tid, if w_ok { scales } else { j.w }, w_ok);
            }
            commit();
        };
        for s in 0..GROUPED_STAGES - 1 {
            load(s);
        }
        let warp_at = (16 * MT as u32 * (w / 4), 32 * (w % 4));
        let mut acc = [[[0.0f32; 4]; 4]; MT];
        for step in 0..steps {
            core::arch::asm!("cp.async.wait_group {n};", n = const GROUPED_STAGES - 2, options(nostack));
            let (rs, bt) = (raw(step % GROUPED_STAGES), b_tile(step % 2));
            let codes = lds16(rs + 16 * tid);
            // Blocks 2 bh and 2 bh + 1 of the stage's four: this thread's 32 weights.
            let v = fp4_chunks(codes, (lds4(rs + 16 * GROUPED_BLOCK + 4 * tid) >> (16 * bh)) as u16);
            for (q, v) in v.into_iter().enumerate() {
                sts16(bt.at(br, 32 * bh + 8 * q as u32), v);
            }
            sync_threads();
            load(step + GROUPED_STAGES - 1);
            for ks in 0..4 {
                mma_step::<false, MT>(&mut acc, (a_tile(step % GROUPED_STAGES), bt), warp_at, ks);
            }
        }
        t.store_mma(&j, &acc, warp_at, ld(j.w_scale, t.e as usize) * FP4_SUM_SCALE);
    }
}
