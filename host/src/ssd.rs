//! Launcher of the chunked scan (kernels-gpu/src/ssd.rs; reference: cpu/ssd.rs).

use cudarc::driver::{CudaSlice, DevicePtrMut};
use half::bf16;
use kernels_gpu::ssd::{
    SSD_CHUNK, SSD_MAX_HEAD_DIM, SSD_MAX_STATE, SSD_PASS_BLOCK, SSD_PASS_PER_THREAD, SsdChunk, SsdParams,
    SsdPassParams, chunk_state_smem_bytes, scan_smem_bytes,
};
use kernels_gpu::{Kernel, KernelParams, entry};

use crate::args::{Elem, Len};
use crate::batch::Prefill;
use crate::check::Check;
use crate::error::Result;
use crate::gpu::{Gpu, Grid};
use crate::ssm::{SsmHeads, SsmInputs, SsmShape, StateDtype};

/// The chunks of a prefill batch (SSD_CHUNK tokens, never spanning two sequences) and the
/// workspaces of one scan over it. Build once per batch shape; reusable across layers.
pub struct SsdPlan {
    chunks: CudaSlice<SsdChunkRepr>,
    seq_chunks: CudaSlice<u32>,
    delta: CudaSlice<f32>,
    acum: CudaSlice<f32>,
    states: CudaSlice<f32>,
    starts: CudaSlice<u16>,
    cb: CudaSlice<f32>,
    nchunks: usize,
    tokens: usize,
    lens: Vec<usize>,
    shape: (usize, usize, usize, usize),
}

/// The chunk table of sequences of `lens` tokens: (chunks, first chunk of each sequence).
pub fn chunk_table(lens: &[usize]) -> (Vec<SsdChunk>, Vec<u32>) {
    let (mut chunks, mut first) = (Vec::new(), vec![0u32]);
    let mut start = 0;
    for (s, &len) in lens.iter().enumerate() {
        for c0 in (0..len).step_by(SSD_CHUNK as usize) {
            let l = (len - c0).min(SSD_CHUNK as usize);
            chunks.push(SsdChunk { seq: s as u32, start: (start + c0) as u32, len: l as u32, _pad: 0 });
        }
        first.push(chunks.len() as u32);
        start += len;
    }
    (chunks, first)
}

// SAFETY: #[repr(C)] plain integers; any bit pattern is a valid value.
unsafe impl cudarc::driver::DeviceRepr for SsdChunkRepr {}

impl Elem for SsdChunkRepr {
    type Raw = SsdChunk;
}

/// SsdChunk as cudarc sees it (kernels-gpu cannot implement cudarc's trait).
#[repr(transparent)]
#[derive(Clone, Copy)]
struct SsdChunkRepr(SsdChunk);

impl SsdPlan {
    /// Plans a scan over `seqs` for the heads, states and groups of `shape`.
    pub fn new(gpu: &Gpu, seqs: &Prefill, shape: SsmShape) -> Result<SsdPlan> {
        let (heads, head_dim, state_size, groups) = (shape.heads, shape.head_dim, shape.state_size, shape.groups);
        let c = Check(Kernel::SsdScan.name());
        c.count("head_dim", SSD_MAX_HEAD_DIM as usize, head_dim)?;
        c.count("state_size", SSD_MAX_STATE as usize, state_size)?;
        let (chunks, first) = chunk_table(&seqs.lens);
        let n = chunks.len();
        let repr: Vec<SsdChunkRepr> = chunks.iter().map(|&c| SsdChunkRepr(c)).collect();
        Ok(SsdPlan {
            chunks: gpu.upload(&repr)?,
            seq_chunks: gpu.upload(&first)?,
            delta: gpu.zeros(n * heads * SSD_CHUNK as usize)?,
            acum: gpu.zeros(n * heads * SSD_CHUNK as usize)?,
            states: gpu.zeros(n * heads * head_dim * state_size)?,
            starts: gpu.zeros(n * heads * head_dim * state_size)?,
            cb: gpu.zeros(n * groups * 64 * 256)?,
            nchunks: n,
            tokens: seqs.tokens(),
            lens: seqs.lens.clone(),
            shape: (heads, head_dim, state_size, groups),
        })
    }

    /// Chunks in the plan.
    pub fn nchunks(&self) -> usize {
        self.nchunks
    }

    /// Whether the plan serves a scan over `seqs` for `shape` (built for them): every layer of
    /// a step's prefill can then run on one plan, its workspaces written before they are read by
    /// each scan.
    pub fn fits(&self, seqs: &Prefill, shape: SsmShape) -> bool {
        self.lens == seqs.lens && self.shape == (shape.heads, shape.head_dim, shape.state_size, shape.groups)
    }
}

/// Chunked scan (kernels-gpu/src/ssd.rs has the math) over the sequences of `seqs`: writes
/// `y [tokens, heads * head_dim]` and each sequence's final state to its slot in `state` (read
/// first where it has an initial state; pad sequences start from zero and write nothing).
/// Three launches.
pub fn ssd_scan<T: StateDtype>(
    gpu: &Gpu,
    shape: SsmShape,
    (inputs, heads): (SsmInputs, SsmHeads),
    (state, seqs): (&mut CudaSlice<T>, &Prefill),
    plan: &mut SsdPlan,
    y: &mut impl DevicePtrMut<bf16>,
) -> Result<()>
where
    SsdPassParams<T::Raw>: KernelParams,
{
    let k = entry::SSD_SCAN;
    let args = gpu.args(k);
    let c = args.check();
    shape.check(T::PASS.kernel, &heads, state.len(), seqs.num_slots())?;
    c.that("plan", plan.lens == seqs.lens, "a plan built for this batch", "a plan of another batch")?;
    let planned = (shape.heads, shape.head_dim, shape.state_size, shape.groups);
    c.that("plan", plan.shape == planned, format!("a plan for {planned:?}"), format!("{:?}", plan.shape))?;
    c.count("sequences", 65535, seqs.nseq())?;
    let (tokens, w, gn) = (plan.tokens, shape.width(), shape.groups * shape.state_size);
    let ((x, x_stride), (b, b_stride), (cc, c_stride), (dt, dt_stride)) = (
        args.rows("x", &inputs.x, (tokens, w))?,
        args.rows("b", &inputs.b, (tokens, gn))?,
        args.rows("c", &inputs.c, (tokens, gn))?,
        args.rows("dt", &inputs.dt, (tokens, shape.heads))?,
    );
    // 16-byte staging: every row of x, B and C starts aligned, whole 8-element groups.
    let aligned = |a: *const u16, stride: u32| (a as usize).is_multiple_of(16) && stride.is_multiple_of(8);
    let vec = aligned(x, x_stride)
        && aligned(b, b_stride)
        && aligned(cc, c_stride)
        && shape.head_dim.is_multiple_of(8)
        && shape.state_size.is_multiple_of(8);
    let (dt_bias, a, d) = heads.args(&args, shape.heads)?;
    // The plan's workspaces and tables were sized for its chunks and shape when it was built
    // (SsdPlan::new), which the checks above tie to this batch and shape.
    let p = SsdParams {
        x,
        dt,
        b,
        c: cc,
        dt_bias,
        a,
        d,
        chunks: args.input("plan", &plan.chunks, Len::Any)?,
        delta: args.output("plan", &mut plan.delta, Len::Any)?,
        acum: args.output("plan", &mut plan.acum, Len::Any)?,
        states: args.output("plan", &mut plan.states, Len::Any)?,
        starts: args.output("plan", &mut plan.starts, Len::Any)?,
        cb: args.output("plan", &mut plan.cb, Len::Any)?,
        y: args.output("y", y, Len::Exactly(tokens * w))?,
        nchunks: plan.nchunks as u32,
        geo: shape.geometry(),
        x_stride,
        dt_stride,
        b_stride,
        c_stride,
        vec: u32::from(vec),
    };
    let pass = gpu.args(T::PASS);
    let q = SsdPassParams::<T::Raw> {
        base: p,
        state: pass.output("state", state, Len::Any)?,
        cache_index: pass.input("seqs", &seqs.slots, Len::Any)?,
        has_initial: pass.input("seqs", &seqs.has_initial, Len::Any)?,
        seq_chunks: pass.input("plan", &plan.seq_chunks, Len::Any)?,
        nseq: seqs.nseq() as u32,
    };
    let (nc, h) = (plan.nchunks as u32, shape.heads as u32);
    let (hd, n) = (shape.head_dim as u32, shape.state_size as u32);
    let hn_blocks = (hd * n).div_ceil(SSD_PASS_BLOCK * SSD_PASS_PER_THREAD);
    // SAFETY: `check`, `Args::rows` and the plan checks proved every input covers the batch's
    // tokens, the per-head arrays `heads`, the cache `num_slots` slots and the workspaces the
    // plan's chunks (cb: chunks x groups score tiles; the plan's shape is this one); the chunk
    // table comes from the same lengths as Prefill's cu_seqlens, so chunks lie inside their
    // sequences; Prefill's slots are PAD_SLOT or distinct in range;
    // head_dim, state_size are within the kernels' limits (SsdPlan::new); launches are
    // ordered on the stream; `vec` only where every staged row is 16-byte aligned (the
    // workspaces' rows are whole 8-element groups then too); grids, blocks and shared memory
    // as each kernel documents.
    unsafe {
        let state_grid = (nc, h + shape.groups as u32, 1);
        gpu.launch(Grid::new(entry::SSD_CHUNK_STATE, state_grid).smem(chunk_state_smem_bytes(hd, n)), p)?;
        gpu.launch(Grid::new(T::PASS, (hn_blocks, h, seqs.nseq() as u32)), q)?;
        gpu.launch(Grid::new(k, (nc, h, 1)).smem(scan_smem_bytes(hd, n)), p)
    }
}
