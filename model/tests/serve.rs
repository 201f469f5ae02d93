//! The `serve` binary against the real OpenAI Python client: starts it on the built-in model
//! (CPU backend, a free port on 127.0.0.1) and runs tests/serve/client_test.py (chat and
//! completions, streamed and not, usage, stop strings, the bad-request table beside a running
//! stream, 429 past the queue, a dropped client's slot reused, streaming or not, 32 concurrent seeded clients
//! each getting the tokens it gets alone). The Python with the `openai` package comes from
//! `$NEMOTRON_TEST_PYTHON`, which `./x test` sets up (a virtual environment under
//! target/tools/); without it the test fails saying so. The server is killed at the end,
//! whatever happens. Beside it: tests/serve/tool_calls_test.py against a server with a
//! scripted engine, for what the random built-in model never writes (reasoning, tool calls);
//! `--model ORG/NAME` on a fake Hugging Face cache; `--synthetic CONFIG`; `serve_bench`.

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Kills its process when dropped (a failed assertion included).
struct Killed(Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn python() -> PathBuf {
    match std::env::var_os("NEMOTRON_TEST_PYTHON") {
        Some(p) => PathBuf::from(p),
        None => panic!(
            "NEMOTRON_TEST_PYTHON is not set: this test needs a Python with the `openai` package. `./x test` \
             creates one in target/tools/venv (it needs python3 with venv and pip, and PyPI); or set \
             NEMOTRON_TEST_PYTHON to such a python yourself"
        ),
    }
}

/// `serve` on the CPU backend and a free port of 127.0.0.1 with `args` (its environment
/// changed by `env`: a value of `None` removes the variable): the process, its address once it
/// serves (the model loaded), and its log (stderr, read to its end on a thread so it never blocks on a full pipe).
fn serve(args: &[&str], env: &[(&str, Option<&Path>)]) -> (Killed, String, JoinHandle<String>) {
    let mut command = Command::new(env!("CARGO_BIN_EXE_serve"));
    command.args(["--backend", "cpu", "--host", "127.0.0.1", "--port", "0"]).args(args).env("RUST_LOG", "info");
    for (name, value) in env {
        match value {
            Some(v) => command.env(name, v),
            None => command.env_remove(name),
        };
    }
    let mut server =
        command.stdin(Stdio::null()).stdout(Stdio::null()).stderr(Stdio::piped()).spawn().expect("starting serve");
    let stderr = server.stderr.take().expect("piped");
    let server = Killed(server);
    let (tx, rx) = mpsc::channel();
    let log = std::thread::spawn(move || {
        let mut all = String::new();
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            // The address runs to the line's end, or to the quote that ends a JSON log field.
            if let Some(url) = line.split("ready on ").nth(1).and_then(|u| u.split(['"', ' ']).next()) {
                let _ = tx.send(url.trim().to_string());
            }
            all += &line;
            all.push('\n');
        }
        all
    });
    match rx.recv_timeout(Duration::from_secs(60)) {
        Ok(url) => (server, url, log),
        Err(_) => {
            drop(server);
            panic!("serve did not say it is ready within 60 s:\n{}", log.join().unwrap_or_default())
        }
    }
}

/// Runs `command` (its stdout piped here and printed as it comes, its stderr inherited) for
/// at most `limit`, killing it then: its stdout if it exited successfully, else that with how
/// it ended.
fn run_for(mut command: Command, limit: Duration) -> Result<String, String> {
    let name = format!("{:?}", command.get_program());
    let mut child = command
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap_or_else(|e| panic!("running {name}: {e}"));
    let out = child.stdout.take().expect("piped");
    let mut child = Killed(child);
    let printed = std::thread::spawn(move || {
        let mut all = String::new();
        for line in BufReader::new(out).lines().map_while(Result::ok) {
            println!("{line}");
            all += &line;
            all.push('\n');
        }
        all
    });
    let t0 = Instant::now();
    let status = loop {
        if let Some(s) = child.0.try_wait().expect("waiting for the child") {
            break Some(s);
        }
        if t0.elapsed() > limit {
            break None;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    drop(child);
    let printed = printed.join().unwrap_or_default();
    match status {
        Some(s) if s.success() => Ok(printed),
        _ => Err(format!(
            "{name} {} after {:.0} s:\n{printed}",
            status.map_or("timed out".to_string(), |s| s.to_string()),
            t0.elapsed().as_secs_f64()
        )),
    }
}

/// The Python client test `script` (in tests/serve/) against the server at `url`.
fn client_test(script: &str, url: &str) -> Command {
    let mut command = Command::new(python());
    // It imports tests/serve/common.py: no __pycache__ left in the source tree.
    command
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/serve").join(script))
        .arg(url);
    command
}

#[test]
fn openai_client_against_serve() {
    let (server, url, log) = serve(&["--slots", "8", "--max-queue", "24", "--max-len", "512"], &[]);
    let result = run_for(client_test("client_test.py", &url), Duration::from_secs(480));
    drop(server);
    let log = log.join().unwrap_or_default();
    if let Err(e) = result {
        panic!("{e}\nserver log:\n{log}");
    }
}

/// Reasoning and tool calls as the OpenAI client sees them (tests/serve/tool_calls_test.py):
/// the built-in model never writes them, so the server here runs in this process with a
/// scripted engine (`model::serve::scripted::echo`: each request's last user message comes
/// back as the model's output) behind the real routes and HTTP stack.
#[test]
fn openai_client_sees_reasoning_and_tool_calls() {
    let runtime = tokio::runtime::Runtime::new().expect("a tokio runtime");
    let listener = runtime.block_on(tokio::net::TcpListener::bind("127.0.0.1:0")).expect("a free port");
    let url = format!("http://{}", listener.local_addr().unwrap());
    // Never drained (the sender dropped): it serves until the runtime ends.
    let (limits, never) = (model::serve::conn::ConnLimits::default(), tokio::sync::watch::channel(false).1);
    let echo = model::serve::scripted::echo();
    runtime.spawn(async move { model::serve::conn::serve(listener, echo, limits, never).await });
    if let Err(e) = run_for(client_test("tool_calls_test.py", &url), Duration::from_secs(120)) {
        panic!("{e}");
    }
}

/// The response (head and body) to `request` (`METHOD PATH`) with `body` (JSON), on a
/// connection of its own to the server at `url`.
fn http(url: &str, request: &str, body: &str) -> String {
    let addr = url.trim_start_matches("http://");
    let mut stream = std::net::TcpStream::connect(addr).expect("connecting");
    let head = format!("{request} HTTP/1.1\r\nHost: test\r\nConnection: close\r\nContent-Type: application/json\r\n");
    write!(stream, "{head}Content-Length: {}\r\n\r\n{body}", body.len()).unwrap();
    let mut reply = String::new();
    stream.read_to_string(&mut reply).unwrap();
    reply
}

/// `--model ORG/NAME` finds the snapshot that `refs/main` names in `$HF_HOME/hub` (files
/// linked into `blobs/`, as huggingface_hub keeps them) and serves it under the repo id; a repo
/// that is not there is an error that says so, before anything loads.
#[test]
fn a_repo_id_is_served_from_the_hub_cache() {
    let (home, snapshot) = common::fake_hub("serve");
    let env = [("HF_HOME", Some(home.as_path())), ("HF_HUB_CACHE", None)];
    let (server, url, log) = serve(&["--model", "test-org/tiny", "--slots", "1", "--max-len", "64"], &env);
    let reply = http(&url, "GET /v1/models", "");
    drop(server);
    let log = log.join().unwrap_or_default();
    assert!(reply.contains(r#""id":"test-org/tiny""#), "{reply}\nserver log:\n{log}");
    assert!(log.contains(&snapshot.display().to_string()), "it loads the snapshot: {log}");

    let out = Command::new(env!("CARGO_BIN_EXE_serve"))
        .args(["--model", "test-org/absent", "--port", "0"])
        .env("HF_HOME", &home)
        .env("HF_HUB_OFFLINE", "1")
        .env_remove("HF_HUB_CACHE")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(stderr.contains("`test-org/absent` is not in the Hugging Face cache"), "{stderr}");
    assert!(stderr.contains(&home.join("hub/models--test-org--absent").display().to_string()), "{stderr}");
    std::fs::remove_dir_all(home).unwrap();
}

/// `--synthetic CONFIG`: random weights for that config (here the built-in model's with a
/// vocabulary of 4096, so a prompt token past the built-in 266 is taken), and the built-in
/// tokenizer filled up to it: every generated token past the built-in vocabulary has its text
/// (`w{id} `); `ignore_eos` runs the request to its `max_tokens`.
#[test]
fn synthetic_weights_for_a_config() {
    let dir = std::env::temp_dir().join(format!("nemotron-serve-synthetic-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (_, built_in) = model::built_in::FILES.iter().find(|(name, _)| *name == "config.json").unwrap();
    let mut config: serde_json::Value = serde_json::from_slice(built_in).unwrap();
    config["vocab_size"] = 4096.into();
    let path = dir.join("config.json");
    std::fs::write(&path, config.to_string()).unwrap();
    let (server, url, log) = serve(&["--synthetic", path.to_str().unwrap(), "--slots", "1", "--max-len", "64"], &[]);
    let body = r#"{"prompt": [300, 4000, 5], "max_tokens": 12, "temperature": 0, "ignore_eos": true,
        "logprobs": 0, "return_tokens_as_token_ids": true}"#;
    let reply = http(&url, "POST /v1/completions", body);
    drop(server);
    let log = log.join().unwrap_or_default();
    std::fs::remove_dir_all(dir).unwrap();
    let v: serde_json::Value = reply
        .split_once("\r\n\r\n")
        .and_then(|(_, body)| serde_json::from_str(body).ok())
        .unwrap_or_else(|| panic!("{reply}\nserver log:\n{log}"));
    assert!(log.contains(&format!("random weights for {}", path.display())), "{log}");
    let choice = &v["choices"][0];
    assert_eq!(
        (v["usage"]["completion_tokens"].as_u64(), choice["finish_reason"].as_str()),
        (Some(12), Some("length")),
        "{v}"
    );
    let ids: Vec<u32> = choice["logprobs"]["tokens"]
        .as_array()
        .expect("the tokens")
        .iter()
        .map(|t| t.as_str().and_then(|t| t.strip_prefix("token_id:")?.parse().ok()).expect("token_id:N"))
        .collect();
    let filled: Vec<u32> = ids.iter().copied().filter(|&id| id >= 266).collect();
    assert!(!filled.is_empty(), "{ids:?}");
    let text = choice["text"].as_str().unwrap();
    for id in filled {
        assert!(text.contains(&format!("w{id} ")), "token {id} in {text:?}");
    }
}

/// `serve_bench` against `serve` on the built-in model, plain and with `--json-schema`: a row
/// per concurrency, every request exactly its tokens (`ignore_eos`), positive speed, ordered
/// quantiles; without a server, an error.
#[test]
fn serve_bench_reports_each_concurrency() {
    let (server, url, log) = serve(&["--slots", "4", "--max-len", "256"], &[]);
    // Plain, then every request held to an unbounded schema (it runs to --max-tokens too).
    let bench = |schema: Option<&str>| {
        let mut bench = Command::new(env!("CARGO_BIN_EXE_serve_bench"));
        bench.args(["--url", &url, "--clients", "1,3", "--max-tokens", "8", "--rounds", "2", "--warmup", "1"]);
        bench.args(schema.map(|s| ["--json-schema", s]).into_iter().flatten());
        run_for(bench, Duration::from_secs(120))
    };
    let outs = [bench(None), bench(Some(r#"{"type": "array", "items": {"type": "string"}, "minItems": 200}"#))];
    drop(server);
    let log = log.join().unwrap_or_default();
    for out in outs {
        let out = out.unwrap_or_else(|e| panic!("{e}\nserver log:\n{log}"));
        let rows = table(&out);
        assert_eq!(rows.len(), 2, "{out}");
        for (row, clients) in rows.iter().zip([1.0, 3.0]) {
            assert_eq!(row.len(), 10, "{out}");
            assert_eq!(&row[..3], [clients, 2.0 * clients, 16.0 * clients], "clients, requests, tokens: {out}");
            assert!(row[4] > 0.0 && row[5] > 0.0 && row[5] <= row[6] && row[7] <= row[8] && row[9] >= 1.0, "{out}");
        }
    }
    assert!(bench(None).is_err(), "no server: an error");
}

/// The rows of a `serve_bench` table (lines that start with a number), as numbers (a `%`
/// dropped).
fn table(out: &str) -> Vec<Vec<f64>> {
    out.lines()
        .filter(|l| l.trim_start().starts_with(|c: char| c.is_ascii_digit()))
        .map(|l| l.split_whitespace().map(|x| x.trim_end_matches('%').parse().unwrap_or(f64::NAN)).collect())
        .collect()
}

/// `serve_bench --turns` and `--shared-prefix` against `serve` (its prefix cache on by
/// default): each turn after the first restores the last turn's conversation (up to its
/// generation prompt), and every request after the first two restores all of the shared system
/// prompt, whatever follows it; `/metrics` counts the hits and the tokens they restored as the
/// requests' usage does, and the request log lines carry their cached tokens.
#[test]
fn serve_bench_measures_the_prefix_cache() {
    let (server, url, log) = serve(&["--slots", "4", "--max-len", "2048"], &[]);
    let bench = |args: &[&str]| {
        let mut bench = Command::new(env!("CARGO_BIN_EXE_serve_bench"));
        bench.args(["--url", &url, "--max-tokens", "4"]).args(args);
        run_for(bench, Duration::from_secs(120))
    };
    let turns = bench(&["--turns", "3", "--conversations", "2", "--turn-tokens", "150"]);
    let shared = bench(&["--shared-prefix", "300", "--suffixes", "1,40", "--requests", "2"]);
    let metrics = http(&url, "GET /metrics", "");
    drop(server);
    let log = log.join().unwrap_or_default();
    let metric = |name: &str| -> f64 {
        let line = metrics.lines().find(|l| l.starts_with(&format!("{name} "))).unwrap_or_else(|| panic!("{metrics}"));
        line[name.len()..].trim().parse().unwrap()
    };
    let hits = metric("nemotron_prefix_cache_hits_total");
    assert!(hits > 0.0 && metric("nemotron_prefix_cache_bytes") > 0.0, "{metrics}");
    assert!(metric("nemotron_prefix_cache_save_seconds_total") > 0.0, "{metrics}");
    assert_eq!(metric("nemotron_prompt_tokens_cached_total"), metric("nemotron_prefix_cache_hit_tokens_total"));
    assert!(
        log.contains("cached_tokens=0")
            && log.lines().any(|l| l.contains("cached_tokens=") && !l.contains("cached_tokens=0"))
    );
    let turns = turns.unwrap_or_else(|e| panic!("{e}\nserver log:\n{log}"));
    let rows = table(&turns);
    assert_eq!(rows.len(), 3, "{turns}");
    assert_eq!(rows[0][2], 0.0, "nothing to restore at the first turn: {turns}");
    for (t, row) in rows.iter().enumerate().skip(1) {
        let (prompt, last) = (row[1], rows[t - 1][1]);
        assert!(row[2] > last - 20.0 && row[2] < prompt, "turn {}: {turns}", t + 1);
    }
    assert!(turns.contains("turn 4 of all 2 at once"), "{turns}");
    let shared = shared.unwrap_or_else(|e| panic!("{e}\nserver log:\n{log}"));
    let rows = table(&shared);
    assert_eq!(rows.len(), 2, "{shared}");
    assert!(rows.iter().all(|r| r[2] == 100.0 && r[3] == 100.0), "all of the system prompt restored: {shared}");
}

/// The port is bound before the model loads: a port in use ends `serve` with the address in
/// its error and no model loaded.
#[test]
fn a_port_in_use_is_refused_before_the_model_loads() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").expect("a free port");
    let port = taken.local_addr().expect("its address").port().to_string();
    let out = Command::new(env!("CARGO_BIN_EXE_serve"))
        .args(["--backend", "cpu", "--host", "127.0.0.1", "--port", &port])
        .env("RUST_LOG", "info")
        .output()
        .expect("running serve");
    let log = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{log}");
    assert!(log.contains(&format!("listening on 127.0.0.1:{port}")), "{log}");
    assert!(!log.contains("loaded") && !log.contains("backend:"), "{log}");
}

/// SIGTERM with a stream in flight (`--shutdown-timeout 0`: the generations are cut at once):
/// the stream ends with a chunk of finish reason `abort` and `[DONE]`, and serve exits 0.
#[test]
fn sigterm_ends_a_stream_with_abort_and_exits_0() {
    let (mut server, url, log) = serve(&["--shutdown-timeout", "0"], &[]);
    let addr = url.trim_start_matches("http://");
    let mut stream = std::net::TcpStream::connect(addr).expect("connecting");
    let body = r#"{"messages": [{"role": "user", "content": "Go on."}], "stream": true, "max_tokens": 4000, "ignore_eos": true}"#;
    let head =
        "POST /v1/chat/completions HTTP/1.1\r\nHost: test\r\nConnection: close\r\nContent-Type: application/json\r\n";
    write!(stream, "{head}Content-Length: {}\r\n\r\n{body}", body.len()).unwrap();
    let mut reader = BufReader::new(stream);
    let (mut got, mut line) = (String::new(), String::new());
    // The first chunk, then the signal.
    while !got.contains("data: ") {
        line.clear();
        assert!(reader.read_line(&mut line).unwrap() > 0, "the stream ended before its first chunk: {got}");
        got += &line;
    }
    // SAFETY: kill sends a signal to the child this test started.
    assert_eq!(unsafe { libc::kill(server.0.id() as i32, libc::SIGTERM) }, 0);
    reader.read_to_string(&mut got).unwrap();
    let t0 = Instant::now();
    let status = loop {
        if let Some(s) = server.0.try_wait().unwrap() {
            break s;
        }
        assert!(t0.elapsed() < Duration::from_secs(10), "serve still runs 10 s after SIGTERM");
        std::thread::sleep(Duration::from_millis(50));
    };
    let log = log.join().unwrap_or_default();
    assert!(status.success(), "serve ended {status}:\n{log}");
    let abort = got.find(r#""finish_reason":"abort""#).unwrap_or_else(|| panic!("no abort chunk: {got}"));
    let done = got.rfind("data: [DONE]").unwrap_or_else(|| panic!("no [DONE]: {got}"));
    assert!(abort < done && got[done..].trim_end().ends_with("0"), "[DONE] last: {got}");
    assert!(log.contains("SIGTERM: shutting down") && log.contains("shut down"), "{log}");
    // The request's log line.
    let line = log.lines().find(|l| l.contains(" request id=chatcmpl-")).unwrap_or_else(|| panic!("{log}"));
    for field in ["prompt_tokens=", "completion_tokens=", "ttft_ms=", "duration_ms=", "finish=abort"] {
        assert!(line.contains(field), "{field} in {line}");
    }
}

/// `--log-format json`: every log line is a JSON object; a request's line carries its id,
/// tokens in and out, time to first token, duration and finish reason as fields.
#[test]
fn json_log_lines() {
    let (server, url, log) = serve(&["--log-format", "json"], &[]);
    let reply = http(&url, "POST /v1/completions", r#"{"prompt": "Hello", "max_tokens": 3, "ignore_eos": true}"#);
    assert!(reply.starts_with("HTTP/1.1 200"), "{reply}");
    std::thread::sleep(Duration::from_millis(200));
    drop(server);
    let log = log.join().unwrap_or_default();
    let lines: Vec<serde_json::Value> =
        log.lines().map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}"))).collect();
    let request = lines.iter().find(|v| v["fields"]["message"] == "request").unwrap_or_else(|| panic!("{log}"));
    let f = &request["fields"];
    assert!(f["prompt_tokens"].as_u64().is_some_and(|n| n > 0), "{f}");
    assert_eq!(f["completion_tokens"].as_u64(), Some(3), "{f}");
    assert!(f["id"].as_str().is_some_and(|id| id.starts_with("cmpl-")), "{f}");
    assert!(f["ttft_ms"].is_number() && f["duration_ms"].is_number(), "{f}");
    assert_eq!(f["finish"], "length", "{f}");
}
