//! `persist-prefix` on a worker: pages written to `[runtime.persist] dir`
//! survive `kill -9`, come back as `cached_tokens` with the same greedy
//! output, and a damaged, foreign, truncated or torn file is never used (it is
//! deleted, counted and recomputed); a budget of 0 writes nothing; persisted
//! pages are deleted by prefix, by age and after `ttl_ms`.

mod common;

use std::path::{Path, PathBuf};
use std::time::Duration;

use common::Server;
use pie_core::hash::chain_from;
use pie_core::ModelFingerprint;
use pie_model::synth::{write_test_model, SynthSpec};
use serde_json::{json, Value};

const PAGE: usize = 16;

fn scratch(name: &str) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("persist-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

fn config(dir: &Path, extra: &str) -> String {
    format!(
        "[runtime.persist]\ndir = {:?}\n{extra}",
        dir.display().to_string()
    )
}

fn prompt(len: usize, seed: u32) -> Vec<u32> {
    (0..len as u32)
        .map(|i| (i * 7 + seed * 31) % 240 + 3)
        .collect()
}

/// A greedy completion: (its token ids as text, cached prompt tokens).
async fn complete(s: &Server, tokens: &[u32], props: Value) -> (String, u64) {
    let (status, v) = s
        .post(
            "/v1/completions",
            json!({"prompt": tokens, "max_tokens": 12, "temperature": 0, "ignore_eos": true, "props": props}),
        )
        .await;
    assert_eq!(status, 200, "{v}");
    let cached = v["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap_or(0);
    (
        v["choices"][0]["text"].as_str().unwrap().to_string(),
        cached,
    )
}

async fn persist(s: &Server, tokens: &[u32]) -> (u16, Value) {
    s.post("/v1/internal/kv/persist", json!({ "tokens": tokens }))
        .await
}

async fn persist_events(s: &Server, event: &str) -> f64 {
    let text = s.metrics_text().await;
    pie_testkit::metric_value(
        &text,
        &format!("pie_kv_persist_pages_total{{event=\"{event}\"}}"),
    )
}

/// The format directory the worker writes and the block hashes of `tokens`.
async fn pages_of(s: &Server, root: &Path, tokens: &[u32]) -> (PathBuf, Vec<PathBuf>) {
    let (_, state) = s.get("/v1/internal/state").await;
    let fp = state["fingerprint"].as_u64().unwrap();
    let dir = std::fs::read_dir(root)
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| {
            p.file_name()
                .unwrap()
                .to_string_lossy()
                .starts_with(&format!("{fp:016x}"))
        })
        .expect("the format's directory");
    let chain = chain_from(ModelFingerprint(fp).salted_root(None), tokens, PAGE);
    let files = chain
        .iter()
        .map(|h| dir.join(format!("{:016x}.kvpage", h.0)))
        .collect();
    (dir, files)
}

#[tokio::test]
async fn persisted_pages_survive_kill_9_with_the_same_output() {
    let root = scratch("restart");
    let cfg = config(&root, "");
    let p = prompt(200, 1);
    let mut s = Server::start(&cfg, &[]).await;
    let (first, cached) = complete(&s, &p, json!({"persist": true})).await;
    assert_eq!(cached, 0);
    s.eventually("the prompt's 12 pages written", async || {
        persist_events(&s, "written").await >= 12.0
    })
    .await;
    let (_, files) = pages_of(&s, &root, &p).await;
    assert!(files.iter().all(|f| f.exists()), "one file per full page");
    s.kill();
    let s = Server::start(&cfg, &[]).await;
    assert_eq!(
        pie_testkit::metric_value(&s.metrics_text().await, "pie_kv_persisted_pages"),
        12.0
    );
    let (again, cached) = complete(&s, &p, json!({})).await;
    assert_eq!(again, first, "identical greedy output from persisted pages");
    assert!(cached >= 180, "cached_tokens {cached} of 200");
    assert_eq!(persist_events(&s, "loaded").await, 12.0);
    // The KV events count them as held, and name the disk tier.
    let resp = s
        .client
        .get(s.url("/v1/internal/kv-events"))
        .send()
        .await
        .unwrap();
    let snapshot = first_event(resp).await;
    assert_eq!(snapshot["persisted"].as_array().unwrap().len(), 12);
    assert!(snapshot["hashes"].as_array().unwrap().len() >= 12);
    std::fs::remove_dir_all(root).unwrap();
}

/// Kill -9 during writes, then damage files in every way we know: each
/// damaged page is refused (counted, deleted, recomputed) and outputs stay
/// those of an undamaged run.
#[tokio::test]
async fn damaged_torn_and_foreign_pages_are_never_used() {
    let root = scratch("damage");
    let cfg = config(&root, "");
    let prompts: Vec<Vec<u32>> = (0..4).map(|i| prompt(160, i + 10)).collect();
    let mut s = Server::start(&cfg, &[]).await;
    let mut want = Vec::new();
    for p in &prompts {
        want.push(complete(&s, p, json!({})).await.0);
        let (status, v) = persist(&s, p).await;
        assert_eq!(status, 200, "{v}");
        assert_eq!(v["written"], 10, "{v}");
    }
    // Kill -9 while a long prefix is being written, three times over.
    for round in 0..3u64 {
        let long = prompt(900, 100 + round as u32);
        complete(&s, &long, json!({})).await;
        let writer = {
            let (client, url) = (s.client.clone(), s.url("/v1/internal/kv/persist"));
            tokio::spawn(
                async move { client.post(url).json(&json!({"tokens": long})).send().await },
            )
        };
        tokio::time::sleep(Duration::from_millis(5 + round * 7)).await;
        s.kill();
        let _ = writer.await;
        s = Server::start(&cfg, &[]).await;
    }
    let (dir, a) = pages_of(&s, &root, &prompts[0]).await;
    let (_, b) = pages_of(&s, &root, &prompts[1]).await;
    let (_, c) = pages_of(&s, &root, &prompts[2]).await;
    let (_, d) = pages_of(&s, &root, &prompts[3]).await;
    let mut flipped = std::fs::read(&a[4]).unwrap();
    flipped[1000] ^= 0x10;
    std::fs::write(&a[4], flipped).unwrap();
    let whole = std::fs::read(&b[2]).unwrap();
    std::fs::write(&b[2], &whole[..whole.len() / 2]).unwrap();
    std::fs::copy(&a[0], &c[6]).unwrap();
    // A page of another model, under the name of one of ours.
    let other_model = scratch("other-model").with_extension("gguf");
    write_test_model(
        &other_model,
        &SynthSpec {
            seed: 3,
            ..SynthSpec::default()
        },
    )
    .unwrap();
    let other_root = scratch("other-root");
    let mut other = Server::start_model(&other_model, &config(&other_root, ""), &[]).await;
    complete(&other, &prompts[3], json!({})).await;
    assert_eq!(persist(&other, &prompts[3]).await.0, 200);
    let (_, foreign) = pages_of(&other, &other_root, &prompts[3]).await;
    other.kill();
    std::fs::copy(&foreign[0], &d[0]).unwrap();
    std::fs::write(dir.join(".00000000000000aa.1.tmp"), b"torn").unwrap();
    s.kill();

    let s = Server::start(&cfg, &[]).await;
    assert!(
        !dir.join(".00000000000000aa.1.tmp").exists(),
        "torn writes are deleted at start"
    );
    let cached_want = [4 * PAGE as u64, 2 * PAGE as u64, 6 * PAGE as u64, 0];
    for (i, p) in prompts.iter().enumerate() {
        let (text, cached) = complete(&s, p, json!({})).await;
        assert_eq!(text, want[i], "prompt {i}: the output of an undamaged run");
        assert_eq!(
            cached, cached_want[i],
            "prompt {i}: pages up to the damaged one"
        );
    }
    assert_eq!(persist_events(&s, "refused").await, 4.0);
    for f in [&a[4], &b[2], &c[6], &d[0]] {
        assert!(!f.exists(), "{} deleted", f.display());
    }
    std::fs::remove_dir_all(root).unwrap();
    std::fs::remove_dir_all(other_root).unwrap();
}

#[tokio::test]
async fn no_dir_no_pool_or_a_zero_budget_persists_nothing_and_says_so() {
    let p = prompt(64, 5);
    let plain = Server::start("", &[]).await;
    let (want, _) = complete(&plain, &p, json!({"persist": true})).await;
    let (status, v) = persist(&plain, &p).await;
    assert_eq!(status, 409, "{v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("[runtime.persist] dir"),
        "{v}"
    );

    let root = scratch("zero");
    let s = Server::start(&config(&root, "budget = 0\n"), &[]).await;
    let (text, _) = complete(&s, &p, json!({})).await;
    assert_eq!(text, want);
    let (status, v) = persist(&s, &p).await;
    assert_eq!(status, 507, "{v}");
    assert!(
        v["error"]["message"].as_str().unwrap().contains("budget"),
        "{v}"
    );
    assert_eq!(persist_events(&s, "written").await, 0.0);
    assert_eq!(complete(&s, &p, json!({})).await.0, want);
    let (status, v) = s
        .post(
            "/v1/internal/kv/persist",
            json!({"tokens": p, "to": "pool"}),
        )
        .await;
    assert_eq!(status, 409, "a disk but no pool: {v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("[runtime] pool"),
        "{v}"
    );
    let (status, v) = plain
        .post(
            "/v1/internal/kv/persist",
            json!({"tokens": p, "to": "disk"}),
        )
        .await;
    assert_eq!(status, 409, "{v}");
    let (status, v) = plain
        .post(
            "/v1/internal/kv/persist",
            json!({"tokens": p, "to": "tape"}),
        )
        .await;
    assert_eq!(status, 422, "an unknown `to` names the field: {v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("unknown variant `tape`"),
        "{v}"
    );
    std::fs::remove_dir_all(root).unwrap();
}

#[tokio::test]
async fn persisted_pages_are_deleted_by_prefix_by_age_and_by_ttl() {
    let root = scratch("forget");
    let s = Server::start(&config(&root, ""), &[]).await;
    let (a, b) = (prompt(64, 7), prompt(96, 8));
    for p in [&a, &b] {
        complete(&s, p, json!({})).await;
        assert_eq!(persist(&s, p).await.0, 200);
    }
    let gauge =
        async || pie_testkit::metric_value(&s.metrics_text().await, "pie_kv_persisted_pages");
    assert_eq!(gauge().await, 10.0);
    let (status, v) = s
        .post("/v1/admin/kv/persisted/delete", json!({"tokens": a}))
        .await;
    assert_eq!((status, v["deleted"].as_u64()), (200, Some(4)), "{v}");
    let (status, v) = s
        .post(
            "/v1/admin/kv/persisted/delete",
            json!({"older_than_ms": 3_600_000}),
        )
        .await;
    assert_eq!(
        (status, v["deleted"].as_u64()),
        (200, Some(0)),
        "nothing is that old: {v}"
    );
    let (status, v) = s
        .post("/v1/admin/kv/persisted/delete", json!({"older_than_ms": 0}))
        .await;
    assert_eq!((status, v["deleted"].as_u64()), (200, Some(6)), "{v}");
    assert_eq!(gauge().await, 0.0);
    let (status, v) = s.post("/v1/admin/kv/persisted/delete", json!({})).await;
    assert_eq!(status, 400, "{v}");
    drop(s);

    let root = scratch("ttl");
    let s = Server::start(&config(&root, "ttl_ms = 300\n"), &[]).await;
    complete(&s, &a, json!({})).await;
    assert_eq!(persist(&s, &a).await.1["written"], 4);
    s.eventually("pages expire after ttl_ms", async || {
        persist_events(&s, "expired").await == 4.0
    })
    .await;
    assert_eq!(
        pie_testkit::metric_value(&s.metrics_text().await, "pie_kv_persisted_pages"),
        0.0
    );
    std::fs::remove_dir_all(root).unwrap();
}

/// The first `data:` of an endless SSE stream, as JSON.
async fn first_event(mut resp: reqwest::Response) -> Value {
    let mut buf = String::new();
    loop {
        let chunk = resp
            .chunk()
            .await
            .unwrap()
            .expect("an event before the end");
        buf.push_str(&String::from_utf8_lossy(&chunk));
        if let Some(end) = buf.find("\n\n") {
            let data = buf[..end]
                .lines()
                .find_map(|l| l.strip_prefix("data:"))
                .expect("a data line");
            return serde_json::from_str(data.trim()).unwrap();
        }
    }
}

/// A sequence whose prompt's pages came from disk, preempted by a
/// higher-priority one whose pages evict them, loads them from disk again
/// before it runs on: the disk-read counter rises a second time, and the
/// prompt tokens computed are the other sequence's (A's last partial page at
/// most), not A's prompt again.
#[tokio::test]
async fn a_sequence_preempted_after_a_disk_load_loads_its_pages_again() {
    let root = scratch("preempted");
    let cfg = config(&root, "");
    let p = prompt(128, 2);
    let mut s = Server::start(&cfg, &[]).await;
    complete(&s, &p, json!({"persist": true})).await;
    s.eventually("the prompt's pages written", async || {
        persist_events(&s, "written").await >= 7.0
    })
    .await;
    s.kill();
    let s = Server::start(&cfg, &["--worker-policy", "priority", "--kv-pages", "16"]).await;
    let slow = json!({"fault": "slow-steps", "delay_ms": 20});
    let (status, v) = s.post("/v1/admin/fault", slow).await;
    assert_eq!(status, 200, "{v}");
    let body = json!({"prompt": p, "max_tokens": 40, "temperature": 0, "ignore_eos": true,
        "stream": true, "pie_stream_ids": true});
    let (first, a) = common::read_stream(s.stream(body).await, Some(1)).await;
    let loaded = persist_events(&s, "loaded").await;
    assert!(loaded >= 7.0, "the prompt's pages came from disk: {loaded}");
    let computed = s.metric("pie_prompt_tokens_total").await;
    // 200 tokens need 13 of the 16 pages: A (9 pages) is preempted and its
    // cached prompt pages are evicted.
    let urgent = json!({"prompt": prompt(200, 9), "max_tokens": 2, "ignore_eos": true,
        "props": {"priority": 10}});
    let (status, v) = s.post("/v1/completions", urgent).await;
    assert_eq!(status, 200, "{v}");
    let (rest, _) = common::read_stream(a, None).await;
    assert_eq!(first.tokens.len() + rest.tokens.len(), 40);
    assert!(s.metric("pie_preemptions_total").await >= 1.0);
    let reloaded = persist_events(&s, "loaded").await - loaded;
    assert!(
        reloaded >= 1.0,
        "A's evicted pages loaded again: {reloaded}"
    );
    let recomputed = s.metric("pie_prompt_tokens_total").await - computed - 200.0;
    assert!(
        recomputed <= PAGE as f64,
        "{recomputed} of A's prompt tokens computed again"
    );
    std::fs::remove_dir_all(root).unwrap();
}
