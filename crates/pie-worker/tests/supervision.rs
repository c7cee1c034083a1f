//! Engine supervision over HTTP: an injected engine panic or stall turns
//! `/health` (and the controller's `/v1/internal/state`) to 503 with the
//! reason, fails the processes in flight instead of leaving them hanging, and
//! refuses new launches. Needs `--features fault-injection` (CI enables it);
//! without it the fault route does not exist.

mod common;

use common::Server;
use serde_json::json;

#[cfg(not(feature = "fault-injection"))]
#[tokio::test]
async fn without_the_feature_there_is_no_fault_route() {
    let s = Server::start("", &[]).await;
    let (status, body) = s.post("/v1/admin/fault", json!({"fault": "panic"})).await;
    assert_eq!(status, 404, "{body}");
    assert_eq!(s.get("/health").await.0, 200);
}

#[cfg(feature = "fault-injection")]
mod faults {
    use std::time::{Duration, Instant};

    use super::*;
    use pie_testkit::sse_data;
    use serde_json::Value;

    /// Queued processes behind the streaming one (`--max-running 1`), so that
    /// some are surely in flight when the fault hits.
    const QUEUED: usize = 3;

    /// A server with one streaming completion running (its first chunk read)
    /// and `QUEUED` native processes waiting behind it.
    async fn busy_server() -> (Server, reqwest::Response, Vec<String>) {
        let s = Server::start("[server]\nstall_ms = 300\n", &["--max-running", "1"]).await;
        let mut stream = s
            .client
            .post(s.url("/v1/completions"))
            .json(
                &json!({"prompt": "x", "max_tokens": 100_000, "ignore_eos": true, "stream": true}),
            )
            .send()
            .await
            .unwrap();
        assert_eq!(stream.status(), 200);
        let first = stream.chunk().await.unwrap().expect("a first chunk");
        assert!(String::from_utf8_lossy(&first).contains("choices"));
        let mut queued = Vec::new();
        for _ in 0..QUEUED {
            queued.push(s.launch(json!({"inferlet": "text-completion", "args": {"prompt": "y", "max_tokens": 100_000, "ignore_eos": true}})).await);
        }
        (s, stream, queued)
    }

    /// Inject `fault`; returns the `/health` body once it is 503, asserting
    /// that took under 2 s.
    async fn inject_and_wait_unhealthy(s: &Server, fault: &str) -> Value {
        let (status, body) = s.post("/v1/admin/fault", json!({"fault": fault})).await;
        assert_eq!(status, 200, "{body}");
        let injected = Instant::now();
        loop {
            let (status, body) = s.get("/health").await;
            if status == 503 {
                assert_eq!(body["status"], "unhealthy", "{body}");
                return body;
            }
            assert_eq!(status, 200, "{body}");
            assert!(
                injected.elapsed() < Duration::from_secs(2),
                "/health still 200 2 s after a {fault} fault"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// The stream in flight ends (no hang) with an error naming `reason`.
    async fn assert_stream_fails(stream: reqwest::Response, reason: &str) {
        let rest = tokio::time::timeout(Duration::from_secs(10), sse_data(stream))
            .await
            .expect("the stream in flight hung after the fault");
        assert_eq!(rest.last().map(String::as_str), Some("[DONE]"));
        let error: Value = serde_json::from_str(&rest[rest.len() - 2]).unwrap();
        let message = error["error"]["message"].as_str().unwrap_or_default();
        assert!(message.contains(reason), "{message:?} lacks {reason:?}");
        assert!(
            !rest.iter().any(|d| d.contains("finish_reason\":\"length")),
            "a failed stream must not end normally"
        );
    }

    /// Every queued process failed with the reason; launches get 503 with it;
    /// the controller's poll gets 503 with it.
    async fn assert_refused_and_reported(s: &Server, queued: &[String], reason: &str) {
        for id in queued {
            let p = s.wait_done(id).await;
            assert_eq!(p["state"], "failed", "{p}");
            assert!(p["error"].as_str().unwrap().contains(reason), "{p}");
        }
        let (status, body) = s
            .post("/v1/completions", json!({"prompt": "z", "max_tokens": 2}))
            .await;
        assert_eq!(status, 503, "{body}");
        assert!(
            body["error"]["message"].as_str().unwrap().contains(reason),
            "{body}"
        );
        let (status, state) = s.get("/v1/internal/state").await;
        assert_eq!(status, 503, "{state}");
        assert!(
            state["reason"].as_str().unwrap().contains(reason),
            "{state}"
        );
        assert_eq!(s.metric("pie_engine_healthy").await, 0.0);
        assert_eq!(s.metric("pie_queue_depth").await, 0.0);
        assert_eq!(s.metric("pie_running_processes").await, 0.0);
    }

    #[tokio::test]
    async fn an_engine_panic_is_reported_and_fails_what_was_in_flight() {
        let (s, stream, queued) = busy_server().await;
        assert_eq!(s.metric("pie_engine_healthy").await, 1.0);
        let health = inject_and_wait_unhealthy(&s, "panic").await;
        let reason = health["reason"].as_str().unwrap();
        assert!(
            reason.contains("panicked: fault injected: engine panic"),
            "{reason}"
        );
        assert_stream_fails(stream, "panicked").await;
        assert_refused_and_reported(&s, &queued, "panicked").await;
        assert_eq!(s.metric("pie_engine_panics_total").await, 1.0);
        assert_eq!(s.metric("pie_engine_stalls_total").await, 0.0);
    }

    #[tokio::test]
    async fn an_engine_stall_is_reported_and_fails_what_was_in_flight() {
        let (s, stream, queued) = busy_server().await;
        let health = inject_and_wait_unhealthy(&s, "stall").await;
        let reason = health["reason"].as_str().unwrap();
        assert!(
            reason.contains("stalled") && reason.contains("server.stall_ms = 300"),
            "{reason}"
        );
        assert_stream_fails(stream, "stalled").await;
        assert_refused_and_reported(&s, &queued, "stalled").await;
        assert_eq!(s.metric("pie_engine_stalls_total").await, 1.0);
        assert_eq!(s.metric("pie_engine_panics_total").await, 0.0);
    }

    #[tokio::test]
    async fn an_unknown_fault_is_a_bad_request() {
        let s = Server::start("", &[]).await;
        let (status, body) = s.post("/v1/admin/fault", json!({"fault": "fire"})).await;
        assert_eq!(status, 422, "{body}");
        assert_eq!(s.get("/health").await.0, 200);
    }
}
