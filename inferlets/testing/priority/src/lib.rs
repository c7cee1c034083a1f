//! Test inferlet `priority`: raises or lowers its own `priority` prop, then
//! generates (streamed). If `bad_priority` is given it first tries to set
//! that and emits `{"bad_priority_error": <error text, or null if it was
//! accepted>}`.
//!
//! Args: `{"priority": int, "bad_priority"?: int, "prompt": string,
//! "max_tokens"?: int (default 256)}`; greedy.

use pie_inferlet::serde_json::json;
use pie_inferlet::{Context, GenerateOptions, emit_json, set_prop};
use serde::Deserialize;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Args {
    priority: i64,
    bad_priority: Option<i64>,
    prompt: String,
    max_tokens: Option<u32>,
}

fn run() -> Result<(), String> {
    let args: Args = pie_inferlet::args()?;
    if let Some(bad) = args.bad_priority {
        let error = set_prop("priority", &json!(bad)).err();
        emit_json(&json!({ "bad_priority_error": error }))?;
    }
    set_prop("priority", &json!(args.priority))?;
    let ctx = Context::new()?;
    ctx.append_text(&args.prompt)?;
    let options = GenerateOptions::new()
        .max_tokens(args.max_tokens.unwrap_or(256))
        .stream(true);
    ctx.generate(&options)?;
    Ok(())
}

pie_inferlet::main!(run);
