//! Cluster actors in the simulator: the same `ActorRunner` (and actors) that
//! `pie-controller` runs, ticked every `actor_tick_ms` of simulated time over a
//! snapshot of the simulated workers. Actions are executed as the controller
//! executes them: a scale hint is published (kept in the run's metrics; with
//! `--autoscale` the fleet follows it, `autoscale.rs`); a
//! `MigrateProcess` moves the process with its KV (`sim/migrate.rs`, costed as
//! `migrate.rs` says); a `CopyPrefix` sends the prefix's pages to the target
//! (`copies.rs`); a `CopyPrefixToPool` (`pool-replicate`) pushes them to the
//! pool and a `RetainSpill` (`retain-all`) makes the worker spill retained
//! sessions to it (`pool.rs`: both need `--pool-pages`); an action this
//! executor cannot carry out stops the run with an error naming it, never
//! silently. A `PersistPrefix` (`persist-prefix`) writes the prefix to the
//! worker's disk and a `RetainSpill` to `disk` spills there (`disk.rs`: both
//! need `--disk-pages`). Dry-run records are kept, not executed. Events
//! reach the actors as they reach the controller's (`ActorRunner::event`):
//! the fleet's (`health_events` whenever it changes: a worker serving,
//! draining, stopped) and `ActionFailed` (a copy whose target stopped).

use anyhow::{bail, Context, Result};
use pie_policy::cluster::{
    Action, ActionRecord, ActorConfigs, ActorRunner, ClusterEvent, ClusterSnapshot, Tier,
};
use serde::{de::DeserializeOwned, Serialize};

/// The actors of a pipeline and when they look next.
pub struct SimActors {
    runner: ActorRunner,
    tick_us: u64,
    next_tick_us: u64,
    /// Every action recorded, in order (dry-run ones included).
    pub records: Vec<ActionRecord>,
    /// Every action that failed, in order.
    pub failures: Vec<FailedAction>,
}

/// An action the simulation carried out and that failed (the actors heard
/// `ActionFailed`).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct FailedAction {
    pub at_ms: u64,
    pub action: Action,
    pub error: String,
}

impl SimActors {
    /// None when `names` is empty (no actor, no ticks). `pool`: the run has
    /// a pool (`--pool-pages`), which `pool-replicate` needs; `disk`: the
    /// workers have a disk tier (`--disk-pages`), which `persist-prefix`
    /// needs; `retain-all` needs the tier its `to` names (`any`: either).
    pub fn new(
        names: &[&str],
        configs: &ActorConfigs,
        tick_ms: u64,
        pool: bool,
        disk: bool,
    ) -> Result<Option<Self>> {
        if names.is_empty() {
            return Ok(None);
        }
        anyhow::ensure!(tick_ms > 0, "the actor tick must be positive");
        // They would run and never act (or every action would fail).
        anyhow::ensure!(
            disk || !names.contains(&"persist-prefix"),
            "persist-prefix: the simulated workers have no disk tier: give --disk-pages N"
        );
        anyhow::ensure!(
            pool || !names.contains(&"pool-replicate"),
            "pool-replicate: the simulated workers have no pool: give --pool-pages N"
        );
        if names.contains(&"retain-all") {
            match configs.retain_all.to {
                Tier::Pool => anyhow::ensure!(
                    pool,
                    "retain-all: the simulated workers have no pool: give --pool-pages N"
                ),
                Tier::Disk => anyhow::ensure!(
                    disk,
                    "retain-all: to = disk: the simulated workers have no disk tier: give --disk-pages N"
                ),
                Tier::Any => anyhow::ensure!(
                    pool || disk,
                    "retain-all: the simulated workers have no pool: give --pool-pages N (or a disk tier: --disk-pages N)"
                ),
            }
        }
        let runner = ActorRunner::new(names, configs).map_err(anyhow::Error::msg)?;
        Ok(Some(Self {
            runner,
            tick_us: tick_ms * 1000,
            next_tick_us: 0,
            records: Vec::new(),
            failures: Vec::new(),
        }))
    }

    /// Whether an actor reads the snapshot's hot prefixes (the simulation
    /// then tracks them).
    pub fn reads_hot_prefixes(&self) -> bool {
        self.runner.reads_hot_prefixes()
    }

    /// The next tick, if it is due by `now_us`.
    pub fn due(&self, now_us: u64) -> Option<u64> {
        (self.next_tick_us <= now_us).then_some(self.next_tick_us)
    }

    /// The actors look at `snapshot` (taken at `at_us`); their actions are
    /// recorded, and those the simulation must carry out (all but dry-run
    /// ones) returned in order.
    pub fn tick(&mut self, at_us: u64, snapshot: &ClusterSnapshot) -> Vec<ActionRecord> {
        self.next_tick_us = at_us + self.tick_us;
        let records = self.runner.tick(at_us / 1000, snapshot);
        self.keep(records)
    }

    /// The actors' reaction to `event` at `now_us` (the cluster as
    /// `snapshot` shows it then): recorded, and those to carry out returned
    /// in order, as for a tick. A failed action is kept in `failures`.
    pub fn event(
        &mut self,
        now_us: u64,
        event: &ClusterEvent,
        snapshot: &ClusterSnapshot,
    ) -> Vec<ActionRecord> {
        if let ClusterEvent::ActionFailed { action, error } = event {
            self.failures.push(FailedAction {
                at_ms: now_us / 1000,
                action: action.clone(),
                error: error.clone(),
            });
        }
        let records = self.runner.event(now_us / 1000, event, snapshot);
        self.keep(records)
    }

    /// Record `records`; those to carry out, in order.
    fn keep(&mut self, records: Vec<ActionRecord>) -> Vec<ActionRecord> {
        let out = (records.iter()).filter(|r| !r.dry_run).cloned().collect();
        self.records.extend(records);
        out
    }
}

/// `--actor-set ACTOR.KEY=VALUE` (as `[cluster.ACTOR] KEY = VALUE` in the
/// controller's config; the value in JSON, else taken as a string): each
/// replaces one key of `configs`. An unknown actor or key, or a value of the
/// wrong type, is an error naming it.
pub fn apply_overrides(configs: &mut ActorConfigs, overrides: &[String]) -> Result<()> {
    for item in overrides {
        let (path, raw) = item
            .split_once('=')
            .with_context(|| format!("--actor-set `{item}` is not ACTOR.KEY=VALUE"))?;
        let (name, key) = path
            .split_once('.')
            .with_context(|| format!("--actor-set `{item}` is not ACTOR.KEY=VALUE"))?;
        let value = serde_json::from_str(raw)
            .unwrap_or_else(|_| serde_json::Value::String(raw.to_string()));
        match name {
            "scale-by-prop" => set_key(&mut configs.scale_by_prop, key, value),
            "rebalance" => set_key(&mut configs.rebalance, key, value),
            "replicate" => set_key(&mut configs.replicate, key, value),
            "pool-replicate" => set_key(&mut configs.pool_replicate, key, value),
            "retain-all" => set_key(&mut configs.retain_all, key, value),
            "persist-prefix" => set_key(&mut configs.persist_prefix, key, value),
            other => bail!(
                "--actor-set: no configurable actor `{other}` (scale-by-prop, rebalance, replicate, pool-replicate, retain-all, persist-prefix)"
            ),
        }
        .with_context(|| format!("--actor-set `{item}`"))?;
    }
    Ok(())
}

fn set_key<T: Serialize + DeserializeOwned>(
    config: &mut T,
    key: &str,
    value: serde_json::Value,
) -> Result<()> {
    let mut json = serde_json::to_value(&*config)?;
    let table = json.as_object_mut().context("a config is a table")?;
    if !table.contains_key(key) {
        let known: Vec<&str> = table.keys().map(String::as_str).collect();
        bail!("no key `{key}` (keys: {})", known.join(", "));
    }
    table.insert(key.to_string(), value);
    *config = serde_json::from_value(json).map_err(|e| anyhow::anyhow!("`{key}`: {e}"))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use pie_policy::cluster::RebalanceSignal;

    #[test]
    fn an_actor_the_simulator_cannot_model_is_refused_at_start() {
        let refused = |names: &[&str], configs: &ActorConfigs, pool: bool| {
            SimActors::new(names, configs, 100, pool, false)
                .err()
                .expect("refused")
                .to_string()
        };
        let defaults = ActorConfigs::default();
        let err = refused(&["persist-prefix"], &defaults, true);
        assert!(
            err.contains("disk tier") && err.contains("--disk-pages"),
            "{err}"
        );
        assert!(SimActors::new(&["persist-prefix"], &defaults, 100, false, true).is_ok());
        for name in ["pool-replicate", "retain-all"] {
            let err = refused(&[name], &defaults, false);
            assert!(
                err.starts_with(name) && err.contains("--pool-pages"),
                "{err}"
            );
            assert!(SimActors::new(&[name], &defaults, 100, true, false).is_ok());
        }
        // retain-all to any: a disk tier will do.
        assert!(SimActors::new(&["retain-all"], &defaults, 100, false, true).is_ok());
        let mut disk = ActorConfigs::default();
        disk.retain_all.to = Tier::Disk;
        let err = refused(&["retain-all"], &disk, true);
        assert!(
            err.contains("to = disk") && err.contains("--disk-pages"),
            "{err}"
        );
        assert!(SimActors::new(&["retain-all"], &disk, 100, false, true).is_ok());
    }

    #[test]
    fn overrides_set_actor_keys_and_name_bad_ones() {
        let mut c = ActorConfigs::default();
        let set = |items: &[&str]| items.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        apply_overrides(
            &mut c,
            &set(&[
                "rebalance.signal=kv",
                "rebalance.high=0.8",
                "scale-by-prop.prop=tier2",
                "retain-all.to=pool",
                "pool-replicate.min_hits=2",
            ]),
        )
        .expect("valid");
        assert_eq!(c.rebalance.signal, RebalanceSignal::Kv);
        assert_eq!(c.rebalance.high, 0.8);
        assert_eq!(c.scale_by_prop.prop, "tier2");
        assert_eq!(c.retain_all.to, Tier::Pool);
        assert_eq!(c.pool_replicate.min_hits, 2);
        let err = |item: &str| {
            let e = apply_overrides(&mut ActorConfigs::default(), &set(&[item])).unwrap_err();
            format!("{e:#}")
        };
        assert!(err("rebalance.hgh=1").contains("no key `hgh`"));
        assert!(err("rebalance.signal=bytes").contains("`signal`"));
        assert!(err("drain.x=1").contains("`drain`"));
        assert!(err("rebalance").contains("ACTOR.KEY=VALUE"));
    }
}
