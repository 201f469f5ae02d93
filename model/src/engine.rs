//! The engine: requests in, tokens out. Each step feeds waiting prompts (as prefill
//! sequences) and running requests (one token each, as decode rows) to the model in one
//! batch, samples each request's next token, and frees the slots of finished requests. A bad
//! request is refused when it is added, so it never disturbs the others. A step that fails
//! anyway (out of device memory for a large batch, say) ends the requests that were in it,
//! with [`Error::StepFailed`] naming them, and the engine serves the rest at the next step.

use std::collections::{BTreeMap, VecDeque};

use crate::backend::Backend;
use crate::cache::{Part, SlotPool};
use crate::error::{Error, Result};
use crate::model::Model;
use crate::sampling::{Sampler, SamplingParams};

/// A request's handle.
pub type RequestId = u64;

/// How a request generates.
#[derive(Clone, Debug, PartialEq)]
pub struct RequestParams {
    pub max_new_tokens: usize,
    pub sampling: SamplingParams,
    /// Generation stops after any of these (the checkpoint's end-of-sequence ids, say).
    pub stop_tokens: Vec<u32>,
}

/// Why a request ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Finish {
    /// It produced `max_new_tokens` tokens.
    Length,
    /// It produced a stop token (included in its output).
    Stop,
}

/// One generated token.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Event {
    pub id: RequestId,
    pub token: u32,
    /// Set on the request's last token.
    pub finished: Option<Finish>,
}

struct Request {
    params: RequestParams,
    sampler: Sampler,
    /// Tokens not yet fed to the model (the prompt, then each sampled token).
    pending: Vec<u32>,
    computed: usize,
    generated: usize,
    slot: Option<i32>,
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
        }
    }

    /// Adds a request; it starts at a following step, once a slot is free.
    pub fn add(&mut self, prompt: &[u32], params: RequestParams) -> Result<RequestId> {
        if prompt.is_empty() {
            return Err(Error::Unsupported("the prompt is empty".into()));
        }
        if let Some(&t) = prompt.iter().find(|&&t| t as usize >= self.vocab) {
            return Err(Error::Unsupported(format!("token id {t} is outside the vocabulary of {}", self.vocab)));
        }
        if prompt.len() + params.max_new_tokens > self.max_len {
            return Err(Error::Capacity(format!(
                "prompt of {} tokens plus {} new ones exceeds the maximum of {} tokens",
                prompt.len(),
                params.max_new_tokens,
                self.max_len
            )));
        }
        if params.max_new_tokens == 0 {
            return Err(Error::Unsupported("max_new_tokens must be at least 1".into()));
        }
        let sampler = Sampler::new(params.sampling)?;
        let id = self.next_id;
        self.next_id += 1;
        self.requests
            .insert(id, Request { params, sampler, pending: prompt.to_vec(), computed: 0, generated: 0, slot: None });
        self.waiting.push_back(id);
        Ok(id)
    }

    /// Whether any request is waiting or running.
    pub fn has_work(&self) -> bool {
        !self.requests.is_empty()
    }

    /// Ends a request early and frees its slot.
    pub fn cancel(&mut self, id: RequestId) -> Result<()> {
        let r = self.requests.remove(&id).ok_or_else(|| Error::Unsupported(format!("no request {id}")))?;
        self.waiting.retain(|&w| w != id);
        if let Some(s) = r.slot {
            self.model.release(s);
            self.pool.free(s)?;
        }
        Ok(())
    }

    /// Runs one model step over every running request and as many waiting ones as there are
    /// free slots; returns one token per request that took part.
    pub fn step(&mut self) -> Result<Vec<Event>> {
        while let Some(&id) = self.waiting.front() {
            let Ok(slot) = self.pool.alloc() else { break };
            self.waiting.pop_front();
            if let Some(r) = self.requests.get_mut(&id) {
                r.slot = Some(slot);
            }
        }
        let ids: Vec<RequestId> = self.requests.iter().filter(|(_, r)| r.slot.is_some()).map(|(&id, _)| id).collect();
        if ids.is_empty() {
            return Ok(Vec::new());
        }
        let parts: Vec<Part> = ids
            .iter()
            .map(|id| {
                let r = &self.requests[id];
                Part { slot: r.slot.unwrap_or(-1), computed: r.computed, tokens: &r.pending }
            })
            .collect();
        let logits = match self.model.step(&parts) {
            Ok(logits) => logits,
            Err(source) => {
                // The step may have updated some of these requests' states before it failed.
                for id in &ids {
                    self.cancel(*id)?;
                }
                return Err(Error::StepFailed { requests: ids, source: Box::new(source) });
            }
        };
        let mut events = Vec::new();
        for (id, logits) in ids.iter().zip(logits) {
            let r = self.requests.get_mut(id).expect("ids come from the map");
            r.computed += r.pending.len();
            let token = r.sampler.sample(&logits)?;
            r.generated += 1;
            r.pending = vec![token];
            let finished = if r.params.stop_tokens.contains(&token) {
                Some(Finish::Stop)
            } else if r.generated >= r.params.max_new_tokens {
                Some(Finish::Length)
            } else {
                None
            };
            events.push(Event { id: *id, token, finished });
        }
        for e in events.iter().filter(|e| e.finished.is_some()) {
            self.cancel(e.id)?;
        }
        Ok(events)
    }
}
