//! The tensors a NemotronH checkpoint must hold for its config (docs/MATH.md, "Checkpoint formats"),
//! found, shape- and type-checked, and kept as borrowed views of the mapped files: nothing is
//! copied until a backend converts or uploads a tensor. Every problem is reported, not just
//! the first, each with the tensor's name, its shape and dtype, and what was expected.

use half::bf16;

use crate::config::{Config, LayerKind};
use crate::error::{Error, Result};
use crate::nvfp4::NVFP4_BLOCK;
use crate::quantization::{Declared, Quantization};
use crate::weights::{Checkpoint, Dtype, Tensor};

/// A linear layer's weight `[out, in]`: floating point, or FP8 e4m3 with its per-tensor
/// `weight_scale` and, for W8A8, the activation's static `input_scale`, or NVFP4 (`[out, in /
/// 2]` bytes of two e2m1 codes) with its block and per-tensor scales.
#[derive(Clone, Copy, Debug)]
pub struct Linear<'a> {
    pub weight: Tensor<'a>,
    pub bias: Option<Tensor<'a>>,
    pub fp8: Option<Fp8Scales>,
    pub nvfp4: Option<Nvfp4Scales<'a>>,
}

impl<'a> Linear<'a> {
    /// The layer's `[out, in]` (an NVFP4 weight's bytes are `[out, in / 2]`).
    pub fn shape(&self) -> [usize; 2] {
        let s = self.weight.shape;
        [s[0], if self.nvfp4.is_some() { 2 * s[1] } else { s[1] }]
    }

    /// The weight as bf16 values: floats as [`Tensor::to_bf16`] gives them, NVFP4 dequantized
    /// ([`crate::nvfp4::dequantize`]) and rounded once to nearest even
    /// (`host::cpu::nvfp4::bf16_nearest`); FP8 is an error (its codes
    /// run as they are).
    pub fn to_bf16(&self) -> Result<Vec<bf16>> {
        match self.nvfp4 {
            Some(_) => Ok(crate::nvfp4::dequantize(self)?.into_iter().map(host::cpu::nvfp4::bf16_nearest).collect()),
            None => self.weight.to_bf16(),
        }
    }

    /// A bf16 weight `[n, k]` held in memory as little-endian bytes, without bias (tests and
    /// benches build layers this way).
    pub fn bf16(name: &'a str, shape: &'a [usize; 2], bytes: &'a [u8]) -> Linear<'a> {
        let weight = Tensor { name, path: std::path::Path::new("memory"), dtype: Dtype::Bf16, shape, bytes };
        Linear { weight, bias: None, fp8: None, nvfp4: None }
    }
}

/// Scales of an FP8 linear layer: `W ~= codes * weight_scale`; activations are quantized
/// with `input_scale` when the checkpoint gives one (else dynamically).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Fp8Scales {
    pub weight_scale: f32,
    pub input_scale: Option<f32>,
}

/// Scales of an NVFP4 linear layer (`crate::nvfp4`): `W ~= e2m1 * block * global`, `block`
/// `[out, in / 16]` e4m3 (`weight_scale`), `global` the per-tensor `weight_scale_2`; the
/// checkpoint's `input_scale`, where it has one, is its activations' scale for W4A4.
#[derive(Clone, Copy, Debug)]
pub struct Nvfp4Scales<'a> {
    pub block: Tensor<'a>,
    pub global: f32,
    pub input_scale: Option<f32>,
}

/// A Mamba2 mixer.
#[derive(Clone, Copy, Debug)]
pub struct Mamba<'a> {
    pub in_proj: Linear<'a>,
    /// `[conv_dim, 1, k]`.
    pub conv_w: Tensor<'a>,
    pub conv_b: Option<Tensor<'a>>,
    /// `[heads]`; A = -exp(A_log) is computed when a backend loads it.
    pub a_log: Tensor<'a>,
    pub d: Tensor<'a>,
    pub dt_bias: Tensor<'a>,
    /// The gated norm's weight `[heads * head_dim]`.
    pub norm: Tensor<'a>,
    pub out_proj: Linear<'a>,
}

/// A non-gated relu^2 MLP: `down(relu(up x)^2)`.
#[derive(Clone, Copy, Debug)]
pub struct Mlp<'a> {
    pub up: Linear<'a>,
    pub down: Linear<'a>,
}

/// A MoE layer: router, routed experts, optional shared expert.
#[derive(Clone, Debug)]
pub struct Moe<'a> {
    /// Router `[experts, hidden]`.
    pub gate: Tensor<'a>,
    /// `[experts]`, added to the scores for selection only.
    pub score_bias: Option<Tensor<'a>>,
    pub experts: Vec<Mlp<'a>>,
    pub shared: Option<Mlp<'a>>,
}

/// An attention layer.
#[derive(Clone, Copy, Debug)]
pub struct Attention<'a> {
    pub q: Linear<'a>,
    pub k: Linear<'a>,
    pub v: Linear<'a>,
    pub o: Linear<'a>,
}

/// One layer's mixer.
#[derive(Clone, Debug)]
pub enum Mixer<'a> {
    Mamba(Mamba<'a>),
    Moe(Moe<'a>),
    Attention(Attention<'a>),
    Mlp(Mlp<'a>),
}

/// One residual block: `h = h + mixer(rmsnorm(h) * norm)`.
#[derive(Clone, Debug)]
pub struct Layer<'a> {
    pub norm: Tensor<'a>,
    pub mixer: Mixer<'a>,
}

/// Every tensor of the model.
#[derive(Clone, Debug)]
pub struct Layout<'a> {
    pub embeddings: Tensor<'a>,
    pub layers: Vec<Layer<'a>>,
    pub norm_f: Tensor<'a>,
    /// `[vocab, hidden]`; the embeddings when they are tied.
    pub lm_head: Linear<'a>,
}

/// Looks tensors up and collects every problem.
struct Finder<'a> {
    ck: &'a Checkpoint,
    problems: Vec<String>,
    /// Whether every tensor's values are read for NaN and infinities.
    scan: bool,
    /// The checkpoint's declared quantization, which the weights' formats must agree with.
    quant: Option<Quantization>,
}

fn is_float(d: Dtype) -> bool {
    matches!(d, Dtype::Bf16 | Dtype::F16 | Dtype::F32)
}

impl<'a> Finder<'a> {
    /// A floating-point tensor of `shape` (`None` after recording the problem).
    fn float(&mut self, name: &str, shape: &[usize]) -> Option<Tensor<'a>> {
        let t = self.shaped(name, shape)?;
        if !is_float(t.dtype) {
            self.problems.push(format!("`{name}` is {:?}, expected BF16, F16 or F32", t.dtype));
            return None;
        }
        Some(t)
    }

    fn shaped(&mut self, name: &str, shape: &[usize]) -> Option<Tensor<'a>> {
        match self.ck.tensor(name) {
            Err(_) => {
                self.problems.push(format!("`{name}` {shape:?} is missing"));
                None
            }
            Ok(t) if t.shape != shape => {
                self.problems.push(format!("`{name}` has shape {:?}, expected {shape:?}", t.shape));
                None
            }
            Ok(t) => match self.scan.then(|| t.first_non_finite()).flatten() {
                Some((i, bits)) => {
                    self.problems.push(format!("`{name}` holds a NaN or infinite value (element {i}, bits {bits:#x})"));
                    None
                }
                None => Some(t),
            },
        }
    }

    /// A single-value scale, if present.
    fn scale(&mut self, name: &str) -> Option<f32> {
        let t = self.ck.tensor(name).ok()?;
        match t.scalar() {
            Ok(v) if v.is_finite() && v > 0.0 => Some(v),
            Ok(v) => {
                self.problems.push(format!("`{name}` is {v}, expected a finite scale > 0"));
                None
            }
            Err(e) => {
                self.problems.push(e.to_string());
                None
            }
        }
    }

    /// `{prefix}.weight` of `[out, inp]` (and `{prefix}.bias` when `bias`), float, FP8 or
    /// NVFP4.
    fn linear(&mut self, prefix: &str, out: usize, inp: usize, bias: bool) -> Option<Linear<'a>> {
        let name = format!("{prefix}.weight");
        let dtype = self.ck.tensor(&name).ok().map(|t| t.dtype);
        if let Some(d) = dtype {
            self.agrees(prefix, d);
        }
        if dtype == Some(Dtype::U8) {
            return self.nvfp4_linear(prefix, out, inp, bias);
        }
        let weight = self.shaped(&name, &[out, inp]);
        let bias = if bias { Some(self.float(&format!("{prefix}.bias"), &[out])) } else { None };
        let weight = weight?;
        let fp8 = match weight.dtype {
            Dtype::F8E4M3 => match self.scale(&format!("{prefix}.weight_scale")) {
                Some(weight_scale) => {
                    Some(Fp8Scales { weight_scale, input_scale: self.scale(&format!("{prefix}.input_scale")) })
                }
                None => {
                    if !self.ck.contains(&format!("{prefix}.weight_scale")) {
                        self.problems.push(format!("`{name}` is F8_E4M3 but `{prefix}.weight_scale` is missing"));
                    }
                    return None;
                }
            },
            _ => None,
        };
        Some(Linear { weight, bias: bias.flatten(), fp8, nvfp4: None })
    }

    /// Records a problem where the format of module `prefix`'s weight (`dtype`: U8 is NVFP4,
    /// F8_E4M3 FP8, floats unquantized) contradicts the declared quantization
    /// ([`Quantization::declared`]). An unquantized weight of a module a single-algorithm
    /// declaration does not exclude is accepted (it runs as it is).
    fn agrees(&mut self, prefix: &str, dtype: Dtype) {
        let Some(q) = &self.quant else { return };
        let name = format!("{prefix}.weight");
        let format = match dtype {
            Dtype::U8 => Some("NVFP4"),
            Dtype::F8E4M3 => Some("FP8"),
            _ => None,
        };
        let from = q.source;
        let problem = match (q.declared(prefix), format) {
            (Declared::Excluded(p), Some(f)) => {
                Some(format!("`{name}` is {f}, but `{p}` in {from}'s exclude_modules leaves `{prefix}` unquantized"))
            }
            (Declared::As(d), Some(f)) if d != f => Some(format!("`{name}` is {f}, but {from} declares it {d}")),
            (Declared::Unlisted, Some(f)) => {
                Some(format!("`{name}` is {f}, but {from}'s quantized_layers has no entry for `{prefix}`"))
            }
            (Declared::As(d), None) if q.quant_algo == "MIXED_PRECISION" => {
                Some(format!("`{name}` is {dtype:?}, but {from}'s quantized_layers declares `{prefix}` {d}"))
            }
            _ => None,
        };
        self.problems.extend(problem);
    }

    /// [`Self::linear`] of an NVFP4 weight (`{prefix}.weight` U8): `[out, inp / 2]` with
    /// `{prefix}.weight_scale` F8_E4M3 `[out, inp / 16]` and `{prefix}.weight_scale_2`.
    fn nvfp4_linear(&mut self, prefix: &str, out: usize, inp: usize, bias: bool) -> Option<Linear<'a>> {
        let name = format!("{prefix}.weight");
        if !inp.is_multiple_of(NVFP4_BLOCK) {
            let why = format!("is NVFP4 (U8) for an input of {inp}, not a multiple of its blocks of {NVFP4_BLOCK}");
            self.problems.push(format!("`{name}` {why}"));
            return None;
        }
        let weight = self.shaped(&name, &[out, inp / 2]);
        let bias = if bias { Some(self.float(&format!("{prefix}.bias"), &[out])) } else { None };
        let (sname, gname) = (format!("{prefix}.weight_scale"), format!("{prefix}.weight_scale_2"));
        let block = match self.ck.tensor(&sname) {
            Ok(t) if t.dtype != Dtype::F8E4M3 => {
                self.problems.push(format!("`{sname}` is {:?}, expected F8_E4M3 (`{name}` is NVFP4)", t.dtype));
                None
            }
            Ok(_) => self.shaped(&sname, &[out, inp / NVFP4_BLOCK]).filter(|t| {
                // A block scale is a block's amax over 6, never negative (the W4A4 product
                // reads it unsigned, as ue4m3).
                let negative = self.scan.then(|| t.bytes.iter().position(|&b| b & 0x80 != 0)).flatten();
                if let Some(i) = negative {
                    let b = t.bytes[i];
                    self.problems.push(format!("`{sname}` holds a negative block scale (element {i}, bits {b:#x})"));
                }
                negative.is_none()
            }),
            Err(_) => {
                self.problems.push(format!("`{name}` is NVFP4 (U8) but `{sname}` is missing"));
                None
            }
        };
        let global = self.scale(&gname);
        if global.is_none() && !self.ck.contains(&gname) {
            self.problems.push(format!("`{name}` is NVFP4 (U8) but `{gname}` is missing"));
        }
        let input_scale = self.scale(&format!("{prefix}.input_scale"));
        let nvfp4 = Some(Nvfp4Scales { block: block?, global: global?, input_scale });
        Some(Linear { weight: weight?, bias: bias.flatten(), fp8: None, nvfp4 })
    }

    fn mlp(&mut self, prefix: &str, hidden: usize, inter: usize, bias: bool) -> Option<Mlp<'a>> {
        let up = self.linear(&format!("{prefix}.up_proj"), inter, hidden, bias);
        let down = self.linear(&format!("{prefix}.down_proj"), hidden, inter, bias);
        Some(Mlp { up: up?, down: down? })
    }
}

impl<'a> Layout<'a> {
    /// Finds and checks every tensor `config` needs in `ck`: present, of its shape and dtype,
    /// and without NaN or infinite values (every value read once; see
    /// [`Layout::trusting_values`]). Every problem found is in the error, by tensor name.
    pub fn new(config: &Config, ck: &'a Checkpoint) -> Result<Layout<'a>> {
        Layout::find(config, ck, true)
    }

    /// [`Layout::new`] without reading the values for NaN and infinities (a trusted
    /// checkpoint; the scan reads every byte once).
    pub fn trusting_values(config: &Config, ck: &'a Checkpoint) -> Result<Layout<'a>> {
        Layout::find(config, ck, false)
    }

    fn find(config: &Config, ck: &'a Checkpoint, scan: bool) -> Result<Layout<'a>> {
        let mut f = Finder { ck, problems: Vec::new(), scan, quant: config.quantization.clone() };
        let (hidden, vocab) = (config.hidden_size, config.vocab_size);
        let embeddings = f.float("backbone.embeddings.weight", &[vocab, hidden]);
        let mut layers = Vec::new();
        for (i, kind) in config.layers.iter().enumerate() {
            let p = format!("backbone.layers.{i}");
            let norm = f.float(&format!("{p}.norm.weight"), &[hidden]);
            let m = format!("{p}.mixer");
            let mixer = match kind {
                LayerKind::Mamba => {
                    let c = config.mamba.as_ref().ok_or_else(|| missing_section("mamba"))?;
                    let h = c.heads;
                    let in_proj = f.linear(&format!("{m}.in_proj"), c.in_proj_width(), hidden, c.proj_bias);
                    let conv_w = f.float(&format!("{m}.conv1d.weight"), &[c.conv_dim(), 1, c.conv_kernel]);
                    let conv_b =
                        if c.conv_bias { Some(f.float(&format!("{m}.conv1d.bias"), &[c.conv_dim()])) } else { None };
                    let a_log = f.float(&format!("{m}.A_log"), &[h]);
                    let d = f.float(&format!("{m}.D"), &[h]);
                    let dt_bias = f.float(&format!("{m}.dt_bias"), &[h]);
                    let gnorm = f.float(&format!("{m}.norm.weight"), &[c.inner()]);
                    let out_proj = f.linear(&format!("{m}.out_proj"), hidden, c.inner(), c.proj_bias);
                    (|| {
                        Some(Mixer::Mamba(Mamba {
                            in_proj: in_proj?,
                            conv_w: conv_w?,
                            conv_b: match conv_b {
                                Some(b) => Some(b?),
                                None => None,
                            },
                            a_log: a_log?,
                            d: d?,
                            dt_bias: dt_bias?,
                            norm: gnorm?,
                            out_proj: out_proj?,
                        }))
                    })()
                }
                LayerKind::Moe => {
                    let c = config.moe.as_ref().ok_or_else(|| missing_section("moe"))?;
                    let gate = f.float(&format!("{m}.gate.weight"), &[c.experts, hidden]);
                    let bias_name = format!("{m}.gate.e_score_correction_bias");
                    let score_bias =
                        if ck.contains(&bias_name) { Some(f.float(&bias_name, &[c.experts])) } else { None };
                    let experts: Vec<Option<Mlp>> = (0..c.experts)
                        .map(|e| f.mlp(&format!("{m}.experts.{e}"), hidden, c.intermediate, config.mlp_bias))
                        .collect();
                    let shared = c
                        .shared_intermediate
                        .map(|s| f.mlp(&format!("{m}.shared_experts"), hidden, s, config.mlp_bias));
                    (|| {
                        Some(Mixer::Moe(Moe {
                            gate: gate?,
                            score_bias: match score_bias {
                                Some(b) => Some(b?),
                                None => None,
                            },
                            experts: experts.into_iter().collect::<Option<Vec<_>>>()?,
                            shared: match shared {
                                Some(s) => Some(s?),
                                None => None,
                            },
                        }))
                    })()
                }
                LayerKind::Attention => {
                    let c = config.attention.as_ref().ok_or_else(|| missing_section("attention"))?;
                    let (q, kv) = (c.heads * c.head_dim, c.kv_heads * c.head_dim);
                    let q_proj = f.linear(&format!("{m}.q_proj"), q, hidden, c.bias);
                    let k_proj = f.linear(&format!("{m}.k_proj"), kv, hidden, c.bias);
                    let v_proj = f.linear(&format!("{m}.v_proj"), kv, hidden, c.bias);
                    let o_proj = f.linear(&format!("{m}.o_proj"), hidden, q, c.bias);
                    (|| Some(Mixer::Attention(Attention { q: q_proj?, k: k_proj?, v: v_proj?, o: o_proj? })))()
                }
                LayerKind::Mlp => {
                    let inter = config.mlp_intermediate.ok_or_else(|| missing_section("intermediate_size"))?;
                    f.mlp(&m, hidden, inter, config.mlp_bias).map(Mixer::Mlp)
                }
            };
            if let (Some(norm), Some(mixer)) = (norm, mixer) {
                layers.push(Layer { norm, mixer });
            }
        }
        let norm_f = f.float("backbone.norm_f.weight", &[hidden]);
        let lm_head = if config.tie_word_embeddings && !ck.contains("lm_head.weight") {
            embeddings.map(|weight| Linear { weight, bias: None, fp8: None, nvfp4: None })
        } else {
            f.linear("lm_head", vocab, hidden, false)
        };
        match (embeddings, norm_f, lm_head) {
            (Some(embeddings), Some(norm_f), Some(lm_head)) if f.problems.is_empty() => {
                Ok(Layout { embeddings, layers, norm_f, lm_head })
            }
            _ => Err(Error::Tensors(f.problems)),
        }
    }
}

fn missing_section(what: &str) -> Error {
    Error::Config { field: what.to_string(), reason: "settings are missing for a layer that needs them".into() }
}
