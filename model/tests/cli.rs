//! The `generate` binary: the built-in model generates (on the GPU when there is one, else on
//! the CPU, saying which), and a checkpoint without a tokenizer is a clear error.

use std::process::Command;

fn generate(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_generate")).args(args).output().unwrap()
}

#[test]
fn built_in_model_generates() {
    let out = generate(&["--prompt", "Hello", "--max-new-tokens", "4", "--temperature", "0.8", "--seed", "3"]);
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{stderr}");
    assert!(stdout.starts_with("Hello"), "{stdout}");
    assert!(stderr.contains("prefill: 5 tokens in") && stderr.contains("ms/token"), "{stderr}");
    let cpu_because = stderr.contains("no GPU (") && stderr.contains("backend: CPU reference");
    assert!(cpu_because || stderr.contains("backend: CUDA ("), "{stderr}");
    let out = generate(&["--prompt", "Hello", "--max-new-tokens", "2", "--backend", "cpu", "--max-step-tokens", "2"]);
    let chunked = String::from_utf8_lossy(&out.stdout);
    assert!(String::from_utf8_lossy(&out.stderr).contains("backend: CPU reference"));
    // The prompt fed two tokens at a time gives the same greedy text as fed at once.
    let whole = generate(&["--prompt", "Hello", "--max-new-tokens", "2", "--backend", "cpu"]);
    assert_eq!(chunked, String::from_utf8_lossy(&whole.stdout));
}

#[test]
fn missing_tokenizer_and_bad_arguments_are_errors() {
    let fixture = concat!(env!("CARGO_MANIFEST_DIR"), "/../tests/fixtures/tiny_nemotron_h");
    let out = generate(&["--model", fixture, "--prompt", "x"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("has no tokenizer.json"));
    let out = generate(&["--max-new-tokens", "3"]);
    assert!(String::from_utf8_lossy(&out.stderr).contains("--prompt is required"));
    let out = generate(&["--prompt", "x", "--bogus"]);
    assert!(String::from_utf8_lossy(&out.stderr).contains("unknown argument `--bogus`"));
}

#[test]
fn cuda_backend_runs_or_says_why() {
    let out = generate(&["--prompt", "Hi", "--max-new-tokens", "2", "--backend", "cuda"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success() || stderr.contains("no CUDA driver found"), "{stderr}");
    let out = generate(&["--prompt", "Hi", "--backend", "tpu"]);
    assert!(String::from_utf8_lossy(&out.stderr).contains("unknown backend `tpu`"));
}
