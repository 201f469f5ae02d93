//! Builds `kernels-gpu` to PTX for one arch with rustc's NVPTX backend.
//!
//! Shared by `host/build.rs` (which embeds the PTX of every arch) and `cargo xtask ptx` (which
//! also assembles it with ptxas), through `#[path]`, so there is one definition of the build.

use kernels_gpu::Kernel;
use std::path::{Path, PathBuf};
use std::process::Command;

/// The arches whose PTX the host embeds, by `-C target-cpu` name.
pub const ARCHES: [&str; 4] = ["sm_90", "sm_90a", "sm_110a", "sm_121a"];

/// Environment a parent cargo (or clippy, or rustup) sets that must not leak into the device
/// build: a stable parent's `RUSTC` or `RUSTUP_TOOLCHAIN` would run the device build on stable.
const CLEARED_ENV: [&str; 11] = [
    "RUSTC",
    "RUSTDOC",
    "RUSTUP_TOOLCHAIN",
    "RUSTFLAGS",
    "CARGO_ENCODED_RUSTFLAGS",
    "CARGO_BUILD_RUSTFLAGS",
    "RUSTC_WRAPPER",
    "RUSTC_WORKSPACE_WRAPPER",
    "CARGO_TARGET_DIR",
    "CARGO_BUILD_TARGET",
    "CARGO_PROFILE_RELEASE_DEBUG",
];

/// Builds the PTX of `arch` under `target_dir/<arch>` (`<arch>-timeline` with `NEMO_TIMELINE`
/// set: kernels-gpu's `timeline` feature) and returns its path, after checking that its
/// `.target` line names `arch`. Each build has its own directory: cargo finds a build of the
/// other feature set fresh and would not rewrite the one `--emit` file.
pub fn build_ptx(workspace: &Path, target_dir: &Path, arch: &str) -> Result<PathBuf, String> {
    if !ARCHES.contains(&arch) {
        return Err(format!("unsupported arch `{arch}`; supported: {}", ARCHES.join(", ")));
    }
    let timeline = std::env::var_os("NEMO_TIMELINE").is_some();
    let dir = target_dir.join(if timeline { format!("{arch}-timeline") } else { arch.to_string() });
    let out = dir.join("kernels.ptx");
    let mut cmd = pinned_cargo(workspace)?;
    cmd.current_dir(workspace)
        .args(["rustc", "-p", "kernels-gpu", "--lib"])
        .args(PTX_PROFILE)
        .args(["--target", "nvptx64-nvidia-cuda", "-Zbuild-std=core", "--target-dir"])
        .arg(&dir)
        .args(if timeline { &["--features", "timeline"][..] } else { &[] })
        .arg("--")
        .arg(format!("--emit=asm={}", out.display()));
    for var in CLEARED_ENV {
        cmd.env_remove(var);
    }
    // The row kernels keep [[f32; 8]; CHUNKS_PER_THREAD] per thread in registers; that needs
    // their loops fully unrolled, past LLVM's default threshold (else the array lives in local
    // memory: `cargo xtask ptx` fails on any stack frame or spill).
    // The FP8 tensor-core products (`mma.sync` m16n8k32 e4m3) need PTX ISA 8.4, above what
    // rustc emits for sm_90 and sm_90a by default (its sm_110a and sm_121a PTX are newer).
    let isa = if arch.starts_with("sm_90") { "\x1f-Ctarget-feature=+ptx84" } else { "" };
    // The block-scaled FP4 kernels only where the arch has the instruction (rustc reports no
    // target feature past sm_90a to `cfg`).
    let fp4 = if kernels_gpu::block_scaled_fp4(arch) { "\x1f--cfg\x1fblock_scaled_fp4" } else { "" };
    // Likewise the fifth-generation tensor-core (`tcgen05`) kernels.
    let tc = if kernels_gpu::has_tcgen05(arch) { "\x1f--cfg\x1ftcgen05" } else { "" };
    cmd.env(
        "CARGO_ENCODED_RUSTFLAGS",
        format!("-Ctarget-cpu={arch}{isa}{fp4}{tc}\x1f-Cllvm-args=-unroll-threshold=4000"),
    );
    let output = cmd.output().map_err(|e| format!("cannot run cargo for the {arch} PTX build: {e}"))?;
    if !output.status.success() {
        return Err(format!(
            "building kernels-gpu for {arch} failed ({}; the device code builds with rust-toolchain.toml's nightly, \
             run through rustup):\n{}",
            output.status,
            String::from_utf8_lossy(&output.stderr)
        ));
    }
    let ptx = std::fs::read_to_string(&out).map_err(|e| {
        format!("the {arch} build succeeded but {} is unreadable ({e}); run `cargo clean` and retry", out.display())
    })?;
    let target = ptx_target(&ptx);
    if target != Some(arch) {
        let t = target.unwrap_or("<none>");
        return Err(format!("{} has `.target {t}`, expected `.target {arch}`", out.display()));
    }
    // Written beside rustc's output, never over it: cargo may find the build fresh and not
    // rewrite that file.
    let bounded = dir.join("kernels-bounded.ptx");
    std::fs::write(&bounded, with_launch_bounds(&ptx, arch)?)
        .map_err(|e| format!("cannot write {}: {e}", bounded.display()))?;
    Ok(bounded)
}

/// The `ptx` profile, as cargo arguments (the device build's and its lint's): given on the
/// command line rather than in the workspace manifest, where `panic = "immediate-abort"` would
/// need `cargo-features`, which a stable cargo refuses to read. One codegen unit, so
/// `--emit=asm` yields one PTX module; immediate-abort keeps the panic machinery out of the PTX.
pub const PTX_PROFILE: [&str; 11] = [
    "--profile",
    "ptx",
    "-Zpanic-immediate-abort",
    "--config",
    "profile.ptx.inherits=\"release\"",
    "--config",
    "profile.ptx.panic=\"immediate-abort\"",
    "--config",
    "profile.ptx.codegen-units=1",
    "--config",
    "profile.ptx.debug=false",
];

/// A cargo of the toolchain `rust-toolchain.toml` pins, whatever toolchain runs the caller (a
/// crate outside the workspace builds on stable): through rustup (`rustup run`, after `rustup
/// toolchain install`, a no-op when it is there, which installs the file's toolchain with its
/// components), or the caller's own cargo where there is no rustup.
fn pinned_cargo(workspace: &Path) -> Result<Command, String> {
    let file = workspace.join("rust-toolchain.toml");
    let text = std::fs::read_to_string(&file).map_err(|e| format!("cannot read {}: {e}", file.display()))?;
    let channel = text
        .lines()
        .find_map(|l| l.trim().strip_prefix("channel = \"")?.strip_suffix('"'))
        .ok_or(format!("{} names no channel", file.display()))?;
    let rustup = |args: &[&str]| {
        let mut cmd = Command::new("rustup");
        cmd.current_dir(workspace).args(args).env_remove("RUSTUP_TOOLCHAIN");
        cmd
    };
    match rustup(&["toolchain", "install"]).output() {
        Ok(out) if out.status.success() => Ok(rustup(&["run", channel, "cargo"])),
        Ok(out) => Err(format!(
            "`rustup toolchain install` in {} failed ({}); the device code needs {channel}:\n{}",
            workspace.display(),
            out.status,
            String::from_utf8_lossy(&out.stderr)
        )),
        Err(_) => Ok(Command::new(std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into()))),
    }
}

/// Kernels whose launches need a bound on their registers (64K registers an SM: a block of
/// 512 threads fits only at 128 or fewer each, which ptxas does not assume), bounded by their
/// most threads a block (`Kernel::threads`), and the blocks an SM should hold at once
/// (`.minnctapersm`, 0: not said). One block for `sample_bf16` (for sm_121a ptxas otherwise
/// kept it at 64 registers, and spilled); the chunked scan's kernels as many as their shared
/// memory allows at NemotronH widths, so the staging of some blocks overlaps the products of
/// others; the FP8 and NVFP4 tensor-core mat-vecs three (at most 80 registers: an SM holds 24
/// warps of weight loads), the expert kernels on them two. The norms launch up to 1024
/// threads (rows wider than 8192), so at most 64 registers.
const LAUNCH_BOUNDS: [(Kernel, u32); 30] = [
    (Kernel::MoeGroupedWide, 2),
    (Kernel::MoeGrouped, 2),
    (Kernel::MoeGroupedFp8, 2),
    (Kernel::MoeGroupedNvfp4, 2),
    (Kernel::MoeGroupedWgmma, 1),
    (Kernel::MoeGroupedWgmmaFp8, 1),
    (Kernel::MoeGroupedWgmmaNvfp4, 1),
    (Kernel::GemmWgmma, 1),
    (Kernel::GemmWgmmaFp8, 1),
    (Kernel::GemmFp8, 2),
    (Kernel::GemmWideBf16, 2),
    (Kernel::GemmBf16, 2),
    (Kernel::AttnFlash, 1),
    (Kernel::AttnFlashD128, 1),
    (Kernel::AttnFlashK32, 1),
    (Kernel::AttnFlashK32D128, 1),
    (Kernel::AttnFlashWgmma, 1),
    (Kernel::MambaDecode, 0),
    (Kernel::GemvTcFp8, 3),
    (Kernel::MoeExpertTcFp8, 2),
    (Kernel::GemvTcNvfp4, 3),
    (Kernel::MoeExpertTcNvfp4, 2),
    (Kernel::Sample, 1),
    (Kernel::SsdChunkState, 3),
    (Kernel::SsdStatePassF32, 2),
    (Kernel::SsdStatePassBf16, 2),
    (Kernel::SsdScan, 3),
    (Kernel::NormRms, 0),
    (Kernel::NormGated, 0),
    (Kernel::NormGatedFp8, 0),
];

/// `ptx` with a `.maxntid` directive (and `.minnctapersm` where asked) on each entry of
/// [`LAUNCH_BOUNDS`] (rustc has no attribute for them), so ptxas keeps their registers within
/// what the block size allows.
fn with_launch_bounds(ptx: &str, arch: &str) -> Result<String, String> {
    let mut text = ptx.to_string();
    for (kernel, blocks) in LAUNCH_BOUNDS {
        let (name, threads) = (kernel.name(), kernel.threads().most());
        if !kernel.in_arch(arch) {
            continue;
        }
        let at = text.find(&format!(".entry {name}(")).ok_or(format!("no entry {name} in the PTX"))?;
        let body = at + text[at..].find("\n{").ok_or(format!("entry {name} has no body"))?;
        let min = if blocks > 0 { format!("\n.minnctapersm {blocks}") } else { String::new() };
        text.insert_str(body, &format!("\n.maxntid {threads}, 1, 1{min}"));
    }
    Ok(text)
}

/// The `.target` of a PTX module (first word after the directive).
pub fn ptx_target(ptx: &str) -> Option<&str> {
    ptx.lines().find_map(|l| l.trim().strip_prefix(".target ")).and_then(|t| t.split([',', ' ']).next())
}
