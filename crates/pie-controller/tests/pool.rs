//! `pie-pool` with real workers (test model): a prefix first computed on one
//! worker serves another through the pool, also after the pool restarts from
//! its disk tier; a pool that is down costs a local prefill, never a request;
//! the controller's `pool-replicate` pushes a crowded prefix to the pool;
//! under `retain-all` a retained session evicted early comes back from it
//! (or from the worker's disk tier).
//! (The pool alone: `crates/pie-pool/tests/api.rs`.)

mod common;

use std::path::PathBuf;

use common::{
    bin, get_json, hold_streams, model, settled, settled_at_least, spawn, wait_for, Proc,
};
use serde_json::{json, Value};

fn scratch(name: &str) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("pool-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

fn pool(args: &[&str]) -> Proc {
    let mut all = vec!["--port", "0"];
    all.extend(args);
    spawn(&bin("pie-pool"), &all, "pie-pool: listening on ")
}

/// A worker whose `[runtime] pool` is `pool_url`.
async fn worker(tag: &str, pool_url: &str) -> Proc {
    worker_with(tag, pool_url, "").await
}

/// A worker whose `[runtime]` has `pool = pool_url` (none when empty) and
/// the keys in `runtime`.
async fn worker_with(tag: &str, pool_url: &str, runtime: &str) -> Proc {
    let cfg = scratch(tag).with_extension("toml");
    let pool = match pool_url {
        "" => String::new(),
        url => format!("pool = {url:?}\n"),
    };
    std::fs::write(&cfg, format!("[runtime]\n{pool}{runtime}")).unwrap();
    let w = common::worker(&["--config", cfg.to_str().unwrap()]);
    wait_for("the worker healthy", async || {
        reqwest::get(format!("{}/health", w.url))
            .await
            .is_ok_and(|r| r.status() == 200)
    })
    .await;
    w
}

/// A controller (`[cluster]` as `cluster`, poll every 20 ms) over `workers`
/// as w0, w1, ...; once it sees them all healthy.
async fn controller(tag: &str, cluster: &str, workers: &[&Proc]) -> Proc {
    let cfg = scratch(tag).with_extension("toml");
    std::fs::write(&cfg, format!("[cluster]\npoll_ms = 20\n{cluster}")).unwrap();
    let m = model();
    let mut args: Vec<String> = ["--port", "0", "--model", m.to_str().unwrap()]
        .map(String::from)
        .to_vec();
    args.extend(["--config".into(), cfg.to_str().unwrap().into()]);
    for (i, w) in workers.iter().enumerate() {
        args.extend(["--worker".into(), format!("w{i}={}", w.url)]);
    }
    let refs: Vec<&str> = args.iter().map(String::as_str).collect();
    let ctl = spawn(
        &bin("pie-controller"),
        &refs,
        "pie-controller: listening on ",
    );
    wait_for("every worker healthy", async || {
        let v = get_json(&format!("{}/v1/cluster", ctl.url)).await;
        v["workers"]
            .as_array()
            .is_some_and(|ws| ws.len() == workers.len() && ws.iter().all(|w| w["healthy"] == true))
    })
    .await;
    ctl
}

fn prompt() -> Vec<u32> {
    (0..160u32).map(|i| (i * 11) % 230 + 5).collect()
}

/// `prompt()` and then a question of its own.
fn prompt_and(question: u32) -> Vec<u32> {
    let mut p = prompt();
    p.extend([7, question, 9]);
    p
}

/// A greedy completion on `w`: (text, cached prompt tokens).
async fn complete(w: &Proc, props: Value) -> (String, u64) {
    complete_at(&w.url, prompt(), props).await
}

async fn complete_at(url: &str, prompt: Vec<u32>, props: Value) -> (String, u64) {
    let v: Value = reqwest::Client::new()
        .post(format!("{url}/v1/completions"))
        .json(
            &json!({"prompt": prompt, "max_tokens": 12, "temperature": 0,
            "ignore_eos": true, "props": props}),
        )
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let text = v["choices"][0]["text"]
        .as_str()
        .unwrap_or_else(|| panic!("{v}"));
    let cached = v["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap_or(0);
    (text.to_string(), cached)
}

async fn metric(url: &str, name: &str) -> f64 {
    let text = reqwest::get(format!("{url}/metrics"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    pie_testkit::metric_value(&text, name)
}

async fn pool_pages(p: &Proc) -> u64 {
    let health = get_json(&format!("{}/health", p.url)).await;
    health["pages"].as_u64().unwrap()
}

#[tokio::test]
async fn a_prefix_computed_on_one_worker_serves_another_through_the_pool_even_after_a_restart() {
    let disk = scratch("disk");
    let p = pool(&["--dir", disk.to_str().unwrap()]);
    let a = worker("a", &p.url).await;
    let (want, cached) = complete(&a, json!({"persist": true})).await;
    assert_eq!(cached, 0);
    wait_for("the prompt's 10 pages in the pool", async || {
        pool_pages(&p).await >= 10
    })
    .await;

    let b = worker("b", &p.url).await;
    let (got, cached) = complete(&b, json!({})).await;
    assert_eq!(got, want, "the output of the worker that computed it");
    assert!(cached >= 144, "cached_tokens {cached} of 160");
    assert_eq!(
        metric(&b.url, "pie_kv_transfer_pages_total{direction=\"in\"}").await,
        10.0
    );
    assert!(metric(&p.url, "pie_pool_memory_hits_total").await >= 10.0);

    drop(p);
    let p = pool(&["--dir", disk.to_str().unwrap()]);
    assert_eq!(pool_pages(&p).await, 0, "memory starts empty");
    let c = worker("c", &p.url).await;
    let (got, cached) = complete(&c, json!({})).await;
    assert_eq!(got, want);
    assert!(cached >= 144, "from the disk tier: cached_tokens {cached}");
    assert_eq!(metric(&p.url, "pie_pool_disk_hits_total").await, 10.0);
    std::fs::remove_dir_all(disk).unwrap();
}

#[tokio::test]
async fn a_pool_that_is_down_costs_a_local_prefill_never_a_request() {
    let p = pool(&[]);
    let w = worker("down", &p.url).await;
    let (want, _) = complete(&w, json!({})).await;
    drop(p);
    let fresh = prompt().iter().map(|t| t + 1).collect::<Vec<u32>>();
    let r = reqwest::Client::new()
        .post(format!("{}/v1/completions", w.url))
        .json(&json!({"prompt": fresh, "max_tokens": 4, "props": {"persist": true}}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200, "served by a local prefill");
    assert!(metric(&w.url, "pie_kv_transfer_fallbacks_total").await >= 1.0);
    let r = reqwest::Client::new()
        .post(format!("{}/v1/internal/kv/persist", w.url))
        .json(&json!({"tokens": prompt()}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 502, "persisting to a pool that is down says so");
    let v: Value = r.json().await.unwrap();
    assert!(
        v["error"]["message"].as_str().unwrap().contains("pool"),
        "{v}"
    );
    assert_eq!(complete(&w, json!({})).await.0, want);
}

/// `pool-replicate`: two workers with `max_running = 3` sharing a pool behind a
/// controller. A prompt prefix asked for three times lives on one worker and
/// is not in the pool; once that worker is full (three streams held on it),
/// the controller has it push the prefix to the pool, and the other worker
/// serves the prefix from the pool with the holder's output.
#[tokio::test]
async fn pool_replicate_pushes_a_crowded_prefix_that_another_worker_then_pulls() {
    let p = pool(&[]);
    let limit = "max_running = 3\n";
    let ws = [
        worker_with("pr-0", &p.url, limit).await,
        worker_with("pr-1", &p.url, limit).await,
    ];
    let ctl = controller(
        "pool-replicate",
        "actor_tick_ms = 20\ncluster_policies = [\"cache-aware\", \"pool-replicate\"]\n\
         [cluster.pool-replicate]\nhot_rps = 0.01\nhigh = 1.0\n",
        &[&ws[0], &ws[1]],
    )
    .await;
    let http = reqwest::Client::new();
    let mut holder = String::new();
    for question in 0..3 {
        let r = http
            .post(format!("{}/v1/completions", ctl.url))
            .json(&json!({"prompt": prompt_and(question), "max_tokens": 4, "temperature": 0}))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        let worker = r.headers()["x-pie-worker"].to_str().unwrap().to_string();
        assert!(holder.is_empty() || holder == worker);
        holder = worker;
    }
    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    assert_eq!(
        pool_pages(&p).await,
        0,
        "its holder has room: nothing pushed"
    );

    let (holder, other) = match holder.as_str() {
        "w0" => (&ws[0], &ws[1]),
        _ => (&ws[1], &ws[0]),
    };
    let busy = hold_streams(&reqwest::Client::new(), &holder.url, 3, json!({})).await;
    wait_for("the prefix's 10 pages in the pool", async || {
        pool_pages(&p).await >= 10
    })
    .await;
    let pushes = settled(&ctl.url, "copy-prefix-to-pool").await;
    assert_eq!(pushes.len(), 1, "pushed once within retry_ms: {pushes:?}");
    assert_eq!(pushes[0]["outcome"], "executed");
    drop(busy);
    let (want, _) = complete_at(&holder.url, prompt_and(77), json!({})).await;
    let (got, cached) = complete_at(&other.url, prompt_and(77), json!({})).await;
    assert_eq!(got, want, "the holder's output");
    assert!(cached >= 160, "from the pool: cached_tokens {cached}");
    assert_eq!(
        metric(&other.url, "pie_kv_transfer_pages_total{direction=\"in\"}").await,
        10.0
    );
}

/// The controller follows the pool's KV events (`[cluster] pool`): a prefix
/// only the pool holds (pushed by a worker outside this cluster) is not a cold
/// prompt: cache-aware sends it to the worker that can pull it from the pool,
/// not to the one without a pool, and that worker serves it from the pool.
/// A pool that goes away is forgotten (its blocks draw no more requests).
#[tokio::test]
async fn cache_aware_sends_a_prefix_only_the_pool_holds_to_a_worker_that_can_pull_it() {
    let p = pool(&[]);
    let outside = worker("outside", &p.url).await;
    let (want, _) = complete(&outside, json!({"persist": true})).await;
    wait_for("the prompt's 10 pages in the pool", async || {
        pool_pages(&p).await >= 10
    })
    .await;
    let plain = worker_with("no-pool", "", "").await;
    let pooled = worker("pooled", &p.url).await;
    let ctl = controller(
        "pool-tier",
        &format!("cluster_policies = [\"cache-aware\"]\npool = {:?}\n", p.url),
        &[&plain, &pooled],
    )
    .await;
    wait_for("the pool's blocks in the controller's index", async || {
        get_json(&format!("{}/v1/cluster", ctl.url)).await["pool_blocks"] == 10
    })
    .await;
    for question in [0, 1] {
        let r = reqwest::Client::new()
            .post(format!("{}/v1/completions", ctl.url))
            .json(&json!({"prompt": prompt_and(question), "max_tokens": 12, "temperature": 0}))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
        let header = |n: &str| r.headers()[n].to_str().unwrap().to_string();
        let (worker, route) = (header("x-pie-worker"), header("x-pie-route"));
        assert_eq!(worker, "w1", "the worker with a pool: {route}");
        if question == 0 {
            assert!(
                route.contains("160/163 prefix tokens in the pool for w1"),
                "{route}"
            );
        }
        let v: Value = r.json().await.unwrap();
        let cached = v["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap_or(0);
        assert!(cached >= 160, "from the pool or its own cache: {v}");
    }
    let (text, _) = complete_at(&pooled.url, prompt(), json!({})).await;
    assert_eq!(
        text, want,
        "the pooled pages give the output of the worker that computed them"
    );
    drop(p);
    wait_for("a pool that is gone forgotten", async || {
        get_json(&format!("{}/v1/cluster", ctl.url)).await["pool_blocks"] == 0
    })
    .await;
}

/// `[runtime]` keys of a worker with keep-session and 16 pages of 16 tokens.
const SMALL: &str = "worker_policy = [\"fcfs\", \"keep-session\"]\nkv_pages = 16\npage_size = 16\n";

/// Turn one of a session (80 prompt tokens: 5 full pages, kept for 60 s by
/// keep-session), then two fillers that each need 13 of the worker's 16 pages
/// (the retained session must go, and then everything merely cached), then
/// turn two (turn one's prompt and 3 more tokens) once the worker counted
/// `pages` spill pages of `event` (`spilled`: kept; `spill_failed`): (turn
/// two's text, its cached tokens).
async fn session_under_pressure(w: &Proc, event: &str, pages: f64) -> (String, u64) {
    let session = json!({"session": "s", "keep-ms": 60_000});
    let turn1: Vec<u32> = (0..80u32).map(|i| (i * 7) % 200 + 20).collect();
    complete_at(&w.url, turn1.clone(), session.clone()).await;
    for f in 0..2u32 {
        let filler: Vec<u32> = (0..200u32).map(|i| (i * 13 + f * 5) % 190 + 30).collect();
        complete_at(&w.url, filler, json!({})).await;
    }
    let counted = format!("pie_kv_persist_pages_total{{event=\"{event}\"}}");
    wait_for("the spill counted", async || {
        metric(&w.url, &counted).await >= pages
    })
    .await;
    let mut turn2 = turn1;
    turn2.extend([7, 8, 9]);
    complete_at(&w.url, turn2, session).await
}

/// `retain-all`: the controller asks its workers to spill retained sessions;
/// the one with a pool does, the one with neither pool nor disk refuses
/// (logged failed with its reason). On the worker that spills, a session
/// whose retained pages had to go comes back from the pool (turn two finds
/// turn one's 5 pages cached); on a worker outside the cluster (with a pool
/// of its own), the same traffic loses them; both give the same greedy
/// output.
#[tokio::test]
async fn retain_all_spills_a_session_evicted_early_to_the_pool_and_turn_two_pulls_it() {
    let p = pool(&[]);
    let spills = worker_with("ra-spill", &p.url, SMALL).await;
    let nothing = worker_with("ra-none", "", SMALL).await;
    // Its own pool: the shared one will hold the spilled session's pages.
    let other_pool = pool(&[]);
    let outside = worker_with("ra-out", &other_pool.url, SMALL).await;
    let ctl = controller(
        "retain-all",
        "actor_tick_ms = 20\ncluster_policies = [\"cache-aware\", \"retain-all\"]\n",
        &[&spills, &nothing],
    )
    .await;
    // One per worker: w0 spills, w1 refuses.
    let asked = settled_at_least(&ctl.url, "retain-spill", 2).await;
    let outcome = |w: &str| {
        asked
            .iter()
            .find(|a| a["action"]["worker"] == w)
            .unwrap_or_else(|| panic!("{w} asked: {asked:?}"))
            .clone()
    };
    assert_eq!(outcome("w0")["outcome"], "executed", "{asked:?}");
    let refused = outcome("w1");
    assert!(
        refused["outcome"]["failed"]["error"]
            .as_str()
            .is_some_and(|e| e.contains("409") && e.contains("neither")),
        "{refused}"
    );
    let state = get_json(&format!("{}/v1/internal/state", spills.url)).await;
    assert_eq!(state["retain_spill"], "any");

    let ((kept_text, kept_cached), (lost_text, lost_cached)) = tokio::join!(
        session_under_pressure(&spills, "spilled", 5.0),
        session_under_pressure(&outside, "spilled", 0.0)
    );
    assert!(
        kept_cached >= 80,
        "turn one's pages pulled back: {kept_cached}"
    );
    assert!(
        lost_cached < 80,
        "without retain-all they are gone: {lost_cached}"
    );
    assert_eq!(
        kept_text, lost_text,
        "the spilled pages give the same output"
    );
    assert!(metric(&p.url, "pie_pool_memory_hits_total").await >= 5.0);
    let dropped = "pie_kv_persist_pages_total{event=\"spill_dropped\"}";
    assert_eq!(metric(&spills.url, dropped).await, 0.0);
    assert_eq!(
        metric(
            &outside.url,
            "pie_kv_persist_pages_total{event=\"spilled\"}"
        )
        .await,
        0.0,
        "a worker not asked never spills"
    );
}

async fn ask_to_spill(w: &Proc, spill: Value) -> (u16, Value) {
    let r = reqwest::Client::new()
        .post(format!("{}/v1/internal/retain", w.url))
        .json(&json!({ "spill": spill }))
        .send()
        .await
        .unwrap();
    (r.status().as_u16(), r.json().await.unwrap())
}

/// A worker asked (as `retain-all` asks) to spill to its disk tier: a tier
/// it lacks or does not know is refused naming it; a session evicted early
/// is written to disk and turn two loads it back from there; asked to stop,
/// it reports it no longer spills.
#[tokio::test]
async fn a_worker_spilling_to_disk_loads_the_session_back_and_refuses_a_tier_it_lacks() {
    let root = scratch("spill-disk");
    let persist = format!(
        "[runtime.persist]\ndir = {:?}\n",
        root.display().to_string()
    );
    let w = worker_with("spill-disk", "", &format!("{SMALL}{persist}")).await;
    let (status, v) = ask_to_spill(&w, json!("pool")).await;
    assert_eq!(status, 409, "{v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("[runtime] pool"),
        "{v}"
    );
    let (status, v) = ask_to_spill(&w, json!("tape")).await;
    assert_eq!(status, 422, "{v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("unknown variant `tape`"),
        "{v}"
    );
    let (status, v) = ask_to_spill(&w, json!("disk")).await;
    assert_eq!((status, &v["keep_session"]), (200, &json!(true)), "{v}");
    assert_eq!(
        get_json(&format!("{}/v1/internal/state", w.url)).await["retain_spill"],
        "disk"
    );

    let (_, cached) = session_under_pressure(&w, "spilled", 5.0).await;
    assert!(cached >= 80, "turn one's pages loaded from disk: {cached}");
    let loaded = metric(&w.url, "pie_kv_persist_pages_total{event=\"loaded\"}").await;
    assert!(loaded >= 5.0, "{loaded}");

    assert_eq!(ask_to_spill(&w, Value::Null).await.0, 200);
    assert_eq!(
        get_json(&format!("{}/v1/internal/state", w.url)).await["retain_spill"],
        Value::Null
    );
    std::fs::remove_dir_all(root).unwrap();
}

/// A spill to a pool that is down fails, is counted and logged, and costs
/// turn two a recompute, never the request.
#[tokio::test]
async fn a_spill_to_a_pool_that_is_down_costs_a_recompute_never_a_request() {
    let p = pool(&[]);
    let w = worker_with("spill-down", &p.url, SMALL).await;
    assert_eq!(ask_to_spill(&w, json!("pool")).await.0, 200);
    drop(p);
    let (text, cached) = session_under_pressure(&w, "spill_failed", 5.0).await;
    assert!(cached < 80, "nothing came back: {cached}");
    assert!(!text.is_empty());
    let kept = metric(&w.url, "pie_kv_persist_pages_total{event=\"spilled\"}").await;
    assert_eq!(kept, 0.0);
}
