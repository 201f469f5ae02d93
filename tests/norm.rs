//! RMSNorm family: the CPU reference against hand-checked values (CI), and the kernels
//! against the reference on the GPU (`#[ignore]`d: run with `--include-ignored` on a GPU).

use half::bf16;
use host::Rows;
use host::cpu::{norm as cpu, quant as cpu_quant};
use host::norm::{MANY_ROWS, NormShape, RowPath, add_rms_norm, gated_norm, gated_norm_fp8, rms_norm};
use host::quant::quant_token;
use nemotron_rs::{POISON_BF16, POISON_FP8, Rng, assert_close, assert_same, gpu, to_f64};

const EPS: f32 = 1e-5;
/// bf16 output vs the f64 reference: half a bf16 ulp (2^-8 relative) plus f32 rounding slack.
const RTOL: f64 = 1.0 / 256.0 + 1e-5;
const ATOL: f64 = 1e-6;

fn bf(v: &[f64]) -> Vec<bf16> {
    v.iter().map(|&x| bf16::from_f64(x)).collect()
}

#[test]
fn reference_rms_norm_hand_checked() {
    // Row [3, 4]: mean square 12.5; y = w * x / sqrt(12.5 + eps).
    let y = cpu::rms_norm(&bf(&[3.0, 4.0]), &bf(&[1.0, 2.0]), 2, 1e-5);
    let r = (12.5f64 + 1e-5).sqrt();
    assert_close("rms [3,4]", &y, &[3.0 / r, 8.0 / r], 0.0, 1e-15);
    // Two rows are independent.
    let y = cpu::rms_norm(&bf(&[1.0, 1.0, 2.0, 2.0]), &bf(&[1.0, 1.0]), 2, 0.0);
    assert_close("rms rows", &y, &[1.0, 1.0, 1.0, 1.0], 0.0, 1e-15);
}

#[test]
fn reference_gated_norm_hand_checked() {
    // z = 0 gives silu(0) = 0: u = 0, y = 0 whatever x.
    let y = cpu::gated_norm(&bf(&[5.0, -3.0]), Some(&bf(&[0.0, 0.0])), &bf(&[1.0, 1.0]), 2, 1, 1e-5);
    assert_close("gate 0", &y, &[0.0, 0.0], 0.0, 0.0);
    // Two groups of 2 normalize separately: group 0 = [1, 1] (after gating), group 1 = [2, 2]
    // scaled differently by w; with eps = 0 the common gate silu(10) cancels.
    let x = bf(&[1.0, 1.0, 2.0, -2.0]);
    let z = bf(&[10.0; 4]);
    let y = cpu::gated_norm(&x, Some(&z), &bf(&[1.0, 2.0, 3.0, 4.0]), 4, 2, 0.0);
    assert_close("two groups", &y, &[1.0, 2.0, 3.0, -4.0], 0.0, 1e-12);
    // One group of 4 over the same data mixes the groups: mean square of [1,1,2,-2] = 2.5.
    let y = cpu::gated_norm(&x, Some(&z), &bf(&[1.0; 4]), 4, 1, 0.0);
    let r = 2.5f64.sqrt();
    assert_close("one group", &y, &[1.0 / r, 1.0 / r, 2.0 / r, -2.0 / r], 0.0, 1e-12);
}

/// Rows with values of different magnitudes per row, never all zero.
fn activations(rng: &mut Rng, rows: usize, width: usize) -> Vec<bf16> {
    (0..rows)
        .flat_map(|r| {
            let scale = 0.1 + (r % 7) as f64;
            rng.bf16s(width, -scale, scale)
        })
        .collect()
}

/// Copies contiguous `[rows, width]` into `[rows, stride]` with garbage in the padding.
fn strided(rng: &mut Rng, v: &[bf16], width: usize, stride: usize) -> Vec<bf16> {
    v.chunks_exact(width).flat_map(|r| r.iter().copied().chain(rng.bf16s(stride - width, 50.0, 60.0))).collect()
}

/// (rows, width, groups): NemotronH widths (hidden 2688, D_in 4096 with 8 groups, in_proj
/// 10304) and edges (one row, one channel, widths not a multiple of the block, odd groups).
/// The widest row (32768: 1024 threads of 4 chunks) and widths with a partial last chunk (257)
/// or a partial last block (2688: 336 chunks on 96 threads) are edges too.
const PLAIN_CASES: &[(usize, usize)] =
    &[(1, 2688), (64, 2688), (7, 4096), (3, 10304), (1, 1), (5, 1000), (2, 257), (2, 32768)];
const GATED_CASES: &[(usize, usize, usize)] = &[
    (64, 4096, 8),
    (1, 4096, 8),
    (129, 4096, 8),
    (3, 1000, 5),
    (2, 24, 3),
    (1, 1, 1),
    (4, 2048, 256),
    (2, 10304, 1),
    (3, 1001, 1),
    (1, 32768, 8),
];

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_rms_norm_matches_reference() {
    let gpu = gpu();
    let mut rng = Rng::new(1);
    let mut compared = 0;
    for &(rows, width) in PLAIN_CASES {
        for x_stride in [width, width + 3] {
            let x = activations(&mut rng, rows, width);
            let w = rng.bf16s(width, -2.0, 2.0);
            let shape = NormShape::new(rows, width, 1, EPS);
            let dx = gpu.upload(&strided(&mut rng, &x, width, x_stride)).unwrap();
            let dw = gpu.upload(&w).unwrap();
            let mut dy = gpu.upload(&vec![POISON_BF16; rows * width]).unwrap();
            rms_norm(&gpu, shape, Rows::strided(&dx, rows, width, x_stride), &dw, &mut dy).unwrap();
            let got = to_f64(&gpu.download(&dy).unwrap());
            let want = cpu::rms_norm(&x, &w, width, EPS as f64);
            compared += assert_close(&format!("rms {rows}x{width} stride {x_stride}"), &got, &want, ATOL, RTOL);
        }
    }
    println!("rms_norm: {compared} elements compared");
}

/// The residual add fused with the norm: h becomes bf16(h + add) (bit-exact), y the norm of
/// that sum.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_add_rms_norm_matches_reference() {
    let gpu = gpu();
    let mut rng = Rng::new(2);
    let mut compared = 0;
    for &(rows, width) in PLAIN_CASES {
        let (h, add) = (activations(&mut rng, rows, width), activations(&mut rng, rows, width));
        let w = rng.bf16s(width, -2.0, 2.0);
        let (mut dh, dadd, dw) = (gpu.upload(&h).unwrap(), gpu.upload(&add).unwrap(), gpu.upload(&w).unwrap());
        let mut dy = gpu.upload(&vec![POISON_BF16; rows * width]).unwrap();
        add_rms_norm(&gpu, NormShape::new(rows, width, 1, EPS), &mut dh, &dadd, &dw, &mut dy).unwrap();
        let sum: Vec<bf16> = h.iter().zip(&add).map(|(a, b)| bf16::from_f32(a.to_f32() + b.to_f32())).collect();
        compared += assert_same(&format!("add {rows}x{width}"), &gpu.download(&dh).unwrap(), &sum);
        let want = cpu::rms_norm(&sum, &w, width, EPS as f64);
        let got = to_f64(&gpu.download(&dy).unwrap());
        compared += assert_close(&format!("add+rms {rows}x{width}"), &got, &want, ATOL, RTOL);
    }
    println!("add_rms_norm: {compared} elements compared");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_gated_norm_matches_reference() {
    let gpu = gpu();
    let mut rng = Rng::new(2);
    let mut compared = 0;
    for &(rows, width, groups) in GATED_CASES {
        // Contiguous, and strided as the mixer reads z out of in_proj's [T, 10304] output.
        for (x_stride, z_stride) in [(width, width), (width + 1, 10304.max(width))] {
            let (x, z) = (activations(&mut rng, rows, width), rng.bf16s(rows * width, -6.0, 6.0));
            let w = rng.bf16s(width, -2.0, 2.0);
            let shape = NormShape::new(rows, width, groups, EPS);
            let dx = gpu.upload(&strided(&mut rng, &x, width, x_stride)).unwrap();
            let dz = gpu.upload(&strided(&mut rng, &z, width, z_stride)).unwrap();
            let dw = gpu.upload(&w).unwrap();
            let mut dy = gpu.upload(&vec![POISON_BF16; rows * width]).unwrap();
            let (xr, zr) = (Rows::strided(&dx, rows, width, x_stride), Rows::strided(&dz, rows, width, z_stride));
            gated_norm(&gpu, shape, xr, zr, &dw, &mut dy).unwrap();
            let got = to_f64(&gpu.download(&dy).unwrap());
            let want = cpu::gated_norm(&x, Some(&z), &w, width, groups, EPS as f64);
            let label = format!("gated {rows}x{width} g{groups} strides {x_stride}/{z_stride}");
            compared += assert_close(&label, &got, &want, ATOL, RTOL);
        }
    }
    println!("gated_norm: {compared} elements compared");
}

/// A wrong group size (the whole row as one group) must fail the tolerance: shows the test
/// separates the defect from rounding noise.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_gated_norm_tolerance_catches_wrong_groups() {
    let gpu = gpu();
    let mut rng = Rng::new(3);
    let (rows, width, groups) = (8, 4096, 8);
    let (x, z) = (activations(&mut rng, rows, width), rng.bf16s(rows * width, -6.0, 6.0));
    // Make groups differ in scale so a wrong grouping changes the result.
    let x: Vec<bf16> =
        x.iter().enumerate().map(|(i, v)| bf16::from_f32(v.to_f32() * (1 + (i % width) / 512) as f32)).collect();
    let w = rng.bf16s(width, -2.0, 2.0);
    let (dx, dz, dw) = (gpu.upload(&x).unwrap(), gpu.upload(&z).unwrap(), gpu.upload(&w).unwrap());
    let mut dy = gpu.zeros::<bf16>(rows * width).unwrap();
    let (xr, zr) = (Rows::new(&dx, rows, width), Rows::new(&dz, rows, width));
    gated_norm(&gpu, NormShape::new(rows, width, groups, EPS), xr, zr, &dw, &mut dy).unwrap();
    let got = to_f64(&gpu.download(&dy).unwrap());
    let right = cpu::gated_norm(&x, Some(&z), &w, width, groups, EPS as f64);
    let wrong = cpu::gated_norm(&x, Some(&z), &w, width, 1, EPS as f64);
    assert!(got.len() == rows * width && right.len() == got.len() && wrong.len() == got.len(), "outputs compared");
    let rel = |a: &[f64], b: &[f64]| a.iter().zip(b).map(|(g, w)| (g - w).abs() / (ATOL + w.abs())).fold(0.0, f64::max);
    let (noise, defect) = (rel(&got, &right), rel(&got, &wrong));
    println!(
        "{} outputs, max relative error: against the right grouping {noise:.2e}, against one group {defect:.2e}, \
         band {RTOL:.2e}",
        got.len()
    );
    assert!(
        noise <= RTOL && defect > 10.0 * RTOL,
        "tolerance band does not separate noise {noise} from defect {defect}"
    );
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_gated_norm_fp8_equals_unfused_and_reference() {
    let gpu = gpu();
    let mut rng = Rng::new(4);
    let (mut same, mut close) = (0, 0);
    for &(rows, width, groups) in GATED_CASES {
        for amax_ub in [None, Some(0.5)] {
            let (x, z) = (activations(&mut rng, rows, width), rng.bf16s(rows * width, -6.0, 6.0));
            let w = rng.bf16s(width, -2.0, 2.0);
            let shape = NormShape::new(rows, width, groups, EPS);
            let (dx, dz, dw) = (gpu.upload(&x).unwrap(), gpu.upload(&z).unwrap(), gpu.upload(&w).unwrap());
            let mut q = gpu.upload(&vec![POISON_FP8; rows * width]).unwrap();
            let mut s = gpu.upload(&vec![f32::NAN; rows]).unwrap();
            let (xr, zr) = (Rows::new(&dx, rows, width), Rows::new(&dz, rows, width));
            gated_norm_fp8(&gpu, shape, (xr, zr), &dw, amax_ub, (&mut q, &mut s)).unwrap();
            // Unfused: gated norm, then per-token quantization of its bf16 output.
            let mut y = gpu.zeros::<bf16>(rows * width).unwrap();
            gated_norm(&gpu, shape, xr, zr, &dw, &mut y).unwrap();
            let mut q2 = gpu.upload(&vec![POISON_FP8; rows * width]).unwrap();
            let mut s2 = gpu.upload(&vec![f32::NAN; rows]).unwrap();
            quant_token(&gpu, width, &y, amax_ub, &mut q2, &mut s2).unwrap();
            let label = format!("fused {rows}x{width} g{groups} ub {amax_ub:?}");
            let (q, s) = (gpu.download(&q).unwrap(), gpu.download(&s).unwrap());
            same += assert_same(&format!("{label} codes"), &q, &gpu.download(&q2).unwrap());
            same += assert_same(&format!("{label} scales"), &s, &gpu.download(&s2).unwrap());
            // Against the reference: dequantized codes within e4m3's half-ulp (2^-4 relative)
            // of the bf16-rounded reference, plus the subnormal step; clipped where ub binds.
            let want = cpu::gated_norm(&x, Some(&z), &w, width, groups, EPS as f64);
            let deq: Vec<f64> =
                q.iter().enumerate().map(|(i, &c)| (cpu_quant::e4m3_decode(c) * s[i / width]) as f64).collect();
            let want: Vec<f64> = want
                .iter()
                .enumerate()
                .map(|(i, &v)| {
                    let lim = 448.0 * s[i / width] as f64;
                    v.clamp(-lim, lim)
                })
                .collect();
            let atol = s.iter().fold(0.0f32, |a, &b| a.max(b)) as f64 / 512.0 * 1.01;
            close += assert_close(&format!("{label} dequant"), &deq, &want, atol, 1.0 / 16.0 + RTOL);
        }
    }
    println!("gated_norm_fp8: {same} values identical to the unfused path, {close} dequantized values compared");
}

/// The many-rows block shape (`RowPath::Many`, four chunks a thread) against the reference
/// and bit for bit against the few-rows one, and the gated norm a block a group
/// (`RowPath::Group`) bit for bit against a block a row, all forced on the same inputs: at the row
/// counts that pick it (NemotronH prefill sizes, widths not a multiple of 8 or of the block,
/// groups of odd sizes) and on shapes the launchers would give the other (one row, one
/// channel, the widest row).
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_norms_many_rows_path_matches_reference_and_few_rows_path() {
    let gpu = gpu();
    let mut rng = Rng::new(5);
    let (mut close, mut same) = (0, 0);
    // (rows, width, groups)
    let cases: &[(usize, usize, usize)] = &[
        (4096, 4096, 8),
        (MANY_ROWS, 2688, 1),
        (MANY_ROWS + 3, 1001, 1),
        (300, 1000, 5),
        (257, 24, 3),
        (2051, 24, 3),
        (260, 10304, 1),
        (1, 4096, 8),
        (1, 1, 1),
        (3, 257, 1),
        (2, 32768, 8),
    ];
    for &(rows, width, groups) in cases {
        assert!(rows < MANY_ROWS || RowPath::for_rows(rows) == RowPath::Many);
        let (x, z) = (activations(&mut rng, rows, width), rng.bf16s(rows * width, -6.0, 6.0));
        let add = activations(&mut rng, rows, width);
        let w = rng.bf16s(width, -2.0, 2.0);
        let (dx, dz, dw, dadd) =
            (gpu.upload(&x).unwrap(), gpu.upload(&z).unwrap(), gpu.upload(&w).unwrap(), gpu.upload(&add).unwrap());
        let mut outs = Vec::new();
        for path in [RowPath::Many, RowPath::Few, RowPath::Group] {
            let shape = NormShape { path: Some(path), ..NormShape::new(rows, width, groups, EPS) };
            let plain = NormShape { groups: 1, ..shape };
            let mut y = gpu.upload(&vec![POISON_BF16; rows * width]).unwrap();
            let (xr, zr) = (Rows::new(&dx, rows, width), Rows::new(&dz, rows, width));
            gated_norm(&gpu, shape, xr, zr, &dw, &mut y).unwrap();
            let mut r = gpu.upload(&vec![POISON_BF16; rows * width]).unwrap();
            rms_norm(&gpu, plain, xr, &dw, &mut r).unwrap();
            let mut h = gpu.upload(&x).unwrap();
            let mut ar = gpu.upload(&vec![POISON_BF16; rows * width]).unwrap();
            add_rms_norm(&gpu, plain, &mut h, &dadd, &dw, &mut ar).unwrap();
            let mut q = gpu.upload(&vec![POISON_FP8; rows * width]).unwrap();
            let mut s = gpu.upload(&vec![f32::NAN; rows]).unwrap();
            gated_norm_fp8(&gpu, shape, (xr, zr), &dw, None, (&mut q, &mut s)).unwrap();
            let d = |b: &host::CudaSlice<bf16>| gpu.download(b).unwrap();
            outs.push((d(&y), d(&r), d(&h), d(&ar), gpu.download(&q).unwrap(), gpu.download(&s).unwrap()));
        }
        let label = format!("{rows}x{width} g{groups}");
        let (many, few, group) = (&outs[0], &outs[1], &outs[2]);
        // A block a group: the gated norm's bits as a block a row's; the rest run as Few.
        same += assert_same(&format!("group == few gated {label}"), &group.0, &few.0);
        let want = cpu::gated_norm(&x, Some(&z), &w, width, groups, EPS as f64);
        close += assert_close(&format!("many gated {label}"), &to_f64(&many.0), &want, ATOL, RTOL);
        let want = cpu::rms_norm(&x, &w, width, EPS as f64);
        close += assert_close(&format!("many rms {label}"), &to_f64(&many.1), &want, ATOL, RTOL);
        let sum: Vec<bf16> = x.iter().zip(&add).map(|(a, b)| bf16::from_f32(a.to_f32() + b.to_f32())).collect();
        same += assert_same(&format!("many add {label}"), &many.2, &sum);
        let want = cpu::rms_norm(&sum, &w, width, EPS as f64);
        close += assert_close(&format!("many add+rms {label}"), &to_f64(&many.3), &want, ATOL, RTOL);
        // The fused FP8 path as the unfused one: per-token quantization of the gated output.
        let (want_q, want_s) = cpu_quant::quant_token(&many.0, width, None);
        same += assert_same(&format!("many gated fp8 codes {label}"), &many.4, &want_q);
        same += assert_same(&format!("many gated fp8 scales {label}"), &many.5, &want_s);
        for (what, a, b) in [("gated", &many.0, &few.0), ("rms", &many.1, &few.1), ("add+rms", &many.3, &few.3)] {
            same += assert_same(&format!("many == few {what} {label}"), a, b);
        }
        same += assert_same(&format!("many == few fp8 codes {label}"), &many.4, &few.4);
        same += assert_same(&format!("many == few fp8 scales {label}"), &many.5, &few.5);
    }
    println!("norms, many-rows path: {close} elements compared with the reference, {same} values identical");
}
