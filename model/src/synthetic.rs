//! Random NemotronH checkpoints of any config: every tensor a [`crate::layout::Layout`] needs,
//! bf16, seeded. For tests and for the small built-in model; the values mean nothing.

use std::collections::BTreeMap;
use std::path::Path;

use half::bf16;
use safetensors::tensor::TensorView;

use crate::config::{Config, LayerKind};
use crate::error::{Error, Result};

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
/// weights scaled by 1/sqrt(fan-in) so activations stay O(1) through many layers.
fn values(name: &str, shape: &[usize], seed: &mut u64) -> Vec<bf16> {
    let n: usize = shape.iter().product();
    let mut next = || {
        *seed = seed.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = *seed;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        ((z ^ (z >> 31)) >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0
    };
    let (center, spread) = if name.ends_with("norm.weight") || name.ends_with("norm_f.weight") {
        (1.0, 0.1)
    } else if name.ends_with("A_log") {
        (0.0, 1.0)
    } else if name.ends_with("dt_bias") || name.ends_with("D") || name.ends_with("bias") {
        (0.0, 0.5)
    } else {
        (0.0, 1.0 / (*shape.last().unwrap_or(&1) as f64).sqrt())
    };
    (0..n).map(|_| bf16::from_f64(center + spread * next())).collect()
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
            let bytes = values(&name, &shape, &mut seed).iter().flat_map(|v| v.to_le_bytes()).collect();
            (name, (shape, bytes))
        })
        .collect();
    let views = data.iter().map(|(name, (shape, bytes))| {
        (name.clone(), TensorView::new(safetensors::Dtype::BF16, shape.clone(), bytes).expect("shape and bytes agree"))
    });
    let bytes = safetensors::serialize(views, None).map_err(|e| io(std::io::Error::other(e.to_string())))?;
    std::fs::write(dir.join("model.safetensors"), bytes).map_err(io)
}
