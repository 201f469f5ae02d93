//! `cargo bench --bench gemv`: linear layers at decode batch sizes, Nemotron-3 Nano shapes,
//! through the gemv kernels' warp mode (`host::gemv::gemv`), their split mode
//! (`host::gemv::gemv_split`) and through cuBLASLt (`host::gemm::linear`): which the CUDA
//! backend takes for bf16 linear layers. Method as in
//! benches/norm.rs (CUDA graph replays timed with events; cold: weights rotated through more
//! than the L2); bytes: the weight, x and y once. Then FP8 (W8A8, static input scale):
//! `fp8/.../m1` and `m8` the FP8 gemv alone, by graph replays, cold (the bf16 gemv's method);
//! `fp8/.../m16` and up the FP8 gemv against the FP8 GEMM on tensor cores
//! (`host::grouped::linear_fp8_as`, its quantization included; 64-row tiles and, where the GPU
//! has it, `wgmma`) and against cuBLASLt's FP8 GEMM (`host::gemm::linear_fp8`, its quantization
//! included) from 16 to 4096 rows, each timed with events around one call (median of
//! 11; the GEMM's temporaries outgrow a graph's arena), with bf16 beside it: cuBLASLt and the
//! same tensor-core GEMMs (`host::grouped::gemm`, every tile); TFLOP/s of `2 rows n k`. Then
//! NVFP4 (weight-only): `nvfp4/.../m1` to `m64` the NVFP4 gemv by graph replays, cold, bytes the
//! rows (codes, block scales, padding), x and y once: `kernel` what `gemv` takes (the warp mode
//! at one row, then the tensor cores), `tc` the tensor-core kernel where `gemv` takes the warp
//! mode; `nvfp4/.../m4` and up also the path past the gemv's rows, the weight dequantized to
//! bf16 (`host::nvfp4::to_bf16`) then cuBLASLt, events around each call (median of 11).

use half::bf16;
use host::gemv::{NVFP4_TC_MIN_ROWS, Proj, Weights, gemv, gemv_split, gemv_tc};
use host::grouped::{Tiles, gemm, linear_fp8_as};
use host::nvfp4::{row_bytes, to_bf16};
use nemotron_rs::{BenchGpu, Rng};

fn main() {
    let Some(b) = BenchGpu::open() else { return };
    let gpu = &b.gpu;
    let mut rng = Rng::new(5);
    // (name, n, k): Mamba in_proj and out_proj, the shared expert's up and down, attention
    // q and o, the LM head.
    let shapes = [
        ("in_proj", 10304, 2688),
        ("out_proj", 2688, 4096),
        ("shared_up", 3712, 2688),
        ("shared_down", 2688, 3712),
        ("q", 4096, 2688),
        ("lm_head", 131072, 2688),
    ];
    for (name, n, k) in shapes {
        let sets = BenchGpu::cold_sets(n * k * 2);
        let ws: Vec<_> = (0..sets).map(|_| gpu.upload(&rng.bf16s(n * k, -0.05, 0.05)).unwrap()).collect();
        for rows in [1usize, 2, 4, 8, 16, 32, 64] {
            let tag = format!("{name}/{n}x{k}/m{rows}");
            // As the results are named up to the kernel, so `m1/` selects one row alone.
            if !BenchGpu::selected(&format!("gemv/{tag}/")) {
                continue;
            }
            let x = gpu.upload(&rng.bf16s(rows * k, -1.0, 1.0)).unwrap();
            let mut y = gpu.zeros::<bf16>(rows * n).unwrap();
            let bytes = n * k * 2 + rows * (n + k) * 2;
            let proj = |i: usize| Proj { w: Weights::Bf16(&ws[i]), n, k, relu2: false };
            let timed = b.capture(sets, |i| gemv(gpu, &x, rows, proj(i), &mut y));
            timed.report(&format!("gemv/{tag}/kernel"), bytes);
            let timed = b.capture(sets, |i| gemv_split(gpu, &x, rows, &ws[i], (n, k), &mut y));
            timed.report(&format!("gemv/{tag}/split"), bytes);
            let timed =
                b.capture(sets, |i| host::gemm::linear(gpu, rows, &x.as_view(), &ws[i].as_view(), n, k, &mut y));
            timed.report(&format!("gemv/{tag}/cublaslt"), bytes);
        }
    }
    // FP8: zero codes (the products' time does not depend on the values), unit scales.
    let one = gpu.upload(&[1.0f32]).unwrap();
    let wide = gpu.fits(host::Kernel::GemmWideBf16).then_some(Tiles::Wide);
    let dense_tiles: Vec<Tiles> = [Some(Tiles::Narrow), wide, gpu.has(host::Kernel::GemmWgmma).then_some(Tiles::Wgmma)]
        .into_iter()
        .flatten()
        .collect();
    for (name, n, k) in shapes.into_iter().filter(|&(name, ..)| name != "lm_head") {
        let (codes, wb) = (gpu.zeros::<u8>(n * k).unwrap(), gpu.zeros::<bf16>(n * k).unwrap());
        let w = Weights::Fp8 { codes: &codes, w_scale: &one, in_scale: Some(&one) };
        // Decode rows: the FP8 gemv by graph replays as the bf16 one above, cold (code sets
        // rotated), beside the bf16 gemv's bytes floor.
        let sets = BenchGpu::cold_sets(n * k);
        let code_sets: Vec<_> = (0..sets).map(|_| gpu.zeros::<u8>(n * k).unwrap()).collect();
        for rows in [1usize, 8] {
            let tag = format!("fp8/{name}/{n}x{k}/m{rows}");
            if !BenchGpu::selected(&format!("gemv/{tag}/")) {
                continue;
            }
            let x = gpu.upload(&rng.bf16s(rows * k, -1.0, 1.0)).unwrap();
            let mut y = gpu.zeros::<bf16>(rows * n).unwrap();
            let proj = |i: usize| Proj {
                w: Weights::Fp8 { codes: &code_sets[i], w_scale: &one, in_scale: Some(&one) },
                n,
                k,
                relu2: false,
            };
            let timed = b.capture(sets, |i| gemv(gpu, &x, rows, proj(i), &mut y));
            timed.report(&format!("gemv/{tag}/kernel"), n * k + rows * (n + k) * 2);
        }
        for rows in [16usize, 64, 128, 512, 4096] {
            let tag = format!("fp8/{name}/{n}x{k}/m{rows}");
            if !BenchGpu::selected(&format!("gemv/{tag}/")) {
                continue;
            }
            let x = gpu.upload(&rng.bf16s(rows * k, -1.0, 1.0)).unwrap();
            let mut y = gpu.zeros::<bf16>(rows * n).unwrap();
            let flops = 2.0 * (rows * n * k) as f64;
            let line = |what: &str, (med, p10, p90): (f64, f64, f64)| {
                let rate = flops / (med * 1e-6) / 1e12;
                println!(
                    "gemv/{tag}/{what:<9} {med:9.1} us (median of 11, p10 {p10:.1}, p90 {p90:.1}) {rate:6.1} TFLOP/s"
                );
            };
            if rows <= 128 {
                line("gemv", b.calls_us(|| gemv(gpu, &x, rows, Proj { w, n, k, relu2: false }, &mut y)));
            }
            let proj = Proj { w, n, k, relu2: false };
            for tiles in dense_tiles.iter().copied().filter(|&t| t != Tiles::Wide) {
                let what = format!("fp8 {tiles:?}");
                line(&what, b.calls_us(|| linear_fp8_as(gpu, (&x.as_view(), rows), proj, tiles, &mut y)));
            }
            line("fp8 cublaslt", b.calls_us(|| host::gemm::linear_fp8(gpu, (&x.as_view(), rows), proj, &mut y)));
            // bf16 beside it: cuBLASLt (the model's path past one row) and the same tensor-core
            // GEMMs in bf16.
            line("cublaslt", b.calls_us(|| host::gemm::linear(gpu, rows, &x.as_view(), &wb.as_view(), n, k, &mut y)));
            for &tiles in &dense_tiles {
                let what = format!("bf16 {tiles:?}");
                line(&what, b.calls_us(|| gemm(gpu, (&x, rows), Proj { w: &wb, n, k, relu2: false }, tiles, &mut y)));
            }
        }
    }
    // NVFP4: zero codes and block scales (the time does not depend on the values), a unit
    // per-tensor scale.
    for (name, n, k) in shapes.into_iter().filter(|&(name, ..)| name != "lm_head") {
        let sets = BenchGpu::cold_sets(n * row_bytes(k));
        let row_sets: Vec<_> = (0..sets).map(|_| gpu.zeros::<u8>(n * row_bytes(k)).unwrap()).collect();
        let mut wb = gpu.zeros::<bf16>(n * k).unwrap();
        for rows in [1usize, 2, 4, 8, 16, 32, 64] {
            let tag = format!("nvfp4/{name}/{n}x{k}/m{rows}");
            if !BenchGpu::selected(&format!("gemv/{tag}/")) {
                continue;
            }
            let x = gpu.upload(&rng.bf16s(rows * k, -1.0, 1.0)).unwrap();
            let mut y = gpu.zeros::<bf16>(rows * n).unwrap();
            let w = |i: usize| Weights::Nvfp4 { rows: &row_sets[i], global: &one };
            let bytes = n * row_bytes(k) + rows * (n + k) * 2;
            let timed = b.capture(sets, |i| gemv(gpu, &x, rows, Proj { w: w(i), n, k, relu2: false }, &mut y));
            timed.report(&format!("gemv/{tag}/kernel"), bytes);
            if rows < NVFP4_TC_MIN_ROWS {
                let timed = b.capture(sets, |i| gemv_tc(gpu, &x, rows, Proj { w: w(i), n, k, relu2: false }, &mut y));
                timed.report(&format!("gemv/{tag}/tc"), bytes);
            }
            if rows >= 4 {
                let (med, p10, p90) = b.calls_us(|| {
                    to_bf16(gpu, w(0), 1, (n, k), &mut wb)?;
                    host::gemm::linear(gpu, rows, &x.as_view(), &wb.as_view(), n, k, &mut y)
                });
                println!("gemv/{tag}/to_bf16+cublaslt {med:9.1} us (median of 11, p10 {p10:.1}, p90 {p90:.1})");
            }
        }
    }
}
