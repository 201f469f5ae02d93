//! One qwen3_coder tool call read as it streams, for [`super::OutputParser`] (its module docs
//! give the rules): [`head`] decides whether the text after `<tool_call>` starts a call, and a
//! [`CallReader`] reads the rest, sending the arguments a parameter at a time.

use serde_json::{Map, Value as Json};

use super::parse::{Delta, emit, partial_tag_len};
use super::python::{JsonStyle, json_dumps};

pub(super) const CALL_OPEN: &str = "<tool_call>";
const CALL_CLOSE: &str = "</tool_call>";
const FUNCTION_OPEN: &str = "<function=";
const FUNCTION_CLOSE: &str = "</function>";
const PARAM_OPEN: &str = "<parameter=";
const PARAM_CLOSE: &str = "</parameter>";
/// A value missing its `</parameter>` ends where a line starts the next parameter.
const NEXT_PARAM: &str = "\n<parameter=";

/// What the text after `<tool_call>` is.
#[derive(Debug, PartialEq)]
pub(super) enum Head {
    /// Too little to tell yet.
    Wait,
    /// Not a call: the `<tool_call>` and what follows are content.
    NotACall,
    /// A call to `name`, whose `<function=NAME>` (with the whitespace before it) takes `len`
    /// bytes.
    Call { name: String, len: usize },
}

/// Whether `text` (after `<tool_call>`) starts a call: whitespace, then `<function=NAME>`
/// with a valid name. Decided as soon as a character rules it out.
pub(super) fn head(text: &str, last: bool) -> Head {
    let lead = text.len() - text.trim_start().len();
    let t = &text[lead..];
    let Some(name) = t.strip_prefix(FUNCTION_OPEN) else {
        return if !last && FUNCTION_OPEN.starts_with(t) { Head::Wait } else { Head::NotACall };
    };
    match name.find('>') {
        Some(end) if valid_name(&name[..end]) => {
            Head::Call { name: name[..end].to_string(), len: lead + FUNCTION_OPEN.len() + end + 1 }
        }
        None if !last && (name.is_empty() || valid_name(name)) => Head::Wait,
        _ => Head::NotACall,
    }
}

/// Where a call's reader is.
#[derive(Debug)]
enum Place {
    /// Between parameters.
    Params,
    /// In the value of this parameter.
    Value(String),
    /// After `</function>`: a `</tool_call>` (after whitespace) is the call's.
    After,
}

/// The rest of one call, after its `<function=NAME>`.
#[derive(Debug)]
pub(super) struct CallReader {
    index: usize,
    name: String,
    /// The parameters sent so far.
    keys: Vec<String>,
    place: Place,
}

impl CallReader {
    /// A call begins: its [`Delta::ToolCallStart`] and the `{` of its arguments.
    pub(super) fn start(index: usize, id: String, name: String, out: &mut Vec<Delta>) -> CallReader {
        emit(out, Delta::ToolCallStart { index, id, name: name.clone() });
        emit(out, Delta::ToolCallArguments { index, json: "{".into() });
        CallReader { index, name, keys: Vec::new(), place: Place::Params }
    }

    /// Reads what it can of `buf` (taking it off the front), sending each parameter once its
    /// value has ended; `true` once the call is over (always when `last`: the output ended),
    /// with what follows it left in `buf`.
    pub(super) fn read(&mut self, buf: &mut String, last: bool, tools: Option<&Json>, out: &mut Vec<Delta>) -> bool {
        loop {
            match &self.place {
                Place::Params => match first_of(buf, &[PARAM_OPEN, FUNCTION_CLOSE, CALL_CLOSE]) {
                    Some((at, 0)) => {
                        let from = at + PARAM_OPEN.len();
                        match buf[from..].find(['>', '<', '\n']) {
                            Some(end) if end > 0 && buf.as_bytes()[from + end] == b'>' => {
                                self.place = Place::Value(buf[from..from + end].to_string());
                                buf.drain(..from + end + 1);
                            }
                            // Not a parameter's name: stray text.
                            Some(_) => drop(buf.drain(..from)),
                            None if last => {
                                buf.clear();
                                return self.close(out);
                            }
                            None => {
                                buf.drain(..at);
                                return false;
                            }
                        }
                    }
                    Some((at, 1)) => {
                        buf.drain(..at + FUNCTION_CLOSE.len());
                        self.place = Place::After;
                    }
                    Some((at, _)) => {
                        buf.drain(..at + CALL_CLOSE.len());
                        return self.close(out);
                    }
                    None if last => {
                        buf.clear();
                        return self.close(out);
                    }
                    None => {
                        // Stray text is dropped; an end that could begin a tag is kept.
                        let keep = [PARAM_OPEN, FUNCTION_CLOSE, CALL_CLOSE].map(|t| partial_tag_len(buf, t));
                        buf.drain(..buf.len() - keep.into_iter().max().unwrap_or(0));
                        return false;
                    }
                },
                Place::Value(key) => {
                    let key = key.clone();
                    let Some(end) = value_end(buf, last) else { return false };
                    let value = &buf[..end.value];
                    let value = value.strip_prefix('\n').unwrap_or(value);
                    let value = value.strip_suffix('\n').unwrap_or(value);
                    let schema = tool_properties(tools, &self.name).and_then(|p| p.get(&key));
                    let value = convert(value, schema);
                    self.send(key, &value, out);
                    buf.drain(..end.taken);
                    if end.call_over {
                        return self.close(out);
                    }
                    self.place = Place::Params;
                }
                Place::After => {
                    let t = buf.trim_start();
                    if let Some(rest) = t.strip_prefix(CALL_CLOSE) {
                        *buf = rest.to_string();
                    } else if !last && CALL_CLOSE.starts_with(t) {
                        return false;
                    } else if t.is_empty() {
                        buf.clear();
                    }
                    return self.close(out);
                }
            }
        }
    }

    /// One parameter's `"key": value` (a repeated parameter keeps its first value).
    fn send(&mut self, key: String, value: &Json, out: &mut Vec<Delta>) {
        if self.keys.contains(&key) {
            return;
        }
        let style = JsonStyle::default();
        let sep = if self.keys.is_empty() { "" } else { style.item_sep.as_str() };
        let json = format!(
            "{sep}{}{}{}",
            json_dumps(&Json::String(key.clone()), &style),
            style.key_sep,
            json_dumps(value, &style)
        );
        emit(out, Delta::ToolCallArguments { index: self.index, json });
        self.keys.push(key);
    }

    /// The call's end: the `}` of its arguments. Returns `true` (the call is over).
    fn close(&self, out: &mut Vec<Delta>) -> bool {
        emit(out, Delta::ToolCallArguments { index: self.index, json: "}".into() });
        true
    }
}

/// Where a value ends (in the text after its `<parameter=KEY>`).
struct ValueEnd {
    /// The value's bytes.
    value: usize,
    /// The bytes it takes with its end tag.
    taken: usize,
    /// The value ended the call (`</function>`, whitespace, `</tool_call>`; or the output's end).
    call_over: bool,
}

/// The end of a value: `</parameter>`; or, where that is missing, a line starting the next
/// parameter, `</function>` followed by `</tool_call>` (a `</function>` followed by other text
/// is part of the value), or the end of the output. `None` while it is not known yet.
fn value_end(text: &str, last: bool) -> Option<ValueEnd> {
    let mut from = 0;
    loop {
        let at = match first_of(&text[from..], &[PARAM_CLOSE, NEXT_PARAM, FUNCTION_CLOSE]) {
            Some((i, 0)) => {
                return Some(ValueEnd { value: from + i, taken: from + i + PARAM_CLOSE.len(), call_over: false });
            }
            Some((i, 1)) => return Some(ValueEnd { value: from + i + 1, taken: from + i + 1, call_over: false }),
            Some((i, _)) => from + i,
            None if last => return Some(ValueEnd { value: text.len(), taken: text.len(), call_over: true }),
            None => return None,
        };
        let t = text[at + FUNCTION_CLOSE.len()..].trim_start();
        if t.starts_with(CALL_CLOSE) {
            return Some(ValueEnd { value: at, taken: text.len() - t.len() + CALL_CLOSE.len(), call_over: true });
        }
        if last && t.is_empty() {
            return Some(ValueEnd { value: at, taken: text.len(), call_over: true });
        }
        if !last && CALL_CLOSE.starts_with(t) {
            return None;
        }
        from = at + FUNCTION_CLOSE.len();
    }
}

/// The first of `tags` in `text`: its position and which tag.
fn first_of(text: &str, tags: &[&str]) -> Option<(usize, usize)> {
    tags.iter().enumerate().filter_map(|(k, t)| text.find(t).map(|at| (at, k))).min()
}

/// A function name as a real call has one: not empty, no whitespace, quotes or brackets.
fn valid_name(name: &str) -> bool {
    !name.is_empty() && !name.chars().any(|c| c.is_whitespace() || "{}<>\"'".contains(c))
}

/// The `parameters.properties` of the named tool (OpenAI's `{"type": "function", "function":
/// {...}}` or a bare function object).
fn tool_properties<'a>(tools: Option<&'a Json>, name: &str) -> Option<&'a Map<String, Json>> {
    tools?.as_array()?.iter().find_map(|t| {
        let f = t.get("function").unwrap_or(t);
        (f.get("name")?.as_str()? == name).then(|| f.get("parameters")?.get("properties")?.as_object())?
    })
}

/// A schema's type, lowercased, and whether it admits null.
fn schema_type(schema: &Json) -> (String, bool) {
    let name = |t: &Json| t.as_str().map(|s| s.trim().to_lowercase());
    match (schema.get("type"), schema.get("anyOf")) {
        (Some(Json::Array(types)), _) => {
            let names: Vec<String> = types.iter().filter_map(name).collect();
            let nullable = names.iter().any(|n| n == "null");
            (names.into_iter().find(|n| n != "null").unwrap_or_else(|| "null".into()), nullable)
        }
        (Some(t), _) => {
            let t = name(t).unwrap_or_else(|| "string".into());
            let nullable = t == "null";
            (t, nullable)
        }
        (None, Some(Json::Array(options))) => {
            let names: Vec<String> = options.iter().filter_map(|o| o.get("type").and_then(name)).collect();
            let nullable = names.iter().any(|n| n == "null");
            (names.into_iter().find(|n| n != "null").unwrap_or_else(|| "string".into()), nullable)
        }
        _ => ("string".into(), false),
    }
}

/// A parameter's text as the JSON value its schema asks for (module docs: the rules).
fn convert(value: &str, schema: Option<&Json>) -> Json {
    let text = || Json::String(value.to_string());
    let Some(schema) = schema else { return text() };
    let (ty, nullable) = schema_type(schema);
    let is_null = matches!(value.to_lowercase().as_str(), "null" | "none");
    if nullable && is_null {
        return Json::Null;
    }
    if ["string", "str", "text", "varchar", "char", "enum"].contains(&ty.as_str()) {
        return text();
    }
    if is_null {
        return Json::Null;
    }
    let starts = |prefixes: &[&str]| prefixes.iter().any(|p| ty.starts_with(p));
    if starts(&["int", "uint", "long", "short", "unsigned"]) {
        value.trim().parse::<i64>().map(Json::from).unwrap_or_else(|_| text())
    } else if starts(&["num", "float"]) {
        match value.trim().parse::<f64>() {
            Ok(x) if x.is_finite() && x.fract() == 0.0 && x.abs() < 9.0e15 => Json::from(x as i64),
            Ok(x) => serde_json::Number::from_f64(x).map(Json::Number).unwrap_or_else(text),
            Err(_) => text(),
        }
    } else if ["boolean", "bool", "binary"].contains(&ty.as_str()) {
        Json::Bool(value.trim().eq_ignore_ascii_case("true"))
    } else {
        serde_json::from_str(value).unwrap_or_else(|_| text())
    }
}
