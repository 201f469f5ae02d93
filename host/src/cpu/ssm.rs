//! Reference selective state update (docs/MATH.md section 2): the Mamba2 recurrence for one token,
//! in f64, from inputs of any type that widens to f64 (bf16 from tests, f64 from the model's
//! reference forward). The chunked scan's reference (cpu/ssd.rs) is this step applied token by token.

/// softplus(v) = ln(1 + e^v), and v itself above 20.
pub fn softplus(v: f64) -> f64 {
    if v > 20.0 { v } else { v.exp().ln_1p() }
}

/// The group head `h` reads: contiguous blocks of `heads / groups` heads per group.
pub fn group_of(h: usize, heads: usize, groups: usize) -> usize {
    h / (heads / groups)
}

/// SSM geometry and per-head parameters (f32, as the kernels take them).
pub struct SsmRef<'a> {
    pub heads: usize,
    pub head_dim: usize,
    pub groups: usize,
    pub state_size: usize,
    pub dt_bias: &'a [f32],
    /// A = -exp(A_log).
    pub a: &'a [f32],
    pub d: Option<&'a [f32]>,
    pub dt_min: f64,
    pub dt_max: f64,
}

/// One token's inputs: x (and the optional gate z) `heads * head_dim` values, dt `heads`, B and
/// C `groups * state_size`.
#[derive(Clone, Copy)]
pub struct Token<'a, T> {
    pub x: &'a [T],
    pub dt: &'a [T],
    pub b: &'a [T],
    pub c: &'a [T],
    pub z: Option<&'a [T]>,
}

impl<'a, T> Token<'a, T> {
    /// x, B and C from a conv output row `[x (inner) | B (gn) | C (gn)]`, with `dt`, no gate.
    pub fn of_xbc(xbc: &'a [T], dt: &'a [T], (inner, gn): (usize, usize)) -> Token<'a, T> {
        Token { x: &xbc[..inner], dt, b: &xbc[inner..inner + gn], c: &xbc[inner + gn..inner + 2 * gn], z: None }
    }
}

impl SsmRef<'_> {
    /// One token: updates `s` (`[heads, head_dim, state_size]`) in place and returns
    /// `y [heads * head_dim]`; head h uses group `group(h)`.
    pub fn step_with_groups<T: Copy + Into<f64>>(
        &self,
        s: &mut [f64],
        t: Token<T>,
        group: impl Fn(usize) -> usize,
    ) -> Vec<f64> {
        let Token { x, dt, b, c, z } = t;
        let (hd, n) = (self.head_dim, self.state_size);
        let mut y = vec![0.0; self.heads * hd];
        for h in 0..self.heads {
            let g = group(h);
            let delta = softplus(dt[h].into() + f64::from(self.dt_bias[h])).clamp(self.dt_min, self.dt_max);
            let da = (f64::from(self.a[h]) * delta).exp();
            for p in 0..hd {
                let xv = x[h * hd + p].into();
                let row = &mut s[(h * hd + p) * n..(h * hd + p + 1) * n];
                let mut acc = 0.0;
                for (i, sv) in row.iter_mut().enumerate() {
                    *sv = *sv * da + delta * xv * b[g * n + i].into();
                    acc += *sv * c[g * n + i].into();
                }
                acc += self.d.map_or(0.0, |d| f64::from(d[h]) * xv);
                if let Some(z) = z {
                    let zv = z[h * hd + p].into();
                    acc *= zv / (1.0 + (-zv).exp());
                }
                y[h * hd + p] = acc;
            }
        }
        y
    }

    /// [`SsmRef::step_with_groups`] with docs/MATH.md's head-to-group mapping.
    pub fn step<T: Copy + Into<f64>>(&self, s: &mut [f64], t: Token<T>) -> Vec<f64> {
        self.step_with_groups(s, t, |h| group_of(h, self.heads, self.groups))
    }
}
