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
//!   schema does not declare, stays a string. A repeated parameter keeps its first value.
//! - A `<tool_call>` followed (after whitespace) by `<function=NAME>` with a name without
//!   spaces, quotes or brackets is a call from there on; any other `<tool_call>` is content,
//!   tags and all. A value ends at its `</parameter>`; where that is missing, at the next line
//!   that starts `<parameter=`, at a `</function>` followed by `</tool_call>`, or at the end of
//!   the output (a `</tool_call>`, or a `</function>` followed by other text, inside a value is
//!   part of it). The call ends at `</function>` (and the `</tool_call>` after it), at a
//!   `</tool_call>` between parameters, or at the end of the output (cut short, it keeps the
//!   parameters read so far). Text between parameters is dropped; text after the call is
//!   content.
//!
//! Streaming: [`OutputParser::push`] returns reasoning and content as soon as no tag can start
//! in them (only the end that could begin a tag is held back). A tool call comes as OpenAI
//! streams one: [`Delta::ToolCallStart`] (its id and name) once `<function=NAME>` is read,
//! then its arguments' JSON in [`Delta::ToolCallArguments`] pieces: `{`, each parameter's
//! `"ARG": VALUE` once its value has ended (it is typed whole), `}`. The deltas of any split of
//! a text, merged, are those of the whole text.

use serde_json::Value as Json;

use super::tool_call::{CALL_OPEN, CallReader, Head, head};

const THINK_OPEN: &str = "<think>";
const THINK_CLOSE: &str = "</think>";

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
    /// A tool call begins: its position among the output's calls, a fresh id (`call_` and 24
    /// hex digits) and the function's name.
    ToolCallStart { index: usize, id: String, name: String },
    /// The next piece of call `index`'s arguments (together: a JSON object).
    ToolCallArguments { index: usize, json: String },
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
                Delta::ToolCallStart { index, id, name } => {
                    m.tool_calls.push(ToolCall { index, id, name, arguments_json: String::new() })
                }
                Delta::ToolCallArguments { index, json } => {
                    if let Some(call) = m.tool_calls.iter_mut().rfind(|c| c.index == index) {
                        call.arguments_json.push_str(&json);
                    }
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
    /// After `<tool_call>`: is it a call?
    CallHead,
    /// In a call (the parser's `call`).
    Call,
}

/// Splits streamed output text into [`Delta`]s (module docs: the conventions).
#[derive(Debug)]
pub struct OutputParser {
    opts: ParserOptions,
    mode: Mode,
    /// Text received and not yet returned.
    buf: String,
    /// The call being read (in [`Mode::Call`]).
    call: Option<CallReader>,
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
        OutputParser { opts, mode, buf: String::new(), call: None, calls: 0, id_base: h.finish() }
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
                        self.mode = Mode::CallHead;
                    }
                    None => {
                        let text = self.take_safe(CALL_OPEN, last);
                        emit(out, Delta::Content(text));
                        return;
                    }
                },
                Mode::CallHead => match head(&self.buf, last) {
                    Head::Wait => return,
                    Head::NotACall => {
                        emit(out, Delta::Content(CALL_OPEN.into()));
                        self.mode = Mode::Content;
                    }
                    Head::Call { name, len } => {
                        self.buf.drain(..len);
                        let (index, id_base) = (self.calls, self.id_base);
                        self.calls += 1;
                        let id = format!("call_{id_base:016x}{:08x}", index as u32);
                        self.call = Some(CallReader::start(index, id, name, out));
                        self.mode = Mode::Call;
                    }
                },
                Mode::Call => {
                    let call = self.call.as_mut().expect("set with Mode::Call");
                    if !call.read(&mut self.buf, last, self.opts.tools.as_ref(), out) {
                        return;
                    }
                    self.call = None;
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

/// Appends a delta, merged into the one before when both are text of the same kind or
/// arguments of the same call; empty text is dropped.
pub(super) fn emit(out: &mut Vec<Delta>, d: Delta) {
    match (out.last_mut(), d) {
        (_, Delta::Reasoning(t) | Delta::Content(t) | Delta::ToolCallArguments { json: t, .. }) if t.is_empty() => {}
        (Some(Delta::Reasoning(a)), Delta::Reasoning(b)) | (Some(Delta::Content(a)), Delta::Content(b)) => {
            a.push_str(&b)
        }
        (Some(Delta::ToolCallArguments { index: i, json: a }), Delta::ToolCallArguments { index: j, json: b })
            if *i == j =>
        {
            a.push_str(&b)
        }
        (_, d) => out.push(d),
    }
}

/// The length of the longest end of `text` that is a proper start of `tag` (a character
/// boundary: tags are ASCII and start with `<`).
pub(super) fn partial_tag_len(text: &str, tag: &str) -> usize {
    let (t, g) = (text.as_bytes(), tag.as_bytes());
    (1..g.len().min(t.len() + 1)).rev().find(|&n| t[t.len() - n..] == g[..n]).unwrap_or(0)
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
                Delta::ToolCallStart { index, id, name } => {
                    assert!(id.starts_with("call_") && id.len() == 29, "{id}");
                    out.push(Delta::ToolCallStart { index, id: String::new(), name })
                }
                d => emit(&mut out, d),
            }
        }
        out
    }

    fn r(s: &str) -> Vec<Delta> {
        vec![Delta::Reasoning(s.into())]
    }
    fn c(s: &str) -> Vec<Delta> {
        vec![Delta::Content(s.into())]
    }
    /// A whole call (its id blanked), as `run` merges it.
    fn call(index: usize, name: &str, args: &str) -> Vec<Delta> {
        vec![
            Delta::ToolCallStart { index, id: String::new(), name: name.into() },
            Delta::ToolCallArguments { index, json: args.into() },
        ]
    }

    /// Every cut of `text` into two or three pieces at character boundaries gives the
    /// deltas of the whole (`want`, concatenated).
    fn check(o: &ParserOptions, text: &str, want: &[Vec<Delta>]) {
        let want = want.concat();
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
        assert_eq!(run(&no_tools, &[&text]), c(&format!("pre{one}\n{two}post")));
        // Unknown function (no schema): arguments stay strings. A value may hold tags.
        let literal = "<tool_call>\n<function=run>\n<parameter=code>\nif a<b:\n  </tool_call>\n</parameter>\n</function>\n</tool_call>";
        check(&opts(false, false), literal, &[call(0, "run", r#"{"code": "if a<b:\n  </tool_call>"}"#)]);
    }

    /// A call comes out as it is read: its name once `<function=NAME>` is in, each
    /// parameter once its value has ended, the close at `</function>`.
    #[test]
    fn a_call_streams_as_it_is_read() {
        let mut p = OutputParser::new(opts(false, false));
        let mut step = |text: &str| -> Vec<Delta> {
            let mut out = Vec::new();
            for d in p.push(text) {
                emit(
                    &mut out,
                    if let Delta::ToolCallStart { index, name, .. } = d {
                        Delta::ToolCallStart { index, id: String::new(), name }
                    } else {
                        d
                    },
                );
            }
            out
        };
        let args = |s: &str| Delta::ToolCallArguments { index: 0, json: s.into() };
        assert_eq!(step("Hi <tool_call>\n<function=get_weather"), c("Hi "));
        let start = Delta::ToolCallStart { index: 0, id: String::new(), name: "get_weather".into() };
        assert_eq!(step(">\n<parameter=city>\nPar"), [start, args("{")]);
        assert_eq!(step("is\n</parameter>\n<parameter=days>\n3"), [args(r#""city": "Paris""#)]);
        assert_eq!(step("\n</parameter>\n</func"), [args(r#", "days": 3"#)]);
        assert_eq!(step("tion>\n</tool_call>"), [args("}")]);
        assert_eq!(step(" Bye"), c(" Bye"));
    }

    #[test]
    fn malformed_calls() {
        let o = opts(false, false);
        // No function or a bad name: content, tags and all (a later call still counts).
        for bad in [
            "<tool_call>\n{\"name\": \"a\"}\n</tool_call>",
            "<tool_call>\n<function=my tool>\n</function>\n</tool_call>",
        ] {
            check(&o, bad, &[c(bad)]);
        }
        check(&o, "<tool_call>{}<tool_call><function=a></function>", &[c("<tool_call>{}"), call(0, "a", "{}")]);
        // Cut short: the parameters read so far, a value to the end.
        check(&o, "x<tool_call>\n<function=a>\n<parameter=p>\nv", &[c("x"), call(0, "a", r#"{"p": "v"}"#)]);
        check(&o, "<tool_call><function=a><parameter=p>1</parameter><parameter=q", &[call(0, "a", r#"{"p": "1"}"#)]);
        // Text between parameters is dropped, text after the call is content.
        check(&o, "<tool_call>\n<function=a>\nstray\n</function>\n</tool_call>", &[call(0, "a", "{}")]);
        check(
            &o,
            "<tool_call><function=a></function>trailing</tool_call>",
            &[call(0, "a", "{}"), c("trailing</tool_call>")],
        );
        check(
            &o,
            "<tool_call><function=a>x<parameter=>y<parameter=p>1</parameter></tool_call>z",
            &[call(0, "a", r#"{"p": "1"}"#), c("z")],
        );
        // A repeated parameter keeps its first value; a `</function>` inside a value.
        check(
            &o,
            "<tool_call><function=a><parameter=p>1</parameter><parameter=p>2</parameter></function></tool_call>",
            &[call(0, "a", r#"{"p": "1"}"#)],
        );
        check(
            &o,
            "<tool_call><function=a><parameter=p>x</function>y</function>\n</tool_call>",
            &[call(0, "a", r#"{"p": "x</function>y"}"#)],
        );
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

    /// Random texts built from tag pieces: any split gives the deltas of the whole, with
    /// and without reasoning and tools, and nothing panics.
    #[test]
    fn random_texts_split_anywhere() {
        const PIECES: [&str; 16] = [
            "<think>",
            "</think>",
            "<tool_call>",
            "</tool_call>",
            "<function=f>",
            "<function=get_weather>",
            "</function>",
            "<parameter=days>",
            "</parameter>",
            "\n",
            "a",
            "é",
            "<",
            "</",
            "1",
            "true",
        ];
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = |n: usize| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state % n as u64) as usize
        };
        let all_opts = [opts(true, true), opts(true, false), opts(false, false), ParserOptions::default()];
        for _ in 0..150 {
            let len = 1 + next(10);
            let text: String = (0..len).map(|_| PIECES[next(PIECES.len())]).collect();
            for o in &all_opts {
                let whole = run(o, &[&text]);
                let cuts: Vec<usize> = (1..text.len()).filter(|&i| text.is_char_boundary(i)).collect();
                for &a in &cuts {
                    assert_eq!(run(o, &[&text[..a], &text[a..]]), whole, "cut at {a} of {text:?}");
                }
                let chars: Vec<String> = text.chars().map(String::from).collect();
                let pieces: Vec<&str> = chars.iter().map(String::as_str).collect();
                assert_eq!(run(o, &pieces), whole, "by character: {text:?}");
                // Nothing is lost: without tool calls the text comes back whole (less the
                // think tags the parser consumed).
                if !whole.iter().any(|d| matches!(d, Delta::ToolCallStart { .. })) && !o.reasoning {
                    assert_eq!(whole, if text.is_empty() { vec![] } else { c(&text) });
                }
            }
        }
    }
}
