//! Strangers' programs on one worker (the tiny test model): time limits on
//! guests that wait forever, per-key overrides, messages bounded in bytes,
//! and per-key shares of the queue and the instances, so that one tenant
//! using all it may never locks another out.

mod common;

use common::guests::{config, error_of, launch, message, store_dir, upload, upload_as};
use common::Server;
use reqwest::Method;
use serde_json::{json, Value};

const TENANTS: &str = r#"[server]
max_queued = 8
api_keys = [
  { name = "alice", key = "sk-alice", limits = { max_wall_ms = 60000 } },
  { name = "bob", key = "sk-bob" },
  { name = "root", key = "sk-root", role = "admin" },
]
"#;

async fn launch_as(s: &Server, key: &str, inferlet: &str, args: Value) -> (u16, Value) {
    let body = json!({"inferlet": inferlet, "args": args});
    s.call(Method::POST, "/v1/processes", key, Some(body), &[])
        .await
}

/// Guests blocked in `receive` or `sleep` with nothing arriving fail past
/// `max_idle_ms`, naming it, and their instance serves the next launch.
#[tokio::test]
async fn guests_that_wait_forever_fail_past_max_idle_ms() {
    let limits = "max_idle_ms = 500\nmax_instances = 1";
    let s = Server::start(&config(&store_dir(), "", limits), &[]).await;
    upload(&s, "echo", "echo").await;
    upload(&s, "sleeper", "sleeper").await;
    let receiving = launch(&s, "echo", json!({}), json!({})).await;
    let done = s.wait_done(&receiving).await;
    assert_eq!(done["state"], "failed", "{done}");
    assert!(error_of(&done).contains("`receive`"), "{done}");
    assert!(error_of(&done).contains("max_idle_ms"), "{done}");
    let sleeping = launch(&s, "sleeper", json!({"ms": u64::MAX}), json!({})).await;
    let done = s.wait_done(&sleeping).await;
    assert!(error_of(&done).contains("`sleep`"), "{done}");
    let short = launch(&s, "sleeper", json!({"ms": 100}), json!({})).await;
    let done = s.wait_done(&short).await;
    assert_eq!(
        done["output"], "woke",
        "a wait within the limit is fine: {done}"
    );
}

/// `max_wall_ms` bounds a process's life, and a key's own limit replaces
/// the worker's.
#[tokio::test]
async fn max_wall_ms_bounds_a_life_and_a_key_may_have_its_own() {
    let cfg = format!(
        "{TENANTS}{}",
        config(&store_dir(), "", "max_wall_ms = 1000")
    );
    let s = Server::start(&cfg, &[]).await;
    assert_eq!(
        upload_as(&s, Some("sk-root"), "sleeper", "sleeper").await.0,
        201
    );
    let (_, bob) = launch_as(&s, "sk-bob", "sleeper", json!({"ms": 3000})).await;
    let (_, alice) = launch_as(&s, "sk-alice", "sleeper", json!({"ms": 1500})).await;
    let bob = s.wait_done_as("sk-bob", bob["id"].as_str().unwrap()).await;
    assert_eq!(bob["state"], "failed", "{bob}");
    assert!(error_of(&bob).contains("max_wall_ms"), "{bob}");
    let alice = s
        .wait_done_as("sk-alice", alice["id"].as_str().unwrap())
        .await;
    assert_eq!(alice["output"], "woke", "alice's key allows 60 s: {alice}");
}

/// Under the default limits an agent waits 30 s for a tool: in `sleep`, and
/// in `receive` for a result that comes as a message.
#[tokio::test]
async fn the_defaults_let_an_agent_wait_30_s_for_a_tool() {
    let s = Server::start(&config(&store_dir(), "", ""), &[]).await;
    upload(&s, "echo", "echo").await;
    upload(&s, "sleeper", "sleeper").await;
    let sleeping = launch(&s, "sleeper", json!({"ms": 30_000}), json!({})).await;
    let receiving = launch(&s, "echo", json!({}), json!({})).await;
    tokio::time::sleep(std::time::Duration::from_secs(30)).await;
    assert_eq!(message(&s, &receiving, "tool result").await.0, 200);
    assert_eq!(message(&s, &receiving, "quit").await.0, 200);
    let done = s.wait_done(&receiving).await;
    assert_eq!(done["output"], "echo: tool result\n", "{done}");
    assert_eq!(s.wait_done(&sleeping).await["output"], "woke");
}

/// Messages waiting for a process are bounded in bytes as well as number.
#[tokio::test]
async fn waiting_messages_are_bounded_in_bytes() {
    let limits = "max_pending_bytes = \"1KiB\"";
    let s = Server::start(&config(&store_dir(), "", limits), &[]).await;
    upload(&s, "sleeper", "sleeper").await;
    let id = launch(&s, "sleeper", json!({"ms": 60_000}), json!({})).await;
    let text = "m".repeat(900);
    assert_eq!(message(&s, &id, &text).await.0, 200);
    let (status, body) = message(&s, &id, &text).await;
    assert_eq!(status, 429, "{body}");
    assert!(body.to_string().contains("max_pending_bytes"), "{body}");
}

/// One key holding every queue place and instance it may (all but the
/// reserve) is refused past its share, naming it, while another key's
/// inferlet is admitted and runs, and its completion is served.
#[tokio::test]
async fn one_tenant_using_its_whole_share_never_locks_another_out() {
    let cfg = format!("{TENANTS}{}", config(&store_dir(), "", "max_instances = 4"));
    let s = Server::start(&cfg, &[]).await;
    assert_eq!(
        upload_as(&s, Some("sk-root"), "sleeper", "sleeper").await.0,
        201
    );
    // Alice's first 3 take the instances her share allows (one is kept back).
    for _ in 0..3 {
        let (status, body) = launch_as(&s, "sk-alice", "sleeper", json!({"ms": 60_000})).await;
        assert_eq!(status, 201, "{body}");
    }
    s.eventually("3 instances live", async || {
        s.call(Method::GET, "/v1/inferlets", "sk-root", None, &[])
            .await
            .1["live_instances"]
            == 3
    })
    .await;
    let mut accepted = 3;
    let refusal = loop {
        let (status, body) = launch_as(&s, "sk-alice", "sleeper", json!({"ms": 60_000})).await;
        if status != 201 {
            break (status, body);
        }
        accepted += 1;
        assert!(accepted <= 12, "alice is never refused");
    };
    assert_eq!(refusal.0, 429, "{}", refusal.1);
    assert!(refusal.1.to_string().contains("share"), "{}", refusal.1);
    // 3 of 4 instances (one reserved) and 7 of 8 queue places (one reserved).
    assert_eq!(accepted, 10, "alice got all but the reserves");
    let (status, bob) = launch_as(&s, "sk-bob", "sleeper", json!({"ms": 10})).await;
    assert_eq!(status, 201, "{bob}");
    let bob = s.wait_done_as("sk-bob", bob["id"].as_str().unwrap()).await;
    assert_eq!(bob["output"], "woke", "bob's inferlet ran: {bob}");
    let completion = json!({"prompt": "hello", "max_tokens": 2});
    let (status, body) = s
        .call(
            Method::POST,
            "/v1/completions",
            "sk-bob",
            Some(completion),
            &[],
        )
        .await;
    assert_eq!(status, 200, "{body}");
}

/// The heavy host calls take inputs up to a bound tied to the model (its
/// context window x 16 bytes: 16,384 on the test model's 1,024), refuse
/// larger ones naming the bound, and the CPU time of large ones, run off
/// the guest's thread, is charged to the process's `max_cpu_ms`.
#[tokio::test]
async fn host_call_inputs_are_bounded_by_the_model_and_charged_to_the_guest() {
    let s = Server::start(&config(&store_dir(), "", "max_cpu_ms = 300"), &[]).await;
    upload(&s, "bigcalls", "bigcalls").await;
    let results = async |bytes: usize| {
        let id = launch(
            &s,
            "bigcalls",
            json!({"bytes": bytes, "rounds": 1}),
            json!({}),
        )
        .await;
        s.wait_done(&id).await;
        common::guests::json_events(&s, &id).await
    };
    let largest = results(16_384).await;
    assert_eq!(largest.len(), 3, "{largest:?}");
    for call in &largest {
        assert_eq!(call["ok"], true, "{call}");
    }
    let over = results(16_385).await;
    let by_call = |name: &str| over.iter().find(|c| c["call"] == name).unwrap().clone();
    for name in ["encode", "apply-chat-template"] {
        let error = by_call(name)["error"].as_str().unwrap_or("").to_string();
        assert!(error.contains("at most 16384"), "{name}: {error}");
    }
    let error = by_call("decode")["error"]
        .as_str()
        .unwrap_or("")
        .to_string();
    assert!(error.contains("context of 1024"), "decode: {error}");
    let looping = launch(
        &s,
        "bigcalls",
        json!({"bytes": 16_384, "rounds": 100_000}),
        json!({}),
    )
    .await;
    let done = s.wait_done(&looping).await;
    assert_eq!(done["state"], "failed", "{done}");
    assert!(
        common::guests::error_of(&done).contains("max_cpu_ms"),
        "{done}"
    );
}

const UPLOADERS: &str = r#"[server]
api_keys = [
  { name = "alice", key = "sk-alice", limits = { upload_inferlets = true, max_inferlets = 2 } },
  { name = "bob", key = "sk-bob", limits = { upload_inferlets = true, max_inferlet_bytes = 1000 } },
  { name = "root", key = "sk-root", role = "admin" },
]
"#;

fn api_error(body: &Value) -> &str {
    body["error"]["message"].as_str().unwrap_or("")
}

/// A client key holds at most its quota of inferlets, replaces and deletes
/// only its own versions; an admin key may delete any.
#[tokio::test]
async fn upload_quotas_and_ownership_hold_per_key() {
    let cfg = format!("{UPLOADERS}{}", config(&store_dir(), "", ""));
    let s = Server::start(&cfg, &[]).await;
    for version in ["1", "2"] {
        let (status, body) = upload_as(
            &s,
            Some("sk-alice"),
            &format!("a&version={version}"),
            "echo",
        )
        .await;
        assert_eq!(status, 201, "{body}");
        assert_eq!(body["owner"], "alice", "{body}");
    }
    let (status, body) = upload_as(&s, Some("sk-alice"), "a&version=3", "echo").await;
    assert_eq!(status, 403, "{body}");
    assert!(api_error(&body).contains("max_inferlets"), "{body}");
    // Replacing its own version is no new one.
    let (status, body) = upload_as(&s, Some("sk-alice"), "a&version=2", "echo").await;
    assert_eq!(status, 201, "{body}");
    let (status, body) = upload_as(&s, Some("sk-bob"), "b", "echo").await;
    assert_eq!(status, 403, "{body}");
    assert!(api_error(&body).contains("max_inferlet_bytes"), "{body}");
    let delete = async |key: &str, what: &str| {
        let path = format!("/v1/inferlets/{what}");
        s.call(Method::DELETE, &path, key, None, &[]).await
    };
    let (status, body) = delete("sk-bob", "a").await;
    assert_eq!(status, 403, "{body}");
    assert!(api_error(&body).contains("another key"), "{body}");
    let (status, _) = delete("sk-alice", "a@1").await;
    assert_eq!(status, 200);
    let (status, body) = upload_as(&s, Some("sk-alice"), "a&version=3", "echo").await;
    assert_eq!(status, 201, "a freed place takes a new one: {body}");
    let (status, body) = delete("sk-root", "a").await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["removed"].as_array().map(Vec::len), Some(2), "{body}");
}
