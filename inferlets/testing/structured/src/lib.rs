//! Test inferlet `structured`: one constrained generation
//! (`pie:inferlet@0.2.0`'s `structured.generate-constrained`). Args:
//! `{"prompt", "max_tokens", "format", "logprobs"?}` where `format` is
//! `{"json-schema": SCHEMA}`, `{"json-object": true}`, `{"regex": RX}` or
//! `{"grammar": LARK}`, and `logprobs: false` turns the context's
//! log-probabilities off (`reporting.report-logprobs`). Emits one JSON
//! event: `{"text", "finish", "tokens", "logprobs"}` (the last two counts),
//! or `{"error"}` when the host refused the call (so a test reads the
//! refusal's text).

use pie_inferlet::serde_json::{Value, json};
use pie_inferlet::{Context, FinishReason, GenerateOptions, OutputFormat};

fn format_of(v: &Value) -> Result<OutputFormat, String> {
    if let Some(schema) = v.get("json-schema") {
        return Ok(OutputFormat::JsonSchema(schema.to_string()));
    }
    if v.get("json-object").is_some() {
        return Ok(OutputFormat::JsonObject);
    }
    let text = |key: &str| v.get(key).and_then(Value::as_str).map(str::to_string);
    if let Some(rx) = text("regex") {
        return Ok(OutputFormat::Regex(rx));
    }
    text("grammar")
        .map(OutputFormat::Grammar)
        .ok_or_else(|| format!("unknown format {v}"))
}

fn run() -> Result<(), String> {
    let args: Value = pie_inferlet::args()?;
    let ctx = Context::new()?;
    if args["logprobs"] == false {
        ctx.report_logprobs(false)?;
    }
    ctx.append_text(args["prompt"].as_str().unwrap_or("go"))?;
    let options =
        GenerateOptions::new().max_tokens(args["max_tokens"].as_u64().unwrap_or(64) as u32);
    let event = match ctx.generate_constrained(&options, &format_of(&args["format"])?) {
        Ok(g) => json!({"text": g.text, "finish": match g.finish_reason {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
        }, "tokens": g.tokens.len(), "logprobs": g.logprobs.len()}),
        Err(e) => json!({"error": e}),
    };
    pie_inferlet::emit_json(&event)
}

pie_inferlet::main!(run);
