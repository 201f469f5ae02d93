//! Reference chunked scan (docs/MATH.md section 3): not chunked at all, but the sequential
//! recurrence it must equal, token by token, in f64.

use half::bf16;

use super::ssm::{SsmRef, Token};

impl SsmRef<'_> {
    /// Runs one sequence from state `s` (zeros for a fresh sequence), updating it in place
    /// to the final state. Token t's inputs are `x[t]`, `dt[t]`, `b[t]`, `c[t]` (each a
    /// row as in [`SsmRef::step`]); returns the outputs of every token.
    pub fn scan(&self, s: &mut [f64], x: &[&[bf16]], dt: &[&[bf16]], b: &[&[bf16]], c: &[&[bf16]]) -> Vec<Vec<f64>> {
        (0..x.len()).map(|t| self.step::<bf16>(s, Token { x: x[t], dt: dt[t], b: b[t], c: c[t], z: None })).collect()
    }
}
