//! `contrastive`: contrastive decoding (Li et al., "Contrastive Decoding",
//! 2023) with one model over two contexts: an "expert" context holding the
//! prompt and an "amateur" one holding a weaker prompt, `amateur_prompt`,
//! or by default just the last 8 tokens of the expert's prompt (no system
//! prefix, little context).
//!
//! Each token starts both contexts' passes at once (`full` reports; the
//! first with no tokens, each later one appending the token chosen before),
//! so the engine computes them in the same steps, and picks the token
//! maximizing `expert - alpha * amateur` (log-probabilities) among the
//! plausible ones, those whose expert probability is at least 0.1 times
//! the likeliest token's; ties go to the lower id. The token goes to both
//! contexts. It stops before a stop token of the model or after
//! `max_tokens`. With `alpha` 0 it is greedy decoding of the expert.
//!
//! Args (any other key is an error): `{"prompt": string, "amateur_prompt"?:
//! string, "alpha"?: number (default 0.5, at least 0), "max_tokens"?: int
//! (default 64, at least 1), "chat"?: bool (default false: true applies the
//! chat template to one user message, to `amateur_prompt` too)}`.
//!
//! Emits the text as it comes, then `{"tokens": [ids], "text": string}`.

use pie_inferlet::serde_json::json;
use pie_inferlet::{Context, Message, Report, TextStream, emit_json, model, wait_all};
use serde::Deserialize;

/// The plausibility constraint: a token's expert probability must be at
/// least this times the likeliest token's.
const PLAUSIBLE: f32 = 0.1;
/// The amateur's default prompt: the expert prompt's last tokens.
const AMATEUR_TOKENS: usize = 8;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Args {
    prompt: String,
    amateur_prompt: Option<String>,
    alpha: Option<f32>,
    max_tokens: Option<u32>,
    #[serde(default)]
    chat: bool,
}

/// `prompt`, in the chat template if `chat`.
fn prompt_text(prompt: &str, chat: bool) -> Result<String, String> {
    if chat {
        model::apply_chat_template(&[Message::user(prompt)])
    } else {
        Ok(prompt.to_string())
    }
}

/// The expert and the amateur contexts, neither empty.
fn contexts(args: &Args) -> Result<(Context, Context), String> {
    let expert = Context::new()?;
    if expert.append_text(&prompt_text(&args.prompt, args.chat)?)? == 0 {
        return Err("the prompt must not be empty".into());
    }
    let amateur = Context::new()?;
    match &args.amateur_prompt {
        Some(p) => {
            if amateur.append_text(&prompt_text(p, args.chat)?)? == 0 {
                return Err("amateur_prompt must not be empty".into());
            }
        }
        None => {
            let tokens = expert.tokens()?;
            let tail = &tokens[tokens.len().saturating_sub(AMATEUR_TOKENS)..];
            amateur.append_tokens(tail)?;
        }
    }
    Ok((expert, amateur))
}

/// The token maximizing `expert - alpha * amateur` among the plausible
/// ones (ties to the lower id); none for an empty distribution.
fn choose(expert: &[f32], amateur: &[f32], alpha: f32) -> Option<u32> {
    let top = expert.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let floor = top + PLAUSIBLE.ln();
    let mut best: Option<(u32, f32)> = None;
    for (t, (&e, &a)) in expert.iter().zip(amateur).enumerate() {
        if e < floor {
            continue;
        }
        let score = e - alpha * a;
        if best.is_none_or(|(_, b)| score > b) {
            best = Some((t as u32, score));
        }
    }
    best.map(|(t, _)| t)
}

/// Both contexts' full distributions after appending `tokens`, computed
/// together.
fn both_passes(
    expert: &Context,
    amateur: &Context,
    tokens: &[u32],
) -> Result<(Vec<f32>, Vec<f32>), String> {
    let at = [tokens.len() as u32];
    let pending = vec![
        expert.start_pass(tokens, &at, Report::Full)?,
        amateur.start_pass(tokens, &at, Report::Full)?,
    ];
    let mut fulls = Vec::with_capacity(2);
    for r in wait_all(pending) {
        match r?.into_iter().next() {
            Some(d) => fulls.push(d.full),
            None => return Err("a pass reported no distribution".into()),
        }
    }
    let amateur = fulls.pop().unwrap_or_default();
    let expert = fulls.pop().unwrap_or_default();
    if expert.len() != amateur.len() || expert.is_empty() {
        return Err(format!(
            "full reports of {} and {} log-probabilities",
            expert.len(),
            amateur.len()
        ));
    }
    Ok((expert, amateur))
}

fn run() -> Result<(), String> {
    let args: Args = pie_inferlet::args()?;
    let alpha = args.alpha.unwrap_or(0.5);
    if !(alpha.is_finite() && alpha >= 0.0) {
        return Err(format!("alpha must be a number at least 0, got {alpha}"));
    }
    let max_tokens = args.max_tokens.unwrap_or(64);
    if max_tokens == 0 {
        return Err("max_tokens must be at least 1".into());
    }
    let (expert, amateur) = contexts(&args)?;
    let stop_tokens = model::stop_tokens();
    let mut text = TextStream::new();
    let mut last: Vec<u32> = Vec::new();
    for _ in 0..max_tokens {
        let (e, a) = both_passes(&expert, &amateur, &last)?;
        let token = choose(&e, &a, alpha).ok_or("no plausible token")?;
        if stop_tokens.contains(&token) {
            break;
        }
        text.push(&[token])?;
        last = vec![token];
    }
    let tokens = text.tokens();
    emit_json(&json!({"tokens": tokens, "text": model::decode(tokens)?}))
}

pie_inferlet::main!(run);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn alpha_zero_is_greedy() {
        let e = [-2.0, -0.5, -0.5, -3.0];
        let a = [-0.1, -0.2, -5.0, -9.0];
        assert_eq!(choose(&e, &a, 0.0), Some(1));
    }

    #[test]
    fn the_amateur_demotes_what_it_also_likes_among_plausible_tokens() {
        // ln 0.1 = -2.30: token 3 (-3.0) is implausible however much the
        // amateur dislikes it.
        let e = [-2.0, -0.5, -0.6, -3.0];
        let a = [-0.1, -0.2, -5.0, -90.0];
        assert_eq!(choose(&e, &a, 0.5), Some(2));
        assert_eq!(choose(&[], &[], 0.5), None);
    }
}
