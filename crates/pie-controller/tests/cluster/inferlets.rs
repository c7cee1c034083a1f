//! Inferlets installed through the controller: every worker gets them, and
//! so does a worker that registers later; a controller restart keeps the
//! set (and uploads nothing again); a worker that was down gets them when it
//! is back, and no launch goes to it before; a component every worker
//! refuses is a 400 and is not kept.

use std::path::PathBuf;

use crate::common::{bin, model, spawn, wait_for};
use crate::harness::{post_json, Cluster, Spec};
use serde_json::{json, Value};

/// A fresh directory for one controller's installed set.
fn controller_dir(tag: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("controller-inferlets-{tag}-{}", std::process::id()))
}

async fn upload(c: &Cluster, name: &str, wasm: Vec<u8>) -> (u16, Value) {
    let r = (c
        .http
        .post(format!("{}/v1/inferlets?name={name}", c.controller.url)))
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
    let dir = controller_dir("restart");
    let _ = std::fs::remove_dir_all(&dir);
    let cluster_config = format!("inferlets_dir = {:?}\n", dir.display().to_string());
    let mut c = Cluster::start_with(Spec {
        workers: 2,
        cluster_config: &cluster_config,
        groups: &["", ""],
        ..Spec::new("pin,least-loaded")
    })
    .await;
    let (status, v) = upload(&c, "tc-wasm", guest("text_completion")).await;
    assert_eq!(status, 201, "{v}");
    assert_eq!(v["workers"], json!({"w0": "installed", "w1": "installed"}));
    let (_, direct) = run_through(&c, "text-completion", json!({})).await;
    let (_, component) = run_through(&c, "tc-wasm", json!({})).await;
    assert_eq!(
        component["output"], direct["output"],
        "greedy, token for token"
    );

    let m = model();
    let _late = spawn(
        &bin("pie"),
        &[
            "serve",
            "--port",
            "0",
            "--model",
            m.to_str().unwrap(),
            "--controller",
            &c.controller.url,
            "--name",
            "late",
        ],
        "pie: listening on ",
    );
    wait_for("the late worker holds it", async || {
        state_on(&c, "tc-wasm", "late").await == "installed"
    })
    .await;
    let (id, _) = run_through(&c, "tc-wasm", json!({"pin": "late"})).await;
    assert!(id.starts_with("late~"), "{id}");

    let before = (compiles(&c, 0).await, compiles(&c, 1).await);
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
    let dir = controller_dir("down");
    let _ = std::fs::remove_dir_all(&dir);
    let cluster_config = format!("inferlets_dir = {:?}\n", dir.display().to_string());
    let c = Cluster::start_with(Spec {
        workers: 2,
        cluster_config: &cluster_config,
        relayed: true,
        ..Spec::new("pin,least-loaded")
    })
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
    assert_eq!(v["workers"], json!({"w0": "installed", "w1": "pending"}));
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
