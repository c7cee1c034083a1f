//! Routing: cache-aware prefix hits against round-robin (and balance),
//! session affinity and pins, requests of one new prefix arriving together
//! (anticipation), and the trace of routed requests.

use std::path::PathBuf;
use std::time::Duration;

use crate::common::wait_for;
use crate::harness::{Cluster, Spec};
use serde_json::json;

/// 8 groups x 8 prompts, each group sharing a 192-token system prompt, sent one
/// prompt of every group in turn; returns the total cached prompt tokens and the
/// requests per worker.
async fn shared_prefix(c: &Cluster) -> (u64, std::collections::HashMap<String, usize>) {
    let mut cached = 0;
    let mut per_worker = std::collections::HashMap::new();
    for q in 0..8u32 {
        for g in 0..8u32 {
            let system: Vec<u32> = (0..192).map(|i| 32 + (g * 31 + i * 7) % 200).collect();
            let mut prompt = system.clone();
            prompt.extend((0..8).map(|i| 40 + (q * 3 + i) % 50));
            let (status, worker, _, body) = c
                .complete(json!({"prompt": prompt, "max_tokens": 2, "temperature": 0}))
                .await;
            assert_eq!(status, 200, "{body}");
            cached += body["usage"]["prompt_tokens_details"]["cached_tokens"]
                .as_u64()
                .unwrap();
            *per_worker.entry(worker).or_insert(0) += 1;
            // Let the controller's next poll see the worker's cache.
            tokio::time::sleep(Duration::from_millis(60)).await;
        }
    }
    (cached, per_worker)
}

#[tokio::test]
async fn cache_aware_doubles_prefix_hits_over_round_robin_and_stays_balanced() {
    // 52 pages of 16 tokens: the prefixes of 3 groups (36 pages) and a request.
    let aware = Cluster::start("cache-aware", "52").await;
    let (aware_hits, per_worker) = shared_prefix(&aware).await;
    let rr = Cluster::start("round-robin", "52").await;
    let (rr_hits, _) = shared_prefix(&rr).await;
    assert!(
        aware_hits >= 2 * rr_hits,
        "cache-aware {aware_hits} vs round-robin {rr_hits} cached tokens"
    );
    let (max, min) = (
        per_worker.values().max().unwrap(),
        per_worker.values().min().unwrap(),
    );
    assert_eq!(per_worker.len(), 3, "{per_worker:?}");
    assert!(max - min <= 8, "balance_abs: {per_worker:?}");
}

#[tokio::test]
async fn sessions_stick_move_on_death_and_pins_are_obeyed() {
    let mut c = Cluster::start("pin,session-affinity,least-loaded", "256").await;
    let turn = json!({"prompt": "turn", "max_tokens": 2, "session": "conv-1"});
    let (_, first, route, _) = c.complete(turn.clone()).await;
    for _ in 0..3 {
        let (status, w, route2, _) = c.complete(turn.clone()).await;
        assert_eq!((status, w.as_str()), (200, first.as_str()));
        assert!(route2.starts_with("session-affinity"), "{route2}");
    }
    assert!(route.starts_with("least-loaded"), "first turn: {route}");
    let idx: usize = first[1..].parse().unwrap();
    c.workers[idx] = None; // kill the session's worker
    let (status, moved, _, body) = c.complete(turn.clone()).await;
    assert_eq!(status, 200, "{body}");
    assert_ne!(moved, first);
    let (_, again, _, _) = c.complete(turn.clone()).await;
    assert_eq!(again, moved, "the session stays on its new worker");

    let alive = (0..3).find(|i| *i != idx).unwrap();
    let (status, w, route, _) = c
        .complete(
            json!({"prompt": "pinned", "max_tokens": 1, "props": {"pin": format!("w{alive}")}}),
        )
        .await;
    assert_eq!((status, w), (200, format!("w{alive}")));
    assert!(route.starts_with("pin"), "{route}");
    let (status, _, _, body) = c
        .complete(json!({"prompt": "pinned", "max_tokens": 1, "props": {"pin": "w9"}}))
        .await;
    assert_eq!(status, 503);
    assert!(
        body["error"]["message"].as_str().unwrap().contains("w9"),
        "{body}"
    );
}

#[tokio::test]
async fn the_controller_records_routed_requests_as_a_trace() {
    let path = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("controller-trace-{}.jsonl", std::process::id()));
    let _ = std::fs::remove_file(&path);
    let config = format!("[server]\ntrace_file = {:?}", path.to_str().unwrap());
    let c = Cluster::start_with(Spec {
        workers: 1,
        cluster_config: &config,
        ..Spec::new("least-loaded")
    })
    .await;
    let prompt: Vec<u32> = (0..530).map(|i| 32 + i % 90).collect();
    let (status, _, _, body) = c
        .complete(json!({"prompt": prompt, "max_tokens": 4, "ignore_eos": true, "props": {"priority": 3}}))
        .await;
    assert_eq!(status, 200, "{body}");
    let r = c
        .http
        .post(format!("{}/v1/completions", c.controller.url))
        .json(&json!({"prompt": [40, 41, 42], "max_tokens": 5, "ignore_eos": true, "stream": true}))
        .send()
        .await
        .unwrap();
    r.text().await.unwrap();
    wait_for("two trace lines", async || {
        std::fs::read_to_string(&path).is_ok_and(|t| t.lines().count() == 2)
    })
    .await;
    let text = std::fs::read_to_string(&path).unwrap();
    let records = pie_workload::trace::read_trace(text.as_bytes()).unwrap();
    assert_eq!(
        (records[0].input_length, records[0].output_length),
        (530, 4)
    );
    assert_eq!(records[0].hash_ids.len(), 2, "512 + 18 tokens");
    assert_eq!(records[0].props.int("priority"), Some(3));
    assert_eq!(
        (records[1].input_length, records[1].output_length),
        (3, 5),
        "a stream without usage: its token chunks"
    );
}

/// Send four requests sharing a new 192-token prefix at once; the workers
/// they landed on.
async fn one_new_prefix_at_once(c: &Cluster) -> std::collections::HashSet<String> {
    let system: Vec<u32> = (0..192).map(|i| 32 + (i * 13) % 200).collect();
    let sends = (0..4u32).map(|q| {
        let mut prompt = system.clone();
        prompt.extend([40 + q, 41, 42]);
        c.complete(json!({"prompt": prompt, "max_tokens": 16, "ignore_eos": true}))
    });
    let mut workers = std::collections::HashSet::new();
    for (status, worker, _, body) in futures_util::future::join_all(sends).await {
        assert_eq!(status, 200, "{body}");
        workers.insert(worker);
    }
    workers
}

#[tokio::test]
async fn requests_of_one_new_prefix_arriving_together_land_on_one_worker() {
    let c = Cluster::start("cache-aware", "512").await;
    let landed = one_new_prefix_at_once(&c).await;
    assert_eq!(
        landed.len(),
        1,
        "anticipated on the first one's worker: {landed:?}"
    );
    let blind = Cluster::start_with(Spec {
        cluster_config: "[cluster.cache-aware]\nanticipate_ms = 0\n",
        ..Spec::new("cache-aware")
    })
    .await;
    let spread = one_new_prefix_at_once(&blind).await;
    assert!(
        spread.len() > 1,
        "without anticipation they look cold: {spread:?}"
    );
}
