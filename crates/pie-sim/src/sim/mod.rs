//! The discrete-event simulation: N workers behind a router, each running a real
//! `pie-policy` ordering policy (and `KeepSession` when configured) over a
//! modelled page pool and prefix cache, with step times from the cost model.
//!
//! Owns the event loop (events from `events.rs`; routing goes through
//! `router.rs`, the real cluster policies), and each worker's step, which mirrors `pie-worker`'s engine plan:
//! the policy orders every sequence on the worker; in that order each gets a
//! prefill chunk or one decode token while `max_batch_tokens` lasts; a sequence
//! not yet running needs a free slot under `max_running` (or, if the policy
//! preempts for slots, takes the slot of the last running one) and first shares
//! the longest cached prefix of its tokens; when pages run out, unreferenced
//! cached pages go (LRU), then retained sessions (soonest expiry first), then the
//! running sequence ordered last is preempted and recomputed later. The step's
//! tokens take effect when it ends: full pages are published to the prefix cache,
//! sampled tokens counted, the policy charged, finished sequences released or
//! retained for their session. Workers may share a host (`machine.rs`): their
//! concurrent steps then split its speed. With prefill-stage workers
//! (`disaggregate.rs`), a request the router prefills remotely is first a
//! prefill-only sequence on the prefill worker; when its prompt is computed its
//! full pages travel to the decode worker's prefix cache (a transfer event), and
//! it is then admitted there like a new arrival that finds its prefix cached.
//! A `MigrateProcess` action (`rebalance`) moves a queued or running process to
//! another worker in copy stages and a short pause (`migrate.rs`): it leaves the
//! source at a step boundary, its pages reach the target's prefix cache, and it
//! joins the target's queue with the tokens it generated so far.
//! With a shared pool (`--pool-pages`, `pool.rs`) every worker pulls, before
//! admitting an arrival, the leading pages of its prompt the pool holds past
//! its own cached prefix (over its receiving link; the request joins the
//! queue when they arrive and attaches them as cached); pushes to the pool (a
//! `retain-all` spill: a retained session evicted before its expiry; a
//! `CopyPrefixToPool` from `pool-replicate`) cross the sender's link without
//! holding up its steps and become readable when they arrive.
//! With a disk tier (`--disk-pages`, `disk.rs`) each worker first loads
//! the leading pages of an arrival's prompt its own disk holds past its
//! cached prefix (then pulls from the pool past those); `PersistPrefix`
//! (`persist-prefix`) and spills to disk (`retain-all`) are written to the
//! worker's disk, queued on it, without holding up its steps.
//! With `--autoscale` (`autoscale.rs`) the fleet follows `scale-by-prop`'s
//! hints: a started worker (a new or reused slot, empty) serves after its
//! start-up delay; a drained one takes no new requests, finishes what it
//! has, then stops, its cached pages (and retained sessions) gone with it.
//!
//! This file owns the state ([`Sim`]), its construction and the event loop;
//! each job is an `impl Sim` block of its own file: arrivals and routing
//! (`arrive.rs`), a worker's step (`step.rs`), the actors' actions
//! (`actions.rs`), and each feature's behaviour in the file named after it
//! (`disaggregate.rs`, `migrate.rs`, `copies.rs`, `pool.rs`, `disk.rs`,
//! `autoscale.rs`), whose cost models and counters are the crate's modules of
//! the same names.

mod actions;
mod arrive;
mod autoscale;
mod copies;
mod disaggregate;
mod disk;
mod in_transit;
mod migrate;
mod pool;
mod step;

use std::collections::{BTreeMap, HashMap};

use pie_core::{BlockHash, ModelFingerprint, SeqId};
use pie_policy::cluster::{ActionRecord, PrefixHeat};
use pie_policy::{KeepSession, Planned, Scheduler, StepLimits, WorkerPolicy};

use crate::actors::{FailedAction, SimActors};
use crate::autoscale::{Fleet, FleetStats};
use crate::config::SimConfig;
use crate::copies::PrefixCopy;
use crate::counters::Counters;
use crate::disaggregate::Links;
use crate::disk::Disks;
use crate::events::{Event, Events};
use crate::jitter::StepJitter;
use crate::machine::SharedMachine;
use crate::migrate::Migration;
use crate::pages::{Seq, WorkerPages};
use crate::pool::Pool;
use crate::records::Record;
use crate::router::Router;
use crate::schedule::Schedule;
use crate::workload::Request;
use pie_policy::cluster::HEAT_CAPACITY;

use self::in_transit::{DiskWrite, PoolPush, Pull};

struct Worker {
    scheduler: Scheduler,
    pages: WorkerPages,
    /// The running step.
    plan: Vec<Planned>,
    /// When the running step (or a pending wake-up) ends; None while idle.
    /// Step-end events at other times are stale (a shared machine moved the end).
    step_end: Option<u64>,
    /// When its last step ended; None before its first.
    last_step_end: Option<u64>,
}

struct Sim<'a> {
    cfg: &'a SimConfig,
    reqs: &'a [Request],
    /// Makes a worker's ordering policy (a started worker gets a fresh one).
    policy: &'a dyn Fn() -> Box<dyn WorkerPolicy>,
    workers: Vec<Worker>,
    /// Which slots run (`autoscale.rs`).
    fleet: Fleet,
    /// Sequences admitted so far: the high bits of the next `SeqId`.
    arrivals: u64,
    records: Vec<Record>,
    followers: Vec<Option<u32>>,
    events: Events,
    /// Hosts of `workers_per_machine` workers each; empty when every worker has
    /// its own.
    machines: Vec<SharedMachine>,
    /// Each step's variance around the profile's cost (`jitter.rs`).
    jitter: StepJitter,
    router: Router,
    /// Hashes of first prompt segments that are whole pages (bounded; cleared when
    /// full), so shared system prompts are hashed once.
    memo: HashMap<(u64, u32), Vec<BlockHash>>,
    /// A later turn's first hashes: those of the turn it continues, left by its
    /// finish.
    carried: Vec<Option<Vec<BlockHash>>>,
    client_ids: HashMap<String, u32>,
    counters: Counters,
    /// Service up to the last open-loop arrival is counted per client.
    window_end_us: u64,
    tokens: Vec<u32>,
    /// Pages a step filled (hash, sequence, page index), published when it
    /// ends (a reused buffer).
    published: Vec<(BlockHash, SeqId, u32)>,
    /// Steps and admissions, when [`run_schedule`] asks for them.
    log: Option<Schedule>,
    /// The router's actors, if it lists any.
    actors: Option<SimActors>,
    /// The decode workers' receiving links for prefilled pages.
    links: Links,
    /// Prefilled requests whose pages are on their way to the decode worker.
    in_transfer: HashMap<u32, Seq>,
    /// Migrations in progress by request.
    migrations: BTreeMap<u32, Migration>,
    /// Per worker: migrating requests whose copy stage ended, to be looked at
    /// at its next step boundary.
    awaiting: Vec<Vec<u32>>,
    /// Migrating requests that left their source, in their pause, with the
    /// leading pages of theirs the target gets.
    paused: BTreeMap<u32, (Seq, usize)>,
    /// Routed prompts' blocks, while an actor reads hot prefixes.
    heat: Option<PrefixHeat>,
    /// Prefix copies on their way, by number (`counters.copies.copies` at
    /// their start).
    copies: BTreeMap<u32, PrefixCopy>,
    /// The shared page pool, with `--pool-pages`.
    pool: Option<Pool>,
    /// The workers' sending links (pushes to the pool).
    send_links: Links,
    /// Arrivals whose pages are coming from the pool, by request.
    pulling: HashMap<u32, Pull>,
    /// Pushes on their way to the pool, by number.
    pushes: BTreeMap<u32, PoolPush>,
    pushed: u32,
    /// Per worker: its spills on their way to the pool or its disk.
    spills_in_flight: Vec<usize>,
    /// The workers' disks, with `--disk-pages`.
    disks: Option<Disks>,
    /// Writes on their way to a disk, by number.
    disk_writes: BTreeMap<u32, DiskWrite>,
    disk_written: u32,
}

const FINGERPRINT: ModelFingerprint = ModelFingerprint(0x51_u64);
const MEMO_CAPACITY: usize = 4096;

/// What a finished simulation leaves for its metrics.
pub struct Outcome {
    /// Every request's record, in workload order.
    pub records: Vec<Record>,
    /// The clients' names by their dense ids.
    pub clients: Vec<String>,
    pub counters: Counters,
    /// The actors' actions, in order, and those that failed.
    pub actions: Vec<ActionRecord>,
    pub failed_actions: Vec<FailedAction>,
    /// Started workers integrated over the run.
    pub worker_hours: f64,
    /// The autoscaled fleet's figures (`--autoscale`).
    pub fleet: Option<FleetStats>,
}

/// Simulate `reqs` on the configured cluster, each worker's ordering policy
/// made by `policy`: every request finishes (or is rejected or aborted).
pub fn simulate(
    cfg: &SimConfig,
    reqs: &[Request],
    policy: &dyn Fn() -> Box<dyn WorkerPolicy>,
) -> anyhow::Result<Outcome> {
    cfg.validate()?;
    let mut sim = Sim::new(cfg, reqs, policy);
    sim.run()?;
    Ok(sim.outcome())
}

/// [`simulate`] of one worker, logged step by step.
pub fn run_schedule(
    cfg: &SimConfig,
    reqs: &[Request],
    policy: &dyn Fn() -> Box<dyn WorkerPolicy>,
) -> anyhow::Result<Schedule> {
    anyhow::ensure!(
        cfg.workers == 1 && cfg.workers_per_machine == 1 && cfg.autoscale.is_none(),
        "a schedule is logged for one worker on its own machine"
    );
    cfg.validate()?;
    let mut sim = Sim::new(cfg, reqs, policy);
    sim.log = Some(Schedule::default());
    sim.run()?;
    let mut schedule = sim.log.take().unwrap_or_default();
    schedule.records = sim.records;
    schedule.preemptions = sim.workers[0].scheduler.preemptions();
    Ok(schedule)
}

/// A fresh worker: its own scheduler (policy, limits, keep-session) and an
/// empty page model.
fn new_worker(cfg: &SimConfig, policy: &dyn Fn() -> Box<dyn WorkerPolicy>, track: bool) -> Worker {
    let limits = StepLimits {
        max_batch_tokens: cfg.profile.max_batch_tokens,
        max_running: cfg.profile.max_running,
    };
    let mut scheduler = Scheduler::new(policy(), limits);
    let keep = cfg
        .keep_session
        .then(|| KeepSession::new(cfg.runtime.keep_session.clone()));
    scheduler.set_keep_session(keep);
    Worker {
        scheduler,
        pages: WorkerPages::new(cfg.profile.page_size, cfg.profile.kv_pages, track),
        plan: Vec::new(),
        step_end: None,
        last_step_end: None,
    }
}
impl<'a> Sim<'a> {
    fn new(
        cfg: &'a SimConfig,
        reqs: &'a [Request],
        policy: &'a dyn Fn() -> Box<dyn WorkerPolicy>,
    ) -> Self {
        let router = Router::new(&cfg.router, cfg.workers, cfg.profile.page_size)
            .staged(cfg.prefill_workers, cfg.profile.max_running);
        let track = router.tracks_prefixes();
        let workers = (0..cfg.workers)
            .map(|_| new_worker(cfg, policy, track))
            .collect();
        let mut followers = vec![None; reqs.len()];
        for (i, r) in reqs.iter().enumerate() {
            if let Some(f) = r.follows {
                if let Some(slot) = followers.get_mut(f.request) {
                    *slot = Some(i as u32);
                }
            }
        }
        let window_end_us = reqs
            .iter()
            .filter(|r| r.follows.is_none())
            .map(|r| r.arrival_us)
            .max()
            .unwrap_or(0);
        Self {
            cfg,
            reqs,
            policy,
            workers,
            fleet: Fleet::new(cfg.workers, cfg.autoscale.clone()),
            arrivals: 0,
            records: vec![Record::default(); reqs.len()],
            followers,
            events: Events::new(reqs),
            machines: match cfg.workers_per_machine {
                1 => Vec::new(),
                n => (0..cfg.workers.div_ceil(n))
                    .map(|_| SharedMachine::default())
                    .collect(),
            },
            jitter: StepJitter::new(&cfg.profile, cfg.seed),
            router,
            memo: HashMap::new(),
            carried: vec![None; reqs.len()],
            client_ids: HashMap::new(),
            counters: Counters::default(),
            window_end_us,
            tokens: Vec::new(),
            published: Vec::new(),
            log: None,
            actors: None,
            links: Links::new(cfg.workers),
            in_transfer: HashMap::new(),
            migrations: BTreeMap::new(),
            awaiting: vec![Vec::new(); cfg.workers],
            paused: BTreeMap::new(),
            heat: None,
            copies: BTreeMap::new(),
            pool: (cfg.pool_pages > 0).then(|| Pool::new(cfg.pool_pages)),
            send_links: Links::new(cfg.workers),
            pulling: HashMap::new(),
            pushes: BTreeMap::new(),
            pushed: 0,
            spills_in_flight: vec![0; cfg.workers],
            disks: (cfg.disk_pages > 0).then(|| Disks::new(cfg.workers, cfg.disk_pages)),
            disk_writes: BTreeMap::new(),
            disk_written: 0,
        }
    }

    fn run(&mut self) -> anyhow::Result<()> {
        self.actors = SimActors::new(
            &self.cfg.router.actors(),
            &self.cfg.actor_configs,
            self.cfg.actor_tick_ms,
            self.pool.is_some(),
            self.disks.is_some(),
        )?;
        if self
            .actors
            .as_ref()
            .is_some_and(SimActors::reads_hot_prefixes)
        {
            self.heat = Some(PrefixHeat::new(HEAT_CAPACITY));
        }
        while let Some((now, ev)) = self.events.pop() {
            self.tick_actors(now)?;
            if let Event::StepEnd(w) = ev {
                if self.workers[w as usize].step_end != Some(now) {
                    continue;
                }
            }
            self.counters.events += 1;
            self.counters.end_us = self.counters.end_us.max(now);
            match ev {
                Event::Arrive(r) => self.arrive(r as usize, now)?,
                Event::StepEnd(w) => self.step_ended(w as usize, now)?,
                Event::Transferred(r) => self.transferred(r, now)?,
                Event::MigrationCopied(r) => self.migration_copied(r, now)?,
                Event::Migrated(r) => self.migrated(r, now)?,
                Event::PrefixCopied(c) => self.prefix_copied(c, now)?,
                Event::Pulled(r) => self.pulled(r, now)?,
                Event::PoolPushed(p) => self.pool_pushed(p, now)?,
                Event::WorkerUp(w) => self.worker_up(w as usize, now)?,
                Event::DiskWritten(d) => self.disk_written(d, now)?,
            }
        }
        Ok(())
    }
    /// The run's records and counts, its pool's and disks' final figures
    /// and every worker's preemptions counted in.
    fn outcome(mut self) -> Outcome {
        let mut clients = vec![String::new(); self.client_ids.len()];
        for (name, &id) in &self.client_ids {
            clients[id as usize] = name.clone();
        }
        let mut counters = std::mem::take(&mut self.counters);
        if let Some(pool) = &self.pool {
            counters.pool.finish(pool);
        }
        if let Some(disks) = &self.disks {
            disks.finish(&mut counters.disk);
        }
        counters.preemptions += (self.workers.iter())
            .map(|w| w.scheduler.preemptions())
            .sum::<u64>();
        let worker_hours = self.fleet.worker_hours(counters.end_us);
        let fleet = self.cfg.autoscale.is_some().then(|| {
            let mut fleet = std::mem::take(&mut self.fleet.stats);
            fleet.arrivals(&self.records, counters.end_us);
            fleet
        });
        let (actions, failed_actions) = self
            .actors
            .map(|a| (a.records, a.failures))
            .unwrap_or_default();
        Outcome {
            actions,
            failed_actions,
            records: self.records,
            clients,
            counters,
            worker_hours,
            fleet,
        }
    }
}
