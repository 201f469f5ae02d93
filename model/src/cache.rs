//! Per-request slots in the state cache, and the split of a step's rows into decode rows and
//! prefill sequences, decided from request metadata (never from token counts: a fresh
//! one-token request is a prefill with no initial state).

use crate::error::{Error, Result};

/// Hands out the cache's slots to requests and takes them back.
#[derive(Debug)]
pub struct SlotPool {
    free: Vec<i32>,
    used: Vec<bool>,
}

impl SlotPool {
    /// A pool of `slots` slots, all free.
    pub fn new(slots: usize) -> SlotPool {
        SlotPool { free: (0..slots as i32).rev().collect(), used: vec![false; slots] }
    }

    /// A free slot, or an error when all are taken.
    pub fn alloc(&mut self) -> Result<i32> {
        let s = self
            .free
            .pop()
            .ok_or_else(|| Error::Capacity(format!("all {} state slots are in use", self.used.len())))?;
        self.used[s as usize] = true;
        Ok(s)
    }

    /// Returns a slot; freeing a slot that is not in use is an error.
    pub fn free(&mut self, slot: i32) -> Result<()> {
        match self.used.get_mut(slot.max(0) as usize) {
            Some(u) if *u && slot >= 0 => {
                *u = false;
                self.free.push(slot);
                Ok(())
            }
            _ => Err(Error::Capacity(format!("slot {slot} is not in use"))),
        }
    }

    /// Slots in use.
    pub fn in_use(&self) -> usize {
        self.used.iter().filter(|&&u| u).count()
    }
}

/// One request's part of a step: its slot, how many of its tokens the model has already
/// processed, and the new tokens this step feeds.
#[derive(Clone, Debug, PartialEq)]
pub struct Part<'a> {
    pub slot: i32,
    pub computed: usize,
    pub tokens: &'a [u32],
}

/// A step's rows: decode rows first (one token each, continuing from their slot's state),
/// then prefill sequences (their tokens in order, from their slot's state when they continue
/// one, else from zero). `order[i]` is the index of the part that row group i came from.
#[derive(Clone, Debug, PartialEq)]
pub struct StepPlan {
    pub decode_slots: Vec<i32>,
    pub decode_tokens: Vec<u32>,
    pub prefill_lens: Vec<usize>,
    pub prefill_slots: Vec<i32>,
    pub prefill_initial: Vec<bool>,
    pub prefill_tokens: Vec<u32>,
    pub order: Vec<usize>,
}

impl StepPlan {
    /// Splits `parts` (each with at least one new token): a part is a decode row exactly when
    /// it continues a request (`computed > 0`) with one new token.
    pub fn new(parts: &[Part]) -> Result<StepPlan> {
        let mut plan = StepPlan {
            decode_slots: Vec::new(),
            decode_tokens: Vec::new(),
            prefill_lens: Vec::new(),
            prefill_slots: Vec::new(),
            prefill_initial: Vec::new(),
            prefill_tokens: Vec::new(),
            order: Vec::new(),
        };
        if let Some(i) = parts.iter().position(|p| p.tokens.is_empty()) {
            return Err(Error::Unsupported(format!("request part {i} has no new tokens")));
        }
        let decode = |p: &Part| p.computed > 0 && p.tokens.len() == 1;
        for (i, p) in parts.iter().enumerate().filter(|(_, p)| decode(p)) {
            plan.decode_slots.push(p.slot);
            plan.decode_tokens.push(p.tokens[0]);
            plan.order.push(i);
        }
        for (i, p) in parts.iter().enumerate().filter(|(_, p)| !decode(p)) {
            plan.prefill_lens.push(p.tokens.len());
            plan.prefill_slots.push(p.slot);
            plan.prefill_initial.push(p.computed > 0);
            plan.prefill_tokens.extend_from_slice(p.tokens);
            plan.order.push(i);
        }
        Ok(plan)
    }

    /// Rows of activations the step processes.
    pub fn rows(&self) -> usize {
        self.decode_tokens.len() + self.prefill_tokens.len()
    }
}
