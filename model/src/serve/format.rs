//! Structured outputs as clients ask for them ([`read`]): OpenAI's `response_format`
//! (`json_object`, `json_schema`), vLLM's `structured_outputs` (`json`, `regex`, `choice`,
//! `grammar`: a Lark grammar, `json_object`) and its older `guided_json`, `guided_regex`,
//! `guided_choice`, `guided_grammar`, and llama-server's top-level `json_schema`. One of them
//! a request; llama-server's `grammar` (GBNF) and vLLM's other structured-output options are
//! refused by name.

use serde_json::Value;

use super::api::{ApiError, Fields};
use crate::structured::Format;

/// The request's structured output and the field it came in, if it asks for one.
pub fn read(f: &Fields) -> Result<Option<(Format, String)>, ApiError> {
    let mut found: Vec<(Format, String)> = Vec::new();
    if let Some(r) = f.object("response_format")? {
        let r = Fields(r);
        match r.str("type")? {
            Some("text") => {}
            Some("json_object") => found.push((Format::JsonObject, "response_format".into())),
            Some("json_schema") => {
                let bad = || {
                    invalid("response_format", "`response_format.json_schema.schema` must be a JSON schema (an object)")
                };
                let spec = r.object("json_schema").map_err(|_| bad())?.ok_or_else(bad)?;
                let schema = spec.get("schema").filter(|s| s.is_object()).ok_or_else(bad)?;
                found.push((Format::JsonSchema(schema.clone()), "response_format".into()));
            }
            Some(t) => {
                let message =
                    format!("`response_format` type `{t}` is not one of `text`, `json_object`, `json_schema`");
                return Err(invalid("response_format", &message));
            }
            None => return Err(invalid("response_format", "`response_format` needs a `type`")),
        }
    }
    if let Some(s) = f.object("structured_outputs")? {
        for (key, value) in s {
            let field = format!("structured_outputs.{key}");
            if let Some(format) = kind(key, value, &field)? {
                found.push((format, field));
            }
        }
    }
    for (name, key) in
        [("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"), ("guided_grammar", "grammar")]
    {
        if let Some(value) = f.get_raw(name).filter(|v| !v.is_null()) {
            found.extend(kind(key, value, name)?.map(|format| (format, name.to_string())));
        }
    }
    if let Some(schema) = f.object("json_schema")? {
        found.push((Format::JsonSchema(Value::Object(schema.clone())), "json_schema".into()));
    }
    f.refuse(
        &["grammar"],
        "llama-server's GBNF grammars are not read here: give a Lark grammar as `structured_outputs.grammar`",
    )?;
    match found.len() {
        0 | 1 => Ok(found.pop()),
        _ => {
            let names: Vec<String> = found.iter().map(|(_, n)| format!("`{n}`")).collect();
            Err(invalid(&found[1].1, &format!("one structured output a request: {} were given", names.join(", "))))
        }
    }
}

/// One of vLLM's structured-output kinds (`key`, as `structured_outputs` names it) given as
/// `value` in `field`; `None` where it asks for nothing (null, `json_object: false`).
fn kind(key: &str, value: &Value, field: &str) -> Result<Option<Format>, ApiError> {
    let wrong = |want: &str| invalid(field, &format!("`{field}` must be {want}"));
    Ok(Some(match (key, value) {
        (_, Value::Null) | ("json_object", Value::Bool(false)) => return Ok(None),
        ("json", Value::Object(_)) => Format::JsonSchema(value.clone()),
        ("json", Value::String(s)) => match serde_json::from_str::<Value>(s) {
            Ok(schema @ Value::Object(_)) => Format::JsonSchema(schema),
            _ => return Err(wrong("a JSON schema (an object, or a string that holds one)")),
        },
        ("json", _) => return Err(wrong("a JSON schema (an object, or a string that holds one)")),
        ("json_object", Value::Bool(true)) => Format::JsonObject,
        ("json_object", _) => return Err(wrong("a boolean")),
        ("regex", Value::String(rx)) => Format::Regex(rx.clone()),
        ("regex", _) => return Err(wrong("a regular expression (a string)")),
        ("grammar", Value::String(lark)) => Format::Lark(lark.clone()),
        ("grammar", _) => return Err(wrong("a Lark grammar (a string)")),
        ("choice", Value::Array(list)) if !list.is_empty() => {
            let choices: Option<Vec<String>> = list.iter().map(|c| c.as_str().map(str::to_string)).collect();
            Format::Choice(choices.ok_or_else(|| wrong("a non-empty list of strings"))?)
        }
        ("choice", _) => return Err(wrong("a non-empty list of strings")),
        _ => {
            return Err(invalid(
                field,
                &format!("`{field}` is not supported: give one of `json`, `regex`, `choice`, `grammar`, `json_object`"),
            ));
        }
    }))
}

fn invalid(field: &str, message: &str) -> ApiError {
    ApiError::invalid(Some(field), message.to_string())
}

#[cfg(test)]
mod tests {
    use serde_json::{Map, json};

    use super::*;

    fn read_body(body: &str) -> Result<Option<(Format, String)>, ApiError> {
        read(&Fields(&serde_json::from_str::<Map<String, Value>>(body).unwrap()))
    }

    #[test]
    fn every_spelling_of_a_structured_output() {
        let schema = json!({"type": "object", "properties": {"a": {"type": "integer"}}});
        let s = schema.to_string();
        let cases = [
            (r#"{}"#.to_string(), None),
            (r#"{"response_format": {"type": "text"}}"#.into(), None),
            (r#"{"response_format": {"type": "json_object"}}"#.into(), Some((Format::JsonObject, "response_format"))),
            (
                format!(
                    r#"{{"response_format": {{"type": "json_schema", "json_schema": {{"name": "x", "schema": {s}}}}}}}"#
                ),
                Some((Format::JsonSchema(schema.clone()), "response_format")),
            ),
            (
                format!(r#"{{"structured_outputs": {{"json": {s}}}}}"#),
                Some((Format::JsonSchema(schema.clone()), "structured_outputs.json")),
            ),
            (
                format!(r#"{{"guided_json": {}}}"#, Value::String(s.clone())),
                Some((Format::JsonSchema(schema.clone()), "guided_json")),
            ),
            (format!(r#"{{"json_schema": {s}}}"#), Some((Format::JsonSchema(schema.clone()), "json_schema"))),
            (
                r#"{"structured_outputs": {"regex": "[a-z]+"}}"#.into(),
                Some((Format::Regex("[a-z]+".into()), "structured_outputs.regex")),
            ),
            (r#"{"guided_regex": "x|y"}"#.into(), Some((Format::Regex("x|y".into()), "guided_regex"))),
            (
                r#"{"structured_outputs": {"choice": ["a", "b"]}}"#.into(),
                Some((Format::Choice(vec!["a".into(), "b".into()]), "structured_outputs.choice")),
            ),
            (r#"{"guided_choice": ["yes"]}"#.into(), Some((Format::Choice(vec!["yes".into()]), "guided_choice"))),
            (
                r#"{"structured_outputs": {"grammar": "start: \"x\""}}"#.into(),
                Some((Format::Lark("start: \"x\"".into()), "structured_outputs.grammar")),
            ),
            (
                r#"{"guided_grammar": "start: \"y\""}"#.into(),
                Some((Format::Lark("start: \"y\"".into()), "guided_grammar")),
            ),
            (
                r#"{"structured_outputs": {"json_object": true}}"#.into(),
                Some((Format::JsonObject, "structured_outputs.json_object")),
            ),
            (r#"{"structured_outputs": {"json_object": false, "regex": null}}"#.into(), None),
        ];
        for (body, want) in cases {
            let got = read_body(&body).unwrap_or_else(|e| panic!("{body}: {e:?}"));
            assert_eq!(got, want.map(|(f, n)| (f, n.to_string())), "{body}");
        }
    }

    #[test]
    fn bad_or_several_are_refused_naming_the_field() {
        let cases = [
            (r#"{"response_format": {"type": "xml"}}"#, "response_format"),
            (r#"{"response_format": {}}"#, "response_format"),
            (r#"{"response_format": {"type": "json_schema"}}"#, "response_format"),
            (r#"{"response_format": {"type": "json_schema", "json_schema": {"schema": 3}}}"#, "response_format"),
            (r#"{"structured_outputs": {"json": 7}}"#, "structured_outputs.json"),
            (r#"{"structured_outputs": {"json": "not json"}}"#, "structured_outputs.json"),
            (r#"{"structured_outputs": {"choice": []}}"#, "structured_outputs.choice"),
            (r#"{"structured_outputs": {"choice": ["a", 1]}}"#, "structured_outputs.choice"),
            (r#"{"structured_outputs": {"structural_tag": "x"}}"#, "structured_outputs.structural_tag"),
            (r#"{"guided_regex": 5}"#, "guided_regex"),
            (r#"{"grammar": "root ::= \"x\""}"#, "grammar"),
            (r#"{"json_schema": {"type": "object"}, "guided_regex": "x"}"#, "json_schema"),
            (r#"{"structured_outputs": {"regex": "a", "choice": ["b"]}}"#, "structured_outputs.choice"),
        ];
        for (body, field) in cases {
            let e = read_body(body).expect_err(body);
            assert_eq!(e.param.as_deref(), Some(field), "{body}: {}", e.message);
        }
        let e = read_body(r#"{"guided_regex": "x", "response_format": {"type": "json_object"}}"#).unwrap_err();
        assert!(
            e.message.contains("one structured output a request") && e.message.contains("`guided_regex`"),
            "{}",
            e.message
        );
    }
}
