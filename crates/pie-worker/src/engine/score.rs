//! A pass's reports: the model's own next-token distribution after chosen
//! prompt positions ([`Score`], an inferlet's verification pass), read from
//! the rows the step's forward returns for them. A leaf.
//!
//! Invariant: a reported row's logits are the bits decoding the same tokens
//! one a step would give (each matmul and attention row is computed alike
//! whatever shares its step), so a greedy report equals greedy decoding.

use pie_model::sampling::argmax;
use pie_model::{log_sum_exp, logprobs};

/// Which prompt positions a sequence reports, and how much of each.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Score {
    /// Prompt positions, ascending and distinct, each below the prompt's
    /// length: the distribution after each is reported.
    pub positions: Vec<usize>,
    /// The most likely tokens reported with each (0: the greedy choice only).
    pub top: usize,
    /// Every token's log-probability too.
    pub full: bool,
}

/// The distribution after one position.
#[derive(Clone, Debug, PartialEq)]
pub struct Scored {
    pub position: usize,
    /// The most likely token and its log-probability.
    pub greedy: (u32, f32),
    /// The `top` most likely, most likely first (ties: lower id).
    pub top: Vec<(u32, f32)>,
    /// Every token's log-probability, by id, where `full` was asked.
    pub full: Vec<f32>,
}

impl Score {
    /// The first position whose row the forward must return.
    pub fn first(&self) -> Option<usize> {
        self.positions.first().copied()
    }

    /// The report for `position`'s row, if it is asked for.
    pub fn report(&self, position: usize, row: &[f32]) -> Option<Scored> {
        self.positions.binary_search(&position).ok()?;
        let greedy = argmax(row);
        let lp = logprobs(row, greedy, self.top);
        let full = match self.full {
            true => {
                let log_sum = log_sum_exp(row);
                row.iter().map(|l| l - log_sum).collect()
            }
            false => Vec::new(),
        };
        Some(Scored {
            position,
            greedy: (greedy, lp.logprob),
            top: lp.top,
            full,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_asked_positions_are_reported_with_what_was_asked() {
        let score = Score {
            positions: vec![2, 4],
            top: 2,
            full: true,
        };
        let row = [0.0, 3.0, 1.0, 3.0];
        assert_eq!(score.report(3, &row), None);
        let scored = score.report(4, &row).unwrap();
        assert_eq!(scored.greedy.0, 1, "ties go to the lower id");
        assert_eq!(scored.top.iter().map(|t| t.0).collect::<Vec<_>>(), [1, 3]);
        let total: f32 = scored.full.iter().map(|l| l.exp()).sum();
        assert!((total - 1.0).abs() < 1e-5);
        assert_eq!(scored.full[1], scored.greedy.1);
    }
}
