//! Autoscaling in the simulation (`--autoscale`; the fleet's bookkeeping is
//! `crate::autoscale`): scale hints set the fleet's target, workers start
//! (booting, then serving) or drain (then stop when empty) to meet it.
//! Every change of the fleet goes to the actors as the controller's events
//! (`health_events`): a worker serving joined, one draining is draining, one
//! stopped left.

use crate::autoscale::Life;
use crate::events::Event;
use crate::machine::SharedMachine;

use super::{new_worker, Sim};

impl Sim<'_> {
    /// A scale hint at `at`: with `--autoscale`, the unlabelled workers'
    /// group's recommendation is the fleet's (`autoscale.rs`).
    pub(super) fn scale_hint(&mut self, group: &str, recommended: usize, at: u64) {
        if group == self.cfg.actor_configs.scale_by_prop.default_group {
            self.fleet.recommend(at, recommended);
        }
    }

    /// After the actors' tick at `at`: the fleet's target from the
    /// recommendations, workers started or stopped to meet it at `now`.
    pub(super) fn reconcile(&mut self, at: u64, now: u64) -> anyhow::Result<()> {
        self.fleet.target = self.fleet.wanted(at);
        while self.fleet.active() < self.fleet.target {
            self.start_worker(now)?;
        }
        while self.fleet.active() > self.fleet.target {
            self.scale_in(now)?;
        }
        Ok(())
    }

    /// Start a worker in the lowest stopped slot (a new one past the last):
    /// empty, serving `start_ms` from now.
    pub(super) fn start_worker(&mut self, now: u64) -> anyhow::Result<()> {
        let auto = (self.cfg.autoscale.as_ref()).ok_or_else(|| anyhow::anyhow!("no autoscaler"))?;
        let up_us = now + auto.start_ms * 1000;
        let w = self.fleet.free_slot();
        let before = self.fleet.health();
        let track = self.router.tracks_prefixes();
        let fresh = new_worker(self.cfg, self.policy, track);
        if w == self.workers.len() {
            self.workers.push(fresh);
            let added = self.router.add_worker(self.cfg.profile.max_running);
            debug_assert_eq!(added, w);
            self.links.grow(w + 1);
            self.send_links.grow(w + 1);
            self.awaiting.push(Vec::new());
            self.spills_in_flight.push(0);
            if let Some(disks) = &mut self.disks {
                disks.grow(w + 1);
            }
            if let Some(m) = self.machine_of(w) {
                if m == self.machines.len() {
                    self.machines.push(SharedMachine::default());
                }
            }
        } else {
            let old = std::mem::replace(&mut self.workers[w], fresh);
            self.counters.preemptions += old.scheduler.preemptions();
        }
        self.fleet.set(w, Life::Booting { up_us }, now, "start");
        self.events.push(up_us, Event::WorkerUp(w as u32));
        self.fleet_changed(&before, now)
    }

    /// Worker `w` is done booting at `now` (unless it was stopped, or
    /// stopped and started again, meanwhile): it serves, and the actors hear
    /// it joined.
    pub(super) fn worker_up(&mut self, w: usize, now: u64) -> anyhow::Result<()> {
        if self.fleet.life[w] != (Life::Booting { up_us: now }) {
            return Ok(());
        }
        let before = self.fleet.health();
        self.fleet.set(w, Life::Serving, now, "up");
        self.router.set_serving(w, true);
        self.fleet_changed(&before, now)
    }

    /// One worker fewer: the newest booting one stops at once, else the
    /// least loaded serving one (ties: the highest slot) drains (the actors
    /// hear it, then it stops if it has nothing left).
    pub(super) fn scale_in(&mut self, now: u64) -> anyhow::Result<()> {
        let before = self.fleet.health();
        let life = &self.fleet.life;
        let booting = (0..life.len())
            .filter_map(|w| match life[w] {
                Life::Booting { up_us } => Some((up_us, w)),
                _ => None,
            })
            .max()
            .map(|(_, w)| w);
        if let Some(w) = booting {
            self.fleet.set(w, Life::Stopped, now, "cancel");
            return self.fleet_changed(&before, now);
        }
        let Some(w) = (0..life.len())
            .filter(|&w| life[w] == Life::Serving)
            .min_by_key(|&w| (self.router.load(w), std::cmp::Reverse(w)))
        else {
            return Ok(());
        };
        self.fleet.set(w, Life::Draining, now, "drain");
        self.router.set_serving(w, false);
        self.fleet_changed(&before, now)?;
        self.stop_if_drained(w, now)
    }

    /// A draining worker with nothing left (no request routed to it, none
    /// queued or running, no step in flight) stops: its pages and retained
    /// sessions go with it, and the actors hear it left.
    pub(super) fn stop_if_drained(&mut self, w: usize, now: u64) -> anyhow::Result<()> {
        let worker = &self.workers[w];
        if self.fleet.life[w] != Life::Draining
            || self.router.load(w) > 0
            || !worker.scheduler.is_empty()
            || worker.step_end.is_some()
        {
            return Ok(());
        }
        let before = self.fleet.health();
        self.fleet.set(w, Life::Stopped, now, "stop");
        let track = self.router.tracks_prefixes();
        let fresh = new_worker(self.cfg, self.policy, track);
        let old = std::mem::replace(&mut self.workers[w], fresh);
        self.counters.preemptions += old.scheduler.preemptions();
        self.router.forget(w);
        self.fleet_changed(&before, now)
    }
}
