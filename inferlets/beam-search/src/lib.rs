//! `beam-search`: beam search of width `width` for `length` tokens, scoring
//! a sequence by the sum of its tokens' log-probabilities. End-of-turn
//! tokens are ordinary tokens here: every beam runs `length` tokens.
//!
//! A beam is a context holding the prompt and its tokens but the last (its
//! pending token). Each step runs one pass per beam that appends the pending
//! token and reports what follows it (the first step: a pass with no tokens
//! over the prompt); each beam's candidates are its parent's score plus each
//! next token's log-probability; the `width` best candidates of all beams
//! (ties: the lower beam index, then the lower token id) become the new
//! beams, forks of their parents, and the old contexts are dropped.
//!
//! Two modes, which give the same output:
//! - `"concurrent"` (default): every beam's pass starts at once, reporting
//!   the top `width` tokens (`top-k`), and the step waits for all of them:
//!   the engine computes them in the same steps.
//! - `"reference"`: one beam's pass at a time, each reporting every token's
//!   log-probability (`full`); the program picks each beam's `width` best
//!   itself.
//!
//! Args (any other key is an error): `{"prompt": string, "width"?: int
//! (default 4, 1 to 16), "length"?: int (default 16, 1 to 512), "chat"?:
//! bool (default false: true applies the chat template to one user
//! message), "mode"?: "concurrent" | "reference"}`.
//!
//! Emits one JSON event `{"beams": [{"tokens": [ids], "text": string,
//! "score": number}], "passes": n}`, the beams best first (`width` of them,
//! fewer only if the vocabulary is smaller), `passes` the passes run.

use std::cmp::Ordering;

use pie_inferlet::serde_json::{Value, json};
use pie_inferlet::{
    Context, Distribution, Pending, Report, TokenLogprob, emit_json, model, wait_all,
};
use serde::Deserialize;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Args {
    prompt: String,
    width: Option<u32>,
    length: Option<u32>,
    #[serde(default)]
    chat: bool,
    #[serde(default)]
    mode: Mode,
}

#[derive(Deserialize, Default, Clone, Copy, PartialEq)]
#[serde(rename_all = "lowercase")]
enum Mode {
    #[default]
    Concurrent,
    Reference,
}

/// A sequence being searched: its context holds all of `tokens` but the
/// last, `pending` (none only before the first step).
struct Beam {
    ctx: Context,
    tokens: Vec<u32>,
    score: f64,
    pending: Option<u32>,
}

/// A finished sequence and its score.
struct Sequence {
    tokens: Vec<u32>,
    score: f64,
}

/// One possible extension of a beam.
#[derive(Debug, Clone, PartialEq)]
struct Candidate {
    parent: usize,
    token: u32,
    score: f64,
}

/// The search's order: higher score first, then the lower beam index, then
/// the lower token id.
fn by_rank(a: &Candidate, b: &Candidate) -> Ordering {
    b.score
        .total_cmp(&a.score)
        .then(a.parent.cmp(&b.parent))
        .then(a.token.cmp(&b.token))
}

/// The `width` best candidates, best first.
fn select(mut candidates: Vec<Candidate>, width: usize) -> Vec<Candidate> {
    candidates.sort_by(by_rank);
    candidates.truncate(width);
    candidates
}

/// Likelier first, then the lower token id.
fn by_likelihood(a: &TokenLogprob, b: &TokenLogprob) -> Ordering {
    b.logprob.total_cmp(&a.logprob).then(a.token.cmp(&b.token))
}

/// The `width` likeliest tokens of a full distribution (log-probabilities
/// by id), likelier first, ties to the lower id.
fn best_of_full(full: &[f32], width: usize) -> Vec<TokenLogprob> {
    let mut all: Vec<TokenLogprob> = (full.iter().enumerate())
        .map(|(token, &logprob)| TokenLogprob {
            token: token as u32,
            logprob,
        })
        .collect();
    let width = width.min(all.len());
    if width == 0 {
        return Vec::new();
    }
    all.select_nth_unstable_by(width - 1, by_likelihood);
    all.truncate(width);
    all.sort_by(by_likelihood);
    all
}

/// The one distribution a beam's pass reports.
fn single(dists: Vec<Distribution>) -> Result<Distribution, String> {
    let n = dists.len();
    let mut dists = dists.into_iter();
    match (dists.next(), dists.next()) {
        (Some(d), None) => Ok(d),
        _ => Err(format!("a pass at one position reported {n} distributions")),
    }
}

/// The pass that appends `beam`'s pending token and reports what follows.
fn start(beam: &Beam, report: Report) -> Result<Pending<'_, Vec<Distribution>>, String> {
    let tokens: Vec<u32> = beam.pending.into_iter().collect();
    beam.ctx.start_pass(&tokens, &[tokens.len() as u32], report)
}

/// Each beam's `width` likeliest next tokens: all passes at once, top-k.
fn expand_concurrent(beams: &[Beam], width: usize) -> Result<Vec<Vec<TokenLogprob>>, String> {
    let pending = beams
        .iter()
        .map(|b| start(b, Report::TopK(width as u32)))
        .collect::<Result<Vec<_>, String>>()?;
    wait_all(pending)
        .into_iter()
        .map(|r| {
            let mut top = single(r?)?.top;
            top.sort_by(by_likelihood);
            top.truncate(width);
            Ok(top)
        })
        .collect()
}

/// The same, one beam at a time, chosen from full distributions.
fn expand_reference(beams: &[Beam], width: usize) -> Result<Vec<Vec<TokenLogprob>>, String> {
    beams
        .iter()
        .map(|b| {
            let d = single(start(b, Report::Full)?.wait()?)?;
            Ok(best_of_full(&d.full, width))
        })
        .collect()
}

/// Every beam's extensions by its next tokens.
fn candidates(beams: &[Beam], next: &[Vec<TokenLogprob>]) -> Vec<Candidate> {
    let mut all = Vec::new();
    for (parent, (beam, tops)) in beams.iter().zip(next).enumerate() {
        for t in tops {
            all.push(Candidate {
                parent,
                token: t.token,
                score: beam.score + t.logprob as f64,
            });
        }
    }
    all
}

/// The chosen candidates' sequences (the search's end).
fn finish(beams: &[Beam], chosen: &[Candidate]) -> Vec<Sequence> {
    chosen
        .iter()
        .map(|c| {
            let mut tokens = beams[c.parent].tokens.clone();
            tokens.push(c.token);
            Sequence {
                tokens,
                score: c.score,
            }
        })
        .collect()
}

/// The chosen candidates as beams: forks of their parents.
fn advance(beams: &[Beam], chosen: &[Candidate]) -> Result<Vec<Beam>, String> {
    let sequences = finish(beams, chosen);
    chosen
        .iter()
        .zip(sequences)
        .map(|(c, s)| {
            Ok(Beam {
                ctx: beams[c.parent].ctx.fork()?,
                tokens: s.tokens,
                score: s.score,
                pending: Some(c.token),
            })
        })
        .collect()
}

/// The search: the final sequences, best first, and the passes run.
fn search(
    prompt: Context,
    width: usize,
    length: u32,
    mode: Mode,
) -> Result<(Vec<Sequence>, u32), String> {
    let mut beams = vec![Beam {
        ctx: prompt,
        tokens: Vec::new(),
        score: 0.0,
        pending: None,
    }];
    let mut passes = 0;
    for step in 1..=length {
        let next = match mode {
            Mode::Concurrent => expand_concurrent(&beams, width)?,
            Mode::Reference => expand_reference(&beams, width)?,
        };
        passes += beams.len() as u32;
        let chosen = select(candidates(&beams, &next), width);
        if chosen.is_empty() {
            return Err("a pass reported no candidates".into());
        }
        if step == length {
            return Ok((finish(&beams, &chosen), passes));
        }
        // The old beams' contexts are dropped here, after the forks.
        beams = advance(&beams, &chosen)?;
    }
    Ok((Vec::new(), passes))
}

fn report(beams: &[Sequence], passes: u32) -> Result<Value, String> {
    let beams = beams
        .iter()
        .map(|s| {
            let text = model::decode(&s.tokens)?;
            Ok(json!({"tokens": s.tokens, "text": text, "score": s.score}))
        })
        .collect::<Result<Vec<Value>, String>>()?;
    Ok(json!({"beams": beams, "passes": passes}))
}

fn run() -> Result<(), String> {
    let args: Args = pie_inferlet::args()?;
    let width = args.width.unwrap_or(4);
    if !(1..=16).contains(&width) {
        return Err(format!("width must be between 1 and 16, got {width}"));
    }
    let length = args.length.unwrap_or(16);
    if !(1..=512).contains(&length) {
        return Err(format!("length must be between 1 and 512, got {length}"));
    }
    let prompt = Context::with_prompt(&args.prompt, args.chat)?;
    let (beams, passes) = search(prompt, width as usize, length, args.mode)?;
    emit_json(&report(&beams, passes)?)
}

pie_inferlet::main!(run);

#[cfg(test)]
mod tests {
    use super::*;

    fn c(parent: usize, token: u32, score: f64) -> Candidate {
        Candidate {
            parent,
            token,
            score,
        }
    }

    #[test]
    fn select_ranks_by_score_then_beam_then_token() {
        let all = vec![
            c(1, 5, -1.0),
            c(0, 9, -1.0),
            c(0, 3, -1.0),
            c(2, 0, -0.5),
            c(1, 1, -3.0),
        ];
        let chosen = select(all, 3);
        assert_eq!(chosen, vec![c(2, 0, -0.5), c(0, 3, -1.0), c(0, 9, -1.0)]);
    }

    #[test]
    fn best_of_full_takes_the_likeliest_ties_to_lower_ids() {
        let full = [-3.0, -1.0, -2.0, -1.0, -5.0];
        let best: Vec<u32> = best_of_full(&full, 3).iter().map(|t| t.token).collect();
        assert_eq!(best, vec![1, 3, 2]);
        assert_eq!(best_of_full(&full, 9).len(), 5);
        assert!(best_of_full(&[], 2).is_empty());
    }
}
