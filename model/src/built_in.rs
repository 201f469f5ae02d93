//! The small built-in model (`model/assets/default`, made by
//! `cargo run -p model --example make_default_model`), embedded in the crate so a binary runs
//! without a checkpoint: a NemotronH with random weights (its text means nothing), a
//! byte-level tokenizer with ChatML's tokens, and a chat template.
//!
//! Loading wants a checkpoint directory, so [`dir`] writes the files into this user's cache
//! (`$XDG_CACHE_HOME`, else `$HOME/.cache`): `nemotron-rs/built-in-VERSION-DIGEST`, both
//! folders created private (0700) and refused if they are links, open to other users or
//! another user's; each file compared with the embedded bytes before use and, where it differs
//! or is not a plain file (a link), written under a temporary name and renamed over it (a
//! rename replaces a link, it does not follow it); anything else in the folder but the writers'
//! dot-named temporary files removed (the loader would read a `chat_template.jinja` put there).

use std::fs::{DirBuilder, OpenOptions};
use std::io::Write;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use crate::{Error, Result};

/// The built-in model's files: (name, bytes).
pub const FILES: [(&str, &[u8]); 5] = [
    ("config.json", include_bytes!("../assets/default/config.json")),
    ("generation_config.json", include_bytes!("../assets/default/generation_config.json")),
    ("model.safetensors", include_bytes!("../assets/default/model.safetensors")),
    ("tokenizer.json", include_bytes!("../assets/default/tokenizer.json")),
    ("tokenizer_config.json", include_bytes!("../assets/default/tokenizer_config.json")),
];

/// The built-in model as a checkpoint directory in this user's cache (see the module's doc).
pub fn dir() -> Result<PathBuf> {
    let absolute = |v: Option<std::ffi::OsString>| v.map(PathBuf::from).filter(|p| p.is_absolute());
    let base = absolute(std::env::var_os("XDG_CACHE_HOME"))
        .or_else(|| absolute(std::env::var_os("HOME")).map(|h| h.join(".cache")))
        .ok_or_else(|| {
            fail(Path::new("."), "no cache folder for it: set HOME or XDG_CACHE_HOME to an absolute path".into())
        })?;
    dir_in(&base)
}

/// [`dir`] under `base` (created if missing, as the user's cache folder is).
pub fn dir_in(base: &Path) -> Result<PathBuf> {
    std::fs::create_dir_all(base).map_err(|e| fail(base, e.to_string()))?;
    let uid = own_uid(base)?;
    let parent = base.join("nemotron-rs");
    private_dir(&parent, uid)?;
    let dir = parent.join(format!("built-in-{}-{:016x}", env!("CARGO_PKG_VERSION"), digest()));
    private_dir(&dir, uid)?;
    for entry in std::fs::read_dir(&dir).map_err(|e| fail(&dir, e.to_string()))? {
        let entry = entry.map_err(|e| fail(&dir, e.to_string()))?;
        let path = entry.path();
        // Dot names are the writers' temporary files (and nothing the loader reads).
        let name = entry.file_name();
        if !name.to_string_lossy().starts_with('.') && !FILES.iter().any(|(n, _)| name == *n) {
            let kind = entry.file_type().map_err(|e| fail(&path, e.to_string()))?;
            let removed = if kind.is_dir() { std::fs::remove_dir_all(&path) } else { std::fs::remove_file(&path) };
            removed.map_err(|e| fail(&path, format!("removing what is not the model's: {e}")))?;
        }
    }
    for (name, bytes) in FILES {
        let path = dir.join(name);
        let plain = std::fs::symlink_metadata(&path).is_ok_and(|m| m.file_type().is_file());
        if !plain || std::fs::read(&path).ok().as_deref() != Some(bytes) {
            // A fresh file beside it (never an existing one, nor through a link), renamed over
            // it: a process starting at the same time never reads half a file.
            let tmp = dir.join(format!(".{name}.{}.{}", std::process::id(), unique()));
            let mut f = OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(0o600)
                .open(&tmp)
                .map_err(|e| fail(&tmp, e.to_string()))?;
            f.write_all(bytes).map_err(|e| fail(&tmp, e.to_string()))?;
            std::fs::rename(&tmp, &path).map_err(|e| fail(&path, e.to_string()))?;
        }
    }
    Ok(dir)
}

/// Creates `path` as a folder only this user reads and writes, or checks that the one there
/// is such a folder: not a link, not open to group or others, owned by `uid`.
fn private_dir(path: &Path, uid: u32) -> Result<()> {
    match DirBuilder::new().mode(0o700).create(path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
            let m = std::fs::symlink_metadata(path).map_err(|e| fail(path, e.to_string()))?;
            if !m.file_type().is_dir() {
                return Err(fail(path, "it is a link or not a folder: refusing to write through it".into()));
            }
            if m.mode() & 0o077 != 0 {
                return Err(fail(
                    path,
                    format!("it is open to other users (mode {:o}): make it 0700", m.mode() & 0o777),
                ));
            }
            if m.uid() != uid {
                return Err(fail(path, format!("it belongs to user {}, not to this one ({uid})", m.uid())));
            }
            Ok(())
        }
        Err(e) => Err(fail(path, e.to_string())),
    }
}

/// This process's user id: the owner of a file it creates (in `base`) and removes.
fn own_uid(base: &Path) -> Result<u32> {
    let probe = base.join(format!(".nemotron-rs-uid-{}.{}", std::process::id(), unique()));
    let f = OpenOptions::new().write(true).create_new(true).mode(0o600).open(&probe);
    let uid = f.and_then(|f| f.metadata()).map(|m| m.uid());
    let _ = std::fs::remove_file(&probe);
    uid.map_err(|e| fail(&probe, e.to_string()))
}

/// A number no other call in this process gets (temporary names of threads writing at once).
fn unique() -> u64 {
    static N: AtomicU64 = AtomicU64::new(0);
    N.fetch_add(1, Ordering::Relaxed)
}

/// FNV-1a over the files' names and bytes: a folder per content, so builds of other contents
/// never share one.
fn digest() -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    for (name, bytes) in FILES {
        for &b in name.as_bytes().iter().chain(bytes) {
            h = (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    h
}

fn fail(path: &Path, reason: String) -> Error {
    Error::Checkpoint {
        path: path.to_path_buf(),
        tensor: String::new(),
        reason: format!("writing the built-in model: {reason}"),
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt;
    use std::path::PathBuf;

    use super::{FILES, dir_in};

    fn base(tag: &str) -> PathBuf {
        let b = std::env::temp_dir().join(format!("nemotron-built-in-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&b);
        b
    }

    /// Written private and whole; a link planted in place of a file (to other bytes, or to the
    /// same) is replaced, not written through; a planted template is removed; a link or an open folder in place of the
    /// model's folder is refused and not written through.
    #[test]
    fn the_built_in_model_is_private_and_never_written_through_a_link() {
        let b = base("plain");
        let dir = dir_in(&b).unwrap();
        assert_eq!(std::fs::metadata(&dir).unwrap().permissions().mode() & 0o777, 0o700);
        for (name, bytes) in FILES {
            assert_eq!(std::fs::read(dir.join(name)).unwrap(), bytes, "{name}");
        }
        // A planted link and template.
        let outside = b.join("outside.json");
        std::fs::write(&outside, b"{}").unwrap();
        std::fs::remove_file(dir.join("config.json")).unwrap();
        std::os::unix::fs::symlink(&outside, dir.join("config.json")).unwrap();
        std::fs::write(dir.join("chat_template.jinja"), "{{ 'planted' }}").unwrap();
        // A link to a file of the same bytes (which could change after the check).
        let (name, bytes) = FILES[4];
        let same = b.join("same.json");
        std::fs::write(&same, bytes).unwrap();
        std::fs::remove_file(dir.join(name)).unwrap();
        std::os::unix::fs::symlink(&same, dir.join(name)).unwrap();
        assert_eq!(dir_in(&b).unwrap(), dir);
        for name in ["config.json", name] {
            assert!(std::fs::symlink_metadata(dir.join(name)).unwrap().file_type().is_file(), "{name} a plain file");
        }
        assert_eq!(std::fs::read(&outside).unwrap(), b"{}", "the link's target untouched");
        assert_eq!(std::fs::read(dir.join("config.json")).unwrap(), FILES[0].1);
        assert!(!dir.join("chat_template.jinja").exists(), "the planted template removed");
        let names = std::fs::read_dir(&dir).unwrap().count();
        assert_eq!(names, FILES.len(), "the model's files and nothing else");
        std::fs::remove_dir_all(&b).unwrap();

        // The model's folder a link to another: refused, nothing written there.
        let b = base("link");
        let elsewhere = b.join("elsewhere");
        std::fs::create_dir_all(&elsewhere).unwrap();
        std::fs::create_dir_all(b.join("nemotron-rs")).unwrap();
        std::fs::set_permissions(b.join("nemotron-rs"), std::fs::Permissions::from_mode(0o700)).unwrap();
        std::os::unix::fs::symlink(&elsewhere, dir_name(&b, &dir)).unwrap();
        let err = dir_in(&b).unwrap_err().to_string();
        assert!(err.contains("is a link or not a folder"), "{err}");
        assert_eq!(std::fs::read_dir(&elsewhere).unwrap().count(), 0, "nothing written through the link");
        // Open to others: refused.
        std::fs::set_permissions(b.join("nemotron-rs"), std::fs::Permissions::from_mode(0o777)).unwrap();
        let err = dir_in(&b).unwrap_err().to_string();
        assert!(err.contains("open to other users (mode 777)"), "{err}");
        std::fs::remove_dir_all(&b).unwrap();
    }

    /// The model's folder under another base, by the name `dir_in` gave it.
    fn dir_name(base: &std::path::Path, dir: &std::path::Path) -> PathBuf {
        base.join("nemotron-rs").join(dir.file_name().unwrap())
    }
}
