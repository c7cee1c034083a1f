//! `cache-aware`: route to the worker holding the longest prefix of the prompt,
//! unless the load is too uneven.
//!
//! Rule (as SGLang's router): when the candidates' loads are imbalanced, that is
//! `max - min > balance_abs` and `max > balance_rel * min`, load wins and the
//! least-loaded worker goes first. Otherwise the worker with the longest prefix
//! cached or anticipated (routed there and not yet confirmed, see
//! `PendingBlocks`) goes first, a tie going to the one that holds more of it,
//! then to the least loaded; a cold prompt (no such prefix anywhere) goes to
//! the least loaded, rotating among equally loaded workers. A worker with a
//! shared page pool counts the prompt's prefix the pool holds at
//! `pool_weight` of its length (pulling pages costs a transfer, less than a
//! prefill, more than nothing), so a prompt only the pool holds is not cold
//! and goes to a worker that can pull it. Props read: none. Config keys:
//! `[cluster.cache-aware] balance_abs` (default 8), `balance_rel` (default
//! 1.5), `anticipate_ms` (default 30000: how long a routed prompt's blocks
//! count as pending on its worker; 0: never), `pool_weight` (default 0.8, in
//! [0, 1); 0: pool hits count for nothing). Invariant (tested): balanced load
//! -> longest prefix first; imbalanced -> least loaded first; cold -> least
//! loaded; an anticipated prefix never beats the same prefix held, nor a
//! pooled one the same prefix held.

use serde::{Deserialize, Serialize};

use super::{ClusterPolicy, Reject, RouteRequest, WorkerView};

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CacheAwareConfig {
    pub balance_abs: usize,
    pub balance_rel: f64,
    /// How long a routed prompt's blocks count as pending on its worker.
    pub anticipate_ms: u64,
    /// What a prefix token in the shared pool is worth against one held.
    pub pool_weight: f64,
}

impl Default for CacheAwareConfig {
    fn default() -> Self {
        Self {
            balance_abs: 8,
            balance_rel: 1.5,
            anticipate_ms: 30_000,
            pool_weight: 0.8,
        }
    }
}

impl CacheAwareConfig {
    /// An error names the offending key.
    pub fn validate(&self) -> Result<(), String> {
        if !(0.0..1.0).contains(&self.pool_weight) {
            return Err(format!(
                "pool_weight: {} is not in [0, 1) (a pooled prefix must weigh less than one held)",
                self.pool_weight
            ));
        }
        Ok(())
    }
}

/// Prefix tokens a worker holds or will hold (never fewer than it holds).
fn anticipated(w: &WorkerView) -> usize {
    w.anticipated_prefix_tokens.max(w.cached_prefix_tokens)
}

impl CacheAware {
    /// What the worker's prefix is worth: held or anticipated tokens, or its
    /// pool's at `pool_weight`, whichever is more.
    fn worth(&self, w: &WorkerView) -> usize {
        let pooled = (w.pool_prefix_tokens as f64 * self.config.pool_weight) as usize;
        anticipated(w).max(pooled)
    }
}

/// Moves the candidate with the least `key` to the front. Only the first
/// candidate is read after a policy decides (a later policy sorts or filters
/// by its own unique key or a name), so a pass finding the minimum decides as
/// a full sort did, in O(n) instead of O(n log n) over a shortlist of
/// hundreds of prefix holders.
fn least_first<K: Ord>(candidates: &mut [usize], key: impl Fn(usize) -> K) {
    let best = (0..candidates.len()).min_by_key(|&at| key(candidates[at]));
    if let Some(at) = best {
        candidates.swap(0, at);
    }
}

#[derive(Debug, Default)]
pub struct CacheAware {
    config: CacheAwareConfig,
    /// Rotates among equally loaded workers for cold prompts, so new prefixes
    /// spread over the cluster's caches instead of piling onto the first worker.
    next_cold: usize,
}

impl CacheAware {
    pub fn new(config: CacheAwareConfig) -> Self {
        Self {
            config,
            next_cold: 0,
        }
    }

    /// A cold prompt's turn: among the candidates at load `min`, the first
    /// worker at or after `next_cold` (by index), else the first one; moved
    /// to the front and returned. Rotates over workers, not over places in
    /// the tie set: the set changes between decisions (a load counted until
    /// the next poll), and a place-based turn could skip a worker for good.
    fn rotate_cold(&self, workers: &[WorkerView], candidates: &mut [usize], min: usize) -> usize {
        let next = self.next_cold;
        least_first(candidates, |i| (workers[i].load != min, i < next, i));
        candidates[0]
    }
}

impl ClusterPolicy for CacheAware {
    fn name(&self) -> &'static str {
        "cache-aware"
    }

    fn route(
        &mut self,
        _now_ms: u64,
        req: &RouteRequest,
        workers: &[WorkerView],
        candidates: &mut Vec<usize>,
    ) -> Result<Option<String>, Reject> {
        let loads = candidates.iter().map(|&i| workers[i].load);
        let (min, max) = (loads.clone().min().unwrap_or(0), loads.max().unwrap_or(0));
        let imbalanced = max - min > self.config.balance_abs
            && max as f64 > self.config.balance_rel * min as f64;
        let best_cached = candidates
            .iter()
            .map(|&i| self.worth(&workers[i]))
            .max()
            .unwrap_or(0);
        if imbalanced || best_cached == 0 {
            if imbalanced {
                least_first(candidates, |i| (workers[i].load, i));
            } else {
                self.next_cold = self.rotate_cold(workers, candidates, min) + 1;
            }
            let w = &workers[candidates[0]];
            let why = if imbalanced {
                format!("load imbalance {min}..{max}, least loaded {}", w.name)
            } else {
                format!("cold prompt, least loaded {}", w.name)
            };
            return Ok(Some(why));
        }
        least_first(candidates, |i| {
            (
                std::cmp::Reverse(self.worth(&workers[i])),
                std::cmp::Reverse(workers[i].cached_prefix_tokens),
                workers[i].load,
                i,
            )
        });
        let w = &workers[candidates[0]];
        let pending = anticipated(w) - w.cached_prefix_tokens;
        Ok(Some(if self.worth(w) > anticipated(w) {
            format!(
                "{}/{} prefix tokens in the pool for {} ({} on it)",
                w.pool_prefix_tokens,
                req.prompt_tokens,
                w.name,
                anticipated(w)
            )
        } else if pending > 0 {
            format!(
                "{}/{} prefix tokens on {} ({pending} of them pending)",
                anticipated(w),
                req.prompt_tokens,
                w.name
            )
        } else {
            format!(
                "{}/{} prefix tokens on {}",
                w.cached_prefix_tokens, req.prompt_tokens, w.name
            )
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::views;
    use pie_core::Props;

    fn first(loads: &[usize], cached: &[usize]) -> (usize, String) {
        let w = views(loads, cached);
        let mut c: Vec<usize> = (0..w.len()).collect();
        let why = CacheAware::default()
            .route(
                0,
                &RouteRequest {
                    props: &Props::new(),
                    prompt_tokens: 512,
                },
                &w,
                &mut c,
            )
            .unwrap()
            .unwrap();
        (c[0], why)
    }

    #[test]
    fn prefix_load_and_cold_rules() {
        assert_eq!(
            first(&[2, 3, 2], &[0, 480, 16]),
            (1, "480/512 prefix tokens on w1".into())
        );
        // 20 vs 2: imbalanced (diff 18 > 8, 20 > 1.5 * 2), load wins.
        assert_eq!(first(&[2, 20, 4], &[0, 480, 16]).0, 0);
        assert_eq!(
            first(&[5, 1, 3], &[0, 0, 0]),
            (1, "cold prompt, least loaded w1".into())
        );
        // Equal prefixes: the less loaded one.
        assert_eq!(first(&[4, 2], &[64, 64]).0, 1);
    }

    #[test]
    fn cold_prompts_take_turns_over_workers_even_as_the_tie_set_changes() {
        // The last pick still counts one load until the next poll.
        let mut policy = CacheAware::default();
        let props = Props::new();
        let req = RouteRequest {
            props: &props,
            prompt_tokens: 64,
        };
        let picks: Vec<usize> = [[0, 0, 0], [1, 0, 0], [0, 1, 0], [0, 0, 1]]
            .iter()
            .map(|loads| {
                let w = views(loads, &[0, 0, 0]);
                let mut c: Vec<usize> = (0..3).collect();
                policy.route(0, &req, &w, &mut c).unwrap();
                c[0]
            })
            .collect();
        assert_eq!(
            picks,
            [0, 1, 2, 0],
            "every worker gets a new prefix in turn"
        );
    }

    /// A 512-token prompt routed by a default cache-aware over every worker:
    /// the first candidate and why.
    fn route(w: &[WorkerView]) -> (usize, String) {
        let mut c: Vec<usize> = (0..w.len()).collect();
        let props = Props::new();
        let req = RouteRequest {
            props: &props,
            prompt_tokens: 512,
        };
        let why = CacheAware::default().route(0, &req, w, &mut c).unwrap();
        (c[0], why.unwrap())
    }

    #[test]
    fn an_anticipated_prefix_attracts_its_group_but_never_beats_it_held() {
        // w1 will hold 480 tokens (a request of the group went there): not cold.
        let mut w = views(&[2, 3, 2], &[0, 0, 16]);
        w[1].anticipated_prefix_tokens = 480;
        assert_eq!(
            route(&w),
            (
                1,
                "480/512 prefix tokens on w1 (480 of them pending)".into()
            )
        );
        // w2 holds the same 480: held beats pending, whatever the load.
        w[2].cached_prefix_tokens = 480;
        w[2].load = 4;
        assert_eq!(route(&w).0, 2);
    }

    #[test]
    fn a_pooled_prefix_beats_a_shorter_held_one_and_cold_but_never_the_same_held() {
        // Only the pool holds the prompt: w2 can pull it, w0 and w1 cannot.
        let mut w = views(&[0, 0, 1], &[0, 0, 0]);
        w[2].pool_prefix_tokens = 480;
        assert_eq!(
            route(&w),
            (
                2,
                "480/512 prefix tokens in the pool for w2 (0 on it)".into()
            )
        );
        // w0 holds 64 of it: 480 pooled (worth 384) still wins.
        w[0].cached_prefix_tokens = 64;
        assert_eq!(route(&w).0, 2);
        // w1 holds all 480: held beats pooled.
        w[1].cached_prefix_tokens = 480;
        assert_eq!(route(&w).0, 1);
        let zero = CacheAwareConfig {
            pool_weight: 0.0,
            ..CacheAwareConfig::default()
        };
        assert!(zero.validate().is_ok());
        let one = CacheAwareConfig {
            pool_weight: 1.0,
            ..CacheAwareConfig::default()
        };
        assert!(one.validate().unwrap_err().starts_with("pool_weight"));
    }
}
