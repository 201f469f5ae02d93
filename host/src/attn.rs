//! Launcher of causal attention over the KV cache (kernels-gpu/src/attn.rs; reference:
//! cpu/attn.rs).

use std::collections::HashSet;

use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut};
use half::bf16;
use kernels_gpu::Kernel;
use kernels_gpu::attn::{ATTN_BLOCK, AttnParams, smem_bytes};

use crate::check::{Check, MAX_ROWS};
use crate::error::Result;
use crate::gpu::Gpu;

/// Attention geometry and the cache's length per slot.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttnShape {
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub max_len: usize,
}

/// Writes each row's `k`, `v` into the caches at (`slots[r]`, `pos[r]`), then attends each
/// row's query over its slot's keys `0..=pos[r]`; `out [rows, heads * head_dim]`.
#[allow(clippy::too_many_arguments)]
pub fn attention(
    gpu: &Gpu,
    s: AttnShape,
    q: &impl DevicePtr<bf16>,
    k: &impl DevicePtr<bf16>,
    v: &impl DevicePtr<bf16>,
    k_cache: &mut CudaSlice<bf16>,
    v_cache: &mut CudaSlice<bf16>,
    slots: &[i32],
    pos: &[u32],
    out: &mut impl DevicePtrMut<bf16>,
) -> Result<()> {
    let kn = Kernel::Attn;
    let c = Check(kn.name());
    let rows = slots.len();
    c.count("rows", MAX_ROWS, rows)?;
    c.len("pos", rows, pos.len())?;
    c.count("heads", 65535, s.heads)?;
    c.count("kv_heads", s.heads, s.kv_heads)?;
    c.that("kv_heads", s.heads.is_multiple_of(s.kv_heads), format!("a divisor of heads {}", s.heads), s.kv_heads)?;
    c.count("head_dim", 1024, s.head_dim)?;
    c.count("max_len", i32::MAX as usize, s.max_len)?;
    let (qw, kw) = (s.heads * s.head_dim, s.kv_heads * s.head_dim);
    c.len_at_least("q", rows * qw, q.len())?;
    c.len_at_least("k", rows * kw, k.len())?;
    c.len_at_least("v", rows * kw, v.len())?;
    c.len("out", rows * qw, out.len())?;
    let per_slot = s.max_len * kw;
    c.that(
        "k_cache",
        k_cache.len().is_multiple_of(per_slot),
        format!("whole slots of {per_slot} elements"),
        k_cache.len(),
    )?;
    c.len("v_cache", k_cache.len(), v_cache.len())?;
    let num_slots = k_cache.len() / per_slot;
    let mut seen = HashSet::new();
    for (r, (&sl, &p)) in slots.iter().zip(pos).enumerate() {
        c.that(
            "slots",
            sl >= 0 && (sl as usize) < num_slots,
            format!("slots in 0..{num_slots}"),
            format!("{sl} at row {r}"),
        )?;
        c.that("pos", (p as usize) < s.max_len, format!("positions below {}", s.max_len), format!("{p} at row {r}"))?;
        c.that("pos", seen.insert((sl, p)), "one row per slot and position", format!("row {r} repeats ({sl}, {p})"))?;
    }
    let (dslots, dpos) = (gpu.upload(slots)?, gpu.upload(pos)?);
    let p = AttnParams {
        q: gpu.addr(kn, "q", q)? as *const u16,
        k: gpu.addr(kn, "k", k)? as *const u16,
        v: gpu.addr(kn, "v", v)? as *const u16,
        k_cache: gpu.addr_mut(kn, "k_cache", k_cache)? as *mut u16,
        v_cache: gpu.addr_mut(kn, "v_cache", v_cache)? as *mut u16,
        slot: gpu.addr(kn, "slots", &dslots)? as *const i32,
        pos: gpu.addr(kn, "pos", &dpos)? as *const u32,
        out: gpu.addr_mut(kn, "out", out)? as *mut u16,
        rows: rows as u32,
        heads: s.heads as u32,
        kv_heads: s.kv_heads as u32,
        head_dim: s.head_dim as u32,
        max_len: s.max_len as u32,
        scale: 1.0 / (s.head_dim as f32).sqrt(),
    };
    // SAFETY: every extent above is checked; slots and positions are in range and distinct,
    // so cache writes do not collide; the caches and out are `&mut` (distinct from the
    // inputs); the attention launch runs after the cache write on the stream; the metadata
    // buffers outlive this call's queued work (freed in stream order).
    unsafe {
        gpu.launch(Kernel::AttnCacheWrite, (rows as u32, 1, 1), ATTN_BLOCK, 0, p)?;
        gpu.launch(kn, (rows as u32, s.heads as u32, 1), ATTN_BLOCK, smem_bytes(p.head_dim, p.max_len), p)
    }
}
