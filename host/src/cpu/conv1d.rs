//! Reference causal conv1d (docs/MATH.md section 1), f64 accumulation. States hold raw inputs (of
//! the inputs' own type), so bf16 states compare bit-exact with the kernels'.

use half::bf16;

fn silu(v: f64) -> f64 {
    v / (1.0 + (-v).exp())
}

/// Conv weights: `w [dim, k]`, optional `bias [dim]`.
pub struct ConvRef<'a> {
    pub dim: usize,
    pub k: usize,
    pub w: &'a [bf16],
    pub bias: Option<&'a [bf16]>,
}

impl ConvRef<'_> {
    /// `silu(bias + sum_j w[c, j] * window[j])` for channel c.
    fn out<T: Copy + Into<f64>>(&self, c: usize, window: &[T]) -> f64 {
        let b = self.bias.map_or(0.0, |b| b[c].to_f64());
        silu(b + (0..self.k).map(|j| self.w[c * self.k + j].to_f64() * window[j].into()).sum::<f64>())
    }

    /// The `k - 1` state values of channel c in slot s of a `[slots, dim, k - 1]` cache.
    fn state_of<'s, T>(&self, state: &'s mut [T], s: usize, c: usize) -> &'s mut [T] {
        let km1 = self.k - 1;
        &mut state[(s * self.dim + c) * km1..(s * self.dim + c + 1) * km1]
    }

    /// Decode: row r's input is `x[r * x_stride ..][..dim]`, its slot `slots[r]` (negative:
    /// pad). Returns each row's outputs (None for pad rows) and rolls the states in place.
    pub fn update<T: Copy + Into<f64>>(
        &self,
        x: &[T],
        x_stride: usize,
        state: &mut [T],
        slots: &[i32],
    ) -> Vec<Option<Vec<f64>>> {
        slots
            .iter()
            .enumerate()
            .map(|(r, &s)| {
                if s < 0 {
                    return None;
                }
                Some(
                    (0..self.dim)
                        .map(|c| {
                            let st = self.state_of(state, s as usize, c);
                            let mut window: Vec<T> = st.to_vec();
                            window.push(x[r * x_stride + c]);
                            st.copy_from_slice(&window[1..]);
                            self.out(c, &window)
                        })
                        .collect(),
                )
            })
            .collect()
    }

    /// Prefill: sequences of `lens` tokens stacked in x (row stride `x_stride`), slot
    /// `slots[s]` (negative: pad), starting from the slot's state where `has_initial[s]`.
    /// Returns each token row's outputs (None for pad sequences) and writes final states.
    pub fn forward(
        &self,
        x: &[bf16],
        x_stride: usize,
        state: &mut [bf16],
        lens: &[usize],
        slots: &[i32],
        has_initial: &[bool],
    ) -> Vec<Option<Vec<f64>>> {
        let km1 = self.k - 1;
        let mut rows = Vec::new();
        let mut start = 0;
        for (s, &len) in lens.iter().enumerate() {
            if slots[s] < 0 {
                rows.extend((0..len).map(|_| None));
                start += len;
                continue;
            }
            let mut outs = vec![vec![0.0; self.dim]; len];
            for c in 0..self.dim {
                let st = self.state_of(state, slots[s] as usize, c);
                let mut xx: Vec<bf16> = if has_initial[s] { st.to_vec() } else { vec![bf16::ZERO; km1] };
                xx.extend((0..len).map(|t| x[(start + t) * x_stride + c]));
                for (t, o) in outs.iter_mut().enumerate() {
                    o[c] = self.out(c, &xx[t..t + self.k]);
                }
                st.copy_from_slice(&xx[len..]);
            }
            rows.extend(outs.into_iter().map(Some));
            start += len;
        }
        rows
    }
}
