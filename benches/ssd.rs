//! `cargo bench --bench ssd`: the chunked scan (all three launches) at NemotronH geometry, f32
//! state: one sequence of 512/4096/16384 tokens with an initial state, and 8 sequences of 512
//! (fresh) in one call. Criterion's throughput line is tokens/s; bytes: x, B, C, dt read and y
//! written once, each sequence's state read (where it has one) and written.

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use half::bf16;
use host::Rows;
use host::batch::Prefill;
use host::ssd::{SsdPlan, ssd_scan};
use host::ssm::{SsmHeads, SsmInputs, SsmShape};
use nemotron_rs::{BenchGpu, Rng};
use std::time::Duration;

fn benches(c: &mut Criterion) {
    let Some(b) = BenchGpu::open() else { return };
    let gpu = &b.gpu;
    let mut rng = Rng::new(11);
    let mut group = c.benchmark_group("ssd");
    group.sample_size(10).measurement_time(Duration::from_secs(3)).warm_up_time(Duration::from_millis(300));
    let shape = SsmShape::new(64, 64, 8, 128);
    let (w, gn) = (shape.width(), shape.groups * shape.state_size);
    let stride = w + 2 * gn;
    let dt_bias = gpu.upload(&vec![0.5f32; 64]).unwrap();
    let a = gpu.upload(&vec![-1.0f32; 64]).unwrap();
    let d = gpu.upload(&vec![1.0f32; 64]).unwrap();
    let heads = SsmHeads { dt_bias: &dt_bias, a: &a, d: Some(&d) };
    for (nseq, len) in [(1usize, 512usize), (1, 4096), (1, 16384), (8, 512)] {
        let tokens = nseq * len;
        let name = if nseq == 1 {
            format!("scan/f32/64x64x128/t{tokens}")
        } else {
            format!("scan/f32/64x64x128/{nseq}x{len}")
        };
        if !BenchGpu::selected(&name) {
            continue;
        }
        let bytes = tokens * 2 * (w + 2 * gn + 64 + w) + (nseq + usize::from(nseq == 1)) * shape.slot_len() * 4;
        // Inputs, outputs and states rotated over enough sets for a cold L2 (the plan's
        // workspaces, written before they are read, shared).
        let sets = BenchGpu::cold_sets(bytes);
        let xbc: Vec<_> = (0..sets).map(|_| gpu.upload(&rng.bf16s(tokens * stride, -1.0, 1.0)).unwrap()).collect();
        let dt: Vec<_> = (0..sets).map(|_| gpu.upload(&rng.bf16s(tokens * 64, -3.0, 0.0)).unwrap()).collect();
        let mut y: Vec<_> = (0..sets).map(|_| gpu.zeros::<bf16>(tokens * w).unwrap()).collect();
        let mut state: Vec<_> = (0..sets).map(|_| gpu.zeros::<f32>(nseq * shape.slot_len()).unwrap()).collect();
        let slots: Vec<i32> = (0..nseq as i32).collect();
        let seqs = Prefill::new(gpu, &vec![len; nseq], &slots, &vec![nseq == 1; nseq], nseq).unwrap();
        let mut plan = SsdPlan::new(gpu, &seqs, shape).unwrap();
        let mut launch = |i: usize| {
            let xbcr = Rows::new(&xbc[i], tokens, stride);
            let dt = Rows::new(&dt[i], tokens, 64);
            let inputs = SsmInputs { x: xbcr.cols(0, w), dt, b: xbcr.cols(w, gn), c: xbcr.cols(w + gn, gn) };
            ssd_scan(gpu, shape, (inputs, heads), (&mut state[i], &seqs), &mut plan, &mut y[i])
        };
        let timed = b.capture(sets, &mut launch);
        timed.report(&format!("ssd/{name}"), bytes);
        group.throughput(Throughput::Elements(tokens as u64));
        group.bench_function(&name, |bench| bench.iter_custom(|iters| timed.criterion(iters)));
    }
    group.finish();
}

criterion_group!(ssd, benches);
criterion_main!(ssd);
