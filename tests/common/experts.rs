//! What the MoE suites share (tests/moe.rs, tests/grouped.rs): Nano's routing, the f64
//! expert, the grouped GEMM's tiles this GPU runs, FP8 experts.

use half::bf16;
use host::cpu::router::Routing;
use host::grouped::Tiles;
use host::moe::ExpertWeights;
use nemotron_rs::{Rng, fp8_weights, w8a8};

/// Nemotron-3 Nano's routing: top 6, one group, the weights renormalized and scaled by 2.5.
pub const NANO: Routing = Routing { top_k: 6, n_group: 1, topk_group: 1, norm_topk_prob: true, scaling: 2.5 };

/// One expert's MLP in f64, `down relu(bf16(up x))^2` with the hidden activation rounded to
/// bf16 as the kernels store it (`up [inter, hidden]`, `down [hidden, inter]`).
pub fn expert_reference(x: &[f64], up: &[f64], down: &[f64], inter: usize) -> Vec<f64> {
    let h: Vec<f64> = up
        .chunks(x.len())
        .map(|row| {
            let v = bf16::from_f64(row.iter().zip(x).map(|(a, b)| a * b).sum::<f64>()).to_f64().max(0.0);
            bf16::from_f64(v * v).to_f64()
        })
        .collect();
    down.chunks(inter).map(|row| row.iter().zip(&h).map(|(a, b)| a * b).sum()).collect()
}

/// The grouped GEMM's tiles this GPU runs (FP8: no wide ones; those only where a block may
/// have their shared memory, `Gpu::fits`): the `wgmma` ones where its PTX is sm_90a (compute
/// capability 9.0, the H200), where they must be present.
pub fn grouped_tiles(gpu: &host::Gpu, fp8: bool) -> Vec<Tiles> {
    let wgmma = gpu.arch() == host::Arch::Sm90a;
    assert_eq!(gpu.has(host::Kernel::MoeGroupedWgmma), wgmma, "wgmma kernels on {:?}", gpu.arch());
    let wide = !fp8 && gpu.fits(host::Kernel::MoeGroupedWide);
    let mut tiles: Vec<Tiles> = [Tiles::Narrow].into_iter().chain(wide.then_some(Tiles::Wide)).collect();
    tiles.extend(wgmma.then_some(Tiles::Wgmma));
    tiles
}

/// FP8 experts for the tests: `e` experts' up `[inter, hidden]` and down `[hidden, inter]`
/// projections (codes, scales and code values), with static input scales for the up
/// projections (`up_static`) or for the down ones (the other per row), on the host and on
/// the device.
pub struct Fp8Experts {
    pub sizes: (usize, usize),
    /// Per projection: code values, weight scales, static input scales (or none).
    pub host: [Fp8Proj<Vec<f64>, Vec<f32>>; 2],
    /// Per projection: codes, weight scales, static input scales (or none).
    pub dev: [Fp8Proj<host::CudaSlice<u8>, host::CudaSlice<f32>>; 2],
}

/// One projection's weights, their scales and static input scales.
pub type Fp8Proj<W, S> = (W, S, Option<S>);

impl Fp8Experts {
    pub fn new(gpu: &host::Gpu, rng: &mut Rng, (e, inter, hidden): (usize, usize, usize), up_static: bool) -> Self {
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

    pub fn weights(&self) -> (ExpertWeights<'_>, ExpertWeights<'_>) {
        let [(uc, us, ui), (dc, ds, di)] = &self.dev;
        (
            ExpertWeights::Fp8 { codes: uc, w_scale: us, in_scale: ui.as_ref() },
            ExpertWeights::Fp8 { codes: dc, w_scale: ds, in_scale: di.as_ref() },
        )
    }

    /// Expert `ex`'s MLP of one row in f64: [`Self::up`], then [`Self::down`].
    pub fn reference(&self, ex: usize, x: &[f64]) -> Vec<f64> {
        self.down(ex, &self.up(ex, x))
    }

    /// Expert `ex`'s hidden row in f64: `w8a8` up, relu^2 of the bf16-rounded value rounded
    /// to bf16 (as the kernels store the hidden rows).
    pub fn up(&self, ex: usize, x: &[f64]) -> Vec<f64> {
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
    pub fn down(&self, ex: usize, h: &[f64]) -> Vec<f64> {
        let (inter, hidden) = self.sizes;
        let (dv, ds, di) = &self.host[1];
        w8a8(h, &dv[ex * hidden * inter..][..hidden * inter], ds[ex], di.as_ref().map(|s| s[ex]))
    }
}
