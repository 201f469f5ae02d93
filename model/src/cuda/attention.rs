//! Attention layers on the CUDA backend: a layer on the device ([`CudaAttention`]: its
//! projections, q, k and v as one weight where they can be, and its slots' key and value
//! caches) and its attention: q, k and v as strided rows (column blocks of the fused
//! projection's output), keys and values with one stride, through the host crate's attention
//! over the KV cache.

use half::bf16;
use host::Buffer;
use host::attn::{AttnShape, Qkv, attention};

use super::{Cuda, CudaRows, CudaWeight, rows_of, view_mut};
use crate::backend::{AttentionOps, Backend, CacheSizes, In, Out, QkvBufs, QkvRows, project};
use crate::config::AttentionConfig;
use crate::error::Result;
use crate::layout::{self, Linear};
use crate::weights::Dtype;

/// An attention layer on the device.
pub struct CudaAttention {
    /// The heads, and the caches' tokens per slot.
    shape: AttnShape,
    qkv: QkvWeights,
    o: CudaWeight,
    /// `[slots, max_len, kv_heads * head_dim]` each.
    k_cache: Buffer<bf16>,
    v_cache: Buffer<bf16>,
}

/// An attention layer's q, k and v projections: one weight of their rows in order where all
/// three are bf16 without bias (one launch instead of three), else apart (q, k, v).
enum QkvWeights {
    Fused(CudaWeight),
    Apart(Box<[CudaWeight; 3]>),
}

impl QkvWeights {
    fn upload(cuda: &Cuda, a: &layout::Attention) -> Result<QkvWeights> {
        let plain = |l: &Linear| l.weight.dtype == Dtype::Bf16 && l.bias.is_none() && l.fp8.is_none();
        let (q, k, v) = (&a.q, &a.k, &a.v);
        let hidden = q.shape()[1];
        if [q, k, v].iter().all(|l| plain(l) && l.shape()[1] == hidden) {
            let bytes = [q, k, v].iter().flat_map(|l| l.weight.bytes.iter().copied()).collect::<Vec<u8>>();
            let shape = [q.weight.shape[0] + k.weight.shape[0] + v.weight.shape[0], hidden];
            return Ok(QkvWeights::Fused(cuda.weight(&Linear::bf16("q_proj + k_proj + v_proj", &shape, &bytes))?));
        }
        Ok(QkvWeights::Apart(Box::new([cuda.weight(q)?, cuda.weight(k)?, cuda.weight(v)?])))
    }
}

impl CudaAttention {
    /// Uploads the layer `a` of `c` with zero key and value caches of `sizes`.
    pub(super) fn upload(
        cuda: &Cuda,
        c: &AttentionConfig,
        a: &layout::Attention,
        sizes: &CacheSizes,
    ) -> Result<CudaAttention> {
        let shape = AttnShape { heads: c.heads, kv_heads: c.kv_heads, head_dim: c.head_dim, max_len: sizes.max_len };
        let (qkv, o) = (QkvWeights::upload(cuda, a)?, cuda.weight(&a.o)?);
        Ok(CudaAttention { shape, qkv, o, k_cache: cuda.zeros(sizes.kv)?, v_cache: cuda.zeros(sizes.kv)? })
    }

    /// The widths of q, and of k (and of v).
    fn widths(&self) -> (usize, usize) {
        let s = &self.shape;
        (s.heads * s.head_dim, s.kv_heads * s.head_dim)
    }
}

impl AttentionOps<Cuda> for CudaAttention {
    /// q, k and v of `rows` rows of `x`: one buffer with the three side by side (fused), or
    /// one each.
    fn qkv(&self, cuda: &Cuda, x: In<Buffer<bf16>>, rows: usize) -> Result<QkvBufs<Buffer<bf16>>> {
        let (qw, kw) = self.widths();
        Ok(match &self.qkv {
            QkvWeights::Fused(w) => QkvBufs::Fused(project(cuda, x, rows, w, qw + 2 * kw)?),
            QkvWeights::Apart(w) => {
                let [q, k, v] = &**w;
                let (q, k) = (project(cuda, x, rows, q, qw)?, project(cuda, x, rows, k, kw)?);
                QkvBufs::Apart { q, k, v: project(cuda, x, rows, v, kw)? }
            }
        })
    }

    /// Attention of the step's rows over their sequences' cached keys and values, the new
    /// ones written into the cache first.
    fn attend(
        &mut self,
        cuda: &Cuda,
        qkv: &QkvBufs<Buffer<bf16>>,
        rows: &CudaRows,
        y: Out<Buffer<bf16>>,
    ) -> Result<()> {
        let ((qw, kw), n) = (self.widths(), rows.attn.len());
        let QkvRows { q, k, v } = qkv.rows(qw, kw);
        let mut y = view_mut(y, n * qw)?;
        let qkv = Qkv { q: rows_of(&q, n, qw), k: rows_of(&k, n, kw), v: rows_of(&v, n, kw) };
        Ok(attention(&cuda.gpu, self.shape, qkv, &mut self.k_cache, &mut self.v_cache, &rows.attn, &mut y)?)
    }

    /// o_proj over `rows` rows of `x`.
    fn out(&self, cuda: &Cuda, x: In<Buffer<bf16>>, rows: usize, y: Out<Buffer<bf16>>) -> Result<()> {
        cuda.linear(x, rows, &self.o, y)
    }

    fn kv_cache(&mut self) -> (&mut Buffer<bf16>, &mut Buffer<bf16>) {
        (&mut self.k_cache, &mut self.v_cache)
    }
}
