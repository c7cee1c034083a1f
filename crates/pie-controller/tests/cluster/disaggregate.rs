//! Disaggregated prefill: long prompts prefilled on the prefill worker and
//! decoded on another with one worker's output; the threshold; a client
//! cannot name a prefill worker; the threshold reloaded on SIGHUP.

use crate::common::{wait_for, worker};
use crate::harness::{Cluster, Spec};
use serde_json::{json, Value};

/// The greedy completion of `prompt` by one worker alone.
async fn alone(prompt: &[u32]) -> String {
    let w = worker(&[]);
    let http = reqwest::Client::new();
    wait_for("the worker loaded", async || {
        let health = http.get(format!("{}/health", w.url)).send().await;
        health.is_ok_and(|r| r.status() == 200)
    })
    .await;
    let body: Value = http
        .post(format!("{}/v1/completions", w.url))
        .json(&json!({"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": true}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    body["choices"][0]["text"].as_str().unwrap().to_string()
}

#[tokio::test]
async fn disaggregate_prefills_long_prompts_remotely_with_one_workers_output_and_reloads() {
    let c = Cluster::start_with(Spec {
        workers: 2,
        stages: &["prefill", "decode"],
        cluster_config: "[cluster.disaggregate]\nmin_remote_prefill_tokens = 64\n",
        ..Spec::new("disaggregate,cache-aware")
    })
    .await;
    wait_for("stages seen", async || {
        c.cluster().await["workers"][0]["stage"] == "prefill"
    })
    .await;
    let long: Vec<u32> = (0..200).map(|i| 32 + (i * 7) % 200).collect();
    let body = json!({"prompt": long, "max_tokens": 8, "temperature": 0, "ignore_eos": true});
    let (status, worker, route, resp) = c.complete(body.clone()).await;
    assert_eq!((status, worker.as_str()), (200, "w1"), "{resp}");
    assert!(
        route.starts_with("disaggregate: prefill on w0 (200 uncached tokens), decode on w1"),
        "{route}"
    );
    assert_eq!(resp["choices"][0]["text"], alone(&long).await.as_str());
    assert!(
        resp["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap()
            >= 176,
        "the decode worker used the pulled pages: {resp}"
    );

    let (status, worker, route, _) = c
        .complete(json!({"prompt": vec![9u32; 20], "max_tokens": 2}))
        .await;
    assert_eq!((status, worker.as_str()), (200, "w1"));
    assert!(
        route.starts_with("disaggregate: prefill stays on w1 (20 uncached tokens < 64)"),
        "{route}"
    );

    let mut own = body.clone();
    own["pie_prefill_from"] = json!(c.controller.url);
    let (status, _, _, resp) = c.complete(own).await;
    assert_eq!(status, 400, "a client cannot name a prefill worker: {resp}");

    let text = std::fs::read_to_string(&c.config).unwrap();
    std::fs::write(
        &c.config,
        text.replace(
            "min_remote_prefill_tokens = 64",
            "min_remote_prefill_tokens = 100000",
        ),
    )
    .unwrap();
    let hup = std::process::Command::new("kill")
        .args(["-HUP", &c.controller.pid().to_string()])
        .status()
        .unwrap();
    assert!(hup.success());
    let other: Vec<u32> = (0..200).map(|i| 40 + (i * 11) % 190).collect();
    wait_for("the threshold reloaded", async || {
        let (_, _, route, _) = c.complete(json!({"prompt": other, "max_tokens": 1})).await;
        route.contains("< 100000")
    })
    .await;
}
