//! A slot's state copied out and back ([`Model::save`], [`Model::restore`]): what the prefix
//! cache ([`crate::prefix`]) keeps.

use super::{MixW, Model};
use crate::backend::Backend;
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
        let (mut m, mut a) = (0, 0);
        for layer in &mut self.weights.layers {
            match layer {
                MixW::Mamba(x) => {
                    let (conv, ssm) = B::mamba_state(x);
                    b.copy(conv, s * shape.conv, &mut snap.conv, m * shape.conv, shape.conv)?;
                    b.copy32(ssm, s * shape.ssm, &mut snap.ssm, m * shape.ssm, shape.ssm)?;
                    m += 1;
                }
                MixW::Attention(x) => {
                    let (k, v) = B::kv_cache(x);
                    for (i, cache) in [k, v].into_iter().enumerate() {
                        let n = len * shape.kv;
                        b.copy(cache, s * max_len * shape.kv, &mut snap.kv, (2 * a + i) * n, n)?;
                    }
                    a += 1;
                }
                MixW::Moe(_) | MixW::Mlp { .. } => {}
            }
        }
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
        let b = &self.backend;
        let (mut m, mut a) = (0, 0);
        for layer in &mut self.weights.layers {
            match layer {
                MixW::Mamba(x) => {
                    let (conv, ssm) = B::mamba_state(x);
                    b.copy(&snap.conv, m * shape.conv, conv, s * shape.conv, shape.conv)?;
                    b.copy32(&snap.ssm, m * shape.ssm, ssm, s * shape.ssm, shape.ssm)?;
                    m += 1;
                }
                MixW::Attention(x) => {
                    let (k, v) = B::kv_cache(x);
                    for (i, cache) in [k, v].into_iter().enumerate() {
                        let n = snap.len * shape.kv;
                        b.copy(&snap.kv, (2 * a + i) * n, cache, s * max_len * shape.kv, n)?;
                    }
                    a += 1;
                }
                MixW::Moe(_) | MixW::Mlp { .. } => {}
            }
        }
        self.past[s] = snap.len;
        Ok(())
    }
}
