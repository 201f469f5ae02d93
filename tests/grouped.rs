//! The tensor-core GEMM family (kernels-gpu/src/grouped.rs: grouped and dense layouts) against
//! f64 references (`#[ignore]`d: needs a GPU): the grouped GEMM of routed experts at Nano's
//! sizes with a skewed routing, in bf16, FP8 and NVFP4 (weight-only); the one-matrix GEMM of
//! many rows in bf16 and FP8 (beside cuBLASLt's FP8 GEMM).

mod common;

use common::experts::{Fp8Experts, expert_reference, grouped_tiles};
use half::bf16;
use host::cpu::gemm::linear;
use host::cpu::quant::quant_static;
use host::gemv::{Proj, Weights};
use host::grouped::{
    Fp8Rows, Fp8RowsMut, Tiles, experts_mlp_grouped_as, gemm, grouped_fp8, grouped_fp8_quant, grouped_nvfp4,
    linear_fp8_as,
};
use host::moe::{Dispatch, ExpertMlp, ExpertWeights, dispatch};
use host::quant::{Source, quant_rows};
use nemotron_rs::{POISON_BF16, Rng, assert_close, fp8_weights, gpu, nvfp4_weights, to_f64, w8a8};

/// A dispatch of `rows` tokens' top-`k` choices of `e` experts that leaves expert 0 without
/// rows, gives expert 1 one (token 0's) and expert 2 every token (many tiles), the other
/// choices distinct, from experts 3 on; its offsets and tokens read back (the skew checked).
struct Skewed {
    d: Dispatch,
    offsets: Vec<u32>,
    token: Vec<u32>,
}

impl Skewed {
    fn new(gpu: &host::Gpu, rng: &mut Rng, (rows, k, e): (usize, usize, usize)) -> Skewed {
        let mut idx = Vec::with_capacity(rows * k);
        for t in 0..rows {
            let mut picks = vec![2i32, if t == 0 { 1 } else { 3 + (t % (e - 3)) as i32 }];
            while picks.len() < k {
                let c = 3 + (rng.next_u64() % (e as u64 - 3)) as i32;
                if !picks.contains(&c) {
                    picks.push(c);
                }
            }
            idx.extend(picks);
        }
        let mut d = Dispatch::new(gpu, e, k, rows).unwrap();
        dispatch(gpu, &gpu.upload(&idx).unwrap(), &mut d).unwrap();
        let (offsets, token) = (gpu.download(d.offsets()).unwrap(), gpu.download(d.token()).unwrap());
        assert_eq!((offsets[1] - offsets[0], offsets[2] - offsets[1], offsets[3] - offsets[2]), (0, 1, rows as u32));
        Skewed { d, offsets, token }
    }

    /// The grouped rows a test compares, by expert: expert 1's, the first and last `edge` of
    /// expert 2's, every `every`th.
    fn sample(&self, every: usize, edge: usize) -> Vec<Vec<usize>> {
        let (lo2, hi2) = (self.offsets[2] as usize, self.offsets[3] as usize);
        let edge_of_2 = |j: usize| j < lo2 + edge || j + edge >= hi2;
        (0..self.offsets.len() - 1)
            .map(|ex| {
                let (lo, hi) = (self.offsets[ex] as usize, self.offsets[ex + 1] as usize);
                (lo..hi).filter(|&j| j % every == 0 || ex == 1 || (ex == 2 && edge_of_2(j))).collect()
            })
            .collect()
    }
}

/// The grouped GEMM at Nemotron-3 Nano's sizes (128 experts of 2688 x 1856, top-6) with a
/// skewed routing: expert 0 chosen by no token, expert 1 by one, expert 2 by every token
/// (many tiles), the others at random; a sample of the grouped rows (expert 1's, the first
/// and last 64 of expert 2's, and every 31st) against the reference, expert by expert.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_grouped_experts_at_nano_size() {
    let gpu = gpu();
    let mut rng = Rng::new(95);
    let (hidden, inter, e, k, rows) = (2688, 1856, 128usize, 6, 600);
    let up = rng.bf16s(e * inter * hidden, -(3.0 / hidden as f64).sqrt(), (3.0 / hidden as f64).sqrt());
    let down = rng.bf16s(e * hidden * inter, -(3.0 / inter as f64).sqrt(), (3.0 / inter as f64).sqrt());
    let x = rng.bf16s(rows * hidden, -1.0, 1.0);
    let skewed = Skewed::new(&gpu, &mut rng, (rows, k, e));
    let (d, token) = (&skewed.d, &skewed.token);
    let (dup, ddown, dx) = (gpu.upload(&up).unwrap(), gpu.upload(&down).unwrap(), gpu.upload(&x).unwrap());
    let tiles = grouped_tiles(&gpu, false);
    let w = ExpertMlp { up: ExpertWeights::Bf16(&dup), down: ExpertWeights::Bf16(&ddown), inter, hidden };
    let outs: Vec<Vec<f64>> = tiles
        .iter()
        .map(|&t| {
            let mut out = gpu.upload(&vec![POISON_BF16; rows * k * hidden]).unwrap();
            experts_mlp_grouped_as(&gpu, d, &dx, w, t, &mut out).unwrap();
            to_f64(&gpu.download(&out).unwrap())
        })
        .collect();
    let (mut got, mut want, mut sampled) = (vec![Vec::new(); tiles.len()], Vec::new(), 0);
    for (ex, sample) in skewed.sample(31, 64).into_iter().enumerate() {
        if sample.is_empty() {
            continue;
        }
        let u = to_f64(&up[ex * inter * hidden..][..inter * hidden]);
        let dn = to_f64(&down[ex * hidden * inter..][..hidden * inter]);
        for &j in &sample {
            want.extend(expert_reference(&to_f64(&x[token[j] as usize * hidden..][..hidden]), &u, &dn, inter));
            for (g, out) in got.iter_mut().zip(&outs) {
                g.extend_from_slice(&out[j * hidden..][..hidden]);
            }
        }
        sampled += sample.len();
    }
    for (g, t) in got.iter().zip(&tiles) {
        let n = assert_close(&format!("grouped experts at Nano size, {t:?} tiles"), g, &want, 2e-3, 1.0 / 128.0);
        assert_eq!(n, sampled * hidden);
        println!("grouped experts, {t:?} tiles: {n} values compared ({sampled} grouped rows)");
    }
}

/// The FP8 grouped GEMM path (each projection's rows quantized, then multiplied on tensor
/// cores) at Nemotron-3 Nano's expert sizes with the skewed routing (an expert without rows,
/// one with one, one with every token), static input scales for up and per-row for down (16
/// experts: about 115 rows each) and the other way round (12 experts: about 167 rows each, a
/// full row tile and one of at most 64 on `wgmma`), and an odd shape (k not a multiple of
/// the 64-byte stage, n not of the 128-column tile), on a sample of the grouped rows (expert
/// 1's, the first and last 16 of expert 2's, every 7th), in two checks:
/// - the hidden rows (the up projection alone, `quant_rows` + `grouped_fp8`, as the MLP
///   runs it where the down projection's scales are per row; with static ones its launch
///   writes their codes, the next test) against the f64 up projection: within three bf16
///   steps (f32 sums against f64 move the pre-activation by one step at most, the square
///   doubles it, the square's rounding adds one);
/// - the MLP's output against the f64 down projection of those same hidden rows.
///
/// The output is not compared with the f64 MLP of x: a hidden value one bf16 step from an
/// e4m3 rounding boundary takes either code, and a code step of a large hidden value moves
/// a whole output row by up to ~0.015 (seen on the H200: 693 of 768768 values outside the
/// band, the worst 0.0147 off, all in one row).
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_fp8_grouped_experts_match_reference() {
    let gpu = gpu();
    let mut rng = Rng::new(98);
    let mut compared = 0;
    for (hidden, inter, e, k, rows, up_static) in
        [(2688, 1856, 16, 6, 300, true), (2688, 1856, 12, 6, 300, false), (144, 48, 5, 2, 70, true)]
    {
        let ex8 = Fp8Experts::new(&gpu, &mut rng, (e, inter, hidden), up_static);
        let x = rng.bf16_rows(rows, hidden);
        let skewed = Skewed::new(&gpu, &mut rng, (rows, k, e));
        let (d, token) = (&skewed.d, &skewed.token);
        let (up, down) = ex8.weights();
        let (dx, entries) = (gpu.upload(&x).unwrap(), rows * k);
        let up_in = ex8.dev[0].2.as_ref();
        for t in grouped_tiles(&gpu, true) {
            let mut out = gpu.upload(&vec![POISON_BF16; entries * hidden]).unwrap();
            experts_mlp_grouped_as(&gpu, d, &dx, ExpertMlp { up, down, inter, hidden }, t, &mut out).unwrap();
            let out = to_f64(&gpu.download(&out).unwrap());
            let (mut q, mut s) = (gpu.zeros::<u8>(entries * hidden).unwrap(), gpu.zeros::<f32>(entries).unwrap());
            quant_rows(&gpu, hidden, &dx, Source::Grouped { d, by_token: true }, up_in, &mut q, &mut s).unwrap();
            let mut h = gpu.upload(&vec![POISON_BF16; entries * inter]).unwrap();
            let up_proj = Proj { w: up, n: inter, k: hidden, relu2: true };
            grouped_fp8(&gpu, d, Fp8Rows { codes: &q, scales: &s }, up_proj, t, &mut h).unwrap();
            let h = to_f64(&gpu.download(&h).unwrap());
            let (mut got, mut want, mut got_h, mut want_h, mut sampled) = (vec![], vec![], vec![], vec![], 0);
            for (ex, rows_of_ex) in skewed.sample(7, 16).into_iter().enumerate() {
                for j in rows_of_ex {
                    let hj = &h[j * inter..][..inter];
                    want_h.extend(ex8.up(ex, &to_f64(&x[token[j] as usize * hidden..][..hidden])));
                    got_h.extend_from_slice(hj);
                    want.extend(ex8.down(ex, hj));
                    got.extend_from_slice(&out[j * hidden..][..hidden]);
                    sampled += 1;
                }
            }
            let label = format!(
                "FP8 grouped experts ({t:?}) hidden {hidden} inter {inter} rows {rows} static {}",
                if up_static { "up" } else { "down" }
            );
            let n_h = assert_close(&format!("{label}, hidden rows"), &got_h, &want_h, 1e-3, 1.0 / 32.0);
            // The same codes on both sides: f32 sums against f64, one bf16 rounding.
            let n = assert_close(&label, &got, &want, 2e-3, 1.0 / 64.0);
            assert_eq!((n_h, n), (sampled * inter, sampled * hidden));
            compared += n + n_h;
        }
    }
    println!("FP8 grouped experts: {compared} values compared");
}

/// `grouped_fp8_quant` (the up projection writing the down projection's e4m3 input with its
/// static scales, a scale per expert) against `grouped_fp8`'s bf16 results quantized on the
/// CPU (`cpu::quant::quant_static`, each grouped row by its expert's scale): every grouped
/// row's codes bit for bit and its scale, at Nano's expert sizes with 16 experts and the
/// skewed routing (an expert without rows, one with one, one with every token) and at a small
/// shape whose n is not a multiple of the column tile, on every FP8 tile kind here.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_fp8_grouped_quant_epilogue_matches_quantized_results() {
    let gpu = gpu();
    let mut rng = Rng::new(99);
    let mut compared = 0;
    for (hidden, inter, e, k, rows) in [(2688, 1856, 16, 6, 300), (144, 48, 5, 2, 70)] {
        // Static input scales for the down projections.
        let ex8 = Fp8Experts::new(&gpu, &mut rng, (e, inter, hidden), false);
        let (next_dev, next) = (ex8.dev[1].2.as_ref().unwrap(), ex8.host[1].2.as_ref().unwrap());
        let x = rng.bf16_rows(rows, hidden);
        let skewed = Skewed::new(&gpu, &mut rng, (rows, k, e));
        let (d, entries) = (&skewed.d, rows * k);
        let dx = gpu.upload(&x).unwrap();
        let (mut q, mut s) = (gpu.zeros::<u8>(entries * hidden).unwrap(), gpu.zeros::<f32>(entries).unwrap());
        quant_rows(&gpu, hidden, &dx, Source::Grouped { d, by_token: true }, None, &mut q, &mut s).unwrap();
        let up = Proj { w: ex8.weights().0, n: inter, k: hidden, relu2: true };
        for t in grouped_tiles(&gpu, true) {
            let label = format!("FP8 up projection to codes ({t:?}) hidden {hidden} inter {inter}");
            let mut h = gpu.upload(&vec![POISON_BF16; entries * inter]).unwrap();
            grouped_fp8(&gpu, d, Fp8Rows { codes: &q, scales: &s }, up, t, &mut h).unwrap();
            let mut codes = gpu.upload(&vec![0x7fu8; entries * inter]).unwrap();
            let mut scales = gpu.upload(&vec![f32::NAN; entries]).unwrap();
            let a = Fp8Rows { codes: &q, scales: &s };
            let next_rows = Fp8RowsMut { codes: &mut codes, scales: &mut scales };
            grouped_fp8_quant(&gpu, d, a, up, t, next_dev, next_rows).unwrap();
            let (h, codes, scales) =
                (gpu.download(&h).unwrap(), gpu.download(&codes).unwrap(), gpu.download(&scales).unwrap());
            let mut n = 0;
            for (ex, &scale) in next.iter().enumerate() {
                for j in skewed.offsets[ex] as usize..skewed.offsets[ex + 1] as usize {
                    let want = quant_static(&h[j * inter..][..inter], scale);
                    assert_eq!(&codes[j * inter..][..inter], &want[..], "{label}: grouped row {j} (expert {ex})");
                    assert_eq!(scales[j].to_bits(), scale.to_bits(), "{label}: grouped row {j}'s scale");
                    n += inter;
                }
            }
            assert_eq!(n, entries * inter, "{label}: every grouped row compared");
            compared += n;
        }
    }
    println!("FP8 up projection to codes: {compared} codes compared");
}

/// The NVFP4 grouped GEMM (`grouped_nvfp4`: the codes made bf16 in shared memory, the
/// per-tensor scale on the sums), on `mma.sync` (64-row tiles) and, where the PTX is sm_90a, on
/// `wgmma`, against the exact NVFP4 values in f64, at Nano's expert sizes with 16 experts and
/// the skewed routing (an expert without rows, one with one, one with every token: several row
/// tiles, the last partial) and at a small shape whose n is not a multiple of the 128- or
/// 256-column tile, on a sample of the grouped rows (expert 1's, the first and last 16 of
/// expert 2's, every 7th): the up projection's hidden rows (relu^2 rounded as the kernel rounds
/// it) and the MLP's output from the reference's own hidden rows, so a hidden value one bf16
/// step from a rounding boundary moves neither check. Then its refusals: k not a multiple of
/// 64, bf16 weights, the 128-row tiles.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_nvfp4_grouped_experts_match_reference() {
    let gpu = gpu();
    let mut rng = Rng::new(102);
    let wgmma = gpu.arch() == host::Arch::Sm90a;
    assert_eq!(gpu.has(host::Kernel::MoeGroupedWgmmaNvfp4), wgmma, "wgmma kernels on {:?}", gpu.arch());
    let tiles: Vec<Tiles> = [Tiles::Narrow].into_iter().chain(wgmma.then_some(Tiles::Wgmma)).collect();
    let (mut compared, mut expected) = (0, 0);
    for (hidden, inter, e, k, rows) in [(2688, 1856, 16, 6, 300), (192, 320, 5, 2, 70)] {
        let (up_rows, up_g, up_v) = nvfp4_weights(&mut rng, e, inter, hidden);
        let (down_rows, down_g, down_v) = nvfp4_weights(&mut rng, e, hidden, inter);
        let dev = [up_rows, down_rows].map(|r| gpu.upload(&r).unwrap());
        let dg = [up_g, down_g].map(|g| gpu.upload(&g).unwrap());
        let up = Weights::Nvfp4 { rows: &dev[0], global: &dg[0] };
        let down = Weights::Nvfp4 { rows: &dev[1], global: &dg[1] };
        let x = rng.bf16_rows(rows, hidden);
        let skewed = Skewed::new(&gpu, &mut rng, (rows, k, e));
        let (d, token) = (&skewed.d, &skewed.token);
        let (dx, entries) = (gpu.upload(&x).unwrap(), rows * k);
        let dot = |w: &[f64], x: &[f64]| -> Vec<f64> {
            w.chunks(x.len()).map(|r| r.iter().zip(x).map(|(a, b)| a * b).sum()).collect()
        };
        // The reference of the sampled grouped rows: hidden rows and outputs.
        let (mut sample, mut want, mut want_h) = (vec![], vec![], vec![]);
        for (ex, rows_of_ex) in skewed.sample(7, 16).into_iter().enumerate() {
            let (u, dn) =
                (&up_v[ex * inter * hidden..][..inter * hidden], &down_v[ex * hidden * inter..][..hidden * inter]);
            for j in rows_of_ex {
                let xj = to_f64(&x[token[j] as usize * hidden..][..hidden]);
                let hj: Vec<f64> = dot(u, &xj)
                    .into_iter()
                    .map(|v| bf16::from_f64(bf16::from_f64(v).to_f64().max(0.0).powi(2)).to_f64())
                    .collect();
                want.extend(dot(dn, &hj));
                want_h.extend(hj);
                sample.push(j);
            }
        }
        for &t in &tiles {
            let mut out = gpu.upload(&vec![POISON_BF16; entries * hidden]).unwrap();
            experts_mlp_grouped_as(&gpu, d, &dx, ExpertMlp { up, down, inter, hidden }, t, &mut out).unwrap();
            let out = to_f64(&gpu.download(&out).unwrap());
            let mut h = gpu.upload(&vec![POISON_BF16; entries * inter]).unwrap();
            grouped_nvfp4(&gpu, d, &dx, true, Proj { w: up, n: inter, k: hidden, relu2: true }, t, &mut h).unwrap();
            let h = to_f64(&gpu.download(&h).unwrap());
            let got_h: Vec<f64> = sample.iter().flat_map(|&j| h[j * inter..][..inter].to_vec()).collect();
            let got: Vec<f64> = sample.iter().flat_map(|&j| out[j * hidden..][..hidden].to_vec()).collect();
            let label = format!("NVFP4 grouped experts ({t:?}) hidden {hidden} inter {inter} rows {rows}");
            // f32 sums of exact products against f64, one bf16 rounding (relu^2 doubles the
            // relative error of its rounded input); the output from the reference's hidden
            // rows is within the kernel's hidden rows' error of ours.
            let n_h = assert_close(&format!("{label}, hidden rows"), &got_h, &want_h, 1e-3, 1.0 / 32.0);
            let n = assert_close(&label, &got, &want, 4e-3, 1.0 / 64.0);
            assert_eq!((n_h, n), (sample.len() * inter, sample.len() * hidden));
            println!("{label}: {} values compared ({} grouped rows)", n + n_h, sample.len());
            compared += n + n_h;
            expected += sample.len() * (inter + hidden);
        }
    }
    assert_eq!(compared, expected);
    // Refusals: k not whole stages of 64, bf16 weights, the 128-row tiles.
    let (rows_b, g, _) = nvfp4_weights(&mut rng, 2, 64, 80);
    let (dr, dg) = (gpu.upload(&rows_b).unwrap(), gpu.upload(&g).unwrap());
    let mut d = Dispatch::new(&gpu, 2, 1, 4).unwrap();
    dispatch(&gpu, &gpu.upload(&[0i32, 1, 0, 1]).unwrap(), &mut d).unwrap();
    let dx = gpu.upload(&rng.bf16_rows(4, 80)).unwrap();
    let mut y = gpu.zeros::<bf16>(4 * 64).unwrap();
    let w = Weights::Nvfp4 { rows: &dr, global: &dg };
    let p = Proj { w, n: 64, k: 80, relu2: false };
    let err = grouped_nvfp4(&gpu, &d, &dx, true, p, Tiles::Narrow, &mut y).unwrap_err();
    assert!(err.to_string().contains("a positive multiple of 64"), "{err}");
    let bf = gpu.zeros::<bf16>(2 * 64 * 128).unwrap();
    let p = Proj { w: Weights::Bf16(&bf), n: 64, k: 128, relu2: false };
    let err = grouped_nvfp4(&gpu, &d, &dx, true, p, Tiles::Narrow, &mut y).unwrap_err();
    assert!(err.to_string().contains("NVFP4 weights"), "{err}");
    let mlp = ExpertMlp { up: w, down: w, inter: 64, hidden: 80 };
    let err = experts_mlp_grouped_as(&gpu, &d, &dx, mlp, Tiles::Wide, &mut y).unwrap_err();
    assert!(err.to_string().contains("Narrow or Wgmma tiles for NVFP4"), "{err}");
}

/// The FP8 linear layer of many rows on tensor cores against W8A8 in f64: ours
/// (`linear_fp8_as`: the rows quantized, then `gemm_fp8`, with each FP8 tile kind this GPU has)
/// and, with a static input scale, cuBLASLt's FP8 GEMM (`host::gemm::linear_fp8`); a Nano
/// expert's up shape and in_proj's (n past the 128- and 256-column tiles' multiples) with a
/// static input scale and with per-row scales, at one row, at 65 (a partial 64-row tile) and at
/// 129 or 300 (partial 128-row tiles); an odd shape (k not a multiple of the 64- or 128-byte
/// stage); with relu^2 once. Then cuBLASLt's refusals: dynamic scales, k not a multiple of 16,
/// n not of 8.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_linear_fp8_matches_reference() {
    let gpu = gpu();
    let mut rng = Rng::new(98);
    let (mut compared, mut expected) = (0, 0);
    let cases = [
        (1856, 2688, true, false, [1, 65, 300]),
        (10304, 2688, false, false, [1, 65, 129]),
        (48, 144, true, true, [1, 65, 300]),
        (48, 144, false, false, [1, 65, 300]),
    ];
    for (n, k, static_in, relu2, row_counts) in cases {
        let (codes, w_scale, values) = fp8_weights(&mut rng, 1, n, k);
        let in_scale = static_in.then(|| rng.uniform(0.002, 0.004) as f32);
        let (dc, ds) = (gpu.upload(&codes).unwrap(), gpu.upload(&w_scale).unwrap());
        let din = in_scale.map(|s| gpu.upload(&[s]).unwrap());
        let w = Weights::Fp8 { codes: &dc, w_scale: &ds, in_scale: din.as_ref() };
        for rows in row_counts {
            let x = rng.bf16_rows(rows, k);
            let dx = gpu.upload(&x).unwrap();
            let want: Vec<f64> = x
                .chunks(k)
                .flat_map(|r| w8a8(&to_f64(r), &values, w_scale[0], in_scale))
                .map(|v| if relu2 { bf16::from_f64(v).to_f64().max(0.0).powi(2) } else { v })
                .collect();
            // Our tiles, and cuBLASLt's FP8 GEMM (None) where the input scale is static.
            let ours = dense_tiles(&gpu).into_iter().filter(|&t| t != Tiles::Wide).map(Some);
            for tiles in ours.chain(static_in.then_some(None)) {
                let mut y = gpu.upload(&vec![POISON_BF16; rows * n]).unwrap();
                let (xv, p) = ((&dx.as_view(), rows), Proj { w, n, k, relu2 });
                match tiles {
                    Some(tiles) => linear_fp8_as(&gpu, xv, p, tiles, &mut y),
                    None => host::gemm::linear_fp8(&gpu, xv, p, &mut y),
                }
                .unwrap();
                let path = tiles.map_or("cuBLASLt".into(), |t| format!("{t:?}"));
                let label =
                    format!("FP8 GEMM ({path}) {n} x {k}, rows {rows}, static input scale {static_in}, relu2 {relu2}");
                // f32 sums of exact products against f64; relu^2 doubles the relative error
                // of its bf16-rounded input.
                let rtol = if relu2 { 1.0 / 64.0 } else { 1.0 / 128.0 };
                compared += assert_close(&label, &to_f64(&gpu.download(&y).unwrap()), &want, 1e-3, rtol);
                expected += rows * n;
            }
        }
    }
    println!("FP8 GEMM: {compared} values compared");
    assert_eq!(compared, expected);
    // cuBLASLt's FP8 GEMM takes per-tensor scales and its alignment only.
    let (codes, w_scale, _) = fp8_weights(&mut rng, 1, 48, 152);
    let (dc, ds, one) = (gpu.upload(&codes).unwrap(), gpu.upload(&w_scale).unwrap(), gpu.upload(&[1.0f32]).unwrap());
    let dx = gpu.upload(&rng.bf16_rows(2, 152)).unwrap();
    let refused = |w, k, n| {
        let p = Proj { w, n, k, relu2: false };
        host::gemm::linear_fp8(&gpu, (&dx.as_view(), 2), p, &mut gpu.zeros::<bf16>(2 * n).unwrap())
            .unwrap_err()
            .to_string()
    };
    let dynamic = Weights::Fp8 { codes: &dc, w_scale: &ds, in_scale: None };
    assert!(refused(dynamic, 152, 48).contains("static input scale"));
    let w = Weights::Fp8 { codes: &dc, w_scale: &ds, in_scale: Some(&one) };
    assert!(refused(w, 152, 48).contains("a multiple of 16"));
    assert!(refused(w, 144, 38).contains("a multiple of 8"));
}

/// The bf16 linear layer of many rows on tensor cores (`gemm`, every tile kind this GPU has) against the
/// f64 reference: in_proj's shape (n past the 128-column tiles' multiple) at 65 rows (a
/// partial 64-row tile) and 300, out_proj's at 129 (a partial 128-row tile), an odd shape (k
/// not a multiple of the 32- or 64-element stage) at 1, 65 and 200 rows, with relu^2 once.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_gemm_matches_reference() {
    let gpu = gpu();
    let mut rng = Rng::new(99);
    let (mut compared, mut expected) = (0, 0);
    let cases: [(usize, usize, &[usize], bool); 4] = [
        (10304, 2688, &[65, 300], false),
        (2688, 4096, &[129], false),
        (40, 136, &[1, 65, 200], false),
        (40, 136, &[65], true),
    ];
    for (n, k, row_counts, relu2) in cases {
        let bound = (3.0 / k as f64).sqrt();
        let w = rng.bf16s(n * k, -bound, bound);
        let dw = gpu.upload(&w).unwrap();
        for &rows in row_counts {
            let x = rng.bf16s(rows * k, -1.0, 1.0);
            let dx = gpu.upload(&x).unwrap();
            let want: Vec<f64> = linear(&x, &w, rows, n, k)
                .into_iter()
                .map(|v| if relu2 { bf16::from_f64(v).to_f64().max(0.0).powi(2) } else { v })
                .collect();
            for tiles in dense_tiles(&gpu) {
                let mut out = gpu.upload(&vec![POISON_BF16; rows * n]).unwrap();
                gemm(&gpu, (&dx, rows), Proj { w: &dw, n, k, relu2 }, tiles, &mut out).unwrap();
                let label = format!("gemm ({tiles:?}) {n} x {k}, rows {rows}, relu2 {relu2}");
                // bf16 output over f32 sums of bf16 products; relu^2 doubles the relative
                // error of its bf16-rounded input.
                let rtol = if relu2 { 1.0 / 64.0 } else { 1.0 / 128.0 };
                compared += assert_close(&label, &to_f64(&gpu.download(&out).unwrap()), &want, 1e-4, rtol);
                expected += rows * n;
            }
        }
    }
    println!("gemm: {compared} values compared");
    assert_eq!(compared, expected);
}

/// The one-matrix GEMM's tiles this GPU runs: the 128-row ones where a block may have their
/// shared memory (`Gpu::fits`), the `wgmma` ones where its PTX is sm_90a (compute capability
/// 9.0, the H200), where they must be present.
fn dense_tiles(gpu: &host::Gpu) -> Vec<Tiles> {
    let wgmma = gpu.arch() == host::Arch::Sm90a;
    assert_eq!(gpu.has(host::Kernel::GemmWgmma), wgmma, "wgmma kernels on {:?}", gpu.arch());
    let wide = gpu.fits(host::Kernel::GemmWideBf16).then_some(Tiles::Wide);
    [Some(Tiles::Narrow), wide, wgmma.then_some(Tiles::Wgmma)].into_iter().flatten().collect()
}
