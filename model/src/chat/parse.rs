//! The model's output split into reasoning, content and tool calls, as it streams.
//!
//! Conventions (those of vLLM's `deepseek_r1` / Nemotron `nano_v3` reasoning parsers and its
//! `qwen3_coder` tool parser, which serve this model):
//!
//! - Reasoning is the text before `</think>`. When the prompt already opened the block (a
//!   thinking-enabled template ends with `<think>\n`: [`ParserOptions::starts_in_reasoning`]),
//!   the output starts inside it, and if `</think>` never comes, all of it is reasoning. A
//!   `<think>` at the very start of the output opens (or repeats the opening of) the block;
//!   elsewhere it is text. Whitespace after `</think>` is kept (the content starts with it).
//! - A tool call is `<tool_call>\n<function=NAME>\n<parameter=ARG>\nVALUE\n</parameter>...
//!   </function>\n</tool_call>` in the content (not inside reasoning). One newline at each end
//!   of a value is dropped. A value is typed by the tool's JSON schema
//!   (`parameters.properties.ARG.type`, or the first non-null type of an `anyOf` or a type
//!   list): string types stay strings; integer types become integers and number types numbers
//!   (an integral number as an integer), when they parse; `boolean` is `true` for `true` in any
//!   case and `false` otherwise; `object`/`array` (and other types) the JSON they hold when they
//!   hold JSON; `null`/`None` is null unless the type is a string type (then null only where
//!   the schema also admits null). Anything that does not convert, and any argument the
//!   schema does not declare, stays a string.
//! - A block ends at the first `</tool_call>` that follows `</function>` (or that has no
//!   `</function>` before it and is outside a parameter's value); a value missing its
//!   `</parameter>` ends at the next line that starts `<parameter=`; at the end of the output a block that ends with `</function>`
//!   still counts. A block that does not parse (no `<function=NAME>`, a name with spaces,
//!   quotes or brackets, text other than parameters) or that never ends is returned as content,
//!   tags and all. Text between and after tool calls is content.
//!
//! Streaming: [`OutputParser::push`] returns reasoning and content as soon as no tag can start
//! in them (only the end that could begin a tag is held back), and each tool call whole, once
//! its block has ended ([`Delta::ToolCall`]: an OpenAI stream may send a call's id, name and
//! complete arguments in one chunk). The deltas of any split of a text, merged, are those of
//! the whole text.

use serde_json::{Map, Value as Json};

use super::python::{JsonStyle, json_dumps};

const THINK_OPEN: &str = "<think>";
const THINK_CLOSE: &str = "</think>";
const CALL_OPEN: &str = "<tool_call>";
const CALL_CLOSE: &str = "</tool_call>";
const FUNCTION_OPEN: &str = "<function=";
const FUNCTION_CLOSE: &str = "</function>";
const PARAM_OPEN: &str = "<parameter=";
const PARAM_CLOSE: &str = "</parameter>";

/// What the parser looks for.
#[derive(Clone, Debug, Default)]
pub struct ParserOptions {
    /// Split `<think>...</think>` out as reasoning (otherwise all text is content).
    pub reasoning: bool,
    /// The prompt ended inside a `<think>` block, so the output starts as reasoning (see
    /// [`super::prompt_opens_reasoning`]). Only read when `reasoning` is set.
    pub starts_in_reasoning: bool,
    /// The request's `tools` (its OpenAI-style array): `Some` turns tool-call parsing on (pass
    /// `None` for `tool_choice: "none"`), and their parameter schemas type the arguments.
    pub tools: Option<Json>,
}

/// A piece of parsed output, in order.
#[derive(Clone, Debug, PartialEq)]
pub enum Delta {
    /// Reasoning text (`reasoning_content`).
    Reasoning(String),
    /// Answer text (`content`).
    Content(String),
    /// A complete tool call: its position among the output's calls, a fresh id
    /// (`call_` and 24 hex digits), the function name and the arguments as a JSON object.
    ToolCall { index: usize, id: String, name: String, arguments_json: String },
}

/// A tool call of a finished output.
#[derive(Clone, Debug, PartialEq)]
pub struct ToolCall {
    pub index: usize,
    pub id: String,
    pub name: String,
    pub arguments_json: String,
}

/// A whole output, parsed (what a non-streaming response returns).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Message {
    /// The reasoning text, `None` when there was none.
    pub reasoning: Option<String>,
    /// The content, `None` when there was none.
    pub content: Option<String>,
    pub tool_calls: Vec<ToolCall>,
}

impl Message {
    /// The deltas of an output put together.
    pub fn from_deltas(deltas: impl IntoIterator<Item = Delta>) -> Message {
        let mut m = Message::default();
        for d in deltas {
            match d {
                Delta::Reasoning(t) => m.reasoning.get_or_insert_default().push_str(&t),
                Delta::Content(t) => m.content.get_or_insert_default().push_str(&t),
                Delta::ToolCall { index, id, name, arguments_json } => {
                    m.tool_calls.push(ToolCall { index, id, name, arguments_json })
                }
            }
        }
        m
    }
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Mode {
    /// Nothing read yet: a `<think>` here opens reasoning.
    Start,
    /// Inside `<think>`, at its start: a repeated `<think>` is dropped.
    ReasoningStart,
    Reasoning,
    Content,
    /// After `<tool_call>`: the block is buffered until it ends.
    ToolCall,
}

/// Splits streamed output text into [`Delta`]s (module docs: the conventions).
#[derive(Debug)]
pub struct OutputParser {
    opts: ParserOptions,
    mode: Mode,
    /// Text received and not yet returned.
    buf: String,
    calls: usize,
    /// Random per parser, so ids differ between requests.
    id_base: u64,
}

impl OutputParser {
    pub fn new(opts: ParserOptions) -> OutputParser {
        let mode = match (opts.reasoning, opts.starts_in_reasoning) {
            (false, _) => Mode::Content,
            (true, false) => Mode::Start,
            (true, true) => Mode::ReasoningStart,
        };
        use std::hash::{BuildHasher, Hasher};
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u64(
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64),
        );
        OutputParser { opts, mode, buf: String::new(), calls: 0, id_base: h.finish() }
    }

    /// The next piece of text; the deltas that are final now.
    pub fn push(&mut self, text: &str) -> Vec<Delta> {
        self.buf.push_str(text);
        let mut out = Vec::new();
        self.run(false, &mut out);
        out
    }

    /// The end of the output: the deltas of what was held back.
    pub fn finish(mut self) -> Vec<Delta> {
        let mut out = Vec::new();
        self.run(true, &mut out);
        out
    }

    /// How many tool calls have been returned (for `finish_reason: "tool_calls"`).
    pub fn tool_calls(&self) -> usize {
        self.calls
    }

    /// The whole of an output at once.
    pub fn parse(opts: ParserOptions, text: &str) -> Message {
        let mut p = OutputParser::new(opts);
        let mut deltas = p.push(text);
        deltas.extend(p.finish());
        Message::from_deltas(deltas)
    }

    fn run(&mut self, last: bool, out: &mut Vec<Delta>) {
        loop {
            match self.mode {
                Mode::Start | Mode::ReasoningStart => {
                    let next = if self.mode == Mode::Start { Mode::Content } else { Mode::Reasoning };
                    if let Some(rest) = self.buf.strip_prefix(THINK_OPEN) {
                        self.buf = rest.to_string();
                        self.mode = Mode::Reasoning;
                    } else if !last && THINK_OPEN.starts_with(self.buf.as_str()) {
                        return; // could still be `<think>`
                    } else {
                        self.mode = next;
                    }
                }
                Mode::Reasoning => match self.buf.find(THINK_CLOSE) {
                    Some(at) => {
                        emit(out, Delta::Reasoning(self.buf[..at].to_string()));
                        self.buf.drain(..at + THINK_CLOSE.len());
                        self.mode = Mode::Content;
                    }
                    None => {
                        let text = self.take_safe(THINK_CLOSE, last);
                        emit(out, Delta::Reasoning(text));
                        return;
                    }
                },
                Mode::Content if self.opts.tools.is_none() => {
                    emit(out, Delta::Content(std::mem::take(&mut self.buf)));
                    return;
                }
                Mode::Content => match self.buf.find(CALL_OPEN) {
                    Some(at) => {
                        emit(out, Delta::Content(self.buf[..at].to_string()));
                        self.buf.drain(..at + CALL_OPEN.len());
                        self.mode = Mode::ToolCall;
                    }
                    None => {
                        let text = self.take_safe(CALL_OPEN, last);
                        emit(out, Delta::Content(text));
                        return;
                    }
                },
                Mode::ToolCall => {
                    let (block, rest, closed) = match block_end(&self.buf) {
                        Some(at) => (self.buf[..at].to_string(), self.buf[at + CALL_CLOSE.len()..].to_string(), true),
                        None if last && self.buf.trim_end().ends_with(FUNCTION_CLOSE) => {
                            (std::mem::take(&mut self.buf), String::new(), false)
                        }
                        None if last => {
                            emit(out, Delta::Content(format!("{CALL_OPEN}{}", std::mem::take(&mut self.buf))));
                            return;
                        }
                        None => return,
                    };
                    match parse_call(&block, self.opts.tools.as_ref()) {
                        Some((name, arguments)) => {
                            let index = self.calls;
                            self.calls += 1;
                            let id = format!("call_{:016x}{:08x}", self.id_base, index as u32);
                            emit(out, Delta::ToolCall { index, id, name, arguments_json: arguments });
                        }
                        None => {
                            let close = if closed { CALL_CLOSE } else { "" };
                            emit(out, Delta::Content(format!("{CALL_OPEN}{block}{close}")));
                        }
                    }
                    self.buf = rest;
                    self.mode = Mode::Content;
                }
            }
        }
    }

    /// Takes the buffered text except the longest end that could begin `tag` (all of it when
    /// `last`).
    fn take_safe(&mut self, tag: &str, last: bool) -> String {
        let keep = if last { 0 } else { partial_tag_len(&self.buf, tag) };
        let cut = self.buf.len() - keep;
        let text = self.buf[..cut].to_string();
        self.buf.drain(..cut);
        text
    }
}

/// Appends a delta, merged into the one before when both are text of the same kind; empty
/// text is dropped.
fn emit(out: &mut Vec<Delta>, d: Delta) {
    match (out.last_mut(), d) {
        (_, Delta::Reasoning(t) | Delta::Content(t)) if t.is_empty() => {}
        (Some(Delta::Reasoning(a)), Delta::Reasoning(b)) | (Some(Delta::Content(a)), Delta::Content(b)) => {
            a.push_str(&b)
        }
        (_, d) => out.push(d),
    }
}

/// The length of the longest end of `text` that is a proper start of `tag` (a character
/// boundary: tags are ASCII and start with `<`).
fn partial_tag_len(text: &str, tag: &str) -> usize {
    let (t, g) = (text.as_bytes(), tag.as_bytes());
    (1..g.len().min(t.len() + 1)).rev().find(|&n| t[t.len() - n..] == g[..n]).unwrap_or(0)
}

/// Where a tool-call block (the text after `<tool_call>`) ends: the first `</tool_call>`
/// that follows `</function>` and whitespace, or that has no `</function>` before it and is
/// not inside a parameter's value (more `<parameter=` than `</parameter>` before it).
fn block_end(block: &str) -> Option<usize> {
    let mut from = 0;
    while let Some(i) = block[from..].find(CALL_CLOSE) {
        let at = from + i;
        let before = &block[..at];
        let in_value = before.matches(PARAM_OPEN).count() > before.matches(PARAM_CLOSE).count();
        if before.trim_end().ends_with(FUNCTION_CLOSE) || (!before.contains(FUNCTION_CLOSE) && !in_value) {
            return Some(at);
        }
        from = at + CALL_CLOSE.len();
    }
    None
}

/// A function name as a real call has one: not empty, no whitespace, quotes or brackets.
fn valid_name(name: &str) -> bool {
    !name.is_empty() && !name.chars().any(|c| c.is_whitespace() || "{}<>\"'".contains(c))
}

/// The name and JSON arguments of a tool-call block, or `None` when it is malformed.
fn parse_call(block: &str, tools: Option<&Json>) -> Option<(String, String)> {
    let body = block.trim_start().strip_prefix(FUNCTION_OPEN)?;
    let name_end = body.find('>')?;
    let name = &body[..name_end];
    if !valid_name(name) {
        return None;
    }
    let mut body = &body[name_end + 1..];
    if let Some(end) = body.rfind(FUNCTION_CLOSE) {
        if !body[end + FUNCTION_CLOSE.len()..].trim().is_empty() {
            return None;
        }
        body = &body[..end];
    }
    let schema = tool_properties(tools, name);
    let mut args = Map::new();
    let mut rest = body;
    loop {
        rest = rest.trim_start();
        if rest.is_empty() {
            break;
        }
        let after = rest.strip_prefix(PARAM_OPEN)?;
        let key_end = after.find('>')?;
        let key = &after[..key_end];
        if key.is_empty() || key.contains(['<', '\n']) {
            return None;
        }
        let value_text = &after[key_end + 1..];
        // The value ends at `</parameter>`, or where it is missing at the next parameter (a
        // `<parameter=` starting a line) or the end.
        let close = value_text.find(PARAM_CLOSE);
        let next_param = value_text.find(&format!("\n{PARAM_OPEN}")).map(|i| i + 1);
        let (value, next) = match (close, next_param) {
            (Some(end), n) if n.is_none_or(|n| end < n) => (&value_text[..end], &value_text[end + PARAM_CLOSE.len()..]),
            (_, Some(n)) => (&value_text[..n], &value_text[n..]),
            (_, None) => (value_text, ""),
        };
        let value = value.strip_prefix('\n').unwrap_or(value);
        let value = value.strip_suffix('\n').unwrap_or(value);
        args.insert(key.to_string(), convert(value, schema.and_then(|p| p.get(key))));
        rest = next;
    }
    Some((name.to_string(), json_dumps(&Json::Object(args), &JsonStyle::default())))
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

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn tools() -> Json {
        json!([{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
            "city": {"type": "string"}, "days": {"type": "integer"}, "celsius": {"type": "boolean"},
            "ratio": {"type": "number"}, "opts": {"type": "object"}, "tags": {"type": "array"},
            "note": {"anyOf": [{"type": "string"}, {"type": "null"}]}, "limit": {"type": ["integer", "null"]}}}}}])
    }

    fn opts(reasoning: bool, starts_in_reasoning: bool) -> ParserOptions {
        ParserOptions { reasoning, starts_in_reasoning, tools: Some(tools()) }
    }

    /// The deltas of `pieces`, with ids blanked (they are random) and text merged.
    fn run(o: &ParserOptions, pieces: &[&str]) -> Vec<Delta> {
        let mut p = OutputParser::new(o.clone());
        let mut all = Vec::new();
        for piece in pieces {
            all.extend(p.push(piece));
        }
        all.extend(p.finish());
        let mut out = Vec::new();
        for d in all {
            match d {
                Delta::ToolCall { index, id, name, arguments_json } => {
                    assert!(id.starts_with("call_") && id.len() == 29, "{id}");
                    out.push(Delta::ToolCall { index, id: String::new(), name, arguments_json })
                }
                d => emit(&mut out, d),
            }
        }
        out
    }

    fn r(s: &str) -> Delta {
        Delta::Reasoning(s.into())
    }
    fn c(s: &str) -> Delta {
        Delta::Content(s.into())
    }
    fn call(index: usize, name: &str, args: &str) -> Delta {
        Delta::ToolCall { index, id: String::new(), name: name.into(), arguments_json: args.into() }
    }

    /// Every cut of `text` into two or three pieces at character boundaries gives the
    /// deltas of the whole.
    fn check(o: &ParserOptions, text: &str, want: &[Delta]) {
        assert_eq!(run(o, &[text]), want, "whole text {text:?}");
        let cuts: Vec<usize> = (1..text.len()).filter(|&i| text.is_char_boundary(i)).collect();
        for (i, &a) in cuts.iter().enumerate() {
            assert_eq!(run(o, &[&text[..a], &text[a..]]), want, "cut at {a} of {text:?}");
            for &b in &cuts[i + 1..] {
                let pieces = [&text[..a], &text[a..b], &text[b..]];
                assert_eq!(run(o, &pieces), want, "pieces {pieces:?}");
            }
        }
        // And one character at a time.
        let chars: Vec<String> = text.chars().map(String::from).collect();
        let pieces: Vec<&str> = chars.iter().map(String::as_str).collect();
        assert_eq!(run(o, &pieces), want, "by character: {text:?}");
    }

    #[test]
    fn reasoning_split() {
        check(&opts(true, true), "I think.\n</think>\nAnswer é", &[r("I think.\n"), c("\nAnswer é")]);
        check(&opts(true, true), "<think>x</think>y", &[r("x"), c("y")]);
        check(&opts(true, true), "never closed </thi", &[r("never closed </thi")]);
        check(&opts(true, false), "<think>a</think>b", &[r("a"), c("b")]);
        check(&opts(true, false), "plain <think>a</think>", &[c("plain <think>a</think>")]);
        check(&opts(true, false), "<thin", &[c("<thin")]);
        check(&opts(false, true), "a</think>b", &[c("a</think>b")]);
        // A tool call inside reasoning is reasoning.
        check(&opts(true, true), "<tool_call>x</tool_call></think>", &[r("<tool_call>x</tool_call>")]);
    }

    #[test]
    fn typed_tool_calls() {
        let text = "Let me look.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nSão Paulo\n</parameter>\n\
            <parameter=days>\n3\n</parameter>\n<parameter=celsius>\nTrue\n</parameter>\n<parameter=ratio>\n2.0\n</parameter>\n\
            <parameter=opts>\n{\"a\": [1, null]}\n</parameter>\n<parameter=tags>\n[\"x\"]\n</parameter>\n\
            <parameter=note>\nnull\n</parameter>\n<parameter=limit>\nNone\n</parameter>\n<parameter=extra>\n7\n</parameter>\n\
            </function>\n</tool_call>";
        let args = r#"{"city": "São Paulo", "days": 3, "celsius": true, "ratio": 2, "opts": {"a": [1, null]}, "tags": ["x"], "note": null, "limit": null, "extra": "7"}"#;
        let m = OutputParser::parse(opts(true, false), text);
        assert_eq!(m.content.as_deref(), Some("Let me look.\n"));
        assert_eq!(m.reasoning, None);
        assert_eq!(m.tool_calls.len(), 1);
        assert_eq!((m.tool_calls[0].name.as_str(), m.tool_calls[0].arguments_json.as_str()), ("get_weather", args));
        let short = "<tool_call>\n<function=get_weather>\n<parameter=days>\nmany\n</parameter>\n<parameter=ratio>\n0.5\n</parameter>\n</function>\n</tool_call>";
        check(&opts(true, false), short, &[call(0, "get_weather", r#"{"days": "many", "ratio": 0.5}"#)]);
    }

    #[test]
    fn several_calls_and_text_between() {
        let one = "<tool_call>\n<function=a>\n<parameter=x>\n1\n</parameter>\n</function>\n</tool_call>";
        let two = "<tool_call>\n<function=b>\n</function>\n</tool_call>";
        let text = format!("</think>pre{one}\n{two}post");
        check(
            &opts(true, true),
            &text,
            &[c("pre"), call(0, "a", r#"{"x": "1"}"#), c("\n"), call(1, "b", "{}"), c("post")],
        );
        // Without tools, the same text is content.
        let no_tools = ParserOptions { tools: None, ..opts(true, true) };
        assert_eq!(run(&no_tools, &[&text]), [c(&format!("pre{one}\n{two}post"))]);
        // Unknown function (no schema): arguments stay strings. A value may hold tags.
        let literal = "<tool_call>\n<function=run>\n<parameter=code>\nif a<b:\n  </tool_call>\n</parameter>\n</function>\n</tool_call>";
        check(&opts(false, false), literal, &[call(0, "run", r#"{"code": "if a<b:\n  </tool_call>"}"#)]);
    }

    #[test]
    fn malformed_calls_are_content() {
        let o = opts(false, false);
        // Never closed: content, tags and all.
        check(&o, "x<tool_call>\n<function=a>\n<parameter=p>\nv", &[c("x<tool_call>\n<function=a>\n<parameter=p>\nv")]);
        // No function, a bad name, stray text.
        for bad in [
            "<tool_call>\n{\"name\": \"a\"}\n</tool_call>",
            "<tool_call>\n<function=my tool>\n</function>\n</tool_call>",
            "<tool_call>\n<function=a>\nstray\n</function>\n</tool_call>",
            "<tool_call><function=a></function>trailing</tool_call>",
        ] {
            check(&o, bad, &[c(bad)]);
        }
        // Closed by </function> at the end of the output, or a parameter missing its close.
        check(&o, "<tool_call>\n<function=a>\n</function>\n", &[call(0, "a", "{}")]);
        check(
            &o,
            "<tool_call>\n<function=a>\n<parameter=p>\n1\n<parameter=q>\n2\n</parameter>\n</function>\n</tool_call>",
            &[call(0, "a", r#"{"p": "1", "q": "2"}"#)],
        );
        // Nothing at all.
        assert_eq!(run(&o, &[]), []);
        assert_eq!(run(&opts(true, true), &[""]), []);
    }
}
