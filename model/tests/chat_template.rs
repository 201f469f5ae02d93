//! Chat templates rendered by `ChatTemplate` against transformers' `apply_chat_template` on
//! the same conversations (recorded by scripts/record_chat_fixture.py into
//! tests/fixtures/chat/rendered.json): the built-in model's template (the form of Nemotron-3
//! Nano's) and a second ChatML template; and the built-in model's chat tokens and eos ids.

use std::path::{Path, PathBuf};

use model::chat::{ChatTemplate, generation_eos_ids, prompt_opens_reasoning};
use serde_json::{Map, Value};

fn built_in_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("assets/default")
}

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/chat")
}

fn templates() -> (ChatTemplate, ChatTemplate) {
    let built_in = ChatTemplate::from_dir(&built_in_dir()).unwrap().expect("the built-in model has a chat template");
    let config: Value =
        serde_json::from_str(&std::fs::read_to_string(built_in_dir().join("tokenizer_config.json")).unwrap()).unwrap();
    let second_src = std::fs::read_to_string(fixtures().join("second_template.jinja")).unwrap();
    let second = ChatTemplate::from_config(&config, Some(second_src)).unwrap().unwrap();
    (built_in, second)
}

/// The messages with each tool call's arguments as a JSON string, as OpenAI clients send them.
fn arguments_as_strings(messages: &Value) -> Value {
    let mut messages = messages.clone();
    for m in messages.as_array_mut().unwrap() {
        if let Some(Value::Array(calls)) = m.get_mut("tool_calls") {
            for call in calls {
                let args = &mut call["function"]["arguments"];
                *args = Value::String(args.to_string());
            }
        }
    }
    messages
}

/// Renders every case of a recorded fixture and compares with transformers' text; returns
/// how many were compared. Templates: the built-in model's, the second one, or those whose
/// source the fixture holds (`sources`, from the script's `--extra`).
fn check_fixture(path: &Path) -> usize {
    let fixture: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let (built_in, second) = templates();
    let config: Value =
        serde_json::from_str(&std::fs::read_to_string(built_in_dir().join("tokenizer_config.json")).unwrap()).unwrap();
    let mut extra = std::collections::HashMap::new();
    for (name, source) in fixture["sources"].as_object().into_iter().flatten() {
        let t = ChatTemplate::from_config(&config, Some(source.as_str().unwrap().to_string()));
        extra.insert(name.clone(), t.unwrap_or_else(|e| panic!("{name}: {e}")).unwrap());
    }
    let mut compared = 0;
    for case in fixture["cases"].as_array().unwrap() {
        let name = case["template"].as_str().unwrap();
        let template = match name {
            _ if extra.contains_key(name) => &extra[name],
            "built_in" => &built_in,
            "second" => &second,
            other => panic!("unknown template {other}"),
        };
        let name = format!("{}/{}", case["template"], case["name"]);
        let tools = (!case["tools"].is_null()).then_some(&case["tools"]);
        let kwargs: Map<String, Value> = case["kwargs"].as_object().unwrap().clone();
        let add = case["add_generation_prompt"].as_bool().unwrap();
        let want = case["text"].as_str().unwrap();
        let got = template.render(&case["messages"], tools, add, &kwargs).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(got, want, "{name}: rendered text differs from transformers {}", fixture["transformers"]);
        let strings = template.render(&arguments_as_strings(&case["messages"]), tools, add, &kwargs).unwrap();
        assert_eq!(strings, want, "{name}: with tool-call arguments as JSON strings");
        compared += 1;
    }
    compared
}

#[test]
fn renders_as_transformers_does() {
    assert_eq!(check_fixture(&fixtures().join("rendered.json")), 20, "cases compared");
    // Another recorded fixture, when given (scripts/record_chat_fixture.py --extra).
    if let Some(path) = std::env::var_os("NEMOTRON_CHAT_FIXTURE") {
        assert!(check_fixture(Path::new(&path)) > 0, "no cases in {path:?}");
    }
}

#[test]
fn built_in_template_refuses_unknown_roles_and_opens_reasoning() {
    let (built_in, _) = templates();
    let none = Map::new();
    let err = built_in.render(&serde_json::json!([{"role": "robot", "content": "x"}]), None, true, &none).unwrap_err();
    assert!(err.to_string().contains("unknown role `robot`"), "{err}");
    let user = serde_json::json!([{"role": "user", "content": "hi"}]);
    let on = built_in.render(&user, None, true, &none).unwrap();
    assert!(on.ends_with("<|im_start|>assistant\n<think>\n") && prompt_opens_reasoning(&on), "{on}");
    let mut off = Map::new();
    off.insert("enable_thinking".into(), Value::Bool(false));
    let off = built_in.render(&user, None, true, &off).unwrap();
    assert!(off.ends_with("<think></think>") && !prompt_opens_reasoning(&off), "{off}");
}

#[test]
fn built_in_model_has_chat_tokens_and_stops_at_end_of_turn() {
    let tokenizer = tokenizers::Tokenizer::from_file(built_in_dir().join("tokenizer.json")).unwrap();
    let id = |t: &str| tokenizer.token_to_id(t).unwrap_or_else(|| panic!("{t} is not a token"));
    let im_end = id("<|im_end|>");
    for tag in ["<|im_start|>", "<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>"] {
        let enc = tokenizer.encode(format!("a{tag}b"), false).unwrap();
        assert_eq!(enc.get_ids(), [u32::from(b'a'), id(tag), u32::from(b'b')], "{tag} is one token");
    }
    // The output parser's tags survive a decode that skips special tokens; turn markers do not.
    let text = tokenizer.decode(&[id("<|im_start|>"), id("<think>"), 104, id("</think>"), im_end], true).unwrap();
    assert_eq!(text, "<think>h</think>");
    assert_eq!(generation_eos_ids(&built_in_dir()).unwrap(), [im_end, 256]);
    let config = model::Config::from_dir(&built_in_dir()).unwrap();
    assert!(tokenizer.get_vocab_size(true) <= config.vocab_size, "every token has an embedding row");
}

/// generation_config.json read strictly: absent, its ids (and config.json's) without repeats;
/// not JSON, or an `eos_token_id` that is not token ids, an error naming the file.
#[test]
fn a_corrupt_generation_config_is_an_error_naming_it() {
    let dir = std::env::temp_dir().join(format!("nemotron-eos-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("config.json"), r#"{"eos_token_id": 2}"#).unwrap();
    assert_eq!(generation_eos_ids(&dir).unwrap(), [2], "config.json alone");
    std::fs::write(dir.join("generation_config.json"), r#"{"eos_token_id": [7, 2]}"#).unwrap();
    assert_eq!(generation_eos_ids(&dir).unwrap(), [7, 2]);
    for (text, says) in [
        ("{nope", "is not valid JSON"),
        (r#"{"eos_token_id": "7"}"#, "`eos_token_id` must be a token id or a list of them"),
        (r#"{"eos_token_id": [7, -1]}"#, "`eos_token_id` must be"),
        (r#"{"eos_token_id": 4294967296}"#, "`eos_token_id` must be"),
    ] {
        std::fs::write(dir.join("generation_config.json"), text).unwrap();
        let e = generation_eos_ids(&dir).unwrap_err();
        assert!(e.contains("generation_config.json") && e.contains(says), "{text}: {e}");
    }
    std::fs::remove_dir_all(dir).unwrap();
}
