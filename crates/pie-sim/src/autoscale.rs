//! The fleet: which worker slots run, and (with `--autoscale`) an autoscaler
//! that follows `scale-by-prop`'s hints as KEDA or an HPA would act on the
//! published gauge. Each slot is stopped, booting (started, loading its model:
//! not healthy, routed nothing), serving, or draining (taking no new requests,
//! finishing what it has, then stopped; its cached pages go with it).
//!
//! Rule: the autoscaler's target is the last `recommended` of the hint for
//! the group of unlabelled workers (`scale-by-prop`'s `default_group`: the
//! simulated workers carry no `group` label), clamped to `--scale-min` ..=
//! `--scale-max`. When the active workers (booting + serving) are fewer, it
//! starts workers in the lowest stopped slots (new slots past the last), each
//! serving `--scale-start-ms` later; when more, it stops booting ones first
//! (the newest: a Deployment deletes pods that are not ready first), then
//! drains the least loaded serving ones (ties: the highest slot). As the
//! Kubernetes HPA (and so KEDA) does by default, a step down waits out a
//! stabilisation window (`--scale-down-window-ms`, the HPA's default 300 s:
//! `behavior.scaleDown.stabilizationWindowSeconds`): the target is the
//! highest recommendation in effect during the window, so a step up is
//! followed at once and a step down once the window has passed without a
//! higher one. The actor steps one worker at a time, no further while the
//! step is pending (its `current`, serving workers, differs from its
//! recommendation) until `pending_timeout_ms`; the fleet follows it on
//! every actor tick, so its target, too, moves by at most one a tick.
//!
//! Worker-hours: the started workers (booting, serving or draining)
//! integrated over simulated time, for fixed fleets too (their size times
//! the run's length).

use pie_policy::cluster::WorkerHealth;
use serde::Serialize;

use crate::records::Record;

/// `--autoscale`'s settings.
#[derive(Clone, Debug, PartialEq)]
pub struct AutoscaleConfig {
    /// From start to serving (a worker loading its model).
    pub start_ms: u64,
    /// Bounds on the started workers.
    pub min_workers: usize,
    pub max_workers: usize,
    /// A step down follows the highest recommendation of this window (0:
    /// every hint as it comes).
    pub down_window_ms: u64,
}

impl Default for AutoscaleConfig {
    fn default() -> Self {
        Self {
            start_ms: 60_000,
            min_workers: 1,
            max_workers: 64,
            down_window_ms: 300_000,
        }
    }
}

/// A worker slot's state.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Life {
    /// Started at some time, serving at `up_us`.
    Booting {
        up_us: u64,
    },
    Serving,
    Draining,
    Stopped,
}

impl Life {
    pub fn started(self) -> bool {
        self != Life::Stopped
    }
}

/// What happened to a slot, when.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct FleetEvent {
    pub at_ms: f64,
    pub worker: String,
    /// `start`, `up` (serving), `cancel` (stopped while booting), `drain`,
    /// `stop` (a drained worker, empty).
    pub kind: &'static str,
    /// Started and serving workers after it.
    pub started: usize,
    pub serving: usize,
    /// The autoscaler's target then.
    pub target: usize,
}

/// The fleet over a run (present in the metrics when autoscaled).
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct FleetStats {
    pub initial_workers: usize,
    pub start_ms: u64,
    pub min_workers: usize,
    pub max_workers: usize,
    /// The fewest and most workers started at once.
    pub min_started: usize,
    pub max_started: usize,
    pub starts: usize,
    pub cancels: usize,
    pub drains: usize,
    pub stops: usize,
    /// Every change, in order.
    pub events: Vec<FleetEvent>,
    /// Requests arriving per second over the run, in `ARRIVAL_BUCKETS`
    /// buckets of `arrivals_bucket_s` (what the fleet followed).
    pub arrivals_bucket_s: f64,
    pub arrivals_per_s: Vec<f64>,
}

/// Buckets of [`FleetStats::arrivals_per_s`].
pub const ARRIVAL_BUCKETS: usize = 120;

impl FleetStats {
    /// The arrival rate over `0..end_us` from the records.
    pub fn arrivals(&mut self, records: &[Record], end_us: u64) {
        let bucket_us = (end_us as f64 / ARRIVAL_BUCKETS as f64).max(1.0);
        let mut counts = vec![0.0; ARRIVAL_BUCKETS];
        for r in records {
            let at = ((r.arrival_us as f64 / bucket_us) as usize).min(ARRIVAL_BUCKETS - 1);
            counts[at] += 1.0;
        }
        self.arrivals_bucket_s = bucket_us / 1e6;
        counts.iter_mut().for_each(|c| *c /= bucket_us / 1e6);
        self.arrivals_per_s = counts;
    }
}

/// The slots' states, the target, and the worker-time integral.
#[derive(Debug)]
pub struct Fleet {
    pub life: Vec<Life>,
    pub auto: Option<AutoscaleConfig>,
    pub target: usize,
    started: usize,
    serving: usize,
    since_us: u64,
    worker_us: f64,
    /// Recommendations (clamped) by time, first the one in effect at the
    /// window's start.
    hints: std::collections::VecDeque<(u64, usize)>,
    /// How many times each slot has stopped: which of its workers is
    /// there (a copy started to one fails if it is gone when it arrives).
    stops: Vec<u32>,
    pub stats: FleetStats,
}

impl Fleet {
    /// `workers` serving from the start.
    pub fn new(workers: usize, auto: Option<AutoscaleConfig>) -> Self {
        let stats = FleetStats {
            initial_workers: workers,
            start_ms: auto.as_ref().map_or(0, |a| a.start_ms),
            min_workers: auto.as_ref().map_or(workers, |a| a.min_workers),
            max_workers: auto.as_ref().map_or(workers, |a| a.max_workers),
            min_started: workers,
            max_started: workers,
            ..FleetStats::default()
        };
        Self {
            life: vec![Life::Serving; workers],
            auto,
            target: workers,
            started: workers,
            serving: workers,
            since_us: 0,
            worker_us: 0.0,
            hints: [(0, workers)].into(),
            stops: vec![0; workers],
            stats,
        }
    }

    /// A hint recommended `workers` (clamped to the bounds) at `at_us`.
    pub fn recommend(&mut self, at_us: u64, workers: usize) {
        if let Some(a) = &self.auto {
            self.hints
                .push_back((at_us, workers.clamp(a.min_workers, a.max_workers)));
        }
    }

    /// The target at `at_us`: the highest recommendation in effect during
    /// the scale-down window before it.
    pub fn wanted(&mut self, at_us: u64) -> usize {
        let window_us = self.auto.as_ref().map_or(0, |a| a.down_window_ms * 1000);
        let start = at_us.saturating_sub(window_us);
        while self.hints.len() > 1 && self.hints[1].0 <= start {
            self.hints.pop_front();
        }
        (self.hints.iter().map(|h| h.1).max()).unwrap_or(self.target)
    }

    pub fn started(&self) -> usize {
        self.started
    }

    /// Booting or serving workers: what the autoscaler holds to its target
    /// (a draining one is on its way out).
    pub fn active(&self) -> usize {
        (self.life.iter())
            .filter(|l| matches!(l, Life::Booting { .. } | Life::Serving))
            .count()
    }

    pub fn is_serving(&self, w: usize) -> bool {
        self.life[w] == Life::Serving
    }

    /// Slot `w` becomes `life` at `now_us`; `kind` names the change in the log.
    pub fn set(&mut self, w: usize, life: Life, now_us: u64, kind: &'static str) {
        self.worker_us += self.started as f64 * now_us.saturating_sub(self.since_us) as f64;
        self.since_us = self.since_us.max(now_us);
        if w == self.life.len() {
            self.life.push(Life::Stopped);
            self.stops.push(0);
        }
        let old = self.life[w];
        self.life[w] = life;
        if old.started() && !life.started() {
            self.stops[w] += 1;
        }
        self.started = self.started + usize::from(life.started()) - usize::from(old.started());
        self.serving =
            self.serving + usize::from(life == Life::Serving) - usize::from(old == Life::Serving);
        let s = &mut self.stats;
        s.min_started = s.min_started.min(self.started);
        s.max_started = s.max_started.max(self.started);
        match kind {
            "start" => s.starts += 1,
            "cancel" => s.cancels += 1,
            "drain" => s.drains += 1,
            "stop" => s.stops += 1,
            _ => {}
        }
        s.events.push(FleetEvent {
            at_ms: now_us as f64 / 1000.0,
            worker: format!("w{w}"),
            kind,
            started: self.started,
            serving: self.serving,
            target: self.target,
        });
    }

    /// How many times slot `w` has stopped (its worker's incarnation).
    pub fn stops(&self, w: usize) -> u32 {
        self.stops[w]
    }

    /// The started workers as the fleet's events see them
    /// (`pie_policy::cluster::health_events`), as the actors' snapshot
    /// lists them: a booting one is not healthy, a draining one is
    /// draining, a stopped one is gone.
    pub fn health(&self) -> Vec<WorkerHealth> {
        (self.life.iter().enumerate())
            .filter(|(_, l)| l.started())
            .map(|(w, &l)| WorkerHealth {
                name: format!("w{w}"),
                healthy: !matches!(l, Life::Booting { .. }),
                draining: l == Life::Draining,
            })
            .collect()
    }

    /// The slot the next start takes: the lowest stopped one, else a new one.
    pub fn free_slot(&self) -> usize {
        (self.life.iter().position(|l| *l == Life::Stopped)).unwrap_or(self.life.len())
    }

    /// Worker-hours up to `end_us`.
    pub fn worker_hours(&self, end_us: u64) -> f64 {
        let tail = self.started as f64 * end_us.saturating_sub(self.since_us) as f64;
        (self.worker_us + tail) / 3.6e9
    }
}
