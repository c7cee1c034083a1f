//! Which tokens a generation may sample: an allowed set (none: any) and a
//! banned set, applied to the logits after the penalties and biases, before
//! greedy choice or a draw (an inferlet's `steering.set-token-sets`).
//!
//! Invariant: a token outside `allowed` or inside `banned` is never
//! sampled; its logit is minus infinity.

use serde::{Deserialize, Serialize};

/// The most ids one set may list.
pub const MAX_TOKEN_SET: usize = 8192;

/// Sorted, deduplicated ids.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct TokenSets {
    pub allowed: Option<Vec<u32>>,
    pub banned: Vec<u32>,
}

impl TokenSets {
    /// The sets, each at most [`MAX_TOKEN_SET`] ids and `allowed` not empty
    /// (that the ids are in the vocabulary, `SamplingRequest::check` checks).
    pub fn new(allowed: Option<Vec<u32>>, banned: Vec<u32>) -> Result<Self, String> {
        let set = |what: &str, mut ids: Vec<u32>| -> Result<Vec<u32>, String> {
            if ids.len() > MAX_TOKEN_SET {
                return Err(format!(
                    "{what} lists {} ids; at most {MAX_TOKEN_SET}",
                    ids.len()
                ));
            }
            ids.sort_unstable();
            ids.dedup();
            Ok(ids)
        };
        let allowed = match allowed {
            Some(ids) if ids.is_empty() => {
                return Err("allowed is empty: no token could be sampled".into())
            }
            Some(ids) => Some(set("allowed", ids)?),
            None => None,
        };
        Ok(Self {
            allowed,
            banned: set("banned", banned)?,
        })
    }

    pub fn is_empty(&self) -> bool {
        self.allowed.is_none() && self.banned.is_empty()
    }

    /// Bytes the sets keep.
    pub fn bytes(&self) -> usize {
        (self.allowed.as_ref().map_or(0, |a| a.len()) + self.banned.len()) * 4
    }

    /// Every id of both sets.
    pub fn ids(&self) -> impl Iterator<Item = u32> + '_ {
        let allowed = self.allowed.iter().flatten();
        allowed.chain(self.banned.iter()).copied()
    }

    /// Every token outside `allowed` or in `banned` to minus infinity.
    pub fn apply(&self, logits: &mut [f32]) {
        if let Some(allowed) = &self.allowed {
            let mut next = allowed.iter().peekable();
            for (id, logit) in logits.iter_mut().enumerate() {
                if next.peek() == Some(&&(id as u32)) {
                    next.next();
                } else {
                    *logit = f32::NEG_INFINITY;
                }
            }
        }
        for &t in self.banned.iter() {
            if let Some(l) = logits.get_mut(t as usize) {
                *l = f32::NEG_INFINITY;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_allowed_tokens_not_banned_keep_their_logits() {
        let sets = TokenSets::new(Some(vec![4, 1, 4, 2]), vec![2]).unwrap();
        let mut logits = vec![1.0; 6];
        sets.apply(&mut logits);
        let kept: Vec<usize> = (0..6).filter(|&i| logits[i].is_finite()).collect();
        assert_eq!(kept, [1, 4]);
        assert_eq!(sets.bytes(), 16);
    }

    #[test]
    fn bad_sets_are_errors_naming_them() {
        assert!(TokenSets::new(Some(vec![]), vec![])
            .unwrap_err()
            .contains("allowed is empty"));
        let many = vec![0; MAX_TOKEN_SET + 1];
        assert!(TokenSets::new(Some(many), vec![])
            .unwrap_err()
            .contains("at most"));
        assert!(TokenSets::new(None, vec![]).unwrap().is_empty());
    }
}
