//! Choosing the next token from logits: greedy, or temperature with optional top-k and top-p
//! (nucleus) truncation, from a seeded generator so a request's output is reproducible.

use crate::error::{Error, Result};

/// How a request picks its tokens.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SamplingParams {
    /// 0: greedy (the highest logit, the lowest id on ties). Otherwise logits are divided by it.
    pub temperature: f32,
    /// Keep only the `top_k` most likely tokens (None: all).
    pub top_k: Option<usize>,
    /// Keep the smallest set of most likely tokens whose probability reaches `top_p` (None: 1).
    pub top_p: Option<f32>,
    pub seed: u64,
}

impl SamplingParams {
    /// Greedy decoding.
    pub fn greedy() -> SamplingParams {
        SamplingParams { temperature: 0.0, top_k: None, top_p: None, seed: 0 }
    }

    fn check(&self) -> Result<()> {
        let bad = |what: String| Err(Error::Unsupported(format!("sampling: {what}")));
        if !(self.temperature.is_finite() && self.temperature >= 0.0) {
            return bad(format!("temperature {} must be finite and >= 0", self.temperature));
        }
        if self.top_k == Some(0) {
            return bad("top_k must be at least 1".into());
        }
        if let Some(p) = self.top_p.filter(|p| !(*p > 0.0 && *p <= 1.0)) {
            return bad(format!("top_p {p} must be in (0, 1]"));
        }
        Ok(())
    }
}

/// A request's sampler: its parameters and its random stream.
pub struct Sampler {
    params: SamplingParams,
    state: u64,
}

impl Sampler {
    /// Checks the parameters.
    pub fn new(params: SamplingParams) -> Result<Sampler> {
        params.check()?;
        Ok(Sampler { params, state: params.seed })
    }

    /// Uniform in [0, 1) (SplitMix64).
    fn uniform(&mut self) -> f64 {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        ((z ^ (z >> 31)) >> 11) as f64 / (1u64 << 53) as f64
    }

    /// The next token id for `logits` (one per vocabulary entry).
    pub fn sample(&mut self, logits: &[f32]) -> Result<u32> {
        if logits.is_empty() || logits.iter().any(|v| v.is_nan()) {
            return Err(Error::Unsupported("sampling: logits are empty or contain NaN".into()));
        }
        // Most likely first; equal logits in id order.
        let mut ids: Vec<usize> = (0..logits.len()).collect();
        ids.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]));
        let p = &self.params;
        if p.temperature == 0.0 {
            return Ok(ids[0] as u32);
        }
        ids.truncate(p.top_k.unwrap_or(ids.len()));
        let t = f64::from(p.temperature);
        let top = f64::from(logits[ids[0]]);
        let mut probs: Vec<f64> = ids.iter().map(|&i| ((f64::from(logits[i]) - top) / t).exp()).collect();
        let total: f64 = probs.iter().sum();
        probs.iter_mut().for_each(|q| *q /= total);
        if let Some(top_p) = p.top_p {
            let mut cum = 0.0;
            let keep = probs.iter().position(|q| {
                cum += q;
                cum >= f64::from(top_p) - 1e-12
            });
            probs.truncate(keep.map_or(probs.len(), |k| k + 1));
        }
        let total: f64 = probs.iter().sum();
        let mut u = self.uniform() * total;
        for (i, q) in probs.iter().enumerate() {
            if u < *q {
                return Ok(ids[i] as u32);
            }
            u -= q;
        }
        Ok(ids[probs.len() - 1] as u32)
    }
}
