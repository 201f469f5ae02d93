//! config.json parsing: the released Nemotron-3 Nano layout, the transformers 5.x layout, and
//! the errors a malformed or unsupported config gives.

use model::config::{CacheDtype, Config, LayerKind};

/// The values docs/MATH.md lists for Nemotron-3 Nano 30B-A3B, as its config.json writes them.
const NANO: &str = r#"{
  "architectures": ["NemotronHForCausalLM"],
  "vocab_size": 131072, "hidden_size": 2688, "num_hidden_layers": 52,
  "hybrid_override_pattern": "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME",
  "layer_norm_epsilon": 1e-05, "tie_word_embeddings": false,
  "mamba_num_heads": 64, "mamba_head_dim": 64, "ssm_state_size": 128, "n_groups": 8,
  "conv_kernel": 4, "chunk_size": 128, "use_conv_bias": true, "mamba_proj_bias": false,
  "mamba_hidden_act": "silu", "mamba_ssm_cache_dtype": "float32",
  "n_routed_experts": 128, "num_experts_per_tok": 6, "moe_intermediate_size": 1856,
  "moe_shared_expert_intermediate_size": 3712, "n_group": 1, "topk_group": 1,
  "norm_topk_prob": true, "routed_scaling_factor": 2.5, "mlp_hidden_act": "relu2",
  "num_attention_heads": 32, "num_key_value_heads": 2, "head_dim": 128, "attention_bias": false
}"#;

fn with(edit: impl FnOnce(&mut serde_json::Value)) -> String {
    let mut v: serde_json::Value = serde_json::from_str(NANO).unwrap();
    edit(&mut v);
    v.to_string()
}

fn err(text: &str) -> String {
    Config::from_json(text).unwrap_err().to_string()
}

#[test]
fn nano_config() {
    let c = Config::from_json(NANO).unwrap();
    assert_eq!(c.layer_counts(), (23, 23, 6, 0));
    assert_eq!((c.layers[0], c.layers[1], c.layers[5]), (LayerKind::Mamba, LayerKind::Moe, LayerKind::Attention));
    let m = c.mamba.as_ref().unwrap();
    assert_eq!((m.inner(), m.conv_dim(), m.in_proj_width()), (4096, 6144, 10304));
    assert_eq!(m.dt_limit, (0.0, f32::INFINITY), "absent time_step_limit is (0, inf)");
    assert_eq!(m.cache_dtype, CacheDtype::F32);
    let e = c.moe.as_ref().unwrap();
    assert_eq!((e.experts, e.top_k, e.intermediate, e.shared_intermediate), (128, 6, 1856, Some(3712)));
    assert_eq!(e.routed_scaling_factor, 2.5);
    let a = c.attention.as_ref().unwrap();
    assert_eq!((a.heads, a.kv_heads, a.head_dim), (32, 2, 128));
    assert_eq!(c.mlp_intermediate, None);
    assert_eq!(c.norm_eps, 1e-5);
}

#[test]
fn transformers_5_layout() {
    let text = with(|v| {
        let o = v.as_object_mut().unwrap();
        o.remove("hybrid_override_pattern");
        o.remove("num_hidden_layers"); // transformers 5.x does not write it
        o.insert("layers_block_type".into(), serde_json::json!(["linear_attention", "moe", "full_attention", "mlp"]));
        o.insert("intermediate_size".into(), 512.into());
        o.insert("time_step_limit".into(), serde_json::json!([0.0, {"__float__": "Infinity"}]));
        o.insert("moe_latent_size".into(), serde_json::Value::Null);
        o.insert("mtp_layers_block_type".into(), serde_json::json!(["attention", "moe"]));
    });
    let c = Config::from_json(&text).unwrap();
    assert_eq!(c.layers, vec![LayerKind::Mamba, LayerKind::Moe, LayerKind::Attention, LayerKind::Mlp]);
    assert_eq!(c.mamba.unwrap().dt_limit, (0.0, f32::INFINITY));
    assert_eq!(c.mlp_intermediate, Some(512));
}

#[test]
fn dt_limit_is_read() {
    let c = Config::from_json(&with(|v| v["time_step_limit"] = serde_json::json!([0.001, 0.1]))).unwrap();
    assert_eq!(c.mamba.unwrap().dt_limit, (0.001, 0.1));
}

#[test]
fn errors_name_the_field() {
    let cases: Vec<(String, &str)> = vec![
        (with(|v| v["hybrid_override_pattern"] = "MEX".into()), "`hybrid_override_pattern` has 'X' at layer 2"),
        (with(|v| v["num_hidden_layers"] = 51.into()), "names 52 layers, num_hidden_layers is 51"),
        (with(|v| v["hybrid_override_pattern"] = "".into()), "`hybrid_override_pattern` names no layers"),
        (with(|v| v["n_groups"] = 7.into()), "`n_groups` 7 does not divide mamba_num_heads 64"),
        (
            with(|v| v.as_object_mut().unwrap().remove("ssm_state_size").map(|_| ()).unwrap()),
            "`ssm_state_size` is missing",
        ),
        (with(|v| v["hidden_size"] = 0.into()), "`hidden_size` must be at least 1"),
        (with(|v| v["num_key_value_heads"] = 3.into()), "`num_key_value_heads` 3 does not divide"),
        (with(|v| v["mlp_hidden_act"] = "silu".into()), "`mlp_hidden_act` \"silu\" is not supported"),
        (with(|v| v["num_experts_per_tok"] = 17.into()), "top-17 of 128 experts is not supported"),
        (with(|v| v["moe_latent_size"] = 1024.into()), "latent MoE projections are not supported"),
        (
            with(|v| v["time_step_limit"] = serde_json::json!([0.1, 0.01])),
            "`time_step_limit` (0.1, 0.01) is not a range",
        ),
        (with(|v| v["mamba_ssm_cache_dtype"] = "float64".into()), "\"float64\" is not supported"),
        (with(|v| v["n_group"] = 3.into()), "cannot hold top-6"),
        ("{ not json".to_string(), "`config.json` key must be a string"),
    ];
    for (text, want) in cases {
        let got = err(&text);
        assert!(got.contains(want), "expected an error containing {want:?}, got {got:?}");
    }
}

#[test]
fn missing_file_is_an_error() {
    let got = Config::from_dir(std::path::Path::new("/nonexistent/checkpoint")).unwrap_err().to_string();
    assert!(got.contains("cannot read /nonexistent/checkpoint/config.json"), "{got}");
}

/// Sizes past the largest width the kernels index (2^31 - 1), alone or multiplied (a product
/// that wrapped past 2^64 once loaded a checkpoint written for the wrapped shapes), and a
/// million-layer pattern: short errors naming the field, before any allocation.
#[test]
fn sizes_past_the_largest_width_and_huge_patterns_are_errors() {
    let big = |f: &'static str, n: u64| (f, n, with(|v| v[f] = n.into()));
    let two = |a: &'static str, b: &'static str, n: u64| {
        (
            b,
            n,
            with(|v| {
                v[a] = n.into();
                v[b] = n.into();
            }),
        )
    };
    for (field, n, text) in [
        big("vocab_size", 1 << 33),
        big("mamba_head_dim", 1 << 40),
        big("ssm_state_size", 1 << 62),
        big("head_dim", 1 << 60),
        two("mamba_num_heads", "mamba_head_dim", 1 << 20),
        (
            "ssm_state_size",
            1 << 16,
            with(|v| {
                for f in ["mamba_num_heads", "n_groups", "ssm_state_size"] {
                    v[f] = (1u64 << 16).into();
                }
            }),
        ),
        two("num_attention_heads", "head_dim", 1 << 20),
    ] {
        let e = err(&text);
        assert!(e.contains(field) && e.len() < 300, "{field} = {n}: {e}");
        println!("{field} = {n}: {e}");
    }
    let e = err(&with(|v| {
        v["hybrid_override_pattern"] = "M".repeat(1_000_000).into();
        v["num_hidden_layers"] = 1_000_000.into();
    }));
    assert!(e.contains("names 1000000 layers") && e.len() < 200, "{e}");
}

/// Values present in config.json are checked, never silently replaced: a group count of 0
/// (it became 1), a scaling factor that is not finite and positive.
#[test]
fn present_values_are_checked_not_defaulted() {
    for (field, value) in [
        ("n_group", serde_json::json!(0)),
        ("topk_group", serde_json::json!(0)),
        ("routed_scaling_factor", serde_json::json!(-1.0)),
        ("routed_scaling_factor", serde_json::json!(0.0)),
        ("routed_scaling_factor", serde_json::json!({"__float__": "NaN"})),
        ("routed_scaling_factor", serde_json::json!({"__float__": "Infinity"})),
    ] {
        let e = err(&with(|v| v[field] = value.clone()));
        assert!(e.contains(field), "{field} = {value}: {e}");
    }
    let c = Config::from_json(&with(|v| {
        v.as_object_mut().unwrap().remove("n_group");
        v.as_object_mut().unwrap().remove("topk_group");
    }))
    .unwrap();
    assert_eq!(c.moe.as_ref().map(|m| (m.n_group, m.topk_group)), Some((1, 1)), "absent: one group");
}
