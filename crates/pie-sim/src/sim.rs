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

use std::collections::{BTreeMap, HashMap};
use std::str::FromStr;
use std::time::Instant;

use pie_core::{block_hash, block_hashes, BlockHash, KvDtype, ModelFingerprint, SeqId};
use pie_policy::cluster::{
    ActionRecord, ActorConfigs, ClusterSnapshot, KvPages, PrefixHeat, ProcessState, Stage, Tier,
    WorkerState,
};
use pie_policy::runtime::{PolicyList, RuntimeConfig, WorkerPolicies};
use pie_policy::scheduler::prefill_share;
use pie_policy::{Candidate, KeepSession, OnMiss, Planned, Scheduler, StepLimits, WorkerPolicy};

use crate::actors::{SimActors, ToExecute};
use crate::autoscale::{AutoscaleConfig, Fleet, Life};
use crate::copies::{hot_prefixes, leading_held, PrefixCopy, HEAT_CAPACITY};
use crate::cost::{CostProfile, StepShape, AFTER_IDLE_MS};
use crate::disaggregate::{kv_bytes_per_token, Links};
use crate::disk::{read_us, write_us, Disks};
use crate::events::{Event, Events};
use crate::jitter::StepJitter;
use crate::machine::SharedMachine;
use crate::metrics::{Counters, Record, RunMetrics};
use crate::migrate::{Migration, PAUSE_US};
use crate::pages::{slot, PageModel, Seq, WorkerPages, SLOT_BITS};
use crate::pool::{Pool, SPILLS_IN_FLIGHT};
use crate::router::{Router, RouterSpec};
use crate::workload::Request;

/// The worker-plane ordering policies the simulator can run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PolicyName {
    Fcfs,
    Fair,
    Priority,
    Deadline,
    /// `deadline` with `on_miss = "abort"`.
    DeadlineAbort,
}

impl PolicyName {
    pub const ALL: &'static [&'static str] =
        &["fcfs", "fair", "priority", "deadline", "deadline-abort"];

    /// A fresh policy object, with the defaults `pie serve` uses.
    pub fn build(self) -> Box<dyn WorkerPolicy> {
        self.build_with(&RuntimeConfig::default())
    }

    /// A fresh policy object with a worker's `[runtime]` settings, by the
    /// worker's own factory (`pie_policy::runtime::WorkerPolicies`).
    pub fn build_with(self, runtime: &RuntimeConfig) -> Box<dyn WorkerPolicy> {
        WorkerPolicies::build(&self.runtime(runtime))
            .expect("an ordering policy name the factory knows")
            .ordering
    }

    /// `runtime` with this as its only worker policy (`deadline-abort`:
    /// `deadline` with `on_miss = "abort"`).
    fn runtime(self, runtime: &RuntimeConfig) -> RuntimeConfig {
        let mut rt = runtime.clone();
        let name = match self {
            Self::DeadlineAbort => {
                rt.deadline.on_miss = OnMiss::Abort;
                "deadline"
            }
            other => other.label(),
        };
        rt.worker_policy = PolicyList::One(name.into());
        rt
    }

    /// The ordering policy a worker's `[runtime]` runs (fcfs when it lists
    /// none); an error for what the simulator does not model (`offload`).
    pub fn of_runtime(runtime: &RuntimeConfig) -> Result<Self, String> {
        let policies = WorkerPolicies::build(runtime)?;
        if policies.offload.is_some() {
            return Err("`offload` is not simulated: remove it from worker_policy".into());
        }
        Ok(match policies.ordering.name() {
            "deadline" if runtime.deadline.on_miss == OnMiss::Abort => Self::DeadlineAbort,
            name => name.parse()?,
        })
    }

    pub fn label(self) -> &'static str {
        Self::ALL[self as usize]
    }
}

impl FromStr for PolicyName {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Ok(match s {
            "fcfs" => Self::Fcfs,
            "fair" => Self::Fair,
            "priority" => Self::Priority,
            "deadline" => Self::Deadline,
            "deadline-abort" => Self::DeadlineAbort,
            other => {
                return Err(format!(
                    "unknown policy `{other}` (available: {})",
                    Self::ALL.join(", ")
                ))
            }
        })
    }
}

#[derive(Clone, Debug)]
pub struct SimConfig {
    pub workers: usize,
    pub policy: PolicyName,
    /// The cluster policies' pipeline (`pie_policy::cluster`).
    pub router: RouterSpec,
    /// Run `KeepSession` (retention from the `session` and `keep-ms` props).
    pub keep_session: bool,
    /// The worker's `[runtime]` policy settings (`[runtime.fair]`,
    /// `[runtime.keep-session]`, ...); its limits are the profile's.
    pub runtime: RuntimeConfig,
    /// The `[cluster.<actor>]` settings of the router's actors.
    pub actor_configs: ActorConfigs,
    /// How often the actors look at the cluster (simulated ms).
    pub actor_tick_ms: u64,
    pub profile: CostProfile,
    /// Workers sharing one machine of the profile (`machine.rs`); 1: each worker
    /// has a machine to itself.
    pub workers_per_machine: usize,
    /// Workers `w0..` of this many are prefill-stage (the rest decode-stage);
    /// 0: every worker does both.
    pub prefill_workers: usize,
    /// KV bytes per token, which prices a transfer of pages between workers
    /// (default: the model the profile models, `disaggregate::kv_bytes_per_token`).
    pub kv_bytes_per_token: u64,
    /// The shared pool's capacity in pages (`pool.rs`); 0: no pool. Every
    /// worker pulls from it.
    pub pool_pages: usize,
    /// Follow `scale-by-prop`'s hints (`autoscale.rs`), `workers` being the
    /// initial fleet; None: a fixed fleet of `workers`.
    pub autoscale: Option<AutoscaleConfig>,
    /// The TTFT objective (ms) of `slo_attainment` in the metrics.
    pub slo_ttft_ms: f64,
    /// Each worker's disk tier in pages (`disk.rs`); 0: none.
    pub disk_pages: usize,
    /// Seeds the run's own randomness (the profile's step-time variance,
    /// `jitter.rs`); the workload's seed, so a run is reproducible from it.
    pub seed: u64,
}

impl SimConfig {
    pub fn new(
        workers: usize,
        policy: PolicyName,
        router: RouterSpec,
        profile: CostProfile,
    ) -> Self {
        Self {
            workers,
            policy,
            router,
            keep_session: false,
            runtime: RuntimeConfig::default(),
            actor_configs: ActorConfigs::default(),
            actor_tick_ms: 1000,
            kv_bytes_per_token: kv_bytes_per_token(&profile, KvDtype::default()),
            profile,
            workers_per_machine: 1,
            prefill_workers: 0,
            pool_pages: 0,
            autoscale: None,
            slo_ttft_ms: DEFAULT_SLO_TTFT_MS,
            disk_pages: 0,
            seed: 0,
        }
    }
}

/// `--slo-ttft-ms`'s default: a chat service's first token within half a
/// second; at the GPU profile's speed a worker that keeps up answers in tens
/// of ms, so a miss means a queue.
pub const DEFAULT_SLO_TTFT_MS: f64 = 500.0;

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

/// Pages on their way to worker `w`'s disk; `spill`: a retained session's.
struct DiskWrite {
    w: usize,
    blocks: Vec<BlockHash>,
    spill: bool,
}

/// A pull from the pool: request `seq` waits for its pages `from..to` to
/// reach worker `w`.
struct Pull {
    w: usize,
    seq: Seq,
    from: usize,
    /// Pages `from..disk_to` come from its disk, the rest from the pool.
    disk_to: usize,
    to: usize,
}

/// Pages on their way to the pool, soft-pinned there until `pinned_until_ms`
/// (0: not pinned); `spilled_by`: a spill of that worker's.
struct PoolPush {
    blocks: Vec<BlockHash>,
    pinned_until_ms: u64,
    spilled_by: Option<usize>,
}

const FINGERPRINT: ModelFingerprint = ModelFingerprint(0x51_u64);
const MEMO_CAPACITY: usize = 4096;
/// A logged schedule ([`run_schedule`]) longer than this is a livelock.
const MAX_SCHEDULE_STEPS: usize = 100_000;

/// Simulate `reqs` on the configured cluster; every request finishes (or is
/// rejected or aborted), and the metrics say so.
pub fn run(cfg: &SimConfig, workload: &str, reqs: &[Request]) -> anyhow::Result<RunMetrics> {
    run_with(cfg, workload, reqs, &|| cfg.policy.build_with(&cfg.runtime))
}

/// [`run`] with each worker's ordering policy made by `policy` instead of
/// `cfg.policy` (the metrics still name `cfg.policy`): any `WorkerPolicy` object.
pub fn run_with(
    cfg: &SimConfig,
    workload: &str,
    reqs: &[Request],
    policy: &dyn Fn() -> Box<dyn WorkerPolicy>,
) -> anyhow::Result<RunMetrics> {
    run_records_with(cfg, workload, reqs, policy).map(|(m, _)| m)
}

/// [`run`], with what happened to each request (the worker that served it,
/// its arrival, first token and finish).
pub fn run_records(
    cfg: &SimConfig,
    workload: &str,
    reqs: &[Request],
) -> anyhow::Result<(RunMetrics, Vec<Record>)> {
    run_records_with(cfg, workload, reqs, &|| cfg.policy.build_with(&cfg.runtime))
}

fn run_records_with(
    cfg: &SimConfig,
    workload: &str,
    reqs: &[Request],
    policy: &dyn Fn() -> Box<dyn WorkerPolicy>,
) -> anyhow::Result<(RunMetrics, Vec<Record>)> {
    let started = Instant::now();
    let mut sim = simulate(cfg, reqs, policy)?;
    let wall_s = started.elapsed().as_secs_f64();
    let mut clients = vec![String::new(); sim.client_ids.len()];
    for (name, &id) in &sim.client_ids {
        clients[id as usize] = name.clone();
    }
    let mut counters = std::mem::take(&mut sim.counters);
    if let Some(pool) = &sim.pool {
        counters.pool.finish(pool);
    }
    if let Some(disks) = &sim.disks {
        disks.finish(&mut counters.disk);
    }
    counters.preemptions += sim
        .workers
        .iter()
        .map(|w| w.scheduler.preemptions())
        .sum::<u64>();
    let worker_hours = sim.fleet.worker_hours(counters.end_us);
    let counters_end_us = counters.end_us;
    let actions: Vec<ActionRecord> = sim.actors.take().map(|a| a.records).unwrap_or_default();
    let mut metrics = RunMetrics::compute(
        cfg,
        workload,
        reqs,
        &sim.records,
        &clients,
        counters,
        wall_s,
    );
    metrics.actions = actions;
    metrics.worker_hours = worker_hours;
    if cfg.autoscale.is_some() {
        let mut fleet = std::mem::take(&mut sim.fleet.stats);
        fleet.arrivals(&sim.records, counters_end_us);
        metrics.fleet = Some(fleet);
    }
    Ok((metrics, sim.records))
}

/// A one-worker run step by step: what the engine, driven on the simulator's
/// clock, must reproduce.
#[derive(Clone, Debug, Default)]
pub struct Schedule {
    /// Every request's record (first token, finish, cached tokens).
    pub records: Vec<Record>,
    /// Every time the worker planned, in order, also when it found nothing to
    /// run (sequences may have expired then).
    pub steps: Vec<LoggedStep>,
    /// Admitted requests in admission order, each with the number of plans made
    /// before it arrived: it joins the next.
    pub admissions: Vec<(usize, usize)>,
    pub preemptions: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LoggedStep {
    pub start_us: u64,
    /// `start_us` when nothing ran.
    pub end_us: u64,
    pub batch_tokens: usize,
    /// Free pages and unreferenced cached pages once the step took effect.
    pub free_pages: usize,
    pub cached_pages: usize,
}

/// [`run_with`]'s simulation of one worker, logged step by step.
pub fn run_schedule(
    cfg: &SimConfig,
    reqs: &[Request],
    policy: &dyn Fn() -> Box<dyn WorkerPolicy>,
) -> anyhow::Result<Schedule> {
    anyhow::ensure!(
        cfg.workers == 1 && cfg.workers_per_machine == 1 && cfg.autoscale.is_none(),
        "a schedule is logged for one worker on its own machine"
    );
    validate(cfg)?;
    let mut sim = Sim::new(cfg, reqs, policy);
    sim.log = Some(Schedule::default());
    sim.run()?;
    let mut schedule = sim.log.take().unwrap_or_default();
    schedule.records = sim.records;
    schedule.preemptions = sim.workers[0].scheduler.preemptions();
    Ok(schedule)
}

fn simulate<'a>(
    cfg: &'a SimConfig,
    reqs: &'a [Request],
    policy: &'a dyn Fn() -> Box<dyn WorkerPolicy>,
) -> anyhow::Result<Sim<'a>> {
    validate(cfg)?;
    let mut sim = Sim::new(cfg, reqs, policy);
    sim.run()?;
    Ok(sim)
}

fn validate(cfg: &SimConfig) -> anyhow::Result<()> {
    anyhow::ensure!(cfg.workers > 0, "at least one worker");
    anyhow::ensure!(
        cfg.profile.page_size > 0 && cfg.profile.kv_pages > 0,
        "page size and pages must be positive"
    );
    anyhow::ensure!(
        cfg.profile.max_batch_tokens > 0 && cfg.profile.max_running > 0,
        "max_batch_tokens and max_running must be positive"
    );
    anyhow::ensure!(
        cfg.workers_per_machine > 0,
        "workers per machine must be positive"
    );
    anyhow::ensure!(
        cfg.prefill_workers < cfg.workers,
        "--prefill-workers ({}) must leave at least one of the {} workers to decode",
        cfg.prefill_workers,
        cfg.workers
    );
    if let Some(a) = &cfg.autoscale {
        anyhow::ensure!(
            cfg.router.actors().contains(&"scale-by-prop"),
            "--autoscale follows scale-by-prop's hints: add scale-by-prop to --router"
        );
        anyhow::ensure!(
            cfg.prefill_workers == 0,
            "--autoscale: prefill-stage workers (--prefill-workers) are not autoscaled"
        );
        anyhow::ensure!(
            a.min_workers >= 1 && a.min_workers <= a.max_workers,
            "--scale-min ({}) must be at least 1 and at most --scale-max ({})",
            a.min_workers,
            a.max_workers
        );
    }
    Ok(())
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
                Event::PrefixCopied(c) => self.prefix_copied(c)?,
                Event::Pulled(r) => self.pulled(r, now)?,
                Event::PoolPushed(p) => self.pool_pushed(p, now)?,
                Event::WorkerUp(w) => self.worker_up(w as usize, now),
                Event::DiskWritten(d) => self.disk_written(d, now)?,
            }
        }
        Ok(())
    }

    /// Every actor tick due by `now`, each over the cluster as it stands.
    fn tick_actors(&mut self, now: u64) -> anyhow::Result<()> {
        while let Some(at) = self.actors.as_ref().and_then(|a| a.due(now)) {
            let snapshot = self.snapshot(at);
            let Some(actors) = &mut self.actors else {
                break;
            };
            let actions = actors.tick(at, &snapshot)?;
            for action in actions {
                match action {
                    ToExecute::Migrate { process, from, to } => {
                        self.migrate(&process, &from, &to, now)?
                    }
                    ToExecute::CopyPrefix { blocks, from, to } => {
                        self.copy_prefix(blocks, &from, &to, now)?
                    }
                    ToExecute::CopyToPool { blocks, from } => {
                        self.copy_to_pool(blocks, &from, now)?
                    }
                    ToExecute::RetainSpill { worker, to } => self.retain_spill(&worker, to)?,
                    ToExecute::Persist { blocks, worker } => {
                        self.persist_prefix(blocks, &worker, now)?
                    }
                    ToExecute::Scale { group, recommended } => {
                        self.scale_hint(&group, recommended, at)
                    }
                }
            }
            if self.cfg.autoscale.is_some() {
                self.reconcile(at, now)?;
            }
        }
        Ok(())
    }

    /// The cluster as an actor sees it: every worker with its load and pages,
    /// every sequence with its props, the hot prefixes (when tracked) at
    /// `at_us`. A migrating process in its pause is on no worker's list
    /// (nothing can act on it then); its load counts on its target already.
    /// As the controller lists them: a booting worker is not healthy (its
    /// `/health` answers 503 while the model loads), a draining one is
    /// draining, a stopped one is gone.
    fn snapshot(&self, at_us: u64) -> ClusterSnapshot {
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

    /// Carry out a `CopyPrefix` from an actor: the blocks `from` holds (from
    /// the first) that `to` lacks go over `to`'s link (see `copies`). A
    /// worker that does not exist is an error that stops the run.
    fn copy_prefix(
        &mut self,
        blocks: Vec<BlockHash>,
        from: &str,
        to: &str,
        now: u64,
    ) -> anyhow::Result<()> {
        let (f, t) = (self.worker_named(from)?, self.worker_named(to)?);
        anyhow::ensure!(f != t, "copy-prefix: from `{from}` to itself");
        let held = leading_held(&self.workers[f].pages.cache, &blocks);
        let mut blocks = blocks;
        blocks.truncate(held);
        let target = &self.workers[t].pages.cache;
        let pages = blocks.iter().filter(|h| !target.contains(h)).count() as u64;
        let ps = self.cfg.profile.page_size as u64;
        let bytes = pages * ps * self.cfg.kv_bytes_per_token;
        let arrive = match bytes {
            0 => now,
            _ => self.links.book(&self.cfg.profile, t, now, bytes).1,
        };
        let c = &mut self.counters.copies;
        c.copies += 1;
        c.pages += pages;
        c.bytes += bytes;
        let id = u32::try_from(c.copies)?;
        self.copies.insert(id, PrefixCopy { to: t, blocks });
        self.events.push(arrive, Event::PrefixCopied(id));
        Ok(())
    }

    /// Copy `c` reached its target: the blocks into its prefix cache (as many
    /// as fit) and the router's index.
    fn prefix_copied(&mut self, c: u32) -> anyhow::Result<()> {
        let copy = (self.copies.remove(&c))
            .ok_or_else(|| anyhow::anyhow!("prefix copy {c} arrived twice"))?;
        let received = self.workers[copy.to].pages.receive(&copy.blocks);
        self.counters.copies.received += received as u64;
        self.sync_index(copy.to);
        Ok(())
    }

    /// Carry out a `CopyPrefixToPool` (`pool-replicate`): the blocks `from`
    /// holds (from the first) go to the pool, unpinned.
    fn copy_to_pool(&mut self, blocks: Vec<BlockHash>, from: &str, now: u64) -> anyhow::Result<()> {
        let f = self
            .worker_named(from)
            .map_err(|e| anyhow::anyhow!("copy-prefix-to-pool: {e}"))?;
        let held = leading_held(&self.workers[f].pages.cache, &blocks);
        let mut blocks = blocks;
        blocks.truncate(held);
        let (pages, bytes) = self.push_to_pool(f, blocks, 0, false, now)?;
        let c = &mut self.counters.pool;
        c.replicated += 1;
        c.replicated_pages += pages;
        c.replicated_bytes += bytes;
        Ok(())
    }

    /// Carry out a `RetainSpill` (`retain-all`): worker `name` spills the
    /// retained sessions it evicts early to the pool from now on.
    fn retain_spill(&mut self, name: &str, to: Tier) -> anyhow::Result<()> {
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

    /// Carry out a `PersistPrefix` (`persist-prefix`): the blocks worker
    /// `name` holds (from the first) and its disk lacks are written to it.
    fn persist_prefix(
        &mut self,
        blocks: Vec<BlockHash>,
        name: &str,
        now: u64,
    ) -> anyhow::Result<()> {
        let w = self
            .worker_named(name)
            .map_err(|e| anyhow::anyhow!("persist-prefix: {e}"))?;
        let held = leading_held(&self.workers[w].pages.cache, &blocks);
        let mut blocks = blocks;
        blocks.truncate(held);
        let (pages, bytes) = self.write_to_disk(w, blocks, false, now)?;
        let c = &mut self.counters.disk;
        c.persists += 1;
        c.persisted_pages += pages;
        c.persisted_bytes += bytes;
        Ok(())
    }

    /// Worker `w` writes the pages of `blocks` its disk lacks (a spill if
    /// `spill`), queued on its disk; they are stored when the write ends.
    /// Returns the pages and bytes written.
    fn write_to_disk(
        &mut self,
        w: usize,
        blocks: Vec<BlockHash>,
        spill: bool,
        now: u64,
    ) -> anyhow::Result<(u64, u64)> {
        let disks = (self.disks.as_mut()).ok_or_else(|| anyhow::anyhow!("no disk tier"))?;
        let store = disks.store_mut(w);
        store.read(&blocks);
        let lacking: Vec<BlockHash> = blocks.into_iter().filter(|h| !store.contains(h)).collect();
        if lacking.is_empty() {
            return Ok((0, 0));
        }
        let pages = lacking.len() as u64;
        let bytes = pages * self.cfg.profile.page_size as u64 * self.cfg.kv_bytes_per_token;
        let end = disks.book(w, now, write_us(bytes));
        self.disk_written += 1;
        if spill {
            self.spills_in_flight[w] += 1;
        }
        let write = DiskWrite {
            w,
            blocks: lacking,
            spill,
        };
        self.disk_writes.insert(self.disk_written, write);
        self.events.push(end, Event::DiskWritten(self.disk_written));
        Ok((pages, bytes))
    }

    /// Write `d` ended: its pages are on the disk (the least recently used
    /// going past its capacity).
    fn disk_written(&mut self, d: u32, now: u64) -> anyhow::Result<()> {
        let write = (self.disk_writes.remove(&d))
            .ok_or_else(|| anyhow::anyhow!("disk write {d} ended twice"))?;
        if write.spill {
            self.spills_in_flight[write.w] -= 1;
        }
        let disks = (self.disks.as_mut()).ok_or_else(|| anyhow::anyhow!("no disk tier"))?;
        let new = disks.store_mut(write.w).put(&write.blocks, 0, now / 1000) as u64;
        let c = &mut self.counters.disk;
        c.stored_pages += new;
        c.already_held_pages += write.blocks.len() as u64 - new;
        Ok(())
    }

    /// Worker `w` pushes `blocks` to the pool (a spill if `spill`),
    /// soft-pinned until `pinned_until_ms`: those the pool holds are pinned
    /// (and refreshed) at once, the rest cross `w`'s sending link and are
    /// stored when they arrive. Returns the pages and bytes sent.
    fn push_to_pool(
        &mut self,
        w: usize,
        blocks: Vec<BlockHash>,
        pinned_until_ms: u64,
        spill: bool,
        now: u64,
    ) -> anyhow::Result<(u64, u64)> {
        let pool = (self.pool.as_mut()).ok_or_else(|| anyhow::anyhow!("no pool to push to"))?;
        pool.pin(&blocks, pinned_until_ms);
        let lacking: Vec<BlockHash> = blocks.into_iter().filter(|h| !pool.contains(h)).collect();
        if lacking.is_empty() {
            return Ok((0, 0));
        }
        let pages = lacking.len() as u64;
        let bytes = pages * self.cfg.profile.page_size as u64 * self.cfg.kv_bytes_per_token;
        let (_, end) = self.send_links.book(&self.cfg.profile, w, now, bytes);
        self.pushed += 1;
        let push = PoolPush {
            blocks: lacking,
            pinned_until_ms,
            spilled_by: spill.then_some(w),
        };
        if spill {
            self.spills_in_flight[w] += 1;
        }
        self.pushes.insert(self.pushed, push);
        self.events.push(end, Event::PoolPushed(self.pushed));
        Ok((pages, bytes))
    }

    /// Push `p` reached the pool: its pages are stored (evicting past the
    /// high watermark).
    fn pool_pushed(&mut self, p: u32, now: u64) -> anyhow::Result<()> {
        let push = (self.pushes.remove(&p))
            .ok_or_else(|| anyhow::anyhow!("pool push {p} arrived twice"))?;
        if let Some(w) = push.spilled_by {
            self.spills_in_flight[w] -= 1;
        }
        let pool = (self.pool.as_mut()).ok_or_else(|| anyhow::anyhow!("no pool"))?;
        let new = pool.put(&push.blocks, push.pinned_until_ms, now / 1000) as u64;
        let c = &mut self.counters.pool;
        c.stored_pages += new;
        c.already_held_pages += push.blocks.len() as u64 - new;
        Ok(())
    }

    /// The retained sessions worker `w` spilled in its last plan go to the
    /// pool, each pinned until its retention would have ended; with
    /// `SPILLS_IN_FLIGHT` of its spills on their way already, one more is
    /// dropped (as `pie-worker` bounds them).
    /// To its disk when it spills there (`to = "disk"`, or `any` without a
    /// pool), unpinned.
    fn spill(&mut self, w: usize, now: u64) -> anyhow::Result<()> {
        let to_disk = match self.workers[w].pages.spill {
            Some(Tier::Disk) => true,
            Some(Tier::Any) => self.pool.is_none(),
            _ => false,
        };
        for s in std::mem::take(&mut self.workers[w].pages.spilled) {
            if self.spills_in_flight[w] >= SPILLS_IN_FLIGHT {
                if to_disk {
                    self.counters.disk.dropped_spills += 1;
                    continue;
                }
                let c = &mut self.counters.pool;
                c.dropped_spills += 1;
                c.dropped_spill_pages += s.blocks.len() as u64;
                continue;
            }
            if to_disk {
                let (pages, bytes) = self.write_to_disk(w, s.blocks, true, now)?;
                let c = &mut self.counters.disk;
                c.spills += 1;
                c.spilled_pages += pages;
                c.spilled_bytes += bytes;
                continue;
            }
            let (pages, bytes) = self.push_to_pool(w, s.blocks, s.expires_ms, true, now)?;
            let c = &mut self.counters.pool;
            c.spills += 1;
            c.spilled_pages += pages;
            c.spilled_bytes += bytes;
        }
        Ok(())
    }

    /// Queue `seq` on worker `w` (`admit`), first pulling from the pool the
    /// leading pages of its prompt the pool holds past `w`'s own cached
    /// prefix, if any: it is admitted when they arrive.
    fn pull_then_admit(&mut self, w: usize, seq: Seq, now: u64) -> anyhow::Result<()> {
        if self.pool.is_none() && self.disks.is_none() {
            return self.admit(w, seq, now);
        }
        let ps = self.cfg.profile.page_size;
        let page_bytes = ps as u64 * self.cfg.kv_bytes_per_token;
        let usable = seq.prefix_pages(ps);
        let own = leading_held(&self.workers[w].pages.cache, &seq.hashes[..usable]);
        let mut end = now;
        let mut disk_to = own;
        if let Some(disks) = &mut self.disks {
            let loaded = disks.store(w).leading(&seq.hashes[own..usable]);
            if loaded > 0 {
                disk_to = own + loaded;
                disks.store_mut(w).read(&seq.hashes[own..disk_to]);
                let bytes = loaded as u64 * page_bytes;
                end = disks.book(w, now, read_us(bytes));
                let c = &mut self.counters.disk;
                c.loads += 1;
                c.loaded_pages += loaded as u64;
                c.loaded_bytes += bytes;
                c.load_s += (end - now) as f64 / 1e6;
            }
        }
        let mut to = disk_to;
        if let Some(pool) = &mut self.pool {
            let pulled = pool.leading(&seq.hashes[disk_to..usable]);
            if pulled > 0 {
                to = disk_to + pulled;
                pool.read(&seq.hashes[disk_to..to]);
                let bytes = pulled as u64 * page_bytes;
                let (_, pool_end) = self.links.book(&self.cfg.profile, w, now, bytes);
                end = end.max(pool_end);
                let c = &mut self.counters.pool;
                c.pulls += 1;
                if c.pulls_by_worker.len() <= w {
                    c.pulls_by_worker.resize(w + 1, 0);
                }
                c.pulls_by_worker[w] += 1;
                c.pulled_pages += pulled as u64;
                c.pulled_bytes += bytes;
                c.pull_s += (pool_end - now) as f64 / 1e6;
            }
        }
        if to == own {
            return self.admit(w, seq, now);
        }
        let r = seq.req;
        self.pulling.insert(
            r,
            Pull {
                w,
                seq,
                from: own,
                disk_to,
                to,
            },
        );
        self.events.push(end, Event::Pulled(r));
        Ok(())
    }

    /// Request `r`'s pages from its worker's disk and the pool reached its
    /// worker: into its prefix cache (as many as fit: as the engine imports
    /// pages, retained sessions make room first, soonest expiry first and
    /// spilled when the worker spills; then unreferenced cached pages are
    /// evicted; never a running sequence's), then the request joins its queue.
    fn pulled(&mut self, r: u32, now: u64) -> anyhow::Result<()> {
        let p =
            (self.pulling.remove(&r)).ok_or_else(|| anyhow::anyhow!("request {r} pulled twice"))?;
        self.make_room(p.w, p.to - p.from);
        self.spill(p.w, now)?;
        let kept = self.workers[p.w].pages.receive(&p.seq.hashes[p.from..p.to]);
        // The disk's pages come first: they are the last to be dropped.
        let disk_unfit = (p.disk_to - p.from).saturating_sub(kept) as u64;
        let unfit = (p.to - p.from - kept) as u64 - disk_unfit;
        self.counters.disk.unfit_pages += disk_unfit;
        self.counters.pool.unfit_pages += unfit;
        self.counters.pool.short_pulls += u64::from(unfit > 0);
        self.sync_index(p.w);
        self.admit(p.w, p.seq, now)
    }

    /// Retained sessions on worker `w` evicted (soonest expiry first) until
    /// `pages` are free or evictable, as the engine's import does.
    fn make_room(&mut self, w: usize, pages: usize) {
        let (scheduler, mut kv, _) = self.split(w);
        while kv.pages.free_pages() + kv.pages.cache.evictable() < pages
            && scheduler.evict_soonest_retained(&mut kv)
        {}
    }

    /// The index of worker `name` (`w3`); an unknown or stopped one is an
    /// error.
    fn worker_named(&self, name: &str) -> anyhow::Result<usize> {
        name.strip_prefix('w')
            .and_then(|n| n.parse::<usize>().ok())
            .filter(|&w| w < self.workers.len() && self.fleet.life[w].started())
            .ok_or_else(|| anyhow::anyhow!("no worker `{name}`"))
    }

    /// A scale hint at `at`: with `--autoscale`, the unlabelled workers'
    /// group's recommendation is the fleet's (`autoscale.rs`).
    fn scale_hint(&mut self, group: &str, recommended: usize, at: u64) {
        if group == self.cfg.actor_configs.scale_by_prop.default_group {
            self.fleet.recommend(at, recommended);
        }
    }

    /// After the actors' tick at `at`: the fleet's target from the
    /// recommendations, workers started or stopped to meet it at `now`.
    fn reconcile(&mut self, at: u64, now: u64) -> anyhow::Result<()> {
        self.fleet.target = self.fleet.wanted(at);
        while self.fleet.active() < self.fleet.target {
            self.start_worker(now)?;
        }
        while self.fleet.active() > self.fleet.target {
            self.scale_in(now);
        }
        Ok(())
    }

    /// Start a worker in the lowest stopped slot (a new one past the last):
    /// empty, serving `start_ms` from now.
    fn start_worker(&mut self, now: u64) -> anyhow::Result<()> {
        let auto = (self.cfg.autoscale.as_ref()).ok_or_else(|| anyhow::anyhow!("no autoscaler"))?;
        let up_us = now + auto.start_ms * 1000;
        let w = self.fleet.free_slot();
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
        Ok(())
    }

    /// Worker `w` is done booting at `now` (unless it was stopped, or
    /// stopped and started again, meanwhile): it serves.
    fn worker_up(&mut self, w: usize, now: u64) {
        if self.fleet.life[w] == (Life::Booting { up_us: now }) {
            self.fleet.set(w, Life::Serving, now, "up");
            self.router.set_serving(w, true);
        }
    }

    /// One worker fewer: the newest booting one stops at once, else the
    /// least loaded serving one (ties: the highest slot) drains.
    fn scale_in(&mut self, now: u64) {
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
            return;
        }
        let Some(w) = (0..life.len())
            .filter(|&w| life[w] == Life::Serving)
            .min_by_key(|&w| (self.router.load(w), std::cmp::Reverse(w)))
        else {
            return;
        };
        self.fleet.set(w, Life::Draining, now, "drain");
        self.router.set_serving(w, false);
        self.stop_if_drained(w, now);
    }

    /// A draining worker with nothing left (no request routed to it, none
    /// queued or running, no step in flight) stops: its pages and retained
    /// sessions go with it.
    fn stop_if_drained(&mut self, w: usize, now: u64) {
        let worker = &self.workers[w];
        if self.fleet.life[w] != Life::Draining
            || self.router.load(w) > 0
            || !worker.scheduler.is_empty()
            || worker.step_end.is_some()
        {
            return;
        }
        self.fleet.set(w, Life::Stopped, now, "stop");
        let track = self.router.tracks_prefixes();
        let fresh = new_worker(self.cfg, self.policy, track);
        let old = std::mem::replace(&mut self.workers[w], fresh);
        self.counters.preemptions += old.scheduler.preemptions();
        self.router.forget(w);
    }

    fn step_ended(&mut self, w: usize, now: u64) -> anyhow::Result<()> {
        self.workers[w].step_end = None;
        if let Some(m) = self.machine_of(w) {
            self.machines[m].finish(now, w as u32);
        }
        self.end_step(w, now);
        self.migration_boundary(w, now)?;
        let started = self.start_step(w, now)?;
        match self.machine_of(w) {
            Some(m) if !started => self.schedule_machine(m, now),
            _ => {}
        }
        if !started {
            self.stop_if_drained(w, now);
        }
        Ok(())
    }

    fn machine_of(&self, w: usize) -> Option<usize> {
        (!self.machines.is_empty()).then(|| w / self.cfg.workers_per_machine)
    }

    /// Schedule the end of `w`'s step of `work_us` (profile time) begun at
    /// `now`, keeping the profile's `host_share` of its host busy (`machine.rs`).
    fn schedule_step(&mut self, w: usize, now: u64, work_us: u64) {
        match self.machine_of(w) {
            None => self.set_step_end(w, now + work_us),
            Some(m) => {
                let demand = self.cfg.profile.host_share.unwrap_or(1.0);
                self.machines[m].start(now, w as u32, work_us, demand);
                self.schedule_machine(m, now);
            }
        }
    }

    /// (Re)schedule the ends of every step in flight on machine `m`.
    fn schedule_machine(&mut self, m: usize, now: u64) {
        let ends: Vec<(u32, u64)> = self.machines[m].ends(now).collect();
        for (w, end) in ends {
            self.set_step_end(w as usize, end);
        }
    }

    fn set_step_end(&mut self, w: usize, end: u64) {
        self.workers[w].step_end = Some(end);
        self.events.push(end, Event::StepEnd(w as u32));
    }

    fn arrive(&mut self, r: usize, now: u64) -> anyhow::Result<()> {
        let reqs = self.reqs;
        let req = &reqs[r];
        let ps = self.cfg.profile.page_size;
        self.records[r].arrival_us = now;
        let limit = self.cfg.profile.kv_pages * ps;
        let prompt_len = req.prompt_len();
        if prompt_len == 0 || prompt_len >= limit {
            self.reject(r, now);
            return Ok(());
        }
        let max_tokens = req.output_len().min(limit - prompt_len).max(1);
        let hashes = self.hashes(r, prompt_len + max_tokens);
        let usable = hashes.len().min((prompt_len - 1) / ps);
        if let Some(heat) = &mut self.heat {
            heat.record(&hashes[..usable], now / 1000);
        }
        if let (Some(pool), true) = (&self.pool, self.router.tracks_prefixes()) {
            self.router.set_pooled(pool.leading(&hashes[..usable]));
        }
        let routed = self
            .router
            .route(now / 1000, &req.props, prompt_len, &hashes[..usable]);
        let Ok(routed) = routed else {
            self.reject(r, now);
            return Ok(());
        };
        let decode = routed.decode;
        let client = self.client_id(&req.client);
        let seq = Seq {
            hashes,
            prompt_len: prompt_len as u32,
            max_tokens: max_tokens as u32,
            generated: 0,
            len: 0,
            pages: 0,
            published: 0,
            client,
            req: r as u32,
            window_tokens: 0,
            last_token_us: 0,
            handoff: routed.prefill.map(|_| decode as u32),
        };
        self.records[r].worker = decode as u32;
        self.records[r].prompt_tokens = prompt_len as u32;
        // The decode worker has the request from now on, as the controller
        // counts it; a prefill worker only while it prefills.
        self.router.set_load(decode, self.router.load(decode) + 1);
        let Some(p) = routed.prefill else {
            return self.pull_then_admit(decode, seq, now);
        };
        self.records[r].prefill_worker = Some(p as u32);
        let t = &mut self.counters.transfers;
        let uncached = routed.uncached_tokens as u64;
        t.min_remote_uncached_tokens = match t.remote_prefills {
            0 => uncached,
            _ => t.min_remote_uncached_tokens.min(uncached),
        };
        t.remote_prefills += 1;
        self.router.set_load(p, self.router.load(p) + 1);
        self.pull_then_admit(p, seq, now)
    }

    /// Queue `seq` on worker `w`'s scheduler (a new arrival, or a prefilled
    /// request reaching its decode worker) and wake the worker if idle.
    fn admit(&mut self, w: usize, seq: Seq, now: u64) -> anyhow::Result<()> {
        let r = seq.req as usize;
        let prefill_tokens = seq.prompt_len as usize;
        let slot = self.workers[w].pages.insert(seq).ok_or_else(|| {
            anyhow::anyhow!("more than 2^{SLOT_BITS} live sequences on worker {w}")
        })?;
        self.arrivals += 1;
        let req = &self.reqs[r];
        let candidate = Candidate {
            seq: SeqId(self.arrivals << SLOT_BITS | slot as u64),
            arrival_ms: self.records[r].arrival_us / 1000,
            running: false,
            prefill_tokens,
            client: req.client.clone(),
            props: req.props.clone(),
        };
        let (scheduler, kv, _) = self.split(w);
        scheduler.add(&kv, candidate);
        if let Some(log) = &mut self.log {
            log.admissions.push((r, log.steps.len()));
        }
        if self.workers[w].step_end.is_none() {
            if self.events.next_at() == Some(now) {
                // Wake it once every arrival at this instant is in, as the
                // engine takes all queued requests before it plans a step.
                self.set_step_end(w, now);
            } else {
                self.start_step(w, now)?;
            }
        }
        Ok(())
    }

    /// A prefill ended on prefill worker `p`: the prompt's full pages that the
    /// decode worker does not hold go to it over its link.
    fn hand_off(&mut self, p: usize, mut s: Seq, d: usize, now: u64) {
        s.handoff = None;
        self.router.set_load(p, self.router.load(p) - 1);
        let ps = self.cfg.profile.page_size;
        let cache = &self.workers[d].pages.cache;
        let pages = s.hashes[..s.prefix_pages(ps)]
            .iter()
            .filter(|h| !cache.contains(h))
            .count() as u64;
        let bytes = pages * ps as u64 * self.cfg.kv_bytes_per_token;
        let (start, end) = self.links.book(&self.cfg.profile, d, now, bytes);
        let t = &mut self.counters.transfers;
        t.pages += pages;
        t.bytes += bytes;
        t.transfer_us += end - start;
        t.wait_us += start - now;
        let r = s.req;
        self.in_transfer.insert(r, s);
        self.events.push(end, Event::Transferred(r));
    }

    /// Request `r`'s prefilled pages reached its decode worker: into its prefix
    /// cache (as many as fit), then the request joins its queue.
    fn transferred(&mut self, r: u32, now: u64) -> anyhow::Result<()> {
        let s = self
            .in_transfer
            .remove(&r)
            .ok_or_else(|| anyhow::anyhow!("request {r} transferred twice"))?;
        let d = self.records[r as usize].worker as usize;
        let pages = s.prefix_pages(self.cfg.profile.page_size);
        self.workers[d].pages.receive(&s.hashes[..pages]);
        self.sync_index(d);
        self.admit(d, s, now)
    }

    /// Carry out a `MigrateProcess` from an actor: request `process` on worker
    /// `from` starts moving to `to` (its first copy stage). What cannot be
    /// done is an error that stops the run.
    fn migrate(&mut self, process: &str, from: &str, to: &str, now: u64) -> anyhow::Result<()> {
        let r: u32 = process
            .strip_prefix("request-")
            .and_then(|n| n.parse().ok())
            .ok_or_else(|| anyhow::anyhow!("migrate: no process `{process}`"))?;
        let worker = |name: &str| {
            self.worker_named(name)
                .map_err(|e| anyhow::anyhow!("migrate: {e}"))
        };
        let (f, t) = (worker(from)?, worker(to)?);
        anyhow::ensure!(f != t, "migrate: `{process}` from `{from}` to itself");
        anyhow::ensure!(
            self.router.views()[t].stage != Stage::Prefill,
            "migrate: `{to}` is a prefill-stage worker"
        );
        anyhow::ensure!(
            !self.migrations.contains_key(&r),
            "migrate: `{process}` is already migrating"
        );
        let seq = self
            .find_seq(f, r)
            .ok_or_else(|| anyhow::anyhow!("migrate: `{process}` is not on `{from}`"))?;
        anyhow::ensure!(
            self.workers[f].pages.seq(slot(seq)).handoff.is_none(),
            "migrate: `{process}` is a remote prefill on `{from}`"
        );
        self.migrations.insert(
            r,
            Migration {
                from: f,
                to: t,
                copied_pages: 0,
            },
        );
        self.counters.migrations.started += 1;
        self.copy_stage(r, seq, now);
        Ok(())
    }

    /// Request `r`'s sequence on worker `w`, if it is there.
    fn find_seq(&self, w: usize, r: u32) -> Option<SeqId> {
        let worker = &self.workers[w];
        (worker.scheduler.candidates().iter())
            .map(|c| c.seq)
            .find(|&seq| worker.pages.seq(slot(seq)).req == r)
    }

    /// The leading pages of `s` whose KV worker `w` has for it: a running
    /// sequence's computed full pages, a queued one's prefix in `w`'s cache.
    fn computed_pages(&self, w: usize, s: &Seq) -> usize {
        let ps = self.cfg.profile.page_size;
        if s.pages > 0 {
            return (s.len as usize / ps).min(s.hashes.len());
        }
        let usable = ((s.tokens() as usize - 1) / ps).min(s.hashes.len());
        let cache = &self.workers[w].pages.cache;
        s.hashes[..usable]
            .iter()
            .take_while(|h| cache.contains(h))
            .count()
    }

    /// A copy stage of request `r`'s migration: the pages computed since the
    /// last stage that the target lacks go over its link while the process
    /// runs on; with none to copy, it is looked at at the next step boundary.
    fn copy_stage(&mut self, r: u32, seq: SeqId, now: u64) {
        let Some(m) = self.migrations.get(&r).copied() else {
            return;
        };
        let s = self.workers[m.from].pages.seq(slot(seq));
        let upto = self.computed_pages(m.from, s);
        let target = &self.workers[m.to].pages.cache;
        let pages = s.hashes[m.copied_pages.min(upto)..upto]
            .iter()
            .filter(|h| !target.contains(h))
            .count() as u64;
        if let Some(m) = self.migrations.get_mut(&r) {
            m.copied_pages = upto;
        }
        if pages == 0 {
            self.awaiting[m.from].push(r);
            return;
        }
        let bytes = pages * self.cfg.profile.page_size as u64 * self.cfg.kv_bytes_per_token;
        let (_, end) = self.links.book(&self.cfg.profile, m.to, now, bytes);
        let c = &mut self.counters.migrations;
        c.stages += 1;
        c.pages += pages;
        c.bytes += bytes;
        self.events.push(end, Event::MigrationCopied(r));
    }

    /// A copy stage of request `r` reached its target: the source looks at it
    /// when its running step ends (at once if it is idle).
    fn migration_copied(&mut self, r: u32, now: u64) -> anyhow::Result<()> {
        let Some(m) = self.migrations.get(&r).copied() else {
            return Ok(()); // it finished on its source meanwhile
        };
        self.awaiting[m.from].push(r);
        if self.workers[m.from].step_end.is_none() {
            self.migration_boundary(m.from, now)?;
        }
        Ok(())
    }

    /// At a step boundary of worker `w`, each migration whose copy stage ended:
    /// another stage if more than one full page was computed meanwhile, else
    /// the process leaves `w` and pauses while its last pages cross the link.
    fn migration_boundary(&mut self, w: usize, now: u64) -> anyhow::Result<()> {
        if self.awaiting[w].is_empty() {
            return Ok(());
        }
        let ps = self.cfg.profile.page_size;
        for r in std::mem::take(&mut self.awaiting[w]) {
            let Some(m) = self.migrations.get(&r).copied() else {
                continue;
            };
            let Some(seq) = self.find_seq(w, r) else {
                continue;
            };
            let s = self.workers[w].pages.seq(slot(seq));
            let upto = self.computed_pages(w, s);
            let uncopied = upto.saturating_sub(m.copied_pages);
            if uncopied > 1 {
                self.copy_stage(r, seq, now);
                continue;
            }
            let partial = usize::from(s.pages > 0 && !(s.len as usize).is_multiple_of(ps));
            let index = (self.workers[w].scheduler.position(seq))
                .ok_or_else(|| anyhow::anyhow!("request {r} is not among its worker's"))?;
            let (scheduler, mut kv, _) = self.split(w);
            scheduler.finish(&mut kv, &[index], false);
            let s = self.workers[w].pages.remove(slot(seq));
            self.sync_index(w);
            self.router.set_load(w, self.router.load(w) - 1);
            self.router.set_load(m.to, self.router.load(m.to) + 1);
            let pages = (uncopied + partial) as u64;
            let bytes = pages * ps as u64 * self.cfg.kv_bytes_per_token;
            let copied = match bytes {
                0 => now,
                _ => self.links.book(&self.cfg.profile, m.to, now, bytes).1,
            };
            let resume = copied + PAUSE_US;
            let c = &mut self.counters.migrations;
            c.stages += u64::from(bytes > 0);
            c.pages += pages;
            c.bytes += bytes;
            c.pause_us += resume - now;
            c.max_pause_us = c.max_pause_us.max(resume - now);
            self.records[r as usize].worker = m.to as u32;
            self.paused.insert(r, (s, upto));
            self.events.push(resume, Event::Migrated(r));
        }
        Ok(())
    }

    /// Request `r`'s pause ended: its pages into the target's prefix cache (as
    /// many as fit), its session routed there from now on, and it joins the
    /// target's queue.
    fn migrated(&mut self, r: u32, now: u64) -> anyhow::Result<()> {
        let (s, pages) = self
            .paused
            .remove(&r)
            .ok_or_else(|| anyhow::anyhow!("request {r} resumed twice"))?;
        let m = self
            .migrations
            .remove(&r)
            .ok_or_else(|| anyhow::anyhow!("request {r} resumed without a migration"))?;
        self.workers[m.to].pages.receive(&s.hashes[..pages]);
        self.sync_index(m.to);
        let props = &self.reqs[r as usize].props;
        self.router
            .moved(now / 1000, props, s.prompt_len as usize, m.to);
        self.counters.migrations.completed += 1;
        self.admit(m.to, s, now)
    }

    /// A dense id per client name (allocating only for a new client).
    fn client_id(&mut self, name: &str) -> u32 {
        if let Some(&id) = self.client_ids.get(name) {
            return id;
        }
        let id = self.client_ids.len() as u32;
        self.client_ids.insert(name.to_string(), id);
        id
    }

    /// A worker's scheduler, its pages as the scheduler sees them, and its step.
    fn split(&mut self, w: usize) -> (&mut Scheduler, PageModel<'_>, &mut Vec<Planned>) {
        let worker = &mut self.workers[w];
        let kv = PageModel {
            pages: &mut worker.pages,
            records: &mut self.records,
            prefix_hit_tokens: &mut self.counters.prefix_hit_tokens,
        };
        (&mut worker.scheduler, kv, &mut worker.plan)
    }

    /// Refused: too long for a worker's pool, or by a cluster policy.
    fn reject(&mut self, r: usize, now: u64) {
        self.records[r].rejected = true;
        self.records[r].finish_us = Some(now);
        self.counters.rejected += 1;
        self.follow_up(r, now);
    }

    /// `pie_core::block_hashes` of request `r`'s first `total` tokens, hashing
    /// only past a known prefix of whole pages: the hashes of the turn it
    /// continues, or of a first segment made of whole pages (a shared system
    /// prompt).
    fn hashes(&mut self, r: usize, total: usize) -> Vec<BlockHash> {
        let ps = self.cfg.profile.page_size;
        let mut hashes = self.known_prefix(r, total);
        hashes.reserve(total / ps - hashes.len());
        self.tokens.clear();
        self.reqs[r].push_token_range(hashes.len() * ps, total, &mut self.tokens);
        let mut parent = hashes.last().copied().unwrap_or(FINGERPRINT.root());
        for page in self.tokens.chunks_exact(ps) {
            parent = block_hash(parent, page);
            hashes.push(parent);
        }
        hashes
    }

    /// Hashes of whole pages at the start of request `r`'s first `total` tokens
    /// known without hashing them.
    fn known_prefix(&mut self, r: usize, total: usize) -> Vec<BlockHash> {
        let ps = self.cfg.profile.page_size;
        if let Some(mut carried) = self.carried[r].take() {
            carried.truncate(total / ps);
            return carried;
        }
        let first = self.reqs[r].prompt[0];
        let len = first.len as usize;
        if len == 0 || !len.is_multiple_of(ps) || len > total {
            return Vec::new();
        }
        if self.memo.len() >= MEMO_CAPACITY {
            self.memo.clear();
        }
        let tokens = &mut self.tokens;
        self.memo
            .entry((first.key, first.len))
            .or_insert_with(|| {
                tokens.clear();
                first.push_tokens(tokens);
                block_hashes(FINGERPRINT, tokens, ps)
            })
            .clone()
    }

    fn follow_up(&mut self, r: usize, now: u64) {
        if let Some(next) = self.followers[r] {
            let think = self.reqs[next as usize].follows.map_or(0, |f| f.think_us);
            self.events.push(now + think, Event::Arrive(next));
        }
    }

    fn sync_index(&mut self, w: usize) {
        if self.router.tracks_prefixes() {
            let log = self.workers[w].pages.cache.drain_log();
            self.router.cache_changed(w, &log);
        }
    }

    /// Plan and start `w`'s next step; false when it has nothing to run.
    fn start_step(&mut self, w: usize, now: u64) -> anyhow::Result<bool> {
        let now_ms = now / 1000;
        let (scheduler, mut kv, _) = self.split(w);
        scheduler.expire_retained(&mut kv, now_ms);
        self.abort_expired(w, now);
        let (scheduler, mut kv, plan) = self.split(w);
        scheduler.plan(&mut kv, now_ms, plan);
        let mut shape = StepShape::default();
        for p in plan.iter() {
            shape.add(kv.pages.seq(slot(p.seq)).len as usize, p.tokens);
        }
        let planned = !plan.is_empty();
        if !self.workers[w].pages.spilled.is_empty() {
            self.spill(w, now)?;
        }
        self.sync_index(w);
        let step_us = if planned {
            let profile = &self.cfg.profile;
            let woke = self.workers[w]
                .last_step_end
                .is_none_or(|end| now.saturating_sub(end) >= AFTER_IDLE_MS * 1000);
            let draw = profile.step_draw(shape.kind(), woke);
            self.jitter.apply(w, now, profile.step_us(&shape), draw)
        } else {
            0
        };
        if let Some(log) = &mut self.log {
            anyhow::ensure!(
                log.steps.len() < MAX_SCHEDULE_STEPS,
                "no end after {MAX_SCHEDULE_STEPS} steps: the schedule does not progress"
            );
            let pages = &self.workers[w].pages;
            log.steps.push(LoggedStep {
                start_us: now,
                end_us: now + step_us,
                batch_tokens: shape.batch_tokens,
                free_pages: pages.free_pages(),
                cached_pages: pages.cache.evictable(),
            });
        }
        if !planned {
            let waiting = self.workers[w].scheduler.len();
            anyhow::ensure!(
                waiting == 0,
                "worker {w} stalled with {waiting} sequences at {now} us"
            );
            return Ok(false);
        }
        self.counters.steps += 1;
        self.counters.batch_tokens += shape.batch_tokens as u64;
        self.schedule_step(w, now, step_us);
        Ok(true)
    }

    fn abort_expired(&mut self, w: usize, now: u64) {
        let expired = self.workers[w].scheduler.expired(now / 1000);
        if !expired.is_empty() {
            self.finish(w, &expired, now, false);
        }
    }

    /// The running step's tokens take effect at `now`.
    fn end_step(&mut self, w: usize, now: u64) {
        if !self.workers[w].plan.is_empty() {
            self.workers[w].last_step_end = Some(now);
        }
        let ps = self.cfg.profile.page_size as u32;
        let plan = std::mem::take(&mut self.workers[w].plan);
        let mut published = std::mem::take(&mut self.published);
        let mut done = Vec::new();
        let in_window = now <= self.window_end_us;
        for p in &plan {
            self.workers[w].pages.prefetch_seq(slot(p.seq));
        }
        for p in &plan {
            let n = p.tokens as u32;
            let pages = &mut self.workers[w].pages;
            let s = pages.seq_mut(slot(p.seq));
            let new_len = s.len + n;
            let prefill = prefill_share(s.prompt_len as usize, s.len as usize, p.tokens) as u32;
            let full = ((new_len / ps) as usize).min(s.hashes.len()) as u32;
            let filled = published.len();
            for page in s.published..full {
                published.push((s.hashes[page as usize], p.seq, page));
            }
            s.published = s.published.max(full);
            s.len = new_len;
            let mut generated = 0;
            if s.handoff.is_some() {
                // A remote prefill samples nothing; its prompt is done.
                if new_len >= s.prompt_len {
                    done.push(p.index);
                }
            } else if new_len == s.tokens() {
                s.generated += 1;
                generated = 1;
                if s.generated == 1 {
                    self.records[s.req as usize].first_token_us = Some(now);
                } else {
                    self.counters.itl.add(now - s.last_token_us);
                }
                s.last_token_us = now;
                if s.generated >= s.max_tokens {
                    done.push(p.index);
                }
                if w < self.cfg.prefill_workers {
                    self.counters.transfers.prefill_worker_output_tokens += 1;
                }
            }
            if in_window {
                s.window_tokens += u64::from(prefill + generated);
            }
            for &(h, _, _) in &published[filled..] {
                pages.cache.prefetch(h);
            }
            self.counters.prefill_tokens += u64::from(prefill);
            self.counters.decode_tokens += u64::from(n - prefill);
            let (scheduler, kv, _) = self.split(w);
            scheduler.charge(&kv, p.index, prefill as usize, generated as usize);
        }
        // Published after the loop, so that their cache misses overlap.
        let pages = &mut self.workers[w].pages;
        for &(h, seq, page) in &published {
            pages.publish(h, slot(seq), page);
        }
        published.clear();
        self.published = published;
        let mut plan = plan;
        plan.clear();
        self.workers[w].plan = plan;
        if !done.is_empty() {
            self.finish(w, &done, now, true);
        }
        self.sync_index(w);
        let pages = &self.workers[w].pages;
        if let Some(step) = self.log.as_mut().and_then(|log| log.steps.last_mut()) {
            step.free_pages = pages.free_pages();
            step.cached_pages = pages.cache.evictable();
        }
    }

    /// Remove the candidates at `indices`: their pages are retained for their
    /// session (if `may_retain`, else they expired) or released, their records
    /// closed, their next turns queued.
    fn finish(&mut self, w: usize, indices: &[usize], now: u64, may_retain: bool) {
        let (scheduler, mut kv, _) = self.split(w);
        for seq in scheduler.finish(&mut kv, indices, may_retain) {
            let s = self.workers[w].pages.remove(slot(seq));
            match s.handoff {
                Some(d) if may_retain => self.hand_off(w, s, d as usize, now),
                _ => self.close(w, s, now, !may_retain),
            }
        }
    }

    /// A finished sequence's record, service and next turn.
    fn close(&mut self, w: usize, s: Seq, now: u64, expired: bool) {
        let req = s.req as usize;
        let rec = &mut self.records[req];
        rec.finish_us = Some(now);
        rec.expired = expired;
        rec.generated_tokens = s.generated;
        let c = s.client as usize;
        let window = &mut self.counters.window_service;
        if window.len() <= c {
            window.resize(c + 1, 0);
        }
        window[c] += s.window_tokens;
        let next_turn = self.followers[req]
            .map(|n| n as usize)
            .filter(|&n| self.reqs[n].continues(&self.reqs[req]));
        if let Some(n) = next_turn {
            self.carried[n] = Some(s.hashes);
        }
        if self.migrations.remove(&s.req).is_some() {
            // Finished (or aborted) before it left its source.
            self.counters.migrations.abandoned += 1;
        }
        self.router.set_load(w, self.router.load(w) - 1);
        if let Some(d) = s.handoff.map(|d| d as usize) {
            // Expired while prefilling remotely: its decode worker drops it too.
            self.router.set_load(d, self.router.load(d) - 1);
        }
        self.follow_up(req, now);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::workload::WorkloadSpec;

    #[test]
    fn reused_hashes_equal_block_hashes_of_the_tokens() {
        let cfg = SimConfig::new(
            1,
            PolicyName::Fcfs,
            "round-robin".parse().expect("built-in router"),
            CostProfile::cpu_placeholder(),
        );
        for name in ["shared-prefix", "multi-turn", "deadline-mix"] {
            let reqs = WorkloadSpec::named(name).unwrap().generate(20, 1);
            let policy = || cfg.policy.build();
            let mut sim = Sim::new(&cfg, &reqs, &policy);
            let mut tokens = Vec::new();
            let mut carried = 0;
            for (i, r) in reqs.iter().enumerate() {
                let total = r.prompt_len() + r.output_len() - 3;
                r.tokens(&mut tokens);
                tokens.truncate(total);
                let want = block_hashes(FINGERPRINT, &tokens, 16);
                carried += usize::from(sim.carried[i].is_some());
                assert_eq!(sim.hashes(i, total), want, "{name}");
                // Twice: the second comes from the memo, not the carried turn.
                assert_eq!(sim.hashes(i, total), want, "{name}");
                // As `finish` leaves them for the next turn.
                if let Some(n) = sim.followers[i].map(|n| n as usize) {
                    if reqs[n].continues(r) {
                        let all = sim.hashes(i, r.prompt_len() + r.output_len());
                        sim.carried[n] = Some(all);
                    }
                }
            }
            assert!(!sim.memo.is_empty() || name == "deadline-mix");
            assert_eq!(carried > 0, name == "multi-turn", "{name}: {carried}");
        }
    }
}
