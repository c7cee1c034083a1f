//! `text-completion`: completes a prompt, streaming the text to the
//! process's output as it is made (the native built-in's job, as a guest).
//!
//! Args (same names as the native built-in's; any other key is an error):
//! `{"prompt": string, "max_tokens"?: int (default 256), "temperature"?:
//! number (default 0, greedy), "top_p"?: number (1), "top_k"?: int (0),
//! "min_p"?: number (0), "seed"?: int, "stop"?: string or [string],
//! "ignore_eos"?: bool (false), "frequency_penalty"?: number (0),
//! "presence_penalty"?: number (0), "repetition_penalty"?: number (1),
//! "logit_bias"?: {token id: number}}`.

use pie_inferlet::{Context, GenArgs};

fn run() -> Result<(), String> {
    let args: GenArgs = pie_inferlet::args()?;
    if args.messages.is_some() {
        return Err("text-completion takes `prompt`, not `messages`".into());
    }
    let prompt = args.prompt.as_deref().ok_or("missing field `prompt`")?;
    let ctx = Context::new()?;
    ctx.append_text(prompt)?;
    args.shape(&ctx)?;
    ctx.generate(&args.options(256).stream(true))?;
    Ok(())
}

pie_inferlet::main!(run);
