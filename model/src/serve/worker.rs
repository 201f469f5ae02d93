//! The engine thread: the one owner of the [`Engine`] (its backend need not be `Send`: the
//! thread builds the model itself). It loops: takes the new requests off a channel and adds
//! them, drops the requests whose client went away (their receiver dropped) with
//! [`Engine::cancel`], runs a step, and sends each event to its request's channel. New
//! requests so join the running batch at the next step. It blocks on the channel only while
//! the engine is idle.
//!
//! Admission is bounded: the [`EngineHandle`] counts the requests it handed over and not yet
//! done with (running or waiting for a slot in the engine); past the slots plus `max_queue`
//! it refuses ([`Busy`]), and the HTTP layer answers 429.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};

use tokio::sync::mpsc::{UnboundedReceiver, UnboundedSender, unbounded_channel};

use crate::backend::Backend;
use crate::engine::{Constraint, Engine, Event, RequestId, RequestParams};
use crate::error::{Error, Result};
use crate::prefix::PrefixStats;

/// What the engine thread sends a request: its tokens, or why it ended without one.
#[derive(Debug)]
pub enum Update {
    Token(Event),
    /// The engine refused the request or its step failed; the request is over.
    Error {
        message: String,
        client: bool,
    },
}

/// The engine is full: its slots and the queue are taken.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Busy {
    pub limit: usize,
}

/// One admitted request's place in the count; given back when dropped.
struct Permit(Arc<AtomicUsize>);

impl Drop for Permit {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

struct Job {
    prompt: Vec<u32>,
    params: RequestParams,
    /// Its structured output's constraint (taken when the engine adds it).
    constraint: Option<Box<dyn Constraint>>,
    out: UnboundedSender<Update>,
    _permit: Permit,
}

/// What the loaded model offers.
#[derive(Debug, Clone, Copy)]
pub struct ModelInfo {
    pub slots: usize,
    /// Prompt plus generated tokens of one request.
    pub max_len: usize,
    pub vocab: usize,
}

/// Given to the engine thread's start function: takes the engine it built (of any backend).
pub struct Starter {
    jobs: mpsc::Receiver<Job>,
    ready: mpsc::Sender<Result<ModelInfo>>,
    prefix: Arc<Mutex<Option<PrefixStats>>>,
}

impl Starter {
    /// Reports the engine (or why there is none) to [`EngineHandle::spawn`] and serves
    /// requests on it until every handle is dropped.
    pub fn run<B: Backend>(self, engine: Result<Engine<B>>) {
        match engine {
            Ok(engine) => {
                let info = ModelInfo { slots: engine.slots(), max_len: engine.max_len(), vocab: engine.vocab() };
                if self.ready.send(Ok(info)).is_ok() {
                    run(engine, self.jobs, &self.prefix);
                }
            }
            Err(e) => {
                let _ = self.ready.send(Err(e));
            }
        }
    }
}

/// The server side's handle on the engine thread (cheap to clone).
#[derive(Clone)]
pub struct EngineHandle {
    jobs: mpsc::Sender<Job>,
    admitted: Arc<AtomicUsize>,
    limit: usize,
    /// The engine's prefix cache counts after its last step (`None`: no cache).
    prefix: Arc<Mutex<Option<PrefixStats>>>,
    pub info: ModelInfo,
}

/// Requests admitted at once: the slots plus the queue, all of `usize` where they would pass it
/// (`--max-queue 18446744073709551615` admits without bound; a wrapped sum admitted almost
/// none).
fn admission_limit(slots: usize, max_queue: usize) -> usize {
    slots.saturating_add(max_queue)
}

impl EngineHandle {
    /// Starts the engine thread, which runs `start` to build the engine there (the backend
    /// opened, the weights uploaded) and hand it to [`Starter::run`]; returns once it has,
    /// or with its error. Up to the engine's slots plus `max_queue` requests are admitted at
    /// once.
    pub fn spawn(max_queue: usize, start: impl FnOnce(Starter) + Send + 'static) -> Result<EngineHandle> {
        let (jobs, rx) = mpsc::channel::<Job>();
        let (ready, ready_rx) = mpsc::channel::<Result<ModelInfo>>();
        let prefix = Arc::new(Mutex::new(None));
        let starter = Starter { jobs: rx, ready, prefix: prefix.clone() };
        std::thread::Builder::new()
            .name("engine".into())
            .spawn(move || start(starter))
            .map_err(|e| Error::Unsupported(format!("starting the engine thread: {e}")))?;
        let info = ready_rx
            .recv()
            .map_err(|_| Error::Unsupported("the engine thread ended while loading the model".into()))??;
        Ok(EngineHandle {
            jobs,
            admitted: Arc::new(AtomicUsize::new(0)),
            limit: admission_limit(info.slots, max_queue),
            prefix,
            info,
        })
    }

    /// Hands a request to the engine thread; its tokens come on the returned channel, which
    /// the request's client holds: dropping it cancels the request.
    pub fn submit(
        &self,
        prompt: Vec<u32>,
        params: RequestParams,
        constraint: Option<Box<dyn Constraint>>,
    ) -> Result<UnboundedReceiver<Update>, Busy> {
        let limit = self.limit;
        self.admitted
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| (n < limit).then_some(n + 1))
            .map_err(|_| Busy { limit })?;
        let permit = Permit(self.admitted.clone());
        let (out, rx) = unbounded_channel();
        let job = Job { prompt, params, constraint, out, _permit: permit };
        if let Err(mpsc::SendError(job)) = self.jobs.send(job) {
            let _ = job.out.send(Update::Error { message: "the engine thread has stopped".into(), client: false });
        }
        Ok(rx)
    }

    /// Requests admitted and not yet done (running or waiting for a slot).
    pub fn admitted(&self) -> usize {
        self.admitted.load(Ordering::Acquire)
    }

    /// What the engine's prefix cache has done (`None` without one).
    pub fn prefix_stats(&self) -> Option<PrefixStats> {
        *self.prefix.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// The engine thread's loop; returns when every handle is gone and no request is left. After
/// each step it publishes the prefix cache's counts to `prefix` (its evictions logged at debug
/// level: under a full cache they come every few steps).
fn run<B: Backend>(mut engine: Engine<B>, jobs: mpsc::Receiver<Job>, prefix: &Mutex<Option<PrefixStats>>) {
    let mut live: HashMap<RequestId, Job> = HashMap::new();
    let admit = |engine: &mut Engine<B>, live: &mut HashMap<RequestId, Job>, mut job: Job| match engine.add_constrained(
        &job.prompt,
        job.params.clone(),
        job.constraint.take(),
    ) {
        Ok(id) => {
            tracing::debug!(id, prompt = job.prompt.len(), "request added");
            live.insert(id, job);
        }
        Err(e) => {
            let _ = job.out.send(Update::Error { message: e.to_string(), client: true });
        }
    };
    loop {
        if live.is_empty() {
            match jobs.recv() {
                Ok(job) => admit(&mut engine, &mut live, job),
                Err(_) => return,
            }
        }
        while let Ok(job) = jobs.try_recv() {
            admit(&mut engine, &mut live, job);
        }
        live.retain(|&id, job| {
            if !job.out.is_closed() {
                return true;
            }
            tracing::debug!(id, "client gone: request cancelled");
            if let Err(e) = engine.cancel(id) {
                tracing::warn!(id, "cancelling: {e}");
            }
            false
        });
        if live.is_empty() {
            continue;
        }
        let stepped = engine.step();
        let stats = engine.prefix_stats();
        let mut published = prefix.lock().unwrap_or_else(|e| e.into_inner());
        if let (Some(s), Some(was)) = (stats, *published)
            && s.evictions > was.evictions
        {
            tracing::debug!(
                evictions = s.evictions - was.evictions,
                snapshots = s.entries,
                mib = s.bytes >> 20,
                "prefix cache full: least recently used snapshots evicted"
            );
        }
        *published = stats;
        drop(published);
        match stepped {
            Ok(events) => {
                for e in events {
                    let (id, done) = (e.id, e.finished.is_some());
                    if let Some(job) = live.get(&id) {
                        let _ = job.out.send(Update::Token(e));
                    }
                    if done {
                        tracing::debug!(id, "request finished");
                        live.remove(&id);
                    }
                }
            }
            Err(Error::StepFailed { requests, source }) => {
                tracing::error!("a step failed: {source}; ending requests {requests:?}");
                for id in requests {
                    if let Some(job) = live.remove(&id) {
                        let _ = job
                            .out
                            .send(Update::Error { message: format!("the model step failed: {source}"), client: false });
                    }
                }
            }
            Err(e) => {
                tracing::error!("the engine failed: {e}; ending every request");
                for (id, job) in live.drain() {
                    let _ = engine.cancel(id);
                    let _ = job.out.send(Update::Error { message: format!("the engine failed: {e}"), client: false });
                }
            }
        }
    }
}

/// A stand-in for the engine thread, for the server's tests ([`super::scripted`]): `reply`
/// gets each request's prompt, parameters and token channel in turn and sends what it likes (a
/// request's place in the admission count is given back when `reply` returns).
#[cfg(feature = "scripted")]
pub(super) fn scripted(
    info: ModelInfo,
    max_queue: usize,
    mut reply: impl FnMut(Vec<u32>, RequestParams, UnboundedSender<Update>) + Send + 'static,
) -> EngineHandle {
    let (jobs, rx) = mpsc::channel::<Job>();
    std::thread::spawn(move || {
        for Job { prompt, params, out, _permit, .. } in rx {
            reply(prompt, params, out);
        }
    });
    EngineHandle {
        jobs,
        admitted: Arc::new(AtomicUsize::new(0)),
        limit: admission_limit(info.slots, max_queue),
        prefix: Arc::new(Mutex::new(None)),
        info,
    }
}

#[cfg(test)]
mod tests {
    use super::admission_limit;

    #[test]
    fn the_admission_limit_does_not_wrap() {
        assert_eq!(admission_limit(16, 64), 80);
        assert_eq!(admission_limit(16, usize::MAX - 16), usize::MAX);
        assert_eq!(admission_limit(16, usize::MAX - 15), usize::MAX);
        assert_eq!(admission_limit(16, usize::MAX), usize::MAX);
        assert_eq!(admission_limit(0, 0), 0);
    }
}
