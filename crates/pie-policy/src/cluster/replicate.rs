//! `replicate`: a hot prefix whose holders are all busy is copied, worker to
//! worker, to a worker that is not, so `cache-aware` can send its requests
//! there without recomputing it.
//!
//! Rule, on every tick, hottest prefix first: the part worth copying is the
//! leading blocks asked for at least `min_hits` times (at least `min_blocks`
//! of them). It is copied (`CopyPrefix`) when its request rate is at least
//! `hot_rps`, every serving worker holding all of it is at or above `high`
//! (queued + running over `max_running`), there is at least one such holder
//! (the source: the least loaded), those holders number fewer than
//! `1 + max_replicas`, and no copy of it is pending. The target is the least
//! loaded serving worker below `low` that does not hold it and serves prefill
//! (not a decode-only worker). A copy is pending until the target's KV events
//! announce the pages or `pending_ms` passes, so each copy's effect on load
//! is seen before the next one; at most `max_per_tick` copies a tick. A copy
//! the executor reports failed (`ActionFailed`: the target refused or did not
//! answer) frees its place at once, and that target is not chosen again for
//! `pending_ms`.
//!
//! Props read: none. Config keys (`[cluster.replicate]`, defaults first):
//! `hot_rps` (1.0, positive), `min_hits` (3, at least 2), `min_blocks` (1),
//! `max_replicas` (2), `high` (0.75) and `low` (0.5) with 0 < low <= high,
//! `max_per_tick` (4), `pending_ms` (30000; counts at least 1), `dry_run`.
//!
//! Invariant (tested, with a property test): a copy names a prefix at least
//! `hot_rps` hot, a serving source holding every block it names, a serving,
//! prefill-capable target below `low` that does not; every serving holder of
//! the prefix is at or above `high`; holders plus the copy never exceed
//! `1 + max_replicas`; one copy of a prefix pending at a time; no tick asks
//! more than `max_per_tick` copies; a target that refused is not asked again
//! within `pending_ms`.

use std::collections::BTreeMap;

use pie_core::BlockHash;
use serde::{Deserialize, Serialize};
use serde_json::json;

use super::actions::{
    Action, ClusterActor, ClusterEvent, ClusterSnapshot, Decision, HotPrefix, Stage, WorkerState,
};

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ReplicateConfig {
    /// Record decisions without executing them (applied by `ActorRunner`).
    pub dry_run: bool,
    /// Requests per second (of the prefix's first block) that make it hot.
    pub hot_rps: f64,
    /// A block is worth copying once this many routed requests included it.
    pub min_hits: u64,
    /// Shorter hot prefixes are not worth a transfer.
    pub min_blocks: usize,
    /// Copies beyond the first holder, at most.
    pub max_replicas: usize,
    /// A holder at or above this level is busy.
    pub high: f64,
    /// A target must be below this level.
    pub low: f64,
    /// Copies asked per tick, at most.
    pub max_per_tick: usize,
    /// A copy not announced by its target after this long no longer counts.
    pub pending_ms: u64,
}

impl Default for ReplicateConfig {
    fn default() -> Self {
        Self {
            dry_run: false,
            hot_rps: 1.0,
            min_hits: 3,
            min_blocks: 1,
            max_replicas: 2,
            high: 0.75,
            low: 0.5,
            max_per_tick: 4,
            pending_ms: 30_000,
        }
    }
}

impl ReplicateConfig {
    /// An error names the offending key.
    pub fn validate(&self) -> Result<(), String> {
        if !(self.hot_rps.is_finite() && self.hot_rps > 0.0) {
            return Err(format!("hot_rps: {} must be positive", self.hot_rps));
        }
        if self.min_hits < 2 {
            return Err("min_hits: must be at least 2 (a prefix used once is not hot)".into());
        }
        if !(self.low.is_finite() && self.low > 0.0) {
            return Err(format!("low: {} must be positive", self.low));
        }
        if !(self.high.is_finite() && self.high >= self.low) {
            return Err(format!(
                "high: {} must be at least low {}",
                self.high, self.low
            ));
        }
        for (key, value) in [
            ("min_blocks", self.min_blocks as u64),
            ("max_replicas", self.max_replicas as u64),
            ("max_per_tick", self.max_per_tick as u64),
            ("pending_ms", self.pending_ms),
        ] {
            if value == 0 {
                return Err(format!("{key}: must be at least 1"));
            }
        }
        Ok(())
    }
}

/// A copy asked for and not yet announced by its target.
#[derive(Clone, Debug, PartialEq, Serialize)]
struct Pending {
    target: String,
    at_ms: u64,
}

#[derive(Debug)]
pub struct Replicate {
    config: ReplicateConfig,
    /// The copied prefix's last block -> its copy in flight.
    pending: BTreeMap<BlockHash, Pending>,
    /// Targets that refused a copy -> until when they are not asked again.
    refused: BTreeMap<String, u64>,
    copies_asked: u64,
}

impl Replicate {
    pub fn new(config: ReplicateConfig) -> Self {
        Self {
            config,
            pending: BTreeMap::new(),
            refused: BTreeMap::new(),
            copies_asked: 0,
        }
    }

    /// Copies in flight are done once their target holds the prefix, and
    /// forgotten after `pending_ms`.
    fn retire(&mut self, now_ms: u64, snapshot: &ClusterSnapshot) {
        let depth_of = |last: &BlockHash, target: &str| {
            snapshot
                .hot_prefixes
                .iter()
                .find_map(|p| {
                    let at = p.blocks.iter().position(|b| b == last)?;
                    Some(p.held_by(target) > at)
                })
                .unwrap_or(false)
        };
        let pending_ms = self.config.pending_ms;
        self.pending.retain(|last, c| {
            now_ms.saturating_sub(c.at_ms) < pending_ms && !depth_of(last, &c.target)
        });
        self.refused.retain(|_, until| now_ms < *until);
    }

    /// A copy the executor could not make: its place is free, its target
    /// avoided for `pending_ms`.
    fn failed(&mut self, now_ms: u64, blocks: &[BlockHash], to: &str) {
        let Some(last) = blocks.last() else { return };
        if self.pending.get(last).is_some_and(|c| c.target == to) {
            self.pending.remove(last);
        }
        self.refused
            .insert(to.to_string(), now_ms + self.config.pending_ms);
    }

    /// The copy one hot prefix gets this tick, if any.
    fn copy_for(&self, hot: &HotPrefix, workers: &[WorkerState]) -> Option<(Decision, String)> {
        let c = &self.config;
        let (blocks, holders) = crowded(hot, workers, c.hot_rps, c.min_hits, c.min_blocks, c.high)?;
        let &last = blocks.last()?;
        if self.pending.contains_key(&last) || holders.len() > c.max_replicas {
            return None;
        }
        let holds = |w: &WorkerState| hot.held_by(&w.name) >= blocks.len();
        let source = least_loaded(&holders)?;
        let idle: Vec<&WorkerState> = workers
            .iter()
            .filter(|w| {
                w.serving()
                    && w.stage != Stage::Decode
                    && !holds(w)
                    && !self.refused.contains_key(&w.name)
                    && w.load_level().is_some_and(|l| l < c.low)
            })
            .collect();
        let target = least_loaded(&idle)?;
        let decision = Decision {
            action: Action::CopyPrefix {
                blocks: blocks.to_vec(),
                from: source.name.clone(),
                to: target.name.clone(),
            },
            reason: format!(
                "{}; {} at {}",
                crowded_reason(blocks, hot, c.high, &holders),
                target.name,
                loaded(target)
            ),
        };
        Some((decision, target.name.clone()))
    }

    fn decide(&mut self, now_ms: u64, snapshot: &ClusterSnapshot) -> Vec<Decision> {
        self.retire(now_ms, snapshot);
        let mut out = Vec::new();
        for hot in &snapshot.hot_prefixes {
            if out.len() >= self.config.max_per_tick {
                break;
            }
            let Some((decision, target)) = self.copy_for(hot, &snapshot.workers) else {
                continue;
            };
            if let Action::CopyPrefix { blocks, .. } = &decision.action {
                if let Some(&last) = blocks.last() {
                    self.pending.insert(
                        last,
                        Pending {
                            target,
                            at_ms: now_ms,
                        },
                    );
                }
            }
            self.copies_asked += 1;
            out.push(decision);
        }
        out
    }
}

/// A prefix asked for at least `hot_rps` times a second whose serving
/// holders are all at or above `high`: its leading blocks asked for at least
/// `min_hits` times (at least `min_blocks` of them) and those holders (never
/// none). What `replicate` and `pool-replicate` copy.
pub(super) fn crowded<'a>(
    hot: &'a HotPrefix,
    workers: &'a [WorkerState],
    hot_rps: f64,
    min_hits: u64,
    min_blocks: usize,
    high: f64,
) -> Option<(&'a [BlockHash], Vec<&'a WorkerState>)> {
    if hot.requests_per_s < hot_rps {
        return None;
    }
    let blocks = hot.leading_hot(min_hits);
    if blocks.is_empty() || blocks.len() < min_blocks {
        return None;
    }
    let holders: Vec<&WorkerState> = workers
        .iter()
        .filter(|w| w.serving() && hot.held_by(&w.name) >= blocks.len())
        .collect();
    let busy = |w: &&WorkerState| w.load_level().is_some_and(|l| l >= high);
    (!holders.is_empty() && holders.iter().all(busy)).then_some((blocks, holders))
}

/// The least loaded of `workers` (ties by name).
pub(super) fn least_loaded<'a>(workers: &[&'a WorkerState]) -> Option<&'a WorkerState> {
    workers.iter().copied().min_by_key(|w| (w.load, &w.name))
}

/// Why a crowded prefix is worth copying, for reasons.
pub(super) fn crowded_reason(
    blocks: &[BlockHash],
    hot: &HotPrefix,
    high: f64,
    holders: &[&WorkerState],
) -> String {
    let loads: Vec<String> = holders.iter().map(|w| loaded(w)).collect();
    format!(
        "{} blocks asked for {:.1}/s; its holders at or above {high} of max_running ({})",
        blocks.len(),
        hot.requests_per_s,
        loads.join(", ")
    )
}

/// `name load/max_running`, for reasons.
fn loaded(w: &WorkerState) -> String {
    format!("{} {}/{}", w.name, w.load, w.max_running)
}

impl ClusterActor for Replicate {
    fn name(&self) -> &'static str {
        "replicate"
    }

    fn on_tick(&mut self, now_ms: u64, snapshot: &ClusterSnapshot) -> Vec<Decision> {
        self.decide(now_ms, snapshot)
    }

    fn on_event(
        &mut self,
        now_ms: u64,
        event: &ClusterEvent,
        _snapshot: &ClusterSnapshot,
    ) -> Vec<Decision> {
        if let ClusterEvent::ActionFailed {
            action: Action::CopyPrefix { blocks, to, .. },
            ..
        } = event
        {
            self.failed(now_ms, blocks, to);
        }
        Vec::new()
    }

    fn reads_hot_prefixes(&self) -> bool {
        true
    }

    fn summary(&self) -> serde_json::Value {
        json!({
            "copies_asked": self.copies_asked,
            "pending": self.pending.len(),
            "refused": self.refused.keys().collect::<Vec<_>>(),
            "hot_rps": self.config.hot_rps,
            "max_replicas": self.config.max_replicas,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::fixtures::{self, holders, worker};
    use proptest::prelude::*;

    fn hot(rate: f64, at: &[(&str, usize)]) -> HotPrefix {
        fixtures::hot(1, &[9, 9, 9], &holders(at), rate)
    }

    fn copies(d: &[Decision]) -> Vec<(String, String, usize)> {
        d.iter()
            .map(|d| match &d.action {
                Action::CopyPrefix { blocks, from, to } => (from.clone(), to.clone(), blocks.len()),
                other => panic!("{other:?}"),
            })
            .collect()
    }

    #[test]
    fn a_hot_prefix_on_busy_holders_goes_to_the_least_loaded_idle_worker() {
        let mut actor = Replicate::new(ReplicateConfig::default());
        let snapshot = ClusterSnapshot {
            workers: vec![worker("a", 4), worker("b", 1), worker("c", 0)],
            hot_prefixes: vec![hot(5.0, &[("a", 3), ("b", 1)])],
            ..ClusterSnapshot::default()
        };
        assert_eq!(
            copies(&actor.on_tick(0, &snapshot)),
            vec![("a".into(), "c".into(), 3)]
        );
        assert!(
            actor.on_tick(1, &snapshot).is_empty(),
            "the copy to c is pending: no other copy until it is announced"
        );
        let mut announced = snapshot.clone();
        announced.hot_prefixes[0].holders.push(("c".into(), 3));
        assert!(
            actor.on_tick(2, &announced).is_empty(),
            "c holds it and is not busy"
        );
        announced.workers[2].load = 4;
        assert_eq!(
            copies(&actor.on_tick(3, &announced)),
            vec![("a".into(), "b".into(), 3)],
            "both holders busy: a third copy, the last one max_replicas allows"
        );
        announced.hot_prefixes[0].holders[1].1 = 3;
        announced.workers[1].load = 4;
        announced.workers.push(worker("d", 0));
        assert!(actor.on_tick(4, &announced).is_empty(), "three copies");
    }

    #[test]
    fn cold_idle_or_unheld_prefixes_stay_where_they_are() {
        let mut actor = Replicate::new(ReplicateConfig::default());
        let snap = |prefix: HotPrefix, a_load: usize| ClusterSnapshot {
            workers: vec![worker("a", a_load), worker("b", 0)],
            hot_prefixes: vec![prefix],
            ..ClusterSnapshot::default()
        };
        assert!(actor.on_tick(0, &snap(hot(0.5, &[("a", 3)]), 4)).is_empty());
        assert!(actor.on_tick(0, &snap(hot(5.0, &[("a", 3)]), 2)).is_empty());
        assert!(actor.on_tick(0, &snap(hot(5.0, &[("a", 2)]), 4)).is_empty());
        let mut decode = snap(hot(5.0, &[("a", 3)]), 4);
        decode.workers[1].stage = Stage::Decode;
        assert!(actor.on_tick(0, &decode).is_empty());
    }

    #[test]
    fn a_copy_never_announced_frees_its_place_after_pending_ms() {
        let mut actor = Replicate::new(ReplicateConfig {
            max_replicas: 1,
            ..ReplicateConfig::default()
        });
        let snapshot = ClusterSnapshot {
            workers: vec![worker("a", 4), worker("b", 0), worker("c", 1)],
            hot_prefixes: vec![hot(5.0, &[("a", 3)])],
            ..ClusterSnapshot::default()
        };
        assert_eq!(copies(&actor.on_tick(0, &snapshot)).len(), 1);
        assert!(actor.on_tick(29_999, &snapshot).is_empty());
        assert_eq!(
            copies(&actor.on_tick(30_000, &snapshot)),
            vec![("a".into(), "b".into(), 3)]
        );
    }

    #[test]
    fn a_refused_copy_frees_its_place_at_once_and_its_target_is_avoided() {
        let mut actor = Replicate::new(ReplicateConfig::default());
        let snapshot = ClusterSnapshot {
            workers: vec![worker("a", 4), worker("b", 0), worker("c", 1)],
            hot_prefixes: vec![hot(5.0, &[("a", 3)])],
            ..ClusterSnapshot::default()
        };
        let asked = actor.on_tick(0, &snapshot);
        assert_eq!(copies(&asked), vec![("a".into(), "b".into(), 3)]);
        let refused = ClusterEvent::ActionFailed {
            action: asked[0].action.clone(),
            error: "409".into(),
        };
        assert!(actor.on_event(5, &refused, &snapshot).is_empty());
        assert_eq!(
            copies(&actor.on_tick(10, &snapshot)),
            vec![("a".into(), "c".into(), 3)],
            "at once, to the next idle worker"
        );
        assert_eq!(actor.summary()["refused"], json!(["b"]));
        let other = ClusterEvent::ActionFailed {
            action: Action::CopyPrefix {
                blocks: vec![BlockHash(9)],
                from: "a".into(),
                to: "c".into(),
            },
            error: "another prefix".into(),
        };
        actor.on_event(11, &other, &snapshot);
        assert!(
            actor.on_tick(12, &snapshot).is_empty(),
            "the copy to c is of this prefix, still pending"
        );
        let mut later = snapshot.clone();
        later.workers.truncate(2);
        assert_eq!(
            copies(&actor.on_tick(30_011, &later)),
            vec![("a".into(), "b".into(), 3)],
            "once the copy to c expired, b (its refusal past pending_ms) is asked again"
        );
    }

    #[test]
    fn config_errors_name_the_key() {
        let bad = |c: ReplicateConfig| c.validate().unwrap_err();
        for (config, key) in [
            (
                ReplicateConfig {
                    hot_rps: 0.0,
                    ..Default::default()
                },
                "hot_rps",
            ),
            (
                ReplicateConfig {
                    low: 0.8,
                    high: 0.5,
                    ..Default::default()
                },
                "high",
            ),
            (
                ReplicateConfig {
                    max_replicas: 0,
                    ..Default::default()
                },
                "max_replicas",
            ),
        ] {
            assert!(bad(config).starts_with(key));
        }
    }

    proptest! {
        #[test]
        fn copies_go_from_busy_holders_to_idle_workers_within_the_cap(
            loads in proptest::collection::vec((0usize..6, any::<bool>(), any::<bool>()), 1..7),
            prefixes in proptest::collection::vec(
                (0.0f64..4.0, proptest::collection::vec((0usize..7, 0usize..4), 0..5)),
                1..4,
            ),
            max_replicas in 1usize..3,
            max_per_tick in 1usize..4,
            ticks in 1usize..4,
        ) {
            let workers: Vec<WorkerState> = loads
                .iter()
                .enumerate()
                .map(|(i, &(load, healthy, decode))| WorkerState {
                    healthy,
                    stage: if decode { Stage::Decode } else { Stage::Both },
                    ..worker(&format!("w{i}"), load)
                })
                .collect();
            let hot_prefixes: Vec<HotPrefix> = prefixes
                .iter()
                .enumerate()
                .map(|(i, (rate, at))| fixtures::generated_hot(i, *rate, at, loads.len()))
                .collect();
            let snapshot = ClusterSnapshot { workers, hot_prefixes, ..ClusterSnapshot::default() };
            let config = ReplicateConfig { max_replicas, max_per_tick, ..Default::default() };
            let mut actor = Replicate::new(config.clone());
            let mut asked: BTreeMap<String, usize> = BTreeMap::new();
            for tick in 0..ticks {
                let out = actor.on_tick(tick as u64, &snapshot);
                prop_assert!(out.len() <= max_per_tick);
                for d in &out {
                    let Action::CopyPrefix { blocks, from, to } = &d.action else { unreachable!() };
                    let hot = snapshot.hot_prefixes.iter().find(|p| p.blocks.starts_with(blocks)).unwrap();
                    let w = |n: &str| snapshot.workers.iter().find(|w| w.name == n).unwrap();
                    prop_assert!(hot.requests_per_s >= config.hot_rps);
                    prop_assert!(w(from).serving() && hot.held_by(from) >= blocks.len());
                    let t = w(to);
                    prop_assert!(t.serving() && t.stage != Stage::Decode && hot.held_by(to) < blocks.len());
                    prop_assert!(t.load_level().unwrap() < config.low);
                    let holders: Vec<&WorkerState> = snapshot.workers.iter()
                        .filter(|w| w.serving() && hot.held_by(&w.name) >= blocks.len())
                        .collect();
                    prop_assert!(holders.iter().all(|w| w.load_level().unwrap() >= config.high));
                    let n = asked.entry(format!("{:?}", blocks.last())).or_default();
                    *n += 1;
                    prop_assert!(holders.len() + *n <= 1 + max_replicas);
                }
            }
        }
    }
}
