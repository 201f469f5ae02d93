//! The CPU backend's Mamba2 mixer: conv and selective state update token by token from the
//! host crate's references, outputs rounded to bf16, states in f32.

use half::bf16;
use host::cpu::conv1d::ConvRef;
use host::cpu::norm;
use host::cpu::ssm::{SsmRef, Token};

use super::{Cpu, gather, put, put_rows};
use crate::backend::{Backend, In, MambaOps, MambaWeights, Out, StepRows};
use crate::config::MambaConfig;
use crate::error::Result;

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

impl MambaOps<Cpu> for CpuMamba {
    fn in_proj(&self, b: &Cpu, x: In<Vec<bf16>>, rows: usize, zx: Out<Vec<bf16>>) -> Result<()> {
        b.linear(x, rows, &self.in_proj, zx)
    }

    /// The conv update, the state update and the gated norm, each output rounded to bf16.
    fn decode(&mut self, b: &Cpu, zx: In<Vec<bf16>>, nd: usize, rows: &StepRows, y: Out<Vec<bf16>>) -> Result<()> {
        let (inner, cd) = (self.c.inner(), self.c.conv_dim());
        let mut xbc = b.scratch(nd * cd)?;
        conv_decode(self, zx.at(0, inner), rows, Out { buf: &mut xbc, offset: 0 });
        let mut ys = b.scratch(nd * inner)?;
        ssm_decode(self, In::rows(&xbc, cd), zx.at(0, inner + cd), rows, Out { buf: &mut ys, offset: 0 });
        self.gated_norm(b, In::rows(&ys, inner), zx, nd, y)
    }

    fn conv(&mut self, _b: &Cpu, x: In<Vec<bf16>>, rows: &StepRows, y: Out<Vec<bf16>>) -> Result<()> {
        let (c, seqs, xs) = (&self.c, &rows.prefill, &x.buf[x.offset..]);
        let conv = conv_ref(c, &self.conv_w, self.conv_b.as_ref());
        let rows = conv.forward(xs, x.stride, &mut self.conv_state, &seqs.lens, &seqs.slots, &seqs.initial);
        put_rows(y, rows, c.conv_dim());
        Ok(())
    }

    fn scan(
        &mut self,
        _b: &Cpu,
        xbc: In<Vec<bf16>>,
        dt: In<Vec<bf16>>,
        rows: &StepRows,
        y: Out<Vec<bf16>>,
    ) -> Result<()> {
        // The sequential recurrence the chunked scan equals, token by token.
        let (c, seqs) = (&self.c, &rows.prefill);
        let r = ssm_ref(c, (&self.dt_bias, &self.a, &self.d));
        let (inner, sl) = (c.inner(), c.inner() * c.state_size);
        let mut row = 0;
        for s in 0..seqs.lens.len() {
            let slot = if seqs.initial[s] { seqs.slots[s] } else { -1 };
            let mut carry = None;
            for _ in 0..seqs.lens[s] {
                let out = ssm_token(&r, token(c, &xbc, &dt, row), &self.ssm_state, slot, &mut carry);
                put(Out { buf: &mut *y.buf, offset: y.offset + row * inner }, out);
                row += 1;
            }
            store_state(&mut self.ssm_state, seqs.slots[s], sl, &carry.unwrap_or_default());
        }
        Ok(())
    }

    fn gated_norm(&self, _b: &Cpu, x: In<Vec<bf16>>, z: In<Vec<bf16>>, rows: usize, y: Out<Vec<bf16>>) -> Result<()> {
        let width = self.c.inner();
        let (xs, zs) = (gather(&x, rows, width), gather(&z, rows, width));
        put(y, norm::gated_norm(&xs, Some(&zs), &self.norm, width, self.c.groups, f64::from(self.eps)));
        Ok(())
    }

    fn out_proj(&self, b: &Cpu, x: In<Vec<bf16>>, rows: usize, y: Out<Vec<bf16>>) -> Result<()> {
        b.linear(x, rows, &self.out_proj, y)
    }

    fn state(&mut self) -> (&mut Vec<bf16>, &mut Vec<f32>) {
        (&mut self.conv_state, &mut self.ssm_state)
    }
}
