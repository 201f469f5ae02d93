//! NemotronH on a [`Backend`]: the weights uploaded once, the state cache (conv, SSM and KV
//! state per slot, held by the Mamba and attention layers' objects, [`Backend::Mamba`] and
//! [`Backend::Attention`]), and the step that runs a batch mixing decode rows and prefill
//! sequences. This is the model's one code path: it orders each layer's operations (and the
//! profile's stamps and the step's counters between them); backends differ only in how they
//! run each operation, a layer object choosing the kernels of its own.
//!
//! A step of decode rows only is recorded by the backend where it can ([`Backend::record`]),
//! once per number of rows, and replayed for later steps of as many rows with their rows
//! written in place; the logits land in a buffer kept with the recording.
//!
//! `forward.rs` queues one step's operations in the model's order; `snapshot.rs` copies a
//! slot's state out and back (the prefix cache's snapshots).

mod forward;
mod snapshot;

use forward::{Marks, Step, forward};

use std::collections::HashMap;

use host::sample::RowSampling;
use kernels_gpu::sample::SampleOut;

use crate::backend::{Backend, CacheSizes, MoeWeights, PrefillSeqs, StepRows, bf16s};
use crate::cache::{Part, StepPlan};
use crate::config::{Config, LayerKind};
use crate::error::{Error, Result};
use crate::layout::{Layout, Mixer, Mlp};
use crate::profile::{ExpertLoad, Profile, Stage};

/// A layer's mixer: the backend's Mamba or attention layer (weights, the slots' states, the
/// choice of kernels), a MoE layer's weights, or a dense MLP's.
enum MixW<B: Backend> {
    Mamba(Box<B::Mamba>),
    Moe(MoeWeights<B>),
    Attention(B::Attention),
    Mlp { up: B::Weight, down: B::Weight },
}

/// What one step ran, counted at the call sites: decode rows must go through the update
/// kernels and prefill rows through the forward / scan kernels, and nothing else.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StepCounters {
    pub conv_updates: usize,
    pub conv_forwards: usize,
    pub state_updates: usize,
    pub chunk_scans: usize,
    pub attention_calls: usize,
    pub moe_calls: usize,
}

/// The weights on the backend, the state cache inside the layers that have one.
struct Weights<B: Backend> {
    embeddings: B::Buf,
    /// Each layer's RMSNorm weight (of its input).
    norms: Vec<B::Buf>,
    /// Each layer's mixer.
    layers: Vec<MixW<B>>,
    norm_f: B::Buf,
    lm_head: B::Weight,
}

/// Makes a step's late masks ([`Model::step_masked`]): one entry a part.
pub type LateMasks<'a> = &'a mut dyn FnMut() -> Vec<Option<Vec<u32>>>;

/// A recorded decode step: its rows (written over for each replay), the logits buffer it
/// writes, and what it ran.
struct Recorded<B: Backend> {
    graph: B::Graph,
    rows: B::Rows,
    logits: B::Buf,
    /// The sampling rows of a step recorded with its sampling.
    sampling: Option<B::Sampling>,
    counters: StepCounters,
}

/// What a step returns: every part's logits, or its sampled token.
enum StepOut {
    Logits(Vec<Vec<f32>>),
    Sampled(Vec<SampleOut>),
}

/// A loaded model with its state cache.
pub struct Model<B: Backend> {
    backend: B,
    config: Config,
    weights: Weights<B>,
    /// Tokens each slot's state has seen.
    past: Vec<usize>,
    max_len: usize,
    counters: StepCounters,
    /// Recorded decode steps by their number of rows and whether they sample.
    recorded: HashMap<(usize, bool), Recorded<B>>,
    /// The sampling rows of steps whose masks came late, by their number of rows.
    late_sampling: HashMap<usize, B::Sampling>,
    /// Whether steps are profiled (see [`Model::set_profiling`]), and the last one's profile.
    profiling: bool,
    profile: Option<Profile>,
    /// Whether steps tally their experts' loads (see [`Model::set_expert_tally`]), and the
    /// last tallied step's.
    tallying: bool,
    loads: Vec<ExpertLoad>,
}

/// A dense MLP's two weights.
pub(crate) fn mlp<B: Backend>(b: &B, m: &Mlp) -> Result<(B::Weight, B::Weight)> {
    Ok((b.weight(&m.up)?, b.weight(&m.down)?))
}

impl<B: Backend> Model<B> {
    /// Uploads every weight of `layout` and allocates a state cache of `slots` slots, each
    /// holding up to `max_len` tokens of attention keys and values.
    pub fn load(backend: B, config: &Config, layout: &Layout, slots: usize, max_len: usize) -> Result<Model<B>> {
        Model::load_with_progress(backend, config, layout, slots, max_len, &mut |_, _| {})
    }

    /// The checkpoint in `dir` (config.json and its safetensors) loaded as [`Model::load`]
    /// loads it, `progress` called as [`Model::load_with_progress`] calls it; what the config
    /// says this code does not honour (an FP8 KV cache, [`Config::kv_cache_note`]) is logged
    /// as a warning.
    pub fn from_dir(
        backend: B,
        dir: &std::path::Path,
        slots: usize,
        max_len: usize,
        progress: &mut dyn FnMut(usize, usize),
    ) -> Result<Model<B>> {
        let config = Config::from_dir(dir)?;
        if let Some(note) = config.kv_cache_note() {
            tracing::warn!("{note}");
        }
        let checkpoint = crate::Checkpoint::open(dir)?;
        tracing::info!(
            "{}: {} tensors, {:.1} MB mapped",
            dir.display(),
            checkpoint.names().count(),
            checkpoint.total_bytes() as f64 / 1e6
        );
        let layout = Layout::new(&config, &checkpoint)?;
        Model::load_with_progress(backend, &config, &layout, slots, max_len, progress)
    }

    /// [`Model::load`], calling `progress(layers_done, layers)` after each layer's weights.
    pub fn load_with_progress(
        backend: B,
        config: &Config,
        layout: &Layout,
        slots: usize,
        max_len: usize,
        progress: &mut dyn FnMut(usize, usize),
    ) -> Result<Model<B>> {
        let b = &backend;
        let sizes = CacheSizes::new(config, slots, max_len)?;
        let (mut norms, mut layers) = (Vec::new(), Vec::new());
        let total = layout.layers.len();
        for layer in &layout.layers {
            let mix = match &layer.mixer {
                Mixer::Mamba(m) => {
                    let c = config.mamba.as_ref().ok_or_else(|| Error::Unsupported("mamba settings missing".into()))?;
                    MixW::Mamba(Box::new(b.mamba(c, config.norm_eps, m, &sizes)?))
                }
                Mixer::Moe(m) => {
                    let experts = config.moe.as_ref().map_or(0, |c| c.experts);
                    let bias = match &m.score_bias {
                        Some(t) => t.to_f32()?,
                        None => vec![0.0; experts],
                    };
                    let w = MoeWeights {
                        gate: bf16s(b, &m.gate)?,
                        score_bias: b.upload32(&bias)?,
                        experts: b.experts(&m.experts, m.shared.as_ref())?,
                    };
                    MixW::Moe(w)
                }
                Mixer::Attention(a) => {
                    let c = config
                        .attention
                        .as_ref()
                        .ok_or_else(|| Error::Unsupported("attention settings missing".into()))?;
                    MixW::Attention(b.attention(c, a, &sizes)?)
                }
                Mixer::Mlp(m) => {
                    let (up, down) = mlp(b, m)?;
                    MixW::Mlp { up, down }
                }
            };
            norms.push(bf16s(b, &layer.norm)?);
            layers.push(mix);
            progress(layers.len(), total);
        }
        let weights = Weights {
            embeddings: bf16s(b, &layout.embeddings)?,
            norm_f: bf16s(b, &layout.norm_f)?,
            lm_head: b.weight(&layout.lm_head)?,
            norms,
            layers,
        };
        Ok(Model {
            weights,
            past: vec![0; slots],
            max_len,
            config: config.clone(),
            counters: StepCounters::default(),
            recorded: HashMap::new(),
            late_sampling: HashMap::new(),
            profiling: false,
            profile: None,
            tallying: false,
            loads: Vec::new(),
            backend,
        })
    }

    /// What the last step ran.
    pub fn counters(&self) -> StepCounters {
        self.counters
    }

    /// Whether the next steps are profiled: the backend's queue of work stamped after each
    /// part of the step ([`crate::profile`]; on the CUDA backend a CUDA event each). A
    /// profiled step is neither recorded nor replayed: its operations are launched one by
    /// one, so a profile of a decode step is not the recorded step's. Off by default; off,
    /// a step makes no stamps.
    pub fn set_profiling(&mut self, on: bool) {
        self.profiling = on;
    }

    /// The last profiled step's profile (kept until the next profiled step ends).
    pub fn profile(&self) -> Option<&Profile> {
        self.profile.as_ref()
    }

    /// Whether the next steps tally how each MoE layer's routing spreads their rows over its
    /// experts ([`ExpertLoad`]): every MoE layer's routing is computed once more and read
    /// back before the layer runs (a wait for the queue each), so, as a profiled step, a
    /// tallied step is neither recorded nor replayed, and its time is not a plain step's. Off
    /// by default.
    pub fn set_expert_tally(&mut self, on: bool) {
        self.tallying = on;
    }

    /// Replaces MoE layer `layer`'s score correction bias (its `e_score_correction_bias`, one
    /// value an expert), as [`crate::synthetic::balance`] fits a synthetic checkpoint's. The
    /// recorded steps are dropped (they read the old bias); the next steps record anew.
    pub fn set_score_bias(&mut self, layer: usize, bias: &[f32]) -> Result<()> {
        let experts = self.config.moe.as_ref().map_or(0, |c| c.experts);
        let Some(MixW::Moe(w)) = self.weights.layers.get_mut(layer) else {
            return Err(Error::Unsupported(format!("layer {layer} is not a MoE layer")));
        };
        if bias.len() != experts {
            return Err(Error::Unsupported(format!("a score bias of {} values for {experts} experts", bias.len())));
        }
        w.score_bias = self.backend.upload32(bias)?;
        self.recorded.clear();
        Ok(())
    }

    /// The last tallied step's expert loads, one a MoE layer in layer order (empty before the
    /// first; kept until the next tallied step ends).
    pub fn expert_loads(&self) -> &[ExpertLoad] {
        &self.loads
    }

    /// Runs one step over `parts` (requests' new tokens, each at its slot) and returns the
    /// logits after each part's last token, in the order of `parts`. After an error the
    /// states of the step's slots are unspecified (the device may have advanced some of
    /// them): release those slots ([`Model::release`]) before using them again, as the
    /// engine does by ending the step's requests.
    pub fn step(&mut self, parts: &[Part]) -> Result<Vec<Vec<f32>>> {
        match self.run(parts, None, None)? {
            StepOut::Logits(l) => Ok(l),
            StepOut::Sampled(_) => unreachable!("a step without sampling rows returns logits"),
        }
    }

    /// [`Model::step`], each part's token picked on the backend with its row of `sampling`
    /// (one per part, in the order of `parts`) from the logits where the LM head left them:
    /// only the picks come back (a recorded step records the sampling too, with room for
    /// twice its penalty pairs, and is recorded again when a later step's outgrow it).
    pub fn step_sampled(&mut self, parts: &[Part], sampling: &[RowSampling]) -> Result<Vec<SampleOut>> {
        self.step_masked(parts, sampling, None)
    }

    /// [`Model::step_sampled`], some rows' masks made by `masks` (one entry a part, in the
    /// order of `parts`; `Some` replaces that row's mask) while the device runs the step's
    /// forward pass: the masks of structured outputs, a trie walk a row on the host, cost the
    /// step nothing then. The sampling is launched once they are in (a recorded step records
    /// the forward pass alone).
    pub fn step_masked(
        &mut self,
        parts: &[Part],
        sampling: &[RowSampling],
        masks: Option<LateMasks<'_>>,
    ) -> Result<Vec<SampleOut>> {
        if sampling.len() != parts.len() {
            return Err(Error::Unsupported(format!(
                "{} sampling rows for a step of {} parts",
                sampling.len(),
                parts.len()
            )));
        }
        match self.run(parts, Some(sampling), masks)? {
            StepOut::Sampled(s) => Ok(s),
            StepOut::Logits(_) => unreachable!("a step with sampling rows returns their picks"),
        }
    }

    fn run(
        &mut self,
        parts: &[Part],
        sampling: Option<&[RowSampling]>,
        late: Option<LateMasks<'_>>,
    ) -> Result<StepOut> {
        let plan = StepPlan::new(parts)?;
        let rows = self.step_rows(parts, &plan)?;
        let vocab = self.config.vocab_size;
        let nd = plan.decode_tokens.len();
        let (slots, max_len) = (self.past.len(), self.max_len);
        // The sampling rows in the order of the logits rows.
        let ordered: Option<Vec<RowSampling>> = sampling.map(|s| plan.order.iter().map(|&p| s[p]).collect());
        let Model {
            backend: b,
            config,
            weights,
            recorded,
            counters,
            profiling,
            profile,
            tallying,
            loads,
            late_sampling,
            ..
        } = self;
        // A step that notes more than its outputs runs its operations one by one.
        let (profiling, tallying) = (*profiling, *tallying);
        let plain = !profiling && !tallying;
        let b = &*b;
        let seqs = &plan.prefill_lens;
        // Sampling in the step itself (recorded with it), unless some masks come late.
        let in_step = if late.is_some() { None } else { ordered.as_ref() };
        let key = (nd, in_step.is_some());
        // A recording whose penalty pairs or masks would not fit is recorded again, with room.
        let pairs: usize = ordered.iter().flatten().map(|r| r.penalties.len()).sum();
        if let (Some(r), Some(o)) = (recorded.get(&key), in_step)
            && r.sampling.as_ref().is_some_and(|s| !b.sampling_fits(s, o))
        {
            recorded.remove(&key);
        }
        // The step's outputs once its forward pass (and the sampling in it) is queued: with
        // late masks, they are made now, then the rows sampled.
        let outputs = |logits: &B::Buf, sampled: Option<&B::Sampling>| -> Result<StepOut> {
            let (Some(masks), Some(o)) = (late, &ordered) else { return fetch(b, logits, sampled, vocab) };
            let masks = masks();
            let rows: Vec<RowSampling> = (o.iter().zip(&plan.order))
                .map(|(r, &p)| RowSampling { mask: masks.get(p).and_then(Option::as_deref).or(r.mask), ..*r })
                .collect();
            let s = match late_sampling.remove(&rows.len()) {
                Some(mut s) if b.sampling_fits(&s, &rows) => {
                    b.set_sampling(&mut s, &rows)?;
                    s
                }
                _ => b.sampling(&rows, vocab, pairs.max(rows.len() * PAIRS_PER_ROW))?,
            };
            let s = late_sampling.entry(rows.len()).or_insert(s);
            b.sample(logits, vocab, s)?;
            fetch(b, logits, Some(s), vocab)
        };
        let out = if let Some(r) = recorded.get_mut(&key).filter(|_| seqs.is_empty() && plain) {
            b.set_rows(&mut r.rows, &rows)?;
            if let (Some(s), Some(o)) = (r.sampling.as_mut(), in_step) {
                b.set_sampling(s, o)?;
            }
            b.replay(&r.graph)?;
            *counters = r.counters;
            outputs(&r.logits, r.sampling.as_ref())?
        } else {
            let step_rows = b.rows(&rows, slots, max_len)?;
            let mut logits = b.scratch(rows.last.len() * vocab)?;
            // Room for a recorded step's later rows to carry more pairs: twice today's, at
            // least PAIRS_PER_ROW a row (grown by recording again when they outgrow it).
            let capacity = if seqs.is_empty() { (2 * pairs).max(nd * PAIRS_PER_ROW) } else { pairs };
            let mut sampling = in_step.map(|o| b.sampling(o, vocab, capacity)).transpose()?;
            let mut marks = Marks::new(b, profiling, tallying)?;
            let mut run = || {
                let (rows, marks) = (&step_rows, &mut marks);
                let step = Step { nd, seqs, rows };
                let ran = forward(b, config, &mut *weights, step, &mut logits, marks)?;
                if let Some(s) = sampling.as_mut() {
                    b.sample(&logits, vocab, s)?;
                    marks.end(b, Stage::Sample)?;
                }
                Ok(ran)
            };
            let mut ran = StepCounters::default();
            let graph = if seqs.is_empty() && plain {
                b.record(nd, &mut || run().map(|c| ran = c))?
            } else {
                ran = run()?;
                None
            };
            *counters = ran;
            match graph {
                Some(graph) => {
                    b.replay(&graph)?;
                    let out = outputs(&logits, sampling.as_ref())?;
                    recorded.insert(key, Recorded { graph, rows: step_rows, logits, sampling, counters: ran });
                    out
                }
                None => {
                    let out = outputs(&logits, sampling.as_ref())?;
                    if let Some(p) = marks.profile(b)? {
                        *profile = Some(p);
                    }
                    if let Some(l) = marks.loads {
                        *loads = l;
                    }
                    out
                }
            }
        };

        for &s in &plan.decode_slots {
            self.past[s as usize] += 1;
        }
        for ((&s, &l), &i) in plan.prefill_slots.iter().zip(&plan.prefill_lens).zip(&plan.prefill_initial) {
            self.past[s as usize] = if i { self.past[s as usize] } else { 0 } + l;
        }
        Ok(match out {
            StepOut::Logits(l) => StepOut::Logits(by_part(l, &plan.order)),
            StepOut::Sampled(s) => StepOut::Sampled(by_part(s, &plan.order)),
        })
    }

    /// Checks `parts` against the cache and the vocabulary; the step's rows.
    fn step_rows(&self, parts: &[Part], plan: &StepPlan) -> Result<StepRows> {
        let slots = self.past.len();
        let mut seen = vec![false; slots];
        for (i, p) in parts.iter().enumerate() {
            if p.slot < 0 || p.slot as usize >= slots || std::mem::replace(&mut seen[p.slot as usize], true) {
                return Err(Error::Capacity(format!(
                    "part {i}: slot {} is out of range (0..{slots}) or used twice",
                    p.slot
                )));
            }
            let past = self.past[p.slot as usize];
            if p.computed > 0 && p.computed != past {
                return Err(Error::Unsupported(format!(
                    "part {i}: {} tokens computed, but slot {} holds the state of {past}",
                    p.computed, p.slot
                )));
            }
            if p.computed + p.tokens.len() > self.max_len {
                return Err(Error::Capacity(format!(
                    "part {i}: a sequence of {} tokens exceeds the KV cache's {}",
                    p.computed + p.tokens.len(),
                    self.max_len
                )));
            }
            let vocab = self.config.vocab_size;
            if let Some(t) = p.tokens.iter().find(|&&t| t as usize >= vocab) {
                return Err(Error::Unsupported(format!("part {i}: token id {t} is outside the vocabulary of {vocab}")));
            }
        }
        let nd = plan.decode_tokens.len();
        // Attention: each decode row continues its slot; each prefill sequence starts at its
        // slot's past when it continues it, else at 0.
        let mut positions: Vec<u32> = plan.decode_slots.iter().map(|&s| self.past[s as usize] as u32).collect();
        let mut row_slots = plan.decode_slots.clone();
        // The last row of each part: decode rows, then each prefill sequence's end.
        let mut last: Vec<u32> = (0..nd as u32).collect();
        let mut end = nd;
        for ((&s, &l), &i) in plan.prefill_slots.iter().zip(&plan.prefill_lens).zip(&plan.prefill_initial) {
            let p0 = if i { self.past[s as usize] } else { 0 };
            positions.extend((p0..p0 + l).map(|p| p as u32));
            row_slots.extend(std::iter::repeat_n(s, l));
            end += l;
            last.push(end as u32 - 1);
        }
        Ok(StepRows {
            tokens: plan.decode_tokens.iter().chain(&plan.prefill_tokens).copied().collect(),
            decode_slots: plan.decode_slots.clone(),
            prefill: PrefillSeqs {
                lens: plan.prefill_lens.clone(),
                slots: plan.prefill_slots.clone(),
                initial: plan.prefill_initial.clone(),
            },
            slots: row_slots,
            positions,
            last,
        })
    }

    /// Forgets a slot's state (its next part must start with `computed == 0`).
    pub fn release(&mut self, slot: i32) {
        if let Some(p) = self.past.get_mut(slot.max(0) as usize) {
            *p = 0;
        }
    }

    /// The model's config.
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// The layer kinds, in order.
    pub fn layers(&self) -> &[LayerKind] {
        &self.config.layers
    }

    /// Slots in the state cache.
    pub fn slots(&self) -> usize {
        self.past.len()
    }

    /// Most tokens a slot holds.
    pub fn max_len(&self) -> usize {
        self.max_len
    }

    /// Vocabulary size.
    pub fn vocab(&self) -> usize {
        self.config.vocab_size
    }
}

/// Penalty pairs a row of a recorded step has room for at first.
const PAIRS_PER_ROW: usize = 64;

/// What a step's logits buffer and sampling rows hold for the host: the sampled picks, or
/// the logits rows.
fn fetch<B: Backend>(b: &B, logits: &B::Buf, sampling: Option<&B::Sampling>, vocab: usize) -> Result<StepOut> {
    Ok(match sampling {
        Some(s) => StepOut::Sampled(b.sampled(s)?),
        None => StepOut::Logits(b.download_rows(logits, vocab)?),
    })
}

/// `rows` (row i is part `order[i]`'s) in the order of the parts.
fn by_part<T: Clone + Default>(rows: Vec<T>, order: &[usize]) -> Vec<T> {
    let mut out = vec![T::default(); order.len()];
    for (row, &part) in rows.into_iter().zip(order) {
        out[part] = row;
    }
    out
}
