//! `ActorRunner`: owns the configured actors and their dry-run flags, calls them
//! on ticks and events, and turns their decisions into [`ActionRecord`]s. Dry
//! run lives here, once, so no actor can forget it: a dry-run actor's records say
//! `dry_run`, and executors (controller, simulator) record them without acting.

use serde_json::{json, Map, Value};

use super::actions::{ActionRecord, ClusterActor, ClusterEvent, ClusterSnapshot, Decision};
use super::{actor, ActorConfigs};

struct Slot {
    actor: Box<dyn ClusterActor>,
    dry_run: bool,
}

#[derive(Default)]
pub struct ActorRunner {
    slots: Vec<Slot>,
}

impl ActorRunner {
    /// The named actors (see [`super::ACTORS`]) with their `[cluster.<name>]`
    /// configs; an unknown name or a bad config is an error naming it.
    pub fn new(names: &[&str], configs: &ActorConfigs) -> Result<Self, String> {
        let slots = names
            .iter()
            .map(|&name| {
                Ok(Slot {
                    actor: actor(name, configs)?,
                    dry_run: configs.dry_run(name),
                })
            })
            .collect::<Result<_, String>>()?;
        Ok(Self { slots })
    }

    pub fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }

    pub fn names(&self) -> Vec<&'static str> {
        self.slots.iter().map(|s| s.actor.name()).collect()
    }

    /// Whether any actor reads hot prefixes.
    pub fn reads_hot_prefixes(&self) -> bool {
        self.slots.iter().any(|s| s.actor.reads_hot_prefixes())
    }

    /// Every actor's periodic look at the cluster.
    pub fn tick(&mut self, now_ms: u64, snapshot: &ClusterSnapshot) -> Vec<ActionRecord> {
        self.collect(now_ms, |a| a.on_tick(now_ms, snapshot))
    }

    /// Every actor's reaction to `event`.
    pub fn event(
        &mut self,
        now_ms: u64,
        event: &ClusterEvent,
        snapshot: &ClusterSnapshot,
    ) -> Vec<ActionRecord> {
        self.collect(now_ms, |a| a.on_event(now_ms, event, snapshot))
    }

    fn collect(
        &mut self,
        now_ms: u64,
        mut f: impl FnMut(&mut dyn ClusterActor) -> Vec<Decision>,
    ) -> Vec<ActionRecord> {
        let mut out = Vec::new();
        for slot in &mut self.slots {
            let actor = slot.actor.name();
            out.extend(f(slot.actor.as_mut()).into_iter().map(|d| ActionRecord {
                at_ms: now_ms,
                actor: actor.to_string(),
                action: d.action,
                reason: d.reason,
                dry_run: slot.dry_run,
            }));
        }
        out
    }

    /// `{name: {"dry_run": .., "state": ..}}` for operators.
    pub fn summary(&self) -> Value {
        let map: Map<String, Value> = self
            .slots
            .iter()
            .map(|s| {
                (
                    s.actor.name().to_string(),
                    json!({"dry_run": s.dry_run, "state": s.actor.summary()}),
                )
            })
            .collect();
        Value::Object(map)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::actions::{Action, ProcessState, WorkerState};
    use crate::cluster::ScaleByPropConfig;

    #[test]
    fn dry_run_marks_records_of_that_actor_only() {
        let snap = ClusterSnapshot {
            workers: vec![WorkerState {
                name: "w0".into(),
                healthy: true,
                ..WorkerState::default()
            }],
            processes: vec![ProcessState::default(); 20],
            ..ClusterSnapshot::default()
        };
        let configs = |dry_run| ActorConfigs {
            scale_by_prop: ScaleByPropConfig {
                dry_run,
                ..ScaleByPropConfig::default()
            },
            ..ActorConfigs::default()
        };
        for dry_run in [false, true] {
            let mut r = ActorRunner::new(&["scale-by-prop"], &configs(dry_run)).expect("known");
            assert_eq!(r.names(), ["scale-by-prop"]);
            let records = r.tick(5, &snap);
            assert_eq!(records.len(), 1);
            let rec = &records[0];
            assert_eq!((rec.at_ms, rec.dry_run), (5, dry_run));
            assert_eq!(
                (rec.actor.as_str(), rec.action.kind()),
                ("scale-by-prop", "scale-hint")
            );
            assert!(matches!(&rec.action, Action::ScaleHint(h) if h.recommended == 2));
            assert_eq!(r.summary()["scale-by-prop"]["dry_run"], dry_run);
            let event = ClusterEvent::WorkerLeft {
                worker: "w0".into(),
            };
            assert!(r.event(6, &event, &snap).is_empty());
        }
        let err = ActorRunner::new(&["retain-none"], &configs(false)).err();
        assert!(err.is_some_and(|e| e.contains("`retain-none`") && e.contains("rebalance")));
    }
}
