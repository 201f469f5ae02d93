//! Tensor-core matrix products: `mma.sync.aligned.m16n8k16` (bf16 inputs, f32 accumulators)
//! and its FP8 form `m16n8k32` (e4m3 inputs, `mma_e4m3`), `ldmatrix` fragment loads from
//! shared memory and `cp.async` staging, through inline PTX. The bf16 forms exist on sm_80 and
//! later, the e4m3 one on sm_89 and later (PTX ISA 8.4: the sm_90 build asks rustc for it), so
//! every arch's PTX (sm_90, sm_110a, sm_121a) has them.
//!
//! # Fragments
//! One `mma` multiplies a 16x16 A block by a 16x8 B block into a 16x8 f32 accumulator, each
//! spread over the warp's 32 lanes. With `g = lane / 4` and `q = lane % 4`:
//! - A, four u32 of two bf16 each (the lower half the lower column): `a[0]` row g, columns
//!   `2q, 2q+1`; `a[1]` row `g+8`, the same columns; `a[2]`, `a[3]` as `a[0]`, `a[1]` at columns
//!   `2q+8, 2q+9`;
//! - B, two u32: `b[0]` rows (the k index) `2q, 2q+1` of column g; `b[1]` rows `2q+8, 2q+9`;
//! - the accumulator, four f32: `c[0]`, `c[1]` row g, columns `2q, 2q+1`; `c[2]`, `c[3]` row
//!   `g+8` ([`acc_row`], [`acc_col`]).
//!
//! The accumulators of two adjacent 16x8 tiles are, element for element, the A fragment of
//! the 16x16 block they form ([`acc_to_a`]): a product can feed the next one from registers.
//!
//! # Shared-memory tiles
//! [`Tile`] is a bf16 matrix in shared memory, rows of `stride` elements. `ldmatrix` reads
//! eight 16-byte rows per 8x8 matrix; with `stride * 2` an odd multiple of 16 bytes
//! ([`tile_stride`]) those eight rows fall in distinct banks and no load conflicts. A tile
//! serves as A stored row-major (`[m][k]`, [`Tile::a`]) or transposed (`[k][m]`, [`Tile::a_t`]),
//! and as B stored `[n][k]` ([`Tile::b_nk`]) or `[k][n]` ([`Tile::b_kn`]).
//!
//! The `tc_matmul_bf16` kernel ([`MatmulParams`]) multiplies two matrices of any size with
//! these pieces, every storage order of A and B: the GPU test of this module.

use crate::KernelParams;

/// Row stride, in elements, of a shared tile holding rows of `cols` elements (rounded up to
/// 16, the k extent of one `mma`), plus 8: `2 * stride` bytes an odd multiple of 16.
pub const fn tile_stride(cols: u32) -> u32 {
    cols.div_ceil(16) * 16 + 8
}

/// Bytes of a shared tile of `rows` rows of `cols` elements (rows rounded up to 16).
pub const fn tile_bytes(rows: u32, cols: u32) -> u32 {
    rows.div_ceil(16) * 16 * tile_stride(cols) * 2
}

/// Row (within its 16x8 tile) of accumulator element `e` (0..4) of `lane`.
pub const fn acc_row(lane: u32, e: u32) -> u32 {
    lane / 4 + 8 * (e / 2)
}

/// Column (within its 16x8 tile) of accumulator element `e` (0..4) of `lane`.
pub const fn acc_col(lane: u32, e: u32) -> u32 {
    2 * (lane % 4) + e % 2
}

/// Threads of a `tc_matmul_bf16` block (four warps, 16 rows of the block's output each).
pub const MATMUL_BLOCK: u32 = 128;
/// Output rows and columns of a `tc_matmul_bf16` block.
pub const MATMUL_TILE: u32 = 64;
/// k staged at a time by `tc_matmul_bf16`.
pub const MATMUL_K: u32 = 32;

/// `d [m, n] = a · b` (f32 out) for bf16 `a` and `b`, each in either storage order.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct MatmulParams {
    /// `[m, k]` row-major, or `[k, m]` where `a_t`.
    pub a: *const u16,
    /// `[k, n]` row-major, or `[n, k]` where `b_nk`.
    pub b: *const u16,
    /// `[m, n]` f32, written.
    pub d: *mut f32,
    pub m: u32,
    pub n: u32,
    pub k: u32,
    pub a_t: u32,
    pub b_nk: u32,
    /// 1: every row of a and b starts 16-byte aligned and holds a multiple of 8 elements, so
    /// staging copies 16 bytes at a time (`cp.async`); 0: one element at a time.
    pub vec: u32,
}

// SAFETY: #[repr(C)], Copy, only pointers and integers.
unsafe impl KernelParams for MatmulParams {}

/// Dynamic shared memory of `tc_matmul_bf16`: one A and one B tile of 64 x 32 (either way).
pub const fn matmul_smem_bytes() -> u32 {
    let a = tile_bytes(MATMUL_TILE, MATMUL_K);
    let b = tile_bytes(MATMUL_K, MATMUL_TILE);
    2 * if a > b { a } else { b }
}

#[cfg(target_arch = "nvptx64")]
pub(crate) use device::*;

#[cfg(target_arch = "nvptx64")]
mod device {
    use super::*;
    use crate::device::*;
    use core::arch::asm;

    /// Shared-window address of byte `offset` of the block's dynamic shared memory.
    #[inline(always)]
    pub fn smem_addr(offset: u32) -> u32 {
        let p: u32;
        // SAFETY: takes the shared-window address of the module's `dyn_smem` symbol.
        unsafe { asm!("mov.u32 {p}, dyn_smem;", p = out(reg32) p, options(pure, nomem, nostack)) };
        p + offset
    }

    /// A bf16 matrix in shared memory: element (r, c) at byte `addr + 2 (r stride + c)`.
    #[derive(Clone, Copy)]
    pub struct Tile {
        pub addr: u32,
        pub stride: u32,
    }

    /// Four 8x8 bf16 matrices, lane l giving the address of row `l % 8` of matrix `l / 8`.
    ///
    /// # Safety
    /// Every lane's 16 bytes at `addr` in the block's shared memory, 16-byte aligned; the
    /// whole warp calls it.
    #[inline(always)]
    unsafe fn ldmatrix<const TRANS: bool>(addr: u32) -> [u32; 4] {
        let (a, b, c, d): (u32, u32, u32, u32);
        // SAFETY: guaranteed by the caller.
        unsafe {
            if TRANS {
                asm!("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {{{a}, {b}, {c}, {d}}}, [{p}];",
                     a = out(reg32) a, b = out(reg32) b, c = out(reg32) c, d = out(reg32) d, p = in(reg32) addr,
                     options(readonly, nostack))
            } else {
                asm!("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {{{a}, {b}, {c}, {d}}}, [{p}];",
                     a = out(reg32) a, b = out(reg32) b, c = out(reg32) c, d = out(reg32) d, p = in(reg32) addr,
                     options(readonly, nostack))
            }
        }
        [a, b, c, d]
    }

    impl Tile {
        /// Address of element (r, c).
        #[inline(always)]
        pub fn at(self, r: u32, c: u32) -> u32 {
            self.addr + 2 * (r * self.stride + c)
        }

        /// Lane's address for an x4 `ldmatrix` whose matrix `l / 8` starts at row
        /// `r0 + 8 (l/8 & 1)` or `r0 + 8 (l/8 >> 1)` (`row_bit`) and the other bit on the
        /// columns.
        #[inline(always)]
        fn quad(self, r0: u32, c0: u32, row_bit_low: bool) -> u32 {
            let l = lane_id();
            let (m, r) = (l / 8, l % 8);
            let (rb, cb) = if row_bit_low { (m & 1, m >> 1) } else { (m >> 1, m & 1) };
            self.at(r0 + r + 8 * rb, c0 + 8 * cb)
        }

        /// A fragment of the 16x16 block at (m0, k0) of A stored row-major here (`[m][k]`).
        ///
        /// # Safety
        /// Rows `m0..m0+16`, columns `k0..k0+16` inside the tile; the whole warp calls it.
        #[inline(always)]
        pub unsafe fn a(self, m0: u32, k0: u32) -> [u32; 4] {
            // SAFETY: guaranteed by the caller.
            unsafe { ldmatrix::<false>(self.quad(m0, k0, true)) }
        }

        /// A fragment of the 16x16 block at (m0, k0) of A stored transposed here (`[k][m]`).
        ///
        /// # Safety
        /// Rows `k0..k0+16`, columns `m0..m0+16` inside the tile; the whole warp calls it.
        #[inline(always)]
        pub unsafe fn a_t(self, m0: u32, k0: u32) -> [u32; 4] {
            // SAFETY: guaranteed by the caller.
            unsafe { ldmatrix::<true>(self.quad(k0, m0, false)) }
        }

        /// B fragments of the 16x8 blocks at (k0, n0) and (k0, n0 + 8) of B stored here as
        /// `[n][k]` (each column of B a row of the tile).
        ///
        /// # Safety
        /// Rows `n0..n0+16`, columns `k0..k0+16` inside the tile; the whole warp calls it.
        #[inline(always)]
        pub unsafe fn b_nk(self, k0: u32, n0: u32) -> [[u32; 2]; 2] {
            // SAFETY: guaranteed by the caller.
            let r = unsafe { ldmatrix::<false>(self.quad(n0, k0, false)) };
            [[r[0], r[1]], [r[2], r[3]]]
        }

        /// B fragments of the 16x8 blocks at (k0, n0) and (k0, n0 + 8) of B stored here
        /// row-major (`[k][n]`).
        ///
        /// # Safety
        /// Rows `k0..k0+16`, columns `n0..n0+16` inside the tile; the whole warp calls it.
        #[inline(always)]
        pub unsafe fn b_kn(self, k0: u32, n0: u32) -> [[u32; 2]; 2] {
            // SAFETY: guaranteed by the caller.
            let r = unsafe { ldmatrix::<true>(self.quad(k0, n0, true)) };
            [[r[0], r[1]], [r[2], r[3]]]
        }

        /// Element (r, c) as f32.
        ///
        /// # Safety
        /// (r, c) inside the tile.
        #[inline(always)]
        pub unsafe fn get(self, r: u32, c: u32) -> f32 {
            let v: u16;
            // SAFETY: guaranteed by the caller.
            unsafe {
                asm!("ld.shared.u16 {v}, [{p}];", v = out(reg16) v, p = in(reg32) self.at(r, c),
                     options(readonly, nostack))
            };
            bf16_to_f32(v)
        }

        /// Copies rows `0..rows`, columns `0..cols` (a multiple of 8) of the tile from `src`
        /// (row r at `src + r * stride`), zero outside the `valid` (rows, columns), the block's
        /// `nthreads` threads sharing the work. With `vec` each 16 bytes move as one `cp.async`
        /// (zero-filled where invalid); without, element by element. Complete after
        /// [`staged`].
        ///
        /// # Safety
        /// The tile holds `rows x cols`; `src` readable at the valid rows and columns; with
        /// `vec`, `src` and `stride * 2` 16-byte aligned and the valid columns a multiple of 8.
        #[inline(always)]
        pub unsafe fn stage(
            self,
            src: *const u16,
            stride: usize,
            (rows, cols): (u32, u32),
            (vr, vc): (u32, u32),
            vec: bool,
            (tid, nthreads): (u32, u32),
        ) {
            let mut e = tid;
            if vec {
                let per_row = cols / 8;
                while e < rows * per_row {
                    let (r, c) = (e / per_row, 8 * (e % per_row));
                    let ok = r < vr && c < vc;
                    let from = if ok { src.wrapping_add(r as usize * stride + c as usize) } else { src };
                    // SAFETY: 16 aligned bytes of the tile; from readable where ok (caller).
                    unsafe { copy16(self.at(r, c), from, ok) };
                    e += nthreads;
                }
            } else {
                while e < rows * cols {
                    let (r, c) = (e / cols, e % cols);
                    // SAFETY: inside src where valid (caller).
                    let v = if r < vr && c < vc { unsafe { ld(src, r as usize * stride + c as usize) } } else { 0 };
                    // SAFETY: inside the tile (caller).
                    unsafe {
                        asm!("st.shared.u16 [{p}], {v};", p = in(reg32) self.at(r, c), v = in(reg16) v, options(nostack))
                    };
                    e += nthreads;
                }
            }
        }
    }

    /// Starts copying the 16 bytes at `src` to shared address `dst` (`cp.async`), or, where not
    /// `ok`, zeros there (nothing read). Complete after [`staged`] or [`staged_but`].
    ///
    /// # Safety
    /// `dst` 16 bytes of the block's shared memory, 16-byte aligned; with `ok`, `src` 16
    /// readable bytes of global memory, 16-byte aligned.
    #[inline(always)]
    pub unsafe fn copy16(dst: u32, src: *const u16, ok: bool) {
        // SAFETY: guaranteed by the caller; source size 0 where not ok.
        unsafe {
            asm!("cp.async.cg.shared.global [{d}], [{s}], 16, {n};", d = in(reg32) dst, s = in(reg64) src,
                 n = in(reg32) if ok { 16u32 } else { 0 }, options(nostack))
        }
    }

    /// As [`copy16`], L2 fetching the 256-byte block around `src` (`.L2::256B`): a stage's
    /// copies of a row bring the next stages' bytes of it (the grouped GEMMs, which read each
    /// weight row 128 bytes a stage; the other kernels measured no better with it, the router
    /// worse).
    ///
    /// # Safety
    /// As [`copy16`].
    #[inline(always)]
    pub unsafe fn copy16_l2(dst: u32, src: *const u16, ok: bool) {
        // SAFETY: guaranteed by the caller; source size 0 where not ok.
        unsafe {
            asm!("cp.async.cg.shared.global.L2::256B [{d}], [{s}], 16, {n};", d = in(reg32) dst, s = in(reg64) src,
                 n = in(reg32) if ok { 16u32 } else { 0 }, options(nostack))
        }
    }

    /// As [`copy16`] for the 4 bytes at `src` (`cp.async.ca`: the 16-byte form bypasses L1,
    /// this one may not).
    ///
    /// # Safety
    /// `dst` 4 bytes of the block's shared memory, 4-byte aligned; with `ok`, `src` 4 readable
    /// bytes of global memory, 4-byte aligned.
    #[inline(always)]
    pub unsafe fn copy4(dst: u32, src: *const u8, ok: bool) {
        // SAFETY: guaranteed by the caller; source size 0 where not ok.
        unsafe {
            asm!("cp.async.ca.shared.global [{d}], [{s}], 4, {n};", d = in(reg32) dst, s = in(reg64) src,
                 n = in(reg32) if ok { 4u32 } else { 0 }, options(nostack))
        }
    }

    /// As [`copy16`] for the 8 bytes at `src`, always read (`cp.async.ca`, as [`copy4`]).
    ///
    /// # Safety
    /// `dst` 8 bytes of the block's shared memory, 8-byte aligned; `src` 8 readable bytes of
    /// global memory, 8-byte aligned.
    #[inline(always)]
    pub unsafe fn copy8(dst: u32, src: *const u8) {
        // SAFETY: guaranteed by the caller.
        unsafe {
            asm!("cp.async.ca.shared.global [{d}], [{s}], 8;", d = in(reg32) dst, s = in(reg64) src, options(nostack))
        }
    }

    /// Waits for this thread's `cp.async` copies (no barrier: for a thread that reads back
    /// only what it copied itself).
    #[inline(always)]
    pub fn copied() {
        // SAFETY: waits on this thread's own copies; no operands.
        unsafe { asm!("cp.async.wait_all;", options(nostack)) };
    }

    /// The 8 bytes at shared address `at` as two words.
    ///
    /// # Safety
    /// `at` 8 bytes of the block's shared memory, 8-byte aligned.
    #[inline(always)]
    pub unsafe fn lds8(at: u32) -> [u32; 2] {
        let (a, b): (u32, u32);
        // SAFETY: guaranteed by the caller.
        unsafe {
            asm!("ld.shared.v2.u32 {{{a}, {b}}}, [{p}];", a = out(reg32) a, b = out(reg32) b, p = in(reg32) at,
                 options(readonly, nostack))
        };
        [a, b]
    }

    /// The 16 bytes at shared address `at` as four words.
    ///
    /// # Safety
    /// `at` 16 bytes of the block's shared memory, 16-byte aligned.
    #[inline(always)]
    pub unsafe fn lds16(at: u32) -> [u32; 4] {
        let (a, b, c, d): (u32, u32, u32, u32);
        // SAFETY: guaranteed by the caller.
        unsafe {
            asm!("ld.shared.v4.u32 {{{a}, {b}, {c}, {d}}}, [{p}];", a = out(reg32) a, b = out(reg32) b,
                 c = out(reg32) c, d = out(reg32) d, p = in(reg32) at, options(readonly, nostack))
        };
        [a, b, c, d]
    }

    /// The word at shared address `at`.
    ///
    /// # Safety
    /// `at` 4 bytes of the block's shared memory, 4-byte aligned.
    #[inline(always)]
    pub unsafe fn lds4(at: u32) -> u32 {
        let v: u32;
        // SAFETY: guaranteed by the caller.
        unsafe { asm!("ld.shared.u32 {v}, [{p}];", v = out(reg32) v, p = in(reg32) at, options(readonly, nostack)) };
        v
    }

    /// Stores four words as the 16 bytes at shared address `at`.
    ///
    /// # Safety
    /// `at` 16 bytes of the block's shared memory, 16-byte aligned, no other thread's access
    /// to them unordered with this one.
    #[inline(always)]
    pub unsafe fn sts16(at: u32, v: [u32; 4]) {
        // SAFETY: guaranteed by the caller.
        unsafe {
            asm!("st.shared.v4.u32 [{p}], {{{a}, {b}, {c}, {d}}};", p = in(reg32) at, a = in(reg32) v[0],
                 b = in(reg32) v[1], c = in(reg32) v[2], d = in(reg32) v[3], options(nostack))
        }
    }

    /// Waits for this thread's `cp.async` copies, then the block's barrier: every tile staged
    /// before it is readable by every thread after it. Call it in uniform flow.
    #[inline(always)]
    pub fn staged() {
        copied();
        sync_threads();
    }

    /// Closes this thread's `cp.async` copies issued since the last commit into a group, for
    /// [`staged_but`] to wait on.
    #[inline(always)]
    pub fn commit() {
        // SAFETY: no operands.
        unsafe { asm!("cp.async.commit_group;", options(nostack)) };
    }

    /// Waits until at most `N` of this thread's committed `cp.async` groups are still in
    /// flight (the newest ones), then the block's barrier: every tile of the groups before them
    /// is readable by every thread after it. Call it in uniform flow.
    #[inline(always)]
    pub fn staged_but<const N: u32>() {
        // SAFETY: waits on this thread's own copies.
        unsafe { asm!("cp.async.wait_group {n};", n = const N, options(nostack)) };
        sync_threads();
    }

    /// `c += a · b` for one 16x16 A block and one 16x8 B block (fragments as the module says).
    #[inline(always)]
    pub fn mma(c: &mut [f32; 4], a: [u32; 4], b: [u32; 2]) {
        // SAFETY: register-only tensor-core instruction (sm_80+); the whole warp executes it
        // (callers keep it in warp-uniform flow).
        unsafe {
            asm!("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {{{c0}, {c1}, {c2}, {c3}}}, {{{a0}, {a1}, {a2}, {a3}}}, {{{b0}, {b1}}}, {{{c0}, {c1}, {c2}, {c3}}};",
                 c0 = inout(reg32) c[0], c1 = inout(reg32) c[1], c2 = inout(reg32) c[2], c3 = inout(reg32) c[3],
                 a0 = in(reg32) a[0], a1 = in(reg32) a[1], a2 = in(reg32) a[2], a3 = in(reg32) a[3],
                 b0 = in(reg32) b[0], b1 = in(reg32) b[1], options(pure, nomem, nostack))
        }
    }

    /// `c += a · b` for one 16x32 A block and one 32x8 B block of FP8 e4m3 codes (f32 sums).
    /// The fragments are the bf16 ones with each bf16 element two codes (the lower k in the
    /// lower byte), so a [`Tile`] of codes, its columns counted in pairs, loads them as it
    /// loads bf16 (rows of k bytes: [`Tile::a`], [`Tile::b_nk`]). sm_89 and later, PTX ISA 8.4.
    #[inline(always)]
    pub fn mma_e4m3(c: &mut [f32; 4], a: [u32; 4], b: [u32; 2]) {
        // SAFETY: as in `mma`.
        unsafe {
            asm!("mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {{{c0}, {c1}, {c2}, {c3}}}, {{{a0}, {a1}, {a2}, {a3}}}, {{{b0}, {b1}}}, {{{c0}, {c1}, {c2}, {c3}}};",
                 c0 = inout(reg32) c[0], c1 = inout(reg32) c[1], c2 = inout(reg32) c[2], c3 = inout(reg32) c[3],
                 a0 = in(reg32) a[0], a1 = in(reg32) a[1], a2 = in(reg32) a[2], a3 = in(reg32) a[3],
                 b0 = in(reg32) b[0], b1 = in(reg32) b[1], options(pure, nomem, nostack))
        }
    }

    /// Two f32 as one u32 of bf16 (nearest even), `lo` in the lower half.
    #[inline(always)]
    pub fn pack(lo: f32, hi: f32) -> u32 {
        f32x2_to_bf16x2(hi, lo)
    }

    /// The two bf16 of a u32 as f32, the lower half first.
    #[inline(always)]
    pub fn unpack(v: u32) -> (f32, f32) {
        (bf16_to_f32(v as u16), bf16_to_f32((v >> 16) as u16))
    }

    /// The accumulators of the 16x8 tiles at columns 0..8 (`lo`) and 8..16 (`hi`) as the A
    /// fragment of the 16x16 block they form, rounded to bf16.
    #[inline(always)]
    pub fn acc_to_a(lo: [f32; 4], hi: [f32; 4]) -> [u32; 4] {
        [pack(lo[0], lo[1]), pack(lo[2], lo[3]), pack(hi[0], hi[1]), pack(hi[2], hi[3])]
    }

    /// Matrix product on tensor cores, [`MatmulParams`]. Grid `(ceil(n / 64), ceil(m / 64))`,
    /// block [`MATMUL_BLOCK`], dynamic shared memory [`matmul_smem_bytes`]. Block (bx, by):
    /// outputs `64 by .. +64` x `64 bx .. +64`; warp w its 16 rows from `16 w`, all 64 columns
    /// (eight 16x8 accumulators); k staged 32 at a time, zero past the edges.
    #[unsafe(no_mangle)]
    pub unsafe extern "ptx-kernel" fn tc_matmul_bf16(p: MatmulParams) {
        grid_dependency_wait();
        let (m0, n0) = (block_y() * MATMUL_TILE, block_x() * MATMUL_TILE);
        let (tid, w, lane) = (thread_x(), warp_id(), lane_id());
        let (t, kt) = (MATMUL_TILE, MATMUL_K);
        let half = matmul_smem_bytes() / 2;
        let (a_t, b_nk, vec) = (p.a_t != 0, p.b_nk != 0, p.vec != 0);
        let at = Tile { addr: smem_addr(0), stride: tile_stride(if a_t { t } else { kt }) };
        let bt = Tile { addr: smem_addr(half), stride: tile_stride(if b_nk { kt } else { t }) };
        let (rm, rn) = (p.m.saturating_sub(m0).min(t), p.n.saturating_sub(n0).min(t));
        let mut acc = [[0.0f32; 4]; 8];
        let mut k0 = 0;
        // SAFETY: launch contract checked by host/src/mma.rs (a, b, d of the sizes given; vec
        // only where aligned); the tiles fit in matmul_smem_bytes; `staged` and the barrier
        // after the products separate staging from use.
        unsafe {
            while k0 < p.k {
                let rk = (p.k - k0).min(kt);
                let (k, m, n) = (p.k as usize, p.m as usize, p.n as usize);
                let (k0u, m0u, n0u) = (k0 as usize, m0 as usize, n0 as usize);
                if a_t {
                    at.stage(p.a.wrapping_add(k0u * m + m0u), m, (kt, t), (rk, rm), vec, (tid, MATMUL_BLOCK));
                } else {
                    at.stage(p.a.wrapping_add(m0u * k + k0u), k, (t, kt), (rm, rk), vec, (tid, MATMUL_BLOCK));
                }
                if b_nk {
                    bt.stage(p.b.wrapping_add(n0u * k + k0u), k, (t, kt), (rn, rk), vec, (tid, MATMUL_BLOCK));
                } else {
                    bt.stage(p.b.wrapping_add(k0u * n + n0u), n, (kt, t), (rk, rn), vec, (tid, MATMUL_BLOCK));
                }
                staged();
                for ks in 0..kt / 16 {
                    let a = if a_t { at.a_t(16 * w, 16 * ks) } else { at.a(16 * w, 16 * ks) };
                    for q in 0..4 {
                        let b = if b_nk { bt.b_nk(16 * ks, 16 * q) } else { bt.b_kn(16 * ks, 16 * q) };
                        mma(&mut acc[2 * q as usize], a, b[0]);
                        mma(&mut acc[2 * q as usize + 1], a, b[1]);
                    }
                }
                sync_threads();
                k0 += kt;
            }
            for (j, c) in acc.iter().enumerate() {
                for (e, v) in c.iter().enumerate() {
                    let (r, col) = (16 * w + acc_row(lane, e as u32), 8 * j as u32 + acc_col(lane, e as u32));
                    if r < rm && col < rn {
                        st(p.d, (m0 + r) as usize * p.n as usize + (n0 + col) as usize, *v);
                    }
                }
            }
        }
    }
}
