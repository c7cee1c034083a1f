//! Cluster actors in the simulator: the same `ActorRunner` (and actors) that
//! `pie-controller` runs, ticked every `actor_tick_ms` of simulated time over a
//! snapshot of the simulated workers. Actions are executed as the controller
//! executes them: a scale hint is published (kept in the run's metrics); a
//! `MigrateProcess` moves the process with its KV (`sim.rs`, costed as
//! `migrate.rs` says); an action this executor cannot carry out stops the run
//! with an error naming it, never silently. Dry-run records are kept, not
//! executed.

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

/// An action for the simulation to carry out.
pub enum ToExecute {
    Migrate {
        process: String,
        from: String,
        to: String,
    },
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
    /// recorded, and those the simulation must carry out returned in order.
    pub fn tick(&mut self, at_us: u64, snapshot: &ClusterSnapshot) -> Result<Vec<ToExecute>> {
        self.next_tick_us = at_us + self.tick_us;
        let mut out = Vec::new();
        for record in self.runner.tick(at_us / 1000, snapshot) {
            if !record.dry_run {
                out.extend(execute(&record)?);
            }
            self.records.push(record);
        }
        Ok(out)
    }
}

/// What executing an action means in the simulator.
fn execute(record: &ActionRecord) -> Result<Option<ToExecute>> {
    match &record.action {
        Action::ScaleHint(_) => Ok(None),
        Action::MigrateProcess { process, from, to } => Ok(Some(ToExecute::Migrate {
            process: process.clone(),
            from: from.clone(),
            to: to.clone(),
        })),
        other => bail!(
            "{}: the simulator cannot execute `{}` actions yet",
            record.actor,
            other.kind()
        ),
    }
}
