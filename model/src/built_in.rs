//! The built-in model (model/assets/default: a small NemotronH with random weights and a byte
//! tokenizer, made by `examples/make_default_model.rs`), embedded in the library so a binary
//! runs without a checkpoint.

use std::path::PathBuf;

use crate::error::{Error, Result};

/// Its files, embedded.
const FILES: [(&str, &[u8]); 3] = [
    ("config.json", include_bytes!("../assets/default/config.json")),
    ("model.safetensors", include_bytes!("../assets/default/model.safetensors")),
    ("tokenizer.json", include_bytes!("../assets/default/tokenizer.json")),
];

/// Writes the built-in model to a folder under the temp dir (once: files already there with
/// the same bytes are kept) and returns it.
pub fn dir() -> Result<PathBuf> {
    let dir = std::env::temp_dir().join(format!("nemotron-rs-built-in-{}", env!("CARGO_PKG_VERSION")));
    let fail = |what: &str, path: &std::path::Path, e: std::io::Error| Error::Checkpoint {
        path: path.to_path_buf(),
        tensor: String::new(),
        reason: format!("{what} the built-in model: {e}"),
    };
    std::fs::create_dir_all(&dir).map_err(|e| fail("creating a folder for", &dir, e))?;
    for (name, bytes) in FILES {
        let path = dir.join(name);
        if std::fs::read(&path).ok().as_deref() != Some(bytes) {
            // Written beside and renamed, so a server starting at the same time never reads half a file.
            let tmp = dir.join(format!("{name}.{}", std::process::id()));
            std::fs::write(&tmp, bytes).map_err(|e| fail("writing", &tmp, e))?;
            std::fs::rename(&tmp, &path).map_err(|e| fail("writing", &path, e))?;
        }
    }
    Ok(dir)
}
