//! `retain-all`: cluster-wide retention. `keep-session` keeps a finished
//! session's pages on its worker for `keep-ms`; when that worker needs the
//! pages sooner, it drops them and the next turn recomputes its context.
//! Under `retain-all` every worker spills such a session instead: its full
//! pages go to the shared `pie-pool` (held there, soft-pinned, until its
//! `keep-ms` passes; the pool evicts least recently used first across every
//! worker's spills, so eviction is cluster-wide LRU) or to the worker's disk
//! tier, and the next turn pulls them back instead of recomputing.
//!
//! The spill itself happens on the worker, in the step that evicts (no
//! controller round trip can be in that path); this actor makes every worker
//! do it, and keeps it so: workers report where they spill, and a serving
//! worker that does not spill to `to` (it started, restarted or joined
//! without it) is asked to (`RetainSpill`), once per `retry_ms`, and at once
//! when it joins. A worker that cannot (no pool, no disk tier) refuses; the
//! executor logs the refusal with the worker's reason.
//!
//! Props read: none (`keep-ms` and `session` are read by the worker's
//! keep-session). Config keys (`[cluster.retain-all]`, defaults first): `to`
//! (`any`: the pool where the worker has one, else its disk; `pool`; `disk`),
//! `retry_ms` (10000, at least 1), `dry_run`.
//!
//! Invariant (tested, with a property test): only serving workers that do not
//! already spill to `to` are asked, each at most once per `retry_ms`.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use serde_json::json;

use super::actions::{
    Action, ClusterActor, ClusterEvent, ClusterSnapshot, Decision, Tier, WorkerState,
};

/// Spills a worker keeps on their way at once, at most; one more is dropped
/// and counted (a slow pool costs recomputes, never memory without bound).
/// The worker's runtime and the simulator both hold to it.
pub const SPILLS_IN_FLIGHT: usize = 4;

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RetainAllConfig {
    /// Record decisions without executing them (applied by `ActorRunner`).
    pub dry_run: bool,
    /// Where workers spill retained sessions.
    pub to: Tier,
    /// A worker that still does not spill is asked again after this long.
    pub retry_ms: u64,
}

impl Default for RetainAllConfig {
    fn default() -> Self {
        Self {
            dry_run: false,
            to: Tier::Any,
            retry_ms: 10_000,
        }
    }
}

impl RetainAllConfig {
    /// An error names the offending key.
    pub fn validate(&self) -> Result<(), String> {
        if self.retry_ms == 0 {
            return Err("retry_ms: must be at least 1".into());
        }
        Ok(())
    }
}

#[derive(Debug)]
pub struct RetainAll {
    config: RetainAllConfig,
    /// Worker -> when it was last asked.
    asked: BTreeMap<String, u64>,
}

impl RetainAll {
    pub fn new(config: RetainAllConfig) -> Self {
        Self {
            config,
            asked: BTreeMap::new(),
        }
    }

    fn ask<'a>(
        &mut self,
        now_ms: u64,
        workers: impl Iterator<Item = &'a WorkerState>,
    ) -> Vec<Decision> {
        let (to, retry_ms) = (self.config.to, self.config.retry_ms);
        let mut out = Vec::new();
        for w in workers.filter(|w| w.serving() && w.retain_spill != Some(to)) {
            let recent = self
                .asked
                .get(&w.name)
                .is_some_and(|&at| now_ms.saturating_sub(at) < retry_ms);
            if recent {
                continue;
            }
            self.asked.insert(w.name.clone(), now_ms);
            let now = w.retain_spill.map_or("drops them", |t| t.name());
            out.push(Decision {
                action: Action::RetainSpill {
                    worker: w.name.clone(),
                    to,
                },
                reason: format!(
                    "{} evicts retained sessions early: {now}; retain-all spills them to {}",
                    w.name,
                    to.name()
                ),
            });
        }
        out
    }
}

impl ClusterActor for RetainAll {
    fn name(&self) -> &'static str {
        "retain-all"
    }

    fn on_tick(&mut self, now_ms: u64, snapshot: &ClusterSnapshot) -> Vec<Decision> {
        self.asked
            .retain(|name, _| snapshot.workers.iter().any(|w| &w.name == name));
        self.ask(now_ms, snapshot.workers.iter())
    }

    fn on_event(
        &mut self,
        now_ms: u64,
        event: &ClusterEvent,
        snapshot: &ClusterSnapshot,
    ) -> Vec<Decision> {
        let ClusterEvent::WorkerJoined { worker } = event else {
            return Vec::new();
        };
        // A worker that joins (or comes back) has not been asked yet.
        self.asked.remove(worker);
        self.ask(
            now_ms,
            snapshot.workers.iter().filter(|w| &w.name == worker),
        )
    }

    fn summary(&self) -> serde_json::Value {
        json!({"to": self.config.to.name(), "asked": self.asked.keys().collect::<Vec<_>>()})
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::fixtures::worker;
    use proptest::prelude::*;

    fn asked(d: &[Decision]) -> Vec<String> {
        d.iter()
            .map(|d| match &d.action {
                Action::RetainSpill { worker, to } => format!("{worker}:{}", to.name()),
                other => panic!("{other:?}"),
            })
            .collect()
    }

    fn spilling(name: &str, to: Option<Tier>) -> WorkerState {
        WorkerState {
            retain_spill: to,
            ..worker(name, 0)
        }
    }

    #[test]
    fn workers_not_spilling_are_asked_once_per_retry_and_at_once_when_they_join() {
        let config = RetainAllConfig {
            to: Tier::Pool,
            ..RetainAllConfig::default()
        };
        let mut actor = RetainAll::new(config);
        let mut snap = ClusterSnapshot {
            workers: vec![
                spilling("a", None),
                spilling("b", Some(Tier::Pool)),
                spilling("c", Some(Tier::Disk)),
                WorkerState {
                    draining: true,
                    ..spilling("d", None)
                },
            ],
            ..ClusterSnapshot::default()
        };
        assert_eq!(asked(&actor.on_tick(0, &snap)), ["a:pool", "c:pool"]);
        assert!(actor.on_tick(9_999, &snap).is_empty(), "within retry_ms");
        assert_eq!(asked(&actor.on_tick(10_000, &snap)).len(), 2);

        let joined = ClusterEvent::WorkerJoined { worker: "a".into() };
        assert_eq!(asked(&actor.on_event(10_001, &joined, &snap)), ["a:pool"]);
        snap.workers[0].retain_spill = Some(Tier::Pool);
        snap.workers[2].retain_spill = Some(Tier::Pool);
        assert!(
            actor.on_tick(30_000, &snap).is_empty(),
            "all spill to the pool"
        );
        assert_eq!(actor.summary()["to"], "pool");
    }

    #[test]
    fn config_errors_name_the_key() {
        let bad = RetainAllConfig {
            retry_ms: 0,
            ..RetainAllConfig::default()
        };
        assert!(bad.validate().unwrap_err().starts_with("retry_ms"));
    }

    fn tier(i: u8) -> Option<Tier> {
        [None, Some(Tier::Any), Some(Tier::Pool), Some(Tier::Disk)][usize::from(i % 4)]
    }

    proptest! {
        #[test]
        fn only_serving_workers_not_spilling_to_the_target_are_asked_once_per_retry(
            workers in proptest::collection::vec((0u8..4, any::<bool>(), any::<bool>()), 1..8),
            to in 1u8..4,
            ticks in proptest::collection::vec(0u64..5_000, 1..6),
        ) {
            let to = tier(to).expect("1..4 is a tier");
            let snapshot = ClusterSnapshot {
                workers: workers
                    .iter()
                    .enumerate()
                    .map(|(i, &(spill, healthy, draining))| WorkerState {
                        healthy,
                        draining,
                        ..spilling(&format!("w{i}"), tier(spill))
                    })
                    .collect(),
                ..ClusterSnapshot::default()
            };
            let config = RetainAllConfig { to, retry_ms: 3_000, ..RetainAllConfig::default() };
            let mut actor = RetainAll::new(config);
            let mut last: BTreeMap<String, u64> = BTreeMap::new();
            let mut now = 0;
            for step in ticks {
                now += step;
                for d in actor.on_tick(now, &snapshot) {
                    let Action::RetainSpill { worker, to: asked } = d.action else { unreachable!() };
                    let w = snapshot.workers.iter().find(|w| w.name == worker).unwrap();
                    prop_assert!(w.serving() && w.retain_spill != Some(to) && asked == to);
                    if let Some(&at) = last.get(&worker) {
                        prop_assert!(now - at >= 3_000);
                    }
                    last.insert(worker, now);
                }
            }
        }
    }
}
