//! FP8 e4m3 quantization: the reference encoder against hand-checked codes (CI), and the
//! kernels bit-exact against the reference on the GPU (`#[ignore]`d).

use half::bf16;
use host::cpu::quant as cpu;
use host::moe::{Dispatch, dispatch};
use host::norm::{MANY_ROWS, RowPath};
use host::quant::{Source, quant_rows, quant_static, quant_tensor, quant_token, quant_token_on};
use nemotron_rs::{POISON_FP8, Rng, assert_same, gpu};

#[test]
fn reference_e4m3_hand_checked() {
    let cases: &[(f32, u8)] = &[
        (0.0, 0x00),
        (-0.0, 0x80),
        (1.0, 0x38),
        (-2.0, 0xc0),
        (0.5, 0x30),
        (448.0, 0x7e),
        (-448.0, 0xfe),
        (1000.0, 0x7e),                // saturates
        (f32::INFINITY, 0x7e),         // satfinite
        (1.0625, 0x38),                // tie between 1.0 (even) and 1.125: to even
        (1.1875, 0x3a),                // tie between 1.125 and 1.25 (even)
        (2f32.powi(-9), 0x01),         // smallest subnormal
        (2f32.powi(-10), 0x00),        // tie between 0 (even) and 2^-9
        (3.0 * 2f32.powi(-10), 0x02),  // tie between 2^-9 and 2^-8 (even)
        (0.875 * 2f32.powi(-6), 0x07), // largest subnormal
        (2f32.powi(-6), 0x08),         // smallest normal
        (15.5 * 2f32.powi(-10), 0x08), // rounds up out of the subnormals
        (240.0, 0x77),                 // 1.875 * 2^7
        (464.0, 0x7e),
    ];
    for &(v, code) in cases {
        assert_eq!(cpu::e4m3_encode(v), code, "encode {v}");
    }
    assert_eq!(cpu::e4m3_encode(f32::NAN) & 0x7f, 0x7f, "NaN stays NaN");
    assert!(cpu::e4m3_decode(0x7f).is_nan());
    // Every finite code decodes to a value that encodes back to the same code.
    let mut n = 0;
    for code in (0u8..=255).filter(|c| c & 0x7f != 0x7f) {
        assert_eq!(cpu::e4m3_encode(cpu::e4m3_decode(code)), code, "round trip {code:#04x}");
        n += 1;
    }
    assert_eq!(n, 254);
}

#[test]
fn reference_scales_hand_checked() {
    let x: Vec<bf16> = [0.0, 224.0, -448.0, 0.0, 0.0, 0.0].iter().map(|&v| bf16::from_f32(v)).collect();
    let (q, s) = cpu::quant_token(&x, 3, None);
    assert_eq!(s, vec![1.0, cpu::MIN_SCALE], "row amax 448 -> scale 1; all-zero row -> the floor");
    assert_eq!(q, vec![0x00, 0x76, 0xfe, 0, 0, 0]); // 224 = 1.75 * 2^7
    let (_, s) = cpu::quant_token(&x, 3, Some(224.0));
    assert_eq!(s[0], 0.5, "amax clipped to the upper bound");
    let (q, amax, s) = cpu::quant_tensor(&x);
    assert_eq!((amax, s), (448.0, 1.0));
    assert_eq!(q[2], 0xfe);
    assert_eq!(cpu::quant_static(&x, 2.0)[1], cpu::e4m3_encode(112.0));
}

/// Rows of mixed magnitude, including an all-zero row, a NaN, and (with `static_scale`) values
/// past the saturation point.
fn inputs(rng: &mut Rng, rows: usize, width: usize) -> Vec<bf16> {
    let mut x: Vec<bf16> = (0..rows)
        .flat_map(|r| {
            let scale = [1e-3, 0.3, 7.0, 900.0][r % 4];
            rng.bf16s(width, -scale, scale)
        })
        .collect();
    if rows > 2 {
        x[width..2 * width].fill(bf16::ZERO);
        x[2 * width + width / 2] = bf16::NAN;
    }
    x
}

const CASES: &[(usize, usize)] = &[(64, 2688), (1, 2688), (1, 1), (3, 1000), (7, 257), (1024, 4096), (5, 10304)];

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_quant_token_bit_exact() {
    let gpu = gpu();
    let mut rng = Rng::new(11);
    let mut compared = 0;
    for &(rows, width) in CASES {
        for ub in [None, Some(3.0)] {
            let x = inputs(&mut rng, rows, width);
            let dx = gpu.upload(&x).unwrap();
            let mut q = gpu.upload(&vec![POISON_FP8; rows * width]).unwrap();
            let mut s = gpu.upload(&vec![f32::NAN; rows]).unwrap();
            quant_token(&gpu, width, &dx, ub, &mut q, &mut s).unwrap();
            let (want_q, want_s) = cpu::quant_token(&x, width, ub);
            let label = format!("token {rows}x{width} ub {ub:?}");
            compared += assert_same(&format!("{label} codes"), &gpu.download(&q).unwrap(), &want_q);
            compared += assert_same(&format!("{label} scales"), &gpu.download(&s).unwrap(), &want_s);
        }
    }
    println!("quant_token: {compared} values compared bit-exact");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_quant_tensor_bit_exact() {
    let gpu = gpu();
    let mut rng = Rng::new(12);
    let mut compared = 0;
    for &(rows, width) in CASES.iter().chain(&[(16384, 2688)]) {
        let x = inputs(&mut rng, rows, width);
        let zeros = vec![bf16::ZERO; rows * width];
        for (what, x) in [("random", &x), ("all-zero", &zeros)] {
            let dx = gpu.upload(x).unwrap();
            let mut q = gpu.upload(&vec![POISON_FP8; x.len()]).unwrap();
            let mut amax = gpu.upload(&[f32::NAN]).unwrap();
            let mut scale = gpu.upload(&[f32::NAN]).unwrap();
            quant_tensor(&gpu, &dx, &mut q, &mut amax, &mut scale).unwrap();
            let (want_q, want_amax, want_scale) = cpu::quant_tensor(x);
            let label = format!("tensor {what} {rows}x{width}");
            compared += assert_same(&format!("{label} codes"), &gpu.download(&q).unwrap(), &want_q);
            compared += assert_same(&format!("{label} amax"), &gpu.download(&amax).unwrap(), &[want_amax]);
            compared += assert_same(&format!("{label} scale"), &gpu.download(&scale).unwrap(), &[want_scale]);
        }
    }
    println!("quant_tensor: {compared} values compared bit-exact");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_quant_static_bit_exact() {
    let gpu = gpu();
    let mut rng = Rng::new(13);
    let mut compared = 0;
    for &(rows, width) in CASES {
        // 0.0173: an input_scale-like value; 900-magnitude rows saturate past 448 * 0.0173.
        for scale in [0.0173, 1.0, 3.5] {
            let x = inputs(&mut rng, rows, width);
            let dx = gpu.upload(&x).unwrap();
            let mut q = gpu.upload(&vec![POISON_FP8; x.len()]).unwrap();
            quant_static(&gpu, &dx, scale, &mut q).unwrap();
            let label = format!("static {rows}x{width} scale {scale}");
            compared += assert_same(&label, &gpu.download(&q).unwrap(), &cpu::quant_static(&x, scale));
        }
    }
    println!("quant_static: {compared} values compared bit-exact");
}

/// Per-token quantization with the many-rows block shape (four chunks a thread), forced, bit
/// for bit against the reference: NemotronH prefill rows, widths not a multiple of 8 or of
/// the block, one row, one element; and the launcher's own pick at those row counts.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_quant_token_many_rows_path_bit_exact() {
    let gpu = gpu();
    let mut rng = Rng::new(14);
    let mut compared = 0;
    let cases: &[(usize, usize)] =
        &[(4096, 2688), (MANY_ROWS, 257), (MANY_ROWS + 1, 1001), (2051, 257), (1, 2688), (1, 1), (3, 32768)];
    for &(rows, width) in cases {
        for ub in [None, Some(3.0)] {
            let x = inputs(&mut rng, rows, width);
            let dx = gpu.upload(&x).unwrap();
            let (want_q, want_s) = cpu::quant_token(&x, width, ub);
            for path in [Some(RowPath::Many), None] {
                let mut q = gpu.upload(&vec![POISON_FP8; rows * width]).unwrap();
                let mut s = gpu.upload(&vec![f32::NAN; rows]).unwrap();
                match path {
                    Some(path) => quant_token_on(&gpu, path, width, &dx, ub, &mut q, &mut s).unwrap(),
                    None => quant_token(&gpu, width, &dx, ub, &mut q, &mut s).unwrap(),
                }
                let label = format!("token {path:?} {rows}x{width} ub {ub:?}");
                compared += assert_same(&format!("{label} codes"), &gpu.download(&q).unwrap(), &want_q);
                compared += assert_same(&format!("{label} scales"), &gpu.download(&s).unwrap(), &want_s);
            }
        }
    }
    println!("quant_token, many-rows path: {compared} values compared bit-exact");
}

/// Per-tensor quantization leaves its accumulator (the Gpu's counters) at zero: launches
/// back to back, a large amax then a small one, each bit-exact; element counts that are not a
/// multiple of 8, of a block's chunks or of the 4 chunks a thread loads at once.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_quant_tensor_back_to_back_bit_exact() {
    let gpu = gpu();
    let mut rng = Rng::new(15);
    let mut compared = 0;
    for n in [4096 * 2688 + 5, 8 * 256 * 4 * 3 + 8, 8 * 256 * 4 - 1, 13, 1] {
        for magnitude in [900.0, 0.01, 2.0] {
            let x = rng.bf16s(n, -magnitude, magnitude);
            let dx = gpu.upload(&x).unwrap();
            let mut q = gpu.upload(&vec![POISON_FP8; n]).unwrap();
            let (mut amax, mut scale) = (gpu.upload(&[f32::NAN]).unwrap(), gpu.upload(&[f32::NAN]).unwrap());
            quant_tensor(&gpu, &dx, &mut q, &mut amax, &mut scale).unwrap();
            let (want_q, want_amax, want_scale) = cpu::quant_tensor(&x);
            let label = format!("tensor n {n} magnitude {magnitude}");
            compared += assert_same(&format!("{label} codes"), &gpu.download(&q).unwrap(), &want_q);
            compared += assert_same(&format!("{label} amax"), &gpu.download(&amax).unwrap(), &[want_amax]);
            compared += assert_same(&format!("{label} scale"), &gpu.download(&scale).unwrap(), &[want_scale]);
        }
    }
    println!("quant_tensor back to back: {compared} values compared bit-exact");
}

/// The rows of an FP8 product's input (`quant_rows`), bit for bit against the reference: plain
/// rows with one static scale and with per-row scales (as `quant_token` without a bound), the
/// grouped order of a dispatch gathered by token and taken as it is, each with its expert's
/// static scale and per row; NemotronH widths and odd ones, rows of mixed magnitude.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_quant_rows_bit_exact() {
    let gpu = gpu();
    let mut rng = Rng::new(16);
    let mut compared = 0;
    for &(rows, width, e, k) in &[(300, 2688, 16, 6), (7, 257, 5, 2), (600, 1856, 128, 6)] {
        let x = inputs(&mut rng, rows, width);
        let dx = gpu.upload(&x).unwrap();
        let scales: Vec<f32> = (0..e).map(|_| rng.uniform(0.002, 3.0) as f32).collect();
        let ds = gpu.upload(&scales).unwrap();
        let row = |r: usize| &x[r * width..][..width];
        // Plain: every row, one static scale or its own.
        for fixed in [Some(scales[0]), None] {
            let mut q = gpu.upload(&vec![POISON_FP8; rows * width]).unwrap();
            let mut s = gpu.upload(&vec![f32::NAN; rows]).unwrap();
            let one = fixed.map(|f| gpu.upload(&[f]).unwrap());
            quant_rows(&gpu, width, &dx, Source::Plain, one.as_ref(), &mut q, &mut s).unwrap();
            let (want_q, want_s) = match fixed {
                Some(f) => (cpu::quant_static(&x, f), vec![f; rows]),
                None => cpu::quant_token(&x, width, None),
            };
            let label = format!("rows plain {rows}x{width} static {fixed:?}");
            compared += assert_same(&format!("{label} codes"), &gpu.download(&q).unwrap(), &want_q);
            compared += assert_same(&format!("{label} scales"), &gpu.download(&s).unwrap(), &want_s);
        }
        // Grouped: the dispatch's order, by token (x is the layer input) and as it is (x is
        // taken as the grouped rows: its first `entries` rows, so rows * k of them).
        let mut d = Dispatch::new(&gpu, e, k, rows).unwrap();
        dispatch(&gpu, &gpu.upload(&rng.choices(rows, k, e)).unwrap(), &mut d).unwrap();
        let (offsets, token) = (gpu.download(d.offsets()).unwrap(), gpu.download(d.token()).unwrap());
        let entries = d.entries();
        let expert = |j: usize| (0..e).find(|&ex| offsets[ex] as usize <= j && j < offsets[ex + 1] as usize).unwrap();
        let grouped_x: Vec<bf16> = (0..entries).flat_map(|j| row(j % rows).to_vec()).collect();
        let dg = gpu.upload(&grouped_x).unwrap();
        for by_token in [true, false] {
            for fixed in [true, false] {
                let src = |j: usize| if by_token { row(token[j] as usize) } else { &grouped_x[j * width..][..width] };
                let mut q = gpu.upload(&vec![POISON_FP8; entries * width]).unwrap();
                let mut s = gpu.upload(&vec![f32::NAN; entries]).unwrap();
                let input = if by_token { &dx } else { &dg };
                let source = Source::Grouped { d: &d, by_token };
                quant_rows(&gpu, width, input, source, fixed.then_some(&ds), &mut q, &mut s).unwrap();
                let (mut want_q, mut want_s) = (Vec::new(), Vec::new());
                for j in 0..entries {
                    let (c, sc) = if fixed {
                        (cpu::quant_static(src(j), scales[expert(j)]), vec![scales[expert(j)]])
                    } else {
                        cpu::quant_token(src(j), width, None)
                    };
                    want_q.extend(c);
                    want_s.extend(sc);
                }
                let label = format!("rows grouped {entries}x{width} by token {by_token} static {fixed}");
                compared += assert_same(&format!("{label} codes"), &gpu.download(&q).unwrap(), &want_q);
                compared += assert_same(&format!("{label} scales"), &gpu.download(&s).unwrap(), &want_s);
            }
        }
    }
    println!("quant_rows: {compared} values compared bit-exact");
}
