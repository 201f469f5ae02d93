//! `cargo bench --bench moe`: MoE at Nemotron-3 Nano sizes (hidden 2688, 128 experts of 1856,
//! top-6, shared expert 3712). Method as in benches/norm.rs (CUDA graph replays timed with
//! events; cold: buffers rotated through more than the L2).
//! - `route/b*`: the routing kernel, batch 1..4096; bytes: x, the router, idx and weights.
//! - `layer/b*`: the whole layer on the CUDA backend at batch 1, 8 and 64 (the path the model
//!   takes at each: docs/PERFORMANCE.md); bytes: the weights of the experts the batch routes to
//!   (counted from its routing), the shared expert, the router, x and y.
//! - `experts/b*`: the routed experts alone by the expert kernel, by per-expert cuBLASLt GEMMs
//!   (which reads the offsets back), by the grouped GEMM (each of its tiles, `wgmma` where the
//!   GPU has it), by the FP8 expert kernel (the warp mode at one token, tensor cores from two;
//!   its quantization inside), by the NVFP4 expert kernel, by the FP8 grouped GEMM (its
//!   quantizations included), by the NVFP4 grouped GEMM from the codes (64-row tiles, and
//!   `wgmma`) and, where the GPU has `wgmma`, by NVFP4 dequantized to bf16 then the bf16
//!   grouped GEMM (the dequantization included), each timed with events around one call,
//!   median of 11, with the TFLOP/s of the two projections (`4 entries inter hidden`) and, for
//!   the expert kernels, the share of the copy bandwidth that reading the routed experts'
//!   weights once in that time is.

use criterion::{Criterion, criterion_group, criterion_main};
use half::bf16;
use host::Kernel;
use host::grouped::{Tiles, experts_mlp_grouped_as};
use host::moe::{Dispatch, ExpertMlp, ExpertWeights, dispatch, experts_mlp, experts_mlp_gemm};
use host::router::{Routed, Router, route};
use model::Config;
use model::backend::{Backend, In, MoeWeights, Out};
use model::config::MoeConfig;
use model::cuda::Cuda;
use model::layout::{Linear, Mlp};
use nemotron_rs::{BenchGpu, Rng};

/// The MoE sizes of Nemotron-3 Nano, from model/assets/nano-30b-a3b.json.
struct Nano {
    hidden: usize,
    c: MoeConfig,
}

impl Nano {
    fn new() -> Nano {
        let config = Config::from_json(include_str!("../model/assets/nano-30b-a3b.json")).expect("the Nano config");
        Nano { hidden: config.hidden_size, c: config.moe.expect("Nano has MoE layers") }
    }

    /// Hidden size, experts, top-k, expert and shared-expert intermediate sizes.
    fn sizes(&self) -> (usize, usize, usize, usize, usize) {
        let c = &self.c;
        (self.hidden, c.experts, c.top_k, c.intermediate, c.shared_intermediate.expect("Nano has a shared expert"))
    }
}

fn bench_route(b: &BenchGpu, nano: &Nano, rng: &mut Rng, gate: &host::CudaSlice<bf16>, bias: &host::CudaSlice<f32>) {
    let gpu = &b.gpu;
    let ((hidden, n_exp, top_k, _, _), shape) = (nano.sizes(), nano.c.route_shape());
    for batch in [1usize, 8, 64, 256, 1024, 4096] {
        let name = format!("route/b{batch}");
        if !BenchGpu::selected(&name) {
            continue;
        }
        let bytes = batch * hidden * 2 + n_exp * hidden * 2 + batch * top_k * 8;
        let sets = BenchGpu::cold_sets(batch * hidden * 2);
        let xs: Vec<_> = (0..sets).map(|_| gpu.upload(&rng.bf16s(batch * hidden, -1.0, 1.0)).unwrap()).collect();
        let (mut idx, mut w) = (gpu.zeros::<i32>(batch * top_k).unwrap(), gpu.zeros::<f32>(batch * top_k).unwrap());
        let router = Router { gate, bias };
        let timed =
            b.capture(sets, |i| route(gpu, shape, (&xs[i], hidden), router, Routed { idx: &mut idx, weight: &mut w }));
        timed.report(&format!("moe/{name}"), bytes);
    }
}

/// Experts that `batch` tokens of `x` route to.
fn active_experts(
    gpu: &host::Gpu,
    nano: &Nano,
    x: &host::CudaSlice<bf16>,
    batch: usize,
    w: &MoeWeights<Cuda>,
) -> usize {
    let (hidden, n_exp, top_k, _, _) = nano.sizes();
    let (mut idx, mut wt) = (gpu.zeros::<i32>(batch * top_k).unwrap(), gpu.zeros::<f32>(batch * top_k).unwrap());
    let router = Router { gate: &w.gate, bias: &w.score_bias };
    route(gpu, nano.c.route_shape(), (x, hidden), router, Routed { idx: &mut idx, weight: &mut wt }).unwrap();
    let mut d = Dispatch::new(gpu, n_exp, top_k, batch).unwrap();
    dispatch(gpu, &idx, &mut d).unwrap();
    gpu.download(d.active_count()).unwrap()[0] as usize
}

/// How `experts/b*` runs the routed experts.
#[derive(Clone, Copy)]
enum Path {
    Kernel,
    /// The FP8 expert kernel, static input scales.
    KernelFp8,
    Cublas,
    Grouped(Tiles),
    /// The FP8 grouped GEMM, static input scales (each projection's rows quantized first).
    GroupedFp8(Tiles),
    /// The NVFP4 expert kernel (weight-only, the tensor cores where the experts average two
    /// rows or more).
    KernelNvfp4,
    /// The NVFP4 grouped GEMM, from the codes.
    GroupedNvfp4(Tiles),
    /// NVFP4 dequantized to bf16 (both projections), then the bf16 grouped GEMM on `wgmma`.
    DequantizedNvfp4,
}

impl Path {
    const ALL: [Path; 12] = [
        Path::Kernel,
        Path::KernelFp8,
        Path::KernelNvfp4,
        Path::Cublas,
        Path::Grouped(Tiles::Narrow),
        Path::Grouped(Tiles::Wide),
        Path::Grouped(Tiles::Wgmma),
        Path::GroupedFp8(Tiles::Narrow),
        Path::GroupedFp8(Tiles::Wgmma),
        Path::GroupedNvfp4(Tiles::Narrow),
        Path::GroupedNvfp4(Tiles::Wgmma),
        Path::DequantizedNvfp4,
    ];

    /// Whether the path needs the `wgmma` kernels.
    fn wgmma(self) -> bool {
        matches!(
            self,
            Path::Grouped(Tiles::Wgmma)
                | Path::GroupedFp8(Tiles::Wgmma)
                | Path::GroupedNvfp4(Tiles::Wgmma)
                | Path::DequantizedNvfp4
        )
    }

    fn label(self) -> String {
        match self {
            Path::Kernel => "expert kernel".into(),
            Path::KernelFp8 => "FP8 expert kernel".into(),
            Path::Cublas => "cuBLASLt per expert".into(),
            Path::Grouped(t) => format!("grouped {t:?}"),
            Path::GroupedFp8(t) => format!("grouped FP8 {t:?}"),
            Path::KernelNvfp4 => "NVFP4 expert kernel".into(),
            Path::GroupedNvfp4(t) => format!("grouped NVFP4 {t:?}"),
            Path::DequantizedNvfp4 => "NVFP4 to bf16, Wgmma".into(),
        }
    }
}

fn bench_layer(
    b: &BenchGpu,
    nano: &Nano,
    rng: &mut Rng,
    cuda: &Cuda,
    w: &MoeWeights<Cuda>,
    (up, fp8, nvfp4): (&host::CudaSlice<bf16>, ExpertWeights<'_>, [ExpertWeights<'_>; 2]),
) {
    let gpu = &b.gpu;
    let (c, (hidden, n_exp, top_k, inter, shared_inter)) = (&nano.c, nano.sizes());
    for batch in [1usize, 8, 64] {
        let name = format!("layer/b{batch}");
        if !BenchGpu::selected(&name) {
            continue;
        }
        let x = cuda.upload(&rng.bf16s(batch * hidden, -1.0, 1.0)).unwrap();
        let active = active_experts(gpu, nano, &x, batch, w);
        let weights = 2 * (active * 2 * inter * hidden + 2 * shared_inter * hidden + n_exp * hidden);
        let bytes = weights + 2 * 2 * batch * hidden;
        let mut y = cuda.zeros(batch * hidden).unwrap();
        let timed = b.capture(1, |_| {
            w.forward(cuda, c, In::rows(&x, hidden), batch, Out { buf: &mut y, offset: 0 }).map_err(|e| match e {
                model::Error::Host(e) => e,
                e => panic!("{e}"),
            })
        });
        println!("moe/{name}: {active} experts routed to");
        timed.report(&format!("moe/{name}"), bytes);
    }
    for batch in [1usize, 8, 16, 64, 256, 512, 1024, 4096, 16384] {
        let name = format!("experts/b{batch}");
        if !BenchGpu::selected(&name) {
            continue;
        }
        let x = gpu.upload(&rng.bf16s(batch * hidden, -1.0, 1.0)).unwrap();
        let (mut idx, mut wt) = (gpu.zeros::<i32>(batch * top_k).unwrap(), gpu.zeros::<f32>(batch * top_k).unwrap());
        let router = Router { gate: &w.gate, bias: &w.score_bias };
        route(gpu, c.route_shape(), (&x, hidden), router, Routed { idx: &mut idx, weight: &mut wt }).unwrap();
        let mut d = Dispatch::new(gpu, n_exp, top_k, batch).unwrap();
        dispatch(gpu, &idx, &mut d).unwrap();
        let mut out = gpu.zeros::<bf16>(batch * top_k * hidden).unwrap();
        let flops = 4.0 * (batch * top_k * inter * hidden) as f64;
        // The up projections' weights stand in for the down projections too (the same size).
        let mlp = ExpertMlp { up, down: up, inter, hidden };
        let fp4 = ExpertMlp { up: nvfp4[0], down: nvfp4[1], inter, hidden };
        // The expert kernels are the paths up to 32 and 64 rows (EXPERT_KERNEL_MAX_ROWS,
        // FP8_EXPERT_KERNEL_MAX_ROWS); past 1024 they only take time.
        let paths: &[Path] = if batch <= 1024 { &Path::ALL } else { &Path::ALL[3..] };
        let active = gpu.download(d.active_count()).unwrap()[0] as usize;
        let wgmma = gpu.has(Kernel::MoeGroupedWgmma);
        let wide = gpu.fits(Kernel::MoeGroupedWide);
        for &path in
            paths.iter().filter(|p| (wgmma || !p.wgmma()) && (wide || !matches!(p, Path::Grouped(Tiles::Wide))))
        {
            let bf16 = ExpertMlp { up: ExpertWeights::Bf16(up), down: ExpertWeights::Bf16(up), inter, hidden };
            let (med, p10, p90) = b.calls_us(|| match path {
                Path::Cublas => experts_mlp_gemm(gpu, &d, &x, mlp, &mut out),
                Path::Grouped(tiles) => experts_mlp_grouped_as(gpu, &d, &x, bf16, tiles, &mut out),
                Path::GroupedFp8(tiles) => {
                    let fp8 = ExpertMlp { up: fp8, down: fp8, inter, hidden };
                    experts_mlp_grouped_as(gpu, &d, &x, fp8, tiles, &mut out)
                }
                Path::Kernel => experts_mlp(gpu, &d, &x, bf16, 0, &mut out),
                Path::KernelFp8 => {
                    experts_mlp(gpu, &d, &x, ExpertMlp { up: fp8, down: fp8, inter, hidden }, 0, &mut out)
                }
                Path::KernelNvfp4 => experts_mlp(gpu, &d, &x, fp4, 0, &mut out),
                Path::GroupedNvfp4(tiles) => experts_mlp_grouped_as(gpu, &d, &x, fp4, tiles, &mut out),
                Path::DequantizedNvfp4 => {
                    // SAFETY: to_bf16 writes every value before the grouped GEMM reads it.
                    let (mut u, mut dn) = unsafe {
                        (gpu.scratch::<bf16>(n_exp * inter * hidden)?, gpu.scratch::<bf16>(n_exp * inter * hidden)?)
                    };
                    host::nvfp4::to_bf16(gpu, nvfp4[0], n_exp, (inter, hidden), &mut *u)?;
                    host::nvfp4::to_bf16(gpu, nvfp4[1], n_exp, (hidden, inter), &mut *dn)?;
                    let w = ExpertMlp { up: ExpertWeights::Bf16(&u), down: ExpertWeights::Bf16(&dn), inter, hidden };
                    experts_mlp_grouped_as(gpu, &d, &x, w, Tiles::Wgmma, &mut out)
                }
            });
            // The routed experts' weights read once (the expert kernels read no more).
            let elem = match path {
                Path::Kernel => 2.0,
                Path::KernelFp8 => 1.0,
                Path::KernelNvfp4 => 0.5625,
                _ => 0.0,
            };
            let copy = elem * (2 * active * inter * hidden) as f64 / (med * 1e-6) / b.copy_bytes_per_s * 100.0;
            println!(
                "moe/{name} {:<20} {med:9.1} us (median of 11, p10 {p10:.1}, p90 {p90:.1}) {:6.1} TFLOP/s{}",
                path.label(),
                flops / (med * 1e-6) / 1e12,
                if elem > 0.0 { format!(", {active} experts: {copy:5.1}% of copy") } else { String::new() },
            );
        }
    }
}

fn benches(_: &mut Criterion) {
    let Some(b) = BenchGpu::open() else { return };
    let mut rng = Rng::new(17);
    let cuda = Cuda::on(b.gpu.clone());
    let nano = Nano::new();
    let (hidden, n_exp, _, inter, shared_inter) = nano.sizes();
    let gate = rng.bf16s(n_exp * hidden, -0.05, 0.05);
    let bias: Vec<f32> = (0..n_exp).map(|_| rng.uniform(-0.02, 0.02) as f32).collect();
    bench_route(&b, &nano, &mut rng, &b.gpu.upload(&gate).unwrap(), &b.gpu.upload(&bias).unwrap());
    let zeros = vec![0u8; 2 * shared_inter * hidden];
    let (up_s, down_s, su_s, sd_s) = ([inter, hidden], [hidden, inter], [shared_inter, hidden], [hidden, shared_inter]);
    let experts: Vec<Mlp> = (0..n_exp)
        .map(|_| Mlp {
            up: Linear::bf16("up", &up_s, &zeros[..2 * inter * hidden]),
            down: Linear::bf16("down", &down_s, &zeros[..2 * inter * hidden]),
        })
        .collect();
    let shared = Mlp { up: Linear::bf16("shared up", &su_s, &zeros), down: Linear::bf16("shared down", &sd_s, &zeros) };
    let w = MoeWeights {
        gate: cuda.upload(&gate).unwrap(),
        score_bias: cuda.upload32(&bias).unwrap(),
        experts: cuda.experts(&experts, Some(&shared)).unwrap(),
    };
    let up = b.gpu.zeros::<bf16>(n_exp * inter * hidden).unwrap();
    // FP8 experts: zero codes (the products' time does not depend on the values), unit weight
    // scales, static input scales.
    let codes = b.gpu.zeros::<u8>(n_exp * inter * hidden).unwrap();
    let ones = b.gpu.upload(&vec![1.0f32; n_exp]).unwrap();
    let fp8 = ExpertWeights::Fp8 { codes: &codes, w_scale: &ones, in_scale: Some(&ones) };
    // NVFP4 experts: zero codes and block scales, unit per-tensor scales.
    let row_bytes = |k| n_exp * host::nvfp4::row_bytes(k);
    let fp4_rows =
        [b.gpu.zeros::<u8>(inter * row_bytes(hidden)).unwrap(), b.gpu.zeros::<u8>(hidden * row_bytes(inter)).unwrap()];
    let nvfp4 = fp4_rows.each_ref().map(|rows| ExpertWeights::Nvfp4 { rows, global: &ones });
    bench_layer(&b, &nano, &mut rng, &cuda, &w, (&up, fp8, nvfp4));
}

criterion_group!(moe, benches);
criterion_main!(moe);
