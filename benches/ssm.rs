//! `cargo bench --bench ssm`: the selective state update at NemotronH geometry (64 heads x 64,
//! state 128, 8 groups), batch 1/8/64/256, f32 and bf16 state. Method as in benches/norm.rs;
//! bytes: the state read and written once, plus x, B, C, dt read and y written.

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use half::bf16;
use host::Rows;
use host::batch::Slots;
use host::ssm::{SsmCache, SsmHeads, SsmInputs, SsmShape, StateDtype, ssm_update};
use kernels_gpu::KernelParams;
use kernels_gpu::ssm::SsmUpdateParams;
use nemotron_rs::{BenchGpu, Rng};
use std::time::Duration;

fn bench_dtype<T: StateDtype>(
    b: &BenchGpu,
    group: &mut criterion::BenchmarkGroup<'_, criterion::measurement::WallTime>,
    name: &str,
) where
    SsmUpdateParams<T::Raw>: KernelParams,
{
    let gpu = &b.gpu;
    let mut rng = Rng::new(9);
    let shape = SsmShape::new(64, 64, 8, 128);
    let (w, gn) = (shape.width(), shape.groups * shape.state_size);
    let stride = w + 2 * gn;
    let dt_bias = gpu.upload(&vec![0.5f32; 64]).unwrap();
    let a = gpu.upload(&vec![-1.0f32; 64]).unwrap();
    let d = gpu.upload(&vec![1.0f32; 64]).unwrap();
    let heads = SsmHeads { dt_bias: &dt_bias, a: &a, d: Some(&d) };
    for batch in [1usize, 8, 64, 256] {
        let bench_name = format!("update/{name}/64x64x128/b{batch}");
        if !BenchGpu::selected(&bench_name) {
            continue;
        }
        let state_bytes = batch * shape.slot_len() * std::mem::size_of::<T>();
        let bytes = 2 * state_bytes + batch * (2 * (w + 2 * gn + 64) + 2 * w);
        let sets = BenchGpu::cold_sets(bytes);
        let xbc = gpu.upload(&rng.bf16s(batch * stride, -1.0, 1.0)).unwrap();
        let dt = gpu.upload(&rng.bf16s(batch * 64, -3.0, 0.0)).unwrap();
        let mut states: Vec<_> = (0..sets).map(|_| gpu.zeros::<T>(batch * shape.slot_len()).unwrap()).collect();
        let slots = Slots::new(gpu, &(0..batch as i32).collect::<Vec<_>>(), batch).unwrap();
        let mut y = gpu.zeros::<bf16>(batch * w).unwrap();
        let xbcr = Rows::new(&xbc, batch, stride);
        let inputs = SsmInputs {
            x: xbcr.cols(0, w),
            dt: Rows::new(&dt, batch, 64),
            b: xbcr.cols(w, gn),
            c: xbcr.cols(w + gn, gn),
        };
        let mut launch = |i: usize| {
            let cache = SsmCache { state: &mut states[i % sets], slots: &slots, dst: None };
            ssm_update(gpu, shape, inputs, None, heads, cache, &mut y)
        };
        let timed = b.capture(sets, &mut launch);
        timed.report(&format!("ssm/{bench_name}"), bytes);
        group.throughput(Throughput::Bytes(bytes as u64));
        group.bench_function(&bench_name, |bench| bench.iter_custom(|iters| timed.criterion(iters)));
    }
}

fn benches(c: &mut Criterion) {
    let Some(b) = BenchGpu::open() else { return };
    let mut group = c.benchmark_group("ssm");
    group.sample_size(20).measurement_time(Duration::from_secs(2)).warm_up_time(Duration::from_millis(300));
    bench_dtype::<f32>(&b, &mut group, "f32");
    bench_dtype::<bf16>(&b, &mut group, "bf16");
    group.finish();
}

criterion_group!(ssm, benches);
criterion_main!(ssm);
