//! A step's rows on the CUDA backend ([`CudaRows`]): tokens, decode slots, prefill sequences,
//! attention rows and the rows whose logits are wanted, checked and uploaded once a step and
//! written over in place for a replayed graph.

use std::cell::{RefCell, RefMut};

use host::attn::AttnRows;
use host::batch::{Prefill, Slots};
use host::ssd::SsdPlan;
use host::ssm::SsmShape;
use host::{CudaSlice, Gpu};

use crate::backend::StepRows;
use crate::error::{Error, Result};

/// A step's rows on the device, checked (see [`crate::backend::Backend::rows`]).
pub struct CudaRows {
    pub(super) tokens: CudaSlice<u32>,
    pub(super) decode: Option<Slots>,
    pub(super) prefill: Option<Prefill>,
    pub(super) attn: AttnRows,
    pub(super) last: CudaSlice<u32>,
    /// The chunked scan's plan of the prefill sequences (its chunk table and workspaces), built
    /// by the step's first Mamba layer and reused by the others (each of the same shape).
    ssd: RefCell<Option<SsdPlan>>,
}

impl CudaRows {
    pub(super) fn decode(&self) -> Result<&Slots> {
        self.decode
            .as_ref()
            .ok_or_else(|| Error::Unsupported("a decode operation in a step without decode rows".into()))
    }

    pub(super) fn prefill(&self) -> Result<&Prefill> {
        self.prefill.as_ref().ok_or_else(|| Error::Unsupported("a prefill operation in a step without prefill".into()))
    }

    /// The chunked scan's plan of the prefill sequences for `shape`: the step's, or one built
    /// now (the first Mamba layer of the step, or one of another shape).
    pub(super) fn ssd_plan(&self, g: &Gpu, shape: SsmShape) -> Result<RefMut<'_, SsdPlan>> {
        let seqs = self.prefill()?;
        let mut plan = self.ssd.borrow_mut();
        if !plan.as_ref().is_some_and(|p| p.fits(seqs, shape)) {
            *plan = Some(SsdPlan::new(g, seqs, shape)?);
        }
        Ok(RefMut::map(plan, |p| p.as_mut().expect("built above")))
    }

    /// Checks and uploads `r` for a cache of `slots` slots of `max_len` tokens.
    pub(super) fn new(g: &Gpu, r: &StepRows, slots: usize, max_len: usize) -> Result<CudaRows> {
        let p = &r.prefill;
        Ok(CudaRows {
            tokens: g.upload(&r.tokens)?,
            decode: (!r.decode_slots.is_empty()).then(|| Slots::new(g, &r.decode_slots, slots)).transpose()?,
            prefill: (!p.lens.is_empty()).then(|| Prefill::new(g, &p.lens, &p.slots, &p.initial, slots)).transpose()?,
            attn: AttnRows::new(g, &r.slots, &r.positions, slots, max_len)?,
            last: g.upload(&r.last)?,
            ssd: RefCell::new(None),
        })
    }

    /// Writes `r` over these rows in place (decode rows only, as many as before).
    pub(super) fn set(&mut self, g: &Gpu, r: &StepRows) -> Result<()> {
        let same = self.tokens.len() == r.tokens.len()
            && self.last.len() == r.last.len()
            && self.decode.as_ref().map_or(0, Slots::len) == r.decode_slots.len()
            && self.prefill.is_none()
            && r.prefill.lens.is_empty();
        if !same {
            return Err(Error::Unsupported("rows written in place must be decode rows only, as many as before".into()));
        }
        g.upload_into(&r.tokens, &mut self.tokens)?;
        if let Some(d) = &mut self.decode {
            d.set(g, &r.decode_slots)?;
        }
        // Not `last`: a step of decode rows only reads no gather of last rows (each row is its
        // part's last; see model/mod.rs `forward`).
        Ok(self.attn.set(g, &r.slots, &r.positions)?)
    }
}
