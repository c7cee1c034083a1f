//! The scaffolding of every cluster test: a `Cluster` of real workers
//! (described by a `Spec`) behind a real controller, a `Relay` that can cut
//! a worker off, a `FakeWorker` (axum) that misbehaves on purpose, and the
//! helpers the tests of more than one feature use.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use crate::common::{self, bin, model, spawn, wait_for, Proc};
use serde_json::{json, Value};

/// A TCP relay in front of a worker; `set_cut(true)` drops every connection
/// through it and refuses new ones until `set_cut(false)`; `drop_connections`
/// drops the open ones only.
pub(crate) struct Relay {
    url: String,
    /// (refusing, generation): a connection ends when the relay refuses or
    /// the generation it started in is over.
    state: tokio::sync::watch::Sender<(bool, u64)>,
}

impl Relay {
    pub(crate) async fn start(target_url: &str) -> Relay {
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

    pub(crate) fn set_cut(&self, cut: bool) {
        self.state.send_modify(|s| s.0 = cut);
    }

    pub(crate) fn drop_connections(&self) {
        self.state.send_modify(|s| s.1 += 1);
    }
}

pub(crate) struct Cluster {
    pub(crate) workers: Vec<Option<Proc>>,
    pub(crate) relays: Vec<Relay>,
    pub(crate) controller: Proc,
    pub(crate) http: reqwest::Client,
    pub(crate) config: PathBuf,
}

/// What a test cluster looks like.
pub(crate) struct Spec<'a> {
    pub(crate) policies: &'a str,
    pub(crate) workers: usize,
    pub(crate) worker_args: &'a [&'a str],
    /// Extra `[cluster]` lines.
    pub(crate) cluster_config: &'a str,
    /// Put each worker behind a relay the test can cut (the controller sees the
    /// relay's URL).
    pub(crate) relayed: bool,
    /// The test client's API key for the controller.
    pub(crate) client_key: Option<&'a str>,
    /// Each worker's `group` label ("" for none); when set, the workers are
    /// listed in the config file rather than with `--worker`.
    pub(crate) groups: &'a [&'a str],
    /// Each worker's `--stage` (none: both).
    pub(crate) stages: &'a [&'a str],
    /// Give the controller `--model` (else it reads the workers' tokenizer).
    pub(crate) controller_model: bool,
}

impl<'a> Spec<'a> {
    /// Three plain workers, no extra configuration.
    pub(crate) fn new(policies: &'a str) -> Self {
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
    pub(crate) async fn start(policies: &str, kv_pages: &str) -> Cluster {
        Cluster::start_with(Spec {
            worker_args: &["--kv-pages", kv_pages],
            ..Spec::new(policies)
        })
        .await
    }

    pub(crate) async fn start_with(spec: Spec<'_>) -> Cluster {
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
    pub(crate) async fn metric(&self, name: &str) -> f64 {
        pie_testkit::metric_value(&self.get_text("/metrics").await, name)
    }

    /// GET a controller path; the body as text.
    pub(crate) async fn get_text(&self, path: &str) -> String {
        self.http
            .get(format!("{}{path}", self.controller.url))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap()
    }

    pub(crate) async fn cluster(&self) -> Value {
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
    pub(crate) fn url_of(&self, name: &str) -> String {
        let i: usize = name.trim_start_matches('w').parse().unwrap();
        self.workers[i].as_ref().unwrap().url.clone()
    }

    pub(crate) async fn actions(&self, kind: &str) -> Vec<Value> {
        common::actions(&self.controller.url, kind).await
    }

    pub(crate) async fn settled(&self, kind: &str) -> Vec<Value> {
        common::settled(&self.controller.url, kind).await
    }

    pub(crate) async fn complete(&self, body: Value) -> (u16, String, String, Value) {
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

/// `n` streamed completions with `props` through the controller, their
/// bodies held unread, each keeping a slot (demand the actors see). The
/// workers' steps are slowed first: an unread stream does not stop its
/// process (the worker's events are unbounded), and the tiny model can run
/// 2,000 tokens in a second or two, which freed a slot under a queued
/// request in fresh-clone CI. At 20 ms a step a hold outlasts any `wait_for`.
pub(crate) async fn held_through_controller(
    c: &Cluster,
    n: usize,
    props: Value,
) -> Vec<reqwest::Response> {
    slow_steps(c, 20).await;
    common::hold_streams(&c.http, &c.controller.url, n, props).await
}

/// Drain worker `name` of `c` by its route, or kill it (-9) for a `crash`.
pub(crate) async fn drain_or_kill(c: &mut Cluster, name: &str, crash: bool) {
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
pub(crate) async fn moved_on_drain_and_crash(c: &Cluster) {
    for reason in ["drain", "crash"] {
        let moved = format!("pie_controller_streams_moved_total{{reason=\"{reason}\"}}");
        assert!(labelled_metric(c, &moved).await >= Some(1.0), "{reason}");
    }
}

/// The step delay of the tests that drain or kill a worker under a
/// 900- or 1,000-token request: 4.5 s or more of steps, so it is still running when
/// the move lands on a loaded CI machine (2 ms, 1.8 s, left little room).
pub(crate) const MOVE_STEP_MS: u64 = 5;

/// Every worker of `c` pauses `delay_ms` before each engine step (the
/// test model is so fast that a 1,000-token process would end before a
/// test could move it).
pub(crate) async fn slow_steps(c: &Cluster, delay_ms: u64) {
    for w in c.workers.iter().flatten() {
        slow_worker_steps(&w.url, delay_ms).await;
    }
}

/// The worker at `url` pauses `delay_ms` before each engine step.
pub(crate) async fn slow_worker_steps(url: &str, delay_ms: u64) {
    let fault = json!({"fault": "slow-steps", "delay_ms": delay_ms});
    let (status, _) = post_json(url, "/v1/admin/fault", None, &fault).await;
    assert_eq!(
        status, 200,
        "the pie binary lacks the fault route: build it with `--features pie-worker/fault-injection`"
    );
}

/// The one worker with a request in flight, once it has generated a little.
pub(crate) async fn serving_worker(c: &Cluster) -> String {
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

/// A worker config whose only key is the controller's (`sk-ctl`, role worker).
/// One worker that trusts the controller's key `sk-ctl` (so it takes the
/// controller's prompt ids) behind a `least-loaded` controller; the
/// worker's URL.
pub(crate) async fn cluster_of_one_trusting_worker(tag: &str) -> (Cluster, String) {
    let worker_cfg = worker_config_trusting_the_controller(tag);
    let c = Cluster::start_with(Spec {
        workers: 1,
        worker_args: &["--config", worker_cfg.to_str().unwrap()],
        cluster_config: "worker_key = \"sk-ctl\"",
        ..Spec::new("least-loaded")
    })
    .await;
    let worker = c.workers[0].as_ref().unwrap().url.clone();
    (c, worker)
}

pub(crate) fn worker_config_trusting_the_controller(tag: &str) -> PathBuf {
    let path = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("worker-{tag}-{}.toml", std::process::id()));
    std::fs::write(
        &path,
        "[server]\napi_keys = [{ name = \"controller\", key = \"sk-ctl\", role = \"worker\" }]\n",
    )
    .unwrap();
    path
}

/// (status, body) of a controller request made with `key`.
pub(crate) async fn call_as(
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

pub(crate) fn error_message(body: &Value) -> String {
    body["error"]["message"].as_str().unwrap_or("").to_string()
}

/// The value of a labelled controller metric line `name{labels}`, if present.
pub(crate) async fn labelled_metric(c: &Cluster, series: &str) -> Option<f64> {
    pie_client::prom::sum(&c.get_text("/metrics").await, series)
}

/// A worker that answers polls (until its engine "dies": then 503) but never
/// answers a completion, except one whose body says "stall": one event, then
/// silence. Its n-th KV event subscription sends a snapshot of
/// `kv_blocks[n]` blocks and then nothing, not even a keep-alive.
pub(crate) struct FakeWorker {
    url: String,
    pub(crate) engine_dead: std::sync::Arc<std::sync::atomic::AtomicBool>,
    /// Its `/v1/internal/kv/prefetch` answers 500 (else 200 with no page).
    pub(crate) refuse_prefetch: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

impl FakeWorker {
    /// `full`: it reports its one running slot taken.
    pub(crate) async fn start(kv_blocks: &'static [u64], full: bool) -> FakeWorker {
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
    pub(crate) fn config(&self, name: &str) -> String {
        format!(
            "[[cluster.workers]]\nname = \"{name}\"\nurl = \"{}\"\n",
            self.url
        )
    }
}

/// The `/v1/cluster` entry of worker `name`.
pub(crate) async fn worker_entry(c: &Cluster, name: &str) -> Value {
    let cluster = c.cluster().await;
    let workers = cluster["workers"].as_array().unwrap();
    workers.iter().find(|w| w["name"] == name).unwrap().clone()
}

/// POST a completion; (status, Retry-After, body, how long it took).
pub(crate) async fn timed_completion(c: &Cluster, prompt: &str) -> (u16, String, Value, Duration) {
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

/// POST `body` to `url` + `path`, with `key` if any: (status, JSON body).
pub(crate) async fn post_json(
    url: &str,
    path: &str,
    key: Option<&str>,
    body: &Value,
) -> (u16, Value) {
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
pub(crate) async fn worker_metric(url: &str, name: &str) -> f64 {
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
