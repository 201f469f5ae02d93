//! The whole model on the CPU in f64, one token at a time: the oracle the backends are checked
//! against (docs/MATH.md: a plain sequential recurrence), built from the host crate's CPU
//! references. Activations are never rounded; weights are used as stored (bf16 exact; FP8
//! layers as W8A8, see [`crate::fp8`]), conv and norm weights and the per-head parameters as
//! the kernels take them (bf16, f32). Meant for small models: every weight is widened to f64.

use std::cell::Cell;

use half::bf16;
use host::cpu::conv1d::ConvRef;
use host::cpu::nvfp4::NVFP4_BLOCK;
use host::cpu::quant::E4M3_MAX;
use host::cpu::router::{Routing, margin, route, route_otherwise};
use host::cpu::ssm::{SsmRef, Token};
use host::cpu::{attn, norm};

use crate::config::{Config, MambaConfig};
use crate::error::{Error, Result};
use crate::fp8::Fp8Linear;
use crate::layout::{Layout, Linear, Mixer, Mlp};
use crate::weights::Tensor;

/// A linear layer widened to f64: `y = W x + b`, `W [out, in]`; or an FP8 (W8A8) layer; or an
/// NVFP4 layer as W4A4 ([`Reference::w4a4`]).
enum Lin {
    Dense { w: Vec<f64>, b: Option<Vec<f64>>, inp: usize },
    Fp8(Fp8Linear),
    W4a4(W4a4),
}

/// An NVFP4 layer whose inputs are quantized too (docs/MATH.md, "W4A4"): the layer as the
/// weight-only reference holds it (exact weights, its bias), its input scale, and how many
/// blocks of inputs saturated their e4m3 scale.
struct W4a4 {
    dense: Box<Lin>,
    input_scale: f32,
    saturated: Cell<u64>,
}

/// How the reference takes NVFP4 layers: weight-only (the backends' way), or W4A4.
#[derive(Clone, Copy)]
struct Widen {
    w4a4: bool,
}

impl Widen {
    fn lin(self, l: &Linear) -> Result<Lin> {
        if let Some(f) = Fp8Linear::new(l)? {
            return Ok(Lin::Fp8(f));
        }
        let w = if l.nvfp4.is_some() { crate::nvfp4::dequantize(l)? } else { f64s(&l.weight)? };
        let dense = Lin::Dense { w, b: l.bias.as_ref().map(f64s).transpose()?, inp: l.shape()[1] };
        match (self.w4a4, l.nvfp4) {
            (true, Some(s)) => {
                let input_scale = s.input_scale.ok_or_else(|| {
                    Error::Unsupported(format!("`{}` has no input_scale: W4A4 needs one", l.weight.name))
                })?;
                Ok(Lin::W4a4(W4a4 { dense: Box::new(dense), input_scale, saturated: Cell::new(0) }))
            }
            _ => Ok(dense),
        }
    }

    fn mlp(self, m: &Mlp) -> Result<(Lin, Lin)> {
        Ok((self.lin(&m.up)?, self.lin(&m.down)?))
    }
}

impl Lin {
    fn apply(&self, x: &[f64]) -> Vec<f64> {
        match self {
            Lin::Dense { w, b, inp } => w
                .chunks_exact(*inp)
                .enumerate()
                .map(|(o, row)| row.iter().zip(x).map(|(a, b)| a * b).sum::<f64>() + b.as_ref().map_or(0.0, |b| b[o]))
                .collect(),
            Lin::Fp8(f) => f.apply(&x.iter().map(|&v| v as f32).collect::<Vec<_>>()),
            Lin::W4a4(l) => {
                // The activations as a backend holds them (bf16), quantized with the layer's
                // input scale, their exact values (codes times block scales times the input
                // scale) into the layer.
                let x: Vec<bf16> = x.iter().map(|&v| bf16::from_f64(v)).collect();
                let a = host::cpu::w4a4::quantize_rows(&x, (1, x.len(), x.len()), l.input_scale);
                let g = 1.0 / l.input_scale;
                let clipped = x.chunks_exact(NVFP4_BLOCK).filter(|b| {
                    let amax = b.iter().map(|v| v.to_f32().abs()).fold(0.0f32, f32::max);
                    amax * g / 6.0 > E4M3_MAX
                });
                l.saturated.set(l.saturated.get() + clipped.count() as u64);
                let scale = f64::from(l.input_scale);
                let a: Vec<f64> = host::cpu::w4a4::row_values(&a, x.len()).into_iter().map(|v| v * scale).collect();
                l.dense.apply(&a)
            }
        }
    }

    /// Blocks of inputs whose scale saturated so far (W4A4 layers; 0 for the others).
    fn saturated(&self) -> u64 {
        if let Lin::W4a4(l) = self { l.saturated.get() } else { 0 }
    }
}

/// A non-gated relu^2 MLP (and MoE expert): `down(relu(up x)^2)`.
fn mlp_apply((up, down): &(Lin, Lin), x: &[f64]) -> Vec<f64> {
    down.apply(&up.apply(x).into_iter().map(|v| v.max(0.0).powi(2)).collect::<Vec<_>>())
}

fn f64s(t: &Tensor) -> Result<Vec<f64>> {
    Ok(t.to_f32()?.into_iter().map(f64::from).collect())
}

struct MambaRef {
    cfg: MambaConfig,
    in_proj: Lin,
    conv_w: Vec<bf16>,
    conv_b: Option<Vec<bf16>>,
    dt_bias: Vec<f32>,
    a: Vec<f32>,
    d: Vec<f32>,
    norm: Vec<bf16>,
    out_proj: Lin,
}

struct MoeRef {
    gate: Lin,
    bias: Vec<f64>,
    experts: Vec<(Lin, Lin)>,
    shared: Option<(Lin, Lin)>,
    routing: Routing,
}

enum Mix {
    Mamba(Box<MambaRef>),
    Moe(MoeRef),
    Attention { q: Lin, k: Lin, v: Lin, o: Lin },
    Mlp((Lin, Lin)),
}

/// The model, widened to f64.
pub struct Reference {
    config: Config,
    embeddings: Vec<f64>,
    layers: Vec<(Vec<bf16>, Mix)>,
    norm_f: Vec<bf16>,
    lm_head: Lin,
}

/// One sequence's recurrent state: per layer, the conv and SSM states (Mamba) or the keys and
/// values so far (attention); and how near the last step's routing was to another.
#[derive(Clone)]
pub struct RefState {
    layers: Vec<LayerState>,
    /// The smallest router margin of the last step and its layer.
    nearest: (f64, Option<usize>),
}

impl RefState {
    /// The smallest router margin ([`host::cpu::router::margin`]) of the last step's MoE
    /// layers (infinity without any): near the noise of a backend's bf16 activations, that
    /// backend may route the step's token otherwise ([`Reference::step_routed_otherwise`]),
    /// and its logits then differ by more than noise.
    pub fn router_margin(&self) -> f64 {
        self.nearest.0
    }
}

#[derive(Clone)]
enum LayerState {
    Mamba { conv: Vec<f64>, ssm: Vec<f64> },
    Attention { keys: Vec<Vec<f64>>, values: Vec<Vec<f64>> },
    Stateless,
}

impl Mix {
    /// The layer's linear layers.
    fn lins(&self) -> Vec<&Lin> {
        fn pair((a, b): &(Lin, Lin)) -> [&Lin; 2] {
            [a, b]
        }
        match self {
            Mix::Mamba(m) => vec![&m.in_proj, &m.out_proj],
            Mix::Moe(m) => {
                let experts = m.experts.iter().chain(&m.shared).flat_map(pair);
                std::iter::once(&m.gate).chain(experts).collect()
            }
            Mix::Attention { q, k, v, o } => vec![q, k, v, o],
            Mix::Mlp(m) => pair(m).to_vec(),
        }
    }
}

impl Reference {
    /// Widens every tensor of `layout`; NVFP4 layers weight-only, the activations as they are
    /// (as the backends run them).
    pub fn new(config: &Config, layout: &Layout) -> Result<Reference> {
        Reference::build(config, layout, Widen { w4a4: false })
    }

    /// As [`Reference::new`], every NVFP4 layer as W4A4 (docs/MATH.md): its input rounded to
    /// bf16 and quantized to NVFP4 with the layer's `input_scale` (an error where it has none),
    /// the products exact: what a checkpoint made for W4A4 computes on Blackwell.
    pub fn w4a4(config: &Config, layout: &Layout) -> Result<Reference> {
        Reference::build(config, layout, Widen { w4a4: true })
    }

    /// Blocks of W4A4 inputs whose e4m3 scale saturated in the steps so far (`amax * g / 6`
    /// past 448: their largest inputs clipped, an input scale too small for the activations).
    pub fn saturated_blocks(&self) -> u64 {
        let lins = self.layers.iter().flat_map(|(_, mix)| mix.lins()).chain([&self.lm_head]);
        lins.map(Lin::saturated).sum()
    }

    fn build(config: &Config, layout: &Layout, w: Widen) -> Result<Reference> {
        let mut layers = Vec::new();
        for layer in &layout.layers {
            let mix = match &layer.mixer {
                Mixer::Mamba(m) => {
                    let cfg = config
                        .mamba
                        .clone()
                        .ok_or_else(|| Error::Unsupported("a Mamba layer without mamba settings".into()))?;
                    Mix::Mamba(Box::new(MambaRef {
                        cfg,
                        in_proj: w.lin(&m.in_proj)?,
                        conv_w: m.conv_w.to_bf16()?,
                        conv_b: m.conv_b.as_ref().map(|b| b.to_bf16()).transpose()?,
                        dt_bias: m.dt_bias.to_f32()?,
                        a: m.a_log.to_f32()?.into_iter().map(|v| -v.exp()).collect(),
                        d: m.d.to_f32()?,
                        norm: m.norm.to_bf16()?,
                        out_proj: w.lin(&m.out_proj)?,
                    }))
                }
                Mixer::Moe(m) => {
                    let c = config
                        .moe
                        .as_ref()
                        .ok_or_else(|| Error::Unsupported("an MoE layer without moe settings".into()))?;
                    Mix::Moe(MoeRef {
                        gate: Lin::Dense { w: f64s(&m.gate)?, b: None, inp: config.hidden_size },
                        bias: m.score_bias.as_ref().map(f64s).transpose()?.unwrap_or_else(|| vec![0.0; c.experts]),
                        experts: m.experts.iter().map(|e| w.mlp(e)).collect::<Result<_>>()?,
                        shared: m.shared.as_ref().map(|e| w.mlp(e)).transpose()?,
                        routing: Routing {
                            top_k: c.top_k,
                            n_group: c.n_group,
                            topk_group: c.topk_group,
                            norm_topk_prob: c.norm_topk_prob,
                            scaling: f64::from(c.routed_scaling_factor),
                        },
                    })
                }
                Mixer::Attention(a) => {
                    Mix::Attention { q: w.lin(&a.q)?, k: w.lin(&a.k)?, v: w.lin(&a.v)?, o: w.lin(&a.o)? }
                }
                Mixer::Mlp(m) => Mix::Mlp(w.mlp(m)?),
            };
            layers.push((layer.norm.to_bf16()?, mix));
        }
        Ok(Reference {
            config: config.clone(),
            embeddings: f64s(&layout.embeddings)?,
            layers,
            norm_f: layout.norm_f.to_bf16()?,
            lm_head: w.lin(&layout.lm_head)?,
        })
    }

    /// A fresh sequence's state (zeros, no keys).
    pub fn new_state(&self) -> RefState {
        let layers = self
            .layers
            .iter()
            .map(|(_, mix)| match mix {
                Mix::Mamba(m) => LayerState::Mamba {
                    conv: vec![0.0; m.cfg.conv_dim() * (m.cfg.conv_kernel - 1)],
                    ssm: vec![0.0; m.cfg.inner() * m.cfg.state_size],
                },
                Mix::Attention { .. } => LayerState::Attention { keys: Vec::new(), values: Vec::new() },
                _ => LayerState::Stateless,
            })
            .collect();
        RefState { layers, nearest: (f64::INFINITY, None) }
    }

    /// Feeds one token and returns the logits for the next.
    pub fn step(&self, state: &mut RefState, token: u32) -> Result<Vec<f64>> {
        self.step_with(state, token, None)
    }

    /// As [`Reference::step`], but the MoE layer nearest to routing the token otherwise (the
    /// smallest margin) routes it so ([`host::cpu::router::route_otherwise`]): what a backend
    /// computes whose rounding tipped that near-tie. As `step` without MoE layers.
    pub fn step_routed_otherwise(&self, state: &mut RefState, token: u32) -> Result<Vec<f64>> {
        let mut probe = state.clone();
        self.step(&mut probe, token)?;
        // The layers before the nearest one see the same inputs either way, so its margin,
        // found by the plain step, is the one the flipped step tips.
        self.step_with(state, token, probe.nearest.1)
    }

    /// A step whose MoE layer `otherwise` (an index of the model's layers) routes the token
    /// otherwise.
    fn step_with(&self, state: &mut RefState, token: u32, otherwise: Option<usize>) -> Result<Vec<f64>> {
        let (hidden, eps) = (self.config.hidden_size, f64::from(self.config.norm_eps));
        let t = token as usize;
        if t >= self.config.vocab_size {
            return Err(Error::Unsupported(format!(
                "token id {token} is outside the vocabulary of {}",
                self.config.vocab_size
            )));
        }
        let mut h = self.embeddings[t * hidden..(t + 1) * hidden].to_vec();
        state.nearest = (f64::INFINITY, None);
        for (l, ((norm_w, mix), ls)) in self.layers.iter().zip(&mut state.layers).enumerate() {
            let x = norm::rms_norm(&h, norm_w, hidden, eps);
            let out = match (mix, ls) {
                (Mix::Mamba(m), LayerState::Mamba { conv, ssm }) => m.step(&x, conv, ssm, eps),
                (Mix::Moe(m), _) => {
                    let (out, margin) = m.step(&x, otherwise == Some(l));
                    if margin < state.nearest.0 {
                        state.nearest = (margin, Some(l));
                    }
                    out
                }
                (Mix::Attention { q, k, v, o }, LayerState::Attention { keys, values }) => {
                    let a = self.config.attention.as_ref().expect("attention layers come with attention settings");
                    keys.push(k.apply(&x));
                    values.push(v.apply(&x));
                    o.apply(&attn::attend(&q.apply(&x), keys, values, a.heads, a.kv_heads, a.head_dim))
                }
                (Mix::Mlp(m), _) => mlp_apply(m, &x),
                _ => unreachable!("states are built from the same layers"),
            };
            h.iter_mut().zip(out).for_each(|(a, b)| *a += b);
        }
        Ok(self.lm_head.apply(&norm::rms_norm(&h, &self.norm_f, hidden, eps)))
    }
}

impl MambaRef {
    /// in_proj -> (z, xBC, dt); conv update + silu on xBC; SSM step on (x, B, C, dt); gated
    /// group norm of y with z; out_proj.
    fn step(&self, x: &[f64], conv: &mut [f64], ssm: &mut [f64], eps: f64) -> Vec<f64> {
        let c = &self.cfg;
        let (inner, cd, gn) = (c.inner(), c.conv_dim(), c.groups * c.state_size);
        let zxbcdt = self.in_proj.apply(x);
        let (z, rest) = zxbcdt.split_at(inner);
        let (xbc, dt) = rest.split_at(cd);
        let conv_ref = ConvRef { dim: cd, k: c.conv_kernel, w: &self.conv_w, bias: self.conv_b.as_deref() };
        let xbc = conv_ref.update(xbc, cd, conv, &[0]).remove(0).expect("slot 0 is not padding");
        let ssm_ref = SsmRef {
            heads: c.heads,
            head_dim: c.head_dim,
            groups: c.groups,
            state_size: c.state_size,
            dt_bias: &self.dt_bias,
            a: &self.a,
            d: Some(&self.d),
            dt_min: f64::from(c.dt_limit.0),
            dt_max: f64::from(c.dt_limit.1),
        };
        let y = ssm_ref.step(ssm, Token::of_xbc(&xbc, dt, (inner, gn)));
        self.out_proj.apply(&norm::gated_norm(&y, Some(z), &self.norm, inner, c.groups, eps))
    }
}

impl MoeRef {
    /// Routed experts weighted by the router (`otherwise`: [`route_otherwise`]), plus the
    /// shared expert; and the router's margin.
    fn step(&self, x: &[f64], otherwise: bool) -> (Vec<f64>, f64) {
        let mut out = match &self.shared {
            Some(s) => mlp_apply(s, x),
            None => vec![0.0; x.len()],
        };
        let logits = self.gate.apply(x);
        let routed = if otherwise { route_otherwise } else { route };
        for (e, w) in routed(&logits, &self.bias, &self.routing) {
            let y = mlp_apply(&self.experts[e], x);
            out.iter_mut().zip(y).for_each(|(a, b)| *a += w * b);
        }
        (out, margin(&logits, &self.bias, &self.routing))
    }
}
