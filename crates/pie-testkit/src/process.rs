//! Child processes of the workspace's binaries, killed when their handle drops.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

/// A child process killed (and reaped) on drop, with the URL it printed.
pub struct Proc {
    child: Child,
    pub url: String,
}

impl Proc {
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Whether it has exited (reaped if so).
    pub fn exited(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(Some(_)))
    }

    /// Stop it now (as a crash would).
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Send `signal` (`HUP`, `TERM`, ...) with kill(1).
    pub fn signal(&self, signal: &str) {
        let sent = Command::new("kill")
            .args([format!("-{signal}"), self.pid().to_string()])
            .status()
            .expect("kill(1) runs");
        assert!(sent.success(), "kill -{signal} {} failed", self.pid());
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill();
    }
}

/// The workspace binary `name`, beside the running test executable's
/// directory (see the crate doc).
pub fn workspace_bin(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("the test executable's path");
    let profile_dir = exe
        .parent()
        .and_then(Path::parent)
        .expect("tests run from target/<profile>/deps");
    let path = profile_dir.join(name);
    assert!(
        path.exists(),
        "{} missing: run `cargo build --release --bins` first (or `cargo test --workspace`)",
        path.display()
    );
    path
}

/// Start a program that announces no URL (another project's server),
/// its output dropped unless `PIE_TEST_LOGS` is set; `url` is empty.
pub fn spawn_unannounced(program: &str, args: &[&str]) -> Proc {
    let output = || match std::env::var_os("PIE_TEST_LOGS") {
        Some(_) => Stdio::inherit(),
        None => Stdio::null(),
    };
    let child = Command::new(program)
        .args(args)
        .stdout(output())
        .stderr(output())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start {program}: {e}"));
    Proc {
        child,
        url: String::new(),
    }
}

/// Start `program` with `args` and wait for its first line of stdout,
/// `prefix` followed by its URL; stdout is drained after that so the child
/// never blocks on a full pipe. stderr is inherited when `PIE_TEST_LOGS` is
/// set, else dropped.
pub fn spawn(program: &Path, args: &[&str], prefix: &str) -> Proc {
    let stderr = match std::env::var_os("PIE_TEST_LOGS") {
        Some(_) => Stdio::inherit(),
        None => Stdio::null(),
    };
    let mut child = Command::new(program)
        .args(args)
        .stdout(Stdio::piped())
        .stderr(stderr)
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start {}: {e}", program.display()));
    let stdout = child.stdout.take().expect("stdout is piped");
    let mut lines = BufReader::new(stdout).lines();
    let first = match lines.next() {
        Some(Ok(line)) => line,
        other => panic!("{} printed no first line: {other:?}", program.display()),
    };
    let Some(url) = first.strip_prefix(prefix) else {
        let _ = child.kill();
        panic!("{}: unexpected first line {first:?}", program.display());
    };
    let url = url.to_string();
    std::thread::spawn(move || for _ in lines {});
    Proc { child, url }
}
