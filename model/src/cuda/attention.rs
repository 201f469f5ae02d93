//! Attention layers on the CUDA backend: q, k and v as strided rows (column blocks of the fused
//! q/k/v projection's output), keys and values with one stride, through the host crate's
//! attention over the KV cache.

use half::bf16;
use host::attn::{AttnShape, Qkv, attention};
use host::{Buffer, Gpu};

use super::{Cuda, CudaRows, rows_of, view_mut};
use crate::backend::{KvCache, Out, QkvRows};
use crate::config::AttentionConfig;
use crate::error::Result;

/// Attention of the step's rows over their sequences' cached keys and values, the new ones
/// written into the cache first.
pub(super) fn forward(
    g: &Gpu,
    c: &AttentionConfig,
    QkvRows { q, k, v }: QkvRows<Buffer<bf16>>,
    cache: KvCache<Cuda>,
    rows: &CudaRows,
    y: Out<Buffer<bf16>>,
) -> Result<()> {
    let shape = AttnShape { heads: c.heads, kv_heads: c.kv_heads, head_dim: c.head_dim, max_len: cache.max_len };
    let (n, qw, kw) = (rows.attn.len(), c.heads * c.head_dim, c.kv_heads * c.head_dim);
    let mut y = view_mut(y, n * qw)?;
    let qkv = Qkv { q: rows_of(&q, n, qw), k: rows_of(&k, n, kw), v: rows_of(&v, n, kw) };
    Ok(attention(g, shape, qkv, cache.k, cache.v, &rows.attn, &mut y)?)
}
