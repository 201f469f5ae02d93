//! What `--model` names, for `generate`, `serve` and [`crate::text::Llm`] alike ([`resolve`]):
//! a checkpoint directory, a Hugging Face repo id (`--model ORG/NAME[@REVISION]`), or without a
//! value the built-in model.
//!
//! The cache is laid out as huggingface_hub lays it out: `HUB/models--ORG--NAME/snapshots/COMMIT/`
//! holds a revision's files (links into `blobs/`), and `refs/BRANCH` the commit of a branch or
//! tag. `HUB` is `$HF_HUB_CACHE`, else `$HF_HOME/hub`, else `$XDG_CACHE_HOME/huggingface/hub`,
//! else `~/.cache/huggingface/hub`. A repo (or revision) that is not there is downloaded into it
//! (the `hf-hub` crate: `$HF_ENDPOINT`, `https://huggingface.co` by default; `$HF_TOKEN` for
//! gated repos; a progress bar a file on a terminal): the files a checkpoint is loaded from
//! ([`wanted`]), not the rest of the repo. `HF_HUB_OFFLINE=1` turns downloads off. A value that
//! looks like a path (it starts with `/`, `.` or `~`, or has more than one `/`) and names
//! nothing is a missing directory, never a repo id.

use std::ffi::OsString;
use std::path::{Path, PathBuf};

/// What a `--model` value names.
#[derive(Debug, Clone, PartialEq)]
pub struct Located {
    /// The checkpoint directory.
    pub dir: PathBuf,
    /// The name it goes by (what `serve` serves it as by default): the repo id it was named
    /// by, else the directory's name, else `default` (the built-in model's).
    pub name: String,
}

/// `--model`'s value, or the built-in model ([`crate::built_in`]) without one.
pub fn resolve(model: Option<&str>) -> Result<Located, String> {
    match model {
        Some(m) => locate(m),
        None => Ok(Located { dir: crate::built_in::dir().map_err(|e| e.to_string())?, name: "default".into() }),
    }
}

/// `--model`'s value: an existing path as it is; otherwise a repo id, `ORG/NAME` or
/// `ORG/NAME@REVISION` (a branch, a tag or a commit; `main` by default), found in the cache
/// the environment names, or downloaded into it.
pub fn locate(model: &str) -> Result<Located, String> {
    let path = Path::new(model);
    if path.exists() {
        let name = path.file_name().map_or_else(|| "default".into(), |n| n.to_string_lossy().into_owned());
        return Ok(Located { dir: path.to_path_buf(), name });
    }
    if looks_like_a_path(model) {
        return Err(format!("`{model}`: no such directory"));
    }
    let (repo, revision) = model.split_once('@').unwrap_or((model, "main"));
    if !is_repo_id(repo) || revision.is_empty() {
        return Err(format!("`{model}`: no such directory, nor a Hugging Face repo id (ORG/NAME[@REVISION])"));
    }
    let hub = hub_dir(|name| std::env::var_os(name)).ok_or_else(|| {
        format!("`{model}`: no such directory, and no Hugging Face cache (HF_HUB_CACHE, HF_HOME and HOME are unset)")
    })?;
    let dir = match snapshot(&hub, repo, revision) {
        Ok(dir) => dir,
        Err(e) if offline(|name| std::env::var_os(name)) => {
            return Err(format!("{e}; HF_HUB_OFFLINE is set, so nothing is downloaded"));
        }
        Err(_) => download(&hub, repo, revision)?,
    };
    Ok(Located { dir, name: repo.to_string() })
}

/// Whether the environment turns downloads off (`HF_HUB_OFFLINE` set to 1, true, yes or on).
fn offline(var: impl Fn(&str) -> Option<OsString>) -> bool {
    var("HF_HUB_OFFLINE")
        .is_some_and(|v| ["1", "true", "yes", "on"].contains(&v.to_string_lossy().to_lowercase().as_str()))
}

/// Whether a repo's file is one a checkpoint is loaded from: the configs, the tokenizer and its
/// chat template, the quantization settings, and the weights (safetensors and their index).
pub fn wanted(file: &str) -> bool {
    const FILES: [&str; 7] = [
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "chat_template.jinja",
        "hf_quant_config.json",
    ];
    !file.contains('/')
        && (FILES.contains(&file) || file.ends_with(".safetensors") || file.ends_with(".safetensors.index.json"))
}

/// Downloads `repo` at `revision` into the cache `hub` (the files [`wanted`]) and returns its
/// snapshot directory.
fn download(hub: &Path, repo: &str, revision: &str) -> Result<PathBuf, String> {
    use hf_hub::api::sync::ApiBuilder;
    use hf_hub::{Repo, RepoType};
    // `from_env`: $HF_ENDPOINT, and the token `hf auth login` saved; $HF_TOKEN before that.
    let mut builder = ApiBuilder::from_env()
        .with_cache_dir(hub.to_path_buf())
        .with_progress(std::io::IsTerminal::is_terminal(&std::io::stderr()));
    if let Some(token) = std::env::var("HF_TOKEN").ok().filter(|t| !t.is_empty()) {
        builder = builder.with_token(Some(token));
    }
    let api = builder.build().map_err(|e| format!("`{repo}`: starting the Hugging Face client: {e}"))?;
    let endpoint = std::env::var("HF_ENDPOINT").unwrap_or_else(|_| "https://huggingface.co".into());
    let api = api.repo(Repo::with_revision(repo.to_string(), RepoType::Model, revision.to_string()));
    let failed = |what: &str, e: hf_hub::api::sync::ApiError| {
        format!("`{repo}@{revision}`: {what} from {endpoint} failed ({e}); not in the cache {} either", hub.display())
    };
    let info = api.info().map_err(|e| failed("asking for its files", e))?;
    let files: Vec<&str> = info.siblings.iter().map(|f| f.rfilename.as_str()).filter(|f| wanted(f)).collect();
    if !files.contains(&"config.json") {
        return Err(format!("`{repo}@{revision}` on {endpoint} has no config.json: not a checkpoint"));
    }
    tracing::info!("downloading {} files of `{repo}@{revision}` from {endpoint} into {}", files.len(), hub.display());
    let mut dir = None;
    for file in files {
        let path = api.download(file).map_err(|e| failed(&format!("downloading {file}"), e))?;
        dir = path.parent().map(Path::to_path_buf);
    }
    dir.ok_or_else(|| format!("`{repo}@{revision}`: nothing was downloaded"))
}

/// Whether a `--model` value is meant as a path: it starts with `/`, `.` or `~`, or has more
/// than one `/` (a repo id has exactly one).
fn looks_like_a_path(s: &str) -> bool {
    s.starts_with(['/', '.', '~']) || s.matches('/').count() > 1
}

/// The hub cache folder that the environment (`var` reads a variable) names.
pub fn hub_dir(var: impl Fn(&str) -> Option<OsString>) -> Option<PathBuf> {
    let set = |name: &str| var(name).filter(|v| !v.is_empty()).map(PathBuf::from);
    set("HF_HUB_CACHE")
        .or_else(|| set("HF_HOME").map(|h| h.join("hub")))
        .or_else(|| set("XDG_CACHE_HOME").map(|c| c.join("huggingface").join("hub")))
        .or_else(|| set("HOME").map(|h| h.join(".cache").join("huggingface").join("hub")))
}

/// The snapshot directory of `repo` at `revision` (a name in `refs/`, or a commit) in the
/// cache `hub`; the error says what is missing and what the cache has.
pub fn snapshot(hub: &Path, repo: &str, revision: &str) -> Result<PathBuf, String> {
    let folder = hub.join(format!("models--{}", repo.replace('/', "--")));
    if !folder.is_dir() {
        return Err(format!("`{repo}` is not in the Hugging Face cache (no {})", folder.display()));
    }
    let commit = std::fs::read_to_string(folder.join("refs").join(revision))
        .map(|c| c.trim().to_string())
        .unwrap_or_else(|_| revision.to_string());
    let dir = folder.join("snapshots").join(&commit);
    if dir.is_dir() {
        return Ok(dir);
    }
    let mut have: Vec<String> = std::fs::read_dir(folder.join("snapshots"))
        .into_iter()
        .flatten()
        .filter_map(|e| Some(e.ok()?.file_name().to_string_lossy().into_owned()))
        .collect();
    have.sort();
    let have = if have.is_empty() { "none".to_string() } else { have.join(", ") };
    Err(format!("`{repo}` has no snapshot of revision `{revision}` in {} (its snapshots: {have})", folder.display()))
}

/// `ORG/NAME`: two non-empty parts of letters, digits, `-`, `_` and `.`.
fn is_repo_id(s: &str) -> bool {
    let part = |p: &str| !p.is_empty() && p.chars().all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c));
    s.split_once('/').is_some_and(|(org, name)| part(org) && part(name))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fake cache: `org/tiny` with `main` at commit `c0ffee` and an older snapshot `beef`.
    fn fake_cache(name: &str) -> PathBuf {
        let hub = std::env::temp_dir().join(format!("nemotron-hub-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&hub);
        let repo = hub.join("models--org--tiny");
        for commit in ["c0ffee", "beef"] {
            std::fs::create_dir_all(repo.join("snapshots").join(commit)).unwrap();
        }
        std::fs::create_dir_all(repo.join("refs")).unwrap();
        std::fs::write(repo.join("refs/main"), "c0ffee\n").unwrap();
        std::fs::write(repo.join("refs/old"), "beef").unwrap();
        hub
    }

    #[test]
    fn snapshots_by_branch_tag_or_commit() {
        let hub = fake_cache("revisions");
        let snaps = hub.join("models--org--tiny/snapshots");
        assert_eq!(snapshot(&hub, "org/tiny", "main"), Ok(snaps.join("c0ffee")));
        assert_eq!(snapshot(&hub, "org/tiny", "old"), Ok(snaps.join("beef")));
        assert_eq!(snapshot(&hub, "org/tiny", "beef"), Ok(snaps.join("beef")));
        let e = snapshot(&hub, "org/tiny", "v2").unwrap_err();
        assert!(e.contains("revision `v2`") && e.contains("its snapshots: beef, c0ffee"), "{e}");
        let e = snapshot(&hub, "org/missing", "main").unwrap_err();
        assert!(e.contains("not in the Hugging Face cache") && e.contains("models--org--missing"), "{e}");
        std::fs::remove_dir_all(hub).unwrap();
    }

    #[test]
    fn the_cache_the_environment_names() {
        let env = |vars: &[(&str, &str)]| {
            let vars: Vec<(String, OsString)> = vars.iter().map(|(k, v)| (k.to_string(), v.into())).collect();
            hub_dir(move |name| vars.iter().find(|(k, _)| k == name).map(|(_, v)| v.clone()))
        };
        let all = [("HF_HUB_CACHE", "/a"), ("HF_HOME", "/b"), ("XDG_CACHE_HOME", "/c"), ("HOME", "/d")];
        assert_eq!(env(&all), Some(PathBuf::from("/a")));
        assert_eq!(env(&all[1..]), Some(PathBuf::from("/b/hub")));
        assert_eq!(env(&all[2..]), Some(PathBuf::from("/c/huggingface/hub")));
        assert_eq!(env(&all[3..]), Some(PathBuf::from("/d/.cache/huggingface/hub")));
        assert_eq!(env(&[("HF_HUB_CACHE", ""), ("HOME", "/d")]), Some(PathBuf::from("/d/.cache/huggingface/hub")));
        assert_eq!(env(&[]), None);
    }

    #[test]
    fn directories_come_first_and_other_names_are_refused() {
        let dir = std::env::temp_dir();
        let name = dir.file_name().unwrap().to_string_lossy().into_owned();
        assert_eq!(locate(dir.to_str().unwrap()), Ok(Located { dir: dir.clone(), name }));
        let built_in = resolve(None).unwrap();
        assert_eq!((built_in.dir, built_in.name.as_str()), (crate::built_in::dir().unwrap(), "default"));
        for bad in ["no-such-dir-here", "org/", "org/na me", "org/name@"] {
            let e = locate(bad).unwrap_err();
            assert!(e.contains("nor a Hugging Face repo id"), "{bad}: {e}");
        }
        // Path-looking values are missing directories, never repo ids to download.
        for path in ["./nope", "../org/name", "/org/name", "~/models/x", "a/b/c", ".hidden/x"] {
            assert_eq!(locate(path), Err(format!("`{path}`: no such directory")), "{path}");
        }
        assert!(is_repo_id("nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16") && is_repo_id("a.b/c_d"));
        assert!(!looks_like_a_path("nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16"));
    }

    #[test]
    fn the_files_a_checkpoint_needs() {
        for f in ["config.json", "model-00001-of-00013.safetensors", "model.safetensors.index.json", "tokenizer.json"] {
            assert!(wanted(f), "{f}");
        }
        for f in ["README.md", ".gitattributes", "modeling_nemotron_h.py", "docs/config.json", "model.bin"] {
            assert!(!wanted(f), "{f}");
        }
        let var = |v: &'static str| move |_: &str| Some(OsString::from(v));
        assert!(offline(var("1")) && offline(var("TRUE")) && !offline(var("0")) && !offline(|_| None));
    }
}
