//! `cargo bench --bench norm`: RMSNorm family at NemotronH decode and prefill shapes. Each shape
//! is captured as CUDA graphs of 64+ launches (warm: one buffer set; cold: rotating sets of 256
//! MB or more, over the L2); replays timed with CUDA events give the per-launch median, printed
//! with GB/s and % of the copy bandwidth measured in the same run; then criterion's statistics
//! (cold).

use std::time::Duration;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use half::bf16;
use host::Rows;
use host::norm::{NormShape, RowPath, gated_norm, gated_norm_fp8, rms_norm};
use nemotron_rs::{BenchGpu, Rng};

struct Set {
    x: host::CudaSlice<bf16>,
    z: host::CudaSlice<bf16>,
    y: host::CudaSlice<bf16>,
    q: host::CudaSlice<u8>,
    s: host::CudaSlice<f32>,
}

fn benches(c: &mut Criterion) {
    let Some(b) = BenchGpu::open() else { return };
    let gpu = &b.gpu;
    let mut rng = Rng::new(7);
    let mut group = c.benchmark_group("norm");
    group.sample_size(20).measurement_time(Duration::from_secs(2)).warm_up_time(Duration::from_millis(300));
    // (variant, rows, width, groups): the block pre-norm at hidden 2688, the mixer's gated
    // norm at D_in 4096 with 8 groups; decode batches 1 and 64, prefill 4096 and 16384 tokens;
    // as the launchers pick the block shape, and with it forced (`-group`, `-few`, `-many`)
    // around the switches.
    let cases: &[(&str, usize, usize, usize)] = &[
        ("gated-group", 1, 4096, 8),
        ("gated-group", 64, 4096, 8),
        ("gated-group", 256, 4096, 8),
        ("gated-few", 64, 4096, 8),
        ("gated-many", 64, 4096, 8),
        ("gated-few", 256, 4096, 8),
        ("gated-many", 256, 4096, 8),
        ("gated-few", 512, 4096, 8),
        ("gated-many", 512, 4096, 8),
        ("rms-few", 256, 2688, 1),
        ("rms-many", 256, 2688, 1),
        ("rms", 1, 2688, 1),
        ("rms", 64, 2688, 1),
        ("rms", 4096, 2688, 1),
        ("rms", 16384, 2688, 1),
        ("gated", 1, 4096, 8),
        ("gated", 64, 4096, 8),
        ("gated", 4096, 4096, 8),
        ("gated", 16384, 4096, 8),
        ("gated_fp8", 1, 4096, 8),
        ("gated_fp8", 64, 4096, 8),
        ("gated_fp8", 4096, 4096, 8),
        ("gated_fp8", 16384, 4096, 8),
    ];
    for &(variant, rows, width, groups) in cases {
        if !BenchGpu::selected(&format!("{variant}/bf16/{rows}x{width}")) {
            continue;
        }
        let n = rows * width;
        let (variant, path) = match variant.split_once('-') {
            Some((v, "few")) => (v, Some(RowPath::Few)),
            Some((v, "group")) => (v, Some(RowPath::Group)),
            Some((v, _)) => (v, Some(RowPath::Many)),
            None => (variant, None),
        };
        let gated = variant != "rms";
        let out_bytes = if variant == "gated_fp8" { n + 4 * rows } else { 2 * n };
        let bytes = 2 * n * if gated { 2 } else { 1 } + 2 * width + out_bytes;
        let sets: Vec<Set> = (0..BenchGpu::cold_sets(bytes))
            .map(|_| Set {
                x: gpu.upload(&rng.bf16s(n, -3.0, 3.0)).unwrap(),
                z: if gated { gpu.upload(&rng.bf16s(n, -3.0, 3.0)).unwrap() } else { gpu.zeros(1).unwrap() },
                y: gpu.zeros(n).unwrap(),
                q: gpu.zeros(n).unwrap(),
                s: gpu.zeros(rows).unwrap(),
            })
            .collect();
        let w = gpu.upload(&rng.bf16s(width, -1.0, 1.0)).unwrap();
        let shape = NormShape { path, ..NormShape::new(rows, width, groups, 1e-5) };
        let mut sets = sets;
        let nsets = sets.len();
        let mut launch = |i: usize| {
            let s = &mut sets[i % nsets];
            let (x, z) = (Rows::new(&s.x, rows, width), Rows::new(&s.z, rows, width));
            match variant {
                "rms" => rms_norm(gpu, shape, x, &w, &mut s.y),
                "gated" => gated_norm(gpu, shape, x, z, &w, &mut s.y),
                _ => gated_norm_fp8(gpu, shape, (x, z), &w, None, (&mut s.q, &mut s.s)),
            }
        };
        let tag = path.map_or(String::new(), |p| format!("-{p:?}").to_lowercase());
        let name = format!("norm/{variant}{tag}/bf16/{rows}x{width}");
        let timed = b.capture(nsets, &mut launch);
        timed.report(&name, bytes);
        group.throughput(Throughput::Bytes(bytes as u64));
        group.bench_function(name.trim_start_matches("norm/"), |bench| {
            bench.iter_custom(|iters| timed.criterion(iters))
        });
    }
    group.finish();
}

criterion_group!(norm, benches);
criterion_main!(norm);
