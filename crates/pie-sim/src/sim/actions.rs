//! The actors in the simulation: every tick due, over a snapshot of the
//! simulated cluster as the controller builds it, and every event (the
//! fleet's changes, failed actions) as it happens; each action they return
//! handed to the feature that carries it out (`migrate.rs`, `copies.rs`,
//! `pool.rs`, `disk.rs`, `autoscale.rs`); `RetainSpill` is set here.

use pie_policy::cluster::{
    health_events, Action, ActionRecord, ClusterEvent, ClusterSnapshot, KvPages, ProcessState,
    Tier, WorkerHealth, WorkerState,
};

use crate::autoscale::Life;
use crate::copies::hot_prefixes;
use crate::pages::slot;

use super::Sim;

impl Sim<'_> {
    /// Every actor tick due by `now`, each over the cluster as it stands.
    pub(super) fn tick_actors(&mut self, now: u64) -> anyhow::Result<()> {
        while let Some(at) = self.actors.as_ref().and_then(|a| a.due(now)) {
            let snapshot = self.snapshot(at);
            let Some(actors) = &mut self.actors else {
                break;
            };
            for record in actors.tick(at, &snapshot) {
                self.execute(record, at, now)?;
            }
            if self.cfg.autoscale.is_some() {
                self.reconcile(at, now)?;
            }
        }
        Ok(())
    }

    /// The fleet changed at `now` since it was `before`: its events
    /// (`health_events`) go to the actors, one by one.
    pub(super) fn fleet_changed(
        &mut self,
        before: &[WorkerHealth],
        now: u64,
    ) -> anyhow::Result<()> {
        for event in health_events(before, &self.fleet.health()) {
            self.deliver(event, now)?;
        }
        Ok(())
    }

    /// `event` at `now` to the actors (if any), over the cluster as it
    /// stands; their actions are carried out at once.
    pub(super) fn deliver(&mut self, event: ClusterEvent, now: u64) -> anyhow::Result<()> {
        if self.actors.is_none() {
            return Ok(());
        }
        let snapshot = self.snapshot(now);
        let Some(actors) = &mut self.actors else {
            return Ok(());
        };
        for record in actors.event(now, &event, &snapshot) {
            self.execute(record, now, now)?;
        }
        Ok(())
    }

    /// Carry out an actor's action at `now` (a scale hint counts from the
    /// tick at `at`); an action the simulator cannot carry out stops the run
    /// with an error naming it.
    fn execute(&mut self, record: ActionRecord, at: u64, now: u64) -> anyhow::Result<()> {
        match record.action {
            Action::MigrateProcess { process, from, to } => self.migrate(&process, &from, &to, now),
            Action::CopyPrefix { blocks, from, to } => self.copy_prefix(blocks, &from, &to, now),
            Action::CopyPrefixToPool { blocks, from } => self.copy_to_pool(blocks, &from, now),
            Action::PersistPrefix { blocks, worker } => self.persist_prefix(blocks, &worker, now),
            Action::RetainSpill { worker, to } => self.retain_spill(&worker, to),
            Action::ScaleHint(h) => {
                self.scale_hint(&h.group, h.recommended, at);
                Ok(())
            }
            other @ Action::DrainWorker { .. } => anyhow::bail!(
                "{}: the simulator cannot execute `{}` actions yet",
                record.actor,
                other.kind()
            ),
        }
    }

    /// The cluster as an actor sees it: every worker with its load and pages,
    /// every sequence with its props, the hot prefixes (when tracked) at
    /// `at_us`. A migrating process in its pause is on no worker's list
    /// (nothing can act on it then); its load counts on its target already.
    /// As the controller lists them: a booting worker is not healthy (its
    /// `/health` answers 503 while the model loads), a draining one is
    /// draining, a stopped one is gone.
    pub(super) fn snapshot(&self, at_us: u64) -> ClusterSnapshot {
        let total = self.cfg.profile.kv_pages;
        let mut snapshot = ClusterSnapshot::default();
        for (w, worker) in self.workers.iter().enumerate() {
            let life = self.fleet.life[w];
            if life == Life::Stopped {
                continue;
            }
            let name = format!("w{w}");
            snapshot.workers.push(WorkerState {
                name: name.clone(),
                healthy: !matches!(life, Life::Booting { .. }),
                draining: life == Life::Draining,
                load: self.router.load(w),
                stage: self.router.views()[w].stage,
                max_running: self.cfg.profile.max_running,
                kv_pages: Some(KvPages {
                    used: total - worker.pages.free_pages() - worker.pages.cache.evictable(),
                    total,
                }),
                retain_spill: worker.pages.spill,
                ..WorkerState::default()
            });
            for c in worker.scheduler.candidates() {
                let req = worker.pages.seq(slot(c.seq)).req;
                snapshot.processes.push(ProcessState {
                    id: format!("request-{req}"),
                    worker: Some(name.clone()),
                    props: c.props.clone(),
                });
            }
        }
        if let Some(heat) = &self.heat {
            let caches = self.workers.iter().map(|w| &w.pages.cache);
            snapshot.hot_prefixes =
                hot_prefixes(heat, at_us / 1000, self.cfg.profile.page_size, caches);
            if let Some(disks) = &self.disks {
                for hot in &mut snapshot.hot_prefixes {
                    hot.persisted = (0..self.workers.len())
                        .filter(|&w| self.fleet.life[w] != Life::Stopped)
                        .map(|w| (format!("w{w}"), disks.store(w).leading(&hot.blocks)))
                        .filter(|&(_, n)| n > 0)
                        .collect();
                }
            }
        }
        snapshot
    }

    /// The index of worker `name` (`w3`); an unknown or stopped one is an
    /// error.
    pub(super) fn worker_named(&self, name: &str) -> anyhow::Result<usize> {
        name.strip_prefix('w')
            .and_then(|n| n.parse::<usize>().ok())
            .filter(|&w| w < self.workers.len() && self.fleet.life[w].started())
            .ok_or_else(|| anyhow::anyhow!("no worker `{name}`"))
    }

    /// Carry out a `RetainSpill` (`retain-all`): worker `name` spills the
    /// retained sessions it evicts early to the pool from now on.
    pub(super) fn retain_spill(&mut self, name: &str, to: Tier) -> anyhow::Result<()> {
        let w = self
            .worker_named(name)
            .map_err(|e| anyhow::anyhow!("retain-spill: {e}"))?;
        let (pool, disk) = (self.pool.is_some(), self.disks.is_some());
        let lacks = match to {
            Tier::Pool => (!pool).then_some("pool"),
            Tier::Disk => (!disk).then_some("disk tier"),
            Tier::Any => (!pool && !disk).then_some("pool or disk tier"),
        };
        if let Some(what) = lacks {
            anyhow::bail!("retain-spill: `{name}` has no {what} to spill to");
        }
        self.workers[w].pages.spill = Some(to);
        Ok(())
    }
}
