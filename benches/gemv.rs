//! `cargo bench --bench gemv`: linear layers at decode batch sizes, Nemotron-3 Nano shapes,
//! through the gemv kernels' warp mode (`host::gemv::gemv`), their split mode
//! (`host::gemv::gemv_split`) and through cuBLASLt (`host::gemm::linear`): which the CUDA
//! backend takes for bf16 linear layers. Method as in
//! benches/norm.rs (CUDA graph replays timed with events; cold: weights rotated through more
//! than the L2); bytes: the weight, x and y once.

use half::bf16;
use host::gemv::{Proj, Weights, gemv, gemv_split};
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
}
