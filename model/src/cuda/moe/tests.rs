//! On a GPU: a MoE layer's one-row step with the shared expert run as pieces among the routed
//! experts ([`Shared::MlpAndPieces`]) against the same layer running the shared expert's own MLP
//! ([`Shared::Mlp`]), FP8 (static input scales) and NVFP4, at Nano's widths.

use std::path::Path;

use nemotron_rs::{Rng, assert_close, fp8_weights};

use super::*;
use crate::backend::{In, Out};
use crate::layout::{Fp8Scales, Nvfp4Scales};
use crate::weights::{Dtype, Tensor};

/// One projection `[n, k]` quantized from uniform values in `+-sqrt(3 / k)`: FP8
/// ([`fp8_weights`]: codes, a per-tensor weight scale; and a static input scale) or NVFP4
/// (ModelOpt's rounding: codes, block scales, a per-tensor scale).
struct Quantized {
    shape: [usize; 2],
    fp8: bool,
    codes: Vec<u8>,
    /// NVFP4: `[n, k / 16]` e4m3 block scales.
    blocks: Vec<u8>,
    block_shape: [usize; 2],
    scale: f32,
    input_scale: f32,
}

impl Quantized {
    fn new(rng: &mut Rng, fp8: bool, [n, k]: [usize; 2], input_scale: f32) -> Quantized {
        if fp8 {
            let (codes, scales, _) = fp8_weights(rng, 1, n, k);
            let (blocks, block_shape, scale) = (vec![], [0, 0], scales[0]);
            return Quantized { shape: [n, k], fp8, codes, blocks, block_shape, scale, input_scale };
        }
        let a = (3.0 / k as f64).sqrt();
        let w: Vec<f32> = (0..n * k).map(|_| rng.uniform(-a, a) as f32).collect();
        let q = host::cpu::nvfp4::quantize(&w, n, k);
        let (shape, block_shape) = ([n, k / 2], [n, k / 16]);
        Quantized { shape, fp8, codes: q.packed, blocks: q.block, block_shape, scale: q.global, input_scale }
    }

    fn linear(&self) -> Linear<'_> {
        let tensor = |dtype, shape, bytes| Tensor { name: "w", path: Path::new(""), dtype, shape, bytes };
        if self.fp8 {
            return Linear {
                weight: tensor(Dtype::F8E4M3, &self.shape, &self.codes),
                bias: None,
                fp8: Some(Fp8Scales { weight_scale: self.scale, input_scale: Some(self.input_scale) }),
                nvfp4: None,
            };
        }
        let block = tensor(Dtype::F8E4M3, &self.block_shape, &self.blocks);
        Linear {
            weight: tensor(Dtype::U8, &self.shape, &self.codes),
            bias: None,
            fp8: None,
            nvfp4: Some(Nvfp4Scales { block, global: self.scale, input_scale: None }),
        }
    }
}

/// A MoE layer of 8 experts of Nano's shape (hidden 2688, 1856 wide, top-6) and Nano's shared
/// expert (3712 wide: two pieces), FP8 and NVFP4, one row: with the shared expert as pieces
/// among the routed experts (`CudaExperts::upload`'s form for these formats) against the same
/// weights with the shared expert's MLP alone. The two differ only in roundings to bf16 (the
/// down projection's two halves rounded apart before the combine adds them, where the MLP
/// rounds their sum): within 1/64 of each output and 1/128 of the largest (a few bf16 steps),
/// and far from the layer without a shared expert (so a piece misplaced, or left out, fails).
#[test]
#[ignore = "needs a CUDA GPU"]
fn one_row_pieces_match_the_shared_mlp() {
    let gpu = Gpu::new(0).expect("this test needs a CUDA GPU");
    let (hidden, inter, si, experts, top_k) = (2688, 1856, 3712, 8, 6);
    let c = MoeConfig {
        experts,
        top_k,
        intermediate: inter,
        shared_intermediate: Some(si),
        n_group: 1,
        topk_group: 1,
        norm_topk_prob: true,
        routed_scaling_factor: 2.5,
    };
    let mut rng = Rng::new(61);
    let mut compared = 0;
    for fp8 in [true, false] {
        let label = if fp8 { "FP8" } else { "NVFP4" };
        let mut mlp_weights = |width| {
            [
                Quantized::new(&mut rng, fp8, [width, hidden], 0.003),
                Quantized::new(&mut rng, fp8, [hidden, width], 0.02),
            ]
        };
        let routed: Vec<[Quantized; 2]> = (0..experts).map(|_| mlp_weights(inter)).collect();
        let shared = mlp_weights(si);
        let list: Vec<Mlp> = routed.iter().map(|[u, d]| Mlp { up: u.linear(), down: d.linear() }).collect();
        let s = Mlp { up: shared[0].linear(), down: shared[1].linear() };
        let pieces = CudaExperts::upload(&gpu, &list, Some(&s)).unwrap();
        assert!(matches!(pieces.shared, Shared::MlpAndPieces(_, 2)), "{label}: the shared expert as two pieces");
        // The same routed experts with the shared expert's MLP alone, and with none.
        let (ups, downs): (Vec<&Linear>, Vec<&Linear>) = list.iter().map(|m| (&m.up, &m.down)).unzip();
        let apart = |shared| CudaExperts {
            up: Weights::upload(&gpu, &ups, [inter, hidden], 0).unwrap(),
            down: Weights::upload(&gpu, &downs, [hidden, inter], 0).unwrap(),
            inter,
            shared,
        };
        let own = Box::new((CudaWeight::upload(&gpu, &s.up).unwrap(), CudaWeight::upload(&gpu, &s.down).unwrap()));
        let (alone, without) = (apart(Shared::Mlp(own)), apart(Shared::None));
        let x = Buffer::from(gpu.upload(&rng.bf16s(hidden, -1.0, 1.0)).unwrap());
        let gate = Buffer::from(gpu.upload(&rng.bf16s(experts * hidden, -0.05, 0.05)).unwrap());
        let bias = gpu.upload(&(0..experts).map(|_| rng.uniform(-0.02, 0.02) as f32).collect::<Vec<_>>()).unwrap();
        let run = |e: &CudaExperts| -> Vec<f64> {
            let mut y = Buffer::from(gpu.zeros::<bf16>(hidden).unwrap());
            let router = Router { gate: &gate, bias: &bias };
            e.execute(&gpu, &c, (In::rows(&x, hidden), 1), router, Out { buf: &mut y, offset: 0 }).unwrap();
            gpu.download(&y).unwrap().iter().map(|v| v.to_f64()).collect()
        };
        let (got, want, none) = (run(&pieces), run(&alone), run(&without));
        let gap = |a: &[f64], b: &[f64]| a.iter().zip(b).map(|(a, b)| (a - b).abs()).fold(0.0, f64::max);
        let largest = want.iter().fold(0.0f64, |m, v| m.max(v.abs()));
        println!(
            "{label}: one row through the pieces against the shared MLP: largest gap {:.3e} (outputs up to {largest:.3}), \
             against no shared expert {:.3e}",
            gap(&got, &want),
            gap(&none, &want)
        );
        // The halves' roundings are of the shared expert's output, not of the sum: a bound
        // of the largest output's scale besides each output's own.
        let atol = largest / 128.0;
        assert!(gap(&none, &want) > 10.0 * atol, "{label}: the shared expert hardly matters");
        compared += assert_close(label, &got, &want, atol, 1.0 / 64.0);
    }
    assert_eq!(compared, 2 * hidden);
}
