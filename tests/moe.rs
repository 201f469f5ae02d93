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
    use host::cpu::moe::{Routing, route};
    use host::moe::{RouteShape, combine, route as gpu_route};
    use nemotron_rs::{POISON_BF16, Rng, assert_close, assert_same, gpu, to_f64};

    /// Router logits in f64 from the bf16 activations and weights, as the kernel forms them.
    fn logits(x: &[bf16], gate: &[bf16], hidden: usize) -> Vec<Vec<f64>> {
        x.chunks(hidden)
            .map(|r| gate.chunks(hidden).map(|g| r.iter().zip(g).map(|(a, b)| a.to_f64() * b.to_f64()).sum()).collect())
            .collect()
    }

    #[test]
    #[ignore = "needs a CUDA GPU"]
    fn gpu_routing_matches_reference() {
        let gpu = gpu();
        let mut rng = Rng::new(91);
        let mut compared = 0;
        // NemotronH (128 experts, top-6, one group), grouped (8 groups keep 4), a bias that
        // changes the selection, and identical router rows (ties: lowest index).
        let cases = [
            (
                RouteShape { experts: 128, top_k: 6, n_group: 1, topk_group: 1, renormalize: true, scaling: 2.5 },
                0.0,
                false,
            ),
            (
                RouteShape { experts: 64, top_k: 4, n_group: 8, topk_group: 4, renormalize: true, scaling: 1.0 },
                0.0,
                false,
            ),
            (
                RouteShape { experts: 128, top_k: 6, n_group: 1, topk_group: 1, renormalize: false, scaling: 1.0 },
                0.3,
                false,
            ),
            (
                RouteShape { experts: 16, top_k: 3, n_group: 1, topk_group: 1, renormalize: true, scaling: 1.0 },
                0.0,
                true,
            ),
        ];
        for (s, bias_scale, ties) in cases {
            let (rows, hidden) = (64, 2688);
            let x = rng.bf16s(rows * hidden, -1.0, 1.0);
            let mut gate = rng.bf16s(s.experts * hidden, -0.05, 0.05);
            if ties {
                let first = gate[..hidden].to_vec();
                gate.chunks_mut(hidden).for_each(|g| g.copy_from_slice(&first));
            }
            let bias: Vec<f32> = (0..s.experts).map(|_| (rng.uniform(-1.0, 1.0) * bias_scale) as f32).collect();
            let (dx, dg, db) = (gpu.upload(&x).unwrap(), gpu.upload(&gate).unwrap(), gpu.upload(&bias).unwrap());
            let (mut idx, mut w) = (
                gpu.upload(&vec![-1i32; rows * s.top_k]).unwrap(),
                gpu.upload(&vec![f32::NAN; rows * s.top_k]).unwrap(),
            );
            gpu_route(&gpu, s, &dx, hidden, &dg, &db, &mut idx, &mut w).unwrap();
            let r = Routing {
                top_k: s.top_k,
                n_group: s.n_group,
                topk_group: s.topk_group,
                norm_topk_prob: s.renormalize,
                scaling: f64::from(s.scaling),
            };
            let bias64: Vec<f64> = bias.iter().map(|&b| f64::from(b)).collect();
            let want: Vec<(usize, f64)> =
                logits(&x, &gate, hidden).iter().flat_map(|l| route(l, &bias64, &r)).collect();
            let label = format!("route {s:?}");
            let got_idx: Vec<usize> = gpu.download(&idx).unwrap().iter().map(|&i| i as usize).collect();
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
                assert!(got_idx.chunks(s.top_k).all(|c| c == [0, 1, 2]), "ties go to the lowest index");
            }
        }
        println!("routing: {compared} values compared");
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
        combine(&gpu, &dy, Some(&dsh), &slot, &dw, k, hidden, &mut out).unwrap();
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
}
