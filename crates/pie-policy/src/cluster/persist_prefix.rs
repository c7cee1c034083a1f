//! `persist-prefix`: hot prefixes written to their holders' disks, so they
//! outlive a restart (or a crash) of the worker.
//!
//! Rule: on every tick, for each hot prefix of the snapshot, the leading
//! blocks asked for at least `min_hits` times (at least `min_blocks` of
//! them) are the prefix to keep. Each serving worker that holds all of those
//! blocks but has fewer of them on disk is asked to persist them
//! (`PersistPrefix`), unless it was asked for the same prefix less than
//! `retry_ms` ago; at most `max_per_tick` asks per tick, hottest prefix first.
//! A worker without a disk tier answers that it cannot, and the controller
//! records the action as failed.
//!
//! Props read: none here (a process's `persist = true` is acted on by its
//! worker directly). Config keys (`[cluster.persist-prefix]`): `min_hits`
//! (3, >= 2), `min_blocks` (1, >= 1), `max_per_tick` (8, >= 1), `retry_ms`
//! (30000, > 0), `dry_run`.
//!
//! Invariant (tested): an ask names a serving worker that holds every
//! block it names, each block asked for at least `min_hits` times, a prefix
//! not already on that worker's disk, and the same (worker, prefix) is not
//! asked twice within `retry_ms`.

use std::collections::BTreeMap;

use pie_core::BlockHash;
use serde::{Deserialize, Serialize};
use serde_json::json;

use super::actions::{Action, ClusterActor, ClusterSnapshot, Decision};

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PersistPrefixConfig {
    /// Record decisions without executing them (applied by `ActorRunner`).
    pub dry_run: bool,
    /// A block is hot once this many routed requests included it.
    pub min_hits: u64,
    /// Shorter hot prefixes are not worth a file.
    pub min_blocks: usize,
    /// Asks per tick, at most.
    pub max_per_tick: usize,
    /// The same worker is asked for the same prefix again after this long.
    pub retry_ms: u64,
}

impl Default for PersistPrefixConfig {
    fn default() -> Self {
        Self {
            dry_run: false,
            min_hits: 3,
            min_blocks: 1,
            max_per_tick: 8,
            retry_ms: 30_000,
        }
    }
}

impl PersistPrefixConfig {
    pub fn validate(&self) -> Result<(), String> {
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
pub struct PersistPrefix {
    config: PersistPrefixConfig,
    /// (worker, the prefix's last block) -> when it was asked.
    asked: BTreeMap<(String, BlockHash), u64>,
}

impl PersistPrefix {
    pub fn new(config: PersistPrefixConfig) -> Self {
        Self {
            config,
            asked: BTreeMap::new(),
        }
    }

    fn decide(&mut self, now_ms: u64, snapshot: &ClusterSnapshot) -> Vec<Decision> {
        let retry = self.config.retry_ms;
        self.asked
            .retain(|_, at| now_ms.saturating_sub(*at) < retry);
        let mut out = Vec::new();
        for hot in &snapshot.hot_prefixes {
            let blocks = hot.leading_hot(self.config.min_hits);
            let Some(&last) = blocks
                .last()
                .filter(|_| blocks.len() >= self.config.min_blocks)
            else {
                continue;
            };
            for (worker, held) in &hot.holders {
                if out.len() >= self.config.max_per_tick {
                    return out;
                }
                let on_disk = hot.persisted_by(worker);
                let serving = snapshot
                    .workers
                    .iter()
                    .any(|w| &w.name == worker && w.serving());
                let key = (worker.clone(), last);
                if !serving
                    || *held < blocks.len()
                    || on_disk >= blocks.len()
                    || self.asked.contains_key(&key)
                {
                    continue;
                }
                self.asked.insert(key, now_ms);
                out.push(Decision {
                    action: Action::PersistPrefix {
                        blocks: blocks.to_vec(),
                        worker: worker.clone(),
                    },
                    reason: format!(
                        "{} blocks ({} tokens) asked for at least {} times; {on_disk} on {worker}'s disk",
                        blocks.len(),
                        blocks.len() * hot.page_size,
                        self.config.min_hits
                    ),
                });
            }
        }
        out
    }
}

impl ClusterActor for PersistPrefix {
    fn name(&self) -> &'static str {
        "persist-prefix"
    }

    fn on_tick(&mut self, now_ms: u64, snapshot: &ClusterSnapshot) -> Vec<Decision> {
        self.decide(now_ms, snapshot)
    }

    fn reads_hot_prefixes(&self) -> bool {
        true
    }

    fn summary(&self) -> serde_json::Value {
        json!({"asked_recently": self.asked.len(), "min_hits": self.config.min_hits})
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::actions::{HotPrefix, WorkerState};
    use proptest::prelude::*;

    fn worker(name: &str, healthy: bool) -> WorkerState {
        WorkerState {
            name: name.into(),
            healthy,
            ..WorkerState::default()
        }
    }

    fn prefix(hits: &[u64], holders: &[(&str, usize)], persisted: &[(&str, usize)]) -> HotPrefix {
        let own = |l: &[(&str, usize)]| l.iter().map(|(w, n)| (w.to_string(), *n)).collect();
        HotPrefix {
            blocks: (1..=hits.len() as u64).map(BlockHash).collect(),
            hits: hits.to_vec(),
            page_size: 16,
            holders: own(holders),
            persisted: own(persisted),
            requests_per_s: 1.0,
        }
    }

    fn asks(d: &[Decision]) -> Vec<(String, usize)> {
        d.iter()
            .map(|d| match &d.action {
                Action::PersistPrefix { blocks, worker } => (worker.clone(), blocks.len()),
                other => panic!("{other:?}"),
            })
            .collect()
    }

    #[test]
    fn holders_of_the_hot_part_are_asked_once_per_retry() {
        let mut actor = PersistPrefix::new(PersistPrefixConfig::default());
        let snapshot = ClusterSnapshot {
            workers: vec![
                worker("a", true),
                worker("b", true),
                worker("c", false),
                worker("d", true),
            ],
            hot_prefixes: vec![prefix(
                &[5, 5, 3, 2],
                &[("a", 4), ("b", 3), ("c", 4), ("d", 2)],
                &[("b", 1)],
            )],
            ..ClusterSnapshot::default()
        };
        let first = actor.on_tick(0, &snapshot);
        assert_eq!(
            asks(&first),
            vec![("a".into(), 3), ("b".into(), 3)],
            "c is down, d holds too little"
        );
        assert!(actor.on_tick(29_999, &snapshot).is_empty());
        assert_eq!(asks(&actor.on_tick(30_000, &snapshot)).len(), 2);
    }

    #[test]
    fn a_prefix_on_disk_or_too_short_is_left_alone() {
        let mut actor = PersistPrefix::new(PersistPrefixConfig {
            min_blocks: 2,
            ..PersistPrefixConfig::default()
        });
        let snapshot = ClusterSnapshot {
            workers: vec![worker("a", true)],
            hot_prefixes: vec![
                prefix(&[9, 9], &[("a", 2)], &[("a", 2)]),
                prefix(&[4, 1], &[("a", 2)], &[]),
            ],
            ..ClusterSnapshot::default()
        };
        assert!(actor.on_tick(0, &snapshot).is_empty());
    }

    #[test]
    fn config_errors_name_the_key() {
        let bad = |c: PersistPrefixConfig| c.validate().unwrap_err();
        assert!(bad(PersistPrefixConfig {
            min_hits: 1,
            ..Default::default()
        })
        .starts_with("min_hits"));
        assert!(bad(PersistPrefixConfig {
            retry_ms: 0,
            ..Default::default()
        })
        .starts_with("retry_ms"));
    }

    proptest! {
        #[test]
        fn asks_name_hot_held_blocks_not_on_disk(
            prefixes in proptest::collection::vec(
                (proptest::collection::vec(1u64..8, 1..6), proptest::collection::vec((0usize..4, 0usize..7, 0usize..7), 0..4)),
                0..5,
            ),
            min_hits in 2u64..5,
            max_per_tick in 1usize..6,
        ) {
            let names = ["a", "b", "c", "d"];
            let hot_prefixes: Vec<HotPrefix> = prefixes
                .iter()
                .enumerate()
                .map(|(i, (hits, at))| {
                    let at: BTreeMap<usize, (usize, usize)> =
                        at.iter().map(|&(w, h, d)| (w, (h, d))).collect();
                    let mut hits = hits.clone();
                    hits.sort_unstable_by(|a, b| b.cmp(a));
                    HotPrefix {
                        blocks: (0..hits.len() as u64).map(|b| BlockHash(i as u64 * 100 + b)).collect(),
                        holders: at.iter().map(|(&w, &(h, _))| (names[w].to_string(), h)).collect(),
                        persisted: at.iter().map(|(&w, &(_, d))| (names[w].to_string(), d)).collect(),
                        hits,
                        page_size: 16,
                        requests_per_s: 1.0,
                    }
                })
                .collect();
            let snapshot = ClusterSnapshot {
                workers: names.iter().map(|n| worker(n, *n != "d")).collect(),
                hot_prefixes,
                ..ClusterSnapshot::default()
            };
            let mut actor = PersistPrefix::new(PersistPrefixConfig { min_hits, max_per_tick, ..Default::default() });
            let out = actor.on_tick(0, &snapshot);
            prop_assert!(out.len() <= max_per_tick);
            for d in &out {
                let Action::PersistPrefix { blocks, worker } = &d.action else { unreachable!() };
                prop_assert!(worker != "d");
                let hot = snapshot.hot_prefixes.iter().find(|p| p.blocks.starts_with(blocks)).unwrap();
                prop_assert!(hot.hits[..blocks.len()].iter().all(|&h| h >= min_hits));
                prop_assert!(hot.holders.iter().any(|(w, n)| w == worker && *n >= blocks.len()));
                prop_assert!(!hot.persisted.iter().any(|(w, n)| w == worker && *n >= blocks.len()));
            }
            prop_assert!(actor.on_tick(1, &snapshot).is_empty() || out.len() == max_per_tick);
        }
    }
}
