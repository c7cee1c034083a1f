//! What a chat request offers: `tools`, `tool_choice` and
//! `parallel_tool_calls`, checked as OpenAI defines them, and the JSON
//! schema of one call (a tool's name and arguments valid under its
//! `parameters`) that the formats constrain output to.

use serde_json::{json, Map, Value};

use crate::openai_fields::FieldError;

/// One function a model may call.
#[derive(Clone, Debug, PartialEq)]
pub struct Tool {
    pub name: String,
    pub description: Option<String>,
    /// The JSON schema of its arguments (an object).
    pub parameters: Value,
}

/// Which calls the answer may or must hold (`tool_choice`; `none` offers
/// no tools at all, so it has no variant).
#[derive(Clone, Debug, PartialEq)]
pub enum ToolChoice {
    /// A call or a text answer, as the model chooses.
    Auto,
    /// At least one call.
    Required,
    /// A call of this tool.
    Named(String),
}

/// The tools one request offers, and how they may be called.
#[derive(Clone, Debug, PartialEq)]
pub struct ToolRequest {
    pub tools: Vec<Tool>,
    pub choice: ToolChoice,
    /// Up to [`MAX_PARALLEL_CALLS`] calls in one answer
    /// (`parallel_tool_calls`). Default false, as llama.cpp's server has it:
    /// small models asked for a list tend to repeat a call until their
    /// token limit.
    pub parallel: bool,
}

/// The most calls one answer holds when calls may be parallel.
pub const MAX_PARALLEL_CALLS: usize = 8;

/// Longest function name OpenAI accepts.
const MAX_NAME_LEN: usize = 64;

impl ToolRequest {
    /// The tools a chat `body` offers; None: none offered, or
    /// `tool_choice: "none"`. Errors name the field.
    pub fn from_body(body: &Map<String, Value>) -> Result<Option<Self>, FieldError> {
        let field = |name: &str| body.get(name).unwrap_or(&Value::Null);
        Self::from_fields(
            field("tools"),
            field("tool_choice"),
            field("parallel_tool_calls"),
        )
    }

    /// As [`Self::from_body`], from the three fields (null: absent).
    pub fn from_fields(
        tools: &Value,
        tool_choice: &Value,
        parallel_tool_calls: &Value,
    ) -> Result<Option<Self>, FieldError> {
        let tools = checked_tools(tools)?;
        let choice = checked_choice(tool_choice, &tools)?;
        let parallel = match parallel_tool_calls {
            Value::Null => false,
            Value::Bool(b) => *b,
            other => {
                return Err(field_error(
                    "parallel_tool_calls",
                    format!("parallel_tool_calls must be a boolean, got {other}"),
                ))
            }
        };
        Ok(choice.map(|choice| ToolRequest {
            tools,
            choice,
            parallel,
        }))
    }

    /// The tools as OpenAI sends them, for a template's `tools` variable.
    pub fn openai_tools(&self) -> Value {
        self.tools
            .iter()
            .map(|t| json!({"type": "function", "function": tool_json(t)}))
            .collect()
    }

    /// The tools as a plain list (name, description, parameters), for a
    /// prompt that describes them.
    pub fn described(&self) -> Value {
        self.tools.iter().map(tool_json).collect()
    }

    /// The JSON schema of one call the choice allows: `{"name": NAME,
    /// KEY: ARGS}`, ARGS valid under NAME's parameters (KEY: `arguments`,
    /// or `parameters` as Llama 3 writes it).
    pub fn call_schema(&self, key: &str) -> Value {
        let callable: Vec<Value> = (self.tools.iter())
            .filter(|t| match &self.choice {
                ToolChoice::Named(name) => &t.name == name,
                _ => true,
            })
            .map(|t| {
                json!({
                    "type": "object",
                    "properties": {"name": {"const": t.name}, key: t.parameters},
                    "required": ["name", key],
                    "additionalProperties": false
                })
            })
            .collect();
        match <[Value; 1]>::try_from(callable) {
            Ok([one]) => one,
            Err(many) => json!({ "anyOf": many }),
        }
    }
}

fn tool_json(t: &Tool) -> Value {
    let mut v = json!({"name": t.name, "parameters": t.parameters});
    if let Some(d) = &t.description {
        v["description"] = json!(d);
    }
    v
}

fn field_error(param: &str, message: String) -> FieldError {
    FieldError {
        param: param.into(),
        message,
    }
}

fn checked_tools(tools: &Value) -> Result<Vec<Tool>, FieldError> {
    let list = match tools {
        Value::Null => return Ok(Vec::new()),
        Value::Array(list) => list,
        other => {
            return Err(field_error(
                "tools",
                format!("tools must be an array, got {other}"),
            ))
        }
    };
    let mut checked: Vec<Tool> = Vec::with_capacity(list.len());
    for (i, tool) in list.iter().enumerate() {
        let param = format!("tools[{i}]");
        let tool = checked_tool(tool).map_err(|m| field_error(&param, format!("{param}: {m}")))?;
        if checked.iter().any(|t| t.name == tool.name) {
            let message = format!("{param}: the name `{}` is offered twice", tool.name);
            return Err(field_error(&param, message));
        }
        checked.push(tool);
    }
    Ok(checked)
}

fn checked_tool(tool: &Value) -> Result<Tool, String> {
    if tool["type"] != "function" {
        return Err(format!(
            "type must be \"function\" (the only kind of tool served), got {}",
            tool["type"]
        ));
    }
    let function = &tool["function"];
    let name = function["name"]
        .as_str()
        .ok_or("function.name must be a string")?;
    let well_formed = (1..=MAX_NAME_LEN).contains(&name.len())
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
    if !well_formed {
        return Err(format!(
            "function.name `{name}` must be 1 to {MAX_NAME_LEN} of a-z, A-Z, 0-9, _ and -"
        ));
    }
    let description = match &function["description"] {
        Value::Null => None,
        Value::String(d) => Some(d.clone()),
        _ => return Err("function.description must be a string".into()),
    };
    let parameters = match &function["parameters"] {
        // A function without parameters takes an empty object.
        Value::Null => json!({"type": "object", "properties": {}, "additionalProperties": false}),
        p @ Value::Object(_) => p.clone(),
        _ => return Err("function.parameters must be a JSON schema object".into()),
    };
    Ok(Tool {
        name: name.into(),
        description,
        parameters,
    })
}

/// `tool_choice`, checked against the tools offered; None: no tools.
fn checked_choice(choice: &Value, tools: &[Tool]) -> Result<Option<ToolChoice>, FieldError> {
    let bad = |message: String| field_error("tool_choice", message);
    let choice = match choice {
        Value::Null if tools.is_empty() => return Ok(None),
        Value::Null => ToolChoice::Auto,
        Value::String(s) => match s.as_str() {
            "none" => return Ok(None),
            "auto" => ToolChoice::Auto,
            "required" => ToolChoice::Required,
            other => {
                return Err(bad(format!(
                    "tool_choice must be none, auto, required or a function; got `{other}`"
                )))
            }
        },
        Value::Object(_) if choice["type"] == "function" => match choice["function"]["name"].as_str() {
            Some(name) if tools.iter().any(|t| t.name == name) => ToolChoice::Named(name.into()),
            Some(name) => return Err(bad(format!("tool_choice names `{name}`, which tools does not offer"))),
            None => return Err(bad("tool_choice.function.name must be a string".into())),
        },
        other => return Err(bad(format!("tool_choice must be none, auto, required or {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}; got {other}"))),
    };
    if tools.is_empty() {
        return Err(bad(
            "tool_choice asks for a tool call, but tools offers none".into(),
        ));
    }
    Ok(Some(choice))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn body(v: Value) -> Map<String, Value> {
        v.as_object().expect("an object").clone()
    }

    fn weather() -> Value {
        json!({"type": "function", "function": {"name": "weather", "description": "Today's weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}})
    }

    #[test]
    fn tools_default_to_auto_and_none_offers_nothing() {
        let r = ToolRequest::from_body(&body(json!({"tools": [weather()]})))
            .unwrap()
            .unwrap();
        assert_eq!(r.choice, ToolChoice::Auto);
        assert!(!r.parallel);
        assert_eq!(r.tools[0].name, "weather");
        assert_eq!(
            r.openai_tools()[0]["function"]["description"],
            "Today's weather"
        );
        let none = json!({"tools": [weather()], "tool_choice": "none"});
        assert_eq!(ToolRequest::from_body(&body(none)).unwrap(), None);
        assert_eq!(ToolRequest::from_body(&body(json!({}))).unwrap(), None);
    }

    #[test]
    fn a_named_choice_narrows_the_call_schema() {
        let other = json!({"type": "function", "function": {"name": "clock"}});
        let all = ToolRequest::from_body(&body(json!({"tools": [weather(), other]})))
            .unwrap()
            .unwrap();
        assert_eq!(
            all.call_schema("arguments")["anyOf"]
                .as_array()
                .map(Vec::len),
            Some(2)
        );
        let named = json!({"tools": [weather(), other], "parallel_tool_calls": true,
            "tool_choice": {"type": "function", "function": {"name": "clock"}}});
        let r = ToolRequest::from_body(&body(named)).unwrap().unwrap();
        assert_eq!(r.choice, ToolChoice::Named("clock".into()));
        assert!(r.parallel);
        let schema = r.call_schema("arguments");
        assert_eq!(schema["properties"]["name"]["const"], "clock");
        assert_eq!(
            schema["properties"]["arguments"]["additionalProperties"],
            false
        );
    }

    #[test]
    fn refusals_name_the_field() {
        for (request, param) in [
            (json!({"tools": {"a": 1}}), "tools"),
            (json!({"tools": [{"type": "retrieval"}]}), "tools[0]"),
            (
                json!({"tools": [weather(), {"type": "function", "function": {"name": "bad name"}}]}),
                "tools[1]",
            ),
            (json!({"tools": [weather(), weather()]}), "tools[1]"),
            (
                json!({"tools": [weather()], "tool_choice": "always"}),
                "tool_choice",
            ),
            (json!({"tool_choice": "required"}), "tool_choice"),
            (
                json!({"tools": [weather()], "tool_choice": {"type": "function", "function": {"name": "nope"}}}),
                "tool_choice",
            ),
            (
                json!({"tools": [weather()], "parallel_tool_calls": "yes"}),
                "parallel_tool_calls",
            ),
        ] {
            let e = ToolRequest::from_body(&body(request.clone())).unwrap_err();
            assert_eq!(e.param, param, "{request}: {}", e.message);
        }
    }
}
