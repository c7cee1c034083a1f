//! `chat`: answers a conversation, rendered by the model's own chat
//! template, streaming the reply to the process's output as it is made.
//!
//! Args (any other key is an error): `{"messages": [{"role": string,
//! "content": string}], "max_tokens"?: int (default 256), "temperature"?:
//! number (default 0, greedy), "top_p"?: number (1), "top_k"?: int (0),
//! "min_p"?: number (0), "seed"?: int, "stop"?: string or [string],
//! "ignore_eos"?: bool (false), "frequency_penalty"?: number (0),
//! "presence_penalty"?: number (0), "repetition_penalty"?: number (1),
//! "logit_bias"?: {token id: number}}`.

use pie_inferlet::{Context, GenArgs, Message, model};

fn run() -> Result<(), String> {
    let args: GenArgs = pie_inferlet::args()?;
    if args.prompt.is_some() {
        return Err("chat takes `messages`, not `prompt`".into());
    }
    let turns = args.messages.as_deref().ok_or("missing field `messages`")?;
    if turns.is_empty() {
        return Err("messages must not be empty".into());
    }
    let messages: Vec<Message> = turns
        .iter()
        .map(|t| Message::new(t.role.as_str(), t.content.as_str()))
        .collect();
    let prompt = model::apply_chat_template(&messages)?;
    let ctx = Context::new()?;
    ctx.append_text(&prompt)?;
    args.shape(&ctx)?;
    ctx.generate(&args.options(256).stream(true))?;
    Ok(())
}

pie_inferlet::main!(run);
