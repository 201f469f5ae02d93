//! The engine's request API on the CPU backend and the fixture: any sequence of requests
//! (token ids, lengths and sampling values as given, in or out of range), steps and cancels
//! gives tokens or errors, never a panic or a hang; a request the engine takes produces at
//! most its `max_new_tokens` tokens, all inside the vocabulary.
#![no_main]

use std::collections::HashMap;

use arbitrary::Arbitrary;
use libfuzzer_sys::fuzz_target;
use model::cpu::Cpu;
use model::engine::{Engine, RequestParams};
use model::layout::Layout;
use model::model::Model;
use model::sampling::SamplingParams;
use model::weights::Checkpoint;

#[derive(Arbitrary, Debug)]
enum Op {
    Add {
        prompt: Vec<u32>,
        max_new: u16,
        temperature: f32,
        top_k: Option<u32>,
        top_p: Option<f32>,
        min_p: Option<f32>,
        penalties: (f32, f32, f32),
        seed: u64,
        top_logprobs: u8,
    },
    Step,
    Cancel(u8),
    Bound(u16),
}

fuzz_target!(|ops: Vec<Op>| {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../tests/fixtures/tiny_nemotron_h");
    let config = model::Config::from_dir(dir.as_ref()).unwrap();
    let ck = Checkpoint::open(dir.as_ref()).unwrap();
    let layout = Layout::trusting_values(&config, &ck).unwrap();
    let mut e = Engine::new(Model::load(Cpu::default(), &config, &layout, 2, 48).unwrap());
    let mut asked: HashMap<u64, usize> = HashMap::new();
    let mut got: HashMap<u64, usize> = HashMap::new();
    // Every step feeds at least one token of a running request: the steps the requests need.
    let (mut steps, mut budget) = (0, 0);
    for op in ops.into_iter().take(64) {
        match op {
            Op::Add { prompt, max_new, temperature, top_k, top_p, min_p, penalties, seed, top_logprobs } => {
                let sampling = SamplingParams {
                    temperature,
                    top_k: top_k.map(|k| k as usize),
                    top_p,
                    min_p,
                    repetition_penalty: penalties.0,
                    presence_penalty: penalties.1,
                    frequency_penalty: penalties.2,
                    seed,
                    logprobs: top_logprobs % 2 == 1,
                    top_logprobs: usize::from(top_logprobs % 24),
                };
                // Half the tokens held to a mask (of no stop tokens: it allows all, so every
                // request still runs to its max_new).
                let max_new_tokens = usize::from(max_new);
                let params =
                    RequestParams { max_new_tokens, sampling, stop_tokens: vec![], min_new_tokens: max_new_tokens / 2 };
                let prompt = &prompt[..prompt.len().min(64)];
                if let Ok(id) = e.add(prompt, params) {
                    asked.insert(id, usize::from(max_new));
                    budget += prompt.len() + usize::from(max_new);
                }
            }
            Op::Step => {
                steps += 1;
                for ev in e.step().unwrap_or_default() {
                    assert!(ev.token < 64 || ev.token == u32::MAX, "token {} outside the vocabulary", ev.token);
                    *got.entry(ev.id).or_default() += 1;
                }
            }
            Op::Cancel(id) => {
                let _ = e.cancel(u64::from(id));
            }
            Op::Bound(n) => {
                let _ = e.set_max_step_tokens(usize::from(n));
            }
        }
    }
    // What is left finishes within the steps its tokens need.
    let limit = steps + budget + 1;
    while e.has_work() && steps < limit {
        steps += 1;
        for ev in e.step().unwrap_or_default() {
            *got.entry(ev.id).or_default() += 1;
        }
    }
    assert!(!e.has_work(), "the engine did not finish its requests in {limit} steps");
    for (id, n) in got {
        assert!(n <= asked[&id], "request {id}: {n} tokens for {} asked", asked[&id]);
    }
});
