//! `cargo bench --bench quant`: FP8 e4m3 quantization at NemotronH activation shapes (hidden
//! 2688), decode and prefill. Same method as benches/norm.rs.

use std::time::Duration;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use half::bf16;
use host::norm::RowPath;
use host::quant::{quant_static, quant_tensor, quant_token, quant_token_on};
use nemotron_rs::{BenchGpu, Rng};

struct Set {
    x: host::CudaSlice<bf16>,
    q: host::CudaSlice<u8>,
    s: host::CudaSlice<f32>,
    amax: host::CudaSlice<f32>,
}

fn benches(c: &mut Criterion) {
    let Some(b) = BenchGpu::open() else { return };
    let gpu = &b.gpu;
    let mut rng = Rng::new(8);
    let mut group = c.benchmark_group("quant");
    group.sample_size(20).measurement_time(Duration::from_secs(2)).warm_up_time(Duration::from_millis(300));
    let width = 2688;
    for variant in ["token", "tensor", "static", "token-few", "token-many"] {
        let rows_of: &[usize] = if variant.contains('-') { &[64, 256, 512] } else { &[1, 64, 4096, 16384] };
        for &rows in rows_of {
            if !BenchGpu::selected(&format!("{variant}/bf16/{rows}x{width}")) {
                continue;
            }
            let n = rows * width;
            // Minimal bytes: x read once, codes written, one scale per row (token).
            let bytes = 2 * n + n + if variant.starts_with("token") { 4 * rows } else { 4 };
            let mut sets: Vec<Set> = (0..BenchGpu::cold_sets(bytes))
                .map(|_| Set {
                    x: gpu.upload(&rng.bf16s(n, -3.0, 3.0)).unwrap(),
                    q: gpu.zeros(n).unwrap(),
                    s: gpu.zeros(if variant.starts_with("token") { rows } else { 1 }).unwrap(),
                    amax: gpu.zeros(1).unwrap(),
                })
                .collect();
            let nsets = sets.len();
            let mut launch = |i: usize| {
                let s = &mut sets[i % nsets];
                match variant {
                    "token" => quant_token(gpu, width, &s.x, None, &mut s.q, &mut s.s),
                    "token-few" => quant_token_on(gpu, RowPath::Few, width, &s.x, None, &mut s.q, &mut s.s),
                    "token-many" => quant_token_on(gpu, RowPath::Many, width, &s.x, None, &mut s.q, &mut s.s),
                    "tensor" => quant_tensor(gpu, &s.x, &mut s.q, &mut s.amax, &mut s.s),
                    _ => quant_static(gpu, &s.x, 0.0173, &mut s.q),
                }
            };
            let name = format!("quant/{variant}/bf16/{rows}x{width}");
            let timed = b.capture(nsets, &mut launch);
            timed.report(&name, bytes);
            group.throughput(Throughput::Bytes(bytes as u64));
            group.bench_function(name.trim_start_matches("quant/"), |bench| {
                bench.iter_custom(|iters| timed.criterion(iters))
            });
        }
    }
    group.finish();
}

criterion_group!(quant, benches);
criterion_main!(quant);
