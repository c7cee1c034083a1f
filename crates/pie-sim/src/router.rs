//! The cluster plane in the simulator: the real `pie_policy::cluster` pipeline
//! (`route`, `place_prefill`, then `record`, as `pie-controller`'s proxy calls
//! them) over one `WorkerView` per simulated worker, each with its stage
//! (`--prefill-workers`) and running-slot limit. The views are kept up to date as the
//! simulation runs instead of rebuilt per request: loads as requests arrive and
//! finish, and, when a policy in the pipeline reads them, cached-prefix lengths
//! from the controller's own `ClusterIndex`, fed by the workers' cache logs,
//! and the prefixes anticipated on the workers requests were routed to
//! (`PendingBlocks`, as the controller's registry keeps them). With a shared
//! pool (`--pool-pages`: every worker pulls from it) each view's
//! `pool_prefix_tokens` is the prompt's leading run the pool holds
//! (`set_pooled`), which cache-aware weighs at its `pool_weight`.
//! With an autoscaled fleet (`autoscale.rs`) workers come and go: a new slot
//! is added (`add_worker`), and a worker that is booting, draining or
//! stopped is no candidate (`set_serving`), as the controller routes only to
//! healthy workers that are not draining.
//!
//! At 1,000 workers a request costs what its prompt and the workers that can
//! win cost, not a pass over every worker: only holders of the prompt's
//! prefix that the pipeline looks at have non-zero prefix fields in their
//! views (the previous request's are reset), and a pipeline that decides the
//! same on a shortlist (`decides_on_shortlist`) routes among the holder
//! cache-aware would pick (`LoadOrder::best_holder`), the least-loaded
//! workers, the most loaded one and the workers its policies name
//! (`LoadOrder::shortlist`, loads kept in order as they change).

use std::collections::HashMap;
use std::str::FromStr;

use pie_core::{BlockHash, Props};
use pie_policy::cluster::{
    self, decides_on_shortlist, routing_policy, split_policies, CacheAwareConfig, ClusterIndex,
    ClusterPolicy, LoadOrder, PendingBlocks, PrefixHolder, Reject, RouteRequest, RoutingConfigs,
    Stage, WorkerView,
};

/// The cluster policies, as in the controller's `cluster_policies`
/// (`session-affinity,cache-aware,scale-by-prop`): the routing pipeline in
/// order, and the actors.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RouterSpec {
    names: Vec<String>,
    actors: Vec<String>,
}

impl RouterSpec {
    /// The list as written: names joined by commas.
    pub fn label(&self) -> String {
        let mut all = self.names.clone();
        all.extend(self.actors.iter().cloned());
        all.join(",")
    }

    /// The actors' names, in order.
    pub fn actors(&self) -> Vec<&str> {
        self.actors.iter().map(String::as_str).collect()
    }

    /// Fresh policy objects with the controller's default configs.
    pub fn build(&self) -> Vec<Box<dyn ClusterPolicy>> {
        self.names
            .iter()
            .map(|n| {
                routing_policy(n, &RoutingConfigs::default()).expect("names checked by from_str")
            })
            .collect()
    }

    /// Whether a policy of the pipeline reads `cached_prefix_tokens`
    /// (`disaggregate`: the decode worker's, and cache-aware's among prefill
    /// workers).
    pub fn reads_prefixes(&self) -> bool {
        self.names
            .iter()
            .any(|n| n == "cache-aware" || n == "disaggregate")
    }
}

impl FromStr for RouterSpec {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let all: Vec<String> = s.split(',').map(|n| n.trim().to_string()).collect();
        let (routing, actors) = split_policies(&all).map_err(|e| format!("router `{s}`: {e}"))?;
        if routing.is_empty() {
            return Err(format!(
                "router `{s}`: at least one routing policy (e.g. round-robin)"
            ));
        }
        Ok(Self {
            names: routing.into_iter().map(str::to_string).collect(),
            actors: actors.into_iter().map(str::to_string).collect(),
        })
    }
}

/// Where a request goes: its decode worker, and the prefill-stage worker that
/// prefills it first when `disaggregate` places it remotely.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Routed {
    pub decode: usize,
    pub prefill: Option<usize>,
    /// Its prompt tokens not cached on the decode worker, as the pipeline saw.
    pub uncached_tokens: usize,
}

/// The pipeline and the views it routes over.
pub struct Router {
    pipeline: Vec<Box<dyn ClusterPolicy>>,
    views: Vec<WorkerView>,
    /// Which workers hold each page, when a policy reads cached prefixes.
    index: Option<ClusterIndex>,
    /// Pages of prompts routed to a worker and not yet in its cache, as the
    /// controller anticipates them.
    pending: PendingBlocks,
    page_size: usize,
    /// The last request's holders of a prefix of its prompt, with their
    /// prefixes in blocks.
    holders: Vec<PrefixHolder>,
    /// The workers whose views have non-zero prefix fields (of the last
    /// request's holders, those its pipeline looked at); every other view
    /// has zeros there.
    marked: Vec<usize>,
    /// The decode-capable workers by load, when the pipeline routes on a
    /// shortlist.
    loads: Option<LoadOrder>,
    /// Worker slots by name, for the workers policies name.
    slots: HashMap<String, usize>,
    /// Every view's `pool_prefix_tokens` (the same for all: each pulls from
    /// the one pool).
    pooled_tokens: usize,
    /// Which workers take requests; `not_serving`: how many do not.
    serving: Vec<bool>,
    not_serving: usize,
}

impl Router {
    /// Workers are named `w0`, `w1`, ... (the names `pin` refers to).
    pub fn new(spec: &RouterSpec, workers: usize, page_size: usize) -> Self {
        let loads = decides_on_shortlist(&spec.names).then(|| {
            let mut order = LoadOrder::new();
            (0..workers).for_each(|w| order.set(w, 0));
            order
        });
        Self {
            pipeline: spec.build(),
            views: (0..workers)
                .map(|i| WorkerView {
                    name: format!("w{i}"),
                    load: 0,
                    cached_prefix_tokens: 0,
                    ..WorkerView::default()
                })
                .collect(),
            index: spec.reads_prefixes().then(ClusterIndex::new),
            pending: PendingBlocks::new(CacheAwareConfig::default().anticipate_ms),
            page_size,
            holders: Vec::new(),
            marked: Vec::new(),
            loads,
            slots: (0..workers).map(|i| (format!("w{i}"), i)).collect(),
            pooled_tokens: 0,
            serving: vec![true; workers],
            not_serving: 0,
        }
    }

    /// A new worker slot (`w{n}`), not serving yet, with `max_running` slots.
    pub fn add_worker(&mut self, max_running: usize) -> usize {
        let w = self.views.len();
        self.views.push(WorkerView {
            name: format!("w{w}"),
            max_running,
            pool_prefix_tokens: self.pooled_tokens,
            ..WorkerView::default()
        });
        self.slots.insert(format!("w{w}"), w);
        self.serving.push(false);
        self.not_serving += 1;
        w
    }

    /// Whether worker `w` takes requests (serving: healthy and not draining).
    pub fn set_serving(&mut self, w: usize, serving: bool) {
        if self.serving[w] == serving {
            return;
        }
        self.serving[w] = serving;
        match serving {
            true => self.not_serving -= 1,
            false => self.not_serving += 1,
        }
        let load = self.views[w].load;
        if let Some(loads) = &mut self.loads {
            match serving && self.views[w].stage != Stage::Prefill {
                true => loads.set(w, load),
                false => loads.remove(w),
            }
        }
    }

    /// Worker `w` stopped: its cache is gone from the index.
    pub fn forget(&mut self, w: usize) {
        if let Some(index) = &mut self.index {
            index.clear(w);
        }
    }

    /// The shared pool holds the next prompt's first `blocks` pages: every
    /// worker could pull them (as the controller's registry fills
    /// `pool_prefix_tokens` for the workers with a pool).
    pub fn set_pooled(&mut self, blocks: usize) {
        let tokens = blocks * self.page_size;
        if tokens != self.pooled_tokens {
            for v in &mut self.views {
                v.pool_prefix_tokens = tokens;
            }
            self.pooled_tokens = tokens;
        }
    }

    /// Workers `w0..w{prefill_workers}` prefill-stage and the rest
    /// decode-stage (all `both` when 0), each with `max_running` slots (what
    /// `disaggregate` reads to call a prefill worker saturated).
    pub fn staged(mut self, prefill_workers: usize, max_running: usize) -> Self {
        for (i, view) in self.views.iter_mut().enumerate() {
            view.max_running = max_running;
            view.stage = match (prefill_workers, i < prefill_workers) {
                (0, _) => Stage::Both,
                (_, true) => Stage::Prefill,
                (_, false) => Stage::Decode,
            };
            if let (Some(loads), Stage::Prefill) = (&mut self.loads, view.stage) {
                loads.remove(i);
            }
        }
        self
    }

    /// Whether the workers' caches must report their inserts and evictions.
    pub fn tracks_prefixes(&self) -> bool {
        self.index.is_some()
    }

    pub fn views(&self) -> &[WorkerView] {
        &self.views
    }

    pub fn load(&self, w: usize) -> usize {
        self.views[w].load
    }

    pub fn set_load(&mut self, w: usize, load: usize) {
        self.views[w].load = load;
        if let Some(loads) = self.loads.as_mut().filter(|l| l.contains(w)) {
            loads.set(w, load);
        }
    }

    /// Worker `w`'s cache added (true) or evicted (false) these pages.
    pub fn cache_changed(&mut self, w: usize, log: &[(BlockHash, bool)]) {
        let Some(index) = &mut self.index else {
            return;
        };
        for &(h, _) in log {
            index.prefetch(w, h.0);
        }
        for &(h, added) in log {
            if added {
                index.store(w, h.0);
                self.pending.confirm(w, h.0);
            } else {
                index.remove(w, h.0);
            }
        }
    }

    /// Route a request whose prompt's full pages (all but its last token) hash
    /// to `prefix`, place its prefill, and record the placement.
    pub fn route(
        &mut self,
        now_ms: u64,
        props: &Props,
        prompt_tokens: usize,
        prefix: &[BlockHash],
    ) -> Result<Routed, Reject> {
        self.pending.expire(now_ms);
        let hashes: Vec<u64> = prefix.iter().map(|h| h.0).collect();
        self.find_holders(&hashes);
        let req = RouteRequest {
            props,
            prompt_tokens,
        };
        let shortlist = self.shortlist(now_ms, &req);
        self.mark_prefixes(shortlist.as_deref());
        let (decode, _reason) = match shortlist {
            Some(shortlist) => {
                cluster::route_among(&mut self.pipeline, now_ms, &req, &self.views, shortlist)?
            }
            None if self.not_serving > 0 => {
                let candidates = (0..self.views.len())
                    .filter(|&w| self.serving[w] && self.views[w].stage != Stage::Prefill)
                    .collect();
                cluster::route_among(&mut self.pipeline, now_ms, &req, &self.views, candidates)?
            }
            None => cluster::route(&mut self.pipeline, now_ms, &req, &self.views)?,
        };
        let prefill = cluster::place_prefill(&mut self.pipeline, now_ms, &req, &self.views, decode)
            .and_then(|placement| placement.remote_worker());
        cluster::record(&mut self.pipeline, now_ms, &req, &self.views[decode].name);
        if let Some(index) = &self.index {
            self.pending.anticipate(decode, &hashes, index, now_ms);
        }
        Ok(Routed {
            decode,
            prefill,
            uncached_tokens: prompt_tokens.saturating_sub(self.views[decode].cached_prefix_tokens),
        })
    }

    /// A process moved to worker `w` (a migration): the pipeline records it
    /// there as a routing decision, so its session's next turns follow it.
    pub fn moved(&mut self, now_ms: u64, props: &Props, prompt_tokens: usize, w: usize) {
        let req = RouteRequest {
            props,
            prompt_tokens,
        };
        cluster::record(&mut self.pipeline, now_ms, &req, &self.views[w].name);
    }

    /// The candidates that can win (see `LoadOrder::shortlist`), when the
    /// pipeline routes on a shortlist. A shortlist must hold every worker
    /// that can pull a pooled prefix: with one, that is all of them (None).
    fn shortlist(&self, now_ms: u64, req: &RouteRequest) -> Option<Vec<usize>> {
        let loads = self.loads.as_ref()?;
        if self.views.is_empty() || self.pooled_tokens != 0 {
            return None;
        }
        let named: Vec<usize> = (self.pipeline.iter())
            .filter_map(|p| p.named_worker(now_ms, req))
            .filter_map(|name| self.slots.get(name).copied())
            .collect();
        let best = loads.best_holder(self.holders.iter().map(|h| (h.slot, h.ahead, h.held)));
        Some(loads.shortlist(best.as_slice(), &named))
    }

    /// Each worker's leading run of the prompt's pages held, and held or
    /// pending, as the controller's registry computes them (`holders`; the
    /// views are set by `mark_prefixes`).
    fn find_holders(&mut self, hashes: &[u64]) {
        if let Some(index) = &self.index {
            self.holders = index.prefix_holders(self.pending.index(), hashes, self.views.len());
        }
    }

    /// Sets the prefix fields of the holders' views among `candidates`
    /// (ascending; None: every holder), the previously set ones reset to
    /// zero. The pipeline reads only its candidates' views, so on a
    /// shortlist a prefix every worker holds costs the shortlist's writes,
    /// not a write to every view.
    fn mark_prefixes(&mut self, candidates: Option<&[usize]>) {
        for &w in &self.marked {
            self.views[w].cached_prefix_tokens = 0;
            self.views[w].anticipated_prefix_tokens = 0;
        }
        self.marked.clear();
        let mut wanted = candidates.map(|c| c.iter().peekable());
        for h in &self.holders {
            if let Some(wanted) = &mut wanted {
                while wanted.next_if(|&&w| w < h.slot).is_some() {}
                if wanted.next_if(|&&w| w == h.slot).is_none() {
                    continue;
                }
            }
            self.views[h.slot].cached_prefix_tokens = h.held * self.page_size;
            self.views[h.slot].anticipated_prefix_tokens = h.ahead * self.page_size;
            self.marked.push(h.slot);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every holder's view set, as a full route sees them.
    fn set_cached_prefixes(r: &mut Router, hashes: &[u64]) {
        r.find_holders(hashes);
        r.mark_prefixes(None);
    }

    #[test]
    fn specs_parse_and_name_bad_entries() {
        let spec: RouterSpec = "session-affinity, cache-aware".parse().expect("valid");
        assert_eq!(spec.label(), "session-affinity,cache-aware");
        assert!(spec.reads_prefixes());
        let names: Vec<&str> = spec.build().iter().map(|p| p.name()).collect();
        assert_eq!(names, ["session-affinity", "cache-aware"]);
        let err = "round-robin,nearest".parse::<RouterSpec>().unwrap_err();
        assert!(err.contains("`nearest`"), "{err}");
    }

    #[test]
    fn cached_prefix_is_the_leading_run_held() {
        let spec: RouterSpec = "cache-aware".parse().expect("valid");
        let mut r = Router::new(&spec, 3, 16);
        let h = |i| BlockHash(i);
        r.cache_changed(0, &[(h(1), true), (h(2), true)]);
        r.cache_changed(1, &[(h(1), true), (h(3), true)]);
        // Worker 2 holds the second page only: not a prefix.
        r.cache_changed(2, &[(h(2), true)]);
        set_cached_prefixes(&mut r, &[1, 2, 3]);
        let cached: Vec<usize> = r.views().iter().map(|v| v.cached_prefix_tokens).collect();
        assert_eq!(cached, [32, 16, 0]);
        r.cache_changed(0, &[(h(1), false)]);
        set_cached_prefixes(&mut r, &[1, 2]);
        let cached: Vec<usize> = r.views().iter().map(|v| v.cached_prefix_tokens).collect();
        assert_eq!(cached, [0, 16, 0]);
    }

    #[test]
    fn a_routed_prefix_is_pending_on_its_worker_until_its_cache_confirms_it() {
        let spec: RouterSpec = "cache-aware".parse().expect("valid");
        let mut r = Router::new(&spec, 3, 16);
        let prefix = [BlockHash(7), BlockHash(8)];
        let props = Props::new();
        let first = r.route(0, &props, 40, &prefix).expect("routed").decode;
        r.set_load(first, 1);
        let second = r.route(5, &props, 40, &prefix).expect("routed").decode;
        assert_eq!(second, first, "the prefix is anticipated there");
        let view = &r.views()[first];
        assert_eq!(
            (view.cached_prefix_tokens, view.anticipated_prefix_tokens),
            (0, 32)
        );
        r.cache_changed(first, &[(BlockHash(7), true), (BlockHash(8), true)]);
        set_cached_prefixes(&mut r, &[7, 8]);
        assert_eq!(r.views()[first].cached_prefix_tokens, 32);
        assert!(r.pending.is_empty(), "confirmed by the cache's log");
    }

    #[test]
    fn a_pooled_prefix_draws_a_prompt_away_from_a_cold_worker_never_from_a_holder() {
        let spec: RouterSpec = "cache-aware".parse().expect("valid");
        let mut r = Router::new(&spec, 3, 16);
        let props = Props::new();
        let prefix = [BlockHash(7), BlockHash(8)];
        r.cache_changed(1, &[(BlockHash(7), true), (BlockHash(8), true)]);
        r.set_pooled(2);
        assert!(r.views().iter().all(|v| v.pool_prefix_tokens == 32));
        let routed = r.route(0, &props, 40, &prefix).expect("routed");
        assert_eq!(routed.decode, 1, "held beats pooled");
        r.set_pooled(0);
        assert!(r.views().iter().all(|v| v.pool_prefix_tokens == 0));
    }
}
