//! `best-of-n`: samples `n` completions of one prompt and keeps the one the
//! model finds most likely (highest mean token log-probability). The prompt
//! is prefilled once; the `n` candidates are forks that share its pages.
//!
//! Args (any other key is an error): `{"prompt": string, "n"?: int (default
//! 8, 1 to 64), "max_tokens"?: int (default 256), "temperature"?: number
//! (default 1.0), "top_p"?: number (1), "seed"?: int, "ignore_eos"?: bool}`.
//!
//! Output: the best candidate's text, then a JSON event
//! `{"best": index, "candidates": [{"text", "mean_logprob", "tokens"}]}`.
//!
//! The candidates decode together, in the same engine steps
//! (`generate_all`); with a seed, fork `i` draws with `seed + i`, so a run
//! is reproducible and its candidates distinct.

use pie_inferlet::serde_json::json;
use pie_inferlet::{Context, GenerateOptions, Generation, generate_all};
use serde::Deserialize;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Args {
    prompt: String,
    n: Option<u32>,
    max_tokens: Option<u32>,
    temperature: Option<f32>,
    top_p: Option<f32>,
    seed: Option<u64>,
    ignore_eos: Option<bool>,
}

fn run() -> Result<(), String> {
    let args: Args = pie_inferlet::args()?;
    let n = args.n.unwrap_or(8);
    if !(1..=64).contains(&n) {
        return Err(format!("n must be between 1 and 64, got {n}"));
    }
    let options = GenerateOptions::new()
        .max_tokens(args.max_tokens.unwrap_or(256))
        .temperature(args.temperature.unwrap_or(1.0))
        .top_p(args.top_p.unwrap_or(1.0))
        .seed(args.seed)
        .ignore_eos(args.ignore_eos.unwrap_or(false));

    let base = Context::new()?;
    base.append_text(&args.prompt)?;
    base.prefill()?;
    let forks = (0..n)
        .map(|_| base.fork())
        .collect::<Result<Vec<Context>, String>>()?;

    let refs: Vec<&Context> = forks.iter().collect();
    let candidates: Vec<Generation> = generate_all(&refs, &options)
        .into_iter()
        .collect::<Result<_, _>>()?;

    let best = candidates
        .iter()
        .enumerate()
        .max_by(|(_, a), (_, b)| a.mean_logprob().total_cmp(&b.mean_logprob()))
        .map(|(i, _)| i)
        .ok_or("no candidates")?;
    pie_inferlet::emit(&candidates[best].text)?;
    let list: Vec<_> = candidates
        .iter()
        .map(|g| {
            json!({
                "text": g.text,
                "mean_logprob": g.mean_logprob(),
                "tokens": g.tokens.len(),
            })
        })
        .collect();
    pie_inferlet::emit_json(&json!({ "best": best, "candidates": list }))
}

pie_inferlet::main!(run);
