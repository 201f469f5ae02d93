//! The device code of the sampling family (nvptx64 only): its kernels and their helpers.
//! Launch parameters, sizes and the math the host shares are in `../sample.rs`.

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
