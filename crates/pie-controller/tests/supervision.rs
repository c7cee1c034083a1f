//! Two real workers behind a real controller: a worker whose engine panics
//! reports itself unhealthy in the state the controller polls, and the
//! controller routes every next request to the other worker. Needs the `pie`
//! binary built with `fault-injection` (`cargo test --workspace --features
//! pie-worker/fault-injection` builds it so).

mod common;

use std::collections::HashSet;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use common::{bin, model, spawn, wait_for, worker, Proc};
use serde_json::{json, Value};

struct Cluster {
    workers: Vec<Proc>,
    controller: Proc,
    http: reqwest::Client,
}

impl Cluster {
    /// Two workers, `w0` and `w1`, behind a round-robin controller polling
    /// every 20 ms.
    async fn start() -> Cluster {
        let workers = vec![worker(&[]), worker(&[])];
        let config = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!(
            "controller-supervision-{}.toml",
            std::process::id()
        ));
        std::fs::write(
            &config,
            "[cluster]\npoll_ms = 20\ncluster_policies = [\"round-robin\"]\n",
        )
        .unwrap();
        let model = model();
        let w: Vec<String> = workers
            .iter()
            .enumerate()
            .map(|(i, p)| format!("w{i}={}", p.url))
            .collect();
        let args = [
            "--port",
            "0",
            "--model",
            model.to_str().unwrap(),
            "--config",
            config.to_str().unwrap(),
            "--worker",
            &w[0],
            "--worker",
            &w[1],
        ];
        let controller = spawn(
            &bin("pie-controller"),
            &args,
            "pie-controller: listening on ",
        );
        let c = Cluster {
            workers,
            controller,
            http: reqwest::Client::new(),
        };
        wait_for("both workers healthy", async || {
            c.healthy().await == ["w0", "w1"]
        })
        .await;
        c
    }

    /// The names of the workers the controller routes to.
    async fn healthy(&self) -> Vec<String> {
        let cluster: Value = self
            .http
            .get(format!("{}/v1/cluster", self.controller.url))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        let mut names: Vec<String> = cluster["workers"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|w| w["healthy"] == true)
            .map(|w| w["name"].as_str().unwrap().to_string())
            .collect();
        names.sort();
        names
    }

    /// A 4-token completion through the controller: (status, worker, body).
    async fn complete(&self, prompt: &str) -> (u16, String, Value) {
        let r = self
            .http
            .post(format!("{}/v1/completions", self.controller.url))
            .json(&json!({"prompt": prompt, "max_tokens": 4, "ignore_eos": true}))
            .send()
            .await
            .unwrap();
        let worker = r
            .headers()
            .get("x-pie-worker")
            .map(|v| v.to_str().unwrap().to_string())
            .unwrap_or_default();
        let status = r.status().as_u16();
        (status, worker, r.json().await.unwrap_or(Value::Null))
    }
}

#[tokio::test]
async fn after_an_engine_panic_the_controller_routes_to_the_other_worker() {
    let c = Cluster::start().await;
    let mut before = HashSet::new();
    for i in 0..4 {
        let (status, worker, body) = c.complete(&format!("before {i}")).await;
        assert_eq!(status, 200, "{body}");
        before.insert(worker);
    }
    assert_eq!(before.len(), 2, "round-robin used both workers: {before:?}");

    let r = c
        .http
        .post(format!("{}/v1/admin/fault", c.workers[0].url))
        .json(&json!({"fault": "panic"}))
        .send()
        .await
        .unwrap();
    assert_ne!(
        r.status(),
        404,
        "the pie binary lacks the fault route: build it with `--features pie-worker/fault-injection`"
    );
    assert_eq!(r.status(), 200);
    let injected = Instant::now();
    wait_for("the controller to mark w0 down", async || {
        c.healthy().await == ["w1"]
    })
    .await;
    assert!(
        injected.elapsed() < Duration::from_secs(2),
        "w0 still routed to {:?} after its engine panicked",
        injected.elapsed()
    );
    let health: Value = c
        .http
        .get(format!("{}/health", c.workers[0].url))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(health["status"], "unhealthy", "{health}");

    for i in 0..6 {
        let (status, worker, body) = c.complete(&format!("after {i}")).await;
        assert_eq!(status, 200, "{body}");
        assert_eq!(worker, "w1", "request {i} routed to the failed worker");
        assert_eq!(body["usage"]["completion_tokens"], 4, "{body}");
        assert_eq!(body["choices"][0]["finish_reason"], "length", "{body}");
    }
}
