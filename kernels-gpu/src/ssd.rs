//! Chunked scan (SSD): the Mamba2 prefill, varlen, on tensor cores.
//!
//! # The math
//! Per head h (of group `g = h / (heads / groups)`), token t of a sequence, with
//! `delta_t = clamp(softplus(dt_t + dt_bias_h), dt_min, dt_max)` and `A_h < 0`, the state
//! `S_t [head_dim, state_size]` and output follow the recurrence
//! `S_t = exp(delta_t A_h) S_{t-1} + delta_t x_t B_t^T`, `y_t = S_t C_t + D_h x_t`
//! (x the head's `head_dim` channels, B and C the group's `state_size` columns). Sequences are
//! cut into chunks of [`SSD_CHUNK`] tokens that never span two sequences (the host's plan lists
//! them, [`SsdChunk`], and where each sequence's chunks start). Within a chunk, with
//! `a_i = sum_{j<=i} delta_j A` (inclusive cumsum from the chunk's start):
//! - the chunk's own state `s_c = sum_j exp(a_last - a_j) delta_j x_j B_j^T`;
//! - the start state `S_start(c)`: the slot's state for a sequence's first chunk where it has
//!   one, else zero; then `S_start(c+1) = exp(a_last(c)) S_start(c) + s_c`, the last of which
//!   is the sequence's final state;
//! - `y_i = exp(a_i) (S_start C_i) + sum_{j<=i} (C_i . B_j) exp(a_i - a_j) delta_j x_j + D x_i`.
//!
//! # Three launches
//! 1. `ssd_chunk_state_f32`, grid `(nchunks, heads + groups)`. Blocks (chunk, head): delta and
//!    the cumsum into the `delta`, `acum` workspaces (`[nchunks, heads, SSD_CHUNK]` f32; past a
//!    chunk's length delta is 0 and the cumsum flat, so entry 127 is always `a_last`), then
//!    `s_c` into `states` (`[nchunks, heads, head_dim, state_size]` f32), one
//!    `head_dim x state_size x chunk` product on tensor cores (`(x . w)^T B` with
//!    `w_j = exp(a_last - a_j) delta_j`). Blocks (chunk, heads + group): the chunk's scores
//!    `C_i . B_j` (j <= i, f32) into `cb`, once for the group's heads.
//! 2. `ssd_state_pass_{f32,bf16}`, per (sequence, head, state elements): walks the chunks in
//!    order, writes each `S_start(c)` to `starts` (`[nchunks, heads, head_dim, state_size]`
//!    bf16: what the output products take) and the final state to the sequence's slot.
//! 3. `ssd_scan_bf16`, per (chunk, head): `y` on tensor cores, each warp two 16-row tiles of
//!    the chunk (w and 7 - w: the causal part balanced over the warps) for half the channels:
//!    `C S_start^T` scaled by `exp(a_i)`, then for each 16-token tile j up to the row tile the
//!    group's scores, weighted by `exp(a_i - a_j) delta_j` and masked in registers, rounded
//!    to bf16 and multiplied by `x_j`.
//!
//! The tensor-core operands are bf16: x, B, C as given; `x . w`, the weighted scores and
//! `S_start` rounded once (the sums stay f32). Inputs are rows with their own strides (slices
//! of wider rows): `x [tokens, x_stride]` (heads * head_dim channels), `dt [tokens, dt_stride]`,
//! `B`, `C [tokens, *_stride]` (groups * state_size), `y [tokens, heads * head_dim]`. Limits:
//! `head_dim <= 64`, `state_size <= 128`.

use crate::KernelParams;
use crate::mma::tile_bytes;
use crate::ssm::SsmGeometry;

/// Tokens per chunk.
pub const SSD_CHUNK: u32 = 128;
/// Threads of a chunk-state block (eight warps).
pub const SSD_STATE_BLOCK: u32 = 256;
/// Threads of a state-passing block.
pub const SSD_PASS_BLOCK: u32 = 256;
/// State elements each state-passing thread walks.
pub const SSD_PASS_PER_THREAD: u32 = 8;
/// Threads of a scan block (eight warps: two 16-row tiles of the chunk and half the channels
/// each).
pub const SSD_SCAN_BLOCK: u32 = 256;
/// Largest head_dim (four 16-row tiles of the chunk-state product; eight 8-column
/// accumulators per scan warp).
pub const SSD_MAX_HEAD_DIM: u32 = 64;
/// Largest state_size (a scan warp holds its rows of C, eight 16-column fragments).
pub const SSD_MAX_STATE: u32 = 128;

/// One chunk of the plan: `len` tokens of sequence `seq` from row `start`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SsdChunk {
    pub seq: u32,
    pub start: u32,
    pub len: u32,
    pub _pad: u32,
}

/// Inputs, workspaces and output shared by the three launches.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct SsdParams {
    pub x: *const u16,
    pub dt: *const u16,
    pub b: *const u16,
    pub c: *const u16,
    /// `[heads]` f32.
    pub dt_bias: *const f32,
    /// `[heads]` f32, A = -exp(A_log).
    pub a: *const f32,
    /// `[heads]` f32, or null for no skip term.
    pub d: *const f32,
    /// `[nchunks]`.
    pub chunks: *const SsdChunk,
    /// `[nchunks, heads, SSD_CHUNK]` f32 workspace.
    pub delta: *mut f32,
    /// `[nchunks, heads, SSD_CHUNK]` f32 workspace.
    pub acum: *mut f32,
    /// `[nchunks, heads, head_dim, state_size]` f32 workspace: each chunk's own state.
    pub states: *mut f32,
    /// `[nchunks, heads, head_dim, state_size]` bf16 workspace: each chunk's start state.
    pub starts: *mut u16,
    /// `[nchunks, groups, 64, 256]` f32 workspace: each chunk's scores `C_i . B_j`, per 16x16
    /// tile `(I, J)` (`8 I + J`, J <= I) as its two 16x8 accumulators in lane order (lane l's
    /// eight values at `8 l`).
    pub cb: *mut f32,
    /// `[tokens, heads * head_dim]` bf16, written.
    pub y: *mut u16,
    pub nchunks: u32,
    pub geo: SsmGeometry,
    pub x_stride: u32,
    pub dt_stride: u32,
    pub b_stride: u32,
    pub c_stride: u32,
    /// 1: x, B, C rows 16-byte aligned, their strides, head_dim and state_size multiples of 8,
    /// so tiles are staged 16 bytes at a time (`cp.async`); 0: one element at a time.
    pub vec: u32,
}

/// The state-passing launch: [`SsdParams`] plus the state cache and the sequences' slots.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct SsdPassParams<S> {
    pub base: SsdParams,
    /// `[slots, heads, head_dim, state_size]`: initial states read, final states written.
    pub state: *mut S,
    /// `[nseq]` slot of each sequence, or PAD_SLOT (zero initial state, nothing written).
    pub cache_index: *const i32,
    /// `[nseq]` 1 where the sequence starts from its slot's state.
    pub has_initial: *const u8,
    /// `[nseq + 1]` index of each sequence's first chunk; the last entry is nchunks.
    pub seq_chunks: *const u32,
    pub nseq: u32,
}

// SAFETY: #[repr(C)], Copy, only pointers, integers and floats.
unsafe impl KernelParams for SsdParams {}
// SAFETY: as above.
unsafe impl KernelParams for SsdPassParams<f32> {}
// SAFETY: as above.
unsafe impl KernelParams for SsdPassParams<u16> {}

/// Dynamic shared memory of `ssd_chunk_state_f32`: the chunk's x and B tiles, then the f32
/// weights and eight words of scratch; or, for a scores block, its C and B tiles.
pub const fn chunk_state_smem_bytes(head_dim: u32, state_size: u32) -> u32 {
    let states = tile_bytes(SSD_CHUNK, head_dim) + tile_bytes(SSD_CHUNK, state_size) + (SSD_CHUNK + 8) * 4;
    let scores = 2 * tile_bytes(SSD_CHUNK, state_size);
    if states > scores { states } else { scores }
}

/// Dynamic shared memory of `ssd_scan_bf16`: the chunk's C and x tiles, S_start, then the f32
/// cumsum and deltas.
pub const fn scan_smem_bytes(head_dim: u32, state_size: u32) -> u32 {
    tile_bytes(SSD_CHUNK, state_size)
        + tile_bytes(SSD_CHUNK, head_dim)
        + tile_bytes(head_dim, state_size)
        + 2 * SSD_CHUNK * 4
}

#[cfg(target_arch = "nvptx64")]
mod kernels {
    use super::*;
    use crate::conv1d::PAD_SLOT;
    use crate::device::*;
    use crate::mma::{Tile, acc_col, acc_row, acc_to_a, mma, pack, smem_addr, staged, tile_stride, unpack};

    const CHUNK: usize = SSD_CHUNK as usize;

    /// Two f32 stored as one 8-byte access.
    #[repr(C, align(8))]
    #[derive(Clone, Copy)]
    struct F32x2([f32; 2]);

    /// Four f32 moved as one 16-byte access.
    #[repr(C, align(16))]
    #[derive(Clone, Copy)]
    struct F32x4([f32; 4]);

    /// Offset of (chunk, head) in the `[nchunks, heads, SSD_CHUNK]` workspaces.
    #[inline(always)]
    fn ch_off(p: &SsdParams, c: usize, h: usize) -> usize {
        (c * p.geo.heads as usize + h) * CHUNK
    }

    /// `n` rounded up to the 16 of one `mma` step.
    #[inline(always)]
    fn up16(n: u32) -> u32 {
        n.div_ceil(16) * 16
    }

    /// The two bf16 of `v` scaled by `w0` (lower) and `w1` (upper), rounded again.
    #[inline(always)]
    fn scale2(v: u32, w0: f32, w1: f32) -> u32 {
        let (a, b) = unpack(v);
        pack(a * w0, b * w1)
    }

    /// Chunk cumsum and chunk states, [`SsdParams`]. Grid `(nchunks, heads)`, block
    /// [`SSD_STATE_BLOCK`], dynamic shared memory `chunk_state_smem_bytes`. Threads `i < 128`:
    /// delta and the inclusive cumsum at row i (zero and flat past the chunk's length). Then
    /// the product `(x . w)^T B`, `head_dim x state_size` over the chunk's tokens: work items
    /// of 16 state rows x 64 state columns, warp w taking items w, w + 8, ...; x (A, stored
    /// `[token][channel]`) scaled by the weights in its fragments.
    #[unsafe(no_mangle)]
    pub unsafe extern "ptx-kernel" fn ssd_chunk_state_f32(p: SsdParams) {
        grid_dependency_wait();
        if block_y() >= p.geo.heads {
            // SAFETY: as below; the whole block takes this branch.
            unsafe { chunk_scores(&p) };
            return;
        }
        let (c, h) = (block_x() as usize, block_y() as usize);
        let (tid, w, lane) = (thread_x(), warp_id(), lane_id());
        let (hd, n) = (p.geo.head_dim, p.geo.state_size);
        let g = h / (p.geo.heads / p.geo.groups) as usize;
        let vec = p.vec != 0;
        // SAFETY: launch contract checked by host/src/ssd.rs (inputs cover the chunk's rows at
        // these columns, workspaces the plan's chunks); the tiles and f32 arrays fit in
        // chunk_state_smem_bytes; barriers separate staging from use.
        unsafe {
            let ch = ld(p.chunks, c);
            let (start, len) = (ch.start as usize, ch.len);
            let xs = Tile { addr: smem_addr(0), stride: tile_stride(hd) };
            let bs = Tile { addr: smem_addr(tile_bytes(SSD_CHUNK, hd)), stride: tile_stride(n) };
            let (xst, bst) = (p.x_stride as usize, p.b_stride as usize);
            let x0 = p.x.wrapping_add(start * xst + h * hd as usize);
            xs.stage(x0, xst, (SSD_CHUNK, up16(hd)), (len, hd), vec, (tid, SSD_STATE_BLOCK));
            let b0 = p.b.wrapping_add(start * bst + g * n as usize);
            bs.stage(b0, bst, (SSD_CHUNK, up16(n)), (len, n), vec, (tid, SSD_STATE_BLOCK));
            let f = dyn_smem_f32().wrapping_add(((tile_bytes(SSD_CHUNK, hd) + tile_bytes(SSD_CHUNK, n)) / 4) as usize);
            let (w_s, scratch) = (f, f.wrapping_add(CHUNK));
            let off = ch_off(&p, c, h);
            let i = tid as usize;
            let mut delta = 0.0f32;
            if tid < len {
                let dtv = bf16_to_f32(ld(p.dt, (start + i) * p.dt_stride as usize + h)) + ld(p.dt_bias, h);
                delta = softplus(dtv).max(p.geo.dt_min).min(p.geo.dt_max);
            }
            let mut v = warp_inclusive_sum(delta * ld(p.a, h));
            if lane == 31 {
                st(scratch, w as usize, v);
            }
            sync_threads();
            // Row i's cumsum adds the totals of the warps before it; a_last, row 127's, the
            // same sums in the same order (its own warp's total first).
            let mut last = ld(scratch, 3);
            for k in 0..3 {
                last += ld(scratch, k);
            }
            for k in 0..w as usize {
                v += ld(scratch, k);
            }
            // One branch between the barriers: the compiler may duplicate a barrier between
            // two branches of one condition (sanitizers then see divergent barriers).
            if i < CHUNK {
                st(p.acum, off + i, v);
                st(p.delta, off + i, delta);
                st(w_s, i, exp_fast(last - v) * delta);
            }
            staged();
            let (ptiles, nblocks) = (up16(hd) / 16, up16(n).div_ceil(64));
            let ksteps = len.div_ceil(16);
            let base = (c * p.geo.heads as usize + h) * (hd * n) as usize;
            let mut item = w;
            while item < ptiles * nblocks {
                let (m0, n0) = (16 * (item % ptiles), 64 * (item / ptiles));
                let ntiles = ((up16(n) - n0) / 8).min(8);
                let mut acc = [[0.0f32; 4]; 8];
                for ks in 0..SSD_CHUNK / 16 {
                    if ks < ksteps {
                        let mut a = xs.a_t(m0, 16 * ks);
                        let j = (16 * ks + 2 * (lane % 4)) as usize;
                        let (w0, w1, w8, w9) = (ld(w_s, j), ld(w_s, j + 1), ld(w_s, j + 8), ld(w_s, j + 9));
                        a = [scale2(a[0], w0, w1), scale2(a[1], w0, w1), scale2(a[2], w8, w9), scale2(a[3], w8, w9)];
                        for q in 0..4 {
                            if 2 * q < ntiles {
                                let b = bs.b_kn(16 * ks, n0 + 16 * q);
                                mma(&mut acc[2 * q as usize], a, b[0]);
                                mma(&mut acc[2 * q as usize + 1], a, b[1]);
                            }
                        }
                    }
                }
                for (t, tile) in acc.iter().enumerate() {
                    for e in [0, 2] {
                        let (r, col) = (m0 + acc_row(lane, e), n0 + 8 * t as u32 + acc_col(lane, e));
                        let at = base + (r * n + col) as usize;
                        let (v0, v1) = (tile[e as usize], tile[e as usize + 1]);
                        if vec && r < hd && col < n {
                            // col even, n a multiple of 8: both columns in the row, 8-byte aligned.
                            st(p.states.wrapping_add(at) as *mut F32x2, 0, F32x2([v0, v1]));
                        } else if r < hd {
                            for (k, v) in [v0, v1].into_iter().enumerate() {
                                if col + (k as u32) < n {
                                    st(p.states, at + k, v);
                                }
                            }
                        }
                    }
                }
                item += SSD_STATE_BLOCK / 32;
            }
        }
    }

    /// The scores block (c, heads + g) of `ssd_chunk_state_f32`: `C_i . B_j` of chunk c and
    /// group g for the 36 tiles `J <= I` (those past the chunk's length skipped) into `cb`,
    /// warp w taking tiles w, w + 8, ... (row-major over the triangle). Even and odd k steps
    /// accumulate apart (two chains of dependent products, not one twice as long).
    ///
    /// # Safety
    /// The launch contract of `ssd_chunk_state_f32`.
    #[inline(always)]
    unsafe fn chunk_scores(p: &SsdParams) {
        let (c, g) = (block_x() as usize, (block_y() - p.geo.heads) as usize);
        let (tid, w, lane) = (thread_x(), warp_id(), lane_id());
        let n = p.geo.state_size;
        let np = up16(n);
        let vec = p.vec != 0;
        // SAFETY: as the caller's (B, C cover the chunk's rows at group g's columns; cb holds
        // the plan's chunks x groups); the two tiles fit in chunk_state_smem_bytes.
        unsafe {
            let ch = ld(p.chunks, c);
            let (start, len) = (ch.start as usize, ch.len);
            let cs = Tile { addr: smem_addr(0), stride: tile_stride(n) };
            let bs = Tile { addr: smem_addr(tile_bytes(SSD_CHUNK, n)), stride: tile_stride(n) };
            let (cst, bst, gn) = (p.c_stride as usize, p.b_stride as usize, g * n as usize);
            cs.stage(p.c.wrapping_add(start * cst + gn), cst, (SSD_CHUNK, np), (len, n), vec, (tid, SSD_STATE_BLOCK));
            bs.stage(p.b.wrapping_add(start * bst + gn), bst, (SSD_CHUNK, np), (len, n), vec, (tid, SSD_STATE_BLOCK));
            staged();
            let rows = len.div_ceil(16);
            let mut t = w;
            while t < 36 {
                let mut ti = 0;
                while (ti + 1) * (ti + 2) / 2 <= t {
                    ti += 1;
                }
                let tj = t - ti * (ti + 1) / 2;
                if ti < rows {
                    let mut cb = [[[0.0f32; 4]; 2]; 2];
                    for ks in 0..SSD_MAX_STATE / 16 {
                        if 16 * ks < np {
                            let (a, b) = (cs.a(16 * ti, 16 * ks), bs.b_nk(16 * ks, 16 * tj));
                            let part = &mut cb[ks as usize % 2];
                            mma(&mut part[0], a, b[0]);
                            mma(&mut part[1], a, b[1]);
                        }
                    }
                    let v = |tt: usize| F32x4(core::array::from_fn(|e| cb[0][tt][e] + cb[1][tt][e]));
                    let at = ((c * p.geo.groups as usize + g) * 64 + (8 * ti + tj) as usize) * 256 + 8 * lane as usize;
                    let out = p.cb.wrapping_add(at) as *mut F32x4;
                    st(out, 0, v(0));
                    st(out, 1, v(1));
                }
                t += SSD_STATE_BLOCK / 32;
            }
        }
    }

    /// State passing, [`SsdPassParams`]. Grid `(ceil(head_dim * state_size / span), heads,
    /// nseq)` with `span = SSD_PASS_BLOCK * SSD_PASS_PER_THREAD`, block [`SSD_PASS_BLOCK`].
    /// Thread (o, h, s): state elements `o + SSD_PASS_BLOCK r` of its block's span, walking
    /// sequence s's chunks in order (the own states and decays of the next four chunks in
    /// flight), writing each chunk's start state to `starts`, then the final state to the
    /// slot. This thread alone touches those elements of (s, h).
    #[inline(always)]
    unsafe fn state_pass<S: StateElem>(q: &SsdPassParams<S>) {
        const PER: usize = SSD_PASS_PER_THREAD as usize;
        const AHEAD: usize = 4;
        let p = &q.base;
        let (h, s) = (block_y() as usize, block_z() as usize);
        let blk = SSD_PASS_BLOCK as usize;
        let o0 = block_x() as usize * blk * PER + thread_x() as usize;
        let hn = (p.geo.head_dim * p.geo.state_size) as usize;
        let heads = p.geo.heads as usize;
        // SAFETY: launch contract checked by host/src/ssd.rs (slots PAD_SLOT or in range and
        // distinct across sequences, seq_chunks consistent with chunks, workspaces of the
        // plan's chunks); every access is at an element o < hn.
        unsafe {
            let slot = ld(q.cache_index, s);
            let at = |o: usize| q.state.wrapping_add((slot as usize * heads + h) * hn + o);
            let init = slot != PAD_SLOT && ld(q.has_initial, s) != 0;
            let mut state = [0.0f32; PER];
            for (r, v) in state.iter_mut().enumerate() {
                let o = o0 + blk * r;
                if init && o < hn {
                    *v = S::load(at(o));
                }
            }
            let idx = |c: usize, o: usize| (c * heads + h) * hn + o;
            let load = |c: usize| {
                let mut own = [0.0f32; PER];
                for (r, v) in own.iter_mut().enumerate() {
                    let o = o0 + blk * r;
                    if o < hn {
                        *v = ld(p.states, idx(c, o));
                    }
                }
                (own, exp_fast(ld(p.acum, ch_off(p, c, h) + CHUNK - 1)))
            };
            let (c0, c1) = (ld(q.seq_chunks, s) as usize, ld(q.seq_chunks, s + 1) as usize);
            // A ring of the next AHEAD chunks' loads, refilled as each is used: the chain
            // waits on one load latency per AHEAD chunks, not per chunk. Unrolled by AHEAD so
            // the ring stays in registers.
            let mut ring = [([0.0f32; PER], 0.0f32); AHEAD];
            for (k, r) in ring.iter_mut().enumerate() {
                if c0 + k < c1 {
                    *r = load(c0 + k);
                }
            }
            let mut c = c0;
            while c < c1 {
                for (k, r) in ring.iter_mut().enumerate() {
                    let ck = c + k;
                    if ck < c1 {
                        let (own, decay) = *r;
                        if ck + AHEAD < c1 {
                            *r = load(ck + AHEAD);
                        }
                        for (e, v) in state.iter_mut().enumerate() {
                            let o = o0 + blk * e;
                            if o < hn {
                                st(p.starts, idx(ck, o), f32_to_bf16(*v));
                                *v = decay * *v + own[e];
                            }
                        }
                    }
                }
                c += AHEAD;
            }
            if slot != PAD_SLOT {
                for (r, v) in state.iter().enumerate() {
                    let o = o0 + blk * r;
                    if o < hn {
                        S::store(at(o), *v);
                    }
                }
            }
        }
    }

    /// State passing with an f32 state cache, [`SsdPassParams`]`<f32>`.
    #[unsafe(no_mangle)]
    pub unsafe extern "ptx-kernel" fn ssd_state_pass_f32(q: SsdPassParams<f32>) {
        grid_dependency_wait();
        // SAFETY: launch contract checked by the host launcher.
        unsafe { state_pass(&q) }
    }

    /// State passing with a bf16 state cache, [`SsdPassParams`]`<u16>`.
    #[unsafe(no_mangle)]
    pub unsafe extern "ptx-kernel" fn ssd_state_pass_bf16(q: SsdPassParams<u16>) {
        grid_dependency_wait();
        // SAFETY: launch contract checked by the host launcher.
        unsafe { state_pass(&q) }
    }

    /// Chunk scan outputs, [`SsdParams`], after state passing. Grid `(nchunks, heads)`, block
    /// [`SSD_SCAN_BLOCK`], dynamic shared memory `scan_smem_bytes`. The chunk's C, B, x,
    /// S_start, cumsum and deltas staged (C, x, S_start: the chunk's scores are read from `cb`
    /// by each lane, its accumulator elements, the next tile's loaded while one is used); warp
    /// w then computes row tiles w % 4 and 7 - w % 4 (16 rows each, skipped past the chunk's
    /// length) for channels `32 (w / 4) .. + 32`: the `S_start C` product (C as A, S_start
    /// stored `[channel][state]`, B as `[n][k]`) scaled per row by `exp(a_i)`, then per 16-token
    /// tile of the causal part the scores weighted by `exp(a_i - a_j) delta_j` (zero where
    /// j > i), as the A fragment of their product with x (stored `[token][channel]`, B as
    /// `[k][n]`); `D x` added at the store.
    #[unsafe(no_mangle)]
    pub unsafe extern "ptx-kernel" fn ssd_scan_bf16(p: SsdParams) {
        grid_dependency_wait();
        let (c, h) = (block_x() as usize, block_y() as usize);
        let (tid, w, lane) = (thread_x(), warp_id(), lane_id());
        let (hd, n) = (p.geo.head_dim, p.geo.state_size);
        let (pp, np) = (up16(hd), up16(n));
        let g = h / (p.geo.heads / p.geo.groups) as usize;
        let vec = p.vec != 0;
        let blk = SSD_SCAN_BLOCK;
        // SAFETY: launch contract checked by host/src/ssd.rs; the tiles and f32 arrays fit in
        // scan_smem_bytes; `staged` separates staging from use (no barrier after it).
        unsafe {
            let ch = ld(p.chunks, c);
            let (start, len) = (ch.start as usize, ch.len);
            let tn = tile_bytes(SSD_CHUNK, n);
            let cs = Tile { addr: smem_addr(0), stride: tile_stride(n) };
            let xs = Tile { addr: smem_addr(tn), stride: tile_stride(hd) };
            let ss = Tile { addr: smem_addr(tn + tile_bytes(SSD_CHUNK, hd)), stride: tile_stride(n) };
            let (cst, xst) = (p.c_stride as usize, p.x_stride as usize);
            let gn = g * n as usize;
            cs.stage(p.c.wrapping_add(start * cst + gn), cst, (SSD_CHUNK, np), (len, n), vec, (tid, blk));
            let x0 = p.x.wrapping_add(start * xst + h * hd as usize);
            xs.stage(x0, xst, (SSD_CHUNK, pp), (len, hd), vec, (tid, blk));
            let s0 = p.starts.wrapping_add((c * p.geo.heads as usize + h) * (hd * n) as usize);
            ss.stage(s0, n as usize, (pp, np), (hd, n), vec, (tid, blk));
            let used = tn + tile_bytes(SSD_CHUNK, hd) + tile_bytes(hd, n);
            let acum_s = dyn_smem_f32().wrapping_add((used / 4) as usize);
            let delta_s = acum_s.wrapping_add(CHUNK);
            let off = ch_off(&p, c, h);
            if tid < SSD_CHUNK {
                st(acum_s, tid as usize, ld(p.acum, off + tid as usize));
                st(delta_s, tid as usize, ld(p.delta, off + tid as usize));
            }
            staged();
            let dh = if p.d.is_null() { 0.0 } else { ld(p.d, h) };
            let width = p.geo.heads as usize * hd as usize;
            // Warp w: row tiles w % 4 and 7 - w % 4, channels 32 (w / 4) .. + 32.
            let p0 = 32 * (w / 4);
            for half in 0..2 {
                let rt = if half == 0 { w % 4 } else { 7 - w % 4 };
                let i0 = 16 * rt;
                if i0 >= len || p0 >= pp {
                    continue;
                }
                let mut acc = [[0.0f32; 4]; 4];
                for ks in 0..SSD_MAX_STATE / 16 {
                    if 16 * ks < np {
                        let a = cs.a(i0, 16 * ks);
                        for q in 0..2 {
                            if p0 + 16 * q < pp {
                                let b = ss.b_nk(16 * ks, p0 + 16 * q);
                                mma(&mut acc[2 * q as usize], a, b[0]);
                                mma(&mut acc[2 * q as usize + 1], a, b[1]);
                            }
                        }
                    }
                }
                let (r0, r1) = (i0 + lane / 4, i0 + lane / 4 + 8);
                let (a0, a1) = (ld(acum_s, r0 as usize), ld(acum_s, r1 as usize));
                let (e0, e1) = (exp_fast(a0), exp_fast(a1));
                for t in acc.iter_mut() {
                    *t = [t[0] * e0, t[1] * e0, t[2] * e1, t[3] * e1];
                }
                // This row tile's scores, lane l's eight at 8 l of each tile; the next tile's
                // loaded while this one's are used.
                let tiles = p.cb.wrapping_add(((c * p.geo.groups as usize + g) * 64 + 8 * rt as usize) * 256);
                let load = |jt: u32| {
                    let at = tiles.wrapping_add(256 * jt as usize + 8 * lane as usize) as *const F32x4;
                    [ld(at, 0).0, ld(at, 1).0]
                };
                let mut next = load(0);
                for jt in 0..=rt {
                    let j0 = 16 * jt;
                    let cb = next;
                    if jt < rt {
                        next = load(jt + 1);
                    }
                    let mut scores = [[0.0f32; 4]; 2];
                    for (tt, tile) in scores.iter_mut().enumerate() {
                        for (e, v) in tile.iter_mut().enumerate() {
                            let (i, j) = (i0 + acc_row(lane, e as u32), j0 + 8 * tt as u32 + acc_col(lane, e as u32));
                            let ai = if e < 2 { a0 } else { a1 };
                            let wj = exp_fast(ai - ld(acum_s, j as usize)) * ld(delta_s, j as usize);
                            *v = if j <= i { cb[tt][e] * wj } else { 0.0 };
                        }
                    }
                    let a = acc_to_a(scores[0], scores[1]);
                    for q in 0..2 {
                        if p0 + 16 * q < pp {
                            let b = xs.b_kn(j0, p0 + 16 * q);
                            mma(&mut acc[2 * q as usize], a, b[0]);
                            mma(&mut acc[2 * q as usize + 1], a, b[1]);
                        }
                    }
                }
                for (t, tile) in acc.iter().enumerate() {
                    for e in [0, 2] {
                        let (i, col) = (i0 + acc_row(lane, e), p0 + 8 * t as u32 + acc_col(lane, e));
                        if i >= len || col >= hd {
                            continue;
                        }
                        let at = (start + i as usize) * width + h * hd as usize + col as usize;
                        if vec {
                            // col even, head_dim a multiple of 8: both channels, 4-byte aligned.
                            let v0 = tile[e as usize] + dh * xs.get(i, col);
                            let v1 = tile[e as usize + 1] + dh * xs.get(i, col + 1);
                            st(p.y.wrapping_add(at) as *mut u32, 0, pack(v0, v1));
                        } else {
                            for k in 0..2 {
                                if col + k < hd {
                                    let v = tile[(e + k) as usize] + dh * xs.get(i, col + k);
                                    st(p.y, at + k as usize, f32_to_bf16(v));
                                }
                            }
                        }
                    }
                }
            }
        }
    }
}
