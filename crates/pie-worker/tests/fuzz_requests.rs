//! Request bodies fuzzed against one tiny-model `pie serve`: valid bodies of
//! `/v1/completions`, `/v1/chat/completions` and `/v1/processes`, mutated
//! (fields replaced by any JSON, removed, added; the text cut or spliced).
//! Every answer is 2xx, or 4xx with `{"error": {"message": ...}}`; never a 5xx
//! or a dropped connection; the server is healthy afterwards.
//! `PROPTEST_CASES` sets the number of bodies (default 48).

mod common;

use std::time::Duration;

use common::Server;
use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError, TestRunner};
use serde_json::{json, Value};

fn valid_bodies() -> Vec<(&'static str, Value)> {
    vec![
        (
            "/v1/completions",
            json!({"prompt": "hello", "max_tokens": 2, "temperature": 0.5, "stop": ["x"],
                   "props": {"priority": 1}}),
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                   "stream": false, "props": {"session": "s"}}),
        ),
        (
            "/v1/processes",
            json!({"inferlet": "text-completion",
                   "args": {"prompt": [1, 2, 3], "max_tokens": 2}, "props": {"weight": 2.0}}),
        ),
    ]
}

fn any_json() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        prop_oneof![
            Just(-1i64),
            Just(0),
            Just(1),
            Just(3),
            Just(i64::MAX),
            Just(i64::MIN)
        ]
        .prop_map(|n| json!(n)),
        Just(json!(u64::MAX)),
        prop_oneof![Just(-0.5f64), Just(1e308), Just(2.5)].prop_map(|f| json!(f)),
        "[a-z ]{0,8}".prop_map(Value::String),
        Just(json!([{"role": "user"}])),
        Just(json!([{"role": "bogus", "content": 3}])),
    ];
    leaf.prop_recursive(2, 6, 3, |inner| {
        prop_oneof![
            proptest::collection::vec(inner.clone(), 0..3).prop_map(Value::Array),
            proptest::collection::btree_map("[a-z_]{1,6}", inner, 0..3)
                .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}

/// A field name: one the routes read, or any.
fn field() -> impl Strategy<Value = String> {
    let known = [
        "prompt",
        "messages",
        "max_tokens",
        "temperature",
        "top_p",
        "top_k",
        "seed",
        "stop",
        "stream",
        "ignore_eos",
        "props",
        "session",
        "inferlet",
        "args",
        "model",
        "n",
        "logprobs",
    ];
    prop_oneof![
        3 => proptest::sample::select(known.to_vec()).prop_map(String::from),
        1 => "[a-z_]{1,8}",
    ]
}

#[derive(Clone, Debug)]
enum Mutation {
    Set(String, Value),
    /// Set a field inside `args` (native) or `props`.
    SetNested(&'static str, String, Value),
    Remove(String),
    /// Cut the serialized body at a byte.
    Cut(prop::sample::Index),
    /// Splice bytes into the serialized body.
    Splice(prop::sample::Index, Vec<u8>),
}

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        4 => (field(), any_json()).prop_map(|(f, v)| Mutation::Set(f, v)),
        2 => (prop_oneof![Just("args"), Just("props")], field(), any_json())
            .prop_map(|(o, f, v)| Mutation::SetNested(o, f, v)),
        2 => field().prop_map(Mutation::Remove),
        1 => any::<prop::sample::Index>().prop_map(Mutation::Cut),
        1 => (any::<prop::sample::Index>(), proptest::collection::vec(any::<u8>(), 1..4))
            .prop_map(|(i, b)| Mutation::Splice(i, b)),
    ]
}

/// The body `mutations` make of `valid`, as bytes.
fn mutate(valid: &Value, mutations: &[Mutation]) -> Vec<u8> {
    let mut body = valid.clone();
    let mut bytes = None;
    for m in mutations {
        match m {
            Mutation::Set(f, v) => body[f.as_str()] = v.clone(),
            Mutation::SetNested(o, f, v) => {
                if body[*o].is_object() || body[*o].is_null() {
                    body[*o][f.as_str()] = v.clone();
                }
            }
            Mutation::Remove(f) => {
                body.as_object_mut().map(|o| o.remove(f));
            }
            Mutation::Cut(at) => {
                let b = bytes.get_or_insert_with(|| body.to_string().into_bytes());
                b.truncate(at.index(b.len() + 1));
            }
            Mutation::Splice(at, extra) => {
                let b = bytes.get_or_insert_with(|| body.to_string().into_bytes());
                let at = at.index(b.len() + 1);
                b.splice(at..at, extra.iter().copied());
            }
        }
    }
    bytes.unwrap_or_else(|| body.to_string().into_bytes())
}

/// POST `body`; its status, or Err when the answer breaks the contract.
async fn check(s: &Server, path: &str, body: Vec<u8>) -> Result<u16, String> {
    let shown = String::from_utf8_lossy(&body).to_string();
    let r = s
        .client
        .post(s.url(path))
        .header("content-type", "application/json")
        .body(body)
        .timeout(Duration::from_secs(60))
        .send()
        .await
        .map_err(|e| format!("{path} {shown}: no answer: {e}"))?;
    let status = r.status();
    let text = r
        .text()
        .await
        .map_err(|e| format!("{path} {shown}: body dropped: {e}"))?;
    if status.is_success() {
        return Ok(status.as_u16());
    }
    if !status.is_client_error() {
        return Err(format!("{path} {shown}: {status} {text}"));
    }
    let error: Value = serde_json::from_str(&text).unwrap_or(Value::Null);
    match error["error"]["message"].as_str() {
        Some(m) if !m.is_empty() => Ok(status.as_u16()),
        _ => Err(format!(
            "{path} {shown}: {status} without an error message: {text}"
        )),
    }
}

#[test]
fn mutated_request_bodies_get_2xx_or_a_4xx_with_an_error_message() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let server = rt.block_on(Server::start("", &["--kv-pages", "64"]));
    let cases = std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(48);
    let mut runner = TestRunner::new(Config::with_cases(cases));
    let bodies = valid_bodies();
    let strategy = (0..bodies.len(), proptest::collection::vec(mutation(), 1..4));
    let statuses = std::cell::RefCell::new(std::collections::BTreeMap::new());
    runner
        .run(&strategy, |(route, mutations)| {
            let (path, valid) = &bodies[route];
            let body = mutate(valid, &mutations);
            let status = rt
                .block_on(check(&server, path, body))
                .map_err(TestCaseError::fail)?;
            *statuses.borrow_mut().entry(status).or_insert(0) += 1;
            Ok(())
        })
        .unwrap();
    eprintln!("statuses: {:?}", statuses.borrow());
    for (path, valid) in &bodies {
        let status = rt.block_on(check(&server, path, valid.to_string().into_bytes()));
        assert!(
            status.as_ref().is_ok_and(|s| (200..300).contains(s)),
            "{path}: the valid body still works: {status:?}"
        );
    }
    let health = rt.block_on(async {
        let r = server.client.get(server.url("/health")).send().await;
        r.map(|r| r.status().as_u16()).unwrap_or(0)
    });
    assert_eq!(health, 200, "the server is healthy after the fuzzing");
}
