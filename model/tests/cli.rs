//! The `generate` binary: the built-in model generates (on the GPU when there is one, else on
//! the CPU, saying which), its text streamed is the tokens decoded, the sampling flags reach
//! the sampler and bad values are refused naming them, and a checkpoint without a tokenizer
//! is a clear error; `--model ORG/NAME` is found in the Hugging Face cache; `--chat` runs a
//! turn through the built-in chat template, keeping the conversation.

mod common;

use std::io::Write;
use std::process::{Command, Stdio};

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
    // Usage errors (clap's, and a missing --prompt without --chat): exit status 2.
    let out = generate(&["--max-new-tokens", "3"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("required") && stderr.contains("--prompt"), "{stderr}");
    assert_eq!(out.status.code(), Some(2));
    let out = generate(&["--prompt", "x", "--bogus"]);
    assert!(String::from_utf8_lossy(&out.stderr).contains("unexpected argument '--bogus'"));
    assert_eq!(out.status.code(), Some(2));
}

/// `--model ORG/NAME` is found in the Hugging Face cache as `serve` finds it (`model::hub`):
/// the built-in model's files there generate what the built-in model generates; a repo that
/// is not there is an error naming the folder looked for, before anything loads.
#[test]
fn a_repo_id_is_found_in_the_hub_cache() {
    let (home, snapshot) = common::fake_hub("generate");
    let run = |model: Option<&str>| {
        let mut command = Command::new(env!("CARGO_BIN_EXE_generate"));
        command.args(["--prompt", "Hello", "--max-new-tokens", "6", "--backend", "cpu"]);
        command.args(model.map(|m| ["--model", m]).into_iter().flatten());
        command.env("HF_HOME", &home).env_remove("HF_HUB_CACHE").env("HF_HUB_OFFLINE", "1").output().unwrap()
    };
    let (cached, built_in) = (run(Some("test-org/tiny")), run(None));
    let stderr = String::from_utf8_lossy(&cached.stderr);
    assert!(cached.status.success(), "{stderr}");
    assert!(stderr.contains(&format!("loading {}", snapshot.display())), "it loads the snapshot: {stderr}");
    assert_eq!(String::from_utf8_lossy(&cached.stdout), String::from_utf8_lossy(&built_in.stdout));
    let absent = run(Some("test-org/absent@v1"));
    let stderr = String::from_utf8_lossy(&absent.stderr);
    assert_eq!(absent.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("`test-org/absent` is not in the Hugging Face cache"), "{stderr}");
    assert!(stderr.contains("HF_HUB_OFFLINE is set, so nothing is downloaded"), "{stderr}");
    assert!(stderr.contains(&home.join("hub/models--test-org--absent").display().to_string()), "{stderr}");
    assert!(!stderr.contains("loading"), "refused before anything loads: {stderr}");
    std::fs::remove_dir_all(home).unwrap();
}

#[test]
fn cuda_backend_runs_or_says_why() {
    let out = generate(&["--prompt", "Hi", "--max-new-tokens", "2", "--backend", "cuda"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success() || stderr.contains("no CUDA driver found"), "{stderr}");
    let out = generate(&["--prompt", "Hi", "--backend", "tpu"]);
    assert!(String::from_utf8_lossy(&out.stderr).contains("invalid value 'tpu' for '--backend"));
}

/// The ids of the generated tokens from `--logprobs`'s lines on stderr, with the mean.
fn logprob_ids(stderr: &str) -> (Vec<u32>, Option<f64>) {
    let mut lines = stderr.lines().skip_while(|l| !l.starts_with("logprobs (token id")).skip(1);
    let ids = lines
        .by_ref()
        .filter(|l| !l.trim_start().starts_with('~'))
        .map_while(|l| l.split_whitespace().next()?.parse().ok())
        .collect();
    let mean = stderr.lines().find_map(|l| l.strip_prefix("logprob: mean ")?.split_whitespace().next()?.parse().ok());
    (ids, mean)
}

#[test]
fn sampling_flags_run_and_bad_values_are_refused() {
    let flags = [
        "--prompt",
        "Hello",
        "--max-new-tokens",
        "8",
        "--backend",
        "cpu",
        "--min-p",
        "0.1",
        "--repetition-penalty",
        "1.2",
        "--presence-penalty",
        "0.5",
        "--frequency-penalty",
        "0.25",
        "--temperature",
        "0.8",
        "--seed",
        "3",
        "--logprobs",
    ];
    let out = generate(&flags);
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{stderr}");
    assert!(stdout.starts_with("Hello") && stdout.len() > "Hello\n".len(), "{stdout}");
    let (ids, mean) = logprob_ids(&stderr);
    assert!(!ids.is_empty() && ids.len() <= 8, "{stderr}");
    assert!(mean.is_some_and(|m| m < 0.0), "{stderr}");
    // The seed makes it reproducible.
    assert_eq!(generate(&flags).stdout, out.stdout);

    // A huge presence penalty reaches the sampler: greedy never repeats a token.
    let out = generate(&[
        "--prompt",
        "Hi",
        "--max-new-tokens",
        "12",
        "--backend",
        "cpu",
        "--presence-penalty",
        "1000",
        "--logprobs",
    ]);
    let (ids, _) = logprob_ids(&String::from_utf8_lossy(&out.stderr));
    let distinct: std::collections::HashSet<_> = ids.iter().collect();
    assert!(out.status.success() && !ids.is_empty() && distinct.len() == ids.len(), "{ids:?}");

    for (flag, value, name) in [
        ("--min-p", "2", "min_p"),
        ("--min-p", "-0.1", "min_p"),
        ("--repetition-penalty", "0", "repetition_penalty"),
        ("--presence-penalty", "nan", "presence_penalty"),
        ("--frequency-penalty", "inf", "frequency_penalty"),
        ("--top-p", "1.5", "top_p"),
        ("--top-k", "0", "top_k"),
        ("--temperature", "-1", "temperature"),
        ("--top-logprobs", "21", "top_logprobs"),
    ] {
        let out = generate(&["--prompt", "Hello", "--backend", "cpu", flag, value]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{flag} {value} accepted");
        assert!(stderr.contains(name), "{flag} {value}: {stderr}");
        assert!(!stderr.contains("loading"), "{flag} {value}: refused before the model loads: {stderr}");
    }
    // --top-logprobs: each token's line, then its three most likely tokens', the most likely
    // first (the greedy token itself first, with the same logprob).
    let out = generate(&["--prompt", "Hi", "--max-new-tokens", "4", "--backend", "cpu", "--top-logprobs", "3"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    let lines: Vec<&str> = stderr.lines().skip_while(|l| !l.starts_with("logprobs (token id")).skip(1).collect();
    let fields = |l: &str| -> (String, String) {
        let mut w = l.trim_start().trim_start_matches('~').split_whitespace();
        (w.next().unwrap_or_default().into(), w.next().unwrap_or_default().into())
    };
    assert!(out.status.success() && lines.len() >= 4 * 4, "{stderr}");
    for token in lines[..16].chunks(4) {
        assert!(token[1..].iter().all(|l| l.trim_start().starts_with('~')), "{stderr}");
        assert_eq!(fields(token[0]), fields(token[1]), "greedy: the token is the most likely one: {stderr}");
    }
    let out = generate(&["--prompt", "Hello", "--min-p", "abc"]);
    assert!(!out.status.success() && String::from_utf8_lossy(&out.stderr).contains("--min-p"));
    let out = generate(&["--prompt", "Hello", "--repetition-penalty"]);
    assert!(String::from_utf8_lossy(&out.stderr).contains("a value is required for '--repetition-penalty"));
}

#[test]
fn streamed_text_is_the_decoded_tokens() {
    // The built-in model's random weights give random bytes (incomplete UTF-8 among them): what
    // the decode stream printed is the tokens decoded at once.
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/assets/default/tokenizer.json");
    let tokenizer = tokenizers::Tokenizer::from_file(path).unwrap();
    for seed in ["1", "2", "3", "4", "5"] {
        let out = generate(&[
            "--prompt",
            "Hello",
            "--max-new-tokens",
            "24",
            "--backend",
            "cpu",
            "--temperature",
            "1.5",
            "--seed",
            seed,
            "--logprobs",
        ]);
        let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        assert!(out.status.success(), "{stderr}");
        let (ids, _) = logprob_ids(&stderr);
        assert!(!ids.is_empty(), "{stderr}");
        let text = tokenizer.decode(&ids, true).unwrap();
        assert_eq!(stdout, format!("Hello{text}\n"), "seed {seed}, tokens {ids:?}");
    }
}

/// `generate --chat` with `stdin` written to it, `RUST_LOG=debug` (each turn's speeds logged).
fn chat(args: &[&str], stdin: &str) -> std::process::Output {
    let mut child = Command::new(env!("CARGO_BIN_EXE_generate"))
        .args(["--chat", "--backend", "cpu"])
        .args(args)
        .env("RUST_LOG", "debug")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(stdin.as_bytes()).unwrap();
    child.wait_with_output().unwrap()
}

/// The prompt lengths of the turns `RUST_LOG=debug` logged (`turn N: prefill: P tokens ...`).
fn turn_prompts(stderr: &str) -> Vec<usize> {
    stderr.lines().filter_map(|l| l.split("prefill: ").nth(1)?.split_whitespace().next()?.parse().ok()).collect()
}

/// The prompt tokens each turn restored from the prefix cache (`... tokens/s; R restored ...`).
fn turn_restored(stderr: &str) -> Vec<usize> {
    stderr.lines().filter_map(|l| l.split(" tokens/s; ").nth(1)?.split_whitespace().next()?.parse().ok()).collect()
}

#[test]
fn chat_turns_go_through_the_template_and_keep_the_conversation() {
    // --prompt with --chat: one turn, stdin unread. The built-in template opens a <think>
    // block, so the reply starts as reasoning, shown (stdout is no terminal) after `[think]`.
    let out = chat(&["--prompt", "Hi", "--max-new-tokens", "6"], "never read\n");
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{stderr}");
    assert!(stdout.starts_with("[think]") && stdout.ends_with('\n'), "{stdout}");
    // `<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n`, not the raw "Hi".
    let prompts = turn_prompts(&stderr);
    assert!(prompts.len() == 1 && prompts[0] > 5, "{stderr}");
    // Without thinking the generation prompt closes the block: the reply is all answer.
    let out = chat(&["--prompt", "Hi", "--max-new-tokens", "6", "--no-thinking"], "");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success() && !stdout.contains("[think]"), "{stdout}");
    // On stdin: a turn per line until `/exit`; the second turn's prompt holds the first turn.
    let out = chat(&["--max-new-tokens", "4"], "Hi\nAnd now?\n/exit\nnot read\n");
    let stderr = String::from_utf8_lossy(&out.stderr);
    let prompts = turn_prompts(&stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(prompts.len() == 2 && prompts[1] > prompts[0] + 4, "{stderr}");
    // The prefix cache: each turn restores the conversation before the last turn's generation
    // prompt (at least 64 tokens past what that turn restored), unless --prefix-cache-gb 0.
    let long = "Tell me about the sea, the salt in it, and why it is blue in the sun and grey in the rain.\n";
    let turns = format!("{long}{long}{long}");
    let out = chat(&["--max-new-tokens", "4"], &turns);
    let stderr = String::from_utf8_lossy(&out.stderr);
    let (prompts, restored) = (turn_prompts(&stderr), turn_restored(&stderr));
    assert!(restored.len() == 3 && restored[0] == 0, "{stderr}");
    assert!(restored[1] > prompts[0] - 16 && restored[2] > prompts[1] - 16, "{stderr}");
    let out = chat(&["--max-new-tokens", "4", "--prefix-cache-gb", "0"], &turns);
    assert_eq!(turn_restored(&String::from_utf8_lossy(&out.stderr)), [0, 0, 0]);
    // EOF ends it too.
    let out = chat(&["--max-new-tokens", "2"], "Hi\n");
    assert!(out.status.success() && turn_prompts(&String::from_utf8_lossy(&out.stderr)).len() == 1);
    // --no-thinking without --chat is a usage error.
    let out = generate(&["--prompt", "Hi", "--no-thinking"]);
    assert_eq!(out.status.code(), Some(2));
}

/// A repo id that is not in the cache is downloaded from `$HF_ENDPOINT` (a local server that
/// answers as the hub does) into it, in huggingface_hub's layout and only the checkpoint's
/// files; the next run finds it there without the server; a repo the hub does not have, and a
/// path-looking value, are errors that say so.
#[test]
fn a_repo_id_is_downloaded_into_the_hub_cache() {
    let (url, asked) = common::hub_server();
    let home = std::env::temp_dir().join(format!("nemotron-hf-download-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&home);
    let run = |model: &str, endpoint: &str| {
        let mut command = Command::new(env!("CARGO_BIN_EXE_generate"));
        command.args(["--prompt", "Hello", "--max-new-tokens", "6", "--backend", "cpu", "--model", model]);
        command.env("HF_HOME", &home).env("HF_ENDPOINT", endpoint).env_remove("HF_HUB_CACHE");
        command.env_remove("HF_HUB_OFFLINE").env_remove("HF_TOKEN").output().unwrap()
    };
    let built_in = generate(&["--prompt", "Hello", "--max-new-tokens", "6", "--backend", "cpu"]);
    let fetched = run("test-org/tiny", &url);
    let stderr = String::from_utf8_lossy(&fetched.stderr);
    assert!(fetched.status.success(), "{stderr}");
    assert!(stderr.contains("downloading 5 files of `test-org/tiny@main`"), "{stderr}");
    assert_eq!(String::from_utf8_lossy(&fetched.stdout), String::from_utf8_lossy(&built_in.stdout));
    let repo = home.join("hub/models--test-org--tiny");
    assert_eq!(std::fs::read_to_string(repo.join("refs/main")).unwrap().trim(), common::HUB_COMMIT);
    let snapshot = repo.join("snapshots").join(common::HUB_COMMIT);
    for (name, bytes) in model::built_in::FILES {
        assert_eq!(std::fs::read(snapshot.join(name)).unwrap(), bytes, "{name}");
    }
    assert!(!snapshot.join("README.md").exists(), "only the checkpoint's files");
    assert!(!asked.lock().unwrap().iter().any(|p| p.contains("README")), "{:?}", asked.lock().unwrap());
    // Cached: the next run needs no hub.
    let again = run("test-org/tiny", "http://127.0.0.1:9");
    assert!(again.status.success(), "{}", String::from_utf8_lossy(&again.stderr));
    assert_eq!(again.stdout, fetched.stdout);
    let absent = run("test-org/absent", &url);
    let stderr = String::from_utf8_lossy(&absent.stderr);
    assert_eq!(absent.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains(&format!("`test-org/absent@main`: asking for its files from {url} failed")), "{stderr}");
    assert!(stderr.contains("404"), "{stderr}");
    let path = run("./test-org/tiny", &url);
    let stderr = String::from_utf8_lossy(&path.stderr);
    assert!(stderr.contains("`./test-org/tiny`: no such directory") && !stderr.contains("repo id"), "{stderr}");
    std::fs::remove_dir_all(home).unwrap();
}
