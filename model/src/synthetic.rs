//! Random NemotronH checkpoints of any config: every tensor a [`crate::layout::Layout`] needs,
//! bf16, seeded. For tests and for the small built-in model; the values mean nothing.

use std::collections::BTreeMap;
use std::path::Path;

use half::bf16;
use safetensors::tensor::TensorView;

use crate::config::{Config, LayerKind};
use crate::error::{Error, Result};
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

/// Random values for tensor `name`: norms near 1, A_log in [-1, 1], small dt_bias, and
/// weights scaled by 1/sqrt(fan-in) so activations stay O(1) through many layers. Generated in
/// blocks of 2^20 values, each from its own stream, spread over the machine's threads.
fn values(name: &str, shape: &[usize], seed: &mut u64) -> Vec<bf16> {
    let n: usize = shape.iter().product();
    *seed = seed.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let base = *seed;
    let (center, spread) = if name.ends_with("norm.weight") || name.ends_with("norm_f.weight") {
        (1.0, 0.1)
    } else if name.ends_with("A_log") {
        (0.0, 1.0)
    } else if name.ends_with("dt_bias") || name.ends_with("D") || name.ends_with("bias") {
        (0.0, 0.5)
    } else {
        (0.0, 1.0 / (*shape.last().unwrap_or(&1) as f64).sqrt())
    };
    const BLOCK: usize = 1 << 20;
    let fill = |block: usize, out: &mut [bf16]| {
        let mut state = base ^ (block as u64).wrapping_mul(0xD1B5_4A32_D192_ED03);
        for v in out {
            state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = state;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            let u = ((z ^ (z >> 31)) >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0;
            *v = bf16::from_f64(center + spread * u);
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
fn value_bytes(name: &str, shape: &[usize], seed: &mut u64) -> Vec<u8> {
    bytemuck::cast_slice(&values(name, shape, seed)).to_vec()
}

/// A random bf16 checkpoint of `config` in memory, for speed measurements at full size: one
/// random buffer per kind of tensor, shared by every layer and expert that has that kind
/// (same name up to layer and expert numbers, same shape), so even a 30B-parameter model
/// needs only its embedding, LM head and one tensor of each kind in host memory. Each layer's
/// and expert's weights still get their own device memory when uploaded.
pub fn in_memory(config: &Config, seed: u64) -> Result<Checkpoint> {
    let mut seed = seed;
    let mut kinds: BTreeMap<(String, Vec<usize>), usize> = BTreeMap::new();
    let mut buffers: Vec<Vec<u8>> = Vec::new();
    let mut tensors = Vec::new();
    for (name, shape) in tensor_shapes(config) {
        let kind: String = name.chars().filter(|c| !c.is_ascii_digit()).collect();
        let file = *kinds.entry((kind, shape.clone())).or_insert_with(|| {
            buffers.push(value_bytes(&name, &shape, &mut seed));
            buffers.len() - 1
        });
        tensors.push((name, Dtype::Bf16, shape, file));
    }
    Checkpoint::in_memory(buffers, tensors)
}

/// Writes `config_json` as `dir/config.json` and a random bf16 `dir/model.safetensors` that
/// matches it.
pub fn write_checkpoint(dir: &Path, config_json: &str, seed: u64) -> Result<()> {
    let config = Config::from_json(config_json)?;
    let io =
        |e: std::io::Error| Error::Checkpoint { path: dir.to_path_buf(), tensor: String::new(), reason: e.to_string() };
    std::fs::create_dir_all(dir).map_err(io)?;
    std::fs::write(dir.join("config.json"), config_json).map_err(io)?;
    let mut seed = seed;
    let data: BTreeMap<String, (Vec<usize>, Vec<u8>)> = tensor_shapes(&config)
        .into_iter()
        .map(|(name, shape)| {
            let bytes = value_bytes(&name, &shape, &mut seed);
            (name, (shape, bytes))
        })
        .collect();
    let views = data.iter().map(|(name, (shape, bytes))| {
        (name.clone(), TensorView::new(safetensors::Dtype::BF16, shape.clone(), bytes).expect("shape and bytes agree"))
    });
    let bytes = safetensors::serialize(views, None).map_err(|e| io(std::io::Error::other(e.to_string())))?;
    std::fs::write(dir.join("model.safetensors"), bytes).map_err(io)
}
