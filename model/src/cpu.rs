//! The CPU reference backend: every operation from the host crate's CPU references (f64
//! inside), outputs rounded to bf16 where the model's activations are bf16, SSM states kept in
//! f32, so the model runs without a GPU (slowly) with the dataflow of the GPU backend.

use half::bf16;
use host::cpu::conv1d::ConvRef;
use host::cpu::router::{Routing, route};
use host::cpu::ssm::{SsmRef, Token};
use host::cpu::{attn, gemm, norm};
use host::sample::{RowSampling, check_row};
use kernels_gpu::sample::{SampleOut, SampleRow};

use crate::backend::{
    Backend, CacheSizes, In, MambaWeights, MoeWeights, Norm, Out, QkvBufs, QkvRows, StepRows, check_range, project,
    rows_f32,
};
use crate::config::{AttentionConfig, MambaConfig, MoeConfig};
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

/// A linear layer's weight `[n, k]`: bf16, FP8 (W8A8), or NVFP4 (weight-only, exact).
#[derive(Clone)]
pub enum CpuWeight {
    Bf16 { w: Vec<bf16>, n: usize, k: usize },
    Fp8(Fp8Linear),
    Nvfp4(Nvfp4Linear),
}

impl CpuWeight {
    fn k(&self) -> usize {
        match self {
            CpuWeight::Bf16 { k, .. } => *k,
            CpuWeight::Fp8(f) => f.k,
            CpuWeight::Nvfp4(f) => f.k,
        }
    }

    /// `rows` rows of `xs` (contiguous, `k` each) times the weight, unrounded.
    fn apply(&self, xs: &[bf16], rows: usize) -> Vec<f64> {
        match self {
            CpuWeight::Bf16 { w, n, k } => gemm::linear(xs, w, rows, *n, *k),
            CpuWeight::Fp8(f) => {
                xs.chunks_exact(f.k).flat_map(|r| f.apply(&r.iter().map(|v| v.to_f32()).collect::<Vec<_>>())).collect()
            }
            CpuWeight::Nvfp4(f) => {
                xs.chunks_exact(f.k).flat_map(|r| f.apply(&r.iter().map(|v| v.to_f64()).collect::<Vec<_>>())).collect()
            }
        }
    }
}

/// `rows` rows of `width` from `x`, as f64.
fn gather(x: &In<Vec<bf16>>, rows: usize, width: usize) -> Vec<f64> {
    (0..rows).flat_map(|r| x.buf[x.offset + r * x.stride..][..width].iter().map(|v| v.to_f64())).collect()
}

/// A dense MLP (or expert) on one row: bf16 up projection, relu^2 in bf16, down (unrounded).
fn mlp_row((up, down): (&CpuWeight, &CpuWeight), xr: &[bf16]) -> Vec<f64> {
    let h: Vec<bf16> =
        up.apply(xr, 1).into_iter().map(|v| bf16::from_f32(bf16::from_f64(v).to_f32().max(0.0).powi(2))).collect();
    down.apply(&h, 1)
}

/// Each of `rows` rows of `x`: its routed experts and their weights, as MoE layer `w` routes.
fn routed(c: &MoeConfig, x: In<Vec<bf16>>, rows: usize, w: &MoeWeights<Cpu>) -> Vec<Vec<(usize, f64)>> {
    let hidden = w.gate.len() / c.experts;
    let routing = Routing {
        top_k: c.top_k,
        n_group: c.n_group,
        topk_group: c.topk_group,
        norm_topk_prob: c.norm_topk_prob,
        scaling: f64::from(c.routed_scaling_factor),
    };
    let bias: Vec<f64> = w.score_bias.iter().map(|&v| f64::from(v)).collect();
    (0..rows)
        .map(|r| {
            let xr = &x.buf[x.offset + r * x.stride..][..hidden];
            route(&gemm::linear(xr, &w.gate, 1, c.experts, hidden), &bias, &routing)
        })
        .collect()
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

fn ssm_ref<'a>(c: &MambaConfig, heads: (&'a Vec<f32>, &'a Vec<f32>, &'a Vec<f32>)) -> SsmRef<'a> {
    SsmRef {
        heads: c.heads,
        head_dim: c.head_dim,
        groups: c.groups,
        state_size: c.state_size,
        dt_bias: heads.0,
        a: heads.1,
        d: Some(heads.2),
        dt_min: f64::from(c.dt_limit.0),
        dt_max: f64::from(c.dt_limit.1),
    }
}

/// The conv of a Mamba mixer of `c` (weights `w`, `bias`) as its reference takes it.
fn conv_ref<'a>(c: &MambaConfig, w: &'a [bf16], bias: Option<&'a Vec<bf16>>) -> ConvRef<'a> {
    ConvRef { dim: c.conv_dim(), k: c.conv_kernel, w, bias: bias.map(|b| &b[..]) }
}

/// Row `row`'s SSM inputs: x, B and C of the conv output rows `xbc`, dt of in_proj's.
fn token<'a>(c: &MambaConfig, xbc: &In<'a, Vec<bf16>>, dt: &In<'a, Vec<bf16>>, row: usize) -> Token<'a, bf16> {
    let (inner, gn) = (c.inner(), c.groups * c.state_size);
    let xr = &xbc.buf[xbc.offset + row * xbc.stride..][..inner + 2 * gn];
    Token::of_xbc(xr, &dt.buf[dt.offset + row * dt.stride..][..c.heads], (inner, gn))
}

/// One SSM token on the f32 state of `slot` of `state` (zeros for a pad row, nothing written
/// back).
fn ssm_token(r: &SsmRef, t: Token<bf16>, state: &[f32], slot: i32, carry: &mut Option<Vec<f64>>) -> Vec<f64> {
    let sl = r.heads * r.head_dim * r.state_size;
    let s = carry.get_or_insert_with(|| {
        if slot < 0 { vec![0.0; sl] } else { state[slot as usize * sl..][..sl].iter().map(|&v| f64::from(v)).collect() }
    });
    r.step(s, t)
}

fn store_state(state: &mut [f32], slot: i32, sl: usize, s: &[f64]) {
    if slot >= 0 {
        state[slot as usize * sl..][..sl].iter_mut().zip(s).for_each(|(d, v)| *d = *v as f32);
    }
}

/// A Mamba mixer on the CPU backend: its weights and states as they were uploaded.
pub type CpuMamba = MambaWeights<Cpu>;

/// The conv update of the decode rows `x` (their xBC) into `y`, in place at their slots' states.
fn conv_decode(m: &mut CpuMamba, x: In<Vec<bf16>>, rows: &StepRows, y: Out<Vec<bf16>>) {
    let conv = conv_ref(&m.c, &m.conv_w, m.conv_b.as_ref());
    let rows = conv.update(&x.buf[x.offset..], x.stride, &mut m.conv_state, &rows.decode_slots);
    put_rows(y, rows, m.c.conv_dim());
}

/// The selective state update of the decode rows into `y`, in place at their slots' states;
/// `xbc` rows hold x, B, C, `dt` rows the heads' dt.
fn ssm_decode(m: &mut CpuMamba, xbc: In<Vec<bf16>>, dt: In<Vec<bf16>>, rows: &StepRows, y: Out<Vec<bf16>>) {
    let c = &m.c;
    let r = ssm_ref(c, (&m.dt_bias, &m.a, &m.d));
    let (inner, sl) = (c.inner(), c.inner() * c.state_size);
    for (row, &slot) in rows.decode_slots.iter().enumerate() {
        let mut carry = None;
        let out = ssm_token(&r, token(c, &xbc, &dt, row), &m.ssm_state, slot, &mut carry);
        store_state(&mut m.ssm_state, slot, sl, &carry.unwrap_or_default());
        put(Out { buf: &mut *y.buf, offset: y.offset + row * inner }, out);
    }
}

/// An attention layer on the CPU backend: its projections and its slots' key and value caches.
pub struct CpuAttention {
    c: AttentionConfig,
    q: CpuWeight,
    k: CpuWeight,
    v: CpuWeight,
    o: CpuWeight,
    /// `[slots, max_len, kv_heads * head_dim]` each.
    k_cache: Vec<bf16>,
    v_cache: Vec<bf16>,
    max_len: usize,
}

/// A MoE layer's experts on the CPU backend: each routed expert's and the shared expert's
/// (up, down).
pub struct CpuExperts {
    routed: Vec<(CpuWeight, CpuWeight)>,
    shared: Option<(CpuWeight, CpuWeight)>,
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

    fn mamba_state(m: &mut CpuMamba) -> (&mut Vec<bf16>, &mut Vec<f32>) {
        (&mut m.conv_state, &mut m.ssm_state)
    }

    fn kv_cache(a: &mut CpuAttention) -> (&mut Vec<bf16>, &mut Vec<bf16>) {
        (&mut a.k_cache, &mut a.v_cache)
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

    fn mamba_in_proj(&self, m: &CpuMamba, x: In<Vec<bf16>>, rows: usize, zx: Out<Vec<bf16>>) -> Result<()> {
        self.linear(x, rows, &m.in_proj, zx)
    }

    /// The conv update, the state update and the gated norm, each output rounded to bf16.
    fn mamba_decode(
        &self,
        m: &mut CpuMamba,
        zx: In<Vec<bf16>>,
        nd: usize,
        rows: &StepRows,
        y: Out<Vec<bf16>>,
    ) -> Result<()> {
        let (inner, cd) = (m.c.inner(), m.c.conv_dim());
        let mut xbc = self.scratch(nd * cd)?;
        conv_decode(m, zx.at(0, inner), rows, Out { buf: &mut xbc, offset: 0 });
        let mut ys = self.scratch(nd * inner)?;
        ssm_decode(m, In::rows(&xbc, cd), zx.at(0, inner + cd), rows, Out { buf: &mut ys, offset: 0 });
        self.mamba_gated_norm(m, In::rows(&ys, inner), zx, nd, y)
    }

    fn mamba_conv(&self, m: &mut CpuMamba, x: In<Vec<bf16>>, rows: &StepRows, y: Out<Vec<bf16>>) -> Result<()> {
        let (c, seqs, xs) = (&m.c, &rows.prefill, &x.buf[x.offset..]);
        let conv = conv_ref(c, &m.conv_w, m.conv_b.as_ref());
        let rows = conv.forward(xs, x.stride, &mut m.conv_state, &seqs.lens, &seqs.slots, &seqs.initial);
        put_rows(y, rows, c.conv_dim());
        Ok(())
    }

    fn mamba_scan(
        &self,
        m: &mut CpuMamba,
        xbc: In<Vec<bf16>>,
        dt: In<Vec<bf16>>,
        rows: &StepRows,
        y: Out<Vec<bf16>>,
    ) -> Result<()> {
        // The sequential recurrence the chunked scan equals, token by token.
        let (c, seqs) = (&m.c, &rows.prefill);
        let r = ssm_ref(c, (&m.dt_bias, &m.a, &m.d));
        let (inner, sl) = (c.inner(), c.inner() * c.state_size);
        let mut row = 0;
        for s in 0..seqs.lens.len() {
            let slot = if seqs.initial[s] { seqs.slots[s] } else { -1 };
            let mut carry = None;
            for _ in 0..seqs.lens[s] {
                let out = ssm_token(&r, token(c, &xbc, &dt, row), &m.ssm_state, slot, &mut carry);
                put(Out { buf: &mut *y.buf, offset: y.offset + row * inner }, out);
                row += 1;
            }
            store_state(&mut m.ssm_state, seqs.slots[s], sl, &carry.unwrap_or_default());
        }
        Ok(())
    }

    fn mamba_gated_norm(
        &self,
        m: &CpuMamba,
        x: In<Vec<bf16>>,
        z: In<Vec<bf16>>,
        rows: usize,
        y: Out<Vec<bf16>>,
    ) -> Result<()> {
        let width = m.c.inner();
        let (xs, zs) = (gather(&x, rows, width), gather(&z, rows, width));
        put(y, norm::gated_norm(&xs, Some(&zs), &m.norm, width, m.c.groups, f64::from(m.eps)));
        Ok(())
    }

    fn mamba_out_proj(&self, m: &CpuMamba, x: In<Vec<bf16>>, rows: usize, y: Out<Vec<bf16>>) -> Result<()> {
        self.linear(x, rows, &m.out_proj, y)
    }

    fn moe(&self, c: &MoeConfig, x: In<Vec<bf16>>, rows: usize, w: &MoeWeights<Cpu>, y: Out<Vec<bf16>>) -> Result<()> {
        let hidden = w.gate.len() / c.experts;
        for (r, choices) in routed(c, x, rows, w).into_iter().enumerate() {
            let xr = &x.buf[x.offset + r * x.stride..][..hidden];
            let ex = &w.experts;
            let mut out = ex.shared.as_ref().map_or_else(|| vec![0.0; hidden], |(u, d)| mlp_row((u, d), xr));
            for (e, wt) in choices {
                let (u, d) = &ex.routed[e];
                let o = mlp_row((u, d), xr);
                out.iter_mut().zip(o).for_each(|(a, b)| *a += wt * b);
            }
            put(Out { buf: &mut *y.buf, offset: y.offset + r * hidden }, out);
        }
        Ok(())
    }

    fn moe_choices(&self, c: &MoeConfig, x: In<Vec<bf16>>, rows: usize, w: &MoeWeights<Cpu>) -> Result<Vec<u32>> {
        Ok(routed(c, x, rows, w).into_iter().flatten().map(|(e, _)| e as u32).collect())
    }

    /// q, k and v apart (each output the same product as through one weight of their rows).
    fn attention_qkv(&self, a: &CpuAttention, x: In<Vec<bf16>>, rows: usize) -> Result<QkvBufs<Vec<bf16>>> {
        let (qw, kw) = (a.c.heads * a.c.head_dim, a.c.kv_heads * a.c.head_dim);
        let (q, k) = (project(self, x, rows, &a.q, qw)?, project(self, x, rows, &a.k, kw)?);
        Ok(QkvBufs::Apart { q, k, v: project(self, x, rows, &a.v, kw)? })
    }

    fn attend(&self, a: &mut CpuAttention, qkv: &QkvBufs<Vec<bf16>>, rows: &StepRows, y: Out<Vec<bf16>>) -> Result<()> {
        let (c, max_len, kc, vc) = (&a.c, a.max_len, &mut a.k_cache, &mut a.v_cache);
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

    fn attention_out(&self, a: &CpuAttention, x: In<Vec<bf16>>, rows: usize, y: Out<Vec<bf16>>) -> Result<()> {
        self.linear(x, rows, &a.o, y)
    }
}
