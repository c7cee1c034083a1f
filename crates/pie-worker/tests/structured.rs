//! `response_format`: constrained output on both OpenAI routes and in a
//! native process's args. On the tiny random-weights model, whatever the
//! weights favour, every answer that stops parses and validates; an
//! unusable schema is a 400 naming it; a resumed constrained process goes on
//! under its constraint and refuses tokens that break it; a repeated schema
//! is compiled once.

mod common;

use common::{read_stream, Server};
use serde_json::{json, Value};

fn schema() -> Value {
    json!({
        "type": "object",
        "additionalProperties": false,
        "required": ["kind", "age", "tags", "code", "pos"],
        "properties": {
            "kind": {"enum": ["cat", "dog", "fox"]},
            "age": {"type": "integer", "minimum": 1, "maximum": 30},
            "tags": {"type": "array", "minItems": 2, "maxItems": 3, "items": {"enum": ["a", "b", "c"]}},
            "code": {"type": "string", "pattern": "^[A-Z]{2}[0-9]$"},
            "pos": {
                "type": "object",
                "additionalProperties": false,
                "required": ["x"],
                "properties": {"x": {"type": "integer", "minimum": -5, "maximum": 5}}
            }
        }
    })
}

fn json_schema_format() -> Value {
    json!({"type": "json_schema", "json_schema": {"name": "pet", "schema": schema(), "strict": true}})
}

/// `text` is a value valid under [`schema`]; panics naming what is not.
fn validate(text: &str) {
    let v: Value = serde_json::from_str(text).unwrap_or_else(|e| panic!("{text:?}: {e}"));
    let o = v
        .as_object()
        .unwrap_or_else(|| panic!("not an object: {text}"));
    assert_eq!(o.len(), 5, "exactly the five properties: {text}");
    assert!(
        ["cat", "dog", "fox"].contains(&v["kind"].as_str().unwrap_or("")),
        "{text}"
    );
    let age = v["age"].as_i64().unwrap_or(0);
    assert!((1..=30).contains(&age), "{text}");
    let tags = v["tags"].as_array().unwrap_or_else(|| panic!("{text}"));
    assert!((2..=3).contains(&tags.len()), "{text}");
    assert!(
        tags.iter()
            .all(|t| ["a", "b", "c"].contains(&t.as_str().unwrap_or(""))),
        "{text}"
    );
    let code = v["code"].as_str().unwrap_or("").as_bytes();
    assert!(
        code.len() == 3 && code[..2].iter().all(u8::is_ascii_uppercase) && code[2].is_ascii_digit(),
        "{text}"
    );
    assert_eq!(v["pos"].as_object().map(|p| p.len()), Some(1), "{text}");
    assert!(
        (-5..=5).contains(&v["pos"]["x"].as_i64().unwrap_or(99)),
        "{text}"
    );
}

#[tokio::test]
async fn every_json_schema_answer_validates_sampled_or_streamed() {
    let s = Server::start("", &[]).await;
    for seed in 0..8 {
        let body = json!({"messages": [{"role": "user", "content": format!("pet number {seed}")}],
            "max_tokens": 120, "temperature": 1.0, "seed": seed,
            "response_format": json_schema_format()});
        let (status, r) = s.post("/v1/chat/completions", body).await;
        assert_eq!(status, 200, "{r}");
        let choice = &r["choices"][0];
        assert_eq!(choice["finish_reason"], "stop", "{r}");
        validate(choice["message"]["content"].as_str().unwrap());
    }
    let body = json!({"prompt": "a pet:", "max_tokens": 120, "temperature": 0, "stream": true,
        "response_format": json_schema_format()});
    let chunks = s.stream_chunks("/v1/completions", body).await;
    let text: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["text"].as_str())
        .collect();
    validate(&text);
    let masks = s.metric("pie_constraint_mask_seconds_count").await;
    assert!(
        masks >= 9.0,
        "every constrained token timed its mask: {masks}"
    );
    let compiled = s.metric("pie_grammars_compiled_total").await;
    let reused = s.metric("pie_grammars_reused_total").await;
    assert_eq!(
        (compiled, reused),
        (1.0, 8.0),
        "nine requests of one schema compile it once"
    );
}

#[tokio::test]
async fn a_regex_a_grammar_and_a_native_process_are_constrained() {
    let s = Server::start("", &[]).await;
    let regex = json!({"type": "regex", "regex": "(yes|no), [0-9]{2}"});
    for seed in 0..4 {
        let body = json!({"prompt": "answer:", "max_tokens": 30, "temperature": 1.0,
            "seed": seed, "response_format": regex});
        let (status, r) = s.post("/v1/completions", body).await;
        assert_eq!(status, 200, "{r}");
        let text = r["choices"][0]["text"].as_str().unwrap();
        let (word, digits) = text.split_once(", ").unwrap_or_else(|| panic!("{text:?}"));
        assert!(["yes", "no"].contains(&word), "{text:?}");
        assert!(
            digits.len() == 2 && digits.bytes().all(|b| b.is_ascii_digit()),
            "{text:?}"
        );
    }
    let lark = json!({"type": "grammar", "grammar": "start: (\"ab\" | \"cd\")+ \".\"\n"});
    let body = json!({"prompt": "go", "max_tokens": 12, "temperature": 0, "response_format": lark});
    let (status, r) = s.post("/v1/completions", body).await;
    assert_eq!(status, 200, "{r}");
    let text = r["choices"][0]["text"].as_str().unwrap();
    let body = text.strip_suffix('.').unwrap_or(text);
    assert!(
        body.len() % 2 == 0 && body.as_bytes().chunks(2).all(|p| p == b"ab" || p == b"cd"),
        "{text:?}"
    );
    let id = s
        .launch(
            json!({"inferlet": "text-completion", "args": {"prompt": "answer:",
            "max_tokens": 30, "response_format": regex}}),
        )
        .await;
    let record = s.wait_done(&id).await;
    let output = record["output"].as_str().unwrap();
    assert!(
        output.starts_with("yes, ") || output.starts_with("no, "),
        "{record}"
    );
}

#[tokio::test]
async fn an_unusable_format_is_a_400_naming_it() {
    let s = Server::start("", &[]).await;
    let bad_schema = json!({"type": "json_schema", "json_schema": {"name": "x",
        "schema": {"type": "object", "properties": {"a": {"type": "no-such-type"}}}}});
    for (format, names) in [
        (bad_schema, "no-such-type"),
        (
            json!({"type": "regex", "regex": "(unclosed"}),
            "response_format",
        ),
        (json!({"type": "xml"}), "response_format.type"),
        (
            json!({"type": "json_schema", "json_schema": {"name": "x"}}),
            "schema is required",
        ),
    ] {
        let body =
            json!({"messages": [{"role": "user", "content": "hi"}], "response_format": format});
        let (status, r) = s.post("/v1/chat/completions", body).await;
        assert_eq!(status, 400, "{format}: {r}");
        assert_eq!(r["error"]["param"], "response_format", "{r}");
        let message = r["error"]["message"].as_str().unwrap();
        assert!(message.contains(names), "{format}: {message}");
    }
    let (status, _) = s.get("/health").await;
    assert_eq!(status, 200, "nothing was lost");
}

#[tokio::test]
async fn a_resumed_constrained_stream_goes_on_under_its_constraint() {
    let s = Server::start("", &[]).await;
    let body = || {
        json!({"prompt": "a pet:", "max_tokens": 120, "temperature": 0, "stream": true,
        "pie_stream_ids": true, "response_format": json_schema_format()})
    };
    let (whole, _) = read_stream(s.stream(body()).await, None).await;
    validate(&whole.text());
    for k in [1, 5, whole.tokens.len() - 1] {
        let mut resumed = body();
        resumed["pie_resume"] = json!({"tokens": whole.ids()[..k]});
        let (rest, _) = read_stream(s.stream(resumed).await, None).await;
        assert_eq!(rest.ids(), whole.ids()[k..], "k {k}");
    }
    let mut off_grammar = body();
    // The object's opening twice: no property name starts with it.
    let opening = whole.ids()[0];
    off_grammar["pie_resume"] = json!({"tokens": [opening, opening]});
    off_grammar["stream"] = json!(false);
    let (status, r) = s.post("/v1/completions", off_grammar).await;
    assert_eq!(status, 400, "{r}");
    assert!(
        r["error"]["message"]
            .as_str()
            .unwrap()
            .contains("response_format"),
        "{r}"
    );
}

/// On the real default model, through the chat template: a schema's answer
/// stops by itself and validates.
#[tokio::test]
async fn on_the_default_model_a_schema_answer_validates() {
    let Some(model) = common::cached_default_model() else {
        return;
    };
    let s = Server::start_model(&model, "", &[]).await;
    for seed in 0..3 {
        let body = json!({"messages": [{"role": "user", "content": "Describe a pet as JSON."}],
            "max_tokens": 200, "temperature": 0.7, "seed": seed,
            "response_format": json_schema_format()});
        let (status, r) = s.post("/v1/chat/completions", body).await;
        assert_eq!(status, 200, "{r}");
        assert_eq!(r["choices"][0]["finish_reason"], "stop", "{r}");
        validate(r["choices"][0]["message"]["content"].as_str().unwrap());
    }
}

/// On the default model, 50 sampled answers to a schema whose integer has no
/// `maximum` and whose string has no `maxLength` all parse and validate
/// (the default bounds keep a number from running to `max_tokens`).
#[tokio::test]
async fn on_the_default_model_unbounded_values_end_and_validate() {
    let Some(model) = common::cached_default_model() else {
        return;
    };
    let s = Server::start_model(&model, "", &[]).await;
    let schema = json!({"type": "object", "additionalProperties": false,
        "required": ["city", "population"],
        "properties": {"city": {"type": "string"}, "population": {"type": "integer"}}});
    let format = json!({"type": "json_schema", "json_schema": {"name": "city", "schema": schema}});
    let answers = futures_util::future::join_all((0..50).map(|seed| {
        let body = json!({"messages": [{"role": "user",
            "content": "Name a large city and its population, as JSON."}],
            "max_tokens": 160, "temperature": 0.7, "seed": seed, "response_format": format});
        s.post("/v1/chat/completions", body)
    }))
    .await;
    for (seed, (status, r)) in answers.into_iter().enumerate() {
        assert_eq!(status, 200, "{r}");
        let text = r["choices"][0]["message"]["content"].as_str().unwrap();
        let answer: Value = serde_json::from_str(text)
            .unwrap_or_else(|e| panic!("seed {seed}: {text:?} does not parse: {e}"));
        let object = answer.as_object().expect("an object");
        assert_eq!(object.len(), 2, "seed {seed}: {text}");
        assert!(answer["city"].is_string(), "seed {seed}: {text}");
        assert!(answer["population"].is_i64(), "seed {seed}: {text}");
    }
}
