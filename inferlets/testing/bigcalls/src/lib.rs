//! Test inferlet `bigcalls`: calls the heavy host calls with inputs of a
//! given size, `rounds` times, as a hostile guest looping on the largest
//! allowed inputs would: `encode` of `bytes` of text, `apply-chat-template`
//! of one message of `bytes` (role included), and `decode` of `bytes / 16`
//! (rounded up)
//! tokens (the host's bound on decode is the model's context in tokens).
//! Each call of the first round is reported with `emit_json` as
//! `{"call", "ok", "error"}`; the process returns the first error of a
//! later round, or ends when done.
//!
//! Args: `{"bytes": int, "rounds": int}`.

use pie_inferlet::serde_json::json;
use pie_inferlet::{Message, emit_json, model};
use serde::Deserialize;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Args {
    bytes: usize,
    rounds: u64,
}

fn report<T>(call: &str, result: &Result<T, String>) -> Result<(), String> {
    let error = result.as_ref().err();
    emit_json(&json!({"call": call, "ok": error.is_none(), "error": error}))
}

fn run() -> Result<(), String> {
    let args: Args = pie_inferlet::args()?;
    // Words of ordinary text: what a prompt is, and what tokenizes slowest
    // per byte is not the point; the size is.
    let text: String = "lorem ipsum dolor sit amet "
        .chars()
        .cycle()
        .take(args.bytes)
        .collect();
    let message = Message {
        role: "user".into(),
        content: text.chars().skip(4).collect(),
    };
    let tokens = vec![1u32; args.bytes.div_ceil(16)];
    for round in 0..args.rounds {
        let calls = [
            ("encode", model::encode(&text).map(|_| ())),
            (
                "apply-chat-template",
                model::apply_chat_template(std::slice::from_ref(&message)).map(|_| ()),
            ),
            ("decode", model::decode(&tokens).map(|_| ())),
        ];
        for (call, result) in &calls {
            if round == 0 {
                report(call, result)?;
            } else {
                result.clone()?;
            }
        }
    }
    Ok(())
}

pie_inferlet::main!(run);
