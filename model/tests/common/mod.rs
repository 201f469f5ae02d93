//! What the model's suites share: the transformers fixture (tests/fixtures/tiny_nemotron_h),
//! and a fake Hugging Face cache holding the built-in model ([`fake_hub`]).
#![allow(dead_code)] // each suite that includes this module uses a part of it

pub mod prefix;

use std::path::{Path, PathBuf};

use model::config::Config;
use model::weights::Checkpoint;
use serde::Deserialize;

/// One prompt of reference.json: float32 logits of every position and 8 greedy tokens.
#[derive(Deserialize)]
pub struct Case {
    pub prompt: Vec<u32>,
    pub logits: Vec<Vec<f64>>,
    pub greedy: Vec<u32>,
}

#[derive(Deserialize)]
struct Fixture {
    cases: Vec<Case>,
}

/// The fixture's directory.
pub fn dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/tiny_nemotron_h")
}

/// The fixture's prompts and transformers' outputs.
pub fn cases() -> Vec<Case> {
    let text = std::fs::read_to_string(dir().join("reference.json")).expect("the fixture is in the repository");
    serde_json::from_str::<Fixture>(&text).expect("reference.json parses").cases
}

/// The fixture's config and mapped checkpoint.
pub fn open() -> (Config, Checkpoint) {
    (Config::from_dir(&dir()).unwrap(), Checkpoint::open(&dir()).unwrap())
}

/// Steps `e` until every request ends: each request's events, in order.
pub fn events<B: model::backend::Backend>(
    e: &mut model::engine::Engine<B>,
) -> std::collections::BTreeMap<model::engine::RequestId, Vec<model::engine::Event>> {
    let mut out: std::collections::BTreeMap<_, Vec<_>> = Default::default();
    while e.has_work() {
        for ev in e.step().unwrap() {
            out.entry(ev.id).or_default().push(ev);
        }
    }
    out
}

/// The index of the largest logit (the lowest on ties).
pub fn argmax<T: PartialOrd>(v: &[T]) -> u32 {
    (0..v.len()).fold(0, |best, i| if v[i] > v[best] { i } else { best }) as u32
}

/// Where [`open_patched`] writes its copy of the fixture.
fn patched_dir(tag: &str) -> PathBuf {
    std::env::temp_dir().join(format!("nemotron-patched-fixture-{tag}-{}", std::process::id()))
}

/// A copy of the fixture in a temporary directory (named by `tag`) with elements `range` of
/// the bf16 tensor `name` set to `value`.
pub fn open_patched(tag: &str, name: &str, range: std::ops::Range<usize>, value: half::bf16) -> (Config, Checkpoint) {
    let dir = patched_dir(tag);
    std::fs::create_dir_all(&dir).unwrap();
    for f in ["config.json", "reference.json"] {
        std::fs::copy(self::dir().join(f), dir.join(f)).unwrap();
    }
    let mut bytes = std::fs::read(self::dir().join("model.safetensors")).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let e = &header[name];
    assert_eq!(e["dtype"], "BF16", "{name}");
    let at = 8 + n + e["data_offsets"][0].as_u64().unwrap() as usize;
    for v in bytes[at + 2 * range.start..at + 2 * range.end].chunks_exact_mut(2) {
        v.copy_from_slice(&value.to_bits().to_le_bytes());
    }
    std::fs::write(dir.join("model.safetensors"), bytes).unwrap();
    (Config::from_dir(&dir).unwrap(), Checkpoint::open(&dir).unwrap())
}

/// A copy of the fixture whose token `t` has a NaN embedding row, so a request with `t` in
/// its prompt gets NaN logits (and only it: every operation keeps rows, slots and tokens
/// apart).
pub fn open_with_nan_embedding(t: usize) -> (Config, Checkpoint) {
    let width = open().0.hidden_size;
    open_patched(&format!("nan-{t}"), "backbone.embeddings.weight", t * width..(t + 1) * width, half::bf16::NAN)
}

/// On `backend`: a request whose prompt has a token with a NaN embedding ends with
/// `Finish::Failed(NanLogits)` and no token, while the request beside it, in the same steps,
/// gets transformers' greedy tokens, and so does a request that takes the failed one's slot
/// after it (no NaN left in that slot's state). Returns the number of tokens compared.
pub fn nan_logits_end_only_their_request<B: model::backend::Backend>(backend: B) -> usize {
    use model::engine::{Engine, Finish, RequestParams};
    use model::sampling::{SampleError, SamplingParams};
    let cases = cases();
    let (c, next) = (&cases[0], &cases[1]);
    let t = (0..64u32).find(|t| !c.prompt.contains(t) && !c.greedy.contains(t)).unwrap();
    let (config, ck) = open_with_nan_embedding(t as usize);
    assert!(model::layout::Layout::new(&config, &ck).unwrap_err().to_string().contains("NaN"), "the scan finds it");
    let layout = model::layout::Layout::trusting_values(&config, &ck).unwrap();
    let mut e = Engine::new(model::model::Model::load(backend, &config, &layout, 2, 64).unwrap());
    let params = |n, sampling| RequestParams { max_new_tokens: n, sampling, stop_tokens: vec![], min_new_tokens: 0 };
    let good = e.add(&c.prompt, params(c.greedy.len(), SamplingParams::greedy())).unwrap();
    let bad = e.add(&[t, t, 5], params(4, SamplingParams::nucleus(1.0, 0.9, 3))).unwrap();
    let mut after = None;
    let mut out: std::collections::BTreeMap<_, Vec<_>> = Default::default();
    while e.has_work() {
        for ev in e.step().unwrap() {
            if ev.id == bad {
                after = Some(e.add(&next.prompt, params(next.greedy.len(), SamplingParams::greedy())).unwrap());
            }
            out.entry(ev.id).or_default().push((ev.token, ev.finished));
        }
    }
    assert_eq!(out[&bad], vec![(u32::MAX, Some(Finish::Failed(SampleError::NanLogits)))]);
    let tokens = |id| out[&id].iter().map(|e: &(u32, _)| e.0).collect::<Vec<u32>>();
    assert_eq!(tokens(good), c.greedy, "the request beside the NaN one");
    assert_eq!(out[&good].last().unwrap().1, Some(Finish::Length));
    assert_eq!(tokens(after.unwrap()), next.greedy, "the request in the failed one's slot");
    std::fs::remove_dir_all(patched_dir(&format!("nan-{t}"))).ok();
    c.greedy.len() + next.greedy.len()
}

/// A fake Hugging Face home (a folder under the temp dir named by `tag`, for `HF_HOME`) whose
/// cache holds the built-in model as `test-org/tiny`: `refs/main` names the snapshot `0a1b2c`,
/// whose files link into `blobs/`, as huggingface_hub keeps them. Returns the home and the
/// snapshot directory.
pub fn fake_hub(tag: &str) -> (PathBuf, PathBuf) {
    let home = std::env::temp_dir().join(format!("nemotron-hf-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&home);
    let repo = home.join("hub/models--test-org--tiny");
    let snapshot = repo.join("snapshots/0a1b2c");
    for dir in [repo.join("blobs"), repo.join("refs"), snapshot.clone()] {
        std::fs::create_dir_all(dir).unwrap();
    }
    std::fs::write(repo.join("refs/main"), "0a1b2c").unwrap();
    for (name, bytes) in model::built_in::FILES {
        std::fs::write(repo.join("blobs").join(name), bytes).unwrap();
        std::os::unix::fs::symlink(Path::new("../../blobs").join(name), snapshot.join(name)).unwrap();
    }
    (home, snapshot)
}

/// The last logits of `prompt` from the checkpoint in `dir` on the CPU backend and from the f64
/// reference.
pub fn prompt_logits(dir: &Path, prompt: &[u32]) -> (Vec<f64>, Vec<f64>) {
    use model::cache::Part;
    let config = Config::from_dir(dir).unwrap();
    let ck = Checkpoint::open(dir).unwrap();
    let layout = model::layout::Layout::new(&config, &ck).unwrap();
    let mut model = model::model::Model::load(model::cpu::Cpu::default(), &config, &layout, 1, 64).unwrap();
    let cpu = model.step(&[Part { slot: 0, computed: 0, tokens: prompt }]).unwrap().remove(0);
    let reference = model::reference::Reference::new(&config, &layout).unwrap();
    let mut st = reference.new_state();
    let exact = prompt.iter().map(|&t| reference.step(&mut st, t).unwrap()).last().unwrap();
    (cpu.into_iter().map(f64::from).collect(), exact)
}

/// The last logits of a 24-token prompt on the CPU backend from the checkpoint `ck` of `config`
/// (an in-memory synthetic one, its values trusted).
pub fn synthetic_logits(config: &Config, ck: &Checkpoint) -> Vec<f64> {
    use model::cache::Part;
    let prompt: Vec<u32> = (0..24).map(|i| (i * 5 % 200) as u32).collect();
    let layout = model::layout::Layout::trusting_values(config, ck).unwrap();
    let mut m = model::model::Model::load(model::cpu::Cpu::default(), config, &layout, 1, 64).unwrap();
    let l = m.step(&[Part { slot: 0, computed: 0, tokens: &prompt }]).unwrap().remove(0);
    l.into_iter().map(f64::from).collect()
}

/// The largest |a - b|.
pub fn max_gap(a: &[f64], b: &[f64]) -> f64 {
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f64::max)
}

/// The commit the fake hub ([`hub_server`]) serves every revision at.
pub const HUB_COMMIT: &str = "5eed5eed5eed5eed5eed5eed5eed5eed5eed5eed";

/// A local server that answers as the Hugging Face hub does for `test-org/tiny` (its files:
/// the built-in model's and a README.md), the routes the `hf-hub` client uses: the repo's file
/// list (`/api/models/ORG/NAME/revision/REV`) and each file (`/ORG/NAME/resolve/REV/FILE`, with
/// its etag, commit and byte ranges); anything else is 404. Returns its URL and the paths it
/// was asked for.
pub fn hub_server() -> (String, std::sync::Arc<std::sync::Mutex<Vec<String>>>) {
    use std::io::{BufRead, BufReader, Write};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let asked = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let log = asked.clone();
    let mut files: Vec<(&str, &[u8])> = model::built_in::FILES.to_vec();
    files.push(("README.md", b"# tiny\n"));
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut stream) = stream else { continue };
            let mut reader = BufReader::new(stream.try_clone().unwrap());
            let (mut line, mut range) = (String::new(), None);
            reader.read_line(&mut line).unwrap_or_default();
            let path = line.split_whitespace().nth(1).unwrap_or_default().to_string();
            loop {
                let mut header = String::new();
                if reader.read_line(&mut header).unwrap_or_default() == 0 || header.trim().is_empty() {
                    break;
                }
                if let Some(r) = header.to_ascii_lowercase().strip_prefix("range: bytes=") {
                    let (a, b) = r.trim().split_once('-').unwrap();
                    range = Some((a.parse::<usize>().unwrap(), b.parse::<usize>().ok()));
                }
            }
            log.lock().unwrap().push(path.clone());
            let file = path.strip_prefix("/test-org/tiny/resolve/").and_then(|p| p.split_once('/'));
            let (status, headers, body): (&str, String, Vec<u8>) =
                if path.starts_with("/api/models/test-org/tiny/revision/") {
                    let siblings: Vec<_> = files.iter().map(|(n, _)| serde_json::json!({"rfilename": n})).collect();
                    let info = serde_json::json!({"id": "test-org/tiny", "sha": HUB_COMMIT, "siblings": siblings});
                    ("200 OK", "Content-Type: application/json\r\n".into(), info.to_string().into_bytes())
                } else if let Some((_, bytes)) = file.and_then(|(_, f)| files.iter().find(|(n, _)| *n == f)) {
                    let (a, b) = range.unwrap_or((0, None));
                    let b = b.unwrap_or(bytes.len() - 1).min(bytes.len() - 1);
                    let etag = format!(
                        "{:016x}",
                        bytes.iter().fold(0xcbf29ce484222325u64, |h, &x| (h ^ x as u64).wrapping_mul(0x100000001b3))
                    );
                    let headers = format!(
                        "ETag: \"{etag}\"\r\nX-Repo-Commit: {HUB_COMMIT}\r\nContent-Range: bytes {a}-{b}/{}\r\n",
                        bytes.len()
                    );
                    ("206 Partial Content", headers, bytes[a..=b].to_vec())
                } else {
                    ("404 Not Found", String::new(), b"Repository not found".to_vec())
                };
            let head =
                format!("HTTP/1.1 {status}\r\n{headers}Content-Length: {}\r\nConnection: close\r\n\r\n", body.len());
            let _ = stream.write_all(head.as_bytes()).and_then(|_| stream.write_all(&body));
        }
    });
    (url, asked)
}
