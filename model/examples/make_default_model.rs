//! Writes the small built-in model the CLI and the server run when no checkpoint is given:
//! `model/assets/default/{config.json, generation_config.json, model.safetensors,
//! tokenizer.json, tokenizer_config.json}`. Random weights (the text it generates means
//! nothing), a byte-level tokenizer (every byte a token, no merges) with ChatML's tokens added,
//! and a chat template (`chat_template.jinja` beside this file) in the form Nemotron-3 Nano's
//! takes: ChatML turns, `<think>` reasoning switched by `enable_thinking`, tools and qwen3_coder
//! XML tool calls. A turn ends with `<|im_end|>`, generation_config.json's eos.
//!
//!     cargo run -p model --example make_default_model
//!
//! The output is committed; rerun this only to change the model.

use std::path::PathBuf;

/// A NemotronH with every layer kind, small enough to ship (about 0.5 MB).
const CONFIG: &str = r#"{
  "architectures": ["NemotronHForCausalLM"],
  "model_type": "nemotron_h",
  "vocab_size": 266,
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

/// The tokens added after the 256 bytes, by id from 256: `(text, special)`. The chat tags the
/// output parser reads (`<think>`, `<tool_call>`, ...) are not special, so a decode that skips
/// special tokens keeps them (as Qwen3's tokenizer has them); the turn markers are.
const ADDED: [(&str, bool); 10] = [
    ("</s>", true),
    ("<s>", true),
    ("<|im_start|>", true),
    ("<|im_end|>", true),
    ("<think>", false),
    ("</think>", false),
    ("<tool_call>", false),
    ("</tool_call>", false),
    ("<tool_response>", false),
    ("</tool_response>", false),
];

/// `<|im_end|>`: the end of a turn, what generation stops at.
const IM_END: u32 = 259;

fn main() -> anyhow::Result<()> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("assets/default");
    model::synthetic::write_checkpoint(&dir, CONFIG, 0x5eed)?;
    let vocab: serde_json::Map<String, serde_json::Value> =
        byte_chars().into_iter().enumerate().map(|(i, c)| (c.to_string(), i.into())).collect();
    let added: Vec<serde_json::Value> = (256u32..)
        .zip(ADDED)
        .map(|(id, (content, special))| {
            serde_json::json!({"id": id, "content": content, "single_word": false, "lstrip": false,
                               "rstrip": false, "normalized": false, "special": special})
        })
        .collect();
    let byte_level =
        serde_json::json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true});
    let tokenizer = serde_json::json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": byte_level,
        "post_processor": null,
        "decoder": byte_level,
        "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                  "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false,
                  "ignore_merges": false, "vocab": vocab, "merges": []}
    });
    std::fs::write(dir.join("tokenizer.json"), serde_json::to_string_pretty(&tokenizer)?)?;
    let tokenizer_config = serde_json::json!({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "<|im_end|>",
        "pad_token": "</s>",
        "model_max_length": 4096,
        "chat_template": include_str!("chat_template.jinja"),
    });
    std::fs::write(dir.join("tokenizer_config.json"), serde_json::to_string_pretty(&tokenizer_config)? + "\n")?;
    let generation_config = serde_json::json!({"bos_token_id": 257, "eos_token_id": [IM_END]});
    std::fs::write(dir.join("generation_config.json"), serde_json::to_string_pretty(&generation_config)? + "\n")?;
    println!("wrote {}", dir.display());
    Ok(())
}
