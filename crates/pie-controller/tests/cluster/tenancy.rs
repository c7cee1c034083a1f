//! Tenancy through the controller: client keys, worker-role keys for
//! registration (the name bound to its key, the number bounded), ownership of
//! processes and per-key limits.

use crate::harness::{
    call_as, error_message, worker_config_trusting_the_controller, Cluster, Spec,
};
use serde_json::{json, Value};

#[tokio::test]
async fn client_keys_guard_the_controller_and_name_the_client_on_workers() {
    let worker_cfg = worker_config_trusting_the_controller("keys");
    let c = Cluster::start_with(Spec {
        workers: 1,
        worker_args: &["--config", worker_cfg.to_str().unwrap()],
        cluster_config: "worker_key = \"sk-ctl\"\n[server]\napi_keys = [{ name = \"alice\", key = \"sk-alice\" }]",
        client_key: Some("sk-alice"),
        ..Spec::new("least-loaded")
    })
    .await;
    let anonymous = reqwest::Client::new();
    let r = anonymous
        .post(format!("{}/v1/completions", c.controller.url))
        .json(&json!({"prompt": "hi", "max_tokens": 1}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 401);
    let body: Value = r.json().await.unwrap();
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("API key"),
        "{body}"
    );
    let health = anonymous
        .get(format!("{}/health", c.controller.url))
        .send()
        .await
        .unwrap();
    assert_eq!(health.status(), 200, "health stays open");

    // Alice's key names her as the client on the worker, even if she claims otherwise.
    let r: Value = c
        .http
        .post(format!("{}/v1/processes", c.controller.url))
        .json(
            &json!({"inferlet": "text-completion", "args": {"prompt": "hi", "max_tokens": 2},
                      "props": {"client": "mallory"}}),
        )
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let id = r["id"].as_str().unwrap().to_string();
    let p: Value = serde_json::from_str(&c.get_text(&format!("/v1/processes/{id}")).await).unwrap();
    assert_eq!(p["client"], "alice", "{p}");
}

#[tokio::test]
async fn registration_needs_a_worker_key_binds_the_name_and_is_bounded() {
    let c = Cluster::start_with(Spec {
        workers: 1,
        cluster_config: "max_registered_workers = 1\n[server]\napi_keys = [\
            { name = \"alice\", key = \"sk-alice\" },\
            { name = \"node1\", key = \"sk-node1\", role = \"worker\" },\
            { name = \"node2\", key = \"sk-node2\", role = \"worker\" }]",
        client_key: Some("sk-alice"),
        ..Spec::new("least-loaded")
    })
    .await;
    let register = |key: &'static str, name: &'static str| {
        let body = json!({"name": name, "url": "http://127.0.0.1:9"});
        call_as(
            &c,
            reqwest::Method::POST,
            "/v1/cluster/register",
            key,
            Some(body),
        )
    };
    let (status, r) = register("sk-alice", "x1").await;
    assert_eq!(status, 403, "a client key cannot register: {r}");
    assert!(error_message(&r).contains("role `worker`"), "{r}");
    assert_eq!(register("sk-node1", "x1").await.0, 200);
    assert_eq!(register("sk-node1", "x1").await.0, 200, "its heartbeat");
    let (status, r) = register("sk-node2", "x1").await;
    assert_eq!(status, 403, "another key cannot re-point x1: {r}");
    assert!(error_message(&r).contains("another key"), "{r}");
    let (status, r) = register("sk-node2", "w0").await;
    assert_eq!(status, 403, "nor a configured worker: {r}");
    let (status, r) = register("sk-node1", "x2").await;
    assert_eq!(status, 403, "past max_registered_workers: {r}");
    assert!(error_message(&r).contains("max_registered_workers"), "{r}");
    let (status, r) = register("sk-node1", "a/b").await;
    assert_eq!(status, 400, "{r}");
    let w0 = c.workers[0].as_ref().unwrap().url.clone();
    let urls: Vec<Value> = c.cluster().await["workers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|w| w["url"].clone())
        .collect();
    assert!(
        urls.iter().all(Value::is_null),
        "a client sees no worker addresses: {urls:?}"
    );
    let (_, full) = call_as(&c, reqwest::Method::GET, "/v1/cluster", "sk-node1", None).await;
    assert_eq!(full["workers"][0]["url"], w0.as_str(), "{full}");
}

#[tokio::test]
async fn ownership_and_limits_hold_through_the_controller() {
    let worker_cfg = worker_config_trusting_the_controller("owner-keys");
    let c = Cluster::start_with(Spec {
        workers: 1,
        worker_args: &["--config", worker_cfg.to_str().unwrap()],
        cluster_config: "worker_key = \"sk-ctl\"\n[server]\napi_keys = [\
            { name = \"alice\", key = \"sk-alice\" },\
            { name = \"bob\", key = \"sk-bob\", limits = { max_priority = 5 } },\
            { name = \"root\", key = \"sk-root\", role = \"admin\" }]",
        client_key: Some("sk-alice"),
        ..Spec::new("least-loaded")
    })
    .await;
    let launch = json!({"inferlet": "text-completion", "args": {"prompt": "hi", "max_tokens": 2}});
    let (status, r) = call_as(
        &c,
        reqwest::Method::POST,
        "/v1/processes",
        "sk-alice",
        Some(launch),
    )
    .await;
    assert_eq!(status, 201, "{r}");
    let id = r["id"].as_str().unwrap().to_string();
    let path = format!("/v1/processes/{id}");
    for method in [reqwest::Method::GET, reqwest::Method::DELETE] {
        let (status, r) = call_as(&c, method.clone(), &path, "sk-bob", None).await;
        assert_eq!(status, 404, "bob {method}: {r}");
    }
    let (status, r) = call_as(
        &c,
        reqwest::Method::GET,
        &format!("{path}/events"),
        "sk-bob",
        None,
    )
    .await;
    assert_eq!(status, 404, "{r}");
    let (status, p) = call_as(&c, reqwest::Method::GET, &path, "sk-root", None).await;
    assert_eq!((status, p["client"].as_str()), (200, Some("alice")), "{p}");
    let (status, p) = call_as(&c, reqwest::Method::GET, &path, "sk-alice", None).await;
    assert_eq!(status, 200, "{p}");
    assert_ne!(p["state"], "killed", "bob's DELETE did nothing: {p}");

    // An id cannot smuggle a path to the worker's internal routes.
    let sneaky = "/v1/processes/w0~..%2F..%2Fv1%2Finternal%2Fstate";
    let (status, r) = call_as(&c, reqwest::Method::GET, sneaky, "sk-bob", None).await;
    assert_eq!(status, 404, "{r}");
    assert!(r["fingerprint"].is_null(), "{r}");

    // Bob's limits apply at the controller: the worker trusts its props.
    let body = json!({"prompt": "hi", "max_tokens": 1, "props": {"priority": 1000000}});
    let (status, r) = call_as(
        &c,
        reqwest::Method::POST,
        "/v1/completions",
        "sk-bob",
        Some(body),
    )
    .await;
    assert_eq!(status, 400, "{r}");
    assert!(error_message(&r).contains("limit of 5"), "{r}");

    // And so do they on a PATCH of bob's running process.
    let long = json!({"inferlet": "text-completion",
        "args": {"prompt": "hi", "max_tokens": 100000}});
    let (status, r) = call_as(
        &c,
        reqwest::Method::POST,
        "/v1/processes",
        "sk-bob",
        Some(long),
    )
    .await;
    assert_eq!(status, 201, "{r}");
    let path = format!("/v1/processes/{}", r["id"].as_str().unwrap());
    let patch = |priority: i64| Some(json!({"props": {"priority": priority}}));
    let (status, r) = call_as(
        &c,
        reqwest::Method::PATCH,
        &path,
        "sk-bob",
        patch(1_000_000),
    )
    .await;
    assert_eq!(status, 400, "{r}");
    assert!(error_message(&r).contains("limit of 5"), "{r}");
    assert_eq!(r["error"]["param"], "props.priority", "{r}");
    let (status, r) = call_as(&c, reqwest::Method::PATCH, &path, "sk-bob", patch(5)).await;
    assert_eq!(status, 200, "{r}");
    assert_eq!(r["props"]["priority"], 5, "{r}");
    call_as(&c, reqwest::Method::DELETE, &path, "sk-bob", None).await;
}
