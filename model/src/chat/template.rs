//! Chat templates: a checkpoint's Jinja `chat_template`, rendered with minijinja the way
//! transformers' `apply_chat_template` renders it with Jinja2.
//!
//! What transformers sets up, and so this does too: blocks trimmed (`trim_blocks`,
//! `lstrip_blocks`), `break`/`continue`, Python's string and dict methods (`.strip()`,
//! `.split()`, `.startswith()`, `.items()`, `.get()`: minijinja-contrib's pycompat), a `tojson`
//! filter that is `json.dumps(x, ensure_ascii=False)` (keys in the request's order, no HTML
//! escaping; `indent`, `sort_keys`, `separators`, `ensure_ascii` taken), the functions
//! `raise_exception(msg)` and `strftime_now(fmt)`, the tests `iterable` and `sequence` as
//! Python answers them (none is not iterable; a string and a dict are sequences), and the variables `messages`, `tools` (none
//! when the request has none, as transformers passes it), `add_generation_prompt`, the
//! tokenizer's special tokens (`bos_token`, `eos_token`, ...) and the request's
//! `chat_template_kwargs`. Values print as Python prints them (`{{ true }}` is `True`, the
//! `string` filter of a dict `{'a': 1}`). `{% generation %}` blocks (transformers' assistant
//! mask marker) render their body.
//!
//! Known differences from Jinja2: `~` joins booleans and none as minijinja spells them (`true`,
//! `none`) where Jinja2 writes `True`, `None`; `strftime_now` formats UTC, not local time.

use std::path::Path;

use minijinja::value::{Kwargs, Rest, ValueKind};
use minijinja::{Environment, ErrorKind, UndefinedBehavior, Value};
use serde_json::{Map, Value as Json};

use super::python::{JsonStyle, json_dumps, str_of};
use crate::{Error, Result};

/// The keys of tokenizer_config.json that transformers passes to a template as variables.
const SPECIAL_TOKENS: [&str; 8] = [
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
    "additional_special_tokens",
];

/// A checkpoint's chat template(s), compiled, with the tokenizer's special tokens.
pub struct ChatTemplate {
    env: Environment<'static>,
    /// The named templates (`default`, `tool_use`, ...), or one named `default`.
    names: Vec<String>,
    /// The special tokens of tokenizer_config.json, passed to every render.
    special: Map<String, Json>,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate").field("names", &self.names).field("special", &self.special).finish()
    }
}

fn template_error(reason: impl std::fmt::Display) -> Error {
    Error::Template(reason.to_string())
}

impl ChatTemplate {
    /// The chat template of a checkpoint directory: `chat_template.jinja` if there is one (as
    /// transformers prefers it), else tokenizer_config.json's `chat_template` (a string, or a
    /// list of `{"name", "template"}`); special tokens from tokenizer_config.json. `Ok(None)`
    /// when the directory has no template; an error when a file is unreadable or malformed or
    /// a template does not compile.
    pub fn from_dir(dir: &Path) -> Result<Option<ChatTemplate>> {
        let config_path = dir.join("tokenizer_config.json");
        let config: Json = match std::fs::read_to_string(&config_path) {
            Ok(text) => serde_json::from_str(&text)
                .map_err(|e| template_error(format!("{}: not JSON: {e}", config_path.display())))?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Json::Null,
            Err(e) => return Err(template_error(format!("reading {}: {e}", config_path.display()))),
        };
        let jinja_path = dir.join("chat_template.jinja");
        let jinja = match std::fs::read_to_string(&jinja_path) {
            Ok(text) => Some(text),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
            Err(e) => return Err(template_error(format!("reading {}: {e}", jinja_path.display()))),
        };
        Self::from_config(&config, jinja)
    }

    /// The chat template of a parsed tokenizer_config.json, or `jinja` (a
    /// `chat_template.jinja`'s text) in place of its `chat_template`. `Ok(None)` when neither
    /// has one.
    pub fn from_config(config: &Json, jinja: Option<String>) -> Result<Option<ChatTemplate>> {
        let templates: Vec<(String, String)> = match (jinja, config.get("chat_template")) {
            (Some(text), _) => vec![("default".into(), text)],
            (None, None | Some(Json::Null)) => return Ok(None),
            (None, Some(Json::String(text))) => vec![("default".into(), text.clone())],
            (None, Some(Json::Array(list))) => list
                .iter()
                .map(|t| match (t.get("name").and_then(Json::as_str), t.get("template").and_then(Json::as_str)) {
                    (Some(name), Some(text)) => Ok((name.to_string(), text.to_string())),
                    _ => Err(template_error(
                        "tokenizer_config.json: a `chat_template` list entry needs string `name` and `template`",
                    )),
                })
                .collect::<Result<_>>()?,
            (None, Some(other)) => {
                return Err(template_error(format!(
                    "tokenizer_config.json: `chat_template` must be a string or a list of named templates, not {other}"
                )));
            }
        };
        let mut special = Map::new();
        for key in SPECIAL_TOKENS {
            match config.get(key) {
                Some(Json::String(s)) => {
                    special.insert(key.into(), Json::String(s.clone()));
                }
                // An AddedToken written out: {"content": "<s>", "lstrip": false, ...}.
                Some(Json::Object(o)) => {
                    if let Some(s) = o.get("content").and_then(Json::as_str) {
                        special.insert(key.into(), Json::String(s.into()));
                    }
                }
                Some(list @ Json::Array(_)) => {
                    special.insert(key.into(), list.clone());
                }
                _ => {}
            }
        }
        Self::with_templates(templates, special).map(Some)
    }

    /// One template from its source, with these special tokens (`bos_token`, ...).
    pub fn new(source: &str, special_tokens: Map<String, Json>) -> Result<ChatTemplate> {
        Self::with_templates(vec![("default".into(), source.into())], special_tokens)
    }

    fn with_templates(templates: Vec<(String, String)>, special: Map<String, Json>) -> Result<ChatTemplate> {
        let mut env = environment();
        let mut names = Vec::new();
        for (name, source) in templates {
            env.add_template_owned(name.clone(), unwrap_generation_blocks(&source))
                .map_err(|e| template_error(format!("template `{name}` does not compile: {}", describe(&e))))?;
            names.push(name);
        }
        Ok(ChatTemplate { env, names, special })
    }

    /// The names of the templates (`["default"]` for a single one).
    pub fn names(&self) -> &[String] {
        &self.names
    }

    /// Renders `messages` (an OpenAI-style array of `{"role", "content", ...}`) with the
    /// request's `tools` (its OpenAI-style array; `None` when it has none), the generation
    /// prompt if asked, and `kwargs` (`chat_template_kwargs`, such as `enable_thinking`) as
    /// template variables (they may replace a special token's, not `messages`, `tools` or
    /// `add_generation_prompt`). An assistant message's `tool_calls[].function.arguments` given as a
    /// JSON string (as OpenAI clients send them) is passed to the template as the object it
    /// encodes, as vLLM does, since templates iterate over it. Of several named templates,
    /// `tool_use` is taken when there are tools and the template has one, `default` otherwise
    /// (transformers' rule). A template's `raise_exception("...")` is an error with its message.
    pub fn render(
        &self,
        messages: &Json,
        tools: Option<&Json>,
        add_generation_prompt: bool,
        kwargs: &Map<String, Json>,
    ) -> Result<String> {
        let Json::Array(list) = messages else {
            return Err(template_error("`messages` must be an array of messages"));
        };
        let messages: Vec<Json> = list.iter().map(arguments_as_objects).collect();
        let name = self.pick(tools.is_some())?;
        let template = self.env.get_template(name).map_err(|e| template_error(describe(&e)))?;
        let mut ctx = self.special.clone();
        ctx.extend(kwargs.iter().map(|(k, v)| (k.clone(), v.clone())));
        ctx.insert("messages".into(), Json::Array(messages));
        ctx.insert("tools".into(), tools.cloned().unwrap_or(Json::Null));
        ctx.insert("add_generation_prompt".into(), Json::Bool(add_generation_prompt));
        template.render(Value::from_serialize(&ctx)).map_err(|e| template_error(describe(&e)))
    }

    fn pick(&self, has_tools: bool) -> Result<&str> {
        let has = |n: &str| self.names.iter().any(|m| m == n);
        if has_tools && has("tool_use") {
            Ok("tool_use")
        } else if has("default") {
            Ok("default")
        } else {
            Err(template_error(format!("none of the chat templates {:?} is named `default`", self.names)))
        }
    }
}

/// An error with what minijinja knows of where it happened.
fn describe(e: &minijinja::Error) -> String {
    let mut s = match e.kind() {
        ErrorKind::InvalidOperation if e.detail().is_some_and(|d| d.starts_with(RAISED)) => {
            format!("the template refused the request: {}", &e.detail().unwrap_or_default()[RAISED.len()..])
        }
        _ => e.to_string(),
    };
    let mut source = std::error::Error::source(e);
    while let Some(inner) = source {
        s.push_str(&format!(": {inner}"));
        source = inner.source();
    }
    s
}

/// Marks the error `raise_exception` raises.
const RAISED: &str = "raise_exception: ";

/// A message with its tool calls' `arguments` parsed from JSON strings into objects.
fn arguments_as_objects(message: &Json) -> Json {
    let mut message = message.clone();
    if let Some(Json::Array(calls)) = message.get_mut("tool_calls") {
        for call in calls {
            let Some(function) = call.get_mut("function") else { continue };
            if let Some(Json::String(text)) = function.get("arguments")
                && let Ok(parsed @ Json::Object(_)) = serde_json::from_str::<Json>(text)
                && let Some(slot) = function.get_mut("arguments")
            {
                *slot = parsed;
            }
        }
    }
    message
}

/// `{% generation %}` / `{% endgeneration %}` (transformers' marker of assistant text for
/// training masks) as a block that renders its body, keeping the whitespace control.
fn unwrap_generation_blocks(source: &str) -> String {
    let mut out = String::with_capacity(source.len());
    let mut rest = source;
    while let Some(at) = rest.find("{%") {
        out.push_str(&rest[..at]);
        let tag = &rest[at..];
        let Some(end) = tag.find("%}") else {
            out.push_str(tag);
            return out;
        };
        let inner = &tag[2..end];
        let (open_ctl, body) = split_control(inner);
        let (body, close_ctl) = split_control_end(body);
        let replaced = match body.trim() {
            "generation" => Some("if true"),
            "endgeneration" => Some("endif"),
            _ => None,
        };
        match replaced {
            Some(word) => out.push_str(&format!("{{%{open_ctl} {word} {close_ctl}%}}")),
            None => out.push_str(&tag[..end + 2]),
        }
        rest = &tag[end + 2..];
    }
    out.push_str(rest);
    out
}

fn split_control(s: &str) -> (&str, &str) {
    match s.chars().next() {
        Some(c @ ('-' | '+')) => (&s[..c.len_utf8()], &s[c.len_utf8()..]),
        _ => ("", s),
    }
}

fn split_control_end(s: &str) -> (&str, &str) {
    match s.chars().last() {
        Some('-' | '+') => (&s[..s.len() - 1], &s[s.len() - 1..]),
        _ => (s, ""),
    }
}

/// A minijinja environment set up as transformers sets up Jinja2 for chat templates.
fn environment() -> Environment<'static> {
    let mut env = Environment::new();
    env.set_trim_blocks(true);
    env.set_lstrip_blocks(true);
    env.set_undefined_behavior(UndefinedBehavior::Lenient);
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.set_formatter(|out, _state, value| {
        if value.is_undefined() {
            return Ok(());
        }
        out.write_str(&python_str(value)).map_err(|_| minijinja::Error::from(ErrorKind::WriteFailure))
    });
    // Jinja2's tests, which ask Python: none is not iterable (minijinja iterates it as
    // empty); a str, a list and a dict are sequences (they have a length and items).
    env.add_test("iterable", |v: Value| {
        matches!(v.kind(), ValueKind::Seq | ValueKind::Map | ValueKind::Iterable | ValueKind::String | ValueKind::Bytes)
    });
    env.add_test("sequence", |v: Value| {
        matches!(v.kind(), ValueKind::Seq | ValueKind::Map | ValueKind::String | ValueKind::Bytes)
    });
    env.add_filter("tojson", tojson);
    env.add_filter("string", |v: Value| Value::from(python_str(&v)));
    env.add_function("raise_exception", |msg: Rest<Value>| -> Result<Value, minijinja::Error> {
        let text: Vec<String> = msg.iter().map(python_str).collect();
        Err(minijinja::Error::new(ErrorKind::InvalidOperation, format!("{RAISED}{}", text.join(" "))))
    });
    env.add_function("strftime_now", |fmt: String| strftime(&fmt, chrono::Utc::now()));
    env
}

/// A template value as JSON (what it came from: the context is JSON).
fn as_json(v: &Value) -> Option<Json> {
    serde_json::to_value(v).ok()
}

/// Python's `str()` of a value.
fn python_str(v: &Value) -> String {
    if let Some(s) = v.as_str() {
        return s.to_string();
    }
    if v.is_undefined() {
        return String::new();
    }
    match as_json(v) {
        Some(j) => str_of(&j),
        None => v.to_string(),
    }
}

/// transformers' `tojson`: `json.dumps(x, ensure_ascii=False, indent=None, separators=None,
/// sort_keys=False)`.
fn tojson(v: Value, kwargs: Kwargs) -> Result<Value, minijinja::Error> {
    let json = as_json(&v)
        .ok_or_else(|| minijinja::Error::new(ErrorKind::InvalidOperation, "tojson: the value is not JSON"))?;
    let mut style = JsonStyle::default();
    if let Some(indent) = kwargs.get::<Option<Value>>("indent")? {
        if let Some(n) = indent.as_usize() {
            style.indent = Some(n);
            style.item_sep = ",".into();
        } else if !indent.is_none() {
            return Err(minijinja::Error::new(ErrorKind::InvalidOperation, "tojson: `indent` must be an integer"));
        }
    }
    if let Some(seps) = kwargs.get::<Option<Vec<String>>>("separators")? {
        match seps.as_slice() {
            [item, key] => (style.item_sep, style.key_sep) = (item.clone(), key.clone()),
            _ => {
                return Err(minijinja::Error::new(
                    ErrorKind::InvalidOperation,
                    "tojson: `separators` takes two strings",
                ));
            }
        }
    }
    style.sort_keys = kwargs.get::<Option<bool>>("sort_keys")?.unwrap_or(false);
    style.ensure_ascii = kwargs.get::<Option<bool>>("ensure_ascii")?.unwrap_or(false);
    kwargs.assert_all_used()?;
    Ok(Value::from_safe_string(json_dumps(&json, &style)))
}

/// Python's `strftime` of `t` (chrono's directives are Python's); a format chrono cannot read
/// (an unknown directive) is returned as written.
fn strftime(fmt: &str, t: chrono::DateTime<chrono::Utc>) -> String {
    use std::fmt::Write;
    let mut out = String::new();
    match write!(out, "{}", t.format(fmt)) {
        Ok(()) => out,
        Err(_) => fmt.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn render(src: &str, messages: Json) -> Result<String> {
        ChatTemplate::new(src, Map::new())?.render(&messages, None, false, &Map::new())
    }

    #[test]
    fn shareable_between_threads() {
        fn check<T: Send + Sync>() {}
        check::<ChatTemplate>();
    }

    #[test]
    fn dates() {
        let at = |secs| chrono::DateTime::from_timestamp(secs, 0).unwrap();
        // 2024-02-29 12:34:56 UTC, a Thursday, day 60.
        let t = at(1_709_210_096);
        assert_eq!(strftime("%d %B %Y, %a %b %j %I%p %%", t), "29 February 2024, Thu Feb 060 12PM %");
        assert_eq!(strftime("%A %F %T %e %y", at(0)), "Thursday 1970-01-01 00:00:00  1 70");
        // 2000-12-31 is day 366 of a leap year.
        assert_eq!(strftime("%j", at(978_220_800)), "366");
        // What chrono cannot read comes back as written.
        assert_eq!(strftime("%Q %d", t), "%Q %d");
    }

    #[test]
    fn python_flavoured_rendering() {
        let src = "{{ messages[0].content.strip().split(',')[-1] }}|{{ messages[0].x }}|{{ messages[0].x | string }}|{{ messages[0] | tojson }}|{{ none }}";
        let out = render(src, json!([{"content": " a,b ", "x": true}])).unwrap();
        assert_eq!(out, r#"b|True|True|{"content": " a,b ", "x": true}|None"#);
        let src = "{{ none is iterable }} {{ tools is iterable }} {{ 'ab' is sequence }} {{ messages[0] is sequence }} {{ 3 is iterable }}";
        assert_eq!(render(src, json!([{}])).unwrap(), "False False True True False");
        let out = render("{%- generation -%} x {%- endgeneration %}", json!([])).unwrap();
        assert_eq!(out, "x");
    }

    #[test]
    fn errors_are_clear() {
        let err = render("{{ raise_exception('only user and assistant roles') }}", json!([])).unwrap_err();
        assert!(err.to_string().contains("the template refused the request: only user and assistant roles"), "{err}");
        let err = ChatTemplate::new("{% if %}", Map::new()).unwrap_err();
        assert!(err.to_string().contains("does not compile"), "{err}");
        let err = render("x", json!({"role": "user"})).unwrap_err();
        assert!(err.to_string().contains("must be an array"), "{err}");
        let none = ChatTemplate::from_config(&json!({"eos_token": "</s>"}), None).unwrap();
        assert!(none.is_none());
        let bad = ChatTemplate::from_config(&json!({"chat_template": 3}), None).unwrap_err();
        assert!(bad.to_string().contains("must be a string or a list"), "{bad}");
    }

    #[test]
    fn named_templates_and_tool_arguments() {
        let config = json!({
            "chat_template": [{"name": "default", "template": "D"}, {"name": "tool_use", "template": "T{{ bos_token }}"}],
            "bos_token": {"content": "<s>", "lstrip": false},
        });
        let t = ChatTemplate::from_config(&config, None).unwrap().unwrap();
        assert_eq!(t.render(&json!([]), None, false, &Map::new()).unwrap(), "D");
        assert_eq!(t.render(&json!([]), Some(&json!([])), false, &Map::new()).unwrap(), "T<s>");
        let src = "{% for k, v in messages[0].tool_calls[0].function.arguments | items %}{{ k }}={{ v }};{% endfor %}";
        let msg = json!([{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{\"b\": 1, \"a\": [2]}"}}]}]);
        assert_eq!(render(src, msg).unwrap(), "b=1;a=[2];");
    }
}
