//! Moving native processes (`/v1/processes`): on a drain and on a crash,
//! their ids and event streams going on; killed first when only cut off from
//! the controller; a chat session moving with its earlier turns.

use crate::common::{self, wait_for};
use crate::harness::{
    drain_or_kill, labelled_metric, moved_on_drain_and_crash, post_json, serving_worker,
    slow_steps, slow_worker_steps, Cluster, Spec, MOVE_STEP_MS,
};
use serde_json::{json, Value};

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
