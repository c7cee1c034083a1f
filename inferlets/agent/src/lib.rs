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
//! A step's context keeps its text as the tokenizer makes it, not always
//! the tokens sampled: the two can differ (a sampled `" th" "ought"` where
//! the tokenizer makes `" thought"`), and a client loop re-sends the text,
//! so an agent that kept the sampled tokens would go on from a context no
//! loop sees and make other calls. Each step generates on a fork of the
//! context; the fork is kept when its tokens are the text's, else a fork
//! of the context takes the text's tokens (computed again, as a loop's
//! are, but for full pages the attempt filled, which the prefix cache can
//! hold, and the part of its last page the two share, which is copied).
//!
//! The protocol (`protocol.rs`: the system prompt, the expressions; then the
//! observation turn) is the one `scripts/agent-bench.py` and
//! `crates/pie-worker/tests/agent.rs` drive over `/v1/chat/completions`, so
//! the three ways of running an agent make the same calls.
//!
//! Args: `{"question": string, "max_steps"?: int (default 6), "min_actions"?:
//! int (default 0: the first this many steps must call a tool)}`; greedy.

use pie_inferlet::serde_json::json;
use pie_inferlet::{
    Context, GenerateOptions, Generation, Message, OutputFormat, emit_json, model, receive,
};
use serde::Deserialize;

mod protocol;

use protocol::{ACTION, FINAL, STEP, SYSTEM};

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

/// One step on `ctx` under `expression`: the context that holds it (the
/// step's text as the tokenizer makes it), what was generated, and, where
/// the sampled tokens are not the text's, the attempt that sampled them:
/// kept until the next step's generation, which copies the part of its
/// last page the two share instead of computing it.
fn generate_step(
    ctx: Context,
    options: &GenerateOptions,
    expression: &str,
) -> Result<(Context, Generation, Option<Context>), String> {
    let attempt = ctx.fork()?;
    let made = attempt.generate_constrained(options, &OutputFormat::Regex(expression.into()))?;
    let text_tokens = model::encode(&made.text)?;
    if text_tokens == made.tokens {
        return Ok((attempt, made, None));
    }
    // Go on as a fork: `ctx`'s pages are the attempt's too (its full pages
    // shared, its partial one copied or computed again), so `ctx` is
    // dropped here and its retention with it, instead of holding a page no
    // step reads while the agent waits for its tool.
    let text = ctx.fork()?;
    text.append_tokens(&text_tokens)?;
    Ok((text, made, Some(attempt)))
}

fn run() -> Result<(), String> {
    let args: Args = pie_inferlet::args()?;
    let max_steps = args.max_steps.unwrap_or(6).clamp(1, 32);
    let mut messages = vec![
        Message::new("system", SYSTEM),
        Message::new("user", &args.question),
    ];
    let mut rendered = model::apply_chat_template(&messages)?;
    let mut ctx = Context::new()?;
    // Its steps' log-probabilities are never read (forks take this too).
    ctx.report_logprobs(false)?;
    ctx.append_text(&rendered)?;
    // Enough for the longest step the expression allows, a byte a token.
    let options = GenerateOptions::new().max_tokens(256);
    // Held, not read: dropped when the next step's generation has copied
    // from its pages.
    let mut _last_attempt = None;
    for step in 0..max_steps {
        let expression = match step {
            s if s + 1 == max_steps => FINAL,
            s if s < args.min_actions.unwrap_or(0) => ACTION,
            _ => STEP,
        };
        let (kept, made, attempt) = generate_step(ctx, &options, expression)?;
        ctx = kept;
        _last_attempt = attempt;
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
