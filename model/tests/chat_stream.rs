//! The serving pipeline on the built-in tokenizer: tokens one at a time through a `Detok`
//! (characters split over byte tokens come out whole), a `StopMatcher`, then an
//! `OutputParser`: reasoning, content and a typed tool call come out as from the whole text,
//! and the text stops before the stop string.

use std::sync::Arc;

use model::chat::{Delta, Detok, Message, OutputParser, ParserOptions, StopMatcher};

#[test]
fn tokens_to_reasoning_content_and_tool_calls() {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/assets/default/tokenizer.json");
    let tokenizer = Arc::new(tokenizers::Tokenizer::from_file(dir).unwrap());
    let text = "<think>\nplan é😀\n</think>\nHi 日本 <tool_call>\n<function=get_weather>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>\nEND ignored<tool_call>";
    let ids = tokenizer.encode(text, false).unwrap().get_ids().to_vec();
    assert!(ids.len() < text.len(), "the tags are single tokens");
    let tools = serde_json::json!([{"type": "function", "function": {"name": "get_weather",
        "parameters": {"type": "object", "properties": {"days": {"type": "integer"}}}}}]);
    let opts = ParserOptions { reasoning: true, starts_in_reasoning: false, tools: Some(tools) };
    let mut detok = Detok::new(tokenizer.clone(), &[]);
    let mut stop = StopMatcher::new(&["END".to_string()]);
    let mut parser = OutputParser::new(opts.clone());
    let mut deltas = Vec::new();
    let mut stopped = false;
    for &id in &ids {
        let piece = detok.push(id).unwrap();
        let (safe, s) = stop.push(&piece);
        deltas.extend(parser.push(&safe));
        if s {
            stopped = true;
            break;
        }
    }
    assert!(stopped, "the stop string was found");
    deltas.extend(parser.push(&stop.finish()));
    assert_eq!(
        deltas.iter().filter(|d| matches!(d, Delta::ToolCallStart { .. })).count(),
        1,
        "the call came before the end"
    );
    deltas.extend(parser.finish());
    assert!(deltas.iter().all(|d| !matches!(d, Delta::Reasoning(t) | Delta::Content(t) if t.is_empty())));
    let got = Message::from_deltas(deltas);
    assert_eq!(got.reasoning.as_deref(), Some("\nplan é😀\n"));
    assert_eq!(got.content.as_deref(), Some("\nHi 日本 \n"));
    assert_eq!(got.tool_calls.len(), 1);
    assert_eq!(
        (got.tool_calls[0].name.as_str(), got.tool_calls[0].arguments_json.as_str()),
        ("get_weather", r#"{"days": 3}"#)
    );
    // The same as the text up to the stop string parsed at once (ids aside).
    let whole = OutputParser::parse(opts, &text[..text.find("END").unwrap()]);
    assert_eq!((whole.reasoning, whole.content), (got.reasoning, got.content));
    assert_eq!(whole.tool_calls[0].arguments_json, got.tool_calls[0].arguments_json);
}
