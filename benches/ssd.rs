//! `cargo bench --bench ssd`: the chunked scan (all four launches) at NemotronH geometry, one
//! sequence of 512/4096/16384 tokens with an initial state, f32 state. Criterion's throughput
//! line is tokens/s; bytes: x, B, C, dt read and y written once, the state read and written.

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use half::bf16;
use host::batch::Prefill;
use host::ssd::{SsdPlan, ssd_scan};
use host::ssm::{Rows, SsmHeads, SsmInputs, SsmShape};
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
    for tokens in [512usize, 4096, 16384] {
        let name = format!("scan/f32/64x64x128/t{tokens}");
        if !BenchGpu::selected(&name) {
            continue;
        }
        let xbc = gpu.upload(&rng.bf16s(tokens * stride, -1.0, 1.0)).unwrap();
        let dt = gpu.upload(&rng.bf16s(tokens * 64, -3.0, 0.0)).unwrap();
        let mut y = gpu.zeros::<bf16>(tokens * w).unwrap();
        let mut state = gpu.zeros::<f32>(shape.slot_len()).unwrap();
        let seqs = Prefill::new(gpu, &[tokens], &[0], &[true], 1).unwrap();
        let mut plan = SsdPlan::new(gpu, &seqs, 64, 64, 128).unwrap();
        let inputs = SsmInputs {
            x: Rows { buf: &xbc, offset: 0, stride },
            dt: Rows::contiguous(&dt, 64),
            b: Rows { buf: &xbc, offset: w, stride },
            c: Rows { buf: &xbc, offset: w + gn, stride },
        };
        let bytes = tokens * 2 * (w + 2 * gn + 64 + w) + 2 * shape.slot_len() * 4;
        let mut launch = |_: usize| ssd_scan(gpu, shape, inputs, heads, &mut state, &seqs, &mut plan, &mut y);
        let timed = b.capture(1, &mut launch);
        timed.report(&format!("ssd/{name}"), bytes);
        group.throughput(Throughput::Elements(tokens as u64));
        group.bench_function(&name, |bench| bench.iter_custom(|iters| timed.criterion(iters)));
    }
    group.finish();
}

criterion_group!(ssd, benches);
criterion_main!(ssd);
