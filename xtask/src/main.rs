//! `cargo xtask <command>`:
//! - `ptx --arch <sm_90|sm_90a|sm_110a|sm_121a|all> [--out DIR]`: build the kernels to PTX, check the
//!   `.target` and every entry, assemble with ptxas 13.x, print registers / spills / shared
//!   memory per kernel, and write `DIR/<arch>.ptx` (default `target/ptx/out`);
//! - `generate ARGS...`: the model crate's `generate` CLI (release build), e.g.
//!   `./x generate --prompt "Hello"` runs the built-in model;
//! - `test [ARGS...]`: provision ptxas and a Python with the `openai` package (a virtual
//!   environment in `target/tools/venv`, for the serve client test), then
//!   `cargo test --workspace ARGS...` (the CI command);
//! - `serve ARGS...`: the model crate's `serve` (release build), e.g. `./x serve --port 8000`;
//! - `lint`: rustfmt check, and clippy with warnings denied on the host crates and on the
//!   device code as built for nvptx64;
//! - `bundle [--out DIR]`: build the release test and bench executables and the model crate's
//!   binaries (`serve`, `serve_bench`, `generate`) and copy them, stripped, into DIR (default
//!   `.device`: `tests/`, `benches/`, `bin/`) to carry to a GPU machine.

#[path = "../../host/ptx_build.rs"]
mod ptx_build;
mod tools;

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};
use kernels_gpu::Kernel;

fn main() -> Result<()> {
    let mut args = std::env::args().skip(1);
    let workspace =
        Path::new(env!("CARGO_MANIFEST_DIR")).parent().context("xtask lives in the workspace")?.to_path_buf();
    match args.next().as_deref() {
        Some("ptx") => {
            let (mut arch, mut out) = (None, workspace.join("target/ptx/out"));
            while let Some(a) = args.next() {
                match a.as_str() {
                    "--arch" => arch = args.next(),
                    "--out" => out = args.next().map(PathBuf::from).context("--out needs a directory")?,
                    other => bail!("unknown argument `{other}`; usage: cargo xtask ptx --arch <arch|all> [--out DIR]"),
                }
            }
            let arch =
                arch.context("missing --arch; usage: cargo xtask ptx --arch <sm_90|sm_90a|sm_110a|sm_121a|all>")?;
            let arches: Vec<&str> = match arch.as_str() {
                "all" => ptx_build::ARCHES.to_vec(),
                a if ptx_build::ARCHES.contains(&a) => vec![a],
                a => bail!("unsupported arch `{a}`; supported: {}, all", ptx_build::ARCHES.join(", ")),
            };
            ptx(&workspace, &arches, &out)
        }
        Some("test") => {
            let ptxas = tools::ptxas(&workspace)?;
            // The serve client test fails, saying why, when it has no Python; the rest still run.
            let mut env = vec![("PTXAS", ptxas)];
            match tools::python_with_openai(&workspace) {
                Ok(python) => env.push(("NEMOTRON_TEST_PYTHON", python)),
                Err(e) => eprintln!("warning: no Python with openai for the serve client test: {e:#}"),
            }
            cargo(&workspace, &["test", "--workspace"], args, &env)
        }
        Some("serve") => {
            cargo(&workspace, &["run", "--release", "--quiet", "-p", "model", "--bin", "serve", "--"], args, &[])
        }
        Some("generate") => {
            cargo(&workspace, &["run", "--release", "--quiet", "-p", "model", "--bin", "generate", "--"], args, &[])
        }
        Some("lint") => {
            cargo(&workspace, &["fmt", "--all", "--", "--check"], args, &[])?;
            cargo(
                &workspace,
                &["clippy", "--workspace", "--all-targets", "--", "-D", "warnings"],
                std::iter::empty(),
                &[],
            )?;
            let device = [
                &["clippy", "-p", "kernels-gpu"][..],
                &ptx_build::PTX_PROFILE,
                &[
                    "--target",
                    "nvptx64-nvidia-cuda",
                    "-Zbuild-std=core",
                    "--target-dir",
                    "target/clippy-ptx",
                    "--",
                    "-D",
                    "warnings",
                ],
            ]
            .concat();
            // With the arch-specific block-scaled FP4 and `tcgen05` kernels (kernels-gpu's
            // `block_scaled_fp4` and `tcgen05` cfgs), which only sm_121a's and sm_110a's PTX
            // builds compile otherwise.
            let fp4 = [("CARGO_ENCODED_RUSTFLAGS", PathBuf::from("--cfg\x1fblock_scaled_fp4\x1f--cfg\x1ftcgen05"))];
            cargo(&workspace, &device, std::iter::empty(), &fp4)?;
            // The crate outside the workspace (outside/: it has a workspace of its own).
            cargo(
                &workspace,
                &["fmt", "--manifest-path", "outside/Cargo.toml", "--", "--check"],
                std::iter::empty(),
                &[],
            )
        }
        Some("bundle") => {
            let out = match (args.next().as_deref(), args.next()) {
                (Some("--out"), Some(dir)) => PathBuf::from(dir),
                (None, _) => workspace.join(".device"),
                _ => bail!("usage: cargo xtask bundle [--out DIR]"),
            };
            bundle(&workspace, &out)
        }
        _ => bail!(
            "usage: cargo xtask <ptx --arch <sm_90|sm_90a|sm_110a|sm_121a|all> [--out DIR] | test [ARGS] | generate ARGS | serve ARGS | lint | bundle [--out DIR]>"
        ),
    }
}

/// Builds, checks and assembles the PTX of each arch, printing a resource table per arch.
fn ptx(workspace: &Path, arches: &[&str], out: &Path) -> Result<()> {
    let ptxas = tools::ptxas(workspace)?;
    std::fs::create_dir_all(out)?;
    for &arch in arches {
        eprintln!("building PTX for {arch}");
        let path = ptx_build::build_ptx(workspace, &workspace.join("target/ptx"), arch).map_err(anyhow::Error::msg)?;
        let text = std::fs::read_to_string(&path)?;
        let mine: Vec<&str> = Kernel::ALL.iter().filter(|k| k.in_arch(arch)).map(|k| k.name()).collect();
        let missing: Vec<&str> = mine.iter().copied().filter(|n| !has_entry(&text, n)).collect();
        if !missing.is_empty() {
            bail!("{}: entries missing: {}", path.display(), missing.join(", "));
        }
        let cubin = path.with_extension("cubin");
        let output = Command::new(&ptxas)
            .args(["-arch", arch, "-v", "-o"])
            .arg(&cubin)
            .arg(&path)
            .output()
            .with_context(|| format!("running {}", ptxas.display()))?;
        let log = String::from_utf8_lossy(&output.stderr).into_owned() + &String::from_utf8_lossy(&output.stdout);
        if !output.status.success() {
            bail!("ptxas -arch {arch} rejected {}:\n{log}", path.display());
        }
        let dest = out.join(format!("{arch}.ptx"));
        std::fs::copy(&path, &dest)?;
        println!("\n{arch}: {} ({} bytes), assembled by ptxas for {arch}", dest.display(), text.len());
        println!(
            "{:<24} {:>9} {:>12} {:>11} {:>12} {:>11}",
            "kernel", "registers", "spill-store", "spill-load", "static-smem", "stack"
        );
        let rows = parse_ptxas(&log);
        for r in &rows {
            println!(
                "{:<24} {:>9} {:>12} {:>11} {:>12} {:>11}",
                r.name, r.registers, r.spill_stores, r.spill_loads, r.smem, r.stack
            );
        }
        if rows.len() != mine.len() {
            bail!("ptxas -v reported {} entries, expected {}:\n{log}", rows.len(), mine.len());
        }
        let local: Vec<&str> =
            rows.iter().filter(|r| r.stack + r.spill_stores + r.spill_loads > 0).map(|r| r.name.as_str()).collect();
        if !local.is_empty() {
            bail!("{arch}: kernels using local memory (stack frame or spills): {}", local.join(", "));
        }
    }
    println!("\n(dynamic shared memory is set per launch: see each kernel's doc comment)");
    Ok(())
}

/// Whether `ptx` declares `.entry name(`.
fn has_entry(ptx: &str, name: &str) -> bool {
    ptx.lines().any(|l| {
        l.trim_start()
            .strip_prefix(".visible .entry ")
            .is_some_and(|r| r.strip_prefix(name).is_some_and(|r| r.starts_with('(')))
    })
}

/// One kernel's resources as `ptxas -v` reports them.
#[derive(Default)]
struct Resources {
    name: String,
    registers: u32,
    spill_stores: u32,
    spill_loads: u32,
    smem: u32,
    stack: u32,
}

/// Parses `ptxas -v` output into one row per entry function.
fn parse_ptxas(log: &str) -> Vec<Resources> {
    let number_before = |line: &str, unit: &str| -> Option<u32> {
        let i = line.find(unit)?;
        line[..i].trim_end().rsplit([' ', ',']).next()?.parse().ok()
    };
    let mut rows: Vec<Resources> = Vec::new();
    for line in log.lines() {
        if let Some(rest) = line.split("Compiling entry function '").nth(1) {
            let name = rest.split('\'').next().unwrap_or_default().to_string();
            rows.push(Resources { name, ..Resources::default() });
        } else if let Some(r) = rows.last_mut() {
            if let Some(v) = number_before(line, "bytes stack frame") {
                r.stack = v;
            }
            if let Some(v) = number_before(line, "bytes spill stores") {
                r.spill_stores = v;
            }
            if let Some(v) = number_before(line, "bytes spill loads") {
                r.spill_loads = v;
            }
            if let Some(v) = number_before(line, "registers") {
                r.registers = v;
            }
            if let Some(v) = number_before(line, "bytes smem") {
                r.smem = v;
            }
        }
    }
    rows
}

/// Runs `cargo <base> <extra...>` in the workspace, with the variables of `env` set.
fn cargo(workspace: &Path, base: &[&str], extra: impl Iterator<Item = String>, env: &[(&str, PathBuf)]) -> Result<()> {
    let mut cmd = Command::new(std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into()));
    cmd.current_dir(workspace).args(base).args(extra).envs(env.iter().map(|(k, v)| (k, v)));
    let status = cmd.status().context("running cargo")?;
    if !status.success() {
        bail!("cargo {} failed ({status})", base.join(" "));
    }
    Ok(())
}

/// Builds the release test and bench executables and the model crate's binaries, and copies
/// them, stripped, into `out` (`out/tests/<name>`, `out/benches/<name>`, `out/bin/<name>`).
fn bundle(workspace: &Path, out: &Path) -> Result<()> {
    if out.exists() {
        std::fs::remove_dir_all(out).with_context(|| format!("clearing {}", out.display()))?;
    }
    let test: &[&str] = &["test", "--no-run", "--release", "--workspace"];
    let bench: &[&str] = &["bench", "--no-run", "--workspace"];
    // A build of their own: a test build turns on test-only features (model's `scripted`).
    let bin: &[&str] = &["build", "--release", "-p", "model", "--bins"];
    for (kind, args) in [("tests", test), ("benches", bench), ("bin", bin)] {
        let output = Command::new(std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into()))
            .current_dir(workspace)
            .args(args)
            .arg("--message-format=json-render-diagnostics")
            .stderr(std::process::Stdio::inherit())
            .output()
            .context("running cargo")?;
        if !output.status.success() {
            bail!("cargo {} failed", args.join(" "));
        }
        let dir = out.join(kind);
        std::fs::create_dir_all(&dir)?;
        for line in String::from_utf8_lossy(&output.stdout).lines() {
            let Ok(msg) = serde_json::from_str::<serde_json::Value>(line) else { continue };
            let (Some(exe), Some(name)) = (msg["executable"].as_str(), msg["target"]["name"].as_str()) else {
                continue;
            };
            let is = |k: &str| msg["target"]["kind"].as_array().is_some_and(|kinds| kinds.iter().any(|x| x == k));
            // The tests are the libraries' and the suites' (a test build also builds the
            // binaries, their test harnesses, named as they are, and the examples).
            let wanted = match kind {
                "tests" => !is("bench") && !is("bin") && !is("example"),
                "benches" => is("bench"),
                _ => is("bin"),
            };
            if !wanted {
                continue;
            }
            let dest = dir.join(name);
            std::fs::copy(exe, &dest).with_context(|| format!("copying {exe}"))?;
            let stripped = Command::new("strip").arg(&dest).status().map(|s| s.success()).unwrap_or(false);
            eprintln!("{}{}", dest.display(), if stripped { "" } else { " (not stripped: no `strip`)" });
        }
    }
    Ok(())
}
