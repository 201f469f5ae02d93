//! The model's code path on the CPU backend (bf16 activations, f32 SSM state), against the
//! transformers fixture and the f64 reference, batched and split steps against single ones,
//! and the per-step counters of which kernels ran.

mod common;

use common::{argmax, cases, open};
use host::sample::RowSampling;
use kernels_gpu::sample::SampleRow;
use model::cache::Part;
use model::config::{Config, LayerKind};
use model::cpu::Cpu;
use model::layout::Layout;
use model::model::{Model, StepCounters};
use model::profile::{Group, Part as P, Stage};
use model::reference::Reference;
use nemotron_rs::assert_close;

fn f64s(v: &[f32]) -> Vec<f64> {
    v.iter().map(|&x| f64::from(x)).collect()
}

/// bf16 activations through 6 layers against float32/f64 computation: the measured gap is
/// printed; the band allows bf16's 2^-8 relative rounding compounded over the layers.
const ATOL: f64 = 0.05;
const RTOL: f64 = 0.02;

#[test]
fn cpu_backend_matches_transformers_and_reference() {
    let (config, ck) = open();
    let layout = Layout::new(&config, &ck).unwrap();
    let reference = Reference::new(&config, &layout).unwrap();
    let mut model = Model::load(Cpu::default(), &config, &layout, 4, 64).unwrap();
    let (mut compared, mut matched, mut total) = (0, 0, 0);
    for (i, case) in cases().iter().enumerate() {
        let slot = i as i32;
        let got = model.step(&[Part { slot, computed: 0, tokens: &case.prompt }]).unwrap().remove(0);
        let mut st = reference.new_state();
        let want: Vec<f64> = case.prompt.iter().map(|&t| reference.step(&mut st, t).unwrap()).last().unwrap();
        let gap = got.iter().zip(&want).map(|(g, w)| (f64::from(*g) - w).abs()).fold(0.0, f64::max);
        println!("prompt {i}: max |bf16 CPU backend - f64 reference| = {gap:.3e}");
        compared +=
            assert_close(&format!("prompt {i} vs transformers"), &f64s(&got), case.logits.last().unwrap(), ATOL, RTOL);
        compared += assert_close(&format!("prompt {i} vs f64 reference"), &f64s(&got), &want, ATOL, RTOL);
        let mut next = argmax(&got);
        for (n, &g) in (case.prompt.len()..).zip(&case.greedy) {
            matched += usize::from(next == g);
            total += 1;
            next = argmax(&model.step(&[Part { slot, computed: n, tokens: &[g] }]).unwrap().remove(0));
        }
    }
    println!("CPU backend: {compared} logits compared, {matched}/{total} greedy tokens as transformers");
    assert!(matched * 10 >= total * 9, "greedy tokens diverge from transformers: {matched}/{total}");
}

/// One step with every prompt as a prefill, then decode steps for all of them at once: the
/// same logits as each prompt alone (operations are row-independent on the CPU, so exactly).
#[test]
fn batched_steps_equal_single_ones() {
    let (config, ck) = open();
    let layout = Layout::new(&config, &ck).unwrap();
    let cases = cases();
    let mut single = Model::load(Cpu::default(), &config, &layout, 4, 64).unwrap();
    let mut batched = Model::load(Cpu::default(), &config, &layout, 4, 64).unwrap();
    // Slots in a different order in the batch.
    let slot = |i: usize| 3 - i as i32;
    let parts: Vec<Part> =
        cases.iter().enumerate().map(|(i, c)| Part { slot: slot(i), computed: 0, tokens: &c.prompt }).collect();
    let b = batched.step(&parts).unwrap();
    assert_eq!(
        batched.counters(),
        StepCounters { conv_forwards: 2, chunk_scans: 2, attention_calls: 1, moe_calls: 2, ..Default::default() }
    );
    for (i, c) in cases.iter().enumerate() {
        let s = single.step(&[Part { slot: slot(i), computed: 0, tokens: &c.prompt }]).unwrap().remove(0);
        assert_eq!(b[i], s, "prompt {i}: batched prefill");
    }
    let mut len: Vec<usize> = cases.iter().map(|c| c.prompt.len()).collect();
    for step in 0..3 {
        let toks: Vec<[u32; 1]> = (0..cases.len()).map(|i| [(7 * step + i) as u32]).collect();
        let parts: Vec<Part> =
            (0..cases.len()).map(|i| Part { slot: slot(i), computed: len[i], tokens: &toks[i] }).collect();
        let b = batched.step(&parts).unwrap();
        assert_eq!(
            batched.counters(),
            StepCounters { conv_updates: 2, state_updates: 2, attention_calls: 1, moe_calls: 2, ..Default::default() }
        );
        for i in 0..cases.len() {
            let s = single.step(&[parts[i].clone()]).unwrap().remove(0);
            assert_eq!(b[i], s, "prompt {i}: batched decode step {step}");
            len[i] += 1;
        }
    }
}

/// A prompt fed in two parts (the second continuing from the slot's state) against one part;
/// and a fresh one-token request runs as a prefill, not a decode.
#[test]
fn split_prefill_and_fresh_one_token_requests() {
    let (config, ck) = open();
    let layout = Layout::new(&config, &ck).unwrap();
    let prompt = &cases()[2].prompt;
    let mut a = Model::load(Cpu::default(), &config, &layout, 2, 64).unwrap();
    let whole = a.step(&[Part { slot: 0, computed: 0, tokens: prompt }]).unwrap().remove(0);
    a.step(&[Part { slot: 1, computed: 0, tokens: &prompt[..17] }]).unwrap();
    let split = a.step(&[Part { slot: 1, computed: 17, tokens: &prompt[17..] }]).unwrap().remove(0);
    assert_eq!(a.counters().chunk_scans, 2, "a continuing multi-token part is a prefill");
    // The split stores the SSM state in f32 midway; the whole carries it in f64.
    assert_close("split prefill", &f64s(&split), &f64s(&whole), 1e-2, 1e-2);
    a.release(0);
    a.step(&[Part { slot: 0, computed: 0, tokens: &[5] }]).unwrap();
    assert_eq!(
        a.counters(),
        StepCounters { conv_forwards: 2, chunk_scans: 2, attention_calls: 1, moe_calls: 2, ..Default::default() }
    );
}

#[test]
fn loading_reports_progress_per_layer() {
    let (config, ck) = open();
    let layout = Layout::new(&config, &ck).unwrap();
    let mut seen = Vec::new();
    Model::load_with_progress(Cpu::default(), &config, &layout, 1, 8, &mut |done, total| seen.push((done, total)))
        .unwrap();
    assert_eq!(seen, (1..=6).map(|i| (i, 6)).collect::<Vec<_>>());
}

#[test]
fn bad_steps_are_errors() {
    let (config, ck) = open();
    let layout = Layout::new(&config, &ck).unwrap();
    let mut m = Model::load(Cpu::default(), &config, &layout, 2, 8).unwrap();
    let err = |m: &mut Model<Cpu>, parts: &[Part]| m.step(parts).unwrap_err().to_string();
    assert!(err(&mut m, &[Part { slot: 2, computed: 0, tokens: &[1] }]).contains("slot 2 is out of range"));
    assert!(
        err(&mut m, &[Part { slot: 0, computed: 0, tokens: &[1] }, Part { slot: 0, computed: 0, tokens: &[2] }])
            .contains("used twice")
    );
    assert!(err(&mut m, &[Part { slot: 0, computed: 3, tokens: &[1] }]).contains("slot 0 holds the state of 0"));
    assert!(
        err(&mut m, &[Part { slot: 0, computed: 0, tokens: &[64] }]).contains("token id 64 is outside the vocabulary")
    );
    assert!(err(&mut m, &[Part { slot: 0, computed: 0, tokens: &[1; 9] }]).contains("exceeds the KV cache's 8"));
    assert!(err(&mut m, &[Part { slot: 0, computed: 0, tokens: &[] }]).contains("no new tokens"));
}

/// The stages a profiled step runs, in order: the embedding, each layer's parts (Mamba's for
/// prefill sequences, or for decode rows), the LM head, the sampling where it samples.
fn stages(config: &Config, decode: bool, sampled: bool) -> Vec<Stage> {
    use LayerKind::*;
    let mut want = vec![Stage::Embed];
    for (index, &kind) in config.layers.iter().enumerate() {
        let parts: &[P] = match kind {
            Mamba if decode => &[P::InProj, P::Decode, P::OutProj, P::Residual],
            Mamba => &[P::InProj, P::Conv, P::Scan, P::GatedNorm, P::OutProj, P::Residual],
            Moe => &[P::Moe, P::Residual],
            Attention => &[P::Qkv, P::Attend, P::OProj, P::Residual],
            Mlp => &[P::Mlp, P::Residual],
        };
        want.extend(parts.iter().map(|&part| Stage::Layer { index, kind, part }));
    }
    want.push(Stage::Head);
    want.extend(sampled.then_some(Stage::Sample));
    want
}

/// A profiled step returns what an unprofiled one does and times each stage once, in order;
/// the groups count each kind's layers; with profiling off a step leaves the last profile.
#[test]
fn profiled_steps_time_every_stage_and_change_nothing() {
    let (config, ck) = open();
    let layout = Layout::new(&config, &ck).unwrap();
    let prompt = &cases()[0].prompt;
    let mut plain = Model::load(Cpu::default(), &config, &layout, 2, 64).unwrap();
    let mut profiled = Model::load(Cpu::default(), &config, &layout, 2, 64).unwrap();
    assert!(profiled.profile().is_none());
    profiled.set_profiling(true);
    let prefill = [Part { slot: 0, computed: 0, tokens: prompt }];
    assert_eq!(profiled.step(&prefill).unwrap(), plain.step(&prefill).unwrap());
    let p = profiled.profile().expect("a profiled step's profile").clone();
    let got: Vec<Stage> = p.spans.iter().map(|s| s.stage).collect();
    assert_eq!(got, stages(&config, false, false));
    assert!(p.spans.iter().all(|s| s.ms.is_finite() && s.ms >= 0.0), "{p:?}");
    let groups = p.by_group();
    let kinds: Vec<Group> = groups.iter().map(|g| g.group).collect();
    assert_eq!(kinds.first(), Some(&Group::Embed));
    assert_eq!(kinds.last(), Some(&Group::Head));
    for g in &groups[1..groups.len() - 1] {
        let Group::Layers(kind) = g.group else { panic!("{:?} between the embedding and the head", g.group) };
        assert_eq!(g.layers, config.layers.iter().filter(|&&k| k == kind).count(), "{kind:?} layers");
    }
    let kinds_in_config = LAYER_KINDS.iter().filter(|k| config.layers.contains(k)).count();
    assert_eq!(groups.len(), 2 + kinds_in_config, "{kinds:?}");
    assert!((groups.iter().map(|g| g.ms).sum::<f64>() - p.total_ms()).abs() < 1e-9);

    // A decode step, sampled: the decode mixer's part, then the sampling.
    let n = prompt.len();
    let decode = [Part { slot: 0, computed: n, tokens: &[3] }];
    let greedy = [RowSampling { row: SampleRow::GREEDY, penalties: &[], mask: None }];
    assert_eq!(profiled.step_sampled(&decode, &greedy).unwrap(), plain.step_sampled(&decode, &greedy).unwrap());
    let d = profiled.profile().unwrap().clone();
    assert_eq!(d.spans.iter().map(|s| s.stage).collect::<Vec<_>>(), stages(&config, true, true));

    profiled.set_profiling(false);
    let next = [Part { slot: 0, computed: n + 1, tokens: &[5] }];
    assert_eq!(profiled.step(&next).unwrap(), plain.step(&next).unwrap());
    assert_eq!(profiled.profile(), Some(&d), "an unprofiled step leaves the last profile");
}

const LAYER_KINDS: [LayerKind; 4] = [LayerKind::Mamba, LayerKind::Moe, LayerKind::Attention, LayerKind::Mlp];
