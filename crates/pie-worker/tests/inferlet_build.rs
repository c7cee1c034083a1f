//! `pie inferlet build` where the toolchain lacks `wasm32-wasip2`: rustup
//! adds it, saying so; without rustup the error says what to run. Fake
//! `rustc`, `rustup` and `cargo` on `PATH` stand in for the toolchain.

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;

fn script(dir: &Path, name: &str, body: &str) {
    let path = dir.join(name);
    std::fs::write(&path, format!("#!/bin/sh\n{body}\n")).unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
}

/// `pie inferlet build` of a new crate with only `bin` on PATH (and sh's
/// basics): its stderr and whether it succeeded.
fn build_with(bin: &Path, work: &Path) -> (String, bool) {
    let pie = pie_testkit::workspace_bin("pie");
    let created = Command::new(&pie)
        .args(["inferlet", "new", "probe"])
        .current_dir(work)
        .output()
        .unwrap();
    assert!(created.status.success());
    let out = Command::new(&pie)
        .args(["inferlet", "build", "probe"])
        .current_dir(work)
        .env("PATH", format!("{}:/usr/bin:/bin", bin.display()))
        .env("CARGO", bin.join("cargo"))
        .output()
        .unwrap();
    (
        String::from_utf8_lossy(&out.stderr).to_string(),
        out.status.success(),
    )
}

/// A fake toolchain in a fresh directory: `rustc` names a sysroot (with
/// the wasm32-wasip2 library where `has_target`), a `rustup` that logs its
/// arguments where `has_rustup`, and a `cargo` that says it ran and fails.
/// Returns the directory, its `bin` and rustup's log.
fn toolchain(name: &str, has_target: bool, has_rustup: bool) -> (PathBuf, PathBuf, PathBuf) {
    let dir = std::env::temp_dir().join(format!("pie-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let (bin, rustlib) = (dir.join("bin"), dir.join("sysroot/lib/rustlib"));
    std::fs::create_dir_all(&bin).unwrap();
    std::fs::create_dir_all(rustlib.join(if has_target { "wasm32-wasip2" } else { "" })).unwrap();
    script(
        &bin,
        "rustc",
        &format!("echo {}", dir.join("sysroot").display()),
    );
    let log = dir.join("rustup.log");
    if has_rustup {
        script(&bin, "rustup", &format!("echo \"$@\" >> {}", log.display()));
    }
    script(&bin, "cargo", "echo cargo ran >&2; exit 1");
    (dir, bin, log)
}

#[test]
fn a_missing_target_is_added_by_rustup_and_said() {
    let (dir, bin, log) = toolchain("add-target", false, true);
    let (stderr, ok) = build_with(&bin, &dir);
    assert!(!ok, "the fake cargo fails the build");
    assert!(
        stderr.contains("installing the wasm32-wasip2 target"),
        "{stderr}"
    );
    assert!(stderr.contains("cargo ran"), "then builds: {stderr}");
    let calls = std::fs::read_to_string(&log).unwrap();
    assert!(calls.contains("target add wasm32-wasip2"), "{calls}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn without_rustup_the_error_says_what_to_run() {
    let (dir, bin, _) = toolchain("no-rustup", false, false);
    let (stderr, ok) = build_with(&bin, &dir);
    assert!(!ok);
    assert!(
        stderr.contains("rustup target add wasm32-wasip2"),
        "{stderr}"
    );
    assert!(!stderr.contains("cargo ran"), "{stderr}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_present_target_asks_nothing_of_rustup() {
    let (dir, bin, log) = toolchain("has-target", true, true);
    let (stderr, _) = build_with(&bin, &dir);
    assert!(stderr.contains("cargo ran"), "{stderr}");
    assert!(!log.exists(), "rustup was not asked");
    let _ = std::fs::remove_dir_all(&dir);
}
