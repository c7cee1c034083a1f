//! Every field an OpenAI client may send to `/v1/completions` and
//! `/v1/chat/completions` (the lists of the OpenAI Python SDK's
//! `CompletionCreateParams` types), and Pie's own extras, each with its rule,
//! checked alike by the worker and the controller before anything else:
//!
//! - **served**: Pie implements it;
//! - **metadata**: it only labels the request for the caller (`user`,
//!   `store`, ...): accepted and not used;
//! - **refused unless inert**: it would change what the model computes or
//!   returns and Pie does not implement it yet: accepted only with a value
//!   that changes nothing (`echo: false`, an empty `tools`, ...), else a
//!   400 naming it;
//! - anything else (a typo such as `temprature`) is a 400 naming it, as
//!   OpenAI answers `Unrecognized request argument supplied`.
//!
//! Invariant (tested here and end to end in `pie-worker/tests/openai_sdk.py`,
//! which walks the installed SDK's lists): every SDK field has a rule, and a
//! value is refused exactly when its rule says so.

use serde_json::{Map, Value};

/// Which OpenAI route a body is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Endpoint {
    Completions,
    Chat,
}

/// A field refused, and why (an OpenAI error's `param` and `message`).
#[derive(Debug, PartialEq, Eq)]
pub struct FieldError {
    pub param: String,
    pub message: String,
}

/// What Pie does with a field.
#[derive(Clone, Copy)]
enum Rule {
    Served,
    Metadata,
    /// Accepted only with a value for which the predicate holds (the value
    /// named, for the error).
    UnlessInert(fn(&Value) -> bool, &'static str),
}

use Rule::{Metadata, Served, UnlessInert};

fn null(v: &Value) -> bool {
    v.is_null()
}

fn empty(v: &Value) -> bool {
    match v {
        Value::Null => true,
        Value::Array(a) => a.is_empty(),
        Value::Object(o) => o.is_empty(),
        Value::String(s) => s.is_empty(),
        _ => false,
    }
}

fn no_tool_call(v: &Value) -> bool {
    v.is_null() || v == "none" || v == "auto"
}

fn text_only(v: &Value) -> bool {
    v.is_null() || v == &serde_json::json!(["text"])
}

/// Fields both routes share.
const SHARED: &[(&str, Rule)] = &[
    ("model", Served),
    ("max_tokens", Served),
    ("temperature", Served),
    ("top_p", Served),
    ("seed", Served),
    ("stop", Served),
    ("stream", Served),
    ("stream_options", Served),
    ("n", Served),
    ("user", Metadata),
    ("frequency_penalty", Served),
    ("presence_penalty", Served),
    ("logit_bias", Served),
];

const COMPLETIONS: &[(&str, Rule)] = &[
    ("prompt", Served),
    ("best_of", Served),
    ("echo", Served),
    ("suffix", UnlessInert(empty, "empty")),
    ("logprobs", Served),
    // Not in the SDK's completion type; served as vLLM serves it.
    ("response_format", Served),
];

const CHAT: &[(&str, Rule)] = &[
    ("messages", Served),
    ("max_completion_tokens", Served),
    ("metadata", Metadata),
    ("store", Metadata),
    ("safety_identifier", Metadata),
    ("prompt_cache_key", Metadata),
    ("prompt_cache_retention", Metadata),
    ("prompt_cache_options", Metadata),
    ("service_tier", Metadata),
    ("moderation", Metadata),
    ("logprobs", Served),
    ("top_logprobs", Served),
    ("response_format", Served),
    ("tools", Served),
    ("tool_choice", Served),
    ("parallel_tool_calls", Served),
    // The deprecated forms of `tools` and `tool_choice`.
    ("functions", UnlessInert(empty, "empty")),
    (
        "function_call",
        UnlessInert(no_tool_call, "\"none\" or \"auto\""),
    ),
    ("audio", UnlessInert(null, "null")),
    ("modalities", UnlessInert(text_only, "[\"text\"]")),
    ("prediction", UnlessInert(null, "null")),
    ("web_search_options", UnlessInert(null, "null")),
    ("reasoning_effort", UnlessInert(null, "null")),
    ("verbosity", UnlessInert(null, "null")),
];

/// Pie's documented extras (README "Props"): the scheduling props, the
/// session, sampling beyond OpenAI's, and what a controller sends a worker
/// (checked where they are read: only a worker key may send them).
const EXTRAS: &[&str] = &[
    "props",
    "session",
    "top_k",
    "min_p",
    "repetition_penalty",
    "ignore_eos",
    "pie_prompt_tokens",
    "pie_prefill_from",
    "pie_resume",
    "pie_stream_ids",
];

fn rule(endpoint: Endpoint, field: &str) -> Option<Rule> {
    let own = match endpoint {
        Endpoint::Completions => COMPLETIONS,
        Endpoint::Chat => CHAT,
    };
    let listed = SHARED.iter().chain(own).find(|(name, _)| *name == field);
    listed
        .map(|(_, rule)| *rule)
        .or_else(|| EXTRAS.contains(&field).then_some(Served))
}

/// Whether `body`'s fields may be served as their rules say.
pub fn check(endpoint: Endpoint, body: &Map<String, Value>) -> Result<(), FieldError> {
    for (field, value) in body {
        match rule(endpoint, field) {
            None => {
                return Err(FieldError {
                    param: field.clone(),
                    message: format!("Unrecognized request argument supplied: {field}"),
                })
            }
            Some(UnlessInert(inert, named)) if !inert(value) => {
                return Err(FieldError {
                    param: field.clone(),
                    message: format!(
                        "{field} = {value} is not supported by this server yet; only {field} = \
                         {named} (or leaving it out)"
                    ),
                })
            }
            Some(_) => {}
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn checked(endpoint: Endpoint, body: Value) -> Result<(), FieldError> {
        check(endpoint, body.as_object().expect("an object"))
    }

    #[test]
    fn a_typo_is_refused_by_name() {
        let e = checked(Endpoint::Chat, json!({"messages": [], "temprature": 0.5})).unwrap_err();
        assert_eq!(e.param, "temprature");
        assert!(
            e.message.contains("Unrecognized request argument"),
            "{}",
            e.message
        );
    }

    #[test]
    fn an_unserved_field_passes_only_when_inert() {
        for (endpoint, field, inert, live) in [
            (
                Endpoint::Chat,
                "functions",
                json!([]),
                json!([{"name": "f"}]),
            ),
            (
                Endpoint::Chat,
                "function_call",
                json!("auto"),
                json!({"name": "f"}),
            ),
            (Endpoint::Completions, "suffix", json!(""), json!("end")),
        ] {
            assert_eq!(
                checked(endpoint, json!({ field: inert })),
                Ok(()),
                "{field}"
            );
            let e = checked(endpoint, json!({ field: live })).unwrap_err();
            assert_eq!(e.param, field);
        }
    }

    #[test]
    fn metadata_served_fields_and_extras_pass() {
        let chat = json!({"messages": [], "model": "m", "user": "u", "store": true,
            "metadata": {"k": "v"}, "temperature": 0.2, "props": {}, "session": "s",
            "top_k": 5, "ignore_eos": true, "parallel_tool_calls": false});
        assert_eq!(checked(Endpoint::Chat, chat), Ok(()));
        let completion = json!({"prompt": "p", "max_tokens": 3, "stream": true, "user": "u"});
        assert_eq!(checked(Endpoint::Completions, completion), Ok(()));
    }

    #[test]
    fn each_route_knows_only_its_own_fields() {
        let e = checked(Endpoint::Completions, json!({"messages": []})).unwrap_err();
        assert_eq!(e.param, "messages");
        let e = checked(Endpoint::Chat, json!({"echo": false})).unwrap_err();
        assert_eq!(e.param, "echo");
    }
}
