//! Finding and checking every tensor of a config: a random checkpoint with all four layer
//! kinds loads; edited ones report every missing, mis-shaped and mistyped tensor by name.

use std::path::PathBuf;

use model::config::Config;
use model::layout::{Fp8Scales, Layout, Mixer};
use model::synthetic::{tensor_shapes, write_checkpoint};
use model::weights::Checkpoint;
use safetensors::tensor::TensorView;

/// A tiny NemotronH with every layer kind (M, E, *, -), FP8-free.
pub const TINY: &str = r#"{
  "vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 4, "hybrid_override_pattern": "ME*-",
  "mamba_num_heads": 4, "mamba_head_dim": 8, "ssm_state_size": 16, "n_groups": 2, "conv_kernel": 4,
  "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
  "moe_shared_expert_intermediate_size": 24, "routed_scaling_factor": 2.5,
  "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "intermediate_size": 48
}"#;

fn tmpdir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("nemotron-layout-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

#[test]
fn random_checkpoint_has_every_tensor() {
    let dir = tmpdir("ok");
    write_checkpoint(&dir, TINY, 1).unwrap();
    let config = Config::from_dir(&dir).unwrap();
    let ck = Checkpoint::open(&dir).unwrap();
    assert_eq!(ck.names().count(), tensor_shapes(&config).len());
    let layout = Layout::new(&config, &ck).unwrap();
    assert_eq!(layout.layers.len(), 4);
    let kinds: Vec<&str> = layout
        .layers
        .iter()
        .map(|l| match &l.mixer {
            Mixer::Mamba(_) => "M",
            Mixer::Moe(m) => {
                assert_eq!((m.experts.len(), m.shared.is_some(), m.score_bias.is_some()), (8, true, true));
                "E"
            }
            Mixer::Attention(_) => "*",
            Mixer::Mlp(_) => "-",
        })
        .collect();
    assert_eq!(kinds.concat(), "ME*-");
    assert_eq!(layout.lm_head.weight.shape, &[64, 32]);
}

/// Writes the tiny checkpoint with `edit` applied to its (name, dtype, shape) list; tensors
/// hold zeros, single-value F32 tensors (scales) hold `scale`.
fn write_edited(
    name: &str,
    scale: f32,
    edit: impl FnOnce(&mut Vec<(String, safetensors::Dtype, Vec<usize>)>),
) -> PathBuf {
    let dir = tmpdir(name);
    write_checkpoint(&dir, TINY, 2).unwrap();
    let config = Config::from_json(TINY).unwrap();
    let mut list: Vec<(String, safetensors::Dtype, Vec<usize>)> =
        tensor_shapes(&config).into_iter().map(|(n, s)| (n, safetensors::Dtype::BF16, s)).collect();
    edit(&mut list);
    let data: Vec<(String, safetensors::Dtype, Vec<usize>, Vec<u8>)> = list
        .into_iter()
        .map(|(n, d, s)| {
            let bytes = if s.is_empty() && d == safetensors::Dtype::F32 {
                scale.to_le_bytes().to_vec()
            } else {
                vec![0u8; s.iter().product::<usize>() * d.bitsize() / 8]
            };
            (n, d, s, bytes)
        })
        .collect();
    let views = data.iter().map(|(n, d, s, b)| (n.clone(), TensorView::new(*d, s.clone(), b).unwrap()));
    std::fs::write(dir.join("model.safetensors"), safetensors::serialize(views, None).unwrap()).unwrap();
    dir
}

#[test]
fn every_problem_is_reported() {
    let dir = write_edited("bad", 1.0, |list| {
        list.retain(|(n, _, _)| n != "backbone.layers.0.mixer.A_log" && n != "lm_head.weight");
        for (n, d, s) in list.iter_mut() {
            if n == "backbone.layers.1.mixer.experts.3.up_proj.weight" {
                *s = vec![17, 32];
            }
            if n == "backbone.layers.2.mixer.q_proj.weight" {
                *d = safetensors::Dtype::F8_E4M3;
            }
            if n == "backbone.layers.3.norm.weight" {
                *d = safetensors::Dtype::F8_E4M3;
            }
        }
    });
    let config = Config::from_dir(&dir).unwrap();
    let ck = Checkpoint::open(&dir).unwrap();
    let msg = Layout::new(&config, &ck).unwrap_err().to_string();
    for want in [
        "(5 problems)",
        "`backbone.layers.0.mixer.A_log` [4] is missing",
        "`backbone.layers.1.mixer.experts.3.up_proj.weight` has shape [17, 32], expected [16, 32]",
        "`backbone.layers.2.mixer.q_proj.weight` is F8_E4M3 but `backbone.layers.2.mixer.q_proj.weight_scale` is missing",
        "`backbone.layers.3.norm.weight` is F8E4M3, expected BF16, F16 or F32",
        "`lm_head.weight` [64, 32] is missing",
    ] {
        assert!(msg.contains(want), "missing {want:?} in:\n{msg}");
    }
}

/// Makes the dense MLP's up projection FP8 with weight and input scales of `scale`.
fn fp8_mlp(name: &str, scale: f32) -> PathBuf {
    write_edited(name, scale, |list| {
        for (n, d, _) in list.iter_mut() {
            if n == "backbone.layers.3.mixer.up_proj.weight" {
                *d = safetensors::Dtype::F8_E4M3;
            }
        }
        list.push(("backbone.layers.3.mixer.up_proj.weight_scale".into(), safetensors::Dtype::F32, vec![]));
        list.push(("backbone.layers.3.mixer.up_proj.input_scale".into(), safetensors::Dtype::F32, vec![]));
    })
}

#[test]
fn fp8_linear_with_scales() {
    let dir = fp8_mlp("fp8", 0.5);
    let config = Config::from_dir(&dir).unwrap();
    let ck = Checkpoint::open(&dir).unwrap();
    let layout = Layout::new(&config, &ck).unwrap();
    let Mixer::Mlp(mlp) = &layout.layers[3].mixer else { panic!("layer 3 is the dense MLP") };
    assert_eq!(mlp.up.fp8, Some(Fp8Scales { weight_scale: 0.5, input_scale: Some(0.5) }));
    assert_eq!(mlp.down.fp8, None);
}

#[test]
fn fp8_scales_must_be_positive() {
    let dir = fp8_mlp("fp8-zero", 0.0);
    let config = Config::from_dir(&dir).unwrap();
    let ck = Checkpoint::open(&dir).unwrap();
    let msg = Layout::new(&config, &ck).unwrap_err().to_string();
    assert!(msg.contains("`backbone.layers.3.mixer.up_proj.weight_scale` is 0, expected a finite scale > 0"), "{msg}");
}
