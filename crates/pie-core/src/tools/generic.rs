//! The generic tool format, for templates with no tool support (as
//! llama.cpp's server has it): the tools described in the system message,
//! earlier calls written as the JSON the model would have written, results
//! as user messages naming their tool, and the answer one JSON object.

use serde_json::{json, Value};

use super::request::{ToolChoice, ToolRequest, MAX_PARALLEL_CALLS};
use crate::chat::ChatMessage;

pub(super) fn calls_schema(call: Value, parallel: bool) -> Value {
    let (key, value) = match parallel {
        true => (
            "tool_calls",
            json!({"type": "array", "items": call, "minItems": 1, "maxItems": MAX_PARALLEL_CALLS}),
        ),
        false => ("tool_call", call),
    };
    json!({"type": "object", "properties": {key: value}, "required": [key], "additionalProperties": false})
}

pub(super) fn response_schema() -> Value {
    json!({"type": "object", "properties": {"response": {"type": "string"}}, "required": ["response"], "additionalProperties": false})
}

fn instructions(request: &ToolRequest) -> String {
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
pub(super) fn messages(
    messages: &[ChatMessage],
    request: Option<&ToolRequest>,
) -> Vec<ChatMessage> {
    let called = |id: &Option<String>| {
        (messages.iter())
            .flat_map(|m| m.tool_calls.iter().flatten())
            .find(|c| id.as_deref().is_some_and(|id| c["id"] == id))
            .map(|c| c["function"]["name"].clone())
    };
    let mut out: Vec<ChatMessage> = (messages.iter())
        .map(|m| message(m, called(&m.tool_call_id)))
        .collect();
    if let Some(request) = request {
        let instructions = instructions(request);
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
fn message(m: &ChatMessage, tool: Option<Value>) -> ChatMessage {
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
