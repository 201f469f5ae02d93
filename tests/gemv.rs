//! The gemv kernels (kernels-gpu/src/gemv.rs: linear layers at few rows) against the f64
//! references (`#[ignore]`d: needs a GPU): bf16 weights in the warp and the split mode at
//! Nemotron-3 Nano's projection shapes and odd ones, e4m3 weights (W8A8) with a static input
//! scale and with per-token scales, NVFP4 weights (weight-only) and their dequantization to
//! bf16.

use half::bf16;
use host::cpu::gemm::linear;
use host::cpu::nvfp4::bf16_nearest;
use host::gemv::{Proj, Weights, gemv, gemv_split, gemv_tc};
use host::nvfp4::{pack_rows, row_bytes, to_bf16};
use nemotron_rs::{POISON_BF16, Rng, assert_close, assert_same, fp8_weights, gpu, nvfp4_weights, to_f64, w8a8};

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
    // (n, k, static input scale, rows, shift). A Nano expert's up projection with a static
    // input scale and with per-token scales at 1 row (the warp mode), 5 and 8 rows (one pass of
    // the tensor-core kernel) and 9 (two), q at 8; odd shapes: n not a multiple of the 32 rows
    // of a block, k not of the 64-byte half step (k 2720: a half step of 32 bytes at the end,
    // 16-byte loads; k 136: rows 8-byte aligned only, one 8-byte chunk at the end, at one row
    // through the warp mode too), 17 rows (three passes, one row in the last). The last column:
    // x that many elements into its allocation (1: 2-byte aligned rows, no input chunk loaded
    // whole).
    let cases = [
        (1856, 2688, true, 1, 0),
        (1856, 2688, false, 1, 0),
        (40, 136, true, 1, 0),
        (1856, 2688, true, 5, 0),
        (1856, 2688, false, 8, 0),
        (4096, 2688, true, 8, 0),
        (1856, 2688, false, 9, 0),
        (72, 2720, false, 3, 0),
        (40, 136, true, 5, 0),
        (40, 136, false, 17, 0),
        (1856, 2688, true, 8, 1),
    ];
    for (n, k, static_in, rows, shift) in cases {
        let (codes, w_scale, values) = fp8_weights(&mut rng, 1, n, k);
        let in_scale = static_in.then(|| rng.uniform(0.002, 0.004) as f32);
        let x = rng.bf16s(rows * k, -1.0, 1.0);
        let (dc, ds) = (gpu.upload(&codes).unwrap(), gpu.upload(&w_scale).unwrap());
        let din = in_scale.map(|s| gpu.upload(&[s]).unwrap());
        let w = Weights::Fp8 { codes: &dc, w_scale: &ds, in_scale: din.as_ref() };
        let mut y = gpu.upload(&vec![POISON_BF16; rows * n]).unwrap();
        let dx = gpu.upload(&[&vec![bf16::ZERO; shift][..], &x].concat()).unwrap();
        gemv(&gpu, &dx.slice(shift..), rows, Proj { w, n, k, relu2: false }, &mut y).unwrap();
        let want: Vec<f64> = x.chunks(k).flat_map(|r| w8a8(&to_f64(r), &values, w_scale[0], in_scale)).collect();
        let label = format!("FP8 gemv {n} x {k}, rows {rows}, static input scale {static_in}, x shifted {shift}");
        compared += assert_close(&label, &to_f64(&gpu.download(&y).unwrap()), &want, 1e-3, 1.0 / 128.0);
    }
    println!("FP8 gemv: {compared} values compared");
    assert_eq!(compared, cases.iter().map(|&(n, _, _, rows, _)| rows * n).sum::<usize>());
}

/// The NVFP4 gemv (weight-only: `x W^T` with `W` the exact dequantized weights) against f64,
/// both kernels (`gemv` at one row takes the warp mode, from two the tensor cores; `gemv_tc`
/// the tensor cores at every row count): Nano's shapes quantized as ModelOpt does (the expert
/// up projection, in_proj, out_proj) at 1 to 17 rows (a pass of the tensor-core kernel is 8),
/// with relu^2; k not a multiple of the warp mode's 256-element pass (2688, 2720: a checked
/// last pass) nor of the tensor-core kernel's 128-element half step (2720: 1360 code bytes); k
/// 144 (72 code bytes: a lane's 16-byte load half past k, one block scale of its two; at one row
/// through the warp mode too); k of one block; n not a multiple of 16 (a block's rows partly
/// past n).
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_gemv_nvfp4_matches_reference() {
    let gpu = gpu();
    let mut rng = Rng::new(99);
    let mut compared = 0;
    let cases = [
        (1856, 2688, 1, false),
        (10304, 2688, 1, false),
        (2688, 4096, 3, false),
        (1856, 2688, 4, true),
        (4096, 2688, 8, false),
        (2688, 1856, 9, true),
        (72, 2720, 2, false),
        (40, 144, 5, true),
        (40, 144, 1, false),
        (9, 16, 1, false),
        (24, 2720, 17, false),
    ];
    for (n, k, rows, relu2) in cases {
        let (packed, global, values) = nvfp4_weights(&mut rng, 1, n, k);
        let x = rng.bf16s(rows * k, -1.0, 1.0);
        let (dw, dg, dx) = (gpu.upload(&packed).unwrap(), gpu.upload(&global).unwrap(), gpu.upload(&x).unwrap());
        let want: Vec<f64> = x
            .chunks(k)
            .flat_map(|r| {
                let r = to_f64(r);
                values.chunks(k).map(move |w| w.iter().zip(&r).map(|(a, b)| a * b).sum::<f64>()).collect::<Vec<_>>()
            })
            .map(|v| if relu2 { bf16::from_f64(v).to_f64().max(0.0).powi(2) } else { v })
            .collect();
        let w = Weights::Nvfp4 { rows: &dw, global: &dg };
        for (kernel, tc) in [("gemv", false), ("gemv_tc", true)] {
            let mut y = gpu.upload(&vec![POISON_BF16; rows * n]).unwrap();
            let p = Proj { w, n, k, relu2 };
            if tc { gemv_tc(&gpu, &dx, rows, p, &mut y) } else { gemv(&gpu, &dx, rows, p, &mut y) }.unwrap();
            let label = format!("NVFP4 {kernel} {n} x {k}, rows {rows}, relu2 {relu2}");
            compared += assert_close(&label, &to_f64(&gpu.download(&y).unwrap()), &want, 1e-4, 1.0 / 128.0);
        }
    }
    println!("NVFP4 gemv: {compared} values compared");
    assert_eq!(compared, 2 * cases.iter().map(|&(n, _, rows, _)| rows * n).sum::<usize>());
}

/// The tensor-core NVFP4 kernel's weights (each made a bf16 from its code and block scale,
/// kernels-gpu/src/qgemv.rs) bit for bit: a row per e4m3 block scale code (all 254 that are not
/// NaN, negative ones too, subnormals and zero), its 16 weights the 16 e2m1 codes, times rows
/// of x that are the unit vectors: each output one weight times the per-tensor scale 1, a
/// product bf16 holds exactly (at most 6 significant bits), against the CPU's exact values.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_nvfp4_tc_weights_are_exact() {
    let gpu = gpu();
    let k = 16;
    let scales: Vec<u8> = (0..=255u8).filter(|s| s & 0x7f != 0x7f).collect();
    let n = scales.len();
    // Byte i of a row: codes 2i (low four bits) and 2i + 1.
    let codes: Vec<u8> = (0..n * k / 2).map(|i| (2 * (i % 8) as u8) | (2 * (i % 8) as u8 + 1) << 4).collect();
    let values = host::cpu::nvfp4::dequantize(&codes, &scales, 1.0, k);
    let x: Vec<bf16> = (0..k * k).map(|i| if i / k == i % k { bf16::ONE } else { bf16::ZERO }).collect();
    let (dw, dg) = (gpu.upload(&pack_rows(&codes, &scales, n, k).unwrap()).unwrap(), gpu.upload(&[1.0f32]).unwrap());
    let mut y = gpu.upload(&vec![POISON_BF16; k * n]).unwrap();
    let w = Weights::Nvfp4 { rows: &dw, global: &dg };
    gemv_tc(&gpu, &gpu.upload(&x).unwrap(), k, Proj { w, n, k, relu2: false }, &mut y).unwrap();
    // Zeros as +0 (the sign of a zero sum is the tensor cores' choice).
    let bits = |v: bf16| if v == bf16::ZERO { 0 } else { v.to_bits() };
    let got: Vec<u16> = gpu.download(&y).unwrap().into_iter().map(bits).collect();
    // Row j of y is column j of the weights.
    let want: Vec<u16> = (0..k * n).map(|i| bits(bf16_nearest(values[(i % n) * k + i / n]))).collect();
    let compared = assert_same("NVFP4 tensor-core weights", &got, &want);
    println!("NVFP4 tensor-core weights: {compared} compared, bit for bit");
    assert_eq!(compared, 16 * 254);
}

/// NVFP4 dequantized to bf16 on the device (`nvfp4::to_bf16`) against the CPU's exact values
/// (`host::cpu::nvfp4::dequantize`) rounded once to bf16 (`bf16_nearest`), bit for bit: three matrices of an
/// expert's shape (per-tensor scales of their own) and one whose first weight's product with
/// its per-tensor scale rounds in f32 onto a bf16 tie that the exact product is not on (a
/// rounding in f32 then to bf16 gets it wrong).
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_nvfp4_to_bf16_is_bit_exact() {
    let gpu = gpu();
    let mut rng = Rng::new(100);
    let mut compared = 0;
    let (n, k) = (1856, 2688);
    let (packed, global, values) = nvfp4_weights(&mut rng, 3, n, k);
    // The tie: a global scale and a block scale code whose 1.5 * scale * global does it.
    let (tie_global, tie_scale) = (0..)
        .map(|_| rng.uniform(1e-4, 1e-2) as f32)
        .find_map(|g| {
            (1u8..0x7f).find_map(|s| {
                let a = 1.5 * host::cpu::quant::e4m3_decode(s);
                let exact = f64::from(a) * f64::from(g);
                (bf16::from_f32(a * g) != bf16_nearest(exact)).then_some((g, s))
            })
        })
        .unwrap();
    let (small_n, small_k) = (4, 32);
    let mut codes: Vec<u8> = (0..small_n * small_k / 2).map(|_| rng.next_u64() as u8).collect();
    codes[0] = (codes[0] & 0xf0) | 3; // element 0: +1.5
    let scales: Vec<u8> = (0..small_n * small_k / 16).map(|i| if i == 0 { tie_scale } else { 0x38 }).collect();
    let cases = [
        (packed, global, values, 3, n, k),
        (
            pack_rows(&codes, &scales, small_n, small_k).unwrap(),
            vec![tie_global],
            host::cpu::nvfp4::dequantize(&codes, &scales, tie_global, small_k),
            1,
            small_n,
            small_k,
        ),
    ];
    for (packed, global, values, matrices, n, k) in cases {
        let (dw, dg) = (gpu.upload(&packed).unwrap(), gpu.upload(&global).unwrap());
        let mut out = gpu.upload(&vec![POISON_BF16; matrices * n * k]).unwrap();
        to_bf16(&gpu, Weights::Nvfp4 { rows: &dw, global: &dg }, matrices, (n, k), &mut out).unwrap();
        let got: Vec<u16> = gpu.download(&out).unwrap().iter().map(|v| v.to_bits()).collect();
        let want: Vec<u16> = values.iter().map(|&v| bf16_nearest(v).to_bits()).collect();
        compared += assert_same(&format!("NVFP4 to bf16, {matrices} x {n} x {k}"), &got, &want);
    }
    println!("NVFP4 to bf16: {compared} weights compared, bit for bit");
    assert_eq!(compared, 3 * n * k + small_n * small_k);
}

/// NVFP4 launches refuse what their kernels cannot take, naming it: k a multiple of 8 but not
/// of 16 (a block scale would cover two rows; both gemv kernels), codes and scales of another
/// length than the matrix's, the dequantization given bf16 weights or a short output, the
/// tensor-core gemv given bf16 weights.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_nvfp4_misuse_is_refused() {
    let gpu = gpu();
    let (n, k) = (8, 32);
    let (rows, one) = (gpu.zeros::<u8>(n * row_bytes(k)).unwrap(), gpu.upload(&[1.0f32]).unwrap());
    let (x, mut y) = (gpu.zeros::<bf16>(k).unwrap(), gpu.zeros::<bf16>(n).unwrap());
    let w = Weights::Nvfp4 { rows: &rows, global: &one };
    gemv(&gpu, &x, 1, Proj { w, n, k, relu2: false }, &mut y).unwrap();
    let mut refusals = 0;
    for (proj, says) in [
        (Proj { w, n, k: 24, relu2: false }, "a multiple of 16"),
        (Proj { w, n: n + 1, k, relu2: false }, "`w`"),
        (Proj { w, n: n - 1, k, relu2: false }, "`w`"),
    ] {
        let err = gemv(&gpu, &x, 1, proj, &mut y).unwrap_err().to_string();
        assert!(err.contains(says), "{err}");
        refusals += 1;
    }
    let mut out = gpu.zeros::<bf16>(n * k).unwrap();
    to_bf16(&gpu, w, 1, (n, k), &mut out).unwrap();
    let bf = gpu.zeros::<bf16>(n * k).unwrap();
    let err = to_bf16(&gpu, Weights::Bf16(&bf), 1, (n, k), &mut out).unwrap_err().to_string();
    assert!(err.contains("NVFP4 weights"), "{err}");
    let mut short = gpu.zeros::<bf16>(n * k - 1).unwrap();
    let err = to_bf16(&gpu, w, 1, (n, k), &mut short).unwrap_err().to_string();
    assert!(err.contains("`out`"), "{err}");
    let err = to_bf16(&gpu, w, 2, (n, k), &mut out).unwrap_err().to_string();
    assert!(err.contains("`w`"), "{err}");
    let err = gemv_tc(&gpu, &x, 1, Proj { w: Weights::Bf16(&bf), n, k, relu2: false }, &mut y).unwrap_err().to_string();
    assert!(err.contains("FP8 or NVFP4 weights"), "{err}");
    let err = gemv_tc(&gpu, &x, 1, Proj { w, n, k: 24, relu2: false }, &mut y).unwrap_err().to_string();
    assert!(err.contains("a multiple of 16"), "{err}");
    println!("NVFP4 misuse: {} refusals, each naming its argument", refusals + 5);
}
