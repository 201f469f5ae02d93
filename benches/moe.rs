//! `cargo bench --bench moe`: MoE at Nemotron-3 Nano sizes (hidden 2688, 128 experts of 1856,
//! top-6, shared expert 3712). Method as in benches/norm.rs (CUDA graph replays timed with
//! events; cold: buffers rotated through more than the L2).
//! - `route/b*`: the routing kernel, batch 1..4096; bytes: x, the router, idx and weights.
//! - `layer/b*`: the whole layer on the CUDA backend (routing, dispatch, expert kernel, shared
//!   expert through cuBLASLt, combine) at batch 1 and 64; bytes: the weights of the experts the
//!   batch routes to (counted from its routing), the shared expert, the router, x and y.
//! - `experts/b*`: the routed experts alone by the expert kernel and by per-expert cuBLASLt
//!   GEMMs (which reads the offsets back, so it is timed with events around one call, median
//!   of 11), which picks the CUDA backend's threshold between the two.

use criterion::{Criterion, criterion_group, criterion_main};
use half::bf16;
use host::moe::{Dispatch, ExpertWeights, RouteShape, dispatch, experts_mlp, experts_mlp_gemm, route};
use model::backend::{Backend, In, MoeWeights, Out};
use model::config::MoeConfig;
use model::cuda::Cuda;
use model::layout::{Linear, Mlp};
use model::weights::{Dtype, Tensor};
use nemotron_rs::{BenchGpu, Rng};

const HIDDEN: usize = 2688;
const INTER: usize = 1856;
const SHARED: usize = 3712;
const EXPERTS: usize = 128;
const TOP_K: usize = 6;

fn shape() -> RouteShape {
    RouteShape { experts: EXPERTS, top_k: TOP_K, n_group: 1, topk_group: 1, renormalize: true, scaling: 2.5 }
}

fn bench_route(b: &BenchGpu, rng: &mut Rng, gate: &host::CudaSlice<bf16>, bias: &host::CudaSlice<f32>) {
    let gpu = &b.gpu;
    for batch in [1usize, 8, 64, 256, 1024, 4096] {
        let name = format!("route/b{batch}");
        if !BenchGpu::selected(&name) {
            continue;
        }
        let bytes = batch * HIDDEN * 2 + EXPERTS * HIDDEN * 2 + batch * TOP_K * 8;
        let sets = BenchGpu::cold_sets(batch * HIDDEN * 2);
        let xs: Vec<_> = (0..sets).map(|_| gpu.upload(&rng.bf16s(batch * HIDDEN, -1.0, 1.0)).unwrap()).collect();
        let (mut idx, mut w) = (gpu.zeros::<i32>(batch * TOP_K).unwrap(), gpu.zeros::<f32>(batch * TOP_K).unwrap());
        let timed = b.capture(sets, |i| route(gpu, shape(), &xs[i], HIDDEN, gate, bias, &mut idx, &mut w));
        timed.report(&format!("moe/{name}"), bytes);
    }
}

/// Zero bf16 weights `[n, k]` as bytes (the times do not depend on the values).
fn linear<'a>(shape: &'a [usize], bytes: &'a [u8]) -> Linear<'a> {
    let weight = Tensor { name: "w", path: std::path::Path::new("memory"), dtype: Dtype::Bf16, shape, bytes };
    Linear { weight, bias: None, fp8: None }
}

/// Experts that `batch` tokens of `x` route to.
fn active_experts(gpu: &host::Gpu, x: &host::CudaSlice<bf16>, batch: usize, w: &MoeWeights<Cuda>) -> usize {
    let (mut idx, mut wt) = (gpu.zeros::<i32>(batch * TOP_K).unwrap(), gpu.zeros::<f32>(batch * TOP_K).unwrap());
    route(gpu, shape(), x, HIDDEN, &w.gate, &w.score_bias, &mut idx, &mut wt).unwrap();
    let mut d = Dispatch::new(gpu, EXPERTS, TOP_K, batch).unwrap();
    dispatch(gpu, &idx, &mut d).unwrap();
    gpu.download(d.active_count()).unwrap()[0] as usize
}

fn bench_layer(b: &BenchGpu, rng: &mut Rng, cuda: &Cuda, w: &MoeWeights<Cuda>, up: &host::CudaSlice<bf16>) {
    let gpu = &b.gpu;
    let c = MoeConfig {
        experts: EXPERTS,
        top_k: TOP_K,
        intermediate: INTER,
        shared_intermediate: Some(SHARED),
        n_group: 1,
        topk_group: 1,
        norm_topk_prob: true,
        routed_scaling_factor: 2.5,
    };
    for batch in [1usize, 8, 64] {
        let name = format!("layer/b{batch}");
        if !BenchGpu::selected(&name) {
            continue;
        }
        let x = cuda.upload(&rng.bf16s(batch * HIDDEN, -1.0, 1.0)).unwrap();
        let active = active_experts(gpu, &x, batch, w);
        let weights = 2 * (active * 2 * INTER * HIDDEN + 2 * SHARED * HIDDEN + EXPERTS * HIDDEN);
        let bytes = weights + 2 * 2 * batch * HIDDEN;
        let mut y = cuda.zeros(batch * HIDDEN).unwrap();
        let timed = b.capture(1, |_| {
            cuda.moe(&c, In::rows(&x, HIDDEN), batch, w, Out { buf: &mut y, offset: 0 }).map_err(|e| match e {
                model::Error::Host(e) => e,
                e => panic!("{e}"),
            })
        });
        println!("moe/{name}: {active} experts routed to");
        timed.report(&format!("moe/{name}"), bytes);
    }
    for batch in [16usize, 64, 256, 1024, 4096] {
        let name = format!("experts/b{batch}");
        if !BenchGpu::selected(&name) {
            continue;
        }
        let x = gpu.upload(&rng.bf16s(batch * HIDDEN, -1.0, 1.0)).unwrap();
        let (mut idx, mut wt) = (gpu.zeros::<i32>(batch * TOP_K).unwrap(), gpu.zeros::<f32>(batch * TOP_K).unwrap());
        route(gpu, shape(), &x, HIDDEN, &w.gate, &w.score_bias, &mut idx, &mut wt).unwrap();
        let mut d = Dispatch::new(gpu, EXPERTS, TOP_K, batch).unwrap();
        dispatch(gpu, &idx, &mut d).unwrap();
        let mut out = gpu.zeros::<bf16>(batch * TOP_K * HIDDEN).unwrap();
        for gemm in [false, true] {
            let mut t: Vec<f32> = (0..12)
                .map(|_| {
                    gpu.time_ms(|| {
                        if gemm {
                            experts_mlp_gemm(gpu, &d, &x, up, up, (INTER, HIDDEN), &mut out)
                        } else {
                            experts_mlp(
                                gpu,
                                &d,
                                &x,
                                ExpertWeights::Bf16(up),
                                ExpertWeights::Bf16(up),
                                (INTER, HIDDEN),
                                &mut out,
                            )
                        }
                    })
                    .unwrap()
                })
                .skip(1)
                .collect();
            t.sort_by(f32::total_cmp);
            let label = if gemm { "cuBLASLt per expert" } else { "expert kernel" };
            println!(
                "moe/{name} {label:<20} {:9.1} us (median of 11, p10 {:.1}, p90 {:.1})",
                t[5] * 1e3,
                t[1] * 1e3,
                t[9] * 1e3
            );
        }
    }
}

fn benches(_: &mut Criterion) {
    let Some(b) = BenchGpu::open() else { return };
    let mut rng = Rng::new(17);
    let cuda = Cuda::on(b.gpu.clone());
    let gate = rng.bf16s(EXPERTS * HIDDEN, -0.05, 0.05);
    let bias: Vec<f32> = (0..EXPERTS).map(|_| rng.uniform(-0.02, 0.02) as f32).collect();
    bench_route(&b, &mut rng, &b.gpu.upload(&gate).unwrap(), &b.gpu.upload(&bias).unwrap());
    let zeros = vec![0u8; 2 * SHARED * HIDDEN];
    let (up_s, down_s, su_s, sd_s) = ([INTER, HIDDEN], [HIDDEN, INTER], [SHARED, HIDDEN], [HIDDEN, SHARED]);
    let experts: Vec<Mlp> = (0..EXPERTS)
        .map(|_| Mlp {
            up: linear(&up_s, &zeros[..2 * INTER * HIDDEN]),
            down: linear(&down_s, &zeros[..2 * INTER * HIDDEN]),
        })
        .collect();
    let w = MoeWeights {
        gate: cuda.upload(&gate).unwrap(),
        score_bias: cuda.upload32(&bias).unwrap(),
        experts: cuda.experts(&experts).unwrap(),
        shared: Some((cuda.weight(&linear(&su_s, &zeros)).unwrap(), cuda.weight(&linear(&sd_s, &zeros)).unwrap())),
    };
    let up = b.gpu.zeros::<bf16>(EXPERTS * INTER * HIDDEN).unwrap();
    bench_layer(&b, &mut rng, &cuda, &w, &up);
}

criterion_group!(moe, benches);
criterion_main!(moe);
