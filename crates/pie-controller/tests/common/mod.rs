//! Helpers for tests that run real `pie serve` workers (test model) behind a
//! real `pie-controller` as child processes. Shared by several test binaries,
//! each of which uses a part of it.

#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use pie_model::synth::{write_test_model, SynthSpec};

/// A child process killed on drop.
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
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A binary of the workspace, next to `pie-controller`.
pub fn bin(name: &str) -> PathBuf {
    let path = Path::new(env!("CARGO_BIN_EXE_pie-controller")).with_file_name(name);
    assert!(
        path.exists(),
        "{} missing: run `cargo build --release --bin pie --bin pie-pool` first (or `cargo test --workspace`)",
        path.display()
    );
    path
}

/// Start `program` and wait for its first line, `prefix` followed by its URL.
pub fn spawn(program: &Path, args: &[&str], prefix: &str) -> Proc {
    let mut child = Command::new(program)
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let first = lines.next().expect("no output").unwrap();
    let url = first
        .strip_prefix(prefix)
        .unwrap_or_else(|| panic!("unexpected line {first:?}"))
        .to_string();
    std::thread::spawn(move || for _ in lines {});
    Proc { child, url }
}

/// The synthesized test model, written once per test binary.
pub fn model() -> PathBuf {
    let path = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("controller-test-model-{}.gguf", std::process::id()));
    static WRITTEN: std::sync::Once = std::sync::Once::new();
    WRITTEN.call_once(|| {
        write_test_model(
            &path,
            &SynthSpec {
                seed: 3,
                ..SynthSpec::default()
            },
        )
        .unwrap()
    });
    path
}

/// Poll until `f` holds (or panic after 30 s).
pub async fn wait_for(what: &str, mut f: impl AsyncFnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !f().await {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// `GET url` as JSON.
pub async fn get_json(url: &str) -> serde_json::Value {
    reqwest::get(url).await.unwrap().json().await.unwrap()
}

/// The controller's logged actions of `kind` (`GET /v1/cluster/actions`),
/// newest first.
pub async fn actions(controller: &str, kind: &str) -> Vec<serde_json::Value> {
    let log = get_json(&format!("{controller}/v1/cluster/actions")).await;
    log["actions"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|a| a["kind"] == kind)
        .cloned()
        .collect()
}

/// The actions of `kind` once there is one and the workers have answered
/// every one (none is `sent` any more).
pub async fn settled(controller: &str, kind: &str) -> Vec<serde_json::Value> {
    wait_for(&format!("`{kind}` actions answered"), async || {
        let all = actions(controller, kind).await;
        !all.is_empty() && all.iter().all(|a| a["outcome"] != "sent")
    })
    .await;
    actions(controller, kind).await
}

/// `n` long streams with `props` started at `url` (a worker or a
/// controller) by `http`, each past its first chunk: they run until dropped.
pub async fn hold_streams(
    http: &reqwest::Client,
    url: &str,
    n: usize,
    props: serde_json::Value,
) -> Vec<reqwest::Response> {
    let mut held = Vec::new();
    for _ in 0..n {
        let mut r = http
            .post(format!("{url}/v1/completions"))
            .json(&serde_json::json!({"prompt": "hold", "max_tokens": 4000,
                "ignore_eos": true, "stream": true, "props": props}))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        r.chunk().await.unwrap().expect("first chunk");
        held.push(r);
    }
    held
}
