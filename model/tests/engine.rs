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
    Engine::new(Model::load(Cpu, &config, &layout, slots, 64).unwrap())
}

fn greedy(n: usize, stop: Vec<u32>) -> RequestParams {
    RequestParams { max_new_tokens: n, sampling: SamplingParams::greedy(), stop_tokens: stop }
}

/// Runs until every request ends; returns each request's tokens and how it finished.
fn run<B: Backend>(e: &mut Engine<B>) -> BTreeMap<RequestId, (Vec<u32>, Option<Finish>)> {
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

/// The CPU backend, except that embedding more than `limit` tokens at once fails, as a step
/// too large for the device's memory would. (Every other operation delegates: the trait's
/// signatures, written out once more.)
struct Flaky {
    limit: usize,
}

mod flaky {
    use half::bf16;
    use model::backend::{Backend, In, MoeWeights, Out, PrefillSeqs};
    use model::config::{AttentionConfig, MambaConfig, MoeConfig};
    use model::cpu::{Cpu, CpuWeight};
    use model::layout::{Linear, Mlp};
    use model::{Error, Result};

    type Heads<'a> = (&'a Vec<f32>, &'a Vec<f32>, &'a Vec<f32>);

    /// The same weights, as the CPU backend's.
    fn moe(w: &MoeWeights<super::Flaky>) -> MoeWeights<Cpu> {
        let copy = |w: &(CpuWeight, CpuWeight)| w.clone();
        MoeWeights {
            gate: w.gate.clone(),
            score_bias: w.score_bias.clone(),
            experts: w.experts.iter().map(copy).collect(),
            shared: w.shared.as_ref().map(copy),
        }
    }

    impl Backend for super::Flaky {
        type Buf = Vec<bf16>;
        type Buf32 = Vec<f32>;
        type Weight = CpuWeight;
        type Experts = Vec<(CpuWeight, CpuWeight)>;

        fn upload(&self, v: &[bf16]) -> Result<Vec<bf16>> {
            Cpu.upload(v)
        }
        fn upload32(&self, v: &[f32]) -> Result<Vec<f32>> {
            Cpu.upload32(v)
        }
        fn zeros(&self, n: usize) -> Result<Vec<bf16>> {
            Cpu.zeros(n)
        }
        fn zeros32(&self, n: usize) -> Result<Vec<f32>> {
            Cpu.zeros32(n)
        }
        fn download(&self, b: &Vec<bf16>) -> Result<Vec<bf16>> {
            Cpu.download(b)
        }
        fn weight(&self, l: &Linear) -> Result<CpuWeight> {
            Cpu.weight(l)
        }
        fn experts(&self, list: &[Mlp]) -> Result<Self::Experts> {
            Cpu.experts(list)
        }
        fn embed(&self, table: &Vec<bf16>, width: usize, tokens: &[u32], out: Out<Vec<bf16>>) -> Result<()> {
            if tokens.len() > self.limit {
                return Err(Error::Capacity(format!("{} tokens do not fit (simulated)", tokens.len())));
            }
            Cpu.embed(table, width, tokens, out)
        }
        fn rms_norm(
            &self,
            x: In<Vec<bf16>>,
            w: &Vec<bf16>,
            r: usize,
            c: usize,
            eps: f32,
            y: Out<Vec<bf16>>,
        ) -> Result<()> {
            Cpu.rms_norm(x, w, r, c, eps, y)
        }
        #[allow(clippy::too_many_arguments)]
        fn gated_norm(
            &self,
            x: In<Vec<bf16>>,
            z: In<Vec<bf16>>,
            w: &Vec<bf16>,
            r: usize,
            c: usize,
            g: usize,
            eps: f32,
            y: Out<Vec<bf16>>,
        ) -> Result<()> {
            Cpu.gated_norm(x, z, w, r, c, g, eps, y)
        }
        fn linear(&self, x: In<Vec<bf16>>, rows: usize, w: &CpuWeight, y: Out<Vec<bf16>>) -> Result<()> {
            Cpu.linear(x, rows, w, y)
        }
        fn add(&self, h: &mut Vec<bf16>, x: &Vec<bf16>, n: usize) -> Result<()> {
            Cpu.add(h, x, n)
        }
        fn relu2(&self, x: &mut Vec<bf16>, n: usize) -> Result<()> {
            Cpu.relu2(x, n)
        }
        #[allow(clippy::too_many_arguments)]
        fn conv_decode(
            &self,
            c: &MambaConfig,
            x: In<Vec<bf16>>,
            w: &Vec<bf16>,
            b: Option<&Vec<bf16>>,
            st: &mut Vec<bf16>,
            slots: &[i32],
            y: Out<Vec<bf16>>,
        ) -> Result<()> {
            Cpu.conv_decode(c, x, w, b, st, slots, y)
        }
        #[allow(clippy::too_many_arguments)]
        fn conv_prefill(
            &self,
            c: &MambaConfig,
            x: In<Vec<bf16>>,
            w: &Vec<bf16>,
            b: Option<&Vec<bf16>>,
            st: &mut Vec<bf16>,
            seqs: &PrefillSeqs,
            y: Out<Vec<bf16>>,
        ) -> Result<()> {
            Cpu.conv_prefill(c, x, w, b, st, seqs, y)
        }
        #[allow(clippy::too_many_arguments)]
        fn ssm_decode(
            &self,
            c: &MambaConfig,
            xbc: In<Vec<bf16>>,
            dt: In<Vec<bf16>>,
            heads: Heads,
            st: &mut Vec<f32>,
            slots: &[i32],
            y: Out<Vec<bf16>>,
        ) -> Result<()> {
            Cpu.ssm_decode(c, xbc, dt, heads, st, slots, y)
        }
        #[allow(clippy::too_many_arguments)]
        fn ssm_prefill(
            &self,
            c: &MambaConfig,
            xbc: In<Vec<bf16>>,
            dt: In<Vec<bf16>>,
            heads: Heads,
            st: &mut Vec<f32>,
            seqs: &PrefillSeqs,
            y: Out<Vec<bf16>>,
        ) -> Result<()> {
            Cpu.ssm_prefill(c, xbc, dt, heads, st, seqs, y)
        }
        fn moe(
            &self,
            c: &MoeConfig,
            x: In<Vec<bf16>>,
            rows: usize,
            w: &MoeWeights<Self>,
            y: Out<Vec<bf16>>,
        ) -> Result<()> {
            Cpu.moe(c, x, rows, &moe(w), y)
        }
        #[allow(clippy::too_many_arguments)]
        fn attention(
            &self,
            c: &AttentionConfig,
            q: In<Vec<bf16>>,
            k: In<Vec<bf16>>,
            v: In<Vec<bf16>>,
            cache: (&mut Vec<bf16>, &mut Vec<bf16>),
            max_len: usize,
            seqs: (&[usize], &[i32], &[usize]),
            y: Out<Vec<bf16>>,
        ) -> Result<()> {
            Cpu.attention(c, q, k, v, cache, max_len, seqs, y)
        }
    }
}

/// A step too large to run (here: a 40-token prompt beside a decode row, when at most 16
/// tokens fit) ends the requests in it with an error naming them; the engine then serves a
/// later request as if nothing had happened (transformers' greedy tokens).
#[test]
fn a_failing_step_ends_its_requests_and_the_engine_goes_on() {
    let (config, ck) = open();
    let layout = Layout::new(&config, &ck).unwrap();
    let mut e = Engine::new(Model::load(Flaky { limit: 16 }, &config, &layout, 2, 64).unwrap());
    let running = e.add(&[3, 4, 5], greedy(8, vec![])).unwrap();
    assert_eq!(e.step().unwrap().len(), 1);
    let big = e.add(&[7; 40], greedy(2, vec![])).unwrap();
    let err = e.step().unwrap_err();
    assert!(matches!(&err, model::Error::StepFailed { requests, .. } if *requests == vec![running, big]), "{err}");
    assert!(err.to_string().contains("41 tokens do not fit"), "{err}");
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
/// step fits (the backend refuses to embed more than 5 tokens at once), and the three
/// requests on two slots still get transformers' greedy tokens.
#[test]
fn a_step_token_bound_feeds_prompts_in_chunks() {
    let (config, ck) = open();
    let layout = Layout::new(&config, &ck).unwrap();
    let mut e = Engine::new(Model::load(Flaky { limit: 5 }, &config, &layout, 2, 64).unwrap());
    assert!(e.set_max_step_tokens(0).unwrap_err().to_string().contains("at least 1"));
    e.set_max_step_tokens(5).unwrap();
    let cases = cases();
    let ids: Vec<RequestId> = cases.iter().map(|c| e.add(&c.prompt, greedy(8, vec![])).unwrap()).collect();
    let out = run(&mut e);
    for (c, id) in cases.iter().zip(&ids) {
        assert_eq!(out[id], (c.greedy.clone(), Some(Finish::Length)), "request {id}");
    }
}
