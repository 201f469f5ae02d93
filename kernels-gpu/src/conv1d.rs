//! Causal depthwise conv1d with SiLU (SPEC.md section 1), decode update and varlen prefill.
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
/// Threads per block of the conv kernels: one thread per channel.
pub const CONV_BLOCK: u32 = 256;

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
