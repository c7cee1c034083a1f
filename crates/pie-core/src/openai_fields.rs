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
//! Beside the SDK's fields, the extensions that vLLM's and SGLang's OpenAI
//! servers define (`ENGINE_EXTENSIONS`) have rules too: their routers
//! (`sglang-router`, vLLM's, llm-d's gateway) forward bodies with them
//! added, at their defaults.
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

fn null_or_false(v: &Value) -> bool {
    v.is_null() || v == &Value::Bool(false)
}

fn null_or_true(v: &Value) -> bool {
    v.is_null() || v == &Value::Bool(true)
}

fn null_or_zero(v: &Value) -> bool {
    v.is_null() || v.as_f64() == Some(0.0)
}

fn null_or_one(v: &Value) -> bool {
    v.is_null() || v.as_f64() == Some(1.0)
}

/// Any boolean: a switch of a feature Pie does not have, so that either
/// value changes nothing (SGLang's reasoning parser, off unless its server
/// was started with one).
fn null_or_bool(v: &Value) -> bool {
    v.is_null() || v.is_boolean()
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

/// Pie's own extras (docs/http-api.md): the scheduling props, the session,
/// and what a controller sends a worker (checked where they are read: only
/// a worker key may send them).
const EXTRAS: &[&str] = &[
    "props",
    "session",
    "pie_prompt_tokens",
    "pie_prefill_from",
    "pie_resume",
    "pie_stream_ids",
];

/// The extensions vLLM's and SGLang's OpenAI servers define, on both
/// routes, as their `protocol.py` files name them.
const ENGINE_EXTENSIONS: &[(&str, Rule)] = &[
    ("top_k", Served),
    ("min_p", Served),
    ("repetition_penalty", Served),
    ("ignore_eos", Served),
    ("min_tokens", Served),
    ("stop_token_ids", Served),
    ("skip_special_tokens", Served),
    // SGLang's name and vLLM's for one switch: keep the stop string.
    ("no_stop_trim", Served),
    ("include_stop_str_in_output", Served),
    ("request_id", Metadata),
    ("rid", Metadata),
    ("return_hidden_states", UnlessInert(null_or_false, "false")),
    (
        "return_tokens_as_token_ids",
        UnlessInert(null_or_false, "false"),
    ),
    ("return_token_ids", UnlessInert(null_or_false, "false")),
    ("use_beam_search", UnlessInert(null_or_false, "false")),
    (
        "spaces_between_special_tokens",
        UnlessInert(null_or_true, "true"),
    ),
    ("length_penalty", UnlessInert(null_or_one, "1")),
    (
        "priority",
        UnlessInert(null_or_zero, "0 (Pie's is the `priority` prop)"),
    ),
    ("prompt_logprobs", UnlessInert(null, "null")),
    ("truncate_prompt_tokens", UnlessInert(null, "null")),
    ("allowed_token_ids", UnlessInert(null, "null")),
    ("bad_words", UnlessInert(empty, "empty")),
    (
        "guided_json",
        UnlessInert(null, "null (use response_format)"),
    ),
    ("guided_regex", UnlessInert(null, "null")),
    ("guided_choice", UnlessInert(null, "null")),
    ("guided_grammar", UnlessInert(null, "null")),
    ("guided_decoding_backend", UnlessInert(null, "null")),
    ("guided_whitespace_pattern", UnlessInert(null, "null")),
    ("structural_tag", UnlessInert(null, "null")),
    (
        "json_schema",
        UnlessInert(null, "null (use response_format)"),
    ),
    ("regex", UnlessInert(null, "null")),
    ("ebnf", UnlessInert(null, "null")),
    ("logits_processors", UnlessInert(empty, "empty")),
    ("custom_logit_processor", UnlessInert(null, "null")),
    ("custom_params", UnlessInert(null, "null")),
    ("lora_path", UnlessInert(null, "null")),
    ("lora_request", UnlessInert(null, "null")),
    ("session_params", UnlessInert(null, "null")),
    (
        "cache_salt",
        UnlessInert(null, "null (a key's salt is set by the server)"),
    ),
    ("extra_key", UnlessInert(null, "null")),
    ("kv_transfer_params", UnlessInert(null, "null")),
    ("vllm_xargs", UnlessInert(empty, "empty")),
    ("bootstrap_host", UnlessInert(null, "null")),
    ("bootstrap_port", UnlessInert(null, "null")),
    ("bootstrap_room", UnlessInert(null, "null")),
    ("data_parallel_rank", UnlessInert(null, "null")),
    ("mm_processor_kwargs", UnlessInert(empty, "empty")),
];

/// Engine extensions of the chat route only.
const CHAT_ENGINE_EXTENSIONS: &[(&str, Rule)] = &[
    ("continue_final_message", Served),
    ("add_generation_prompt", Served),
    ("echo", UnlessInert(null_or_false, "false")),
    (
        "separate_reasoning",
        UnlessInert(null_or_bool, "a boolean (no reasoning parser)"),
    ),
    (
        "stream_reasoning",
        UnlessInert(null_or_bool, "a boolean (no reasoning parser)"),
    ),
    (
        "chat_template",
        UnlessInert(null, "null (the server's --chat-template)"),
    ),
    ("chat_template_kwargs", UnlessInert(empty, "empty")),
    ("documents", UnlessInert(empty, "empty")),
    ("tool_call_constraint", UnlessInert(null, "null")),
];

/// Engine extensions of the completions route only.
const COMPLETION_ENGINE_EXTENSIONS: &[(&str, Rule)] =
    &[("add_special_tokens", UnlessInert(null_or_true, "true"))];

fn rule(endpoint: Endpoint, field: &str) -> Option<Rule> {
    let (own, own_extensions) = match endpoint {
        Endpoint::Completions => (COMPLETIONS, COMPLETION_ENGINE_EXTENSIONS),
        Endpoint::Chat => (CHAT, CHAT_ENGINE_EXTENSIONS),
    };
    let listed = (SHARED.iter().chain(own))
        .chain(ENGINE_EXTENSIONS)
        .chain(own_extensions)
        .find(|(name, _)| *name == field);
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
        let e = checked(Endpoint::Chat, json!({"best_of": 2})).unwrap_err();
        assert_eq!(e.param, "best_of");
        let e = checked(
            Endpoint::Completions,
            json!({"continue_final_message": false}),
        );
        assert_eq!(e.unwrap_err().param, "continue_final_message");
    }

    /// The bodies `sglang-router` 0.3.2 forwards (its defaults added to a
    /// plain request) pass; a live value of an unserved extension is
    /// refused by name.
    #[test]
    fn what_sglang_router_forwards_passes() {
        let completion = json!({"model": "m", "prompt": "hi", "max_tokens": 3,
            "stream": false, "echo": false, "no_stop_trim": false, "ignore_eos": false,
            "skip_special_tokens": true, "return_hidden_states": false});
        assert_eq!(checked(Endpoint::Completions, completion), Ok(()));
        let chat = json!({"messages": [], "model": "m", "logprobs": false,
            "max_completion_tokens": 3, "stream": false, "no_stop_trim": false,
            "ignore_eos": false, "continue_final_message": false,
            "skip_special_tokens": true, "separate_reasoning": true,
            "stream_reasoning": true, "return_hidden_states": false});
        assert_eq!(checked(Endpoint::Chat, chat), Ok(()));
        for (field, live) in [
            ("return_hidden_states", json!(true)),
            ("guided_regex", json!("a+")),
            ("priority", json!(3)),
            ("use_beam_search", json!(true)),
        ] {
            let e = checked(Endpoint::Chat, json!({ field: live })).unwrap_err();
            assert_eq!(e.param, field);
            assert!(e.message.contains("not supported"), "{}", e.message);
        }
    }

    /// No field has two rules: the lists are disjoint.
    #[test]
    fn every_field_has_one_rule() {
        for own in [
            [COMPLETIONS, COMPLETION_ENGINE_EXTENSIONS],
            [CHAT, CHAT_ENGINE_EXTENSIONS],
        ] {
            let mut names: Vec<&str> = (SHARED.iter().chain(ENGINE_EXTENSIONS))
                .chain(own.into_iter().flatten())
                .map(|(name, _)| *name)
                .chain(EXTRAS.iter().copied())
                .collect();
            let all = names.len();
            names.sort_unstable();
            names.dedup();
            assert_eq!(names.len(), all);
        }
    }
}
