//! Causal depthwise conv1d with SiLU (docs/MATH.md section 1), decode update and varlen prefill.
//!
//! Layouts: activations `x` are rows of `x_stride` bf16 with channels `0..dim` at the start of
//! each row (the mixer's xBC slice of in_proj's output); outputs `y` are contiguous
//! `[rows, dim]` bf16; weights `w` are `[dim, k]` bf16 (the checkpoint's `[dim, 1, k]`), `bias`
//! `[dim]` bf16 or null; the conv state cache is `[slots, dim, k - 1]` bf16 holding each
//! channel's last `k - 1` raw inputs, oldest first. A slot index of [`PAD_SLOT`] marks a padded
//! row or sequence: no state read or write, no output write. Math in f32 from the bias.

use crate::KernelParams;

/// The slot index of a padded row or sequence.
pub const PAD_SLOT: i32 = -1;
/// Widest kernel (taps) the conv kernels handle.
pub const MAX_K: u32 = 8;
/// Threads per block of the conv kernels: one thread per channel (per [`TILE_CHANNELS`]
/// channels in the tiled forward).
pub const CONV_BLOCK: u32 = 256;
/// Tokens a thread of the tiled forward loads at once (one 8-byte load each).
pub const TILE_BATCH: u32 = 8;
/// Channels a thread of the tiled forward computes (one 8-byte load of each token's inputs).
pub const TILE_CHANNELS: u32 = 4;
/// Widest kernel the tiled forward handles (its taps and window live in registers).
pub const TILED_MAX_K: u32 = 4;

/// Decode: one token per row, the state of slot `cache_index[row]` read then rolled in place.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct ConvUpdateParams {
    /// `[batch, x_stride]` bf16, read.
    pub x: *const u16,
    /// `[dim, k]` bf16, read.
    pub w: *const u16,
    /// `[dim]` bf16 or null, read.
    pub bias: *const u16,
    /// `[slots, dim, k - 1]` bf16, read and written at the rows' slots.
    pub state: *mut u16,
    /// `[batch]` slot of each row, or PAD_SLOT.
    pub cache_index: *const i32,
    /// `[batch, dim]` bf16, written (pad rows untouched).
    pub y: *mut u16,
    pub batch: u32,
    pub dim: u32,
    pub k: u32,
    pub x_stride: u32,
}

/// Prefill: several sequences of different lengths, token `t` of sequence `s` at row
/// `cu_seqlens[s] + t`. Used by two launches: the outputs (reading initial states), then the
/// final states (so no block writes a state another block still reads).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct ConvFwdParams {
    /// `[tokens, x_stride]` bf16, read.
    pub x: *const u16,
    pub w: *const u16,
    pub bias: *const u16,
    /// `[slots, dim, k - 1]` bf16: initial states read (outputs launch), final states written
    /// (state launch).
    pub state: *mut u16,
    /// `[nseq + 1]` cumulative start rows, `cu_seqlens[nseq] == tokens`.
    pub cu_seqlens: *const i32,
    /// `[nseq]` slot of each sequence, or PAD_SLOT.
    pub cache_index: *const i32,
    /// `[nseq]` 1 where the sequence continues from its slot's state, else 0.
    pub has_initial: *const u8,
    /// `[tokens, dim]` bf16, written (rows of pad sequences untouched).
    pub y: *mut u16,
    pub tokens: u32,
    pub nseq: u32,
    pub dim: u32,
    pub k: u32,
    pub x_stride: u32,
    /// Tokens per thread of the tiled forward (a multiple of [`TILE_BATCH`]); unused by the
    /// other two.
    pub tile: u32,
}

// SAFETY: #[repr(C)], Copy, only pointers, integers and floats.
unsafe impl KernelParams for ConvUpdateParams {}
// SAFETY: as above.
unsafe impl KernelParams for ConvFwdParams {}

#[cfg(target_arch = "nvptx64")]
pub(crate) use kernels::{KM1, conv_step, put_state};

#[cfg(target_arch = "nvptx64")]
mod kernels {
    use super::*;
    use crate::device::*;

    pub(crate) const KM1: usize = MAX_K as usize - 1;

    /// `silu(bias + sum_j w[c, j] * window[j])` over the `k` taps of channel `c`.
    #[inline(always)]
    unsafe fn conv_out(w: *const u16, bias: *const u16, c: usize, k: usize, window: &[f32; MAX_K as usize]) -> f32 {
        // SAFETY: c < dim; w holds dim * k values, bias dim (or is null).
        unsafe {
            let mut acc = if bias.is_null() { 0.0 } else { bf16_to_f32(ld(bias, c)) };
            for (j, v) in window.iter().enumerate() {
                if j < k {
                    acc += bf16_to_f32(ld(w, c * k + j)) * v;
                }
            }
            silu(acc)
        }
    }

    /// Conv update, [`ConvUpdateParams`]. Grid `(ceil(dim / CONV_BLOCK), batch)`, block
    /// [`CONV_BLOCK`]. Thread (c, row): reads the k - 1 state values of channel c at the row's
    /// slot and x[row, c], writes y[row, c], then the state shifted left with x appended.
    #[unsafe(no_mangle)]
    pub unsafe extern "ptx-kernel" fn conv1d_update_bf16(p: ConvUpdateParams) {
        grid_dependency_wait();
        let c = (block_x() * CONV_BLOCK + thread_x()) as usize;
        let row = block_y() as usize;
        let k = p.k as usize;
        if c >= p.dim as usize {
            return;
        }
        // SAFETY: launch contract checked by host/src/conv1d.rs: the slot is PAD_SLOT or
        // < slots, distinct across rows, so this thread alone touches state[slot, c, ..].
        unsafe {
            let slot = ld(p.cache_index, row);
            if slot == PAD_SLOT {
                return;
            }
            let st_row = p.state.wrapping_add((slot as usize * p.dim as usize + c) * (k - 1));
            let xr = ld(p.x, row * p.x_stride as usize + c);
            let (y, next) = conv_step(p.w, p.bias, c, k, st_row, xr);
            st(p.y, row * p.dim as usize + c, y);
            put_state(st_row, k, &next);
        }
    }

    /// Channel c's decode step from its state row `st_row` (`k - 1` raw inputs, oldest first)
    /// and input `xr`: its output (bf16) and its next state row (the first `k - 1` values).
    ///
    /// # Safety
    /// c < dim of w and bias (or null), st_row readable for k - 1 values, k <= MAX_K.
    #[inline(always)]
    pub(crate) unsafe fn conv_step(
        w: *const u16,
        bias: *const u16,
        c: usize,
        k: usize,
        st_row: *const u16,
        xr: u16,
    ) -> (u16, [u16; KM1]) {
        let mut window = [0.0f32; MAX_K as usize];
        let mut raw = [0u16; KM1];
        // SAFETY: the caller's contract.
        unsafe {
            for (j, (r, v)) in raw.iter_mut().zip(window.iter_mut()).enumerate() {
                if j < k - 1 {
                    *r = ld(st_row, j);
                    *v = bf16_to_f32(*r);
                }
            }
            for (j, v) in window.iter_mut().enumerate() {
                if j == k - 1 {
                    *v = bf16_to_f32(xr);
                }
            }
            let y = f32_to_bf16(conv_out(w, bias, c, k, &window));
            let next = core::array::from_fn(|j| if j + 1 < k - 1 { raw[j + 1] } else { xr });
            (y, next)
        }
    }

    /// Writes the first `k - 1` values of `next` over the state row `st_row`.
    ///
    /// # Safety
    /// st_row writable for k - 1 values, by this thread alone.
    #[inline(always)]
    pub(crate) unsafe fn put_state(st_row: *mut u16, k: usize, next: &[u16; KM1]) {
        for (j, &v) in next.iter().enumerate() {
            if j < k - 1 {
                // SAFETY: the caller's contract.
                unsafe { st(st_row, j, v) };
            }
        }
    }

    /// The sequence holding row `t`: the last s with `cu_seqlens[s] <= t` (binary search).
    #[inline(always)]
    unsafe fn seq_of(cu: *const i32, nseq: u32, t: i32) -> usize {
        let (mut lo, mut hi) = (0usize, nseq as usize);
        while hi - lo > 1 {
            let mid = (lo + hi) / 2;
            // SAFETY: mid < nseq + 1, within cu_seqlens.
            if unsafe { ld(cu, mid) } <= t {
                lo = mid;
            } else {
                hi = mid;
            }
        }
        lo
    }

    /// Input `i` of a sequence's padded stream `xx = prefix ++ x_seq`, where `i < k - 1`
    /// indexes the prefix (the slot's state, or zeros without an initial state).
    #[inline(always)]
    unsafe fn padded_input(p: &ConvFwdParams, s: usize, start: usize, c: usize, i: usize) -> u16 {
        let km1 = p.k as usize - 1;
        // SAFETY: callers pass i < k - 1 + len(s); the prefix is read only for sequences
        // with a non-pad slot and an initial state.
        unsafe {
            if i >= km1 {
                ld(p.x, (start + i - km1) * p.x_stride as usize + c)
            } else if ld(p.has_initial, s) != 0 {
                let slot = ld(p.cache_index, s) as usize;
                ld(p.state, (slot * p.dim as usize + c) * km1 + i)
            } else {
                0
            }
        }
    }

    /// Conv forward outputs, [`ConvFwdParams`]. Grid `(tokens, ceil(dim / CONV_BLOCK))`, block
    /// [`CONV_BLOCK`]. Thread (t, c): finds t's sequence, reads the k inputs ending at t (from
    /// x, or the prefix before the sequence's first token), writes y[t, c]. Reads states only.
    #[unsafe(no_mangle)]
    pub unsafe extern "ptx-kernel" fn conv1d_fwd_bf16(p: ConvFwdParams) {
        grid_dependency_wait();
        let c = (block_y() * CONV_BLOCK + thread_x()) as usize;
        let t = block_x() as usize;
        let k = p.k as usize;
        if c >= p.dim as usize {
            return;
        }
        // SAFETY: launch contract checked by host/src/conv1d.rs (cu_seqlens nondecreasing from
        // 0 to tokens, slots PAD_SLOT or < slots).
        unsafe {
            let s = seq_of(p.cu_seqlens, p.nseq, t as i32);
            if ld(p.cache_index, s) == PAD_SLOT {
                return;
            }
            let start = ld(p.cu_seqlens, s) as usize;
            let mut window = [0.0f32; MAX_K as usize];
            // Output t - start reads padded inputs (t - start) .. (t - start) + k - 1.
            for (j, v) in window.iter_mut().enumerate() {
                if j < k {
                    *v = bf16_to_f32(padded_input(&p, s, start, c, t - start + j));
                }
            }
            st(p.y, t * p.dim as usize + c, f32_to_bf16(conv_out(p.w, p.bias, c, k, &window)));
        }
    }

    /// Conv forward outputs, tiled, [`ConvFwdParams`]: the same values as
    /// [`conv1d_fwd_bf16`] bit for bit, for `k <= TILED_MAX_K`, `dim` and `x_stride`
    /// multiples of [`TILE_CHANNELS`] and 8-byte aligned `x`, `w`, `bias`, `state` and `y`
    /// (the launcher checks). Grid `(ceil(tokens / tile), ceil(dim / (4 * CONV_BLOCK)))`,
    /// block [`CONV_BLOCK`]. Thread (i, g) computes channels `4g .. 4g + 4` of tokens
    /// `i * tile ..` (`tile` of them, fewer at the end): it loads its taps and bias once, the
    /// `k - 1` inputs before its first token (from x, or the sequence's prefix), then batches
    /// of [`TILE_BATCH`] tokens (all loads of a batch first, one 8-byte load each, then the
    /// outputs, the window sliding in registers). A warp's lanes read 256 contiguous bytes of
    /// a row. Four channels a thread, not eight: half the registers (taps, window, batch), so
    /// twice the warps an SM to hide the loads and the two MUFU operations of each output's
    /// SiLU. At a sequence's first token the window restarts from that sequence's prefix;
    /// tokens of pad sequences are skipped. Reads states only.
    #[unsafe(no_mangle)]
    pub unsafe extern "ptx-kernel" fn conv1d_fwd_tiled_bf16(p: ConvFwdParams) {
        grid_dependency_wait();
        // SAFETY: launch contract checked by host/src/conv1d.rs (as for conv1d_fwd_bf16, plus
        // the tiled path's alignment and k).
        unsafe {
            match p.k {
                2 => fwd_tile::<2>(&p),
                3 => fwd_tile::<3>(&p),
                _ => fwd_tile::<4>(&p),
            }
        }
    }

    const CH: usize = TILE_CHANNELS as usize;
    /// Window rows of the tiled forward (`TILED_MAX_K - 1`).
    const MAX_TILED_KM1: usize = TILED_MAX_K as usize - 1;

    /// `n` bf16 from `q` (8-byte aligned, `n` a multiple of 4) as f32, `N >= n` slots.
    ///
    /// # Safety
    /// `q[0..n]` readable.
    #[inline(always)]
    unsafe fn load_run<const N: usize>(q: *const u16, n: usize) -> [f32; N] {
        let mut v = [0.0f32; N];
        for i in (0..N).step_by(4) {
            if i < n {
                // SAFETY: the caller's contract.
                let r = raw4_values(unsafe { load4_raw_whole(q.wrapping_add(i)) });
                v[i..i + 4].copy_from_slice(&r);
            }
        }
        v
    }

    /// [`conv1d_fwd_tiled_bf16`] for `K` taps.
    ///
    /// # Safety
    /// The launch contract of [`conv1d_fwd_tiled_bf16`], with `p.k == K`.
    #[inline(always)]
    unsafe fn fwd_tile<const K: usize>(p: &ConvFwdParams) {
        let c0 = (block_y() * CONV_BLOCK + thread_x()) as usize * CH;
        let (dim, xs) = (p.dim as usize, p.x_stride as usize);
        let t0 = (block_x() * p.tile) as usize;
        let t1 = (t0 + p.tile as usize).min(p.tokens as usize);
        if c0 >= dim {
            return;
        }
        // SAFETY: c0 + 4 <= dim (dim % 4 == 0); rows t < tokens of x and y exist; w holds
        // dim * K values (channels c0.. are 4K of them from c0 * K, 8-byte aligned), bias dim;
        // the state rows read are those of sequences with an initial state and a real slot.
        unsafe {
            // taps[j][i]: tap j of channel c0 + i (w is [dim, K]).
            let wv: [f32; 4 * TILED_MAX_K as usize] = load_run(p.w.wrapping_add(c0 * K), CH * K);
            let taps: [[f32; CH]; K] = core::array::from_fn(|j| core::array::from_fn(|i| wv[i * K + j]));
            let bias = if p.bias.is_null() { [0.0; CH] } else { raw4_values(load4_raw_whole(p.bias.wrapping_add(c0))) };
            let row = |t: usize| load4_raw_whole(p.x.wrapping_add(t * xs + c0));
            // The sequence of the next token and its bounds (`end == t0`: none yet, so the
            // first batch finds t0's), the window (the K - 1 inputs before the next token,
            // oldest first).
            let mut s = seq_of(p.cu_seqlens, p.nseq, t0 as i32);
            let (mut end, mut pad) = (t0, false);
            let mut win = [[0.0f32; CH]; MAX_TILED_KM1];
            let mut tb = t0;
            while tb < t1 {
                if tb >= end {
                    // Sequences have at least one token: this finds tb's, and its window
                    // restarts from the sequence's prefix.
                    while ld(p.cu_seqlens, s + 1) as usize <= tb {
                        s += 1;
                    }
                    let start = ld(p.cu_seqlens, s) as usize;
                    end = ld(p.cu_seqlens, s + 1) as usize;
                    pad = ld(p.cache_index, s) == PAD_SLOT;
                    if !pad {
                        win = tile_window::<K>(p, s, tb - start, tb, c0, &row);
                    }
                }
                // A batch stays inside one sequence.
                let m = (t1.min(end) - tb).min(TILE_BATCH as usize);
                if pad {
                    tb += m;
                    continue;
                }
                let raw: [[u32; 2]; TILE_BATCH as usize] =
                    core::array::from_fn(|u| if u < m { row(tb + u) } else { [0; 2] });
                for (u, r) in raw.iter().enumerate() {
                    if u >= m {
                        break;
                    }
                    let xv = raw4_values(*r);
                    let out: [f32; CH] = core::array::from_fn(|i| {
                        let mut acc = bias[i];
                        for (j, tap) in taps.iter().enumerate() {
                            acc += tap[i] * if j < K - 1 { win[j][i] } else { xv[i] };
                        }
                        silu(acc)
                    });
                    store4_bf16_whole(p.y.wrapping_add((tb + u) * dim + c0), out);
                    for j in 0..K - 1 {
                        win[j] = if j + 1 < K - 1 { win[j + 1] } else { xv };
                    }
                }
                tb += m;
            }
        }
    }

    /// The `K - 1` inputs before token `t`, the `before`-th of sequence `s`, for channels
    /// `c0 .. c0 + 4`, oldest first: rows of x inside the sequence, before it the slot's state
    /// (with an initial state) or zeros.
    ///
    /// # Safety
    /// As [`fwd_tile`].
    #[inline(always)]
    unsafe fn tile_window<const K: usize>(
        p: &ConvFwdParams,
        s: usize,
        before: usize,
        t: usize,
        c0: usize,
        row: &impl Fn(usize) -> [u32; 2],
    ) -> [[f32; CH]; MAX_TILED_KM1] {
        let km1 = K - 1;
        let mut win = [[0.0f32; CH]; MAX_TILED_KM1];
        // SAFETY: the caller's contract; the state's `[dim, K - 1]` values of channels c0..
        // are 4 (K - 1) of them from (slot * dim + c0) * (K - 1), 8-byte aligned.
        unsafe {
            // prefix[i][ch]: channel c0 + ch's prefix value i (at ch * (K - 1) + i).
            let prefix: [[f32; CH]; MAX_TILED_KM1] = if before < km1 && ld(p.has_initial, s) != 0 {
                let slot = ld(p.cache_index, s) as usize;
                let sv: [f32; 4 * MAX_TILED_KM1] =
                    load_run(p.state.wrapping_add((slot * p.dim as usize + c0) * km1), CH * km1);
                core::array::from_fn(|i| core::array::from_fn(|ch| if i < km1 { sv[ch * km1 + i] } else { 0.0 }))
            } else {
                [[0.0; CH]; MAX_TILED_KM1]
            };
            for (j, wj) in win.iter_mut().enumerate().take(km1) {
                // Window slot j holds padded input q = before + j of the sequence: x row
                // t + j - km1, or prefix value q (selected without indexing registers at run
                // time).
                let q = before + j;
                if q >= km1 {
                    *wj = raw4_values(row(t + j - km1));
                } else {
                    for (i, pi) in prefix.iter().enumerate().take(km1) {
                        if q == i {
                            *wj = *pi;
                        }
                    }
                }
            }
        }
        win
    }

    /// Conv forward final states, [`ConvFwdParams`], after the outputs launch. Grid
    /// `(ceil(dim / CONV_BLOCK), nseq)`, block [`CONV_BLOCK`]. Thread (c, s): the last k - 1
    /// padded inputs of sequence s (old state values too when it is shorter than k - 1), read
    /// first, then written to the slot.
    #[unsafe(no_mangle)]
    pub unsafe extern "ptx-kernel" fn conv1d_fwd_state_bf16(p: ConvFwdParams) {
        grid_dependency_wait();
        let c = (block_x() * CONV_BLOCK + thread_x()) as usize;
        let s = block_y() as usize;
        let km1 = p.k as usize - 1;
        if c >= p.dim as usize {
            return;
        }
        // SAFETY: as for conv1d_fwd_bf16; this thread alone touches state[slot, c, ..].
        unsafe {
            let slot = ld(p.cache_index, s);
            if slot == PAD_SLOT {
                return;
            }
            let start = ld(p.cu_seqlens, s) as usize;
            let len = ld(p.cu_seqlens, s + 1) as usize - start;
            let mut new = [0u16; KM1];
            for (j, v) in new.iter_mut().enumerate() {
                if j < km1 {
                    *v = padded_input(&p, s, start, c, len + j);
                }
            }
            let st_row = p.state.wrapping_add((slot as usize * p.dim as usize + c) * km1);
            for (j, v) in new.iter().enumerate() {
                if j < km1 {
                    st(st_row, j, *v);
                }
            }
        }
    }
}
