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
mod kernels;
