//! `cargo bench --bench conv1d`: causal conv1d at NemotronH shapes (conv_dim 6144, K 4, inputs
//! inside in_proj rows of 10304): the decode update at batch 1/8/64/256 and the prefill
//! forward at 1/64/512/4096/16384 tokens (one sequence; as the launcher picks its kernel, and
//! with each kernel forced: `fwd-tiled`, `fwd-token`), and 4096 tokens as 64 sequences of 64
//! with initial states. Method as in benches/norm.rs; bytes: x read, y written, the slots'
//! states read and written, weights once.

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use half::bf16;
use host::Rows;
use host::batch::{Prefill, Slots};
use host::conv1d::{Conv, ConvPath, ConvShape, conv_fwd_on, conv_update};
use nemotron_rs::{BenchGpu, Rng};
use std::time::Duration;

fn benches(c: &mut Criterion) {
    let Some(b) = BenchGpu::open() else { return };
    let gpu = &b.gpu;
    let mut rng = Rng::new(10);
    let mut group = c.benchmark_group("conv1d");
    group.sample_size(20).measurement_time(Duration::from_secs(2)).warm_up_time(Duration::from_millis(300));
    let shape = ConvShape { dim: 6144, k: 4 };
    let w = gpu.upload(&rng.bf16s(6144 * 4, -0.5, 0.5)).unwrap();
    let bias = gpu.upload(&rng.bf16s(6144, -0.5, 0.5)).unwrap();
    let wbytes = 2 * 6144 * 5;
    for (variant, n) in [
        ("update", 1usize),
        ("update", 8),
        ("update", 64),
        ("update", 256),
        ("fwd", 1),
        ("fwd", 64),
        ("fwd", 512),
        ("fwd", 4096),
        ("fwd", 16384),
        ("fwd-token", 64),
        ("fwd-token", 512),
        ("fwd-token", 4096),
        ("fwd-tiled", 64),
        ("fwd-tiled", 512),
        ("fwd-varlen64", 4096),
    ] {
        let name = format!("{variant}/bf16/6144x4/{}{n}", if variant == "update" { "b" } else { "t" });
        if !BenchGpu::selected(&name) {
            continue;
        }
        let x = gpu.upload(&rng.bf16s(n * 10304, -1.0, 1.0)).unwrap();
        let mut y = gpu.zeros::<bf16>(n * 6144).unwrap();
        let varlen = variant == "fwd-varlen64";
        let slots_n = if variant == "update" {
            n
        } else if varlen {
            64
        } else {
            1
        };
        let state_bytes = slots_n * 6144 * 3 * 2;
        let bytes = n * 6144 * 4 + wbytes + 2 * state_bytes;
        let sets = BenchGpu::cold_sets(bytes);
        let mut states: Vec<_> = (0..sets).map(|_| gpu.zeros::<bf16>(slots_n * 6144 * 3).unwrap()).collect();
        let slots = Slots::new(gpu, &(0..n as i32).collect::<Vec<_>>(), n).unwrap();
        let seqs = if varlen {
            Prefill::new(gpu, &[n / 64; 64], &(0..64).collect::<Vec<_>>(), &[true; 64], 64).unwrap()
        } else {
            Prefill::new(gpu, &[n], &[0], &[true], 1).unwrap()
        };
        let path = match variant {
            "fwd-token" => Some(ConvPath::PerToken),
            "fwd-tiled" => Some(ConvPath::Tiled),
            _ => None,
        };
        // The conv's channels of in_proj's rows of 10304.
        let xr = Rows::strided(&x, n, 6144, 10304);
        let mut launch = |i: usize| {
            let conv = Conv { w: &w, bias: Some(&bias), state: &mut states[i % sets] };
            match variant {
                "update" => conv_update(gpu, shape, xr, conv, &slots, &mut y),
                _ => conv_fwd_on(gpu, path, shape, xr, conv, &seqs, &mut y),
            }
        };
        let timed = b.capture(sets, &mut launch);
        timed.report(&format!("conv1d/{name}"), bytes);
        group.throughput(Throughput::Bytes(bytes as u64));
        group.bench_function(&name, |bench| bench.iter_custom(|iters| timed.criterion(iters)));
    }
    group.finish();
}

criterion_group!(conv1d, benches);
criterion_main!(conv1d);
