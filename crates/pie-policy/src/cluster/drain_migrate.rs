//! `drain-migrate`: moves every process off a draining worker, so that a
//! worker can be drained (SIGTERM, `POST /v1/admin/drain`: a rolling upgrade,
//! a scale-in, a Kubernetes preStop) without failing or restarting a stream.
//!
//! Rule: when a worker is seen draining (the `WorkerDraining` event, and on
//! every tick while it drains), each of its processes moves to the serving
//! worker (healthy, not draining, not prefill-stage) with the least load,
//! counting the processes this decision already sent there, ties by name.
//! A process whose move is in flight (asked for less than
//! `pending_timeout_ms` ago and still on the draining worker) is not asked
//! again. With no serving worker nothing is asked: the processes finish
//! where they are, or fail at the worker's own drain timeout.
//!
//! Props read: none (a `pin` naming the draining worker cannot hold: the
//! worker is going away). Config keys (`[cluster.drain-migrate]`):
//! `pending_timeout_ms` (10000, > 0), `dry_run` (false; honoured by the
//! runner).
//!
//! Invariant (tested): every process on a draining worker is asked to move
//! exactly once per `pending_timeout_ms`, to a serving worker, never to a
//! draining, unhealthy or prefill-stage one, and the targets' loads after the
//! moves differ by at most one where they started equal.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use serde_json::json;

use super::actions::{Action, ClusterActor, ClusterEvent, ClusterSnapshot, Decision, Stage};

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DrainMigrateConfig {
    /// Record decisions without executing them (applied by `ActorRunner`).
    pub dry_run: bool,
    /// A move still not done after this long is asked for again.
    pub pending_timeout_ms: u64,
}

impl Default for DrainMigrateConfig {
    fn default() -> Self {
        Self {
            dry_run: false,
            pending_timeout_ms: 10_000,
        }
    }
}

impl DrainMigrateConfig {
    pub fn validate(&self) -> Result<(), String> {
        if self.pending_timeout_ms == 0 {
            return Err("pending_timeout_ms: must be positive".into());
        }
        Ok(())
    }
}

#[derive(Debug)]
pub struct DrainMigrate {
    config: DrainMigrateConfig,
    /// Process -> when its move was asked for.
    asked: BTreeMap<String, u64>,
}

impl DrainMigrate {
    pub fn new(config: DrainMigrateConfig) -> Self {
        Self {
            config,
            asked: BTreeMap::new(),
        }
    }

    fn decide(&mut self, now_ms: u64, snapshot: &ClusterSnapshot) -> Vec<Decision> {
        let timeout = self.config.pending_timeout_ms;
        self.asked
            .retain(|_, at| now_ms.saturating_sub(*at) < timeout);
        let draining: Vec<&str> = snapshot
            .workers
            .iter()
            .filter(|w| w.healthy && w.draining)
            .map(|w| w.name.as_str())
            .collect();
        let mut targets: Vec<(usize, &str)> = snapshot
            .workers
            .iter()
            .filter(|w| w.serving() && w.stage != Stage::Prefill)
            .map(|w| (w.load, w.name.as_str()))
            .collect();
        let mut out = Vec::new();
        if targets.is_empty() {
            return out;
        }
        for p in &snapshot.processes {
            let Some(from) = p.worker.as_deref().filter(|w| draining.contains(w)) else {
                continue;
            };
            if self.asked.contains_key(&p.id) {
                continue;
            }
            let Some(t) = targets.iter_mut().min() else {
                break;
            };
            t.0 += 1;
            self.asked.insert(p.id.clone(), now_ms);
            out.push(Decision {
                action: Action::MigrateProcess {
                    process: p.id.clone(),
                    from: from.to_string(),
                    to: t.1.to_string(),
                },
                reason: format!("{from} is draining; {} is the least loaded", t.1),
            });
        }
        out
    }
}

impl ClusterActor for DrainMigrate {
    fn name(&self) -> &'static str {
        "drain-migrate"
    }

    fn on_tick(&mut self, now_ms: u64, snapshot: &ClusterSnapshot) -> Vec<Decision> {
        self.decide(now_ms, snapshot)
    }

    fn on_event(
        &mut self,
        now_ms: u64,
        event: &ClusterEvent,
        snapshot: &ClusterSnapshot,
    ) -> Vec<Decision> {
        match event {
            ClusterEvent::WorkerDraining { .. } => self.decide(now_ms, snapshot),
            _ => Vec::new(),
        }
    }

    fn summary(&self) -> serde_json::Value {
        json!({"moves_in_flight": self.asked.len(), "pending_timeout_ms": self.config.pending_timeout_ms})
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::actions::{ProcessState, WorkerState};

    fn worker(name: &str, load: usize, draining: bool) -> WorkerState {
        WorkerState {
            name: name.into(),
            healthy: true,
            draining,
            load,
            max_running: 8,
            ..WorkerState::default()
        }
    }

    fn on(id: &str, worker: &str) -> ProcessState {
        ProcessState {
            id: id.into(),
            worker: Some(worker.into()),
            ..ProcessState::default()
        }
    }

    fn moves(d: &[Decision]) -> Vec<(String, String, String)> {
        d.iter()
            .map(|d| match &d.action {
                Action::MigrateProcess { process, from, to } => {
                    (process.clone(), from.clone(), to.clone())
                }
                other => panic!("{other:?}"),
            })
            .collect()
    }

    fn snapshot() -> ClusterSnapshot {
        let mut prefill = worker("p", 0, false);
        prefill.stage = Stage::Prefill;
        let mut sick = worker("sick", 0, false);
        sick.healthy = false;
        ClusterSnapshot {
            workers: vec![
                worker("a", 4, true),
                worker("b", 1, false),
                worker("c", 1, false),
                worker("d", 0, true),
                prefill,
                sick,
            ],
            processes: vec![
                on("1", "a"),
                on("2", "a"),
                on("3", "a"),
                on("4", "a"),
                on("5", "b"),
            ],
            hot_prefixes: Vec::new(),
        }
    }

    #[test]
    fn every_process_of_a_draining_worker_moves_once_to_the_least_loaded_serving_worker() {
        let mut actor = DrainMigrate::new(DrainMigrateConfig::default());
        let event = ClusterEvent::WorkerDraining { worker: "a".into() };
        let got = moves(&actor.on_event(0, &event, &snapshot()));
        assert_eq!(
            got,
            [("1", "b"), ("2", "c"), ("3", "b"), ("4", "c")].map(|(p, t)| (
                p.to_string(),
                "a".to_string(),
                t.to_string()
            ))
        );
        // Asked once: not again while in flight, again after the timeout.
        assert!(actor.on_tick(5_000, &snapshot()).is_empty());
        assert_eq!(actor.on_tick(10_000, &snapshot()).len(), 4);
        assert_eq!(actor.summary()["moves_in_flight"], 4);
    }

    #[test]
    fn with_no_serving_worker_nothing_is_asked() {
        let mut s = snapshot();
        for w in &mut s.workers {
            if w.name == "b" || w.name == "c" {
                w.draining = true;
            }
        }
        // Left: a prefill-stage worker and an unhealthy one.
        assert!(DrainMigrate::new(DrainMigrateConfig::default())
            .on_tick(0, &s)
            .is_empty());
    }

    #[test]
    fn a_zero_timeout_is_refused_by_name() {
        let bad = DrainMigrateConfig {
            pending_timeout_ms: 0,
            ..DrainMigrateConfig::default()
        };
        assert!(bad
            .validate()
            .is_err_and(|e| e.starts_with("pending_timeout_ms")));
    }
}
