//! `tools` on `/v1/chat/completions`: the request's tools checked
//! (`pie_core::tools`), the output held to the format's constraint (a
//! required or named call always parses, its arguments valid under the
//! tool's `parameters`), and the answer's calls shaped as OpenAI returns
//! them: `message.tool_calls` whole, `delta.tool_calls` streamed (each call
//! in one chunk, once it is complete), `finish_reason: "tool_calls"`.

use pie_core::tools::{ToolCall, ToolConstraint, ToolRequest};
use pie_model::GrammarSpec;
use serde_json::{json, Value};

use super::response_format::compile;
use super::state::ApiError;
use crate::runtime::{GenOptions, Runtime};

/// The tools a chat request offers, checked; None: none offered.
pub(super) fn tool_request(
    tools: &Value,
    tool_choice: &Value,
    parallel_tool_calls: &Value,
) -> Result<Option<ToolRequest>, ApiError> {
    ToolRequest::from_fields(tools, tool_choice, parallel_tool_calls)
        .map_err(|e| ApiError::bad_request(e.message).param(&e.param))
}

/// `opts` with the constraint of `request` in the model's format. A
/// `response_format` as well is refused: one answer has one shape.
pub(super) async fn constrained(
    rt: &Runtime,
    request: &ToolRequest,
    mut opts: GenOptions,
) -> Result<GenOptions, ApiError> {
    if opts.grammar.is_some() {
        return Err(ApiError::bad_request(
            "response_format cannot be combined with tools: a tool call has its own format",
        )
        .param("response_format"));
    }
    let spec = match rt.model.tokenizer.tool_format().constraint(request) {
        None => return Ok(opts),
        Some(ToolConstraint::JsonSchema(schema)) => GrammarSpec::JsonSchema(schema),
        Some(ToolConstraint::Lark(grammar)) => GrammarSpec::Lark(grammar),
    };
    opts.grammar = Some(compile(rt, spec, "tools").await?);
    Ok(opts)
}

/// The calls of choice `choice` of response `id`, as `tool_calls` entries
/// (with their `index` when streamed).
pub(super) fn calls_json(id: &str, choice: usize, calls: &[ToolCall], streamed: bool) -> Value {
    (calls.iter().enumerate())
        .map(|(i, call)| {
            let mut v = json!({"id": format!("call_{id}_{choice}_{i}"), "type": "function",
                "function": {"name": call.name, "arguments": call.arguments}});
            if streamed {
                v["index"] = json!(i);
            }
            v
        })
        .collect()
}
