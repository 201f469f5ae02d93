//! Random NemotronH checkpoints of any config: every tensor a [`crate::layout::Layout`] needs,
//! bf16, seeded, drawn as a [`Scaling`] says. For tests, the small built-in model, the check
//! against transformers at Nano widths (model/tests/nano_check.rs), the benches and
//! `serve --synthetic` (with a tokenizer whose vocabulary [`fill_vocabulary`] stretches to the
//! model's); the values mean nothing.

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::path::Path;

use half::bf16;
use tokenizers::{AddedToken, Tokenizer};

use host::cpu::quant::{E4M3_MAX, e4m3_encode};

use crate::backend::Backend;
use crate::cache::Part;
use crate::config::{Config, LayerKind};
use crate::error::{Error, Result};
use crate::model::Model;
use crate::profile::ExpertLoad;
use crate::weights::{Checkpoint, Dtype};

/// Every tensor name and shape a checkpoint of `config` holds (bf16 weights, untied lm_head
/// unless `tie_word_embeddings`).
pub fn tensor_shapes(config: &Config) -> Vec<(String, Vec<usize>)> {
    let (h, v) = (config.hidden_size, config.vocab_size);
    let mut out = vec![("backbone.embeddings.weight".to_string(), vec![v, h])];
    let mlp = |out: &mut Vec<(String, Vec<usize>)>, p: &str, inter: usize| {
        out.push((format!("{p}.up_proj.weight"), vec![inter, h]));
        out.push((format!("{p}.down_proj.weight"), vec![h, inter]));
    };
    for (i, kind) in config.layers.iter().enumerate() {
        let m = format!("backbone.layers.{i}.mixer");
        out.push((format!("backbone.layers.{i}.norm.weight"), vec![h]));
        match kind {
            LayerKind::Mamba => {
                let c = config.mamba.as_ref().expect("a parsed config has mamba settings for M layers");
                out.push((format!("{m}.in_proj.weight"), vec![c.in_proj_width(), h]));
                out.push((format!("{m}.conv1d.weight"), vec![c.conv_dim(), 1, c.conv_kernel]));
                if c.conv_bias {
                    out.push((format!("{m}.conv1d.bias"), vec![c.conv_dim()]));
                }
                for p in ["A_log", "D", "dt_bias"] {
                    out.push((format!("{m}.{p}"), vec![c.heads]));
                }
                out.push((format!("{m}.norm.weight"), vec![c.inner()]));
                out.push((format!("{m}.out_proj.weight"), vec![h, c.inner()]));
            }
            LayerKind::Moe => {
                let c = config.moe.as_ref().expect("a parsed config has moe settings for E layers");
                out.push((format!("{m}.gate.weight"), vec![c.experts, h]));
                out.push((format!("{m}.gate.e_score_correction_bias"), vec![c.experts]));
                for e in 0..c.experts {
                    mlp(&mut out, &format!("{m}.experts.{e}"), c.intermediate);
                }
                if let Some(s) = c.shared_intermediate {
                    mlp(&mut out, &format!("{m}.shared_experts"), s);
                }
            }
            LayerKind::Attention => {
                let c = config.attention.as_ref().expect("a parsed config has attention settings for * layers");
                let (q, kv) = (c.heads * c.head_dim, c.kv_heads * c.head_dim);
                for (p, rows, cols) in [("q_proj", q, h), ("k_proj", kv, h), ("v_proj", kv, h), ("o_proj", h, q)] {
                    out.push((format!("{m}.{p}.weight"), vec![rows, cols]));
                }
            }
            LayerKind::Mlp => {
                mlp(&mut out, &m, config.mlp_intermediate.expect("a parsed config has intermediate_size for - layers"))
            }
        }
    }
    out.push(("backbone.norm_f.weight".to_string(), vec![h]));
    if !config.tie_word_embeddings {
        out.push(("lm_head.weight".to_string(), vec![v, h]));
    }
    out
}

/// How a synthetic checkpoint's matrices are drawn. Norm weights (near 1), A_log (in [-1, 1]),
/// dt_bias, D and biases (small), the routers' score correction bias (as [`Routing`] says) and
/// the conv weights (uniform, 1/sqrt(width)) are the same in both.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scaling {
    /// Every matrix uniform within 1/sqrt(fan-in), so activations stay O(1) through many
    /// layers: what the tests, the benches and the built-in model use.
    FanIn,
    /// As a language model is initialized before training (GPT-2's rule, which NemotronH's
    /// `initializer_range` 0.02 follows), so that every layer adds to the residual stream
    /// without swamping it: embeddings N(0, 1); the residual branches' output projections
    /// (Mamba `out_proj`, attention `o_proj`, every `down_proj`) N(0, 0.02 / sqrt(2 * layers));
    /// every other matrix (`in_proj`, `q/k/v_proj`, `up_proj`, the router, the LM head)
    /// N(0, 0.02).
    Residual,
}

/// Standard deviation of [`Scaling::Residual`]'s matrices.
const INIT_STD: f64 = 0.02;

/// How a synthetic checkpoint's routers spread tokens over the experts, through the score
/// correction bias each MoE layer adds to its sigmoid scores before picking the top k. A
/// trained model fits that bias so that every expert gets its share of the tokens; random
/// router weights give scores that differ between experts by about +-0.15 (a logit's spread
/// is about 1/sqrt(3) over unit-RMS inputs, the sigmoid's slope 1/4 at 0), so the bias decides
/// whether the token or the bias picks the experts.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Routing {
    /// Toward a trained model's routing: the bias within [`BALANCED_BIAS`], small beside the
    /// scores' spread, so the token rather than the bias picks. The residual stream's common
    /// components still skew random routers in the deeper layers, so a loaded model is fitted
    /// with [`balance`] to route as a trained one (every expert its share).
    #[default]
    Balanced,
    /// A stress case no trained model produces: the bias within [`SKEWED_BIAS`], larger than
    /// the scores' spread, so it picks nearly the same experts for every token (on Nano, 32 of
    /// the 128 a layer at 64 tokens by the nano bench's tally), and a batch reads fewer expert
    /// weights.
    Skewed,
}

/// The largest |score correction bias| of [`Routing::Balanced`].
pub const BALANCED_BIAS: f64 = 0.01;

/// The largest |score correction bias| of [`Routing::Skewed`].
pub const SKEWED_BIAS: f64 = 0.5;

/// The distribution of one tensor's values.
#[derive(Clone, Copy)]
enum Draw {
    Uniform { center: f64, spread: f64 },
    Normal { std: f64 },
}

impl Draw {
    /// How `name` (of `shape`, in a model of `layers` layers) is drawn under `scaling` and
    /// `routing`.
    fn of(name: &str, shape: &[usize], layers: usize, scaling: Scaling, routing: Routing) -> Draw {
        let matrix = shape.len() == 2 && name.ends_with(".weight");
        if scaling == Scaling::Residual && matrix {
            let std = if name == "backbone.embeddings.weight" {
                1.0
            } else if ["out_proj.weight", "o_proj.weight", "down_proj.weight"].iter().any(|s| name.ends_with(s)) {
                INIT_STD / (2.0 * layers as f64).sqrt()
            } else {
                INIT_STD
            };
            return Draw::Normal { std };
        }
        let (center, spread) = if name.ends_with("norm.weight") || name.ends_with("norm_f.weight") {
            (1.0, 0.1)
        } else if name.ends_with("e_score_correction_bias") {
            (0.0, if routing == Routing::Balanced { BALANCED_BIAS } else { SKEWED_BIAS })
        } else if name.ends_with("A_log") {
            (0.0, 1.0)
        } else if name.ends_with("dt_bias") || name.ends_with("D") || name.ends_with("bias") {
            (0.0, 0.5)
        } else {
            (0.0, 1.0 / (*shape.last().unwrap_or(&1) as f64).sqrt())
        };
        Draw::Uniform { center, spread }
    }
}

/// The next seed of the sequence a checkpoint's tensors take theirs from, in
/// [`tensor_shapes`] order.
fn next_seed(seed: &mut u64) -> u64 {
    *seed = seed.wrapping_add(0x9E37_79B9_7F4A_7C15);
    *seed
}

/// `n` random values drawn as `draw` from `seed`. Generated in blocks of 2^20 values, each
/// from its own stream, spread over the machine's threads.
fn values(n: usize, draw: Draw, seed: u64) -> Vec<bf16> {
    const BLOCK: usize = 1 << 20;
    let fill = |block: usize, out: &mut [bf16]| {
        let mut state = seed ^ (block as u64).wrapping_mul(0xD1B5_4A32_D192_ED03);
        // Uniform in [0, 1).
        let mut next = || {
            state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = state;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            ((z ^ (z >> 31)) >> 11) as f64 / (1u64 << 53) as f64
        };
        for v in out {
            *v = bf16::from_f64(match draw {
                Draw::Uniform { center, spread } => center + spread * (next() * 2.0 - 1.0),
                // Box-Muller, one of the pair: 1 - u is in (0, 1], so its log is finite.
                Draw::Normal { std } => {
                    let (u, w) = (1.0 - next(), next());
                    std * (-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * w).cos()
                }
            });
        }
    };
    let mut out = vec![bf16::ZERO; n];
    let threads = std::thread::available_parallelism().map_or(1, |t| t.get());
    let per = n.div_ceil(BLOCK).div_ceil(threads).max(1) * BLOCK;
    std::thread::scope(|s| {
        for (t, part) in out.chunks_mut(per).enumerate() {
            s.spawn(move || {
                for (b, block) in part.chunks_mut(BLOCK).enumerate() {
                    fill(t * per / BLOCK + b, block);
                }
            });
        }
    });
    out
}

/// [`values`] as the little-endian bytes a checkpoint holds (native order is little endian on
/// every supported host).
fn value_bytes(n: usize, draw: Draw, seed: u64) -> Vec<u8> {
    bytemuck::cast_slice(&values(n, draw, seed)).to_vec()
}

/// The weights of the linear projections in an [`in_memory_as`] checkpoint.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Precision {
    #[default]
    Bf16,
    /// Every linear projection (`*proj.weight`: Mamba's in_proj and out_proj, attention's
    /// q/k/v/o, every expert's and the shared expert's up and down; not the router, the
    /// embeddings or the LM head) as e4m3 codes with a per-tensor `weight_scale` (the draw's
    /// largest |w| over 448) and a static `input_scale` of [`FP8_INPUT_SCALE`]: W8A8 as
    /// ModelOpt's FP8 checkpoints hold it.
    Fp8,
    /// NVIDIA's NVFP4 recipe for Nemotron-3 Nano: the routed and shared experts' projections
    /// and the Mamba layers' in_proj and out_proj, except those of a Mamba layer just before
    /// an attention layer, as NVFP4 (ModelOpt's rounding: `host::cpu::nvfp4::quantize`; a
    /// `weight_scale`, `weight_scale_2` and an `input_scale` of [`FP8_INPUT_SCALE`] /
    /// 6, which weight-only runs do not read); attention, those Mamba layers, the routers, the
    /// embeddings and the LM head bf16.
    Nvfp4,
}

impl Precision {
    /// Whether the tensor `name` of `shape` is quantized: never for [`Precision::Bf16`], every
    /// projection weight for [`Precision::Fp8`], those of its recipe for [`Precision::Nvfp4`].
    fn quantizes(self, config: &Config, name: &str, shape: &[usize]) -> bool {
        if shape.len() != 2 || !name.ends_with("proj.weight") {
            return false;
        }
        match self {
            Precision::Bf16 => false,
            Precision::Fp8 => true,
            Precision::Nvfp4 => {
                let layer = name.split('.').nth(2).and_then(|i| i.parse::<usize>().ok());
                let kind = |i: usize| config.layers.get(i).copied();
                let moe = name.contains(".experts.") || name.contains(".shared_experts.");
                let mamba = layer
                    .is_some_and(|i| kind(i) == Some(LayerKind::Mamba) && kind(i + 1) != Some(LayerKind::Attention));
                (moe || mamba) && shape[1].is_multiple_of(host::cpu::nvfp4::NVFP4_BLOCK)
            }
        }
    }
}

/// The static activation scale of every projection of an FP8 synthetic checkpoint: activations
/// up to 8 in magnitude keep their e4m3 precision (larger ones saturate, which changes no
/// kernel's speed).
pub const FP8_INPUT_SCALE: f32 = 8.0 / E4M3_MAX;

/// A kind of tensor of an [`in_memory_as`] checkpoint: its name without layer and expert
/// numbers, and its shape.
type Kind = (String, Vec<usize>);

/// What an [`in_memory_as`] checkpoint holds beside its shapes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Draws {
    pub precision: Precision,
    pub routing: Routing,
}

/// A random bf16 checkpoint of `config` in memory, for speed measurements at full size: one
/// random buffer per kind of tensor, shared by every layer and expert that has that kind
/// (same name up to layer and expert numbers, same shape), so even a 30B-parameter model
/// needs only its embedding, LM head and one tensor of each kind in host memory. Each layer's
/// and expert's weights still get their own device memory when uploaded. Routing balanced
/// ([`Routing::Balanced`]).
pub fn in_memory(config: &Config, seed: u64) -> Result<Checkpoint> {
    in_memory_as(config, seed, Draws::default())
}

/// [`in_memory`] with the projections' weights in `draws.precision` (the same draws: an FP8
/// checkpoint holds the bf16 one's values quantized) and the routers as `draws.routing`.
pub fn in_memory_as(config: &Config, seed: u64, draws: Draws) -> Result<Checkpoint> {
    let Draws { precision, routing } = draws;
    let mut seed = seed;
    let layers = config.layers.len();
    // Per kind (and whether quantized): the buffer of its values or codes and, quantized,
    // those of its scales (FP8: the weight scale; NVFP4: the block scales, then the
    // per-tensor scale).
    let mut kinds: BTreeMap<(Kind, bool), (usize, Option<usize>)> = BTreeMap::new();
    // Per kind: the seed of its draw, the same whether quantized or not (a layer kept bf16
    // and one quantized share the values, as in the bf16 checkpoint).
    let mut seeds: BTreeMap<Kind, u64> = BTreeMap::new();
    // Buffer 0: the input scale every FP8 projection shares (4 bytes nothing reads in bf16);
    // buffer 1: NVFP4's (weight-only runs read neither).
    let mut buffers: Vec<Vec<u8>> =
        vec![FP8_INPUT_SCALE.to_le_bytes().to_vec(), (FP8_INPUT_SCALE / 6.0).to_le_bytes().to_vec()];
    let mut tensors = Vec::new();
    for (name, shape) in tensor_shapes(config) {
        let kind: String = name.chars().filter(|c| !c.is_ascii_digit()).collect();
        let quantized = precision.quantizes(config, &name, &shape);
        let seed = *seeds.entry((kind.clone(), shape.clone())).or_insert_with(|| next_seed(&mut seed));
        let (file, scale) = *kinds.entry(((kind, shape.clone()), quantized)).or_insert_with(|| {
            let (n, draw) = (shape.iter().product(), Draw::of(&name, &shape, layers, Scaling::FanIn, routing));
            if !quantized {
                buffers.push(value_bytes(n, draw, seed));
                return (buffers.len() - 1, None);
            }
            let v = values(n, draw, seed);
            if precision == Precision::Nvfp4 {
                let v: Vec<f32> = v.iter().map(|x| x.to_f32()).collect();
                let q = host::cpu::nvfp4::quantize(&v, shape[0], shape[1]);
                buffers.extend([q.packed, q.block, q.global.to_le_bytes().to_vec()]);
                return (buffers.len() - 3, Some(buffers.len() - 2));
            }
            let w_scale = v.iter().fold(0.0f32, |m, x| m.max(x.to_f32().abs())) / E4M3_MAX;
            buffers.push(v.iter().map(|x| e4m3_encode(x.to_f32() / w_scale)).collect());
            buffers.push(w_scale.to_le_bytes().to_vec());
            (buffers.len() - 2, Some(buffers.len() - 1))
        });
        match (scale, name.strip_suffix(".weight")) {
            (Some(block), Some(prefix)) if precision == Precision::Nvfp4 => {
                let (out, inp) = (shape[0], shape[1]);
                tensors.push((format!("{prefix}.weight_scale"), Dtype::F8E4M3, vec![out, inp / 16], block));
                tensors.push((format!("{prefix}.weight_scale_2"), Dtype::F32, vec![], block + 1));
                tensors.push((format!("{prefix}.input_scale"), Dtype::F32, vec![], 1));
                tensors.push((name, Dtype::U8, vec![out, inp / 2], file));
            }
            (Some(w_scale), Some(prefix)) => {
                tensors.push((format!("{prefix}.weight_scale"), Dtype::F32, vec![], w_scale));
                tensors.push((format!("{prefix}.input_scale"), Dtype::F32, vec![], 0));
                tensors.push((name, Dtype::F8E4M3, shape, file));
            }
            _ => tensors.push((name, Dtype::Bf16, shape, file)),
        }
    }
    Checkpoint::in_memory(buffers, tensors)
}

/// Fits every MoE layer's score correction bias so that `tokens` spread evenly over its
/// experts, as training fits a real checkpoint's (auxiliary-loss-free balancing, DeepSeek-V3's
/// and NemotronH's: after each step every expert's bias moves toward its share of the load).
/// Random weights need it: every token's residual stream carries the same components (relu^2
/// activations are positive, so each expert's and the shared expert's output has a mean
/// direction; conv and norm biases add others), which give each expert a score offset of its
/// own that no draw of the bias alone removes, so without fitting the deeper layers route most
/// tokens to the same experts. Runs a tallied prefill of `tokens` at slot 0, then `steps`
/// times moves each expert's bias (from 0) by [`BALANCE_RATE`] times its relative gap to the
/// mean load and runs it again; returns the last run's loads.
pub fn balance<B: Backend>(model: &mut Model<B>, tokens: &[u32], steps: usize) -> Result<Vec<ExpertLoad>> {
    let Some(experts) = model.config().moe.as_ref().map(|c| c.experts) else { return Ok(Vec::new()) };
    model.set_expert_tally(true);
    let loads = fit_biases(model, tokens, steps, experts);
    model.set_expert_tally(false);
    loads
}

/// [`balance`]'s steps on a model whose steps tally their loads.
fn fit_biases<B: Backend>(
    model: &mut Model<B>,
    tokens: &[u32],
    steps: usize,
    experts: usize,
) -> Result<Vec<ExpertLoad>> {
    let run = |m: &mut Model<B>| -> Result<Vec<ExpertLoad>> {
        m.step(&[Part { slot: 0, computed: 0, tokens }])?;
        Ok(m.expert_loads().to_vec())
    };
    let mut loads = run(model)?;
    let mut bias = vec![vec![0.0f32; experts]; loads.len()];
    for _ in 0..steps {
        for (l, b) in loads.iter().zip(&mut bias) {
            let mean = l.rows.iter().sum::<usize>() as f32 / experts as f32;
            for (v, &n) in b.iter_mut().zip(&l.rows) {
                *v += BALANCE_RATE * (mean - n as f32) / mean;
            }
            model.set_score_bias(l.layer, b)?;
        }
        loads = run(model)?;
    }
    Ok(loads)
}

/// [`balance`] as the benches and `serve --synthetic` fit a loaded synthetic model: on
/// [`BALANCE_TOKENS`] tokens spread over the vocabulary (fewer where the model's slots hold
/// fewer), [`BALANCE_STEPS`] steps.
pub fn balance_routers<B: Backend>(model: &mut Model<B>) -> Result<Vec<ExpertLoad>> {
    let (n, vocab) = (BALANCE_TOKENS.min(model.max_len()), model.vocab() as u64);
    let tokens: Vec<u32> = (0..n as u64).map(|i| ((i * 104_729 + 17) % vocab) as u32).collect();
    balance(model, &tokens, BALANCE_STEPS)
}

/// The tokens and steps of [`balance_routers`].
pub const BALANCE_TOKENS: usize = 2048;
pub const BALANCE_STEPS: usize = 16;

/// How far [`balance`] moves an expert's bias a step, per unit of its relative load gap.
pub const BALANCE_RATE: f32 = 0.05;

/// One tensor of a checkpoint being written, drawn when the writer reaches it: one tensor at
/// a time is in memory, however large the checkpoint.
struct Drawn {
    shape: Vec<usize>,
    draw: Draw,
    seed: u64,
}

impl safetensors::View for Drawn {
    fn dtype(&self) -> safetensors::Dtype {
        safetensors::Dtype::BF16
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> Cow<'_, [u8]> {
        Cow::Owned(value_bytes(self.shape.iter().product(), self.draw, self.seed))
    }
    fn data_len(&self) -> usize {
        self.shape.iter().product::<usize>() * 2
    }
}

/// Writes `config_json` as `dir/config.json` and a random bf16 `dir/model.safetensors` that
/// matches it, drawn as [`Scaling::FanIn`] with [`Routing::Balanced`].
pub fn write_checkpoint(dir: &Path, config_json: &str, seed: u64) -> Result<()> {
    write_checkpoint_scaled(dir, config_json, seed, Scaling::FanIn)
}

/// [`write_checkpoint`] with the weights drawn as `scaling` (routing balanced).
pub fn write_checkpoint_scaled(dir: &Path, config_json: &str, seed: u64, scaling: Scaling) -> Result<()> {
    let config = Config::from_json(config_json)?;
    let io =
        |e: std::io::Error| Error::Checkpoint { path: dir.to_path_buf(), tensor: String::new(), reason: e.to_string() };
    std::fs::create_dir_all(dir).map_err(io)?;
    std::fs::write(dir.join("config.json"), config_json).map_err(io)?;
    let mut seed = seed;
    let layers = config.layers.len();
    let tensors: Vec<(String, Drawn)> = tensor_shapes(&config)
        .into_iter()
        .map(|(name, shape)| {
            let drawn = Drawn {
                draw: Draw::of(&name, &shape, layers, scaling, Routing::Balanced),
                seed: next_seed(&mut seed),
                shape,
            };
            (name, drawn)
        })
        .collect();
    let path = dir.join("model.safetensors");
    safetensors::serialize_to_file(tensors, None, &path).map_err(|e| io(std::io::Error::other(e.to_string())))?;
    // The writer makes a private file (it writes a temporary one and renames it): give it the
    // permissions any file written here gets, as config.json has.
    let permissions = std::fs::metadata(dir.join("config.json")).map_err(io)?.permissions();
    std::fs::set_permissions(&path, permissions).map_err(io)
}

/// Adds a token to `tokenizer` for every id from the end of its vocabulary up to `vocab`
/// (`w300 ` for id 300), so that every token a random model of `vocab` tokens writes decodes to
/// text of its own (a stream then brings each token in a chunk of its own).
pub fn fill_vocabulary(tokenizer: &mut Tokenizer, vocab: usize) {
    let have = tokenizer.get_vocab_size(true);
    let tokens: Vec<AddedToken> = (have..vocab).map(|id| AddedToken::from(format!("w{id} "), false)).collect();
    tokenizer.add_tokens(&tokens);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_filled_vocabulary_gives_every_id_its_own_text() {
        let dir = crate::built_in::dir().unwrap();
        let mut tokenizer = Tokenizer::from_file(dir.join("tokenizer.json")).unwrap();
        let have = tokenizer.get_vocab_size(true);
        fill_vocabulary(&mut tokenizer, 1000);
        assert_eq!(tokenizer.get_vocab_size(true), 1000);
        for id in [have as u32, 500, 999] {
            let text = tokenizer.decode(&[id], true).unwrap();
            assert_eq!(text, format!("w{id} "));
            assert_eq!(tokenizer.encode(text.as_str(), false).unwrap().get_ids(), [id]);
        }
        assert_eq!(tokenizer.decode(&[u32::from(b'h'), 500, 999], true).unwrap(), "hw500 w999 ");
        fill_vocabulary(&mut tokenizer, 10);
        assert_eq!(tokenizer.get_vocab_size(true), 1000, "never shrunk");
    }
}
