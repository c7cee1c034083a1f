//! Chat messages as both binaries read them: [`ChatMessage`] (what a chat
//! template renders) and [`OpenAiMessage`], every shape an OpenAI client sends
//! (`content` as a string, an array of text parts, or `null`). The worker and
//! the controller parse messages here and nowhere else, so a request one
//! accepts the other accepts too. An assistant's `tool_calls` (their
//! `arguments` read as JSON, as templates render them) and a tool result's
//! `tool_call_id` reach the template.

use serde::{Deserialize, Serialize};
use serde_json::Value;

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
    /// An assistant's calls: `{"id", "type", "function": {"name", "arguments"}}`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<Value>>,
    /// A `tool` message: the call it answers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
}

impl ChatMessage {
    pub fn text(role: &str, content: String) -> Self {
        Self {
            role: role.into(),
            content,
            tool_calls: None,
            tool_call_id: None,
        }
    }
}

/// One message of an OpenAI chat request.
#[derive(Clone, Debug, Deserialize)]
pub struct OpenAiMessage {
    role: String,
    #[serde(default)]
    content: Option<Content>,
    #[serde(default)]
    tool_calls: Option<Vec<Value>>,
    #[serde(default)]
    tool_call_id: Option<String>,
}

#[derive(Clone, Debug, Deserialize)]
#[serde(untagged)]
enum Content {
    Text(String),
    Parts(Vec<ContentPart>),
}

#[derive(Clone, Debug, Deserialize)]
struct ContentPart {
    #[serde(rename = "type")]
    kind: String,
    text: Option<String>,
}

impl OpenAiMessage {
    /// The message as a template renders it: text parts joined, `null` empty.
    /// A part that is not text is refused, naming its type.
    pub fn into_chat(self) -> Result<ChatMessage, String> {
        let content = match self.content {
            None => String::new(),
            Some(Content::Text(text)) => text,
            Some(Content::Parts(parts)) => joined_text(parts)?,
        };
        let tool_calls = self
            .tool_calls
            .map(|calls| calls.into_iter().map(arguments_as_json).collect());
        Ok(ChatMessage {
            role: self.role,
            content,
            tool_calls,
            tool_call_id: self.tool_call_id,
        })
    }
}

/// A call with its `arguments` string read as the JSON it holds (templates
/// render them with `tojson`); kept as text when it is not JSON.
fn arguments_as_json(mut call: Value) -> Value {
    let parsed = (call["function"]["arguments"].as_str())
        .and_then(|a| serde_json::from_str::<Value>(a).ok());
    if let Some(arguments) = parsed {
        call["function"]["arguments"] = arguments;
    }
    call
}

fn joined_text(parts: Vec<ContentPart>) -> Result<String, String> {
    let mut text = String::new();
    for part in parts {
        if part.kind != "text" {
            return Err(format!(
                "content part type `{}` is not supported (text only)",
                part.kind
            ));
        }
        text.push_str(&part.text.unwrap_or_default());
    }
    Ok(text)
}

/// A request's `messages` array; errors are messages for a 400 on `messages`.
pub fn parse_messages(messages: &Value) -> Result<Vec<ChatMessage>, String> {
    let parsed: Vec<OpenAiMessage> =
        serde_json::from_value(messages.clone()).map_err(|e| format!("messages: {e}"))?;
    parsed
        .into_iter()
        .map(OpenAiMessage::into_chat)
        .collect::<Result<_, _>>()
        .map_err(|e| format!("messages: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn every_content_shape_becomes_text() {
        let messages = json!([
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Say "}, {"type": "text", "text": "hi"}]},
            {"role": "assistant", "content": null},
            {"role": "assistant"}
        ]);
        let parsed = parse_messages(&messages).expect("valid messages");
        let contents: Vec<&str> = parsed.iter().map(|m| m.content.as_str()).collect();
        assert_eq!(contents, ["Be brief.", "Say hi", "", ""]);
        assert_eq!(parsed[1].role, "user");
    }

    #[test]
    fn calls_and_results_reach_the_template_with_json_arguments() {
        let messages = json!([
            {"role": "assistant", "content": null, "tool_calls": [{"id": "c1", "type": "function",
                "function": {"name": "weather", "arguments": "{\"city\": \"Oslo\"}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "cold"}
        ]);
        let parsed = parse_messages(&messages).expect("valid messages");
        let calls = parsed[0].tool_calls.as_ref().expect("calls");
        assert_eq!(calls[0]["function"]["arguments"]["city"], "Oslo");
        assert_eq!(parsed[1].tool_call_id.as_deref(), Some("c1"));
        assert_eq!(parsed[1].content, "cold");
    }

    #[test]
    fn refusals_name_the_problem() {
        let image = json!([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]);
        let e = parse_messages(&image).expect_err("image parts are refused");
        assert!(e.contains("image_url"), "{e}");
        let e = parse_messages(&json!("hi")).expect_err("not an array");
        assert!(e.starts_with("messages:"), "{e}");
        let e = parse_messages(&json!([{"content": "no role"}])).expect_err("no role");
        assert!(e.contains("role"), "{e}");
    }
}
