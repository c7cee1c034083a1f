//! `spec-decode`: greedy speculative decoding by prompt lookup (vLLM's
//! `ngram` speculator, llama.cpp's lookup decoding): drafts come from the
//! context itself, with no draft model.
//!
//! It keeps `next`, the token chosen but not yet appended (the first from a
//! pass with no tokens at position 0). Each step drafts up to its current
//! draft length (below): it finds the most recent earlier occurrence of the sequence's
//! last `ngram` tokens (falling back to shorter n-grams, down to 1) and
//! copies what followed it. One pass appends `[next, drafts...]` and reports
//! the greedy choice after each of them; the drafts that match those choices
//! in order are accepted, the greedy choice after the last accepted token is
//! the new `next`, and the rejected drafts are truncated off the context.
//! The draft length starts at 4 (or `draft`, if less), doubles up to `draft`
//! while drafts are accepted whole, and halves when one is rejected; at 0 it
//! drafts nothing, and tries one token again every 8 passes. A rejected
//! draft costs its row of the pass, so text that copies little (a chat
//! answer) soon stops paying for drafts, and text that copies (a code edit)
//! drafts long runs. While the draft length is 0 it decodes up to 8 tokens
//! at a time in the engine (`generate`, no call into the guest per token)
//! and holds the last back as the next `next`.
//! A pass's logits are those of decoding its tokens one by one, so the
//! output is token for token plain greedy `generate`'s: it stops before a
//! stop token of the model or after `max_tokens`.
//!
//! With `"plain": true` it calls plain greedy `generate` instead (with the
//! same `max_tokens`) and reports the same JSON, so a test or a benchmark
//! compares the two in one component.
//!
//! Args (any other key is an error): `{"prompt": string, "max_tokens"?: int
//! (default 128, at least 1), "ngram"?: int (default 3, 1 to 16), "draft"?:
//! int (default 16, 0 to 64: the longest draft; 0 drafts nothing), "chat"?: bool (default false:
//! true applies the chat template to one user message), "plain"?: bool
//! (default false)}`.
//!
//! Emits the text as it comes, then one JSON event `{"tokens": [ids],
//! "text": string, "passes": n, "drafted": n, "accepted": n, "acceptance":
//! accepted / drafted (null when nothing was drafted)}`. `passes` counts
//! every pass and stretch, the first included; plain mode reports `passes` = the number
//! of tokens, `drafted` = `accepted` = 0.

use pie_inferlet::serde_json::{Value, json};
use pie_inferlet::{Context, FinishReason, GenerateOptions, Report, TextStream, emit_json, model};
use serde::Deserialize;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Args {
    prompt: String,
    max_tokens: Option<u32>,
    ngram: Option<u32>,
    draft: Option<u32>,
    #[serde(default)]
    chat: bool,
    #[serde(default)]
    plain: bool,
}

/// What a run made and how much the speculation saved.
#[derive(Default)]
struct Outcome {
    tokens: Vec<u32>,
    passes: u32,
    drafted: u32,
    accepted: u32,
}

/// The settings of one speculative run, checked.
struct Settings {
    max_tokens: usize,
    ngram: usize,
    draft: usize,
    stop_tokens: Vec<u32>,
}

fn settings(args: &Args) -> Result<Settings, String> {
    let max_tokens = args.max_tokens.unwrap_or(128);
    if max_tokens == 0 {
        return Err("max_tokens must be at least 1".into());
    }
    let ngram = args.ngram.unwrap_or(3);
    if !(1..=16).contains(&ngram) {
        return Err(format!("ngram must be between 1 and 16, got {ngram}"));
    }
    let draft = args.draft.unwrap_or(16);
    if draft > 64 {
        return Err(format!("draft must be at most 64, got {draft}"));
    }
    Ok(Settings {
        max_tokens: max_tokens as usize,
        ngram: ngram as usize,
        draft: draft as usize,
        stop_tokens: model::stop_tokens(),
    })
}

/// Up to `max` tokens that followed the most recent earlier occurrence of
/// `history`'s last `ngram` tokens, falling back to shorter n-grams down to
/// 1; empty if none occurred before.
fn lookup(history: &[u32], ngram: usize, max: usize) -> &[u32] {
    if max == 0 {
        return &[];
    }
    for n in (1..=ngram.min(history.len().saturating_sub(1))).rev() {
        let suffix = &history[history.len() - n..];
        // An occurrence starting at `start` ends before the suffix starts
        // or overlaps it, but is always followed by at least one token.
        let found = (0..history.len() - n)
            .rev()
            .find(|&start| &history[start..start + n] == suffix);
        if let Some(start) = found {
            let from = start + n;
            return &history[from..history.len().min(from + max)];
        }
    }
    &[]
}

/// The greedy token of each distribution, in order.
fn greedy_choices(ctx: &Context, tokens: &[u32]) -> Result<Vec<u32>, String> {
    let positions: Vec<u32> = (1..=tokens.len() as u32).collect();
    let positions = if tokens.is_empty() {
        vec![0]
    } else {
        positions
    };
    let dists = ctx.pass(tokens, &positions, Report::Greedy)?;
    if dists.len() != positions.len() {
        return Err(format!(
            "a pass reported {} distributions for {} positions",
            dists.len(),
            positions.len()
        ));
    }
    Ok(dists.iter().map(|d| d.greedy.token).collect())
}

/// How many of `drafts` match `choices` (the greedy choice after `next`
/// and after each draft), in order.
fn accepted_prefix(drafts: &[u32], choices: &[u32]) -> usize {
    drafts
        .iter()
        .zip(choices)
        .take_while(|(d, c)| d == c)
        .count()
}

/// Passes without a draft before a draft length of 0 tries one token again.
const RETRY_AFTER: usize = 8;

/// How many tokens to draft next (see the module doc).
struct DraftLength {
    now: usize,
    max: usize,
    passes_at_zero: usize,
}

impl DraftLength {
    fn new(max: usize) -> Self {
        Self {
            now: max.min(4),
            max,
            passes_at_zero: 0,
        }
    }

    /// After a pass that drafted `drafted` tokens and accepted `accepted`.
    fn update(&mut self, drafted: usize, accepted: usize) {
        if drafted == 0 {
            if self.now == 0 && self.max > 0 {
                self.passes_at_zero += 1;
                if self.passes_at_zero >= RETRY_AFTER {
                    (self.now, self.passes_at_zero) = (1, 0);
                }
            }
        } else if accepted == drafted {
            self.now = (self.now * 2).clamp(1, self.max);
        } else {
            self.now /= 2;
        }
    }
}

/// The most tokens decoded in the engine at once while nothing is drafted.
const STRETCH: usize = 8;

/// What a stretch of plain decoding made.
enum Stretch {
    /// Tokens that end the output (a stop token came after them).
    Ended(Vec<u32>),
    /// Tokens to output, and the next chosen token, held back.
    Goes(Vec<u32>, u32),
}

/// With nothing to verify, up to [`STRETCH`] tokens after `next` decoded in
/// the engine (`generate`: no call into the guest per token, the same
/// greedy tokens); the last is taken off the context again, to go first in
/// the next pass. `remaining` tokens may still be output after `next`.
fn stretch(ctx: &Context, next: u32, remaining: usize, len: &mut u32) -> Result<Stretch, String> {
    ctx.append_tokens(&[next])?;
    let want = (remaining + 1).min(STRETCH) as u32;
    let made = ctx.generate(&GenerateOptions::new().max_tokens(want))?;
    *len += 1 + made.tokens.len() as u32;
    match (made.finish_reason, made.tokens.split_last()) {
        (FinishReason::Length, Some((&held, rest))) => {
            *len -= 1;
            ctx.truncate(*len)?;
            Ok(Stretch::Goes(rest.to_vec(), held))
        }
        _ => Ok(Stretch::Ended(made.tokens)),
    }
}

/// Greedy decoding, verified by passes over prompt-lookup drafts.
fn speculate(ctx: &Context, s: &Settings) -> Result<Outcome, String> {
    // It reads no log-probabilities: spare the engine their log-softmax.
    ctx.report_logprobs(false)?;
    let mut history = ctx.tokens()?;
    let mut len = history.len() as u32;
    let mut out = Outcome::default();
    let mut text = TextStream::new();
    let mut next = greedy_choices(ctx, &[])?[0];
    let mut length = DraftLength::new(s.draft);
    out.passes = 1;
    while !s.stop_tokens.contains(&next) && out.tokens.len() < s.max_tokens {
        out.tokens.push(next);
        history.push(next);
        text.push(&[next])?;
        if out.tokens.len() == s.max_tokens {
            break;
        }
        let budget = length.now.min(s.max_tokens - out.tokens.len());
        // A draft ends before a stop token: were it chosen, it would be
        // `next` and end the output, never an accepted draft.
        let drafts: Vec<u32> = lookup(&history, s.ngram, budget)
            .iter()
            .take_while(|t| !s.stop_tokens.contains(t))
            .copied()
            .collect();
        if drafts.is_empty() && length.now == 0 {
            match stretch(ctx, next, s.max_tokens - out.tokens.len(), &mut len)? {
                Stretch::Ended(tail) => {
                    out.tokens.extend_from_slice(&tail);
                    text.push(&tail)?;
                    out.passes += 1;
                    break;
                }
                Stretch::Goes(made, held) => {
                    out.tokens.extend_from_slice(&made);
                    history.extend_from_slice(&made);
                    text.push(&made)?;
                    next = held;
                }
            }
            length.update(0, 0);
            out.passes += 1;
            continue;
        }
        let mut pass = Vec::with_capacity(drafts.len() + 1);
        pass.push(next);
        pass.extend_from_slice(&drafts);
        let choices = greedy_choices(ctx, &pass)?;
        let accepted = accepted_prefix(&drafts, &choices);
        len += pass.len() as u32;
        if accepted < drafts.len() {
            len -= (drafts.len() - accepted) as u32;
            ctx.truncate(len)?;
        }
        out.tokens.extend_from_slice(&drafts[..accepted]);
        history.extend_from_slice(&drafts[..accepted]);
        text.push(&drafts[..accepted])?;
        next = choices[accepted];
        length.update(drafts.len(), accepted);
        out.passes += 1;
        out.drafted += drafts.len() as u32;
        out.accepted += accepted as u32;
    }
    Ok(out)
}

/// Plain greedy `generate`, streamed.
fn plain(ctx: &Context, s: &Settings) -> Result<Outcome, String> {
    // It reads no log-probabilities: spare the engine their log-softmax.
    ctx.report_logprobs(false)?;
    let options = GenerateOptions::new()
        .max_tokens(s.max_tokens as u32)
        .stream(true);
    let g = ctx.generate(&options)?;
    Ok(Outcome {
        passes: g.tokens.len() as u32,
        tokens: g.tokens,
        drafted: 0,
        accepted: 0,
    })
}

fn report(out: &Outcome) -> Result<Value, String> {
    let acceptance = if out.drafted == 0 {
        Value::Null
    } else {
        json!(out.accepted as f64 / out.drafted as f64)
    };
    Ok(json!({
        "tokens": out.tokens,
        "text": model::decode(&out.tokens)?,
        "passes": out.passes,
        "drafted": out.drafted,
        "accepted": out.accepted,
        "acceptance": acceptance,
    }))
}

fn run() -> Result<(), String> {
    let args: Args = pie_inferlet::args()?;
    let s = settings(&args)?;
    let ctx = Context::with_prompt(&args.prompt, args.chat)?;
    let out = if args.plain {
        plain(&ctx, &s)?
    } else {
        speculate(&ctx, &s)?
    };
    emit_json(&report(&out)?)
}

pie_inferlet::main!(run);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lookup_copies_what_followed_the_most_recent_match() {
        // "1 2 3 9 | 1 2 3 7 8 | 1 2 3": the most recent earlier "1 2 3"
        // was followed by 7 8 1 2 3.
        let h = [1, 2, 3, 9, 1, 2, 3, 7, 8, 1, 2, 3];
        assert_eq!(lookup(&h, 3, 2), &[7, 8]);
        assert_eq!(lookup(&h, 3, 64), &[7, 8, 1, 2, 3]);
        assert_eq!(lookup(&h, 3, 0), &[] as &[u32]);
    }

    #[test]
    fn lookup_falls_back_to_shorter_ngrams() {
        // No earlier "5 6"; the last earlier 6 was followed by 4.
        let h = [6, 4, 5, 6];
        assert_eq!(lookup(&h, 2, 8), &[4, 5, 6]);
        assert_eq!(lookup(&[1, 2, 3], 3, 8), &[] as &[u32]);
        assert_eq!(lookup(&[], 3, 8), &[] as &[u32]);
        assert_eq!(lookup(&[7], 3, 8), &[] as &[u32]);
        // Overlapping: "7 7 7" after "7 7 7 7" is followed by one 7.
        assert_eq!(lookup(&[7, 7, 7, 7], 3, 8), &[7]);
    }

    #[test]
    fn the_draft_length_grows_on_whole_acceptance_and_backs_off_to_zero() {
        let mut length = DraftLength::new(16);
        assert_eq!(length.now, 4);
        length.update(4, 4);
        length.update(8, 8);
        length.update(16, 16);
        assert_eq!(length.now, 16);
        for _ in 0..5 {
            length.update(length.now, 0);
        }
        assert_eq!(length.now, 0);
        for _ in 0..RETRY_AFTER {
            length.update(0, 0);
        }
        assert_eq!(length.now, 1, "tries again after a while");
        let mut never = DraftLength::new(0);
        for _ in 0..2 * RETRY_AFTER {
            never.update(0, 0);
        }
        assert_eq!(never.now, 0);
    }

    #[test]
    fn accepts_the_matching_prefix() {
        assert_eq!(accepted_prefix(&[1, 2, 3], &[1, 2, 4, 5]), 2);
        assert_eq!(accepted_prefix(&[1, 2, 3], &[1, 2, 3, 5]), 3);
        assert_eq!(accepted_prefix(&[1], &[2, 1]), 0);
        assert_eq!(accepted_prefix(&[], &[2]), 0);
    }
}
