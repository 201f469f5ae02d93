//! The CPU backend's MoE layer: routing from the host crate's reference, each routed expert
//! and the shared expert as a dense MLP a row.

use half::bf16;
use host::cpu::gemm;
use host::cpu::router::{Routing, route};

use super::linear::{CpuWeight, mlp_row};
use super::{Cpu, put};
use crate::backend::{ExpertsOps, In, Out};
use crate::config::MoeConfig;
use crate::error::Result;

/// A MoE layer's experts on the CPU backend: each routed expert's and the shared expert's
/// (up, down).
pub struct CpuExperts {
    pub(super) routed: Vec<(CpuWeight, CpuWeight)>,
    pub(super) shared: Option<(CpuWeight, CpuWeight)>,
}

/// A router: its gate `[experts, hidden]` and selection bias.
type Router<'a> = (&'a Vec<bf16>, &'a Vec<f32>);

/// Each of `rows` rows of `x`: its routed experts and their weights, as `(gate, bias)` routes.
fn routed(c: &MoeConfig, (gate, bias): Router, x: In<Vec<bf16>>, rows: usize) -> Vec<Vec<(usize, f64)>> {
    let hidden = gate.len() / c.experts;
    let routing = Routing {
        top_k: c.top_k,
        n_group: c.n_group,
        topk_group: c.topk_group,
        norm_topk_prob: c.norm_topk_prob,
        scaling: f64::from(c.routed_scaling_factor),
    };
    let bias: Vec<f64> = bias.iter().map(|&v| f64::from(v)).collect();
    (0..rows)
        .map(|r| {
            let xr = &x.buf[x.offset + r * x.stride..][..hidden];
            route(&gemm::linear(xr, gate, 1, c.experts, hidden), &bias, &routing)
        })
        .collect()
}

impl ExpertsOps<Cpu> for CpuExperts {
    fn forward(
        &self,
        _b: &Cpu,
        c: &MoeConfig,
        router: Router,
        (x, rows): (In<Vec<bf16>>, usize),
        y: Out<Vec<bf16>>,
    ) -> Result<()> {
        let hidden = router.0.len() / c.experts;
        for (r, choices) in routed(c, router, x, rows).into_iter().enumerate() {
            let xr = &x.buf[x.offset + r * x.stride..][..hidden];
            let mut out = self.shared.as_ref().map_or_else(|| vec![0.0; hidden], |(u, d)| mlp_row((u, d), xr));
            for (e, wt) in choices {
                let (u, d) = &self.routed[e];
                let o = mlp_row((u, d), xr);
                out.iter_mut().zip(o).for_each(|(a, b)| *a += wt * b);
            }
            put(Out { buf: &mut *y.buf, offset: y.offset + r * hidden }, out);
        }
        Ok(())
    }

    fn choices(&self, _b: &Cpu, c: &MoeConfig, router: Router, (x, rows): (In<Vec<bf16>>, usize)) -> Result<Vec<u32>> {
        Ok(routed(c, router, x, rows).into_iter().flatten().map(|(e, _)| e as u32).collect())
    }
}
