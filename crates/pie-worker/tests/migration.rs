//! What a controller needs to move a process between workers: a stream that
//! names its process and carries each token's id (`pie_stream_ids`), a process
//! resumed from the tokens it generated elsewhere (`pie_resume`) that goes on
//! exactly as it would have (greedy and seeded sampling, held-back text and
//! stop strings), a hand-off that stops a process where it is, a prefetch of a
//! peer's pages, and a drain (SIGTERM or `POST /v1/admin/drain`).

mod common;

use std::time::{Duration, Instant};

use common::{read_stream, Server};
use serde_json::{json, Value};

fn request(prompt: &[u32], seeded: bool, max_tokens: usize) -> Value {
    let mut body = json!({"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": true,
        "stream": true, "pie_stream_ids": true, "temperature": 0, "stop": ["zzzzzzzz"]});
    if seeded {
        body["temperature"] = json!(1.0);
        body["seed"] = json!(11);
    }
    body
}

fn prompt(len: usize) -> Vec<u32> {
    (0..len as u32).map(|i| (i * 13) % 250 + 1).collect()
}

#[tokio::test]
async fn a_process_resumed_from_its_tokens_goes_on_as_it_would_have() {
    let s = Server::start("", &[]).await;
    let p = prompt(40);
    for seeded in [false, true] {
        let (whole, _) = read_stream(s.stream(request(&p, seeded, 60)).await, None).await;
        assert_eq!(whole.tokens.len(), 60);
        assert!(whole.process.is_some(), "the stream names its process");
        for k in [1, 17, 59] {
            let mut body = request(&p, seeded, 60);
            body["pie_resume"] = json!({"tokens": whole.ids()[..k]});
            body["stream_options"] = json!({"include_usage": true});
            let (rest, _) = read_stream(s.stream(body).await, None).await;
            assert_eq!(rest.ids(), whole.ids()[k..], "seeded {seeded}, k {k}");
            let sent: String = whole.tokens[..k].iter().map(|(_, t)| t.as_str()).collect();
            assert_eq!(
                sent + &rest.text(),
                whole.text(),
                "seeded {seeded}, k {k}: the text, held-back bytes included"
            );
        }
    }
    // Usage counts the tokens generated before the resume.
    let mut body = request(&p, false, 10);
    body["stream"] = json!(false);
    body["pie_resume"] = json!({"tokens": [5, 6, 7]});
    let (status, v) = s.post("/v1/completions", body).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["usage"]["completion_tokens"], 10);
    assert_eq!(v["usage"]["prompt_tokens"], 40);
    // Out-of-vocabulary resumed ids are refused by name.
    let mut body = request(&p, false, 10);
    body["pie_resume"] = json!({"tokens": [1 << 30]});
    let (status, v) = s.post("/v1/completions", body).await;
    assert_eq!(status, 400);
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("pie_resume.tokens"),
        "{v}"
    );
}

#[tokio::test]
async fn only_a_worker_key_may_resume_or_ask_for_token_ids() {
    let s = Server::start(
        "[server]\napi_keys = [{ name = \"alice\", key = \"sk-a\" }, { name = \"ctl\", key = \"sk-c\", role = \"worker\" }]\n",
        &[],
    )
    .await;
    for field in ["pie_resume", "pie_stream_ids"] {
        let mut body = json!({"prompt": "hi", "max_tokens": 2});
        body[field] = if field == "pie_resume" {
            json!({"tokens": [3]})
        } else {
            json!(true)
        };
        let r = s
            .client
            .post(s.url("/v1/completions"))
            .bearer_auth("sk-a")
            .json(&body)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 400, "{field}");
        let v: Value = r.json().await.unwrap();
        assert!(
            v["error"]["message"].as_str().unwrap().contains(field),
            "{v}"
        );
        let r = s
            .client
            .post(s.url("/v1/completions"))
            .bearer_auth("sk-c")
            .json(&body)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200, "{field} from the controller's key");
    }
}

#[tokio::test]
async fn a_handed_off_process_goes_on_on_a_peer_that_pulled_its_pages() {
    let a = Server::start("", &[]).await;
    let b = Server::start("", &[]).await;
    // The test model is fast enough to finish the last 80 tokens before the
    // prefetch and the hand-off below: slow its steps so the hand-off lands
    // mid-way (needs `--features fault-injection`).
    let slow = json!({"fault": "slow-steps", "delay_ms": 3});
    let (status, v) = a.post("/v1/admin/fault", slow).await;
    assert_eq!(status, 200, "build with --features fault-injection: {v}");
    let p = prompt(70);
    for seeded in [false, true] {
        // Undisturbed on the source: the target holds none of these pages.
        let (undisturbed, _) = read_stream(a.stream(request(&p, seeded, 120)).await, None).await;
        let (first, r) = read_stream(a.stream(request(&p, seeded, 120)).await, Some(40)).await;
        let id = first.process.clone().unwrap();
        // Stage 1: the peer copies what `a` holds while it keeps decoding.
        let mut so_far = p.clone();
        so_far.extend(first.ids());
        let (status, v) = b
            .post(
                "/v1/internal/kv/prefetch",
                json!({"from": a.url, "tokens": so_far}),
            )
            .await;
        assert_eq!(status, 200, "{v}");
        assert!(
            v["pages"].as_u64().unwrap() >= (so_far.len() / 16 - 1) as u64,
            "{v}"
        );
        let (status, v) = a
            .post(&format!("/v1/internal/processes/{id}/handoff"), json!({}))
            .await;
        assert_eq!((status, v["handing_off"].clone()), (200, json!(true)));
        let (rest_on_a, _) = read_stream(r, None).await;
        assert!(
            rest_on_a.handed_off,
            "the stream ends with a hand-off, not an error"
        );
        let (status, _) = a
            .post(&format!("/v1/internal/processes/{id}/handoff"), json!({}))
            .await;
        assert_eq!(status, 409, "a process hands off once");
        let (_, state) = a.get(&format!("/v1/processes/{id}")).await;
        assert_eq!(state["state"], "migrated");
        let generated: Vec<(u32, String)> = first
            .tokens
            .iter()
            .chain(&rest_on_a.tokens)
            .cloned()
            .collect();
        let ids: Vec<u32> = generated.iter().map(|(t, _)| *t).collect();
        // Stage 2: the peer resumes it, pulling the pages it lacks.
        let mut body = request(&p, seeded, 120);
        body["pie_resume"] = json!({"tokens": ids, "from": a.url});
        let (rest, _) = read_stream(b.stream(body).await, None).await;
        let sent: String = generated.iter().map(|(_, t)| t.as_str()).collect();
        assert_eq!(sent + &rest.text(), undisturbed.text(), "seeded {seeded}");
        assert_eq!([ids, rest.ids()].concat(), undisturbed.ids());
    }
    assert!(
        b.metric("pie_kv_transfer_pages_total{direction=\"in\"}")
            .await
            >= 8.0
    );
    assert!(a.metric("pie_requests_total{status=\"migrated\"}").await >= 2.0);
}

#[tokio::test]
async fn a_drain_refuses_new_work_stays_live_and_exits_when_empty() {
    for by_signal in [false, true] {
        let mut s = Server::start("", &[]).await;
        let r = s.stream(request(&prompt(30), false, 400)).await;
        if by_signal {
            s.terminate();
        } else {
            let (status, v) = s.post("/v1/admin/drain", json!({})).await;
            assert_eq!((status, v["draining"].clone()), (202, json!(true)));
        }
        s.eventually("draining", async || {
            s.client
                .get(s.url("/health"))
                .send()
                .await
                .unwrap()
                .status()
                == 503
        })
        .await;
        let health: Value = s
            .client
            .get(s.url("/health"))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        assert_eq!(health["status"], "draining");
        assert_eq!(
            s.client.get(s.url("/livez")).send().await.unwrap().status(),
            200
        );
        assert_eq!(s.get("/v1/internal/state").await.1["draining"], true);
        let (status, v) = s
            .post("/v1/completions", json!({"prompt": "new", "max_tokens": 2}))
            .await;
        assert_eq!(status, 503);
        assert!(
            v["error"]["message"].as_str().unwrap().contains("draining"),
            "{v}"
        );
        // The stream in flight finishes; then the worker exits.
        let (done, _) = read_stream(r, None).await;
        assert_eq!(done.tokens.len(), 400);
        let deadline = Instant::now() + Duration::from_secs(10);
        while !s.exited() {
            assert!(Instant::now() < deadline, "a drained worker exits");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

#[tokio::test]
async fn a_drain_that_outlasts_its_timeout_fails_what_is_left_and_exits() {
    let mut s = Server::start("[server]\ndrain_timeout_ms = 0\n", &[]).await;
    let r = s.stream(request(&prompt(30), false, 1_000_000)).await;
    let started = Instant::now();
    s.terminate();
    let body = r.text().await.unwrap_or_default();
    assert!(
        body.contains("drain_timeout_ms (0 ms) passed"),
        "the left-over process fails naming the timeout: {}",
        &body[body.len().saturating_sub(400)..]
    );
    while !s.exited() {
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "exits after its drain timeout"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
