//! Cluster actors: scale-by-prop hints (published, in dry run, and from a
//! prop an inferlet raises on itself),
//! persist-prefix, replicate and pool-replicate, and bad actor configs
//! refused naming the file and key.

use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use crate::common::{self, bin, wait_for};
use crate::harness::{
    held_through_controller, labelled_metric, post_json, slow_worker_steps, timed_completion,
    worker_metric, Cluster, Spec, MOVE_STEP_MS,
};
use serde_json::{json, Value};

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

/// A prop an inferlet sets on itself reaches the cluster plane: the
/// controller follows its process's props events, so `scale-by-prop` counts
/// it in the group it names (its launch named none) from the next tick.
#[tokio::test]
async fn a_prop_an_inferlet_raises_on_itself_is_seen_by_scale_by_prop() {
    let c = Cluster::start_with(Spec {
        workers: 1,
        cluster_config: "actor_tick_ms = 10\n[cluster.scale-by-prop]\nprop = \"priority\"\n\
                         target_load_per_worker = 1\nmax_workers = 8\n",
        ..Spec::new("least-loaded,scale-by-prop")
    })
    .await;
    let w0 = c.workers[0].as_ref().unwrap().url.clone();
    let wasm = std::fs::read(pie_testkit::inferlet_wasm("priority")).unwrap();
    let uploaded = (c.http.post(format!("{w0}/v1/inferlets?name=raiser")))
        .body(wasm)
        .send()
        .await
        .unwrap();
    assert_eq!(uploaded.status(), 201);
    slow_worker_steps(&w0, MOVE_STEP_MS).await;
    let launch = json!({"inferlet": "raiser", "args": {"priority": 7,
        "prompt": "count to a thousand", "max_tokens": 2000}});
    let (status, v) = post_json(&c.controller.url, "/v1/processes", None, &launch).await;
    assert_eq!(status, 201, "{v}");
    let group = "pie_cluster_scale_recommended{group=\"7\"}";
    wait_for("the raised prop's group", async || {
        labelled_metric(&c, group).await.is_some()
    })
    .await;
    let id = v["id"].as_str().unwrap();
    let record = c.get_text(&format!("/v1/processes/{id}")).await;
    assert!(record.contains("\"priority\":7"), "{record}");
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
