//! The OpenAI surface through the controller: every field of the installed
//! SDK's request types is served or refused by name, as a worker does (the
//! same rule, `pie_core::openai_fields`, checked before any worker is asked);
//! tool calls come back as the worker answers them.

use crate::harness::{cluster_of_one_trusting_worker, post_json, worker_metric, Cluster, Spec};
use serde_json::{json, Value};

#[tokio::test]
async fn every_sdk_field_is_served_or_refused_by_name_through_the_controller() {
    if !pie_testkit::openai_sdk_available() {
        return;
    }
    let c = Cluster::start_with(Spec {
        workers: 1,
        ..Spec::new("least-loaded")
    })
    .await;
    let script = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../pie-worker/tests/openai_fields.py"
    );
    let report = pie_testkit::python_report(script, &c.controller.url).await;
    for route in ["completions", "chat"] {
        let r = &report[route];
        assert_eq!(r["undecided"], json!([]), "{route}: {r}");
        assert_eq!(r["wrong"], json!([]), "{route}: {r}");
        assert_eq!(
            r["typo"],
            json!({"status": 400, "param": "temprature"}),
            "{route}: {r}"
        );
        let refused = r["refused"].as_array().unwrap();
        let refused_here = if route == "chat" {
            "functions"
        } else {
            "suffix"
        };
        assert!(refused.contains(&refused_here.into()), "{route}: {r}");
        for served in ["n", "logprobs"] {
            let served_here = r["served"].as_array().unwrap();
            assert!(served_here.contains(&served.into()), "{route}: {r}");
        }
    }
}

/// A chat offering tools through the controller: its prompt ids, rendered
/// with the tools by the controller, are the ones the worker renders (the
/// same prompt length as sent directly, the forwarded ids counted), and the
/// call comes back whole and streamed.
#[tokio::test]
async fn tool_calls_come_back_through_the_controller() {
    let (c, worker) = cluster_of_one_trusting_worker("tools").await;
    let tool = json!({"type": "function", "function": {"name": "get_weather",
        "parameters": {"type": "object", "additionalProperties": false, "required": ["unit"],
            "properties": {"unit": {"enum": ["celsius", "fahrenheit"]}}}}});
    let body = json!({"messages": [{"role": "user", "content": "Weather?"}], "tools": [tool],
        "tool_choice": "required", "max_tokens": 100, "temperature": 0});
    let path = "/v1/chat/completions";
    let (status, direct) = post_json(&worker, path, Some("sk-ctl"), &body).await;
    assert_eq!(status, 200, "{direct}");
    let forwarded = worker_metric(&worker, "pie_pretokenized_requests_total").await;
    let (status, via) = post_json(&c.controller.url, path, None, &body).await;
    assert_eq!(status, 200, "{via}");
    assert_eq!(
        worker_metric(&worker, "pie_pretokenized_requests_total").await,
        forwarded + 1.0
    );
    assert_eq!(
        via["usage"]["prompt_tokens"],
        direct["usage"]["prompt_tokens"]
    );
    let call = &via["choices"][0]["message"]["tool_calls"][0];
    assert_eq!(call["function"]["name"], "get_weather", "{via}");
    assert_eq!(via["choices"][0]["finish_reason"], "tool_calls", "{via}");
    assert_eq!(
        call["function"],
        direct["choices"][0]["message"]["tool_calls"][0]["function"]
    );
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let response = reqwest::Client::new()
        .post(format!("{}{path}", c.controller.url))
        .json(&streamed)
        .send()
        .await
        .unwrap();
    let text = response.text().await.unwrap();
    let chunks: Vec<Value> = (text.lines())
        .filter_map(|l| l.strip_prefix("data: "))
        .filter_map(|d| serde_json::from_str(d).ok())
        .collect();
    let streamed_call = chunks
        .iter()
        .find_map(|c| c["choices"][0]["delta"]["tool_calls"].get(0).cloned())
        .unwrap_or_else(|| panic!("no delta.tool_calls: {text}"));
    assert_eq!(streamed_call["function"], call["function"]);
}
