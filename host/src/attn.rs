//! Launcher of causal attention over the KV cache (kernels-gpu/src/attn.rs for few rows a
//! sequence, kernels-gpu/src/flash.rs on tensor cores for prefills; reference: cpu/attn.rs).

use std::collections::HashSet;

use cudarc::driver::{CudaSlice, DevicePtrMut};
use half::bf16;
use kernels_gpu::attn::{AttnParams, MAX_HEAD_DIM, smem_bytes, split_keys};
use kernels_gpu::flash::{FLASH_MAX_HEAD_DIM, FLASH_ROWS, FlashParams, FlashTile};
use kernels_gpu::{Kernel, entry};

use crate::args::{Elem, Len, Rows};
use crate::check::{Check, MAX_ROWS};
use crate::error::Result;
use crate::gpu::{Gpu, Grid};

/// Attention geometry and the cache's length per slot.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttnShape {
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub max_len: usize,
}

/// Each row's cache slot and position, checked on the host (slots in range, positions below
/// the cache length, no slot and position twice, so the cache writes do not collide) and
/// uploaded.
pub struct AttnRows {
    slot: CudaSlice<i32>,
    pos: CudaSlice<u32>,
    num_slots: usize,
    max_len: usize,
    /// Every row in a slot of its own (decode rows): the attention launch writes the rows'
    /// keys and values into the caches itself.
    own: bool,
    /// Otherwise the rows' query tiles for the flash kernel ([`flash_tiles`]).
    tiles: Option<CudaSlice<TileRepr>>,
}

impl AttnRows {
    /// Checks and uploads `slots` and `pos` (one per row) for a cache of `num_slots` slots of
    /// `max_len` positions.
    pub fn new(gpu: &Gpu, slots: &[i32], pos: &[u32], num_slots: usize, max_len: usize) -> Result<AttnRows> {
        let own = check_rows(slots, pos, num_slots, max_len)?;
        let tiles = if own { None } else { Some(gpu.upload(&tile_reprs(slots, pos))?) };
        Ok(AttnRows { slot: gpu.upload(slots)?, pos: gpu.upload(pos)?, num_slots, max_len, own, tiles })
    }

    /// Checks `slots` and `pos` (as many rows as before, each in a slot of its own if they were
    /// before, and not if not, and as many flash tiles: recorded work launched for the one or
    /// the other) and writes them over these in place, so work recorded reading these buffers
    /// (a CUDA graph) reads the new rows.
    pub fn set(&mut self, gpu: &Gpu, slots: &[i32], pos: &[u32]) -> Result<()> {
        let c = Check(Kernel::Attn.name());
        c.len("slots", self.slot.len(), slots.len())?;
        let own = check_rows(slots, pos, self.num_slots, self.max_len)?;
        let what = |own| if own { "each row in a slot of its own" } else { "rows sharing a slot" };
        c.that("slots", own == self.own, what(self.own), what(own))?;
        if let Some(tiles) = &mut self.tiles {
            let new = tile_reprs(slots, pos);
            c.len("slots (query tiles)", tiles.len(), new.len())?;
            gpu.upload_into(&new, tiles)?;
        }
        gpu.upload_into(slots, &mut self.slot)?;
        gpu.upload_into(pos, &mut self.pos)
    }

    /// Rows.
    pub fn len(&self) -> usize {
        self.slot.len()
    }

    /// Whether there are no rows.
    pub fn is_empty(&self) -> bool {
        self.slot.is_empty()
    }
}

/// Checks the rows; whether each is in a slot of its own.
fn check_rows(slots: &[i32], pos: &[u32], num_slots: usize, max_len: usize) -> Result<bool> {
    let c = Check(Kernel::Attn.name());
    c.count("rows", MAX_ROWS, slots.len())?;
    c.len("pos", slots.len(), pos.len())?;
    c.count("max_len", i32::MAX as usize, max_len)?;
    let (mut seen, mut slots_seen, mut own) = (HashSet::new(), HashSet::new(), true);
    for (r, (&sl, &p)) in slots.iter().zip(pos).enumerate() {
        c.that(
            "slots",
            sl >= 0 && (sl as usize) < num_slots,
            format!("slots in 0..{num_slots}"),
            format!("{sl} at row {r}"),
        )?;
        c.that("pos", (p as usize) < max_len, format!("positions below {max_len}"), format!("{p} at row {r}"))?;
        c.that("pos", seen.insert((sl, p)), "one row per slot and position", format!("row {r} repeats ({sl}, {p})"))?;
        own &= slots_seen.insert(sl);
    }
    Ok(own)
}

/// The query tiles of rows (checked): each run of consecutive rows of one slot at consecutive
/// positions cut into tiles of up to [`FLASH_ROWS`] rows, the tiles with the most keys first
/// (the longest blocks start first, the short ones fill in after them).
pub fn flash_tiles(slots: &[i32], pos: &[u32]) -> Vec<FlashTile> {
    let mut tiles: Vec<FlashTile> = Vec::new();
    for (r, (&sl, &p)) in slots.iter().zip(pos).enumerate() {
        match tiles.last_mut() {
            Some(t) if t.slot == sl as u32 && t.pos0 + t.rows == p && t.rows < FLASH_ROWS => t.rows += 1,
            _ => tiles.push(FlashTile { row0: r as u32, rows: 1, slot: sl as u32, pos0: p }),
        }
    }
    tiles.sort_by_key(|t| std::cmp::Reverse(t.pos0 + t.rows));
    tiles
}

/// FlashTile as cudarc sees it (kernels-gpu cannot implement cudarc's trait).
#[repr(transparent)]
#[derive(Clone, Copy)]
struct TileRepr(FlashTile);

// SAFETY: #[repr(C)] plain integers; any bit pattern is a valid value.
unsafe impl cudarc::driver::DeviceRepr for TileRepr {}

impl Elem for TileRepr {
    type Raw = FlashTile;
}

/// The flash tiles of rows (checked), as uploaded.
fn tile_reprs(slots: &[i32], pos: &[u32]) -> Vec<TileRepr> {
    flash_tiles(slots, pos).into_iter().map(TileRepr).collect()
}

/// A step's queries, keys and values: rows of `heads * head_dim` and of `kv_heads * head_dim`
/// channels, one row per [`AttnRows`] row (q, k and v may be column blocks of one buffer); the
/// keys and values with one row stride.
#[derive(Clone, Copy)]
pub struct Qkv<'a> {
    pub q: Rows<'a>,
    pub k: Rows<'a>,
    pub v: Rows<'a>,
}

/// The flash kernels to run: `Wgmma` (sm_90a: `attn_flash_wgmma_d128_bf16` for heads of 128
/// channels with q and the caches 16-byte aligned, 128 keys a tile; the 64-key kernels for
/// other heads), or the `mma.sync` kernels staging 64 keys at a time, or 32
/// (`attn_flash_k32_bf16` and its 128-channel form) where a block's shared memory cannot hold
/// 64's (the sm_12x family).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FlashKeys {
    Wgmma,
    K64,
    K32,
}

impl FlashKeys {
    /// Every choice, the fastest first.
    pub const ALL: [FlashKeys; 3] = [FlashKeys::Wgmma, FlashKeys::K64, FlashKeys::K32];

    /// The first of [`FlashKeys::ALL`] this GPU runs ([`FlashKeys::fits`]), or None: no flash
    /// kernel fits.
    pub fn fitting(gpu: &Gpu) -> Option<FlashKeys> {
        FlashKeys::ALL.into_iter().find(|f| f.fits(gpu))
    }

    /// Whether this GPU runs every kernel of this choice ([`Gpu::fits`]).
    pub fn fits(self, gpu: &Gpu) -> bool {
        [(128, true), (128, false), (64, false)].into_iter().all(|(d, vec)| gpu.fits(self.kernel(d, vec).kernel))
    }

    /// The kernel these keys take for heads of `head_dim` channels (`vec`: q and the caches
    /// 16-byte aligned): `Wgmma`'s kernel for 128 aligned, the `mma.sync` kernels' `d128`
    /// entries for 113 to 128, the generic ones otherwise.
    fn kernel(self, head_dim: usize, vec: bool) -> kernels_gpu::Entry<FlashParams> {
        let d128 = head_dim.div_ceil(16) == 8;
        match self {
            FlashKeys::Wgmma if head_dim == 128 && vec => entry::ATTN_FLASH_WGMMA,
            FlashKeys::Wgmma | FlashKeys::K64 if d128 => entry::ATTN_FLASH_D128,
            FlashKeys::Wgmma | FlashKeys::K64 => entry::ATTN_FLASH,
            FlashKeys::K32 if d128 => entry::ATTN_FLASH_K32_D128,
            FlashKeys::K32 => entry::ATTN_FLASH_K32,
        }
    }
}

/// Writes each row's `k`, `v` into the caches at its slot and position (`rows`), then attends
/// each row's query over its slot's keys `0..=pos`; `out [rows, heads * head_dim]`. Two
/// launches, or one where each row has a slot of its own (decode rows); the second is the
/// flash kernel (query tiles on tensor cores) for heads of up to [`FLASH_MAX_HEAD_DIM`]
/// channels, with the most keys a block of this GPU holds ([`FlashKeys::fitting`]), else the
/// row kernel. The row kernel splits each row's keys over blocks in a cache of more than
/// `MIN_SPLIT_KEYS` positions ([`split_keys`]), and a combine launch merges the parts.
pub fn attention(
    gpu: &Gpu,
    s: AttnShape,
    qkv: Qkv,
    k_cache: &mut CudaSlice<bf16>,
    v_cache: &mut CudaSlice<bf16>,
    rows: &AttnRows,
    out: &mut impl DevicePtrMut<bf16>,
) -> Result<()> {
    attention_with(gpu, s, qkv, (k_cache, v_cache), rows, FlashKeys::fitting(gpu), out)
}

/// [`attention`] with the flash kernel's keys given (None: the row kernel for prefill rows too).
pub fn attention_with(
    gpu: &Gpu,
    s: AttnShape,
    qkv: Qkv,
    (k_cache, v_cache): (&mut CudaSlice<bf16>, &mut CudaSlice<bf16>),
    rows: &AttnRows,
    flash_keys: Option<FlashKeys>,
    out: &mut impl DevicePtrMut<bf16>,
) -> Result<()> {
    let kn = entry::ATTN;
    let a = gpu.args(kn);
    let c = a.check();
    let n = rows.len();
    c.count("heads", 65535, s.heads)?;
    c.count("kv_heads", s.heads, s.kv_heads)?;
    c.that("kv_heads", s.heads.is_multiple_of(s.kv_heads), format!("a divisor of heads {}", s.heads), s.kv_heads)?;
    c.count("head_dim", MAX_HEAD_DIM as usize, s.head_dim)?;
    c.that("rows", rows.max_len == s.max_len, format!("rows checked against max_len {}", s.max_len), rows.max_len)?;
    let (qw, kw) = (s.heads * s.head_dim, s.kv_heads * s.head_dim);
    let (q, q_stride) = a.rows("q", &qkv.q, (n, qw))?;
    let (k, kv_stride) = a.rows("k", &qkv.k, (n, kw))?;
    let (v, v_stride) = a.rows("v", &qkv.v, (n, kw))?;
    c.that("v", v_stride == kv_stride, format!("the row stride of k, {kv_stride}"), format!("stride {v_stride}"))?;
    let cache = rows.num_slots.checked_mul(s.max_len).and_then(|v| v.checked_mul(kw));
    c.that("max_len", cache.is_some(), "a cache whose size fits in memory", s.max_len)?;
    let cache = Len::Exactly(cache.unwrap_or(usize::MAX));
    let p = AttnParams {
        q,
        k,
        v,
        q_stride,
        kv_stride,
        k_cache: a.output("k_cache", k_cache, cache)?,
        v_cache: a.output("v_cache", v_cache, cache)?,
        slot: a.input("slots", &rows.slot, Len::Any)?,
        pos: a.input("pos", &rows.pos, Len::Any)?,
        out: a.output("out", out, Len::Exactly(n * qw))?,
        rows: n as u32,
        heads: s.heads as u32,
        kv_heads: s.kv_heads as u32,
        head_dim: s.head_dim as u32,
        max_len: s.max_len as u32,
        scale: 1.0 / (s.head_dim as f32).sqrt(),
        own_rows: u32::from(rows.own),
        split_keys: 0,
        splits: 1,
        partial: std::ptr::null_mut(),
    };
    // Prefill rows take the flash kernel of the keys given where their heads fit it: its
    // arguments and grid checked before anything launches.
    let flash = match (&rows.tiles, flash_keys) {
        (Some(tiles), Some(keys)) if s.head_dim <= FLASH_MAX_HEAD_DIM as usize => {
            let aligned = |a: u64| a.is_multiple_of(16);
            let vec = s.head_dim.is_multiple_of(8)
                && q_stride.is_multiple_of(8)
                && [p.q as u64, p.k_cache as u64, p.v_cache as u64].into_iter().all(aligned);
            let kf = keys.kernel(s.head_dim, vec);
            let items = tiles.len().saturating_mul(s.heads);
            Check(kf.name()).count("query tiles x heads", i32::MAX as usize, items)?;
            let f = FlashParams {
                q: p.q,
                q_stride: p.q_stride,
                k_cache: p.k_cache,
                v_cache: p.v_cache,
                tiles: gpu.args(kf).input("tiles", tiles, Len::Any)?,
                out: p.out,
                heads: p.heads,
                kv_heads: p.kv_heads,
                head_dim: p.head_dim,
                max_len: p.max_len,
                scale: p.scale,
                vec: u32::from(vec),
                items: items as u32,
            };
            // The `wgmma` kernel's blocks (one an SM) loop over the items; the others take one each.
            let blocks = if kf.kernel == Kernel::AttnFlashWgmma { items.min(gpu.sms() as usize) } else { items };
            Some((kf, blocks as u32, f))
        }
        _ => None,
    };
    // SAFETY: every extent above is checked; the rows' slots and positions are in range of
    // these caches and distinct (AttnRows), so cache writes do not collide; the caches and out
    // are `&mut` (distinct from the inputs); the attention launch runs after the cache write
    // on the stream, or, each row in a slot of its own, reads no cache position it writes.
    unsafe {
        if !rows.own {
            gpu.launch(Grid::new(entry::ATTN_CACHE_WRITE, (n as u32, 1, 1)), p)?;
        }
        if let Some((kf, blocks, f)) = flash {
            return gpu.launch(Grid::new(kf, (blocks, 1, 1)), f);
        }
        // The row kernel, each row's keys in parts of split_keys (at most MAX_SPLITS).
        let keys = split_keys(p.max_len);
        let splits = p.max_len.div_ceil(keys);
        let (grid, smem) = ((n as u32, s.heads as u32, splits), smem_bytes(p.head_dim, keys));
        if splits == 1 {
            return gpu.launch(Grid::new(kn, grid).smem(smem), AttnParams { split_keys: keys, ..p });
        }
        // SAFETY (uninitialized): attn_bf16 writes every part's sum, and the rest of each part
        // that has keys, before the combine launch reads them (the rest only where the sum is
        // above 0).
        let mut parts = gpu.scratch::<f32>(n * s.heads * splits as usize * (s.head_dim + 2))?;
        let partial = a.output("partial", &mut *parts, Len::Any)?;
        let p = AttnParams { split_keys: keys, splits, partial, ..p };
        gpu.launch(Grid::new(kn, grid).smem(smem), p)?;
        gpu.launch(Grid::new(entry::ATTN_COMBINE, (n as u32, s.heads as u32, 1)), p)
    }
}
