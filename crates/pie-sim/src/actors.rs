//! Cluster actors in the simulator: the same `ActorRunner` (and actors) that
//! `pie-controller` runs, ticked every `actor_tick_ms` of simulated time over a
//! snapshot of the simulated workers. Actions are executed here as the
//! controller executes them: a scale hint is published (kept in the run's
//! metrics); an action this executor cannot carry out yet stops the run with
//! an error naming it, never silently. Dry-run records are kept, not executed.

use anyhow::{bail, Result};
use pie_policy::cluster::{Action, ActionRecord, ActorConfigs, ActorRunner, ClusterSnapshot};

/// The actors of a pipeline and when they look next.
pub struct SimActors {
    runner: ActorRunner,
    tick_us: u64,
    next_tick_us: u64,
    /// Every action recorded, in order (dry-run ones included).
    pub records: Vec<ActionRecord>,
}

impl SimActors {
    /// None when `names` is empty (no actor, no ticks).
    pub fn new(names: &[&str], configs: &ActorConfigs, tick_ms: u64) -> Result<Option<Self>> {
        if names.is_empty() {
            return Ok(None);
        }
        anyhow::ensure!(tick_ms > 0, "the actor tick must be positive");
        let runner = ActorRunner::new(names, configs).map_err(anyhow::Error::msg)?;
        Ok(Some(Self {
            runner,
            tick_us: tick_ms * 1000,
            next_tick_us: 0,
            records: Vec::new(),
        }))
    }

    /// The next tick, if it is due by `now_us`.
    pub fn due(&self, now_us: u64) -> Option<u64> {
        (self.next_tick_us <= now_us).then_some(self.next_tick_us)
    }

    /// The actors look at `snapshot` (taken at `at_us`); their actions are
    /// executed and recorded.
    pub fn tick(&mut self, at_us: u64, snapshot: &ClusterSnapshot) -> Result<()> {
        self.next_tick_us = at_us + self.tick_us;
        for record in self.runner.tick(at_us / 1000, snapshot) {
            if !record.dry_run {
                execute(&record)?;
            }
            self.records.push(record);
        }
        Ok(())
    }
}

/// What executing an action means in the simulator.
fn execute(record: &ActionRecord) -> Result<()> {
    match &record.action {
        Action::ScaleHint(_) => Ok(()),
        other => bail!(
            "{}: the simulator cannot execute `{}` actions yet",
            record.actor,
            other.kind()
        ),
    }
}
