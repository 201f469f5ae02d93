//! The CPU backend's attention layer: its projections and its slots' key and value caches,
//! attention from the host crate's reference.

use half::bf16;
use host::cpu::attn;

use super::{Cpu, CpuWeight, put};
use crate::backend::{AttentionOps, Backend, In, Out, QkvBufs, QkvRows, StepRows, project};
use crate::config::AttentionConfig;
use crate::error::Result;

/// An attention layer on the CPU backend: its projections and its slots' key and value caches.
pub struct CpuAttention {
    pub(super) c: AttentionConfig,
    pub(super) q: CpuWeight,
    pub(super) k: CpuWeight,
    pub(super) v: CpuWeight,
    pub(super) o: CpuWeight,
    /// `[slots, max_len, kv_heads * head_dim]` each.
    pub(super) k_cache: Vec<bf16>,
    pub(super) v_cache: Vec<bf16>,
    pub(super) max_len: usize,
}

impl AttentionOps<Cpu> for CpuAttention {
    /// q, k and v apart (each output the same product as through one weight of their rows).
    fn qkv(&self, b: &Cpu, x: In<Vec<bf16>>, rows: usize) -> Result<QkvBufs<Vec<bf16>>> {
        let (qw, kw) = (self.c.heads * self.c.head_dim, self.c.kv_heads * self.c.head_dim);
        let (q, k) = (project(b, x, rows, &self.q, qw)?, project(b, x, rows, &self.k, kw)?);
        Ok(QkvBufs::Apart { q, k, v: project(b, x, rows, &self.v, kw)? })
    }

    fn attend(&mut self, _b: &Cpu, qkv: &QkvBufs<Vec<bf16>>, rows: &StepRows, y: Out<Vec<bf16>>) -> Result<()> {
        let (c, max_len, kc, vc) = (&self.c, self.max_len, &mut self.k_cache, &mut self.v_cache);
        let (qw, kw) = (c.heads * c.head_dim, c.kv_heads * c.head_dim);
        let QkvRows { q, k, v } = qkv.rows(qw, kw);
        let at = |r: usize| (rows.slots[r] as usize * max_len + rows.positions[r] as usize) * kw;
        for r in 0..rows.slots.len() {
            kc[at(r)..][..kw].copy_from_slice(&k.buf[k.offset + r * k.stride..][..kw]);
            vc[at(r)..][..kw].copy_from_slice(&v.buf[v.offset + r * v.stride..][..kw]);
        }
        for r in 0..rows.slots.len() {
            let base = rows.slots[r] as usize * max_len * kw;
            let upto = |c: &Vec<bf16>| -> Vec<Vec<f64>> {
                (0..=rows.positions[r] as usize)
                    .map(|p| c[base + p * kw..][..kw].iter().map(|x| x.to_f64()).collect())
                    .collect()
            };
            let qr: Vec<f64> = q.buf[q.offset + r * q.stride..][..qw].iter().map(|x| x.to_f64()).collect();
            put(
                Out { buf: &mut *y.buf, offset: y.offset + r * qw },
                attn::attend(&qr, &upto(kc), &upto(vc), c.heads, c.kv_heads, c.head_dim),
            );
        }
        Ok(())
    }

    fn out(&self, b: &Cpu, x: In<Vec<bf16>>, rows: usize, y: Out<Vec<bf16>>) -> Result<()> {
        b.linear(x, rows, &self.o, y)
    }

    fn kv_cache(&mut self) -> (&mut Vec<bf16>, &mut Vec<bf16>) {
        (&mut self.k_cache, &mut self.v_cache)
    }
}
