//! Helpers for tests that run real `pie serve` workers (test model) behind a
//! real `pie-controller` as child processes. Shared by several test binaries,
//! each of which uses a part of it.

#![allow(dead_code)]

use std::path::PathBuf;
use std::time::Duration;

pub use pie_testkit::{spawn, workspace_bin as bin, Proc};

/// The synthesized test model, written once per test binary.
pub fn model() -> PathBuf {
    pie_testkit::test_model(3)
}

/// A `pie serve` on a free port, with the test model unless `extra` names
/// another with `--model`, and `extra`'s flags.
pub fn worker(extra: &[&str]) -> Proc {
    let m = model();
    let mut args = vec!["serve", "--port", "0"];
    if !extra.contains(&"--model") {
        args.extend(["--model", m.to_str().unwrap()]);
    }
    args.extend(extra);
    spawn(&bin("pie"), &args, "pie: listening on ")
}

/// Poll until `f` holds (or panic after 30 s).
pub async fn wait_for(what: &str, f: impl AsyncFnMut() -> bool) {
    pie_testkit::wait_for(what, Duration::from_secs(30), f).await
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
    settled_at_least(controller, kind, 1).await
}

/// The `kind` actions once at least `n` were logged and each was answered
/// (the actors may decide them in different ticks).
pub async fn settled_at_least(controller: &str, kind: &str, n: usize) -> Vec<serde_json::Value> {
    wait_for(&format!("{n} `{kind}` actions answered"), async || {
        let all = actions(controller, kind).await;
        all.len() >= n && all.iter().all(|a| a["outcome"] != "sent")
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
