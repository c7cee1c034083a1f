//! `pie-pool` with real workers (test model): a prefix first computed on one
//! worker serves another through the pool, also after the pool restarts from
//! its disk tier; a pool that is down costs a local prefill, never a request.
//! (The pool alone: `crates/pie-pool/tests/api.rs`.)

mod common;

use std::path::PathBuf;

use common::{bin, model, spawn, wait_for, Proc};
use serde_json::{json, Value};

fn scratch(name: &str) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("pool-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

fn pool(args: &[&str]) -> Proc {
    let mut all = vec!["--port", "0"];
    all.extend(args);
    spawn(&bin("pie-pool"), &all, "pie-pool: listening on ")
}

/// A worker whose `[runtime] pool` is `pool_url`.
async fn worker(tag: &str, pool_url: &str) -> Proc {
    let cfg = scratch(tag).with_extension("toml");
    std::fs::write(&cfg, format!("[runtime]\npool = {pool_url:?}\n")).unwrap();
    let m = model();
    let w = spawn(
        &bin("pie"),
        &[
            "serve",
            "--port",
            "0",
            "--model",
            m.to_str().unwrap(),
            "--config",
            cfg.to_str().unwrap(),
        ],
        "pie: listening on ",
    );
    wait_for("the worker healthy", async || {
        reqwest::get(format!("{}/health", w.url))
            .await
            .is_ok_and(|r| r.status() == 200)
    })
    .await;
    w
}

fn prompt() -> Vec<u32> {
    (0..160u32).map(|i| (i * 11) % 230 + 5).collect()
}

/// A greedy completion on `w`: (text, cached prompt tokens).
async fn complete(w: &Proc, props: Value) -> (String, u64) {
    let v: Value = reqwest::Client::new()
        .post(format!("{}/v1/completions", w.url))
        .json(
            &json!({"prompt": prompt(), "max_tokens": 12, "temperature": 0,
            "ignore_eos": true, "props": props}),
        )
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let text = v["choices"][0]["text"]
        .as_str()
        .unwrap_or_else(|| panic!("{v}"));
    let cached = v["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap_or(0);
    (text.to_string(), cached)
}

async fn metric(url: &str, name: &str) -> f64 {
    let text = reqwest::get(format!("{url}/metrics"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
        .unwrap_or(0.0)
}

async fn pool_pages(p: &Proc) -> u64 {
    let v: Value = reqwest::get(format!("{}/health", p.url))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    v["pages"].as_u64().unwrap()
}

#[tokio::test]
async fn a_prefix_computed_on_one_worker_serves_another_through_the_pool_even_after_a_restart() {
    let disk = scratch("disk");
    let p = pool(&["--dir", disk.to_str().unwrap()]);
    let a = worker("a", &p.url).await;
    let (want, cached) = complete(&a, json!({"persist": true})).await;
    assert_eq!(cached, 0);
    wait_for("the prompt's 10 pages in the pool", async || {
        pool_pages(&p).await >= 10
    })
    .await;

    let b = worker("b", &p.url).await;
    let (got, cached) = complete(&b, json!({})).await;
    assert_eq!(got, want, "the output of the worker that computed it");
    assert!(cached >= 144, "cached_tokens {cached} of 160");
    assert_eq!(
        metric(&b.url, "pie_kv_transfer_pages_total{direction=\"in\"}").await,
        10.0
    );
    assert!(metric(&p.url, "pie_pool_memory_hits_total").await >= 10.0);

    drop(p);
    let p = pool(&["--dir", disk.to_str().unwrap()]);
    assert_eq!(pool_pages(&p).await, 0, "memory starts empty");
    let c = worker("c", &p.url).await;
    let (got, cached) = complete(&c, json!({})).await;
    assert_eq!(got, want);
    assert!(cached >= 144, "from the disk tier: cached_tokens {cached}");
    assert_eq!(metric(&p.url, "pie_pool_disk_hits_total").await, 10.0);
    std::fs::remove_dir_all(disk).unwrap();
}

#[tokio::test]
async fn a_pool_that_is_down_costs_a_local_prefill_never_a_request() {
    let p = pool(&[]);
    let w = worker("down", &p.url).await;
    let (want, _) = complete(&w, json!({})).await;
    drop(p);
    let fresh = prompt().iter().map(|t| t + 1).collect::<Vec<u32>>();
    let r = reqwest::Client::new()
        .post(format!("{}/v1/completions", w.url))
        .json(&json!({"prompt": fresh, "max_tokens": 4, "props": {"persist": true}}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200, "served by a local prefill");
    assert!(metric(&w.url, "pie_kv_transfer_fallbacks_total").await >= 1.0);
    let r = reqwest::Client::new()
        .post(format!("{}/v1/internal/kv/persist", w.url))
        .json(&json!({"tokens": prompt()}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 502, "persisting to a pool that is down says so");
    let v: Value = r.json().await.unwrap();
    assert!(
        v["error"]["message"].as_str().unwrap().contains("pool"),
        "{v}"
    );
    assert_eq!(complete(&w, json!({})).await.0, want);
}
