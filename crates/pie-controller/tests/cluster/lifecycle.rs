//! Lives of the controller and its workers: SIGHUP reloads, `pie cluster up`
//! stopped by SIGTERM, a silent worker passed over and a dead engine down,
//! an engine panic routed around.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::common::{self, bin, model, wait_for};
use crate::harness::{worker_entry, Cluster, FakeWorker, Spec};
use serde_json::json;

#[tokio::test]
async fn sighup_reloads_cluster_policies_and_refuses_broken_files() {
    let c = Cluster::start("round-robin", "256").await;
    let hup = || {
        assert!(Command::new("kill")
            .args(["-HUP", &c.controller.pid().to_string()])
            .status()
            .unwrap()
            .success())
    };
    std::fs::write(
        &c.config,
        "[cluster]\npoll_ms = 20\ncluster_policies = [\"pin\", \"least-loaded\"]\n",
    )
    .unwrap();
    hup();
    wait_for("pipeline swapped", async || {
        c.cluster().await["cluster_policies"] == json!(["pin", "least-loaded"])
    })
    .await;
    std::fs::write(&c.config, "[cluster]\ncluster_policies = [\"telepathy\"]\n").unwrap();
    hup();
    wait_for("failure counted", async || {
        c.metric("pie_controller_config_reload_failures_total")
            .await
            == 1.0
    })
    .await;
    assert_eq!(
        c.cluster().await["cluster_policies"],
        json!(["pin", "least-loaded"]),
        "the running pipeline stays"
    );
}

/// `pie cluster up` stopped with SIGTERM (as `kill`, `docker stop` and systemd
/// stop it) stops its workers and controller instead of orphaning them.
#[tokio::test]
async fn cluster_up_stops_its_children_on_sigterm() {
    let model = model();
    let mut up = Command::new(bin("pie"))
        .args(["cluster", "up", "--workers", "2", "--port", "0", "--model"])
        .arg(&model)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(up.stdout.take().unwrap()).lines();
    let mut addrs = Vec::new();
    for line in lines.by_ref() {
        let line = line.unwrap();
        let url = line.split_once(": http://").map(|(_, rest)| rest);
        if let Some(addr) = url.and_then(|u| u.split_whitespace().next()) {
            addrs.push(addr.to_string());
        }
        if line.starts_with("controller: ") {
            break;
        }
    }
    std::thread::spawn(move || for _ in lines {});
    assert_eq!(addrs.len(), 3, "two workers and a controller: {addrs:?}");
    for addr in &addrs {
        assert!(std::net::TcpStream::connect(addr).is_ok(), "{addr} is up");
    }
    let killed = Command::new("kill")
        .args(["-TERM", &up.id().to_string()])
        .status()
        .unwrap();
    assert!(killed.success());
    let deadline = Instant::now() + Duration::from_secs(10);
    let status = loop {
        if let Some(status) = up.try_wait().unwrap() {
            break status;
        }
        assert!(Instant::now() < deadline, "pie cluster up ignored SIGTERM");
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(status.success(), "{status}");
    for addr in &addrs {
        assert!(
            std::net::TcpStream::connect(addr).is_err(),
            "{addr} still accepts connections after the cluster stopped"
        );
    }
}

#[tokio::test]
async fn a_silent_worker_is_passed_over_within_the_read_timeout_and_a_dead_engine_is_down() {
    let hole = FakeWorker::start(&[0], false).await;
    let config = format!("read_timeout_ms = 1000\n{}", hole.config("hole"));
    let c = Cluster::start_with(Spec {
        workers: 1,
        cluster_config: &config,
        ..Spec::new("pin,round-robin")
    })
    .await;
    // Round robin sends every other request to the silent worker first.
    for i in 0..4 {
        let start = Instant::now();
        let (status, worker, route, body) = c
            .complete(json!({"prompt": format!("p{i}"), "max_tokens": 2}))
            .await;
        assert_eq!((status, worker.as_str()), (200, "w0"), "{route} {body}");
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "{:?}",
            start.elapsed()
        );
    }
    assert!(c.metric("pie_controller_retries_total").await >= 1.0);

    // After its first byte a stall cannot be retried: the stream ends with an error.
    wait_for("the silent worker polled healthy again", async || {
        worker_entry(&c, "hole").await["healthy"] == true
    })
    .await;
    let r = c
        .http
        .post(format!("{}/v1/completions", c.controller.url))
        .json(&json!({"prompt": "stall", "stream": true, "props": {"pin": "hole"}}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let text = tokio::time::timeout(Duration::from_secs(10), r.text())
        .await
        .expect("the stalled stream ends")
        .unwrap();
    assert!(
        text.starts_with("data: {\"choices\"") && text.contains("silent past read_timeout_ms"),
        "{text}"
    );

    // A worker whose engine died answers 503 on its state: down.
    hole.engine_dead
        .store(true, std::sync::atomic::Ordering::SeqCst);
    wait_for("the dead-engine worker is down", async || {
        worker_entry(&c, "hole").await["healthy"] == false
    })
    .await;
}

/// The names of the workers the controller routes to.
async fn healthy_workers(c: &Cluster) -> Vec<String> {
    let mut names: Vec<String> = c.cluster().await["workers"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|w| w["healthy"] == true)
        .map(|w| w["name"].as_str().unwrap().to_string())
        .collect();
    names.sort();
    names
}

/// Needs the `pie` binary built with `fault-injection` (`cargo test
/// --workspace --features pie-worker/fault-injection` builds it so).
#[tokio::test]
async fn after_an_engine_panic_the_controller_routes_to_the_other_worker() {
    let c = Cluster::start_with(Spec {
        workers: 2,
        ..Spec::new("round-robin")
    })
    .await;
    let complete = async |prompt: String| {
        c.complete(json!({"prompt": prompt, "max_tokens": 4, "ignore_eos": true}))
            .await
    };
    let mut before = std::collections::HashSet::new();
    for i in 0..4 {
        let (status, worker, _, body) = complete(format!("before {i}")).await;
        assert_eq!(status, 200, "{body}");
        before.insert(worker);
    }
    assert_eq!(before.len(), 2, "round-robin used both workers: {before:?}");

    let w0 = c.workers[0].as_ref().unwrap().url.clone();
    let r = c
        .http
        .post(format!("{w0}/v1/admin/fault"))
        .json(&json!({"fault": "panic"}))
        .send()
        .await
        .unwrap();
    assert_ne!(
        r.status(),
        404,
        "the pie binary lacks the fault route: build it with `--features pie-worker/fault-injection`"
    );
    assert_eq!(r.status(), 200);
    let injected = Instant::now();
    wait_for("the controller to mark w0 down", async || {
        healthy_workers(&c).await == ["w1"]
    })
    .await;
    assert!(
        injected.elapsed() < Duration::from_secs(2),
        "w0 still routed to {:?} after its engine panicked",
        injected.elapsed()
    );
    let health = common::get_json(&format!("{w0}/health")).await;
    assert_eq!(health["status"], "unhealthy", "{health}");

    for i in 0..6 {
        let (status, worker, _, body) = complete(format!("after {i}")).await;
        assert_eq!(status, 200, "{body}");
        assert_eq!(worker, "w1", "request {i} routed to the failed worker");
        assert_eq!(body["usage"]["completion_tokens"], 4, "{body}");
        assert_eq!(body["choices"][0]["finish_reason"], "length", "{body}");
    }
}
