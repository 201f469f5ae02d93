//! The engine: requests in, tokens out. Each step feeds waiting prompts (as prefill
//! sequences) and running requests (one token each, as decode rows) to the model in one
//! batch, samples each request's next token on the backend (on the GPU only the token ids come
//! back), and frees the slots of finished requests. A bad
//! request is refused when it is added, so it never disturbs the others. A step that fails
//! anyway (out of device memory for a large batch, say) ends the requests that were in it,
//! with [`Error::StepFailed`] naming them, and the engine serves the rest at the next step. A
//! request whose logits give no token (a NaN among them, or all `-inf`) ends with
//! [`Finish::Failed`], the others in its step going on.
//! [`Engine::set_max_step_tokens`] bounds the tokens of one step (and so its activation
//! memory): prompts are then fed in chunks over several steps, oldest request first.
//! [`Engine::set_prefix_cache`] keeps slots' states after prompts, requests and shared
//! prefixes ([`crate::prefix`]): a request whose prompt starts with a saved sequence restores
//! it and prefills only the rest.

use std::collections::{BTreeMap, VecDeque};
use std::time::Instant;

use host::sample::RowSampling;
use kernels_gpu::sample::SampleRow;
use rayon::prelude::*;

use crate::backend::Backend;
use crate::cache::{Part, SlotPool};
use crate::error::{Error, Result};
use crate::model::Model;
use crate::prefix::{Kept, PrefixCache, PrefixSettings, PrefixStats};
use crate::sampling::{SampleError, Sampler, SamplingParams};

/// A request's handle.
pub type RequestId = u64;

/// How a request generates.
#[derive(Clone, Debug, PartialEq)]
pub struct RequestParams {
    pub max_new_tokens: usize,
    pub sampling: SamplingParams,
    /// Generation stops after any of these (the checkpoint's end-of-sequence ids, say).
    pub stop_tokens: Vec<u32>,
    /// The first this many generated tokens are never `stop_tokens`: the sampler's mask holds
    /// them back (at most `max_new_tokens`).
    pub min_new_tokens: usize,
}

/// Why a request ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Finish {
    /// It produced `max_new_tokens` tokens.
    Length,
    /// It produced a stop token (included in its output).
    Stop,
    /// Its logits gave no token (the event's token is `u32::MAX`).
    Failed(SampleError),
}

/// One generated token.
#[derive(Clone, Debug, PartialEq)]
pub struct Event {
    pub id: RequestId,
    pub token: u32,
    /// Set on the request's last token.
    pub finished: Option<Finish>,
    /// The token's log-probability, when its request asked for them.
    pub logprob: Option<f32>,
    /// The most likely tokens and their log-probabilities, when its request asked for them.
    pub top_logprobs: Vec<(u32, f32)>,
    /// The request's prompt tokens restored from the prefix cache, not computed.
    pub cached: usize,
}

/// What a request's output must stay within (structured outputs, [`crate::structured`]):
/// asked, before each of its tokens is drawn, which tokens may come; told which came.
pub trait Constraint: Send {
    /// Clears in `mask` (a bit a token, 1: allowed; [`host::sample::mask_words`] words) the
    /// tokens that may not come next.
    fn restrict(&mut self, mask: &mut [u32]) -> std::result::Result<(), String>;
    /// The token drawn.
    fn accept(&mut self, token: u32) -> std::result::Result<(), String>;
    /// Whether the output is complete (no token may follow): the request ends there.
    fn complete(&self) -> bool;
}

struct Request {
    params: RequestParams,
    sampler: Sampler,
    constraint: Option<Box<dyn Constraint>>,
    /// Tokens not yet fed to the model (the prompt, then each sampled token).
    pending: Vec<u32>,
    /// Tokens fed to the model (or restored): the sequence its slot's state has seen (its
    /// length the tokens computed).
    seen: Vec<u32>,
    generated: usize,
    slot: Option<i32>,
    /// Prompt tokens restored from the prefix cache.
    cached: usize,
    /// Where its prefill stops for snapshots, in order ([`PrefixCache::start`]).
    stops: Vec<usize>,
    /// The length of its last snapshot, saved or restored.
    snapped: usize,
}

/// Serves requests on a [`Model`].
pub struct Engine<B: Backend> {
    model: Model<B>,
    pool: SlotPool,
    vocab: usize,
    max_len: usize,
    requests: BTreeMap<RequestId, Request>,
    waiting: VecDeque<RequestId>,
    next_id: RequestId,
    max_step_tokens: usize,
    prefix: Option<PrefixCache<B>>,
}

impl<B: Backend> Engine<B> {
    /// An engine over `model`, serving as many requests at once as it has state slots.
    pub fn new(model: Model<B>) -> Engine<B> {
        let (slots, vocab, max_len) = (model.slots(), model.vocab(), model.max_len());
        Engine {
            model,
            pool: SlotPool::new(slots),
            vocab,
            max_len,
            requests: BTreeMap::new(),
            waiting: VecDeque::new(),
            next_id: 0,
            max_step_tokens: usize::MAX,
            prefix: None,
        }
    }

    /// Keeps snapshots of slots' states within `settings.budget` bytes of the backend's memory
    /// ([`crate::prefix`]; a budget of 0 turns the cache off, as it starts), dropping those
    /// held.
    pub fn set_prefix_cache(&mut self, settings: PrefixSettings) {
        self.prefix = (settings.budget > 0).then(|| PrefixCache::new(settings));
    }

    /// What the prefix cache did, where it is on.
    pub fn prefix_stats(&self) -> Option<PrefixStats> {
        self.prefix.as_ref().map(PrefixCache::stats)
    }

    /// Feeds at most `n` tokens to the model per step (unbounded by default): running
    /// requests take their tokens oldest first, a prompt that does not fit is fed in chunks
    /// over several steps, and a request left without room waits a step.
    pub fn set_max_step_tokens(&mut self, n: usize) -> Result<()> {
        if n == 0 {
            return Err(Error::Invalid("max_step_tokens must be at least 1".into()));
        }
        self.max_step_tokens = n;
        Ok(())
    }

    /// Adds a request; it starts at a following step, once a slot is free.
    pub fn add(&mut self, prompt: &[u32], params: RequestParams) -> Result<RequestId> {
        self.add_constrained(prompt, params, None)
    }

    /// [`Engine::add`], the output held to `constraint` (its tokens masked by it; the request
    /// ends once it is complete, or fails with [`SampleError::Constrained`] if it errs).
    pub fn add_constrained(
        &mut self,
        prompt: &[u32],
        params: RequestParams,
        constraint: Option<Box<dyn Constraint>>,
    ) -> Result<RequestId> {
        if prompt.is_empty() {
            return Err(Error::Invalid("the prompt is empty".into()));
        }
        if let Some(&t) = prompt.iter().find(|&&t| t as usize >= self.vocab) {
            return Err(Error::Invalid(format!("token id {t} is outside the vocabulary of {}", self.vocab)));
        }
        if prompt.len().saturating_add(params.max_new_tokens) > self.max_len {
            return Err(Error::Capacity(format!(
                "prompt of {} tokens plus {} new ones exceeds the maximum of {} tokens",
                prompt.len(),
                params.max_new_tokens,
                self.max_len
            )));
        }
        if params.max_new_tokens == 0 {
            return Err(Error::Invalid("max_new_tokens must be at least 1".into()));
        }
        if params.min_new_tokens > params.max_new_tokens {
            return Err(Error::Invalid(format!(
                "min_new_tokens ({}) must be at most max_new_tokens ({})",
                params.min_new_tokens, params.max_new_tokens
            )));
        }
        if let Some(&t) = params.stop_tokens.iter().find(|&&t| t as usize >= self.vocab) {
            return Err(Error::Invalid(format!("stop token {t} is outside the vocabulary of {}", self.vocab)));
        }
        let sampler = Sampler::new(params.sampling)?;
        let id = self.next_id;
        self.next_id += 1;
        self.requests.insert(
            id,
            Request {
                params,
                sampler,
                constraint,
                pending: prompt.to_vec(),
                seen: Vec::new(),
                generated: 0,
                slot: None,
                cached: 0,
                stops: Vec::new(),
                snapped: 0,
            },
        );
        self.waiting.push_back(id);
        Ok(id)
    }

    /// The model back, with the requests still in the engine dropped (their slots released).
    pub fn into_model(mut self) -> Model<B> {
        for s in self.requests.values().filter_map(|r| r.slot) {
            self.model.release(s);
        }
        self.model
    }

    /// The model, to read (its last profile or expert tally, say).
    pub fn model(&self) -> &Model<B> {
        &self.model
    }

    /// Whether the engine's next steps tally their experts' loads
    /// ([`Model::set_expert_tally`]; read them with [`Model::expert_loads`]).
    pub fn set_expert_tally(&mut self, on: bool) {
        self.model.set_expert_tally(on);
    }

    /// How many requests run at once (the model's state slots).
    pub fn slots(&self) -> usize {
        self.model.slots()
    }

    /// The most tokens (prompt plus generated) one request may hold.
    pub fn max_len(&self) -> usize {
        self.max_len
    }

    /// The vocabulary size: prompt tokens must be below it.
    pub fn vocab(&self) -> usize {
        self.vocab
    }

    /// Whether any request is waiting or running.
    pub fn has_work(&self) -> bool {
        !self.requests.is_empty()
    }

    /// Ends a request early and frees its slot.
    pub fn cancel(&mut self, id: RequestId) -> Result<()> {
        let r = self.requests.remove(&id).ok_or_else(|| Error::Invalid(format!("no request {id}")))?;
        self.waiting.retain(|&w| w != id);
        if let Some(s) = r.slot {
            self.model.release(s);
            self.pool.free(s)?;
        }
        Ok(())
    }

    /// Runs one model step over the running requests and as many waiting ones as there are
    /// free slots (within the step's token bound); returns one token per request whose
    /// pending tokens were all fed.
    pub fn step(&mut self) -> Result<Vec<Event>> {
        while let Some(&id) = self.waiting.front() {
            let Ok(slot) = self.pool.alloc() else { break };
            self.waiting.pop_front();
            self.start(id, slot);
        }
        // Oldest first, each running request takes what is left of the step's token bound.
        let mut room = self.max_step_tokens;
        let mut fed: Vec<(RequestId, usize)> = Vec::new();
        for (&id, r) in &self.requests {
            if r.slot.is_some() && room > 0 {
                let n = r.pending.len().min(room).min(r.stops.first().map_or(usize::MAX, |s| s - r.seen.len()));
                room -= n;
                fed.push((id, n));
            }
        }
        if fed.is_empty() {
            return Ok(Vec::new());
        }
        // A request short of its `min_new_tokens` masks its stop tokens out, a constrained one
        // what its constraint rules out. The masks are made while the device runs the step's
        // forward pass (each constraint walks the vocabulary's trie, tens of microseconds a
        // row), the constraints in parallel; they are lent to the step for that.
        let vocab = self.vocab;
        let mut late: Vec<Option<Masking>> = fed
            .iter()
            .map(|&(id, n)| {
                let r = self.requests.get_mut(&id).expect("ids come from the map");
                let whole = n == r.pending.len();
                let short = r.generated < r.params.min_new_tokens;
                let held = if short { r.params.stop_tokens.clone() } else { Vec::new() };
                (whole && (short || r.constraint.is_some())).then(|| Masking {
                    id,
                    held,
                    constraint: r.constraint.take(),
                })
            })
            .collect();
        let masked = late.iter().any(Option::is_some);
        let mut failed = Vec::new();
        let mut masks = || {
            let made: Vec<(Option<Vec<u32>>, bool)> = late.par_iter_mut().map(|m| Masking::make(m, vocab)).collect();
            failed.extend(late.iter().zip(&made).filter(|(_, m)| m.1).filter_map(|(l, _)| Some(l.as_ref()?.id)));
            made.into_iter().map(|m| m.0).collect()
        };
        let ids: Vec<RequestId> = fed.iter().map(|&(id, _)| id).collect();
        let parts: Vec<Part> = fed
            .iter()
            .map(|&(id, n)| {
                let r = &self.requests[&id];
                Part { slot: r.slot.unwrap_or(-1), computed: r.seen.len(), tokens: &r.pending[..n] }
            })
            .collect();
        // A row for every part; those with prompt tokens left take none of theirs (greedy:
        // the least work).
        let sampling: Vec<_> = fed
            .iter()
            .map(|&(id, n)| {
                let r = &self.requests[&id];
                if n == r.pending.len() {
                    r.sampler.row()
                } else {
                    RowSampling { row: SampleRow::GREEDY, penalties: &[], mask: None }
                }
            })
            .collect();
        let stepped = self.model.step_masked(&parts, &sampling, masked.then_some(&mut masks));
        for m in late.into_iter().flatten() {
            if let Some(r) = self.requests.get_mut(&m.id) {
                r.constraint = m.constraint;
            }
        }
        let picks = match stepped {
            Ok(picks) => picks,
            Err(source) => {
                // The step may have updated some of these requests' states before it failed.
                for id in &ids {
                    self.cancel(*id)?;
                }
                return Err(Error::StepFailed { requests: ids, source: Box::new(source) });
            }
        };
        let mut events = Vec::new();
        // Requests whose slot's state the prefix cache may keep: where their prefill stops for
        // it, at the end of their prompt and at their own end.
        let mut keep = Vec::new();
        for (&(id, n), pick) in fed.iter().zip(picks) {
            let r = self.requests.get_mut(&id).expect("ids come from the map");
            r.seen.extend(r.pending.drain(..n));
            if r.stops.first() == Some(&r.seen.len()) {
                r.stops.remove(0);
                keep.push((id, Kept::Stop));
            }
            if !r.pending.is_empty() {
                continue;
            }
            let accepted = match r.sampler.accept(pick) {
                // A constraint that failed ends its request whatever the sampler made of its mask.
                _ if failed.contains(&id) => Err(SampleError::Constrained),
                Ok(s) => match r.constraint.as_mut().map(|c| c.accept(s.token)) {
                    Some(Err(e)) => {
                        tracing::warn!("request {id}: its output constraint refused token {}: {e}", s.token);
                        Err(SampleError::Constrained)
                    }
                    _ => Ok(s),
                },
                Err(e) => Err(e),
            };
            let event = match accepted {
                Ok(s) => {
                    // A request whose logits gave no token leaves no snapshot of its state.
                    if r.generated == 0 {
                        keep.push((id, Kept::End));
                    }
                    r.generated += 1;
                    r.pending = vec![s.token];
                    let finished = if r.params.stop_tokens.contains(&s.token) {
                        Some(Finish::Stop)
                    } else if r.generated >= r.params.max_new_tokens {
                        Some(Finish::Length)
                    } else if r.constraint.as_ref().is_some_and(|c| c.complete()) {
                        Some(Finish::Stop)
                    } else {
                        None
                    };
                    if finished.is_some() {
                        keep.push((id, Kept::End));
                    }
                    let (logprob, top_logprobs, cached) = (s.logprob, s.top_logprobs, r.cached);
                    Event { id, token: s.token, finished, logprob, top_logprobs, cached }
                }
                Err(e) => Event {
                    id,
                    token: u32::MAX,
                    finished: Some(Finish::Failed(e)),
                    logprob: None,
                    top_logprobs: vec![],
                    cached: r.cached,
                },
            };
            events.push(event);
        }
        keep.dedup_by_key(|k| k.0);
        for (id, why) in keep {
            self.keep(id, why);
        }
        for e in events.iter().filter(|e| e.finished.is_some()) {
            self.cancel(e.id)?;
        }
        Ok(events)
    }

    /// Gives request `id` its slot, restoring the longest prefix of its prompt the prefix cache
    /// holds, and marks where its prefill stops for snapshots.
    fn start(&mut self, id: RequestId, slot: i32) {
        let Some(r) = self.requests.get_mut(&id) else { return };
        r.slot = Some(slot);
        let Some(cache) = self.prefix.as_mut() else { return };
        let restored = match cache.lookup(&r.pending) {
            Some(snap) => match self.model.restore(slot, snap) {
                Ok(()) => snap.len(),
                Err(e) => {
                    tracing::warn!("request {id}: restoring a snapshot of {} tokens failed: {e}", snap.len());
                    self.model.release(slot);
                    0
                }
            },
            None => 0,
        };
        tracing::debug!(id, prompt = r.pending.len(), restored, "prefix cache");
        r.stops = cache.start(&r.pending, restored);
        r.seen.extend(r.pending.drain(..restored));
        (r.cached, r.snapped) = (restored, restored);
    }

    /// Saves request `id`'s slot's state into the prefix cache (for `why`), where the cache
    /// wants it.
    fn keep(&mut self, id: RequestId, why: Kept) {
        let (Some(cache), Some(r)) = (self.prefix.as_mut(), self.requests.get_mut(&id)) else { return };
        let Some(slot) = r.slot else { return };
        if !cache.wants(&r.seen, r.snapped, self.model.snapshot_shape().bytes(r.seen.len()), why) {
            return;
        }
        let start = Instant::now();
        match self.model.save(slot) {
            Ok(snap) => {
                cache.insert(&r.seen, snap, why, start.elapsed());
                r.snapped = r.seen.len();
            }
            Err(e) => tracing::warn!("request {id}: saving its state of {} tokens failed: {e}", r.seen.len()),
        }
    }
}

/// A row's mask in the making: its request, the stop tokens it holds back, its constraint
/// (lent by the request for the step).
struct Masking {
    id: RequestId,
    held: Vec<u32>,
    constraint: Option<Box<dyn Constraint>>,
}

impl Masking {
    /// The row's mask (none for a row without [`Masking`]), and whether its constraint failed.
    fn make(m: &mut Option<Masking>, vocab: usize) -> (Option<Vec<u32>>, bool) {
        let Some(m) = m else { return (None, false) };
        let mut mask = without(vocab, &m.held);
        match m.constraint.as_mut().map(|c| c.restrict(&mut mask)) {
            Some(Err(e)) => {
                tracing::warn!("request {}: its output constraint failed: {e}", m.id);
                (Some(mask), true)
            }
            _ => (Some(mask), false),
        }
    }
}

/// A sampling mask over `vocab` tokens that allows all but `tokens`.
fn without(vocab: usize, tokens: &[u32]) -> Vec<u32> {
    let mut mask = vec![u32::MAX; host::sample::mask_words(vocab)];
    for &t in tokens {
        mask[t as usize / 32] &= !(1 << (t % 32));
    }
    mask
}
