//! `/v1/completions`' `best_of` and `echo`. `best_of` candidates are
//! generated as `n` choices are (a process each, seed + its index, in the
//! same engine steps) and the `n` with the highest log-probability per token
//! are returned, as OpenAI defines it; every candidate's tokens count in
//! `usage`; it cannot be streamed above `n`. `echo` puts the prompt's text
//! before each choice's (as the first chunk of a stream); with `logprobs` it
//! is refused, since prompt tokens are not scored.

use pie_model::Model;

use super::state::ApiError;
use crate::runtime::{Inferlet, Prompt};

/// The completion route's `best_of` and `echo`, as asked.
#[derive(Clone, Copy, Default)]
pub(super) struct CompletionExtras {
    pub best_of: Option<usize>,
    pub echo: bool,
}

/// How many candidates to generate for `n` choices.
pub(super) fn candidates(
    best_of: Option<usize>,
    n: usize,
    stream: bool,
    max: usize,
) -> Result<usize, ApiError> {
    let Some(best_of) = best_of else {
        return Ok(n);
    };
    let bad = |why: String| Err(ApiError::bad_request(why).param("best_of"));
    if !(n..=max).contains(&best_of) {
        return bad(format!("best_of must be n ({n}) to {max}, got {best_of}"));
    }
    if stream && best_of > n {
        return bad("best_of above n cannot be streamed (the best are known at the end)".into());
    }
    Ok(best_of)
}

/// The indices of the `n` candidates with the highest mean log-probability
/// per token (`scores[i]`: candidate i's tokens' logprobs), best first; ties
/// keep the earlier candidate.
pub(super) fn best(scores: &[Vec<f32>], n: usize) -> Vec<usize> {
    let mean = |s: &Vec<f32>| match s.len() {
        0 => f64::NEG_INFINITY,
        len => s.iter().map(|&l| f64::from(l)).sum::<f64>() / len as f64,
    };
    let mut order: Vec<usize> = (0..scores.len()).collect();
    order.sort_by(|&a, &b| mean(&scores[b]).total_cmp(&mean(&scores[a])));
    order.truncate(n);
    order
}

/// The prompt's text to echo, if `echo` was asked (None for chat).
pub(super) fn echo_text(
    model: &Model,
    inferlet: &Inferlet,
    extras: CompletionExtras,
    logprobs: Option<usize>,
) -> Result<Option<String>, ApiError> {
    let Inferlet::TextCompletion { prompt } = inferlet else {
        return Ok(None);
    };
    if !extras.echo {
        return Ok(None);
    }
    if logprobs.is_some() {
        return Err(ApiError::bad_request(
            "echo with logprobs is not supported: the prompt's tokens are not scored",
        )
        .param("echo"));
    }
    match prompt {
        Prompt::Text(text) => Ok(Some(text.clone())),
        Prompt::Tokens(ids) => (model.tokenizer.decode(ids))
            .map(Some)
            .map_err(|e| ApiError::bad_request(format!("prompt: {e}")).param("prompt")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_best_are_the_highest_means_per_token() {
        let scores = vec![vec![-1.0, -1.0], vec![-0.1], vec![-0.5, -0.5, -0.5], vec![]];
        assert_eq!(best(&scores, 2), [1, 2]);
        assert_eq!(best(&scores, 4), [1, 2, 0, 3]);
        assert_eq!(
            best(&[vec![-1.0], vec![-1.0]], 1),
            [0],
            "ties keep the earlier"
        );
    }

    #[test]
    fn best_of_is_n_to_the_limit_and_not_streamed_above_n() {
        assert_eq!(candidates(None, 2, true, 16).unwrap(), 2);
        assert_eq!(candidates(Some(4), 2, false, 16).unwrap(), 4);
        assert_eq!(candidates(Some(2), 2, true, 16).unwrap(), 2);
        for (best_of, stream) in [(1, false), (17, false), (3, true)] {
            let e = candidates(Some(best_of), 2, stream, 16).unwrap_err();
            assert_eq!(e.param.as_deref(), Some("best_of"));
        }
    }
}
