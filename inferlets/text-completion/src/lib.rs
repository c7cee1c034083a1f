//! `text-completion`: completes a prompt, streaming the text to the
//! process's output as it is made (the native built-in's job, as a guest).
//!
//! Args (same names as the native built-in's; any other key is an error):
//! `{"prompt": string, "max_tokens"?: int (default 256), "temperature"?:
//! number (default 0, greedy), "top_p"?: number (1), "top_k"?: int (0),
//! "min_p"?: number (0), "seed"?: int, "stop"?: string or [string],
//! "ignore_eos"?: bool (false)}`.

use pie_inferlet::{Context, GenerateOptions};
use serde::Deserialize;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Args {
    prompt: String,
    max_tokens: Option<u32>,
    temperature: Option<f32>,
    top_p: Option<f32>,
    top_k: Option<u32>,
    min_p: Option<f32>,
    seed: Option<u64>,
    stop: Option<Stop>,
    #[serde(default)]
    ignore_eos: bool,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum Stop {
    One(String),
    Many(Vec<String>),
}

fn run() -> Result<(), String> {
    let args: Args = pie_inferlet::args()?;
    let stop = match args.stop {
        None => Vec::new(),
        Some(Stop::One(s)) => vec![s],
        Some(Stop::Many(v)) => v,
    };
    let options = GenerateOptions::new()
        .max_tokens(args.max_tokens.unwrap_or(256))
        .temperature(args.temperature.unwrap_or(0.0))
        .top_p(args.top_p.unwrap_or(1.0))
        .top_k(args.top_k.unwrap_or(0))
        .min_p(args.min_p.unwrap_or(0.0))
        .seed(args.seed)
        .stop(stop)
        .ignore_eos(args.ignore_eos)
        .stream(true);

    let ctx = Context::new()?;
    ctx.append_text(&args.prompt)?;
    ctx.generate(&options)?;
    Ok(())
}

pie_inferlet::main!(run);
