//! Admission: cluster-priority order and `max_queued`, the fair queue,
//! `max_wait_ms` (503 with `Retry-After`), and a worker's full queue (the
//! request sent on, or the worker's `Retry-After` relayed).

use std::time::Duration;

use crate::common::wait_for;
use crate::harness::{
    call_as, held_through_controller, slow_steps, timed_completion, worker_entry, Cluster,
    FakeWorker, Spec,
};
use serde_json::json;

#[tokio::test]
async fn cluster_priority_admits_high_priority_first_and_bounds_the_queue() {
    let c = Cluster::start_with(Spec {
        worker_args: &["--kv-pages", "512", "--max-running", "1"],
        cluster_config: "max_queued = 4",
        ..Spec::new("cluster-priority,least-loaded")
    })
    .await;
    let mut holds = held_through_controller(&c, 3, json!({})).await;
    let done = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let mut tasks = Vec::new();
    for (i, (name, priority)) in [("low-1", 0), ("low-2", 0), ("high-1", 5), ("high-2", 5)]
        .into_iter()
        .enumerate()
    {
        let (http, url, done) = (c.http.clone(), c.controller.url.clone(), done.clone());
        tasks.push(tokio::spawn(async move {
            let r = http
                .post(format!("{url}/v1/completions"))
                .json(&json!({"prompt": name, "max_tokens": 1, "props": {"priority": priority}}))
                .send()
                .await
                .unwrap();
            assert_eq!(r.status(), 200, "{name}");
            done.lock().unwrap().push(name);
        }));
        // FCFS within a level needs a known arrival order.
        wait_for("queued", async || c.cluster().await["queued"] == i + 1).await;
    }
    let (status, _, _, body) = c
        .complete(json!({"prompt": "one too many", "max_tokens": 1}))
        .await;
    assert_eq!(status, 429, "{body}");
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("max_queued"),
        "{body}"
    );
    assert!(
        done.lock().unwrap().is_empty(),
        "nothing ran while saturated"
    );
    holds.pop(); // one slot frees: the queue drains through it in priority order
    for t in tasks {
        t.await.unwrap();
    }
    // By level: one freed slot can let two of a level in together (the next
    // poll can report another worker free), and two one-token requests
    // admitted together finish in either order.
    let done = done.lock().unwrap().clone();
    fn level<'a>(names: &[&'a str]) -> Vec<&'a str> {
        let mut v = names.to_vec();
        v.sort_unstable();
        v
    }
    assert_eq!(level(&done[..2]), ["high-1", "high-2"], "{done:?}");
    assert_eq!(level(&done[2..]), ["low-1", "low-2"], "{done:?}");
    assert_eq!(c.metric("pie_controller_queue_full_total").await, 1.0);
}

/// Under `queue_order = "fair"` the queue goes by weighted service, not by
/// requests in flight, charged from non-streamed answers, streams and native
/// processes alike: alice, idle now, already had a long answer; bob had a
/// shorter native process and holds both slots. When one frees, bob's waiting request goes before alice's,
/// although bob has a request in flight and alice none (the old rule, fewest
/// in flight first, would pick alice).
#[tokio::test]
async fn a_fair_queue_serves_the_client_with_less_service_first() {
    let c = Cluster::start_with(Spec {
        workers: 1,
        worker_args: &["--kv-pages", "512", "--max-running", "2"],
        cluster_config: "queue_order = \"fair\"\n[server]\napi_keys = [\
            { name = \"alice\", key = \"sk-alice\" }, { name = \"bob\", key = \"sk-bob\" },\
            { name = \"root\", key = \"sk-root\", role = \"admin\" }]",
        client_key: Some("sk-alice"),
        ..Spec::new("cluster-priority,least-loaded")
    })
    .await;
    let cluster = async || {
        call_as(&c, reqwest::Method::GET, "/v1/cluster", "sk-root", None)
            .await
            .1
    };
    let long = json!({"prompt": "alice's long answer", "max_tokens": 1000, "ignore_eos": true});
    let (status, _, _, body) = c.complete(long).await;
    assert_eq!(status, 200, "{body}");
    // Charged when the controller drops the answer, which may be just after
    // the client read it.
    wait_for(
        "1,000 tokens at output_weight 2 and the prompt charged",
        async || cluster().await["client_service"]["counters"]["alice"].as_f64() >= Some(2_000.0),
    )
    .await;
    // A native process counts too: its tokens and its final status's usage.
    let launch = json!({"inferlet": "text-completion",
        "args": {"prompt": "bob's process", "max_tokens": 200, "ignore_eos": true}});
    let (status, v) = call_as(
        &c,
        reqwest::Method::POST,
        "/v1/processes",
        "sk-bob",
        Some(launch),
    )
    .await;
    assert_eq!(status, 201, "{v}");
    let process = format!("/v1/processes/{}", v["id"].as_str().unwrap());
    wait_for("bob's process charged", async || {
        let (_, p) = call_as(&c, reqwest::Method::GET, &process, "sk-bob", None).await;
        let bob = cluster().await["client_service"]["counters"]["bob"].as_f64();
        p["state"] == "finished" && bob >= Some(400.0)
    })
    .await;
    let mut holds = Vec::new();
    for _ in 0..2 {
        holds.extend(held_as(&c, "sk-bob").await);
    }
    let done = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let mut tasks = Vec::new();
    for (i, (name, key)) in [("alice-1", "sk-alice"), ("bob-1", "sk-bob")]
        .into_iter()
        .enumerate()
    {
        let (http, url, done) = (c.http.clone(), c.controller.url.clone(), done.clone());
        tasks.push(tokio::spawn(async move {
            let r = http
                .post(format!("{url}/v1/completions"))
                .bearer_auth(key)
                .json(&json!({"prompt": name, "max_tokens": 1}))
                .send()
                .await
                .unwrap();
            assert_eq!(r.status(), 200, "{name}");
            done.lock().unwrap().push(name);
        }));
        wait_for("queued", async || cluster().await["queued"] == i + 1).await;
    }
    holds.pop();
    tasks.remove(1).await.unwrap();
    assert_eq!(*done.lock().unwrap(), ["bob-1"], "bob's first, by service");
    holds.clear();
    tasks.remove(0).await.unwrap();
    let counters = cluster().await["client_service"]["counters"].clone();
    assert!(
        counters["bob"].as_f64() < counters["alice"].as_f64(),
        "{counters}"
    );
}

#[tokio::test]
async fn a_request_waits_for_a_slot_at_most_max_wait_ms_then_gets_503_with_retry_after() {
    let full = FakeWorker::start(&[0], true).await;
    let config = format!("max_wait_ms = 800\n{}", full.config("full"));
    let c = Cluster::start_with(Spec {
        workers: 0,
        cluster_config: &config,
        ..Spec::new("cluster-priority,least-loaded")
    })
    .await;
    for (case, prompt) in [("every worker full", "full"), ("every worker down", "down")] {
        if prompt == "down" {
            full.engine_dead
                .store(true, std::sync::atomic::Ordering::SeqCst);
            wait_for("the worker is down", async || {
                worker_entry(&c, "full").await["healthy"] == false
            })
            .await;
        }
        let (status, retry_after, body, took) = timed_completion(&c, prompt).await;
        assert_eq!((status, retry_after.as_str()), (503, "1"), "{case}: {body}");
        let message = body["error"]["message"].as_str().unwrap();
        assert!(message.contains("max_wait_ms = 800"), "{case}: {message}");
        assert!(
            took >= Duration::from_millis(800) && took < Duration::from_secs(5),
            "{case}: {took:?}"
        );
        assert_eq!(c.cluster().await["queued"], 0, "{case}: the waiter left");
    }
    assert_eq!(c.metric("pie_controller_wait_timeouts_total").await, 2.0);
}

#[tokio::test]
async fn a_workers_full_queue_sends_the_request_on_and_its_retry_after_reaches_the_client() {
    let full = FakeWorker::start(&[0], false).await;
    let beside = Cluster::start_with(Spec {
        workers: 1,
        cluster_config: &full.config("full"),
        ..Spec::new("pin,round-robin")
    })
    .await;
    let pinned = json!({"prompt": "queue-full", "max_tokens": 2, "props": {"pin": "full"}});
    let (status, worker, _, body) = beside.complete(pinned.clone()).await;
    assert_eq!((status, worker.as_str()), (200, "w0"), "{body}");

    let alone = Cluster::start_with(Spec {
        workers: 0,
        cluster_config: &full.config("full"),
        ..Spec::new("round-robin")
    })
    .await;
    let r = alone
        .http
        .post(format!("{}/v1/completions", alone.controller.url))
        .json(&pinned)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 429);
    assert_eq!(
        r.headers()["retry-after"],
        "7",
        "the worker's Retry-After is relayed"
    );
}

/// One stream held open through the controller as the client of `key` (the
/// workers' steps slowed so it runs for seconds).
async fn held_as(c: &Cluster, key: &str) -> Option<reqwest::Response> {
    slow_steps(c, 20).await;
    let r = c
        .http
        .post(format!("{}/v1/completions", c.controller.url))
        .bearer_auth(key)
        .json(&json!({"prompt": "hold", "max_tokens": 1000, "ignore_eos": true, "stream": true}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let mut r = r;
    r.chunk().await.unwrap().expect("first chunk");
    Some(r)
}
