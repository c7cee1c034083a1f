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
//! concurrent steps then split its speed.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::str::FromStr;
use std::time::Instant;

use pie_core::{block_hash, block_hashes, BlockHash, ModelFingerprint, SeqId};
use pie_policy::{
    Candidate, Deadline, DeadlineConfig, Fair, FairConfig, Fcfs, KeepSession, KeepSessionConfig,
    OnMiss, Priority, PriorityConfig, WorkerPolicy,
};

use crate::cache::{prefetch, PrefixCache};
use crate::cost::{CostProfile, StepShape};
use crate::events::{Event, Events};
use crate::machine::SharedMachine;
use crate::metrics::{Counters, Record, RunMetrics};
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
        match self {
            Self::Fcfs => Box::new(Fcfs),
            Self::Fair => Box::new(Fair::new(FairConfig::default())),
            Self::Priority => Box::new(Priority::new(PriorityConfig::default())),
            Self::Deadline => Box::new(Deadline::new(DeadlineConfig::default())),
            Self::DeadlineAbort => Box::new(Deadline::new(DeadlineConfig {
                on_miss: OnMiss::Abort,
            })),
        }
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
    pub profile: CostProfile,
    /// Workers sharing one machine of the profile (`machine.rs`); 1: each worker
    /// has a machine to itself.
    pub workers_per_machine: usize,
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
            profile,
            workers_per_machine: 1,
        }
    }
}

/// A sequence on a worker.
struct Seq {
    /// Hashes of the full pages of its prompt and output tokens.
    hashes: Vec<BlockHash>,
    prompt_len: u32,
    max_tokens: u32,
    generated: u32,
    /// Tokens whose KV is computed.
    len: u32,
    /// Pages held: `published` leading cache pages plus private ones.
    pages: u32,
    published: u32,
    client: u32,
    /// The request it serves (index into the workload and the records).
    req: u32,
    /// Tokens served while load was offered, added to its client's at finish.
    window_tokens: u64,
}

impl Seq {
    fn tokens(&self) -> u32 {
        self.prompt_len + self.generated
    }

    /// Pages it holds outside the prefix cache, given its `duplicates` (see
    /// [`Worker::duplicates`]).
    fn private_pages(&self, duplicates: &[u32]) -> usize {
        (self.pages - self.published) as usize + duplicates.len()
    }

    /// The cached pages it references.
    fn cached_hashes(&self, duplicates: &[u32]) -> Vec<BlockHash> {
        let published = &self.hashes[..self.published as usize];
        (0..published.len())
            .filter(|i| !duplicates.contains(&(*i as u32)))
            .map(|i| published[i])
            .collect()
    }

    /// Drop its references to cached pages and its private pages.
    fn release(&self, duplicates: &[u32], cache: &mut PrefixCache, private_pages: &mut usize) {
        if duplicates.is_empty() {
            cache.release_all(&self.hashes[..self.published as usize]);
        } else {
            cache.release_all(&self.cached_hashes(duplicates));
        }
        *private_pages -= self.private_pages(duplicates);
    }
}

impl Worker {
    fn take_duplicates(&mut self, slot: usize) -> Vec<u32> {
        if self.duplicates.is_empty() {
            return Vec::new();
        }
        self.duplicates.remove(&slot).unwrap_or_default()
    }
}

/// A finished session's pages kept for its next turn.
struct Retained {
    hashes: Vec<BlockHash>,
    private: u32,
    expires_ms: u64,
}

struct Worker {
    policy: Box<dyn WorkerPolicy>,
    /// Its live sequences by slot (the low bits of their `SeqId`); finished
    /// slots are reused, so a worker's sequences stay together in memory.
    seqs: Vec<Option<Seq>>,
    free_slots: Vec<u32>,
    /// Every sequence on the worker, in the policy's last order (plus arrivals).
    cands: Vec<Candidate>,
    cache: PrefixCache,
    /// By slot, a sequence's published pages whose hash another page already
    /// held when they filled: as in `pie-kv`, they stay private (freed on
    /// release) instead of joining the cached one. Rare, so kept out of `Seq`.
    duplicates: HashMap<usize, Vec<u32>>,
    /// Pages held by sequences and retained sessions outside the cache.
    private_pages: usize,
    retained: HashMap<String, Retained>,
    /// (expiry, session), lazily checked against `retained`.
    expiries: BinaryHeap<Reverse<(u64, String)>>,
    /// The running step: (index in `cands`, tokens).
    plan: Vec<(usize, u32)>,
    /// When the running step (or a pending wake-up) ends; None while idle.
    /// Step-end events at other times are stale (a shared machine moved the end).
    step_end: Option<u64>,
}

struct Sim<'a> {
    cfg: &'a SimConfig,
    reqs: &'a [Request],
    keep: Option<KeepSession>,
    workers: Vec<Worker>,
    /// Sequences admitted so far: the high bits of the next `SeqId`.
    arrivals: u64,
    records: Vec<Record>,
    followers: Vec<Option<u32>>,
    events: Events,
    /// Hosts of `workers_per_machine` workers each; empty when every worker has
    /// its own.
    machines: Vec<SharedMachine>,
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
}

const FINGERPRINT: ModelFingerprint = ModelFingerprint(0x51_u64);
const MEMO_CAPACITY: usize = 4096;
/// A `SeqId` is the sequence's arrival number (as the engine numbers them, so
/// policies break ties in arrival order) above its slot in its worker's `seqs`.
const SLOT_BITS: u32 = 24;

fn slot(seq: SeqId) -> usize {
    (seq.0 & ((1 << SLOT_BITS) - 1)) as usize
}

/// Simulate `reqs` on the configured cluster; every request finishes (or is
/// rejected or aborted), and the metrics say so.
pub fn run(cfg: &SimConfig, workload: &str, reqs: &[Request]) -> anyhow::Result<RunMetrics> {
    run_with(cfg, workload, reqs, &|| cfg.policy.build())
}

/// [`run`] with each worker's ordering policy made by `policy` instead of
/// `cfg.policy` (the metrics still name `cfg.policy`): any `WorkerPolicy` object.
pub fn run_with(
    cfg: &SimConfig,
    workload: &str,
    reqs: &[Request],
    policy: &dyn Fn() -> Box<dyn WorkerPolicy>,
) -> anyhow::Result<RunMetrics> {
    let started = Instant::now();
    let mut sim = simulate(cfg, reqs, policy)?;
    let wall_s = started.elapsed().as_secs_f64();
    let mut clients = vec![String::new(); sim.client_ids.len()];
    for (name, &id) in &sim.client_ids {
        clients[id as usize] = name.clone();
    }
    let counters = std::mem::take(&mut sim.counters);
    Ok(RunMetrics::compute(
        cfg,
        workload,
        reqs,
        &sim.records,
        &clients,
        counters,
        wall_s,
    ))
}

/// Every request's record (first token, finish, cached tokens, in simulated
/// time), from [`run_with`]'s simulation: to compare with the engine request by
/// request.
pub fn run_records(
    cfg: &SimConfig,
    reqs: &[Request],
    policy: &dyn Fn() -> Box<dyn WorkerPolicy>,
) -> anyhow::Result<Vec<Record>> {
    Ok(simulate(cfg, reqs, policy)?.records)
}

fn simulate<'a>(
    cfg: &'a SimConfig,
    reqs: &'a [Request],
    policy: &dyn Fn() -> Box<dyn WorkerPolicy>,
) -> anyhow::Result<Sim<'a>> {
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
    let mut sim = Sim::new(cfg, reqs, policy);
    sim.run()?;
    Ok(sim)
}

impl<'a> Sim<'a> {
    fn new(
        cfg: &'a SimConfig,
        reqs: &'a [Request],
        policy: &dyn Fn() -> Box<dyn WorkerPolicy>,
    ) -> Self {
        let router = Router::new(&cfg.router, cfg.workers, cfg.profile.page_size);
        let track = router.tracks_prefixes();
        let workers = (0..cfg.workers)
            .map(|_| Worker {
                policy: policy(),
                seqs: Vec::new(),
                free_slots: Vec::new(),
                cands: Vec::new(),
                cache: PrefixCache::new(track),
                duplicates: HashMap::new(),
                private_pages: 0,
                retained: HashMap::new(),
                expiries: BinaryHeap::new(),
                plan: Vec::new(),
                step_end: None,
            })
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
            keep: cfg
                .keep_session
                .then(|| KeepSession::new(KeepSessionConfig::default())),
            workers,
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
            router,
            memo: HashMap::new(),
            carried: vec![None; reqs.len()],
            client_ids: HashMap::new(),
            counters: Counters::default(),
            window_end_us,
            tokens: Vec::new(),
            published: Vec::new(),
        }
    }

    fn run(&mut self) -> anyhow::Result<()> {
        while let Some((now, ev)) = self.events.pop() {
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
            }
        }
        Ok(())
    }

    fn step_ended(&mut self, w: usize, now: u64) -> anyhow::Result<()> {
        self.workers[w].step_end = None;
        if let Some(m) = self.machine_of(w) {
            self.machines[m].finish(now, w as u32);
        }
        self.end_step(w, now);
        let started = self.start_step(w, now)?;
        match self.machine_of(w) {
            Some(m) if !started => self.schedule_machine(m, now),
            _ => {}
        }
        Ok(())
    }

    fn machine_of(&self, w: usize) -> Option<usize> {
        (!self.machines.is_empty()).then(|| w / self.cfg.workers_per_machine)
    }

    /// Schedule the end of `w`'s step of `work_us` (profile time) begun at `now`.
    fn schedule_step(&mut self, w: usize, now: u64, work_us: u64) {
        match self.machine_of(w) {
            None => self.set_step_end(w, now + work_us),
            Some(m) => {
                self.machines[m].start(now, w as u32, work_us);
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
        let routed = self
            .router
            .route(now / 1000, &req.props, prompt_len, &hashes[..usable]);
        let Ok(w) = routed else {
            self.reject(r, now);
            return Ok(());
        };
        let client = self.client_id(&req.client);
        let slot = self.new_slot(w)?;
        self.workers[w].seqs[slot] = Some(Seq {
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
        });
        self.records[r].worker = w as u32;
        self.records[r].prompt_tokens = prompt_len as u32;
        self.workers[w].cands.push(Candidate {
            seq: SeqId(self.arrivals << SLOT_BITS | slot as u64),
            arrival_ms: now / 1000,
            running: false,
            prefill_tokens: prompt_len,
            client: req.client.clone(),
            props: req.props.clone(),
        });
        self.router.set_load(w, self.router.load(w) + 1);
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

    /// A dense id per client name (allocating only for a new client).
    fn client_id(&mut self, name: &str) -> u32 {
        if let Some(&id) = self.client_ids.get(name) {
            return id;
        }
        let id = self.client_ids.len() as u32;
        self.client_ids.insert(name.to_string(), id);
        id
    }

    fn new_slot(&mut self, w: usize) -> anyhow::Result<usize> {
        self.arrivals += 1;
        let worker = &mut self.workers[w];
        if let Some(s) = worker.free_slots.pop() {
            return Ok(s as usize);
        }
        anyhow::ensure!(
            worker.seqs.len() < 1 << SLOT_BITS,
            "more than 2^{SLOT_BITS} live sequences on worker {w}"
        );
        worker.seqs.push(None);
        Ok(worker.seqs.len() - 1)
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
            let log = self.workers[w].cache.drain_log();
            self.router.cache_changed(w, &log);
        }
    }

    /// Plan and start `w`'s next step; false when it has nothing to run.
    fn start_step(&mut self, w: usize, now: u64) -> anyhow::Result<bool> {
        let now_ms = now / 1000;
        self.expire_retained(w, now_ms);
        self.abort_expired(w, now);
        debug_assert!(self.candidates_are_current(w));
        let worker = &mut self.workers[w];
        worker.policy.order(now_ms, &mut worker.cands);
        let shape = self.plan(w);
        self.sync_index(w);
        let worker = &mut self.workers[w];
        if worker.plan.is_empty() {
            anyhow::ensure!(
                worker.cands.is_empty(),
                "worker {w} stalled with {} sequences at {now} us",
                worker.cands.len()
            );
            return Ok(false);
        }
        self.counters.steps += 1;
        self.counters.batch_tokens += shape.batch_tokens as u64;
        self.schedule_step(w, now, self.cfg.profile.step_us(&shape));
        Ok(true)
    }

    /// `cands[ci]`'s `running` and `prefill_tokens` from its sequence, after its
    /// pages or computed tokens changed (instead of refreshing every candidate
    /// before each step).
    fn sync_candidate(&mut self, w: usize, ci: usize) {
        let worker = &mut self.workers[w];
        let c = &mut worker.cands[ci];
        let s = worker.seqs[slot(c.seq)]
            .as_ref()
            .expect("a candidate's sequence exists");
        c.running = s.pages > 0;
        c.prefill_tokens = s.prompt_len.saturating_sub(s.len) as usize;
    }

    fn candidates_are_current(&self, w: usize) -> bool {
        self.workers[w].cands.iter().all(|c| {
            let s = self.seq(w, slot(c.seq));
            c.running == (s.pages > 0)
                && c.prefill_tokens == s.prompt_len.saturating_sub(s.len) as usize
        })
    }

    /// Mirror of the engine's `plan`: fill the step in the policy's order.
    /// Returns the step's shape (batch tokens, context, attention pairs).
    fn plan(&mut self, w: usize) -> StepShape {
        let whole: &'a SimConfig = self.cfg;
        let cfg = &whole.profile;
        let mut plan = std::mem::take(&mut self.workers[w].plan);
        plan.clear();
        let order: Vec<usize> = self.workers[w].cands.iter().map(|c| slot(c.seq)).collect();
        for &id in &order {
            prefetch(&self.workers[w].seqs[id]);
        }
        let mut running = self.workers[w].cands.iter().filter(|c| c.running).count();
        let mut budget = cfg.max_batch_tokens as u32;
        let preempts = self.workers[w].policy.preempts_for_slots();
        let mut shape = StepShape::default();
        for (rank, &id) in order.iter().enumerate() {
            if budget == 0 {
                break;
            }
            let was_running = self.seq(w, id).pages > 0;
            if !was_running {
                if running >= cfg.max_running {
                    if !(preempts && self.preempt_last(w, &order, rank + 1)) {
                        continue;
                    }
                    running -= 1;
                }
                self.attach_prefix(w, id);
            }
            let reserved = self.reserve(w, id, budget, &order, rank + 1);
            match reserved {
                Some(n) => {
                    if !was_running {
                        running += 1;
                        self.note_first_admission(w, id);
                    }
                    budget -= n;
                    plan.push((rank, n));
                    shape.add(self.seq(w, id).len as usize, n as usize);
                }
                None if !was_running => self.release(w, id),
                None => {}
            }
            self.sync_candidate(w, rank);
        }
        self.workers[w].plan = plan;
        shape
    }

    fn seq(&self, w: usize, id: usize) -> &Seq {
        self.workers[w].seqs[id].as_ref().expect("sequence exists")
    }

    fn seq_mut(seqs: &mut [Option<Seq>], id: usize) -> &mut Seq {
        seqs[id].as_mut().expect("sequence exists")
    }

    /// Share the longest cached prefix, leaving at least one token to compute.
    fn attach_prefix(&mut self, w: usize, id: usize) {
        let ps = self.cfg.profile.page_size as u32;
        let worker = &mut self.workers[w];
        let cache = &mut worker.cache;
        let s = Self::seq_mut(&mut worker.seqs, id);
        let usable = ((s.tokens() - 1) / ps) as usize;
        let mut hit = 0;
        for h in s.hashes.iter().take(usable) {
            if !cache.acquire(*h) {
                break;
            }
            hit += 1;
        }
        s.published = hit;
        s.pages = hit;
        s.len = hit * ps;
    }

    fn note_first_admission(&mut self, w: usize, id: usize) {
        let s = self.workers[w].seqs[id].as_ref().expect("sequence exists");
        let rec = &mut self.records[s.req as usize];
        if rec.cached_tokens.is_none() {
            let hit = s.len.min(s.prompt_len);
            rec.cached_tokens = Some(hit);
            self.counters.prefix_hit_tokens += u64::from(hit);
        }
    }

    /// Free a sequence's pages (full ones stay cached), tail first as the engine
    /// does, so eviction keeps prefixes reachable.
    fn release(&mut self, w: usize, id: usize) {
        let worker = &mut self.workers[w];
        let duplicates = worker.take_duplicates(id);
        let s = Self::seq_mut(&mut worker.seqs, id);
        s.release(&duplicates, &mut worker.cache, &mut worker.private_pages);
        s.pages = 0;
        s.published = 0;
        s.len = 0;
    }

    /// Preempt the running sequence ordered last from `order[from..]` (the
    /// candidates in the same order).
    fn preempt_last(&mut self, w: usize, order: &[usize], from: usize) -> bool {
        let Some(ci) = (from..order.len())
            .rev()
            .find(|&i| self.seq(w, order[i]).pages > 0)
        else {
            return false;
        };
        self.release(w, order[ci]);
        self.sync_candidate(w, ci);
        self.counters.preemptions += 1;
        true
    }

    fn free_pages(&self, w: usize) -> usize {
        let worker = &self.workers[w];
        self.cfg.profile.kv_pages - worker.private_pages - worker.cache.len()
    }

    fn reserve(
        &mut self,
        w: usize,
        id: usize,
        budget: u32,
        order: &[usize],
        from: usize,
    ) -> Option<u32> {
        let ps = self.cfg.profile.page_size as u32;
        loop {
            let s = self.seq(w, id);
            let (len, pages) = (s.len, s.pages);
            let want = (s.tokens() - len).min(budget);
            let available = (self.free_pages(w) + self.workers[w].cache.evictable()) as u32;
            let room = (pages + available) * ps - len;
            if room < want {
                if self.drop_soonest_retained(w) {
                    continue;
                }
                if self.preempt_last(w, order, from) {
                    continue;
                }
            }
            let n = want.min(room);
            if n == 0 {
                return None;
            }
            let need = (len + n).div_ceil(ps) - pages;
            while self.free_pages(w) < need as usize {
                if !self.workers[w].cache.evict_one() {
                    break;
                }
            }
            self.workers[w].private_pages += need as usize;
            Self::seq_mut(&mut self.workers[w].seqs, id).pages += need;
            return Some(n);
        }
    }

    fn drop_retained(&mut self, w: usize, session: &str) {
        let worker = &mut self.workers[w];
        if let Some(r) = worker.retained.remove(session) {
            worker.cache.release_all(&r.hashes);
            worker.private_pages -= r.private as usize;
        }
    }

    fn drop_soonest_retained(&mut self, w: usize) -> bool {
        while let Some(Reverse((expires, session))) = self.workers[w].expiries.pop() {
            if self.workers[w]
                .retained
                .get(&session)
                .is_some_and(|r| r.expires_ms == expires)
            {
                self.drop_retained(w, &session);
                return true;
            }
        }
        false
    }

    fn expire_retained(&mut self, w: usize, now_ms: u64) {
        while let Some(Reverse((expires, _))) = self.workers[w].expiries.peek() {
            if *expires > now_ms {
                break;
            }
            let Some(Reverse((expires, session))) = self.workers[w].expiries.pop() else {
                break;
            };
            if self.workers[w]
                .retained
                .get(&session)
                .is_some_and(|r| r.expires_ms == expires)
            {
                self.drop_retained(w, &session);
            }
        }
    }

    fn abort_expired(&mut self, w: usize, now: u64) {
        let worker = &self.workers[w];
        let expired: Vec<usize> = worker
            .cands
            .iter()
            .enumerate()
            .filter(|(_, c)| worker.policy.abort(now / 1000, c))
            .map(|(i, _)| i)
            .collect();
        for &i in expired.iter().rev() {
            let req = self.seq(w, slot(self.workers[w].cands[i].seq)).req;
            self.records[req as usize].expired = true;
            self.finish(w, i, now);
        }
    }

    /// The running step's tokens take effect at `now`.
    fn end_step(&mut self, w: usize, now: u64) {
        let ps = self.cfg.profile.page_size as u32;
        let plan = std::mem::take(&mut self.workers[w].plan);
        let mut published = std::mem::take(&mut self.published);
        let mut done = Vec::new();
        let in_window = now <= self.window_end_us;
        let worker = &self.workers[w];
        for &(ci, _) in &plan {
            if let Some(s) = worker.seqs.get(slot(worker.cands[ci].seq)) {
                prefetch(s);
            }
        }
        for &(ci, n) in &plan {
            let worker = &mut self.workers[w];
            let s = Self::seq_mut(&mut worker.seqs, slot(worker.cands[ci].seq));
            let new_len = s.len + n;
            let prefill = s.prompt_len.clamp(s.len, new_len) - s.len;
            let full = ((new_len / ps) as usize).min(s.hashes.len()) as u32;
            for page in s.published..full {
                let h = s.hashes[page as usize];
                worker.cache.prefetch(h);
                published.push((h, worker.cands[ci].seq, page));
            }
            s.published = s.published.max(full);
            s.len = new_len;
            // As the engine's candidate after the commit: still running.
            worker.cands[ci].prefill_tokens = s.prompt_len.saturating_sub(new_len) as usize;
            let mut generated = 0;
            if new_len == s.tokens() {
                s.generated += 1;
                generated = 1;
                if s.generated == 1 {
                    self.records[s.req as usize].first_token_us = Some(now);
                }
                if s.generated >= s.max_tokens {
                    done.push(ci);
                }
            }
            self.counters.prefill_tokens += u64::from(prefill);
            self.counters.decode_tokens += u64::from(n - prefill);
            if in_window {
                s.window_tokens += u64::from(prefill + generated);
            }
            worker
                .policy
                .charge(&worker.cands[ci], prefill as usize, generated as usize);
        }
        // Published after the loop, so that their cache misses overlap.
        let worker = &mut self.workers[w];
        for &(h, seq, page) in &published {
            if worker.cache.insert(h) {
                worker.private_pages -= 1;
            } else {
                worker.duplicates.entry(slot(seq)).or_default().push(page);
            }
        }
        published.clear();
        self.published = published;
        self.workers[w].plan = plan;
        self.workers[w].plan.clear();
        done.sort_unstable();
        for &ci in done.iter().rev() {
            self.finish(w, ci, now);
        }
        self.sync_index(w);
    }

    /// Remove `cands[ci]`: its pages are retained for its session or released.
    fn finish(&mut self, w: usize, ci: usize, now: u64) {
        let cand = self.workers[w].cands.swap_remove(ci);
        let id = slot(cand.seq);
        let s = self.workers[w].seqs[id]
            .take()
            .expect("finishing sequence exists");
        self.workers[w].free_slots.push(id as u32);
        let duplicates = self.workers[w].take_duplicates(id);
        let req = s.req as usize;
        let rec = &mut self.records[req];
        rec.finish_us = Some(now);
        let retention = self
            .keep
            .as_ref()
            .filter(|_| !rec.expired)
            .and_then(|k| k.retention(&cand.props, now / 1000));
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
        match retention {
            Some(r) => {
                if let Some(n) = next_turn {
                    self.carried[n] = Some(s.hashes.clone());
                }
                let hashes = s.cached_hashes(&duplicates);
                let private = s.private_pages(&duplicates) as u32;
                self.drop_retained(w, &r.session);
                let worker = &mut self.workers[w];
                worker
                    .expiries
                    .push(Reverse((r.expires_ms, r.session.clone())));
                worker.retained.insert(
                    r.session,
                    Retained {
                        hashes,
                        private,
                        expires_ms: r.expires_ms,
                    },
                );
            }
            None => {
                let worker = &mut self.workers[w];
                s.release(&duplicates, &mut worker.cache, &mut worker.private_pages);
                if let Some(n) = next_turn {
                    self.carried[n] = Some(s.hashes);
                }
            }
        }
        self.router.set_load(w, self.router.load(w) - 1);
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
            let mut sim = Sim::new(&cfg, &reqs, &|| cfg.policy.build());
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
