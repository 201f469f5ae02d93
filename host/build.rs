//! Builds the kernels to PTX for every supported arch and leaves them in OUT_DIR, where
//! `host/src/gpu/arch.rs` embeds them. Needs only the pinned nightly (rust-src is in
//! rust-toolchain.toml); no CUDA toolkit.

#[path = "ptx_build.rs"]
mod ptx_build;

use std::path::PathBuf;

fn main() {
    let manifest = PathBuf::from(std::env::var_os("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR"));
    let workspace = manifest.parent().expect("host/ lives in the workspace").to_path_buf();
    let out_dir = PathBuf::from(std::env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));
    for path in ["kernels-gpu/src", "kernels-gpu/Cargo.toml", "Cargo.toml", "host/ptx_build.rs"] {
        println!("cargo:rerun-if-changed={}", workspace.join(path).display());
    }
    println!("cargo:rerun-if-env-changed=NEMO_TIMELINE");
    let target_dir = workspace.join("target").join("ptx");
    for arch in ptx_build::ARCHES {
        let ptx = ptx_build::build_ptx(&workspace, &target_dir, arch).unwrap_or_else(|e| panic!("{e}"));
        std::fs::copy(&ptx, out_dir.join(format!("{arch}.ptx")))
            .unwrap_or_else(|e| panic!("copying {}: {e}", ptx.display()));
    }
}
