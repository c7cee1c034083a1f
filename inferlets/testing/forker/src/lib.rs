//! Test inferlet `forker`: a context of `tokens` token ids, prefilled; then,
//! each step after a message, `forks` forks of it, a `generate_all` of
//! `max_tokens` over the forks, and dropping every context. It emits a JSON
//! event `{"step": NAME}` after each step and waits for the next message, so
//! a test can read the pool between steps. Args: `{"tokens": int, "forks":
//! int, "max_tokens": int}`.

use pie_inferlet::serde_json::json;
use pie_inferlet::{Context, GenerateOptions, generate_all};
use serde::Deserialize;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Args {
    tokens: u32,
    forks: u32,
    max_tokens: u32,
}

fn step(name: &str) -> Result<(), String> {
    pie_inferlet::emit_json(&json!({ "step": name }))?;
    pie_inferlet::receive();
    Ok(())
}

fn run() -> Result<(), String> {
    let args: Args = pie_inferlet::args()?;
    let base = Context::new()?;
    let ids: Vec<u32> = (0..args.tokens).map(|i| 10 + i % 200).collect();
    base.append_tokens(&ids)?;
    base.prefill()?;
    step("prefilled")?;
    let forks = (0..args.forks)
        .map(|_| base.fork())
        .collect::<Result<Vec<Context>, String>>()?;
    step("forked")?;
    let refs: Vec<&Context> = forks.iter().collect();
    let options = GenerateOptions::new()
        .max_tokens(args.max_tokens)
        .ignore_eos(true);
    for generation in generate_all(&refs, &options) {
        generation?;
    }
    step("generated")?;
    drop(forks);
    drop(base);
    step("dropped")
}

pie_inferlet::main!(run);
