//! `cargo bench --bench sample`: token sampling on the device (kernels-gpu/src/sample.rs) at
//! Nemotron-3 Nano's vocabulary (131072), 1, 8 and 64 rows: greedy; temperature 1;
//! temperature 0.8 with top-p 0.95; top-k 50; min-p 0.05 with penalties over 256 generated
//! tokens. Logits: seeded bf16, normal with sigma 2 (a broad distribution: top-p keeps most of
//! the vocabulary, the hard case for its threshold search). Method as in benches/norm.rs
//! (graph replays, warm and cold L2); bytes: the logits read once.
//!
//! First, with or without a GPU, the CPU backend's sampler (`host::cpu::sample::sample_row`,
//! what a user without a GPU runs every token) on one row of the same logits in each mode:
//! wall time, median of 21, beside a plain argmax over the row (`cpu/...` names; the filter
//! applies).

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use half::bf16;
use host::Rows;
use host::cpu::sample::sample_row;
use host::sample::{RowSampling, SampleRows, sample, sample_out};
use kernels_gpu::sample::SampleRow;
use nemotron_rs::{BenchGpu, Rng};
use std::time::Duration;

const VOCAB: usize = 131072;

/// A normal sample (Box-Muller) of sigma `s`.
fn normal(rng: &mut Rng, s: f64) -> f64 {
    let (u, v) = (rng.uniform(1e-12, 1.0), rng.uniform(0.0, 1.0));
    s * (-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos()
}

/// What a mode's rows carry besides their settings.
#[derive(Clone, Copy, PartialEq)]
enum Extra {
    None,
    /// The 256 penalized tokens of [`penalties`].
    Penalties,
    /// A mask allowing every other token (structured outputs' cost).
    Mask,
}

/// The six modes, each a row's sampling and what it carries.
fn modes() -> [(&'static str, SampleRow, Extra); 6] {
    let t = |temperature| SampleRow { temperature, seed: 7, ..SampleRow::GREEDY };
    [
        ("greedy", SampleRow::GREEDY, Extra::None),
        ("t1", t(1.0), Extra::None),
        ("t0.8-top-p0.95", SampleRow { top_p: 0.95, ..t(0.8) }, Extra::None),
        ("top-k50", SampleRow { top_k: 50, ..t(1.0) }, Extra::None),
        (
            "min-p0.05-penalties",
            SampleRow { min_p: 0.05, repetition: 1.1, presence: 0.5, frequency: 0.2, ..t(1.0) },
            Extra::Penalties,
        ),
        ("t1-masked", t(1.0), Extra::Mask),
    ]
}

/// A mask over [`VOCAB`] allowing every other token.
fn mask() -> Vec<u32> {
    vec![0x5555_5555; host::sample::mask_words(VOCAB)]
}

/// 256 penalized tokens and their counts.
fn penalties() -> Vec<(u32, u32)> {
    (0..256).map(|i| (i * 511 % VOCAB as u32, 1 + i % 3)).collect()
}

/// Median wall time of 21 calls of `f`, in microseconds.
fn wall_us(mut f: impl FnMut()) -> f64 {
    let mut t: Vec<f64> = (0..21)
        .map(|_| {
            let t = std::time::Instant::now();
            f();
            t.elapsed().as_secs_f64() * 1e6
        })
        .collect();
    t.sort_by(f64::total_cmp);
    t[10]
}

/// The CPU sampler in each mode against an argmax over the same row.
fn cpu(_: &mut Criterion) {
    let mut rng = Rng::new(5);
    let logits: Vec<f32> = (0..VOCAB).map(|_| bf16::from_f64(normal(&mut rng, 2.0)).to_f32()).collect();
    let argmax = wall_us(|| {
        let best =
            logits.iter().enumerate().fold((0, f32::NEG_INFINITY), |b, (i, &v)| if v > b.1 { (i, v) } else { b });
        std::hint::black_box(best);
    });
    println!("cpu/argmax/v{VOCAB}: {argmax:.1} us (a plain argmax, the unit below)");
    let (penalties, mask) = (penalties(), mask());
    for (mode, row, extra) in modes() {
        let name = format!("cpu/{mode}/v{VOCAB}");
        if BenchGpu::selected(&name) {
            let p: &[(u32, u32)] = if extra == Extra::Penalties { &penalties } else { &[] };
            let m = (extra == Extra::Mask).then_some(&mask[..]);
            let us = wall_us(|| {
                std::hint::black_box(sample_row(&logits, &row, p, m));
            });
            println!("{name}: {us:.1} us = {:.1}x the argmax", us / argmax);
        }
    }
}

fn benches(c: &mut Criterion) {
    let Some(b) = BenchGpu::open() else { return };
    let gpu = &b.gpu;
    let mut group = c.benchmark_group("sample");
    group.sample_size(20).measurement_time(Duration::from_secs(2)).warm_up_time(Duration::from_millis(300));
    let mut rng = Rng::new(5);
    let penalties = penalties();
    for rows in [1usize, 8, 64] {
        let bytes = rows * VOCAB * 2;
        let sets = BenchGpu::cold_sets(bytes);
        let logits: Vec<_> = (0..sets)
            .map(|_| {
                let v: Vec<bf16> = (0..rows * VOCAB).map(|_| bf16::from_f64(normal(&mut rng, 2.0))).collect();
                gpu.upload(&v).unwrap()
            })
            .collect();
        let mask = mask();
        for (mode, row, extra) in modes() {
            let name = format!("{mode}/v{VOCAB}/r{rows}");
            if !BenchGpu::selected(&name) {
                continue;
            }
            let spec: Vec<RowSampling> = (0..rows)
                .map(|r| RowSampling {
                    row: SampleRow { counter: r as u64, ..row },
                    penalties: if extra == Extra::Penalties { &penalties } else { &[] },
                    mask: (extra == Extra::Mask).then_some(&mask[..]),
                })
                .collect();
            let rs = SampleRows::new(gpu, &spec, VOCAB, rows * penalties.len()).unwrap();
            let mut out = sample_out(gpu, rows).unwrap();
            let timed = b.capture(sets, |i| sample(gpu, Rows::new(&logits[i % sets], rows, VOCAB), &rs, &mut out));
            timed.report(&format!("sample/{name}"), bytes);
            group.throughput(Throughput::Bytes(bytes as u64));
            group.bench_function(&name, |bench| bench.iter_custom(|iters| timed.criterion(iters)));
        }
    }
    group.finish();
}

criterion_group!(sample_benches, cpu, benches);
criterion_main!(sample_benches);
