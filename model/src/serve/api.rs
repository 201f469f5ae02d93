//! The OpenAI request fields this server reads, checked one by one (so an error names the
//! field), and its errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`.
//! Fields it does not know are ignored (clients send many); `null` counts as absent. Fields it
//! knows but cannot honour are refused, never ignored, since ignoring them would answer a
//! different request than the one asked (`request::common`; in chat, a `tool_choice` other
//! than `auto` or `none` and the legacy `functions`). What both endpoints read besides the
//! prompt is read in `request.rs`.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::{Map, Value, json};

use super::request::Limits;

/// An error answer.
#[derive(Debug, Clone, PartialEq)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    pub kind: &'static str,
    pub param: Option<String>,
    pub code: Option<&'static str>,
}

impl ApiError {
    /// 400: the request is wrong in `param`.
    pub fn invalid(param: Option<&str>, message: impl Into<String>) -> ApiError {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            kind: "invalid_request_error",
            param: param.map(str::to_string),
            code: None,
        }
    }

    /// 400: the prompt (with the tokens asked for) does not fit the context.
    pub fn context(param: &str, message: String) -> ApiError {
        ApiError { code: Some("context_length_exceeded"), ..ApiError::invalid(Some(param), message) }
    }

    /// 404: no such model here.
    pub fn unknown_model(asked: &str, served: &str) -> ApiError {
        ApiError {
            status: StatusCode::NOT_FOUND,
            message: format!("The model `{asked}` does not exist; this server serves `{served}`"),
            kind: "invalid_request_error",
            param: Some("model".into()),
            code: Some("model_not_found"),
        }
    }

    /// 429: every slot and the queue are taken.
    pub fn busy(limit: usize) -> ApiError {
        ApiError {
            status: StatusCode::TOO_MANY_REQUESTS,
            message: format!("The server is busy: {limit} requests are running or queued; retry later"),
            kind: "rate_limit_error",
            param: None,
            code: Some("rate_limit_exceeded"),
        }
    }

    /// 500: the server failed this request.
    pub fn internal(message: impl Into<String>) -> ApiError {
        ApiError {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            message: message.into(),
            kind: "server_error",
            param: None,
            code: None,
        }
    }

    /// 404 for an unknown path.
    pub fn no_route(path: &str) -> ApiError {
        ApiError {
            status: StatusCode::NOT_FOUND,
            message: format!(
                "No route {path}: this server has /v1/chat/completions, /v1/completions, /v1/models, /tokenize, \
                 /detokenize, /metrics, /health"
            ),
            kind: "invalid_request_error",
            param: None,
            code: None,
        }
    }

    /// 405: a route this server has, asked with another method.
    pub fn wrong_method(method: &str, path: &str) -> ApiError {
        let allowed = if ["/v1/models", "/metrics", "/health"].contains(&path) { "GET" } else { "POST" };
        ApiError {
            status: StatusCode::METHOD_NOT_ALLOWED,
            message: format!("{path} takes {allowed}, not {method}"),
            kind: "invalid_request_error",
            param: None,
            code: None,
        }
    }

    /// 413: a request body past `limit` bytes.
    pub fn too_large(limit: usize) -> ApiError {
        ApiError {
            status: StatusCode::PAYLOAD_TOO_LARGE,
            message: format!("The request body is larger than this server's limit of {limit} bytes"),
            kind: "invalid_request_error",
            param: None,
            code: None,
        }
    }

    /// Any other error status, with `message`: a client error or a server error by its class.
    pub fn other(status: StatusCode, message: impl Into<String>) -> ApiError {
        let kind = if status.is_server_error() { "server_error" } else { "invalid_request_error" };
        ApiError { status, message: message.into(), kind, param: None, code: None }
    }

    /// The body: `{"error": {...}}`.
    pub fn body(&self) -> Value {
        json!({"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}})
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.status, axum::Json(self.body())).into_response()
    }
}

/// The request body as a JSON object.
pub fn parse_body(bytes: &[u8]) -> Result<Map<String, Value>, ApiError> {
    match serde_json::from_slice::<Value>(bytes) {
        Ok(Value::Object(m)) => Ok(m),
        Ok(_) => Err(ApiError::invalid(None, "The request body must be a JSON object")),
        Err(e) => Err(ApiError::invalid(None, format!("The request body is not valid JSON: {e}"))),
    }
}

/// Typed reads of a request's fields, each error naming the field.
pub struct Fields<'a>(pub &'a Map<String, Value>);

impl Fields<'_> {
    fn get(&self, name: &str) -> Option<&Value> {
        self.0.get(name).filter(|v| !v.is_null())
    }

    /// A field as it came (`None` when absent or null).
    pub fn get_raw(&self, name: &str) -> Option<&Value> {
        self.get(name)
    }

    /// Refuses the first of `names` that is present (not null): `` `name` is not supported: why``.
    pub fn refuse(&self, names: &[&str], why: &str) -> Result<(), ApiError> {
        match names.iter().find(|&&name| self.get(name).is_some()) {
            Some(name) => Err(ApiError::invalid(Some(name), format!("`{name}` is not supported: {why}"))),
            None => Ok(()),
        }
    }

    fn wrong(name: &str, want: &str, got: &Value) -> ApiError {
        let kind = match got {
            Value::Null => "null",
            Value::Bool(_) => "a boolean",
            Value::Number(_) => "a number",
            Value::String(_) => "a string",
            Value::Array(_) => "an array",
            Value::Object(_) => "an object",
        };
        ApiError::invalid(Some(name), format!("`{name}` must be {want}, not {kind}"))
    }

    pub fn f32(&self, name: &str) -> Result<Option<f32>, ApiError> {
        match self.get(name) {
            None => Ok(None),
            Some(v) => v.as_f64().map(|x| Some(x as f32)).ok_or_else(|| Self::wrong(name, "a number", v)),
        }
    }

    /// An integer in `lo..=hi`: a JSON integer, or a number with no fraction (`4.0`, as
    /// Python clients may send it); a fraction is refused as not an integer.
    fn integer(&self, name: &str, (lo, hi): (i128, i128)) -> Result<Option<i128>, ApiError> {
        let Some(v) = self.get(name) else { return Ok(None) };
        let n = match (v.as_i64(), v.as_u64(), v.as_f64()) {
            (Some(n), ..) => i128::from(n),
            (_, Some(n), _) => i128::from(n),
            // Saturating: past the range it stays past it.
            (.., Some(x)) if x.fract() == 0.0 => x as i128,
            (.., Some(x)) => {
                return Err(ApiError::invalid(Some(name), format!("`{name}` must be an integer, not {x}")));
            }
            _ => return Err(Self::wrong(name, "an integer", v)),
        };
        if !(lo..=hi).contains(&n) {
            return Err(ApiError::invalid(Some(name), format!("`{name}` must be in {lo}..={hi}, not {v}")));
        }
        Ok(Some(n))
    }

    pub fn i64(&self, name: &str) -> Result<Option<i64>, ApiError> {
        Ok(self.integer(name, (i64::MIN.into(), i64::MAX.into()))?.map(|n| n as i64))
    }

    /// `seed`: every u64 (as `generate --seed` takes), and the negative i64 that clients
    /// written for vLLM send, as their two's complement.
    pub fn seed(&self) -> Result<Option<u64>, ApiError> {
        Ok(self.integer("seed", (i64::MIN.into(), u64::MAX.into()))?.map(|n| n as u64))
    }

    /// A non-negative integer.
    pub fn count(&self, name: &str) -> Result<Option<usize>, ApiError> {
        match self.i64(name)? {
            Some(n) if n < 0 => Err(ApiError::invalid(Some(name), format!("`{name}` must be >= 0, not {n}"))),
            n => Ok(n.map(|n| n as usize)),
        }
    }

    pub fn bool(&self, name: &str) -> Result<Option<bool>, ApiError> {
        match self.get(name) {
            None => Ok(None),
            Some(v) => v.as_bool().map(Some).ok_or_else(|| Self::wrong(name, "a boolean", v)),
        }
    }

    pub fn str(&self, name: &str) -> Result<Option<&str>, ApiError> {
        match self.get(name) {
            None => Ok(None),
            Some(v) => v.as_str().map(Some).ok_or_else(|| Self::wrong(name, "a string", v)),
        }
    }

    pub fn object(&self, name: &str) -> Result<Option<&Map<String, Value>>, ApiError> {
        match self.get(name) {
            None => Ok(None),
            Some(v) => v.as_object().map(Some).ok_or_else(|| Self::wrong(name, "an object", v)),
        }
    }

    /// `stop`: a string or a list of strings, at most `limits.max_stop` of at most
    /// `limits.max_stop_bytes` bytes each.
    pub fn stop(&self, limits: &Limits) -> Result<Vec<String>, ApiError> {
        let stop: Vec<String> = match self.get("stop") {
            None => vec![],
            Some(Value::String(s)) => vec![s.clone()],
            Some(Value::Array(a)) => a
                .iter()
                .map(|s| s.as_str().map(str::to_string).ok_or_else(|| Self::wrong("stop", "a list of strings", s)))
                .collect::<Result<_, _>>()?,
            Some(v) => return Err(Self::wrong("stop", "a string or a list of strings", v)),
        };
        if stop.len() > limits.max_stop {
            let (n, max) = (stop.len(), limits.max_stop);
            return Err(ApiError::invalid(
                Some("stop"),
                format!("`stop` holds {n} strings; this server takes at most {max}"),
            ));
        }
        if let Some(long) = stop.iter().find(|s| s.len() > limits.max_stop_bytes) {
            let (n, max) = (long.len(), limits.max_stop_bytes);
            return Err(ApiError::invalid(
                Some("stop"),
                format!("a `stop` string of {n} bytes; this server takes at most {max} bytes a string"),
            ));
        }
        Ok(stop)
    }
}
