//! The tensor-core matrix product (kernels-gpu/src/mma.rs) against an f64 product on the CPU,
//! every storage order of both operands, sizes that are and are not whole tiles, staged 16
//! bytes at a time (every size a multiple of 8) and one element at a time.

use half::bf16;
use host::mma::{Order, matmul};
use nemotron_rs::{Rng, gpu};

/// `a` stored in `order` (rows x cols logical).
fn stored(a: &[bf16], (rows, cols): (usize, usize), order: Order) -> Vec<bf16> {
    match order {
        Order::RowMajor => a.to_vec(),
        Order::Transposed => (0..cols * rows).map(|e| a[(e % rows) * cols + e / rows]).collect(),
    }
}

/// Checks one product; returns the elements compared. The bound: f32 accumulation of exact
/// bf16 products over k terms, `k 2^-22 sum |a b|` (twice the rounding of a sequential f32
/// sum: the tensor cores' own adder order and alignment), far below any misplaced element.
fn check(gpu: &host::Gpu, rng: &mut Rng, (m, n, k): (usize, usize, usize), ao: Order, bo: Order) -> usize {
    let a = rng.bf16s(m * k, -1.0, 1.0);
    let b = rng.bf16s(k * n, -1.0, 1.0);
    let da = gpu.upload(&stored(&a, (m, k), ao)).unwrap();
    let db = gpu.upload(&stored(&b, (k, n), bo)).unwrap();
    let mut d = gpu.upload(&vec![f32::NAN; m * n]).unwrap();
    matmul(gpu, (m, n, k), &da, ao, &db, bo, &mut d).unwrap();
    let got = gpu.download(&d).unwrap();
    let mut worst = 0.0f64;
    for i in 0..m {
        for j in 0..n {
            let (mut want, mut mag) = (0.0f64, 0.0f64);
            for l in 0..k {
                let v = f64::from(a[i * k + l].to_f32()) * f64::from(b[l * n + j].to_f32());
                want += v;
                mag += v.abs();
            }
            let g = f64::from(got[i * n + j]);
            let bound = k as f64 * mag * 2f64.powi(-22) + 1e-30;
            assert!(
                (g - want).abs() <= bound,
                "{m}x{n}x{k} {ao:?} {bo:?}: d[{i}][{j}] = {g}, want {want} (bound {bound:e})"
            );
            worst = worst.max((g - want).abs() / bound);
        }
    }
    println!("tc_matmul {m}x{n}x{k} a {ao:?} b {bo:?}: {} values, worst error {worst:.3} of the bound", m * n);
    m * n
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_matmul_matches_cpu_product_in_every_order() {
    let gpu = gpu();
    let mut rng = Rng::new(71);
    let orders = [Order::RowMajor, Order::Transposed];
    let mut total = 0;
    // Odd sizes (element-wise staging, partial tiles everywhere), whole tiles and multiples
    // of 8 (16-byte staging, partial k steps and edge tiles).
    for size in [(1, 1, 1), (17, 9, 23), (70, 130, 33), (64, 64, 64), (136, 72, 200), (8, 200, 8)] {
        for ao in orders {
            for bo in orders {
                total += check(&gpu, &mut rng, size, ao, bo);
            }
        }
    }
    println!("tc_matmul: {total} values compared");
    assert_eq!(total, 4 * (1 + 17 * 9 + 70 * 130 + 64 * 64 + 136 * 72 + 8 * 200));
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_matmul_refuses_wrong_lengths() {
    let gpu = gpu();
    let a = gpu.zeros::<bf16>(6).unwrap();
    let b = gpu.zeros::<bf16>(6).unwrap();
    let mut d = gpu.zeros::<f32>(4).unwrap();
    let err = matmul(&gpu, (2, 2, 4), &a, Order::RowMajor, &b, Order::RowMajor, &mut d).unwrap_err();
    assert!(err.to_string().contains("a"), "{err}");
    assert!(matmul(&gpu, (2, 2, 3), &a, Order::RowMajor, &b, Order::RowMajor, &mut d).is_ok());
}
