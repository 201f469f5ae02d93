//! Chunked scan (SSD), the Mamba2 prefill (SPEC.md section 3), varlen.
//!
//! Sequences are cut into chunks of [`SSD_CHUNK`] tokens that never span two sequences; the
//! host's plan lists them ([`SsdChunk`]) and where each sequence's chunks start. Four launches:
//!
//! 1. `ssd_cumsum_f32`: per (chunk, head), `delta_i = clamp(softplus(dt_i + dt_bias))` and the
//!    inclusive cumsum `a_i = sum_{j<=i} delta_j * A` (f32 workspaces `delta`, `acum`,
//!    `[nchunks, heads, SSD_CHUNK]`);
//! 2. `ssd_chunk_state_f32`: per (chunk, head), the chunk's own state
//!    `s_c = sum_j exp(a_last - a_j) * delta_j * x_j (outer) B_j` into `states`
//!    (`[nchunks, heads, head_dim, state_size]` f32);
//! 3. `ssd_state_pass_{f32,bf16}`: per (sequence, head, state element), in chunk order,
//!    replaces each `s_c` in `states` by the chunk's start state `S_start(c)` (the slot's state
//!    for the first chunk where the sequence has one, else zero) and writes the final
//!    `S_end = exp(a_last) * S_start + s_c` of the last chunk to the sequence's slot;
//! 4. `ssd_scan_bf16`: per (chunk, head, tile of [`SSD_I_TILE`] rows),
//!    `y_i = exp(a_i) * (C_i . S_start) + sum_{j<=i} (C_i . B_j) exp(a_i - a_j) delta_j x_j + D x_i`.
//!
//! Inputs are rows with their own strides (slices of wider rows), as for the state update:
//! `x [tokens, x_stride]` (heads * head_dim channels), `dt [tokens, dt_stride]`, `B`, `C`
//! `[tokens, *_stride]` (groups * state_size), `y [tokens, heads * head_dim]`; head h reads
//! group `h / (heads / groups)`. Limits: `head_dim <= 64`, `state_size <= 256`,
//! `head_dim * state_size <= 8192`.

use crate::KernelParams;

/// Tokens per chunk.
pub const SSD_CHUNK: u32 = 128;
/// Threads per block of the chunk-state, state-passing and scan kernels.
pub const SSD_BLOCK: u32 = 256;
/// Rows of a chunk one scan block computes.
pub const SSD_I_TILE: u32 = 32;
/// Tokens staged at a time in shared memory.
pub const SSD_J_TILE: u32 = 32;
/// Largest head_dim * state_size (each chunk-state thread holds 32 outputs).
pub const SSD_MAX_HEAD_STATE: u32 = 8192;
/// Largest head_dim (each scan thread holds 8 outputs of a 32-row tile).
pub const SSD_MAX_HEAD_DIM: u32 = 64;
/// Largest state_size.
pub const SSD_MAX_STATE: u32 = 256;

/// One chunk of the plan: `len` tokens of sequence `seq` from row `start`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SsdChunk {
    pub seq: u32,
    pub start: u32,
    pub len: u32,
    pub _pad: u32,
}

/// Inputs, workspaces and output shared by the four launches.
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
    /// `[nchunks, heads, head_dim, state_size]` f32 workspace.
    pub states: *mut f32,
    /// `[tokens, heads * head_dim]` bf16, written.
    pub y: *mut u16,
    pub nchunks: u32,
    pub heads: u32,
    pub head_dim: u32,
    pub groups: u32,
    pub state_size: u32,
    pub x_stride: u32,
    pub dt_stride: u32,
    pub b_stride: u32,
    pub c_stride: u32,
    pub dt_min: f32,
    pub dt_max: f32,
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

/// Dynamic shared memory of `ssd_chunk_state_f32`.
pub const fn chunk_state_smem_bytes(head_dim: u32, state_size: u32) -> u32 {
    SSD_J_TILE * (head_dim + state_size) * 4
}

/// Dynamic shared memory of `ssd_scan_bf16`: C tile, S_start (then B tiles), x tile, weights.
pub const fn scan_smem_bytes(head_dim: u32, state_size: u32) -> u32 {
    let big = if head_dim > SSD_J_TILE { head_dim * state_size } else { SSD_J_TILE * state_size };
    (SSD_I_TILE * state_size + big + SSD_J_TILE * head_dim + SSD_I_TILE * SSD_J_TILE) * 4
}

#[cfg(target_arch = "nvptx64")]
mod kernels {
    use super::*;
    use crate::conv1d::PAD_SLOT;
    use crate::device::*;

    const CHUNK: usize = SSD_CHUNK as usize;
    /// Chunk-state outputs per thread.
    const OUT_STATE: usize = (SSD_MAX_HEAD_STATE / SSD_BLOCK) as usize;
    /// Scan outputs per thread.
    const OUT_SCAN: usize = (SSD_I_TILE * SSD_MAX_HEAD_DIM / SSD_BLOCK) as usize;

    /// Offset of (chunk, head) in the `[nchunks, heads, SSD_CHUNK]` workspaces.
    #[inline(always)]
    fn ch_off(p: &SsdParams, c: usize, h: usize) -> usize {
        (c * p.heads as usize + h) * CHUNK
    }

    /// Chunk cumsum, [`SsdParams`]. Grid `(nchunks, heads)`, block [`SSD_CHUNK`], dynamic
    /// shared memory 16 bytes. Thread i: delta and the inclusive cumsum of delta * A at row i.
    #[unsafe(no_mangle)]
    pub unsafe extern "ptx-kernel" fn ssd_cumsum_f32(p: SsdParams) {
        grid_dependency_wait();
        let (c, h, i) = (block_x() as usize, block_y() as usize, thread_x() as usize);
        // SAFETY: launch contract checked by host/src/ssd.rs; thread i alone writes entry i.
        unsafe {
            let ch = ld(p.chunks, c);
            let mut delta = 0.0f32;
            if i < ch.len as usize {
                let t = ch.start as usize + i;
                let dtv = bf16_to_f32(ld(p.dt, t * p.dt_stride as usize + h)) + ld(p.dt_bias, h);
                delta = softplus(dtv).max(p.dt_min).min(p.dt_max);
            }
            let mut v = warp_inclusive_sum(delta * ld(p.a, h));
            let smem = dyn_smem_f32();
            if lane_id() == 31 {
                st(smem, warp_id() as usize, v);
            }
            sync_threads();
            for w in 0..warp_id() as usize {
                v += ld(smem, w);
            }
            let o = ch_off(&p, c, h) + i;
            st(p.delta, o, delta);
            st(p.acum, o, v);
        }
    }

    /// Fills `count` entries of shared memory, the block's threads over them: entry e goes to
    /// `dst[at]` with `(at, value) = f(e)`.
    ///
    /// # Safety
    /// Every `at` within `dst`; `f` reads only what the caller may read.
    #[inline(always)]
    unsafe fn stage(dst: *mut f32, count: usize, f: impl Fn(usize) -> (usize, f32)) {
        let mut e = thread_x() as usize;
        while e < count {
            let (at, v) = f(e);
            // SAFETY: at within dst (caller).
            unsafe { st(dst, at, v) };
            e += SSD_BLOCK as usize;
        }
    }

    /// Element `i` of row `j` of a token slice `(start, len)` of a strided bf16 activation
    /// `(base, stride, first column)`, as f32; zero past `len`.
    ///
    /// # Safety
    /// Rows `start..start + len` readable at those columns.
    #[inline(always)]
    unsafe fn token(
        (a, stride, col): (*const u16, usize, usize),
        (start, len): (usize, usize),
        j: usize,
        i: usize,
    ) -> f32 {
        // SAFETY: j < len, so the row is one of the slice's (caller).
        if j < len { bf16_to_f32(unsafe { ld(a, (start + j) * stride + col + i) }) } else { 0.0 }
    }

    /// Chunk states, [`SsdParams`]. Grid `(nchunks, heads)`, block [`SSD_BLOCK`], dynamic
    /// shared memory `chunk_state_smem_bytes`. Tokens are staged SSD_J_TILE at a time
    /// (`x_j * exp(a_last - a_j) * delta_j` and `B_j`); thread t accumulates outputs
    /// `t + SSD_BLOCK * r` of the head_dim x state_size state.
    #[unsafe(no_mangle)]
    pub unsafe extern "ptx-kernel" fn ssd_chunk_state_f32(p: SsdParams) {
        grid_dependency_wait();
        let (c, h, t) = (block_x() as usize, block_y() as usize, thread_x() as usize);
        let (hd, n) = (p.head_dim as usize, p.state_size as usize);
        let g = h / (p.heads / p.groups) as usize;
        let jt = SSD_J_TILE as usize;
        let blk = SSD_BLOCK as usize;
        // SAFETY: launch contract checked by host/src/ssd.rs; shared memory holds
        // jt * (hd + n) floats; barriers separate staging from use.
        unsafe {
            let ch = ld(p.chunks, c);
            let (start, len) = (ch.start as usize, ch.len as usize);
            let off = ch_off(&p, c, h);
            let a_last = ld(p.acum, off + len - 1);
            let xw = dyn_smem_f32();
            let bt = xw.wrapping_add(jt * hd);
            let mut acc = [0.0f32; OUT_STATE];
            let mut j0 = 0;
            while j0 < len {
                let x = (p.x, p.x_stride as usize, h * hd);
                stage(xw, jt * hd, |e| {
                    let j = j0 + e / hd;
                    let w = if j < len { exp_fast(a_last - ld(p.acum, off + j)) * ld(p.delta, off + j) } else { 0.0 };
                    (e, token(x, (start, len), j, e % hd) * w)
                });
                let b = (p.b, p.b_stride as usize, g * n);
                stage(bt, jt * n, |e| (e, token(b, (start, len), j0 + e / n, e % n)));
                sync_threads();
                // Outputs outer (their (p, n) found once, in 32-bit arithmetic), staged tokens
                // inner with a runtime bound: no division in the inner loop.
                let jn = (len - j0).min(jt) as u32;
                for (r, a) in acc.iter_mut().enumerate() {
                    let o = (t + blk * r) as u32;
                    if o < (hd * n) as u32 {
                        let (pi, ni) = ((o / n as u32) as usize, (o % n as u32) as usize);
                        let mut sum = *a;
                        for jj in 0..jn as usize {
                            sum += ld(xw, jj * hd + pi) * ld(bt, jj * n + ni);
                        }
                        *a = sum;
                    }
                }
                sync_threads();
                j0 += jt;
            }
            let base = (c * p.heads as usize + h) * hd * n;
            for (r, a) in acc.iter().enumerate() {
                let o = t + blk * r;
                if o < hd * n {
                    st(p.states, base + o, *a);
                }
            }
        }
    }

    /// State passing, [`SsdPassParams`]. Grid `(ceil(head_dim * state_size / SSD_BLOCK),
    /// heads, nseq)`, block [`SSD_BLOCK`]. Thread (o, h, s): walks sequence s's chunks in
    /// order, replacing `states[c, h, o]` by the chunk's start state, then writes the final
    /// state to the slot. This thread alone touches state element o of (s, h).
    #[inline(always)]
    unsafe fn state_pass<S: StateElem>(q: &SsdPassParams<S>) {
        let p = &q.base;
        let (h, s) = (block_y() as usize, block_z() as usize);
        let o = (block_x() * SSD_BLOCK + thread_x()) as usize;
        let hn = (p.head_dim * p.state_size) as usize;
        if o >= hn {
            return;
        }
        // SAFETY: launch contract checked by host/src/ssd.rs (slots PAD_SLOT or in range and
        // distinct across sequences, seq_chunks consistent with chunks).
        unsafe {
            let slot = ld(q.cache_index, s);
            let at = |slot: i32| q.state.wrapping_add((slot as usize * p.heads as usize + h) * hn + o);
            let mut st_v = if slot != PAD_SLOT && ld(q.has_initial, s) != 0 { S::load(at(slot)) } else { 0.0 };
            for c in ld(q.seq_chunks, s) as usize..ld(q.seq_chunks, s + 1) as usize {
                let idx = (c * p.heads as usize + h) * hn + o;
                let own = ld(p.states, idx);
                st(p.states, idx, st_v);
                let len = ld(p.chunks, c).len as usize;
                st_v = exp_fast(ld(p.acum, ch_off(p, c, h) + len - 1)) * st_v + own;
            }
            if slot != PAD_SLOT {
                S::store(at(slot), st_v);
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

    /// Chunk scan outputs, [`SsdParams`], after state passing. Grid `(nchunks, heads,
    /// SSD_CHUNK / SSD_I_TILE)`, block [`SSD_BLOCK`], dynamic shared memory `scan_smem_bytes`.
    /// Block (c, h, tile): rows `i0 .. i0 + SSD_I_TILE` of chunk c; thread t holds outputs
    /// `t + SSD_BLOCK * r` of the tile (row-major over head_dim). Shared memory: the tile's C
    /// rows, S_start transposed to [n][p] (then B tiles transposed to [n][j]), an x tile, and
    /// the tile's weights `(C_i . B_j) exp(a_i - a_j) delta_j`.
    #[unsafe(no_mangle)]
    pub unsafe extern "ptx-kernel" fn ssd_scan_bf16(p: SsdParams) {
        grid_dependency_wait();
        let (c, h, tile) = (block_x() as usize, block_y() as usize, block_z() as usize);
        let t = thread_x() as usize;
        let (hd, n) = (p.head_dim as usize, p.state_size as usize);
        let g = h / (p.heads / p.groups) as usize;
        let (it, jt, blk) = (SSD_I_TILE as usize, SSD_J_TILE as usize, SSD_BLOCK as usize);
        // SAFETY: launch contract checked by host/src/ssd.rs; shared memory sized by
        // scan_smem_bytes; barriers separate every staging from its uses.
        unsafe {
            let ch = ld(p.chunks, c);
            let (start, len) = (ch.start as usize, ch.len as usize);
            let i0 = tile * it;
            if i0 >= len {
                return;
            }
            let rows = (len - i0).min(it);
            let off = ch_off(&p, c, h);
            let cs = dyn_smem_f32();
            let big = cs.wrapping_add(it * n);
            let big_len = if hd > jt { hd * n } else { jt * n };
            let xs = big.wrapping_add(big_len);
            let cbw = xs.wrapping_add(jt * hd);
            let (x, b) = ((p.x, p.x_stride as usize, h * hd), (p.b, p.b_stride as usize, g * n));
            stage(cs, it * n, |e| (e, token((p.c, p.c_stride as usize, g * n), (start + i0, rows), e / n, e % n)));
            let sbase = (c * p.heads as usize + h) * hd * n;
            stage(big, hd * n, |e| ((e % n) * hd + e / n, ld(p.states, sbase + e)));
            sync_threads();
            let mut acc = [0.0f32; OUT_SCAN];
            for (r, a) in acc.iter_mut().enumerate() {
                let o = t + blk * r;
                if o < it * hd {
                    let (ii, pi) = (o / hd, o % hd);
                    let mut dot = 0.0f32;
                    for ni in 0..n {
                        dot += ld(cs, ii * n + ni) * ld(big, ni * hd + pi);
                    }
                    let ai = if ii < rows { ld(p.acum, off + i0 + ii) } else { 0.0 };
                    *a = exp_fast(ai) * dot;
                }
            }
            let mut j0 = 0;
            while j0 < i0 + rows {
                sync_threads();
                stage(xs, jt * hd, |e| (e, token(x, (start, len), j0 + e / hd, e % hd)));
                stage(big, jt * n, |e| ((e % n) * jt + e / n, token(b, (start, len), j0 + e / n, e % n)));
                sync_threads();
                stage(cbw, it * jt, |e| {
                    let (ii, jj) = (e / jt, e % jt);
                    let (i, j) = (i0 + ii, j0 + jj);
                    let mut w = 0.0f32;
                    if j <= i && ii < rows {
                        let mut dot = 0.0f32;
                        for ni in 0..n {
                            dot += ld(cs, ii * n + ni) * ld(big, ni * jt + jj);
                        }
                        w = dot * exp_fast(ld(p.acum, off + i) - ld(p.acum, off + j)) * ld(p.delta, off + j);
                    }
                    (e, w)
                });
                sync_threads();
                for (r, a) in acc.iter_mut().enumerate() {
                    let o = t + blk * r;
                    if o < it * hd {
                        let (ii, pi) = (o / hd, o % hd);
                        for jj in 0..jt {
                            *a += ld(cbw, ii * jt + jj) * ld(xs, jj * hd + pi);
                        }
                    }
                }
                j0 += jt;
            }
            let dh = if p.d.is_null() { 0.0 } else { ld(p.d, h) };
            for (r, a) in acc.iter().enumerate() {
                let o = t + blk * r;
                if o < it * hd {
                    let (ii, pi) = (o / hd, o % hd);
                    if ii < rows {
                        let row = start + i0 + ii;
                        let xv = bf16_to_f32(ld(p.x, row * p.x_stride as usize + h * hd + pi));
                        st(p.y, (row * p.heads as usize + h) * hd + pi, f32_to_bf16(*a + dh * xv));
                    }
                }
            }
        }
    }
}
