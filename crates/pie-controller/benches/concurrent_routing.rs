//! Routing throughput under concurrency, as the controller routes: 16
//! threads each make routing decisions (`routing::decide`: the workers'
//! views of a 1,000-token prompt, `pin, session-affinity, cache-aware`,
//! anticipation) over one registry of 64 workers with 1,000,000 indexed
//! blocks. Reported per decision (wall time of the 16 threads' decisions
//! over their number), beside one thread alone: how much the pipeline's lock
//! serialises them (issue 12). The baseline, `all_under_lock`, is the
//! decision as it was before `decide` hashed the prompt outside the lock:
//! hashing, views, pipeline and anticipation (which hashed the prompt again)
//! all under the pipeline's lock, built from the same registry calls.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, Criterion};
use pie_controller::registry::{RegisterLimits, Registry};
use pie_controller::routing::{decide, Ask, Pipeline};
use pie_core::clock::now_ms;
use pie_core::Props;
use pie_policy::cluster::{route, CacheAware, ClusterPolicy, Pin, RouteRequest, SessionAffinity};

const WORKERS: usize = 64;
const INDEXED_BLOCKS: usize = 1_000_000;
const PROMPT_TOKENS: u32 = 1000;
const THREADS: usize = 16;

fn registry() -> Registry {
    let r = Registry::default();
    let limits = RegisterLimits {
        max_registered: WORKERS,
        may_rebind: true,
    };
    for i in 0..WORKERS {
        let name = format!("w{i}");
        r.register(
            &name,
            &format!("http://127.0.0.1:{}", 9000 + i),
            None,
            None,
            limits,
        )
        .expect("room for every worker");
        r.update(&name, |w| {
            w.healthy = true;
            w.fingerprint = 42;
            w.page_size = 16;
            w.max_running = 64;
        });
    }
    r.with_index(|index, _| {
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        for i in 0..INDEXED_BLOCKS {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            index.store(i % WORKERS, x);
        }
    });
    r
}

fn pipeline() -> Pipeline {
    let policies: Vec<Box<dyn ClusterPolicy>> = vec![
        Box::new(Pin::new(Default::default())),
        Box::new(SessionAffinity::new(Default::default())),
        Box::new(CacheAware::new(Default::default())),
    ];
    Mutex::new(policies)
}

/// Prompt `n`: one of 64 shared prefixes, then its own tail.
fn prompt(n: u32) -> Vec<u32> {
    (0..PROMPT_TOKENS)
        .map(|i| match i < PROMPT_TOKENS / 2 {
            true => (i * 31 + (n % 64) * 7) % 49_152,
            false => (i * 17 + n * 13) % 49_152,
        })
        .collect()
}

/// The baseline: every step under the pipeline's lock, the prompt hashed
/// twice (for the views, then for the anticipation).
fn all_under_lock(registry: &Registry, pipeline: &Pipeline, req: &RouteRequest, tokens: &[u32]) {
    let mut policies = pipeline.lock().unwrap_or_else(|e| e.into_inner());
    let views = registry.views(&registry.chains(tokens, None), false);
    let worker_views: Vec<_> = views.iter().map(|(v, _)| v.clone()).collect();
    let (chosen, _) = route(&mut policies, now_ms(), req, &worker_views).expect("a worker");
    registry.anticipate(&worker_views[chosen].name, &registry.chains(tokens, None));
}

fn decide_now(registry: &Registry, pipeline: &Pipeline, req: &RouteRequest, tokens: &[u32]) {
    let ask = Ask {
        req,
        tokens,
        salt: None,
        with_free_slot: false,
        exclude: &[],
        place_prefill: true,
    };
    let decided = decide(registry, pipeline, &ask);
    assert!(decided.choice.is_ok());
}

type Decision = fn(&Registry, &Pipeline, &RouteRequest, &[u32]);

/// `iters` decisions spread over `threads` threads: the wall time.
fn decisions(
    registry: &Registry,
    pipeline: &Pipeline,
    threads: usize,
    iters: u64,
    decision: Decision,
) -> Duration {
    let props = Props::new();
    let per_thread = iters.div_ceil(threads as u64);
    let started = Instant::now();
    std::thread::scope(|s| {
        for t in 0..threads {
            let props = &props;
            s.spawn(move || {
                for i in 0..per_thread {
                    let tokens = prompt((t as u64 * per_thread + i) as u32);
                    let req = RouteRequest {
                        props,
                        prompt_tokens: tokens.len(),
                    };
                    decision(registry, pipeline, &req, &tokens);
                }
            });
        }
    });
    started.elapsed()
}

fn bench(c: &mut Criterion) {
    let registry = registry();
    registry.set_anticipate_ms(100);
    let pipeline = pipeline();
    let mut group = c.benchmark_group("decide_64_workers_1m_blocks");
    let strategies: [(&str, Decision); 2] =
        [("decide", decide_now), ("all_under_lock", all_under_lock)];
    for threads in [1, THREADS] {
        for (name, decision) in strategies {
            group.bench_function(format!("{name}/{threads}_threads"), |b| {
                b.iter_custom(|iters| decisions(&registry, &pipeline, threads, iters, decision))
            });
        }
    }
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
