//! KV events: those lost while disconnected repaired by the snapshot on
//! reconnect, and a half-open event stream resubscribed.

use std::time::{Duration, Instant};

use crate::common::wait_for;
use crate::harness::{worker_entry, Cluster, FakeWorker, Spec};
use serde_json::json;

/// The number in a route reason like `cache-aware: 96/120 prefix tokens on w0`.
fn cached_in_reason(route: &str) -> usize {
    route
        .split_once(": ")
        .and_then(|(_, r)| r.split('/').next())
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or(0)
}

#[tokio::test]
async fn kv_events_lost_while_disconnected_are_repaired_by_the_snapshot_on_reconnect() {
    let c = Cluster::start_with(Spec {
        workers: 1,
        relayed: true,
        ..Spec::new("cache-aware")
    })
    .await;
    let worker_url = c.workers[0].as_ref().unwrap().url.clone();
    let prompt_a: Vec<u32> = (0..97).map(|i| 32 + i % 90).collect();
    let prompt_b: Vec<u32> = (0..97).map(|i| 40 + (i * 7) % 90).collect();
    let (status, _, _, _) = c
        .complete(json!({"prompt": prompt_a, "max_tokens": 1}))
        .await;
    assert_eq!(status, 200);
    wait_for("prompt A indexed from events", async || {
        c.cluster().await["workers"][0]["indexed_blocks"].as_u64() >= Some(6)
    })
    .await;

    c.relays[0].set_cut(true);
    wait_for("the controller sees the worker down", async || {
        c.cluster().await["workers"][0]["healthy"] == false
    })
    .await;
    // The worker caches prompt B while the controller cannot hear it: those
    // events are lost to the controller.
    let r = c
        .http
        .post(format!("{worker_url}/v1/completions"))
        .json(&json!({"prompt": prompt_b, "max_tokens": 1}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let (_, _, before, _) = c
        .complete(json!({"prompt": prompt_b, "max_tokens": 1}))
        .await;
    assert!(before.is_empty(), "no healthy worker while cut: {before}");

    c.relays[0].set_cut(false);
    wait_for("resubscribed with a fresh snapshot", async || {
        c.metric("pie_controller_kv_snapshots_total").await == 2.0
            && c.cluster().await["workers"][0]["healthy"] == true
    })
    .await;
    let (status, _, route, _) = c
        .complete(json!({"prompt": prompt_b, "max_tokens": 1}))
        .await;
    assert_eq!(status, 200);
    assert_eq!(
        cached_in_reason(&route),
        96,
        "prompt B's 6 pages are known from the snapshot: {route}"
    );
}

#[tokio::test]
async fn a_half_open_kv_stream_is_resubscribed_and_the_index_catches_up() {
    // The first subscription sends 2 blocks and falls silent; the second, 5.
    let fake = FakeWorker::start(&[2, 5], false).await;
    let config = format!("kv_idle_timeout_ms = 500\n{}", fake.config("fake"));
    let c = Cluster::start_with(Spec {
        workers: 0,
        cluster_config: &config,
        ..Spec::new("round-robin")
    })
    .await;
    wait_for("the first snapshot", async || {
        worker_entry(&c, "fake").await["indexed_blocks"] == 2
    })
    .await;
    let silent_since = Instant::now();
    wait_for("resubscribed with a fresh snapshot", async || {
        worker_entry(&c, "fake").await["indexed_blocks"] == 5
    })
    .await;
    assert!(silent_since.elapsed() >= Duration::from_millis(400));
    assert_eq!(c.metric("pie_controller_kv_snapshots_total").await, 2.0);
}
