//! The worker registry and the cluster prefix index.
//!
//! Every `poll_ms` the controller reads each worker's `/v1/internal/state`:
//! health, load, running processes and `max_running` (a few numbers, no cache
//! contents). Workers are polled in parallel, each in its own task, so a slow
//! one delays only its own entry; any failure, timeout or non-2xx answer (a
//! worker whose engine died answers 503) marks a worker down. What each worker caches arrives separately, as its KV event stream
//! (`kv_sync.rs`), into one [`ClusterIndex`] for all workers: the cached prefix of
//! a prompt on every worker costs one lookup per prompt page, and memory is about
//! 20 bytes per distinct indexed block per 64 workers (see `ClusterIndex`).

use std::sync::{Mutex, RwLock};
use std::time::Duration;

use pie_core::hash::chain_from;
use pie_core::BlockHash;
use pie_core::ModelFingerprint;
use pie_policy::cluster::{
    ClusterIndex, HotPrefix, PendingBlocks, PrefixHeat, Stage, Tier, WorkerHealth, WorkerView,
    HEAT_CAPACITY, HOT_PREFIXES,
};
use serde::Serialize;
use serde_json::Value;

use pie_core::clock::now_ms;

use crate::worker_client::with_worker_key;

/// A poll unanswered this long marks the worker down.
const POLL_TIMEOUT: Duration = Duration::from_secs(2);

#[derive(Clone, Debug, Serialize)]
pub struct Worker {
    pub name: String,
    pub url: String,
    /// Its bit in the cluster index (workers are never removed, so slots are stable).
    #[serde(skip)]
    pub slot: usize,
    /// Its `group` label: from the config for static workers, from the
    /// registration body for registered ones.
    pub group: Option<String>,
    pub healthy: bool,
    /// It said it is draining: no new requests; its streams move elsewhere.
    pub draining: bool,
    /// Queued + running processes, as the worker last reported (plus requests
    /// routed since and still streaming).
    pub load: usize,
    /// Requests counted in `load` since the last poll and not yet finished.
    #[serde(skip)]
    load_since_poll: usize,
    pub running: usize,
    pub max_running: usize,
    /// Requests this controller sent that have not finished streaming.
    pub in_flight: usize,
    pub indexed_blocks: usize,
    pub page_size: usize,
    pub fingerprint: u64,
    /// Its `[runtime] stage`: prefill-stage workers only prefill for others.
    pub stage: Stage,
    /// It pulls missing prefix pages from a shared `pie-pool` (`[runtime] pool`).
    pub pool: bool,
    /// Where it spills retained sessions it must evict early (`retain-all`).
    pub retain_spill: Option<Tier>,
    /// Why it answers but is not admitted (another model, no tokenizer to
    /// read); None when admitted or down.
    pub refused: Option<String>,
    /// Routed here since start.
    pub routed: u64,
    /// The key that registered it (its name is bound to that key); None for a
    /// worker from the controller's config.
    #[serde(skip)]
    pub registered_by: Option<String>,
    /// A registered worker: when it last registered (its heartbeat).
    #[serde(skip)]
    pub heard_ms: Option<u64>,
    /// A registered worker that stopped registering for
    /// `registration_ttl_ms`, or deregistered (a drained worker): not polled,
    /// routed or listed, its blocks out of the index; registering again
    /// brings it back in its slot.
    #[serde(skip)]
    pub expired: bool,
}

impl Worker {
    /// What the cluster events are computed from (`health_events`).
    pub fn health(&self) -> WorkerHealth {
        WorkerHealth {
            name: self.name.clone(),
            healthy: self.healthy,
            draining: self.draining,
        }
    }
}

impl Worker {
    pub(crate) fn new(slot: usize, name: &str, url: &str, group: Option<String>) -> Self {
        Self {
            registered_by: None,
            heard_ms: None,
            expired: false,
            name: name.into(),
            url: url.trim_end_matches('/').into(),
            slot,
            group,
            healthy: false,
            draining: false,
            load: 0,
            load_since_poll: 0,
            running: 0,
            max_running: 0,
            in_flight: 0,
            indexed_blocks: 0,
            page_size: 0,
            fingerprint: 0,
            stage: Stage::Both,
            pool: false,
            retain_spill: None,
            refused: None,
            routed: 0,
        }
    }

    /// The worker's own figure replaces what this controller counted.
    fn polled_load(&mut self, load: usize) {
        self.load = load;
        self.load_since_poll = 0;
    }

    /// Takes new requests: healthy and not draining.
    fn serving(&self) -> bool {
        self.healthy && !self.draining
    }

    /// Processes occupying its running slots, by the freshest figure we have.
    fn busy(&self) -> usize {
        self.running.max(self.in_flight)
    }

    /// Below its `max_running` (a worker that reports none counts as having room).
    fn has_room(&self) -> bool {
        self.max_running == 0 || self.busy() < self.max_running
    }
}

/// What a registration may do (see `Registry::register`).
#[derive(Clone, Copy, Debug)]
pub struct RegisterLimits {
    pub max_registered: usize,
    /// An admin may re-point a name registered by another key.
    pub may_rebind: bool,
}

#[derive(Default)]
pub struct Registry {
    workers: RwLock<Vec<Worker>>,
    index: RwLock<ClusterIndex>,
    /// Blocks of prompts routed to a worker, not yet in its KV events.
    pending: Mutex<PendingBlocks>,
    /// The disk tier: blocks each worker has persisted (also in `index`).
    disk: RwLock<ClusterIndex>,
    /// Routed prompts' blocks by how often they were asked for; kept only
    /// while an actor reads hot prefixes (`persist-prefix`).
    heat: Mutex<Option<PrefixHeat>>,
    /// What the shared `[cluster] pool` holds (its KV events, slot 0).
    pool: RwLock<ClusterIndex>,
}

/// Serving workers as routing sees a prompt (`Registry::held_views`).
#[derive(Clone, Debug, Default)]
pub struct Views {
    pub workers: Vec<WorkerView>,
    pub urls: Vec<String>,
    places: Vec<Place>,
}

impl Views {
    /// Only the workers `keep` accepts.
    pub fn retain(&mut self, keep: impl Fn(&WorkerView) -> bool) {
        let all = std::mem::take(self);
        let rows = all.workers.into_iter().zip(all.urls).zip(all.places);
        for ((worker, url), place) in rows.filter(|((w, _), _)| keep(w)) {
            self.workers.push(worker);
            self.urls.push(url);
            self.places.push(place);
        }
    }
}

/// Where a view's worker sits: its index slot, its kind among the prompt's
/// chains, its page size.
#[derive(Clone, Copy, Debug)]
struct Place {
    slot: usize,
    kind: Option<usize>,
    page_size: usize,
}

/// A prompt's block-hash chain per kind of model (fingerprint, page size)
/// among the workers (`Registry::chains`).
#[derive(Clone, Debug, Default)]
pub struct PromptChains {
    kinds: Vec<((u64, usize), Vec<u64>)>,
}

impl PromptChains {
    fn kind_of(&self, w: &Worker) -> Option<usize> {
        let kind = (w.fingerprint, w.page_size);
        self.kinds.iter().position(|(k, _)| *k == kind)
    }

    /// The chain `w` hashes the prompt to.
    fn of<'a>(&'a self, w: &Worker) -> Option<&'a [u64]> {
        self.kind_of(w).map(|at| self.kinds[at].1.as_slice())
    }
}

impl Registry {
    /// Workers with their indexed block counts (expired ones left out).
    pub fn snapshot(&self) -> Vec<Worker> {
        let index = self.index.read().unwrap_or_else(|e| e.into_inner());
        let mut ws: Vec<Worker> = self
            .workers
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .filter(|w| !w.expired)
            .cloned()
            .collect();
        for w in &mut ws {
            w.indexed_blocks = index.blocks_of(w.slot);
        }
        ws
    }

    /// Add or update a worker. `by` is the key registering it (None: the
    /// controller's config). A name stays bound to the key that first
    /// registered it: another key (but an admin, `may_rebind`) cannot re-point
    /// it, and at most `max_registered` workers come from registration. Returns
    /// the new worker's slot when it was not known before.
    pub fn register(
        &self,
        name: &str,
        url: &str,
        group: Option<String>,
        by: Option<&str>,
        limits: RegisterLimits,
    ) -> Result<Option<usize>, String> {
        let mut ws = self.workers.write().unwrap_or_else(|e| e.into_inner());
        if let Some(w) = ws.iter_mut().find(|w| w.name == name) {
            if w.registered_by.as_deref() != by && !limits.may_rebind {
                return Err(match &w.registered_by {
                    None => format!("worker `{name}` is in the controller's config"),
                    Some(_) => format!("worker `{name}` is registered by another key"),
                });
            }
            w.url = url.trim_end_matches('/').into();
            w.group = group;
            w.heard_ms = by.map(|_| now_ms());
            w.expired = false;
            return Ok(None);
        }
        let registered = ws
            .iter()
            .filter(|w| w.registered_by.is_some() && !w.expired)
            .count();
        if by.is_some() && registered >= limits.max_registered {
            return Err(format!(
                "{registered} workers are registered, the most this controller takes \
                 (cluster.max_registered_workers)"
            ));
        }
        let slot = ws.len();
        let mut worker = Worker::new(slot, name, url, group);
        worker.registered_by = by.map(String::from);
        worker.heard_ms = by.map(|_| now_ms());
        ws.push(worker);
        Ok(Some(slot))
    }

    /// Registered workers not heard from for `ttl_ms` expire; returns their
    /// names.
    pub fn expire_silent(&self, ttl_ms: u64) -> Vec<String> {
        let now = now_ms();
        let silent: Vec<String> = self
            .workers
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .filter(|w| !w.expired && w.heard_ms.is_some_and(|t| now.saturating_sub(t) > ttl_ms))
            .map(|w| w.name.clone())
            .collect();
        for name in &silent {
            self.expire(name);
        }
        silent
    }

    /// Worker `name` leaves (a drained worker); only the key that registered
    /// it, or an admin, may say so.
    pub fn deregister(&self, name: &str, by: &str, admin: bool) -> Result<(), String> {
        let owner = self.read_worker(
            |w| w.name == name && !w.expired,
            |w| w.registered_by.clone(),
        );
        match owner {
            None => Err(format!("no registered worker `{name}`")),
            Some(None) => Err(format!("worker `{name}` is in the controller's config")),
            Some(Some(key)) if key != by && !admin => {
                Err(format!("worker `{name}` is registered by another key"))
            }
            Some(Some(_)) => {
                self.expire(name);
                Ok(())
            }
        }
    }

    fn expire(&self, name: &str) {
        let mut slot = None;
        self.update(name, |w| {
            w.expired = true;
            w.healthy = false;
            slot = Some(w.slot);
        });
        if let Some(slot) = slot {
            self.with_index(|index, disk| {
                index.clear(slot);
                disk.clear(slot);
            });
        }
    }

    pub fn url_of(&self, name: &str) -> Option<String> {
        self.read_worker(|w| w.name == name, |w| w.url.clone())
    }

    /// Whether worker `name` serves (false for an unknown one).
    pub fn healthy(&self, name: &str) -> bool {
        self.read_worker(|w| w.name == name, |w| w.healthy)
            .unwrap_or(false)
    }

    /// The model fingerprint worker `name` last reported (0 before its first poll).
    pub fn fingerprint_of(&self, name: &str) -> Option<u64> {
        self.read_worker(|w| w.name == name, |w| w.fingerprint)
    }

    /// The URL of the worker in `slot`, unless it expired.
    pub fn url_of_slot(&self, slot: usize) -> Option<String> {
        self.read_worker(|w| w.slot == slot && !w.expired, |w| w.url.clone())
    }

    fn read_worker<T>(
        &self,
        pick: impl Fn(&Worker) -> bool,
        f: impl FnOnce(&Worker) -> T,
    ) -> Option<T> {
        self.workers
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .find(|w| pick(w))
            .map(f)
    }

    /// Change worker `name`'s entry (its poll does; benchmarks set states).
    pub fn update(&self, name: &str, f: impl FnOnce(&mut Worker)) {
        if let Some(w) = self
            .workers
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .iter_mut()
            .find(|w| w.name == name)
        {
            f(w);
        }
    }

    /// `[cluster.cache-aware] anticipate_ms` (0: routed prompts are not
    /// anticipated).
    pub fn set_anticipate_ms(&self, ttl_ms: u64) {
        self.lock_pending().set_ttl(ttl_ms);
    }

    fn lock_pending(&self) -> std::sync::MutexGuard<'_, PendingBlocks> {
        self.pending.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Count routed prompts' blocks for hot prefixes (on), or stop and forget.
    pub fn track_heat(&self, on: bool) {
        let mut heat = self.heat.lock().unwrap_or_else(|e| e.into_inner());
        match (on, heat.is_some()) {
            (true, false) => *heat = Some(PrefixHeat::new(HEAT_CAPACITY)),
            (false, true) => *heat = None,
            _ => {}
        }
    }

    /// The hottest prefixes with the workers holding them (memory or disk)
    /// and those with them on disk, for the actors' snapshot.
    pub fn hot_prefixes(&self) -> Vec<HotPrefix> {
        let chains = match &*self.heat.lock().unwrap_or_else(|e| e.into_inner()) {
            Some(heat) => heat.hot(now_ms(), HOT_PREFIXES),
            None => return Vec::new(),
        };
        let ws = self.workers.read().unwrap_or_else(|e| e.into_inner());
        let index = self.index.read().unwrap_or_else(|e| e.into_inner());
        let disk = self.disk.read().unwrap_or_else(|e| e.into_inner());
        let page_size = ws.iter().map(|w| w.page_size).find(|&p| p > 0).unwrap_or(0);
        let depths = |tier: &ClusterIndex, hashes: &[u64]| -> Vec<(String, usize)> {
            let by_slot = tier.prefix_blocks(hashes, ws.len());
            ws.iter()
                .filter(|w| !w.expired && by_slot[w.slot] > 0)
                .map(|w| (w.name.clone(), by_slot[w.slot]))
                .collect()
        };
        chains
            .into_iter()
            .map(|c| {
                let hashes: Vec<u64> = c.blocks.iter().map(|b| b.0).collect();
                HotPrefix {
                    holders: depths(&index, &hashes),
                    persisted: depths(&disk, &hashes),
                    blocks: c.blocks,
                    hits: c.hits,
                    page_size,
                    requests_per_s: c.requests_per_s,
                }
            })
            .collect()
    }

    /// A prompt was routed to worker `name`: its blocks count as pending
    /// there (and as asked for, while hot prefixes are tracked).
    pub fn anticipate(&self, name: &str, chains: &PromptChains) {
        let Some((slot, hashes)) = self.read_worker(
            |w| w.name == name,
            |w| (w.slot, chains.of(w).unwrap_or_default()),
        ) else {
            return;
        };
        if let Some(heat) = &mut *self.heat.lock().unwrap_or_else(|e| e.into_inner()) {
            let chain: Vec<BlockHash> = hashes.iter().copied().map(BlockHash).collect();
            heat.record(&chain, now_ms());
        }
        let index = self.index.read().unwrap_or_else(|e| e.into_inner());
        self.lock_pending()
            .anticipate(slot, hashes, &index, now_ms());
    }

    /// Worker `slot` published these blocks: held, no longer pending.
    pub fn confirm_pending(&self, slot: usize, hashes: &[u64]) {
        let mut pending = self.lock_pending();
        for &h in hashes {
            pending.confirm(slot, h);
        }
    }

    /// Pending (worker, block) pairs.
    pub fn pending_blocks(&self) -> usize {
        self.lock_pending().len()
    }

    /// Change the cluster index and the disk tier's (from a worker's KV events).
    pub fn with_index<T>(&self, f: impl FnOnce(&mut ClusterIndex, &mut ClusterIndex) -> T) -> T {
        f(
            &mut self.index.write().unwrap_or_else(|e| e.into_inner()),
            &mut self.disk.write().unwrap_or_else(|e| e.into_inner()),
        )
    }

    /// Change the shared pool's index (from its KV events).
    pub fn with_pool_index<T>(&self, f: impl FnOnce(&mut ClusterIndex) -> T) -> T {
        f(&mut self.pool.write().unwrap_or_else(|e| e.into_inner()))
    }

    /// Blocks the shared pool holds, as its KV events say.
    pub fn pool_blocks(&self) -> usize {
        self.pool
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .blocks_of(0)
    }

    /// The model fingerprint of the admitted workers (None before one is).
    pub fn fingerprint(&self) -> Option<u64> {
        let ws = self.workers.read().unwrap_or_else(|e| e.into_inner());
        ws.iter()
            .find(|w| w.healthy && w.fingerprint != 0)
            .map(|w| w.fingerprint)
    }

    /// A worker refused connections: out of the candidates until a poll finds it.
    pub fn mark_down(&self, name: &str) {
        self.update(name, |w| w.healthy = false);
    }

    /// A request is being sent to `name`: it holds a slot from now on.
    pub fn count_started(&self, name: &str) {
        self.update(name, |w| {
            w.in_flight += 1;
            // Count it as load until the next poll reports the worker's own figure.
            w.load += 1;
            w.load_since_poll += 1;
        });
    }

    pub fn count_routed(&self, name: &str) {
        self.update(name, |w| w.routed += 1);
    }

    /// A routed request finished streaming (or its client left).
    pub fn count_finished(&self, name: &str) {
        self.update(name, |w| {
            w.in_flight = w.in_flight.saturating_sub(1);
            // Added by `count_started` and not yet replaced by a poll: a
            // finished request must not look like load until the next poll.
            if w.load_since_poll > 0 {
                w.load_since_poll -= 1;
                w.load = w.load.saturating_sub(1);
            }
        });
    }

    /// Running slots free across healthy workers whose `max_running` is known.
    pub fn free_slots(&self) -> usize {
        self.workers
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .filter(|w| w.serving())
            .map(|w| w.max_running.saturating_sub(w.busy()))
            .sum()
    }

    /// No healthy worker is below its `max_running` (none healthy included):
    /// a request must wait for a slot.
    pub fn saturated(&self) -> bool {
        let ws = self.workers.read().unwrap_or_else(|e| e.into_inner());
        !ws.iter().any(|w| w.serving() && w.has_room())
    }

    /// Whether worker `name` takes new requests (healthy, not draining).
    pub fn serves(&self, name: &str) -> bool {
        self.read_worker(|w| w.name == name, Worker::serving)
            .unwrap_or(false)
    }

    /// The page size worker `name` reported (0 before its first poll).
    pub fn page_size_of(&self, name: &str) -> usize {
        self.read_worker(|w| w.name == name, |w| w.page_size)
            .unwrap_or(0)
    }

    /// Every worker's name and URL (what a poll round reads).
    pub fn endpoints(&self) -> Vec<(String, String)> {
        let ws = self.workers.read().unwrap_or_else(|e| e.into_inner());
        ws.iter()
            .filter(|w| !w.expired)
            .map(|w| (w.name.clone(), w.url.clone()))
            .collect()
    }

    /// A prompt's block-hash chains for the kinds of model (fingerprint,
    /// page size) the serving workers serve: hashed once per request,
    /// outside any lock, and read by `views` and `anticipate`.
    pub fn chains(&self, prompt: &[u32], cache_salt: Option<&str>) -> PromptChains {
        let mut kinds: Vec<(u64, usize)> = self
            .workers
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .filter(|w| w.serving() && w.page_size > 0)
            .map(|w| (w.fingerprint, w.page_size))
            .collect();
        kinds.sort_unstable();
        kinds.dedup();
        PromptChains {
            kinds: kinds
                .into_iter()
                .map(|(fp, page)| ((fp, page), routing_chain(fp, page, prompt, cache_salt)))
                .collect(),
        }
    }

    /// Every serving worker (with `with_free_slot`, only those with a free
    /// running slot, when any has one) as routing sees the prompt of
    /// `chains`: its cached, anticipated and pooled prefix; with its URL.
    pub fn views(&self, chains: &PromptChains, with_free_slot: bool) -> Vec<(WorkerView, String)> {
        let mut views = self.held_views(chains, with_free_slot);
        self.add_pending(chains, &mut views);
        views.workers.into_iter().zip(views.urls).collect()
    }

    /// `views` but for the blocks anticipated on each worker (its
    /// `anticipated_prefix_tokens` are its cached ones, until `add_pending`):
    /// what needs no lock against concurrent routing decisions.
    pub fn held_views(&self, chains: &PromptChains, with_free_slot: bool) -> Views {
        let ws = self.workers.read().unwrap_or_else(|e| e.into_inner());
        let index = self.index.read().unwrap_or_else(|e| e.into_inner());
        let pool = self.pool.read().unwrap_or_else(|e| e.into_inner());
        // Per kind: each worker's held depth, and the pool's (looked up only
        // when a worker pulls from it).
        let pulls = ws.iter().any(|w| w.pool);
        let depths: Vec<(Vec<usize>, usize)> = chains
            .kinds
            .iter()
            .map(|(_, hashes)| {
                let held = index.prefix_blocks(hashes, ws.len());
                let pooled = if pulls {
                    pool.prefix_blocks(hashes, 1)[0]
                } else {
                    0
                };
                (held, pooled)
            })
            .collect();
        let any_room = ws.iter().any(|w| w.serving() && w.has_room());
        let mut views = Views::default();
        for w in ws
            .iter()
            .filter(|w| w.serving() && (!with_free_slot || !any_room || w.has_room()))
        {
            let kind = chains.kind_of(w);
            let (cached, pooled) = match kind {
                Some(at) => {
                    let (held, pooled) = &depths[at];
                    let pooled = if w.pool { *pooled } else { 0 };
                    (held[w.slot] * w.page_size, pooled * w.page_size)
                }
                None => (0, 0),
            };
            views.workers.push(WorkerView {
                name: w.name.clone(),
                load: w.load,
                cached_prefix_tokens: cached,
                anticipated_prefix_tokens: cached,
                stage: w.stage,
                max_running: w.max_running,
                pool_prefix_tokens: pooled,
            });
            views.urls.push(w.url.clone());
            views.places.push(Place {
                slot: w.slot,
                kind,
                page_size: w.page_size,
            });
        }
        views
    }

    /// Each view's prefix held or anticipated (routed there, not yet
    /// confirmed). Read under the routing pipeline's lock, with the decision
    /// and its `anticipate`, so concurrent decisions see each other's prompts.
    pub fn add_pending(&self, chains: &PromptChains, views: &mut Views) {
        let slots = self.workers.read().unwrap_or_else(|e| e.into_inner()).len();
        let index = self.index.read().unwrap_or_else(|e| e.into_inner());
        let mut pending = self.lock_pending();
        pending.expire(now_ms());
        let ahead: Vec<Vec<usize>> = chains
            .kinds
            .iter()
            .map(|(_, hashes)| index.prefix_blocks_with(pending.index(), hashes, slots))
            .collect();
        for (view, place) in views.workers.iter_mut().zip(&views.places) {
            if let Some(kind) = place.kind {
                let depth = ahead[kind].get(place.slot).copied().unwrap_or(0);
                view.anticipated_prefix_tokens = depth * place.page_size;
            }
        }
    }

    /// Poll worker `name` at `url` once: its state, or down. It is admitted
    /// (healthy) only with the cluster's model fingerprint `expected` (Err:
    /// why the model could not be learned from it).
    pub async fn poll(
        &self,
        http: &reqwest::Client,
        key: Option<&str>,
        name: &str,
        url: &str,
        expected: Result<u64, String>,
    ) {
        let state = read_state(http, key, url).await;
        self.update(name, |entry| {
            if entry.expired {
                return;
            }
            let Some(s) = state else {
                entry.healthy = false;
                return;
            };
            let num = |k: &str| s[k].as_u64().unwrap_or(0);
            entry.polled_load(num("load") as usize);
            entry.running = num("running") as usize;
            entry.max_running = num("max_running") as usize;
            entry.page_size = num("page_size") as usize;
            entry.fingerprint = num("fingerprint");
            entry.stage = serde_json::from_value(s["stage"].clone()).unwrap_or_default();
            entry.draining = s["draining"].as_bool().unwrap_or(false);
            entry.pool = s["pool"].as_bool().unwrap_or(false);
            entry.retain_spill = serde_json::from_value(s["retain_spill"].clone()).unwrap_or(None);
            let refused = match expected {
                Ok(want) if want == entry.fingerprint => None,
                Ok(want) => Some(format!(
                    "its model fingerprint {:#018x} differs from the cluster's {want:#018x} (the controller's --model, or its first worker's)",
                    entry.fingerprint
                )),
                Err(why) => Some(why),
            };
            if refused.is_some() && refused != entry.refused {
                tracing::error!(worker = name, reason = refused.as_deref(), "worker not admitted");
            }
            entry.healthy = refused.is_none();
            entry.refused = refused;
        });
    }
}

/// The block hashes routing looks up for `prompt` on a worker of this kind:
/// its full pages but the last token's (that one is always computed).
fn routing_chain(
    fingerprint: u64,
    page_size: usize,
    prompt: &[u32],
    salt: Option<&str>,
) -> Vec<u64> {
    let Some((_, head)) = prompt.split_last() else {
        return Vec::new();
    };
    if page_size == 0 {
        return Vec::new();
    }
    let root = ModelFingerprint(fingerprint).salted_root(salt);
    chain_from(root, head, page_size)
        .iter()
        .map(|h| h.0)
        .collect()
}

/// A worker's `/v1/internal/state` as JSON; None when it fails, times out or
/// answers anything but 2xx with JSON.
async fn read_state(http: &reqwest::Client, key: Option<&str>, url: &str) -> Option<Value> {
    let req = http
        .get(format!("{url}/v1/internal/state"))
        .timeout(POLL_TIMEOUT);
    match with_worker_key(req, key).send().await {
        Ok(r) if r.status().is_success() => r.json().await.ok(),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A registry of healthy workers with `(busy, max_running)` each.
    fn registry(slots: &[(usize, usize)]) -> Registry {
        let r = Registry::default();
        for (i, &(busy, max_running)) in slots.iter().enumerate() {
            let name = format!("w{i}");
            let limits = RegisterLimits {
                max_registered: 0,
                may_rebind: false,
            };
            r.register(&name, "http://127.0.0.1:1", None, None, limits)
                .unwrap();
            r.update(&name, |w| {
                w.healthy = true;
                w.running = busy;
                w.max_running = max_running;
            });
        }
        r
    }

    #[test]
    fn saturation_needs_every_healthy_worker_full() {
        assert!(registry(&[(2, 2), (5, 4)]).saturated());
        let r = registry(&[(2, 2), (3, 4)]);
        assert!(!r.saturated());
        assert_eq!(r.free_slots(), 1);
        assert_eq!(
            r.views(&PromptChains::default(), true).len(),
            1,
            "only the worker with room"
        );
        assert!(
            registry(&[]).saturated(),
            "no healthy worker: wait (at most max_wait_ms) for one"
        );
        let r = registry(&[(0, 2)]);
        r.mark_down("w0");
        assert!(r.saturated(), "a down worker's room does not count");
        assert_eq!(r.free_slots(), 0);
        assert!(
            !registry(&[(9, 0)]).saturated(),
            "no max_running reported: room"
        );
    }

    #[test]
    fn a_routed_request_is_load_until_it_finishes_or_a_poll_reports() {
        let r = registry(&[(0, 4)]);
        let load = || r.snapshot()[0].load;
        r.count_started("w0");
        r.count_started("w0");
        assert_eq!(load(), 2);
        r.count_finished("w0");
        assert_eq!(load(), 1, "a finished request is not load");
        r.update("w0", |w| w.polled_load(1));
        r.count_finished("w0");
        assert_eq!(
            load(),
            1,
            "the worker's own figure stands until its next poll"
        );
    }
}
