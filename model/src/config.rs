//! `config.json` of a NemotronH checkpoint: parsed, checked for consistency, and reduced to
//! the values the model uses (docs/MATH.md, "The Nano checkpoint" and "Checkpoint formats").
//!
//! Both ways of naming the layer kinds are accepted: `hybrid_override_pattern` (released
//! checkpoints: a string of `M` Mamba2, `E` MoE, `*` attention, `-` dense MLP) and
//! `layers_block_type` (configs saved by transformers 5.x: `"linear_attention"`/`"mamba"`,
//! `"moe"`, `"full_attention"`/`"attention"`, `"mlp"`). Floats may be written as
//! `{"__float__": "Infinity"}`. Every size comes from the file; nothing is assumed.

use serde::Deserialize;
use serde_json::Value;

use crate::error::{Error, Result};
use crate::quantization::Quantization;

/// The kind of one layer's mixer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LayerKind {
    /// Mamba2 mixer (`M`).
    Mamba,
    /// Mixture of experts (`E`).
    Moe,
    /// Causal self-attention, no positional encoding (`*`).
    Attention,
    /// Dense relu^2 MLP (`-`).
    Mlp,
}

/// Element type of the SSM state cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CacheDtype {
    F32,
    Bf16,
}

/// The Mamba2 mixer's sizes.
#[derive(Clone, Debug, PartialEq)]
pub struct MambaConfig {
    pub heads: usize,
    pub head_dim: usize,
    pub state_size: usize,
    pub groups: usize,
    pub conv_kernel: usize,
    pub conv_bias: bool,
    pub proj_bias: bool,
    /// dt clamp after softplus; `(0, inf)` when the config has none.
    pub dt_limit: (f32, f32),
    pub cache_dtype: CacheDtype,
}

impl MambaConfig {
    /// Width of x, z and y: heads * head_dim (never assumed to be 2 * hidden).
    pub fn inner(&self) -> usize {
        self.heads * self.head_dim
    }

    /// Channels of the conv: x, B and C.
    pub fn conv_dim(&self) -> usize {
        self.inner() + 2 * self.groups * self.state_size
    }

    /// Width of in_proj's output: z, xBC, dt.
    pub fn in_proj_width(&self) -> usize {
        self.inner() + self.conv_dim() + self.heads
    }
}

/// The MoE layer's sizes and routing rule (docs/MATH.md section 6).
#[derive(Clone, Debug, PartialEq)]
pub struct MoeConfig {
    pub experts: usize,
    pub top_k: usize,
    pub intermediate: usize,
    /// The shared expert's intermediate size (none when the config has no shared expert).
    pub shared_intermediate: Option<usize>,
    pub n_group: usize,
    pub topk_group: usize,
    pub norm_topk_prob: bool,
    pub routed_scaling_factor: f32,
}

impl MoeConfig {
    /// The routing settings, as the routing kernel takes them.
    pub fn route_shape(&self) -> host::router::RouteShape {
        host::router::RouteShape {
            experts: self.experts,
            top_k: self.top_k,
            n_group: self.n_group,
            topk_group: self.topk_group,
            renormalize: self.norm_topk_prob,
            scaling: self.routed_scaling_factor,
            shared: 0,
        }
    }
}

/// The attention layer's sizes.
#[derive(Clone, Debug, PartialEq)]
pub struct AttentionConfig {
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub bias: bool,
}

/// A NemotronH model's configuration.
#[derive(Clone, Debug, PartialEq)]
pub struct Config {
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub layers: Vec<LayerKind>,
    pub norm_eps: f32,
    pub tie_word_embeddings: bool,
    pub mamba: Option<MambaConfig>,
    pub moe: Option<MoeConfig>,
    pub attention: Option<AttentionConfig>,
    /// The dense MLP's intermediate size (present when a `-` layer exists).
    pub mlp_intermediate: Option<usize>,
    pub mlp_bias: bool,
    /// The quantization the checkpoint declares (config.json's `quantization_config`, or
    /// `hf_quant_config.json` beside it, which [`Config::from_dir`] reads).
    pub quantization: Option<Quantization>,
}

/// The raw file: every key this crate reads; everything else is ignored.
#[derive(Deserialize)]
struct Raw {
    vocab_size: Option<usize>,
    hidden_size: Option<usize>,
    num_hidden_layers: Option<usize>,
    hybrid_override_pattern: Option<String>,
    layers_block_type: Option<Vec<String>>,
    layer_norm_epsilon: Option<Value>,
    tie_word_embeddings: Option<bool>,
    quantization_config: Option<Value>,
    mamba_num_heads: Option<usize>,
    mamba_head_dim: Option<usize>,
    ssm_state_size: Option<usize>,
    n_groups: Option<usize>,
    conv_kernel: Option<usize>,
    use_conv_bias: Option<bool>,
    mamba_proj_bias: Option<bool>,
    use_bias: Option<bool>,
    mamba_hidden_act: Option<String>,
    time_step_limit: Option<Value>,
    mamba_ssm_cache_dtype: Option<String>,
    n_routed_experts: Option<usize>,
    num_experts_per_tok: Option<usize>,
    moe_intermediate_size: Option<usize>,
    moe_shared_expert_intermediate_size: Option<usize>,
    n_shared_experts: Option<usize>,
    n_group: Option<usize>,
    topk_group: Option<usize>,
    norm_topk_prob: Option<bool>,
    routed_scaling_factor: Option<Value>,
    moe_latent_size: Option<Value>,
    num_attention_heads: Option<usize>,
    num_key_value_heads: Option<usize>,
    head_dim: Option<usize>,
    attention_bias: Option<bool>,
    intermediate_size: Option<usize>,
    mlp_bias: Option<bool>,
    mlp_hidden_act: Option<String>,
}

fn bad(field: &str, reason: impl Into<String>) -> Error {
    Error::Config { field: field.to_string(), reason: reason.into() }
}

fn need<T>(field: &str, v: Option<T>) -> Result<T> {
    v.ok_or_else(|| bad(field, "is missing"))
}

/// Most elements of any width the model derives from a config (a row of activations, of a
/// cache slot): the kernels index with 32-bit arithmetic.
pub const MAX_WIDTH: usize = i32::MAX as usize;
/// Most layers a config may name.
pub const MAX_LAYERS: usize = 4096;

/// A size that must be at least 1 and at most [`MAX_WIDTH`].
fn size(field: &str, v: Option<usize>) -> Result<usize> {
    match need(field, v)? {
        0 => Err(bad(field, "must be at least 1")),
        n if n > MAX_WIDTH => Err(bad(field, format!("{n} is above the largest width, {MAX_WIDTH}"))),
        n => Ok(n),
    }
}

/// `a * b + c`, named `field` in the error when it overflows or passes [`MAX_WIDTH`].
fn width(field: &str, a: usize, b: usize, c: usize) -> Result<usize> {
    a.checked_mul(b)
        .and_then(|v| v.checked_add(c))
        .filter(|&v| v <= MAX_WIDTH)
        .ok_or_else(|| bad(field, format!("{a} x {b} + {c} is above the largest width, {MAX_WIDTH}")))
}

/// A float written as a number or as `{"__float__": "Infinity" | "-Infinity" | "NaN"}`.
fn float(field: &str, v: &Value) -> Result<f64> {
    match v {
        Value::Number(n) => n.as_f64().ok_or_else(|| bad(field, "is not a finite number")),
        Value::Object(o) => match o.get("__float__").and_then(Value::as_str) {
            Some("Infinity" | "inf") => Ok(f64::INFINITY),
            Some("-Infinity" | "-inf") => Ok(f64::NEG_INFINITY),
            _ => Err(bad(field, format!("is not a float: {v}"))),
        },
        _ => Err(bad(field, format!("is not a float: {v}"))),
    }
}

fn layer_kinds(raw: &Raw) -> Result<Vec<LayerKind>> {
    let n = raw.hybrid_override_pattern.as_ref().map(|p| p.len()).or(raw.layers_block_type.as_ref().map(Vec::len));
    if let Some(n) = n.filter(|&n| n > MAX_LAYERS) {
        return Err(bad("hybrid_override_pattern", format!("names {n} layers; at most {MAX_LAYERS} are supported")));
    }
    match (&raw.hybrid_override_pattern, &raw.layers_block_type) {
        (Some(p), _) => p
            .chars()
            .enumerate()
            .map(|(i, c)| match c {
                'M' => Ok(LayerKind::Mamba),
                'E' => Ok(LayerKind::Moe),
                '*' => Ok(LayerKind::Attention),
                '-' => Ok(LayerKind::Mlp),
                _ => Err(bad("hybrid_override_pattern", format!("has '{c}' at layer {i}; expected one of M, E, *, -"))),
            })
            .collect(),
        (None, Some(list)) => list
            .iter()
            .enumerate()
            .map(|(i, s)| match s.as_str() {
                "mamba" | "linear_attention" => Ok(LayerKind::Mamba),
                "moe" => Ok(LayerKind::Moe),
                "attention" | "full_attention" => Ok(LayerKind::Attention),
                "mlp" => Ok(LayerKind::Mlp),
                _ => Err(bad("layers_block_type", format!("has \"{s}\" at layer {i}"))),
            })
            .collect(),
        (None, None) => Err(bad("hybrid_override_pattern", "is missing (and so is layers_block_type)")),
    }
}

fn mamba(raw: &Raw) -> Result<MambaConfig> {
    let heads = size("mamba_num_heads", raw.mamba_num_heads)?;
    let groups = size("n_groups", raw.n_groups)?;
    if heads % groups != 0 {
        return Err(bad("n_groups", format!("{groups} does not divide mamba_num_heads {heads}")));
    }
    let conv_kernel = size("conv_kernel", raw.conv_kernel)?;
    if !(2..=8).contains(&conv_kernel) {
        return Err(bad("conv_kernel", format!("{conv_kernel} is not supported (2..=8)")));
    }
    if let Some(act) = raw.mamba_hidden_act.as_deref().filter(|a| *a != "silu") {
        return Err(bad("mamba_hidden_act", format!("\"{act}\" is not supported (silu)")));
    }
    let dt_limit = match &raw.time_step_limit {
        None | Some(Value::Null) => (0.0, f32::INFINITY),
        Some(Value::Array(v)) if v.len() == 2 => {
            let (lo, hi) = (float("time_step_limit", &v[0])?, float("time_step_limit", &v[1])?);
            if lo.is_nan() || hi.is_nan() || lo > hi || lo < 0.0 {
                return Err(bad("time_step_limit", format!("({lo}, {hi}) is not a range within [0, inf]")));
            }
            (lo as f32, hi as f32)
        }
        Some(v) => return Err(bad("time_step_limit", format!("{v} is not a [min, max] pair"))),
    };
    let cache_dtype = match raw.mamba_ssm_cache_dtype.as_deref() {
        None | Some("float32") => CacheDtype::F32,
        Some("bfloat16") => CacheDtype::Bf16,
        Some(d) => return Err(bad("mamba_ssm_cache_dtype", format!("\"{d}\" is not supported (float32, bfloat16)"))),
    };
    let (head_dim, state_size) =
        (size("mamba_head_dim", raw.mamba_head_dim)?, size("ssm_state_size", raw.ssm_state_size)?);
    // inner, conv_dim and in_proj_width, each within MAX_WIDTH (their methods then cannot overflow).
    let inner = width("mamba_head_dim", heads, head_dim, 0)?;
    let conv_dim = width("ssm_state_size", 2 * groups, state_size, inner)?;
    width("mamba_num_heads", 1, inner + conv_dim, heads)?;
    Ok(MambaConfig {
        heads,
        head_dim,
        state_size,
        groups,
        conv_kernel,
        conv_bias: raw.use_conv_bias.unwrap_or(true),
        proj_bias: raw.mamba_proj_bias.or(raw.use_bias).unwrap_or(false),
        dt_limit,
        cache_dtype,
    })
}

fn moe(raw: &Raw) -> Result<MoeConfig> {
    let experts = size("n_routed_experts", raw.n_routed_experts)?;
    let top_k = size("num_experts_per_tok", raw.num_experts_per_tok)?;
    if experts > 256 || top_k > 16 || top_k > experts {
        return Err(bad(
            "num_experts_per_tok",
            format!("top-{top_k} of {experts} experts is not supported (<= 16 of <= 256)"),
        ));
    }
    // Absent: one group; present: at least 1 (a 0 is an error, not a silent 1).
    let n_group = match raw.n_group {
        None => 1,
        g => size("n_group", g)?,
    };
    let topk_group = match raw.topk_group {
        None => 1,
        g => size("topk_group", g)?,
    };
    if experts % n_group != 0 || topk_group > n_group || top_k > topk_group * (experts / n_group) {
        return Err(bad(
            "topk_group",
            format!("{topk_group} of {n_group} groups of {experts} experts cannot hold top-{top_k}"),
        ));
    }
    if raw.moe_latent_size.as_ref().is_some_and(|v| !v.is_null()) {
        return Err(bad("moe_latent_size", "latent MoE projections are not supported"));
    }
    let shared = match raw.n_shared_experts {
        Some(0) => None,
        _ => raw.moe_shared_expert_intermediate_size,
    };
    let scaling = match &raw.routed_scaling_factor {
        None | Some(Value::Null) => 1.0,
        Some(v) => float("routed_scaling_factor", v)? as f32,
    };
    if !(scaling.is_finite() && scaling > 0.0) {
        return Err(bad("routed_scaling_factor", format!("{scaling} must be finite and > 0")));
    }
    Ok(MoeConfig {
        experts,
        top_k,
        intermediate: size("moe_intermediate_size", raw.moe_intermediate_size)?,
        shared_intermediate: shared,
        n_group,
        topk_group,
        norm_topk_prob: raw.norm_topk_prob.unwrap_or(true),
        routed_scaling_factor: scaling,
    })
}

fn attention(raw: &Raw) -> Result<AttentionConfig> {
    let heads = size("num_attention_heads", raw.num_attention_heads)?;
    let kv_heads = size("num_key_value_heads", raw.num_key_value_heads)?;
    if heads % kv_heads != 0 {
        return Err(bad("num_key_value_heads", format!("{kv_heads} does not divide num_attention_heads {heads}")));
    }
    let head_dim = size("head_dim", raw.head_dim)?;
    // q, k and v side by side (the fused projection's rows).
    let q = width("head_dim", heads, head_dim, 0)?;
    width("num_key_value_heads", 2 * kv_heads, head_dim, q)?;
    Ok(AttentionConfig { heads, kv_heads, head_dim, bias: raw.attention_bias.unwrap_or(false) })
}

impl Config {
    /// Parses and checks the text of a `config.json`.
    pub fn from_json(text: &str) -> Result<Config> {
        let raw: Raw = serde_json::from_str(text).map_err(|e| bad("config.json", e.to_string()))?;
        let layers = layer_kinds(&raw)?;
        if layers.is_empty() {
            return Err(bad("hybrid_override_pattern", "names no layers"));
        }
        // transformers 5.x derives the count from layers_block_type and does not write it.
        if let Some(n) = raw.num_hidden_layers.filter(|&n| n != layers.len()) {
            return Err(bad(
                "hybrid_override_pattern",
                format!("names {} layers, num_hidden_layers is {n}", layers.len()),
            ));
        }
        let has = |k| layers.contains(&k);
        let ffn = has(LayerKind::Moe) || has(LayerKind::Mlp);
        if let Some(act) = raw.mlp_hidden_act.as_deref().filter(|a| *a != "relu2" && ffn) {
            return Err(bad("mlp_hidden_act", format!("\"{act}\" is not supported (relu2)")));
        }
        let eps = match &raw.layer_norm_epsilon {
            None => 1e-5,
            Some(v) => float("layer_norm_epsilon", v)?,
        };
        if !(eps > 0.0 && eps.is_finite()) {
            return Err(bad("layer_norm_epsilon", format!("{eps} must be finite and > 0")));
        }
        Ok(Config {
            vocab_size: size("vocab_size", raw.vocab_size)?,
            hidden_size: size("hidden_size", raw.hidden_size)?,
            norm_eps: eps as f32,
            tie_word_embeddings: raw.tie_word_embeddings.unwrap_or(false),
            mamba: has(LayerKind::Mamba).then(|| mamba(&raw)).transpose()?,
            moe: has(LayerKind::Moe).then(|| moe(&raw)).transpose()?,
            attention: has(LayerKind::Attention).then(|| attention(&raw)).transpose()?,
            mlp_intermediate: has(LayerKind::Mlp)
                .then(|| size("intermediate_size", raw.intermediate_size))
                .transpose()?,
            mlp_bias: raw.mlp_bias.unwrap_or(false),
            quantization: raw.quantization_config.as_ref().map(Quantization::from_quantization_config).transpose()?,
            layers,
        })
    }

    /// Reads and parses `dir/config.json`.
    pub fn from_dir(dir: &std::path::Path) -> Result<Config> {
        let path = dir.join("config.json");
        let text = std::fs::read_to_string(&path)
            .map_err(|e| bad("config.json", format!("cannot read {}: {e}", path.display())))?;
        let mut config = Config::from_json(&text)?;
        let hf = dir.join("hf_quant_config.json");
        if hf.exists() {
            let text = std::fs::read_to_string(&hf).map_err(|e| Error::Checkpoint {
                path: hf.clone(),
                tensor: String::new(),
                reason: format!("cannot be read: {e}"),
            })?;
            config.quantization = Some(Quantization::from_hf_quant_config(&text)?);
        }
        Ok(config)
    }

    /// What the engine does otherwise than the checkpoint declares, for the caller to say:
    /// an FP8 KV cache kept in bf16 (its `k_scale` / `v_scale` not used).
    pub fn kv_cache_note(&self) -> Option<String> {
        let q = self.quantization.as_ref()?;
        let kv = q.kv_cache.as_deref()?;
        Some(format!(
            "{} declares a {kv} KV cache; this engine keeps the KV cache in bf16 and does not use the checkpoint's \
             k_scale / v_scale",
            q.source
        ))
    }

    /// How many layers of each kind: (Mamba, MoE, attention, MLP).
    pub fn layer_counts(&self) -> (usize, usize, usize, usize) {
        let count = |k| self.layers.iter().filter(|&&l| l == k).count();
        (count(LayerKind::Mamba), count(LayerKind::Moe), count(LayerKind::Attention), count(LayerKind::Mlp))
    }
}
