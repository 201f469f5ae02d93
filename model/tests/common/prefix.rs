//! The prefix cache's checks, on any backend (tests/prefix.rs runs them on the CPU,
//! tests/cuda.rs on the GPU): a slot's state saved and restored into another slot continues
//! exactly as the saved slot does, and the engine with the cache gives the greedy tokens it
//! gives without it, restoring what it should, for two conversations of 8 turns, a shared
//! 2000-token system prompt with unique suffixes of 1 to 700 tokens, a hit that ends where a
//! snapshot does, an evicted snapshot, two requests sharing a prefix at once, and a request
//! cancelled mid-prefill. Each check returns the count of tokens (or logits) it compared.

use std::collections::BTreeMap;

use model::backend::Backend;
use model::cache::Part;
use model::engine::{Engine, Event, RequestId, RequestParams};
use model::layout::Layout;
use model::model::Model;
use model::prefix::PrefixSettings;
use model::reference::{RefState, Reference};
use model::sampling::SamplingParams;
use nemotron_rs::{Rng, assert_close};

use super::{argmax, open};

/// Makes a fresh backend.
pub type NewBackend<'a, B> = &'a dyn Fn() -> B;

/// The fixture with `slots` slots of `max_len` tokens.
pub fn model<B: Backend>(backend: B, slots: usize, max_len: usize) -> Model<B> {
    let (config, ck) = open();
    let layout = Layout::new(&config, &ck).unwrap();
    Model::load(backend, &config, &layout, slots, max_len).unwrap()
}

/// `n` seeded tokens of the fixture's vocabulary (64), none 0.
fn tokens(rng: &mut Rng, n: usize) -> Vec<u32> {
    (0..n).map(|_| 1 + (rng.next_u64() % 63) as u32).collect()
}

fn f64s(v: &[f32]) -> Vec<f64> {
    v.iter().map(|&x| f64::from(x)).collect()
}

/// A prompt of 600 tokens saved after `split` of them (each side of the scan's 128-token
/// chunks, one token, all but one) and restored into a slot that held another prompt: its
/// rest gives bit for bit the logits the saved slot gives (and so do 8 decode steps after it,
/// and a prefill after a state saved after those steps),
/// and the whole prompt's logits within `band` (atol and rtol) of it, while the state of a
/// prompt one token apart, restored instead, gives other logits (the bit-exact comparison sees
/// it). A snapshot does not go into a slot out of range or a model whose slots hold fewer
/// tokens.
pub fn restored_state_continues_as_the_saved_slot_would<B: Backend>(backend: NewBackend<B>, band: f64) -> usize {
    let mut m = model(backend(), 3, 1024);
    let mut rng = Rng::new(37);
    let prompt = tokens(&mut rng, 600);
    let other = tokens(&mut rng, 50);
    let whole = m.step(&[Part { slot: 0, computed: 0, tokens: &prompt }]).unwrap().remove(0);
    let (mut compared, mut at300) = (0, Vec::new());
    for split in [1, 127, 128, 129, 300, 599] {
        m.release(1);
        m.step(&[Part { slot: 1, computed: 0, tokens: &prompt[..split] }]).unwrap();
        let snap = m.save(1).unwrap();
        assert_eq!(snap.len(), split);
        assert_eq!(snap.bytes(), m.snapshot_shape().bytes(split));
        m.release(2);
        m.step(&[Part { slot: 2, computed: 0, tokens: &other }]).unwrap();
        m.restore(2, &snap).unwrap();
        let rest = &prompt[split..];
        let saved = m.step(&[Part { slot: 1, computed: split, tokens: rest }]).unwrap().remove(0);
        let restored = m.step(&[Part { slot: 2, computed: split, tokens: rest }]).unwrap().remove(0);
        assert_eq!(restored, saved, "split at {split}");
        if split == 300 {
            at300.clone_from(&restored);
        }
        compared += assert_close(&format!("split at {split}"), &f64s(&restored), &f64s(&whole), band, band);
        for step in 0..8 {
            let t = [1 + (step * 7 + split) as u32 % 63];
            let at = 600 + step;
            let parts = [Part { slot: 1, computed: at, tokens: &t }, Part { slot: 2, computed: at, tokens: &t }];
            let out = m.step(&parts).unwrap();
            assert_eq!(out[0], out[1], "split at {split}, decode step {step}");
            compared += out[0].len();
        }
    }
    assert_eq!(compared, 6 * 9 * 64);
    // A state saved after decode steps (slot 1's, 608 tokens: the prompt and 8 decoded) restores
    // as well: into slot 2, after another prompt there, a prefill of 40 more tokens on each
    // gives the same logits bit for bit.
    m.release(2);
    m.step(&[Part { slot: 2, computed: 0, tokens: &other }]).unwrap();
    let decoded = m.save(1).unwrap();
    assert_eq!(decoded.len(), 608);
    m.restore(2, &decoded).unwrap();
    let more = tokens(&mut rng, 40);
    let on = |m: &mut Model<B>, slot| m.step(&[Part { slot, computed: 608, tokens: &more }]).unwrap().remove(0);
    let (saved, restored) = (on(&mut m, 1), on(&mut m, 2));
    assert_eq!(restored, saved, "a state saved after decode steps");
    compared += restored.len();
    // The comparison sees the state: a snapshot of another prompt of as many tokens (one token
    // changed) restored in its place gives other logits than the right one.
    let mut changed = prompt[..300].to_vec();
    changed[150] = changed[150] % 63 + 1;
    m.release(2);
    m.step(&[Part { slot: 2, computed: 0, tokens: &changed }]).unwrap();
    let wrong = m.save(2).unwrap();
    m.restore(2, &wrong).unwrap();
    let rest = &prompt[300..];
    let got = m.step(&[Part { slot: 2, computed: 300, tokens: rest }]).unwrap().remove(0);
    let gap = got.iter().zip(&at300).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
    println!("a state one token apart moves the logits by up to {gap}");
    assert!(gap > 0.0, "a state one token apart gives the same logits");
    let snap = m.save(1).unwrap();
    assert!(m.restore(3, &snap).unwrap_err().to_string().contains("slot 3 is out of range (0..3)"));
    let err = model(backend(), 1, 64).restore(0, &snap).unwrap_err().to_string();
    assert!(err.contains("a snapshot of 648 tokens") && err.contains("64 tokens"), "{err}");
    compared
}

/// Greedy, each token with its two likeliest tokens' log-probabilities (their gap is their
/// logits' gap: [`agree`] reads ties from it).
fn greedy(n: usize) -> RequestParams {
    let sampling = SamplingParams { top_logprobs: 2, ..SamplingParams::greedy() };
    RequestParams { max_new_tokens: n, sampling, stop_tokens: vec![], min_new_tokens: 0 }
}

const BUDGET: usize = 1 << 30;

/// An engine on 2 slots of 4096 tokens, its snapshots at least 16 tokens apart in `budget`
/// bytes (none at 0).
fn engine<B: Backend>(backend: NewBackend<B>, budget: usize) -> Engine<B> {
    let mut e = Engine::new(model(backend(), 2, 4096));
    e.set_prefix_cache(PrefixSettings { budget, min_tokens: 16, turn_start: None });
    e
}

/// A request's tokens, each with its two likeliest tokens and their log-probabilities, and
/// the prompt tokens it restored.
struct Answer {
    tokens: Vec<u32>,
    top: Vec<Vec<(u32, f32)>>,
    restored: usize,
}

/// Runs until every request ends: each request's answer.
fn run<B: Backend>(e: &mut Engine<B>) -> BTreeMap<RequestId, Answer> {
    let answer = |evs: Vec<Event>| Answer {
        tokens: evs.iter().map(|e| e.token).collect(),
        top: evs.iter().map(|e| e.top_logprobs.clone()).collect(),
        restored: evs.last().map_or(0, |e| e.cached),
    };
    super::events(e).into_iter().map(|(id, evs)| (id, answer(evs))).collect()
}

/// Serves `prompt` alone.
fn serve<B: Backend>(e: &mut Engine<B>, prompt: &[u32], n: usize) -> Answer {
    let id = e.add(prompt, greedy(n)).unwrap();
    run(e).remove(&id).unwrap()
}

/// A backend to make and the widest logit gap and router margin a greedy flip may take
/// ([`agree`]).
pub struct Case<'a, B> {
    pub backend: NewBackend<'a, B>,
    /// 0 where the cached and uncached paths compute the same logits (the CPU backend's scan
    /// is token by token whatever the split); on CUDA the band of chunked against whole
    /// prefill (the chunked scan's sums start at the restored position).
    pub tie: f32,
    /// 0 where the paths compute the same logits; on CUDA the router margin (of the exact
    /// reference, [`model::reference::RefState::router_margin`]) below which the two paths'
    /// noise may route the flipped token's step to other experts ([`agree`] then checks that
    /// it did).
    pub router_tie: f64,
}

impl<B> Clone for Case<'_, B> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<B> Copy for Case<'_, B> {}

/// `got` (with the cache) gives `want`'s tokens (without it), but for a flip at a near-tie: at
/// the first token they differ, each engine's runner-up is the other's pick, within
/// `case.tie` of its own pick (their log-probabilities' gap, which is their logits'); or the
/// exact reference, fed the prompt and the tokens before, routes that step within
/// `case.router_tie` of routing it otherwise, and each engine's two likeliest tokens are
/// within `case.tie` of the reference's log-probabilities, one engine's routed as the
/// reference routes, the other's routed otherwise. Returns the tokens that agree.
fn agree<B: Backend>(case: Case<B>, prompt: &[u32], got: &Answer, want: &Answer) -> usize {
    let what = format!("a prompt of {} tokens ({} restored)", prompt.len(), got.restored);
    assert_eq!(got.tokens.len(), want.tokens.len(), "{what}");
    let Some(i) = got.tokens.iter().zip(&want.tokens).position(|(a, b)| a != b) else { return got.tokens.len() };
    let (a, b) = (got.tokens[i], want.tokens[i]);
    let what = format!("{what}, token {i}: {a} with the cache ({:?}), {b} without ({:?})", got.top[i], want.top[i]);
    let tied = |top: &[(u32, f32)], pick: u32, other: u32| matches!(top, [(p, lp), (o, lo)] if *p == pick && *o == other && lp - lo <= case.tie);
    if tied(&got.top[i], a, b) && tied(&want.top[i], b, a) {
        println!("{what}: a near-tie");
        return i;
    }
    assert!(case.router_tie > 0.0, "{what}: not a near-tie (within {})", case.tie);
    let reference = fixture_reference();
    let tokens = [prompt, &got.tokens[..i]].concat();
    let (last, before) = tokens.split_last().unwrap();
    let (routed, otherwise, margin) = both_routings(&reference, fed(&reference, before), *last);
    let near = |top: &[(u32, f32)], lp: &[f64]| {
        top.iter().all(|&(t, l)| (f64::from(l) - lp[t as usize]).abs() <= f64::from(case.tie))
    };
    let (g, w) = (&got.top[i], &want.top[i]);
    let explained = (near(w, &routed) && near(g, &otherwise)) || (near(g, &routed) && near(w, &otherwise));
    let at = |lp: &[f64]| [a, b].map(|t| (t, lp[t as usize] as f32));
    assert!(
        margin < case.router_tie && explained,
        "{what}: not a near-tie (within {}), nor the router's (margin {margin:.2e}, within {:.0e}; the \
         reference routed {:?}, otherwise {:?})",
        case.tie,
        case.router_tie,
        at(&routed),
        at(&otherwise)
    );
    println!("{what}: a near-tie of the router (margin {margin:.2e}; routed otherwise {:?})", at(&otherwise));
    i
}

/// The fixture's exact reference.
fn fixture_reference() -> Reference {
    let (config, ck) = open();
    Reference::new(&config, &Layout::new(&config, &ck).unwrap()).unwrap()
}

/// The reference's state after `tokens`, fed from the start.
fn fed(reference: &Reference, tokens: &[u32]) -> RefState {
    let mut state = reference.new_state();
    for &t in tokens {
        reference.step(&mut state, t).unwrap();
    }
    state
}

/// The reference's log-probabilities after `state` is fed `last`, routed as it routes and with
/// its router nearest to a tie routing `last` otherwise; and that router's margin.
fn both_routings(reference: &Reference, mut state: RefState, last: u32) -> (Vec<f64>, Vec<f64>, f64) {
    let mut flipped = state.clone();
    let log_softmax = |l: Vec<f64>| {
        let top = l.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let lse = top + l.iter().map(|x| (x - top).exp()).sum::<f64>().ln();
        l.iter().map(|x| x - lse).collect::<Vec<f64>>()
    };
    let routed = log_softmax(reference.step(&mut state, last).unwrap());
    let otherwise = log_softmax(reference.step_routed_otherwise(&mut flipped, last).unwrap());
    (routed, otherwise, state.router_margin())
}

/// [`agree`]'s router near-tie on the flip the H100 saw (the eviction check's prompt of 306
/// tokens, its fourth token; `case` as on CUDA): answers made of the exact reference's two
/// routings of that step (each one's two likeliest tokens and log-probabilities) are taken
/// either way round, and refused with one log-probability 0.1 off or a router tie under the
/// step's margin. Returns the answers compared.
pub fn router_near_ties_are_checked_against_the_reference<B: Backend>(case: Case<B>) -> usize {
    let mut rng = Rng::new(400);
    let a = tokens(&mut rng, 300);
    let prompt: Vec<u32> = a.iter().copied().chain([5, 6, 7, 5, 6, 7]).collect();
    let top2 = |lp: &[f64]| {
        let mut idx: Vec<u32> = (0..lp.len() as u32).collect();
        idx.sort_by(|&x, &y| lp[y as usize].total_cmp(&lp[x as usize]));
        idx[..2].iter().map(|&t| (t, lp[t as usize] as f32)).collect::<Vec<_>>()
    };
    // The reference's greedy tokens, then its two routings of the fourth one's step.
    let reference = fixture_reference();
    let (&prompt_last, before) = prompt.split_last().unwrap();
    let (mut state, mut last, mut picks) = (fed(&reference, before), prompt_last, vec![]);
    for _ in 0..3 {
        let logits = reference.step(&mut state, last).unwrap();
        last = argmax(&logits);
        picks.push(last);
    }
    let (routed, otherwise, margin) = both_routings(&reference, state, last);
    assert!(margin < case.router_tie, "the step's margin {margin}");
    let answer = |lp: &[f64], shift: f32| {
        let mut top = vec![vec![]; 3];
        top.push(top2(lp).into_iter().map(|(t, l)| (t, l + shift)).collect());
        Answer { tokens: picks.iter().copied().chain([top[3][0].0]).collect(), top, restored: 300 }
    };
    let (got, want) = (answer(&otherwise, 0.0), answer(&routed, 0.0));
    assert_ne!(got.tokens[3], want.tokens[3], "the routings pick the same token");
    assert_eq!(agree(case, &prompt, &got, &want), 3);
    assert_eq!(agree(case, &prompt, &want, &got), 3);
    let refused = |case: Case<B>, got: &Answer| {
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| agree(case, &prompt, got, &want))).is_err()
    };
    assert!(refused(case, &answer(&otherwise, 0.1)), "a log-probability 0.1 off");
    assert!(refused(Case { router_tie: margin / 2.0, ..case }, &got), "a router tie under the margin");
    4
}

/// Serves `prompt` on the engine with the cache and on the one without: the same tokens
/// ([`agree`]); the cached engine's and the prompt tokens it restored.
fn both<B: Backend>(
    case: Case<B>,
    (cached, cold): (&mut Engine<B>, &mut Engine<B>),
    prompt: &[u32],
    n: usize,
) -> (Vec<u32>, usize) {
    let answer = serve(cached, prompt, n);
    agree(case, prompt, &answer, &serve(cold, prompt, n));
    (answer.tokens, answer.restored)
}

/// Two conversations of eight turns, taken in turn on two slots (so each turn's slot last held
/// the other conversation), each prompt the last one, its answer and a new message: every turn
/// after the first restores the last turn's prompt and answer (but the answer's last token,
/// never fed), and the answers are those without the cache.
pub fn conversations_restore_each_turn<B: Backend>(case: Case<B>) -> usize {
    let backend = case.backend;
    let (mut cached, mut cold) = (engine(backend, BUDGET), engine(backend, 0));
    assert_eq!(cold.prefix_stats(), None);
    let mut rng = Rng::new(8);
    let mut prompts = [tokens(&mut rng, 200), tokens(&mut rng, 150)];
    let mut want_cached = [0, 0];
    let mut compared = 0;
    for turn in 0..8 {
        for (c, prompt) in prompts.iter_mut().enumerate() {
            let (answer, restored) = both(case, (&mut cached, &mut cold), prompt, 24);
            assert_eq!(restored, want_cached[c], "conversation {c}, turn {turn}");
            compared += answer.len();
            want_cached[c] = prompt.len() + answer.len() - 1;
            prompt.extend(&answer);
            let n = 20 + (rng.next_u64() % 60) as usize;
            prompt.extend(tokens(&mut rng, n));
        }
    }
    let s = cached.prefix_stats().unwrap();
    assert_eq!((s.hits, s.misses), (14, 2), "{s:?}");
    compared
}

/// A 2000-token system prompt, then unique suffixes of 1 to 700 tokens: the second request
/// stops its prefill where it parts from the first (a branch point) for a snapshot, and every
/// later one restores all 2000 shared tokens; the answers are those without the cache.
pub fn shared_system_prompt_is_restored_whatever_follows<B: Backend>(case: Case<B>) -> usize {
    let backend = case.backend;
    let (mut cached, mut cold) = (engine(backend, BUDGET), engine(backend, 0));
    let mut rng = Rng::new(2000);
    let system = tokens(&mut rng, 2000);
    let mut restored = Vec::new();
    for (i, n) in [700, 1, 64, 7, 300, 129, 2].into_iter().enumerate() {
        let mut prompt = system.clone();
        // Each suffix starts with a token of its own: the prompts part at 2000.
        prompt.push(1 + i as u32);
        prompt.extend(tokens(&mut rng, n - 1));
        restored.push(both(case, (&mut cached, &mut cold), &prompt, 4).1);
    }
    assert_eq!(restored, [0, 0, 2000, 2000, 2000, 2000, 2000]);
    7 * 4
}

/// A prompt saved at its end: the same prompt and one more token restores all of it (the rest
/// is a single token, a decode row); the prompt itself cannot (its last token must be fed), so
/// it stops one short for a snapshot there, which the next copy of it restores.
pub fn hits_that_end_where_a_snapshot_does<B: Backend>(case: Case<B>) -> usize {
    let backend = case.backend;
    let (mut cached, mut cold) = (engine(backend, BUDGET), engine(backend, 0));
    let p = tokens(&mut Rng::new(300), 300);
    let longer: Vec<u32> = p.iter().copied().chain([9]).collect();
    let restored: Vec<usize> =
        [&p, &longer, &p, &p].iter().map(|q| both(case, (&mut cached, &mut cold), q, 4).1).collect();
    assert_eq!(restored, [0, 300, 0, 299]);
    4 * 4
}

/// A budget of one snapshot: the second prompt's evicts the first's, whose continuation then
/// prefills from scratch (and still gives the tokens without the cache), stopping where it
/// parts from the first prompt (a branch point) for a snapshot that evicts the second's; the
/// next continuation restores it.
pub fn evicted_snapshot_falls_back_to_prefill<B: Backend>(case: Case<B>) -> usize {
    let backend = case.backend;
    let budget = model(backend(), 1, 64).snapshot_shape().bytes(400);
    let (mut cached, mut cold) = (engine(backend, budget), engine(backend, 0));
    let mut rng = Rng::new(400);
    let (a, b) = (tokens(&mut rng, 300), tokens(&mut rng, 300));
    let more = |p: &[u32]| p.iter().copied().chain([5, 6, 7]).collect::<Vec<u32>>();
    let prompts = [a.clone(), b, more(&a), more(&more(&a))];
    let restored: Vec<usize> = prompts.iter().map(|q| both(case, (&mut cached, &mut cold), q, 4).1).collect();
    assert_eq!(restored, [0, 0, 0, 300]);
    let s = cached.prefix_stats().unwrap();
    assert_eq!((s.evictions, s.entries), (2, 1), "{s:?}");
    assert!(s.bytes <= budget, "{s:?}");
    4 * 4
}

/// Two requests added together after a shared prefix was saved both restore it, each into its
/// own slot, and go on as without the cache.
pub fn two_requests_share_a_snapshot_at_once<B: Backend>(case: Case<B>) -> usize {
    let backend = case.backend;
    let (mut cached, mut cold) = (engine(backend, BUDGET), engine(backend, 0));
    let mut rng = Rng::new(2);
    let p = tokens(&mut rng, 256);
    serve(&mut cached, &p, 2);
    let prompts: Vec<Vec<u32>> = (0..2).map(|_| p.iter().copied().chain(tokens(&mut rng, 40)).collect()).collect();
    let ids: Vec<RequestId> = prompts.iter().map(|q| cached.add(q, greedy(12)).unwrap()).collect();
    let out = run(&mut cached);
    let mut compared = 0;
    for (q, id) in prompts.iter().zip(&ids) {
        assert_eq!(out[id].restored, 256);
        compared += agree(case, q, &out[id], &serve(&mut cold, q, 12));
    }
    compared
}

/// A request cancelled after the first of its prompt's chunks leaves nothing behind: the same
/// prompt again gives the tokens without the cache.
pub fn request_cancelled_mid_prefill_leaves_no_snapshot<B: Backend>(case: Case<B>) -> usize {
    let backend = case.backend;
    let (mut cached, mut cold) = (engine(backend, BUDGET), engine(backend, 0));
    cached.set_max_step_tokens(100).unwrap();
    let p = tokens(&mut Rng::new(600), 600);
    let id = cached.add(&p, greedy(4)).unwrap();
    assert!(cached.step().unwrap().is_empty());
    cached.cancel(id).unwrap();
    assert_eq!(cached.prefix_stats().unwrap().saved, 0);
    both(case, (&mut cached, &mut cold), &p, 4).0.len()
}
