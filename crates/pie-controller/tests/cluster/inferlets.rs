//! Inferlets installed through the controller: every worker gets them, and
//! so does a worker that registers later; a controller restart keeps the
//! set (and uploads nothing again); a worker that was down gets them when it
//! is back, and no launch goes to it before; a component every worker
//! refuses is a 400 and is not kept; a launched inferlet's messages and
//! events go through the controller; an inferlet's process does not move (a
//! drain waits for it, the action log names why) and fails naming its worker
//! when that dies.

use std::path::PathBuf;

use crate::common::{actions, bin, model, spawn, wait_for, worker};
use crate::harness::{
    call_as, drain_or_kill, post_json, slow_steps, worker_config_trusting_the_controller, Cluster,
    Spec, MOVE_STEP_MS,
};
use serde_json::{json, Value};

/// A fresh directory for one controller's installed set.
fn controller_dir(tag: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("controller-inferlets-{tag}-{}", std::process::id()))
}

/// A cluster whose controller keeps its installed set in a fresh directory
/// (named by `tag`), otherwise as `spec` says.
async fn installing_cluster(tag: &str, spec: Spec<'_>) -> Cluster {
    let dir = controller_dir(tag);
    let _ = std::fs::remove_dir_all(&dir);
    let config = format!(
        "inferlets_dir = {:?}\n{}",
        dir.display().to_string(),
        spec.cluster_config
    );
    Cluster::start_with(Spec {
        cluster_config: &config,
        ..spec
    })
    .await
}

/// Upload `wasm` as `name` to the controller, on a fresh connection (a
/// pooled one the server closed would fail the body's write).
async fn upload(c: &Cluster, name: &str, wasm: Vec<u8>) -> (u16, Value) {
    let url = format!("{}/v1/inferlets?name={name}", c.controller.url);
    let r = reqwest::Client::new()
        .post(url)
        .body(wasm)
        .send()
        .await
        .unwrap();
    (r.status().as_u16(), r.json().await.unwrap_or(Value::Null))
}

fn guest(name: &str) -> Vec<u8> {
    std::fs::read(pie_testkit::inferlet_wasm(name)).unwrap()
}

/// Launch `inferlet` through the controller (with `props`) and wait for its
/// end: its `WORKER~ID` and record.
async fn run_through(c: &Cluster, inferlet: &str, props: Value) -> (String, Value) {
    let launch = json!({"inferlet": inferlet, "props": props,
        "args": {"prompt": "hello there", "max_tokens": 6}});
    let (status, v) = post_json(&c.controller.url, "/v1/processes", None, &launch).await;
    assert_eq!(status, 201, "{v}");
    let id = v["id"].as_str().unwrap().to_string();
    let mut record = Value::Null;
    wait_for("the process ends", async || {
        record = serde_json::from_str(&c.get_text(&format!("/v1/processes/{id}")).await).unwrap();
        record["state"] != "running" && record["state"] != "queued"
    })
    .await;
    assert_eq!(record["state"], "finished", "{record}");
    (id, record)
}

/// What the controller lists for `name` on `worker`.
async fn state_on(c: &Cluster, name: &str, worker: &str) -> Value {
    let list: Value = serde_json::from_str(&c.get_text("/v1/inferlets").await).unwrap();
    (list["inferlets"].as_array().unwrap().iter())
        .find(|i| i["name"] == name)
        .map(|i| i["workers"][worker].clone())
        .unwrap_or(Value::Null)
}

/// An upload's answer names every worker of `held` (installed, or pending
/// when its poll just failed on a loaded machine), and each holds it soon.
async fn held_by(c: &Cluster, name: &str, answer: &Value, held: &[&str]) {
    for worker in held {
        let said = answer["workers"][worker].as_str().unwrap_or_default();
        assert!(
            ["installed", "pending"].contains(&said),
            "{worker}: {answer}"
        );
        wait_for("the install", async || {
            state_on(c, name, worker).await == "installed"
        })
        .await;
    }
}

/// The workers' own count of components compiled.
async fn compiles(c: &Cluster, worker: usize) -> u64 {
    let url = c.workers[worker].as_ref().unwrap().url.clone();
    let list: Value = reqwest::get(format!("{url}/v1/inferlets"))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    list["compiles"].as_u64().unwrap()
}

#[tokio::test]
async fn an_installed_inferlet_reaches_every_worker_a_late_one_and_survives_a_restart() {
    let mut c = installing_cluster(
        "restart",
        Spec {
            workers: 2,
            groups: &["", ""],
            ..Spec::new("pin,least-loaded")
        },
    )
    .await;
    let (status, v) = upload(&c, "tc-wasm", guest("text_completion")).await;
    assert_eq!(status, 201, "{v}");
    held_by(&c, "tc-wasm", &v, &["w0", "w1"]).await;
    let (_, direct) = run_through(&c, "text-completion", json!({})).await;
    let (_, component) = run_through(&c, "tc-wasm", json!({})).await;
    assert_eq!(
        component["output"], direct["output"],
        "greedy, token for token"
    );

    let _late = worker(&["--controller", &c.controller.url, "--name", "late"]);
    wait_for("the late worker holds it", async || {
        state_on(&c, "tc-wasm", "late").await == "installed"
    })
    .await;
    let (id, _) = run_through(&c, "tc-wasm", json!({"pin": "late"})).await;
    assert!(id.starts_with("late~"), "{id}");

    let before = (compiles(&c, 0).await, compiles(&c, 1).await);
    let m = model();
    c.controller = spawn(
        &bin("pie-controller"),
        &[
            "--port",
            "0",
            "--model",
            m.to_str().unwrap(),
            "--config",
            c.config.to_str().unwrap(),
        ],
        "pie-controller: listening on ",
    );
    wait_for("both held after the restart", async || {
        state_on(&c, "tc-wasm", "w0").await == "installed"
            && state_on(&c, "tc-wasm", "w1").await == "installed"
    })
    .await;
    run_through(&c, "tc-wasm", json!({})).await;
    let after = (compiles(&c, 0).await, compiles(&c, 1).await);
    assert_eq!(
        before, after,
        "the workers listed it: nothing uploaded again"
    );
}

#[tokio::test]
async fn a_worker_that_was_down_gets_the_install_when_back_and_no_launch_before() {
    let c = installing_cluster(
        "down",
        Spec {
            workers: 2,
            relayed: true,
            ..Spec::new("pin,least-loaded")
        },
    )
    .await;
    c.relays[1].set_cut(true);
    c.relays[1].drop_connections();
    wait_for("w1 down", async || {
        let cluster = c.cluster().await;
        cluster["workers"][1]["healthy"] == false
    })
    .await;
    let (status, v) = upload(&c, "tc-down", guest("text_completion")).await;
    assert_eq!(status, 201, "{v}");
    assert_eq!(v["workers"]["w1"], "pending", "w1 is down: {v}");
    held_by(&c, "tc-down", &v, &["w0"]).await;
    for _ in 0..4 {
        let (id, _) = run_through(&c, "tc-down", json!({})).await;
        assert!(id.starts_with("w0~"), "only w0 holds it: {id}");
    }
    c.relays[1].set_cut(false);
    wait_for("w1 installed once back", async || {
        state_on(&c, "tc-down", "w1").await == "installed"
    })
    .await;
    let (id, _) = run_through(&c, "tc-down", json!({"pin": "w1"})).await;
    assert!(id.starts_with("w1~"), "{id}");

    let (status, v) = upload(&c, "not-wasm", b"not a component".to_vec()).await;
    assert_eq!(status, 400, "{v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("every worker refused it"),
        "{v}"
    );
    assert_eq!(
        state_on(&c, "not-wasm", "w0").await,
        Value::Null,
        "not kept"
    );
}

/// `echo` installed through the controller, launched through it: messages
/// sent to its `WORKER~ID` reach it and its events come back the same way.
#[tokio::test]
async fn messages_and_events_of_an_installed_inferlet_go_through_the_controller() {
    let c = installing_cluster(
        "echo",
        Spec {
            workers: 2,
            ..Spec::new("least-loaded")
        },
    )
    .await;
    let (status, v) = upload(&c, "echo-ctl", guest("echo")).await;
    assert_eq!(status, 201, "{v}");
    let launch = json!({"inferlet": "echo-ctl", "args": {}});
    let (status, v) = post_json(&c.controller.url, "/v1/processes", None, &launch).await;
    assert_eq!(status, 201, "{v}");
    let id = v["id"].as_str().unwrap().to_string();
    for message in ["one", "two", "quit"] {
        let path = format!("/v1/processes/{id}/messages");
        let (status, v) =
            post_json(&c.controller.url, &path, None, &json!({"message": message})).await;
        assert_eq!(status, 200, "{v}");
    }
    let events = c.get_text(&format!("/v1/processes/{id}/events")).await;
    assert!(
        events.contains("echo: one") && events.contains("echo: two"),
        "{events}"
    );
    assert!(events.contains("finished"), "{events}");
}

/// Launch a long `tc-stay` process through the controller: its `WORKER~ID`
/// and its worker's name. 1,000 tokens at [`MOVE_STEP_MS`] each, as the
/// other move tests: at 400 (2 s) a loaded CI machine's polls could miss the
/// drain while the process still ran.
async fn launch_long(c: &Cluster) -> (String, String) {
    let launch = json!({"inferlet": "tc-stay",
        "args": {"prompt": "a long story", "max_tokens": 1000, "ignore_eos": true}});
    let (status, v) = post_json(&c.controller.url, "/v1/processes", None, &launch).await;
    assert_eq!(status, 201, "{v}");
    let id = v["id"].as_str().unwrap().to_string();
    let worker = id.split('~').next().unwrap().to_string();
    (id, worker)
}

/// An inferlet's state lives in its guest's memory: on a drain
/// `drain-migrate` does not move it (the action log says why) and the drain
/// waits for it to finish where it is; when its worker is killed it fails
/// with a reason naming the worker.
#[tokio::test]
async fn an_inferlets_process_stays_on_a_drain_and_fails_naming_its_dead_worker() {
    let mut c = installing_cluster(
        "stay",
        Spec {
            cluster_config: "actor_tick_ms = 20\n",
            ..Spec::new("least-loaded,drain-migrate")
        },
    )
    .await;
    let (status, v) = upload(&c, "tc-stay", guest("text_completion")).await;
    assert_eq!(status, 201, "{v}");
    slow_steps(&c, MOVE_STEP_MS).await;
    let (id, worker) = launch_long(&c).await;
    let events = c
        .http
        .get(format!("{}/v1/processes/{id}/events", c.controller.url))
        .send();
    let events = tokio::spawn(async move { events.await.unwrap().text().await.unwrap() });
    drain_or_kill(&mut c, &worker, false).await;
    wait_for("drain-migrate's refusal logged", async || {
        let logged = actions(&c.controller.url, "migrate-process").await;
        logged.iter().any(|a| {
            let error = a["outcome"]["failed"]["error"].as_str().unwrap_or_default();
            error.contains("stays where it is") && error.contains("WebAssembly inferlet")
        })
    })
    .await;
    let events = events.await.unwrap();
    assert!(
        events.contains("\"finished\""),
        "it finished where it was: {events}"
    );

    let (id, worker) = launch_long(&c).await;
    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    drain_or_kill(&mut c, &worker, true).await;
    let mut answer = Value::Null;
    wait_for("the process is lost, naming its worker", async || {
        answer = serde_json::from_str(&c.get_text(&format!("/v1/processes/{id}")).await)
            .unwrap_or(Value::Null);
        answer["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("cannot go on elsewhere"))
    })
    .await;
    let message = answer["error"]["message"].as_str().unwrap();
    assert!(
        message.contains(&format!("its worker `{worker}` failed")),
        "{message}"
    );
}

/// A client key's limits hold on the worker for an inferlet launched
/// through the controller (the worker gets them with the launch): its guest
/// cannot raise its `priority` past the key's `max_priority`.
#[tokio::test]
async fn a_controller_launched_guest_is_bounded_by_its_clients_key() {
    let worker_cfg = worker_config_trusting_the_controller("acting-limits");
    let c = installing_cluster(
        "acting-limits",
        Spec {
            workers: 1,
            worker_args: &["--config", worker_cfg.to_str().unwrap()],
            cluster_config: "worker_key = \"sk-ctl\"\n[server]\napi_keys = [\
                { name = \"bob\", key = \"sk-bob\", limits = { max_priority = 5 } },\
                { name = \"root\", key = \"sk-root\", role = \"admin\" }]",
            client_key: Some("sk-root"),
            ..Spec::new("least-loaded")
        },
    )
    .await;
    let url = format!("{}/v1/inferlets?name=priority-ctl", c.controller.url);
    let r = reqwest::Client::new()
        .post(url)
        .bearer_auth("sk-root")
        .body(guest("priority"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 201);
    let launch = json!({"inferlet": "priority-ctl", "args":
        {"priority": 1, "bad_priority": 1_000_000, "prompt": "hi", "max_tokens": 2}});
    let post = reqwest::Method::POST;
    let (status, v) = call_as(&c, post, "/v1/processes", "sk-bob", Some(launch)).await;
    assert_eq!(status, 201, "{v}");
    let events = c
        .get_text(&format!(
            "/v1/processes/{}/events",
            v["id"].as_str().unwrap()
        ))
        .await;
    assert!(events.contains("bad_priority_error"), "{events}");
    assert!(events.contains("limit of 5"), "{events}");
}
