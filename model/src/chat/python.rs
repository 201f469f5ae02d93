//! Values printed the way Python prints them, for templates written against transformers'
//! Jinja2: `str()` (what `{{ x }}` and the `string` filter give: `True`, `None`,
//! `{'a': [1, 2]}`), `repr()` of the pieces inside containers, and `json.dumps` (what
//! transformers' `tojson` filter calls: `", "` and `": "` separators, non-ASCII kept, no HTML
//! escaping, keys in their order).

use serde_json::Value;

/// Python's `str(x)` of a JSON value: a string is itself, everything else its `repr`.
pub fn str_of(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        _ => {
            let mut out = String::new();
            repr_into(&mut out, v);
            out
        }
    }
}

/// Python's `repr(x)` of a JSON value (as the dict, list, str, int, float, bool or None that
/// `json.loads` would have made of it).
fn repr_into(out: &mut String, v: &Value) {
    match v {
        Value::Null => out.push_str("None"),
        Value::Bool(true) => out.push_str("True"),
        Value::Bool(false) => out.push_str("False"),
        Value::Number(n) => number_into(out, n),
        Value::String(s) => str_repr_into(out, s),
        Value::Array(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                repr_into(out, item);
            }
            out.push(']');
        }
        Value::Object(map) => {
            out.push('{');
            for (i, (k, item)) in map.iter().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                str_repr_into(out, k);
                out.push_str(": ");
                repr_into(out, item);
            }
            out.push('}');
        }
    }
}

/// Python's `repr` of a str: single quotes unless the text has a `'` and no `"`.
fn str_repr_into(out: &mut String, s: &str) {
    let quote = if s.contains('\'') && !s.contains('"') { '"' } else { '\'' };
    out.push(quote);
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c == quote => {
                out.push('\\');
                out.push(c);
            }
            c if (c as u32) < 0x20 || c as u32 == 0x7f => out.push_str(&format!("\\x{:02x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push(quote);
}

/// An int as Python prints it; a float as Python's `repr(float)`: the shortest digits that
/// read back, in positional notation for exponents -4 to 15 (with a `.0` when whole) and
/// scientific (`1e-05`, `1e+16`) outside.
fn number_into(out: &mut String, n: &serde_json::Number) {
    if n.is_f64() {
        out.push_str(&float_repr(n.as_f64().unwrap_or(f64::NAN)));
    } else {
        out.push_str(&n.to_string());
    }
}

fn float_repr(x: f64) -> String {
    if x.is_nan() {
        return "NaN".into();
    }
    if x.is_infinite() {
        return if x > 0.0 { "Infinity".into() } else { "-Infinity".into() };
    }
    if x == 0.0 {
        return if x.is_sign_negative() { "-0.0".into() } else { "0.0".into() };
    }
    // Rust's `{:e}` gives the shortest round-trip digits: "1.2345e-5", "1e16".
    let sci = format!("{x:e}");
    let (mantissa, exp) = sci.split_once('e').unwrap_or((&sci, "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    if (-4..16).contains(&exp) {
        let s = format!("{x}");
        if s.contains('.') { s } else { format!("{s}.0") }
    } else {
        let sign = if exp < 0 { '-' } else { '+' };
        format!("{mantissa}e{sign}{:02}", exp.abs())
    }
}

/// How `json.dumps` lays a value out.
pub struct JsonStyle {
    /// `indent=N`: newlines and N spaces per level; `None` keeps one line.
    pub indent: Option<usize>,
    /// Between items (`", "` by default, `","` when indenting).
    pub item_sep: String,
    /// Between a key and its value (`": "`).
    pub key_sep: String,
    /// `sort_keys=True`.
    pub sort_keys: bool,
    /// `ensure_ascii=True`: non-ASCII characters as `\uXXXX` escapes.
    pub ensure_ascii: bool,
}

impl Default for JsonStyle {
    /// transformers' `tojson`: `json.dumps(x, ensure_ascii=False)`.
    fn default() -> Self {
        JsonStyle { indent: None, item_sep: ", ".into(), key_sep: ": ".into(), sort_keys: false, ensure_ascii: false }
    }
}

/// `json.dumps(v, ...)` in the given style.
pub fn json_dumps(v: &Value, style: &JsonStyle) -> String {
    let mut out = String::new();
    json_into(&mut out, v, style, 0);
    out
}

fn json_into(out: &mut String, v: &Value, style: &JsonStyle, depth: usize) {
    let newline = |out: &mut String, depth: usize| {
        if let Some(n) = style.indent {
            out.push('\n');
            out.extend(std::iter::repeat_n(' ', n * depth));
        }
    };
    match v {
        Value::Null => out.push_str("null"),
        Value::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
        Value::Number(n) => number_into(out, n),
        Value::String(s) => json_str_into(out, s, style.ensure_ascii),
        Value::Array(items) if items.is_empty() => out.push_str("[]"),
        Value::Array(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(&style.item_sep);
                }
                newline(out, depth + 1);
                json_into(out, item, style, depth + 1);
            }
            newline(out, depth);
            out.push(']');
        }
        Value::Object(map) if map.is_empty() => out.push_str("{}"),
        Value::Object(map) => {
            let mut entries: Vec<_> = map.iter().collect();
            if style.sort_keys {
                entries.sort_by(|a, b| a.0.cmp(b.0));
            }
            out.push('{');
            for (i, (k, item)) in entries.into_iter().enumerate() {
                if i > 0 {
                    out.push_str(&style.item_sep);
                }
                newline(out, depth + 1);
                json_str_into(out, k, style.ensure_ascii);
                out.push_str(&style.key_sep);
                json_into(out, item, style, depth + 1);
            }
            newline(out, depth);
            out.push('}');
        }
    }
}

/// A JSON string as Python's encoder writes it.
fn json_str_into(out: &mut String, s: &str, ensure_ascii: bool) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c if ensure_ascii && !c.is_ascii() => {
                let mut units = [0u16; 2];
                for u in c.encode_utf16(&mut units) {
                    out.push_str(&format!("\\u{u:04x}"));
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn prints_like_python() {
        let v = json!({"a": [1, 2.5, true, null], "b'": "it's", "c": 1e-5, "d": 1e16, "e": 3.0});
        assert_eq!(str_of(&v), r#"{'a': [1, 2.5, True, None], "b'": "it's", 'c': 1e-05, 'd': 1e+16, 'e': 3.0}"#);
        assert_eq!(str_of(&json!("x")), "x");
        assert_eq!(str_of(&json!(false)), "False");
        assert_eq!(float_repr(0.1), "0.1");
        assert_eq!(float_repr(123456789012345.0), "123456789012345.0");
        assert_eq!(float_repr(-2.5e-7), "-2.5e-07");
    }

    #[test]
    fn dumps_like_python() {
        let v = json!({"z": "é\n<b>", "a": [], "m": {"k": [1, {}]}});
        assert_eq!(json_dumps(&v, &JsonStyle::default()), r#"{"z": "é\n<b>", "a": [], "m": {"k": [1, {}]}}"#);
        let ascii = JsonStyle { ensure_ascii: true, ..JsonStyle::default() };
        assert_eq!(json_dumps(&json!("é😀"), &ascii), r#""\u00e9\ud83d\ude00""#);
        let indented = JsonStyle { indent: Some(2), item_sep: ",".into(), sort_keys: true, ..JsonStyle::default() };
        assert_eq!(json_dumps(&json!({"b": [1], "a": 2}), &indented), "{\n  \"a\": 2,\n  \"b\": [\n    1\n  ]\n}");
    }
}
