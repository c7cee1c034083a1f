//! A policy's decisions in the simulator match its decisions outside it for the
//! same event sequence.
//!
//! Cluster plane: the simulator's router (loads and cached prefixes maintained
//! incrementally) and a direct `pie_policy::cluster::route` over views built the
//! way `pie-controller`'s registry builds them (a worker's cached prefix: the
//! leading pages of the prompt found in its set of block hashes) pick the same
//! worker for every request. Worker plane: every call the simulator makes to an
//! ordering policy is recorded, then replayed into a fresh policy object with
//! each candidate list reversed (the engine collects candidates from a hash map,
//! so in arbitrary order): the orders, aborts and slot preemption agree.

use std::collections::HashSet;
use std::sync::{Arc, Mutex};

use pie_core::{BlockHash, PropValue, Props, SeqId};
use pie_policy::cluster::{
    self, CacheAwareConfig, ClusterIndex, PendingBlocks, Reject, RouteRequest, WorkerView,
};
use pie_policy::{Candidate, WorkerPolicy};
use pie_sim::router::{Router, RouterSpec};
use pie_sim::{run_with, CostProfile, PolicyName, SimConfig, WorkloadSpec};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

const WORKERS: usize = 12;
const PAGE: usize = 16;

/// What a request looks like to the controller: props and its prompt's pages.
fn request(rng: &mut StdRng, i: usize) -> (Props, Vec<BlockHash>) {
    let mut props = Props::new();
    if rng.gen_bool(0.5) {
        let session = format!("s{}", rng.gen_range(0..20));
        props.set("session", PropValue::Str(session)).expect("prop");
    }
    if rng.gen_bool(0.05) {
        // Sometimes a worker that does not exist: strict pin refuses.
        let pin = format!("w{}", rng.gen_range(0..WORKERS + 2));
        props.set("pin", PropValue::Str(pin)).expect("prop");
    }
    // Chained pages: a group's shared prefix, then the request's own pages.
    let group = rng.gen_range(0..6u64);
    let shared = rng.gen_range(0..8usize);
    let own = rng.gen_range(0..4usize);
    let mut pages: Vec<BlockHash> = (0..shared as u64)
        .map(|p| BlockHash(group * 1000 + p))
        .collect();
    pages.extend((0..own as u64).map(|p| BlockHash(1_000_000 + i as u64 * 10 + p)));
    (props, pages)
}

/// The controller's view: each worker's cached prefix from its block-hash
/// set, and its prefix held or pending (routed there, not yet confirmed).
fn controller_views(
    loads: &[usize],
    held: &[HashSet<BlockHash>],
    pending: &PendingBlocks,
    prefix: &[BlockHash],
) -> Vec<WorkerView> {
    (0..WORKERS)
        .map(|w| {
            let depth = |counts: &dyn Fn(&BlockHash) -> bool| {
                prefix.iter().take_while(|h| counts(h)).count() * PAGE
            };
            WorkerView {
                name: format!("w{w}"),
                load: loads[w],
                cached_prefix_tokens: depth(&|h| held[w].contains(h)),
                anticipated_prefix_tokens: depth(&|h| held[w].contains(h) || pending.holds(w, h.0)),
                ..WorkerView::default()
            }
        })
        .collect()
}

fn replay_cluster(pipeline: &str, seed: u64) -> usize {
    let spec: RouterSpec = pipeline.parse().expect("valid pipeline");
    let mut sim = Router::new(&spec, WORKERS, PAGE);
    let mut direct = spec.build();
    let mut loads = vec![0usize; WORKERS];
    let mut held: Vec<HashSet<BlockHash>> = vec![HashSet::new(); WORKERS];
    // The controller's registry anticipates as the router does.
    let mut pending = PendingBlocks::new(CacheAwareConfig::default().anticipate_ms);
    let mut held_index = ClusterIndex::new();
    let mut rng = StdRng::seed_from_u64(seed);
    let mut agreed = 0;
    for i in 0..2000 {
        let now_ms = i as u64 * 7;
        let (props, pages) = request(&mut rng, i);
        pending.expire(now_ms);
        let views = controller_views(&loads, &held, &pending, &pages);
        let req = RouteRequest {
            props: &props,
            prompt_tokens: pages.len() * PAGE + 1,
        };
        let want: Result<usize, Reject> =
            cluster::route(&mut direct, now_ms, &req, &views).map(|(w, _)| w);
        if let Ok(w) = want {
            cluster::record(&mut direct, now_ms, &req, &views[w].name);
            let hashes: Vec<u64> = pages.iter().map(|h| h.0).collect();
            pending.anticipate(w, &hashes, &held_index, now_ms);
        }
        let got = sim
            .route(now_ms, &props, req.prompt_tokens, &pages)
            .map(|r| r.decode);
        assert_eq!(got, want, "{pipeline}: request {i}");
        let Ok(w) = got else { continue };
        agreed += 1;
        // The request lands: load, and its pages enter the worker's cache.
        loads[w] += 1;
        sim.set_load(w, loads[w]);
        let added: Vec<(BlockHash, bool)> = pages
            .iter()
            .filter(|h| held[w].insert(**h))
            .map(|h| (*h, true))
            .collect();
        sim.cache_changed(w, &added);
        for (h, _) in &added {
            held_index.store(w, h.0);
            pending.confirm(w, h.0);
        }
        // Requests finish and caches evict a page at random.
        let (v, e) = (rng.gen_range(0..WORKERS), rng.gen_range(0..WORKERS));
        if loads[v] > 0 && rng.gen_bool(0.7) {
            loads[v] -= 1;
            sim.set_load(v, loads[v]);
        }
        if let Some(&h) = held[e].iter().min_by_key(|h| h.0 ^ i as u64) {
            held[e].remove(&h);
            held_index.remove(e, h.0);
            sim.cache_changed(e, &[(h, false)]);
        }
    }
    agreed
}

#[test]
fn cluster_decisions_match_the_controllers_route() {
    for pipeline in [
        "round-robin",
        "least-loaded",
        "cache-aware",
        "session-affinity,cache-aware",
        "pin,session-affinity,cache-aware",
        "pin,session-affinity,least-loaded",
    ] {
        let placed = replay_cluster(pipeline, 11);
        assert!(placed > 1800, "{pipeline}: {placed} placed");
    }
}

/// One call the simulator made to a worker's ordering policy.
#[derive(Clone, Debug)]
enum Call {
    Order {
        now_ms: u64,
        input: Vec<Candidate>,
        output: Vec<SeqId>,
    },
    Charge {
        candidate: Candidate,
        prefill: usize,
        generated: usize,
    },
    Abort {
        now_ms: u64,
        candidate: Candidate,
        aborted: bool,
    },
    PreemptsForSlots(bool),
}

/// The real policy, with every call written to a shared log.
struct Recorder {
    inner: Box<dyn WorkerPolicy>,
    log: Arc<Mutex<Vec<Call>>>,
}

impl Recorder {
    fn push(&self, call: Call) {
        self.log.lock().expect("log").push(call);
    }
}

impl WorkerPolicy for Recorder {
    fn name(&self) -> &'static str {
        self.inner.name()
    }

    fn order(&mut self, now_ms: u64, candidates: &mut [Candidate]) {
        let input = candidates.to_vec();
        self.inner.order(now_ms, candidates);
        let output = candidates.iter().map(|c| c.seq).collect();
        self.push(Call::Order {
            now_ms,
            input,
            output,
        });
    }

    fn charge(&mut self, candidate: &Candidate, prefill: usize, generated: usize) {
        self.inner.charge(candidate, prefill, generated);
        self.push(Call::Charge {
            candidate: candidate.clone(),
            prefill,
            generated,
        });
    }

    fn preempts_for_slots(&self) -> bool {
        let yes = self.inner.preempts_for_slots();
        self.push(Call::PreemptsForSlots(yes));
        yes
    }

    fn abort(&self, now_ms: u64, candidate: &Candidate) -> bool {
        let aborted = self.inner.abort(now_ms, candidate);
        self.push(Call::Abort {
            now_ms,
            candidate: candidate.clone(),
            aborted,
        });
        aborted
    }
}

fn replay_worker(policy: PolicyName, workload: &str) -> usize {
    let spec = WorkloadSpec::named(workload).expect("built-in");
    let reqs = spec.generate(200, 4);
    let mut profile = CostProfile::gpu_a100_llama3_8b();
    profile.max_running = 16;
    profile.kv_pages = 400;
    let cfg = SimConfig::new(1, policy, "round-robin".parse().expect("router"), profile);
    let log = Arc::new(Mutex::new(Vec::new()));
    let recorder = || -> Box<dyn WorkerPolicy> {
        Box::new(Recorder {
            inner: policy.build(),
            log: log.clone(),
        })
    };
    run_with(&cfg, workload, &reqs, &recorder).expect("simulation runs");
    let calls = log.lock().expect("log").clone();
    let mut fresh = policy.build();
    let mut orders = 0;
    for (i, call) in calls.into_iter().enumerate() {
        match call {
            Call::Order {
                now_ms,
                mut input,
                output,
            } => {
                input.reverse();
                fresh.order(now_ms, &mut input);
                let got: Vec<SeqId> = input.iter().map(|c| c.seq).collect();
                assert_eq!(got, output, "{workload}: order call {i}");
                orders += 1;
            }
            Call::Charge {
                candidate,
                prefill,
                generated,
            } => fresh.charge(&candidate, prefill, generated),
            Call::Abort {
                now_ms,
                candidate,
                aborted,
            } => {
                assert_eq!(
                    fresh.abort(now_ms, &candidate),
                    aborted,
                    "{workload}: abort call {i}"
                )
            }
            Call::PreemptsForSlots(yes) => assert_eq!(fresh.preempts_for_slots(), yes),
        }
    }
    orders
}

#[test]
fn worker_decisions_replay_identically_outside_the_simulator() {
    for (policy, workload) in [
        (PolicyName::Fcfs, "priority-mix"),
        (PolicyName::Fair, "multi-tenant"),
        (PolicyName::Priority, "priority-mix"),
        (PolicyName::Deadline, "deadline-mix"),
        (PolicyName::DeadlineAbort, "deadline-mix"),
    ] {
        let orders = replay_worker(policy, workload);
        assert!(orders > 50, "{}: {orders} order calls", policy.label());
    }
}
