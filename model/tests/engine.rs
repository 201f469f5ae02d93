//! The engine on the CPU backend and the transformers fixture: requests served concurrently
//! and in turn give the tokens transformers gives, stop tokens end them, bad requests are
//! refused without disturbing the others, a failing step ends only its own requests, and a
//! bound on a step's tokens feeds prompts in chunks.

mod common;

use std::collections::BTreeMap;

use common::{cases, open};
use model::backend::Backend;
use model::cpu::Cpu;
use model::engine::{Engine, Event, Finish, RequestId, RequestParams};
use model::layout::Layout;
use model::model::Model;
use model::sampling::SamplingParams;

fn engine(slots: usize) -> Engine<Cpu> {
    let (config, ck) = open();
    let layout = Layout::new(&config, &ck).unwrap();
    Engine::new(Model::load(Cpu::default(), &config, &layout, slots, 64).unwrap())
}

fn greedy(n: usize, stop: Vec<u32>) -> RequestParams {
    RequestParams { max_new_tokens: n, sampling: SamplingParams::greedy(), stop_tokens: stop, min_new_tokens: 0 }
}

/// Runs until every request ends; returns each request's tokens and how it finished.
fn run<B: Backend>(e: &mut Engine<B>) -> BTreeMap<RequestId, (Vec<u32>, Option<Finish>)> {
    let mut out: BTreeMap<RequestId, (Vec<u32>, Option<Finish>)> = BTreeMap::new();
    let mut steps = 0;
    while e.has_work() {
        for Event { id, token, finished, .. } in e.step().unwrap() {
            let o = out.entry(id).or_default();
            o.0.push(token);
            o.1 = finished;
        }
        steps += 1;
        assert!(steps < 100, "the engine does not finish");
    }
    out
}

#[test]
fn requests_in_turn_and_together_give_transformers_tokens() {
    let cases = cases();
    // Two slots for three requests: the third waits for a slot.
    let mut e = engine(2);
    let ids: Vec<RequestId> = cases.iter().map(|c| e.add(&c.prompt, greedy(8, vec![])).unwrap()).collect();
    let out = run(&mut e);
    let mut matched = 0;
    for (c, id) in cases.iter().zip(&ids) {
        assert_eq!(out[id].1, Some(Finish::Length));
        assert_eq!(out[id].0, c.greedy, "request {id}");
        matched += c.greedy.len();
    }
    println!("engine: {matched}/{matched} tokens as transformers, 3 requests on 2 slots");
}

#[test]
fn stop_tokens_end_a_request() {
    let cases = cases();
    let c = &cases[1];
    let mut e = engine(1);
    let id = e.add(&c.prompt, greedy(8, vec![c.greedy[2]])).unwrap();
    let out = run(&mut e);
    let first_stop = c.greedy.iter().position(|&t| t == c.greedy[2]).unwrap();
    assert_eq!(out[&id], (c.greedy[..=first_stop].to_vec(), Some(Finish::Stop)));
}

#[test]
fn bad_requests_are_refused_and_others_go_on() {
    let mut e = engine(2);
    let good = e.add(&[3, 4, 5], greedy(4, vec![])).unwrap();
    let err = |e: &mut Engine<Cpu>, p: &[u32], params| e.add(p, params).unwrap_err().to_string();
    assert_eq!(err(&mut e, &[], greedy(4, vec![])), "invalid: the prompt is empty");
    assert_eq!(err(&mut e, &[1, 64], greedy(4, vec![])), "invalid: token id 64 is outside the vocabulary of 64");
    assert!(err(&mut e, &[1; 60], greedy(5, vec![])).contains("exceeds the maximum of 64 tokens"));
    assert_eq!(err(&mut e, &[1], greedy(0, vec![])), "invalid: max_new_tokens must be at least 1");
    let g = SamplingParams::greedy();
    for (sampling, named) in [
        (SamplingParams { temperature: -1.0, ..g }, "temperature"),
        (SamplingParams { temperature: f32::NAN, ..g }, "temperature"),
        (SamplingParams { top_p: Some(0.0), ..g }, "top_p"),
        (SamplingParams { top_p: Some(1.5), ..g }, "top_p"),
        (SamplingParams { top_k: Some(0), ..g }, "top_k"),
        (SamplingParams { min_p: Some(-0.5), ..g }, "min_p"),
        (SamplingParams { min_p: Some(2.0), ..g }, "min_p"),
        (SamplingParams { repetition_penalty: 0.0, ..g }, "repetition_penalty"),
        (SamplingParams { frequency_penalty: f32::INFINITY, ..g }, "frequency_penalty"),
    ] {
        let msg = err(&mut e, &[1], RequestParams { sampling, ..greedy(4, vec![]) });
        assert!(msg.contains(named), "{sampling:?}: {msg}");
    }
    let cancelled = e.add(&[9, 9], greedy(4, vec![])).unwrap();
    e.step().unwrap();
    e.cancel(cancelled).unwrap();
    assert!(e.cancel(cancelled).is_err());
    let out = run(&mut e);
    assert_eq!(out.keys().copied().collect::<Vec<_>>(), vec![good]);
    assert_eq!(out[&good].0.len(), 3, "4 tokens in all, one produced before the cancel");
}

/// A step too large to run (here: a 40-token prompt beside a decode row, when at most 16
/// tokens fit) ends the requests in it with an error naming them; the engine then serves a
/// later request as if nothing had happened (transformers' greedy tokens).
#[test]
fn a_failing_step_ends_its_requests_and_the_engine_goes_on() {
    let (config, ck) = open();
    let layout = Layout::new(&config, &ck).unwrap();
    let mut e = Engine::new(Model::load(Cpu::limited(16), &config, &layout, 2, 64).unwrap());
    let running = e.add(&[3, 4, 5], greedy(8, vec![])).unwrap();
    assert_eq!(e.step().unwrap().len(), 1);
    let big = e.add(&[7; 40], greedy(2, vec![])).unwrap();
    let err = e.step().unwrap_err();
    assert!(matches!(&err, model::Error::StepFailed { requests, .. } if *requests == vec![running, big]), "{err}");
    assert!(err.to_string().contains("a step of 41 tokens does not fit"), "{err}");
    assert!(!e.has_work() && e.cancel(running).is_err() && e.cancel(big).is_err());
    let cases = cases();
    let c = &cases[0];
    let id = e.add(&c.prompt, greedy(c.greedy.len(), vec![])).unwrap();
    let mut out = Vec::new();
    while e.has_work() {
        out.extend(e.step().unwrap().into_iter().map(|ev| (ev.id, ev.token)));
    }
    assert_eq!(out, c.greedy.iter().map(|&t| (id, t)).collect::<Vec<_>>());
}

/// At most 5 tokens per step: the prompts (up to 40 tokens) go in over several steps, every
/// step fits (the backend refuses steps of more than 5 tokens), and the three
/// requests on two slots still get transformers' greedy tokens.
#[test]
fn a_step_token_bound_feeds_prompts_in_chunks() {
    let (config, ck) = open();
    let layout = Layout::new(&config, &ck).unwrap();
    let mut e = Engine::new(Model::load(Cpu::limited(5), &config, &layout, 2, 64).unwrap());
    assert!(e.set_max_step_tokens(0).unwrap_err().to_string().contains("at least 1"));
    e.set_max_step_tokens(5).unwrap();
    let cases = cases();
    let ids: Vec<RequestId> = cases.iter().map(|c| e.add(&c.prompt, greedy(8, vec![])).unwrap()).collect();
    let out = run(&mut e);
    for (c, id) in cases.iter().zip(&ids) {
        assert_eq!(out[id], (c.greedy.clone(), Some(Finish::Length)), "request {id}");
    }
}

#[test]
fn nan_logits_end_only_their_request() {
    let n = common::nan_logits_end_only_their_request(Cpu::default());
    println!("CPU: {n} greedy tokens beside a request with NaN logits, as transformers");
}

/// `min_new_tokens`: the first tokens are never stop tokens (the sampler's mask holds them
/// back): with transformers' greedy first token as the stop token, the request takes
/// transformers' next best instead, and none of its first `min_new_tokens` is a stop token;
/// without it the request stops at once. More than `max_new_tokens`, or a stop token past the
/// vocabulary, is refused.
#[test]
fn min_new_tokens_hold_the_stop_tokens_back() {
    let mut checked = 0;
    for c in &cases() {
        let stop = c.greedy[0];
        let last = c.logits.last().unwrap();
        let next_best = (0..last.len()).filter(|&t| t as u32 != stop).max_by(|&a, &b| last[a].total_cmp(&last[b]));
        let mut e = engine(1);
        let free = e.add(&c.prompt, greedy(6, vec![stop])).unwrap();
        assert_eq!(run(&mut e)[&free], (vec![stop], Some(Finish::Stop)));
        let held = e.add(&c.prompt, RequestParams { min_new_tokens: 4, ..greedy(6, vec![stop]) }).unwrap();
        let (tokens, finish) = run(&mut e).remove(&held).unwrap();
        assert_eq!(Some(tokens[0] as usize), next_best, "prompt {:?}", c.prompt);
        assert!(tokens.len() >= 4 && !tokens[..4].contains(&stop), "{tokens:?}");
        assert!(finish == Some(Finish::Length) || tokens.last() == Some(&stop), "{tokens:?} {finish:?}");
        checked += 1;
    }
    assert_eq!(checked, 3);
    let mut e = engine(1);
    let err = |e: &mut Engine<Cpu>, p| e.add(&[1], p).unwrap_err().to_string();
    let over = err(&mut e, RequestParams { min_new_tokens: 5, ..greedy(4, vec![]) });
    assert_eq!(over, "invalid: min_new_tokens (5) must be at most max_new_tokens (4)");
    let outside = err(&mut e, greedy(4, vec![3, 64]));
    assert_eq!(outside, "invalid: stop token 64 is outside the vocabulary of 64");
}
