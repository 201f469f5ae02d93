//! A slot's state copied out and back ([`Model::save`], [`Model::restore`]): what the prefix
//! cache ([`crate::prefix`]) keeps.

use super::{MixW, Model};
use crate::backend::{AttentionOps, Backend, MambaOps};
use crate::error::{Error, Result};
use crate::prefix::{Snapshot, SnapshotShape};

impl<B: Backend> Model<B> {
    /// The shape of a slot's state, as a [`Snapshot`] holds it.
    pub fn snapshot_shape(&self) -> SnapshotShape {
        SnapshotShape::new(&self.config)
    }

    /// The slot's index, or an error naming it.
    fn slot_index(&self, slot: i32) -> Result<usize> {
        usize::try_from(slot)
            .ok()
            .filter(|&s| s < self.past.len())
            .ok_or_else(|| Error::Capacity(format!("slot {slot} is out of range (0..{})", self.past.len())))
    }

    /// A copy of `slot`'s state as it stands (after the tokens its steps fed), queued on the
    /// backend: restored into any slot ([`Model::restore`]), it continues as this one would.
    pub fn save(&mut self, slot: i32) -> Result<Snapshot<B>> {
        let s = self.slot_index(slot)?;
        let (len, max_len, shape) = (self.past[s], self.max_len, self.snapshot_shape());
        let b = &self.backend;
        let mut snap = Snapshot {
            len,
            shape,
            conv: b.scratch(shape.mamba_layers * shape.conv)?,
            ssm: b.zeros32(shape.mamba_layers * shape.ssm)?,
            kv: b.scratch(shape.attention_layers * 2 * len * shape.kv)?,
        };
        let n = len * shape.kv;
        self.each_state(&mut |b, state| match state {
            State::Mamba(m, conv, ssm) => {
                b.copy(conv, s * shape.conv, &mut snap.conv, m * shape.conv, shape.conv)?;
                b.copy32(ssm, s * shape.ssm, &mut snap.ssm, m * shape.ssm, shape.ssm)
            }
            State::Kv(i, cache) => b.copy(cache, s * max_len * shape.kv, &mut snap.kv, i * n, n),
        })?;
        Ok(snap)
    }

    /// Puts `snap` ([`Model::save`] of this model) into `slot`, which then holds the state of
    /// the snapshot's tokens: the slot's next part continues with `computed == snap.len()`.
    pub fn restore(&mut self, slot: i32, snap: &Snapshot<B>) -> Result<()> {
        let s = self.slot_index(slot)?;
        let (max_len, shape) = (self.max_len, self.snapshot_shape());
        if snap.shape != shape || snap.len > max_len {
            return Err(Error::Unsupported(format!(
                "a snapshot of {} tokens shaped {:?} does not fit this model's slots ({shape:?}, {max_len} tokens)",
                snap.len, snap.shape
            )));
        }
        let n = snap.len * shape.kv;
        self.each_state(&mut |b, state| match state {
            State::Mamba(m, conv, ssm) => {
                b.copy(&snap.conv, m * shape.conv, conv, s * shape.conv, shape.conv)?;
                b.copy32(&snap.ssm, m * shape.ssm, ssm, s * shape.ssm, shape.ssm)
            }
            State::Kv(i, cache) => b.copy(&snap.kv, i * n, cache, s * max_len * shape.kv, n),
        })?;
        self.past[s] = snap.len;
        Ok(())
    }

    /// `f` on every state buffer of the layers, in layer order: each Mamba layer's conv and SSM
    /// states (the m-th Mamba layer's), each attention layer's key then value cache (the a-th
    /// attention layer's as the caches `2a` and `2a + 1`).
    fn each_state(&mut self, f: &mut dyn FnMut(&B, State<'_, B>) -> Result<()>) -> Result<()> {
        let (mut m, mut i) = (0, 0);
        for layer in &mut self.weights.layers {
            match layer {
                MixW::Mamba(x) => {
                    let (conv, ssm) = x.state();
                    f(&self.backend, State::Mamba(m, conv, ssm))?;
                    m += 1;
                }
                MixW::Attention(x) => {
                    let (k, v) = x.kv_cache();
                    for cache in [k, v] {
                        f(&self.backend, State::Kv(i, cache))?;
                        i += 1;
                    }
                }
                MixW::Moe(_) | MixW::Mlp { .. } => {}
            }
        }
        Ok(())
    }
}

/// A layer's state buffers of every slot ([`Model::each_state`]): a Mamba layer's conv and SSM
/// states with its index among the Mamba layers, or a key or value cache with its index among
/// the caches.
enum State<'a, B: Backend> {
    Mamba(usize, &'a mut B::Buf, &'a mut B::Buf32),
    Kv(usize, &'a mut B::Buf),
}
