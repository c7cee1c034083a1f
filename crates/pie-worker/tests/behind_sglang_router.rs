//! Two workers behind SGLang's router (`sglang-router` from PyPI, the
//! version `.ci/run` pins), as users already run it: the router adds its own
//! fields to every body (`no_stop_trim`, `skip_special_tokens`,
//! `continue_final_message`, ...) and the workers serve them
//! (`pie_core::openai_fields`). Completions and chat, streamed and not.
//!
//! Needs python3 with `sglang_router` (`.ci/run` installs it and sets
//! PIE_REQUIRE_SGLANG_ROUTER=1 so a missing router fails instead of
//! skipping).

mod common;

use std::net::TcpListener;
use std::time::Duration;

use common::Server;
use serde_json::{json, Value};

fn free_port() -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").expect("binds port 0");
    listener.local_addr().expect("an address").port()
}

/// SGLang's router, round robin over `workers`, once it is ready.
async fn router(workers: &[&str]) -> (pie_testkit::Proc, String) {
    let (port, metrics_port) = (free_port().to_string(), free_port().to_string());
    let mut args = vec![
        "-m",
        "sglang_router.launch_router",
        "--host",
        "127.0.0.1",
        "--port",
        &port,
        "--prometheus-host",
        "127.0.0.1",
        "--prometheus-port",
        &metrics_port,
        "--policy",
        "round_robin",
        "--log-level",
        "warn",
        "--worker-urls",
    ];
    args.extend_from_slice(workers);
    let proc = pie_testkit::spawn_unannounced("python3", &args);
    let url = format!("http://127.0.0.1:{port}");
    let client = reqwest::Client::new();
    pie_testkit::wait_for("the router ready", Duration::from_secs(60), async || {
        let ready = client.get(format!("{url}/readiness")).send().await;
        ready.is_ok_and(|r| r.status().is_success())
    })
    .await;
    (proc, url)
}

async fn post(url: &str, body: Value) -> (u16, String) {
    let r = reqwest::Client::new()
        .post(url)
        .json(&body)
        .send()
        .await
        .expect("the router answers");
    (r.status().as_u16(), r.text().await.unwrap_or_default())
}

/// The text of a response: a JSON body's, or a stream's chunks' joined.
fn text_of(route: &str, streamed: bool, body: &str) -> String {
    let piece = |v: &Value| match route {
        "completions" => v["choices"][0]["text"].as_str().map(str::to_string),
        _ if streamed => v["choices"][0]["delta"]["content"]
            .as_str()
            .map(str::to_string),
        _ => v["choices"][0]["message"]["content"]
            .as_str()
            .map(str::to_string),
    };
    match streamed {
        false => piece(&serde_json::from_str(body).expect("a JSON body")).unwrap_or_default(),
        true => (body.lines())
            .filter_map(|l| l.strip_prefix("data: "))
            .filter(|d| *d != "[DONE]")
            .map(|d| serde_json::from_str::<Value>(d).expect("a JSON chunk"))
            .filter_map(|v| piece(&v))
            .collect(),
    }
}

#[tokio::test]
async fn completions_and_chat_pass_through_sglang_router() {
    if !pie_testkit::python_module_available(
        "sglang_router",
        "PIE_REQUIRE_SGLANG_ROUTER",
        "sglang-router==0.3.2",
    ) {
        return;
    }
    let (a, b) = (Server::start("", &[]).await, Server::start("", &[]).await);
    let (_router, url) = router(&[&a.url, &b.url]).await;
    let model = a.get("/v1/models").await.1["data"][0]["id"].clone();
    let chat = json!({"messages": [{"role": "user", "content": "Hi"}]});
    let completion = json!({"prompt": "Once upon a time"});
    for (route, base) in [("completions", completion), ("chat/completions", chat)] {
        for streamed in [false, true] {
            let mut body = base.clone();
            for (k, v) in [
                ("model", model.clone()),
                ("max_tokens", json!(4)),
                ("temperature", json!(0)),
                ("ignore_eos", json!(true)),
                ("stream", json!(streamed)),
            ] {
                body[k] = v;
            }
            let (status, answer) = post(&format!("{url}/v1/{route}"), body).await;
            assert_eq!(status, 200, "{route} stream={streamed}: {answer}");
            let text = text_of(route, streamed, &answer);
            assert!(!text.is_empty(), "{route} stream={streamed}: {answer}");
        }
    }
    for w in [&a, &b] {
        assert!(w.metric("pie_generated_tokens_total").await >= 4.0);
    }
    // A live value of an extension Pie does not serve is refused by name.
    let (status, answer) = post(
        &format!("{url}/v1/completions"),
        json!({"model": model, "prompt": "x", "return_hidden_states": true}),
    )
    .await;
    assert_eq!(status, 400, "{answer}");
    assert!(answer.contains("return_hidden_states"), "{answer}");
}
