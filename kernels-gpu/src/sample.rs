//! Choosing each row's next token from its bf16 logits where the LM head left them, so only
//! token ids come back to the host.
//!
//! The math, for one row of logits `x` (a request's), in this order:
//! 0. A row with a mask (a bit a token, 1: allowed; structured outputs, `min_tokens`): every
//!    token it leaves out is `-inf`, whatever its logit (NaN included).
//! 1. Penalties over the tokens the request generated (token `i`, `c_i` times): `x_i / r` if
//!    `x_i > 0` else `x_i * r` (repetition `r`), then `- presence - frequency * c_i` (f32, one
//!    rounding each, [`penalize`]).
//! 2. A NaN anywhere: no token ([`SAMPLE_NAN`]); the maximum `m` is `-inf`: none
//!    ([`SAMPLE_ALL_NEG_INF`]).
//! 3. Temperature 0: the argmax, the lowest id among equal logits.
//! 4. Otherwise each token's weight is `2^(z_i)` with `z_i = (x_i - m) * log2(e) / T` (0 where
//!    `x_i == m`, so `+inf` logits share all of the mass), as a fixed-point integer `q_i`
//!    of [`Q_ONE`] units ([`weight`]: a polynomial of f32 FMAs, so the CPU and the GPU get the
//!    same integers; 0 below `z = -40`). Integer sums are exact in any order.
//! 5. Tokens rank by logit (the [`key`] order). Truncations never split equal logits:
//!    top-k keeps the tokens with fewer than `k` tokens strictly above them; top-p, over
//!    those, the tokens whose mass strictly above them is below `p` times their total mass
//!    ([`keeps_top_p`]: the token that crosses the threshold is kept); min-p the tokens with
//!    `q_i >= min_p * Q_ONE` ([`keeps_min_p`]).
//! 6. A 64-bit draw `r` from Philox4x32-10 keyed by the request's seed at the counter of the
//!    token (its index among the request's generated tokens, [`random`]), so a request's
//!    tokens do not depend on its batch neighbours; the token is the kept one, in id order,
//!    whose range of cumulative mass holds `floor(r * Q / 2^64)` ([`target`]), `Q` the kept
//!    mass.
//! 7. When asked, the chosen token's log-probability under the penalized logits at
//!    temperature 1 (`x_t - m - ln sum_i e^(x_i - m)`), and those of the `n` most likely
//!    tokens (at most [`SAMPLE_MAX_TOP`], by [`rank`]: the lowest id first among equal
//!    logits).
//!
//! The kernel runs a row in a cluster of [`SAMPLE_CLUSTER`] blocks, each holding its slice of
//! the row in shared memory; thresholds come from histograms merged through distributed
//! shared memory (see the kernel's comment).

use crate::KernelParams;

/// Blocks of the cluster that handles one row.
pub const SAMPLE_CLUSTER: u32 = 8;
/// Threads per block.
pub const SAMPLE_BLOCK: u32 = 512;
/// Histogram bins of a threshold search (one per thread).
pub const SAMPLE_BINS: u32 = SAMPLE_BLOCK;
/// Most top log-probabilities a row returns besides its token's.
pub const SAMPLE_MAX_TOP: u32 = 20;
/// Words of a row's output ([`SampleOut::from_words`]).
pub const SAMPLE_OUT_WORDS: u32 = 5 + 2 * SAMPLE_MAX_TOP;
/// Most logits of a row: a block's slice lives in shared memory as f32.
pub const SAMPLE_MAX_VOCAB: u32 = SAMPLE_CLUSTER * 32 * 1024;
/// The fixed-point unit of token weights: the most likely token weighs `Q_ONE`.
pub const Q_ONE: u64 = 1 << 40;
/// Below this `z` a token weighs nothing.
pub const Z_MIN: f32 = -40.0;

/// [`SampleOut::status`]: a token was chosen.
pub const SAMPLE_OK: u32 = 0;
/// [`SampleOut::status`]: the row's logits hold a NaN (after the penalties).
pub const SAMPLE_NAN: u32 = 1;
/// [`SampleOut::status`]: every logit of the row is `-inf`.
pub const SAMPLE_ALL_NEG_INF: u32 = 2;

/// How one row samples (all checked by the host).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SampleRow {
    /// 0: greedy. Otherwise finite and > 0.
    pub temperature: f32,
    /// 0: no top-k.
    pub top_k: u32,
    /// In (0, 1]; 1: no top-p.
    pub top_p: f32,
    /// In [0, 1]; 0: no min-p.
    pub min_p: f32,
    /// Finite, > 0; 1: none.
    pub repetition: f32,
    pub presence: f32,
    pub frequency: f32,
    /// The row's penalized tokens: pairs (token, count) at `penalties[2 * at..]`, `len` pairs,
    /// distinct tokens below the vocabulary, counts >= 1.
    pub penalties_at: u32,
    pub penalties_len: u32,
    /// 0: no log-probabilities; otherwise the chosen token's, and those of the `logprobs - 1`
    /// most likely tokens (at most [`SAMPLE_MAX_TOP`]).
    pub logprobs: u32,
    /// 0: every token allowed; 1: only those whose bit is set in the row's mask, the
    /// `vocab.div_ceil(32)` words at `masks[mask_at..]` (token `i`: bit `i % 32` of word `i / 32`).
    pub masked: u32,
    pub mask_at: u32,
    pub seed: u64,
    /// The token's index among the request's generated tokens.
    pub counter: u64,
}

// The host uploads `SampleRow::words` as the device's struct: 16 words, the u64s last.
const _: () = {
    assert!(core::mem::size_of::<SampleRow>() == 64);
    assert!(core::mem::offset_of!(SampleRow, masked) == 40);
    assert!(core::mem::offset_of!(SampleRow, mask_at) == 44);
    assert!(core::mem::offset_of!(SampleRow, seed) == 48);
    assert!(core::mem::offset_of!(SampleRow, counter) == 56);
};

impl SampleRow {
    /// Greedy, no penalties.
    pub const GREEDY: SampleRow = SampleRow {
        temperature: 0.0,
        top_k: 0,
        top_p: 1.0,
        min_p: 0.0,
        repetition: 1.0,
        presence: 0.0,
        frequency: 0.0,
        penalties_at: 0,
        penalties_len: 0,
        logprobs: 0,
        masked: 0,
        mask_at: 0,
        seed: 0,
        counter: 0,
    };

    /// The row as the words of its `#[repr(C)]` layout (for an upload).
    pub fn words(&self) -> [u32; 16] {
        let f = f32::to_bits;
        [
            f(self.temperature),
            self.top_k,
            f(self.top_p),
            f(self.min_p),
            f(self.repetition),
            f(self.presence),
            f(self.frequency),
            self.penalties_at,
            self.penalties_len,
            self.logprobs,
            self.masked,
            self.mask_at,
            self.seed as u32,
            (self.seed >> 32) as u32,
            self.counter as u32,
            (self.counter >> 32) as u32,
        ]
    }
}

/// What the kernel writes for one row (as [`SAMPLE_OUT_WORDS`] words: token, status, logprob,
/// kept, top_len, then the top pairs).
#[derive(Clone, Copy, Debug, PartialEq, Default)]
pub struct SampleOut {
    /// The chosen token (`u32::MAX` unless the status is [`SAMPLE_OK`]).
    pub token: u32,
    pub status: u32,
    /// The chosen token's log-probability (0 unless asked).
    pub logprob: f32,
    /// Tokens the truncations kept (1 for greedy).
    pub kept: u32,
    /// The most likely tokens and their log-probabilities, most likely first: `top_len` of
    /// them (as asked, or the vocabulary when smaller).
    pub top_len: u32,
    pub top: [(u32, f32); SAMPLE_MAX_TOP as usize],
}

impl SampleOut {
    /// No token, for `status`.
    pub fn failed(status: u32) -> SampleOut {
        SampleOut { token: u32::MAX, status, ..SampleOut::default() }
    }

    /// From a row's words (at least [`SAMPLE_OUT_WORDS`]); the top pairs past `top_len`,
    /// which the kernel leaves as they were, read as (0, 0).
    pub fn from_words(w: &[u32]) -> SampleOut {
        let mut top = [(0, 0.0); SAMPLE_MAX_TOP as usize];
        for (i, t) in top.iter_mut().enumerate().take(w[4] as usize) {
            *t = (w[5 + 2 * i], f32::from_bits(w[6 + 2 * i]));
        }
        SampleOut { token: w[0], status: w[1], logprob: f32::from_bits(w[2]), kept: w[3], top_len: w[4], top }
    }

    /// The top pairs given.
    pub fn top(&self) -> &[(u32, f32)] {
        &self.top[..(self.top_len as usize).min(self.top.len())]
    }
}

/// `sample_bf16`'s parameters: `rows` rows of `vocab` logits, row r at `logits[r * stride..]`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct SampleParams {
    pub logits: *const u16,
    /// `[rows]`.
    pub rows: *const SampleRow,
    /// Pairs (token, count), see [`SampleRow::penalties_at`].
    pub penalties: *const u32,
    /// The masked rows' masks, see [`SampleRow::masked`].
    pub masks: *const u32,
    /// `[rows * SAMPLE_OUT_WORDS]`.
    pub out: *mut u32,
    pub vocab: u32,
    pub stride: u32,
}

// SAFETY: #[repr(C)], Copy, only pointers, integers and floats.
unsafe impl KernelParams for SampleParams {}

/// Bytes of dynamic shared memory a block needs for rows of `vocab` logits.
pub const fn sample_smem(vocab: u32) -> u32 {
    SMEM_FIXED + 4 * slice(vocab)
}

/// Logits of one block's slice of a row (the last blocks' may be shorter).
pub const fn slice(vocab: u32) -> u32 {
    vocab.div_ceil(SAMPLE_CLUSTER)
}

/// Shared memory before a block's slice: bin counts and masses (u64), per-warp
/// scratch (u64 pairs), broadcast words (u64) and the block's top ranks (u64).
const SMEM_FIXED: u32 = SAMPLE_BINS * 16 + (SAMPLE_BLOCK / 32) * 16 + WORDS * 8 + SAMPLE_MAX_TOP * 8;
/// Broadcast words of a block.
const WORDS: u32 = 16;

/// Step 1: `x` penalized for a token generated `count` times.
#[inline(always)]
pub fn penalize(x: f32, count: u32, r: &SampleRow) -> f32 {
    let x = if x > 0.0 { x / r.repetition } else { x * r.repetition };
    x - r.presence - r.frequency * count as f32
}

/// The rank order of logits as unsigned integers: larger logit, larger key (-0 as +0).
#[inline(always)]
pub fn key(x: f32) -> u32 {
    let b = (x + 0.0).to_bits();
    if b & 0x8000_0000 != 0 { !b } else { b | 0x8000_0000 }
}

/// The logit of key `k` ([`key`]'s inverse; -0 comes back as +0).
#[inline(always)]
pub fn from_key(k: u32) -> f32 {
    f32::from_bits(if k & 0x8000_0000 != 0 { k & 0x7fff_ffff } else { !k })
}

/// Step 7's order of tokens: larger logit first, then lower id (as one integer, larger first).
#[inline(always)]
pub fn rank(x: f32, id: u32) -> u64 {
    (u64::from(key(x)) << 32) | u64::from(!id)
}

/// The token and logit of a [`rank`].
#[inline(always)]
pub fn unrank(r: u64) -> (u32, f32) {
    (!(r as u32), from_key((r >> 32) as u32))
}

/// `log2(e) / T`, the factor of [`scaled`].
#[inline(always)]
pub fn log2e_over(temperature: f32) -> f32 {
    core::f32::consts::LOG2_E / temperature
}

/// `z` of step 4: `(x - m) * c`, exactly 0 where `x == m`.
#[inline(always)]
pub fn scaled(x: f32, m: f32, c: f32) -> f32 {
    if x == m { 0.0 } else { (x - m) * c }
}

/// `2^z` in [`Q_ONE`] units for `z <= 0`, truncated; 0 below [`Z_MIN`] (and for NaN). The
/// same f32 operations on every target (`2^f` on `[-0.5, 0.5]` by its degree-7 Taylor
/// polynomial in FMAs, relative error below 1e-7, then an exact power-of-two scaling), so
/// the CPU and the GPU agree bit for bit.
#[inline(always)]
pub fn weight(z: f32) -> u64 {
    if z.is_nan() || z < Z_MIN {
        return 0;
    }
    let n = (0.5 - z) as u32;
    let f = z + n as f32;
    // A fused multiply-add on every target (std's on the host: it rounds once, as the device's).
    #[cfg(target_arch = "nvptx64")]
    let fma = core::f32::math::mul_add;
    #[cfg(not(target_arch = "nvptx64"))]
    let fma = f32::mul_add;
    let p = fma(fma(fma(1.525_273_4e-5, f, 1.540_353e-4), f, 1.333_355_8e-3), f, 9.618_129e-3);
    let p = fma(fma(fma(fma(p, f, 5.550_411e-2), f, 0.240_226_5), f, core::f32::consts::LN_2), f, 1.0);
    (p * f32::from_bits((127 + 40 - n) << 23)) as u64
}

/// Step 5, top-p: whether a token with `above` mass strictly above it, among tokens of
/// `total` mass, is kept (f64, the same rounding everywhere).
#[inline(always)]
pub fn keeps_top_p(above: u64, total: u64, p: f32) -> bool {
    (above as f64) < (p as f64) * (total as f64)
}

/// Step 5, min-p: whether a token of weight `q` is kept.
#[inline(always)]
pub fn keeps_min_p(q: u64, min_p: f32) -> bool {
    (q as f64) >= (min_p as f64) * (Q_ONE as f64)
}

/// Philox4x32-10 (Salmon et al., SC'11): the block of counter `ctr` under key `key`.
#[inline(always)]
pub fn philox4x32(ctr: [u32; 4], key: [u32; 2]) -> [u32; 4] {
    let (mut c, mut k) = (ctr, key);
    for round in 0..10 {
        if round > 0 {
            k = [k[0].wrapping_add(0x9E37_79B9), k[1].wrapping_add(0xBB67_AE85)];
        }
        let p0 = u64::from(0xD251_1F53u32) * u64::from(c[0]);
        let p1 = u64::from(0xCD9E_8D57u32) * u64::from(c[2]);
        c = [(p1 >> 32) as u32 ^ c[1] ^ k[0], p1 as u32, (p0 >> 32) as u32 ^ c[3] ^ k[1], p0 as u32];
    }
    c
}

/// Step 6's 64 random bits for the token at `counter` of a request seeded `seed`.
#[inline(always)]
pub fn random(seed: u64, counter: u64) -> u64 {
    let r = philox4x32([counter as u32, (counter >> 32) as u32, 0, 0], [seed as u32, (seed >> 32) as u32]);
    u64::from(r[0]) | (u64::from(r[1]) << 32)
}

/// Step 6: the mass offset `floor(r * total / 2^64)` the chosen token's range holds.
#[inline(always)]
pub fn target(r: u64, total: u64) -> u64 {
    ((u128::from(r) * u128::from(total)) >> 64) as u64
}

#[cfg(target_arch = "nvptx64")]
mod kernels {
    use core::sync::atomic::{AtomicU64, Ordering::Relaxed};

    use super::*;
    use crate::device::*;

    const BLOCK: usize = SAMPLE_BLOCK as usize;
    const WARPS: usize = BLOCK / 32;
    const BINS: usize = SAMPLE_BINS as usize;
    /// Level-0 bins per unit of `-z` (bins `0..BINS - 1` cover `z` in [-40, 0], the last one
    /// the weightless tokens).
    const Z_BIN_SCALE: f32 = (SAMPLE_BINS - 1) as f32 / 40.0;

    // Broadcast words of a block.
    const W_MAX: usize = 0;
    const W_ARG: usize = 1;
    const W_NAN: usize = 2;
    const W_BIN: usize = 3;
    const W_ABOVE_COUNT: usize = 4;
    const W_ABOVE_MASS: usize = 5;
    const W_LO: usize = 6;
    const W_HI: usize = 7;
    const W_KEPT_MASS: usize = 8;
    const W_KEPT: usize = 9;
    const W_SUM: usize = 10;
    const W_WARP: usize = 11;
    const W_REL: usize = 12;

    /// A block's shared memory (the same offsets in every block of the cluster).
    #[derive(Clone, Copy)]
    struct Smem {
        count: *mut u64,
        mass: *mut u64,
        /// Per-warp pairs.
        scratch: *mut u64,
        words: *mut u64,
        /// The block's best ranks (step 7).
        top: *mut u64,
        x: *mut f32,
    }

    impl Smem {
        fn new() -> Smem {
            let base = dyn_smem_f32() as *mut u8;
            let at = |bytes: usize| base.wrapping_add(bytes) as *mut u64;
            Smem {
                count: at(0),
                mass: at(BINS * 8),
                scratch: at(BINS * 16),
                words: at(BINS * 16 + WARPS * 16),
                top: at(BINS * 16 + WARPS * 16 + WORDS as usize * 8),
                x: base.wrapping_add(SMEM_FIXED as usize) as *mut f32,
            }
        }

        fn word(&self, i: usize) -> u64 {
            // SAFETY: i < WORDS; written before a barrier that precedes the read.
            unsafe { ld(self.words, i) }
        }

        fn set_word(&self, i: usize, v: u64) {
            // SAFETY: i < WORDS; one writer per word between barriers.
            unsafe { st(self.words, i, v) }
        }

        fn atomic(&self, p: *mut u64) -> &AtomicU64 {
            // SAFETY: p points into this block's shared memory, 8-byte aligned.
            unsafe { AtomicU64::from_ptr(p) }
        }

        /// Word `i` of block `rank` of the cluster.
        fn remote_word(&self, i: usize, rank: u32) -> u64 {
            // SAFETY: every block of the cluster runs (a cluster barrier passed) and waits at
            // a cluster barrier after these reads before it changes or frees its words.
            unsafe { ld_cluster_u64(self.words.wrapping_add(i), rank) }
        }

        /// Word `i` summed over the cluster's blocks (as [`Smem::remote_word`]).
        fn cluster_word_sum(&self, i: usize) -> u64 {
            (0..SAMPLE_CLUSTER).map(|r| self.remote_word(i, r)).sum()
        }

        /// The largest `v` of the block's threads; every thread gets it. Barriers inside:
        /// uniform flow.
        fn block_max_u64(&self, v: u64) -> u64 {
            let v = warp_max_u64(v);
            if lane_id() == 0 {
                self.set_pair(warp_id() as usize, (v, 0));
            }
            sync_threads();
            let best = (0..WARPS).map(|w| self.pair(w).0).max().unwrap_or(0);
            sync_threads();
            best
        }

        /// Pair `w` of the scratch.
        fn pair(&self, w: usize) -> (u64, u64) {
            // SAFETY: w < WARPS; written before a barrier that precedes the read.
            unsafe { (ld(self.scratch, 2 * w), ld(self.scratch, 2 * w + 1)) }
        }

        fn set_pair(&self, w: usize, v: (u64, u64)) {
            // SAFETY: w < WARPS; one writer per pair between barriers.
            unsafe {
                st(self.scratch, 2 * w, v.0);
                st(self.scratch, 2 * w + 1, v.1);
            }
        }
    }

    /// A block's view of its row: its slice's length, the row's maximum and `log2(e) / T`.
    struct Ctx {
        s: Smem,
        n: usize,
        m: f32,
        c: f32,
    }

    impl Ctx {
        fn x(&self, j: usize) -> f32 {
            // SAFETY: j < n, inside the slice, written before a barrier.
            unsafe { ld(self.s.x, j) }
        }

        fn q(&self, x: f32) -> u64 {
            weight(scaled(x, self.m, self.c))
        }

        /// Level-0 bin of `x`: by z, the most likely first.
        fn zbin(&self, x: f32) -> usize {
            let z = scaled(x, self.m, self.c);
            if z.is_nan() || z < Z_MIN { BINS - 1 } else { ((-z * Z_BIN_SCALE) as usize).min(BINS - 2) }
        }

        /// The bin `take` gives each of the slice's logits (none: not a candidate), counted
        /// and weighed over the cluster: thread t gets bin t's (count, mass). Cluster barriers
        /// inside: uniform flow.
        fn histogram(&self, take: impl Fn(f32, u32) -> Option<usize>) -> (u64, u64) {
            let t = thread_x() as usize;
            // SAFETY: bin t of this block's arrays; no block reads them now (every histogram
            // ends with a cluster barrier after its reads).
            unsafe {
                st(self.s.count, t, 0);
                st(self.s.mass, t, 0);
            }
            sync_threads();
            let mut j = t;
            while j < self.n {
                let x = self.x(j);
                if let Some(b) = take(x, key(x)) {
                    self.s.atomic(self.s.count.wrapping_add(b)).fetch_add(1, Relaxed);
                    self.s.atomic(self.s.mass.wrapping_add(b)).fetch_add(self.q(x), Relaxed);
                }
                j += BLOCK;
            }
            cluster_sync();
            let (mut c, mut m) = (0, 0);
            for r in 0..SAMPLE_CLUSTER {
                // SAFETY: bin t of block r, complete since the barrier, read before the next.
                unsafe {
                    c += ld_cluster_u64(self.s.count.wrapping_add(t), r);
                    m += ld_cluster_u64(self.s.mass.wrapping_add(t), r);
                }
            }
            cluster_sync();
            (c, m)
        }

        /// Prefix sums over the bins from bin 0: the (count, mass) of the bins before thread
        /// t's, and the total mass.
        fn above(&self, (c, m): (u64, u64)) -> (u64, u64, u64) {
            let (ci, mi) = (warp_inclusive_sum_u64(c), warp_inclusive_sum_u64(m));
            let w = warp_id() as usize;
            if lane_id() == 31 {
                self.s.set_pair(w, (ci, mi));
            }
            sync_threads();
            let (mut cb, mut mb, mut total) = (0, 0, 0);
            for v in 0..WARPS {
                let (cv, mv) = self.s.pair(v);
                if v < w {
                    cb += cv;
                    mb += mv;
                }
                total += mv;
            }
            sync_threads();
            (cb + ci - c, mb + mi - m, total)
        }

        /// The last nonempty bin whose (count, mass) above it `keep` takes (some bin is: the
        /// callers' limits keep what is above the range); what is above it in the words.
        fn boundary(&self, count: u64, above: (u64, u64), keep: impl Fn(u64, u64) -> bool) -> usize {
            let t = thread_x() as usize;
            if t == 0 {
                self.s.set_word(W_BIN, 0);
            }
            sync_threads();
            if count > 0 && keep(above.0, above.1) {
                self.s.atomic(self.s.words.wrapping_add(W_BIN)).fetch_max(t as u64, Relaxed);
            }
            sync_threads();
            let b = self.s.word(W_BIN) as usize;
            if t == b {
                self.s.set_word(W_ABOVE_COUNT, above.0);
                self.s.set_word(W_ABOVE_MASS, above.1);
            }
            sync_threads();
            b
        }

        /// The smallest key `t >= floor` of a logit for which `keep(count, mass, total)` holds
        /// of the candidates (logits of keys >= floor, of total mass `total`) strictly above
        /// it, `keep` true for (0, 0) and monotone. Cluster barriers inside: uniform flow.
        fn threshold(&self, floor: u32, keep: impl Fn(u64, u64, u64) -> bool) -> u32 {
            // Level 0: by z.
            let h = self.histogram(|x, k| (k >= floor).then(|| self.zbin(x)));
            let (ca, ma, total) = self.above(h);
            let b = self.boundary(h.0, (ca, ma), |c, m| keep(c, m, total));
            let (mut oc, mut om) = (self.s.word(W_ABOVE_COUNT), self.s.word(W_ABOVE_MASS));
            // The keys present in bin b (z and the key grow with the logit: bin b's logits
            // are the candidates with keys in lo..=hi).
            let t = thread_x() as usize;
            if t == 0 {
                self.s.set_word(W_LO, u64::from(u32::MAX));
                self.s.set_word(W_HI, 0);
            }
            sync_threads();
            let (mut lo, mut hi) = (u32::MAX, 0u32);
            let mut j = t;
            while j < self.n {
                let x = self.x(j);
                let k = key(x);
                if k >= floor && self.zbin(x) == b {
                    (lo, hi) = (lo.min(k), hi.max(k));
                }
                j += BLOCK;
            }
            self.s.atomic(self.s.words.wrapping_add(W_LO)).fetch_min(u64::from(lo), Relaxed);
            self.s.atomic(self.s.words.wrapping_add(W_HI)).fetch_max(u64::from(hi), Relaxed);
            cluster_sync();
            for r in 0..SAMPLE_CLUSTER {
                lo = lo.min(self.s.remote_word(W_LO, r) as u32);
                hi = hi.max(self.s.remote_word(W_HI, r) as u32);
            }
            cluster_sync();
            // Levels linear in the key over lo..=hi, until one key is left.
            while lo < hi {
                let width = u64::from(hi - lo) + 1;
                let bin = |k: u32| (u64::from(hi - k) * BINS as u64 / width) as usize;
                let h = self.histogram(|_, k| (k >= lo && k <= hi).then(|| bin(k)));
                let (ca, ma, _) = self.above(h);
                let b = self.boundary(h.0, (ca, ma), |c, m| keep(oc + c, om + m, total)) as u64;
                oc += self.s.word(W_ABOVE_COUNT);
                om += self.s.word(W_ABOVE_MASS);
                // Bin b holds the keys k with hi - k in ceil(b w / BINS)..ceil((b + 1) w / BINS).
                let top = (b * width).div_ceil(BINS as u64) as u32;
                let bottom = ((b + 1) * width).div_ceil(BINS as u64) as u32 - 1;
                (lo, hi) = (hi - bottom, hi - top);
            }
            lo
        }
    }

    /// Token sampling, [`SampleParams`]. Grid `(SAMPLE_CLUSTER, rows)` in clusters of
    /// [`SAMPLE_CLUSTER`] along x, block [`SAMPLE_BLOCK`], dynamic shared memory
    /// [`sample_smem`]`(vocab)`. Block `rank` holds ids `rank * slice..` of the row as f32
    /// (penalized). Maxima, histograms and sums are combined over the cluster by reading
    /// the other blocks' shared memory after a cluster barrier, each block computing the
    /// same result. A threshold search: a histogram of the candidates by z (512 bins), the
    /// last bin whose mass or count above it keeps it, the key range inside that bin, then
    /// histograms linear in the key over that range (often none: a bin is about 0.05 T wide in
    /// logit, a few bf16 values where logits are of magnitude 2 or more) until one key is left. The draw: each block's kept mass, the block
    /// whose range holds the target, its warp (each warp holds a contiguous run of ids), its
    /// lane.
    #[unsafe(no_mangle)]
    pub unsafe extern "ptx-kernel" fn sample_bf16(p: SampleParams) {
        grid_dependency_wait();
        let s = Smem::new();
        let (t, rank, row) = (thread_x() as usize, cluster_rank(), block_y() as usize);
        let vocab = p.vocab as usize;
        let sl = slice(p.vocab) as usize;
        let base = (rank as usize * sl).min(vocab);
        let n = sl.min(vocab - base);
        if t == 0 {
            s.set_word(W_NAN, 0);
        }
        // SAFETY: the launcher checked rows and out (`rows` entries), the logits (each row's
        // `vocab` values inside the buffer) and the penalty pairs (in bounds, distinct tokens
        // below vocab); x has room for the slice.
        let rp = p.rows.wrapping_add(row);
        // A field of the row, read where it is used (a copy of the whole row held in registers
        // across the kernel spilled on sm_121a).
        macro_rules! r {
            ($f:ident) => {
                // SAFETY: see above.
                unsafe { core::ptr::read_volatile(&raw const (*rp).$f) }
            };
        }
        let logits = p.logits.wrapping_add(row * p.stride as usize + base);
        let mask = if r!(masked) != 0 { p.masks.wrapping_add(r!(mask_at) as usize) } else { core::ptr::null() };
        let mut j = t;
        while j < n {
            let id = base + j;
            // SAFETY: see above; a masked row's mask holds vocab.div_ceil(32) words (launcher).
            unsafe {
                let allowed = mask.is_null() || (ld(mask, id / 32) >> (id % 32)) & 1 != 0;
                st(s.x, j, if allowed { bf16_to_f32(ld(logits, j)) } else { f32::NEG_INFINITY });
            }
            j += BLOCK;
        }
        sync_threads();
        {
            // SAFETY: see above.
            let r = unsafe { ld(rp, 0) };
            let mut e = t;
            while e < r.penalties_len as usize {
                // SAFETY: see above; distinct tokens: one writer each.
                unsafe {
                    let at = 2 * (r.penalties_at as usize + e);
                    let (tok, count) = (ld(p.penalties, at) as usize, ld(p.penalties, at + 1));
                    if tok >= base && tok < base + n {
                        st(s.x, tok - base, penalize(ld(s.x, tok - base), count, &r));
                    }
                }
                e += BLOCK;
            }
        }
        sync_threads();
        // The maximum, the lowest id holding it, and whether there is a NaN.
        let (mut m, mut arg, mut nan) = (f32::NEG_INFINITY, u32::MAX, false);
        let mut j = t;
        while j < n {
            // SAFETY: as above.
            let x = unsafe { ld(s.x, j) };
            nan |= x.is_nan();
            if x > m || (arg == u32::MAX && x == m) {
                (m, arg) = (x, (base + j) as u32);
            }
            j += BLOCK;
        }
        if nan {
            s.atomic(s.words.wrapping_add(W_NAN)).store(1, Relaxed);
        }
        let (wm, wa) = warp_argmax(m, arg);
        if lane_id() == 0 {
            s.set_pair(warp_id() as usize, (u64::from(wm.to_bits()), u64::from(wa)));
        }
        sync_threads();
        if t == 0 {
            let (mut bm, mut ba) = (f32::NEG_INFINITY, u32::MAX);
            for w in 0..WARPS {
                let (v, a) = s.pair(w);
                let (v, a) = (f32::from_bits(v as u32), a as u32);
                if v > bm || (v == bm && a < ba) {
                    (bm, ba) = (v, a);
                }
            }
            s.set_word(W_MAX, u64::from(bm.to_bits()));
            s.set_word(W_ARG, u64::from(ba));
        }
        cluster_sync();
        let (mut m, mut arg, mut nan) = (f32::NEG_INFINITY, u32::MAX, false);
        for q in 0..SAMPLE_CLUSTER {
            let (v, a) = (f32::from_bits(s.remote_word(W_MAX, q) as u32), s.remote_word(W_ARG, q) as u32);
            if v > m || (v == m && a < arg) {
                (m, arg) = (v, a);
            }
            nan |= s.remote_word(W_NAN, q) != 0;
        }
        cluster_sync();
        let out = p.out.wrapping_add(row * SAMPLE_OUT_WORDS as usize);
        // SAFETY: row < rows (launcher); each word of a row's out has one writer.
        let put = |i: usize, v: u32| unsafe { st(out, i, v) };
        let lead = rank == 0 && t == 0;
        if nan || m == f32::NEG_INFINITY {
            if lead {
                let status = if nan { SAMPLE_NAN } else { SAMPLE_ALL_NEG_INF };
                for (i, v) in [u32::MAX, status, 0, 0, 0].into_iter().enumerate() {
                    put(i, v);
                }
            }
            return;
        }
        let cx = Ctx { s, n, m, c: log2e_over(r!(temperature)) };
        // ln sum_i e^(x_i - m), when asked.
        let logprobs = r!(logprobs);
        let lse = if logprobs != 0 {
            let mut sum = 0.0f32;
            let mut j = t;
            while j < n {
                let x = cx.x(j);
                sum += if x == m { 1.0 } else { exp_fast(x - m) };
                j += BLOCK;
            }
            let total = block_sum(sum, s.scratch as *mut f32);
            if t == 0 {
                s.set_word(W_SUM, u64::from(total.to_bits()));
            }
            cluster_sync();
            let all: f32 = (0..SAMPLE_CLUSTER).map(|q| f32::from_bits(s.remote_word(W_SUM, q) as u32)).sum();
            cluster_sync();
            ln_fast(all)
        } else {
            0.0
        };
        let logprob = |x: f32| {
            if logprobs == 0 {
                0.0
            } else if x == m {
                -lse
            } else {
                x - m - lse
            }
        };
        // The most likely tokens: each block's best ranks, then rank 0 merges the lists.
        let n_top = logprobs.saturating_sub(1).min(SAMPLE_MAX_TOP) as usize;
        let mut top_len = 0u32;
        if n_top > 0 {
            let mut prev = u64::MAX;
            for i in 0..n_top {
                let mut best = 0;
                let mut j = t;
                while j < n {
                    let v = super::rank(cx.x(j), (base + j) as u32);
                    if v < prev && v > best {
                        best = v;
                    }
                    j += BLOCK;
                }
                prev = s.block_max_u64(best);
                if t == 0 {
                    // SAFETY: i < SAMPLE_MAX_TOP; this thread alone writes the list.
                    unsafe { st(s.top, i, prev) };
                }
            }
            cluster_sync();
            let gather = rank == 0 && t < SAMPLE_CLUSTER as usize * n_top;
            // SAFETY: entry t % n_top of block t / n_top's list, complete since the barrier.
            let mine =
                if gather { unsafe { ld_cluster_u64(s.top.wrapping_add(t % n_top), (t / n_top) as u32) } } else { 0 };
            cluster_sync();
            if rank == 0 {
                let mut prev = u64::MAX;
                while (top_len as usize) < n_top {
                    let best = s.block_max_u64(if mine < prev { mine } else { 0 });
                    if best == 0 {
                        break;
                    }
                    if t == 0 {
                        let (id, x) = unrank(best);
                        put(5 + 2 * top_len as usize, id);
                        put(6 + 2 * top_len as usize, logprob(x).to_bits());
                    }
                    (prev, top_len) = (best, top_len + 1);
                }
            }
        }
        if lead {
            put(4, top_len);
        }
        if r!(temperature) == 0.0 {
            if lead {
                for (i, v) in [arg, SAMPLE_OK, logprob(m).to_bits(), 1].into_iter().enumerate() {
                    put(i, v);
                }
            }
            return;
        }
        // Thresholds: top-k, then top-p over the top-k tokens.
        let mut floor = 0u32;
        let top_k = r!(top_k);
        if top_k > 0 && (top_k as usize) < vocab {
            let k = u64::from(top_k);
            floor = cx.threshold(0, |c, _, _| c < k);
        }
        let top_p = r!(top_p);
        if top_p < 1.0 {
            floor = cx.threshold(floor, |_, mass, total| keeps_top_p(mass, total, top_p));
        }
        // The kept mass of each warp's run of ids, then of the block.
        let run = n.div_ceil(WARPS).next_multiple_of(32);
        let (w, lane) = (warp_id() as usize, lane_id() as usize);
        // The weight of id `base + j` if it is kept.
        let min_p = r!(min_p);
        let kept_q = |j: usize| {
            let x = if j < n { cx.x(j) } else { f32::NEG_INFINITY };
            let q = cx.q(x);
            (j < n && key(x) >= floor && keeps_min_p(q, min_p)).then_some(q)
        };
        let (mut mass, mut count) = (0u64, 0u64);
        let mut i = 0;
        while i < run {
            if let Some(q) = kept_q(w * run + i + lane) {
                (mass, count) = (mass + q, count + 1);
            }
            i += 32;
        }
        let (mass, count) = (warp_sum_u64(mass), warp_sum_u64(count));
        if lane == 0 {
            s.set_pair(w, (mass, count));
        }
        sync_threads();
        if t == 0 {
            let (bm, bc) = (0..WARPS).map(|v| s.pair(v)).fold((0, 0), |a, v| (a.0 + v.0, a.1 + v.1));
            s.set_word(W_KEPT_MASS, bm);
            s.set_word(W_KEPT, bc);
        }
        cluster_sync();
        let before: u64 = (0..rank).map(|q| s.remote_word(W_KEPT_MASS, q)).sum();
        let total = s.cluster_word_sum(W_KEPT_MASS);
        let kept = s.cluster_word_sum(W_KEPT);
        cluster_sync();
        let goal = target(random(r!(seed), r!(counter)), total);
        let own = s.word(W_KEPT_MASS);
        if lead {
            put(3, kept as u32);
        }
        if goal < before || goal >= before + own {
            return;
        }
        // This block holds the token: its warp, then its lane.
        if t == 0 {
            let (mut rel, mut v) = (goal - before, 0);
            while rel >= s.pair(v).0 {
                rel -= s.pair(v).0;
                v += 1;
            }
            s.set_word(W_WARP, v as u64);
            s.set_word(W_REL, rel);
        }
        sync_threads();
        if w as u64 != s.word(W_WARP) {
            return;
        }
        let mut rel = s.word(W_REL);
        let mut i = 0;
        while i < run {
            let j = w * run + i + lane;
            let q = kept_q(j).unwrap_or(0);
            let incl = warp_inclusive_sum_u64(q);
            let chunk = warp_read_u64(incl, 31);
            if rel < chunk {
                if incl > rel && incl - q <= rel {
                    // Exactly one lane of the row gets here.
                    for (i, v) in [(base + j) as u32, SAMPLE_OK, logprob(cx.x(j)).to_bits()].into_iter().enumerate() {
                        put(i, v);
                    }
                }
                return;
            }
            rel -= chunk;
            i += 32;
        }
    }
}
