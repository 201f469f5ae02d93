//! MoE experts: the CPU reference's expert, dispatch and combine; on the GPU the combine, the
//! dispatch, the expert kernels (bf16, FP8, NVFP4; per routing choice and dispatched) against
//! f64 references, and the launchers' refusals. The router has tests/router.rs, the grouped
//! GEMM tests/grouped.rs.

mod common;

use common::experts::NANO;
use host::cpu::moe::expert;
use host::cpu::router::{Routing, route};
use nemotron_rs::{Rng, assert_close};

#[test]
fn expert_hand_checked() {
    // hidden 2, inter 2: up rows [1, 1] and [1, -1]; x = [2, 3]: h = [25, relu(-1)^2 = 0];
    // down rows [1, 0] and [0.5, 2]: out = [25, 12.5].
    let y = expert(&[2.0, 3.0], &[1.0, 1.0, 1.0, -1.0], &[1.0, 0.0, 0.5, 2.0]);
    assert_close("expert", &y, &[25.0, 12.5], 0.0, 0.0);
}

#[test]
fn dispatch_groups_tokens_by_expert() {
    use host::cpu::moe::dispatch;
    // 3 tokens, top-2 of 4 experts.
    let routes = vec![vec![(2, 0.5), (0, 0.5)], vec![(2, 0.7), (3, 0.3)], vec![(0, 0.9), (2, 0.1)]];
    let d = dispatch(&routes, 4);
    assert_eq!(d.counts, vec![2, 0, 3, 1]);
    assert_eq!(d.offsets, vec![0, 2, 2, 5, 6]);
    assert_eq!(d.order, vec![(0, 1), (2, 0), (0, 0), (1, 0), (2, 1), (1, 1)]);
}

#[test]
fn permute_then_combine_is_identity_with_unit_weights() {
    use host::cpu::moe::{combine, dispatch, permute};
    let mut rng = Rng::new(52);
    let (tokens, width) = (37, 5);
    let x: Vec<f64> = (0..tokens * width).map(|_| rng.uniform(-1.0, 1.0)).collect();
    let routes: Vec<Vec<(usize, f64)>> = (0..tokens)
        .map(|_| {
            let logits: Vec<f64> = (0..16).map(|_| rng.uniform(-3.0, 3.0)).collect();
            let r = route(&logits, &[0.0; 16], &Routing { top_k: 4, norm_topk_prob: false, scaling: 1.0, ..NANO });
            r.into_iter().map(|(e, _)| (e, 0.25)).collect()
        })
        .collect();
    let d = dispatch(&routes, 16);
    assert_eq!(d.order.len(), tokens * 4);
    let back = combine(&permute(&x, width, &d), width, &d, &routes);
    assert_close("round trip", &back, &x, 1e-15, 1e-15);
}

mod gpu {
    use half::bf16;
    use host::cpu::moe::dispatch as cpu_dispatch;
    use host::gemv::Proj;
    use host::grouped::experts_mlp_grouped_as;
    use host::moe::{
        Choices, Dispatch, ExpertMlp, ExpertWeights, Picks, SharedExpert, combine, dispatch, experts, experts_mlp,
        experts_mlp_choices, experts_mlp_gemm,
    };
    use host::router::{RouteShape, Routed as RouteOut, Router, route as gpu_route};
    use nemotron_rs::{POISON_BF16, Rng, assert_close, assert_same, gpu, nvfp4_weights, to_f64};

    use super::common::experts::{Fp8Experts, expert_reference, grouped_tiles};

    #[test]
    #[ignore = "needs a CUDA GPU"]
    fn gpu_combine_matches_reference() {
        let gpu = gpu();
        let mut rng = Rng::new(92);
        // (rows, top_k, hidden, slots, shared): Nano's width, a width of a partial last chunk
        // and unaligned rows, top_k past the kernel's group of 8 and at MAX_TOP_K.
        for (rows, k, hidden, slots, with_shared) in
            [(7, 3, 2688, 21, true), (64, 6, 2688, 384, true), (5, 16, 100, 40, false), (3, 9, 24, 10, true)]
        {
            let y = rng.bf16s(slots * hidden, -2.0, 2.0);
            let shared = rng.bf16s(rows * hidden, -1.0, 1.0);
            let slot: Vec<i32> = (0..rows * k).map(|j| ((j * 5 + 2) % slots) as i32).collect();
            let w: Vec<f32> = (0..rows * k).map(|_| rng.uniform(0.0, 1.0) as f32).collect();
            let (dy, dsh, dw) = (gpu.upload(&y).unwrap(), gpu.upload(&shared).unwrap(), gpu.upload(&w).unwrap());
            let mut out = gpu.upload(&vec![POISON_BF16; rows * hidden]).unwrap();
            let dslot = gpu.upload(&slot).unwrap();
            let sh = with_shared.then_some(&dsh);
            combine(&gpu, (&dy, hidden), sh, Picks { slot: &dslot, weight: &dw, top_k: k }, &mut out).unwrap();
            let want: Vec<f64> = (0..rows * hidden)
                .map(|i| {
                    let (t, c) = (i / hidden, i % hidden);
                    let base = if with_shared { shared[i].to_f64() } else { 0.0 };
                    base + (0..k)
                        .map(|kk| f64::from(w[t * k + kk]) * y[slot[t * k + kk] as usize * hidden + c].to_f64())
                        .sum::<f64>()
                })
                .collect();
            let got = to_f64(&gpu.download(&out).unwrap());
            let n = assert_close("combine", &got, &want, 1e-5, 1.0 / 256.0 + 1e-5);
            assert_eq!(n, rows * hidden, "combine {rows} x {hidden}, top_k {k}: values compared");
            println!("combine {rows} x {hidden}, top_k {k}, shared {with_shared}: {n} values compared");
        }
    }

    /// `rows` tokens each choosing `k` distinct experts of `e` at random.
    #[test]
    #[ignore = "needs a CUDA GPU"]
    fn gpu_dispatch_groups_by_expert() {
        let gpu = gpu();
        let mut rng = Rng::new(93);
        let mut compared = 0;
        // NemotronH at decode and prefill batches, the largest expert count and top-k, every
        // expert chosen by every token, one token.
        for (rows, k, e) in
            [(1, 6, 128), (7, 6, 128), (64, 6, 128), (1024, 6, 128), (16384, 6, 128), (300, 16, 256), (5, 8, 8)]
        {
            let idx = rng.choices(rows, k, e);
            let mut d = Dispatch::new(&gpu, e, k, rows).unwrap();
            dispatch(&gpu, &gpu.upload(&idx).unwrap(), &mut d).unwrap();
            let routes: Vec<Vec<(usize, f64)>> =
                idx.chunks(k).map(|r| r.iter().map(|&x| (x as usize, 1.0)).collect()).collect();
            let want = cpu_dispatch(&routes, e);
            let offsets: Vec<usize> = gpu.download(d.offsets()).unwrap().iter().map(|&o| o as usize).collect();
            let label = format!("dispatch rows {rows} top-{k} of {e}");
            compared += assert_same(&format!("{label} offsets"), &offsets, &want.offsets);
            let active: Vec<u32> =
                (0..e as u32).filter(|&x| want.offsets[x as usize + 1] > want.offsets[x as usize]).collect();
            let count = gpu.download(d.active_count()).unwrap()[0] as usize;
            compared += assert_same(&format!("{label} active"), &gpu.download(d.active()).unwrap()[..count], &active);
            // Each choice sits in its expert's range, at a row holding its token, and no two
            // choices share a row.
            let (token, slot) = (gpu.download(d.token()).unwrap(), gpu.download(d.slot()).unwrap());
            let mut seen = vec![false; rows * k];
            for (i, (&x, &s)) in idx.iter().zip(&slot).enumerate() {
                let s = s as usize;
                assert!((want.offsets[x as usize]..want.offsets[x as usize + 1]).contains(&s), "{label}: entry {i}");
                assert_eq!(token[s] as usize, i / k, "{label}: token of row {s}");
                assert!(!std::mem::replace(&mut seen[s], true), "{label}: row {s} twice");
                compared += 1;
            }
        }
        println!("dispatch: {compared} values compared");
    }

    #[test]
    #[ignore = "needs a CUDA GPU"]
    fn gpu_experts_match_reference() {
        let gpu = gpu();
        let mut rng = Rng::new(94);
        let mut compared = 0;
        // NemotronH's expert sizes with 16 experts (each expert then gets more rows), and an
        // odd shape (k not a multiple of the 256-wide lane stride, n not of the block's rows);
        // with the last two experts a shared expert's pieces (down projections as column
        // blocks of one matrix; the expert kernel only) at one row and at the odd shape.
        for (hidden, inter, e, k, rows, pieces) in [
            (2688, 1856, 16, 6, 1, 0),
            (2688, 1856, 16, 6, 1, 2),
            (2688, 1856, 16, 6, 7, 0),
            (2688, 1856, 16, 6, 64, 0),
            (136, 40, 5, 2, 33, 0),
            (136, 40, 5, 2, 33, 2),
        ] {
            let up = rng.bf16s(e * inter * hidden, -(3.0 / hidden as f64).sqrt(), (3.0 / hidden as f64).sqrt());
            let down = rng.bf16s(e * hidden * inter, -(3.0 / inter as f64).sqrt(), (3.0 / inter as f64).sqrt());
            let x = rng.bf16s(rows * hidden, -1.0, 1.0);
            let idx = rng.choices(rows, k, e);
            let (dup, ddown, dx) = (gpu.upload(&up).unwrap(), gpu.upload(&down).unwrap(), gpu.upload(&x).unwrap());
            let mut d = Dispatch::new(&gpu, e, k, rows).unwrap();
            dispatch(&gpu, &gpu.upload(&idx).unwrap(), &mut d).unwrap();
            let slot = gpu.download(d.slot()).unwrap();
            // The reference expert in f64 with the hidden activation rounded to bf16 as the
            // kernels store it.
            let (up64, down64) = (to_f64(&up), to_f64(&down));
            // Expert ex's down projection `[hidden, inter]`.
            let p0 = e - pieces;
            let down_of = |ex: usize| -> Vec<f64> {
                if ex < p0 {
                    return down64[ex * hidden * inter..][..hidden * inter].to_vec();
                }
                let wide = &down64[p0 * hidden * inter..];
                (0..hidden).flat_map(|r| wide[(r * pieces + ex - p0) * inter..][..inter].to_vec()).collect()
            };
            let mut want = vec![0.0; rows * k * hidden];
            for (i, &ex) in idx.iter().enumerate() {
                let ex = ex as usize;
                let xr = to_f64(&x[i / k * hidden..][..hidden]);
                let y = expert_reference(&xr, &up64[ex * inter * hidden..][..inter * hidden], &down_of(ex), inter);
                want[slot[i] as usize * hidden..][..hidden].copy_from_slice(&y);
            }
            // cuBLASLt per expert and the grouped GEMM take no pieces (0: the expert kernel,
            // 1: cuBLASLt, 2..: grouped with each of this GPU's tiles).
            let tiles = grouped_tiles(&gpu, false);
            let paths: Vec<usize> = if pieces == 0 { (0..2 + tiles.len()).collect() } else { vec![0] };
            for &path in &paths {
                let mut out = gpu.upload(&vec![POISON_BF16; rows * k * hidden]).unwrap();
                let mlp = ExpertMlp { up: &dup, down: &ddown, inter, hidden };
                if path == 1 {
                    experts_mlp_gemm(&gpu, &d, &dx, mlp, &mut out).unwrap();
                } else if path >= 2 {
                    let w =
                        ExpertMlp { up: ExpertWeights::Bf16(&dup), down: ExpertWeights::Bf16(&ddown), inter, hidden };
                    experts_mlp_grouped_as(&gpu, &d, &dx, w, tiles[path - 2], &mut out).unwrap();
                } else {
                    let (up, down) = (ExpertWeights::Bf16(&dup), ExpertWeights::Bf16(&ddown));
                    experts_mlp(&gpu, &d, &dx, ExpertMlp { up, down, inter, hidden }, pieces, &mut out).unwrap();
                }
                let label = match path {
                    0 => "kernel".to_string(),
                    1 => "cuBLASLt".to_string(),
                    p => format!("grouped {:?}", tiles[p - 2]),
                };
                let label = format!("experts {label} hidden {hidden} inter {inter} rows {rows} pieces {pieces}");
                // bf16 output (2^-8 relative) over f32 sums of bf16 products.
                compared += assert_close(&label, &to_f64(&gpu.download(&out).unwrap()), &want, 2e-3, 1.0 / 128.0);
            }
            // Per choice, the combining fused (a shared output added where there are no
            // pieces): bit for bit the kernel path then `combine`, and close to the f64 sum of
            // the kernel path's expert outputs (checked against the reference above).
            let wt: Vec<f32> = (0..rows * k).map(|_| rng.uniform(0.0, 1.0) as f32).collect();
            let shared = (pieces == 0).then(|| rng.bf16s(rows * hidden, -1.0, 1.0));
            let (dw, didx) = (gpu.upload(&wt).unwrap(), gpu.upload(&idx).unwrap());
            let dsh = shared.as_ref().map(|s| gpu.upload(s).unwrap());
            let mut grouped = gpu.upload(&vec![POISON_BF16; rows * k * hidden]).unwrap();
            let (up_w, down_w) = (ExpertWeights::Bf16(&dup), ExpertWeights::Bf16(&ddown));
            experts_mlp(&gpu, &d, &dx, ExpertMlp { up: up_w, down: down_w, inter, hidden }, pieces, &mut grouped)
                .unwrap();
            let mut unfused = gpu.upload(&vec![POISON_BF16; rows * hidden]).unwrap();
            combine(
                &gpu,
                (&grouped, hidden),
                dsh.as_ref(),
                Picks { slot: d.slot(), weight: &dw, top_k: k },
                &mut unfused,
            )
            .unwrap();
            let mut fused = gpu.upload(&vec![POISON_BF16; rows * hidden]).unwrap();
            let ch = Choices { idx: &didx, weight: &dw, per: k, experts: e };
            let mlp = ExpertMlp { up: up_w, down: down_w, inter, hidden };
            experts_mlp_choices(&gpu, ch, &dx, mlp, SharedExpert { pieces, out: dsh.as_ref() }, &mut fused).unwrap();
            let label =
                format!("experts per choice, combined: hidden {hidden} inter {inter} rows {rows} pieces {pieces}");
            let (fused, grouped) = (gpu.download(&fused).unwrap(), gpu.download(&grouped).unwrap());
            let bits = |v: &[bf16]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            compared += assert_same(&label, &bits(&fused), &bits(&gpu.download(&unfused).unwrap()));
            let combined: Vec<f64> = (0..rows * hidden)
                .map(|i| {
                    let (t, c) = (i / hidden, i % hidden);
                    let own = (0..k)
                        .map(|j| f64::from(wt[t * k + j]) * grouped[slot[t * k + j] as usize * hidden + c].to_f64());
                    shared.as_ref().map_or(0.0, |s| s[i].to_f64()) + own.sum::<f64>()
                })
                .collect();
            compared += assert_close(&label, &to_f64(&fused), &combined, 1e-5, 1.0 / 256.0 + 1e-5);
        }
        println!("experts: {compared} values compared");
    }

    #[test]
    #[ignore = "needs a CUDA GPU"]
    fn gpu_fp8_experts_match_reference() {
        let gpu = gpu();
        let mut rng = Rng::new(96);
        let mut compared = 0;
        // NemotronH's expert sizes, static input scales for up and per-token for down, then
        // the other way round, and a decode step's one token of 6 choices; an odd shape (up's k
        // 136 and down's 40 not multiples of 16: rows 8-byte aligned; n not a multiple of the
        // 32 rows of a block; experts of over 8 rows: passes of the tensor-core kernel).
        for (hidden, inter, e, k, rows, up_static) in [
            (2688, 1856, 8, 2, 7, true),
            (2688, 1856, 8, 2, 7, false),
            (2688, 1856, 8, 6, 1, true),
            (136, 40, 5, 2, 33, true),
        ] {
            let ex8 = Fp8Experts::new(&gpu, &mut rng, (e, inter, hidden), up_static);
            let x = rng.bf16s(rows * hidden, -1.0, 1.0);
            let idx = rng.choices(rows, k, e);
            let mut d = Dispatch::new(&gpu, e, k, rows).unwrap();
            dispatch(&gpu, &gpu.upload(&idx).unwrap(), &mut d).unwrap();
            let slot = gpu.download(d.slot()).unwrap();
            let (up, down) = ex8.weights();
            let mut out = gpu.upload(&vec![POISON_BF16; rows * k * hidden]).unwrap();
            experts_mlp(&gpu, &d, &gpu.upload(&x).unwrap(), ExpertMlp { up, down, inter, hidden }, 0, &mut out)
                .unwrap();
            let mut want = vec![0.0; rows * k * hidden];
            for (i, &ex) in idx.iter().enumerate() {
                let xr = to_f64(&x[i / k * hidden..][..hidden]);
                want[slot[i] as usize * hidden..][..hidden].copy_from_slice(&ex8.reference(ex as usize, &xr));
            }
            let label = format!(
                "FP8 experts hidden {hidden} inter {inter} rows {rows} static {}",
                if up_static { "up" } else { "down" }
            );
            // The codes are the same on both sides (same bf16 inputs, same f32 division);
            // sums in f32 against f64 can move a hidden value by one bf16 step.
            compared += assert_close(&label, &to_f64(&gpu.download(&out).unwrap()), &want, 2e-3, 1.0 / 64.0);
            let routed = Routed { x: &x, idx: &idx, d: &d, out: &out, want: &want };
            compared += check_choices(&gpu, &mut rng, &label, routed, ExpertMlp { up, down, inter, hidden }, 2e-3);
        }
        println!("FP8 experts: {compared} values compared");
        assert_eq!(compared, 2 * 7 * 2 * 2688 + 6 * 2688 + 33 * 2 * 136 + 2 * 7 * 2688 + 2 * 2688 + 33 * 136);
    }

    /// NVFP4 experts (weight-only, quantized as ModelOpt does) against f64 with the exact
    /// dequantized weights: the expert kernels (`experts_mlp` after a dispatch: the warp mode at
    /// one token, the tensor cores from two) at Nano's expert sizes (7 tokens of 2 choices, 1
    /// of 6, 40 of 6) and an odd shape (k of 144 and 48: 72 and 24 code bytes, a lane's 16-byte
    /// load half past k; 33 tokens); per choice (`experts_mlp_choices`, the combining fused, a
    /// shared output added) within the summed tolerances, and at one token bit for bit the
    /// expert kernel then `combine`.
    #[test]
    #[ignore = "needs a CUDA GPU"]
    fn gpu_nvfp4_experts_match_reference() {
        let gpu = gpu();
        let mut rng = Rng::new(101);
        let (mut compared, mut expected) = (0, 0);
        for (hidden, inter, e, k, rows) in
            [(2688, 1856, 8, 2, 7), (2688, 1856, 8, 6, 1), (2688, 1856, 16, 6, 40), (144, 48, 5, 2, 33)]
        {
            let (up_rows, up_g, up_v) = nvfp4_weights(&mut rng, e, inter, hidden);
            let (down_rows, down_g, down_v) = nvfp4_weights(&mut rng, e, hidden, inter);
            let dev = [up_rows, down_rows].map(|r| gpu.upload(&r).unwrap());
            let dg = [up_g, down_g].map(|g| gpu.upload(&g).unwrap());
            let up = ExpertWeights::Nvfp4 { rows: &dev[0], global: &dg[0] };
            let down = ExpertWeights::Nvfp4 { rows: &dev[1], global: &dg[1] };
            let dot = |w: &[f64], x: &[f64]| {
                w.chunks(x.len()).map(|r| r.iter().zip(x).map(|(a, b)| a * b).sum::<f64>()).collect::<Vec<_>>()
            };
            let reference = |ex: usize, x: &[f64]| {
                let h: Vec<f64> = dot(&up_v[ex * inter * hidden..][..inter * hidden], x)
                    .iter()
                    .map(|&v| bf16::from_f64(bf16::from_f64(v).to_f64().max(0.0).powi(2)).to_f64())
                    .collect();
                dot(&down_v[ex * hidden * inter..][..hidden * inter], &h)
            };
            let x = rng.bf16s(rows * hidden, -1.0, 1.0);
            let dx = gpu.upload(&x).unwrap();
            let idx = rng.choices(rows, k, e);
            let mut d = Dispatch::new(&gpu, e, k, rows).unwrap();
            dispatch(&gpu, &gpu.upload(&idx).unwrap(), &mut d).unwrap();
            let slot = gpu.download(d.slot()).unwrap();
            let mut out = gpu.upload(&vec![POISON_BF16; rows * k * hidden]).unwrap();
            experts_mlp(&gpu, &d, &dx, ExpertMlp { up, down, inter, hidden }, 0, &mut out).unwrap();
            let mut want = vec![0.0; rows * k * hidden];
            for (i, &ex) in idx.iter().enumerate() {
                let xr = to_f64(&x[i / k * hidden..][..hidden]);
                want[slot[i] as usize * hidden..][..hidden].copy_from_slice(&reference(ex as usize, &xr));
            }
            let label = format!("NVFP4 experts hidden {hidden} inter {inter} rows {rows}");
            // f32 sums against f64 can move a hidden value by one bf16 step: at an up output
            // near 2.5 (x in +-1 against weights of variance 1 / hidden: 4 standard
            // deviations) relu^2 moves by 2 * 2.5 * 2^-7 = 0.04, times a down weight of up to
            // sqrt(3 / 1856) = 0.04: 1.6e-3 on an output, beside the sums' own error (one such
            // flip in the 645120 values of 40 tokens measured 2.2e-3 off).
            const ATOL: f64 = 4e-3;
            compared += assert_close(&label, &to_f64(&gpu.download(&out).unwrap()), &want, ATOL, 1.0 / 64.0);
            let routed = Routed { x: &x, idx: &idx, d: &d, out: &out, want: &want };
            compared += check_choices(&gpu, &mut rng, &label, routed, ExpertMlp { up, down, inter, hidden }, ATOL);
            expected += rows * k * hidden + rows * hidden + if rows == 1 { hidden } else { 0 };
        }
        println!("NVFP4 experts: {compared} values compared");
        assert_eq!(compared, expected);
    }

    /// What a test's expert kernel launch was given and gave: the tokens' inputs, their
    /// choices, the dispatch, the grouped expert outputs and the reference's.
    struct Routed<'a> {
        x: &'a [bf16],
        idx: &'a [i32],
        d: &'a Dispatch,
        out: &'a host::CudaSlice<bf16>,
        want: &'a [f64],
    }

    /// The same experts per choice, the combining fused, a shared output added
    /// (`experts_mlp_choices`): each token's weighted sum of the reference's expert outputs
    /// (random weights), within the sum of their tolerances (`atol` and 1/64 relative) and the
    /// output's bf16 rounding; at one token (the warp mode on both paths) bit for bit the expert
    /// kernel's outputs then `combine`. Returns the values compared.
    fn check_choices(
        gpu: &host::Gpu,
        rng: &mut Rng,
        label: &str,
        r: Routed,
        mlp: ExpertMlp<ExpertWeights>,
        atol: f64,
    ) -> usize {
        let (hidden, rows, e) = (mlp.hidden, r.d.rows(), r.d.experts());
        let k = r.d.entries() / rows;
        let slot = gpu.download(r.d.slot()).unwrap();
        let wt: Vec<f32> = (0..rows * k).map(|_| rng.uniform(0.0, 1.0) as f32).collect();
        let shared = rng.bf16s(rows * hidden, -1.0, 1.0);
        let (dw, didx, dsh) = (gpu.upload(&wt).unwrap(), gpu.upload(r.idx).unwrap(), gpu.upload(&shared).unwrap());
        let ch = Choices { idx: &didx, weight: &dw, per: k, experts: e };
        let mut fused = gpu.upload(&vec![POISON_BF16; rows * hidden]).unwrap();
        experts_mlp_choices(
            gpu,
            ch,
            &gpu.upload(r.x).unwrap(),
            mlp,
            SharedExpert { pieces: 0, out: Some(&dsh) },
            &mut fused,
        )
        .unwrap();
        let fused = to_f64(&gpu.download(&fused).unwrap());
        let mut outside = 0;
        for (i, &got) in fused.iter().enumerate() {
            let (t, c) = (i / hidden, i % hidden);
            let terms = (0..k).map(|j| (f64::from(wt[t * k + j]), r.want[slot[t * k + j] as usize * hidden + c]));
            let (sum, bound) =
                terms.fold((shared[i].to_f64(), 0.0), |(s, b), (w, v)| (s + w * v, b + w * (atol + v.abs() / 64.0)));
            outside += usize::from((got - sum).abs() > bound + sum.abs() / 256.0);
        }
        assert_eq!(outside, 0, "{label}, per choice combined: {outside} of {} outside", fused.len());
        let mut compared = fused.len();
        if rows == 1 {
            let mut unfused = gpu.upload(&vec![POISON_BF16; rows * hidden]).unwrap();
            combine(gpu, (r.out, hidden), Some(&dsh), Picks { slot: r.d.slot(), weight: &dw, top_k: k }, &mut unfused)
                .unwrap();
            let unfused = to_f64(&gpu.download(&unfused).unwrap());
            let bits = |v: &[f64]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            compared += assert_same(&format!("{label}, per choice"), &bits(&fused), &bits(&unfused));
        }
        compared
    }

    /// Misuse the launchers cannot be trusted with: a dispatch never filled, x shorter than the
    /// dispatch's tokens, more pieces than experts, more choices than the dispatch's exact
    /// prefix sums allow, per-choice buffers of the wrong size, and a token whose activations
    /// are NaN (routing still picks valid, distinct experts).
    #[test]
    #[ignore = "needs a CUDA GPU"]
    fn gpu_moe_misuse_is_refused() {
        let gpu = gpu();
        let (e, k, rows, hidden, inter) = (8, 2, 4, 64, 16);
        let w = gpu.zeros::<bf16>(e * inter * hidden).unwrap();
        let x = gpu.zeros::<bf16>(rows * hidden).unwrap();
        let mut out = gpu.zeros::<bf16>(rows * k * inter).unwrap();
        let mut d = Dispatch::new(&gpu, e, k, rows).unwrap();
        let up = Proj { w: ExpertWeights::Bf16(&w), n: inter, k: hidden, relu2: false };
        let err = experts(&gpu, &d, &x, true, up, 0, &mut out).unwrap_err();
        assert!(err.to_string().contains("never dispatched"), "{err}");
        dispatch(&gpu, &gpu.upload(&Rng::new(97).choices(rows, k, e)).unwrap(), &mut d).unwrap();
        let short = gpu.zeros::<bf16>((rows - 1) * hidden).unwrap();
        let err = experts(&gpu, &d, &short, true, up, 0, &mut out).unwrap_err();
        assert!(err.to_string().contains("`x`"), "{err}");
        let err = experts(&gpu, &d, &x, true, up, e + 1, &mut out).unwrap_err();
        assert!(err.to_string().contains("`pieces`"), "{err}");
        experts(&gpu, &d, &x, true, up, 0, &mut out).unwrap();
        assert!(Dispatch::new(&gpu, 128, 16, 1 << 20).is_err(), "2^24 choices");
        // Per choice: weights not one per choice, a short down projection, no choices per
        // token, an intermediate size not a multiple of 8, more choices than block rows.
        let (cidx, cw) = (gpu.zeros::<i32>(rows * k).unwrap(), gpu.zeros::<f32>(rows * k).unwrap());
        let mut y = gpu.zeros::<bf16>(rows * hidden).unwrap();
        let ch = Choices { idx: &cidx, weight: &cw, per: k, experts: e };
        let short = gpu.zeros::<f32>(rows * k - 1).unwrap();
        let bw = ExpertWeights::Bf16(&w);
        let mlp = ExpertMlp { up: bw, down: bw, inter, hidden };
        let err = experts_mlp_choices(
            &gpu,
            Choices { weight: &short, ..ch },
            &x,
            mlp,
            SharedExpert { pieces: 0, out: None },
            &mut y,
        )
        .unwrap_err();
        assert!(err.to_string().contains("`weight`"), "{err}");
        let down = gpu.zeros::<bf16>(e * hidden * inter - 1).unwrap();
        let err = experts_mlp_choices(
            &gpu,
            ch,
            &x,
            ExpertMlp { down: ExpertWeights::Bf16(&down), ..mlp },
            SharedExpert { pieces: 0, out: None },
            &mut y,
        )
        .unwrap_err();
        assert!(err.to_string().contains("moe_expert_combine_bf16: argument `w`"), "{err}");
        let err =
            experts_mlp_choices(&gpu, Choices { per: 0, ..ch }, &x, mlp, SharedExpert { pieces: 0, out: None }, &mut y)
                .unwrap_err();
        assert!(err.to_string().contains("`top_k`"), "{err}");
        let odd = gpu.zeros::<bf16>(e * (inter - 1) * hidden).unwrap();
        let odd =
            ExpertMlp { up: ExpertWeights::Bf16(&odd), down: ExpertWeights::Bf16(&odd), inter: inter - 1, hidden };
        let err = experts_mlp_choices(&gpu, ch, &x, odd, SharedExpert { pieces: 0, out: None }, &mut y).unwrap_err();
        assert!(err.to_string().contains("`inter`"), "{err}");
        let many = gpu.zeros::<i32>(65536).unwrap();
        let (wmany, mut ymany) = (gpu.zeros::<f32>(65536).unwrap(), gpu.zeros::<bf16>(65536 / k * hidden).unwrap());
        let big = Choices { idx: &many, weight: &wmany, per: k, experts: e };
        let err =
            experts_mlp_choices(&gpu, big, &x, mlp, SharedExpert { pieces: 0, out: None }, &mut ymany).unwrap_err();
        assert!(err.to_string().contains("`idx`"), "{err}");
        experts_mlp_choices(&gpu, ch, &x, mlp, SharedExpert { pieces: 0, out: None }, &mut y).unwrap();
        let s =
            RouteShape { experts: e, top_k: k, n_group: 2, topk_group: 1, renormalize: true, scaling: 1.0, shared: 0 };
        let mut xs = vec![bf16::ONE; rows * hidden];
        xs[hidden..2 * hidden].fill(bf16::NAN);
        let gate = gpu.upload(&vec![bf16::from_f32(0.01); e * hidden]).unwrap();
        let (mut idx, mut wt) = (gpu.zeros::<i32>(rows * k).unwrap(), gpu.zeros::<f32>(rows * k).unwrap());
        let bias = gpu.zeros(e).unwrap();
        gpu_route(
            &gpu,
            s,
            (&gpu.upload(&xs).unwrap(), hidden),
            Router { gate: &gate, bias: &bias },
            RouteOut { idx: &mut idx, weight: &mut wt },
        )
        .unwrap();
        let idx = gpu.download(&idx).unwrap();
        for r in idx.chunks(k) {
            assert!(r.iter().all(|&i| (0..e as i32).contains(&i)) && r[0] != r[1], "{idx:?}");
        }
        println!("misuse: {} routing choices checked", idx.len());
    }
}
