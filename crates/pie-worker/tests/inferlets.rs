//! WebAssembly inferlets on one worker (the tiny test model): uploads and
//! what is refused, the reference components against the built-ins, forks
//! over shared pages, the one scheduler's slots and charges, the limits
//! (CPU, memory, output, messages), untrusted calls, kills at random points,
//! and a restart that compiles nothing.

mod common;

use std::time::{Duration, Instant};

use common::guests::{
    config, error_of, json_events, launch, message, store_dir, upload, upload_as,
};
use common::Server;
use pie_testkit::inferlet_wasm;
use reqwest::Method;
use serde_json::{json, Value};

/// Launch and wait for the end; returns the record.
async fn run(s: &Server, inferlet: &str, args: Value) -> Value {
    let id = launch(s, inferlet, args, json!({})).await;
    s.wait_done(&id).await
}

/// The `step` of each JSON event the process emits, as it comes.
fn step_events(s: &Server, id: &str) -> tokio::sync::mpsc::UnboundedReceiver<String> {
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    let request = s.client.get(s.url(&format!("/v1/processes/{id}/events")));
    tokio::spawn(async move {
        let mut r = request.send().await.unwrap();
        let mut blocks = pie_client::sse::SseBlocks::default();
        while let Ok(Some(chunk)) = r.chunk().await {
            for block in blocks.push(&chunk).unwrap() {
                let block = String::from_utf8_lossy(&block).to_string();
                let Some(data) = block.lines().find_map(|l| l.strip_prefix("data: ")) else {
                    continue;
                };
                if let Some(step) = serde_json::from_str::<Value>(data)
                    .ok()
                    .and_then(|v| v["step"].as_str().map(str::to_string))
                {
                    let _ = tx.send(step);
                }
            }
        }
    });
    rx
}

/// `fault-injection`: each engine step waits `ms` first, so that the tiny
/// model's steps, not the test's polling, bound what clients get.
async fn slow_steps(s: &Server, key: Option<&str>, ms: u64) {
    let mut req = s
        .client
        .post(s.url("/v1/admin/fault"))
        .json(&json!({"fault": "slow-steps", "delay_ms": ms}));
    if let Some(key) = key {
        req = req.bearer_auth(key);
    }
    assert_eq!(req.send().await.unwrap().status(), 200);
}

/// The worker still runs a process of `inferlet` to its end.
async fn assert_serves(s: &Server, inferlet: &str) {
    let after = run(s, inferlet, json!({"prompt": "hi", "max_tokens": 4})).await;
    assert_eq!(after["state"], "finished", "{after}");
}

#[tokio::test]
async fn reference_components_give_the_built_ins_greedy_output_token_for_token() {
    let s = Server::start(&config(&store_dir(), "", ""), &[]).await;
    upload(&s, "text-completion-wasm", "text-completion").await;
    upload(&s, "chat-wasm", "chat").await;
    upload(&s, "custom-sampler", "custom-sampler").await;
    for prompt in ["The capital of France is", "1, 2, 3,", "Once upon a time"] {
        let args = json!({"prompt": prompt, "max_tokens": 24});
        let native = run(&s, "text-completion", args.clone()).await;
        let wasm = run(&s, "text-completion-wasm", args.clone()).await;
        assert_eq!(wasm["state"], "finished", "{wasm}");
        assert_eq!(wasm["output_tokens"], native["output_tokens"], "{prompt}");
        assert_eq!(wasm["output"], native["output"]);
        // Usage counts the prompt the guest appended as a built-in's does;
        // the native run left its full pages cached for the guest's.
        let usage = |record: &Value, field: &str| record["usage"][field].as_u64().unwrap();
        for field in ["prompt_tokens", "completion_tokens"] {
            assert_eq!(usage(&wasm, field), usage(&native, field), "{field}");
        }
        let cached = wasm["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64();
        // The last prompt token is always computed.
        let full_pages = (usage(&native, "prompt_tokens") - 1) / 16 * 16;
        assert!(cached.unwrap() >= full_pages, "{prompt}: {wasm}");
        let sampler = run(&s, "custom-sampler", args).await;
        assert_eq!(sampler["state"], "finished", "{sampler}");
        assert_eq!(
            sampler["output"], native["output"],
            "custom-sampler, {prompt}"
        );
    }
    let chat =
        json!({"messages": [{"role": "user", "content": "Name a color."}], "max_tokens": 24});
    let native = run(&s, "chat", chat.clone()).await;
    let wasm = run(&s, "chat-wasm", chat).await;
    assert_eq!(wasm["output_tokens"], native["output_tokens"]);
    assert_eq!(wasm["output"], native["output"]);
    assert_eq!(
        wasm["usage"]["prompt_tokens"],
        native["usage"]["prompt_tokens"]
    );
    assert_eq!(
        wasm["usage"]["total_tokens"],
        native["usage"]["total_tokens"]
    );
}

/// Forking a 1,000-token context takes no page; the forks' generations
/// share its full pages (each computes at most its partial last page) and
/// decode in the same engine steps; dropping everything returns the pool.
#[tokio::test]
async fn forks_share_the_prompts_pages_and_decode_in_the_same_steps() {
    let steps = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("fork-steps-{}.jsonl", rand::random::<u32>()));
    let server = format!("[server]\nstep_log = {:?}\n", steps.display().to_string());
    let s = Server::start(&(server + &fork_config()), &[]).await;
    check_forks(&s, 1000, 12).await;
    let log = std::fs::read_to_string(&steps).unwrap();
    let together = log
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|r| r["sequences"] == 8 && r["batch_tokens"] == 8)
        .count();
    // 12 tokens: a first step that also computes each fork's partial page,
    // then 11 decode steps; one may split where a fork joined a step late.
    assert!(together >= 10, "decode steps with all 8 forks: {together}");
}

/// Every event, props change and log line a guest makes is charged with
/// its overhead against `max_output_bytes`, so floods of empty events stop
/// at a bound the config states (64 KiB here: at most 1,024 events of
/// 64 bytes) with an error naming it; log lines past the configured rates
/// (here a burst of 10, then none) are dropped, counted, and the guest goes
/// on.
#[tokio::test]
async fn floods_of_empty_events_and_props_stop_at_the_output_budget() {
    let limits = "max_output_bytes = \"64KiB\"\nlog_lines_per_s = 0\nlog_lines_burst = 10";
    let s = Server::start(&config(&store_dir(), "", limits), &[]).await;
    upload(&s, "flood", "flood").await;
    for kind in ["emit", "json", "props"] {
        let done = run(&s, "flood", json!({"kind": kind, "count": 1_000_000})).await;
        assert_eq!(done["state"], "failed", "{kind}: {done}");
        assert!(
            error_of(&done).contains("max_output_bytes = 65536"),
            "{kind}: {done}"
        );
    }
    let logs = run(&s, "flood", json!({"kind": "log", "count": 20_000})).await;
    assert_eq!(logs["state"], "finished", "{logs}");
    let dropped = s.metric("pie_inferlet_log_lines_dropped_total").await;
    assert_eq!(
        dropped, 19_990.0,
        "all but the burst of 20,000 lines dropped"
    );
}

/// `pie run text-completion` is the built-in `pie serve` runs (one launch,
/// driver and sequence runner): its output after the prompt is the served
/// built-in's, greedy; a sampling flag out of range is refused naming it.
#[tokio::test]
async fn pie_run_prints_what_the_served_built_in_makes() {
    let s = Server::start(&config(&store_dir(), "", ""), &[]).await;
    let prompt = "Once upon a time";
    let served = run(
        &s,
        "text-completion",
        json!({"prompt": prompt, "max_tokens": 12}),
    )
    .await;
    let pie_run = |extra: &[&str]| {
        std::process::Command::new(env!("CARGO_BIN_EXE_pie"))
            .args([
                "run",
                "text-completion",
                "--prompt",
                prompt,
                "--max-tokens",
                "12",
            ])
            .args(extra)
            .arg("--model")
            .arg(common::test_model())
            .output()
            .expect("pie runs")
    };
    let out = pie_run(&[]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let expected = format!("{prompt}{}\n", served["output"].as_str().unwrap());
    assert_eq!(String::from_utf8_lossy(&out.stdout), expected);
    let refused = pie_run(&["--temperature", "3"]);
    assert!(!refused.status.success());
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(
        stderr.contains("--temperature must be between 0 and 2, got 3"),
        "{stderr}"
    );
}

/// `shaping.set-shaping`: a guest's generation with penalties and a bias
/// gives the tokens the OpenAI route and the native built-in give for the
/// same fields (and other tokens than without them); a value out of range
/// fails the process naming the field as the WIT spells it.
#[tokio::test]
async fn guest_penalties_and_bias_match_the_openai_route() {
    let s = Server::start(&config(&store_dir(), "", ""), &[]).await;
    upload(&s, "text-completion-wasm", "text-completion").await;
    let prompt = "1, 2, 3, 1, 2, 3,";
    let plain = json!({"prompt": prompt, "max_tokens": 24, "temperature": 0});
    let mut shaped = plain.clone();
    for (field, value) in [
        ("frequency_penalty", json!(1.5)),
        ("presence_penalty", json!(0.5)),
        ("repetition_penalty", json!(1.3)),
        ("logit_bias", json!({"7": 4.0, "11": -100})),
    ] {
        shaped[field] = value;
    }
    let wasm = run(&s, "text-completion-wasm", shaped.clone()).await;
    assert_eq!(wasm["state"], "finished", "{wasm}");
    let native = run(&s, "text-completion", shaped.clone()).await;
    assert_eq!(wasm["output_tokens"], native["output_tokens"]);
    let (status, openai) = s.post("/v1/completions", shaped.clone()).await;
    assert_eq!(status, 200, "{openai}");
    assert_eq!(wasm["output"], openai["choices"][0]["text"]);
    let unshaped = run(&s, "text-completion-wasm", plain).await;
    assert_ne!(
        unshaped["output_tokens"], wasm["output_tokens"],
        "the penalties and bias changed nothing"
    );
    shaped["frequency_penalty"] = json!(5);
    let refused = run(&s, "text-completion-wasm", shaped).await;
    assert_eq!(refused["state"], "failed", "{refused}");
    assert!(
        error_of(&refused).contains("frequency-penalty must be in [-2, 2], got 5"),
        "{refused}"
    );
}

/// End to end on the real default model: the reference components give the
/// built-ins' greedy tokens, and 8 forks of a 2,000-token context share it.
#[tokio::test]
async fn on_the_default_model_components_match_the_built_ins_and_forks_share_pages() {
    let Some(model) = common::cached_default_model() else {
        return;
    };
    let s = Server::start_model(&model, &fork_config(), &[]).await;
    upload(&s, "text-completion-wasm", "text-completion").await;
    upload(&s, "custom-sampler", "custom-sampler").await;
    let args = json!({"prompt": "The capital of France is", "max_tokens": 24});
    let native = run(&s, "text-completion", args.clone()).await;
    let wasm = run(&s, "text-completion-wasm", args.clone()).await;
    assert_eq!(wasm["output_tokens"], native["output_tokens"]);
    assert_eq!(wasm["output"], native["output"]);
    let sampler = run(&s, "custom-sampler", args.clone()).await;
    assert_eq!(sampler["output"], native["output"]);
    let mut shaped = args;
    shaped["frequency_penalty"] = json!(1.0);
    shaped["logit_bias"] = json!({"314": -100});
    let native_shaped = run(&s, "text-completion", shaped.clone()).await;
    let wasm_shaped = run(&s, "text-completion-wasm", shaped).await;
    assert_eq!(wasm_shaped["output_tokens"], native_shaped["output_tokens"]);
    assert_ne!(wasm_shaped["output_tokens"], native["output_tokens"]);
    check_forks(&s, 2000, 4).await;
}

/// `keep-session`, so a context's pages stay between its calls.
fn fork_config() -> String {
    let runtime = "worker_policy = [\"fcfs\", \"keep-session\"]\nmax_running = 16";
    config(&store_dir(), runtime, "")
}

/// Run `forker` over a context of `tokens` with 8 forks, reading the pool
/// between its steps.
async fn check_forks(s: &Server, tokens: usize, max_tokens: usize) {
    upload(s, "forker", "forker").await;
    let baseline = s.metric("pie_kv_pages_used").await;
    let args = json!({"tokens": tokens, "forks": 8, "max_tokens": max_tokens});
    let id = launch(s, "forker", args, json!({"keep-ms": 60000})).await;
    let mut steps_seen = step_events(s, &id);
    let mut at_step = async |name: &str| {
        let step = tokio::time::timeout(Duration::from_secs(60), steps_seen.recv()).await;
        assert_eq!(step.ok().flatten().as_deref(), Some(name));
        // The gauges follow the engine thread's next turn.
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    at_step("prefilled").await;
    let prefilled_pages = s.metric("pie_kv_pages_used").await;
    let prefilled_tokens = s.metric("pie_prompt_tokens_total").await;
    let full_pages = (tokens / 16) as f64;
    assert!(
        prefilled_pages - baseline >= full_pages,
        "the context's pages are retained"
    );
    message(s, &id, "fork").await;
    at_step("forked").await;
    assert_eq!(
        s.metric("pie_kv_pages_used").await,
        prefilled_pages,
        "a fork takes no page"
    );
    message(s, &id, "generate").await;
    at_step("generated").await;
    let generated_pages = s.metric("pie_kv_pages_used").await - prefilled_pages;
    assert!(
        generated_pages <= 8.0 * 2.0,
        "8 forks took {generated_pages} pages beyond the prompt's {full_pages} full ones"
    );
    let recomputed = s.metric("pie_prompt_tokens_total").await - prefilled_tokens;
    assert!(
        recomputed <= 8.0 * 16.0,
        "the forks prefilled {recomputed} tokens"
    );
    message(s, &id, "drop").await;
    at_step("dropped").await;
    message(s, &id, "quit").await;
    let record = s.wait_done(&id).await;
    assert_eq!(record["state"], "finished", "{record}");
    s.eventually("pages back to where they were", async || {
        s.metric("pie_kv_pages_used").await == baseline
    })
    .await;
}

/// With `fair` and 4 slots, a client running `best-of-n` (8 forks a
/// process) and one running 8 plain streams, both backlogged, get
/// generated-token shares within 10% of each other: the forks take the
/// scheduler's slots and are charged like any sequence.
#[tokio::test]
async fn forks_get_no_more_than_their_clients_fair_share() {
    let runtime = "worker_policy = \"fair\"\nmax_running = 4";
    let s = Server::start(&config(&store_dir(), runtime, ""), &[]).await;
    upload(&s, "best-of-n", "best-of-n").await;
    slow_steps(&s, None, 2).await;
    let window = Duration::from_secs(12);
    let deadline = Instant::now() + window;
    let launched = std::sync::Mutex::new(Vec::new());
    let lp = |client: &'static str, inferlet: &'static str, args: Value| {
        let (s, launched) = (&s, &launched);
        async move {
            while Instant::now() < deadline {
                let id = launch(s, inferlet, args.clone(), json!({ "client": client })).await;
                launched.lock().unwrap().push((client, id.clone()));
                s.wait_done(&id).await;
            }
        }
    };
    let forks = json!({"prompt": "Once upon a time", "n": 8, "max_tokens": 64, "ignore_eos": true});
    let stream = json!({"prompt": "Once upon a time", "max_tokens": 64, "ignore_eos": true});
    let loops = (0..2)
        .map(|_| lp("forks", "best-of-n", forks.clone()))
        .chain((0..8).map(|_| lp("streams", "text-completion", stream.clone())));
    let snapshot = async {
        tokio::time::sleep(window).await;
        let ids = launched.lock().unwrap().clone();
        let (mut a, mut b) = (0.0, 0.0);
        for (client, id) in ids {
            let n = s.get(&format!("/v1/processes/{id}")).await.1["usage"]["completion_tokens"]
                .as_f64()
                .unwrap();
            *if client == "forks" { &mut a } else { &mut b } += n;
        }
        (a, b)
    };
    let (_, (a, b)) = tokio::join!(futures_util::future::join_all(loops), snapshot);
    assert!(a > 0.0 && b > 0.0);
    let gap = (a - b).abs() / a.max(b);
    assert!(gap <= 0.10, "forks {a} tokens, streams {b}: {gap:.3} apart");
}

#[tokio::test]
async fn a_spinning_guest_is_stopped_past_max_cpu_ms_and_others_go_on() {
    let s = Server::start(&config(&store_dir(), "", "max_cpu_ms = 1000"), &[]).await;
    upload(&s, "spin", "spin").await;
    upload(&s, "text-completion-wasm", "text-completion").await;
    let started = Instant::now();
    let spin = launch(&s, "spin", json!({}), json!({})).await;
    let other = run(
        &s,
        "text-completion-wasm",
        json!({"prompt": "hi", "max_tokens": 16}),
    )
    .await;
    assert_eq!(other["state"], "finished", "{other}");
    let record = s.wait_done(&spin).await;
    assert_eq!(record["state"], "failed");
    assert!(error_of(&record).contains("max_cpu_ms = 1000"), "{record}");
    assert!(started.elapsed() < Duration::from_secs(60));
}

#[tokio::test]
async fn guests_past_their_memory_cap_fail_naming_it_and_memory_comes_back() {
    let s = Server::start(&config(&store_dir(), "", "max_memory = \"64MiB\""), &[]).await;
    upload(&s, "hog", "hog").await;
    let rss = || {
        let status = std::fs::read_to_string(format!("/proc/{}/status", s.pid())).unwrap();
        let kb: f64 = status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.split_whitespace().next()?.parse().ok())
            .unwrap();
        kb / 1024.0
    };
    let first = run(&s, "hog", json!({})).await;
    assert_eq!(first["state"], "failed");
    assert!(error_of(&first).contains("max_memory = 64 MiB"), "{first}");
    let batch = async || {
        let ids: Vec<String> = futures_util::future::join_all(
            (0..10).map(|_| launch(&s, "hog", json!({}), json!({}))),
        )
        .await;
        for id in ids {
            assert_eq!(s.wait_done(&id).await["state"], "failed");
        }
    };
    let settled_rss = async || {
        s.eventually("no live instance", async || {
            s.get("/v1/inferlets").await.1["live_instances"] == 0
        })
        .await;
        rss()
    };
    // The first batch warms the threads' allocators up.
    batch().await;
    let before = settled_rss().await;
    for _ in 0..10 {
        batch().await;
    }
    let after = settled_rss().await;
    assert!(
        after - before < 16.0,
        "RSS {before:.0} MiB -> {after:.0} MiB after 100 hogs"
    );
}

#[tokio::test]
async fn a_trapping_guest_fails_alone_with_its_panic_message() {
    let s = Server::start(&config(&store_dir(), "", ""), &[]).await;
    upload(&s, "trap", "trap").await;
    upload(&s, "text-completion-wasm", "text-completion").await;
    let trap = launch(&s, "trap", json!({}), json!({})).await;
    let other = run(
        &s,
        "text-completion-wasm",
        json!({"prompt": "hi", "max_tokens": 8}),
    )
    .await;
    let record = s.wait_done(&trap).await;
    assert_eq!(record["state"], "failed");
    assert!(
        error_of(&record).contains("deliberate panic from the trap inferlet"),
        "{record}"
    );
    assert_eq!(other["state"], "finished");
    let overflow = run(&s, "trap", json!({"overflow": true})).await;
    assert_eq!(overflow["state"], "failed", "{overflow}");
    assert!(error_of(&overflow).contains("stack overflow"), "{overflow}");
}

#[tokio::test]
async fn every_bad_host_call_gets_an_error_and_the_worker_keeps_serving() {
    let s = Server::start(&config(&store_dir(), "", ""), &[]).await;
    upload(&s, "fuzz", "fuzz").await;
    let id = launch(&s, "fuzz", json!({}), json!({})).await;
    let events = json_events(&s, &id).await;
    let record = s.wait_done(&id).await;
    assert_eq!(record["state"], "finished", "{record}");
    let calls = events[0]["calls"].as_array().expect("the fuzzer's report");
    assert!(calls.len() >= 70, "{} calls", calls.len());
    for call in calls {
        let result = call["result"].as_str().unwrap();
        assert!(!result.contains("UNEXPECTED OK"), "{call}");
    }
    // 0.3.0's calls: each bad one an err, and the context as it was after.
    let called = |name: &str| calls.iter().any(|c| c["call"].as_str() == Some(name));
    for name in [
        "start-pass(129 tokens)",
        "start-pass(top-k 65)",
        "truncate(len + 1)",
        "set-token-sets(allowed [])",
        "generation-op: second take",
        "65th operation in flight: start-pass",
    ] {
        assert!(called(name), "the fuzzer calls {name}");
    }
    assert_eq!(events[0]["failed_checks"], json!([]), "{}", events[0]);
    assert_serves(&s, "text-completion").await;
}

/// Every launch killed at a random point (queued, instantiating, mid
/// generation, waiting for a message): pages and instances back to zero.
#[tokio::test]
async fn launches_killed_at_random_points_leave_no_pages_or_instances() {
    let s = Server::start(&config(&store_dir(), "max_running = 8", ""), &[]).await;
    upload(&s, "text-completion-wasm", "text-completion").await;
    upload(&s, "echo", "echo").await;
    upload(&s, "best-of-n", "best-of-n").await;
    let kinds = [
        (
            "text-completion-wasm",
            json!({"prompt": "Once upon a time", "max_tokens": 64}),
        ),
        (
            "best-of-n",
            json!({"prompt": "Once upon a time", "n": 4, "max_tokens": 32}),
        ),
        ("echo", json!({})),
    ];
    let one = async |i: usize| {
        let (name, args) = &kinds[i % kinds.len()];
        let id = launch(&s, name, args.clone(), json!({})).await;
        tokio::time::sleep(Duration::from_millis(rand::random::<u64>() % 40)).await;
        let r = s
            .client
            .delete(s.url(&format!("/v1/processes/{id}")))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
    };
    for batch in 0..50 {
        futures_util::future::join_all((0..20).map(|i| one(batch * 20 + i))).await;
    }
    s.eventually("no live instance", async || {
        s.get("/v1/inferlets").await.1["live_instances"] == 0
    })
    .await;
    s.eventually("no page in use", async || {
        s.metric("pie_kv_pages_used").await == 0.0
    })
    .await;
    assert_serves(&s, "text-completion-wasm").await;
}

#[tokio::test]
async fn an_inferlet_raising_its_priority_overtakes_queued_work() {
    let keys = r#"[server]
api_keys = [
  { name = "bob", key = "sk-bob", limits = { max_priority = 20, upload_inferlets = true } },
  { name = "root", key = "sk-root", role = "admin" },
]
"#;
    let runtime = "worker_policy = \"priority\"\nmax_running = 1";
    let s = Server::start(
        &(keys.to_string() + &config(&store_dir(), runtime, "")),
        &[],
    )
    .await;
    let (status, body) = upload_as(&s, Some("sk-bob"), "priority", "priority").await;
    assert_eq!(status, 201, "{body}");
    slow_steps(&s, Some("sk-root"), 5).await;
    let post = async |body: Value| {
        let (status, v) = s
            .call(Method::POST, "/v1/processes", "sk-bob", Some(body), &[])
            .await;
        assert_eq!(status, 201, "{v}");
        v["id"].as_str().unwrap().to_string()
    };
    let get = async |id: &str| {
        let path = format!("/v1/processes/{id}");
        s.call(Method::GET, &path, "sk-bob", None, &[]).await.1
    };
    let plain = |tokens: u32| {
        json!({"inferlet": "text-completion",
            "args": {"prompt": "Once upon a time", "max_tokens": tokens, "ignore_eos": true},
            "props": {"priority": 1}})
    };
    let holder = post(plain(200)).await;
    s.eventually("the holder runs", async || {
        get(&holder).await["first_token_ms"].is_u64()
    })
    .await;
    let queued: Vec<String> = futures_util::future::join_all((0..4).map(|_| post(plain(40)))).await;
    for id in &queued {
        assert_eq!(get(id).await["state"], "queued", "behind the holder");
    }
    let raised = post(json!({"inferlet": "priority",
        "args": {"priority": 10, "bad_priority": 50, "prompt": "hi", "max_tokens": 8},
        "props": {"priority": 1}}))
    .await;
    let done = loop {
        let r = get(&raised).await;
        if r["state"] != "queued" && r["state"] != "running" {
            break r;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(done["state"], "finished", "{done}");
    assert_eq!(done["props"]["priority"], 10);
    let finished_at = done["finished_ms"].as_u64().unwrap();
    for id in &queued {
        let q = get(id).await;
        let first = q["first_token_ms"].as_u64().unwrap_or(u64::MAX);
        assert!(
            first > finished_at,
            "queued {q} started before the raised one ended: {done}"
        );
    }
    let events = format!("/v1/processes/{raised}/events");
    let text = s.call(Method::GET, &events, "sk-bob", None, &[]).await.1;
    let text = text.as_str().unwrap();
    assert!(text.contains("above key `bob`'s limit of 20"), "{text}");
    assert!(
        text.contains("event: props"),
        "the raise is an event: {text}"
    );
}

#[tokio::test]
async fn uploads_are_checked_and_deleting_a_running_inferlet_is_refused() {
    let keys = r#"[server]
api_keys = [{ name = "alice", key = "sk-alice" }, { name = "root", key = "sk-root", role = "admin" }]
"#;
    let limits = "max_upload = \"300KiB\"";
    let s = Server::start(&(keys.to_string() + &config(&store_dir(), "", limits)), &[]).await;
    let (status, body) = upload_as(&s, Some("sk-alice"), "echo", "echo").await;
    assert_eq!(status, 403, "{body}");
    let (status, body) = upload_as(&s, Some("sk-root"), "chat", "echo").await;
    assert_eq!(status, 400);
    assert!(body["error"]["message"]
        .as_str()
        .unwrap()
        .contains("built-in"));
    let (status, body) = upload_as(&s, Some("sk-root"), "fs", "fs").await;
    assert_eq!(status, 400);
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("wasi:filesystem"),
        "{body}"
    );
    let r = s
        .client
        .post(s.url("/v1/inferlets?name=junk"))
        .bearer_auth("sk-root")
        .body(vec![0u8; 1000])
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    let r = s
        .client
        .post(s.url("/v1/inferlets?name=big"))
        .bearer_auth("sk-root")
        .body(vec![0u8; 400 << 10])
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 413);
    let body: Value = r.json().await.unwrap();
    assert!(body["error"]["message"]
        .as_str()
        .unwrap()
        .contains("max_upload"));
    let (status, _) = upload_as(&s, Some("sk-root"), "echo", "echo").await;
    assert_eq!(status, 201);
    let list = s
        .call(Method::GET, "/v1/inferlets", "sk-alice", None, &[])
        .await
        .1;
    assert_eq!(list["inferlets"].as_array().unwrap().len(), 1);
    let echo = Some(json!({"inferlet": "echo"}));
    let (_, launched) = s
        .call(Method::POST, "/v1/processes", "sk-alice", echo.clone(), &[])
        .await;
    let id = launched["id"].as_str().unwrap().to_string();
    let delete = async || {
        s.call(Method::DELETE, "/v1/inferlets/echo", "sk-root", None, &[])
            .await
            .0
    };
    assert_eq!(delete().await, 409);
    let quit = Some(json!({"message": "quit"}));
    let messages = format!("/v1/processes/{id}/messages");
    assert_eq!(
        s.call(Method::POST, &messages, "sk-alice", quit, &[])
            .await
            .0,
        200
    );
    s.eventually("echo ended", async || delete().await == 200)
        .await;
    let (status, _) = s
        .call(Method::POST, "/v1/processes", "sk-alice", echo, &[])
        .await;
    assert_eq!(status, 400, "a deleted inferlet is unknown");
}

#[tokio::test]
async fn messages_reach_their_process_and_are_bounded() {
    let s = Server::start(&config(&store_dir(), "", "max_pending_messages = 2"), &[]).await;
    upload(&s, "echo", "echo").await;
    upload(&s, "sleeper", "sleeper").await;
    let echo = launch(&s, "echo", json!({}), json!({})).await;
    for m in ["a", "b"] {
        assert_eq!(message(&s, &echo, m).await.0, 200);
    }
    s.eventually("both echoed", async || {
        s.get(&format!("/v1/processes/{echo}")).await.1["output"] == "echo: a\necho: b\n"
    })
    .await;
    message(&s, &echo, "quit").await;
    assert_eq!(s.wait_done(&echo).await["state"], "finished");
    assert_eq!(message(&s, &echo, "late").await.0, 409);
    let sleeper = launch(&s, "sleeper", json!({"ms": 60000}), json!({})).await;
    assert_eq!(message(&s, &sleeper, "1").await.0, 200);
    assert_eq!(message(&s, &sleeper, "2").await.0, 200);
    let (status, body) = message(&s, &sleeper, "3").await;
    assert_eq!(status, 429, "{body}");
    assert!(body["error"]["message"]
        .as_str()
        .unwrap()
        .contains("max_pending_messages"));
    let native = launch(
        &s,
        "text-completion",
        json!({"prompt": "hi", "max_tokens": 200}),
        json!({}),
    )
    .await;
    assert_eq!(message(&s, &native, "x").await.0, 409);
    s.client
        .delete(s.url(&format!("/v1/processes/{sleeper}")))
        .send()
        .await
        .unwrap();
}

#[tokio::test]
async fn a_restarted_worker_launches_an_uploaded_inferlet_without_compiling() {
    let dir = store_dir();
    let s = Server::start(&config(&dir, "", ""), &[]).await;
    upload(&s, "text-completion-wasm", "text-completion").await;
    let before = run(
        &s,
        "text-completion-wasm",
        json!({"prompt": "hi", "max_tokens": 8}),
    )
    .await;
    drop(s);
    let s = Server::start(&config(&dir, "", ""), &[]).await;
    let after = run(
        &s,
        "text-completion-wasm",
        json!({"prompt": "hi", "max_tokens": 8}),
    )
    .await;
    assert_eq!(after["output"], before["output"]);
    let counts = s.get("/v1/inferlets").await.1;
    assert_eq!(counts["compiles"], 0, "{counts}");
    assert_eq!(counts["cache_loads"], 1, "{counts}");
}

/// Past `max_instances` live instances a launch waits queued (and counts
/// against `max_queued`), and runs once an instance ends.
#[tokio::test]
async fn launches_past_max_instances_wait_for_an_instance() {
    let s = Server::start(&config(&store_dir(), "", "max_instances = 1"), &[]).await;
    upload(&s, "sleeper", "sleeper").await;
    let first = launch(&s, "sleeper", json!({"ms": 60000}), json!({})).await;
    let second = launch(&s, "sleeper", json!({"ms": 1}), json!({})).await;
    s.eventually("the first runs", async || {
        s.get(&format!("/v1/processes/{first}")).await.1["state"] == "running"
    })
    .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let waiting = s.get(&format!("/v1/processes/{second}")).await.1;
    assert_eq!(waiting["state"], "queued", "{waiting}");
    assert_eq!(s.get("/v1/inferlets").await.1["live_instances"], 1);
    let r = s
        .client
        .delete(s.url(&format!("/v1/processes/{first}")))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let done = s.wait_done(&second).await;
    assert_eq!(done["state"], "finished", "{done}");
    assert_eq!(done["output"], "woke");
}

/// `pie:inferlet@0.2.0`: a component's constrained generation matches its
/// format (a schema, a regex), an unusable format is an `err` naming it,
/// and a component that imports only 0.1.0 (`echo`) still loads and runs.
#[tokio::test]
async fn a_constrained_generate_matches_its_format_and_0_1_0_components_still_load() {
    let s = Server::start(&config(&store_dir(), "", ""), &[]).await;
    upload(&s, "structured", "structured").await;
    let schema = json!({"type": "object", "additionalProperties": false,
        "required": ["kind", "n"],
        "properties": {"kind": {"enum": ["cat", "dog"]}, "n": {"type": "integer", "minimum": 0, "maximum": 9}}});
    let cases = [
        (json!({"json-schema": schema}), "schema"),
        (json!({"regex": "(yes|no)-[0-9]{3}"}), "regex"),
        (json!({"json-schema": {"type": "no-such-type"}}), "bad"),
    ];
    for (format, what) in cases {
        let args = json!({"prompt": "go", "max_tokens": 60, "format": format});
        let id = launch(&s, "structured", args, json!({})).await;
        let events = json_events(&s, &id).await;
        let event = &events[0];
        if what == "bad" {
            let error = event["error"].as_str().unwrap_or_default();
            assert!(error.contains("no-such-type"), "{event}");
            continue;
        }
        assert_eq!(event["finish"], "stop", "{what}: {event}");
        let text = event["text"].as_str().unwrap();
        if what == "schema" {
            let v: Value = serde_json::from_str(text).unwrap_or_else(|e| panic!("{text}: {e}"));
            assert!(
                ["cat", "dog"].contains(&v["kind"].as_str().unwrap_or("")),
                "{text}"
            );
            assert!((0..=9).contains(&v["n"].as_i64().unwrap_or(-1)), "{text}");
        } else {
            let (word, digits) = text.split_once('-').unwrap_or_else(|| panic!("{text}"));
            assert!(["yes", "no"].contains(&word) && digits.len() == 3, "{text}");
        }
    }
    let imports = |guest: &str| std::fs::read(inferlet_wasm(guest)).unwrap();
    let has = |wasm: &[u8], name: &[u8]| wasm.windows(name.len()).any(|w| w == name);
    let echo = imports("echo");
    assert!(has(&echo, b"pie:inferlet/process@0.1.0"));
    assert!(
        !has(&echo, b"pie:inferlet/structured"),
        "echo is a 0.1.0 component"
    );
    upload(&s, "echo", "echo").await;
    let id = launch(&s, "echo", json!({}), json!({})).await;
    assert_eq!(message(&s, &id, "quit").await.0, 200);
    assert_eq!(s.wait_done(&id).await["state"], "finished");
}

/// `reporting.report-logprobs(false)` leaves a generation's tokens as they
/// were and its log-probabilities empty; on (the default), one per token.
#[tokio::test]
async fn a_context_with_logprobs_off_generates_the_same_tokens_without_them() {
    let s = Server::start(&config(&store_dir(), "", ""), &[]).await;
    upload(&s, "structured", "structured").await;
    let mut made = Vec::new();
    for logprobs in [true, false] {
        let args = json!({"prompt": "go", "max_tokens": 40, "logprobs": logprobs,
            "format": {"regex": "[a-z ]{10,30}"}});
        let id = launch(&s, "structured", args, json!({})).await;
        let event = json_events(&s, &id).await.remove(0);
        let tokens = event["tokens"].as_u64().unwrap_or(0);
        assert!(tokens > 0, "{event}");
        let expected = if logprobs { tokens } else { 0 };
        assert_eq!(event["logprobs"], expected, "{event}");
        made.push(event["text"].clone());
    }
    assert_eq!(made[0], made[1]);
}

/// A WebAssembly inferlet's process does not move: its hand-off is a 422
/// naming why, and it keeps running.
#[tokio::test]
async fn an_inferlets_process_refuses_a_hand_off_and_keeps_running() {
    let s = Server::start(&config(&store_dir(), "", ""), &[]).await;
    upload(&s, "echo", "echo").await;
    let id = launch(&s, "echo", json!({}), json!({})).await;
    let (status, v) = s
        .post(&format!("/v1/internal/processes/{id}/handoff"), json!({}))
        .await;
    assert_eq!(status, 422, "{v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("does not move"),
        "{v}"
    );
    assert_eq!(message(&s, &id, "quit").await.0, 200);
    assert_eq!(s.wait_done(&id).await["state"], "finished");
}
