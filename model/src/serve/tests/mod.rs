//! The chat handler over a scripted engine ([`scripted`]): outputs the random built-in model
//! would never write, reasoning and tool calls, through the request's checks, detokenizing,
//! the output parser and the JSON body or SSE chunks; `server.rs` the server around the
//! handlers, `output.rs` what becomes of an output's tokens.

use std::sync::Arc;
use std::time::Duration;

use axum::body::Bytes;
use axum::http::StatusCode;
use serde_json::{Value, json};
use tower::ServiceExt;

use super::{BODY_LIMIT, Served, chat, scripted};
use crate::engine::Finish;

const CALL: &str = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n\
    <parameter=days>\n3\n</parameter>\n</function>\n</tool_call>";
/// Reasoning (the prompt opened `<think>`), content, a tool call.
const OUTPUT: &str = "Paris, then.\n</think>\nLet me look.\n";

fn tools() -> Value {
    json!([{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object",
        "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}])
}

/// A server whose engine writes `text` for every request, then the eos id.
fn writing(text: impl Into<String>) -> Arc<Served> {
    let text = text.into();
    scripted::built_in(move |turn| turn.write(&text))
}

/// The handler's status and body for a chat request.
async fn post(s: &Arc<Served>, body: Value) -> (StatusCode, String) {
    let r = chat::handle(s.clone(), Bytes::from(body.to_string())).await.unwrap_or_else(|e| {
        panic!("{body}: {e:?}");
    });
    let status = r.status();
    let bytes = axum::body::to_bytes(r.into_body(), usize::MAX).await.expect("the body");
    (status, String::from_utf8(bytes.to_vec()).expect("UTF-8"))
}

/// A request through `app`: the answer's status, headers and body (text).
async fn respond(
    app: &axum::Router,
    req: axum::http::Request<axum::body::Body>,
) -> (StatusCode, axum::http::HeaderMap, String) {
    let r = app.clone().oneshot(req).await.expect("infallible");
    let (status, headers) = (r.status(), r.headers().clone());
    let body = axum::body::to_bytes(r.into_body(), usize::MAX).await.expect("the body");
    (status, headers, String::from_utf8(body.to_vec()).expect("UTF-8"))
}

/// The `data:` of each server-sent event, `[DONE]` last.
fn events(body: &str) -> Vec<String> {
    body.split("\n\n").filter(|e| !e.is_empty()).map(|e| e.strip_prefix("data: ").expect(e).to_string()).collect()
}

/// A chat answer's choices with their message (streamed: each chunk's, with its delta).
fn replies(body: &str, stream: bool) -> Vec<(Value, Value)> {
    let chunks: Vec<Value> = match stream {
        true => events(body).iter().filter(|e| *e != "[DONE]").map(|e| serde_json::from_str(e).unwrap()).collect(),
        false => vec![serde_json::from_str(body).unwrap()],
    };
    let part = if stream { "delta" } else { "message" };
    chunks.iter().map(|c| (c["choices"][0].clone(), c["choices"][0][part].clone())).collect()
}

fn request(stream: bool) -> Value {
    json!({"messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": tools(), "stream": stream})
}

mod output;
mod server;

#[tokio::test]
async fn tool_calls_and_reasoning_in_a_response() {
    let s = writing(format!("{OUTPUT}{CALL}"));
    let (status, body) = post(&s, request(false)).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    let choice = &v["choices"][0];
    assert_eq!(choice["finish_reason"], "tool_calls", "{v}");
    let m = &choice["message"];
    assert_eq!((m["reasoning"].as_str(), m["content"].as_str()), (Some("Paris, then.\n"), Some("\nLet me look.\n")));
    assert_eq!(m["reasoning_content"], m["reasoning"], "reasoning under its former name too");
    let calls = m["tool_calls"].as_array().expect("tool_calls");
    assert_eq!(calls.len(), 1, "{m}");
    assert!(calls[0]["id"].as_str().is_some_and(|id| id.starts_with("call_")), "{m}");
    assert_eq!(calls[0]["type"], "function");
    assert_eq!(calls[0]["function"], json!({"name": "get_weather", "arguments": r#"{"city": "Paris", "days": 3}"#}));
}

#[tokio::test]
async fn tool_calls_and_reasoning_in_a_stream() {
    let s = writing(format!("{OUTPUT}{CALL}"));
    let (status, body) = post(&s, request(true)).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let events = events(&body);
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"), "{body}");
    let chunks: Vec<Value> = events[..events.len() - 1].iter().map(|e| serde_json::from_str(e).unwrap()).collect();
    let (mut reasoning, mut former, mut content) = (String::new(), String::new(), String::new());
    let (mut calls, mut finish) = (vec![], vec![]);
    for c in &chunks {
        assert_eq!(c["object"], "chat.completion.chunk");
        let choice = &c["choices"][0];
        let d = &choice["delta"];
        reasoning += d["reasoning"].as_str().unwrap_or("");
        former += d["reasoning_content"].as_str().unwrap_or("");
        content += d["content"].as_str().unwrap_or("");
        calls.extend(d["tool_calls"].as_array().into_iter().flatten().cloned());
        finish.extend(choice["finish_reason"].as_str().map(str::to_string));
    }
    assert_eq!((reasoning.as_str(), content.as_str()), ("Paris, then.\n", "\nLet me look.\n"));
    assert_eq!(former, reasoning);
    assert_eq!(finish, ["tool_calls"], "one finish reason, on the last choice chunk");
    assert_eq!(chunks.last().unwrap()["choices"][0]["finish_reason"], "tool_calls");
    // As OpenAI streams a call: its id, type and name first, then the arguments in pieces
    // (each parameter's once its value has ended).
    let (first, rest) = calls.split_first().expect("tool_calls deltas");
    assert!(first["id"].as_str().is_some_and(|id| id.starts_with("call_")), "{first}");
    assert_eq!((first["index"].as_u64(), first["type"].as_str()), (Some(0), Some("function")));
    assert_eq!(first["function"], json!({"name": "get_weather", "arguments": ""}));
    assert!(rest.len() >= 3, "the arguments come in pieces: {rest:?}");
    let mut arguments = String::new();
    for d in rest {
        assert_eq!((d["index"].as_u64(), d.get("id"), d["function"].get("name")), (Some(0), None, None), "{d}");
        arguments += d["function"]["arguments"].as_str().expect("an arguments piece");
    }
    assert_eq!(arguments, r#"{"city": "Paris", "days": 3}"#);
}

#[tokio::test]
async fn without_tools_or_with_tool_choice_none_a_call_is_content() {
    let s = writing(CALL);
    for body in [
        json!({"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"enable_thinking": false}}),
        json!({"messages": [{"role": "user", "content": "hi"}], "tools": tools(), "tool_choice": "none",
               "chat_template_kwargs": {"enable_thinking": false}}),
    ] {
        let v: Value = serde_json::from_str(&post(&s, body.clone()).await.1).unwrap();
        let choice = &v["choices"][0];
        assert_eq!(
            (choice["finish_reason"].as_str(), choice["message"]["content"].as_str()),
            (Some("stop"), Some(CALL)),
            "{body}"
        );
        assert!(choice["message"].get("tool_calls").is_none() && choice["message"].get("reasoning").is_none(), "{v}");
    }
}

/// What the server cannot honour (an unknown `tool_choice`, a call to a function not offered,
/// `required` without tools, a forced call beside a structured output, the legacy functions, a
/// structured output that does not compile) is a 400 naming the field; `tool_choice: "auto"`
/// is the default.
#[tokio::test]
async fn a_call_or_format_that_cannot_be_forced_is_refused() {
    let s = writing(format!("{OUTPUT}{CALL}"));
    for (extra, param) in [
        (json!({"tool_choice": {"type": "function", "function": {"name": "get_time"}}}), "tool_choice"),
        (json!({"tool_choice": "required", "tools": []}), "tool_choice"),
        (json!({"tool_choice": "required", "guided_regex": "x"}), "guided_regex"),
        (json!({"tool_choice": "sometimes"}), "tool_choice"),
        (json!({"functions": [{"name": "get_weather"}]}), "functions"),
        (json!({"structured_outputs": {"regex": "(unclosed"}}), "structured_outputs.regex"),
        (
            json!({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "nope"}}}}),
            "response_format",
        ),
    ] {
        let mut body = request(false);
        body.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        let e = chat::handle(s.clone(), Bytes::from(body.to_string())).await.expect_err("a refusal");
        assert_eq!((e.status, e.param.as_deref()), (StatusCode::BAD_REQUEST, Some(param)), "{body}: {e:?}");
    }
    let mut body = request(false);
    body["tool_choice"] = json!("auto");
    let v: Value = serde_json::from_str(&post(&s, body).await.1).unwrap();
    assert_eq!(v["choices"][0]["finish_reason"], "tool_calls", "{v}");
}

/// A non-streamed request whose handler is dropped mid-generation (as hyper drops it when the
/// client disconnects) closes its token channel: the engine thread then cancels it.
#[tokio::test]
async fn a_dropped_response_closes_its_channel() {
    let (tx, rx) = std::sync::mpsc::channel();
    let s = scripted::built_in(move |turn| {
        turn.send(u32::from(b'a'), None);
        let _ = tx.send(turn.out);
    });
    let handler = post(&s, json!({"messages": [{"role": "user", "content": "hi"}]}));
    assert!(tokio::time::timeout(Duration::from_millis(300), handler).await.is_err(), "no last token: no answer");
    let out = rx.recv_timeout(Duration::from_secs(10)).expect("the request reached the engine");
    assert!(out.is_closed(), "the dropped handler closed the request's channel");
}

/// Nemotron-3 Nano's tokenizer shape (tests/fixtures/nano_tokenizer: its first 18 ids, `<think>`
/// 12 to `</tool_response>` 17, eos ids 2 and 11) with the parser's tags marked special or not
/// (the public checkpoint's flags for them are not confirmed): reasoning, content and a tool call
/// are parsed from the generated ids either way, streamed and not, and no special token's text
/// (the eos) reaches the content. Seen red with special tags skipped by the detokenizer.
#[tokio::test]
async fn reasoning_and_calls_with_nano_token_ids_special_or_not() {
    let fixture = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/nano_tokenizer");
    let mut checked = 0;
    for special in [false, true] {
        let dir = std::env::temp_dir().join(format!("nemotron-nano-tok-{special}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        for f in ["tokenizer_config.json", "generation_config.json"] {
            std::fs::copy(fixture.join(f), dir.join(f)).unwrap();
        }
        let mut tok: Value =
            serde_json::from_str(&std::fs::read_to_string(fixture.join("tokenizer.json")).unwrap()).unwrap();
        for t in tok["added_tokens"].as_array_mut().unwrap() {
            if (12..=15).contains(&t["id"].as_u64().unwrap()) {
                t["special"] = json!(special);
            }
        }
        std::fs::write(dir.join("tokenizer.json"), tok.to_string()).unwrap();
        let ids = Arc::new(std::sync::Mutex::new(Vec::new()));
        let seen = ids.clone();
        let s = scripted::from_dir(&dir, super::special::SpecialInContent::Allow, move |turn| {
            let out: Vec<u32> = turn.tokenizer().encode(format!("{OUTPUT}{CALL}"), false).unwrap().get_ids().to_vec();
            *seen.lock().unwrap() = out;
            turn.write(&format!("{OUTPUT}{CALL}"));
        });
        assert_eq!(s.chat.stop_ids(), [2, 11], "generation_config.json's eos ids");
        for stream in [false, true] {
            let (status, body) = post(&s, request(stream)).await;
            assert_eq!(status, StatusCode::OK, "{body}");
            let generated = ids.lock().unwrap().clone();
            // `</think>` and `<tool_call>` came as their single ids.
            assert!(generated.contains(&13) && generated.contains(&14) && generated.contains(&15), "{generated:?}");
            let (mut reasoning, mut content, mut args) = (String::new(), String::new(), String::new());
            for (_, d) in &replies(&body, stream) {
                reasoning += d["reasoning"].as_str().unwrap_or("");
                content += d["content"].as_str().unwrap_or("");
                for call in d["tool_calls"].as_array().into_iter().flatten() {
                    args += call["function"]["arguments"].as_str().unwrap_or("");
                }
            }
            let label = format!("special {special}, stream {stream}");
            assert_eq!(
                (reasoning.as_str(), content.as_str()),
                ("Paris, then.\n", "\nLet me look.\n"),
                "{label}: {body}"
            );
            assert_eq!(serde_json::from_str::<Value>(&args).unwrap(), json!({"city": "Paris", "days": 3}), "{label}");
            assert!(!body.contains("</s>") && !body.contains("<|im_end|>"), "{label}: {body}");
            checked += 1;
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
    assert_eq!(checked, 4);
}

/// A forced call (`tool_choice` a named function, or `required`) is the output's JSON (which
/// the structured output holds to the tools' schema; here the script writes it) made into tool
/// calls, as vLLM makes them: no content, finish reason `tool_calls`, streamed and not.
#[tokio::test]
async fn forced_calls_are_made_of_the_json() {
    let named = r#"{"city": "Paris", "days": 3}"#;
    let listed = r#"[{"name": "get_weather", "parameters": {"city": "Rome"}}, {"name": "get_weather", "parameters": {"days": 2}}]"#;
    let cases = [
        (
            json!({"type": "function", "function": {"name": "get_weather"}}),
            named,
            vec![json!({"city": "Paris", "days": 3})],
        ),
        (json!("required"), listed, vec![json!({"city": "Rome"}), json!({"days": 2})]),
    ];
    let mut checked = 0;
    for (choice, output, want) in cases {
        let s = writing(format!("Thinking.\n</think>\n{output}"));
        for stream in [false, true] {
            let mut body = request(stream);
            body["tool_choice"] = choice.clone();
            let (status, text) = post(&s, body).await;
            assert_eq!(status, StatusCode::OK, "{text}");
            let (mut calls, mut content, mut finish): (Vec<(String, String)>, String, Vec<String>) =
                (vec![], String::new(), vec![]);
            for (choice, d) in &replies(&text, stream) {
                content += d["content"].as_str().unwrap_or("");
                for call in d["tool_calls"].as_array().into_iter().flatten() {
                    let f = &call["function"];
                    match f["name"].as_str() {
                        Some(name) => calls.push((name.to_string(), f["arguments"].as_str().unwrap_or("").to_string())),
                        None => calls.last_mut().unwrap().1 += f["arguments"].as_str().unwrap_or(""),
                    }
                }
                finish.extend(choice["finish_reason"].as_str().map(str::to_string));
            }
            let args: Vec<Value> = calls
                .iter()
                .map(|(n, a)| {
                    assert_eq!(n, "get_weather");
                    serde_json::from_str(a).unwrap()
                })
                .collect();
            assert_eq!(
                (args, content.as_str(), finish),
                (want.clone(), "", vec!["tool_calls".to_string()]),
                "{choice} stream {stream}: {text}"
            );
            checked += 1;
        }
    }
    assert_eq!(checked, 4);
}
