//! Real `pie serve` workers (test model) behind a real `pie-controller`.

mod common;

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{bin, model, spawn, wait_for, Proc};
use serde_json::{json, Value};

/// A TCP relay in front of a worker; `set_cut(true)` drops every connection
/// through it and refuses new ones until `set_cut(false)`; `drop_connections`
/// drops the open ones only.
struct Relay {
    url: String,
    /// (refusing, generation): a connection ends when the relay refuses or
    /// the generation it started in is over.
    state: tokio::sync::watch::Sender<(bool, u64)>,
}

impl Relay {
    async fn start(target_url: &str) -> Relay {
        let target = target_url.trim_start_matches("http://").to_string();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let (state, watch) = tokio::sync::watch::channel((false, 0));
        tokio::spawn(async move {
            while let Ok((mut inbound, _)) = listener.accept().await {
                let (refusing, generation) = *watch.borrow();
                if refusing {
                    continue; // dropped: the connection is refused
                }
                let (target, mut watch) = (target.clone(), watch.clone());
                tokio::spawn(async move {
                    let Ok(mut outbound) = tokio::net::TcpStream::connect(&target).await else {
                        return;
                    };
                    tokio::select! {
                        _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound) => {}
                        _ = watch.wait_for(|&(refusing, g)| refusing || g != generation) => {}
                    }
                });
            }
        });
        Relay { url, state }
    }

    fn set_cut(&self, cut: bool) {
        self.state.send_modify(|s| s.0 = cut);
    }

    fn drop_connections(&self) {
        self.state.send_modify(|s| s.1 += 1);
    }
}

struct Cluster {
    workers: Vec<Option<Proc>>,
    relays: Vec<Relay>,
    controller: Proc,
    http: reqwest::Client,
    config: PathBuf,
}

/// What a test cluster looks like.
struct Spec<'a> {
    policies: &'a str,
    workers: usize,
    worker_args: &'a [&'a str],
    /// Extra `[cluster]` lines.
    cluster_config: &'a str,
    /// Put each worker behind a relay the test can cut (the controller sees the
    /// relay's URL).
    relayed: bool,
    /// The test client's API key for the controller.
    client_key: Option<&'a str>,
    /// Each worker's `group` label ("" for none); when set, the workers are
    /// listed in the config file rather than with `--worker`.
    groups: &'a [&'a str],
    /// Each worker's `--stage` (none: both).
    stages: &'a [&'a str],
    /// Give the controller `--model` (else it reads the workers' tokenizer).
    controller_model: bool,
}

impl<'a> Spec<'a> {
    /// Three plain workers, no extra configuration.
    fn new(policies: &'a str) -> Self {
        Spec {
            policies,
            workers: 3,
            worker_args: &["--kv-pages", "512"],
            cluster_config: "",
            relayed: false,
            client_key: None,
            groups: &[],
            stages: &[],
            controller_model: true,
        }
    }
}

impl Cluster {
    async fn start(policies: &str, kv_pages: &str) -> Cluster {
        Cluster::start_with(Spec {
            worker_args: &["--kv-pages", kv_pages],
            ..Spec::new(policies)
        })
        .await
    }

    async fn start_with(spec: Spec<'_>) -> Cluster {
        let model = model();
        let m = model.to_str().unwrap();
        let workers: Vec<Option<Proc>> = (0..spec.workers)
            .map(|i| {
                let mut args = vec!["serve", "--port", "0", "--model", m, "--page-size", "16"];
                args.extend(spec.worker_args);
                if let Some(stage) = spec.stages.get(i) {
                    args.extend(["--stage", stage]);
                }
                Some(spawn(&bin("pie"), &args, "pie: listening on "))
            })
            .collect();
        let mut args = vec!["--port".to_string(), "0".into()];
        if spec.controller_model {
            args.extend(["--model".into(), m.into()]);
        }
        // Tests run in parallel in one process: one file per cluster.
        static CLUSTERS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let cfg = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!(
            "controller-{}-{}-{}.toml",
            std::process::id(),
            CLUSTERS.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            spec.policies
        ));
        let names: Vec<&str> = spec.policies.split(',').collect();
        let mut text = format!(
            "[cluster]\npoll_ms = 20\ncluster_policies = {names:?}\n{}\n",
            spec.cluster_config
        );
        args.extend(["--config".into(), cfg.to_str().unwrap().into()]);
        let mut relays = Vec::new();
        for (i, w) in workers.iter().enumerate() {
            let mut url = w.as_ref().unwrap().url.clone();
            if spec.relayed {
                let relay = Relay::start(&url).await;
                url = relay.url.clone();
                relays.push(relay);
            }
            match spec.groups.get(i) {
                Some(group) => {
                    text += &format!("[[cluster.workers]]\nname = \"w{i}\"\nurl = \"{url}\"\n");
                    if !group.is_empty() {
                        text += &format!("group = \"{group}\"\n");
                    }
                }
                None => args.extend(["--worker".into(), format!("w{i}={url}")]),
            }
        }
        std::fs::write(&cfg, text).unwrap();
        let refs: Vec<&str> = args.iter().map(String::as_str).collect();
        let controller = spawn(
            &bin("pie-controller"),
            &refs,
            "pie-controller: listening on ",
        );
        let mut headers = reqwest::header::HeaderMap::new();
        if let Some(key) = spec.client_key {
            headers.insert("authorization", format!("Bearer {key}").parse().unwrap());
        }
        let c = Cluster {
            workers,
            relays,
            controller,
            http: reqwest::Client::builder()
                .default_headers(headers)
                .build()
                .unwrap(),
            config: cfg,
        };
        wait_for("all workers healthy", async || {
            c.cluster().await["workers"]
                .as_array()
                .unwrap()
                .iter()
                .all(|w| w["healthy"] == true)
        })
        .await;
        c
    }

    /// The value of the controller's metric `name` (0 when absent).
    async fn metric(&self, name: &str) -> f64 {
        pie_testkit::metric_value(&self.get_text("/metrics").await, name)
    }

    /// GET a controller path; the body as text.
    async fn get_text(&self, path: &str) -> String {
        self.http
            .get(format!("{}{path}", self.controller.url))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap()
    }

    async fn cluster(&self) -> Value {
        self.http
            .get(format!("{}/v1/cluster", self.controller.url))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap()
    }

    /// POST a completion; returns (status, worker, route reason, body).
    /// The URL of worker `name` (`w1`).
    fn url_of(&self, name: &str) -> String {
        let i: usize = name.trim_start_matches('w').parse().unwrap();
        self.workers[i].as_ref().unwrap().url.clone()
    }

    async fn actions(&self, kind: &str) -> Vec<Value> {
        common::actions(&self.controller.url, kind).await
    }

    async fn settled(&self, kind: &str) -> Vec<Value> {
        common::settled(&self.controller.url, kind).await
    }

    async fn complete(&self, body: Value) -> (u16, String, String, Value) {
        let r = self
            .http
            .post(format!("{}/v1/completions", self.controller.url))
            .json(&body)
            .send()
            .await
            .unwrap();
        let header = |n: &str| {
            r.headers()
                .get(n)
                .map(|v| v.to_str().unwrap().to_string())
                .unwrap_or_default()
        };
        let (worker, route) = (header("x-pie-worker"), header("x-pie-route"));
        (
            r.status().as_u16(),
            worker,
            route,
            r.json().await.unwrap_or(Value::Null),
        )
    }
}

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
    let m = model();
    let join = |name: &'static str| {
        spawn(
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
                name,
            ],
            "pie: listening on ",
        )
    };
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
    let m = model();
    let _extra = spawn(
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
            "--group",
            "gold",
        ],
        "pie: listening on ",
    );
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
async fn a_broken_stream_that_no_worker_can_resume_ends_with_an_error_event() {
    let mut c = Cluster::start_with(Spec {
        workers: 1,
        ..Spec::new("least-loaded")
    })
    .await;
    let body = json!({"prompt": "long", "max_tokens": 100_000, "ignore_eos": true, "stream": true});
    let mut r = c
        .http
        .post(format!("{}/v1/completions", c.controller.url))
        .json(&body)
        .send()
        .await
        .unwrap();
    let mut seen = String::new();
    while !seen.contains("\"text\"") {
        seen.push_str(&String::from_utf8_lossy(&r.chunk().await.unwrap().unwrap()));
    }
    assert!(seen.starts_with("data: {"), "{seen}");
    c.workers[0] = None; // the only worker dies mid-stream
    while let Ok(Some(chunk)) = r.chunk().await {
        seen.push_str(&String::from_utf8_lossy(&chunk));
    }
    let last = seen.trim_end().rsplit("\n\n").next().unwrap();
    assert!(
        last.contains("\"error\"")
            && last.contains("stream broke")
            && last.contains("no worker could resume"),
        "no silent truncation: {last}"
    );
    assert!(!seen.contains("pie_token_ids") && !seen.contains("pie-process"));
}

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

/// The number in a route reason like `cache-aware: 96/120 prefix tokens on w0`.
fn cached_in_reason(route: &str) -> usize {
    route
        .split_once(": ")
        .and_then(|(_, r)| r.split('/').next())
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or(0)
}

#[tokio::test]
async fn kv_events_lost_while_disconnected_are_repaired_by_the_snapshot_on_reconnect() {
    let c = Cluster::start_with(Spec {
        workers: 1,
        relayed: true,
        ..Spec::new("cache-aware")
    })
    .await;
    let worker_url = c.workers[0].as_ref().unwrap().url.clone();
    let prompt_a: Vec<u32> = (0..97).map(|i| 32 + i % 90).collect();
    let prompt_b: Vec<u32> = (0..97).map(|i| 40 + (i * 7) % 90).collect();
    let (status, _, _, _) = c
        .complete(json!({"prompt": prompt_a, "max_tokens": 1}))
        .await;
    assert_eq!(status, 200);
    wait_for("prompt A indexed from events", async || {
        c.cluster().await["workers"][0]["indexed_blocks"].as_u64() >= Some(6)
    })
    .await;

    c.relays[0].set_cut(true);
    wait_for("the controller sees the worker down", async || {
        c.cluster().await["workers"][0]["healthy"] == false
    })
    .await;
    // The worker caches prompt B while the controller cannot hear it: those
    // events are lost to the controller.
    let r = c
        .http
        .post(format!("{worker_url}/v1/completions"))
        .json(&json!({"prompt": prompt_b, "max_tokens": 1}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let (_, _, before, _) = c
        .complete(json!({"prompt": prompt_b, "max_tokens": 1}))
        .await;
    assert!(before.is_empty(), "no healthy worker while cut: {before}");

    c.relays[0].set_cut(false);
    wait_for("resubscribed with a fresh snapshot", async || {
        c.metric("pie_controller_kv_snapshots_total").await == 2.0
            && c.cluster().await["workers"][0]["healthy"] == true
    })
    .await;
    let (status, _, route, _) = c
        .complete(json!({"prompt": prompt_b, "max_tokens": 1}))
        .await;
    assert_eq!(status, 200);
    assert_eq!(
        cached_in_reason(&route),
        96,
        "prompt B's 6 pages are known from the snapshot: {route}"
    );
}

/// `n` streamed completions with `props` through the controller, their
/// bodies held unread, each keeping a slot (demand the actors see). The
/// workers' steps are slowed first: an unread stream does not stop its
/// process (the worker's events are unbounded), and the tiny model can run
/// 2,000 tokens in a second or two, which freed a slot under a queued
/// request in fresh-clone CI. At 20 ms a step a hold outlasts any `wait_for`.
async fn held_through_controller(c: &Cluster, n: usize, props: Value) -> Vec<reqwest::Response> {
    slow_steps(c, 20).await;
    common::hold_streams(&c.http, &c.controller.url, n, props).await
}

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

#[tokio::test]
async fn a_fair_queue_serves_the_client_with_fewer_requests_in_flight_first() {
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
    let queued = async || {
        call_as(&c, reqwest::Method::GET, "/v1/cluster", "sk-root", None)
            .await
            .1["queued"]
            .clone()
    };
    // Alice holds both slots, then queues two more; bob queues one after her.
    let mut holds = held_through_controller(&c, 2, json!({})).await;
    let done = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let mut tasks = Vec::new();
    for (i, (name, key)) in [
        ("alice-1", "sk-alice"),
        ("alice-2", "sk-alice"),
        ("bob-1", "sk-bob"),
    ]
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
        wait_for("queued", async || queued().await == i + 1).await;
    }
    // One slot frees while alice still has a request in flight: bob goes first.
    holds.pop();
    for t in tasks {
        t.await.unwrap();
    }
    assert_eq!(*done.lock().unwrap(), ["bob-1", "alice-1", "alice-2"]);
}

/// A streamed completion through the controller: its text, and whether it
/// ended with `[DONE]` and no error event.
async fn stream_text(r: reqwest::Response) -> (String, bool, String) {
    stream_text_after(r, String::new()).await
}

/// `stream_text` of a stream whose first bytes, `raw`, were already read.
async fn stream_text_after(mut r: reqwest::Response, mut raw: String) -> (String, bool, String) {
    while let Ok(Some(chunk)) = r.chunk().await {
        raw.push_str(&String::from_utf8_lossy(&chunk));
    }
    let mut text = String::new();
    for data in raw.split("\n\n").filter_map(|e| e.strip_prefix("data: ")) {
        if let Ok(v) = serde_json::from_str::<Value>(data) {
            text += v["choices"][0]["text"].as_str().unwrap_or_default();
            text += v["choices"][0]["delta"]["content"]
                .as_str()
                .unwrap_or_default();
        }
    }
    let clean = raw.trim_end().ends_with("data: [DONE]") && !raw.contains("\"error\"");
    (text, clean, raw)
}

/// `n` long completions (greedy, or seeded at temperature 1) through the
/// controller, started at once; every third one not streamed (the controller
/// streams it to the workers so that it can move, and gathers the answer).
/// Each task gives the text, whether it ended cleanly and the raw answer.
fn stream_load(c: &Cluster, n: usize, seeded: bool) -> Vec<tokio::task::JoinHandle<Served>> {
    (0..n)
        .map(|i| {
            let (http, url) = (c.http.clone(), c.controller.url.clone());
            tokio::spawn(async move {
                let stream = !is_whole(i);
                let r = http
                    .post(format!("{url}/v1/completions"))
                    .json(&load_body(i, seeded, stream))
                    .send()
                    .await
                    .unwrap();
                assert_eq!(r.status(), 200, "request {i}");
                let (text, clean, raw) = if stream {
                    stream_text(r).await
                } else {
                    whole_text(r, 1000).await
                };
                Served { text, clean, raw }
            })
        })
        .collect()
}

/// Request `i` of `stream_load` asks for one JSON answer.
fn is_whole(i: usize) -> bool {
    i % 3 == 2
}

struct Served {
    text: String,
    clean: bool,
    raw: String,
}

/// A non-streamed completion's text, whether it is a whole answer of
/// `max_tokens` tokens, and its body.
async fn whole_text(r: reqwest::Response, max_tokens: u64) -> (String, bool, String) {
    let raw = r.text().await.unwrap();
    let v: Value = serde_json::from_str(&raw).unwrap_or_default();
    let text = v["choices"][0]["text"].as_str().unwrap_or_default();
    let clean = v["object"] == "text_completion"
        && v["choices"][0]["finish_reason"] == "length"
        && v["usage"]["completion_tokens"] == max_tokens;
    (text.to_string(), clean, raw)
}

fn load_body(i: usize, seeded: bool, stream: bool) -> Value {
    let mut body = json!({"prompt": format!("request number {i} says"), "max_tokens": 1000, "ignore_eos": true, "stream": stream, "temperature": 0});
    if seeded {
        body["temperature"] = json!(1.0);
        body["seed"] = json!(i);
    }
    body
}

/// What request `i` of `stream_load` generates undisturbed on one worker.
async fn undisturbed(c: &Cluster, worker_url: &str, i: usize, seeded: bool) -> String {
    let v: Value = c
        .http
        .post(format!("{worker_url}/v1/completions"))
        .json(&load_body(i, seeded, false))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    v["choices"][0]["text"].as_str().unwrap().to_string()
}

/// Wait until w0 streams at least two requests, and a little longer.
async fn w0_streaming(c: &Cluster) {
    wait_for("w0 streaming", async || {
        c.cluster().await["workers"][0]["in_flight"].as_u64() >= Some(2)
    })
    .await;
    tokio::time::sleep(Duration::from_millis(100)).await;
}

/// Every request of `stream_load` ended cleanly with the text it has on w1
/// undisturbed.
async fn each_as_undisturbed(
    c: &Cluster,
    tasks: Vec<tokio::task::JoinHandle<Served>>,
    seeded: bool,
) {
    let survivor = c.workers[1].as_ref().unwrap().url.clone();
    for (i, t) in tasks.into_iter().enumerate() {
        let served = t.await.unwrap();
        assert!(
            served.clean,
            "request {i} saw an error or no end: {}",
            served.raw
        );
        assert_eq!(
            served.text,
            undisturbed(c, &survivor, i, seeded).await,
            "request {i} (seeded: {seeded})"
        );
    }
}

/// A non-streamed request moves like a stream: on a drain (handed off, its
/// pages pulled) and on a crash (resumed from the tokens so far), its one
/// JSON answer is the undisturbed one.
#[tokio::test]
async fn a_non_streamed_request_moves_on_drain_and_on_crash_with_the_same_answer() {
    let mut c = Cluster::start_with(Spec {
        worker_args: &["--kv-pages", "512"],
        ..Spec::new("least-loaded,drain-migrate")
    })
    .await;
    let survivor = c.workers[2].as_ref().unwrap().url.clone();
    let mut body = load_body(2, false, false);
    body["max_tokens"] = json!(900);
    let direct: Value = c
        .http
        .post(format!("{survivor}/v1/completions"))
        .json(&body)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let expected = direct["choices"][0]["text"].as_str().unwrap().to_string();
    slow_steps(&c, MOVE_STEP_MS).await;
    for crash in [false, true] {
        let (http, url, body) = (c.http.clone(), c.controller.url.clone(), body.clone());
        let task = tokio::spawn(async move {
            let r = http
                .post(format!("{url}/v1/completions"))
                .json(&body)
                .send()
                .await
                .unwrap();
            let worker = r.headers()["x-pie-worker"].to_str().unwrap().to_string();
            (worker, whole_text(r, 900).await)
        });
        let running = serving_worker(&c).await;
        drain_or_kill(&mut c, &running, crash).await;
        let (worker, (text, clean, raw)) = task.await.unwrap();
        assert!(clean, "crash: {crash}: {raw}");
        assert_eq!(text, expected, "crash: {crash}");
        assert_eq!(worker, running, "x-pie-worker names the first worker");
    }
    moved_on_drain_and_crash(&c).await;
}

/// A native process moves too: on a drain (handed off, its pages pulled)
/// and on a crash (resumed from the tokens the controller saw), by a
/// chat and a text completion. Its client's event stream through the
/// controller, opened before the move, goes on with every piece once and
/// ends `finished`; its id then answers from the new worker with the whole
/// output, the undisturbed one, under the id the client holds.
#[tokio::test]
async fn a_native_process_moves_on_drain_and_on_crash_and_its_id_and_events_go_on() {
    let mut c = Cluster::start_with(Spec {
        worker_args: &["--kv-pages", "512"],
        ..Spec::new("least-loaded,drain-migrate")
    })
    .await;
    let survivor = c.workers[2].as_ref().unwrap().url.clone();
    let text = json!({"inferlet": "text-completion", "args": {"prompt": "request number 5 says", "max_tokens": 900, "ignore_eos": true, "temperature": 0}});
    let chat = json!({"inferlet": "chat", "args": {"messages": [{"role": "user", "content": "tell a long story"}], "max_tokens": 900, "ignore_eos": true, "temperature": 0}});
    let runs = [&text, &chat].map(|launch| native_output(&c.http, &survivor, launch));
    let expected = futures_util::future::join_all(runs).await;
    slow_steps(&c, MOVE_STEP_MS).await;
    for ((crash, launch), expected) in [(false, text), (true, chat)].into_iter().zip(expected) {
        let (status, v) = post_json(&c.controller.url, "/v1/processes", None, &launch).await;
        assert_eq!(status, 201, "{v}");
        let id = v["id"].as_str().unwrap().to_string();
        let first = id.split('~').next().unwrap().to_string();
        let events = c
            .http
            .get(format!("{}/v1/processes/{id}/events", c.controller.url))
            .send()
            .await
            .unwrap();
        assert_eq!(events.status(), 200);
        let reading = tokio::spawn(native_events(events));
        serving_worker(&c).await;
        drain_or_kill(&mut c, &first, crash).await;
        let (streamed, state) = reading.await.unwrap();
        assert_eq!(state, "finished", "crash: {crash}");
        assert_eq!(streamed, expected, "crash: {crash}: the events");
        let r = c
            .http
            .get(format!("{}/v1/processes/{id}", c.controller.url))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        assert_ne!(r.headers()["x-pie-worker"], first.as_str());
        let v: Value = r.json().await.unwrap();
        assert_eq!(v["id"], id.as_str());
        assert_eq!(v["state"], "finished");
        assert_eq!(v["output"], expected.as_str(), "crash: {crash}: the record");
        assert_eq!(v["usage"]["completion_tokens"], 900);
    }
    moved_on_drain_and_crash(&c).await;
}

/// A native process whose worker only lost the controller's connections
/// (alive, still running it) is killed there before it goes on elsewhere,
/// so it never runs twice: the old copy's record says `killed`, and its id
/// answers from the new worker with the undisturbed output.
#[tokio::test]
async fn a_native_process_cut_off_from_the_controller_is_killed_before_it_goes_on() {
    let c = Cluster::start_with(Spec {
        worker_args: &["--kv-pages", "512"],
        relayed: true,
        ..Spec::new("least-loaded")
    })
    .await;
    let launch = json!({"inferlet": "text-completion", "args": {"prompt": "request number 7 says", "max_tokens": 900, "ignore_eos": true, "temperature": 0}});
    let expected = native_output(&c.http, &c.url_of("w2"), &launch).await;
    slow_steps(&c, MOVE_STEP_MS).await;
    let (status, v) = post_json(&c.controller.url, "/v1/processes", None, &launch).await;
    assert_eq!(status, 201, "{v}");
    let id = v["id"].as_str().unwrap().to_string();
    let (first, local) = id.split_once('~').unwrap();
    // The old copy must still be running when the controller kills it: at
    // 2 ms a step it finished first on a loaded CI machine (900 tokens, 2 s).
    slow_worker_steps(&c.url_of(first), 10).await;
    serving_worker(&c).await;
    let slot: usize = first.trim_start_matches('w').parse().unwrap();
    c.relays[slot].drop_connections();
    let (worker, record) = finished_record(&c, &id).await;
    assert_ne!(worker, first, "it went on elsewhere");
    assert_eq!(record["output"], expected.as_str());
    let old = common::get_json(&format!("{}/v1/processes/{local}", c.url_of(first))).await;
    assert_eq!(old["state"], "killed", "the old copy: {old}");
    let moved = "pie_controller_streams_moved_total{reason=\"crash\"}";
    assert!(labelled_metric(&c, moved).await >= Some(1.0));
}

/// A native chat resuming a session moves with its earlier turns: drained
/// mid-way through its second turn, it goes on with the output that turn
/// has where the whole session ran undisturbed, and the session's third
/// turn follows it and sees both earlier turns.
#[tokio::test]
async fn a_native_chat_session_moves_with_its_earlier_turns() {
    let mut c = Cluster::start_with(Spec {
        worker_args: &["--kv-pages", "512"],
        ..Spec::new("session-affinity,least-loaded,drain-migrate")
    })
    .await;
    let turn = |session: &str, content: &str, max_tokens: u64| json!({"inferlet": "chat", "props": {"session": session}, "args": {"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens, "ignore_eos": true, "temperature": 0}});
    let turns = [
        ("my name is Ada", 8),
        ("tell a long story", 900),
        ("what is my name", 4),
    ];
    let direct = c.workers[2].as_ref().unwrap().url.clone();
    let mut expected = Vec::new();
    for (content, max_tokens) in turns {
        let launch = turn("direct", content, max_tokens);
        expected.push(native_record(&c.http, &direct, &launch).await);
    }
    let (first, _) = native_run(&c, &turn("s1", turns[0].0, turns[0].1)).await;
    slow_steps(&c, MOVE_STEP_MS).await;
    let (status, v) = post_json(
        &c.controller.url,
        "/v1/processes",
        None,
        &turn("s1", turns[1].0, turns[1].1),
    )
    .await;
    assert_eq!(status, 201, "{v}");
    let id = v["id"].as_str().unwrap().to_string();
    assert!(
        id.starts_with(&format!("{first}~")),
        "session-affinity: {id}"
    );
    assert!(
        v.get("pie_session_turns").is_none(),
        "the turns are the controller's: {v}"
    );
    serving_worker(&c).await;
    drain_or_kill(&mut c, &first, false).await;
    let (worker, record) = finished_record(&c, &id).await;
    assert_ne!(worker, first, "the second turn moved");
    assert_eq!(record["output"], expected[1]["output"]);
    assert_eq!(
        record["usage"]["prompt_tokens"],
        expected[1]["usage"]["prompt_tokens"]
    );
    let (third_worker, third) = native_run(&c, &turn("s1", turns[2].0, turns[2].1)).await;
    assert_eq!(third_worker, worker, "the session's next turn follows it");
    assert_eq!(
        third["usage"]["prompt_tokens"], expected[2]["usage"]["prompt_tokens"],
        "the third turn sees both earlier turns"
    );
    assert_eq!(third["output"], expected[2]["output"]);
}

/// Launch `launch` through the controller and wait for its record to be
/// final: the worker that answers for it, and the record.
async fn native_run(c: &Cluster, launch: &Value) -> (String, Value) {
    let (status, v) = post_json(&c.controller.url, "/v1/processes", None, launch).await;
    assert_eq!(status, 201, "{v}");
    finished_record(c, v["id"].as_str().unwrap()).await
}

/// The record of process `id` through the controller once it is final, and
/// the worker that answered for it.
async fn finished_record(c: &Cluster, id: &str) -> (String, Value) {
    let get = async || {
        let r = c
            .http
            .get(format!("{}/v1/processes/{id}", c.controller.url))
            .send()
            .await
            .unwrap();
        let worker = r.headers()["x-pie-worker"].to_str().unwrap().to_string();
        (worker, r.json::<Value>().await.unwrap())
    };
    wait_for("the process final", async || {
        get().await.1["state"] == "finished"
    })
    .await;
    get().await
}

/// The record of native process `launch` run to its end on the worker at
/// `url` (its events read to the end: their text is its output).
async fn native_record(http: &reqwest::Client, url: &str, launch: &Value) -> Value {
    let v: Value = http
        .post(format!("{url}/v1/processes"))
        .json(launch)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let id = v["id"].as_str().unwrap();
    let events = http
        .get(format!("{url}/v1/processes/{id}/events"))
        .send()
        .await
        .unwrap();
    let (text, state) = native_events(events).await;
    assert_eq!(state, "finished");
    let record: Value = http
        .get(format!("{url}/v1/processes/{id}"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(record["output"], text.as_str());
    record
}

/// The output of native process `launch` run to its end on the worker at `url`.
async fn native_output(http: &reqwest::Client, url: &str, launch: &Value) -> String {
    let record = native_record(http, url, launch).await;
    record["output"].as_str().unwrap().to_string()
}

/// A native event stream's text, and the state of its last status event.
async fn native_events(mut r: reqwest::Response) -> (String, String) {
    let mut raw = String::new();
    while let Ok(Some(chunk)) = r.chunk().await {
        raw.push_str(&String::from_utf8_lossy(&chunk));
    }
    let (mut text, mut state) = (String::new(), String::new());
    for event in raw.split("\n\n") {
        let data = event.lines().find_map(|l| l.strip_prefix("data: "));
        let Some(v) = data.and_then(|d| serde_json::from_str::<Value>(d).ok()) else {
            continue;
        };
        if event.starts_with("event: text") {
            text += v["text"].as_str().unwrap_or_default();
        } else if event.starts_with("event: status") {
            state = format!(
                "{}{}",
                v["state"].as_str().unwrap_or_default(),
                v["error"]
                    .as_str()
                    .map(|e| format!(": {e}"))
                    .unwrap_or_default()
            );
        }
    }
    (text, state)
}

/// Drain worker `name` of `c` by its route, or kill it (-9) for a `crash`.
async fn drain_or_kill(c: &mut Cluster, name: &str, crash: bool) {
    let slot = name.trim_start_matches('w').parse::<usize>().unwrap();
    if crash {
        c.workers[slot] = None;
        return;
    }
    let url = c.workers[slot].as_ref().unwrap().url.clone();
    let (status, _) = post_json(&url, "/v1/admin/drain", None, &json!({})).await;
    assert_eq!(status, 202);
}

/// The controller counted a move on a drain and one on a crash.
async fn moved_on_drain_and_crash(c: &Cluster) {
    for reason in ["drain", "crash"] {
        let moved = format!("pie_controller_streams_moved_total{{reason=\"{reason}\"}}");
        assert!(labelled_metric(c, &moved).await >= Some(1.0), "{reason}");
    }
}

/// The step delay of the tests that drain or kill a worker under a
/// 900- or 1,000-token request: 4.5 s or more of steps, so it is still running when
/// the move lands on a loaded CI machine (2 ms, 1.8 s, left little room).
const MOVE_STEP_MS: u64 = 5;

/// Every worker of `c` pauses `delay_ms` before each engine step (the
/// test model is so fast that a 1,000-token process would end before a
/// test could move it).
async fn slow_steps(c: &Cluster, delay_ms: u64) {
    for w in c.workers.iter().flatten() {
        slow_worker_steps(&w.url, delay_ms).await;
    }
}

/// The worker at `url` pauses `delay_ms` before each engine step.
async fn slow_worker_steps(url: &str, delay_ms: u64) {
    let fault = json!({"fault": "slow-steps", "delay_ms": delay_ms});
    let (status, _) = post_json(url, "/v1/admin/fault", None, &fault).await;
    assert_eq!(
        status, 200,
        "the pie binary lacks the fault route: build it with `--features pie-worker/fault-injection`"
    );
}

/// The one worker with a request in flight, once it has generated a little.
async fn serving_worker(c: &Cluster) -> String {
    let mut name = String::new();
    wait_for("one request in flight", async || {
        let cluster = c.cluster().await;
        let busy = cluster["workers"]
            .as_array()
            .unwrap()
            .iter()
            .find(|w| w["in_flight"].as_u64() >= Some(1));
        name = busy
            .map(|w| w["name"].as_str().unwrap().to_string())
            .unwrap_or_default();
        !name.is_empty()
    })
    .await;
    tokio::time::sleep(Duration::from_millis(50)).await;
    name
}

#[tokio::test]
async fn killing_a_worker_mid_stream_loses_nothing_its_streams_resume_elsewhere() {
    let mut c = Cluster::start_with(Spec {
        worker_args: &["--kv-pages", "512", "--max-running", "2"],
        ..Spec::new("least-loaded")
    })
    .await;
    let tasks = stream_load(&c, 24, false);
    w0_streaming(&c).await;
    c.workers[0] = None; // kill -9: no chance to migrate
    each_as_undisturbed(&c, tasks, false).await;
    assert!(
        labelled_metric(&c, "pie_controller_streams_moved_total{reason=\"crash\"}").await
            >= Some(1.0)
    );
}

#[tokio::test]
async fn a_draining_worker_hands_its_streams_off_and_exits_with_identical_transcripts() {
    for seeded in [false, true] {
        let mut c = Cluster::start_with(Spec {
            worker_args: &["--kv-pages", "512", "--max-running", "4"],
            ..Spec::new("least-loaded,drain-migrate")
        })
        .await;
        let w0 = c.workers[0].as_ref().unwrap().url.clone();
        // On a fast CPU w0's streams could end before the drain moves them
        // (CI saw it); the streams moved to w1 and w2 run at full speed.
        slow_worker_steps(&w0, MOVE_STEP_MS).await;
        let tasks = stream_load(&c, 6, seeded);
        w0_streaming(&c).await;
        if seeded {
            let pid = c.workers[0].as_ref().unwrap().pid().to_string();
            assert!(Command::new("kill")
                .args(["-TERM", &pid])
                .status()
                .unwrap()
                .success());
            wait_for("w0 draining", async || {
                reqwest::get(format!("{w0}/health")).await.unwrap().status() == 503
            })
            .await;
        } else {
            let (status, body) = post_json(&w0, "/v1/admin/drain", None, &json!({})).await;
            assert_eq!((status, body["draining"].clone()), (202, json!(true)));
        }
        let health = reqwest::get(format!("{w0}/health")).await.unwrap();
        assert_eq!(health.status(), 503);
        assert_eq!(health.json::<Value>().await.unwrap()["status"], "draining");
        assert_eq!(
            reqwest::get(format!("{w0}/livez")).await.unwrap().status(),
            200
        );
        each_as_undisturbed(&c, tasks, seeded).await;
        assert!(
            labelled_metric(&c, "pie_controller_streams_moved_total{reason=\"drain\"}").await
                >= Some(1.0),
            "{}",
            c.get_text("/metrics").await
        );
        // The targets pulled the pages instead of computing them.
        let mut pulled = 0.0;
        for w in &c.workers[1..] {
            pulled += worker_metric(
                &w.as_ref().unwrap().url,
                "pie_kv_transfer_pages_total{direction=\"in\"}",
            )
            .await;
        }
        assert!(pulled > 0.0, "no page moved");
        wait_for("the drained worker exits", async || {
            c.workers[0].as_mut().unwrap().exited()
        })
        .await;
    }
}

/// `relocate` on a PATCH: a stream's process, by the id its client holds
/// (`WORKER~ID`: the worker named by `x-pie-worker`, the id in its chunks),
/// gets a `pin` naming the other worker through the controller: the stream
/// moves there with the undisturbed transcript, the same id then finds the
/// process where it runs now, with the new pin.
#[tokio::test]
async fn a_patched_pin_moves_the_stream_and_its_id_stays_valid() {
    let c = Cluster::start_with(Spec {
        workers: 2,
        ..Spec::new("least-loaded")
    })
    .await;
    let mut body = load_body(0, false, true);
    let (mut r, from, to) = long_stream(&c, &mut body).await;
    let mut raw = String::new();
    let local = loop {
        raw.push_str(&String::from_utf8_lossy(&r.chunk().await.unwrap().unwrap()));
        let first = raw.split("\n\n").find_map(|e| e.strip_prefix("data: "));
        if let Some(v) = first.and_then(|d| serde_json::from_str::<Value>(d).ok()) {
            break v["id"]
                .as_str()
                .unwrap()
                .trim_start_matches("cmpl-")
                .to_string();
        }
    };
    let id = format!("{from}~{local}");
    let reading = tokio::spawn(stream_text_after(r, raw));
    let r = c
        .http
        .patch(format!("{}/v1/processes/{id}", c.controller.url))
        .json(&json!({"props": {"pin": to}}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["x-pie-relocating"], to);
    let process = async || {
        let r = c
            .http
            .get(format!("{}/v1/processes/{id}", c.controller.url))
            .send()
            .await
            .unwrap();
        let worker = r.headers()["x-pie-worker"].to_str().unwrap().to_string();
        (r.status(), worker, r.json::<Value>().await.unwrap())
    };
    wait_for("the id answered by the pinned worker", async || {
        let (status, worker, _) = process().await;
        status == 200 && worker == to
    })
    .await;
    let (_, _, v) = process().await;
    assert_eq!(
        v["props"]["pin"], to,
        "the new worker has the new props: {v}"
    );
    relocated_as_undisturbed(&c, &body, reading).await;
}

/// `body` made 3,000 tokens long, streamed through the controller of two
/// workers: the response, the worker serving it and the other one.
async fn long_stream(c: &Cluster, body: &mut Value) -> (reqwest::Response, String, &'static str) {
    body["max_tokens"] = json!(3000);
    let r = c
        .http
        .post(format!("{}/v1/completions", c.controller.url))
        .json(&body)
        .send()
        .await
        .unwrap();
    let from = r.headers()["x-pie-worker"].to_str().unwrap().to_string();
    let to = if from == "w0" { "w1" } else { "w0" };
    (r, from, to)
}

/// The relocated stream `reading` ends cleanly with the transcript `body`
/// gives undisturbed (sent to a worker directly, without its session), and
/// the controller counted the relocation.
async fn relocated_as_undisturbed(
    c: &Cluster,
    body: &Value,
    reading: tokio::task::JoinHandle<(String, bool, String)>,
) {
    let (text, clean, raw) = reading.await.unwrap();
    assert!(clean, "{raw}");
    let worker_url = c.workers[0].as_ref().unwrap().url.clone();
    let mut direct = body.clone();
    direct["stream"] = json!(false);
    direct.as_object_mut().unwrap().remove("session");
    let v: Value = c
        .http
        .post(format!("{worker_url}/v1/completions"))
        .json(&direct)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(text, v["choices"][0]["text"].as_str().unwrap());
    let moved = "pie_controller_streams_moved_total{reason=\"relocate\"}";
    assert!(labelled_metric(c, moved).await >= Some(1.0));
}

#[tokio::test]
async fn relocate_moves_a_sessions_stream_to_the_named_worker_with_the_same_transcript() {
    let c = Cluster::start_with(Spec {
        workers: 2,
        ..Spec::new("session-affinity,least-loaded")
    })
    .await;
    let mut body = load_body(0, true, true);
    body["session"] = json!("chat-7");
    let (r, _, to) = long_stream(&c, &mut body).await;
    let reading = tokio::spawn(stream_text(r));
    let relocate = |session: &str, worker: &str| {
        let (http, url) = (c.http.clone(), c.controller.url.clone());
        let (session, worker) = (session.to_string(), worker.to_string());
        async move {
            let r = http
                .post(format!("{url}/v1/cluster/sessions/{session}/relocate"))
                .json(&json!({"worker": worker}))
                .send()
                .await
                .unwrap();
            (r.status().as_u16(), r.json::<Value>().await.unwrap())
        }
    };
    let (status, v) = relocate("chat-7", to).await;
    assert_eq!((status, v["moving"].clone()), (202, json!(1)), "{v}");
    let (status, v) = relocate("chat-7", "nowhere").await;
    assert_eq!(status, 404);
    assert!(error_message(&v).contains("`nowhere`"), "{v}");
    let (status, v) = relocate("no-such-session", to).await;
    assert_eq!(status, 404);
    assert!(error_message(&v).contains("no-such-session"), "{v}");
    relocated_as_undisturbed(&c, &body, reading).await;
    // The session's next turn follows it.
    let (_, worker, route, _) = c
        .complete(json!({"prompt": "next", "max_tokens": 2, "session": "chat-7"}))
        .await;
    assert_eq!(worker, to, "{route}");
}

/// A worker config whose only key is the controller's (`sk-ctl`, role worker).
fn worker_config_trusting_the_controller(tag: &str) -> PathBuf {
    let path = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("worker-{tag}-{}.toml", std::process::id()));
    std::fs::write(
        &path,
        "[server]\napi_keys = [{ name = \"controller\", key = \"sk-ctl\", role = \"worker\" }]\n",
    )
    .unwrap();
    path
}

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

/// (status, body) of a controller request made with `key`.
async fn call_as(
    c: &Cluster,
    method: reqwest::Method,
    path: &str,
    key: &str,
    body: Option<Value>,
) -> (u16, Value) {
    let mut req = c
        .http
        .request(method, format!("{}{path}", c.controller.url))
        .bearer_auth(key);
    if let Some(b) = body {
        req = req.json(&b);
    }
    let r = req.send().await.unwrap();
    (r.status().as_u16(), r.json().await.unwrap_or(Value::Null))
}

fn error_message(body: &Value) -> String {
    body["error"]["message"].as_str().unwrap_or("").to_string()
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

/// The value of a labelled controller metric line `name{labels}`, if present.
async fn labelled_metric(c: &Cluster, series: &str) -> Option<f64> {
    pie_client::prom::sum(&c.get_text("/metrics").await, series)
}

/// Where `scale_cluster(dry_run)` writes its scale history.
fn scale_history(dry_run: bool) -> PathBuf {
    PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!(
        "scale-history-{dry_run}-{}.jsonl",
        std::process::id()
    ))
}

/// Two workers, w0 labelled `gold`, w1 unlabelled (the default group); one gold
/// worker per gold process wanted; `dry_run` as given; the history in
/// `scale_history(dry_run)`.
async fn scale_cluster(dry_run: bool) -> Cluster {
    let history = scale_history(dry_run);
    let _ = std::fs::remove_file(&history);
    let cluster_config = format!(
        "actor_tick_ms = 10\nscale_history_file = {:?}\n\
         [cluster.scale-by-prop]\nprop = \"tier\"\n\
         target_load_per_worker = 1\nmax_workers = 8\npending_timeout_ms = 600000\n\
         dry_run = {dry_run}\n",
        history.display().to_string()
    );
    Cluster::start_with(Spec {
        workers: 2,
        cluster_config: &cluster_config,
        groups: &["gold", ""],
        ..Spec::new("cache-aware,scale-by-prop")
    })
    .await
}

/// The newest `scale-hint` for `group` in `GET /v1/cluster/actions`.
async fn newest_hint(c: &Cluster, group: &str) -> Option<Value> {
    let log: Value = serde_json::from_str(&c.get_text("/v1/cluster/actions").await).unwrap();
    assert_eq!(log["actors"], json!(["scale-by-prop"]));
    log["actions"]
        .as_array()
        .unwrap()
        .iter()
        .find(|a| a["kind"] == "scale-hint" && a["action"]["group"] == group)
        .cloned()
}

/// Six gold requests held open.
async fn gold_load(c: &Cluster) -> Vec<reqwest::Response> {
    held_through_controller(c, 6, json!({"tier": "gold"})).await
}

#[tokio::test]
async fn scale_by_prop_publishes_one_step_under_load_and_holds_while_pending() {
    let c = scale_cluster(false).await;
    let holds = gold_load(&c).await;
    // Gold processes want a gold worker each; 1 exists: one step, to 2.
    wait_for("the gold hint", async || {
        labelled_metric(&c, "pie_cluster_scale_recommended{group=\"gold\"}").await == Some(2.0)
    })
    .await;
    drop(holds);
    // No autoscaler adds the worker: the step stays pending, even with no load
    // left, for `pending_timeout_ms`.
    wait_for("the pending hint", async || {
        newest_hint(&c, "gold").await.is_some_and(|h| {
            h["reason"]
                .as_str()
                .unwrap()
                .starts_with("previous-step-pending")
        })
    })
    .await;
    let hint = newest_hint(&c, "gold").await.expect("a gold hint");
    assert_eq!(hint["actor"], "scale-by-prop");
    assert_eq!(hint["dry_run"], false);
    assert_eq!(hint["outcome"], "executed", "{hint}");
    assert_eq!(hint["action"]["recommended"], 2, "{hint}");
    assert_eq!(hint["action"]["current"], 1, "{hint}");
    let log: Value = serde_json::from_str(&c.get_text("/v1/cluster/actions").await).unwrap();
    let step = log["actions"]
        .as_array()
        .unwrap()
        .iter()
        .find(|a| {
            a["reason"]
                .as_str()
                .unwrap()
                .starts_with("load-above-target")
        })
        .cloned()
        .expect("the step up is in the log");
    assert_eq!(step["action"]["group"], "gold", "{step}");
    assert!(step["action"]["value"].as_f64().unwrap() >= 2.0, "{step}");
    for (series, want) in [
        ("pie_cluster_scale_recommended{group=\"gold\"}", 2.0),
        ("pie_cluster_scale_current{group=\"gold\"}", 1.0),
        ("pie_cluster_scale_recommended{group=\"default\"}", 1.0),
        ("pie_cluster_scale_current{group=\"default\"}", 1.0),
    ] {
        assert_eq!(labelled_metric(&c, series).await, Some(want), "{series}");
    }
    let scale: Value = serde_json::from_str(&c.get_text("/v1/cluster/scale").await).unwrap();
    let gold = scale["groups"]
        .as_array()
        .unwrap()
        .iter()
        .find(|g| g["group"] == "gold")
        .cloned()
        .expect("gold published");
    assert_eq!(
        (gold["recommended"].as_u64(), gold["current"].as_u64()),
        (Some(2), Some(1))
    );
    // The load when the pending hint was made: 0 to 6 as the streams ended.
    assert_eq!(gold["signal"], "load");
    assert!(gold["value"].as_f64().is_some_and(|v| v <= 6.0), "{gold}");
    let counted = labelled_metric(
        &c,
        "pie_cluster_actions_total{actor=\"scale-by-prop\",kind=\"scale-hint\",dry_run=\"false\"}",
    )
    .await;
    assert!(counted.is_some_and(|n| n >= 3.0), "{counted:?}");
    let history = std::fs::read_to_string(scale_history(false)).unwrap();
    let lines: Vec<Value> = history
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let gold: Vec<_> = lines.iter().filter(|l| l["group"] == "gold").collect();
    assert!(
        gold.iter().any(|l| l["recommended"] == 2
            && l["current"] == 1
            && l["reason"]
                .as_str()
                .unwrap()
                .starts_with("load-above-target")),
        "the step up in the history: {history}"
    );
    assert!(
        lines
            .windows(2)
            .all(|w| w[0]["at_ms"].as_u64() <= w[1]["at_ms"].as_u64()),
        "in order: {history}"
    );
    assert_eq!(
        lines.len() as f64,
        counted.unwrap(),
        "a line per hint published"
    );
}

#[tokio::test]
async fn scale_by_prop_in_dry_run_records_hints_and_publishes_nothing() {
    let c = scale_cluster(true).await;
    let holds = gold_load(&c).await;
    wait_for("the gold hint recorded", async || {
        newest_hint(&c, "gold")
            .await
            .is_some_and(|h| h["action"]["recommended"] == 2)
    })
    .await;
    drop(holds);
    let hint = newest_hint(&c, "gold").await.expect("a gold hint");
    assert_eq!(
        (&hint["dry_run"], &hint["outcome"]),
        (&json!(true), &json!("dry-run"))
    );
    let metrics = c.get_text("/metrics").await;
    assert!(
        !metrics.contains("pie_cluster_scale_recommended{"),
        "{metrics}"
    );
    assert!(!metrics.contains("pie_cluster_scale_current{"), "{metrics}");
    let history = std::fs::read_to_string(scale_history(true)).unwrap_or_default();
    assert!(history.is_empty(), "a dry run writes no history: {history}");
    assert!(metrics.contains(
        "pie_cluster_actions_total{actor=\"scale-by-prop\",kind=\"scale-hint\",dry_run=\"true\"}"
    ));
    let scale: Value = serde_json::from_str(&c.get_text("/v1/cluster/scale").await).unwrap();
    assert_eq!(scale["groups"], json!([]));
}

#[test]
fn bad_actor_configs_are_refused_naming_the_file_and_key() {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"));
    for (name, text, wanted) in [
        (
            "unknown-actor",
            "[cluster]\ncluster_policies = [\"cache-aware\", \"retain-none\"]\n",
            &["key `cluster.cluster_policies`", "`retain-none`", "cache-aware", "scale-by-prop"][..],
        ),
        (
            "bad-key",
            "[cluster]\ncluster_policies = [\"scale-by-prop\"]\n[cluster.scale-by-prop]\ntargett = 3\n",
            &["key `cluster.scale-by-prop.targett`"][..],
        ),
        (
            "bad-value",
            "[cluster]\ncluster_policies = [\"scale-by-prop\"]\n[cluster.scale-by-prop]\nhysteresis = 1.5\n",
            &["key `cluster.scale-by-prop.hysteresis`"][..],
        ),
        (
            "bad-pool-weight",
            "[cluster]\ncluster_policies = [\"cache-aware\"]\n[cluster.cache-aware]\npool_weight = 1.5\n",
            &["key `cluster.cache-aware.pool_weight`", "[0, 1)"][..],
        ),
        (
            "bad-pool-url",
            "[cluster]\npool = \"localhost:8090\"\n",
            &["key `cluster.pool`", "not an http(s) URL"][..],
        ),
        (
            "bad-history-file",
            "[cluster]\nscale_history_file = \"/no/such/dir/history.jsonl\"\n",
            &["key `cluster.scale_history_file`", "/no/such/dir/history.jsonl"][..],
        ),
    ] {
        let file = dir.join(format!("actor-config-{}-{name}.toml", std::process::id()));
        std::fs::write(&file, text).unwrap();
        let out = Command::new(bin("pie-controller"))
            .args(["--port", "0", "--config", file.to_str().unwrap()])
            .output()
            .unwrap();
        assert!(!out.status.success(), "{name}: started");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(file.to_str().unwrap()), "{name}: {err}");
        for w in wanted {
            assert!(err.contains(w), "{name}: `{w}` not in {err}");
        }
    }
}

/// A worker that answers polls (until its engine "dies": then 503) but never
/// answers a completion, except one whose body says "stall": one event, then
/// silence. Its n-th KV event subscription sends a snapshot of
/// `kv_blocks[n]` blocks and then nothing, not even a keep-alive.
struct FakeWorker {
    url: String,
    engine_dead: std::sync::Arc<std::sync::atomic::AtomicBool>,
    /// Its `/v1/internal/kv/prefetch` answers 500 (else 200 with no page).
    refuse_prefetch: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

impl FakeWorker {
    /// `full`: it reports its one running slot taken.
    async fn start(kv_blocks: &'static [u64], full: bool) -> FakeWorker {
        use axum::response::IntoResponse;
        use futures_util::StreamExt;
        use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
        use std::sync::Arc;

        fn silent_after(first: String) -> axum::response::Response {
            let body = futures_util::stream::once(async move { Ok::<_, std::io::Error>(first) })
                .chain(futures_util::stream::pending());
            (
                [("content-type", "text/event-stream")],
                axum::body::Body::from_stream(body),
            )
                .into_response()
        }
        let dead = Arc::new(AtomicBool::new(false));
        let refuse_prefetch = Arc::new(AtomicBool::new(false));
        let refuses = refuse_prefetch.clone();
        let subscriptions = Arc::new(AtomicUsize::new(0));
        // The controller admits workers of its own model only.
        let fingerprint = pie_model::gguf::GgufFile::open(&model())
            .unwrap()
            .fingerprint
            .0;
        let is_dead = dead.clone();
        let app = axum::Router::new()
            .route(
                "/v1/internal/state",
                axum::routing::get(move || {
                    let dead = is_dead.load(Ordering::SeqCst);
                    async move {
                        if dead {
                            (
                                axum::http::StatusCode::SERVICE_UNAVAILABLE,
                                "engine panicked",
                            )
                                .into_response()
                        } else {
                            let busy = usize::from(full);
                            axum::Json(json!({"load": busy, "running": busy, "max_running": 1,
                                "fingerprint": fingerprint}))
                            .into_response()
                        }
                    }
                }),
            )
            .route(
                "/v1/internal/kv-events",
                axum::routing::get(move || {
                    let n = subscriptions.fetch_add(1, Ordering::SeqCst);
                    let blocks = kv_blocks[n.min(kv_blocks.len() - 1)];
                    let snapshot = json!({"seq": 1, "fingerprint": 1, "page_size": 16,
                        "hashes": (1..=blocks).collect::<Vec<u64>>()});
                    async move { silent_after(format!("event: snapshot\ndata: {snapshot}\n\n")) }
                }),
            )
            .route(
                "/v1/internal/kv/prefetch",
                axum::routing::post(move || {
                    let refuse = refuses.load(Ordering::SeqCst);
                    async move {
                        if refuse {
                            (axum::http::StatusCode::INTERNAL_SERVER_ERROR, "no").into_response()
                        } else {
                            axum::Json(json!({"pages": 0})).into_response()
                        }
                    }
                }),
            )
            .route(
                "/v1/completions",
                axum::routing::post(|body: String| async move {
                    if body.contains("pie_resume") {
                        (axum::http::StatusCode::SERVICE_UNAVAILABLE, "draining").into_response()
                    } else if body.contains("stall") {
                        silent_after("data: {\"choices\": [{\"text\": \"a\"}]}\n\n".into())
                    } else if body.contains("queue-full") {
                        let busy = json!({"error": {"message": "too many queued processes"}});
                        let retry = [("retry-after", "7")];
                        (
                            axum::http::StatusCode::TOO_MANY_REQUESTS,
                            retry,
                            axum::Json(busy),
                        )
                            .into_response()
                    } else {
                        std::future::pending().await
                    }
                }),
            );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        tokio::spawn(async move { axum::serve(listener, app).await });
        FakeWorker {
            url,
            engine_dead: dead,
            refuse_prefetch,
        }
    }

    /// `[cluster]` lines listing it as worker `name`.
    fn config(&self, name: &str) -> String {
        format!(
            "[[cluster.workers]]\nname = \"{name}\"\nurl = \"{}\"\n",
            self.url
        )
    }
}

/// A move that fails leaves the stream where it was, with its transcript:
/// the target refuses the prefetch (nothing was handed off: the process goes
/// on on its source), or refuses the resume after the hand-off (the source
/// still serves and resumes it from its own pages).
#[tokio::test]
async fn a_move_whose_target_fails_finishes_the_stream_on_its_source() {
    let hole = FakeWorker::start(&[0], false).await;
    let c = Cluster::start_with(Spec {
        workers: 1,
        cluster_config: &hole.config("hole"),
        ..Spec::new("pin,session-affinity,least-loaded")
    })
    .await;
    let w0 = c.workers[0].as_ref().unwrap().url.clone();
    for refuse_prefetch in [true, false] {
        hole.refuse_prefetch
            .store(refuse_prefetch, std::sync::atomic::Ordering::SeqCst);
        let session = format!("s-{refuse_prefetch}");
        let mut body = json!({"prompt": (0..700u32).map(|i| i % 200 + 1).collect::<Vec<_>>(),
            "max_tokens": 300, "temperature": 0, "ignore_eos": true, "stream": true});
        let mut routed = body.clone();
        routed["session"] = json!(session);
        routed["props"] = json!({"pin": "w0"});
        let r = c
            .http
            .post(format!("{}/v1/completions", c.controller.url))
            .json(&routed)
            .send()
            .await
            .unwrap();
        assert_eq!(r.headers()["x-pie-worker"], "w0");
        let reading = tokio::spawn(stream_text(r));
        let (status, v) = post_json(
            &c.controller.url,
            &format!("/v1/cluster/sessions/{session}/relocate"),
            None,
            &json!({"worker": "hole"}),
        )
        .await;
        assert_eq!(status, 202, "{v}");
        let (text, clean, raw) = reading.await.unwrap();
        assert!(clean, "{raw}");
        body["stream"] = json!(false);
        let (_, direct) = post_json(&w0, "/v1/completions", None, &body).await;
        assert_eq!(
            text,
            direct["choices"][0]["text"].as_str().unwrap(),
            "refused prefetch: {refuse_prefetch}"
        );
    }
    // The refused prefetch is a failed move; the refused resume went back to w0.
    let failed = labelled_metric(
        &c,
        "pie_controller_stream_move_failures_total{reason=\"relocate\"}",
    )
    .await;
    let moved = labelled_metric(
        &c,
        "pie_controller_streams_moved_total{reason=\"relocate\"}",
    )
    .await;
    assert_eq!(
        (failed, moved),
        (Some(1.0), Some(1.0)),
        "{}",
        c.get_text("/metrics").await
    );
}

/// The `/v1/cluster` entry of worker `name`.
async fn worker_entry(c: &Cluster, name: &str) -> Value {
    let cluster = c.cluster().await;
    let workers = cluster["workers"].as_array().unwrap();
    workers.iter().find(|w| w["name"] == name).unwrap().clone()
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

#[tokio::test]
async fn a_half_open_kv_stream_is_resubscribed_and_the_index_catches_up() {
    // The first subscription sends 2 blocks and falls silent; the second, 5.
    let fake = FakeWorker::start(&[2, 5], false).await;
    let config = format!("kv_idle_timeout_ms = 500\n{}", fake.config("fake"));
    let c = Cluster::start_with(Spec {
        workers: 0,
        cluster_config: &config,
        ..Spec::new("round-robin")
    })
    .await;
    wait_for("the first snapshot", async || {
        worker_entry(&c, "fake").await["indexed_blocks"] == 2
    })
    .await;
    let silent_since = Instant::now();
    wait_for("resubscribed with a fresh snapshot", async || {
        worker_entry(&c, "fake").await["indexed_blocks"] == 5
    })
    .await;
    assert!(silent_since.elapsed() >= Duration::from_millis(400));
    assert_eq!(c.metric("pie_controller_kv_snapshots_total").await, 2.0);
}

/// POST a completion; (status, Retry-After, body, how long it took).
async fn timed_completion(c: &Cluster, prompt: &str) -> (u16, String, Value, Duration) {
    let start = Instant::now();
    let r = c
        .http
        .post(format!("{}/v1/completions", c.controller.url))
        .json(&json!({"prompt": prompt, "max_tokens": 1}))
        .send()
        .await
        .unwrap();
    let status = r.status().as_u16();
    let retry_after = r
        .headers()
        .get("retry-after")
        .map(|v| v.to_str().unwrap().to_string())
        .unwrap_or_default();
    (
        status,
        retry_after,
        r.json().await.unwrap(),
        start.elapsed(),
    )
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

/// POST `body` to `url` + `path`, with `key` if any: (status, JSON body).
async fn post_json(url: &str, path: &str, key: Option<&str>, body: &Value) -> (u16, Value) {
    let mut req = reqwest::Client::new()
        .post(format!("{url}{path}"))
        .json(body);
    if let Some(key) = key {
        req = req.bearer_auth(key);
    }
    let r = req.send().await.unwrap();
    let status = r.status().as_u16();
    (status, r.json().await.unwrap_or(Value::Null))
}

/// A worker metric, read with the controller's worker key.
async fn worker_metric(url: &str, name: &str) -> f64 {
    let text = reqwest::Client::new()
        .get(format!("{url}/metrics"))
        .bearer_auth("sk-ctl")
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    pie_testkit::metric_value(&text, name)
}

/// Tokenize once: through the controller the worker uses the controller's
/// prompt ids (`pie_prompt_tokens`, counted), and greedy outputs are token for
/// token those of the same text sent to the worker directly: completions, chat
/// through its template, and stop strings. A native chat session is not
/// pretokenized; a client cannot send the field; every routed request is
/// timed once per part in `pie_controller_overhead_seconds`.
#[tokio::test]
async fn forwarded_prompt_tokens_give_the_outputs_of_text() {
    let worker_cfg = worker_config_trusting_the_controller("tokenize-once");
    let c = Cluster::start_with(Spec {
        workers: 1,
        worker_args: &["--config", worker_cfg.to_str().unwrap()],
        cluster_config: "worker_key = \"sk-ctl\"",
        ..Spec::new("least-loaded")
    })
    .await;
    let worker = c.workers[0].as_ref().unwrap().url.clone();
    let ctl = c.controller.url.clone();
    let counter = "pie_pretokenized_requests_total";
    let completion = json!({"prompt": "The quick brown fox jumps over", "max_tokens": 16,
        "temperature": 0, "ignore_eos": true});
    let chat = json!({"messages": [{"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Name three colours, please."}],
        "max_tokens": 16, "temperature": 0, "ignore_eos": true});
    let mut bodies = vec![
        ("/v1/completions", completion.clone()),
        ("/v1/chat/completions", chat.clone()),
    ];
    // Each with a stop string from the middle of its own greedy text.
    for (path, body) in bodies.clone() {
        let (status, r) = post_json(&worker, path, Some("sk-ctl"), &body).await;
        assert_eq!(status, 200, "{r}");
        let text = r["choices"][0]["text"]
            .as_str()
            .or(r["choices"][0]["message"]["content"].as_str())
            .unwrap()
            .to_string();
        let chars: Vec<char> = text.chars().collect();
        assert!(chars.len() >= 6, "{path}: too little text to cut: {r}");
        let stop: String = chars[chars.len() / 2..chars.len() / 2 + 2].iter().collect();
        let mut with_stop = body.clone();
        with_stop["stop"] = json!(stop);
        bodies.push((path, with_stop));
    }
    let mut routed = 0;
    for (path, body) in &bodies {
        let before = worker_metric(&worker, counter).await;
        let (status, direct) = post_json(&worker, path, Some("sk-ctl"), body).await;
        assert_eq!(status, 200, "{direct}");
        assert_eq!(
            worker_metric(&worker, counter).await,
            before,
            "text is tokenized"
        );
        let (status, via) = post_json(&ctl, path, None, body).await;
        assert_eq!(status, 200, "{via}");
        routed += 1;
        assert_eq!(
            worker_metric(&worker, counter).await,
            before + 1.0,
            "{path}: the controller's ids were used"
        );
        assert_eq!(via["choices"], direct["choices"], "{path} {body}");
        assert_eq!(
            via["usage"]["prompt_tokens"], direct["usage"]["prompt_tokens"],
            "{path}"
        );
        assert_eq!(
            via["usage"]["completion_tokens"], direct["usage"]["completion_tokens"],
            "{path}"
        );
        if body.get("stop").is_some() {
            assert_eq!(via["choices"][0]["finish_reason"], "stop", "{via}");
        }
    }
    // A native chat may resume a session only the worker knows: no ids.
    let before = worker_metric(&worker, counter).await;
    let native = json!({"inferlet": "chat", "args": {"messages": chat["messages"], "max_tokens": 2},
        "props": {"session": "s1"}});
    let (status, r) = post_json(&ctl, "/v1/processes", None, &native).await;
    assert_eq!(status, 201, "{r}");
    routed += 1;
    assert_eq!(worker_metric(&worker, counter).await, before, "{r}");
    // The controller's fields: a caller's own is refused, naming it, on
    // the OpenAI routes and native launches alike (the workers would trust
    // them under the controller's key).
    let forgeries = [
        (
            "pie_prompt_tokens",
            json!({"fingerprint": 1, "ids": [1, 2]}),
        ),
        (
            "pie_resume",
            json!({"tokens": [1], "from": "http://127.0.0.1:9"}),
        ),
        ("pie_stream_ids", json!(true)),
    ];
    for (field, value) in forgeries {
        for (path, body) in [("/v1/completions", &completion), ("/v1/processes", &native)] {
            let mut forged = body.clone();
            forged[field] = value.clone();
            let (status, r) = post_json(&ctl, path, None, &forged).await;
            assert_eq!(status, 400, "{path} {field}: {r}");
            let message = r["error"]["message"].as_str().unwrap();
            assert!(message.contains(field), "{r}");
        }
    }
    for part in ["tokenize", "hash", "route", "proxy"] {
        let count = c
            .metric(&format!(
                "pie_controller_overhead_seconds_count{{part=\"{part}\"}}"
            ))
            .await;
        assert_eq!(count, routed as f64, "{part}");
    }
}

/// OpenAI clients send `content` as an array of text parts, or `null`: the
/// controller parses messages as a worker does (one parser, `pie_core::chat`),
/// so such a chat routes, is tokenized once, and answers as its plain-text
/// twin does on the worker; a part that is not text is refused naming it.
#[tokio::test]
async fn chat_content_parts_and_null_content_route_like_plain_text() {
    let worker_cfg = worker_config_trusting_the_controller("content-parts");
    let c = Cluster::start_with(Spec {
        workers: 1,
        worker_args: &["--config", worker_cfg.to_str().unwrap()],
        cluster_config: "worker_key = \"sk-ctl\"",
        ..Spec::new("least-loaded")
    })
    .await;
    let worker = c.workers[0].as_ref().unwrap().url.clone();
    let ctl = c.controller.url.clone();
    let plain = json!({"messages": [{"role": "user", "content": "Say hi"},
        {"role": "assistant", "content": ""}, {"role": "user", "content": "Again"}],
        "max_tokens": 12, "temperature": 0, "ignore_eos": true});
    let parts = json!({"messages": [
        {"role": "user", "content": [{"type": "text", "text": "Say "}, {"type": "text", "text": "hi"}]},
        {"role": "assistant", "content": null},
        {"role": "user", "content": [{"type": "text", "text": "Again"}]}],
        "max_tokens": 12, "temperature": 0, "ignore_eos": true});
    let path = "/v1/chat/completions";
    let (status, direct) = post_json(&worker, path, Some("sk-ctl"), &plain).await;
    assert_eq!(status, 200, "{direct}");
    let before = worker_metric(&worker, "pie_pretokenized_requests_total").await;
    let (status, via) = post_json(&ctl, path, None, &parts).await;
    assert_eq!(status, 200, "{via}");
    assert_eq!(via["choices"], direct["choices"], "{via}");
    assert_eq!(
        via["usage"]["prompt_tokens"],
        direct["usage"]["prompt_tokens"]
    );
    assert_eq!(
        worker_metric(&worker, "pie_pretokenized_requests_total").await,
        before + 1.0,
        "the controller tokenized the parts"
    );
    let image = json!({"messages": [{"role": "user", "content":
        [{"type": "image_url", "image_url": {"url": "http://127.0.0.1:9/x.png"}}]}]});
    let (status, r) = post_json(&ctl, path, None, &image).await;
    assert_eq!(status, 400, "{r}");
    assert!(error_message(&r).contains("image_url"), "{r}");
}

/// The greedy completion of `prompt` by one worker alone.
async fn alone(prompt: &[u32]) -> String {
    let model = model();
    let w = spawn(
        &bin("pie"),
        &["serve", "--port", "0", "--model", model.to_str().unwrap()],
        "pie: listening on ",
    );
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

#[tokio::test]
async fn without_model_the_controller_reads_a_workers_tokenizer_and_routes_by_prefix() {
    let c = Cluster::start_with(Spec {
        controller_model: false,
        ..Spec::new("disaggregate,cache-aware")
    })
    .await;
    let system = "You are the keeper of a lighthouse on a rocky northern island. ".repeat(6);
    let ask = |q: &str| json!({"prompt": format!("{system}{q}"), "max_tokens": 2});
    let (status, first, _, body) = c.complete(ask("Who are you?")).await;
    assert_eq!(status, 200, "{body}");
    wait_for("the first prompt's pages indexed", async || {
        c.cluster().await["index_entries"].as_u64().unwrap_or(0) > 0
    })
    .await;
    let (status, second, route, _) = c.complete(ask("What do you see?")).await;
    assert_eq!((status, second.as_str()), (200, first.as_str()));
    let cached: usize = route
        .split("cache-aware: ")
        .nth(1)
        .and_then(|r| r.split('/').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or(0);
    assert!(cached >= 64, "real prefix matches from the text: {route}");
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
    let stranger = spawn(
        &bin("pie"),
        &[
            "serve",
            "--port",
            "0",
            "--model",
            other.to_str().unwrap(),
            "--controller",
            &c.controller.url,
            "--name",
            "stranger",
        ],
        "pie: listening on ",
    );
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

/// `persist-prefix` through the controller: a system prompt routed three
/// times is hot; the actor asks its worker to persist it once, the worker
/// writes its pages, and its KV events' disk tier tells the controller, which
/// asks no more (past the retry window only the disk tier stops it).
#[tokio::test]
async fn persist_prefix_writes_a_hot_prefix_to_its_workers_disk_once() {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("persist-cluster-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let worker_config = dir.with_extension("toml");
    std::fs::write(
        &worker_config,
        format!("[runtime.persist]\ndir = {:?}\n", dir.display().to_string()),
    )
    .unwrap();
    let c = Cluster::start_with(Spec {
        workers: 1,
        worker_args: &[
            "--kv-pages",
            "512",
            "--config",
            worker_config.to_str().unwrap(),
        ],
        cluster_config:
            "actor_tick_ms = 20\n[cluster.persist-prefix]\nmin_hits = 3\nretry_ms = 1000\n",
        ..Spec::new("cache-aware,persist-prefix")
    })
    .await;
    let system = "The harbour master keeps a ledger of every ship. ".repeat(12);
    let persisted = async || c.actions("persist-prefix").await;
    for (i, question) in ["Who?", "What?"].into_iter().enumerate() {
        let (status, _, v, _) = timed_completion(&c, &format!("{system}{question}")).await;
        assert_eq!(status, 200, "request {i}: {v}");
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(persisted().await.is_empty(), "asked for twice: not hot yet");
    let (status, _, v, _) = timed_completion(&c, &format!("{system}Where?")).await;
    assert_eq!(status, 200, "{v}");
    let worker = c.workers[0].as_ref().unwrap().url.clone();
    wait_for("the worker persisted the prefix", async || {
        worker_metric(&worker, "pie_kv_persisted_pages").await > 0.0
    })
    .await;
    let asks = c.settled("persist-prefix").await;
    assert_eq!(asks.len(), 1, "{asks:?}");
    assert_eq!(asks[0]["action"]["worker"], "w0");
    assert_eq!(asks[0]["outcome"], "executed");
    let blocks = asks[0]["action"]["blocks"].as_array().unwrap().len();
    assert!(blocks >= 2, "the system prompt's pages: {blocks}");
    assert_eq!(
        worker_metric(&worker, "pie_kv_persisted_pages").await,
        blocks as f64
    );
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(
        persisted().await.len(),
        1,
        "on the worker's disk (its KV events say so): not asked again"
    );
    std::fs::remove_dir_all(dir).unwrap();
}

/// A cluster of `workers` workers with `max_running = 3` and `actors` (set
/// by `actor_config`) behind `cache-aware`.
async fn small_workers(workers: usize, actors: &str, actor_config: &str) -> Cluster {
    let worker_config = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!(
        "max-running-3-{actors}-{}.toml",
        std::process::id()
    ));
    std::fs::write(&worker_config, "[runtime]\nmax_running = 3\n").unwrap();
    let policies = format!("cache-aware,{actors}");
    let cluster_config = format!("actor_tick_ms = 20\n{actor_config}");
    Cluster::start_with(Spec {
        workers,
        worker_args: &[
            "--kv-pages",
            "512",
            "--config",
            worker_config.to_str().unwrap(),
        ],
        cluster_config: &cluster_config,
        ..Spec::new(&policies)
    })
    .await
}

const LIGHTHOUSE: &str = "The lighthouse keeper writes down every passing ship. ";

/// A greedy completion of the lighthouse system prompt and `question`.
fn lighthouse(question: &str) -> Value {
    json!({"prompt": format!("{}{question}", LIGHTHOUSE.repeat(10)), "max_tokens": 8, "temperature": 0})
}

/// The lighthouse prompt asked three times through the controller (one
/// worker holds it), checked not to move while that worker has room; then
/// that worker filled with three held streams. The holder's name, its URL and
/// the streams holding it.
async fn hot_prefix_on_a_full_worker(
    c: &Cluster,
    kind: &str,
) -> (String, String, Vec<reqwest::Response>) {
    let mut holder = String::new();
    for question in ["Who?", "What?", "Where?"] {
        let (status, worker, route, v) = c.complete(lighthouse(question)).await;
        assert_eq!(status, 200, "{v}");
        assert!(holder.is_empty() || holder == worker, "{route}");
        holder = worker;
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    let early = c.actions(kind).await;
    assert!(
        early.is_empty(),
        "its holder has room: no {kind}: {early:?}"
    );
    let holder_url = c.url_of(&holder);
    let busy = common::hold_streams(&reqwest::Client::new(), &holder_url, 3, json!({})).await;
    (holder, holder_url, busy)
}

/// `replicate`: three workers with `max_running = 3`. A system prompt asked
/// for three times lives on one worker; while that worker is full (three
/// streams held on it), the controller copies the prefix to an idle worker (it pulls
/// the pages, nothing is computed), whose KV events announce it: the copy
/// serves the prefix from cache with the output the source gives, and
/// cache-aware sends the next request of the prefix to the copy.
#[tokio::test]
async fn replicate_copies_a_hot_prefix_off_its_busy_holder_and_routing_uses_the_copy() {
    let c = small_workers(
        3,
        "replicate",
        "[cluster.replicate]\nhot_rps = 0.01\nmin_hits = 3\nhigh = 1.0\nlow = 0.5\n",
    )
    .await;
    let (holder, holder_url, busy) = hot_prefix_on_a_full_worker(&c, "copy-prefix").await;
    let copy = c.settled("copy-prefix").await.remove(0);
    assert_eq!(copy["action"]["from"], holder.as_str(), "{copy}");
    assert_eq!(copy["outcome"], "executed", "{copy}");
    let target = copy["action"]["to"].as_str().unwrap().to_string();
    assert_ne!(target, holder);
    let blocks = copy["action"]["blocks"].as_array().unwrap().len();
    assert!(blocks >= 4, "the system prompt's pages: {blocks}");

    let target_url = c.url_of(&target);
    wait_for("the copy announced in the target's KV events", async || {
        let view = c.cluster().await;
        let entry = view["workers"]
            .as_array()
            .unwrap()
            .iter()
            .find(|w| w["name"] == target.as_str())
            .cloned();
        entry.is_some_and(|w| w["indexed_blocks"].as_u64().unwrap_or(0) >= blocks as u64)
    })
    .await;
    assert_eq!(
        worker_metric(&target_url, "pie_kv_transfer_pages_total{direction=\"in\"}").await,
        blocks as f64,
        "pulled, not computed"
    );
    let (_, worker, route, _) = c.complete(lighthouse("Why?")).await;
    assert_eq!(
        worker, target,
        "the copy is as long and less loaded: {route}"
    );
    let (_, direct) = post_json(&target_url, "/v1/completions", None, &lighthouse("When?")).await;
    let cached = direct["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap_or(0);
    assert!(cached >= (blocks * 16) as u64, "cached {cached}: {direct}");
    drop(busy);
    let (_, at_source) =
        post_json(&holder_url, "/v1/completions", None, &lighthouse("When?")).await;
    assert_eq!(
        direct["choices"][0]["text"], at_source["choices"][0]["text"],
        "the copied pages give the source's output"
    );
}

/// `pool-replicate` with workers that have no `[runtime] pool`: the push is
/// asked of the full holder, which refuses, and the action log says so with
/// the worker's reason (never `executed`).
#[tokio::test]
async fn pool_replicate_without_a_workers_pool_is_logged_failed_with_the_reason() {
    let c = small_workers(
        2,
        "pool-replicate",
        "[cluster.pool-replicate]\nhot_rps = 0.01\nhigh = 1.0\n",
    )
    .await;
    let (holder, _, _busy) = hot_prefix_on_a_full_worker(&c, "copy-prefix-to-pool").await;
    let push = c.settled("copy-prefix-to-pool").await.remove(0);
    assert_eq!(push["action"]["from"], holder.as_str(), "{push}");
    let error = push["outcome"]["failed"]["error"]
        .as_str()
        .unwrap_or_default();
    assert!(
        error.contains("409") && error.contains("[runtime] pool"),
        "{push}"
    );
}
