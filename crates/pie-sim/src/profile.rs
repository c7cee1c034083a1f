//! `--profile NAME|PATH`: a built-in cost profile by name, or a JSON profile
//! file (as `pie bench --calibrate` writes it); errors name the file and field.

use std::path::Path;

use anyhow::{Context, Result};
use pie_workload::cost::PROFILES;
use pie_workload::CostProfile;

/// The built-in profile `arg` names, else the profile in the file at `arg`.
pub fn load(arg: &str) -> Result<CostProfile> {
    if PROFILES.contains(&arg) {
        return CostProfile::named(arg).map_err(anyhow::Error::msg);
    }
    read(Path::new(arg))
}

fn read(path: &Path) -> Result<CostProfile> {
    let text = std::fs::read_to_string(path).with_context(|| {
        format!(
            "reading cost profile file {} (built-in profiles: {})",
            path.display(),
            PROFILES.join(", ")
        )
    })?;
    CostProfile::from_json(&text)
        .map_err(|e| anyhow::anyhow!("cost profile file {}: {e}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn temp(name: &str, text: &str) -> std::path::PathBuf {
        let path = std::env::temp_dir().join(format!("pie-sim-{}-{name}", std::process::id()));
        std::fs::write(&path, text).expect("temp file");
        path
    }

    #[test]
    fn names_and_files_load() {
        assert_eq!(
            load("cpu").expect("built-in"),
            CostProfile::cpu_placeholder()
        );
        let mut p = CostProfile::cpu_placeholder();
        p.calibrated = true;
        p.a_ms = 3.5;
        let path = temp("ok.json", &serde_json::to_string(&p).expect("json"));
        let loaded = load(path.to_str().expect("utf-8 temp path")).expect("file loads");
        assert_eq!(loaded, p);
        let _ = std::fs::remove_file(path);
    }

    #[test]
    fn errors_name_the_file_and_field() {
        let path = temp("bad.json", r#"{"name": "x", "a_ms": "slow"}"#);
        let shown = path.display().to_string();
        let err = format!("{:#}", load(&shown).unwrap_err());
        assert!(
            err.contains(&shown) && err.contains("field `a_ms`"),
            "{err}"
        );
        let _ = std::fs::remove_file(path);
        let err = format!("{:#}", load("/nonexistent/p.json").unwrap_err());
        assert!(
            err.contains("/nonexistent/p.json") && err.contains("gpu, cpu"),
            "{err}"
        );
    }
}
