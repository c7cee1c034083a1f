//! How a model is asked for tool calls and how it writes them: the format
//! its chat template speaks. [`ToolFormat::Hermes`] when the template
//! writes `<tool_call>` tags (Qwen 2.5 and 3, Hermes, many fine-tunes): the
//! template renders the tools itself and calls come as
//! `<tool_call>{"name": ..., "arguments": ...}</tool_call>`.
//! [`ToolFormat::Generic`] for any other template (SmolLM2's has no tool
//! support), as llama.cpp's server does: the tools described in the system
//! message, and the answer one JSON object, `{"tool_call": CALL}` (or
//! `{"tool_calls": [CALL, ...]}` when calls may be parallel) or
//! `{"response": TEXT}`.

use std::borrow::Cow;

use serde_json::{json, Value};

use super::request::{ToolChoice, ToolRequest, MAX_PARALLEL_CALLS};
use crate::chat::ChatMessage;

/// The tag that opens a Hermes-style call.
pub(super) const HERMES_OPEN: &str = "<tool_call>";
pub(super) const HERMES_CLOSE: &str = "</tool_call>";
/// How a generic text answer begins (compact JSON, as it is constrained).
pub(super) const GENERIC_RESPONSE_OPENING: &str = "{\"response\":\"";

/// The tool-call format of a chat template.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ToolFormat {
    Hermes,
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
            _ => ToolFormat::Generic,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            ToolFormat::Hermes => "hermes (<tool_call> tags, from the chat template)",
            ToolFormat::Generic => "generic (JSON answers, tools described in the system message)",
        }
    }

    /// What the output is held to; None: free text, parsed afterwards (a
    /// Hermes template's `auto`, as vLLM serves it).
    pub fn constraint(self, request: &ToolRequest) -> Option<ToolConstraint> {
        let call = compact(request.call_schema());
        match self {
            ToolFormat::Hermes if request.choice == ToolChoice::Auto => None,
            ToolFormat::Hermes => Some(ToolConstraint::Lark(hermes_grammar(
                &call,
                request.parallel,
            ))),
            ToolFormat::Generic => {
                let calls = generic_calls_schema(call, request.parallel);
                let answer = match request.choice {
                    ToolChoice::Auto => json!({"anyOf": [calls, generic_response_schema()]}),
                    _ => calls,
                };
                Some(ToolConstraint::JsonSchema(compact(answer)))
            }
        }
    }

    /// The messages the template renders: as sent (Hermes), or with the
    /// tools described in the system message and earlier calls and results
    /// written as this format's text (Generic).
    pub fn template_messages<'a>(
        self,
        messages: &'a [ChatMessage],
        request: Option<&ToolRequest>,
    ) -> Cow<'a, [ChatMessage]> {
        let uses_tools = |m: &ChatMessage| m.tool_calls.is_some() || m.role == "tool";
        match self {
            ToolFormat::Hermes => Cow::Borrowed(messages),
            ToolFormat::Generic if request.is_none() && !messages.iter().any(uses_tools) => {
                Cow::Borrowed(messages)
            }
            ToolFormat::Generic => Cow::Owned(generic_messages(messages, request)),
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

fn generic_calls_schema(call: Value, parallel: bool) -> Value {
    let (key, value) = match parallel {
        true => (
            "tool_calls",
            json!({"type": "array", "items": call, "minItems": 1, "maxItems": MAX_PARALLEL_CALLS}),
        ),
        false => ("tool_call", call),
    };
    json!({"type": "object", "properties": {key: value}, "required": [key], "additionalProperties": false})
}

fn generic_response_schema() -> Value {
    json!({"type": "object", "properties": {"response": {"type": "string"}}, "required": ["response"], "additionalProperties": false})
}

fn generic_instructions(request: &ToolRequest) -> String {
    let call = r#"{"name": "<tool name>", "arguments": {<its arguments>}}"#;
    let calls = match request.parallel {
        true => format!(r#"{{"tool_calls": [{call}, ...]}}"#),
        false => format!(r#"{{"tool_call": {call}}}"#),
    };
    let answer = match request.choice {
        ToolChoice::Auto => format!(
            "Answer with one JSON object: {calls} to call tools, or {{\"response\": \"<your answer>\"}} to answer the user."
        ),
        _ => format!("Answer with one JSON object that calls tools: {calls}."),
    };
    format!(
        "You can call these tools (each one's arguments follow its JSON schema):\n{}\n\n{answer}",
        request.described()
    )
}

/// Generic messages: the tools in the first system message (one added when
/// there is none), an assistant's calls as the JSON it would have written,
/// and a tool's result as a user message naming the tool (templates without
/// tool support may refuse a `tool` role; llama.cpp writes results alike).
fn generic_messages(messages: &[ChatMessage], request: Option<&ToolRequest>) -> Vec<ChatMessage> {
    let called = |id: &Option<String>| {
        (messages.iter())
            .flat_map(|m| m.tool_calls.iter().flatten())
            .find(|c| id.as_deref().is_some_and(|id| c["id"] == id))
            .map(|c| c["function"]["name"].clone())
    };
    let mut out: Vec<ChatMessage> = (messages.iter())
        .map(|m| generic_message(m, called(&m.tool_call_id)))
        .collect();
    if let Some(request) = request {
        let instructions = generic_instructions(request);
        match out.first_mut() {
            Some(first) if first.role == "system" => {
                first.content = format!("{}\n\n{instructions}", first.content)
            }
            _ => out.insert(0, ChatMessage::text("system", instructions)),
        }
    }
    out
}

/// `m` as generic text; `tool`: the name of the tool a result answers.
fn generic_message(m: &ChatMessage, tool: Option<Value>) -> ChatMessage {
    if m.role == "tool" {
        let tool = tool.unwrap_or_else(|| json!(m.tool_call_id));
        let result = json!({"tool_response": {"tool": tool, "content": m.content}});
        return ChatMessage::text("user", result.to_string());
    }
    let Some(calls) = &m.tool_calls else {
        return m.clone();
    };
    let calls: Vec<Value> = (calls.iter())
        .map(|c| json!({"name": c["function"]["name"], "arguments": c["function"]["arguments"]}))
        .collect();
    let written = match <[Value; 1]>::try_from(calls) {
        Ok([one]) => json!({ "tool_call": one }),
        Err(many) => json!({ "tool_calls": many }),
    };
    let content = match m.content.is_empty() {
        true => written.to_string(),
        false => format!("{}\n{written}", m.content),
    };
    ChatMessage::text(&m.role, content)
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
