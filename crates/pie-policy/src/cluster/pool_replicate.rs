//! `pool-replicate`: `replicate`'s rule with a shared `pie-pool` as the
//! target: a hot prefix whose holders are all busy is pushed to the pool, from
//! which any worker with `[runtime] pool` pulls it before a prefill instead of
//! computing it.
//!
//! Rule, on every tick, hottest prefix first: a prefix crowded as `replicate`
//! defines it (its leading blocks asked for at least `min_hits` times, at
//! least `min_blocks` of them, at least `hot_rps` requests a second, every
//! serving holder at or above `high`) is pushed to the pool
//! (`CopyPrefixToPool`) by its least loaded holder, unless it was pushed less
//! than `retry_ms` ago (the pool publishes no KV events, so the controller
//! cannot see what it holds: the retry window is what keeps the same prefix
//! from being pushed on every tick; a push of pages the pool holds moves only
//! those it lacks). At most `max_per_tick` pushes a tick.
//!
//! Props read: none. Config keys (`[cluster.pool-replicate]`, defaults
//! first): `hot_rps` (1.0, positive), `min_hits` (3, at least 2),
//! `min_blocks` (1), `high` (0.75, positive), `max_per_tick` (4), `retry_ms`
//! (60000; counts at least 1), `dry_run`.
//!
//! Invariant (tested, with a property test): a push names a crowded prefix and
//! a serving source that holds every block it names; the same prefix is not
//! pushed twice within `retry_ms`; no tick asks more than `max_per_tick`.

use std::collections::BTreeMap;

use pie_core::BlockHash;
use serde::{Deserialize, Serialize};
use serde_json::json;

use super::actions::{Action, ClusterActor, ClusterSnapshot, Decision};
use super::replicate::{crowded, crowded_reason, least_loaded};

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PoolReplicateConfig {
    /// Record decisions without executing them (applied by `ActorRunner`).
    pub dry_run: bool,
    /// Requests per second (of the prefix's first block) that make it hot.
    pub hot_rps: f64,
    /// A block is worth pushing once this many routed requests included it.
    pub min_hits: u64,
    /// Shorter hot prefixes are not worth a transfer.
    pub min_blocks: usize,
    /// A holder at or above this level (load over `max_running`) is busy.
    pub high: f64,
    /// Pushes asked per tick, at most.
    pub max_per_tick: usize,
    /// The same prefix is pushed again after this long at the earliest.
    pub retry_ms: u64,
}

impl Default for PoolReplicateConfig {
    fn default() -> Self {
        Self {
            dry_run: false,
            hot_rps: 1.0,
            min_hits: 3,
            min_blocks: 1,
            high: 0.75,
            max_per_tick: 4,
            retry_ms: 60_000,
        }
    }
}

impl PoolReplicateConfig {
    /// An error names the offending key.
    pub fn validate(&self) -> Result<(), String> {
        for (key, value) in [("hot_rps", self.hot_rps), ("high", self.high)] {
            if !(value.is_finite() && value > 0.0) {
                return Err(format!("{key}: {value} must be positive"));
            }
        }
        if self.min_hits < 2 {
            return Err("min_hits: must be at least 2 (a prefix used once is not hot)".into());
        }
        for (key, value) in [
            ("min_blocks", self.min_blocks as u64),
            ("max_per_tick", self.max_per_tick as u64),
            ("retry_ms", self.retry_ms),
        ] {
            if value == 0 {
                return Err(format!("{key}: must be at least 1"));
            }
        }
        Ok(())
    }
}

#[derive(Debug)]
pub struct PoolReplicate {
    config: PoolReplicateConfig,
    /// The pushed prefix's last block -> when it was pushed.
    pushed: BTreeMap<BlockHash, u64>,
}

impl PoolReplicate {
    pub fn new(config: PoolReplicateConfig) -> Self {
        Self {
            config,
            pushed: BTreeMap::new(),
        }
    }

    fn decide(&mut self, now_ms: u64, snapshot: &ClusterSnapshot) -> Vec<Decision> {
        let c = &self.config;
        self.pushed
            .retain(|_, at| now_ms.saturating_sub(*at) < c.retry_ms);
        let mut out = Vec::new();
        for hot in &snapshot.hot_prefixes {
            if out.len() >= c.max_per_tick {
                break;
            }
            let Some((blocks, holders)) = crowded(
                hot,
                &snapshot.workers,
                c.hot_rps,
                c.min_hits,
                c.min_blocks,
                c.high,
            ) else {
                continue;
            };
            let (Some(&last), Some(source)) = (blocks.last(), least_loaded(&holders)) else {
                continue;
            };
            if self.pushed.contains_key(&last) {
                continue;
            }
            self.pushed.insert(last, now_ms);
            out.push(Decision {
                action: Action::CopyPrefixToPool {
                    blocks: blocks.to_vec(),
                    from: source.name.clone(),
                },
                reason: format!(
                    "{}; pushed by {}",
                    crowded_reason(blocks, hot, c.high, &holders),
                    source.name
                ),
            });
        }
        out
    }
}

impl ClusterActor for PoolReplicate {
    fn name(&self) -> &'static str {
        "pool-replicate"
    }

    fn on_tick(&mut self, now_ms: u64, snapshot: &ClusterSnapshot) -> Vec<Decision> {
        self.decide(now_ms, snapshot)
    }

    fn reads_hot_prefixes(&self) -> bool {
        true
    }

    fn summary(&self) -> serde_json::Value {
        json!({"pushed_recently": self.pushed.len(), "hot_rps": self.config.hot_rps})
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::actions::{HotPrefix, WorkerState};
    use crate::cluster::fixtures::{self, holders, worker};
    use proptest::prelude::*;

    fn hot(rate: f64, at: &[(&str, usize)]) -> HotPrefix {
        fixtures::hot(1, &[9, 9, 2], &holders(at), rate)
    }

    fn pushes(d: &[Decision]) -> Vec<(String, usize)> {
        d.iter()
            .map(|d| match &d.action {
                Action::CopyPrefixToPool { blocks, from } => (from.clone(), blocks.len()),
                other => panic!("{other:?}"),
            })
            .collect()
    }

    #[test]
    fn a_crowded_prefix_is_pushed_once_per_retry_by_its_least_loaded_holder() {
        let mut actor = PoolReplicate::new(PoolReplicateConfig::default());
        let snapshot = ClusterSnapshot {
            workers: vec![worker("a", 4), worker("b", 3), worker("c", 0)],
            hot_prefixes: vec![hot(5.0, &[("a", 3), ("b", 2), ("c", 1)])],
            ..ClusterSnapshot::default()
        };
        assert_eq!(
            pushes(&actor.on_tick(0, &snapshot)),
            vec![("b".into(), 2)],
            "the two blocks asked for 9 times; b holds them and is less loaded than a"
        );
        assert!(actor.on_tick(59_999, &snapshot).is_empty());
        assert_eq!(pushes(&actor.on_tick(60_000, &snapshot)).len(), 1);
    }

    #[test]
    fn a_prefix_with_an_idle_holder_or_a_slow_rate_is_not_pushed() {
        let mut actor = PoolReplicate::new(PoolReplicateConfig::default());
        let snap = |rate: f64, b_load: usize| ClusterSnapshot {
            workers: vec![worker("a", 4), worker("b", b_load)],
            hot_prefixes: vec![hot(rate, &[("a", 3), ("b", 3)])],
            ..ClusterSnapshot::default()
        };
        assert!(actor.on_tick(0, &snap(5.0, 1)).is_empty(), "b has room");
        assert!(actor.on_tick(0, &snap(0.5, 4)).is_empty(), "not hot");
        assert_eq!(pushes(&actor.on_tick(0, &snap(5.0, 4))).len(), 1);
    }

    #[test]
    fn config_errors_name_the_key() {
        let bad = |c: PoolReplicateConfig| c.validate().unwrap_err();
        assert!(bad(PoolReplicateConfig {
            high: 0.0,
            ..Default::default()
        })
        .starts_with("high"));
        assert!(bad(PoolReplicateConfig {
            retry_ms: 0,
            ..Default::default()
        })
        .starts_with("retry_ms"));
    }

    proptest! {
        #[test]
        fn pushes_name_crowded_prefixes_held_by_their_source(
            loads in proptest::collection::vec((0usize..6, any::<bool>()), 1..6),
            prefixes in proptest::collection::vec(
                (0.0f64..4.0, proptest::collection::vec((0usize..6, 0usize..4), 0..5)),
                1..5,
            ),
            max_per_tick in 1usize..4,
        ) {
            let workers: Vec<WorkerState> = loads
                .iter()
                .enumerate()
                .map(|(i, &(load, healthy))| WorkerState { healthy, ..worker(&format!("w{i}"), load) })
                .collect();
            let hot_prefixes: Vec<HotPrefix> = prefixes
                .iter()
                .enumerate()
                .map(|(i, (rate, at))| fixtures::generated_hot(i, *rate, at, loads.len()))
                .collect();
            let snapshot = ClusterSnapshot { workers, hot_prefixes, ..ClusterSnapshot::default() };
            let config = PoolReplicateConfig { max_per_tick, ..Default::default() };
            let mut actor = PoolReplicate::new(config.clone());
            let out = actor.on_tick(0, &snapshot);
            prop_assert!(out.len() <= max_per_tick);
            for d in &out {
                let Action::CopyPrefixToPool { blocks, from } = &d.action else { unreachable!() };
                let hot = snapshot.hot_prefixes.iter().find(|p| p.blocks.starts_with(blocks)).unwrap();
                prop_assert!(hot.requests_per_s >= config.hot_rps);
                let source = snapshot.workers.iter().find(|w| &w.name == from).unwrap();
                prop_assert!(source.serving() && hot.held_by(from) >= blocks.len());
                for w in snapshot.workers.iter().filter(|w| w.serving() && hot.held_by(&w.name) >= blocks.len()) {
                    prop_assert!(w.load_level().unwrap() >= config.high);
                }
            }
            prop_assert!(actor.on_tick(1, &snapshot).is_empty() || out.len() == max_per_tick);
        }
    }
}
