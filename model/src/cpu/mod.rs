//! The CPU reference backend: every operation from the host crate's CPU references (f64
//! inside), outputs rounded to bf16 where the model's activations are bf16, SSM states kept in
//! f32, so the model runs without a GPU (slowly) with the dataflow of the GPU backend. Its
//! layers as the CUDA backend's: `linear.rs`, `mamba.rs`, `attention.rs`, `moe.rs`.

mod attention;
mod linear;
mod mamba;
mod moe;

use half::bf16;
use host::cpu::norm;
use host::sample::{RowSampling, check_row};
use kernels_gpu::sample::{SampleOut, SampleRow};

pub use self::attention::CpuAttention;
pub use self::linear::CpuWeight;
use self::linear::mlp_row;
pub use self::mamba::CpuMamba;
pub use self::moe::CpuExperts;
use crate::backend::{Backend, CacheSizes, In, MambaWeights, Norm, Out, StepRows, check_range, rows_f32};
use crate::config::{AttentionConfig, MambaConfig};
use crate::error::{Error, Result};
use crate::fp8::Fp8Linear;
use crate::layout::{self, Linear, Mlp};
use crate::nvfp4::Nvfp4Linear;

/// The CPU backend (buffers are `Vec`s). It runs steps of any size unless made with
/// [`Cpu::limited`].
#[derive(Clone, Copy, Debug)]
pub struct Cpu {
    max_rows: usize,
}

impl Default for Cpu {
    fn default() -> Cpu {
        Cpu { max_rows: usize::MAX }
    }
}

impl Cpu {
    /// A CPU backend that refuses steps of more than `max_rows` rows with
    /// [`Error::Capacity`], as a GPU backend out of memory for a large batch does: a stand-in
    /// for testing how callers recover.
    pub fn limited(max_rows: usize) -> Cpu {
        Cpu { max_rows }
    }
}

/// `rows` rows of `width` from `x`, as f64.
fn gather(x: &In<Vec<bf16>>, rows: usize, width: usize) -> Vec<f64> {
    (0..rows).flat_map(|r| x.buf[x.offset + r * x.stride..][..width].iter().map(|v| v.to_f64())).collect()
}

/// Writes `v` rounded to bf16 at the output.
fn put(y: Out<Vec<bf16>>, v: impl IntoIterator<Item = f64>) {
    for (i, x) in v.into_iter().enumerate() {
        y.buf[y.offset + i] = bf16::from_f64(x);
    }
}

/// Writes the rows that exist (pad rows have none) at their places, `width` apart.
fn put_rows(y: Out<Vec<bf16>>, rows: Vec<Option<Vec<f64>>>, width: usize) {
    for (r, row) in rows.into_iter().enumerate() {
        if let Some(row) = row {
            put(Out { buf: &mut *y.buf, offset: y.offset + r * width }, row);
        }
    }
}

/// `n` zeros, or an error where the host cannot hold them (never an abort).
fn zeroed<T: Clone + Default>(n: usize) -> Result<Vec<T>> {
    let mut v = Vec::new();
    v.try_reserve_exact(n).map_err(|e| {
        Error::Capacity(format!("{n} elements of {} bytes do not fit in host memory: {e}", std::mem::size_of::<T>()))
    })?;
    v.resize(n, T::default());
    Ok(v)
}

/// [`Backend::copy`] on the host.
fn copy_range<T: Copy>(src: &[T], from: usize, dst: &mut [T], to: usize, n: usize) -> Result<()> {
    check_range(src.len(), from, n, "reads past")?;
    check_range(dst.len(), to, n, "writes past")?;
    dst[to..to + n].copy_from_slice(&src[from..from + n]);
    Ok(())
}

/// A row's sampling settings, penalty pairs and mask, owned.
type CpuRow = (SampleRow, Vec<(u32, u32)>, Option<Vec<u32>>);

/// A step's sampling rows on the CPU, and what the last sampling picked.
pub struct CpuSampling {
    rows: Vec<CpuRow>,
    vocab: usize,
    out: Vec<SampleOut>,
}

impl Backend for Cpu {
    type Buf = Vec<bf16>;
    type Buf32 = Vec<f32>;
    type Weight = CpuWeight;
    type Experts = CpuExperts;
    type Mamba = CpuMamba;
    type Attention = CpuAttention;
    type Rows = StepRows;
    type Graph = ();
    type Sampling = CpuSampling;
    type Stamp = std::time::Instant;

    fn upload(&self, v: &[bf16]) -> Result<Vec<bf16>> {
        Ok(v.to_vec())
    }
    fn upload32(&self, v: &[f32]) -> Result<Vec<f32>> {
        Ok(v.to_vec())
    }
    fn zeros(&self, n: usize) -> Result<Vec<bf16>> {
        zeroed(n)
    }
    fn zeros32(&self, n: usize) -> Result<Vec<f32>> {
        zeroed(n)
    }
    fn scratch(&self, n: usize) -> Result<Vec<bf16>> {
        self.zeros(n)
    }
    fn download_rows(&self, b: &Vec<bf16>, width: usize) -> Result<Vec<Vec<f32>>> {
        Ok(rows_f32(b, width))
    }
    fn copy(&self, src: &Vec<bf16>, from: usize, dst: &mut Vec<bf16>, to: usize, n: usize) -> Result<()> {
        copy_range(src, from, dst, to, n)
    }
    fn copy32(&self, src: &Vec<f32>, from: usize, dst: &mut Vec<f32>, to: usize, n: usize) -> Result<()> {
        copy_range(src, from, dst, to, n)
    }

    fn weight(&self, l: &Linear) -> Result<CpuWeight> {
        if l.bias.is_some() {
            return Err(Error::Unsupported(format!(
                "`{}`: the CPU backend handles linear layers without bias",
                l.weight.name
            )));
        }
        if let Some(f) = Fp8Linear::new(l)? {
            return Ok(CpuWeight::Fp8(f));
        }
        if let Some(f) = Nvfp4Linear::new(l)? {
            return Ok(CpuWeight::Nvfp4(f));
        }
        let [n, k] = l.shape();
        Ok(CpuWeight::Bf16 { w: l.to_bf16()?, n, k })
    }

    fn experts(&self, list: &[Mlp], shared: Option<&Mlp>) -> Result<CpuExperts> {
        let mlp = |m| crate::model::mlp(self, m);
        Ok(CpuExperts { routed: list.iter().map(mlp).collect::<Result<_>>()?, shared: shared.map(mlp).transpose()? })
    }

    fn mamba(&self, c: &MambaConfig, eps: f32, m: &layout::Mamba, sizes: &CacheSizes) -> Result<CpuMamba> {
        MambaWeights::upload(self, c, eps, m, sizes)
    }

    fn attention(&self, c: &AttentionConfig, a: &layout::Attention, sizes: &CacheSizes) -> Result<CpuAttention> {
        Ok(CpuAttention {
            c: c.clone(),
            q: self.weight(&a.q)?,
            k: self.weight(&a.k)?,
            v: self.weight(&a.v)?,
            o: self.weight(&a.o)?,
            k_cache: self.zeros(sizes.kv)?,
            v_cache: self.zeros(sizes.kv)?,
            max_len: sizes.max_len,
        })
    }

    fn rows(&self, rows: &StepRows, _slots: usize, _max_len: usize) -> Result<StepRows> {
        if rows.tokens.len() > self.max_rows {
            return Err(Error::Capacity(format!(
                "a step of {} tokens does not fit (this backend takes {})",
                rows.tokens.len(),
                self.max_rows
            )));
        }
        Ok(rows.clone())
    }

    fn set_rows(&self, into: &mut StepRows, rows: &StepRows) -> Result<()> {
        *into = self.rows(rows, 0, 0)?;
        Ok(())
    }

    fn record(&self, _decode: usize, f: &mut dyn FnMut() -> Result<()>) -> Result<Option<()>> {
        f().map(|()| None)
    }

    fn replay(&self, _graph: &()) -> Result<()> {
        Ok(())
    }

    fn sampling(&self, rows: &[RowSampling], vocab: usize, _capacity: usize) -> Result<CpuSampling> {
        let mut s = CpuSampling { rows: Vec::new(), vocab, out: Vec::new() };
        self.set_sampling(&mut s, rows)?;
        Ok(s)
    }

    fn set_sampling(&self, into: &mut CpuSampling, rows: &[RowSampling]) -> Result<()> {
        for r in rows {
            check_row(r, into.vocab)?;
        }
        into.rows = rows.iter().map(|r| (r.row, r.penalties.to_vec(), r.mask.map(<[u32]>::to_vec))).collect();
        Ok(())
    }

    fn sampling_fits(&self, _s: &CpuSampling, _rows: &[RowSampling]) -> bool {
        true
    }

    fn sample(&self, logits: &Vec<bf16>, vocab: usize, s: &mut CpuSampling) -> Result<()> {
        let rows = rows_f32(&logits[..s.rows.len() * vocab], vocab);
        s.out = (rows.iter().zip(&s.rows))
            .map(|(x, (r, p, m))| host::cpu::sample::sample_row(x, r, p, m.as_deref()))
            .collect();
        Ok(())
    }

    fn sampled(&self, s: &CpuSampling) -> Result<Vec<SampleOut>> {
        Ok(s.out.clone())
    }

    /// The host clock: each operation has run when its call returns.
    fn stamp(&self) -> Result<std::time::Instant> {
        Ok(std::time::Instant::now())
    }

    fn ms_between(&self, from: &std::time::Instant, to: &std::time::Instant) -> Result<f64> {
        Ok(to.saturating_duration_since(*from).as_secs_f64() * 1e3)
    }

    fn embed(&self, table: &Vec<bf16>, width: usize, rows: &StepRows, out: Out<Vec<bf16>>) -> Result<()> {
        let vocab = table.len() / width;
        for (i, &t) in rows.tokens.iter().enumerate() {
            if t as usize >= vocab {
                return Err(Error::Unsupported(format!("token id {t} is outside the vocabulary of {vocab}")));
            }
            out.buf[out.offset + i * width..][..width].copy_from_slice(&table[t as usize * width..][..width]);
        }
        Ok(())
    }

    fn last_rows(&self, x: &Vec<bf16>, width: usize, rows: &StepRows, out: Out<Vec<bf16>>) -> Result<()> {
        for (i, &r) in rows.last.iter().enumerate() {
            out.buf[out.offset + i * width..][..width].copy_from_slice(&x[r as usize * width..][..width]);
        }
        Ok(())
    }

    fn rms_norm(&self, x: In<Vec<bf16>>, n: Norm<Vec<bf16>>, rows: usize, y: Out<Vec<bf16>>) -> Result<()> {
        put(y, norm::rms_norm(&gather(&x, rows, n.width), n.w, n.width, f64::from(n.eps)));
        Ok(())
    }

    fn linear(&self, x: In<Vec<bf16>>, rows: usize, w: &CpuWeight, y: Out<Vec<bf16>>) -> Result<()> {
        let k = w.k();
        let xs: Vec<bf16> = (0..rows).flat_map(|r| x.buf[x.offset + r * x.stride..][..k].iter().copied()).collect();
        put(y, w.apply(&xs, rows));
        Ok(())
    }

    fn add_rms_norm(
        &self,
        h: &mut Vec<bf16>,
        x: &Vec<bf16>,
        norm: Norm<Vec<bf16>>,
        rows: usize,
        y: Out<Vec<bf16>>,
    ) -> Result<()> {
        let n = rows * norm.width;
        h[..n].iter_mut().zip(&x[..n]).for_each(|(a, b)| *a = bf16::from_f32(a.to_f32() + b.to_f32()));
        self.rms_norm(In::rows(h, norm.width), norm, rows, y)
    }

    fn mlp(&self, x: In<Vec<bf16>>, rows: usize, up: &CpuWeight, down: &CpuWeight, y: Out<Vec<bf16>>) -> Result<()> {
        let k = up.k();
        let out = (0..rows).flat_map(|r| mlp_row((up, down), &x.buf[x.offset + r * x.stride..][..k]));
        put(y, out);
        Ok(())
    }
}
