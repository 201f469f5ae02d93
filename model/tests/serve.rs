//! The `serve` binary against the real OpenAI Python client: starts it on the built-in model
//! (CPU backend, a free port on 127.0.0.1) and runs tests/serve/client_test.py (chat and
//! completions, streamed and not, usage, stop strings, the bad-request table beside a running
//! stream, 429 past the queue, a dropped client's slot reused, streaming or not, 32 concurrent seeded clients
//! each getting the tokens it gets alone). The Python with the `openai` package comes from
//! `$NEMOTRON_TEST_PYTHON`, which `./x test` sets up (a virtual environment under
//! target/tools/); without it the test fails saying so. The server is killed at the end,
//! whatever happens.

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
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

#[test]
fn openai_client_against_serve() {
    let python = python();
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../tests/serve/client_test.py");
    let mut server = Command::new(env!("CARGO_BIN_EXE_serve"))
        .args(["--backend", "cpu", "--host", "127.0.0.1", "--port", "0"])
        .args(["--slots", "8", "--max-queue", "24", "--max-len", "512"])
        .env("RUST_LOG", "info")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("starting serve");
    let stderr = server.stderr.take().expect("piped");
    let server = Killed(server);
    // The server's log, read to its end on a thread (so it never blocks on a full pipe); the
    // address is on the line that says it listens.
    let (tx, rx) = mpsc::channel();
    let log = std::thread::spawn(move || {
        let mut all = String::new();
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            if let Some(url) = line.split("listening on ").nth(1) {
                let _ = tx.send(url.trim().to_string());
            }
            all += &line;
            all.push('\n');
        }
        all
    });
    let url = rx.recv_timeout(Duration::from_secs(60)).expect("serve did not say it listens within 60 s");
    let mut client = Command::new(&python)
        .arg(script)
        .arg(&url)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap_or_else(|e| panic!("running {} (NEMOTRON_TEST_PYTHON): {e}", python.display()));
    let out = client.stdout.take().expect("piped");
    let client = Killed(client);
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
    let mut client = client;
    let status = loop {
        if let Some(s) = client.0.try_wait().expect("waiting for the client") {
            break Some(s);
        }
        if t0.elapsed() > Duration::from_secs(480) {
            break None;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    drop(client);
    let printed = printed.join().unwrap_or_default();
    drop(server);
    let log = log.join().unwrap_or_default();
    let ok = status.is_some_and(|s| s.success());
    assert!(
        ok,
        "client_test.py {} after {:.0} s:\n{printed}\nserver log:\n{log}",
        status.map_or("timed out".to_string(), |s| s.to_string()),
        t0.elapsed().as_secs_f64()
    );
}
