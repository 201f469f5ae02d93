//! The CPU backend's MoE layer: routing from the host crate's reference, each routed expert
//! and the shared expert as a dense MLP a row.

use half::bf16;
use host::cpu::gemm;
use host::cpu::router::{Routing, route};

use super::linear::{CpuWeight, mlp_row};
use super::{Cpu, put};
use crate::backend::{In, MoeWeights, Out};
use crate::config::MoeConfig;

/// A MoE layer's experts on the CPU backend: each routed expert's and the shared expert's
/// (up, down).
pub struct CpuExperts {
    pub(super) routed: Vec<(CpuWeight, CpuWeight)>,
    pub(super) shared: Option<(CpuWeight, CpuWeight)>,
}

/// Each of `rows` rows of `x`: its routed experts and their weights, as MoE layer `w` routes.
fn routed(c: &MoeConfig, x: In<Vec<bf16>>, rows: usize, w: &MoeWeights<Cpu>) -> Vec<Vec<(usize, f64)>> {
    let hidden = w.gate.len() / c.experts;
    let routing = Routing {
        top_k: c.top_k,
        n_group: c.n_group,
        topk_group: c.topk_group,
        norm_topk_prob: c.norm_topk_prob,
        scaling: f64::from(c.routed_scaling_factor),
    };
    let bias: Vec<f64> = w.score_bias.iter().map(|&v| f64::from(v)).collect();
    (0..rows)
        .map(|r| {
            let xr = &x.buf[x.offset + r * x.stride..][..hidden];
            route(&gemm::linear(xr, &w.gate, 1, c.experts, hidden), &bias, &routing)
        })
        .collect()
}

/// The whole MoE layer for `rows` rows of `x`: routing, routed experts, shared expert.
pub(super) fn moe(c: &MoeConfig, x: In<Vec<bf16>>, rows: usize, w: &MoeWeights<Cpu>, y: Out<Vec<bf16>>) {
    let hidden = w.gate.len() / c.experts;
    for (r, choices) in routed(c, x, rows, w).into_iter().enumerate() {
        let xr = &x.buf[x.offset + r * x.stride..][..hidden];
        let ex = &w.experts;
        let mut out = ex.shared.as_ref().map_or_else(|| vec![0.0; hidden], |(u, d)| mlp_row((u, d), xr));
        for (e, wt) in choices {
            let (u, d) = &ex.routed[e];
            let o = mlp_row((u, d), xr);
            out.iter_mut().zip(o).for_each(|(a, b)| *a += wt * b);
        }
        put(Out { buf: &mut *y.buf, offset: y.offset + r * hidden }, out);
    }
}

/// The routed experts of each of `rows` rows of `x` (`top_k` ids a row, row by row).
pub(super) fn choices(c: &MoeConfig, x: In<Vec<bf16>>, rows: usize, w: &MoeWeights<Cpu>) -> Vec<u32> {
    routed(c, x, rows, w).into_iter().flatten().map(|(e, _)| e as u32).collect()
}
