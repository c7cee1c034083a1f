//! Moving requests between workers: streams and non-streamed requests on a
//! crash and on a drain (transcripts identical), a relocation by a PATCHed
//! pin and by session, a move whose target fails, and a broken stream that
//! no worker can resume; a constrained stream keeps its constraint.

use std::process::Command;
use std::time::Duration;

use crate::common::wait_for;
use crate::harness::{
    drain_or_kill, error_message, labelled_metric, moved_on_drain_and_crash, post_json,
    serving_worker, slow_steps, slow_worker_steps, worker_metric, Cluster, FakeWorker, Spec,
    MOVE_STEP_MS,
};
use serde_json::{json, Value};

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
    let answers = across_drain_and_crash(&mut c, &body, |r| async move {
        let worker = r.headers()["x-pie-worker"].to_str().unwrap().to_string();
        (worker, whole_text(r, 900).await)
    })
    .await;
    for (crash, running, (worker, (text, clean, raw))) in answers {
        assert!(clean, "crash: {crash}: {raw}");
        assert_eq!(text, expected, "crash: {crash}");
        assert_eq!(worker, running, "x-pie-worker names the first worker");
    }
}

/// `body` through the controller twice on slowed workers, the worker serving
/// it drained the first time and killed the second: each time (crash, that
/// worker, what `read` made of the answer); both moves counted.
async fn across_drain_and_crash<T, Fut>(
    c: &mut Cluster,
    body: &Value,
    read: impl Fn(reqwest::Response) -> Fut + Clone + Send + 'static,
) -> Vec<(bool, String, T)>
where
    T: Send + 'static,
    Fut: std::future::Future<Output = T> + Send,
{
    slow_steps(c, MOVE_STEP_MS).await;
    let mut answers = Vec::new();
    for crash in [false, true] {
        let (http, url, body) = (c.http.clone(), c.controller.url.clone(), body.clone());
        let read = read.clone();
        let task = tokio::spawn(async move {
            let r = (http.post(format!("{url}/v1/completions")).json(&body))
                .send()
                .await
                .unwrap();
            read(r).await
        });
        let running = serving_worker(c).await;
        drain_or_kill(c, &running, crash).await;
        answers.push((crash, running, task.await.unwrap()));
    }
    moved_on_drain_and_crash(c).await;
    answers
}

/// A constrained stream (`response_format`) goes on under its constraint
/// where it moves: on a drain and on a crash its text is the undisturbed
/// one, and it matches the grammar (the target re-advanced it over the
/// tokens so far).
#[tokio::test]
async fn a_constrained_stream_keeps_its_constraint_on_drain_and_on_crash() {
    let mut c = Cluster::start_with(Spec {
        worker_args: &["--kv-pages", "512"],
        ..Spec::new("least-loaded,drain-migrate")
    })
    .await;
    let body = json!({"prompt": "spell it:", "max_tokens": 1000, "temperature": 0,
        "stream": true, "response_format": {"type": "regex", "regex": "[a-z]{600}"}});
    let survivor = c.workers[2].as_ref().unwrap().url.clone();
    let direct = c
        .http
        .post(format!("{survivor}/v1/completions"))
        .json(&body)
        .send()
        .await
        .unwrap();
    let (expected, clean, raw) = stream_text(direct).await;
    assert!(clean, "{raw}");
    assert!(
        expected.len() == 600 && expected.bytes().all(|b| b.is_ascii_lowercase()),
        "{expected:?}"
    );
    let answers = across_drain_and_crash(&mut c, &body, stream_text).await;
    for (crash, _, (text, clean, raw)) in answers {
        assert!(clean, "crash: {crash}: {raw}");
        assert_eq!(text, expected, "crash: {crash}");
    }
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
