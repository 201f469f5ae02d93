//! Random Mamba2 inputs laid out as the mixer holds them, shared by tests/ssm.rs and tests/ssd.rs.
#![allow(dead_code)] // each suite that includes this module uses a part of it

pub mod experts;
pub mod sampling;

use half::bf16;
use host::cpu::ssm::{SsmRef, Token};
use host::ssm::{SsmHeads, SsmInputs, SsmShape};
use host::{CudaSlice, Rows};
use nemotron_rs::Rng;

/// `rows` tokens of SSM inputs: x, B, C inside one conv-output-like row `[x | B | C]`, dt at
/// offset 1 of rows of `heads + 3`, a gate z, and per-head parameters.
pub struct Problem {
    pub shape: SsmShape,
    pub xbc: Vec<bf16>,
    pub dt: Vec<bf16>,
    pub z: Vec<bf16>,
    pub dt_bias: Vec<f32>,
    pub a: Vec<f32>,
    pub d: Vec<f32>,
}

impl Problem {
    pub fn new(rng: &mut Rng, shape: SsmShape, rows: usize) -> Problem {
        let h = shape.heads;
        let stride = shape.width() + 2 * shape.groups * shape.state_size;
        Problem {
            shape,
            xbc: rng.bf16s(rows * stride, -1.0, 1.0),
            dt: rng.bf16s(rows * (h + 3), -4.0, 0.5),
            z: rng.bf16s(rows * shape.width(), -3.0, 3.0),
            dt_bias: (0..h).map(|_| rng.uniform(-1.0, 1.0) as f32).collect(),
            a: (0..h).map(|_| -(rng.uniform(-1.5, 1.0).exp()) as f32).collect(),
            d: (0..h).map(|_| rng.uniform(-1.0, 1.0) as f32).collect(),
        }
    }

    fn stride(&self) -> usize {
        self.shape.width() + 2 * self.shape.groups * self.shape.state_size
    }

    pub fn x(&self, r: usize) -> &[bf16] {
        &self.xbc[r * self.stride()..][..self.shape.width()]
    }

    pub fn b(&self, r: usize) -> &[bf16] {
        let gn = self.shape.groups * self.shape.state_size;
        &self.xbc[r * self.stride() + self.shape.width()..][..gn]
    }

    pub fn c(&self, r: usize) -> &[bf16] {
        let gn = self.shape.groups * self.shape.state_size;
        &self.xbc[r * self.stride() + self.shape.width() + gn..][..gn]
    }

    pub fn dt(&self, r: usize) -> &[bf16] {
        &self.dt[r * (self.shape.heads + 3) + 1..][..self.shape.heads]
    }

    pub fn z(&self, r: usize) -> &[bf16] {
        &self.z[r * self.shape.width()..][..self.shape.width()]
    }

    /// Row `r`'s inputs, as the reference takes them, with the gate `z`.
    pub fn token<'a>(&'a self, r: usize, z: Option<&'a [bf16]>) -> Token<'a, bf16> {
        Token { x: self.x(r), dt: self.dt(r), b: self.b(r), c: self.c(r), z }
    }

    /// The f64 reference with this problem's parameters; `with_d`: the D skip term.
    pub fn reference(&self, with_d: bool) -> SsmRef<'_> {
        SsmRef {
            heads: self.shape.heads,
            head_dim: self.shape.head_dim,
            groups: self.shape.groups,
            state_size: self.shape.state_size,
            dt_bias: &self.dt_bias,
            a: &self.a,
            d: with_d.then_some(&self.d[..]),
            dt_min: f64::from(self.shape.dt_min),
            dt_max: f64::from(self.shape.dt_max),
        }
    }

    pub fn upload(&self, gpu: &host::Gpu) -> Dev {
        Dev {
            xbc: gpu.upload(&self.xbc).unwrap(),
            dt: gpu.upload(&self.dt).unwrap(),
            z: gpu.upload(&self.z).unwrap(),
            dt_bias: gpu.upload(&self.dt_bias).unwrap(),
            a: gpu.upload(&self.a).unwrap(),
            d: gpu.upload(&self.d).unwrap(),
            shape: self.shape,
            stride: self.stride(),
        }
    }
}

/// A [`Problem`] on the device.
pub struct Dev {
    pub xbc: CudaSlice<bf16>,
    pub dt: CudaSlice<bf16>,
    pub z: CudaSlice<bf16>,
    pub dt_bias: CudaSlice<f32>,
    pub a: CudaSlice<f32>,
    pub d: CudaSlice<f32>,
    shape: SsmShape,
    stride: usize,
}

impl Dev {
    /// The inputs of `rows` rows from row `row0` on.
    pub fn inputs_at(&self, row0: usize, rows: usize) -> SsmInputs<'_> {
        let (w, gn, h) = (self.shape.width(), self.shape.groups * self.shape.state_size, self.shape.heads);
        let xbc = Rows { offset: row0 * self.stride, ..Rows::strided(&self.xbc, rows, w, self.stride) };
        // dt: the heads' values at column 1 of rows of heads + 3.
        let dt = Rows { offset: row0 * (h + 3), ..Rows::strided(&self.dt, rows, h + 3, h + 3) };
        SsmInputs { x: xbc, dt: dt.cols(1, h), b: xbc.cols(w, gn), c: xbc.cols(w + gn, gn) }
    }

    /// The gate of `rows` rows from row `row0` on.
    pub fn z_at(&self, row0: usize, rows: usize) -> Rows<'_> {
        Rows { offset: row0 * self.shape.width(), ..Rows::new(&self.z, rows, self.shape.width()) }
    }

    pub fn heads(&self, with_d: bool) -> SsmHeads<'_> {
        SsmHeads { dt_bias: &self.dt_bias, a: &self.a, d: with_d.then_some(&self.d) }
    }
}

/// A state cache of `slots` slots with random contents, in f64 (the reference's) and as the
/// device type's values.
pub fn random_states(rng: &mut Rng, shape: &SsmShape, slots: usize) -> Vec<f64> {
    (0..slots * shape.slot_len()).map(|_| rng.uniform(-1.0, 1.0)).collect()
}

/// A state element type under test, with its tolerance against the f64 reference.
pub trait TestState: host::ssm::StateDtype + Copy {
    const NAME: &'static str;
    /// Relative tolerance of one written state value (its own rounding).
    const RTOL: f64;
    fn from_f64(v: f64) -> Self;
    fn to_f64(self) -> f64;
}

impl TestState for f32 {
    const NAME: &'static str = "f32";
    const RTOL: f64 = 1e-5;
    fn from_f64(v: f64) -> f32 {
        v as f32
    }
    fn to_f64(self) -> f64 {
        f64::from(self)
    }
}

impl TestState for bf16 {
    const NAME: &'static str = "bf16";
    const RTOL: f64 = 1.0 / 256.0 + 1e-5;
    fn from_f64(v: f64) -> bf16 {
        bf16::from_f64(v)
    }
    fn to_f64(self) -> f64 {
        bf16::to_f64(self)
    }
}
