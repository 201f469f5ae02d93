//! The gemv kernels (kernels-gpu/src/gemv.rs: linear layers at few rows) against the f64
//! references (`#[ignore]`d: needs a GPU): bf16 weights in the warp and the split mode at
//! Nemotron-3 Nano's projection shapes and odd ones, e4m3 weights (W8A8) with a static input
//! scale and with per-token scales.

use host::cpu::gemm::linear;
use host::gemv::{Proj, Weights, gemv, gemv_split};
use nemotron_rs::{POISON_BF16, Rng, assert_close, fp8_weights, gpu, to_f64, w8a8};

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_gemv_matches_reference() {
    let gpu = gpu();
    let mut rng = Rng::new(96);
    let mut compared = 0;
    // Nano's out_proj and shared down projection (the split mode's rows), in_proj and the
    // fused q/k/v (the warp mode's) at one row; rows of k not a multiple of the kernels'
    // strides, n not of their rows per block, a few rows, k of one chunk. Both modes on every
    // case.
    let cases =
        [(2688, 4096, 1), (2688, 3712, 1), (10304, 2688, 1), (4608, 2688, 1), (7, 1032, 3), (5, 40, 2), (9, 8, 1)];
    for (n, k, rows) in cases {
        let bound = (3.0 / k as f64).sqrt();
        let (w, x) = (rng.bf16s(n * k, -bound, bound), rng.bf16s(rows * k, -1.0, 1.0));
        let (dw, dx) = (gpu.upload(&w).unwrap(), gpu.upload(&x).unwrap());
        let want = linear(&x, &w, rows, n, k);
        for split in [true, false] {
            let mut out = gpu.upload(&vec![POISON_BF16; rows * n]).unwrap();
            if split {
                gemv_split(&gpu, &dx, rows, &dw, (n, k), &mut out).unwrap();
            } else {
                gemv(&gpu, &dx, rows, Proj { w: Weights::Bf16(&dw), n, k, relu2: false }, &mut out).unwrap();
            }
            let label = format!("gemv (split: {split}) {n} x {k}, rows {rows}");
            // bf16 output (2^-8 relative) over f32 sums of bf16 products.
            compared += assert_close(&label, &to_f64(&gpu.download(&out).unwrap()), &want, 1e-4, 1.0 / 128.0);
        }
    }
    let expected: usize = cases.iter().map(|&(n, _, rows)| 2 * n * rows).sum();
    println!("gemv: {compared} values compared");
    assert_eq!(compared, expected);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_gemv_fp8_matches_reference() {
    let gpu = gpu();
    let mut rng = Rng::new(97);
    let mut compared = 0;
    // A Nano expert's up projection shape with a static input scale and with per-token scales;
    // an odd shape.
    let (cases, rows) = ([(1856, 2688, true), (1856, 2688, false), (40, 136, true)], 5);
    for (n, k, static_in) in cases {
        let (codes, w_scale, values) = fp8_weights(&mut rng, 1, n, k);
        let in_scale = static_in.then(|| rng.uniform(0.002, 0.004) as f32);
        let x = rng.bf16s(rows * k, -1.0, 1.0);
        let (dc, ds) = (gpu.upload(&codes).unwrap(), gpu.upload(&w_scale).unwrap());
        let din = in_scale.map(|s| gpu.upload(&[s]).unwrap());
        let w = Weights::Fp8 { codes: &dc, w_scale: &ds, in_scale: din.as_ref() };
        let mut y = gpu.upload(&vec![POISON_BF16; rows * n]).unwrap();
        gemv(&gpu, &gpu.upload(&x).unwrap(), rows, Proj { w, n, k, relu2: false }, &mut y).unwrap();
        let want: Vec<f64> = x.chunks(k).flat_map(|r| w8a8(&to_f64(r), &values, w_scale[0], in_scale)).collect();
        let label = format!("FP8 gemv {n} x {k}, rows {rows}, static input scale {static_in}");
        compared += assert_close(&label, &to_f64(&gpu.download(&y).unwrap()), &want, 1e-3, 1.0 / 128.0);
    }
    println!("FP8 gemv: {compared} values compared");
    assert_eq!(compared, cases.iter().map(|&(n, _, _)| rows * n).sum::<usize>());
}
