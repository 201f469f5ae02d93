//! What both endpoints read besides the prompt ([`Common`], through [`common`], within the
//! server's [`Limits`]; a field this server knows but cannot honour refused by name), and the
//! engine's parameters of a request from it ([`request_params`]).

use serde_json::Value;

use super::api::{ApiError, Fields};
use crate::engine::RequestParams;
use crate::sampling::SamplingParams;
use crate::structured::Format;

/// What a request may ask for, the server's settings (`serve --max-stop`, `--max-stop-bytes`):
/// each stop string is matched against every piece of text generated, so their number and
/// length bound that work.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    pub max_stop: usize,
    pub max_stop_bytes: usize,
}

impl Default for Limits {
    /// 8 stop strings (OpenAI takes 4) of at most 256 bytes.
    fn default() -> Limits {
        Limits { max_stop: 8, max_stop_bytes: 256 }
    }
}

/// What both endpoints read besides the prompt.
#[derive(Debug, Clone)]
pub struct Common {
    pub model: Option<String>,
    pub stream: bool,
    pub include_usage: bool,
    /// `max_tokens` (or chat's `max_completion_tokens`), if given.
    pub max_tokens: Option<usize>,
    pub sampling: SamplingParams,
    pub stop: Vec<String>,
    /// vLLM's extension: logprobs name tokens as `token_id:N`.
    pub token_ids: bool,
    /// vLLM's extension: the eos ids do not end the generation (it runs to `max_tokens`, or a
    /// stop string).
    pub ignore_eos: bool,
    /// vLLM's extension: token ids that end the generation (included in it), `ignore_eos` or not.
    pub stop_token_ids: Vec<u32>,
    /// vLLM's extension: the first this many tokens are never the eos ids or `stop_token_ids`,
    /// and their text ends nothing (stop strings count from the next token on).
    pub min_tokens: usize,
    /// The structured output asked for, and the field it came in ([`super::format`]).
    pub format: Option<(Format, String)>,
}

/// Most `stop_token_ids` a request may give.
pub const MAX_STOP_TOKEN_IDS: usize = 64;

/// Refuses the fields both endpoints know but cannot honour: a non-empty `logit_bias`.
fn unsupported(f: &Fields) -> Result<(), ApiError> {
    if f.object("logit_bias")?.is_some_and(|b| !b.is_empty()) {
        return Err(ApiError::invalid(Some("logit_bias"), "`logit_bias` is not supported by this server"));
    }
    Ok(())
}

/// `stop_token_ids`: a list of at most [`MAX_STOP_TOKEN_IDS`] token ids (checked against the
/// vocabulary when the prompt is).
fn stop_token_ids(f: &Fields) -> Result<Vec<u32>, ApiError> {
    let bad = |m: String| Err(ApiError::invalid(Some("stop_token_ids"), m));
    let list = match f.get_raw("stop_token_ids") {
        None => return Ok(vec![]),
        Some(Value::Array(list)) => list,
        Some(_) => return bad("`stop_token_ids` must be a list of token ids".into()),
    };
    if list.len() > MAX_STOP_TOKEN_IDS {
        return bad(format!("`stop_token_ids` may hold at most {MAX_STOP_TOKEN_IDS} ids, not {}", list.len()));
    }
    token_ids(list).map_or_else(|| bad("`stop_token_ids` must hold token ids (non-negative integers)".into()), Ok)
}

/// A JSON list as token ids, `None` unless every entry is an integer that fits a u32.
pub fn token_ids(list: &[Value]) -> Option<Vec<u32>> {
    list.iter().map(|t| t.as_u64().and_then(|t| u32::try_from(t).ok())).collect()
}

/// Reads the fields both endpoints share. `logprobs` is chat's (a boolean with
/// `top_logprobs`) when `chat`, else completions' (the number of top tokens).
pub fn common(f: &Fields, chat: bool, seed: u64, limits: &Limits) -> Result<Common, ApiError> {
    let mut s = SamplingParams { temperature: 1.0, seed, ..SamplingParams::greedy() };
    if let Some(t) = f.f32("temperature")? {
        if !(t.is_finite() && t >= 0.0) {
            return Err(ApiError::invalid(Some("temperature"), format!("`temperature` must be >= 0, not {t}")));
        }
        s.temperature = t;
    }
    if let Some(p) = f.f32("top_p")? {
        if !(p > 0.0 && p <= 1.0) {
            return Err(ApiError::invalid(Some("top_p"), format!("`top_p` must be in (0, 1], not {p}")));
        }
        s.top_p = (p < 1.0).then_some(p);
    }
    match f.i64("top_k")? {
        None | Some(-1) | Some(0) => {}
        Some(k) if k > 0 => s.top_k = Some(k as usize),
        Some(k) => return Err(ApiError::invalid(Some("top_k"), format!("`top_k` must be >= 1 (or -1: off), not {k}"))),
    }
    if let Some(p) = f.f32("min_p")? {
        if !(0.0..=1.0).contains(&p) {
            return Err(ApiError::invalid(Some("min_p"), format!("`min_p` must be in [0, 1], not {p}")));
        }
        s.min_p = (p > 0.0).then_some(p);
    }
    for name in ["presence_penalty", "frequency_penalty"] {
        if let Some(v) = f.f32(name)? {
            if !(-2.0..=2.0).contains(&v) {
                return Err(ApiError::invalid(Some(name), format!("`{name}` must be in [-2, 2], not {v}")));
            }
            if name == "presence_penalty" {
                s.presence_penalty = v;
            } else {
                s.frequency_penalty = v;
            }
        }
    }
    if let Some(r) = f.f32("repetition_penalty")? {
        if !(r.is_finite() && r > 0.0) {
            return Err(ApiError::invalid(
                Some("repetition_penalty"),
                format!("`repetition_penalty` must be > 0, not {r}"),
            ));
        }
        s.repetition_penalty = r;
    }
    if let Some(seed) = f.seed()? {
        s.seed = seed;
    }
    if chat {
        s.logprobs = f.bool("logprobs")?.unwrap_or(false);
        if let Some(n) = f.count("top_logprobs")? {
            if n > 20 {
                return Err(ApiError::invalid(
                    Some("top_logprobs"),
                    format!("`top_logprobs` must be at most 20, not {n}"),
                ));
            }
            if n > 0 && !s.logprobs {
                return Err(ApiError::invalid(Some("top_logprobs"), "`top_logprobs` needs `logprobs: true`"));
            }
            s.top_logprobs = n;
        }
    } else if let Some(n) = f.count("logprobs")? {
        if n > 20 {
            return Err(ApiError::invalid(Some("logprobs"), format!("`logprobs` must be at most 20, not {n}")));
        }
        s.logprobs = true;
        s.top_logprobs = n;
    }
    unsupported(f)?;
    for name in ["n", "best_of"] {
        if let Some(n) = f.i64(name)?.filter(|&n| n != 1) {
            return Err(ApiError::invalid(Some(name), format!("`{name}` must be 1 (one choice per request), not {n}")));
        }
    }
    let names: &[&str] = if chat { &["max_completion_tokens", "max_tokens"] } else { &["max_tokens"] };
    let mut max_tokens = None;
    for &name in names {
        if let Some(n) = f.i64(name)? {
            if n < 1 {
                return Err(ApiError::invalid(Some(name), format!("`{name}` must be at least 1, not {n}")));
            }
            max_tokens.get_or_insert(n as usize);
        }
    }
    s.check().map_err(|e| ApiError::invalid(None, e.to_string()))?;
    let stream = f.bool("stream")?.unwrap_or(false);
    let include_usage = match f.object("stream_options")? {
        Some(_) if !stream => {
            return Err(ApiError::invalid(
                Some("stream_options"),
                "`stream_options` is only allowed when `stream` is true",
            ));
        }
        Some(o) => Fields(o).bool("include_usage")?.unwrap_or(false),
        None => false,
    };
    Ok(Common {
        model: f.str("model")?.map(str::to_string),
        stream,
        include_usage,
        max_tokens,
        sampling: s,
        stop: f.stop(limits)?,
        token_ids: f.bool("return_tokens_as_token_ids")?.unwrap_or(false),
        ignore_eos: f.bool("ignore_eos")?.unwrap_or(false),
        stop_token_ids: stop_token_ids(f)?,
        min_tokens: f.count("min_tokens")?.unwrap_or(0),
        format: super::format::read(f)?,
    })
}

/// The engine's parameters for a prompt of `prompt_len` tokens, checked against the context
/// of `max_len` tokens (`param` names the prompt's field in errors); `stop_tokens` (the model's
/// eos ids) end the generation unless the request ignores them, its `stop_token_ids` always.
pub fn request_params(
    c: &Common,
    prompt_len: usize,
    max_len: usize,
    stop_tokens: Vec<u32>,
    param: &str,
) -> Result<RequestParams, ApiError> {
    if prompt_len == 0 {
        return Err(ApiError::invalid(Some(param), "The prompt is empty"));
    }
    if prompt_len >= max_len {
        return Err(ApiError::context(
            param,
            format!("The prompt is {prompt_len} tokens; this model's context is {max_len} tokens"),
        ));
    }
    let room = max_len - prompt_len;
    let max_new_tokens = match c.max_tokens {
        Some(n) if n > room => {
            return Err(ApiError::context(
                "max_tokens",
                format!(
                    "The prompt is {prompt_len} tokens and {n} more were asked for; this model's context is {max_len} tokens"
                ),
            ));
        }
        Some(n) => n,
        None => room,
    };
    if c.min_tokens > max_new_tokens {
        let (n, max) = (c.min_tokens, max_new_tokens);
        let message = match c.max_tokens {
            Some(_) => format!("`min_tokens` ({n}) must be at most `max_tokens` ({max})"),
            None => format!("`min_tokens` ({n}) must be at most the {max} tokens the context leaves"),
        };
        return Err(ApiError::invalid(Some("min_tokens"), message));
    }
    let mut stop_tokens = if c.ignore_eos { vec![] } else { stop_tokens };
    stop_tokens.extend(c.stop_token_ids.iter().filter(|t| !stop_tokens.contains(t)).collect::<Vec<_>>());
    Ok(RequestParams { max_new_tokens, sampling: c.sampling, stop_tokens, min_new_tokens: c.min_tokens })
}

#[cfg(test)]
mod tests {
    use axum::http::StatusCode;
    use serde_json::json;

    use super::super::api::parse_body;
    use super::*;

    fn read(body: &str, chat: bool) -> Result<Common, ApiError> {
        let m = parse_body(body.as_bytes())?;
        common(&Fields(&m), chat, 7, &Limits::default())
    }

    #[test]
    fn fields_map_onto_sampling() {
        let c = read(
            r#"{"temperature": 0.5, "top_p": 0.9, "top_k": 40, "min_p": 0.1, "seed": 3, "presence_penalty": 0.5,
            "frequency_penalty": -0.5, "repetition_penalty": 1.1, "logprobs": true, "top_logprobs": 2,
            "max_completion_tokens": 9, "stop": "x", "stream": true, "stream_options": {"include_usage": true}}"#,
            true,
        )
        .unwrap();
        let s = c.sampling;
        assert_eq!((s.temperature, s.top_p, s.top_k, s.min_p, s.seed), (0.5, Some(0.9), Some(40), Some(0.1), 3));
        assert_eq!((s.presence_penalty, s.frequency_penalty, s.repetition_penalty), (0.5, -0.5, 1.1));
        assert_eq!((s.logprobs, s.top_logprobs, c.max_tokens), (true, 2, Some(9)));
        assert!(c.stream && c.include_usage && c.stop == ["x"]);
        let c = read(r#"{"logprobs": 3, "top_k": -1}"#, false).unwrap();
        assert_eq!(
            (c.sampling.logprobs, c.sampling.top_logprobs, c.sampling.top_k, c.sampling.seed),
            (true, 3, None, 7)
        );
    }

    #[test]
    fn bad_values_name_their_field() {
        for (body, param) in [
            (r#"{"temperature": -1}"#, "temperature"),
            (r#"{"temperature": "hot"}"#, "temperature"),
            (r#"{"top_p": 0}"#, "top_p"),
            (r#"{"top_p": 1.5}"#, "top_p"),
            (r#"{"n": 2}"#, "n"),
            (r#"{"max_tokens": 0}"#, "max_tokens"),
            (r#"{"stop": 3}"#, "stop"),
            (r#"{"top_logprobs": 30, "logprobs": true}"#, "top_logprobs"),
            (r#"{"stream": "yes"}"#, "stream"),
            (r#"{"ignore_eos": 1}"#, "ignore_eos"),
            (r#"{"logit_bias": {"17": 100}}"#, "logit_bias"),
            (r#"{"logit_bias": [1]}"#, "logit_bias"),
            (r#"{"response_format": {"type": "json_schema", "json_schema": {}}}"#, "response_format"),
            (r#"{"response_format": {}}"#, "response_format"),
            (r#"{"guided_choice": []}"#, "guided_choice"),
            (r#"{"stream_options": {"include_usage": true}}"#, "stream_options"),
            (r#"{"stream": false, "stream_options": {}}"#, "stream_options"),
        ] {
            let e = read(body, true).unwrap_err();
            assert_eq!((e.status, e.param.as_deref()), (StatusCode::BAD_REQUEST, Some(param)), "{body}: {e:?}");
        }
        // What changes nothing is taken: an empty bias, plain text, vLLM's fields set to null.
        read(r#"{"logit_bias": {}, "response_format": {"type": "text"}, "guided_json": null}"#, true).unwrap();
        assert!(parse_body(b"{nope").unwrap_err().message.contains("not valid JSON"));
        assert!(parse_body(b"[1]").unwrap_err().message.contains("JSON object"));
        let c = read("{}", false).unwrap();
        assert_eq!(request_params(&c, 10, 10, vec![], "prompt").unwrap_err().code, Some("context_length_exceeded"));
        assert_eq!(request_params(&c, 4, 10, vec![], "prompt").unwrap().max_new_tokens, 6);
        assert_eq!(request_params(&c, 4, 10, vec![2, 3], "prompt").unwrap().stop_tokens, [2, 3]);
        let c = read(r#"{"ignore_eos": true}"#, false).unwrap();
        assert_eq!(request_params(&c, 4, 10, vec![2, 3], "prompt").unwrap().stop_tokens, Vec::<u32>::new());
        // stop_token_ids join the eos ids, and stay with ignore_eos.
        let c = read(r#"{"stop_token_ids": [7, 3, 9]}"#, false).unwrap();
        assert_eq!(request_params(&c, 4, 10, vec![2, 3], "prompt").unwrap().stop_tokens, [2, 3, 7, 9]);
        let c = read(r#"{"stop_token_ids": [7], "ignore_eos": true, "min_tokens": 0}"#, false).unwrap();
        assert_eq!(request_params(&c, 4, 10, vec![2, 3], "prompt").unwrap().stop_tokens, [7]);
        let many = format!(r#"{{"stop_token_ids": {:?}}}"#, vec![1; MAX_STOP_TOKEN_IDS + 1]);
        for body in
            [r#"{"stop_token_ids": 5}"#, r#"{"stop_token_ids": [1, -1]}"#, r#"{"stop_token_ids": [4294967296]}"#, &many]
        {
            assert_eq!(read(body, true).unwrap_err().param.as_deref(), Some("stop_token_ids"), "{body}");
        }
        // min_tokens reaches the engine, within max_tokens (or the context's room).
        let c = read(r#"{"min_tokens": 4, "max_tokens": 5}"#, true).unwrap();
        assert_eq!(request_params(&c, 4, 10, vec![2], "prompt").unwrap().min_new_tokens, 4);
        let c = read(r#"{"min_tokens": 6, "max_tokens": 5}"#, true).unwrap();
        let e = request_params(&c, 4, 10, vec![2], "prompt").unwrap_err();
        assert_eq!(
            (e.param.as_deref(), e.message.as_str()),
            (Some("min_tokens"), "`min_tokens` (6) must be at most `max_tokens` (5)")
        );
        let c = read(r#"{"min_tokens": 7}"#, true).unwrap();
        assert!(
            request_params(&c, 4, 10, vec![2], "prompt")
                .unwrap_err()
                .message
                .contains("the 6 tokens the context leaves")
        );
        for body in [r#"{"min_tokens": -1}"#, r#"{"min_tokens": 1.5}"#, r#"{"min_tokens": "2"}"#] {
            assert_eq!(read(body, true).unwrap_err().param.as_deref(), Some("min_tokens"), "{body}");
        }
    }

    /// Integers as clients send them: `4.0` is 4, a fraction is not an integer; seeds over the
    /// whole u64 range (as `generate --seed`), negative ones as vLLM takes them.
    #[test]
    fn integers_and_seeds() {
        assert_eq!(read(r#"{"max_tokens": 4.0}"#, false).unwrap().max_tokens, Some(4));
        for (body, param, says) in [
            (r#"{"max_tokens": 4.5}"#, "max_tokens", "must be an integer, not 4.5"),
            (r#"{"seed": 1.5}"#, "seed", "must be an integer, not 1.5"),
            (r#"{"seed": 18446744073709551616}"#, "seed", "must be in"),
            (r#"{"seed": -1e19}"#, "seed", "must be in"),
            (r#"{"top_k": 1e300}"#, "top_k", "must be in"),
            (r#"{"seed": "1"}"#, "seed", "must be an integer, not a string"),
        ] {
            let e = read(body, false).unwrap_err();
            assert_eq!(e.param.as_deref(), Some(param), "{body}");
            assert!(e.message.contains(says), "{body}: {}", e.message);
        }
        for (body, seed) in [
            (r#"{"seed": 18446744073709551615}"#, u64::MAX),
            (r#"{"seed": 9223372036854775808}"#, 1 << 63),
            (r#"{"seed": -1}"#, u64::MAX),
            (r#"{"seed": 7.0}"#, 7),
        ] {
            assert_eq!(read(body, false).unwrap().sampling.seed, seed, "{body}");
        }
    }

    /// At most `max_stop` stop strings of at most `max_stop_bytes` bytes each.
    #[test]
    fn stop_strings_are_bounded() {
        let limits = Limits { max_stop: 3, max_stop_bytes: 5 };
        let stop = |v: Value| {
            let m = json!({ "stop": v }).as_object().cloned().unwrap();
            common(&Fields(&m), true, 7, &limits).map(|c| c.stop)
        };
        assert_eq!(stop(json!(["a", "bb", "ccccc"])).unwrap(), ["a", "bb", "ccccc"]);
        assert_eq!(stop(json!("ddddd")).unwrap(), ["ddddd"]);
        let e = stop(json!(["a", "b", "c", "d"])).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("stop"));
        assert!(e.message.contains("holds 4 strings; this server takes at most 3"), "{}", e.message);
        let e = stop(json!("éééé")).unwrap_err();
        assert!(e.message.contains("of 8 bytes; this server takes at most 5 bytes"), "{}", e.message);
        let many: Vec<String> = (0..110_000).map(|i| i.to_string()).collect();
        assert!(common(&Fields(json!({ "stop": many }).as_object().unwrap()), true, 7, &Limits::default()).is_err());
    }
}
