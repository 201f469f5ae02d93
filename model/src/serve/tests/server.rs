//! The server around the handlers: errors as OpenAI JSON, health and loading, shutdown,
//! authentication and origins, tokenize, metrics.

use super::*;

/// The answers axum makes itself (an unknown path, a wrong method, a body past the limit) and
/// the handlers' own, each in OpenAI's error JSON with its status.
#[tokio::test]
async fn every_error_is_openai_json() {
    use axum::body::Body;
    use axum::http::Request;
    let app = scripted::echo();
    let big = format!(r#"{{"prompt": "{}"}}"#, "x".repeat(BODY_LIMIT));
    let cases = [
        ("GET", "/v1/chat/completions", String::new(), 405, "/v1/chat/completions takes POST, not GET"),
        ("POST", "/v1/models", String::new(), 405, "/v1/models takes GET, not POST"),
        ("DELETE", "/health", String::new(), 405, "/health takes GET, not DELETE"),
        ("POST", "/v1/completions", big, 413, "larger than this server's limit of 2097152 bytes"),
        ("GET", "/nope", String::new(), 404, "No route /nope"),
        (
            "POST",
            "/v1/completions",
            r#"{"prompt": "a", "stop": ["1","2","3","4","5","6","7","8","9"]}"#.into(),
            400,
            "at most 8",
        ),
        ("POST", "/v1/completions", r#"{"prompt": "a", "max_tokens": 2.5}"#.into(), 400, "must be an integer, not 2.5"),
        ("POST", "/v1/completions", r#"{"prompt": "a", "stream_options": {}}"#.into(), 400, "only allowed when"),
    ];
    for (method, path, body, status, says) in cases {
        let request = Request::builder()
            .method(method)
            .uri(path)
            .header("content-type", "application/json")
            .body(Body::from(body))
            .unwrap();
        let r = app.clone().oneshot(request).await.unwrap();
        assert_eq!(r.status().as_u16(), status, "{method} {path}");
        let json = r.headers()["content-type"].to_str().unwrap().starts_with("application/json");
        let bytes = axum::body::to_bytes(r.into_body(), usize::MAX).await.unwrap();
        assert!(json, "{method} {path}: {}", String::from_utf8_lossy(&bytes));
        let v: Value = serde_json::from_slice(&bytes).unwrap();
        let message = v["error"]["message"].as_str().unwrap_or_else(|| panic!("{method} {path}: {v}"));
        assert!(message.contains(says), "{method} {path}: {message}");
        assert!(v["error"]["type"].is_string(), "{v}");
    }
}

/// What a chat template would drop or garble is refused by name: content parts that are not
/// text, tools that are not functions; text parts are taken.
#[tokio::test]
async fn parts_and_tools_the_template_cannot_take_are_refused() {
    let s = writing("ok");
    let user = |content: Value| json!({"messages": [{"role": "user", "content": content}]});
    for (body, param, says) in [
        (user(json!([1, 2])), "messages", "`messages[0].content[0]` must be a text part"),
        (
            user(json!([{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": "x"}}])),
            "messages",
            "content[1]",
        ),
        (json!({"messages": [{"role": "user", "content": "a"}], "tools": [1, 2]}), "tools", "`tools[0]` must be"),
        (json!({"messages": [{"role": "user", "content": "a"}], "tools": [{}]}), "tools", "`tools[0]` must be"),
        (
            json!({"messages": [{"role": "user", "content": "a"}], "tools": [{"type": "function", "function": {}}]}),
            "tools",
            "`tools[0]`",
        ),
    ] {
        let e = chat::handle(s.clone(), Bytes::from(body.to_string()))
            .await
            .err()
            .unwrap_or_else(|| panic!("{body} taken"));
        assert_eq!((e.status, e.param.as_deref()), (StatusCode::BAD_REQUEST, Some(param)), "{body}");
        assert!(e.message.contains(says), "{body}: {}", e.message);
    }
    let (status, body) = post(&s, user(json!([{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]))).await;
    assert_eq!(status, StatusCode::OK, "{body}");
}

/// Parsing, rendering and tokenizing run on the blocking pool: on a runtime of one async
/// thread (so that work done on it holds every other request), `/health` answers while two
/// requests of 400 kB prompts are still being tokenized; they get their 400 (too long for the
/// context) after it. With the tokenizing on the async thread, both were done before `/health`
/// was polled (seen red).
#[tokio::test]
async fn health_answers_while_huge_prompts_are_tokenized() {
    use axum::body::Body;
    use axum::http::Request;
    let app = crate::serve::router(writing("ok"));
    let body = json!({"prompt": "word ".repeat(80_000)}).to_string();
    let post = |body: String| {
        let request = Request::post("/v1/completions").header("content-type", "application/json");
        request.body(Body::from(body)).unwrap()
    };
    let huge: Vec<_> = (0..2).map(|_| tokio::spawn(app.clone().oneshot(post(body.clone())))).collect();
    // The runtime's one thread runs the spawned requests up to their first wait.
    tokio::time::sleep(Duration::from_millis(10)).await;
    let t = std::time::Instant::now();
    let health = tokio::spawn(app.clone().oneshot(Request::get("/health").body(Body::empty()).unwrap()));
    let health = health.await.unwrap().unwrap();
    let waited = t.elapsed();
    assert_eq!(health.status(), StatusCode::OK);
    let pending = huge.iter().filter(|h| !h.is_finished()).count();
    for h in huge {
        let r = h.await.unwrap().unwrap();
        assert_eq!(r.status(), StatusCode::BAD_REQUEST, "a prompt past the context");
    }
    assert_eq!(pending, 2, "the huge prompts were done before /health answered ({waited:?})");
    assert!(waited < Duration::from_millis(250), "/health took {waited:?} beside the prompts being tokenized");
}

/// Before the model is in, the bound port answers 503: `/health` `{"status": "loading"}`, any
/// other request OpenAI's error JSON; once the router is set, it serves.
#[tokio::test]
async fn loading_answers_503_until_the_model_is_in() {
    use axum::body::Body;
    use axum::http::Request;
    let ready = Arc::new(std::sync::OnceLock::new());
    let app = crate::serve::loading(ready.clone());
    let call = |req: Request<Body>| {
        let app = app.clone();
        async move {
            let (status, _, body) = respond(&app, req).await;
            (status, serde_json::from_str::<Value>(&body).expect("JSON"))
        }
    };
    let health = || Request::get("/health").body(Body::empty()).unwrap();
    let chat = || Request::post("/v1/chat/completions").body(Body::from(request(false).to_string())).unwrap();
    let (status, body) = call(health()).await;
    assert_eq!((status, &body), (StatusCode::SERVICE_UNAVAILABLE, &json!({"status": "loading"})));
    let (status, body) = call(chat()).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{body}");
    assert!(body["error"]["message"].as_str().is_some_and(|m| m.contains("loading")), "{body}");
    assert!(ready.set(crate::serve::router(writing("Paris."))).is_ok());
    let (status, body) = call(health()).await;
    assert_eq!((status, &body), (StatusCode::OK, &json!({"status": "ok"})));
    let (status, body) = call(chat()).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(body["choices"][0]["message"]["reasoning"], "Paris.", "{body}");
}

/// The server's shutdown cuts the generations still running: a stream waiting for tokens ends
/// with a chunk of finish reason `abort`, then `[DONE]`; a request started after the cut too.
#[tokio::test]
async fn a_cut_ends_running_streams_with_abort_and_done() {
    // The engine takes each request and never answers it (its turn kept, so the channel stays open).
    let held = Arc::new(std::sync::Mutex::new(Vec::new()));
    let keep = held.clone();
    let s = scripted::built_in(move |turn| keep.lock().unwrap().push(turn));
    let mut ask = request(true);
    ask["stream_options"] = json!({"include_usage": true});
    let running = tokio::spawn({
        let (s, ask) = (s.clone(), ask.clone());
        async move { post(&s, ask).await }
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(!running.is_finished(), "the stream waits for tokens");
    s.ending.cut();
    let limit = Duration::from_secs(5);
    let first = tokio::time::timeout(limit, running).await.expect("the cut ends it").unwrap();
    let later = tokio::time::timeout(limit, post(&s, ask)).await.expect("the cut ends it");
    for (status, body) in [first, later] {
        assert_eq!(status, StatusCode::OK, "{body}");
        let ev = events(&body);
        assert_eq!(ev.last().map(String::as_str), Some("[DONE]"), "{body}");
        let finish: Vec<Value> = ev[..ev.len() - 1]
            .iter()
            .map(|e| serde_json::from_str::<Value>(e).unwrap())
            .filter(|v| !v["choices"][0]["finish_reason"].is_null())
            .collect();
        assert_eq!(finish.len(), 1, "{body}");
        assert_eq!(finish[0]["choices"][0]["finish_reason"], "abort", "{body}");
        assert!(body.contains(r#""completion_tokens":0"#), "{body}");
    }
}

/// `--api-key`: the `/v1/` routes want `Authorization: Bearer KEY` (401 in OpenAI's error JSON
/// without it or with another key, of the same length or not), `/health` does not;
/// `--allowed-origins`: a browser's preflight from an allowed origin is answered with it,
/// another origin is not; malformed settings are refused.
#[tokio::test]
async fn api_key_and_allowed_origins() {
    use crate::serve::{Access, router};
    use axum::body::Body;
    use axum::http::Request;

    let mut served = Arc::try_unwrap(writing("Paris.")).ok().expect("the only owner");
    served.access = Access { api_key: Some("sk-test".into()), allowed_origins: vec!["https://app.example".into()] };
    let app = router(Arc::new(served));
    let call = |req: Request<Body>| respond(&app, req);
    let chat = |key: Option<&str>| {
        let mut req = Request::post("/v1/chat/completions").header("content-type", "application/json");
        if let Some(k) = key {
            req = req.header("authorization", format!("Bearer {k}"));
        }
        req.body(Body::from(request(false).to_string())).unwrap()
    };
    for key in [None, Some("sk-tesu"), Some("sk-test2"), Some("")] {
        let (status, _, body) = call(chat(key)).await;
        assert_eq!(status, StatusCode::UNAUTHORIZED, "{key:?}: {body}");
        let v: Value = serde_json::from_str(&body).unwrap();
        assert_eq!(v["error"]["code"], "invalid_api_key", "{body}");
    }
    let (status, _, body) = call(chat(Some("sk-test"))).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let (status, _, body) = call(Request::get("/health").body(Body::empty()).unwrap()).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    let preflight = |origin: &str| {
        Request::options("/v1/chat/completions")
            .header("origin", origin)
            .header("access-control-request-method", "POST")
            .header("access-control-request-headers", "authorization,content-type")
            .body(Body::empty())
            .unwrap()
    };
    let (status, headers, _) = call(preflight("https://app.example")).await;
    assert!(status.is_success(), "{status}");
    assert_eq!(headers["access-control-allow-origin"], "https://app.example");
    let (_, headers, _) = call(preflight("https://evil.example")).await;
    assert!(headers.get("access-control-allow-origin").is_none(), "{headers:?}");
    for (key, origin) in [(Some(""), "*"), (None, "app.example"), (None, "https://app.example/path"), (None, "ftp://x")]
    {
        let a = Access { api_key: key.map(String::from), allowed_origins: vec![origin.into()] };
        assert!(a.check().is_err(), "{key:?} {origin}");
    }
    let a = Access { api_key: Some("k".into()), allowed_origins: vec!["*".into(), "http://localhost:3000".into()] };
    assert_eq!(a.check(), Ok(()));
}

/// `/tokenize` gives the ids a completions prompt or a chat request feeds the model (the
/// chat's as the engine sees them), with token strings when asked; `/detokenize` gives the
/// text back; bad input is a 400 naming the field.
#[tokio::test]
async fn tokenize_and_detokenize() {
    use axum::body::Body;
    use axum::http::Request;
    let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
    let record = seen.clone();
    let s = scripted::built_in(move |turn| {
        record.lock().unwrap().push(turn.prompt.clone());
        turn.write("ok");
    });
    let app = crate::serve::router(s.clone());
    let call = |path: &str, body: Value| {
        let (app, req) = (app.clone(), Request::post(path).body(Body::from(body.to_string())).unwrap());
        async move {
            let (status, _, body) = respond(&app, req).await;
            (status, serde_json::from_str::<Value>(&body).expect("JSON"))
        }
    };
    let (status, v) = call("/tokenize", json!({"prompt": "Hello there", "return_token_strs": true})).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    let ids: Vec<u32> = serde_json::from_value(v["tokens"].clone()).unwrap();
    assert_eq!(ids, s.tokenizer.encode("Hello there", false).unwrap().get_ids());
    assert_eq!(v["count"], ids.len());
    assert_eq!(v["max_model_len"], 4096);
    assert_eq!(v["token_strs"].as_array().map(Vec::len), Some(ids.len()), "{v}");
    let (status, back) = call("/detokenize", json!({"tokens": ids})).await;
    assert_eq!((status, &back["prompt"]), (StatusCode::OK, &json!("Hello there")), "{back}");
    // A chat request's ids are those the engine gets for it.
    let (status, v) = call("/tokenize", request(false)).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    assert!(v.get("token_strs").is_none(), "{v}");
    let (status, _) = post(&s, request(false)).await;
    assert_eq!(status, StatusCode::OK);
    let fed = seen.lock().unwrap().pop().expect("the engine saw the prompt");
    assert_eq!(serde_json::from_value::<Vec<u32>>(v["tokens"].clone()).unwrap(), fed);
    let bad = [
        ("/tokenize", json!({}), Value::Null),
        ("/tokenize", json!({"prompt": 5}), json!("prompt")),
        ("/tokenize", json!({"prompt": "a", "messages": []}), json!("prompt")),
        ("/tokenize", json!({"prompt": "a", "add_generation_prompt": false}), json!("add_generation_prompt")),
        ("/detokenize", json!({"tokens": [1, -2]}), json!("tokens")),
        ("/detokenize", json!({"tokens": [u32::MAX]}), json!("tokens")),
        ("/detokenize", json!({"tokens": "1 2"}), json!("tokens")),
    ];
    for (path, body, param) in bad {
        let (status, v) = call(path, body.clone()).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{path} {body}: {v}");
        assert_eq!(v["error"]["param"], param, "{path} {body}: {v}");
    }
}

/// `/metrics`: answers counted by route and status, the tokens of the generations, the time to
/// first token, inter-token and duration histograms (cumulative buckets, as many as the
/// requests that had tokens), and the admission gauges back at zero once the requests are done.
#[tokio::test]
async fn metrics_count_what_was_served() {
    use axum::body::Body;
    use axum::http::Request;
    let s = writing("Paris, the capital.");
    let app = crate::serve::router(s.clone());
    let send = |req: Request<Body>| {
        let app = app.clone();
        async move {
            let (status, _, body) = respond(&app, req).await;
            (status, body)
        }
    };
    let chat = |body: Value| Request::post("/v1/chat/completions").body(Body::from(body.to_string())).unwrap();
    let mut prompt_tokens = 0;
    let mut generated = 0;
    for stream in [false, true] {
        let mut body = request(stream);
        body["stream_options"] = if stream { json!({"include_usage": true}) } else { Value::Null };
        let (status, text) = send(chat(body)).await;
        assert_eq!(status, StatusCode::OK, "{text}");
        let usage = match stream {
            false => serde_json::from_str::<Value>(&text).unwrap()["usage"].clone(),
            true => {
                let ev = events(&text);
                serde_json::from_str::<Value>(&ev[ev.len() - 2]).unwrap()["usage"].clone()
            }
        };
        prompt_tokens += usage["prompt_tokens"].as_u64().unwrap();
        generated += usage["completion_tokens"].as_u64().unwrap();
    }
    let (status, _) = send(chat(json!({"messages": "no"}))).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    let (status, _) = send(Request::get("/nowhere").body(Body::empty()).unwrap()).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    let (status, text) = send(Request::get("/metrics").body(Body::empty()).unwrap()).await;
    assert_eq!(status, StatusCode::OK, "{text}");
    let value = |name: &str| -> f64 {
        let line =
            text.lines().find(|l| l.split(' ').next() == Some(name)).unwrap_or_else(|| panic!("{name}:\n{text}"));
        line.rsplit(' ').next().unwrap().parse().unwrap()
    };
    assert_eq!(value(r#"nemotron_requests_total{route="/v1/chat/completions",status="200"}"#), 2.0);
    assert_eq!(value(r#"nemotron_requests_total{route="/v1/chat/completions",status="400"}"#), 1.0);
    assert_eq!(value(r#"nemotron_requests_total{route="other",status="404"}"#), 1.0);
    assert_eq!(value("nemotron_prompt_tokens_total"), prompt_tokens as f64);
    assert_eq!(value("nemotron_generation_tokens_total"), generated as f64);
    assert_eq!(value("nemotron_time_to_first_token_seconds_count"), 2.0);
    assert_eq!(value(r#"nemotron_time_to_first_token_seconds_bucket{le="+Inf"}"#), 2.0);
    assert_eq!(value("nemotron_request_duration_seconds_count"), 2.0);
    // A gap between each two tokens of a request.
    assert_eq!(value("nemotron_inter_token_latency_seconds_count"), (generated - 2) as f64);
    let buckets: Vec<f64> = text
        .lines()
        .filter(|l| l.starts_with("nemotron_inter_token_latency_seconds_bucket"))
        .map(|l| l.rsplit(' ').next().unwrap().parse().unwrap())
        .collect();
    assert!(buckets.len() > 2 && buckets.windows(2).all(|w| w[0] <= w[1]), "{buckets:?}");
    assert_eq!(value("nemotron_slots"), 2.0);
    // The engine thread gives a request's place back just after its last token: soon zero.
    for _ in 0..100 {
        let (_, text) = send(Request::get("/metrics").body(Body::empty()).unwrap()).await;
        if text.lines().any(|l| l == "nemotron_requests_admitted 0")
            && text.lines().any(|l| l == "nemotron_busy_slots 0")
        {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("requests still admitted:\n{text}");
}
