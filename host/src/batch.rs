//! Validated per-call metadata the recurrence kernels index with: the cache slots of decode
//! rows ([`Slots`]) and the sequences of a prefill batch ([`Prefill`]). They are checked on the
//! host once, when built, and uploaded; launchers take them by reference, so a kernel never
//! sees an out-of-range or repeated slot.

use cudarc::driver::CudaSlice;
use kernels_gpu::conv1d::PAD_SLOT;

use crate::error::{Error, Result};
use crate::gpu::Gpu;

/// Checks slot indices: each is [`PAD_SLOT`] or in `0..num_slots`, and no slot repeats.
fn check_slots(what: &'static str, slots: &[i32], num_slots: usize) -> Result<()> {
    let mut seen = vec![false; num_slots];
    for (i, &s) in slots.iter().enumerate() {
        if s == PAD_SLOT {
            continue;
        }
        let ok = s >= 0 && (s as usize) < num_slots;
        if !ok || seen[s as usize] {
            return Err(Error::Batch(if ok {
                format!("{what} {i}: slot {s} is used twice in one call (states are updated in place)")
            } else {
                format!(
                    "{what} {i}: slot {s} is out of range: the cache has {num_slots} slots, and {PAD_SLOT} marks padding"
                )
            }));
        }
        seen[s as usize] = true;
    }
    Ok(())
}

/// Checks a prefill batch's metadata; returns the cumulative start rows `cu_seqlens`.
fn check_prefill(lens: &[usize], slots: &[i32], has_initial: &[bool], num_slots: usize) -> Result<Vec<i32>> {
    let bad = |msg: String| Err(Error::Batch(msg));
    if lens.is_empty() || lens.len() != slots.len() || lens.len() != has_initial.len() {
        return bad(format!(
            "a prefill needs one or more sequences, each with a length, a slot and an initial-state flag; got {} lengths, {} slots, {} flags",
            lens.len(),
            slots.len(),
            has_initial.len()
        ));
    }
    if let Some(i) = lens.iter().position(|&l| l == 0) {
        return bad(format!("prefill sequence {i} has length 0"));
    }
    let tokens: usize = lens.iter().sum();
    if tokens > i32::MAX as usize {
        return bad(format!("a prefill of {tokens} tokens is too long"));
    }
    if let Some(i) = (0..slots.len()).find(|&i| slots[i] == PAD_SLOT && has_initial[i]) {
        return bad(format!("prefill sequence {i} is padding but claims an initial state"));
    }
    check_slots("prefill sequence", slots, num_slots)?;
    let mut cu = vec![0i32];
    for &l in lens {
        cu.push(cu.last().copied().unwrap_or(0) + l as i32);
    }
    Ok(cu)
}

/// The cache slot of each decode row (or [`PAD_SLOT`]), validated against a cache of
/// `num_slots` slots and uploaded.
pub struct Slots {
    pub(crate) dev: CudaSlice<i32>,
    host: Vec<i32>,
    num_slots: usize,
}

impl Slots {
    /// Validates `slots` (in range or PAD_SLOT, no repeats) and uploads them.
    pub fn new(gpu: &Gpu, slots: &[i32], num_slots: usize) -> Result<Slots> {
        check_slots("decode row", slots, num_slots)?;
        Ok(Slots { dev: gpu.upload(slots)?, host: slots.to_vec(), num_slots })
    }

    /// Validates `slots` (as many as before) and writes them over these in place, so work
    /// recorded reading this buffer (a CUDA graph) reads the new slots.
    pub fn set(&mut self, gpu: &Gpu, slots: &[i32]) -> Result<()> {
        if slots.len() != self.host.len() {
            return Err(Error::Batch(format!("{} decode rows given for {} in place", slots.len(), self.host.len())));
        }
        check_slots("decode row", slots, self.num_slots)?;
        gpu.upload_into(slots, &mut self.dev)?;
        self.host.copy_from_slice(slots);
        Ok(())
    }

    /// Rows (the batch size).
    pub fn len(&self) -> usize {
        self.host.len()
    }

    /// Whether there are no rows.
    pub fn is_empty(&self) -> bool {
        self.host.is_empty()
    }

    /// The slots, as given.
    pub fn as_slice(&self) -> &[i32] {
        &self.host
    }

    /// Slots in the cache these indices were checked against.
    pub fn num_slots(&self) -> usize {
        self.num_slots
    }
}

/// The sequences of a prefill call: lengths (each >= 1), the slot of each (or PAD_SLOT), and
/// whether each continues from its slot's state. Token `t` of sequence `s` is row
/// `cu_seqlens[s] + t` of the activations.
pub struct Prefill {
    pub(crate) cu_seqlens: CudaSlice<i32>,
    pub(crate) slots: CudaSlice<i32>,
    pub(crate) has_initial: CudaSlice<u8>,
    pub(crate) lens: Vec<usize>,
    slot_list: Vec<i32>,
    num_slots: usize,
}

impl Prefill {
    /// Validates and uploads the batch's sequence metadata.
    pub fn new(gpu: &Gpu, lens: &[usize], slots: &[i32], has_initial: &[bool], num_slots: usize) -> Result<Prefill> {
        let cu = check_prefill(lens, slots, has_initial, num_slots)?;
        let flags: Vec<u8> = has_initial.iter().map(|&b| u8::from(b)).collect();
        Ok(Prefill {
            cu_seqlens: gpu.upload(&cu)?,
            slots: gpu.upload(slots)?,
            has_initial: gpu.upload(&flags)?,
            lens: lens.to_vec(),
            slot_list: slots.to_vec(),
            num_slots,
        })
    }

    /// Total tokens (rows of the activations).
    pub fn tokens(&self) -> usize {
        self.lens.iter().sum()
    }

    /// Number of sequences.
    pub fn nseq(&self) -> usize {
        self.lens.len()
    }

    /// The sequences' slots, as given.
    pub fn slots(&self) -> &[i32] {
        &self.slot_list
    }

    /// Slots in the cache these indices were checked against.
    pub fn num_slots(&self) -> usize {
        self.num_slots
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn msg<T: std::fmt::Debug>(r: Result<T>) -> String {
        match r {
            Err(Error::Batch(m)) => m,
            other => panic!("expected a batch error, got {other:?}"),
        }
    }

    #[test]
    fn slots_must_be_in_range_distinct_or_pad() {
        check_slots("row", &[3, PAD_SLOT, 0, PAD_SLOT, 7], 8).unwrap();
        assert!(msg(check_slots("row", &[0, 8], 8)).contains("row 1: slot 8 is out of range"));
        assert!(msg(check_slots("row", &[-2], 8)).contains("out of range"));
        assert!(msg(check_slots("row", &[5, 1, 5], 8)).contains("row 2: slot 5 is used twice"));
    }

    #[test]
    fn prefill_metadata_is_checked() {
        assert_eq!(
            check_prefill(&[3, 1, 128], &[2, PAD_SLOT, 0], &[true, false, false], 4).unwrap(),
            vec![0, 3, 4, 132]
        );
        assert!(msg(check_prefill(&[], &[], &[], 4)).contains("one or more sequences"));
        assert!(msg(check_prefill(&[3, 1], &[0], &[false, false], 4)).contains("2 lengths, 1 slots"));
        assert!(msg(check_prefill(&[3, 0], &[0, 1], &[false, false], 4)).contains("sequence 1 has length 0"));
        assert!(msg(check_prefill(&[3], &[PAD_SLOT], &[true], 4)).contains("padding but claims an initial state"));
        assert!(msg(check_prefill(&[3, 2], &[1, 1], &[false, false], 4)).contains("used twice"));
        assert!(msg(check_prefill(&[3], &[4], &[false], 4)).contains("out of range"));
    }
}
