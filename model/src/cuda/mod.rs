//! The CUDA backend: each operation through the host crate's kernels and cuBLASLt (bf16 linear
//! layers of more than one row).
//!
//! MoE layers route and run their experts on the device: up to [`CHOICES_MAX_ROWS`] rows of
//! bf16 experts per routing choice (no dispatch; down projections and combining in one
//! launch), else dispatched: up to [`EXPERT_KERNEL_MAX_ROWS`] rows through the expert kernel
//! (no synchronization), past it through the grouped GEMM on tensor cores (one launch a
//! projection, no synchronization; on `wgmma` where the GPU has it), or, on GPUs without
//! `wgmma` past [`GROUPED_MAX_ROWS`], through per-expert cuBLASLt GEMMs (one synchronization
//! to read the expert offsets).
//!
//! FP8 (W8A8) linear layers and experts keep their e4m3 codes on the device and run through
//! the FP8 gemv kernels (up to [`FP8_GEMV_MAX_ROWS`] rows) and, at one row, the per-choice
//! expert kernels (the same row-dot code, an expert per choice), which quantize each input row
//! with the checkpoint's `input_scale` (or per token without one) before the product; at more
//! rows (experts: past [`FP8_EXPERT_KERNEL_MAX_ROWS`]), the rows are quantized the same way
//! into codes first and multiplied on tensor cores (the FP8 GEMM and grouped GEMM).
//!
//! A step's rows (tokens, slots, positions, prefill sequences) are checked and uploaded once
//! per step ([`CudaRows`]). Steps of decode rows only, up to [`GRAPH_MAX_ROWS`] of them (no
//! operation synchronizes at so few rows), are recorded into a CUDA graph once per row count
//! and replayed after that, with the new rows copied over the recorded ones; the graph's
//! temporaries are ranges of the Gpu's capture arena (`Gpu::scratch`; allocations inside the
//! capture past it). The prefill scan's plan (its chunk table and workspaces) is built once a
//! step, by its first Mamba layer, and kept with the step's rows for the others.
//!
//! The backend composes one object a layer kind, each built at load from the layout and owning
//! its device weights, its slots' states and its choice of kernels, each in its module:
//! `linear` ([`CudaWeight`]: a linear layer's weight and its kernel by rows; a dense MLP is two
//! of them), `moe` ([`CudaExperts`]: the routed and shared experts and the row thresholds
//! above), `mamba` ([`CudaMamba`]: the mixer's weights and conv and SSM states; the decode rows
//! in one launch up to [`FUSED_MAMBA_ROWS`] rows, else three; the prefill conv and chunked
//! scan), `attention` ([`CudaAttention`]: q, k and v as one weight where they are bf16 without
//! bias, the KV caches, the attention launch); `rows` holds a step's [`CudaRows`]. This file
//! holds the buffers, the norms between the layers, embedding, sampling and graphs, and hands
//! each layer operation to its layer's object.

mod attention;
mod linear;
mod mamba;
mod moe;
mod rows;

use std::sync::Arc;

use half::bf16;
use host::norm::{NormShape, add_rms_norm, rms_norm};

use host::sample::{RowSampling, SampleRows, read_out, sample_out};
use host::{Buffer, CudaSlice, CudaViewMut, DeviceRepr, Gpu, Graph, Rows, Stamp, UPLOAD_STAGE_BYTES};

use kernels_gpu::sample::SampleOut;

use crate::backend::{Backend, CacheSizes, In, Norm, Out, StepRows, check_range, rows_f32};
use crate::config::{AttentionConfig, MambaConfig};
use crate::error::{Error, Result};
use crate::layout::{self, Linear, Mlp};
use linear::mlp_rows;

pub use attention::CudaAttention;
pub use linear::{CudaWeight, FP8_GEMV_MAX_ROWS, SPLIT_MIN_K};
pub use mamba::{CudaMamba, FUSED_MAMBA_ROWS};
pub use moe::{
    CHOICES_MAX_ROWS, CudaExperts, EXPERT_KERNEL_MAX_ROWS, FP8_EXPERT_KERNEL_MAX_ROWS, GROUPED_MAX_ROWS,
    NVFP4_EXPERT_KERNEL_MAX_ROWS, NVFP4_NARROW_MAX_ROWS, SHARED_PIECES_MAX_ROWS,
};
pub use rows::CudaRows;

/// Most decode rows of a step recorded as a CUDA graph (and replayed): every operation of a
/// step of up to [`GROUPED_MAX_ROWS`] rows runs without synchronizing, and the engine's
/// batches go up to 64.
pub const GRAPH_MAX_ROWS: usize = 64;

/// The CUDA backend on one GPU.
pub struct Cuda {
    gpu: Arc<Gpu>,
    graphs: bool,
}

impl Cuda {
    /// Opens device `ordinal` (a clear error without a driver or GPU).
    pub fn new(ordinal: usize) -> Result<Cuda> {
        Ok(Cuda::on(Arc::new(Gpu::new(ordinal)?)))
    }

    /// The backend on an opened device, shared with other users of its stream.
    pub fn on(gpu: Arc<Gpu>) -> Cuda {
        Cuda { gpu, graphs: true }
    }

    /// Whether decode steps are recorded into CUDA graphs (the default) or every step's
    /// operations are launched one by one.
    pub fn with_graphs(self, graphs: bool) -> Cuda {
        Cuda { graphs, ..self }
    }

    /// The device.
    pub fn gpu(&self) -> &Gpu {
        &self.gpu
    }

    /// [`Backend::copy`] on the device's stream.
    fn copy_range<T: DeviceRepr>(
        &self,
        src: &CudaSlice<T>,
        from: usize,
        dst: &mut CudaSlice<T>,
        to: usize,
        n: usize,
    ) -> Result<()> {
        check_range(src.len(), from, n, "reads past")?;
        check_range(dst.len(), to, n, "writes past")?;
        if n > 0 {
            self.gpu.copy(&src.slice(from..from + n), &mut dst.slice_mut(to..to + n))?;
        }
        Ok(())
    }
}

/// A step's sampling rows on the device and where the kernel writes their tokens.
pub struct CudaSampling {
    rows: SampleRows,
    out: CudaSlice<u32>,
}

/// `rows` rows of `width` of an [`In`].
fn rows_of<'a>(x: &In<'a, Buffer<bf16>>, rows: usize, width: usize) -> Rows<'a> {
    Rows { buf: x.buf, offset: x.offset, rows, width, stride: x.stride }
}

/// The output region of an [`Out`] of `len` elements.
fn view_mut<'a>(y: Out<'a, Buffer<bf16>>, len: usize) -> Result<CudaViewMut<'a, bf16>> {
    let end = y.offset + len;
    if end > y.buf.len() {
        return Err(Error::Unsupported(format!("output region {}..{end} past a buffer of {}", y.offset, y.buf.len())));
    }
    Ok(y.buf.slice_mut(y.offset..end))
}

fn unsupported(what: &str) -> Error {
    Error::Unsupported(format!("the CUDA backend has no {what} yet"))
}

impl Backend for Cuda {
    type Buf = Buffer<bf16>;
    type Buf32 = CudaSlice<f32>;
    type Weight = CudaWeight;
    type Experts = CudaExperts;
    type Mamba = CudaMamba;
    type Attention = CudaAttention;
    type Rows = CudaRows;
    type Graph = Graph;
    type Sampling = CudaSampling;
    type Stamp = Stamp;

    fn upload(&self, v: &[bf16]) -> Result<Buffer<bf16>> {
        if std::mem::size_of_val(v) < UPLOAD_STAGE_BYTES {
            return Ok(self.gpu.upload(v)?.into());
        }
        // SAFETY: the copy below writes every element, in stream order before any use.
        let mut b = unsafe { self.gpu.uninit::<bf16>(v.len()) }?;
        self.gpu.upload_bytes_into(bytemuck::cast_slice(v), &mut b.as_view_mut())?;
        Ok(b.into())
    }
    fn upload32(&self, v: &[f32]) -> Result<CudaSlice<f32>> {
        Ok(self.gpu.upload(v)?)
    }
    fn zeros(&self, n: usize) -> Result<Buffer<bf16>> {
        Ok(self.gpu.zeros(n.max(1))?.into())
    }
    fn zeros32(&self, n: usize) -> Result<CudaSlice<f32>> {
        Ok(self.gpu.zeros(n.max(1))?)
    }
    fn scratch(&self, n: usize) -> Result<Buffer<bf16>> {
        // SAFETY: unwritten device memory holds arbitrary bf16 values, not undefined
        // behaviour: no kernel indexes memory with activation values (routing ranks NaN last
        // and traps on an empty pick). The model writes these buffers before reading them;
        // one taken while recording lives only as long as the step it serves (Gpu::scratch).
        Ok(unsafe { self.gpu.scratch(n.max(1)) }?)
    }
    fn download_rows(&self, b: &Buffer<bf16>, width: usize) -> Result<Vec<Vec<f32>>> {
        Ok(self.gpu.download_with(b, |v| rows_f32(v, width))?)
    }
    fn copy(&self, src: &Buffer<bf16>, from: usize, dst: &mut Buffer<bf16>, to: usize, n: usize) -> Result<()> {
        self.copy_range(src, from, dst, to, n)
    }
    fn copy32(&self, src: &CudaSlice<f32>, from: usize, dst: &mut CudaSlice<f32>, to: usize, n: usize) -> Result<()> {
        self.copy_range(src, from, dst, to, n)
    }

    fn weight(&self, l: &Linear) -> Result<CudaWeight> {
        CudaWeight::upload(&self.gpu, l)
    }

    fn experts(&self, list: &[Mlp], shared: Option<&Mlp>) -> Result<CudaExperts> {
        CudaExperts::upload(&self.gpu, list, shared)
    }

    fn mamba(&self, c: &MambaConfig, eps: f32, m: &layout::Mamba, sizes: &CacheSizes) -> Result<CudaMamba> {
        CudaMamba::upload(self, c, eps, m, sizes)
    }

    fn attention(&self, c: &AttentionConfig, a: &layout::Attention, sizes: &CacheSizes) -> Result<CudaAttention> {
        CudaAttention::upload(self, c, a, sizes)
    }

    fn rows(&self, r: &StepRows, slots: usize, max_len: usize) -> Result<CudaRows> {
        CudaRows::new(&self.gpu, r, slots, max_len)
    }

    fn set_rows(&self, into: &mut CudaRows, r: &StepRows) -> Result<()> {
        into.set(&self.gpu, r)
    }

    fn record(&self, decode: usize, f: &mut dyn FnMut() -> Result<()>) -> Result<Option<Graph>> {
        if !self.graphs || decode > GRAPH_MAX_ROWS {
            return f().map(|()| None);
        }
        self.gpu.capture(f).map(Some)
    }

    fn replay(&self, graph: &Graph) -> Result<()> {
        Ok(graph.replay()?)
    }

    fn sampling(&self, rows: &[RowSampling], vocab: usize, capacity: usize) -> Result<CudaSampling> {
        let g = &self.gpu;
        Ok(CudaSampling { rows: SampleRows::new(g, rows, vocab, capacity)?, out: sample_out(g, rows.len())? })
    }

    fn set_sampling(&self, into: &mut CudaSampling, rows: &[RowSampling]) -> Result<()> {
        Ok(into.rows.set(&self.gpu, rows)?)
    }

    fn sampling_fits(&self, s: &CudaSampling, rows: &[RowSampling]) -> bool {
        let masks_fit = s.rows.has_masks() || rows.iter().all(|r| r.mask.is_none());
        masks_fit && rows.iter().map(|r| r.penalties.len()).sum::<usize>() <= s.rows.capacity()
    }

    fn sample(&self, logits: &Buffer<bf16>, vocab: usize, s: &mut CudaSampling) -> Result<()> {
        Ok(host::sample::sample(&self.gpu, Rows::new(logits, s.rows.len(), vocab), &s.rows, &mut s.out)?)
    }

    fn sampled(&self, s: &CudaSampling) -> Result<Vec<SampleOut>> {
        let mut out = read_out(&self.gpu.download(&s.out)?);
        out.truncate(s.rows.len());
        Ok(out)
    }

    fn stamp(&self) -> Result<Stamp> {
        Ok(self.gpu.stamp()?)
    }

    fn ms_between(&self, from: &Stamp, to: &Stamp) -> Result<f64> {
        Ok(f64::from(to.ms_since(from)?))
    }

    fn embed(&self, table: &Buffer<bf16>, width: usize, rows: &CudaRows, out: Out<Buffer<bf16>>) -> Result<()> {
        let mut y = view_mut(out, rows.tokens.len() * width)?;
        Ok(host::act::gather_by(&self.gpu, table, width, &rows.tokens, &mut y)?)
    }

    fn last_rows(&self, x: &Buffer<bf16>, width: usize, rows: &CudaRows, out: Out<Buffer<bf16>>) -> Result<()> {
        let mut y = view_mut(out, rows.last.len() * width)?;
        Ok(host::act::gather_by(&self.gpu, x, width, &rows.last, &mut y)?)
    }

    fn rms_norm(&self, x: In<Buffer<bf16>>, n: Norm<Buffer<bf16>>, rows: usize, y: Out<Buffer<bf16>>) -> Result<()> {
        let mut y = view_mut(y, rows * n.width)?;
        let shape = NormShape::new(rows, n.width, 1, n.eps);
        Ok(rms_norm(&self.gpu, shape, rows_of(&x, rows, n.width), n.w, &mut y)?)
    }

    fn linear(&self, x: In<Buffer<bf16>>, rows: usize, w: &CudaWeight, y: Out<Buffer<bf16>>) -> Result<()> {
        if x.stride != w.k {
            return Err(unsupported("strided linear inputs"));
        }
        let xv = x.buf.slice(x.offset..x.offset + rows * w.k);
        let mut y = view_mut(y, rows * w.n)?;
        w.forward(&self.gpu, &xv, rows, false, &mut y)
    }

    fn add_rms_norm(
        &self,
        h: &mut Buffer<bf16>,
        x: &Buffer<bf16>,
        norm: Norm<Buffer<bf16>>,
        rows: usize,
        y: Out<Buffer<bf16>>,
    ) -> Result<()> {
        let n = rows * norm.width;
        let mut y = view_mut(y, n)?;
        let shape = NormShape::new(rows, norm.width, 1, norm.eps);
        Ok(add_rms_norm(&self.gpu, shape, &mut h.slice_mut(..n), &x.slice(..n), norm.w, &mut y)?)
    }

    fn mlp(
        &self,
        x: In<Buffer<bf16>>,
        rows: usize,
        up: &CudaWeight,
        down: &CudaWeight,
        y: Out<Buffer<bf16>>,
    ) -> Result<()> {
        if x.stride != up.k {
            return Err(unsupported("strided MLP inputs"));
        }
        let xv = x.buf.slice(x.offset..x.offset + rows * up.k);
        let mut y = view_mut(y, rows * down.n)?;
        mlp_rows(&self.gpu, &xv, rows, (up, down), &mut y)
    }
}
