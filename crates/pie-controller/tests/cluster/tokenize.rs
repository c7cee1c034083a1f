//! Tokenize once: the controller's prompt ids forwarded to the workers give
//! the outputs of text; chat content parts and `null` content; a controller
//! without `--model` reading a worker's tokenizer.

use crate::common::wait_for;
use crate::harness::{
    cluster_of_one_trusting_worker, error_message, post_json, worker_metric, Cluster, Spec,
};
use serde_json::json;

/// Tokenize once: through the controller the worker uses the controller's
/// prompt ids (`pie_prompt_tokens`, counted), and greedy outputs are token for
/// token those of the same text sent to the worker directly: completions, chat
/// through its template, and stop strings. A native chat session is not
/// pretokenized; a client cannot send the field; every routed request is
/// timed once per part in `pie_controller_overhead_seconds`.
#[tokio::test]
async fn forwarded_prompt_tokens_give_the_outputs_of_text() {
    let (c, worker) = cluster_of_one_trusting_worker("tokenize-once").await;
    let ctl = c.controller.url.clone();
    let counter = "pie_pretokenized_requests_total";
    let completion = json!({"prompt": "The quick brown fox jumps over", "max_tokens": 16,
        "temperature": 0, "ignore_eos": true});
    let chat = json!({"messages": [{"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Name three colours, please."}],
        "max_tokens": 16, "temperature": 0, "ignore_eos": true});
    let mut bodies = vec![
        ("/v1/completions", completion.clone()),
        ("/v1/chat/completions", chat.clone()),
    ];
    // Each with a stop string from the middle of its own greedy text.
    for (path, body) in bodies.clone() {
        let (status, r) = post_json(&worker, path, Some("sk-ctl"), &body).await;
        assert_eq!(status, 200, "{r}");
        let text = r["choices"][0]["text"]
            .as_str()
            .or(r["choices"][0]["message"]["content"].as_str())
            .unwrap()
            .to_string();
        let chars: Vec<char> = text.chars().collect();
        assert!(chars.len() >= 6, "{path}: too little text to cut: {r}");
        let stop: String = chars[chars.len() / 2..chars.len() / 2 + 2].iter().collect();
        let mut with_stop = body.clone();
        with_stop["stop"] = json!(stop);
        bodies.push((path, with_stop));
    }
    let mut routed = 0;
    for (path, body) in &bodies {
        let before = worker_metric(&worker, counter).await;
        let (status, direct) = post_json(&worker, path, Some("sk-ctl"), body).await;
        assert_eq!(status, 200, "{direct}");
        assert_eq!(
            worker_metric(&worker, counter).await,
            before,
            "text is tokenized"
        );
        let (status, via) = post_json(&ctl, path, None, body).await;
        assert_eq!(status, 200, "{via}");
        routed += 1;
        assert_eq!(
            worker_metric(&worker, counter).await,
            before + 1.0,
            "{path}: the controller's ids were used"
        );
        assert_eq!(via["choices"], direct["choices"], "{path} {body}");
        assert_eq!(
            via["usage"]["prompt_tokens"], direct["usage"]["prompt_tokens"],
            "{path}"
        );
        assert_eq!(
            via["usage"]["completion_tokens"], direct["usage"]["completion_tokens"],
            "{path}"
        );
        if body.get("stop").is_some() {
            assert_eq!(via["choices"][0]["finish_reason"], "stop", "{via}");
        }
    }
    // A native chat may resume a session only the worker knows: no ids.
    let before = worker_metric(&worker, counter).await;
    let native = json!({"inferlet": "chat", "args": {"messages": chat["messages"], "max_tokens": 2},
        "props": {"session": "s1"}});
    let (status, r) = post_json(&ctl, "/v1/processes", None, &native).await;
    assert_eq!(status, 201, "{r}");
    routed += 1;
    assert_eq!(worker_metric(&worker, counter).await, before, "{r}");
    // The controller's fields: a caller's own is refused, naming it, on
    // the OpenAI routes and native launches alike (the workers would trust
    // them under the controller's key).
    let forgeries = [
        (
            "pie_prompt_tokens",
            json!({"fingerprint": 1, "ids": [1, 2]}),
        ),
        (
            "pie_resume",
            json!({"tokens": [1], "from": "http://127.0.0.1:9"}),
        ),
        ("pie_stream_ids", json!(true)),
    ];
    for (field, value) in forgeries {
        for (path, body) in [("/v1/completions", &completion), ("/v1/processes", &native)] {
            let mut forged = body.clone();
            forged[field] = value.clone();
            let (status, r) = post_json(&ctl, path, None, &forged).await;
            assert_eq!(status, 400, "{path} {field}: {r}");
            let message = r["error"]["message"].as_str().unwrap();
            assert!(message.contains(field), "{r}");
        }
    }
    for part in ["tokenize", "hash", "route", "proxy"] {
        let count = c
            .metric(&format!(
                "pie_controller_overhead_seconds_count{{part=\"{part}\"}}"
            ))
            .await;
        assert_eq!(count, routed as f64, "{part}");
    }
}

/// OpenAI clients send `content` as an array of text parts, or `null`: the
/// controller parses messages as a worker does (one parser, `pie_core::chat`),
/// so such a chat routes, is tokenized once, and answers as its plain-text
/// twin does on the worker; a part that is not text is refused naming it.
#[tokio::test]
async fn chat_content_parts_and_null_content_route_like_plain_text() {
    let (c, worker) = cluster_of_one_trusting_worker("content-parts").await;
    let ctl = c.controller.url.clone();
    let plain = json!({"messages": [{"role": "user", "content": "Say hi"},
        {"role": "assistant", "content": ""}, {"role": "user", "content": "Again"}],
        "max_tokens": 12, "temperature": 0, "ignore_eos": true});
    let parts = json!({"messages": [
        {"role": "user", "content": [{"type": "text", "text": "Say "}, {"type": "text", "text": "hi"}]},
        {"role": "assistant", "content": null},
        {"role": "user", "content": [{"type": "text", "text": "Again"}]}],
        "max_tokens": 12, "temperature": 0, "ignore_eos": true});
    let path = "/v1/chat/completions";
    let (status, direct) = post_json(&worker, path, Some("sk-ctl"), &plain).await;
    assert_eq!(status, 200, "{direct}");
    let before = worker_metric(&worker, "pie_pretokenized_requests_total").await;
    let (status, via) = post_json(&ctl, path, None, &parts).await;
    assert_eq!(status, 200, "{via}");
    assert_eq!(via["choices"], direct["choices"], "{via}");
    assert_eq!(
        via["usage"]["prompt_tokens"],
        direct["usage"]["prompt_tokens"]
    );
    assert_eq!(
        worker_metric(&worker, "pie_pretokenized_requests_total").await,
        before + 1.0,
        "the controller tokenized the parts"
    );
    let image = json!({"messages": [{"role": "user", "content":
        [{"type": "image_url", "image_url": {"url": "http://127.0.0.1:9/x.png"}}]}]});
    let (status, r) = post_json(&ctl, path, None, &image).await;
    assert_eq!(status, 400, "{r}");
    assert!(error_message(&r).contains("image_url"), "{r}");
}

#[tokio::test]
async fn without_model_the_controller_reads_a_workers_tokenizer_and_routes_by_prefix() {
    let c = Cluster::start_with(Spec {
        controller_model: false,
        ..Spec::new("disaggregate,cache-aware")
    })
    .await;
    let system = "You are the keeper of a lighthouse on a rocky northern island. ".repeat(6);
    let ask = |q: &str| json!({"prompt": format!("{system}{q}"), "max_tokens": 2});
    let (status, first, _, body) = c.complete(ask("Who are you?")).await;
    assert_eq!(status, 200, "{body}");
    wait_for("the first prompt's pages indexed", async || {
        c.cluster().await["index_entries"].as_u64().unwrap_or(0) > 0
    })
    .await;
    let (status, second, route, _) = c.complete(ask("What do you see?")).await;
    assert_eq!((status, second.as_str()), (200, first.as_str()));
    let cached: usize = route
        .split("cache-aware: ")
        .nth(1)
        .and_then(|r| r.split('/').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or(0);
    assert!(cached >= 64, "real prefix matches from the text: {route}");
}
