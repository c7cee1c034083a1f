//! Workers joining and leaving: self-registration (native ids route back),
//! deregistration on a drain and expiry when silent, and a worker of another
//! model refused.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use crate::common::{wait_for, worker};
use crate::harness::{post_json, Cluster, Spec};
use serde_json::{json, Value};

/// A registered worker that drains deregisters as it exits; one killed
/// without a word expires after `registration_ttl_ms`; either comes back by
/// registering again.
#[tokio::test]
async fn a_drained_worker_deregisters_and_a_silent_one_expires() {
    let c = Cluster::start_with(Spec {
        workers: 1,
        cluster_config: "registration_ttl_ms = 3000",
        ..Spec::new("least-loaded")
    })
    .await;
    let join = |name: &'static str| worker(&["--controller", &c.controller.url, "--name", name]);
    let listed = async |name: &str| {
        c.cluster().await["workers"]
            .as_array()
            .unwrap()
            .iter()
            .any(|w| w["name"] == name && w["healthy"] == true)
    };
    let mut drained = join("drained");
    let silent = join("silent");
    wait_for("both registered", async || {
        listed("drained").await && listed("silent").await
    })
    .await;
    let (status, _) = post_json(&drained.url, "/v1/admin/drain", None, &json!({})).await;
    assert_eq!(status, 202);
    wait_for("the drained worker exits", async || drained.exited()).await;
    // Deregistered at once: well within the 3 s of expiry.
    let started = Instant::now();
    wait_for("deregistered", async || {
        !c.cluster().await["workers"]
            .as_array()
            .unwrap()
            .iter()
            .any(|w| w["name"] == "drained")
    })
    .await;
    assert!(
        started.elapsed() < Duration::from_millis(2500),
        "{:?}",
        started.elapsed()
    );
    drop(silent); // killed: no deregistration
    wait_for("the silent worker expires", async || {
        !c.cluster().await["workers"]
            .as_array()
            .unwrap()
            .iter()
            .any(|w| w["name"] == "silent")
    })
    .await;
    let _back = join("silent");
    wait_for("registered again", async || listed("silent").await).await;
    // Only the key that registered a worker (here: anyone, no keys) may
    // deregister it; an unknown name is a 404.
    let (status, v) = post_json(
        &c.controller.url,
        "/v1/cluster/deregister",
        None,
        &json!({"name": "nobody"}),
    )
    .await;
    assert_eq!(status, 404, "{v}");
}

#[tokio::test]
async fn workers_register_themselves_and_native_ids_route_back() {
    let c = Cluster::start("least-loaded", "256").await;
    let _extra = worker(&[
        "--controller",
        &c.controller.url,
        "--name",
        "late",
        "--group",
        "gold",
    ]);
    wait_for("registration", async || {
        c.cluster().await["workers"]
            .as_array()
            .unwrap()
            .iter()
            .any(|w| w["name"] == "late" && w["healthy"] == true && w["group"] == "gold")
    })
    .await;

    let r: Value = c
        .http
        .post(format!("{}/v1/processes", c.controller.url))
        .json(&json!({"inferlet": "text-completion", "args": {"prompt": "hi", "max_tokens": 3}}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let id = r["id"].as_str().unwrap().to_string();
    assert!(id.contains('~'), "{id}");
    wait_for("process finished", async || {
        let p: Value =
            serde_json::from_str(&c.get_text(&format!("/v1/processes/{id}")).await).unwrap();
        p["state"] == "finished"
    })
    .await;
    let r = c
        .http
        .get(format!("{}/v1/processes/nope", c.controller.url))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 404);
}

#[tokio::test]
async fn a_worker_of_another_model_is_not_admitted_and_both_fingerprints_are_named() {
    let c = Cluster::start_with(Spec {
        workers: 1,
        ..Spec::new("cache-aware")
    })
    .await;
    let other = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!(
        "controller-other-model-{}.gguf",
        std::process::id()
    ));
    pie_model::synth::write_test_model(
        &other,
        &pie_model::synth::SynthSpec {
            seed: 11,
            ..Default::default()
        },
    )
    .unwrap();
    let stranger = worker(&[
        "--model",
        other.to_str().unwrap(),
        "--controller",
        &c.controller.url,
        "--name",
        "stranger",
    ]);
    wait_for("the stranger refused", async || {
        let cluster = c.cluster().await;
        let refused = cluster["workers"]
            .as_array()
            .unwrap()
            .iter()
            .find(|w| w["name"] == "stranger")
            .map(|w| (w["healthy"].clone(), w["refused"].as_str().unwrap_or("").to_string()));
        matches!(refused, Some((healthy, why)) if healthy == false && why.matches("0x").count() == 2)
    })
    .await;
    for _ in 0..4 {
        let (status, worker, _, _) = c
            .complete(json!({"prompt": "hello", "max_tokens": 1}))
            .await;
        assert_eq!((status, worker.as_str()), (200, "w0"));
    }
    drop(stranger);
}
