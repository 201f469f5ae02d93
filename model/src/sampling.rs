//! Choosing a request's next token: greedy, or temperature with top-k, top-p and min-p
//! truncation, repetition / presence / frequency penalties over the request's generated
//! tokens, and a per-request seed (a counter-based generator: a request's tokens do not
//! depend on the requests beside it). On the CUDA backend the sampling runs on the device,
//! where the LM head left the logits (kernels-gpu's sample.rs, whose module doc has the
//! math); on the CPU backend the same math picks the same tokens (`host::cpu::sample`).
//!
//! Truncations never split equal logits: the tokens tied with the last one kept are kept.
//! Infinite logits: a `+inf` logit takes all the probability (shared by the `+inf` ones), a
//! `-inf` one none; a NaN logit, or every logit `-inf`, leaves the request without a token
//! ([`SampleError`]).

use std::collections::HashMap;

use host::sample::RowSampling;
use kernels_gpu::sample::{SAMPLE_ALL_NEG_INF, SAMPLE_MAX_TOP, SAMPLE_NAN, SAMPLE_OK, SampleOut, SampleRow};

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
    /// Keep only tokens at least `min_p` times as likely as the most likely one (None: 0).
    pub min_p: Option<f32>,
    /// A generated token's positive logits are divided by it, negative ones multiplied (1: off).
    pub repetition_penalty: f32,
    /// Subtracted from the logit of every token generated before (0: off).
    pub presence_penalty: f32,
    /// Subtracted once per earlier occurrence among the generated tokens (0: off).
    pub frequency_penalty: f32,
    pub seed: u64,
    /// Whether each token comes with its log-probability (under the penalized logits at
    /// temperature 1).
    pub logprobs: bool,
    /// Each token also comes with the `top_logprobs` most likely tokens and their
    /// log-probabilities (at most 20; more than 0 implies `logprobs`).
    pub top_logprobs: usize,
}

impl Default for SamplingParams {
    fn default() -> SamplingParams {
        SamplingParams::greedy()
    }
}

impl SamplingParams {
    /// Greedy decoding, no penalties.
    pub fn greedy() -> SamplingParams {
        SamplingParams {
            temperature: 0.0,
            top_k: None,
            top_p: None,
            min_p: None,
            repetition_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            seed: 0,
            logprobs: false,
            top_logprobs: 0,
        }
    }

    /// Temperature `t` with nucleus `top_p`, seeded.
    pub fn nucleus(t: f32, top_p: f32, seed: u64) -> SamplingParams {
        SamplingParams { temperature: t, top_p: Some(top_p), seed, ..SamplingParams::greedy() }
    }

    /// Refuses what no sampler can do, naming the parameter.
    pub fn check(&self) -> Result<()> {
        let bad = |what: String| Err(Error::Invalid(format!("sampling: {what}")));
        if !(self.temperature.is_finite() && self.temperature >= 0.0) {
            return bad(format!("temperature {} must be finite and >= 0", self.temperature));
        }
        if self.top_k == Some(0) {
            return bad("top_k must be at least 1".into());
        }
        if let Some(p) = self.top_p.filter(|p| !(*p > 0.0 && *p <= 1.0)) {
            return bad(format!("top_p {p} must be in (0, 1]"));
        }
        if let Some(p) = self.min_p.filter(|p| !(0.0..=1.0).contains(p)) {
            return bad(format!("min_p {p} must be in [0, 1]"));
        }
        if !(self.repetition_penalty.is_finite() && self.repetition_penalty > 0.0) {
            return bad(format!("repetition_penalty {} must be finite and > 0", self.repetition_penalty));
        }
        if self.top_logprobs > SAMPLE_MAX_TOP as usize {
            return bad(format!("top_logprobs {} must be at most {SAMPLE_MAX_TOP}", self.top_logprobs));
        }
        for (name, v) in [("presence_penalty", self.presence_penalty), ("frequency_penalty", self.frequency_penalty)] {
            if !v.is_finite() {
                return bad(format!("{name} {v} must be finite"));
            }
        }
        Ok(())
    }

    fn penalized(&self) -> bool {
        self.repetition_penalty != 1.0 || self.presence_penalty != 0.0 || self.frequency_penalty != 0.0
    }
}

/// Why a request got no token.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SampleError {
    /// Its logits held a NaN.
    NanLogits,
    /// Every logit was `-inf` (or the row's mask allowed no token).
    AllNegInf,
    /// The request's output constraint failed (the engine logs why).
    Constrained,
}

impl std::fmt::Display for SampleError {
    fn fmt(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str(match self {
            SampleError::NanLogits => "its logits contain NaN",
            SampleError::AllNegInf => "every logit is -inf",
            SampleError::Constrained => "its output constraint failed",
        })
    }
}

/// A chosen token.
#[derive(Clone, Debug, PartialEq)]
pub struct Sampled {
    pub token: u32,
    /// Its log-probability, when asked.
    pub logprob: Option<f32>,
    /// The most likely tokens and their log-probabilities, most likely first, when asked.
    pub top_logprobs: Vec<(u32, f32)>,
}

/// A request's sampler: its parameters, how often it generated each token (for the
/// penalties), and how many tokens it generated (the generator's counter).
#[derive(Clone, Debug)]
pub struct Sampler {
    params: SamplingParams,
    /// Pairs (token, times generated), in the order tokens first appeared.
    pairs: Vec<(u32, u32)>,
    /// Each generated token's pair.
    index: HashMap<u32, usize>,
    generated: u64,
}

impl Sampler {
    /// Checks the parameters.
    pub fn new(params: SamplingParams) -> Result<Sampler> {
        params.check()?;
        Ok(Sampler { params, pairs: Vec::new(), index: HashMap::new(), generated: 0 })
    }

    /// The parameters.
    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// The next token's row for the backends.
    pub fn row(&self) -> RowSampling<'_> {
        let p = &self.params;
        let row = SampleRow {
            temperature: p.temperature,
            top_k: p.top_k.map_or(0, |k| k.min(u32::MAX as usize) as u32),
            top_p: p.top_p.unwrap_or(1.0),
            min_p: p.min_p.unwrap_or(0.0),
            repetition: p.repetition_penalty,
            presence: p.presence_penalty,
            frequency: p.frequency_penalty,
            logprobs: if p.logprobs || p.top_logprobs > 0 { 1 + p.top_logprobs as u32 } else { 0 },
            seed: p.seed,
            counter: self.generated,
            ..SampleRow::GREEDY
        };
        RowSampling { row, penalties: if p.penalized() { &self.pairs } else { &[] }, mask: None }
    }

    /// What a backend chose for [`Sampler::row`]: the token, counted for later penalties, or
    /// why there is none.
    pub fn accept(&mut self, out: SampleOut) -> std::result::Result<Sampled, SampleError> {
        match out.status {
            SAMPLE_OK => {}
            SAMPLE_NAN => return Err(SampleError::NanLogits),
            SAMPLE_ALL_NEG_INF => return Err(SampleError::AllNegInf),
            s => unreachable!("sampling status {s}"),
        }
        self.generated += 1;
        let at = *self.index.entry(out.token).or_insert_with(|| {
            self.pairs.push((out.token, 0));
            self.pairs.len() - 1
        });
        self.pairs[at].1 += 1;
        let asked = self.params.logprobs || self.params.top_logprobs > 0;
        Ok(Sampled { token: out.token, logprob: asked.then_some(out.logprob), top_logprobs: out.top().to_vec() })
    }

    /// The next token for `logits` (one per vocabulary entry) on the CPU.
    pub fn sample(&mut self, logits: &[f32]) -> std::result::Result<Sampled, SampleError> {
        let r = self.row();
        let out = host::cpu::sample::sample_row(logits, &r.row, r.penalties, r.mask);
        self.accept(out)
    }
}
