//! The official OpenAI Python SDK, unmodified, against `pie serve`.
//!
//! Needs python3 with the `openai` package (`.ci/run` installs it and sets
//! PIE_REQUIRE_OPENAI=1 so a missing SDK fails instead of skipping).

mod common;

use common::Server;

#[tokio::test]
async fn openai_python_sdk_works_unmodified() {
    if !pie_testkit::openai_sdk_available() {
        return;
    }
    let s = Server::start("", &[]).await;
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/openai_sdk.py");
    let seen = pie_testkit::python_report(script, &s.url).await;
    assert_eq!(seen["completion_tokens"], 5);
    assert!(!seen["completion_text"].as_str().unwrap().is_empty());
    // Role chunk, content chunks, finish chunk, usage chunk.
    assert!(seen["chunk_count"].as_u64().unwrap() >= 4, "{seen}");
    assert_eq!(seen["stream_usage"], 6);
    assert_eq!(seen["finish_reason"], "length");
    // The SDK raises BadRequestError and hands over the inner `error` object.
    assert_eq!(seen["bad_props"]["param"], "props.priority", "{seen}");
    let id = seen["props_id"]
        .as_str()
        .unwrap()
        .strip_prefix("chatcmpl-")
        .unwrap();
    let (_, process) = s.get(&format!("/v1/processes/{id}")).await;
    assert_eq!(process["props"]["priority"], 3);
    assert_eq!(process["props"]["tag"], "sdk");
    assert_eq!(process["props"]["session"], "sdk-1");
    assert_eq!(process["output"], seen["props_answer"]);
}

/// Every field of the installed SDK's request types has a rule: served, or
/// refused by name (and accepted with the value that changes nothing); a
/// misspelt field is refused by name (`openai_fields.py`).
#[tokio::test]
async fn every_sdk_field_is_served_or_refused_by_name() {
    if !pie_testkit::openai_sdk_available() {
        return;
    }
    let s = Server::start("", &[]).await;
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/openai_fields.py");
    let report = pie_testkit::python_report(script, &s.url).await;
    for route in ["completions", "chat"] {
        let r = &report[route];
        assert_eq!(r["undecided"], serde_json::json!([]), "{route}: {r}");
        assert_eq!(r["wrong"], serde_json::json!([]), "{route}: {r}");
        assert_eq!(r["typo"]["status"], 400, "{route}: {r}");
        assert_eq!(r["typo"]["param"], "temprature", "{route}: {r}");
        let refused = r["refused"].as_array().unwrap();
        let refused_here = if route == "chat" {
            "functions"
        } else {
            "suffix"
        };
        assert!(refused.contains(&refused_here.into()), "{route}: {r}");
        let served = r["served"].as_array().unwrap();
        for field in [
            "seed",
            "frequency_penalty",
            "presence_penalty",
            "logit_bias",
            "n",
            "logprobs",
        ] {
            assert!(served.contains(&field.into()), "{route}: {field}: {r}");
        }
    }
}
