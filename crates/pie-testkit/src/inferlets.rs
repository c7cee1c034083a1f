//! The repository's guest inferlets (`inferlets/`, its own workspace),
//! built for `wasm32-wasip2` once per test binary; cargo's build lock keeps
//! test binaries that build them at once from racing.

use std::path::PathBuf;
use std::process::Command;
use std::sync::OnceLock;

/// The component `name` (a crate of `inferlets/`, e.g. `best-of-n`).
pub fn inferlet_wasm(name: &str) -> PathBuf {
    static BUILT: OnceLock<PathBuf> = OnceLock::new();
    BUILT
        .get_or_init(build_inferlets)
        .join(format!("{}.wasm", name.replace('-', "_")))
}

fn build_inferlets() -> PathBuf {
    let workspace = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../inferlets");
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    // The host build's settings are not the guests'.
    let status = Command::new(cargo)
        .args(["build", "--release", "--quiet"])
        .current_dir(&workspace)
        .env_remove("RUSTFLAGS")
        .env_remove("CARGO_ENCODED_RUSTFLAGS")
        .env_remove("CARGO_TARGET_DIR")
        .env_remove("CARGO_BUILD_TARGET")
        .status()
        .expect("running cargo to build the guest inferlets");
    assert!(
        status.success(),
        "building inferlets/ for wasm32-wasip2 failed"
    );
    workspace.join("target/wasm32-wasip2/release")
}
