//! `cargo bench --bench attn`: causal attention of a prefill at NemotronH's geometry (32 query
//! heads, 2 kv heads, head_dim 128): one fresh sequence of 512/4096/16384 tokens, the cache write
//! and the flash kernel (`prefill/`: the one the model takes, on `wgmma` where the GPU has it;
//! `prefill-k64/`: the `mma.sync` kernel of 64-key tiles; `prefill-k32/`: its 32-key tiles, the
//! sm_12x form; each where it fits).
//! Criterion's throughput line is tokens/s; the report line gives TFLOP/s
//! of the causal products (`4 heads head_dim n (n + 1) / 2`: scores and values, the masked half
//! not counted). Then decode rows: `b` rows, each in a slot of its own at position `ctx - 1` of
//! a cache of `ctx` positions (its keys split over blocks past 512 positions, then the combine
//! launch); bytes: the keys and values each row attends over, its query and output.

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use half::bf16;
use host::Rows;
use host::attn::{AttnRows, AttnShape, FlashKeys, Qkv, attention, attention_with};
use nemotron_rs::{BenchGpu, Rng};
use std::time::Duration;

fn benches(c: &mut Criterion) {
    let Some(b) = BenchGpu::open() else { return };
    let gpu = &b.gpu;
    let mut rng = Rng::new(12);
    let mut group = c.benchmark_group("attn");
    group.sample_size(10).measurement_time(Duration::from_secs(3)).warm_up_time(Duration::from_millis(300));
    let flash = [(FlashKeys::Wgmma, "prefill"), (FlashKeys::K64, "prefill-k64"), (FlashKeys::K32, "prefill-k32")];
    let flash = flash.into_iter().filter(|&(f, _)| f.fits(gpu));
    for ((keys, kind), n) in flash.flat_map(|f| [512usize, 4096, 16384].map(|n| (f, n))) {
        let name = format!("{kind}/32x2x128/t{n}");
        if !BenchGpu::selected(&name) {
            continue;
        }
        let s = AttnShape { heads: 32, kv_heads: 2, head_dim: 128, max_len: n };
        let (qw, kw) = (s.heads * s.head_dim, s.kv_heads * s.head_dim);
        // q, k and v read, out written, the caches written and read once.
        let bytes = 2 * n * (2 * qw + 4 * kw);
        let sets = BenchGpu::cold_sets(bytes);
        let q: Vec<_> = (0..sets).map(|_| gpu.upload(&rng.bf16s(n * qw, -1.0, 1.0)).unwrap()).collect();
        let k: Vec<_> = (0..sets).map(|_| gpu.upload(&rng.bf16s(n * kw, -1.0, 1.0)).unwrap()).collect();
        let v: Vec<_> = (0..sets).map(|_| gpu.upload(&rng.bf16s(n * kw, -1.0, 1.0)).unwrap()).collect();
        let mut caches: Vec<_> =
            (0..sets).map(|_| (gpu.zeros::<bf16>(n * kw).unwrap(), gpu.zeros::<bf16>(n * kw).unwrap())).collect();
        let mut out: Vec<_> = (0..sets).map(|_| gpu.zeros::<bf16>(n * qw).unwrap()).collect();
        let pos: Vec<u32> = (0..n as u32).collect();
        let rows = AttnRows::new(gpu, &vec![0; n], &pos, 1, n).unwrap();
        let mut launch = |i: usize| {
            let (kc, vc) = &mut caches[i];
            let qkv = Qkv { q: Rows::new(&q[i], n, qw), k: Rows::new(&k[i], n, kw), v: Rows::new(&v[i], n, kw) };
            attention_with(gpu, s, qkv, (kc, vc), &rows, Some(keys), &mut out[i])
        };
        let timed = b.capture(sets, &mut launch);
        timed.report_flops(&format!("attn/{name}"), 4.0 * (qw * n) as f64 * (n + 1) as f64 / 2.0);
        group.throughput(Throughput::Elements(n as u64));
        group.bench_function(&name, |bench| bench.iter_custom(|iters| timed.criterion(iters)));
    }
    for (rows, ctx) in [(1usize, 4096usize), (1, 32768), (16, 32768), (64, 4096)] {
        let name = format!("decode/32x2x128/b{rows}/ctx{ctx}");
        if !BenchGpu::selected(&name) {
            continue;
        }
        let s = AttnShape { heads: 32, kv_heads: 2, head_dim: 128, max_len: ctx };
        let (qw, kw) = (s.heads * s.head_dim, s.kv_heads * s.head_dim);
        let bytes = 2 * rows * (2 * qw + 2 * ctx * kw);
        let sets = BenchGpu::cold_sets(bytes);
        let q: Vec<_> = (0..sets).map(|_| gpu.upload(&rng.bf16s(rows * qw, -1.0, 1.0)).unwrap()).collect();
        let k: Vec<_> = (0..sets).map(|_| gpu.upload(&rng.bf16s(rows * kw, -1.0, 1.0)).unwrap()).collect();
        let v: Vec<_> = (0..sets).map(|_| gpu.upload(&rng.bf16s(rows * kw, -1.0, 1.0)).unwrap()).collect();
        let cache = |rng: &mut Rng| gpu.upload(&rng.bf16s(rows * ctx * kw, -1.0, 1.0)).unwrap();
        let mut caches: Vec<_> = (0..sets).map(|_| (cache(&mut rng), cache(&mut rng))).collect();
        let mut out: Vec<_> = (0..sets).map(|_| gpu.zeros::<bf16>(rows * qw).unwrap()).collect();
        let slots: Vec<i32> = (0..rows as i32).collect();
        let arows = AttnRows::new(gpu, &slots, &vec![ctx as u32 - 1; rows], rows, ctx).unwrap();
        let mut launch = |i: usize| {
            let (kc, vc) = &mut caches[i];
            let qkv =
                Qkv { q: Rows::new(&q[i], rows, qw), k: Rows::new(&k[i], rows, kw), v: Rows::new(&v[i], rows, kw) };
            attention(gpu, s, qkv, kc, vc, &arows, &mut out[i])
        };
        let timed = b.capture(sets, &mut launch);
        timed.report(&format!("attn/{name}"), bytes);
        group.throughput(Throughput::Bytes(bytes as u64));
        group.bench_function(&name, |bench| bench.iter_custom(|iters| timed.criterion(iters)));
    }
    group.finish();
}

criterion_group!(attn, benches);
criterion_main!(attn);
