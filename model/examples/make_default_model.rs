//! Writes the small built-in model the CLI runs when no checkpoint is given:
//! `model/assets/default/{config.json, model.safetensors, tokenizer.json}`. Random weights (the
//! text it generates means nothing) and a byte-level tokenizer (every byte a token, no merges).
//!
//!     cargo run -p model --example make_default_model
//!
//! The output is committed; rerun this only to change the model.

use std::path::PathBuf;

/// A NemotronH with every layer kind, small enough to ship (about 0.5 MB).
const CONFIG: &str = r#"{
  "architectures": ["NemotronHForCausalLM"],
  "model_type": "nemotron_h",
  "vocab_size": 258,
  "hidden_size": 64,
  "hybrid_override_pattern": "ME*-ME",
  "num_hidden_layers": 6,
  "mamba_num_heads": 4,
  "mamba_head_dim": 16,
  "ssm_state_size": 16,
  "n_groups": 2,
  "conv_kernel": 4,
  "chunk_size": 128,
  "use_conv_bias": true,
  "mamba_proj_bias": false,
  "mamba_hidden_act": "silu",
  "n_routed_experts": 8,
  "num_experts_per_tok": 2,
  "moe_intermediate_size": 32,
  "moe_shared_expert_intermediate_size": 48,
  "n_group": 1,
  "topk_group": 1,
  "norm_topk_prob": true,
  "routed_scaling_factor": 2.5,
  "mlp_hidden_act": "relu2",
  "num_attention_heads": 4,
  "num_key_value_heads": 2,
  "head_dim": 16,
  "intermediate_size": 96,
  "layer_norm_epsilon": 1e-05,
  "tie_word_embeddings": false,
  "eos_token_id": 256,
  "bos_token_id": 257
}"#;

/// GPT-2's printable stand-in for each byte, as the ByteLevel pre-tokenizer maps them.
fn byte_chars() -> Vec<char> {
    let printable = |b: u32| (0x21..=0x7e).contains(&b) || (0xa1..=0xac).contains(&b) || (0xae..=0xff).contains(&b);
    let mut extra = 0;
    (0..256u32)
        .map(|b| {
            if printable(b) {
                char::from_u32(b).expect("printable latin-1")
            } else {
                extra += 1;
                char::from_u32(255 + extra).expect("U+0100 and up")
            }
        })
        .collect()
}

fn main() -> anyhow::Result<()> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("assets/default");
    model::synthetic::write_checkpoint(&dir, CONFIG, 0x5eed)?;
    let vocab: serde_json::Map<String, serde_json::Value> =
        byte_chars().into_iter().enumerate().map(|(i, c)| (c.to_string(), i.into())).collect();
    let special = |id: u32, content: &str| {
        serde_json::json!({"id": id, "content": content, "single_word": false, "lstrip": false,
                           "rstrip": false, "normalized": false, "special": true})
    };
    let byte_level =
        serde_json::json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true});
    let tokenizer = serde_json::json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": [special(256, "</s>"), special(257, "<s>")],
        "normalizer": null,
        "pre_tokenizer": byte_level,
        "post_processor": null,
        "decoder": byte_level,
        "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                  "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false,
                  "ignore_merges": false, "vocab": vocab, "merges": []}
    });
    std::fs::write(dir.join("tokenizer.json"), serde_json::to_string_pretty(&tokenizer)?)?;
    println!("wrote {}", dir.display());
    Ok(())
}
