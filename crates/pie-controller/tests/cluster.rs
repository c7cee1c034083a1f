//! Three real `pie serve` workers (test model) behind a real `pie-controller`.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use pie_model::synth::{write_test_model, SynthSpec};
use serde_json::{json, Value};

/// A child process killed on drop.
struct Proc {
    child: Child,
    url: String,
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn bin(name: &str) -> PathBuf {
    let path = Path::new(env!("CARGO_BIN_EXE_pie-controller")).with_file_name(name);
    assert!(
        path.exists(),
        "{} missing: run `cargo build --release --bin pie` first",
        path.display()
    );
    path
}

fn spawn(program: &Path, args: &[&str], prefix: &str) -> Proc {
    let mut child = Command::new(program)
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let first = lines.next().expect("no output").unwrap();
    let url = first
        .strip_prefix(prefix)
        .unwrap_or_else(|| panic!("unexpected line {first:?}"))
        .to_string();
    std::thread::spawn(move || for _ in lines {});
    Proc { child, url }
}

fn model() -> PathBuf {
    let path = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("cluster-model-{}.gguf", std::process::id()));
    if !path.exists() {
        write_test_model(
            &path,
            &SynthSpec {
                seed: 3,
                ..SynthSpec::default()
            },
        )
        .unwrap();
    }
    path
}

async fn wait_for(what: &str, mut f: impl AsyncFnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !f().await {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

struct Cluster {
    workers: Vec<Option<Proc>>,
    controller: Proc,
    http: reqwest::Client,
    config: PathBuf,
}

impl Cluster {
    async fn start(policies: &str, kv_pages: &str) -> Cluster {
        let model = model();
        let m = model.to_str().unwrap();
        let workers: Vec<Option<Proc>> = (0..3)
            .map(|_| {
                Some(spawn(
                    &bin("pie"),
                    &[
                        "serve",
                        "--port",
                        "0",
                        "--model",
                        m,
                        "--kv-pages",
                        kv_pages,
                        "--page-size",
                        "16",
                    ],
                    "pie: listening on ",
                ))
            })
            .collect();
        let mut args = vec!["--port".to_string(), "0".into(), "--model".into(), m.into()];
        let cfg = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
            .join(format!("controller-{}-{policies}.toml", std::process::id()));
        let names: Vec<&str> = policies.split(',').collect();
        std::fs::write(
            &cfg,
            format!("[cluster]\npoll_ms = 20\ncluster_policies = {names:?}\n"),
        )
        .unwrap();
        args.extend(["--config".into(), cfg.to_str().unwrap().into()]);
        for (i, w) in workers.iter().enumerate() {
            args.extend([
                "--worker".into(),
                format!("w{i}={}", w.as_ref().unwrap().url),
            ]);
        }
        let refs: Vec<&str> = args.iter().map(String::as_str).collect();
        let controller = spawn(
            &bin("pie-controller"),
            &refs,
            "pie-controller: listening on ",
        );
        let c = Cluster {
            workers,
            controller,
            http: reqwest::Client::new(),
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
        ],
        "pie: listening on ",
    );
    wait_for("registration", async || {
        c.cluster().await["workers"]
            .as_array()
            .unwrap()
            .iter()
            .any(|w| w["name"] == "late" && w["healthy"] == true)
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
async fn a_stream_broken_after_its_first_byte_ends_with_an_error_event() {
    let mut c = Cluster::start("least-loaded", "256").await;
    let body = json!({"prompt": "long", "max_tokens": 100_000, "ignore_eos": true, "stream": true});
    let mut r = c
        .http
        .post(format!("{}/v1/completions", c.controller.url))
        .json(&body)
        .send()
        .await
        .unwrap();
    let worker: usize = r.headers()["x-pie-worker"].to_str().unwrap()[1..]
        .parse()
        .unwrap();
    let mut seen = String::from_utf8_lossy(&r.chunk().await.unwrap().unwrap()).to_string();
    assert!(seen.starts_with("data: {"), "{seen}");
    c.workers[worker] = None; // the worker dies mid-stream
    while let Ok(Some(chunk)) = r.chunk().await {
        seen.push_str(&String::from_utf8_lossy(&chunk));
    }
    let last = seen.trim_end().rsplit("\n\n").next().unwrap();
    assert!(
        last.contains("\"error\"") && last.contains("stream broke"),
        "no silent truncation: {last}"
    );
}

#[tokio::test]
async fn sighup_reloads_cluster_policies_and_refuses_broken_files() {
    let c = Cluster::start("round-robin", "256").await;
    let hup = || {
        assert!(Command::new("kill")
            .args(["-HUP", &c.controller.child.id().to_string()])
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
        let m = c.get_text("/metrics").await;
        m.contains("pie_controller_config_reload_failures_total 1")
    })
    .await;
    assert_eq!(
        c.cluster().await["cluster_policies"],
        json!(["pin", "least-loaded"]),
        "the running pipeline stays"
    );
}
