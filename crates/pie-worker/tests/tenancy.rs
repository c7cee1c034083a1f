//! Tenancy on one worker: roles on keys, process ownership, per-key limits.
//! Each case is an attack that used to work, now refused.

mod common;

use common::Server;
use reqwest::Method;
use serde_json::{json, Value};

const KEYS: &str = r#"[server]
api_keys = [
  { name = "alice", key = "sk-alice" },
  { name = "bob", key = "sk-bob", limits = { max_priority = 5, min_deadline_ms = 1000 } },
  { name = "ctl", key = "sk-ctl", role = "worker" },
  { name = "root", key = "sk-root", role = "admin" },
]
"#;

async fn launch_as(s: &Server, key: &str, props: Value) -> (u16, Value) {
    let body = json!({"inferlet": "text-completion",
        "args": {"prompt": "hello", "max_tokens": 2}, "props": props});
    s.call(Method::POST, "/v1/processes", key, Some(body), &[])
        .await
}

fn message(body: &Value) -> &str {
    body["error"]["message"].as_str().unwrap_or("")
}

/// A running process's identity never changes, and a patch is bounded by
/// the key's limits as a launch is: no client re-labels its process as
/// another's, raises its priority past its limit, or asks for a deadline at
/// or before its arrival.
#[tokio::test]
async fn a_patch_cannot_change_identity_or_pass_the_keys_limits() {
    let s = Server::start(KEYS, &[]).await;
    let (status, r) = launch_as(&s, "sk-bob", json!({"priority": 1})).await;
    assert_eq!(status, 201, "{r}");
    let path = format!("/v1/processes/{}", r["id"].as_str().unwrap());
    for (patch, key, why) in [
        (json!({"client": "alice"}), "client", "identity"),
        (json!({"client": null}), "client", "identity"),
        (
            json!({"priority": 6}),
            "priority",
            "above key `bob`'s limit of 5",
        ),
        (json!({"deadline-ms": -5}), "deadline-ms", "> 0"),
    ] {
        let body = Some(json!({ "props": patch }));
        let (status, body) = s.call(Method::PATCH, &path, "sk-bob", body, &[]).await;
        assert_eq!(status, 400, "{patch}: {body}");
        assert!(
            message(&body).contains(key) && message(&body).contains(why),
            "{body}"
        );
    }
    let body = Some(json!({"props": {"priority": 5}}));
    let (status, body) = s.call(Method::PATCH, &path, "sk-bob", body, &[]).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(
        (
            body["props"]["priority"].as_i64(),
            body["props"]["client"].as_str()
        ),
        (Some(5), Some("bob"))
    );
    let (status, body) = launch_as(&s, "sk-alice", json!({"deadline-ms": 0})).await;
    assert_eq!(status, 400, "{body}");
    assert!(message(&body).contains("deadline-ms"), "{body}");
}

#[tokio::test]
async fn a_client_sees_only_its_own_processes() {
    let s = Server::start(KEYS, &[]).await;
    let (status, r) = launch_as(&s, "sk-alice", json!({})).await;
    assert_eq!(status, 201, "{r}");
    let id = r["id"].as_str().unwrap().to_string();
    let path = format!("/v1/processes/{id}");

    for (method, suffix, body) in [
        (Method::GET, "", None),
        (Method::GET, "/events", None),
        (Method::PATCH, "", Some(json!({"props": {"x": 1}}))),
        (Method::DELETE, "", None),
    ] {
        let (status, body) = s
            .call(
                method.clone(),
                &format!("{path}{suffix}"),
                "sk-bob",
                body,
                &[],
            )
            .await;
        assert_eq!(status, 404, "bob {method} {suffix}: {body}");
        assert!(message(&body).contains("no process"), "{body}");
    }
    // A client key cannot claim to act for alice: only worker keys may.
    let (status, _) = s
        .call(
            Method::GET,
            &path,
            "sk-bob",
            None,
            &[("x-pie-client", "alice")],
        )
        .await;
    assert_eq!(status, 404);

    let (_, list) = s
        .call(Method::GET, "/v1/processes", "sk-bob", None, &[])
        .await;
    assert_eq!(list["data"].as_array().unwrap().len(), 0, "{list}");
    let (_, list) = s
        .call(Method::GET, "/v1/processes", "sk-alice", None, &[])
        .await;
    assert_eq!(list["data"][0]["id"], id.as_str());

    // The admin sees everyone's; a controller's worker key sees what the
    // client it acts for may see.
    let (status, _) = s.call(Method::GET, &path, "sk-root", None, &[]).await;
    assert_eq!(status, 200);
    let (status, _) = s
        .call(
            Method::GET,
            &path,
            "sk-ctl",
            None,
            &[("x-pie-client", "bob")],
        )
        .await;
    assert_eq!(status, 404);
    let (status, p) = s
        .call(
            Method::GET,
            &path,
            "sk-ctl",
            None,
            &[("x-pie-client", "alice")],
        )
        .await;
    assert_eq!((status, p["client"].as_str()), (200, Some("alice")));

    // Alice's process survived bob's DELETE.
    let (_, p) = s.call(Method::GET, &path, "sk-alice", None, &[]).await;
    assert_ne!(p["state"], "killed", "{p}");
}

#[tokio::test]
async fn client_keys_cannot_call_internal_or_admin_routes() {
    let s = Server::start(KEYS, &[]).await;
    // (method, path, body, the worker key's status: past auth, a pull
    // without a page format is a 422 naming the field)
    let internal = [
        (
            Method::POST,
            "/v1/internal/kv/pull",
            Some(json!({"tokens": [1, 2, 3]})),
            422,
        ),
        (Method::GET, "/v1/internal/state", None, 200),
        (Method::GET, "/v1/policies", None, 200),
    ];
    for (method, path, body, worker_status) in &internal {
        let (status, r) = s
            .call(method.clone(), path, "sk-alice", body.clone(), &[])
            .await;
        assert_eq!(status, 403, "{path}: {r}");
        assert!(message(&r).contains("role `worker`"), "{r}");
        let (status, r) = s
            .call(method.clone(), path, "sk-ctl", body.clone(), &[])
            .await;
        assert_eq!(status, *worker_status, "a worker key may call {path}: {r}");
    }
    let (status, r) = s
        .call(Method::GET, "/v1/internal/kv-events", "sk-alice", None, &[])
        .await;
    assert_eq!(status, 403, "{r}");
    for key in ["sk-alice", "sk-ctl"] {
        let (status, r) = s
            .call(Method::POST, "/v1/admin/reload", key, None, &[])
            .await;
        assert_eq!(status, 403, "{key}: {r}");
        assert!(message(&r).contains("role `admin`"), "{r}");
    }
    let (status, r) = s
        .call(Method::POST, "/v1/admin/reload", "sk-root", None, &[])
        .await;
    assert_eq!(status, 200, "{r}");
}

#[tokio::test]
async fn props_beyond_a_keys_limits_are_refused_naming_the_prop_and_limit() {
    let s = Server::start(KEYS, &[]).await;
    for (props, prop, says) in [
        (json!({"weight": 1e9}), "weight", "limit of 1"),
        (json!({"priority": 1000000}), "priority", "limit of 5"),
        (json!({"deadline-ms": 10}), "deadline-ms", "limit of 1000"),
    ] {
        let (status, r) = launch_as(&s, "sk-bob", props).await;
        assert_eq!(status, 400, "{r}");
        assert_eq!(r["error"]["param"], format!("props.{prop}"), "{r}");
        assert!(message(&r).contains(says), "{r}");
    }
    let (status, r) = launch_as(&s, "sk-bob", json!({"priority": 5})).await;
    assert_eq!(status, 201, "within the limit: {r}");
    let id = r["id"].as_str().unwrap();
    let (_, p) = s
        .call(
            Method::GET,
            &format!("/v1/processes/{id}"),
            "sk-bob",
            None,
            &[],
        )
        .await;
    assert_eq!(
        p["props"]["weight"], 1.0,
        "the key's weight is filled in: {p}"
    );
    assert_eq!(p["props"]["client"], "bob", "{p}");
    // The OpenAI route checks the same limits.
    let body = json!({"prompt": "hi", "max_tokens": 1, "props": {"priority": 6}});
    let (status, r) = s
        .call(Method::POST, "/v1/completions", "sk-bob", Some(body), &[])
        .await;
    assert_eq!(
        (status, r["error"]["param"].as_str()),
        (400, Some("props.priority")),
        "{r}"
    );
}

#[tokio::test]
async fn process_ids_are_unguessable_and_lists_come_in_pages() {
    let s = Server::start(KEYS, &[]).await;
    let mut ids = Vec::new();
    for _ in 0..5 {
        let (status, r) = launch_as(&s, "sk-alice", json!({})).await;
        assert_eq!(status, 201);
        ids.push(r["id"].as_str().unwrap().to_string());
    }
    // 64 random bits after the launch number: neighbours share no suffix.
    let random = |id: &str| id[id.len() - 16..].to_string();
    assert_ne!(random(&ids[0]), random(&ids[1]));
    assert!(
        ids.iter().all(|id| id.len() == "proc-".len() + 28),
        "{ids:?}"
    );

    let mut seen = Vec::new();
    let mut path = "/v1/processes?limit=2".to_string();
    loop {
        let (status, page) = s.call(Method::GET, &path, "sk-alice", None, &[]).await;
        assert_eq!(status, 200, "{page}");
        let data = page["data"].as_array().unwrap();
        assert!(data.len() <= 2);
        seen.extend(data.iter().map(|p| p["id"].as_str().unwrap().to_string()));
        if page["has_more"] == false {
            break;
        }
        path = format!(
            "/v1/processes?limit=2&after={}",
            page["last_id"].as_str().unwrap()
        );
    }
    assert_eq!(seen, ids, "every process once, in launch order");
    let (status, r) = s
        .call(Method::GET, "/v1/processes?limit=0", "sk-alice", None, &[])
        .await;
    assert_eq!(
        (status, r["error"]["param"].as_str()),
        (400, Some("limit")),
        "{r}"
    );
}

#[tokio::test]
async fn cache_salts_keep_tenants_from_seeing_each_others_prefixes() {
    let keys = r#"[server]
api_keys = [
  { name = "alice", key = "sk-alice", limits = { cache_salt = "team-a" } },
  { name = "carol", key = "sk-carol", limits = { cache_salt = "team-a" } },
  { name = "bob", key = "sk-bob" },
  { name = "dave", key = "sk-dave" },
]
"#;
    let s = Server::start(keys, &["--page-size", "16"]).await;
    let prompt: Vec<u32> = (0..64).map(|i| 40 + i % 50).collect();
    let cached = async |key: &str| {
        let body = json!({"prompt": prompt, "max_tokens": 1});
        let (status, r) = s
            .call(Method::POST, "/v1/completions", key, Some(body), &[])
            .await;
        assert_eq!(status, 200, "{r}");
        r["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap()
    };
    assert_eq!(cached("sk-alice").await, 0);
    assert!(cached("sk-carol").await >= 48, "the same salt shares");
    assert_eq!(
        cached("sk-bob").await,
        0,
        "no salt sees nothing of team-a's"
    );
    assert!(
        cached("sk-dave").await >= 48,
        "unsalted keys share as before"
    );
}

#[tokio::test]
async fn a_chat_session_belongs_to_its_client() {
    let s = Server::start(KEYS, &[]).await;
    let turn = |content: &str| json!({"inferlet": "chat", "args": {"messages": [{"role": "user", "content": content}], "max_tokens": 4, "ignore_eos": true}, "props": {"session": "conv-1"}});
    let prompt_tokens = async |key: &str, content: &str| {
        let (status, r) = s
            .call(Method::POST, "/v1/processes", key, Some(turn(content)), &[])
            .await;
        assert_eq!(status, 201, "{r}");
        let path = format!("/v1/processes/{}", r["id"].as_str().unwrap());
        s.eventually("turn finished", async || {
            s.call(Method::GET, &path, key, None, &[]).await.1["state"] == "finished"
        })
        .await;
        s.call(Method::GET, &path, key, None, &[]).await.1["usage"]["prompt_tokens"]
            .as_u64()
            .unwrap()
    };
    let alone = prompt_tokens("sk-alice", "a secret question").await;
    let resumed = prompt_tokens("sk-alice", "a secret question").await;
    assert!(
        resumed > alone + 4,
        "alice's second turn holds her first: {alone} then {resumed}"
    );
    let bob = prompt_tokens("sk-bob", "a secret question").await;
    assert_eq!(
        bob, alone,
        "bob's `conv-1` starts empty: alice's turns are not his"
    );
}

/// `pie_pretokenized_requests_total`, read with the worker key.
async fn pretokenized(s: &Server) -> f64 {
    let (status, text) = s.call(Method::GET, "/metrics", "sk-ctl", None, &[]).await;
    assert_eq!(status, 200, "{text}");
    pie_testkit::metric_value(text.as_str().unwrap(), "pie_pretokenized_requests_total")
}

/// `pie_prompt_tokens` (a controller's prompt ids): only a worker key may send
/// them; a client key is refused naming the field; the fingerprint must be the
/// worker's model and every id in its vocabulary; accepted ids are used (the
/// counter) and give the same output as the text.
#[tokio::test]
async fn forwarded_prompt_tokens_only_from_a_worker_key_and_checked() {
    let s = Server::start(KEYS, &[]).await;
    let (status, state) = s
        .call(Method::GET, "/v1/internal/state", "sk-ctl", None, &[])
        .await;
    assert_eq!(status, 200, "{state}");
    let fingerprint = state["fingerprint"].as_u64().unwrap();
    let (status, models) = s.call(Method::GET, "/v1/models", "sk-ctl", None, &[]).await;
    assert_eq!(status, 200, "{models}");
    let vocab = models["data"][0]["vocab_size"].as_u64().unwrap();
    // The ids of "hello" as the worker tokenizes it: a text request's usage.
    let text = json!({"prompt": "hello", "max_tokens": 6, "temperature": 0, "ignore_eos": true});
    let (status, by_text) = s
        .call(
            Method::POST,
            "/v1/completions",
            "sk-ctl",
            Some(text.clone()),
            &[],
        )
        .await;
    assert_eq!(status, 200, "{by_text}");
    let n = by_text["usage"]["prompt_tokens"].as_u64().unwrap();
    assert!(n >= 1, "{by_text}");
    let with = |ids: Value, fp: Value| {
        let mut body = text.clone();
        body["pie_prompt_tokens"] = json!({"fingerprint": fp, "ids": ids});
        body
    };
    // The right ids: the model's own tokenizer, as a controller has it.
    let gguf = pie_model::gguf::GgufFile::open(&common::test_model()).unwrap();
    assert_eq!(gguf.fingerprint.0, fingerprint);
    let ids = pie_model::Tokenizer::from_gguf(&gguf)
        .unwrap()
        .encode("hello")
        .unwrap();
    assert_eq!(ids.len() as u64, n);
    assert_eq!(pretokenized(&s).await, 0.0);

    let complete = async |key: &str, body: Value| {
        s.call(Method::POST, "/v1/completions", key, Some(body), &[])
            .await
    };
    // A client key: refused, naming the field.
    let (status, r) = complete("sk-alice", with(json!(ids), json!(fingerprint))).await;
    assert_eq!(status, 400, "{r}");
    assert!(message(&r).contains("pie_prompt_tokens"), "{r}");
    assert!(message(&r).contains("worker-role"), "{r}");
    // Also on the native route.
    let native = json!({"inferlet": "text-completion", "args": {"prompt": "hello", "max_tokens": 2},
        "pie_prompt_tokens": {"fingerprint": fingerprint, "ids": ids}});
    let (status, r) = s
        .call(Method::POST, "/v1/processes", "sk-alice", Some(native), &[])
        .await;
    assert_eq!(status, 400, "{r}");
    assert!(message(&r).contains("pie_prompt_tokens"), "{r}");

    // A worker key with another model's fingerprint.
    let (status, r) = complete("sk-ctl", with(json!(ids), json!(fingerprint ^ 1))).await;
    assert_eq!(status, 400, "{r}");
    assert!(message(&r).contains("pie_prompt_tokens.fingerprint"), "{r}");
    // ... or an id outside the vocabulary.
    let (status, r) = complete("sk-ctl", with(json!([1, vocab]), json!(fingerprint))).await;
    assert_eq!(status, 400, "{r}");
    assert!(message(&r).contains("pie_prompt_tokens.ids"), "{r}");
    assert!(message(&r).contains(&format!("token id {vocab}")), "{r}");
    assert_eq!(pretokenized(&s).await, 0.0);

    // The right ids from a worker key are used, and answer as the text did.
    let (status, r) = complete("sk-ctl", with(json!(ids), json!(fingerprint))).await;
    assert_eq!(status, 200, "{r}");
    assert_eq!(pretokenized(&s).await, 1.0);
    assert_eq!(
        r["choices"][0]["text"], by_text["choices"][0]["text"],
        "{r} vs {by_text}"
    );
    assert_eq!(r["usage"], by_text["usage"]);
    // Different ids than the text's are what the worker computes on: the
    // check is of the key's role, not of the text (the controller's job).
    let (status, r) = complete("sk-ctl", with(json!([ids[0]]), json!(fingerprint))).await;
    assert_eq!(status, 200, "{r}");
    assert_eq!(r["usage"]["prompt_tokens"], 1, "{r}");
}
