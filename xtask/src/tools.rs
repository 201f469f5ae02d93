//! Provisioning of ptxas 13.x, which verifies the PTX (the host itself never needs it: the
//! driver compiles the embedded PTX at load time).

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};

/// The PyPI wheel ptxas comes from when none is installed (runs without a GPU).
const NVCC_WHEEL: &str = "nvidia-cuda-nvcc==13.5.37";
/// Where ptxas sits inside that wheel.
const PTXAS_IN_WHEEL: &str = "nvidia/cu13/bin/ptxas";

/// A ptxas 13.x: `$PTXAS`, else `ptxas` on PATH if it is 13.x, else the copy provisioned under
/// `target/tools/`, downloading the wheel with pip the first time.
pub fn ptxas(workspace: &Path) -> Result<PathBuf> {
    if let Some(p) = std::env::var_os("PTXAS") {
        let p = PathBuf::from(p);
        check_version(&p).with_context(|| format!("$PTXAS={}", p.display()))?;
        return Ok(p);
    }
    if check_version(Path::new("ptxas")).is_ok() {
        return Ok("ptxas".into());
    }
    let dir = workspace.join("target/tools");
    let local = dir.join("ptxas");
    if check_version(&local).is_ok() {
        return Ok(local);
    }
    eprintln!("provisioning ptxas: pip download {NVCC_WHEEL} into {}", dir.display());
    let wheels = dir.join("wheels");
    let status = Command::new("python3")
        .args(["-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:", "-d"])
        .arg(&wheels)
        .arg(NVCC_WHEEL)
        .status()
        .context("running python3 -m pip (python3 with pip is needed to provision ptxas)")?;
    if !status.success() {
        bail!("pip could not download {NVCC_WHEEL} ({status}); install ptxas 13.x and set PTXAS");
    }
    let extract = format!(
        "import glob, sys, zipfile\n\
         whl = glob.glob(sys.argv[1] + '/nvidia_cuda_nvcc-*.whl')[0]\n\
         open(sys.argv[2], 'wb').write(zipfile.ZipFile(whl).read('{PTXAS_IN_WHEEL}'))"
    );
    let status = Command::new("python3").args(["-c", &extract]).arg(&wheels).arg(&local).status()?;
    if !status.success() {
        bail!("could not extract {PTXAS_IN_WHEEL} from the wheel in {}", wheels.display());
    }
    std::os::unix::fs::PermissionsExt::set_mode(&mut std::fs::metadata(&local)?.permissions(), 0o755);
    std::fs::set_permissions(&local, std::os::unix::fs::PermissionsExt::from_mode(0o755))?;
    check_version(&local)?;
    Ok(local)
}

/// Fails unless `ptxas --version` runs and reports release 13.x.
fn check_version(ptxas: &Path) -> Result<()> {
    let out = Command::new(ptxas).arg("--version").output().with_context(|| format!("running {}", ptxas.display()))?;
    let text = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() || !text.contains("release 13.") {
        bail!("{} is not ptxas 13.x: {}", ptxas.display(), text.trim());
    }
    Ok(())
}

/// The `openai` package the serve client test (tests/serve/client_test.py) runs with.
const OPENAI: &str = "openai==3.57.0";

/// A Python with `openai` installed: the virtual environment `target/tools/venv`, created
/// (python3 -m venv) and filled (pip install) the first time.
pub fn python_with_openai(workspace: &Path) -> Result<PathBuf> {
    let venv = workspace.join("target/tools/venv");
    let python = venv.join("bin/python");
    let has_openai = |p: &Path| {
        Command::new(p)
            .args(["-c", "import openai, sys; sys.exit(openai.__version__ != sys.argv[1])", &OPENAI[8..]])
            .output()
            .is_ok_and(|o| o.status.success())
    };
    if has_openai(&python) {
        return Ok(python);
    }
    if !python.exists() {
        eprintln!("provisioning the serve client test: python3 -m venv {}", venv.display());
        let status = Command::new("python3")
            .args(["-m", "venv"])
            .arg(&venv)
            .status()
            .context("running python3 -m venv (python3 with venv is needed for the serve client test)")?;
        if !status.success() {
            bail!("python3 -m venv {} failed ({status})", venv.display());
        }
    }
    eprintln!("provisioning the serve client test: pip install {OPENAI}");
    let status = Command::new(&python)
        .args(["-m", "pip", "install", "--quiet", "--disable-pip-version-check", OPENAI])
        .status()
        .with_context(|| format!("running {} -m pip", python.display()))?;
    if !status.success() || !has_openai(&python) {
        bail!("pip could not install {OPENAI} into {}", venv.display());
    }
    Ok(python)
}
