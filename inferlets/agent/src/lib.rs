//! `agent`: a ReAct agent that keeps its context live across tool calls.
//! Each step generates, under a regular expression (`STEP`), one line
//! `Thought: ...` and then `Action: TOOL[INPUT]` or `Final Answer: ...`; an
//! action is emitted as a JSON event `{"type": "tool_call", "step", "tool",
//! "input"}` and the agent waits for the client's message with the tool's
//! result, which joins the conversation as the user turn `Observation: ...`
//! (only the new turn's tokens are appended: the KV of everything before is
//! already computed). The last step may only answer (`FINAL`). It ends with
//! `{"type": "final", "answer", "steps"}`.
//!
//! The protocol (system prompt, the two expressions, the observation turn) is
//! the one `scripts/agent-bench.py` drives over `/v1/chat/completions`, so
//! the three ways of running an agent make the same calls.
//!
//! Args: `{"question": string, "max_steps"?: int (default 6), "min_actions"?:
//! int (default 0: the first this many steps must call a tool)}`; greedy.

use pie_inferlet::serde_json::json;
use pie_inferlet::{Context, GenerateOptions, Message, OutputFormat, emit_json, model, receive};
use serde::Deserialize;

const SYSTEM: &str = "You are an agent that answers questions with tools. Each turn, write \
one line `Thought: ...`, then either `Action: search[QUERY]` or `Action: calculate[EXPRESSION]` \
to use a tool, or `Final Answer: ...` when you know the answer. Tool results come back as \
`Observation: ...`.";

/// A step: a thought, then a tool call or the final answer (printable
/// ASCII, so a step fits its token budget on any vocabulary).
const STEP: &str = r"Thought: [ -~]{1,100}\n(Action: (search|calculate)\[[a-zA-Z0-9 +*/.-]{1,40}\]|Final Answer: [ -~]{1,100})";

/// A step that must call a tool (the first `min_actions`).
const ACTION: &str = r"Thought: [ -~]{1,100}\nAction: (search|calculate)\[[a-zA-Z0-9 +*/.-]{1,40}\]";

/// The last step: a thought, then the final answer.
const FINAL: &str = r"Thought: [ -~]{1,100}\nFinal Answer: [ -~]{1,100}";

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Args {
    question: String,
    max_steps: Option<u32>,
    min_actions: Option<u32>,
}

enum Step<'a> {
    Action { tool: &'a str, input: &'a str },
    Final(&'a str),
}

/// A step's text as the expressions made it.
fn parse(text: &str) -> Result<Step<'_>, String> {
    let (_, decision) = text
        .split_once('\n')
        .ok_or_else(|| format!("a step without its second line: {text:?}"))?;
    if let Some(answer) = decision.strip_prefix("Final Answer: ") {
        return Ok(Step::Final(answer));
    }
    let call = decision
        .strip_prefix("Action: ")
        .and_then(|c| c.strip_suffix(']'))
        .and_then(|c| c.split_once('['))
        .ok_or_else(|| format!("a step that is neither an action nor an answer: {text:?}"))?;
    Ok(Step::Action {
        tool: call.0,
        input: call.1,
    })
}

fn run() -> Result<(), String> {
    let args: Args = pie_inferlet::args()?;
    let max_steps = args.max_steps.unwrap_or(6).clamp(1, 32);
    let mut messages = vec![
        Message::new("system", SYSTEM),
        Message::new("user", &args.question),
    ];
    let mut rendered = model::apply_chat_template(&messages)?;
    let ctx = Context::new()?;
    ctx.append_text(&rendered)?;
    // Enough for the longest step the expression allows, a byte a token.
    let options = GenerateOptions::new().max_tokens(256);
    for step in 0..max_steps {
        let expression = match step {
            s if s + 1 == max_steps => FINAL,
            s if s < args.min_actions.unwrap_or(0) => ACTION,
            _ => STEP,
        };
        let made = ctx.generate_constrained(&options, &OutputFormat::Regex(expression.into()))?;
        rendered.push_str(&made.text);
        messages.push(Message::new("assistant", &made.text));
        match parse(&made.text)? {
            Step::Final(answer) => {
                return emit_json(&json!({"type": "final", "answer": answer, "steps": step + 1}));
            }
            Step::Action { tool, input } => {
                emit_json(
                    &json!({"type": "tool_call", "step": step, "tool": tool, "input": input}),
                )?;
            }
        }
        messages.push(Message::new("user", format!("Observation: {}", receive())));
        let next = model::apply_chat_template(&messages)?;
        let turn = next.strip_prefix(&rendered).ok_or(
            "the chat template does not render the conversation as an extension of itself",
        )?;
        ctx.append_text(turn)?;
        rendered = next;
    }
    Err("no final answer within max_steps".into())
}

pie_inferlet::main!(run);
