//! The small built-in model (`model/assets/default`, made by
//! `cargo run -p model --example make_default_model`), embedded in the crate so a binary runs
//! without a checkpoint: a NemotronH with random weights (its text means nothing), a
//! byte-level tokenizer with ChatML's tokens, and a chat template.

use std::path::PathBuf;

use crate::{Error, Result};

/// The built-in model's files: (name, bytes).
pub const FILES: [(&str, &[u8]); 5] = [
    ("config.json", include_bytes!("../assets/default/config.json")),
    ("generation_config.json", include_bytes!("../assets/default/generation_config.json")),
    ("model.safetensors", include_bytes!("../assets/default/model.safetensors")),
    ("tokenizer.json", include_bytes!("../assets/default/tokenizer.json")),
    ("tokenizer_config.json", include_bytes!("../assets/default/tokenizer_config.json")),
];

/// Writes the built-in model to a folder under the temp dir (files that are already there
/// and the same are left alone) and returns it, a checkpoint directory like any other.
pub fn dir() -> Result<PathBuf> {
    let dir = std::env::temp_dir().join(format!("nemotron-rs-built-in-{}", env!("CARGO_PKG_VERSION")));
    let fail = |path: &std::path::Path, e: std::io::Error| Error::Checkpoint {
        path: path.to_path_buf(),
        tensor: String::new(),
        reason: format!("writing the built-in model: {e}"),
    };
    std::fs::create_dir_all(&dir).map_err(|e| fail(&dir, e))?;
    for (name, bytes) in FILES {
        let path = dir.join(name);
        if std::fs::read(&path).ok().as_deref() != Some(bytes) {
            // Written beside and renamed, so a process starting at the same time never reads
            // half a file.
            let tmp = dir.join(format!("{name}.{}", std::process::id()));
            std::fs::write(&tmp, bytes).map_err(|e| fail(&tmp, e))?;
            std::fs::rename(&tmp, &path).map_err(|e| fail(&path, e))?;
        }
    }
    Ok(dir)
}
