//! The engine on the CPU backend and the transformers fixture: requests served concurrently
//! and in turn give the tokens transformers gives, stop tokens end them, bad requests are
//! refused without disturbing the others.

mod common;

use std::collections::BTreeMap;

use common::{cases, open};
use model::cpu::Cpu;
use model::engine::{Engine, Event, Finish, RequestId, RequestParams};
use model::layout::Layout;
use model::model::Model;
use model::sampling::SamplingParams;

fn engine(slots: usize) -> Engine<Cpu> {
    let (config, ck) = open();
    let layout = Layout::new(&config, &ck).unwrap();
    Engine::new(Model::load(Cpu, &config, &layout, slots, 64).unwrap())
}

fn greedy(n: usize, stop: Vec<u32>) -> RequestParams {
    RequestParams { max_new_tokens: n, sampling: SamplingParams::greedy(), stop_tokens: stop }
}

/// Runs until every request ends; returns each request's tokens and how it finished.
fn run(e: &mut Engine<Cpu>) -> BTreeMap<RequestId, (Vec<u32>, Option<Finish>)> {
    let mut out: BTreeMap<RequestId, (Vec<u32>, Option<Finish>)> = BTreeMap::new();
    let mut steps = 0;
    while e.has_work() {
        for Event { id, token, finished } in e.step().unwrap() {
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
    assert!(err(&mut e, &[], greedy(4, vec![])).contains("the prompt is empty"));
    assert!(err(&mut e, &[1, 64], greedy(4, vec![])).contains("token id 64 is outside the vocabulary of 64"));
    assert!(err(&mut e, &[1; 60], greedy(5, vec![])).contains("exceeds the maximum of 64 tokens"));
    assert!(err(&mut e, &[1], greedy(0, vec![])).contains("max_new_tokens must be at least 1"));
    let bad = RequestParams {
        sampling: SamplingParams { temperature: -1.0, ..SamplingParams::greedy() },
        ..greedy(4, vec![])
    };
    assert!(err(&mut e, &[1], bad).contains("temperature"));
    let cancelled = e.add(&[9, 9], greedy(4, vec![])).unwrap();
    e.step().unwrap();
    e.cancel(cancelled).unwrap();
    assert!(e.cancel(cancelled).is_err());
    let out = run(&mut e);
    assert_eq!(out.keys().copied().collect::<Vec<_>>(), vec![good]);
    assert_eq!(out[&good].0.len(), 3, "4 tokens in all, one produced before the cancel");
}
