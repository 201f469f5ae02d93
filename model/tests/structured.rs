//! Structured outputs (`model::structured`) on the built-in model (random weights, CPU): for
//! 20 JSON schemas (nested objects, enums, arrays, bounded numbers and strings) the output,
//! greedy and sampled, parses and validates against its schema (checked by the `jsonschema`
//! crate, not by llguidance) and the request ends by itself; regular expressions, choices and
//! Lark grammars hold too; a free row batched with constrained ones gives the tokens it gives
//! alone; a constraint that waits for the end of the reasoning lets the reasoning run free.

mod common;

use model::cpu::Cpu;
use model::engine::{Constraint, Engine, Event, Finish, RequestId, RequestParams};
use model::model::Model;
use model::sampling::SamplingParams;
use model::structured::{Format, Structured};
use serde_json::{Value as Json, json};
use tokenizers::Tokenizer;

struct Setup {
    engine: Engine<Cpu>,
    tokenizer: Tokenizer,
    structured: Structured,
    eos: Vec<u32>,
    prompt: Vec<u32>,
}

fn setup(slots: usize) -> Setup {
    let dir = model::built_in::dir().unwrap();
    let model = Model::from_dir(Cpu::default(), &dir, slots, 1024, &mut |_, _| {}).unwrap();
    let vocab = model.vocab();
    let tokenizer = Tokenizer::from_file(dir.join("tokenizer.json")).unwrap();
    let eos = model::chat::generation_eos_ids(&dir).unwrap();
    let structured = Structured::new(&tokenizer, vocab, &eos).unwrap();
    let prompt = tokenizer.encode("Answer in JSON:", false).unwrap().get_ids().to_vec();
    Setup { engine: Engine::new(model), tokenizer, structured, eos, prompt }
}

fn params(s: &Setup, sampling: SamplingParams) -> RequestParams {
    RequestParams { max_new_tokens: 600, sampling, stop_tokens: s.eos.clone(), min_new_tokens: 0 }
}

/// Runs the engine until every request ends: each request's tokens and finish.
fn run(e: &mut Engine<Cpu>) -> std::collections::BTreeMap<RequestId, (Vec<u32>, Option<Finish>)> {
    let tokens = |evs: Vec<Event>| (evs.iter().map(|e| e.token).collect(), evs.last().and_then(|e| e.finished));
    common::events(e).into_iter().map(|(id, evs)| (id, tokens(evs))).collect()
}

/// The text of `tokens` without the eos ids.
fn text(s: &Setup, tokens: &[u32]) -> String {
    let kept: Vec<u32> = tokens.iter().copied().filter(|t| !s.eos.contains(t)).collect();
    s.tokenizer.decode(&kept, false).unwrap()
}

fn schemas() -> Vec<Json> {
    let short = json!({"type": "string", "maxLength": 6});
    vec![
        json!({"type": "boolean"}),
        json!({"type": "null"}),
        json!({"type": "integer", "minimum": 0, "maximum": 9}),
        json!({"type": "integer", "minimum": -50, "maximum": 1200}),
        json!({"enum": ["red", "green", "blue"]}),
        json!({"const": "fixed"}),
        short.clone(),
        json!({"type": "string", "minLength": 2, "maxLength": 4, "pattern": "^[a-z]+$"}),
        json!({"type": "array", "items": {"type": "integer", "minimum": 1, "maximum": 3}, "minItems": 1, "maxItems": 4}),
        json!({"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 3}),
        json!({"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": false}),
        json!({"type": "object", "properties": {"name": short, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
               "required": ["name", "age"], "additionalProperties": false}),
        json!({"type": "object", "properties": {"color": {"enum": ["red", "blue"]}, "count": {"type": "integer", "minimum": 1, "maximum": 5}},
               "required": ["color"], "additionalProperties": false}),
        json!({"type": "object", "properties": {"inner": {"type": "object", "properties": {"v": {"type": "integer", "minimum": 0, "maximum": 99}},
               "required": ["v"], "additionalProperties": false}}, "required": ["inner"], "additionalProperties": false}),
        json!({"type": "object", "properties": {"tags": {"type": "array", "items": short, "maxItems": 2}},
               "required": ["tags"], "additionalProperties": false}),
        json!({"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 3}, "b": {"type": "boolean"}, "c": {"type": "null"}},
               "required": ["a", "b", "c"], "additionalProperties": false}),
        json!({"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9}, {"enum": ["none"]}]}),
        json!({"type": "array", "items": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 9}},
               "required": ["id"], "additionalProperties": false}, "minItems": 1, "maxItems": 2}),
        json!({"type": "object", "properties": {"level": {"type": "string", "enum": ["low", "high"]},
               "score": {"type": "integer", "minimum": -5, "maximum": 5}}, "required": ["level", "score"], "additionalProperties": false}),
        json!({"type": "object", "properties": {"matrix": {"type": "array", "maxItems": 2,
               "items": {"type": "array", "maxItems": 2, "items": {"type": "integer", "minimum": 0, "maximum": 1}}}},
               "required": ["matrix"], "additionalProperties": false}),
    ]
}

#[test]
fn outputs_validate_against_their_schemas() {
    let mut s = setup(4);
    let schemas = schemas();
    assert_eq!(schemas.len(), 20);
    let mut checked = 0;
    for (i, schema) in schemas.iter().enumerate() {
        let validator = jsonschema::validator_for(schema).unwrap();
        let runs = [
            SamplingParams::greedy(),
            SamplingParams::nucleus(1.0, 0.95, 11 + i as u64),
            SamplingParams { temperature: 1.5, seed: 3, ..SamplingParams::greedy() },
        ];
        let mut ids = Vec::new();
        for sampling in runs {
            let c = s.structured.constraint(&Format::JsonSchema(schema.clone()), false).unwrap();
            ids.push(s.engine.add_constrained(&s.prompt, params(&s, sampling), Some(c)).unwrap());
        }
        let out = run(&mut s.engine);
        for id in ids {
            let (tokens, finish) = &out[&id];
            let t = text(&s, tokens);
            assert_eq!(*finish, Some(Finish::Stop), "schema {i} {schema}: ended by itself, not at the length: {t:?}");
            let v: Json =
                serde_json::from_str(&t).unwrap_or_else(|e| panic!("schema {i} {schema}: {t:?} is not JSON: {e}"));
            assert!(validator.is_valid(&v), "schema {i} {schema}: {v} does not validate");
            checked += 1;
        }
    }
    println!("structured outputs: {checked} outputs of 20 schemas parsed and validated");
    assert_eq!(checked, 60);
}

/// Whether an output's text and finish are as its format wants.
type Check = dyn Fn(&str, Option<Finish>) -> bool;

/// Whether the output ended by itself.
fn stopped(f: Option<Finish>) -> bool {
    f == Some(Finish::Stop)
}

#[test]
fn regexes_choices_and_grammars_hold() {
    let mut s = setup(2);
    // Any JSON object is unbounded: random weights may write one past the length; what
    // there is must then be the start of an object.
    let object = |t: &str, f| match f {
        Some(Finish::Length) => t.starts_with('{'),
        _ => serde_json::from_str::<Json>(t).is_ok_and(|v| v.is_object()),
    };
    let cases: [(Format, &Check); 4] = [
        (Format::Regex("[0-9]{3}-[a-c]{2}".into()), &|t, f| stopped(f) && t.len() == 6 && t.as_bytes()[3] == b'-'),
        (Format::Choice(vec!["yes (sure)".into(), "no.".into(), "a|b".into()]), &|t, f| {
            stopped(f) && ["yes (sure)", "no.", "a|b"].contains(&t)
        }),
        (Format::Lark("start: \"(\" NUM (\",\" NUM)~0..2 \")\"\nNUM: /[1-9]/".into()), &|t, f| {
            stopped(f) && t.starts_with('(') && t.ends_with(')') && t.len() <= 7
        }),
        (Format::JsonObject, &object),
    ];
    let mut checked = 0;
    for (format, ok) in cases {
        for seed in 0..3 {
            let c = s.structured.constraint(&format, false).unwrap();
            let id = s
                .engine
                .add_constrained(&s.prompt, params(&s, SamplingParams::nucleus(1.0, 1.0, seed)), Some(c))
                .unwrap();
            let (tokens, finish) = run(&mut s.engine).remove(&id).unwrap();
            let t = text(&s, &tokens);
            assert!(ok(&t, finish), "{format:?} seed {seed}: {t:?} {finish:?}");
            checked += 1;
        }
    }
    assert_eq!(checked, 12);
    // What does not compile is an error, not a request.
    for bad in
        [Format::Regex("(".into()), Format::Lark("start: nope".into()), Format::JsonSchema(json!({"type": "nonsense"}))]
    {
        assert!(s.structured.constraint(&bad, false).is_err(), "{bad:?}");
    }
}

/// `tool_choice` `required`'s schema over two tools (serve::prompt::Forced, vLLM's form): a
/// non-empty list of `{"name", "parameters"}`, each one of the tools with its parameters.
#[test]
fn a_required_call_lists_the_tools_calls() {
    use model::serve::prompt::Forced;
    let mut s = setup(3);
    let tools = [
        json!({"type": "function", "function": {"name": "set_level", "parameters": {"type": "object", "additionalProperties": false,
            "required": ["level"], "properties": {"level": {"type": "integer", "minimum": 1, "maximum": 5}}}}}),
        json!({"type": "function", "function": {"name": "stop"}}),
    ];
    let schema = Forced::Required.schema(&tools);
    let validator = jsonschema::validator_for(&schema).unwrap();
    let ids: Vec<RequestId> = (0..3)
        .map(|seed| {
            let c = s.structured.constraint(&Format::JsonSchema(schema.clone()), false).unwrap();
            s.engine.add_constrained(&s.prompt, params(&s, SamplingParams::nucleus(1.0, 1.0, seed)), Some(c)).unwrap()
        })
        .collect();
    let out = run(&mut s.engine);
    for id in ids {
        let t = text(&s, &out[&id].0);
        let v: Json = serde_json::from_str(&t).unwrap_or_else(|e| panic!("{t:?}: {e}"));
        assert!(validator.is_valid(&v) && !v.as_array().unwrap().is_empty(), "{v}");
        for call in v.as_array().unwrap() {
            assert!(call["name"] == "set_level" || call["name"] == "stop", "{call}");
        }
    }
    let named = Forced::Named("set_level".into()).schema(&tools);
    assert_eq!(named, tools[0]["function"]["parameters"]);
}

/// A free row's tokens do not depend on constrained rows in its batch.
#[test]
fn a_free_row_batched_with_constrained_ones_is_unchanged() {
    let mut alone = setup(3);
    let sampling = SamplingParams::nucleus(0.9, 0.95, 5);
    let solo = alone.engine.add(&alone.prompt, params(&alone, sampling)).unwrap();
    let solo = run(&mut alone.engine).remove(&solo).unwrap();
    let mut s = setup(3);
    let free = s.engine.add(&s.prompt, params(&s, sampling)).unwrap();
    for schema in &schemas()[10..12] {
        let c = s.structured.constraint(&Format::JsonSchema(schema.clone()), false).unwrap();
        s.engine.add_constrained(&s.prompt, params(&s, SamplingParams::greedy()), Some(c)).unwrap();
    }
    let batched = run(&mut s.engine).remove(&free).unwrap();
    assert!(solo.0.len() > 8, "{solo:?}");
    assert_eq!(batched, solo);
}

/// Waiting for the end of the reasoning: until the `</think>` token the mask allows everything
/// and nothing is consumed; after it the grammar holds.
#[test]
fn a_constraint_after_reasoning_waits_for_its_end() {
    let s = setup(1);
    let end = s.tokenizer.token_to_id("</think>").expect("the built-in tokenizer has </think> as a token");
    let vocab = 266;
    let words = host::sample::mask_words(vocab);
    let mut c = s.structured.constraint(&Format::Choice(vec!["ok".into()]), true).unwrap();
    let allowed = |c: &mut Box<dyn Constraint>| {
        let mut mask = vec![u32::MAX; words];
        c.restrict(&mut mask).unwrap();
        (0..vocab as u32).filter(|&t| mask[t as usize / 32] >> (t % 32) & 1 == 1).collect::<Vec<u32>>()
    };
    assert_eq!(allowed(&mut c).len(), vocab, "free while reasoning");
    for t in s.tokenizer.encode("thinking...", false).unwrap().get_ids() {
        c.accept(*t).unwrap();
    }
    assert!(!c.complete());
    c.accept(end).unwrap();
    let o = s.tokenizer.token_to_id("o").unwrap();
    assert_eq!(allowed(&mut c), [o], "after </think>: only `ok`'s first byte");
    c.accept(o).unwrap();
    c.accept(s.tokenizer.token_to_id("k").unwrap()).unwrap();
    let after = allowed(&mut c);
    assert!(after.iter().all(|t| s.eos.contains(t)) && !after.is_empty(), "only the eos now: {after:?}");
}
