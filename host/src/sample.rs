//! Launcher of the token sampling kernel (kernels-gpu/src/sample.rs, whose module doc gives the
//! math; the CPU implementation is `cpu::sample`, the same tokens from the same logits).

use cudarc::driver::{CudaSlice, DevicePtr};
use half::bf16;
use kernels_gpu::Kernel;
use kernels_gpu::sample::{
    SAMPLE_BLOCK, SAMPLE_CLUSTER, SAMPLE_MAX_VOCAB, SAMPLE_OUT_WORDS, SampleOut, SampleParams, SampleRow, sample_smem,
};

use crate::check::Check;
use crate::error::{Error, Result};
use crate::gpu::Gpu;

/// Words of a [`SampleRow`] on the device.
const ROW_WORDS: usize = 14;
/// Words of a [`SampleOut`].
const OUT_WORDS: usize = SAMPLE_OUT_WORDS as usize;

/// One row's sampling: its settings (`penalties_at` and `penalties_len` are set from
/// `penalties`) and its penalized tokens, pairs (token, times generated).
#[derive(Clone, Copy, Debug)]
pub struct RowSampling<'a> {
    pub row: SampleRow,
    pub penalties: &'a [(u32, u32)],
}

/// Checks one row's settings for a vocabulary of `vocab`: temperature finite and >= 0, top-p
/// in (0, 1], min-p in [0, 1], repetition finite and > 0, presence and frequency finite;
/// penalized tokens distinct, below `vocab`, counts >= 1.
pub fn check_row(r: &RowSampling, vocab: usize) -> Result<()> {
    let c = Check(Kernel::Sample.name());
    let s = &r.row;
    c.that("temperature", s.temperature.is_finite() && s.temperature >= 0.0, "a finite value >= 0", s.temperature)?;
    c.that("top_p", s.top_p > 0.0 && s.top_p <= 1.0, "a value in (0, 1]", s.top_p)?;
    c.that("min_p", (0.0..=1.0).contains(&s.min_p), "a value in [0, 1]", s.min_p)?;
    c.positive("repetition_penalty", s.repetition)?;
    c.that("presence_penalty", s.presence.is_finite(), "a finite value", s.presence)?;
    c.that("frequency_penalty", s.frequency.is_finite(), "a finite value", s.frequency)?;
    let mut seen = std::collections::HashSet::with_capacity(r.penalties.len());
    for &(t, n) in r.penalties {
        c.that("penalties", (t as usize) < vocab, format!("tokens below {vocab}"), t)?;
        c.that("penalties", n >= 1, "counts >= 1", n)?;
        c.that("penalties", seen.insert(t), "distinct tokens", format!("{t} twice"))?;
    }
    Ok(())
}

/// A step's sampling rows on the device, checked: the rows' settings and their penalty pairs
/// (room for `capacity` pairs), rewritable in place ([`SampleRows::set`]) so a recorded step
/// (a CUDA graph) samples with new settings.
pub struct SampleRows {
    rows: CudaSlice<u32>,
    penalties: CudaSlice<u32>,
    len: usize,
    vocab: usize,
}

impl SampleRows {
    /// Checks `rows` (each with [`check_row`]) and uploads them, with room for `capacity`
    /// penalty pairs in all.
    pub fn new(gpu: &Gpu, rows: &[RowSampling], vocab: usize, capacity: usize) -> Result<SampleRows> {
        let k = Kernel::Sample;
        let c = Check(k.name());
        c.count("vocab", SAMPLE_MAX_VOCAB as usize, vocab)?;
        let (need, have) = (sample_smem(vocab as u32), gpu.max_smem(k));
        c.that(
            "vocab",
            need <= have,
            format!("a vocabulary whose slices fit this GPU's {have} bytes of shared memory a block"),
            format!("{vocab}, needing {need}"),
        )?;
        c.count("rows", 65535, rows.len())?;
        let mut s = SampleRows {
            rows: gpu.zeros(rows.len() * ROW_WORDS)?,
            penalties: gpu.zeros(2 * capacity.max(1))?,
            len: rows.len(),
            vocab,
        };
        s.set(gpu, rows)?;
        Ok(s)
    }

    /// Checks `rows` (as many as before, their penalty pairs within the capacity) and writes
    /// them over these in place.
    pub fn set(&mut self, gpu: &Gpu, rows: &[RowSampling]) -> Result<()> {
        if rows.len() != self.len {
            return Err(Error::Batch(format!("{} sampling rows given for {} in place", rows.len(), self.len)));
        }
        let mut words = Vec::with_capacity(rows.len() * ROW_WORDS);
        let mut pairs = Vec::new();
        for r in rows {
            check_row(r, self.vocab)?;
            let row =
                SampleRow { penalties_at: (pairs.len() / 2) as u32, penalties_len: r.penalties.len() as u32, ..r.row };
            words.extend(row.words());
            pairs.extend(r.penalties.iter().flat_map(|&(t, n)| [t, n]));
        }
        Check(Kernel::Sample.name()).that(
            "penalties",
            pairs.len() <= self.penalties.len(),
            format!("at most {} pairs in all", self.penalties.len() / 2),
            pairs.len() / 2,
        )?;
        gpu.upload_into(&words, &mut self.rows)?;
        if !pairs.is_empty() {
            gpu.upload_into(&pairs, &mut self.penalties)?;
        }
        Ok(())
    }

    /// Penalty pairs these rows have room for, in all.
    pub fn capacity(&self) -> usize {
        self.penalties.len() / 2
    }

    /// Rows.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether there are no rows.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// A device buffer for `rows` rows' [`SampleOut`]s.
pub fn sample_out(gpu: &Gpu, rows: usize) -> Result<CudaSlice<u32>> {
    // Every word u32::MAX: a row the kernel did not write reads as no status at all.
    gpu.upload(&vec![u32::MAX; rows.max(1) * OUT_WORDS])
}

/// The [`SampleOut`]s of `words` (a [`sample_out`] buffer's contents).
pub fn read_out(words: &[u32]) -> Vec<SampleOut> {
    words.chunks_exact(OUT_WORDS).map(SampleOut::from_words).collect()
}

/// Samples each row of `logits` (rows of `stride` elements, the first `rows.vocab` of each the
/// logits) with its settings in `rows`, into `out` (a [`sample_out`] buffer of at least as
/// many rows). Only the ids and their statuses need to come back: [`read_out`].
pub fn sample(
    gpu: &Gpu,
    logits: &impl DevicePtr<bf16>,
    stride: usize,
    rows: &SampleRows,
    out: &mut CudaSlice<u32>,
) -> Result<()> {
    let k = Kernel::Sample;
    let c = Check(k.name());
    let (n, vocab) = (rows.len, rows.vocab);
    c.that("stride", stride >= vocab && stride <= u32::MAX as usize, format!("{vocab}..=2^32-1"), stride)?;
    let need = (n.max(1) - 1) * stride + vocab;
    c.len_at_least("logits", need, logits.len())?;
    c.len_at_least("out", n * OUT_WORDS, out.len())?;
    let p = SampleParams {
        logits: gpu.addr(k, "logits", logits)? as *const u16,
        rows: gpu.addr(k, "rows", &rows.rows)? as *const SampleRow,
        penalties: gpu.addr(k, "penalties", &rows.penalties)? as *const u32,
        out: gpu.addr_mut(k, "out", out)? as *mut u32,
        vocab: vocab as u32,
        stride: stride as u32,
    };
    if n == 0 {
        return Ok(());
    }
    // SAFETY: the logits hold n rows of stride elements (the last at least vocab), vocab within
    // the kernel's shared memory limit; rows holds n checked rows whose penalty pairs lie
    // inside the penalty buffer (distinct tokens below vocab); out holds n rows and is `&mut`.
    unsafe {
        gpu.launch_clusters(
            k,
            (SAMPLE_CLUSTER, n as u32, 1),
            SAMPLE_CLUSTER,
            SAMPLE_BLOCK,
            sample_smem(vocab as u32),
            p,
        )
    }
}
