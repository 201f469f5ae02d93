//! MoE routing reference: hand-checked selections, the tie rule, the bias that changes the
//! selection but not the weights, and group-limited selection.

use host::cpu::moe::{Routing, expert, route};
use nemotron_rs::{Rng, assert_close};

fn logit(p: f64) -> f64 {
    (p / (1.0 - p)).ln()
}

const NANO: Routing = Routing { top_k: 6, n_group: 1, topk_group: 1, norm_topk_prob: true, scaling: 2.5 };

#[test]
fn top_k_with_renormalized_scaled_weights() {
    // Scores 0.9, 0.2, 0.8, 0.7 (sigmoid of the logits); top-2 = experts 0 and 2.
    let logits: Vec<f64> = [0.9, 0.2, 0.8, 0.7].iter().map(|&p| logit(p)).collect();
    let r = Routing { top_k: 2, ..NANO };
    let got = route(&logits, &[0.0; 4], &r);
    assert_eq!(got.iter().map(|g| g.0).collect::<Vec<_>>(), vec![0, 2]);
    assert_close(
        "weights",
        &got.iter().map(|g| g.1).collect::<Vec<_>>(),
        &[2.5 * 0.9 / 1.7, 2.5 * 0.8 / 1.7],
        0.0,
        1e-12,
    );
    // Without renormalization the weights are the scores times the scaling.
    let got = route(&logits, &[0.0; 4], &Routing { norm_topk_prob: false, ..r });
    assert_close("raw weights", &got.iter().map(|g| g.1).collect::<Vec<_>>(), &[2.5 * 0.9, 2.5 * 0.8], 0.0, 1e-12);
}

#[test]
fn ties_go_to_the_lowest_index() {
    let logits = vec![0.0, 1.0, 1.0, 0.0, 1.0];
    let got = route(&logits, &[0.0; 5], &Routing { top_k: 2, ..NANO });
    assert_eq!(got.iter().map(|g| g.0).collect::<Vec<_>>(), vec![1, 2]);
    // All equal: the first k.
    let got = route(&[0.3; 8], &[0.0; 8], &Routing { top_k: 3, ..NANO });
    assert_eq!(got.iter().map(|g| g.0).collect::<Vec<_>>(), vec![0, 1, 2]);
}

#[test]
fn bias_selects_but_does_not_weigh() {
    let logits: Vec<f64> = [0.9, 0.2, 0.8, 0.7].iter().map(|&p| logit(p)).collect();
    let bias = [0.0, 0.75, 0.0, 0.0]; // expert 1: 0.2 + 0.75 = 0.95, now the best
    let got = route(&logits, &bias, &Routing { top_k: 2, ..NANO });
    assert_eq!(got.iter().map(|g| g.0).collect::<Vec<_>>(), vec![1, 0]);
    assert_close(
        "weights",
        &got.iter().map(|g| g.1).collect::<Vec<_>>(),
        &[2.5 * 0.2 / 1.1, 2.5 * 0.9 / 1.1],
        0.0,
        1e-12,
    );
}

#[test]
fn groups_limit_the_selection() {
    // 8 experts in 4 groups of 2; group scores (sum of top 2): g0 1.0, g1 1.3, g2 0.4, g3 1.2.
    let p = [0.5, 0.5, 0.95, 0.35, 0.3, 0.1, 0.6, 0.6];
    let logits: Vec<f64> = p.iter().map(|&p| logit(p)).collect();
    let r = Routing { top_k: 3, n_group: 4, topk_group: 2, norm_topk_prob: true, scaling: 1.0 };
    let got = route(&logits, &[0.0; 8], &r);
    // Kept groups 1 and 3: experts 2, 3, 6, 7; top 3: 2 (0.95), 6 and 7 (0.6, tie: 6 first).
    assert_eq!(got.iter().map(|g| g.0).collect::<Vec<_>>(), vec![2, 6, 7]);
    // With a fourth pick the grouping decides: expert 3 (0.35, kept group) beats expert 0
    // (0.5, dropped group); ungrouped, expert 0 wins.
    let got = route(&logits, &[0.0; 8], &Routing { top_k: 4, ..r });
    assert_eq!(got.iter().map(|g| g.0).collect::<Vec<_>>(), vec![2, 6, 7, 3]);
    let ungrouped = route(&logits, &[0.0; 8], &Routing { top_k: 4, n_group: 1, topk_group: 1, ..r });
    assert_eq!(ungrouped.iter().map(|g| g.0).collect::<Vec<_>>(), vec![2, 6, 7, 0]);
}

#[test]
fn nano_routing_on_random_logits() {
    let mut rng = Rng::new(51);
    for _ in 0..100 {
        let logits: Vec<f64> = (0..128).map(|_| rng.uniform(-4.0, 4.0)).collect();
        let got = route(&logits, &vec![0.0; 128], &NANO);
        assert_eq!(got.len(), 6);
        let total: f64 = got.iter().map(|g| g.1).sum();
        assert!((total - 2.5).abs() < 1e-12, "renormalized weights sum to the scaling: {total}");
        let worst_chosen = got.iter().map(|g| logits[g.0]).fold(f64::INFINITY, f64::min);
        let best_other =
            (0..128).filter(|i| !got.iter().any(|g| g.0 == *i)).map(|i| logits[i]).fold(f64::NEG_INFINITY, f64::max);
        assert!(worst_chosen >= best_other, "a better expert was left out");
    }
}

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
    use host::cpu::moe::{Routing, route};
    use host::gemv::Proj;
    use host::grouped::{Fp8Rows, Tiles, experts_mlp_grouped_as, grouped_fp8};
    use host::moe::{
        Choices, Dispatch, ExpertMlp, ExpertWeights, ROUTE_TC_MIN_ROWS, RouteShape, Router, combine, dispatch, experts,
        experts_mlp, experts_mlp_choices, experts_mlp_choices_after, experts_mlp_gemm, route as gpu_route,
        route_appended_up,
    };
    use host::quant::{Source, quant_rows};
    use nemotron_rs::{POISON_BF16, Rng, assert_close, assert_same, fp8_weights, gpu, nvfp4_weights, to_f64, w8a8};

    /// Router logits in f64 from the bf16 activations and weights, as the kernel forms them.
    fn logits(x: &[bf16], gate: &[bf16], hidden: usize) -> Vec<Vec<f64>> {
        x.chunks(hidden)
            .map(|r| gate.chunks(hidden).map(|g| r.iter().zip(g).map(|(a, b)| a.to_f64() * b.to_f64()).sum()).collect())
            .collect()
    }

    /// Selection scores closer than this may be ordered either way by a kernel's f32 sums.
    const NEAR_TIE: f64 = 1e-5;

    /// Whether `got` (a token's top-k experts, in the kernel's order) is a choice the reference
    /// makes for selection scores within [`NEAR_TIE`] of its own (`sigmoid(logit) + bias`, and
    /// the groups' sums of their top two): every expert of `got` in a group within the margin of
    /// being kept, and within the margin of every other expert of those groups that it beat.
    /// Returns the reference's (expert, weight) pairs for `got` where it is.
    fn near_tie(l: &[f64], bias: &[f64], r: &Routing, got: &[usize]) -> Option<Vec<(usize, f64)>> {
        let e = l.len();
        let s: Vec<f64> = l.iter().map(|&v| 1.0 / (1.0 + (-v).exp())).collect();
        let sel: Vec<f64> = s.iter().zip(bias).map(|(a, b)| a + b).collect();
        let per = e / r.n_group;
        let group = |g: usize| {
            let mut m: Vec<f64> = sel[g * per..(g + 1) * per].to_vec();
            m.sort_by(|a, b| b.total_cmp(a));
            m.iter().take(2.min(per)).sum::<f64>()
        };
        let gs: Vec<f64> = (0..r.n_group).map(group).collect();
        let threshold = {
            let mut sorted = gs.clone();
            sorted.sort_by(|a, b| b.total_cmp(a));
            sorted[r.topk_group - 1]
        };
        let kept = |g: usize| gs[g] >= threshold - NEAR_TIE;
        let distinct = got.iter().enumerate().all(|(i, a)| !got[..i].contains(a));
        if !distinct || got.iter().any(|&x| x >= e || !kept(x / per)) {
            return None;
        }
        let weakest = got.iter().map(|&x| sel[x]).fold(f64::INFINITY, f64::min);
        let rival =
            (0..e).filter(|x| !got.contains(x) && kept(x / per)).map(|x| sel[x]).fold(f64::NEG_INFINITY, f64::max);
        if weakest < rival - NEAR_TIE {
            return None;
        }
        let total: f64 = got.iter().map(|&x| s[x]).sum();
        Some(got.iter().map(|&x| (x, if r.norm_topk_prob { s[x] / total } else { s[x] } * r.scaling)).collect())
    }

    /// The near-tie rule takes a swap at the top-k boundary within the margin and nothing else:
    /// not a swap past it, not a repeated expert, not an expert of a group the reference drops
    /// by more than the margin.
    #[test]
    fn near_ties_are_only_close_swaps() {
        let logit = |p: f64| (p / (1.0 - p)).ln();
        let r = Routing { top_k: 2, n_group: 1, topk_group: 1, norm_topk_prob: true, scaling: 1.0 };
        let l: Vec<f64> = [0.9, 0.8, 0.8 + 5e-6, 0.1, 0.2, 0.3, 0.4, 0.5].iter().map(|&p| logit(p)).collect();
        let zero = vec![0.0; 8];
        assert_eq!(route(&l, &zero, &r).iter().map(|c| c.0).collect::<Vec<_>>(), [0, 2]);
        let w = near_tie(&l, &zero, &r, &[0, 1]).expect("a swap within the margin");
        assert!((w[0].1 - 0.9 / 1.7).abs() < 1e-12 && w[1].0 == 1);
        assert!(near_tie(&l, &zero, &r, &[1, 0]).is_some(), "the order of a near tie");
        assert!(near_tie(&l, &zero, &r, &[0, 7]).is_none(), "a swap past the margin");
        assert!(near_tie(&l, &zero, &r, &[0, 0]).is_none(), "a repeated expert");
        // Two groups of four keep one: group 1's top two sum far below group 0's.
        let g = Routing { top_k: 2, n_group: 2, topk_group: 1, ..r };
        let l: Vec<f64> = [0.9, 0.8, 0.7, 0.1, 0.75, 0.1, 0.1, 0.1].iter().map(|&p| logit(p)).collect();
        assert!(near_tie(&l, &zero, &g, &[0, 4]).is_none(), "an expert of a dropped group");
        assert!(near_tie(&l, &zero, &g, &[0, 1]).is_some());
    }

    #[test]
    #[ignore = "needs a CUDA GPU"]
    fn gpu_routing_matches_reference() {
        let gpu = gpu();
        let mut rng = Rng::new(91);
        let mut compared = 0;
        // NemotronH (128 experts, top-6, one group, the shared expert appended as two pieces),
        // grouped (8 groups keep 4), a bias that changes the selection, and identical router
        // rows (ties: lowest index; one appended piece).
        let cases = [
            (
                RouteShape {
                    experts: 128,
                    top_k: 6,
                    n_group: 1,
                    topk_group: 1,
                    renormalize: true,
                    scaling: 2.5,
                    shared: 2,
                },
                0.0,
                false,
            ),
            (
                RouteShape {
                    experts: 64,
                    top_k: 4,
                    n_group: 8,
                    topk_group: 4,
                    renormalize: true,
                    scaling: 1.0,
                    shared: 0,
                },
                0.0,
                false,
            ),
            (
                RouteShape {
                    experts: 128,
                    top_k: 6,
                    n_group: 1,
                    topk_group: 1,
                    renormalize: false,
                    scaling: 1.0,
                    shared: 0,
                },
                0.3,
                false,
            ),
            (
                RouteShape {
                    experts: 16,
                    top_k: 3,
                    n_group: 1,
                    topk_group: 1,
                    renormalize: true,
                    scaling: 1.0,
                    shared: 1,
                },
                0.0,
                true,
            ),
        ];
        // One token, a partial tile of tokens and whole tiles (the kernel selects per tile of
        // LOGITS_TOKENS); each call after the first also finds the arrival counters reset. From
        // ROUTE_TC_MIN_ROWS tokens on tensor cores (the experts a multiple of 32; the 16-expert
        // case keeps the one-launch kernel): there, and a partial tile of 32, and 4096 tokens.
        let many = [ROUTE_TC_MIN_ROWS, ROUTE_TC_MIN_ROWS + 13, 4096];
        for ((s, bias_scale, ties), rows) in
            cases.into_iter().flat_map(|c| [1, 13, 64].into_iter().chain(many).map(move |r| (c, r)))
        {
            let hidden = 2688;
            let x = rng.bf16s(rows * hidden, -1.0, 1.0);
            let mut gate = rng.bf16s(s.experts * hidden, -0.05, 0.05);
            if ties {
                let first = gate[..hidden].to_vec();
                gate.chunks_mut(hidden).for_each(|g| g.copy_from_slice(&first));
            }
            let bias: Vec<f32> = (0..s.experts).map(|_| (rng.uniform(-1.0, 1.0) * bias_scale) as f32).collect();
            let (dx, dg, db) = (gpu.upload(&x).unwrap(), gpu.upload(&gate).unwrap(), gpu.upload(&bias).unwrap());
            let (mut idx, mut w) = (
                gpu.upload(&vec![-1i32; rows * s.choices()]).unwrap(),
                gpu.upload(&vec![f32::NAN; rows * s.choices()]).unwrap(),
            );
            gpu_route(&gpu, s, (&dx, hidden), Router { gate: &dg, bias: &db }, (&mut idx, &mut w)).unwrap();
            let r = Routing {
                top_k: s.top_k,
                n_group: s.n_group,
                topk_group: s.topk_group,
                norm_topk_prob: s.renormalize,
                scaling: f64::from(s.scaling),
            };
            let bias64: Vec<f64> = bias.iter().map(|&b| f64::from(b)).collect();
            let got_idx: Vec<usize> = gpu.download(&idx).unwrap().iter().map(|&i| i as usize).collect();
            // Each row: the top-k, then the appended pieces with weight 1. Where the kernel's
            // f32 sums chose otherwise at a near tie (selection scores within NEAR_TIE), the
            // reference takes its choice, with the weights the reference gives those experts.
            let appended: Vec<(usize, f64)> = (s.experts..s.experts + s.shared).map(|e| (e, 1.0)).collect();
            let mut near_ties = 0;
            let want: Vec<(usize, f64)> = logits(&x, &gate, hidden)
                .iter()
                .zip(got_idx.chunks(s.choices()))
                .flat_map(|(l, got)| {
                    let mut chosen = route(l, &bias64, &r);
                    let got = &got[..s.top_k];
                    if chosen.iter().map(|c| c.0).ne(got.iter().copied()) {
                        let tie = near_tie(l, &bias64, &r, got)
                            .unwrap_or_else(|| panic!("route {s:?}: {got:?} against {chosen:?}, no near tie"));
                        near_ties += 1;
                        chosen = tie;
                    }
                    chosen.into_iter().chain(appended.iter().copied())
                })
                .collect();
            // A flip needs selection scores within 1e-5 of each other: rare (the reviewer's
            // estimate: a few in 10^4 tokens at f32 sums), never a pattern.
            assert!(near_ties <= rows / 200 + 1, "route {s:?}: {near_ties} near ties in {rows} tokens");
            if near_ties > 0 {
                println!("route {s:?} at {rows} tokens: {near_ties} near ties resolved the other way");
            }
            let label = format!("route {s:?}");
            compared +=
                assert_same(&format!("{label} experts"), &got_idx, &want.iter().map(|w| w.0).collect::<Vec<_>>());
            let got_w: Vec<f64> = gpu.download(&w).unwrap().iter().map(|&v| f64::from(v)).collect();
            compared += assert_close(
                &format!("{label} weights"),
                &got_w,
                &want.iter().map(|w| w.1).collect::<Vec<_>>(),
                1e-6,
                1e-5,
            );
            if ties {
                assert!(got_idx.chunks(s.choices()).all(|c| c == [0, 1, 2, 16]), "ties go to the lowest index");
            }
        }
        println!("routing: {compared} values compared");
    }

    /// Bad values never trap the routing kernel (a trap would end the CUDA context for every
    /// request): a NaN router row, a row of infinities, and infinite biases (+inf and -inf in
    /// every group: no group score to rank) give experts in range, the finite rows beside them
    /// route as the reference says (the NaN row with NaN weights), and the context keeps
    /// working.
    #[test]
    #[ignore = "needs a CUDA GPU"]
    fn gpu_routing_never_traps_on_bad_values() {
        let gpu = gpu();
        let mut rng = Rng::new(92);
        let hidden = 2688;
        let mut compared = 0;
        for s in [
            RouteShape { experts: 64, top_k: 4, n_group: 8, topk_group: 4, renormalize: true, scaling: 1.0, shared: 0 },
            RouteShape {
                experts: 128,
                top_k: 6,
                n_group: 1,
                topk_group: 1,
                renormalize: true,
                scaling: 2.5,
                shared: 1,
            },
        ] {
            let rows = 5;
            let mut x = rng.bf16s(rows * hidden, -1.0, 1.0);
            x[hidden..2 * hidden].fill(bf16::NAN);
            x[3 * hidden..4 * hidden].fill(bf16::INFINITY);
            let gate = rng.bf16s(s.experts * hidden, -0.05, 0.05);
            for infinite_bias in [false, true] {
                // Infinite biases: in every group one +inf and the rest -inf, so every group's
                // score (the sum of its two best) is NaN: nothing left to pick by score.
                let per = s.experts / s.n_group;
                let bias: Vec<f32> = (0..s.experts)
                    .map(|i| match (infinite_bias, i % per) {
                        (false, _) => 0.0,
                        (true, 0) => f32::INFINITY,
                        (true, _) => f32::NEG_INFINITY,
                    })
                    .collect();
                let (dx, dg, db) = (gpu.upload(&x).unwrap(), gpu.upload(&gate).unwrap(), gpu.upload(&bias).unwrap());
                let (mut idx, mut w) = (
                    gpu.upload(&vec![-1i32; rows * s.choices()]).unwrap(),
                    gpu.upload(&vec![0.0f32; rows * s.choices()]).unwrap(),
                );
                gpu_route(&gpu, s, (&dx, hidden), Router { gate: &dg, bias: &db }, (&mut idx, &mut w)).unwrap();
                let got_idx = gpu.download(&idx).expect("the routing kernel must not trap");
                assert!(
                    got_idx.iter().all(|&i| (0..(s.experts + s.shared) as i32).contains(&i)),
                    "{s:?} bias inf {infinite_bias}: experts out of range {got_idx:?}"
                );
                compared += got_idx.len();
                if !infinite_bias {
                    let r = Routing {
                        top_k: s.top_k,
                        n_group: s.n_group,
                        topk_group: s.topk_group,
                        norm_topk_prob: s.renormalize,
                        scaling: f64::from(s.scaling),
                    };
                    let l = logits(&x, &gate, hidden);
                    for row in [0, 2, 4] {
                        let want: Vec<usize> =
                            route(&l[row], &vec![0.0; s.experts], &r).into_iter().map(|c| c.0).collect();
                        let c = s.choices();
                        let got: Vec<usize> = got_idx[row * c..row * c + s.top_k].iter().map(|&i| i as usize).collect();
                        compared += assert_same(&format!("{s:?} finite row {row} beside bad rows"), &got, &want);
                    }
                    let got_w = gpu.download(&w).unwrap();
                    assert!(got_w[s.choices()..][..s.top_k].iter().all(|v| v.is_nan()), "the NaN row's weights");
                }
            }
        }
        // The context still works: a plain routing call after the bad ones.
        let s =
            RouteShape { experts: 16, top_k: 2, n_group: 1, topk_group: 1, renormalize: true, scaling: 1.0, shared: 0 };
        let (dx, dg, db) = (
            gpu.upload(&rng.bf16s(hidden, -1.0, 1.0)).unwrap(),
            gpu.upload(&rng.bf16s(16 * hidden, -0.05, 0.05)).unwrap(),
            gpu.upload(&[0.0f32; 16]).unwrap(),
        );
        let (mut idx, mut w) = (gpu.zeros::<i32>(2).unwrap(), gpu.zeros::<f32>(2).unwrap());
        gpu_route(&gpu, s, (&dx, hidden), Router { gate: &dg, bias: &db }, (&mut idx, &mut w)).unwrap();
        assert!(gpu.download(&idx).unwrap().iter().all(|&i| (0..16).contains(&i)));
        println!("routing on bad values: {compared} values checked, no trap");
    }

    #[test]
    #[ignore = "needs a CUDA GPU"]
    fn gpu_route_appended_up_equals_apart() {
        let gpu = gpu();
        let mut rng = Rng::new(94);
        let (mut compared, mut expected) = (0, 0);
        // (experts, top_k, pieces, inter, hidden): Nano's expert shape (16 of its 128 experts,
        // top-6, the shared expert as two pieces); rows not a multiple of the routing's 16 per
        // block, one piece.
        for (e, top_k, pieces, inter, hidden) in [(16, 6, 2, 1856, 2688), (8, 2, 1, 40, 64)] {
            let s = RouteShape {
                experts: e,
                top_k,
                n_group: 1,
                topk_group: 1,
                renormalize: true,
                scaling: 2.5,
                shared: pieces,
            };
            let all = e + pieces;
            let x = gpu.upload(&rng.bf16s(hidden, -1.0, 1.0)).unwrap();
            let gate = gpu.upload(&rng.bf16s(e * hidden, -0.05, 0.05)).unwrap();
            let bias = gpu.upload(&(0..e).map(|_| rng.uniform(-0.1, 0.1) as f32).collect::<Vec<_>>()).unwrap();
            let up = gpu.upload(&rng.bf16s(all * inter * hidden, -0.05, 0.05)).unwrap();
            let down = gpu.upload(&rng.bf16s(all * hidden * inter, -0.05, 0.05)).unwrap();
            let shared = gpu.upload(&rng.bf16s(hidden, -1.0, 1.0)).unwrap();
            let per = s.choices();
            expected += 2 * per + hidden;
            let choice_bufs = || (gpu.zeros::<i32>(per).unwrap(), gpu.zeros::<f32>(per).unwrap());
            // Apart: the routing, then every choice's MLP.
            let ((mut idx, mut wt), mut out) = (choice_bufs(), gpu.upload(&vec![POISON_BF16; hidden]).unwrap());
            let router = Router { gate: &gate, bias: &bias };
            gpu_route(&gpu, s, (&x, hidden), router, (&mut idx, &mut wt)).unwrap();
            let ch = Choices { idx: &idx, weight: &wt, per, experts: all };
            let mlp = ExpertMlp { up: &up, down: &down, inter, hidden };
            let w = ExpertMlp { up: ExpertWeights::Bf16(&up), down: ExpertWeights::Bf16(&down), inter, hidden };
            experts_mlp_choices(&gpu, ch, &x, w, (pieces, Some(&shared)), &mut out).unwrap();
            // The pieces' up projections in the routing's launch.
            let ((mut idx2, mut wt2), mut out2) = (choice_bufs(), gpu.upload(&vec![POISON_BF16; hidden]).unwrap());
            let mut h = gpu.upload(&vec![POISON_BF16; per * inter]).unwrap();
            route_appended_up(&gpu, s, (&x, hidden), router, (&mut idx2, &mut wt2), (&up, inter), &mut h).unwrap();
            let ch2 = Choices { idx: &idx2, weight: &wt2, per, experts: all };
            experts_mlp_choices_after(&gpu, ch2, &x, mlp, (pieces, Some(&shared)), (&mut h, pieces), &mut out2)
                .unwrap();
            let label = format!("experts {e} top-{top_k} pieces {pieces} {inter}x{hidden}");
            compared +=
                assert_same(&format!("{label} idx"), &gpu.download(&idx2).unwrap(), &gpu.download(&idx).unwrap());
            let bits = |v: Vec<f32>| v.iter().map(|w| w.to_bits()).collect::<Vec<_>>();
            compared += assert_same(
                &format!("{label} weights"),
                &bits(gpu.download(&wt2).unwrap()),
                &bits(gpu.download(&wt).unwrap()),
            );
            let bits16 = |v: Vec<bf16>| v.iter().map(|w| w.to_bits()).collect::<Vec<_>>();
            compared += assert_same(
                &format!("{label} out"),
                &bits16(gpu.download(&out2).unwrap()),
                &bits16(gpu.download(&out).unwrap()),
            );
            // Misuse: more than one token; h of another length; more appended rows than pieces.
            let (mut i2, mut w2) = (gpu.zeros::<i32>(2 * per).unwrap(), gpu.zeros::<f32>(2 * per).unwrap());
            let two = gpu.upload(&rng.bf16s(2 * hidden, -1.0, 1.0)).unwrap();
            let err = route_appended_up(&gpu, s, (&two, hidden), router, (&mut i2, &mut w2), (&up, inter), &mut h)
                .unwrap_err();
            assert!(err.to_string().contains("`rows`"), "{err}");
            let mut short = gpu.zeros::<bf16>(per * inter - 1).unwrap();
            let err = route_appended_up(&gpu, s, (&x, hidden), router, (&mut idx2, &mut wt2), (&up, inter), &mut short)
                .unwrap_err();
            assert!(err.to_string().contains("`h`"), "{err}");
            let err = experts_mlp_choices_after(&gpu, ch, &x, mlp, (pieces, None), (&mut h, pieces + 1), &mut out2)
                .unwrap_err();
            assert!(err.to_string().contains("`appended`"), "{err}");
        }
        println!("route with the pieces' up projections: {compared} values compared");
        assert_eq!(compared, expected);
    }

    #[test]
    #[ignore = "needs a CUDA GPU"]
    fn gpu_combine_matches_reference() {
        let gpu = gpu();
        let mut rng = Rng::new(92);
        let (rows, k, hidden, slots) = (7, 3, 2688, 21);
        let y = rng.bf16s(slots * hidden, -2.0, 2.0);
        let shared = rng.bf16s(rows * hidden, -1.0, 1.0);
        let slot: Vec<i32> = (0..rows * k).map(|j| ((j * 5 + 2) % slots) as i32).collect();
        let w: Vec<f32> = (0..rows * k).map(|_| rng.uniform(0.0, 1.0) as f32).collect();
        let (dy, dsh, dw) = (gpu.upload(&y).unwrap(), gpu.upload(&shared).unwrap(), gpu.upload(&w).unwrap());
        let mut out = gpu.upload(&vec![POISON_BF16; rows * hidden]).unwrap();
        combine(&gpu, (&dy, hidden), Some(&dsh), (&gpu.upload(&slot).unwrap(), &dw, k), &mut out).unwrap();
        let want: Vec<f64> = (0..rows * hidden)
            .map(|i| {
                let (t, c) = (i / hidden, i % hidden);
                shared[i].to_f64()
                    + (0..k)
                        .map(|kk| f64::from(w[t * k + kk]) * y[slot[t * k + kk] as usize * hidden + c].to_f64())
                        .sum::<f64>()
            })
            .collect();
        let n = assert_close("combine", &to_f64(&gpu.download(&out).unwrap()), &want, 1e-5, 1.0 / 256.0 + 1e-5);
        println!("combine: {n} values compared");
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

    /// One expert's MLP in f64, `down relu(bf16(up x))^2` with the hidden activation rounded to
    /// bf16 as the kernels store it (`up [inter, hidden]`, `down [hidden, inter]`).
    fn expert_reference(x: &[f64], up: &[f64], down: &[f64], inter: usize) -> Vec<f64> {
        let h: Vec<f64> = up
            .chunks(x.len())
            .map(|row| {
                let v = bf16::from_f64(row.iter().zip(x).map(|(a, b)| a * b).sum::<f64>()).to_f64().max(0.0);
                bf16::from_f64(v * v).to_f64()
            })
            .collect();
        down.chunks(inter).map(|row| row.iter().zip(&h).map(|(a, b)| a * b).sum()).collect()
    }

    /// The grouped GEMM's tiles this GPU runs (FP8: no wide ones): the `wgmma` ones where its
    /// PTX is sm_90a (compute capability 9.0, the H200), where they must be present.
    fn grouped_tiles(gpu: &host::Gpu, fp8: bool) -> Vec<Tiles> {
        let wgmma = gpu.arch() == host::Arch::Sm90a;
        assert_eq!(gpu.has(host::Kernel::MoeGroupedWgmma), wgmma, "wgmma kernels on {:?}", gpu.arch());
        let mut tiles = if fp8 { vec![Tiles::Narrow] } else { vec![Tiles::Narrow, Tiles::Wide] };
        tiles.extend(wgmma.then_some(Tiles::Wgmma));
        tiles
    }

    /// Routing choices that leave expert 0 without rows, give expert 1 one (token 0's) and
    /// expert 2 every token (many tiles); the other choices distinct, from experts 3 on.
    fn skewed_choices(rng: &mut Rng, rows: usize, k: usize, e: usize) -> Vec<i32> {
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
        idx
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
        let idx = skewed_choices(&mut rng, rows, k, e);
        let (dup, ddown, dx) = (gpu.upload(&up).unwrap(), gpu.upload(&down).unwrap(), gpu.upload(&x).unwrap());
        let mut d = Dispatch::new(&gpu, e, k, rows).unwrap();
        dispatch(&gpu, &gpu.upload(&idx).unwrap(), &mut d).unwrap();
        let (offsets, token) = (gpu.download(d.offsets()).unwrap(), gpu.download(d.token()).unwrap());
        assert_eq!((offsets[1] - offsets[0], offsets[2] - offsets[1], offsets[3] - offsets[2]), (0, 1, rows as u32));
        let tiles = grouped_tiles(&gpu, false);
        let w = ExpertMlp { up: ExpertWeights::Bf16(&dup), down: ExpertWeights::Bf16(&ddown), inter, hidden };
        let outs: Vec<Vec<f64>> = tiles
            .iter()
            .map(|&t| {
                let mut out = gpu.upload(&vec![POISON_BF16; rows * k * hidden]).unwrap();
                experts_mlp_grouped_as(&gpu, &d, &dx, w, t, &mut out).unwrap();
                to_f64(&gpu.download(&out).unwrap())
            })
            .collect();
        let (lo2, hi2) = (offsets[2] as usize, offsets[3] as usize);
        let (mut got, mut want, mut sampled) = (vec![Vec::new(); tiles.len()], Vec::new(), 0);
        for ex in 0..e {
            let (lo, hi) = (offsets[ex] as usize, offsets[ex + 1] as usize);
            let sample: Vec<usize> =
                (lo..hi).filter(|&j| j % 31 == 0 || ex == 1 || (ex == 2 && (j < lo2 + 64 || j + 64 >= hi2))).collect();
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
            combine(&gpu, (&grouped, hidden), dsh.as_ref(), (d.slot(), &dw, k), &mut unfused).unwrap();
            let mut fused = gpu.upload(&vec![POISON_BF16; rows * hidden]).unwrap();
            let ch = Choices { idx: &didx, weight: &dw, per: k, experts: e };
            let mlp = ExpertMlp { up: up_w, down: down_w, inter, hidden };
            experts_mlp_choices(&gpu, ch, &dx, mlp, (pieces, dsh.as_ref()), &mut fused).unwrap();
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
        experts_mlp_choices(gpu, ch, &gpu.upload(r.x).unwrap(), mlp, (0, Some(&dsh)), &mut fused).unwrap();
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
            combine(gpu, (r.out, hidden), Some(&dsh), (r.d.slot(), &dw, k), &mut unfused).unwrap();
            let unfused = to_f64(&gpu.download(&unfused).unwrap());
            let bits = |v: &[f64]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            compared += assert_same(&format!("{label}, per choice"), &bits(&fused), &bits(&unfused));
        }
        compared
    }

    /// FP8 experts for the tests: `e` experts' up `[inter, hidden]` and down `[hidden, inter]`
    /// projections (codes, scales and code values), with static input scales for the up
    /// projections (`up_static`) or for the down ones (the other per row), on the host and on
    /// the device.
    struct Fp8Experts {
        sizes: (usize, usize),
        /// Per projection: code values, weight scales, static input scales (or none).
        host: [Fp8Proj<Vec<f64>, Vec<f32>>; 2],
        /// Per projection: codes, weight scales, static input scales (or none).
        dev: [Fp8Proj<host::CudaSlice<u8>, host::CudaSlice<f32>>; 2],
    }

    /// One projection's weights, their scales and static input scales.
    type Fp8Proj<W, S> = (W, S, Option<S>);

    impl Fp8Experts {
        fn new(gpu: &host::Gpu, rng: &mut Rng, (e, inter, hidden): (usize, usize, usize), up_static: bool) -> Self {
            let mut one = |(n, k): (usize, usize), range: (f64, f64), fixed: bool| {
                let (codes, scales, values) = fp8_weights(rng, e, n, k);
                let input: Vec<f32> = (0..e).map(|_| rng.uniform(range.0, range.1) as f32).collect();
                let input = fixed.then_some(input);
                let dev = (
                    gpu.upload(&codes).unwrap(),
                    gpu.upload(&scales).unwrap(),
                    input.as_ref().map(|s| gpu.upload(s).unwrap()),
                );
                ((values, scales, input), dev)
            };
            let (up, up_dev) = one((inter, hidden), (0.002, 0.004), up_static);
            let (down, down_dev) = one((hidden, inter), (0.004, 0.008), !up_static);
            Fp8Experts { sizes: (inter, hidden), host: [up, down], dev: [up_dev, down_dev] }
        }

        fn weights(&self) -> (ExpertWeights<'_>, ExpertWeights<'_>) {
            let [(uc, us, ui), (dc, ds, di)] = &self.dev;
            (
                ExpertWeights::Fp8 { codes: uc, w_scale: us, in_scale: ui.as_ref() },
                ExpertWeights::Fp8 { codes: dc, w_scale: ds, in_scale: di.as_ref() },
            )
        }

        /// Expert `ex`'s MLP of one row in f64: [`Self::up`], then [`Self::down`].
        fn reference(&self, ex: usize, x: &[f64]) -> Vec<f64> {
            self.down(ex, &self.up(ex, x))
        }

        /// Expert `ex`'s hidden row in f64: `w8a8` up, relu^2 of the bf16-rounded value rounded
        /// to bf16 (as the kernels store the hidden rows).
        fn up(&self, ex: usize, x: &[f64]) -> Vec<f64> {
            let (inter, hidden) = self.sizes;
            let (uv, us, ui) = &self.host[0];
            w8a8(x, &uv[ex * inter * hidden..][..inter * hidden], us[ex], ui.as_ref().map(|s| s[ex]))
                .iter()
                .map(|&v| {
                    let v = bf16::from_f64(v).to_f64().max(0.0);
                    bf16::from_f64(v * v).to_f64()
                })
                .collect()
        }

        /// Expert `ex`'s down projection of a hidden row in f64 (`w8a8`).
        fn down(&self, ex: usize, h: &[f64]) -> Vec<f64> {
            let (inter, hidden) = self.sizes;
            let (dv, ds, di) = &self.host[1];
            w8a8(h, &dv[ex * hidden * inter..][..hidden * inter], ds[ex], di.as_ref().map(|s| s[ex]))
        }
    }

    /// The FP8 grouped GEMM path (each projection's rows quantized, then multiplied on tensor
    /// cores) at Nemotron-3 Nano's expert sizes with 16 experts and the skewed routing (an
    /// expert without rows, one with one, one with every token), static input scales for up
    /// and per-row for down and the other way round, and an odd shape (k not a multiple of
    /// the 64-byte stage, n not of the 128-column tile), on a sample of the grouped rows
    /// (expert 1's, the first and last 16 of expert 2's, every 7th), in two checks:
    /// - the hidden rows (the up projection alone, `quant_rows` + `grouped_fp8`, as the MLP
    ///   runs it) against the f64 up projection: within three bf16 steps (f32 sums against f64
    ///   move the pre-activation by one step at most, the square doubles it, the square's
    ///   rounding adds one);
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
            [(2688, 1856, 16, 6, 300, true), (2688, 1856, 16, 6, 300, false), (144, 48, 5, 2, 70, true)]
        {
            let ex8 = Fp8Experts::new(&gpu, &mut rng, (e, inter, hidden), up_static);
            let x = rng.bf16_rows(rows, hidden);
            let idx = skewed_choices(&mut rng, rows, k, e);
            let mut d = Dispatch::new(&gpu, e, k, rows).unwrap();
            dispatch(&gpu, &gpu.upload(&idx).unwrap(), &mut d).unwrap();
            let (offsets, token) = (gpu.download(d.offsets()).unwrap(), gpu.download(d.token()).unwrap());
            assert_eq!((offsets[1], offsets[2] - offsets[1], offsets[3] - offsets[2]), (0, 1, rows as u32));
            let (up, down) = ex8.weights();
            let (dx, entries) = (gpu.upload(&x).unwrap(), rows * k);
            let up_in = ex8.dev[0].2.as_ref();
            for t in grouped_tiles(&gpu, true) {
                let mut out = gpu.upload(&vec![POISON_BF16; entries * hidden]).unwrap();
                experts_mlp_grouped_as(&gpu, &d, &dx, ExpertMlp { up, down, inter, hidden }, t, &mut out).unwrap();
                let out = to_f64(&gpu.download(&out).unwrap());
                let (mut q, mut s) = (gpu.zeros::<u8>(entries * hidden).unwrap(), gpu.zeros::<f32>(entries).unwrap());
                quant_rows(&gpu, hidden, &dx, Source::Grouped { d: &d, by_token: true }, up_in, &mut q, &mut s)
                    .unwrap();
                let mut h = gpu.upload(&vec![POISON_BF16; entries * inter]).unwrap();
                let up_proj = Proj { w: up, n: inter, k: hidden, relu2: true };
                grouped_fp8(&gpu, &d, Fp8Rows { codes: &q, scales: &s }, up_proj, t, &mut h).unwrap();
                let h = to_f64(&gpu.download(&h).unwrap());
                let (lo2, hi2) = (offsets[2] as usize, offsets[3] as usize);
                let (mut got, mut want, mut got_h, mut want_h, mut sampled) = (vec![], vec![], vec![], vec![], 0);
                for ex in 0..e {
                    let (lo, hi) = (offsets[ex] as usize, offsets[ex + 1] as usize);
                    for j in (lo..hi).filter(|&j| j % 7 == 0 || ex == 1 || (ex == 2 && (j < lo2 + 16 || j + 16 >= hi2)))
                    {
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
        let err = experts(&gpu, &d, (&x, true), up, 0, &mut out).unwrap_err();
        assert!(err.to_string().contains("never dispatched"), "{err}");
        dispatch(&gpu, &gpu.upload(&Rng::new(97).choices(rows, k, e)).unwrap(), &mut d).unwrap();
        let short = gpu.zeros::<bf16>((rows - 1) * hidden).unwrap();
        let err = experts(&gpu, &d, (&short, true), up, 0, &mut out).unwrap_err();
        assert!(err.to_string().contains("`x`"), "{err}");
        let err = experts(&gpu, &d, (&x, true), up, e + 1, &mut out).unwrap_err();
        assert!(err.to_string().contains("`pieces`"), "{err}");
        experts(&gpu, &d, (&x, true), up, 0, &mut out).unwrap();
        assert!(Dispatch::new(&gpu, 128, 16, 1 << 20).is_err(), "2^24 choices");
        // Per choice: weights not one per choice, a short down projection, no choices per
        // token, an intermediate size not a multiple of 8, more choices than block rows.
        let (cidx, cw) = (gpu.zeros::<i32>(rows * k).unwrap(), gpu.zeros::<f32>(rows * k).unwrap());
        let mut y = gpu.zeros::<bf16>(rows * hidden).unwrap();
        let ch = Choices { idx: &cidx, weight: &cw, per: k, experts: e };
        let short = gpu.zeros::<f32>(rows * k - 1).unwrap();
        let bw = ExpertWeights::Bf16(&w);
        let mlp = ExpertMlp { up: bw, down: bw, inter, hidden };
        let err = experts_mlp_choices(&gpu, Choices { weight: &short, ..ch }, &x, mlp, (0, None), &mut y).unwrap_err();
        assert!(err.to_string().contains("`weight`"), "{err}");
        let down = gpu.zeros::<bf16>(e * hidden * inter - 1).unwrap();
        let err =
            experts_mlp_choices(&gpu, ch, &x, ExpertMlp { down: ExpertWeights::Bf16(&down), ..mlp }, (0, None), &mut y)
                .unwrap_err();
        assert!(err.to_string().contains("moe_expert_combine_bf16: argument `w`"), "{err}");
        let err = experts_mlp_choices(&gpu, Choices { per: 0, ..ch }, &x, mlp, (0, None), &mut y).unwrap_err();
        assert!(err.to_string().contains("`top_k`"), "{err}");
        let odd = gpu.zeros::<bf16>(e * (inter - 1) * hidden).unwrap();
        let odd =
            ExpertMlp { up: ExpertWeights::Bf16(&odd), down: ExpertWeights::Bf16(&odd), inter: inter - 1, hidden };
        let err = experts_mlp_choices(&gpu, ch, &x, odd, (0, None), &mut y).unwrap_err();
        assert!(err.to_string().contains("`inter`"), "{err}");
        let many = gpu.zeros::<i32>(65536).unwrap();
        let (wmany, mut ymany) = (gpu.zeros::<f32>(65536).unwrap(), gpu.zeros::<bf16>(65536 / k * hidden).unwrap());
        let big = Choices { idx: &many, weight: &wmany, per: k, experts: e };
        let err = experts_mlp_choices(&gpu, big, &x, mlp, (0, None), &mut ymany).unwrap_err();
        assert!(err.to_string().contains("`idx`"), "{err}");
        experts_mlp_choices(&gpu, ch, &x, mlp, (0, None), &mut y).unwrap();
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
            (&mut idx, &mut wt),
        )
        .unwrap();
        let idx = gpu.download(&idx).unwrap();
        for r in idx.chunks(k) {
            assert!(r.iter().all(|&i| (0..e as i32).contains(&i)) && r[0] != r[1], "{idx:?}");
        }
        println!("misuse: {} routing choices checked", idx.len());
    }
}
