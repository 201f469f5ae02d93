//! The W4A4 NVFP4 family (kernels-gpu/src/w4a4.rs). On the CPU: the block-scaled FP4 `mma`
//! emulated from the PTX ISA's description of its operands, fed by the kernel's own fragment
//! loaders, equals the plain product (no GPU of the sm_120a family is at hand to run it), and
//! so does the `tcgen05` kernel's block, emulated likewise (w4a4/tcgen05.rs: no GPU of the
//! sm_100a family either); the activations' quantization from hand-worked blocks and the
//! nearest-code property. On a GPU (`#[ignore]`d): the quantization kernel bit for bit against
//! the CPU's, and the linear layer against the exact product: with the instruction emulated by
//! the warp on every GPU (the kernel's loads, guards and output), on the instructions where
//! the PTX has them (sm_121a, sm_110a), refused by name elsewhere.

use half::bf16;
use host::cpu::nvfp4::E2M1;
use host::cpu::quant::{e4m3_decode, e4m3_encode};
use host::cpu::w4a4::{product, quantize_rows};
use host::gemv::Weights;
use host::nvfp4::{pack_rows, row_bytes};
use host::w4a4::{Product, linear};
use host::{Kernel, Rows};
use kernels_gpu::w4a4::{MMA_K, a_word, b_word, scale_a_row, scale_b_col};
use nemotron_rs::{POISON_BF16, Rng, assert_band, assert_same, gpu, nvfp4_weights, to_f64};

/// The word at byte `at` of `bytes`, little-endian (as the device loads it).
fn word(bytes: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(bytes[at..at + 4].try_into().unwrap())
}

/// Code `i` (0..8) of a word, as its value.
fn code(word: u32, i: usize) -> f64 {
    f64::from(E2M1[(word >> (4 * i)) as usize & 15])
}

/// Scale `i` (0..4) of a word of e4m3 block scales, as its value.
fn scale(word: u32, i: usize) -> f64 {
    f64::from(e4m3_decode((word >> (8 * i)) as u8))
}

/// `d += A B` as `mma.sync.aligned.m16n8k64.row.col.kind::mxf4nvf4.block_scale.scale_vec::4X`
/// computes it from the warp's registers, by the PTX ISA's operand description (selectors
/// `{0, 0}`): element (i, k) of A is nibble `k % 8` of register `i / 8 + 2 (k / 32)` of lane
/// `4 (i % 8) + (k % 32) / 8`; element (k, j) of B nibble `k % 8` of register `k / 32` of lane
/// `4 j + (k % 32) / 8`; row i's scale of block `k / 16` byte `k / 16` of lane `4 (i % 8) +
/// i / 8`'s scale register, column j's of lane `4 j`'s; D (i, j) element `2 (i / 8) + j % 2` of
/// lane `4 (i % 8) + j / 2`. Sums in f64.
fn mma_isa(a: &[[u32; 4]; 32], b: &[[u32; 2]; 32], sa: &[u32; 32], sb: &[u32; 32], d: &mut [[f64; 4]; 32]) {
    for i in 0..16 {
        for j in 0..8 {
            let mut sum = 0.0;
            for k in 0..64 {
                let x = code(a[4 * (i % 8) + (k % 32) / 8][i / 8 + 2 * (k / 32)], k % 8);
                let y = code(b[4 * j + (k % 32) / 8][k / 32], k % 8);
                sum += x * scale(sa[4 * (i % 8) + i / 8], k / 16) * y * scale(sb[4 * j], k / 16);
            }
            d[4 * (i % 8) + j / 2][2 * (i / 8) + j % 2] += sum;
        }
    }
}

/// Random NVFP4 rows in the device layout: every code, block scales of a few binades (so the
/// f64 sums of a tile are exact in any order), one block of zero scale.
fn random_rows(rng: &mut Rng, rows: usize, k: usize) -> Vec<u8> {
    let codes: Vec<u8> = (0..rows * k / 2).map(|_| rng.next_u64() as u8).collect();
    let mut scales: Vec<u8> = (0..rows * k / 16).map(|_| 0x30 + (rng.next_u64() % 32) as u8).collect();
    scales[rows * k / 16 / 2] = 0;
    pack_rows(&codes, &scales, rows, k).unwrap()
}

/// The kernel's loaders (`a_word`, `b_word`, `scale_a_row`, `scale_b_col`: the words each lane
/// loads, from the rows' bytes as the kernel addresses them) into the emulated instruction,
/// tile by tile and 64 of k at a time, give the exact product of the rows; rows past m or n
/// load zeros, as in the kernel. Also red with one loader changed (tried on each).
#[test]
fn emulated_mma_of_the_loaded_fragments_is_the_product() {
    let mut rng = Rng::new(44);
    let (m, n, k) = (40, 20, 3 * MMA_K as usize);
    let bytes = row_bytes(k);
    let (a, w) = (random_rows(&mut rng, m, k), random_rows(&mut rng, n, k));
    let mut got = vec![0.0; m * n];
    let words = |rows: &[u8], count: usize, row: usize, kk: usize| -> u32 {
        if row < count { word(rows, row * bytes + kk / 2) } else { 0 }
    };
    let scales = |rows: &[u8], count: usize, row: usize, k0: usize| -> u32 {
        if row < count { word(rows, row * bytes + k / 2 + k0 / 16) } else { 0 }
    };
    for m0 in (0..m).step_by(16) {
        for n0 in (0..n).step_by(8) {
            let mut d = [[0.0f64; 4]; 32];
            for k0 in (0..k).step_by(MMA_K as usize) {
                let (mut fa, mut fb, mut sa, mut sb) = ([[0u32; 4]; 32], [[0u32; 2]; 32], [0u32; 32], [0u32; 32]);
                for lane in 0..32u32 {
                    let l = lane as usize;
                    for r in 0..4 {
                        let (row, kk) = a_word(lane, r);
                        fa[l][r as usize] = words(&a, m, m0 + row as usize, k0 + kk as usize);
                    }
                    for r in 0..2 {
                        let (col, kk) = b_word(lane, r);
                        fb[l][r as usize] = words(&w, n, n0 + col as usize, k0 + kk as usize);
                    }
                    sa[l] = scales(&a, m, m0 + scale_a_row(lane) as usize, k0);
                    sb[l] = scales(&w, n, n0 + scale_b_col(lane) as usize, k0);
                }
                mma_isa(&fa, &fb, &sa, &sb, &mut d);
            }
            for (lane, d) in d.iter().enumerate() {
                for (e, &v) in d.iter().enumerate() {
                    let (row, col) = (m0 + lane / 4 + 8 * (e / 2), n0 + 2 * (lane % 4) + e % 2);
                    if row < m && col < n {
                        got[row * n + col] = v;
                    } else {
                        assert_eq!(v, 0.0, "row {row} column {col} is past the matrices");
                    }
                }
            }
        }
    }
    let (want, _) = product(&a, &w, (m, n, k));
    assert!(want.iter().filter(|&&v| v != 0.0).count() > m * n / 2, "the product is not mostly zero");
    assert_eq!(assert_same("emulated mma over the loaded fragments", &got, &want), m * n);
}

/// A block by hand (input scale 1/6, so g = 6): amax 3 gives the scale 3 (e4m3 0x44) and x 6/3
/// = 2x to the nearest e2m1, ties to even; a block of zeros gives code and scale 0; a block
/// whose scale passes 448 saturates it and its largest elements at 6.
#[test]
fn quantized_blocks_by_hand() {
    let mut x = [0.0f32; 48];
    x[..8].copy_from_slice(&[3.0, 1.5, -0.75, 0.0, 0.625, 0.375, 1.25, -1.75]);
    x[32] = 1000.0;
    x[33] = -250.0;
    let x: Vec<bf16> = x.iter().map(|&v| bf16::from_f32(v)).collect();
    let q = quantize_rows(&x, (1, 48, 48), 1.0 / 6.0);
    assert_eq!(q.len(), row_bytes(48));
    assert_eq!(&q[24..27], &[0x44, 0, 0x7e], "scales: 3, none, saturated at 448");
    // 2x: 6, 3, -1.5, 0 | 1.25 (tie: to 1, code 2), 0.75 (tie: to 1, code 2), 2.5 (tie: to 2,
    // code 4), -3.5 (tie: to -4, code 14).
    assert_eq!(&q[..4], &[0x57, 0x0b, 0x22, 0xe4]);
    assert!(q[4..16].iter().all(|&c| c == 0), "the rest of block 0 and block 1 are zero");
    // Block 2: g / 448 = 6 / 448; 1000 -> 13.4 saturates at 6 (code 7), -250 -> -3.35 to -3.
    assert_eq!(q[16], 0x7 | 0xd << 4);
    assert!(q[27..].iter().all(|&b| b == 0), "padding");
}

/// Random rows (magnitudes over several binades, a zero block): each block's scale is the e4m3
/// code of amax g / 6, and each element's code the e2m1 value nearest x g / s (none nearer).
#[test]
fn quantized_elements_are_the_nearest_codes() {
    let mut rng = Rng::new(45);
    let (rows, k, stride) = (6, 256, 272);
    let mut x = rng.bf16s(rows * stride, -1.0, 1.0);
    for (i, v) in x.iter_mut().enumerate() {
        *v = bf16::from_f64(v.to_f64() * 4f64.powi((i / 16 % 7) as i32 - 3));
    }
    x[stride..stride + 16].fill(bf16::ZERO);
    let scale = 0.01;
    let q = quantize_rows(&x, (rows, k, stride), scale);
    let g = 1.0 / scale;
    let mut compared = 0;
    for r in 0..rows {
        let row = &q[r * row_bytes(k)..][..row_bytes(k)];
        for b in 0..k / 16 {
            let block = &x[r * stride + 16 * b..][..16];
            let amax = block.iter().map(|v| v.to_f32().abs()).fold(0.0, f32::max);
            assert_eq!(row[k / 2 + b], e4m3_encode(amax * g / 6.0), "row {r} block {b}");
            let s = e4m3_decode(row[k / 2 + b]);
            for (j, v) in block.iter().enumerate() {
                let c = (row[8 * b + j / 2] >> (4 * (j % 2))) & 15;
                let t = if s == 0.0 { 0.0 } else { f64::from(v.to_f32() * (g / s)) };
                let err = (f64::from(E2M1[usize::from(c)]) - t.clamp(-6.0, 6.0)).abs();
                let best = E2M1.iter().map(|&e| (f64::from(e) - t.clamp(-6.0, 6.0)).abs()).fold(f64::MAX, f64::min);
                assert!(err == best, "row {r} element {}: code {c} for {t}", 16 * b + j);
                compared += 1;
            }
        }
    }
    assert_eq!(compared, rows * k);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_quantize_matches_the_cpu() {
    let gpu = gpu();
    let mut rng = Rng::new(46);
    let mut compared = 0;
    // Nano's widths into in_proj, out_proj, the experts' down projection; a strided view; one
    // block; many rows. The scale as calibrated (amax / (6 * 448)) and 8 times smaller (blocks
    // saturate).
    let cases = [(1, 2688, 2688), (5, 4096, 4104), (64, 1856, 1856), (3, 16, 48), (300, 2688, 2688)];
    for (rows, k, stride) in cases {
        let mut x = rng.bf16s(rows * stride, -2.0, 2.0);
        for (i, v) in x.iter_mut().enumerate() {
            *v = bf16::from_f64(v.to_f64() * 2f64.powi((i / 16 % 9) as i32 - 4));
        }
        x[..16].fill(bf16::ZERO);
        let amax = x.iter().map(|v| v.to_f32().abs()).fold(0.0, f32::max);
        for scale in [amax / (6.0 * 448.0), amax / (6.0 * 448.0 * 8.0)] {
            let want = quantize_rows(&x, (rows, k, stride), scale);
            let dx = gpu.upload(&x).unwrap();
            let mut out = gpu.upload(&vec![0xa5u8; rows * row_bytes(k)]).unwrap();
            let view = Rows::strided(&dx, rows, k, stride);
            host::w4a4::quantize(&gpu, view, scale, &mut out).unwrap();
            let got = gpu.download(&out).unwrap();
            let used = |q: &[u8]| -> Vec<u8> {
                q.chunks_exact(row_bytes(k)).flat_map(|r| r[..k / 2 + k / 16].to_vec()).collect()
            };
            let label = format!("quantize {rows} x {k} (stride {stride}), scale {scale:e}");
            compared += assert_same(&label, &used(&got), &used(&want));
        }
    }
    let expected: usize = cases.iter().map(|&(rows, k, _)| 2 * rows * (k / 2 + k / 16)).sum();
    assert_eq!(compared, expected);
    // Scales whose 1 / scale or g / s would overflow are refused, as is a k of no whole block.
    let x = gpu.upload(&rng.bf16s(32, -1.0, 1.0)).unwrap();
    let mut out = gpu.zeros::<u8>(2 * row_bytes(16)).unwrap();
    for (scale, (rows, k), arg) in
        [(1e-37, (2, 16), "`scale`"), (f32::INFINITY, (2, 16), "`scale`"), (0.01, (4, 8), "`k`")]
    {
        let err = host::w4a4::quantize(&gpu, Rows::new(&x, rows, k), scale, &mut out).unwrap_err().to_string();
        assert!(err.contains(arg), "scale {scale}, k {k}: {err}");
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_linear_matches_the_product() {
    let gpu = gpu();
    let mut rng = Rng::new(47);
    let mut compared = 0;
    let native = gpu.has(Kernel::GemmNvfp4W4a4) || gpu.has(Kernel::GemmNvfp4W4a4Tcgen05);
    // Nano's q, in_proj at 37 rows, an expert's up projection, n and m not multiples of the
    // block's 64, one k step.
    let cases = [(1, 4096, 2688), (37, 10304, 2688), (64, 1856, 2688), (130, 72, 128), (5, 9, 64)];
    for &(m, n, k) in &cases {
        let x = rng.bf16s(m * k, -1.0, 1.0);
        let scale = x.iter().map(|v| v.to_f32().abs()).fold(0.0, f32::max) / (6.0 * 448.0);
        let (w, global, _) = nvfp4_weights(&mut rng, 1, n, k);
        let (dx, dw, dg) = (gpu.upload(&x).unwrap(), gpu.upload(&w).unwrap(), gpu.upload(&global).unwrap());
        let mut a = gpu.zeros::<u8>(m * row_bytes(k)).unwrap();
        host::w4a4::quantize(&gpu, Rows::new(&dx, m, k), scale, &mut a).unwrap();
        let (sums, mag) = product(&quantize_rows(&x, (m, k, k), scale), &w, (m, n, k));
        let alpha = f64::from(scale) * f64::from(global[0]);
        let want: Vec<f64> = sums.iter().map(|s| s * alpha).collect();
        let mag: Vec<f64> = mag.iter().map(|s| s * alpha).collect();
        for p in [Product::Emulated, Product::Native] {
            let mut y = gpu.upload(&vec![POISON_BF16; m * n]).unwrap();
            let run = linear(&gpu, &a, Weights::Nvfp4 { rows: &dw, global: &dg }, (m, n, k), scale, p, &mut y);
            if p == Product::Native && !native {
                let err = run.unwrap_err().to_string();
                assert!(err.contains("gemm_nvfp4_w4a4") && err.contains("sm_121a"), "{err}");
                println!("{m} x {n} x {k}: native refused on {}: {err}", gpu.arch().name());
                continue;
            }
            run.unwrap();
            // bf16 output (2^-8 relative) over f32 sums of exact products (42 steps of k at
            // most: 1e-5 of the magnitudes).
            let label = format!("w4a4 linear ({p:?}) {m} x {n} x {k}");
            compared += assert_band(&label, &to_f64(&gpu.download(&y).unwrap()), &want, &mag, (0.0, 1.0 / 256.0, 1e-5));
        }
    }
    let runs = if native { 2 } else { 1 };
    assert_eq!(compared, runs * cases.iter().map(|&(m, n, _)| m * n).sum::<usize>());
}

#[path = "w4a4/tcgen05.rs"]
mod tcgen05;
