//! Launcher of the token sampling kernel (kernels-gpu/src/sample.rs, whose module doc gives the
//! math; the CPU implementation is `cpu::sample`, the same tokens from the same logits).

use cudarc::driver::CudaSlice;
use kernels_gpu::sample::{
    SAMPLE_CLUSTER, SAMPLE_MAX_VOCAB, SAMPLE_OUT_WORDS, SampleOut, SampleParams, SampleRow, sample_smem,
};
use kernels_gpu::{Kernel, entry};

use crate::args::{Len, Rows};
use crate::check::Check;
use crate::error::{Error, Result};
use crate::gpu::{Gpu, Grid};

/// Words of a [`SampleRow`] on the device.
const ROW_WORDS: usize = 16;
/// Words of a [`SampleOut`].
const OUT_WORDS: usize = SAMPLE_OUT_WORDS as usize;

/// One row's sampling: its settings (`penalties_at`, `penalties_len`, `masked` and `mask_at`
/// are set from the rest), its penalized tokens, pairs (token, times generated), and the
/// tokens it may pick, when not all: a bit a token (1: allowed), `vocab.div_ceil(32)` words.
#[derive(Clone, Copy, Debug)]
pub struct RowSampling<'a> {
    pub row: SampleRow,
    pub penalties: &'a [(u32, u32)],
    pub mask: Option<&'a [u32]>,
}

/// Words of a mask over a vocabulary of `vocab` tokens.
pub fn mask_words(vocab: usize) -> usize {
    vocab.div_ceil(32)
}

/// Checks one row's settings for a vocabulary of `vocab`: temperature finite and >= 0, top-p
/// in (0, 1], min-p in [0, 1], repetition finite and > 0, presence and frequency finite;
/// penalized tokens distinct, below `vocab`, counts >= 1; a mask of [`mask_words`] words.
pub fn check_row(r: &RowSampling, vocab: usize) -> Result<()> {
    check_row_in(r, vocab, &mut Vec::new())
}

/// [`check_row`] with `seen`, a bitmap of the vocabulary the caller keeps between calls
/// (left all clear), so the distinct-token check of a step's rows allocates nothing.
fn check_row_in(r: &RowSampling, vocab: usize, seen: &mut Vec<u64>) -> Result<()> {
    let c = Check(Kernel::Sample.name());
    let s = &r.row;
    c.that("temperature", s.temperature.is_finite() && s.temperature >= 0.0, "a finite value >= 0", s.temperature)?;
    c.that("top_p", s.top_p > 0.0 && s.top_p <= 1.0, "a value in (0, 1]", s.top_p)?;
    c.that("min_p", (0.0..=1.0).contains(&s.min_p), "a value in [0, 1]", s.min_p)?;
    c.positive("repetition_penalty", s.repetition)?;
    c.that("presence_penalty", s.presence.is_finite(), "a finite value", s.presence)?;
    c.that("frequency_penalty", s.frequency.is_finite(), "a finite value", s.frequency)?;
    if let Some(mask) = r.mask {
        c.that("mask", mask.len() == mask_words(vocab), format!("{} words", mask_words(vocab)), mask.len())?;
    }
    if r.penalties.is_empty() {
        return Ok(());
    }
    seen.resize(vocab.div_ceil(64), 0);
    let mut check = || {
        for &(t, n) in r.penalties {
            c.that("penalties", (t as usize) < vocab, format!("tokens below {vocab}"), t)?;
            c.that("penalties", n >= 1, "counts >= 1", n)?;
            let (word, bit) = (t as usize / 64, 1u64 << (t % 64));
            c.that("penalties", seen[word] & bit == 0, "distinct tokens", format!("{t} twice"))?;
            seen[word] |= bit;
        }
        Ok(())
    };
    let checked = check();
    // Clear again every word a token may have marked.
    for &(t, _) in r.penalties {
        if let Some(w) = seen.get_mut(t as usize / 64) {
            *w = 0;
        }
    }
    checked
}

/// A step's sampling rows on the device, checked: the rows' settings, their penalty pairs
/// (room for `capacity` pairs) and their masks (room for one a row when a row had one at
/// [`SampleRows::new`]), rewritable in place ([`SampleRows::set`]) so a recorded step (a CUDA
/// graph) samples with new settings.
pub struct SampleRows {
    rows: CudaSlice<u32>,
    penalties: CudaSlice<u32>,
    masks: CudaSlice<u32>,
    len: usize,
    vocab: usize,
    /// The vocabulary bitmap of [`check_row_in`].
    seen: Vec<u64>,
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
        let masked = rows.iter().any(|r| r.mask.is_some());
        let mut s = SampleRows {
            rows: gpu.zeros(rows.len() * ROW_WORDS)?,
            penalties: gpu.zeros(2 * capacity.max(1))?,
            masks: gpu.zeros(if masked { rows.len() * mask_words(vocab) } else { 1 })?,
            len: rows.len(),
            vocab,
            seen: Vec::new(),
        };
        s.set(gpu, rows)?;
        Ok(s)
    }

    /// Checks `rows` (as many as before, their penalty pairs within the capacity, masks only
    /// where [`SampleRows::has_masks`]) and writes them over these in place.
    pub fn set(&mut self, gpu: &Gpu, rows: &[RowSampling]) -> Result<()> {
        if rows.len() != self.len {
            return Err(Error::Batch(format!("{} sampling rows given for {} in place", rows.len(), self.len)));
        }
        let mut words = Vec::with_capacity(rows.len() * ROW_WORDS);
        let (mut pairs, mut masks) = (Vec::new(), Vec::new());
        let c = Check(Kernel::Sample.name());
        for (i, r) in rows.iter().enumerate() {
            check_row_in(r, self.vocab, &mut self.seen)?;
            let mask_at = (i * mask_words(self.vocab)) as u32;
            let row = SampleRow {
                penalties_at: (pairs.len() / 2) as u32,
                penalties_len: r.penalties.len() as u32,
                masked: u32::from(r.mask.is_some()),
                mask_at,
                ..r.row
            };
            words.extend(row.words());
            pairs.extend(r.penalties.iter().flat_map(|&(t, n)| [t, n]));
            if let Some(mask) = r.mask {
                c.that("mask", self.has_masks(), "rows without masks (made without room for them)", "a mask")?;
                masks.resize(mask_at as usize, u32::MAX);
                masks.extend_from_slice(mask);
            }
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
        if !masks.is_empty() {
            gpu.upload_into(&masks, &mut self.masks)?;
        }
        Ok(())
    }

    /// Whether these rows have room for masks (one a row).
    pub fn has_masks(&self) -> bool {
        self.masks.len() >= self.len * mask_words(self.vocab) && self.len > 0
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

/// Samples each row of `logits` (one a sampling row, of `rows.vocab` logits each) with its
/// settings in `rows`, into `out` (a [`sample_out`] buffer of at least as many rows). Only the
/// ids and their statuses need to come back: [`read_out`].
pub fn sample(gpu: &Gpu, logits: Rows, rows: &SampleRows, out: &mut CudaSlice<u32>) -> Result<()> {
    let k = entry::SAMPLE;
    let a = gpu.args(k);
    let (n, vocab) = (rows.len, rows.vocab);
    let (logits, stride) = a.rows("logits", &logits, (n, vocab))?;
    let p = SampleParams {
        logits,
        rows: a.input("rows", &rows.rows, Len::Any)?.cast(),
        penalties: a.input("penalties", &rows.penalties, Len::Any)?,
        masks: a.input("masks", &rows.masks, Len::Any)?,
        out: a.output("out", out, Len::AtLeast(n * OUT_WORDS))?,
        vocab: vocab as u32,
        stride,
    };
    if n == 0 {
        return Ok(());
    }
    // SAFETY: the logits hold n rows of stride elements (the last at least vocab), vocab within
    // the kernel's shared memory limit; rows holds n checked rows whose penalty pairs lie
    // inside the penalty buffer (distinct tokens below vocab) and whose masks, where they have
    // one, inside the masks buffer (`set` refuses them without room); out holds n rows and is
    // `&mut`.
    let grid = Grid::new(k, (SAMPLE_CLUSTER, n as u32, 1)).clusters(SAMPLE_CLUSTER).smem(sample_smem(vocab as u32));
    unsafe { gpu.launch(grid, p) }
}

#[cfg(test)]
mod tests {
    use kernels_gpu::sample::SampleRow;

    use super::{RowSampling, check_row_in};

    /// The bitmap `SampleRows` keeps across rows and steps is clear again after every row,
    /// refused or not: the same tokens in the next row are no repeats.
    #[test]
    fn the_distinct_token_bitmap_is_left_clear() {
        let row = |penalties| RowSampling { row: SampleRow::GREEDY, penalties, mask: None };
        let mut seen = Vec::new();
        let ok: &[(u32, u32)] = &[(0, 1), (63, 2), (64, 1), (999, 4)];
        for _ in 0..3 {
            check_row_in(&row(ok), 1000, &mut seen).unwrap();
        }
        for bad in [&[(5, 1), (64, 1), (5, 2)][..], &[(7, 1), (1000, 1)], &[(9, 1), (10, 0)]] {
            assert!(check_row_in(&row(bad), 1000, &mut seen).is_err(), "{bad:?}");
            assert!(seen.iter().all(|&w| w == 0), "{bad:?} left bits set");
            check_row_in(&row(ok), 1000, &mut seen).unwrap();
        }
        let e = check_row_in(&row(&[(3, 1), (3, 1)]), 1000, &mut seen).unwrap_err().to_string();
        assert!(e.contains("distinct tokens") && e.contains("3 twice"), "{e}");
    }
}
