//! Each worker policy seen from outside, over HTTP on the test model.

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use common::Server;
use serde_json::{json, Value};

fn text_job(prompt: &str, max_tokens: usize, props: Value) -> Value {
    json!({"inferlet": "text-completion", "args": {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": true}, "props": props})
}

/// An endless job holds the only slot while four short ones queue, the last with
/// `last_props`; then the blocker is killed (after the last job finished, for a
/// policy that `preempts` the blocker for it) and the queue drains. Returns the short jobs' first-token times in launch order.
async fn first_tokens_behind_a_blocker(s: &Server, last_props: Value, preempts: bool) -> Vec<u64> {
    let blocker = s.launch(text_job("blocker", 100_000, json!({}))).await;
    s.eventually("blocker running", async || {
        s.get(&format!("/v1/processes/{blocker}")).await.1["state"] == "running"
    })
    .await;
    let mut ids = Vec::new();
    for i in 0..3 {
        ids.push(s.launch(text_job(&format!("low {i}"), 3, json!({}))).await);
    }
    ids.push(s.launch(text_job("urgent", 3, last_props)).await);
    if preempts {
        s.wait_done(&ids[3]).await;
    } else {
        // A launched process submits its sequence asynchronously: the blocker
        // leaves only once all four wait in the engine, or the first to arrive runs first.
        s.eventually("all four waiting in the engine", async || {
            s.get("/v1/policies").await.1["state"]["sequences"] == 5
        })
        .await;
    }
    s.client
        .delete(s.url(&format!("/v1/processes/{blocker}")))
        .send()
        .await
        .unwrap();
    let mut firsts = Vec::new();
    for id in &ids {
        let p = s.wait_done(id).await;
        assert_eq!(p["state"], "finished", "{p}");
        firsts.push(p["first_token_ms"].as_u64().unwrap());
    }
    firsts
}

#[tokio::test]
async fn priority_lets_urgent_work_overtake_the_queue() {
    let s = Server::start("", &["--worker-policy", "priority", "--max-running", "1"]).await;
    let t = first_tokens_behind_a_blocker(&s, json!({"priority": 10}), true).await;
    assert!(
        t[3] < t[0] && t[3] < t[1] && t[3] < t[2],
        "priority 10 first: {t:?}"
    );
    assert!(
        s.metric("pie_preemptions_total").await >= 1.0,
        "it took the blocker's slot"
    );
    // The same workload under fcfs serves the urgent request last.
    let f = Server::start("", &["--worker-policy", "fcfs", "--max-running", "1"]).await;
    let t = first_tokens_behind_a_blocker(&f, json!({"priority": 10}), false).await;
    assert!(t[3] >= t[2], "fcfs ignores priority: {t:?}");
}

#[tokio::test]
async fn deadline_runs_earliest_deadline_first_and_aborts_misses() {
    let s = Server::start(
        "[runtime]\nworker_policy = \"deadline\"\nmax_running = 1\n",
        &[],
    )
    .await;
    let t = first_tokens_behind_a_blocker(&s, json!({"deadline-ms": 60_000}), false).await;
    assert!(
        t[3] <= t[0] && t[3] <= t[1] && t[3] <= t[2],
        "the only deadline goes first: {t:?}"
    );

    let a = Server::start(
        "[runtime]\nworker_policy = \"deadline\"\n[runtime.deadline]\non_miss = \"abort\"\n",
        &[],
    )
    .await;
    // 1 ms: the test model writes its whole context (about 1,000 tokens) in
    // under 50 ms on a quiet machine, so a longer deadline races the job.
    let id = a
        .launch(text_job("late", 100_000, json!({"deadline-ms": 1})))
        .await;
    let p = a.wait_done(&id).await;
    assert_eq!(p["state"], "failed");
    assert!(p["error"].as_str().unwrap().contains("deadline"), "{p}");
    assert_eq!(a.metric("pie_deadline_misses_total").await, 1.0);
    assert_eq!(a.metric("pie_kv_pages_used").await, 0.0);
}

/// A flooding client keeps 24 requests outstanding, a light one 6 (both stay
/// backlogged behind the 2 running slots, even while requests are in flight), for as long as
/// the light one needs for `light_jobs` completions; returns completions per client.
async fn flood(s: &Server, light_jobs: usize) -> (usize, usize) {
    let done = Arc::new([AtomicUsize::new(0), AtomicUsize::new(0)]);
    let stop = Arc::new(AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for (client, outstanding) in [(0usize, 24usize), (1, 6)] {
        for _ in 0..outstanding {
            let (http, url, done, stop) = (
                s.client.clone(),
                s.url("/v1/completions"),
                done.clone(),
                stop.clone(),
            );
            tasks.push(tokio::spawn(async move {
                let name = ["flood", "light"][client];
                while stop.load(Ordering::Relaxed) == 0 {
                    let body = json!({"prompt": "same length prompt", "max_tokens": 32, "ignore_eos": true, "temperature": 0, "props": {"client": name}});
                    let r = http.post(&url).json(&body).send().await.unwrap();
                    assert_eq!(r.status(), 200);
                    r.bytes().await.unwrap();
                    if stop.load(Ordering::Relaxed) == 0 && done[client].fetch_add(1, Ordering::Relaxed) + 1 >= light_jobs && client == 1 {
                        stop.store(1, Ordering::Relaxed);
                    }
                }
            }));
        }
    }
    for t in tasks {
        t.await.unwrap();
    }
    (
        done[0].load(Ordering::Relaxed),
        done[1].load(Ordering::Relaxed),
    )
}

#[tokio::test]
async fn fair_gives_a_flooding_and_a_light_client_equal_service() {
    let fair = Server::start("", &["--worker-policy", "fair", "--max-running", "2"]).await;
    let (flood_n, light_n) = flood(&fair, 20).await;
    let ratio = flood_n as f64 / light_n as f64;
    assert!(
        (0.6..=1.7).contains(&ratio),
        "fair: flood {flood_n} vs light {light_n}"
    );
    let (_, policies) = fair.get("/v1/policies").await;
    let counters = policies["state"]["ordering_state"]["counters"]
        .as_object()
        .unwrap();
    assert!(
        !counters.is_empty() && counters.values().all(|c| c.as_f64().unwrap() > 0.0),
        "{policies}"
    );
    assert_eq!(
        fair.metric("pie_policy_clients").await,
        counters.len() as f64,
        "the gauge counts the counters kept"
    );

    let fcfs = Server::start("", &["--worker-policy", "fcfs", "--max-running", "2"]).await;
    let (flood_n, light_n) = flood(&fcfs, 20).await;
    assert!(
        flood_n as f64 > 2.5 * light_n as f64,
        "fcfs: flood {flood_n} vs light {light_n}"
    );
}

fn session_props() -> Value {
    json!({"session": "chat-7", "keep-ms": 60_000})
}

/// keep-session's config, and a pool of 16 pages of 16 tokens.
const KEEP_SESSION: &str = "[runtime]\nworker_policy = [\"fcfs\", \"keep-session\"]\n";
const SMALL_POOL: [&str; 4] = ["--kv-pages", "16", "--page-size", "16"];

/// One turn of session "chat-7": `prompt`, then `max_tokens` tokens
/// generated past end-of-turn; its final record.
async fn turn(s: &Server, prompt: &[u32], max_tokens: u32) -> Value {
    let args = json!({"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": true});
    let id = s
        .launch(json!({"inferlet": "text-completion", "args": args, "props": session_props()}))
        .await;
    s.wait_done(&id).await
}

/// `context` and the tokens the turn `record` generated.
fn extended(mut context: Vec<u32>, record: &Value) -> Vec<u32> {
    let output = record["output_tokens"].as_array().expect("output tokens");
    context.extend(output.iter().filter_map(Value::as_u64).map(|t| t as u32));
    context
}

/// Session "chat-7"'s turn 1 (60 prompt tokens + 21 generated); returns its
/// whole context, which turn 2 repeats.
async fn turn_one(s: &Server) -> Vec<u32> {
    let prompt: Vec<u32> = (0..60).map(|i| 32 + (i * 7) % 90).collect();
    let first = turn(s, &prompt, 21).await;
    let context = extended(prompt, &first);
    assert_eq!(context.len(), 81);
    context
}

/// Turn 2: turn 1's `context` token for token plus 10 tokens; its record.
async fn turn_two(s: &Server, context: &[u32]) -> Value {
    let mut prompt = context.to_vec();
    prompt.extend((0..10).map(|i| 65 + i));
    turn(s, &prompt, 2).await
}

/// A 150-token prompt (10 pages of 16), one per `seed`.
fn long_prompt(seed: u32) -> Vec<u32> {
    (0..150).map(|j| 40 + (seed * 13 + j) % 80).collect()
}

/// Turn 1, then filler traffic that cycles the whole small pool, then turn 2.
/// Returns turn 2's record and how many prompt tokens the worker computed for it.
async fn two_turns(s: &Server) -> (Value, f64) {
    let context = turn_one(s).await;
    for i in 0..6u32 {
        let filler = long_prompt(i);
        let f = s
            .launch(
                json!({"inferlet": "text-completion", "args": {"prompt": filler, "max_tokens": 2}}),
            )
            .await;
        s.wait_done(&f).await;
    }
    let before = s.metric("pie_prompt_tokens_total").await;
    let second = turn_two(s, &context).await;
    (second, s.metric("pie_prompt_tokens_total").await - before)
}

#[tokio::test]
async fn keep_session_keeps_turn_one_resident_for_turn_two() {
    // The fillers evict anything that is merely cached.
    let kept = Server::start(KEEP_SESSION, &SMALL_POOL).await;
    let (second, computed) = two_turns(&kept).await;
    // Turn 1's whole context (81 tokens) rounded down to pages: 80.
    assert_eq!(
        second["usage"]["prompt_tokens_details"]["cached_tokens"], 80,
        "{second}"
    );
    assert_eq!(computed, 11.0, "only the new tokens were prefilled");
    let (_, policies) = kept.get("/v1/policies").await;
    assert_eq!(
        policies["state"]["retained_sessions"][0]["session"], "chat-7",
        "{policies}"
    );

    let plain = Server::start("", &SMALL_POOL).await;
    let (second, computed) = two_turns(&plain).await;
    assert_eq!(
        second["usage"]["prompt_tokens_details"]["cached_tokens"], 0,
        "without keep-session the fillers evicted turn 1"
    );
    assert_eq!(computed, 91.0);
}

/// A turn sent with `keep-ms: 0` continues its session's retained pages,
/// then ends the retention: nothing of the session is held once it ends.
#[tokio::test]
async fn a_turn_with_keep_ms_0_continues_its_session_then_frees_it() {
    let s = Server::start(KEEP_SESSION, &SMALL_POOL).await;
    let mut prompt = turn_one(&s).await;
    prompt.extend((0..10).map(|i| 65 + i));
    let args = json!({"prompt": prompt, "max_tokens": 2, "ignore_eos": true});
    let props = json!({"session": "chat-7", "keep-ms": 0});
    let id = s
        .launch(json!({"inferlet": "text-completion", "args": args, "props": props}))
        .await;
    let last = s.wait_done(&id).await;
    assert_eq!(
        last["usage"]["prompt_tokens_details"]["cached_tokens"], 80,
        "turn 1's pages: {last}"
    );
    let (_, policies) = s.get("/v1/policies").await;
    assert_eq!(
        policies["state"]["retained_sessions"],
        json!([]),
        "{policies}"
    );
}

/// A 50-token turn 1 (21 tokens generated: 70 computed, four whole pages
/// of 16 and 6 slots), then turn 2 (its context and 10 new tokens, 8
/// generated). Returns turn 2's record and the prompt tokens computed for it.
async fn turns_off_page(s: &Server) -> (Value, f64) {
    let prompt: Vec<u32> = (0..50).map(|i| 32 + (i * 7) % 90).collect();
    let first = turn(s, &prompt, 21).await;
    let mut context = extended(prompt, &first);
    context.extend((0..10).map(|i| 65 + i));
    let before = s.metric("pie_prompt_tokens_total").await;
    let second = turn(s, &context, 8).await;
    (second, s.metric("pie_prompt_tokens_total").await - before)
}

/// keep-session: the next turn copies the slots of the page its session
/// left partial instead of computing them, and goes on exactly as if it
/// had computed them.
#[tokio::test]
async fn a_next_turn_copies_the_partial_page_it_continues() {
    let kept = Server::start(KEEP_SESSION, &SMALL_POOL).await;
    let (second, computed) = turns_off_page(&kept).await;
    assert_eq!(
        second["usage"]["prompt_tokens_details"]["cached_tokens"], 70,
        "four whole pages and the 6 slots: {second}"
    );
    assert_eq!(computed, 11.0, "only the new tokens were prefilled");
    let plain = Server::start("", &SMALL_POOL).await;
    let (recomputed, computed) = turns_off_page(&plain).await;
    assert_eq!(
        recomputed["usage"]["prompt_tokens_details"]["cached_tokens"], 64,
        "the cache has whole pages only: {recomputed}"
    );
    assert_eq!(computed, 17.0);
    assert_eq!(
        second["output_tokens"], recomputed["output_tokens"],
        "copied K and V continue as computed ones"
    );
}

/// Session A's turn 1 is retained (6 pages of a 24-page pool); a blocker
/// runs (150 prompt tokens, then 60 slow steps); a 150-token filler arrives
/// that fits only if A's retention goes; then A's turn 2. Returns A's turn 2
/// cached tokens and the filler's final record.
#[cfg(feature = "fault-injection")]
async fn turn_two_behind_a_filler(s: &Server) -> (Value, Value) {
    let context = turn_one(s).await;
    let fault = json!({"fault": "slow-steps", "delay_ms": 25});
    assert_eq!(s.post("/v1/admin/fault", fault).await.0, 200);
    let blocker = s.launch(json!({"inferlet": "text-completion", "args": {"prompt": long_prompt(1), "max_tokens": 60, "ignore_eos": true}})).await;
    s.eventually("blocker running", async || {
        s.get(&format!("/v1/processes/{blocker}")).await.1["state"] == "running"
    })
    .await;
    let filler = s.launch(json!({"inferlet": "text-completion", "args": {"prompt": long_prompt(2), "max_tokens": 2, "ignore_eos": true}})).await;
    s.eventually("the filler with the engine", async || {
        s.get("/v1/policies").await.1["state"]["sequences"] == 2
    })
    .await;
    let second = turn_two(s, &context).await;
    let blocker = s.wait_done(&blocker).await;
    assert_eq!(blocker["state"], "finished", "{blocker}");
    (
        second["usage"]["prompt_tokens_details"]["cached_tokens"].clone(),
        s.wait_done(&filler).await,
    )
}

/// With `admission_wait_ms`, a new sequence that fits only by dropping a
/// retention waits while another runs, so the retained session's next turn
/// finds its pages; without it the filler drops some. Either way the filler
/// finishes.
#[cfg(feature = "fault-injection")]
#[tokio::test]
async fn admission_wait_keeps_a_retained_turn_while_a_new_sequence_waits() {
    let args = ["--kv-pages", "24", "--page-size", "16"];
    let waits = Server::start(
        &format!("{KEEP_SESSION}[runtime.keep-session]\nadmission_wait_ms = 60000\n"),
        &args,
    )
    .await;
    let (cached, filler) = turn_two_behind_a_filler(&waits).await;
    assert_eq!(cached, 80, "turn 1's pages were kept for turn 2");
    assert_eq!(filler["state"], "finished", "{filler}");

    let evicts = Server::start(KEEP_SESSION, &args).await;
    let (cached, filler) = turn_two_behind_a_filler(&evicts).await;
    // The filler drops as many of turn 1's pages as it lacks.
    let cached = cached.as_u64().unwrap();
    assert!(
        cached < 80,
        "without the wait the filler drops turn 1's pages: {cached} cached"
    );
    assert_eq!(filler["state"], "finished", "{filler}");
}

#[tokio::test]
async fn offload_prefills_on_the_peer_and_survives_its_death() {
    let mut peer = Server::start("", &[]).await;
    let cfg = format!("[runtime]\nworker_policy = [\"fcfs\", \"offload\"]\n[runtime.offload]\npeers = [\"{}\"]\nqueue_tokens = 10\ntimeout_ms = 5000\n", peer.url);
    let busy = Server::start(&cfg, &[]).await;
    let body = json!({"prompt": "a prompt long enough to be worth offloading", "max_tokens": 12, "temperature": 0, "ignore_eos": true});
    let (status, offloaded) = busy.post("/v1/completions", body.clone()).await;
    assert_eq!(status, 200, "{offloaded}");
    assert_eq!(busy.metric("pie_offloaded_prefills_total").await, 1.0);
    assert!(
        peer.metric("pie_prompt_tokens_total").await >= 32.0,
        "the peer computed the prefill"
    );
    assert!(
        offloaded["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap()
            >= 32,
        "{offloaded}"
    );
    let (_, local) = peer.post("/v1/completions", body.clone()).await;
    assert_eq!(
        offloaded["choices"][0]["text"], local["choices"][0]["text"],
        "same output as a local run"
    );

    peer.kill();
    let mut other = body.clone();
    other["prompt"] = json!("another prompt, long enough to be offloaded too");
    let (status, resp) = busy.post("/v1/completions", other).await;
    assert_eq!(status, 200, "a dead peer never fails the request: {resp}");
    assert_eq!(resp["usage"]["completion_tokens"], 12);
    assert_eq!(busy.metric("pie_kv_transfer_fallbacks_total").await, 1.0);
    assert_eq!(
        busy.metric("pie_kv_transfer_refusals_total{reason=\"peer\"}")
            .await,
        1.0
    );
}

#[tokio::test]
async fn sighup_switches_policy_under_load_and_refuses_broken_files() {
    let s = Server::start(
        "[runtime]\nworker_policy = \"fcfs\"\n",
        &["--max-running", "2"],
    )
    .await;
    let ids: Vec<String> = {
        let mut v = Vec::new();
        for i in 0..8 {
            v.push(
                s.launch(text_job(&format!("load {i}"), 40, json!({"priority": i})))
                    .await,
            );
        }
        v
    };
    std::fs::write(&s.config_path, "[runtime]\nworker_policy = \"priority\"\n").unwrap();
    s.hangup();
    s.eventually("policy switched", async || {
        s.get("/v1/policies").await.1["worker_policy"] == json!(["priority"])
    })
    .await;
    for id in &ids {
        assert_eq!(
            s.wait_done(id).await["state"],
            "finished",
            "no request failed across the switch"
        );
    }

    std::fs::write(
        &s.config_path,
        "[runtime]\nworker_policy = \"priority\"\nbogus_key = 1\n",
    )
    .unwrap();
    s.hangup();
    s.eventually("reload failure counted", async || {
        s.metric("pie_config_reload_failures_total").await == 1.0
    })
    .await;
    assert_eq!(
        s.get("/v1/policies").await.1["worker_policy"],
        json!(["priority"]),
        "the old policy stays"
    );
    let (status, err) = s.post("/v1/admin/reload", json!({})).await;
    assert_eq!(status, 400);
    assert!(
        err["error"]["message"]
            .as_str()
            .unwrap()
            .contains("bogus_key"),
        "{err}"
    );
    std::fs::write(&s.config_path, "[runtime]\nworker_policy = \"fair\"\n").unwrap();
    let (status, ok) = s.post("/v1/admin/reload", json!({})).await;
    assert_eq!(
        (status, ok["worker_policy"].clone()),
        (200, json!(["fair"]))
    );
}

/// Two tenants naming the same session never touch each other's retained
/// pages: bob's turn of "chat-7" that keeps nothing leaves alice's "chat-7"
/// retained, shown under her name.
#[tokio::test]
async fn two_tenants_naming_one_session_keep_their_own_retained_pages() {
    let keys = "[server]\napi_keys = [\
        { name = \"alice\", key = \"sk-alice\" }, { name = \"bob\", key = \"sk-bob\" },\
        { name = \"root\", key = \"sk-root\", role = \"admin\" }]\n";
    let s = Server::start(&format!("{keys}{KEEP_SESSION}"), &SMALL_POOL).await;
    let prompt: Vec<u32> = (0..60).map(|i| 32 + (i * 7) % 90).collect();
    for (key, keep_ms) in [("sk-alice", 60_000), ("sk-bob", 0)] {
        let body = json!({"inferlet": "text-completion",
            "args": {"prompt": prompt, "max_tokens": 2, "ignore_eos": true},
            "props": {"session": "chat-7", "keep-ms": keep_ms}});
        let (status, r) = s
            .call(reqwest::Method::POST, "/v1/processes", key, Some(body), &[])
            .await;
        assert_eq!(status, 201, "{r}");
        let path = format!("/v1/processes/{}", r["id"].as_str().unwrap());
        s.eventually("the turn ends", async || {
            let (_, p) = s.call(reqwest::Method::GET, &path, key, None, &[]).await;
            p["state"] == "finished"
        })
        .await;
    }
    let (_, policies) = s
        .call(reqwest::Method::GET, "/v1/policies", "sk-root", None, &[])
        .await;
    let retained = &policies["state"]["retained_sessions"];
    assert_eq!(retained.as_array().map(Vec::len), Some(1), "{policies}");
    assert_eq!(retained[0]["session"], "chat-7", "{policies}");
    assert_eq!(retained[0]["client"], "alice", "{policies}");
}
