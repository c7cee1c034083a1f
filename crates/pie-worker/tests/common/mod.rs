//! Helpers for tests that run real `pie serve` processes on loopback.

#![allow(dead_code)]

pub mod guests;

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use pie_client::sse::SseBlocks;
use pie_testkit::{spawn, Proc};
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
    pie_testkit::test_model(2)
}

/// A running `pie serve`, killed on drop.
pub struct Server {
    process: Proc,
    pub url: String,
    pub client: reqwest::Client,
    /// The config file it was started with (rewrite it, then `reload`).
    pub config_path: PathBuf,
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
        let mut argv = vec!["serve", "--port", "0", "--model"];
        argv.push(model.to_str().expect("a UTF-8 model path"));
        argv.push("--config");
        argv.push(cfg.to_str().expect("a UTF-8 config path"));
        argv.extend_from_slice(args);
        let process = spawn(
            Path::new(env!("CARGO_BIN_EXE_pie")),
            &argv,
            "pie: listening on ",
        );
        let url = process.url.clone();
        let server = Server {
            process,
            url,
            client: reqwest::Client::new(),
            config_path: cfg,
        };
        server.wait_healthy().await;
        server
    }

    async fn wait_healthy(&self) {
        let health = self.url("/health");
        pie_testkit::wait_for(
            "the server to be healthy",
            Duration::from_secs(60),
            async || matches!(self.client.get(&health).send().await, Ok(r) if r.status() == 200),
        )
        .await
    }

    pub fn pid(&self) -> u32 {
        self.process.pid()
    }

    /// Send SIGHUP.
    pub fn hangup(&self) {
        self.process.signal("HUP");
    }

    /// Send SIGTERM (a drain).
    pub fn terminate(&self) {
        self.process.signal("TERM");
    }

    /// Whether the server has exited (reaped if so).
    pub fn exited(&mut self) -> bool {
        self.process.exited()
    }

    /// Stop the server now (as a crash would).
    pub fn kill(&mut self) {
        self.process.kill();
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

    /// `method` `path` with API key `key`, extra headers and an optional
    /// JSON body: (status, body as JSON, or as a JSON string when it is not).
    pub async fn call(
        &self,
        method: reqwest::Method,
        path: &str,
        key: &str,
        body: Option<Value>,
        headers: &[(&str, &str)],
    ) -> (u16, Value) {
        let mut req = self.client.request(method, self.url(path)).bearer_auth(key);
        for (name, value) in headers {
            req = req.header(*name, *value);
        }
        if let Some(b) = body {
            req = req.json(&b);
        }
        let r = req.send().await.unwrap();
        let status = r.status().as_u16();
        let text = r.text().await.unwrap();
        (
            status,
            serde_json::from_str(&text).unwrap_or(Value::String(text)),
        )
    }

    /// A streamed completion that started (200): its response, to read.
    pub async fn stream(&self, body: Value) -> reqwest::Response {
        self.stream_at("/v1/completions", body).await
    }

    /// A stream from `path` that started (200): its response, to read.
    pub async fn stream_at(&self, path: &str, body: Value) -> reqwest::Response {
        let r = self
            .client
            .post(self.url(path))
            .json(&body)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        r
    }

    /// Every JSON chunk of a stream from `path`, to its end.
    pub async fn stream_chunks(&self, path: &str, body: Value) -> Vec<Value> {
        let data = pie_testkit::sse_data(self.stream_at(path, body).await).await;
        data.iter()
            .filter_map(|d| serde_json::from_str(d).ok())
            .collect()
    }

    /// Launch a native process; returns its id.
    pub async fn launch(&self, body: Value) -> String {
        let (status, resp) = self.post("/v1/processes", body).await;
        assert_eq!(status, 201, "{resp}");
        resp["id"].as_str().unwrap().to_string()
    }

    /// Wait for a process to reach a final state; returns its record.
    pub async fn wait_done(&self, id: &str) -> Value {
        self.wait_done_with(id, async |path| self.get(path).await.1)
            .await
    }

    /// [`Self::wait_done`] asking with API key `key`.
    pub async fn wait_done_as(&self, key: &str, id: &str) -> Value {
        let get = async |path: &str| {
            self.call(reqwest::Method::GET, path, key, None, &[])
                .await
                .1
        };
        self.wait_done_with(id, get).await
    }

    async fn wait_done_with(&self, id: &str, get: impl AsyncFn(&str) -> Value) -> Value {
        let path = format!("/v1/processes/{id}");
        let final_states = ["finished", "failed", "killed"];
        self.eventually("process end", async || {
            final_states.contains(&get(&path).await["state"].as_str().unwrap_or(""))
        })
        .await;
        get(&path).await
    }

    pub async fn get(&self, path: &str) -> (u16, Value) {
        let r = self.client.get(self.url(path)).send().await.unwrap();
        (r.status().as_u16(), r.json().await.unwrap_or(Value::Null))
    }

    /// One metric's value (summed over label sets) from /metrics.
    pub async fn metric(&self, name: &str) -> f64 {
        pie_testkit::metric_value(&self.metrics_text().await, name)
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
    pub async fn eventually<F: AsyncFnMut() -> bool>(&self, what: &str, f: F) {
        pie_testkit::wait_for(what, Duration::from_secs(20), f).await
    }
}

/// A number unique in this test process (config file names).
fn rand_suffix() -> u64 {
    static N: AtomicU64 = AtomicU64::new(0);
    N.fetch_add(1, Ordering::Relaxed)
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
    let mut blocks = SseBlocks::default();
    while let Some(chunk) = r.chunk().await.unwrap() {
        for block in blocks.push(&chunk).expect("events within the cap") {
            let event = String::from_utf8_lossy(&block);
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
