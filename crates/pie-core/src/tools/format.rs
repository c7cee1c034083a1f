//! How a model is asked for tool calls and how it writes them: the format
//! its chat template speaks.
//!
//! - [`ToolFormat::Hermes`] when the template writes `<tool_call>` tags
//!   (Qwen 2.5 and 3, Hermes, many fine-tunes): the template renders the
//!   tools, calls come as `<tool_call>{"name", "arguments"}</tool_call>`.
//! - [`ToolFormat::Llama3Json`] when it is Llama 3.1's or later (it writes
//!   `<|python_tag|>`): the template renders the tools, a call is the whole
//!   answer, `{"name", "parameters"}`; one call per answer, as the
//!   template renders only one.
//! - [`ToolFormat::Generic`] for any other template (SmolLM2's has no tool
//!   support): see [`super::generic`].

use std::borrow::Cow;

use serde_json::{json, Value};

use super::generic;
use super::request::{ToolChoice, ToolRequest, MAX_PARALLEL_CALLS};
use crate::chat::ChatMessage;

/// The tag that opens a Hermes-style call.
pub(super) const HERMES_OPEN: &str = "<tool_call>";
pub(super) const HERMES_CLOSE: &str = "</tool_call>";
/// What Llama 3.1+ templates write before a built-in tool's call.
pub(super) const LLAMA_PYTHON_TAG: &str = "<|python_tag|>";
/// How a generic text answer begins (compact JSON, as it is constrained).
pub(super) const GENERIC_RESPONSE_OPENING: &str = "{\"response\":\"";

/// The tool-call format of a chat template.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ToolFormat {
    Hermes,
    Llama3Json,
    Generic,
}

/// What a request's output is held to: compiled by the model's grammar
/// library (`pie_model::GrammarSpec`).
#[derive(Clone, Debug, PartialEq)]
pub enum ToolConstraint {
    JsonSchema(Value),
    Lark(String),
}

/// JSON as the constraint writes it: no free whitespace (a model could pad
/// with it until its token limit).
const COMPACT: &str = "x-guidance";

impl ToolFormat {
    pub fn of_template(template: Option<&str>) -> Self {
        match template {
            Some(t) if t.contains(HERMES_OPEN) => ToolFormat::Hermes,
            Some(t) if t.contains(LLAMA_PYTHON_TAG) => ToolFormat::Llama3Json,
            _ => ToolFormat::Generic,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            ToolFormat::Hermes => "hermes (<tool_call> tags, from the chat template)",
            ToolFormat::Llama3Json => {
                "llama3-json (a JSON call as the answer, from the chat template)"
            }
            ToolFormat::Generic => "generic (JSON answers, tools described in the system message)",
        }
    }

    /// What the output is held to; None: free text, parsed afterwards (a
    /// template's own format under `auto`, as vLLM serves it).
    pub fn constraint(self, request: &ToolRequest) -> Option<ToolConstraint> {
        let templated = matches!(self, ToolFormat::Hermes | ToolFormat::Llama3Json);
        if templated && request.choice == ToolChoice::Auto {
            return None;
        }
        Some(match self {
            ToolFormat::Hermes => {
                let call = compact(request.call_schema("arguments"));
                ToolConstraint::Lark(hermes_grammar(&call, request.parallel))
            }
            ToolFormat::Llama3Json => {
                ToolConstraint::JsonSchema(compact(request.call_schema("parameters")))
            }
            ToolFormat::Generic => {
                let calls =
                    generic::calls_schema(request.call_schema("arguments"), request.parallel);
                let answer = match request.choice {
                    ToolChoice::Auto => json!({"anyOf": [calls, generic::response_schema()]}),
                    _ => calls,
                };
                ToolConstraint::JsonSchema(compact(answer))
            }
        })
    }

    /// The messages the template renders: as sent where the template knows
    /// tools, else written as generic text.
    pub fn template_messages<'a>(
        self,
        messages: &'a [ChatMessage],
        request: Option<&ToolRequest>,
    ) -> Cow<'a, [ChatMessage]> {
        let uses_tools = |m: &ChatMessage| m.tool_calls.is_some() || m.role == "tool";
        match self {
            ToolFormat::Hermes | ToolFormat::Llama3Json => Cow::Borrowed(messages),
            ToolFormat::Generic if request.is_none() && !messages.iter().any(uses_tools) => {
                Cow::Borrowed(messages)
            }
            ToolFormat::Generic => Cow::Owned(generic::messages(messages, request)),
        }
    }
}

fn compact(mut schema: Value) -> Value {
    schema[COMPACT] = json!({"whitespace_flexible": false});
    schema
}

/// One call or, when parallel, up to [`MAX_PARALLEL_CALLS`], each in its
/// tags on its own line.
fn hermes_grammar(call: &Value, parallel: bool) -> String {
    let more = if parallel { MAX_PARALLEL_CALLS - 1 } else { 0 };
    let start = (0..more).fold("call".to_string(), |inner, _| {
        format!("call (\"\\n\" {inner})?")
    });
    format!(
        "start: {start}\ncall: \"{HERMES_OPEN}\\n\" arguments \"\\n{HERMES_CLOSE}\"\narguments: %json {call}\n"
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tools::request::Tool;

    fn request(choice: ToolChoice, parallel: bool) -> ToolRequest {
        ToolRequest {
            tools: vec![Tool {
                name: "weather".into(),
                description: None,
                parameters: json!({"type": "object", "properties": {"city": {"type": "string"}}}),
            }],
            choice,
            parallel,
        }
    }

    #[test]
    fn the_format_follows_the_template() {
        let hermes = "{% for t in tools %}{{ t | tojson }}{% endfor %}<tool_call>";
        assert_eq!(ToolFormat::of_template(Some(hermes)), ToolFormat::Hermes);
        let llama =
            "{{ '<|python_tag|>' }}{% for t in tools %}{{ t | tojson(indent=4) }}{% endfor %}";
        assert_eq!(ToolFormat::of_template(Some(llama)), ToolFormat::Llama3Json);
        assert_eq!(
            ToolFormat::of_template(Some("{{ messages }}")),
            ToolFormat::Generic
        );
        assert_eq!(ToolFormat::of_template(None), ToolFormat::Generic);
    }

    #[test]
    fn generic_auto_allows_a_text_answer_and_required_does_not() {
        let Some(ToolConstraint::JsonSchema(auto)) =
            ToolFormat::Generic.constraint(&request(ToolChoice::Auto, false))
        else {
            panic!("a schema")
        };
        assert_eq!(auto["anyOf"][1]["properties"]["response"]["type"], "string");
        assert!(auto["anyOf"][0]["properties"]["tool_call"].is_object());
        let Some(ToolConstraint::JsonSchema(required)) =
            ToolFormat::Generic.constraint(&request(ToolChoice::Required, true))
        else {
            panic!("a schema")
        };
        assert_eq!(required["properties"]["tool_calls"]["minItems"], 1);
        assert!(required.get("anyOf").is_none());
    }

    #[test]
    fn hermes_constrains_only_when_a_call_is_required() {
        assert_eq!(
            ToolFormat::Hermes.constraint(&request(ToolChoice::Auto, true)),
            None
        );
        let Some(ToolConstraint::Lark(grammar)) =
            ToolFormat::Hermes.constraint(&request(ToolChoice::Required, false))
        else {
            panic!("a grammar")
        };
        assert!(grammar.contains("\"<tool_call>\\n\""), "{grammar}");
        assert!(grammar.starts_with("start: call\n"), "{grammar}");
    }

    #[test]
    fn generic_messages_describe_the_tools_and_write_calls_and_results_as_text() {
        let call = json!({"id": "c1", "type": "function", "function": {"name": "weather", "arguments": {"city": "Paris"}}});
        let messages = vec![
            ChatMessage::text("user", "Weather in Paris?".into()),
            ChatMessage {
                tool_calls: Some(vec![call]),
                ..ChatMessage::text("assistant", String::new())
            },
            ChatMessage {
                tool_call_id: Some("c1".into()),
                ..ChatMessage::text("tool", "sunny".into())
            },
        ];
        let req = request(ToolChoice::Auto, false);
        let out = ToolFormat::Generic.template_messages(&messages, Some(&req));
        assert_eq!(out[0].role, "system");
        assert!(out[0].content.contains("\"weather\""), "{}", out[0].content);
        let json = |text: &str| serde_json::from_str::<Value>(text).expect("JSON");
        assert_eq!(
            json(&out[2].content),
            json!({"tool_call": {"name": "weather", "arguments": {"city": "Paris"}}})
        );
        assert_eq!(out[3].role, "user");
        assert_eq!(
            json(&out[3].content),
            json!({"tool_response": {"tool": "weather", "content": "sunny"}})
        );
        let hermes = ToolFormat::Hermes.template_messages(&messages, Some(&req));
        assert_eq!(&*hermes, &messages[..]);
    }
}
