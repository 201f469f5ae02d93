//! `model::text::Llm` on the built-in model (CPU): a completion is the engine's greedy tokens
//! decoded, a chat reply is the template's prompt generated and parsed (streamed pieces merge
//! into the whole reply), an output that fails ends its request so the next starts clean, and
//! bad arguments are errors of their kind.

use model::chat::{Delta, Message, OutputParser, ParserOptions};
use model::cpu::Cpu;
use model::engine::{Engine, RequestParams};
use model::model::Model;
use model::sampling::SamplingParams;
use model::text::{Device, Generation, Llm, LoadOptions};
use serde_json::{Map, json};

fn cpu() -> LoadOptions {
    LoadOptions { device: Device::Cpu, max_len: 256, ..LoadOptions::default() }
}

fn greedy(n: usize) -> Generation {
    Generation { max_new_tokens: n, ..Generation::default() }
}

/// The built-in model's greedy ids after `prompt`, from an engine of its own.
fn engine_ids(prompt: &[u32], n: usize) -> Vec<u32> {
    let dir = model::built_in::dir().unwrap();
    let eos = model::chat::generation_eos_ids(&dir).unwrap();
    let mut engine = Engine::new(Model::from_dir(Cpu::default(), &dir, 1, 256, &mut |_, _| {}).unwrap());
    let params =
        RequestParams { max_new_tokens: n, sampling: SamplingParams::greedy(), stop_tokens: eos, min_new_tokens: 0 };
    engine.add(prompt, params).unwrap();
    let mut ids = Vec::new();
    while engine.has_work() {
        ids.extend(engine.step().unwrap().into_iter().map(|e| e.token));
    }
    ids
}

#[test]
fn a_completion_is_the_engines_tokens_decoded() {
    let mut llm = Llm::load(None, &cpu()).unwrap();
    assert_eq!(llm.backend(), "CPU reference");
    let prompt = "The capital of France is";
    let ids = llm.encode(prompt).unwrap();
    let expected = engine_ids(&ids, 24);
    assert_eq!(expected.len(), 24);
    let tok = llm.tokenizer();
    let whole = tok.decode(&[ids.clone(), expected.clone()].concat(), true).unwrap();
    let prompt_text = tok.decode(&ids, true).unwrap();
    let text = llm.complete(prompt, &greedy(24)).unwrap();
    assert_eq!(text, whole[prompt_text.len()..]);
    // The ids and the speeds come with `generate`.
    let mut streamed = String::new();
    let out = llm
        .generate(&ids, &greedy(24), &mut |s| {
            streamed.push_str(s);
            Ok(())
        })
        .unwrap();
    assert_eq!((out.tokens, out.prompt_tokens, streamed), (expected, ids.len(), text));
}

#[test]
fn a_chat_reply_is_the_template_prompt_generated_and_parsed() {
    let mut llm = Llm::load(None, &cpu()).unwrap();
    let messages = json!([{"role": "user", "content": "Hello!"}]);
    let reply = llm.chat(&messages, &greedy(20)).unwrap();
    let prompt = llm.template().unwrap().render(&messages, None, true, &Map::new()).unwrap();
    let ids = llm.encode(&prompt).unwrap();
    let generated = engine_ids(&ids, 20);
    let tok = llm.tokenizer();
    let text = tok.decode(&[ids.clone(), generated].concat(), true).unwrap();
    let opts = ParserOptions {
        reasoning: true,
        starts_in_reasoning: model::chat::prompt_opens_reasoning(&prompt),
        tools: None,
    };
    assert!(opts.starts_in_reasoning, "the built-in template opens a <think> block");
    let expected = OutputParser::parse(opts, &text[tok.decode(&ids, true).unwrap().len()..]);
    assert_eq!(reply, expected);
    assert!(reply.reasoning.is_some());
    // Streamed, the pieces merge into the same reply.
    let mut deltas: Vec<Delta> = Vec::new();
    llm.chat_stream(&messages, &greedy(20), &mut |d| {
        deltas.push(d);
        Ok(())
    })
    .unwrap();
    assert!(deltas.len() > 1, "{deltas:?}");
    assert_eq!(Message::from_deltas(deltas), reply);
    // Without thinking the template closes the block: no reasoning.
    let plain = llm.chat(&messages, &Generation { thinking: false, ..greedy(8) }).unwrap();
    assert!(plain.reasoning.is_none(), "{plain:?}");
}

#[test]
fn a_failed_output_ends_its_request() {
    let mut llm = Llm::load(None, &cpu()).unwrap();
    let clean = llm.complete("Hello", &greedy(12)).unwrap();
    let ids = llm.encode("Hello").unwrap();
    let mut pieces = 0;
    let err = llm
        .generate(&ids, &greedy(12), &mut |_| {
            pieces += 1;
            Err(std::io::Error::new(std::io::ErrorKind::BrokenPipe, "closed"))
        })
        .unwrap_err();
    assert!(matches!(err, model::Error::Io(_)), "{err}");
    assert_eq!(pieces, 1);
    // The request ended with the error: the next one runs alone and gives the same text.
    assert_eq!(llm.complete("Hello", &greedy(12)).unwrap(), clean);
}

#[test]
fn bad_arguments_are_errors_of_their_kind() {
    let err = Llm::load(Some("./no/such/checkpoint"), &cpu()).err().unwrap();
    assert!(matches!(err, model::Error::Locate(_)), "{err}");
    let mut llm = Llm::load(None, &LoadOptions { max_len: 8, ..cpu() }).unwrap();
    let err = llm.complete("Hello", &greedy(6)).unwrap_err();
    assert!(matches!(err, model::Error::Capacity(_)), "{err}");
    let bad = Generation { sampling: SamplingParams { temperature: -1.0, ..SamplingParams::greedy() }, ..greedy(4) };
    assert!(llm.complete("Hi", &bad).is_err());
    // Refused before a step: the engine is idle and serves the next request as a fresh one does.
    let mut fresh = Llm::load(None, &LoadOptions { max_len: 8, ..cpu() }).unwrap();
    assert_eq!(llm.complete("Hi", &greedy(4)).unwrap(), fresh.complete("Hi", &greedy(4)).unwrap());
    let fixture = concat!(env!("CARGO_MANIFEST_DIR"), "/../tests/fixtures/tiny_nemotron_h");
    let err = Llm::load(Some(fixture), &cpu()).err().unwrap();
    assert!(matches!(err, model::Error::Tokenizer(_)) && err.to_string().contains("no tokenizer.json"), "{err}");
}
