//! Linear layers through cuBLASLt against the f64 reference (`#[ignore]`d: needs a GPU), at
//! NemotronH projection shapes and odd ones; the reference itself hand-checked in CI.

use half::bf16;
use host::cpu::gemm as cpu;
use host::gemm::linear;
use nemotron_rs::{POISON_BF16, Rng, assert_close, gpu, to_f64};

#[test]
fn reference_hand_checked() {
    let b = |v: &[f32]| v.iter().map(|&x| bf16::from_f32(x)).collect::<Vec<_>>();
    // X [2, 3] = [[1, 2, 3], [4, 5, 6]], W [2, 3] = [[1, 0, -1], [0.5, 0.5, 0.5]].
    let y = cpu::linear(&b(&[1., 2., 3., 4., 5., 6.]), &b(&[1., 0., -1., 0.5, 0.5, 0.5]), 2, 2, 3);
    assert_close("linear", &y, &[-2.0, 3.0, -2.0, 7.5], 0.0, 0.0);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_linear_matches_reference() {
    let gpu = gpu();
    let mut rng = Rng::new(61);
    let mut compared = 0;
    // (m, n, k): in_proj at decode and prefill batch, out_proj, an expert's up and down, odd.
    for &(m, n, k) in &[
        (1, 10304, 2688),
        (64, 10304, 2688),
        (7, 2688, 4096),
        (256, 1856, 2688),
        (3, 2688, 1856),
        (5, 33, 17),
        (1, 1, 1),
    ] {
        let s = 1.0 / (k as f64).sqrt();
        let (x, w) = (rng.bf16s(m * k, -1.0, 1.0), rng.bf16s(n * k, -s, s));
        let (dx, dw) = (gpu.upload(&x).unwrap(), gpu.upload(&w).unwrap());
        let mut dy = gpu.upload(&vec![POISON_BF16; m * n]).unwrap();
        linear(&gpu, m, &dx.as_view(), &dw.as_view(), n, k, &mut dy).unwrap();
        let want = cpu::linear(&x, &w, m, n, k);
        // bf16 output (half an ulp) plus f32 accumulation over k products of O(1/sqrt(k)) terms.
        compared += assert_close(
            &format!("linear {m}x{n}x{k}"),
            &to_f64(&gpu.download(&dy).unwrap()),
            &want,
            1e-4,
            1.0 / 256.0 + 1e-4,
        );
    }
    println!("linear: {compared} values compared");
}
