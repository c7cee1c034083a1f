//! `tools` on `/v1/chat/completions`: both tool-call formats through the
//! unmodified OpenAI SDK (`tools_sdk.py`), on the default model (its
//! template has no tool support: the generic format) and on a tiny model
//! given a Hermes-style template with `--chat-template`; the prompt carries
//! the tools and the results; refusals name the field. The tiny model is
//! also given a Llama 3-style template.

mod common;

use std::path::PathBuf;

use common::Server;
use pie_model::synth::{write_test_model, SynthSpec};
use serde_json::{json, Value};

const HERMES_TEMPLATE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/templates/hermes.jinja");
const LLAMA3_TEMPLATE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/templates/llama3.jinja");

/// The tiny model with room for a prompt that describes tools byte by byte.
fn roomy_model() -> PathBuf {
    let path = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("tools-model-{}.gguf", std::process::id()));
    let spec = SynthSpec {
        context_length: 4096,
        ..SynthSpec::default()
    };
    write_test_model(&path, &spec).expect("the model is written");
    path
}

/// The roomy tiny model speaking `template`.
async fn templated_server(template: &str) -> Server {
    Server::start_model(&roomy_model(), "", &["--chat-template", template]).await
}

fn weather() -> Value {
    json!({"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
        "parameters": {"type": "object", "additionalProperties": false, "required": ["unit"],
            "properties": {"unit": {"enum": ["celsius", "fahrenheit"]}}}}})
}

fn ask(tool_choice: Value) -> Value {
    json!({"messages": [{"role": "user", "content": "Weather in Oslo?"}], "tools": [weather()],
        "tool_choice": tool_choice, "max_tokens": 120, "temperature": 0})
}

/// The SDK's report holds 50 valid required calls (some streamed), a named
/// call of the named tool, a result that reached the next prompt, and a
/// text answer under `auto`.
fn check_sdk_report(seen: &Value) {
    assert_eq!(seen["required"], 50, "{seen}");
    assert_eq!(seen["streamed"], 10, "{seen}");
    assert_eq!(seen["named"], json!(["get_time"]), "{seen}");
    assert_eq!(seen["named_invalid"], json!([null]), "{seen}");
    assert_eq!(seen["named_finish"], "tool_calls", "{seen}");
    let trip = &seen["round_trip"];
    assert!(
        ["get_weather", "get_time"].contains(&trip["call"].as_str().unwrap()),
        "{seen}"
    );
    // The call and its result are in the second prompt, which is answered.
    let grown = trip["prompt"].as_u64().unwrap();
    let first = trip["first_prompt"].as_u64().unwrap() + trip["first_completion"].as_u64().unwrap();
    assert!(grown > first, "{seen}");
    let answered = trip["calls"].as_u64().unwrap() > 0
        || trip["content"].as_str().is_some_and(|c| !c.is_empty());
    assert!(answered, "{seen}");
    let auto = &seen["auto"];
    assert_eq!(auto["calls"], 0, "{seen}");
    assert!(!auto["content"].as_str().unwrap_or("").is_empty(), "{seen}");
}

#[tokio::test]
async fn tool_calls_through_the_openai_sdk_on_the_default_model() {
    let Some(model) = common::cached_default_model() else {
        return;
    };
    if !pie_testkit::openai_sdk_available() {
        return;
    }
    let s = Server::start_model(&model, "", &[]).await;
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/tools_sdk.py");
    check_sdk_report(&pie_testkit::python_report(script, &s.url).await);
}

/// Templates with their own tool format: Hermes-style tags and Llama 3's
/// JSON, each named at start-up.
#[tokio::test]
async fn tool_calls_through_the_openai_sdk_with_hermes_and_llama3_templates() {
    if !pie_testkit::openai_sdk_available() {
        return;
    }
    for template in [HERMES_TEMPLATE, LLAMA3_TEMPLATE] {
        let s = templated_server(template).await;
        let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/tools_sdk.py");
        check_sdk_report(&pie_testkit::python_report(script, &s.url).await);
    }
}

/// The tiny model's vocabulary is bytes: a prompt's token count is its length.
async fn prompt_tokens(s: &Server, body: Value) -> u64 {
    let (status, answer) = s.post("/v1/chat/completions", body).await;
    assert_eq!(status, 200, "{answer}");
    answer["usage"]["prompt_tokens"].as_u64().unwrap()
}

#[tokio::test]
async fn the_prompt_carries_the_tools_and_the_results_in_either_format() {
    let hermes = templated_server(HERMES_TEMPLATE).await;
    let llama3 = templated_server(LLAMA3_TEMPLATE).await;
    let generic = Server::start_model(&roomy_model(), "", &[]).await;
    let call = json!({"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"unit\": \"celsius\"}"}});
    let result = "a long answer from the weather service, cold and clear";
    for s in [&hermes, &llama3, &generic] {
        let plain = prompt_tokens(
            s,
            json!({"messages": [{"role": "user", "content": "Weather in Oslo?"}], "max_tokens": 1}),
        )
        .await;
        let offered = prompt_tokens(s, json!({"messages": [{"role": "user", "content": "Weather in Oslo?"}], "tools": [weather()], "max_tokens": 1})).await;
        let described = weather()["function"]["description"].as_str().unwrap().len() as u64;
        assert!(offered > plain + described, "{offered} vs {plain}");
        let none = prompt_tokens(s, json!({"messages": [{"role": "user", "content": "Weather in Oslo?"}], "tools": [weather()], "tool_choice": "none", "max_tokens": 1})).await;
        assert_eq!(none, plain, "tool_choice none offers nothing");
        let answered = prompt_tokens(s, json!({"messages": [{"role": "user", "content": "Weather in Oslo?"},
            {"role": "assistant", "content": null, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": result}], "tools": [weather()], "max_tokens": 1})).await;
        assert!(
            answered > offered + result.len() as u64,
            "{answered} vs {offered}"
        );
    }
}

#[tokio::test]
async fn a_streamed_required_call_arrives_whole_in_one_chunk() {
    let s = Server::start_model(&roomy_model(), "", &[]).await;
    let mut body = ask(json!("required"));
    body["stream"] = json!(true);
    let chunks = s.stream_chunks("/v1/chat/completions", body).await;
    let calls: Vec<&Value> = (chunks.iter())
        .filter_map(|c| c["choices"][0]["delta"]["tool_calls"].as_array())
        .flatten()
        .collect();
    assert_eq!(calls.len(), 1, "{chunks:?}");
    assert_eq!(calls[0]["index"], 0);
    assert_eq!(calls[0]["function"]["name"], "get_weather");
    let args: Value =
        serde_json::from_str(calls[0]["function"]["arguments"].as_str().unwrap()).unwrap();
    assert!(
        ["celsius", "fahrenheit"].contains(&args["unit"].as_str().unwrap()),
        "{args}"
    );
    let finish = chunks
        .iter()
        .find_map(|c| c["choices"][0]["finish_reason"].as_str());
    assert_eq!(finish, Some("tool_calls"));
    let text: String = (chunks.iter())
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert_eq!(text, "", "no call text leaks as content");
}

#[tokio::test]
async fn bad_tools_are_refused_naming_the_field() {
    let s = Server::start_model(&roomy_model(), "", &[]).await;
    let unusable = json!({"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"a": {"type": "no-such-type"}}}}});
    let cases = [
        (
            json!({"tools": [{"type": "function", "function": {"name": "two words"}}]}),
            "tools[0]",
        ),
        (
            json!({"tools": [weather()], "tool_choice": {"type": "function", "function": {"name": "other"}}}),
            "tool_choice",
        ),
        (json!({"tool_choice": "required"}), "tool_choice"),
        (
            json!({"tools": [weather()], "response_format": {"type": "json_object"}}),
            "response_format",
        ),
        (
            json!({"tools": [unusable], "tool_choice": "required"}),
            "tools",
        ),
    ];
    for (fields, param) in cases {
        let mut body = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2});
        for (k, v) in fields.as_object().unwrap() {
            body[k] = v.clone();
        }
        let (status, answer) = s.post("/v1/chat/completions", body).await;
        assert_eq!(status, 400, "{fields}: {answer}");
        assert_eq!(answer["error"]["param"], param, "{fields}: {answer}");
    }
}

/// A `--chat-template` that cannot be read or compiled stops the start,
/// naming the key and the file.
#[test]
fn a_bad_chat_template_stops_the_start_naming_it() {
    let bad = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("bad-template-{}.jinja", std::process::id()));
    std::fs::write(&bad, "{% for m in messages %}{{ m.content }}").unwrap();
    let missing = bad.with_extension("missing");
    for (file, why) in [(&bad, "does not compile"), (&missing, "cannot read")] {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_pie"))
            .args(["serve", "--port", "0", "--model"])
            .arg(pie_testkit::test_model(0))
            .arg("--chat-template")
            .arg(file)
            .output()
            .expect("pie runs");
        assert!(!out.status.success());
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains("model.chat_template"), "{stderr}");
        assert!(stderr.contains(&*file.to_string_lossy()), "{stderr}");
        assert!(stderr.contains(why), "{stderr}");
    }
}
