//! Helpers for tests that run real `pie serve` processes on loopback.

#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use pie_model::synth::{write_test_model, SynthSpec};
use serde_json::Value;

/// The cached default model's path; None, said on stderr, when it is not
/// cached (`pie model fetch`), unless `PIE_REQUIRE_DEFAULT_MODEL` makes that a
/// failure (CI, which fetches it).
pub fn cached_default_model() -> Option<PathBuf> {
    let path = pie_worker::fetch::cached_default_model();
    if path.exists() {
        return Some(path);
    }
    assert!(
        std::env::var_os("PIE_REQUIRE_DEFAULT_MODEL").is_none(),
        "default model missing at {}",
        path.display()
    );
    eprintln!(
        "skipping: default model not cached at {} (run `pie model fetch`)",
        path.display()
    );
    None
}

/// The synthesized test model, written once per test binary.
pub fn test_model() -> PathBuf {
    static PATH: OnceLock<PathBuf> = OnceLock::new();
    PATH.get_or_init(|| {
        let path = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
            .join(format!("server-test-model-{}.gguf", std::process::id()));
        write_test_model(
            &path,
            &SynthSpec {
                seed: 2,
                ..SynthSpec::default()
            },
        )
        .unwrap();
        path
    })
    .clone()
}

/// A running `pie serve`, killed on drop.
pub struct Server {
    child: Child,
    pub url: String,
    pub client: reqwest::Client,
    /// The config file it was started with (rewrite it, then `reload`).
    pub config_path: PathBuf,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Server {
    /// Start on a free port with the test model, a config file body, and extra flags.
    pub async fn start(config: &str, args: &[&str]) -> Server {
        Self::start_model(&test_model(), config, args).await
    }

    pub async fn start_model(model: &std::path::Path, config: &str, args: &[&str]) -> Server {
        let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"));
        let cfg = dir.join(format!(
            "config-{}-{}.toml",
            std::process::id(),
            rand_suffix()
        ));
        std::fs::write(&cfg, config).unwrap();
        let mut child = Command::new(env!("CARGO_BIN_EXE_pie"))
            .args(["serve", "--port", "0", "--model"])
            .arg(model)
            .arg("--config")
            .arg(&cfg)
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap();
        let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
        let first = lines.next().expect("server printed nothing").unwrap();
        let url = first
            .strip_prefix("pie: listening on ")
            .unwrap_or_else(|| panic!("unexpected first line {first:?}"))
            .to_string();
        // Keep draining stdout so the server never blocks on a full pipe.
        std::thread::spawn(move || for _ in lines {});
        let server = Server {
            child,
            url,
            client: reqwest::Client::new(),
            config_path: cfg,
        };
        server.wait_healthy().await;
        server
    }

    async fn wait_healthy(&self) {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if let Ok(r) = self.client.get(self.url("/health")).send().await {
                if r.status() == 200 {
                    return;
                }
            }
            assert!(Instant::now() < deadline, "server never became healthy");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Send SIGHUP.
    pub fn hangup(&self) {
        let ok = Command::new("kill")
            .args(["-HUP", &self.child.id().to_string()])
            .status()
            .unwrap()
            .success();
        assert!(ok, "kill -HUP failed");
    }

    /// Send SIGTERM (a drain).
    pub fn terminate(&self) {
        let ok = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status()
            .unwrap()
            .success();
        assert!(ok, "kill -TERM failed");
    }

    /// Whether the server has exited (reaped if so).
    pub fn exited(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(Some(_)))
    }

    /// Stop the server now (as a crash would).
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    pub fn url(&self, path: &str) -> String {
        format!("{}{}", self.url, path)
    }

    pub async fn post(&self, path: &str, body: Value) -> (u16, Value) {
        let r = self
            .client
            .post(self.url(path))
            .json(&body)
            .send()
            .await
            .unwrap();
        (r.status().as_u16(), r.json().await.unwrap_or(Value::Null))
    }

    /// Launch a native process; returns its id.
    pub async fn launch(&self, body: Value) -> String {
        let (status, resp) = self.post("/v1/processes", body).await;
        assert_eq!(status, 201, "{resp}");
        resp["id"].as_str().unwrap().to_string()
    }

    /// Wait for a process to reach a final state; returns its record.
    pub async fn wait_done(&self, id: &str) -> Value {
        let path = format!("/v1/processes/{id}");
        let final_states = ["finished", "failed", "killed"];
        self.eventually("process end", async || {
            final_states.contains(&self.get(&path).await.1["state"].as_str().unwrap_or(""))
        })
        .await;
        self.get(&path).await.1
    }

    pub async fn get(&self, path: &str) -> (u16, Value) {
        let r = self.client.get(self.url(path)).send().await.unwrap();
        (r.status().as_u16(), r.json().await.unwrap_or(Value::Null))
    }

    /// One metric's value (summed over label sets) from /metrics.
    pub async fn metric(&self, name: &str) -> f64 {
        metric_value(&self.metrics_text().await, name)
    }

    pub async fn metrics_text(&self) -> String {
        self.client
            .get(self.url("/metrics"))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap()
    }

    /// Poll until `f` holds (or panic after 20 s).
    pub async fn eventually<F: AsyncFnMut() -> bool>(&self, what: &str, mut f: F) {
        let deadline = Instant::now() + Duration::from_secs(20);
        while !f().await {
            assert!(Instant::now() < deadline, "timed out waiting for {what}");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// Every sample of a Prometheus text body: (name with labels, value).
pub fn metric_samples(text: &str) -> impl Iterator<Item = (&str, f64)> {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| l.rsplit_once(' '))
        .map(|(k, v)| (k, v.trim().parse::<f64>().unwrap()))
}

/// One metric's value, summed over its label sets.
pub fn metric_value(text: &str, name: &str) -> f64 {
    metric_samples(text)
        .filter(|(k, _)| *k == name || k.starts_with(&format!("{name}{{")))
        .map(|(_, v)| v)
        .sum()
}

fn rand_suffix() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    N.fetch_add(1, Ordering::Relaxed)
}

/// Read an SSE body: the `data:` payloads, in order.
pub async fn sse_data(resp: reqwest::Response) -> Vec<String> {
    let mut out = Vec::new();
    let mut buf = String::new();
    let mut resp = resp;
    while let Some(chunk) = resp.chunk().await.unwrap() {
        buf.push_str(&String::from_utf8_lossy(&chunk));
        while let Some(end) = buf.find("\n\n") {
            let event: String = buf.drain(..end + 2).collect();
            out.extend(
                event
                    .lines()
                    .filter_map(|l| l.strip_prefix("data: ").or_else(|| l.strip_prefix("data:")))
                    .map(str::to_string),
            );
        }
    }
    out
}

/// A streamed completion asked with `pie_stream_ids`: (token id, text emitted
/// with it) per token, the text after the last token, its process, and
/// whether it was handed off. `read_stream` stops after `stop_after` tokens
/// when given (the response is returned to read on).
pub struct Streamed {
    pub tokens: Vec<(u32, String)>,
    pub tail: String,
    pub handed_off: bool,
    pub process: Option<String>,
}

impl Streamed {
    pub fn text(&self) -> String {
        self.tokens
            .iter()
            .map(|(_, t)| t.as_str())
            .collect::<String>()
            + &self.tail
    }

    pub fn ids(&self) -> Vec<u32> {
        self.tokens.iter().map(|(t, _)| *t).collect()
    }
}

pub async fn read_stream(
    mut r: reqwest::Response,
    stop_after: Option<usize>,
) -> (Streamed, reqwest::Response) {
    let mut s = Streamed {
        tokens: Vec::new(),
        tail: String::new(),
        handed_off: false,
        process: None,
    };
    let mut buf = String::new();
    while let Some(chunk) = r.chunk().await.unwrap() {
        buf.push_str(&String::from_utf8_lossy(&chunk));
        while let Some(end) = buf.find("\n\n") {
            let event: String = buf.drain(..end + 2).collect();
            for line in event.lines() {
                if let Some(id) = line.strip_prefix(": pie-process ") {
                    s.process = Some(id.to_string());
                } else if line == ": pie-handoff" {
                    s.handed_off = true;
                } else if let Some(data) = line.strip_prefix("data: ") {
                    let Ok(v) = serde_json::from_str::<Value>(data) else {
                        continue;
                    };
                    assert!(v.get("error").is_none(), "{v}");
                    let text = v["choices"][0]["text"]
                        .as_str()
                        .unwrap_or_default()
                        .to_string();
                    match v["pie_token_ids"].as_array() {
                        Some(ids) => s.tokens.push((ids[0].as_u64().unwrap() as u32, text)),
                        None => s.tail.push_str(&text),
                    }
                }
            }
        }
        if stop_after.is_some_and(|n| s.tokens.len() >= n) {
            break;
        }
    }
    (s, r)
}
